"""Constrained against unconstrained decoding, plain and DFlash, on one GPU, in one process: tok/s, steps,
tau, the host time of the grammar work per step, and how many outputs equal plain decoding's.

    python benchmarks/device/structured_steps.py --model smollm2.gguf [--concurrency 1,8,32] [--out DIR]

The `structured` dataset (32 requests with their grammars; unconstrained: the same prompts without them),
greedy, max 256 tokens. DFlash runs twice: with the step gate off (every step drafts: what speculation
itself costs and gains) and with the default gate, reset before each run as a fresh server's would be. The
plain arm is requests with speculative=False on the gate-off engine. The constrained arms also run DFlash
with every verify row of a greedy constrained request masked and its drafts walked (FLASHDRAFT_GRAMMAR_CHECK=0),
against their tokens checked after an unmasked verify (the default: speculative/grammar_check.py). Host
timers wrap the walk of the drafts (structured/walk.py), the verify rows' masks (structured/masks.py) and
the check (which includes the device read of its replaced tokens); the others include no GPU wait."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import flashdraft.engine.logits as logits_module
import flashdraft.speculative.dflash as dflash
import flashdraft.speculative.grammar_drafts as grammar_drafts
from flashdraft import LLM, StructuredOutputsParams, settings
from flashdraft.bench.command import tokenize
from flashdraft.bench.datasets import load_structured
from flashdraft.bench.runner import EngineBackend, Workload
from flashdraft.speculative.costs import Observed
from flashdraft.speculative.gate import DepthProfile, StepGate

HOST_S: dict[str, float] = {}


def timed(name, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            HOST_S[name] = HOST_S.get(name, 0.0) + time.perf_counter() - started
    return wrapper


def fresh_gate(llm: LLM) -> None:
    policy = llm.engine.spec.policy
    if policy.step_gate is not None:
        policy.step_gate, policy.seen = StepGate(), Observed()
        policy.profile = DepthProfile(policy.choices) if policy.profile is not None else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--draft", default="flashdraft/drafters/smollm2-135m-dflash")
    ap.add_argument("--concurrency", default="1,8,32")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    grammar_drafts.walk_drafts = timed("walk", grammar_drafts.walk_drafts)
    logits_module.apply_grammars = timed("masks", logits_module.apply_grammars)
    dflash.check_outcome = timed("check", dflash.check_outcome)
    engines = {"off": LLM(model=args.model, draft=args.draft, speculative_min_acceptance_length=None),
               "auto": LLM(model=args.model, draft=args.draft)}
    prompts, ids, _ = tokenize(engines["off"].engine, load_structured(), True, args.max_tokens)
    # dflash-masked: greedy constrained requests masked at every verify row, their drafts walked (the path
    # before structured checks: FLASHDRAFT_GRAMMAR_CHECK=0), gate off
    for llm in engines.values():  # every grammar compiled (and cached) before any arm's clock
        for p in prompts:
            llm.engine.grammars().request(StructuredOutputsParams(**p.constraint))
        for constrained in (True, False):  # every prompt once, plain and DFlash (kernels for its shapes)
            workload = Workload(32, 0.0, 0, False, [p.constraint for p in prompts] if constrained else None)
            for speculative in (False, True):
                EngineBackend(llm.engine, ids, workload).run(speculative, 8)
    arms = [("plain", "off", False), ("dflash", "off", True), ("dflash-masked", "off", True),
            ("dflash-gated", "auto", True)]
    rows, outputs = [], {}
    for constrained in (True, False):
        workload = Workload(args.max_tokens, 0.0, 0, False, [p.constraint for p in prompts] if constrained else None)
        for c in concurrency:
            for arm, gate, speculative in arms:
                if arm == "dflash-masked" and not constrained:
                    continue
                settings.GRAMMAR_CHECK = arm != "dflash-masked"
                llm = engines[gate]
                backend = EngineBackend(llm.engine, ids, workload)
                fresh_gate(llm)
                backend.warmup(speculative, c)
                fresh_gate(llm)
                HOST_S.clear()
                run = backend.run(speculative, c)
                tokens = sum(r.output_tokens for r in run.results)
                spec = run.spec or {}
                outputs[(constrained, c, arm)] = [r.output for r in sorted(run.results, key=lambda r: r.index)]
                plain = outputs[(constrained, c, "plain")]
                row = {"constrained": constrained, "c": c, "arm": arm, "tok_s": round(tokens / run.wall_s, 1),
                       "steps": run.steps, "tokens": tokens, "tau": spec.get("acceptance_length"),
                       "drafts": spec.get("num_drafts"),
                       **{f"{k}_ms_per_step": round(1e3 * v / run.steps, 4) for k, v in HOST_S.items()},
                       "same_as_plain": sum(a == b for a, b in zip(outputs[(constrained, c, arm)], plain))}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "structured_steps.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
