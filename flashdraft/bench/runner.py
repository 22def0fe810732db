"""The sweep, and the in-process backend that drives an `LLMEngine` directly.

For every concurrency c, the arms run one after the other on the same prompts: plain
(`speculative=False`) then DFlash, both on one engine, so weights, prompts and batching code are the
same and only speculation differs. Each arm starts with a warm-up round of c short requests, then keeps c requests in
flight: whenever one finishes the next prompt is added, and it joins the running batch at the next step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from flashdraft.bench.stats import RequestResult, group_times, same_outputs, spec_delta, summarize
from flashdraft.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:
    from flashdraft.engine.engine import LLMEngine
    from flashdraft.engine.sequence import Sequence

ARMS = ("plain", "dflash")


class BenchError(RuntimeError):
    """The server could not be reached or refused a request."""

WARMUP_TOKENS = 16


@dataclass
class ArmRun:
    results: list[RequestResult]
    wall_s: float  # first request sent -> last request finished
    spec: dict | None  # drafting counters over the arm (warm-up excluded); None for the plain arm
    steps: int | None = None  # engine steps the arm ran (in process)


class Backend(Protocol):
    def warmup(self, speculative: bool, concurrency: int = 1) -> None: ...

    def run(self, speculative: bool, concurrency: int, on_done: Callable[[], None]) -> ArmRun: ...


@dataclass
class Workload:
    max_tokens: int
    temperature: float
    seed: int
    ignore_eos: bool
    constraints: list[dict | None] | None = None  # each prompt's grammar (StructuredOutputsParams' fields)

    def params(self, index: int, speculative: bool, max_tokens: int | None = None) -> SamplingParams:
        # a fixed seed per prompt: at T > 0 both arms draw the same noise for the same prompt
        c = self.constraints[index % len(self.constraints)] if self.constraints else None
        return SamplingParams(temperature=self.temperature, max_tokens=max_tokens or self.max_tokens,
                              ignore_eos=self.ignore_eos, seed=self.seed + index, speculative=speculative,
                              structured_outputs=StructuredOutputsParams(**c) if c else None)


class EngineBackend:
    def __init__(self, engine: LLMEngine, prompt_ids: list[list[int]], workload: Workload):
        if not prompt_ids:
            raise ValueError("no prompts to run")
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.workload = workload

    def _check_idle(self) -> None:
        if self.engine.has_unfinished():
            raise RuntimeError("the engine has requests in flight; the benchmark needs it to itself")

    def warmup(self, speculative: bool, concurrency: int = 1) -> None:
        """A short round of `concurrency` requests at once: the batch shapes the arm will meet run
        (and compile, for kernels specialised on them) before the clock starts."""
        self._check_idle()
        seqs = [self.engine.add_request(None, self.workload.params(i, speculative,
                                                                   min(WARMUP_TOKENS, self.workload.max_tokens)),
                                        prompt_token_ids=self.prompt_ids[i % len(self.prompt_ids)])
                for i in range(concurrency)]
        try:
            while not all(s.is_finished for s in seqs):
                self.engine.step()
        finally:
            for s in seqs:
                self.engine.abort(s)

    def run(self, speculative: bool, concurrency: int, on_done: Callable[[], None] | None = None) -> ArmRun:
        eng = self.engine
        self._check_idle()
        eng.reset_prefix_cache()  # each arm prefills its prompts (the warm-up cached them)
        before, steps = eng.spec_totals(), eng.stats["num_steps"]
        pending = deque(range(len(self.prompt_ids)))
        inflight: dict[int, tuple[int, Sequence]] = {}
        results: list[RequestResult] = []

        def submit() -> None:
            i = pending.popleft()
            seq = eng.add_request(None, self.workload.params(i, speculative), prompt_token_ids=self.prompt_ids[i])
            inflight[seq.seq_id] = (i, seq)

        t0 = time.perf_counter()
        try:
            while pending and len(inflight) < concurrency:
                submit()
            while inflight:
                for seq in eng.step():
                    if seq.is_finished and seq.seq_id in inflight:
                        i, _ = inflight.pop(seq.seq_id)
                        results.append(request_result(i, seq, eng, speculative))
                        if on_done is not None:
                            on_done()
                        if pending:
                            submit()
                if inflight and not eng.has_unfinished():
                    raise RuntimeError("the engine stopped with requests unfinished")
        except BaseException:
            for _, seq in inflight.values():  # leave the engine usable
                eng.abort(seq)
            raise
        wall = time.perf_counter() - t0
        spec = spec_delta(before, eng.spec_totals()) if speculative and eng.spec is not None else None
        return ArmRun(results, wall, spec, eng.stats["num_steps"] - steps)


def request_result(index: int, seq: Sequence, engine: LLMEngine, speculative: bool) -> RequestResult:
    m = engine.output(seq).metrics
    times, counts = group_times(seq.token_times)
    spec = None
    if speculative and "num_drafts" in m:
        spec = {k: m[k] for k in ("acceptance_length", "num_drafts", "num_draft_tokens", "num_accepted_tokens",
                                  "accepted_per_position", "acceptance_histogram", "gated_steps")}
    return RequestResult(index=index, prompt_tokens=seq.num_prompt_tokens, output_tokens=seq.num_output_tokens,
                         ttft_s=m.get("ttft_s"), e2e_s=m["e2e_s"],
                         chunk_times_s=[t - seq.arrival_time for t in times], chunk_tokens=counts,
                         output=list(seq.output_token_ids), finish_reason=seq.finish_reason, spec=spec,
                         grammar_mask_s=m.get("grammar_mask_s"))


def run_sweep(backend: Backend, arms: list[str], concurrencies: list[int], bar=None) -> list[dict]:
    """One row per concurrency: each arm's summary, the speedup and the cross-arm output check."""
    rows = []
    for c in concurrencies:
        runs: dict[str, ArmRun] = {}
        for arm in arms:
            if bar is not None:
                bar.set_description(f"c={c} {arm}")
            backend.warmup(arm == "dflash", c)
            runs[arm] = backend.run(arm == "dflash", c, (lambda: bar.update(1)) if bar is not None else None)
        row: dict = {"concurrency": c,
                     "arms": {a: summarize(r.results, r.wall_s, r.spec, r.steps) for a, r in runs.items()}}
        if "plain" in runs and "dflash" in runs:
            plain, dflash = row["arms"]["plain"]["output_tok_s"], row["arms"]["dflash"]["output_tok_s"]
            row["speedup"] = dflash / plain if plain and dflash is not None else None
            row["same_output"] = same_outputs(runs["plain"].results, runs["dflash"].results)
        else:
            row["speedup"], row["same_output"] = None, None
        rows.append(row)
    return rows
