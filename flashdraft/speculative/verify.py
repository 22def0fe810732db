"""The acceptance rule. Draft d_i (i = 1..k) is accepted iff every earlier draft was and d_i equals
the target's token chosen at verify slot i-1 (argmax at T=0, the seeded Gumbel sample at T>0:
rejection sampling with a one-hot draft distribution, hence exact). The request commits
t_0..t_a: the a accepted drafts (equal to t_0..t_{a-1}) plus the target's own token t_a. The target's
tokens are chosen by the same sampler as plain decoding (target_tokens), with the same processors and
the same (seed, position) noise, so the committed tokens are plain decoding's."""

from __future__ import annotations

import torch

from flashdraft.engine.graphs import to_device
from flashdraft.engine.logits import Seen, StepLogprobs, choose, prompt_logprobs
from flashdraft.engine.pipeline import StepContext
from flashdraft.kernels.dispatch import fused_enabled
from flashdraft.speculative.plan import Plan


def accepted_lengths(drafts: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """drafts [S, k], target [S, k+1] -> a [S]: number of leading drafts that match. On the
    fused GPU path one Triton kernel (token_ops.accepted_lengths), else four torch ops."""
    if drafts.numel() and fused_enabled(drafts):
        from flashdraft.kernels import token_ops

        return token_ops.accepted_lengths(drafts, target)
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


def accept_plans(plans: list[Plan], ids: torch.Tensor | None, toks: torch.Tensor) -> torch.Tensor | None:
    """Accepted drafts of each verifying request, [V] on the device: the leading verify inputs
    (the drafts the target was fed) equal to the target's token one slot earlier."""
    verifying = [p for p in plans if p.verify]
    if not verifying:
        return None
    if len(verifying) == len(plans) and all(p.n == plans[0].n for p in plans):  # rows [S, n], all sampled
        n = plans[0].n
        return accepted_lengths(ids[: len(plans) * n].view(-1, n)[:, 1:], toks.view(-1, n))
    rows, first = [], 0  # ragged: (first draft row in ids, first target token in toks, drafts) each
    for p in plans:
        if p.verify:
            rows.append((p.row + 1, first, p.n - 1))
        first += p.n if p.verify else int(p.seq.num_computed_tokens + p.n == p.seq.num_tokens)
    return ragged_accepted_lengths(ids, toks, rows)


def target_tokens(ctx: StepContext, plans: list[Plan], hidden: torch.Tensor, row_positions: torch.Tensor | None = None,
                  ids: torch.Tensor | None = None, tree_masks: torch.Tensor | None = None, checked=None
                  ) -> tuple[torch.Tensor | None, list[int], StepLogprobs | None]:
    """The target's tokens on the device (every verify slot of a verifying request, the last row of
    other requests that reach their end), the plan index of each, and their raw log-probabilities when
    a request asks for them (engine/logits.py), chosen as plain decoding chooses them. row_positions:
    every row's position on the device (token trees: a row's token is drawn for its position + 1).
    ids, tree_masks: every row's input id and (trees) ancestor mask on the device, for the processors
    of a verify row, which count the drafts on its path as output. checked: requests whose grammar is
    not applied here (grammar_check.py checks their tokens before the commit)."""
    model = ctx.runner.model
    rows, seqs, positions, owner = [], [], [], []
    seen = Seen([], [], ids, [] if tree_masks is not None else None)
    for i, p in enumerate(plans):
        s, start = p.seq, p.seq.num_computed_tokens
        if s.prompt_logprobs is not None and not p.verify:
            prompt_logprobs(model, hidden[p.row: p.row + p.n], s, start)
        if p.verify:
            width = p.n
            if s.params.penalizes or (s.params.constrained and not (checked and checked(s))):
                if ids is None:  # (every path that verifies a penalized request passes them)
                    raise RuntimeError("a penalized or constrained request's verify rows need the step's input ids")
                for j in range(p.n):  # row j counts the drafts of rows 1..j (a tree: of its ancestors)
                    for d in range(1, p.n if tree_masks is not None else j + 1):
                        seen.rows.append(len(rows) + j)
                        seen.src.append(p.row + d)
                        if tree_masks is not None:
                            seen.weights.append((p.row + j, d))
        elif start + p.n == s.num_tokens:
            width = 1
        else:
            continue  # a prefill chunk that does not reach the end samples nothing
        first = p.row + p.n - width
        rows.extend(range(first, first + width))
        positions.extend(range(start + p.n - width + 1, start + p.n + 1))
        seqs.extend([s] * width)
        owner.extend([i] * width)
    if not rows:
        return None, owner, None
    sb = ctx.runner.sampling_batch(seqs, positions)
    if len(rows) < hidden.shape[0]:  # rows ascend: as many as hidden has means all of them
        picked = to_device(rows, torch.long, ctx.device)
        hidden = hidden[picked]
    else:
        picked = slice(None)
    drawn_at: list[int] | torch.Tensor = positions
    if row_positions is not None:
        drawn_at = row_positions[picked][: len(rows)] + 1
        if not sb.all_greedy:
            sb.positions = drawn_at
    if seen.weights:  # each tree pair counts where the row's ancestor mask has the draft row's bit
        at = to_device([list(x) for x in zip(*seen.weights)], torch.long, ctx.device)
        seen.weights = tree_masks[at[0]].bitwise_right_shift(at[1]).bitwise_and(1)
    toks, logprobs = choose(model, hidden, seqs, drawn_at, sb, ctx.eos_token_ids, seen if seen.rows else None,
                            checked)
    return toks, owner, logprobs
