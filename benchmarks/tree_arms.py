"""Token trees against the drafter's chain, side by side in one process: the same prompts through a
plain engine, an engine verifying the chain, and one engine per --tree-sizes, interleaved over --reps
rounds. Per arm: tau, per-depth acceptance, output tok/s, and how many outputs equal plain decoding's
(greedy, or seeded at --temperature; in float32 all of them must).

    python benchmarks/tree_arms.py [--dataset mt-bench] [--num-prompts 12] [--max-tokens 128]
        [--tree-sizes 7,15] [--temperature 0] [--concurrency 1,all] [--reps 2] [--device cpu]
        [--dtype float32] [--model M] [--draft D] [--json out.json] [--once]

--once: one pass of every arm, no warm-ups and no reps (tau and outputs on a whole prompt set; the
tok/s of such a pass include first-use costs).
"""

from __future__ import annotations

import json
import time

from sampled_drafts import arm_parser, arm_row, arm_setup, run  # benchmarks/ is on the path when this script runs

from flashdraft import LLM, SamplingParams


def main() -> None:
    ap = arm_parser()
    ap.add_argument("--tree-sizes", default="7,15", help="comma-separated tree sizes, one arm each")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--once", action="store_true", help="one pass of every arm: no warm-up, no reps")
    args = ap.parse_args()
    try:
        sizes = [int(t) for t in args.tree_sizes.split(",") if t.strip()]
    except ValueError:
        ap.error(f"--tree-sizes takes comma-separated integers, got {args.tree_sizes!r}")
    levels, kw, convs = arm_setup(ap, args)
    params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed + i)
              for i in range(len(convs))]
    arms = {"plain": LLM(draft=None, **kw)}
    for size in [None] + sizes:  # every step drafts: no acceptance gate
        t0 = time.perf_counter()
        llm = LLM(draft=args.draft, speculative_min_acceptance_length=None, speculative_tree_size=size, **kw)
        if llm.engine.spec is None:
            raise SystemExit("no drafter loaded: pass --draft DIR")
        arms["chain" if size is None else f"tree{size}"] = llm
        print(f"engine {'chain' if size is None else f'tree {size}'} ready in {time.perf_counter() - t0:.1f} s",
              flush=True)
    results = []

    def report(name: str, out: tuple, ref: list, level: str, rep: int) -> None:
        toks, dt, d = out
        row = arm_row(name, toks, dt, d, ref, concurrency=level, rep=rep)
        results.append(row)
        tau = f", tau {row['tau']:.3f}, per depth {row['accept_rate_per_position'][:4]}" if "tau" in row else ""
        print(f"c={level} rep {rep} {name:7s}: {row['tokens']} tokens in {dt:.2f} s, {row['tok_s']:.1f} tok/s, "
              f"same as plain {row['same_as_plain']}/{len(convs)}{tau}", flush=True)

    for level in levels:
        one = level == "1"
        first = run(arms["plain"], convs, params, one)  # the reference tokens (and a warm-up)
        ref = first[0]
        if args.once:
            report("plain", first, ref, level, 0)
            for name, llm in list(arms.items())[1:]:
                report(name, run(llm, convs, params, one), ref, level, 0)
            continue
        for llm in arms.values():  # warm-up of every arm
            run(llm, convs[:2], params[:2], one)
        for rep in range(args.reps):
            for name, llm in arms.items():
                report(name, run(llm, convs, params, one), ref, level, rep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
