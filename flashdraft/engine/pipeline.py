"""The engine's step loop: launch the next step, then read the last.

One engine step (`Pipeline.step`) with async scheduling:

    prev = the step in flight (launched last call, its tokens still on the device)
    if the step after prev may launch before prev is read (may_launch_after: one predicate):
        launch it, its inputs taken from prev's outputs on the device; queue the prefill of
        waiting requests that fit behind it (joining)
    read prev and commit it (stops, streaming, pages), then the joiners' first tokens
    with nothing left in flight: schedule and launch a new step; it stays in flight if it may

So the GPU has the next step queued while the host commits, checks stops and streams. A request
that finishes at step N had rows in step N+1: they are computed and dropped, never committed, and
its pages went back only after N+1 was queued, so whatever reuses them runs after it on the stream.

What differs between plain decoding and DFlash steps is a `Steps` (engine/decode.py,
speculative/dflash.py): how a step is launched from the scheduler, how the step after an in-flight
one is planned and launched on its outputs, how a step's outcome is committed. The pipeline owns
the step in flight and the joins; a `Steps` never calls back into it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from flashdraft.config import EngineConfig
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.graphs import to_device
from flashdraft.engine.logits import StepLogprobs
from flashdraft.engine.model_runner import ModelRunner
from flashdraft.engine.scheduler import ScheduledBatch, Scheduler
from flashdraft.engine.sequence import Sequence


@dataclass
class StepContext:
    """What every kind of step works with: the engine's parts, and how tokens are committed to a request
    (LLMEngine.append_tokens: stop checks, finishes)."""

    config: EngineConfig
    runner: ModelRunner
    scheduler: Scheduler
    block_manager: BlockManager
    max_model_len: int
    eos_token_ids: list[int]
    append_tokens: Callable[..., int]
    async_scheduling: bool
    stats: dict = field(default_factory=lambda: {"num_steps": 0, "num_preemptions": 0, "num_generated_tokens": 0,
                                                 "num_overlapped_steps": 0})

    @property
    def device(self) -> torch.device:
        return self.runner.device


class Flight:
    """A launched step not read yet. `stays`: it may stay in flight while the next step is launched
    on its outputs; `joining`: the prefill of requests admitted behind it."""

    seqs: list[Sequence]
    stays: bool = False
    joining: InFlight | None = None

    def finish(self) -> None:
        """Complete a step launched ahead once the step before it is committed (engine/deferred.py:
        choices that read what that commit moves); nothing for most steps."""


class InFlight(Flight):
    """A launched step's samples, one per sequence (a decode step, a prefill's end): on the device,
    and being copied to pinned host memory behind the step (an event marks the copy's end)."""

    def __init__(self, seqs: list[Sequence], tokens: torch.Tensor, logprobs: StepLogprobs | None = None,
                 stays: bool = False):
        self.seqs, self.stays = seqs, stays
        self.joining = None
        self.take(tokens, logprobs)

    def take(self, tokens: torch.Tensor, logprobs: StepLogprobs | None = None) -> None:
        """The step's samples [S] on the device (and their log-probabilities): copied behind the step."""
        self.tokens, self.logprobs, self.done = tokens, logprobs, None
        if tokens.is_cuda:
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record()
        else:  # a snapshot: a static buffer's next step must not change what this one read
            self.host = tokens.clone()

    def next_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        """The device ids of the step after this one over `seqs` (a subsequence of this step's, then of
        the requests admitted behind it): each sequence's sample."""
        own, tokens = self.seqs, self.tokens
        if self.joining is not None:
            own, tokens = own + self.joining.seqs, torch.cat([tokens, self.joining.tokens])
        if len(seqs) == len(own):
            return tokens
        index = {id(s): i for i, s in enumerate(own)}
        return tokens[to_device([index[id(s)] for s in seqs], torch.long, tokens.device)]

    def read(self) -> list[int]:
        if self.done is not None:
            self.done.synchronize()
        return self.host.tolist()


class Steps(Protocol):
    """What a kind of step supplies to the pipeline."""

    join_reserve: int  # slots past its prompt a request admitted behind a step in flight is given
    # whether a step launched ahead of requests that process or read logits defers their choice until the
    # step before it is committed (engine/deferred.py); otherwise no step is launched ahead of them
    defers: bool

    def launch(self) -> Flight | None:
        """Schedule a step now and launch it (None: nothing to run, or nothing to read)."""

    def launch_after(self, prev: Flight) -> Flight | None:
        """The step after `prev`, launched on its outputs before it is read; None when it cannot be
        planned before prev is read. Called only where may_launch_after(prev) holds."""

    def commit(self, flight: Flight, ahead: Flight | None) -> list[Sequence]:
        """Read a launched step and commit it; `ahead`: the step launched after it, if any."""

    def may_join(self, seq: Sequence) -> bool:
        """Whether a waiting request may be admitted behind a step in flight, its prefill a step of its own."""

    def prefill(self, batch: ScheduledBatch) -> InFlight:
        """Launch the prefill of whole prompts admitted behind a step in flight; their first samples."""


def kept_rows(prev: list[Sequence], running: list[Sequence]) -> list[int] | None:
    """Where each running request sits in the in-flight step's `prev`, when the running requests are
    prev's in order less some that finished or were aborted since its launch (a step after it can
    then be launched before it is read, on its outputs); None when any other request runs."""
    index = {id(s): i for i, s in enumerate(prev)}
    rows = [index.get(id(s), -1) for s in running]
    if not rows or -1 in rows or any(a >= b for a, b in zip(rows, rows[1:])):
        return None
    return rows


def commit_samples(ctx: StepContext, flight: InFlight) -> list[Sequence]:
    """Wait for a launched step's samples and commit them (a request finished or aborted since the
    launch takes none)."""
    advanced, toks = [], flight.read()
    lps = flight.logprobs.read(toks, flight.seqs) if flight.logprobs is not None else [None] * len(toks)
    for seq, tok, lp in zip(flight.seqs, toks, lps):
        if not seq.is_finished:
            ctx.append_tokens(seq, [tok], [lp])
            advanced.append(seq)
    return advanced


class Pipeline:
    def __init__(self, ctx: StepContext, steps: Steps):
        self.ctx, self.steps = ctx, steps
        self.inflight: Flight | None = None

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One engine step: the sequences that advanced (the module's docstring). In inference mode, every
        kind of step and its launch ahead alike: the head and the greedy choice then take the fused kernels
        (a step launched ahead outside it ran its eager sampling with autograd on, 80 us more a step for
        SmolLM2's decode steps on an H200)."""
        prev, self.inflight = self.inflight, None
        if prev is None:
            return self._launch()
        if self.may_launch_after(prev):
            self.inflight = self.steps.launch_after(prev)
            if self.inflight is not None:
                self.ctx.stats["num_overlapped_steps"] += 1
                self.inflight.joining = self._launch_joining()
        joined = commit_samples(self.ctx, prev.joining) if prev.joining is not None else []
        advanced = joined + self.steps.commit(prev, self.inflight)
        if self.inflight is not None:
            self.inflight.finish()  # (its choice, where it reads what the commit moved)
        if self.inflight is not None or not self.ctx.scheduler.has_unfinished():
            return advanced
        return advanced + self._launch()

    def _launch(self) -> list[Sequence]:
        flight = self.steps.launch()
        if flight is None:
            return []
        if self.ctx.async_scheduling and flight.stays:
            self.inflight = flight
            return []
        return self.steps.commit(flight, None)

    def may_launch_after(self, prev: Flight) -> bool:
        """Whether the step after the in-flight `prev` may be launched before prev is read: the running
        requests are prev's, in order, less any that finished or were aborted since, then those admitted
        behind it; none processes or reads logits (those read the last step's tokens first); and no
        waiting request could be admitted now that may not join behind a step in flight."""
        sched = self.ctx.scheduler
        running, joining = sched.running, prev.joining.seqs if prev.joining is not None else []
        if joining and [id(s) for s in running[len(running) - len(joining):]] != [id(s) for s in joining]:
            return False  # (a request admitted behind prev was aborted)
        if kept_rows(prev.seqs, running[: len(running) - len(joining)]) is None:
            return False
        if any(s.params.needs_logits for s in running) and not self.steps.defers:
            return False
        return not (sched.waiting and len(running) < sched.max_num_seqs and not self.steps.may_join(sched.waiting[0]))

    def _launch_joining(self) -> InFlight | None:
        """Admit the waiting requests whose whole prompt fits now and queue their prefill as a step of
        its own, behind the step just launched; None when none is admitted."""
        sched = self.ctx.scheduler
        if not sched.waiting or not self.steps.may_join(sched.waiting[0]):
            return None
        batch = sched.admit(reserve=self.steps.join_reserve)
        if not batch.seqs:
            return None
        return self.steps.prefill(batch)
