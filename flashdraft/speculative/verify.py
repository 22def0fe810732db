"""The acceptance rule. Draft d_i (i = 1..k) is accepted iff every earlier draft was and d_i equals
the target's token chosen at verify slot i-1 (argmax at T=0, the seeded Gumbel sample at T>0:
rejection sampling with a one-hot draft distribution, hence exact). The request commits
t_0..t_a: the a accepted drafts (equal to t_0..t_{a-1}) plus the target's own token t_a."""

from __future__ import annotations

import torch

from flashdraft.engine.graphs import to_device
from flashdraft.models.transformer import fused_enabled


def accepted_lengths(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """drafts [S, k], target [S, k+1] -> a [S]: number of leading drafts that match. On the
    fused GPU path one Triton kernel (fused_tokens.accepted_lengths), else four torch ops."""
    if drafts.numel() and fused_enabled(drafts):
        from flashdraft.models import fused_tokens

        return fused_tokens.accepted_lengths(drafts, target)
    match = (drafts == target[:, :-1]).to(torch.int64)
    return match.cumprod(dim=1).sum(dim=1)


def ragged_accepted_lengths(ids: torch.Tensor, toks: torch.Tensor, rows: list[tuple[int, int, int]]) -> torch.Tensor:
    """accepted_lengths of verify blocks of different sizes in one flat batch. ids: every row's input id,
    toks: the target's tokens; rows: per verifying request (its first draft row in ids, its first target
    token in toks, its number of drafts). Each request's drafts and tokens are gathered into [V, w]
    rows, padded with values that never match."""
    w = max(k for _, _, k in rows)
    pad_d, pad_t = ids.shape[0], toks.shape[0]
    d_idx = [d + i if i < k else pad_d for d, _, k in rows for i in range(w)]
    t_idx = [t + i if i < k else pad_t for _, t, k in rows for i in range(w + 1)]
    idx = to_device(d_idx + t_idx, torch.long, ids.device)
    dev_ids = torch.cat([ids, ids.new_full((1,), -1)])[idx[: len(d_idx)]].view(-1, w)
    dev_toks = torch.cat([toks, toks.new_full((1,), -2)])[idx[len(d_idx):]].view(-1, w + 1)
    return accepted_lengths(dev_ids, dev_toks)
