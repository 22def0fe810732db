"""Tokens and acceptance counts of the embedded pair on the CPU (float32), per arm and request, as one
JSON file; with two files, how they differ.

    python benchmarks/same_tokens.py --out before.json
    python benchmarks/same_tokens.py --compare before.json after.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time

ARMS = {  # name: (engine options, sampling)
    "plain": ({"draft": None}, 0.0),
    "chain": ({"speculative_tree_size": None}, 0.0),
    "tree": ({"speculative_tree_size": "auto"}, 0.0),
    "chain-t1": ({"speculative_tree_size": None}, 1.0),
    "tree-t1": ({"speculative_tree_size": "auto"}, 1.0),
    "chain-async": ({"speculative_tree_size": None, "async_scheduling": True}, 0.0),
}


def run(args) -> dict:
    from flashdraft import LLM, SamplingParams
    from flashdraft.bench.datasets import load_prompts

    sets = {name: load_prompts(name, args.num_prompts) for name in ("humaneval", "mt-bench")}
    out = {}
    for arm, (opts, temp) in ARMS.items():
        if args.arms and arm not in args.arms.split(","):
            continue
        llm = LLM(device="cpu", dtype="float32", speculative_min_acceptance_length=None, **opts)
        for name, prompts in sets.items():
            t0 = time.perf_counter()
            params = [SamplingParams(temperature=temp, max_tokens=args.max_tokens, seed=i if temp else None)
                      for i in range(len(prompts))]
            outs = llm.chat([p.messages for p in prompts], params)
            rows = [{"tokens": o.token_ids, "drafts": o.metrics.get("num_drafts", 0),
                     "accepted": o.metrics.get("num_accepted_tokens", 0),
                     "histogram": o.metrics.get("acceptance_histogram")} for o in outs]
            out[f"{arm}/{name}"] = rows
            d = sum(r["drafts"] for r in rows)
            a = sum(r["accepted"] for r in rows)
            print(f"{arm:12s} {name:10s} {time.perf_counter() - t0:6.1f} s  verifies {d}  tau "
                  f"{(a + d) / d if d else 0:.3f}", flush=True)
        del llm
    return out


def compare(a: dict, b: dict) -> int:
    bad = 0
    for key in a:
        if key not in b:
            print(f"{key}: missing in the second file")
            bad += 1
            continue
        same_tok = sum(x["tokens"] == y["tokens"] for x, y in zip(a[key], b[key]))
        same_acc = sum((x["drafts"], x["accepted"], x["histogram"]) == (y["drafts"], y["accepted"], y["histogram"])
                       for x, y in zip(a[key], b[key]))
        n = len(a[key])
        print(f"{key:24s} tokens {same_tok}/{n}  acceptance {same_acc}/{n}")
        bad += (same_tok < n) + (same_acc < n)
    plain = {k.split("/")[1]: v for k, v in a.items() if k.startswith("plain/")}
    for key, rows in a.items():
        name = key.split("/")[1]
        if key.startswith("plain/") or "-t1" in key or name not in plain:
            continue
        match = sum(x["tokens"] == y["tokens"] for x, y in zip(rows, plain[name]))
        print(f"{key:24s} equal to plain decoding: {match}/{len(rows)}")
    return bad


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="same_tokens.json")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--arms", default="", help="comma-separated subset of " + ",".join(ARMS))
    p.add_argument("--compare", nargs=2, metavar=("A", "B"))
    args = p.parse_args()
    if args.compare:
        a, b = (json.load(open(f)) for f in args.compare)
        sys.exit(1 if compare(a, b) else 0)
    json.dump(run(args), open(args.out, "w"))


if __name__ == "__main__":
    main()
