"""Token trees against the drafter's chain, side by side in one process: the same prompts through a
plain engine, an engine verifying the chain, and one engine per --tree-sizes, interleaved over --reps
rounds. Per arm: tau, per-depth acceptance, output tok/s, and how many outputs equal plain decoding's
(greedy, or seeded at --temperature; in float32 all of them must). Prints a table of every arm's
passes and one JSON line (also written to --json).

    python benchmarks/tree_arms.py [--dataset mt-bench] [--num-prompts 12] [--max-tokens 128]
        [--tree-sizes 7,15] [--temperature 0] [--concurrency 1,all] [--reps 2] [--device cpu]
        [--dtype float32] [--model M] [--draft D] [--json out.json] [--once]

--dataset takes bench's names or a .jsonl file ('prompt' or 'messages' per line); --concurrency 1 sends
one request at a time, all sends every prompt at once. --once: one pass of every arm, no warm-ups and no
reps (tau and outputs on a whole prompt set; the tok/s of such a pass include first-use costs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import log, report  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.stats import spec_delta  # noqa: E402


def run(llm: LLM, convs: list, params: list, one_at_a_time: bool) -> tuple[list, float, dict]:
    """Token ids of every request, the wall seconds, and the drafting counters of the run
    (flashdraft.bench.stats.spec_delta: tau, per-position rates, gated steps)."""
    before = llm.engine.spec_totals()
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [llm.chat([c], [p])[0] for c, p in zip(convs, params)]
    else:
        outs = llm.chat(convs, params)
    dt = time.perf_counter() - t0
    return [o.token_ids for o in outs], dt, spec_delta(before, llm.engine.spec_totals())


def arm_row(arm: str, toks: list, dt: float, delta: dict, ref: list, **keys) -> dict:
    """One arm's row: tokens, tok/s, outputs equal to the reference's, and with drafts tau."""
    n = sum(len(t) for t in toks)
    row = {**keys, "arm": arm, "tokens": n, "seconds": dt, "tok_s": n / dt,
           "same_as_plain": sum(a == b for a, b in zip(toks, ref))}
    if delta["num_drafts"]:
        row.update(tau=delta["acceptance_length"], num_drafts=delta["num_drafts"], gated_steps=delta["gated_steps"],
                   accept_rate_per_position=[round(x, 4) for x in delta["acceptance_rate_per_position"]])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default="mt-bench")
    ap.add_argument("--num-prompts", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--concurrency", default="1,all")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1000, help="request i uses seed + i")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default="auto")
    ap.add_argument("--json", default=None)
    ap.add_argument("--tree-sizes", default="7,15", help="comma-separated tree sizes, one arm each")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--once", action="store_true", help="one pass of every arm: no warm-up, no reps")
    args = ap.parse_args()
    try:
        sizes = [int(t) for t in args.tree_sizes.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tree-sizes takes comma-separated integers, got {args.tree_sizes!r}")
    levels = [c.strip() for c in args.concurrency.split(",")]
    if any(c not in ("1", "all") for c in levels):
        ap.error(f"--concurrency takes 1 and/or all, got {args.concurrency!r}")
    kw = {"model": args.model, "device": args.device,
          "dtype": args.dtype or ("float32" if args.device == "cpu" else "bfloat16")}
    convs = [p.messages for p in load_prompts(args.dataset, args.num_prompts)]
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
              for i in range(len(convs))]
    arms = {"plain": LLM(draft=None, **kw)}
    for size in [None] + sizes:  # every step drafts: no acceptance gate
        t0 = time.perf_counter()
        llm = LLM(draft=args.draft, speculative_min_acceptance_length=None, speculative_tree_size=size, **kw)
        if llm.engine.spec is None:
            raise SystemExit("no drafter loaded: pass --draft DIR")
        arms["chain" if size is None else f"tree{size}"] = llm
        log(f"engine {'chain' if size is None else f'tree {size}'} ready in {time.perf_counter() - t0:.1f} s")
    results = []

    def report_pass(name: str, out: tuple, ref: list, level: str, rep: int) -> None:
        toks, dt, d = out
        row = arm_row(name, toks, dt, d, ref, concurrency=level, rep=rep)
        results.append(row)
        tau = f", tau {row['tau']:.3f}, per depth {row['accept_rate_per_position'][:4]}" if "tau" in row else ""
        log(f"c={level} rep {rep} {name:7s}: {row['tokens']} tokens in {dt:.2f} s, {row['tok_s']:.1f} tok/s, "
            f"same as plain {row['same_as_plain']}/{len(convs)}{tau}")

    for level in levels:
        one = level == "1"
        first = run(arms["plain"], convs, params, one)  # the reference tokens (and a warm-up)
        ref = first[0]
        if args.once:
            report_pass("plain", first, ref, level, 0)
            for name, llm in list(arms.items())[1:]:
                report_pass(name, run(llm, convs, params, one), ref, level, 0)
            continue
        for llm in arms.values():  # warm-up of every arm
            run(llm, convs[:2], params[:2], one)
        for rep in range(args.reps):
            for name, llm in arms.items():
                report_pass(name, run(llm, convs, params, one), ref, level, rep)
    report(f"{args.dataset}: {len(convs)} prompts x {args.max_tokens} tokens, T={args.temperature:g} "
           f"(same_as_plain of {len(convs)})", results, {"bench": "tree_arms", "args": vars(args), "results": results},
           args.json, ["concurrency", "rep", "arm", "tok_s", "tau", "same_as_plain", "tokens", "seconds"], args.device)


if __name__ == "__main__":
    main()
