"""A DFlash step's records: one scheduled request's part of it (Plan), what its forward returns
(Verified), and the launched step until the host reads it (VerifyFlight)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashdraft.engine.graphs import StepGraph
from flashdraft.engine.logits import StepLogprobs
from flashdraft.engine.pipeline import Flight, InFlight
from flashdraft.engine.sequence import Sequence, TokenLogprob


@dataclass
class Plan:
    """One scheduled request's part of a step."""
    seq: Sequence
    n: int  # rows the target computes this step
    row: int  # first row of this request in the flattened batch
    verify: bool  # the rows are [x_start, d_1 .. d_{n-1}]: a draft block under verification
    accepted: int = 0  # leading drafts the target agreed with
    path: list[int] | None = None  # token trees: the verify rows of the accepted drafts to move, by depth


@dataclass
class Verified:
    """A step's forward: the target's final hidden states of every row, the verify's input ids on the
    device (None when no request verifies), and the whole-step graph that ran it (None: another path)."""
    hidden: torch.Tensor
    ids: torch.Tensor | None
    graph: StepGraph | None = None


@dataclass
class Committed:
    """A step's outcome on the host: each verifying plan's accepted drafts, each plan's tokens by plan
    index, and their log-probability entries where requests asked for them."""
    accepted: list[int]
    chosen: dict[int, list[int]]
    logprobs: dict[int, list[TokenLogprob]] | None = None


class VerifyFlight(Flight):
    """A launched step of plans not read yet: its outcome on the device, the accepted drafts of its
    verifying plans [V] at 0 and the target's tokens at toks_at (owner: each token's plan index), and its
    copy to the host behind the step. started, whole: the step costs' clock (when the step began, and
    whether every running request is in it), and when it was launched. graph: the whole-step graph
    it replayed, which the step after it may take its inputs from (launch ahead)."""

    def __init__(self, plans: list[Plan], outcome: torch.Tensor | None, toks_at: int, owner: list[int],
                 started: float, whole: bool, graph: StepGraph | None = None, logprobs: StepLogprobs | None = None):
        self.plans, self.outcome, self.toks_at, self.owner = plans, outcome, toks_at, owner
        self.started, self.whole, self.graph, self.logprobs = started, whole, graph, logprobs
        self.launched = started  # (set by whoever launched it, on the policy's clock)
        self.decoding = False  # only decode rows without drafts (set by whoever launched it)
        self.seqs = [p.seq for p in plans]
        self.verifying = [p for p in plans if p.verify]
        self.joining = None
        self.stays = False
        self.hidden: torch.Tensor | None = None  # the verify's final hidden states (grammar_check.py reads them)
        self._read = InFlight(self.seqs, outcome) if outcome is not None else None

    @property
    def accepted(self) -> torch.Tensor:
        return self.outcome[: len(self.verifying)]

    @property
    def toks(self) -> torch.Tensor:
        return self.outcome[self.toks_at: self.toks_at + len(self.owner)]

    def read(self) -> Committed:
        """The outcome on the host (waits for the step)."""
        if self._read is None:
            return Committed([], {})
        host = self._read.read()
        toks = host[self.toks_at: self.toks_at + len(self.owner)]
        chosen: dict[int, list[int]] = {}
        for i, t in zip(self.owner, toks):
            chosen.setdefault(i, []).append(t)
        entries = None
        if self.logprobs is not None:
            entries = {}
            for i, e in zip(self.owner, self.logprobs.read(toks, [self.plans[i].seq for i in self.owner])):
                entries.setdefault(i, []).append(e)
        return Committed(host[: len(self.verifying)], chosen, entries)


class ReadFlight(VerifyFlight):
    """A step whose outcome the host has read already (an eager token-tree step: its accepted paths)."""

    def __init__(self, plans: list[Plan], committed: Committed, started: float, whole: bool):
        super().__init__(plans, None, 0, [], started, whole)
        self.committed = committed

    def read(self) -> Committed:
        return self.committed
