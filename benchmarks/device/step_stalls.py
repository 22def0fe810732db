"""Which serving steps stall, and whether a Triton kernel compiled inside them: the real pair run
through `LLM.generate` at a fixed concurrency (max_num_seqs), every step timed with a device sync
around it; steps over 10 ms are listed with the Triton variants they compiled and the graphs they
captured. Two passes over the same prompts: the second shows what is left once everything is warm.
With --profile, the second pass runs every step under cProfile and prints where the host time of
the slow steps (and, apart, of all the others) goes.

    python benchmarks/device/step_stalls.py --gguf smollm2.gguf --draft DRAFTER_DIR \\
        --prompts prompts/humaneval.jsonl --concurrency 8
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch
import triton

from flashdraft import LLM, SamplingParams
from flashdraft.attention import triton_paged
from flashdraft.bench.datasets import load_prompts
from flashdraft.models import fused, skinny


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--draft", default=None, help="drafter folder; omit for plain decoding")
    ap.add_argument("--prompts", required=True, help="jsonl of {prompt}")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="cProfile the second pass's steps")
    args = ap.parse_args()

    kernels = {f"{m.__name__.rsplit('.', 1)[-1]}.{n}": f for m in (triton_paged, fused, skinny)
               for n, f in vars(m).items() if isinstance(f, triton.runtime.jit.JITFunction)}

    def variants() -> dict[str, int]:
        return {n: sum(len(c[0]) for c in f.device_caches.values()) for n, f in kernels.items()}

    llm = LLM(args.gguf, draft=args.draft, device="cuda", dtype="bfloat16", max_num_seqs=args.concurrency)
    eng = llm.engine
    ids = [eng.apply_chat_template(p.messages) for p in load_prompts(args.prompts, args.num_prompts)]
    real_step, slow = eng.step, []

    profiles = {"slow": pstats.Stats(), "other": pstats.Stats()}  # merged per kind of step
    profiling = False

    def step():
        before, graphs = variants(), len(eng.runner.graphs)
        torch.cuda.synchronize()
        prof = cProfile.Profile() if profiling else None
        t0 = time.perf_counter()
        out = real_step() if prof is None else prof.runcall(real_step)
        torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        if prof is not None:
            profiles["slow" if ms > 10 else "other"].add(prof)
        after = variants()
        new = {k: after[k] - before[k] for k in after if after[k] != before[k]}
        if ms > 10 or new or len(eng.runner.graphs) != graphs:
            slow.append({"ms": round(ms, 1), "compiled": new, "captured": len(eng.runner.graphs) - graphs,
                         "running": len(eng.scheduler.running)})
        return out

    eng.step = step
    for rep in range(2):
        profiling = args.profile and rep == 1
        slow.clear()
        t0 = time.perf_counter()
        outs = llm.generate(ids, SamplingParams(max_tokens=args.max_tokens))
        wall = time.perf_counter() - t0
        print(f"pass {rep + 1}: {wall:.2f} s, {sum(len(o.token_ids) for o in outs)} tokens, "
              f"{len(slow)} steps over 10 ms ({sum(s['ms'] for s in slow):.0f} ms in all), "
              f"{sum(1 for s in slow if s['compiled'])} with a compile")
        for s in slow:
            print("  " + json.dumps(s))
    for kind, st in profiles.items():
        if st.stats:
            buf = io.StringIO()
            st.stream = buf
            st.sort_stats("tottime").print_stats(30)
            st.sort_stats("cumulative").print_stats(30)
            print(f"--- {kind} steps under cProfile ---\n{buf.getvalue()}")


if __name__ == "__main__":
    main()
