"""Plain decoding as the pipeline's steps (engine/pipeline.py): the target over each scheduled
request's new rows and the sampling of every request whose rows reach its end. With async
scheduling a step whose every row samples stays in flight, and the decode step after it launches
on its samples on the device."""

from __future__ import annotations

import torch

from flashdraft.engine.deferred import DeferredChoice, deferred
from flashdraft.engine.graphs import to_device
from flashdraft.engine.logits import choose, prompt_logprobs
from flashdraft.engine.pipeline import Flight, InFlight, StepContext, commit_samples
from flashdraft.engine.scheduler import ScheduledBatch
from flashdraft.engine.sequence import Sequence


def decode_rows(ctx: StepContext) -> list[Sequence] | None:
    """The sequences of a decode step after one in flight (whose samples are their next inputs), each
    given a page for its next token: the running requests less those that their last sample surely ends
    (max_tokens, the context window); None when none is left, they exceed the token budget, or a page
    is missing (the scheduler decides whom to preempt, once the step in flight is read)."""
    sched, bm = ctx.scheduler, ctx.block_manager
    seqs = [s for s in sched.running if not (
        (s.params.max_tokens is not None and s.num_output_tokens + 1 >= s.params.max_tokens)
        or s.num_tokens + 1 >= ctx.max_model_len)]
    if not seqs or len(seqs) > sched.max_num_batched_tokens:
        return None
    for s in seqs:
        if not bm.can_fit(s.seq_id, s.num_computed_tokens + 1):
            return None
        bm.allocate(s.seq_id, s.num_computed_tokens + 1)
    return seqs


class PlainSteps:
    join_reserve = 1
    defers = True  # (a decode step launched ahead chooses after the commit before it: deferred.py)

    def __init__(self, ctx: StepContext):
        self.ctx = ctx

    def launch(self) -> InFlight | None:
        batch = self.ctx.scheduler.schedule()
        self.ctx.stats["num_preemptions"] += len(batch.preempted)
        if not batch.seqs:
            return None
        flight = self._forward(batch.seqs, new_rows(batch))
        if flight is not None:
            flight.stays = len(flight.seqs) == len(batch.seqs)
        return flight

    def launch_after(self, prev: InFlight) -> InFlight | None:
        seqs = decode_rows(self.ctx)
        if seqs is None:
            return None
        flight = self._forward(seqs, [[0]] * len(seqs), prev.next_ids(seqs), defer=True)
        flight.stays = True
        return flight

    def commit(self, flight: Flight, ahead: Flight | None) -> list[Sequence]:
        return commit_samples(self.ctx, flight)

    def may_join(self, seq: Sequence) -> bool:
        return not seq.params.needs_logits and \
            seq.num_tokens - seq.num_computed_tokens <= self.ctx.scheduler.max_num_batched_tokens

    def prefill(self, batch: ScheduledBatch) -> InFlight:
        return self._forward(batch.seqs, new_rows(batch))

    @torch.inference_mode()
    def _forward(self, seqs: list[Sequence], tokens: list[list[int]], ids: torch.Tensor | None = None,
                 defer: bool = False) -> InFlight | None:
        """Queue the target over `tokens` (each sequence's rows from num_computed_tokens on; `ids`:
        their values already on the device) and the sampling of every sequence whose rows reach its
        end (defer: launched ahead, the sampling after the commit before it where a request needs its
        logits); None when none does. Nothing here waits for the GPU. In inference mode, as the target's
        forward is: the head and the greedy choice take the fused kernels (with autograd on, the
        head ran through cuBLAS and the choice through torch's argmax, 25 us more a step at the
        Qwen3.5-4B shape on an H200)."""
        ctx = self.ctx
        runner = ctx.runner
        hidden, _, qsl = runner.forward(seqs, tokens, ctx.block_manager, input_ids=ids)
        for i, (s, t) in enumerate(zip(seqs, tokens)):
            if s.prompt_logprobs is not None:
                prompt_logprobs(runner.model, hidden[qsl[i]: qsl[i + 1]], s, s.num_computed_tokens)
            s.num_computed_tokens += len(t)
        ctx.stats["num_steps"] += 1
        ready = [i for i, s in enumerate(seqs) if s.num_computed_tokens >= s.num_tokens]
        if not ready:
            return None
        rows = [qsl[i + 1] - 1 for i in ready]
        if rows != list(range(len(rows))):  # a decode batch samples rows 0..n-1: no gather
            hidden = hidden[to_device(rows, torch.long, ctx.device)]
        seqs = [seqs[i] for i in ready]
        # the position of the token drawn: one past the rows computed (the in-flight token included)
        positions = [s.num_computed_tokens for s in seqs]
        sb = runner.sampling_batch(seqs, positions)
        if defer and deferred(seqs):
            return DeferredChoice(runner.model, hidden[: len(rows)], seqs, positions, sb, ctx.eos_token_ids)
        return InFlight(seqs, *choose(runner.model, hidden[: len(rows)], seqs, positions, sb, ctx.eos_token_ids))


def new_rows(batch: ScheduledBatch) -> list[list[int]]:
    """Each scheduled sequence's new token ids this step, from its num_computed_tokens on."""
    return [s.token_ids[s.num_computed_tokens: s.num_computed_tokens + n]
            for s, n in zip(batch.seqs, batch.num_new_tokens)]
