"""Drafts a request's grammar allows, and the masks of its verify rows, in one walk.

A constrained request's draft at slot j is the drafter's best candidate that the grammar allows after the
drafts before it (the drafter ranks its candidates: the argmax first, or a sampled request's draw). The
walk goes slot by slot over every constrained request of the step at once: each matcher's mask at the
slot, then each matcher takes its request's draft. The mask filled at slot j is the one plain decoding
applies after the first j drafts: the verify row j's mask, kept for the verify (`Lookahead`) so its rows
cost no second fill. The walk of a request ends where none of its candidates is allowed or the grammar
has ended; that slot keeps the drafter's own token, which the verify rejects (its row's mask forbids it),
as it rejects any draft the target does not choose. Drafts never change what is committed, only how much
of it one verify commits."""

from __future__ import annotations

import time

import numpy as np
import torch

from flashdraft.structured.grammar import Lookahead, RequestGrammar


def fill_masks(grammars: list[RequestGrammar], mask: torch.Tensor, rows: list[int]) -> None:
    """Fill mask[rows[i]] from grammars[i]'s matcher state; a matcher that fails there fails its request
    alone (its row masks nothing: the request ends at its commit). One matcher after another: a fill
    takes 1-35 us (the structured bench's JSON schemas, SmolLM2's 49,152 tokens, 2-core x86_64), while
    xgrammar's threaded batch fill took 1.1 ms a call of up to 8 matchers on the 16-core H200 machine."""
    for g, r in zip(grammars, rows):
        try:
            g.matcher.fill_next_token_bitmask(mask, r)
        except Exception as e:
            g.fail(f"the grammar failed: {e}")
            mask[r] = -1


def walk_drafts(grammars: list[RequestGrammar], candidates: list[list[list[int]]]) -> list[list[int]]:
    """candidates[r][j]: the drafter's ranked candidates for request r's draft slot j (j < J) -> each
    request's J drafts, its first allowed candidate at every slot its walk reaches. Each grammar keeps a
    Lookahead for its verify rows; every matcher ends where it started."""
    import xgrammar as xgr

    started = time.perf_counter()
    R, J = len(grammars), len(candidates[0]) if candidates else 0
    vocab_size = grammars[0].vocab_size if grammars else 0
    masks = xgr.allocate_token_bitmask(R * (J + 1), vocab_size)  # row r * (J + 1) + j: request r after j drafts
    bits = masks.numpy().view(np.uint32)
    drafts = [[slot[0] for slot in c] for c in candidates]  # (past a walk's end: the drafter's own tokens)
    taken: list[list[int]] = [[] for _ in range(R)]
    refused: list[int | None] = [None] * R
    live = [r for r in range(R) if grammars[r].error is None]
    for j in range(J + 1):
        ended = [r for r in live if grammars[r].matcher.is_terminated()]
        for r in ended:  # (its stop token taken: the rows past it are past the request's end)
            masks[r * (J + 1) + j] = -1
        live = [r for r in live if r not in ended]
        fill_masks([grammars[r] for r in live], masks, [r * (J + 1) + j for r in live])
        live = [r for r in live if grammars[r].error is None]
        if j == J:
            break
        going = []
        for r in live:
            row = bits[r * (J + 1) + j]
            tok = next((t for t in candidates[r][j] if 0 <= t < vocab_size and row[t >> 5] >> (t & 31) & 1), None)
            if tok is None:  # no candidate allowed: the walk ends, the verify rejects this slot's draft
                refused[r] = drafts[r][j]
            else:
                drafts[r][j] = tok
                going.append(r)
        ok = _accept([grammars[r] for r in going], [drafts[r][j] for r in going])
        for r, took in zip(going, ok):
            if took:
                taken[r].append(drafts[r][j])
            else:
                refused[r] = drafts[r][j]
        live = [r for r, took in zip(going, ok) if took]
    share = (time.perf_counter() - started) / max(R, 1)
    for r, g in enumerate(grammars):
        if taken[r] and g.error is None:
            g.matcher.rollback(len(taken[r]))
        g.lookahead = Lookahead(taken[r], refused[r], masks[r * (J + 1): r * (J + 1) + len(taken[r]) + 1], drafts[r])
        g.mask_s += share
    return drafts


def _accept(grammars: list[RequestGrammar], tokens: list[int]) -> list[bool]:
    out = []
    for g, t in zip(grammars, tokens):
        try:
            out.append(bool(g.matcher.accept_token(t)))
        except Exception as e:
            g.fail(f"the grammar failed: {e}")
            out.append(False)
    return out
