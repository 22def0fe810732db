"""Grammar masks at the rows that choose a target token (engine/logits.py `process` calls them).

A row's mask is the one plain decoding would apply at its position: the request's matcher holds the state
after its committed output, and a verify row's drafts before it (a chain's earlier rows, a tree's
ancestors, from `Seen`) are walked through the matcher first, then rolled back. A draft the grammar
forbids cannot be the target's token at the row before it, so acceptance ends there; the rows past it
are never committed, and take the mask after the last allowed draft."""

from __future__ import annotations

import time

import torch

from flashdraft.structured.walk import fill_masks


def apply_grammars(logits: torch.Tensor, seqs: list, rows: list[int], seen) -> None:
    """Mask logits [R, V] in place at `rows` (each a row of a request with a grammar), row r of seqs[r]."""
    import xgrammar as xgr  # (only requests with a grammar reach here: grammar.py imported it)

    started = time.perf_counter()
    paths: dict[int, list[int]] = {}  # logits row -> indices into the step's input ids, in path order
    if seen is not None:
        # a tree's pairs count where the row's ancestor mask holds the draft (nodes sorted by depth: a
        # row's ancestors come in path order)
        on = seen.weights.tolist() if isinstance(seen.weights, torch.Tensor) else [1] * len(seen.rows)
        for r, src, w in zip(seen.rows, seen.src, on):
            if w:
                paths.setdefault(r, []).append(src)
    wanted = sorted({i for r in rows for i in paths.get(r, ())})
    tokens = dict(zip(wanted, seen.ids[torch.tensor(wanted, dtype=torch.long, device=seen.ids.device)].tolist())) \
        if wanted else {}
    mask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    # each request's rows in order; round t walks every request to its t-th row's path, then one batched
    # fill takes every request's row at once (a row its drafts' walk already filled is copied instead)
    todo: dict[int, list[tuple[int, list[int]]]] = {}
    for k, r in enumerate(rows):
        s = seqs[r]
        path = [tokens[i] for i in paths.get(r, [])]
        hit = s.grammar.lookahead.mask(path) if s.grammar.lookahead is not None and s.grammar.error is None else None
        if hit is not None:
            mask[k] = hit
        elif s.grammar.error is not None:
            mask[k] = -1  # (a failed grammar masks nothing; its request ends at its commit)
        else:
            todo.setdefault(id(s), []).append((k, path))
    owners = {id(seqs[r]): seqs[r] for r in rows}
    walked: dict[int, list[int]] = {}  # request -> the drafts its matcher holds past the committed output
    for t in range(max((len(v) for v in todo.values()), default=0)):
        group, at = [], []
        for sid, items in todo.items():
            if t >= len(items) or owners[sid].grammar.error is not None:
                continue
            k, path = items[t]
            g = owners[sid].grammar
            try:
                walked[sid] = _walk(g.matcher, walked.get(sid, []), path)
                if g.matcher.is_terminated():  # (its path took the stop token: the row is past the request's end)
                    mask[k] = -1
                    continue
            except Exception as e:  # (this request's grammar failed: it ends, the step goes on)
                g.fail(f"the grammar failed: {e}")
                mask[k] = -1
                continue
            group.append(g)
            at.append(k)
        fill_masks(group, mask, at)
    for sid, s in owners.items():
        held = walked.get(sid, [])
        if held and s.grammar.error is None:
            s.grammar.matcher.rollback(len(held))
        s.grammar.lookahead = None  # (taken: the commit moves the matcher on)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)  # (its rows only: others pay nothing)
    sub = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(sub, mask.to(logits.device), vocab_size=sub.shape[1])
    logits.index_copy_(0, index, sub)
    share = (time.perf_counter() - started) / len(owners)
    for s in owners.values():
        s.grammar.mask_s += share


def _walk(m, held: list[int], path: list[int]) -> list[int]:
    """Move matcher m from holding the drafts `held` to holding the longest prefix of `path` it accepts: back
    to their common prefix, then forward (a chain's next row extends its last; a tree's may branch). A
    draft the grammar forbids ends the walk there: no row past it is ever committed."""
    common = 0
    while common < min(len(held), len(path)) and held[common] == path[common]:
        common += 1
    if len(held) > common:
        m.rollback(len(held) - common)
    held = held[:common]
    for t in path[common:]:
        if m.is_terminated() or not m.accept_token(t):  # (past a stop token nothing is taken)
            break
        held.append(t)
    return held
