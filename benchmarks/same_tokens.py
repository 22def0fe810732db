"""Tokens and acceptance counts of the embedded pair on the CPU (float32), per arm and request, as one
JSON file; with two files, how they differ. Either way prints a table and one JSON line (the counts
without the tokens).

    python benchmarks/same_tokens.py --out before.json
    python benchmarks/same_tokens.py --compare before.json after.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from timing import log, report  # noqa: E402

ARMS = {  # name: (engine options, sampling)
    "plain": ({"draft": None}, 0.0),
    "chain": ({"speculative_tree_size": None}, 0.0),
    "tree": ({"speculative_tree_size": "auto"}, 0.0),
    "chain-t1": ({"speculative_tree_size": None}, 1.0),
    "tree-t1": ({"speculative_tree_size": "auto"}, 1.0),
    "chain-async": ({"speculative_tree_size": None, "async_scheduling": True}, 0.0),
}


def run(args) -> tuple[dict, list[dict]]:
    from flashdraft import LLM, SamplingParams
    from flashdraft.bench.datasets import load_prompts

    sets = {name: load_prompts(name, args.num_prompts) for name in ("humaneval", "mt-bench")}
    out, summary = {}, []
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
            summary.append({"arm": arm, "set": name, "seconds": time.perf_counter() - t0, "verifies": d,
                            "tau": (a + d) / d if d else None})
            log(f"{arm:12s} {name:10s} {summary[-1]['seconds']:6.1f} s  verifies {d}")
        del llm
    return out, summary


def compare(a: dict, b: dict) -> tuple[int, list[dict]]:
    """How many (arm, set) keys differ between two runs, and a row per key: requests with the same tokens,
    with the same acceptance counts, and (greedy arms of the first run) equal to its plain decoding."""
    bad, rows = 0, []
    plain = {k.split("/")[1]: v for k, v in a.items() if k.startswith("plain/")}
    for key in a:
        if key not in b:
            rows.append({"arm/set": key, "tokens": "missing in the second file"})
            bad += 1
            continue
        same_tok = sum(x["tokens"] == y["tokens"] for x, y in zip(a[key], b[key]))
        same_acc = sum((x["drafts"], x["accepted"], x["histogram"]) == (y["drafts"], y["accepted"], y["histogram"])
                       for x, y in zip(a[key], b[key]))
        n = len(a[key])
        row = {"arm/set": key, "tokens": f"{same_tok}/{n}", "acceptance": f"{same_acc}/{n}"}
        name = key.split("/")[1]
        if not key.startswith("plain/") and "-t1" not in key and name in plain:
            row["equal to plain"] = f"{sum(x['tokens'] == y['tokens'] for x, y in zip(a[key], plain[name]))}/{n}"
        rows.append(row)
        bad += (same_tok < n) + (same_acc < n)
    return bad, rows


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
        bad, rows = compare(a, b)
        report(f"{args.compare[0]} against {args.compare[1]}: requests alike", rows,
               {"bench": "same_tokens", "compare": args.compare, "differing": bad, "rows": rows}, device="cpu")
        sys.exit(1 if bad else 0)
    out, summary = run(args)
    json.dump(out, open(args.out, "w"))
    report(f"the embedded pair, float32 CPU, {args.num_prompts} prompts a set x {args.max_tokens} tokens "
           f"(tokens in {args.out})", summary, {"bench": "same_tokens", "out": args.out, "rows": summary},
           device="cpu")


if __name__ == "__main__":
    main()
