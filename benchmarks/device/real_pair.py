"""The real pair on one GPU: SmolLM2-135M (the embedded default's weights) with and without a DFlash
drafter, end to end through `flashdraft bench` (plain vs DFlash arms on one engine, concurrency 1, 8
and 32, HumanEval prompts, greedy, 256 new tokens), beside HF transformers `generate` at batch 1,
the line users would otherwise draw. Also the bf16 token-match rate of flashdraft's plain decoding
against HF's on the same prompts.

    python benchmarks/device/real_pair.py --gguf smollm2.gguf --draft DRAFTER_DIR \\
        --prompts prompts/humaneval.jsonl --out results
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from flashdraft import LLM, SamplingParams
from flashdraft.bench.datasets import load_prompts
from flashdraft.models.loader import resolve_model_dir


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hf_baseline(gguf: str, prompts, max_tokens: int) -> tuple[dict, list[list[int]], list[list[int]]]:
    from transformers import AutoModelForCausalLM

    folder = resolve_model_dir(gguf)
    llm = LLM(gguf, draft=None, device="cuda", dtype="bfloat16", max_num_seqs=1)
    ids = [llm.engine.apply_chat_template(p.messages) for p in prompts]
    ours = [o.token_ids for o in llm.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    del llm
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.bfloat16).cuda().eval()
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, max_new_tokens=max_tokens,
              min_new_tokens=max_tokens)
    x = torch.tensor([ids[0]], device="cuda")
    hf.generate(x, attention_mask=torch.ones_like(x), **kw)  # warm-up
    theirs, n_tok = [], 0
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for p in ids:
        x = torch.tensor([p], device="cuda")
        out = hf.generate(x, attention_mask=torch.ones_like(x), **kw)[0, len(p):].tolist()
        theirs.append(out)
        n_tok += len(out)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    same = sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t))
    first = [next((i for i, (a, b) in enumerate(zip(o, t)) if a != b), None) for o, t in zip(ours, theirs)]
    # at each first divergence: HF's own logits there, to tell a bf16 near-tie from a logic bug
    ties = []
    for p, o, t, i in zip(ids, ours, theirs, first):
        if i is None:
            continue
        x = torch.tensor([p + t[:i]], device="cuda")
        with torch.no_grad():
            logits = hf(x, attention_mask=torch.ones_like(x)).logits[0, -1].float()
        top2 = logits.topk(2)
        ties.append({"position": i, "hf_token": t[i], "flashdraft_token": o[i],
                     "hf_top2_tokens": top2.indices.tolist(), "hf_top2_gap": float(top2.values[0] - top2.values[1]),
                     "hf_logit_gap_to_flashdraft_token": float(logits[t[i]] - logits[o[i]])})
    res = {"prompts": len(ids), "tokens": n_tok, "wall_s": dt, "tok_s": n_tok / dt,
           "token_match_vs_flashdraft_plain": same / max(1, n_tok), "first_divergence": first,
           "divergences": ties}
    del hf
    torch.cuda.empty_cache()
    return res, ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", required=True, help="HumanEval prompt file (jsonl of {prompt})")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--hf-prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--extra", default="", help="more flashdraft bench flags, e.g. --no-cuda-graphs")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    prompts = load_prompts(args.prompts, args.hf_prompts)
    hf, _, _ = hf_baseline(args.gguf, prompts, args.max_tokens)
    log(f"HF generate batch 1: {hf['tok_s']:.1f} tok/s; flashdraft plain vs HF bf16 token match "
        f"{hf['token_match_vs_flashdraft_plain']:.4f}, first divergences {hf['first_divergence']}; "
        f"HF logit gap there: {[round(d['hf_logit_gap_to_flashdraft_token'], 3) for d in hf['divergences']]}")
    (out / "hf.json").write_text(json.dumps(hf, indent=1))
    cmd = [sys.executable, "-m", "flashdraft", "bench", "--model", args.gguf, "--draft", args.draft,
           "--dataset", args.prompts, "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
           "--concurrency", args.concurrency, "--device", "cuda", "--dtype", "bfloat16", "--out", str(out / "bench"),
           *args.extra.split()]
    log(" ".join(cmd))
    subprocess.run(cmd, check=True)
    log("done")


if __name__ == "__main__":
    main()
