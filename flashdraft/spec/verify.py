"""The acceptance rule. Draft d_i (i = 1..k) is accepted iff every earlier draft was and d_i equals
the target's token chosen at verify slot i-1 (argmax at T=0, the seeded Gumbel sample at T>0:
rejection sampling with a one-hot draft distribution, hence exact). The request commits
t_0..t_a: the a accepted drafts (equal to t_0..t_{a-1}) plus the target's own token t_a."""

from __future__ import annotations

import torch

from flashdraft.models.transformer import fused_enabled


def accepted_lengths(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """drafts [S, k], target [S, k+1] -> a [S]: number of leading drafts that match. On the
    fused GPU path one Triton kernel (fused.accepted_lengths), else four torch ops."""
    if drafts.numel() and fused_enabled(drafts):
        from flashdraft.models import fused

        return fused.accepted_lengths(drafts, target)
    match = (drafts == target[:, :-1]).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1)
