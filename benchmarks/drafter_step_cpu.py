"""Two drafters in one process, interleaved: the same HumanEval prompts, greedy, on the embedded
SmolLM2 (CPU, float32); tokens, verify steps, seconds per step and tok/s for each, twice. Run-to-run
spread on a small CPU is larger than a drafter's effect; interleaving in one process removes most
of it.

    python benchmarks/drafter_step_cpu.py DRAFTER_A DRAFTER_B [--prompts 4] [--max-tokens 96]
"""

from __future__ import annotations

import argparse
import time

from flashdraft import LLM, SamplingParams
from flashdraft.bench.datasets import load_prompts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("drafters", nargs=2)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    prompts = [p.messages for p in load_prompts("humaneval")[: args.prompts]]
    llms = {d: LLM(draft=d, device="cpu", dtype="float32", speculative_min_acceptance_length=None)  # no gate
            for d in args.drafters}
    outputs = {}
    for rep in range(args.reps):
        for name, llm in llms.items():
            before = llm.engine.spec_totals()
            t0 = time.perf_counter()
            outs = [llm.chat([m], SamplingParams(max_tokens=args.max_tokens))[0] for m in prompts]
            dt = time.perf_counter() - t0
            steps = llm.engine.spec_totals()["num_drafts"] - before["num_drafts"]
            toks = sum(len(o.token_ids) for o in outs)
            outputs.setdefault(name, [o.token_ids for o in outs])
            print(f"{name} rep {rep}: {toks} tokens, {steps} verify steps, {dt:.1f} s, "
                  f"{dt / steps * 1000:.1f} ms/step, {toks / dt:.1f} tok/s", flush=True)
    a, b = (outputs[d] for d in args.drafters)
    print(f"same tokens: {sum(x == y for x, y in zip(a, b))}/{len(a)}")


if __name__ == "__main__":
    main()
