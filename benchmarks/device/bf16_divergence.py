"""Where bf16 runs of the same greedy request part ways, and whether each parting is a near-tie:
SmolLM2 + a drafter on one GPU, HumanEval prompts, 256 new tokens. Arms: plain decoding one request
at a time, plain with all requests batched, DFlash batched. For every pair of arms and prompt that
differ, the first differing position is scored by an fp32 forward of HF transformers over the
shared prefix: the fp32 logit gap between the two candidate tokens (a gap of a few hundredths is
a tie that bf16 rounding can flip; a logic bug shows up as a large gap).

    python benchmarks/device/bf16_divergence.py --gguf smollm2.gguf --draft DRAFTER --prompts humaneval.jsonl --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from flashdraft import LLM, SamplingParams
from flashdraft.bench.datasets import load_prompts
from flashdraft.models.loader import resolve_model_dir


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    args = ap.parse_args()
    prompts = load_prompts(args.prompts, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    llm = LLM(args.gguf, draft=args.draft, device="cuda", dtype="bfloat16", max_num_seqs=64)
    ids = [llm.engine.apply_chat_template(p.messages) for p in prompts]
    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, speculative=False)
    arms = {"plain_one_by_one": [llm.generate([i], plain)[0].token_ids for i in ids],
            "plain_batched": [o.token_ids for o in llm.generate(ids, plain)],
            "dflash_batched": [o.token_ids for o in llm.generate(ids, params)]}
    del llm
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(resolve_model_dir(args.gguf)), dtype=torch.float32).cuda().eval()
    report = {"prompts": len(ids), "max_tokens": args.max_tokens, "pairs": {}}
    for a, b in itertools.combinations(arms, 2):
        rows = []
        for n, (p, x, y) in enumerate(zip(ids, arms[a], arms[b])):
            i = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), None)
            if i is None:
                continue
            t = torch.tensor([p + x[:i]], device="cuda")
            with torch.no_grad():
                logits = hf(t, attention_mask=torch.ones_like(t)).logits[0, -1]
            top = logits.topk(2)
            rows.append({"prompt": n, "position": i, "tokens": [x[i], y[i]],
                         "fp32_gap": float(logits[x[i]] - logits[y[i]]),
                         "fp32_top2": top.indices.tolist(), "fp32_top2_gap": float(top.values[0] - top.values[1])})
        same = len(ids) - len(rows)
        report["pairs"][f"{a} vs {b}"] = {"identical": same, "divergences": rows}
        gaps = [round(abs(r["fp32_gap"]), 4) for r in rows]
        print(f"{a} vs {b}: {same}/{len(ids)} identical; |fp32 gap| at first divergence {sorted(gaps)}", flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "divergence.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
