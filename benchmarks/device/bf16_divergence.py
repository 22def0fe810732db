"""Where bf16 runs of the same greedy request part ways, and whether each parting is a near-tie:
SmolLM2 + a drafter, N prompts, 256 new tokens. Arms: plain decoding one request at a time, plain
with all requests batched, DFlash batched; with --tree-sizes instead plain, the drafter's chain and a
token tree of each size, all one request at a time (an engine each). For every pair of arms and
prompt that differ, the first differing position is scored by an fp32 forward of HF transformers over
the shared prefix: the fp32 logit gap between the two candidate tokens (a gap of a few hundredths is
a tie that bf16 rounding can flip; a logic bug shows up as a large gap).

    python benchmarks/device/bf16_divergence.py --gguf smollm2.gguf --draft DRAFTER --prompts humaneval.jsonl --out DIR
    python benchmarks/device/bf16_divergence.py --device cpu --prompts mt-bench --tree-sizes 7,15 --out DIR

Prints a table (per pair of arms: outputs identical, and the fp32 gaps at the first partings) and one JSON
line, also written to DIR/divergence.json; every arm's tokens go to DIR/tokens.json.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import log, report  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.models.loader import resolve_model_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", default=None, help="default: the embedded SmolLM2")
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--prompts", required=True, help="a named set (humaneval, mt-bench, sharegpt) or a .jsonl file")
    ap.add_argument("--out", required=True)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tree-sizes", default="", help="comma-separated: plain, chain and these trees one at a time")
    args = ap.parse_args()
    try:
        sizes = [int(t) for t in args.tree_sizes.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tree-sizes takes comma-separated integers, got {args.tree_sizes!r}")
    prompts = load_prompts(args.prompts, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    kw = dict(device=args.device, dtype="bfloat16", max_num_seqs=64, speculative_min_acceptance_length=None)
    if sizes:  # an engine per arm, one request at a time: a small cache each
        kw["kv_cache_memory_gb"] = 1
    llm = LLM(args.gguf, draft=args.draft, speculative_tree_size=None, **kw)
    ids = [llm.engine.apply_chat_template(p.messages) for p in prompts]
    plain = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, speculative=False)
    one_by_one = lambda engine, p: [engine.generate([i], p)[0].token_ids for i in ids]  # noqa: E731
    if sizes:
        arms = {"plain_one_by_one": one_by_one(llm, plain), "chain_one_by_one": one_by_one(llm, params)}
        for size in sizes:
            tree = LLM(args.gguf, draft=args.draft, speculative_tree_size=size, **kw)
            arms[f"tree{size}_one_by_one"] = one_by_one(tree, params)
            del tree
            gc.collect()
    else:
        arms = {"plain_one_by_one": one_by_one(llm, plain),
                "plain_batched": [o.token_ids for o in llm.generate(ids, plain)],
                "dflash_batched": [o.token_ids for o in llm.generate(ids, params)]}
    del llm
    gc.collect()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "tokens.json").write_text(json.dumps({"prompts": ids, "arms": arms}))
    from transformers import AutoModelForCausalLM

    folder = resolve_model_dir(args.gguf, four_bit=False)  # (the dequantized folder: HF reads it)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).to(args.device)
    hf.eval()
    result = {"bench": "bf16_divergence", "prompts": len(ids), "max_tokens": args.max_tokens, "pairs": {}}
    table = []
    for a, b in itertools.combinations(arms, 2):
        rows = []
        for n, (p, x, y) in enumerate(zip(ids, arms[a], arms[b])):
            i = next((k for k, (s, t) in enumerate(zip(x, y)) if s != t), None)
            if i is None:
                continue
            t = torch.tensor([p + x[:i]], device=args.device)
            with torch.no_grad():
                logits = hf(t, attention_mask=torch.ones_like(t)).logits[0, -1]
            top = logits.topk(2)
            rows.append({"prompt": n, "position": i, "tokens": [x[i], y[i]],
                         "fp32_gap": float(logits[x[i]] - logits[y[i]]),
                         "fp32_top2": top.indices.tolist(), "fp32_top2_gap": float(top.values[0] - top.values[1])})
        same = len(ids) - len(rows)
        result["pairs"][f"{a} vs {b}"] = {"identical": same, "divergences": rows}
        gaps = sorted(abs(r["fp32_gap"]) for r in rows)
        table.append({"arms": f"{a} vs {b}", "identical": f"{same}/{len(ids)}",
                      "median |fp32 gap|": gaps[len(gaps) // 2] if gaps else None,
                      "max |fp32 gap|": max(gaps, default=None)})
        log(f"{a} vs {b}: {same}/{len(ids)} identical; |fp32 gap| at first divergence {[round(g, 4) for g in gaps]}")
    report(f"bf16 partings, {len(ids)} prompts x {args.max_tokens} tokens: fp32 logit gap at each first parting",
           table, result, Path(args.out) / "divergence.json", device=args.device)


if __name__ == "__main__":
    main()
