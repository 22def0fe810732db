"""The bench with each engine step timed and classed, to see where an arm's wall time goes: `flashdraft
bench`'s own arguments and runner (plain then DFlash at each concurrency, a warm-up round each), every
`engine.step()` call timed on the host and classed as
  join    a request was waiting at its start (one had just finished: its successor is admitted),
  tail    fewer than c requests were left (the last prompts draining),
  steady  the rest: c requests decoding or verifying.
Prints one JSON line per concurrency: each arm's tok/s and tau, per class its calls, seconds, committed
tokens, forwards and ms a call; the speedup, the outputs equal to plain decoding's, and `steady_ratio`:
DFlash over plain in tokens per second of steady steps alone. The classes count the host's calls, not the
GPU's work: with overlap a call launches the next step and waits for the last one, so a joining request's
prefill, queued in a join call, is paid in the wait of a later (steady) call. For the GPU's time by kind of
step, pair_timeline.py.

    python benchmarks/device/pair_steps.py --model smollm2.gguf --draft flashdraft/drafters/smollm2-135m-dflash \\
        --dataset humaneval.jsonl --num-prompts 64 --max-tokens 256 --concurrency 8,16"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import add_bench_args, tokenize, validate  # noqa: E402
from flashdraft.bench.runner import EngineBackend, Workload  # noqa: E402
from flashdraft.bench.stats import same_outputs, summarize  # noqa: E402
from flashdraft.config import engine_kwargs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    add_bench_args(p)
    args = p.parse_args()
    concs, prompts = validate(args)
    eng = LLM(**engine_kwargs(args)).engine
    prompts, ids, _ = tokenize(eng, prompts, args.chat, args.max_tokens)
    backend = EngineBackend(eng, ids, Workload(args.max_tokens, args.temperature, args.seed, args.ignore_eos))
    log: list[tuple] = []
    step = eng.step

    def timed_step():
        sched = eng.scheduler
        running, waiting = len(sched.running), len(sched.waiting)
        before = {s.seq_id: s.num_output_tokens for s in sched.running}
        forwards = eng.stats["num_steps"]
        t0 = time.perf_counter()
        out = step()
        t1 = time.perf_counter()
        tokens = sum(s.num_output_tokens - before.get(s.seq_id, 0) for s in out)
        log.append((t1 - t0, running, waiting, eng.stats["num_steps"] - forwards, tokens))
        return out

    eng.step = timed_step
    for c in concs:
        row: dict = {"dataset": args.dataset, "c": c}
        runs = {}
        for arm in ("plain", "dflash"):
            backend.warmup(arm == "dflash", c)
            log.clear()
            run = runs[arm] = backend.run(arm == "dflash", c)
            classes: dict[str, list] = {}
            for dt, running, waiting, forwards, tokens in log:
                k = "join" if waiting > 0 else ("tail" if running < c else "steady")
                d = classes.setdefault(k, [0, 0.0, 0, 0])
                d[0] += 1
                d[1] += dt
                d[2] += tokens
                d[3] += forwards
            row[arm] = {"tok_s": summarize(run.results, run.wall_s, run.spec)["output_tok_s"], "wall_s": run.wall_s,
                        "tau": (run.spec or {}).get("acceptance_length"),
                        "classes": {k: {"calls": n, "s": round(t, 4), "tokens": tok, "forwards": f,
                                        "ms_per_call": round(1e3 * t / max(n, 1), 4)}
                                    for k, (n, t, tok, f) in classes.items()}}
        row["speedup"] = row["dflash"]["tok_s"] / row["plain"]["tok_s"]
        row["same"] = same_outputs(runs["plain"].results, runs["dflash"].results)
        steady = [row[a]["classes"].get("steady") for a in ("plain", "dflash")]
        if all(steady):
            row["steady_ratio"] = (steady[1]["tokens"] / steady[1]["s"]) / (steady[0]["tokens"] / steady[0]["s"])
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
