"""A decode step launched ahead whose tokens are chosen after the step before it is committed.

Requests that process or read their logits (a grammar's mask, penalties, min_tokens, log-probabilities)
choose from what the last commit moved: a matcher's state, the output counts. A decode step launched
before that commit (engine/pipeline.py) runs its forward at once, and the pipeline calls `finish` once the
step before it is committed: the head, the processors and the sampling are queued then, behind the
forward, so a grammar's masks are filled on the host while the GPU runs the step."""

from __future__ import annotations

import torch

from flashdraft.engine.logits import choose
from flashdraft.engine.pipeline import InFlight
from flashdraft.engine.sampler import SamplingBatch
from flashdraft.engine.sequence import Sequence


def deferred(seqs: list[Sequence]) -> bool:
    """Whether a decode step over these requests, launched ahead, defers its choice (some request needs
    its logits)."""
    return any(s.params.needs_logits for s in seqs)


class DeferredChoice(InFlight):
    """hidden [S, H]: the final hidden states of the rows that sample, one per request (kept apart from
    the graph's buffers, which the next replay reuses)."""

    def __init__(self, model, hidden: torch.Tensor, seqs: list[Sequence], positions: list[int], sb: SamplingBatch,
                 eos_ids, stays: bool = True):
        self.seqs, self.stays, self.joining = seqs, stays, None
        self._choice = (model, hidden.clone(), positions, sb, eos_ids)

    def finish(self) -> None:
        if self._choice is None:
            return
        model, hidden, positions, sb, eos_ids = self._choice
        self._choice = None
        self.take(*choose(model, hidden, self.seqs, positions, sb, eos_ids))

    def read(self) -> list[int]:
        self.finish()
        return super().read()

    def next_ids(self, seqs: list[Sequence]) -> torch.Tensor:
        self.finish()
        return super().next_ids(seqs)
