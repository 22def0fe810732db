"""One scheduled request's part of a DFlash step: its rows in the step's flat batch and, once the
target has verified them, what it accepted."""

from __future__ import annotations

from dataclasses import dataclass

from flashdraft.engine.sequence import Sequence


@dataclass
class Plan:
    """One scheduled request's part of a step."""
    seq: Sequence
    n: int  # rows the target computes this step
    row: int  # first row of this request in the flattened batch
    verify: bool  # the rows are [x_start, d_1 .. d_{n-1}]: a draft block under verification
    accepted: int = 0  # leading drafts the target agreed with
    path: list[int] | None = None  # token trees: the verify rows of the accepted drafts to move, by depth
