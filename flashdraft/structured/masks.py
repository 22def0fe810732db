"""Grammar masks at the rows that choose a target token (engine/logits.py `process` calls them).

A row's mask is the one plain decoding would apply at its position: the request's matcher holds the state
after its committed output, and a verify row's drafts before it (a chain's earlier rows, a tree's
ancestors, from `Seen`) are walked through the matcher first, then rolled back. A draft the grammar
forbids cannot be the target's token at the row before it, so acceptance ends there; the rows past it
are never committed, and take the mask after the last allowed draft."""

from __future__ import annotations

import time

import torch

from flashdraft.engine.graphs import to_device
from flashdraft.structured.walk import fill_masks


def apply_grammars(logits: torch.Tensor, seqs: list, rows: list[int], seen) -> None:
    """Mask logits [R, V] in place at `rows` (each a row of a request with a grammar), row r of seqs[r].
    Nothing here waits for the device when every path's drafts are known on the host (a chain whose drafts
    the walk chose: `Lookahead.drafts`): the masks are built while the GPU runs the verify, and uploaded
    from pinned memory."""
    import xgrammar as xgr  # (only requests with a grammar reach here: grammar.py imported it)

    paths: dict[int, list[int]] = {}  # logits row -> indices into the step's input ids, in path order
    if seen is not None:
        # a tree's pairs count where the row's ancestor mask holds the draft (nodes sorted by depth: a
        # row's ancestors come in path order)
        on = seen.weights.tolist() if isinstance(seen.weights, torch.Tensor) else [1] * len(seen.rows)
        for r, src, w in zip(seen.rows, seen.src, on):
            if w:
                paths.setdefault(r, []).append(src)
    chain = seen is None or seen.weights is None
    known = {r: seqs[r].grammar.lookahead.drafts for r in rows
             if chain and seqs[r].grammar.lookahead is not None}  # a chain row's path: its first drafts
    wanted = sorted({i for r in rows if r not in known for i in paths.get(r, ())})
    tokens = dict(zip(wanted, seen.ids[to_device(wanted, torch.long, seen.ids.device)].tolist())) if wanted else {}
    started = time.perf_counter()  # (the host's share: after the drafts are read, before the upload)
    pinned = logits.device.type == "cuda"
    mask = torch.empty(len(rows), xgr.get_bitmask_shape(1, logits.shape[1])[1], dtype=torch.int32,
                       pin_memory=pinned)
    # a row its drafts' walk already filled (walk.py) is copied; the others walk their request's matcher
    owners = {id(seqs[r]): seqs[r] for r in rows}
    walked: dict[int, list[int]] = {}  # request -> the drafts its matcher holds past the committed output
    for k, r in enumerate(rows):
        g = seqs[r].grammar
        n = len(paths.get(r, ()))
        path = known[r][:n] if r in known else [tokens[i] for i in paths.get(r, [])]
        hit = g.lookahead.mask(path) if g.lookahead is not None and g.error is None else None
        if hit is not None:
            mask[k] = hit
            continue
        if g.error is None:
            try:
                walked[id(seqs[r])] = _walk(g.matcher, walked.get(id(seqs[r]), []), path)
                if not g.matcher.is_terminated():  # (past its stop token the row is past the request's end)
                    fill_masks([g], mask, [k])
                    continue
            except Exception as e:  # (this request's grammar failed: it ends, the step goes on)
                g.fail(f"the grammar failed: {e}")
        mask[k] = -1  # (a failed grammar masks nothing; its request ends at its commit)
    for sid, s in owners.items():
        held = walked.get(sid, [])
        if held and s.grammar.error is None:
            s.grammar.matcher.rollback(len(held))
        s.grammar.lookahead = None  # (taken: the commit moves the matcher on)
    share = (time.perf_counter() - started) / len(owners)
    index = to_device(rows, torch.long, logits.device)  # (its rows only: others pay nothing)
    sub = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(sub, mask.to(logits.device, non_blocking=pinned), vocab_size=sub.shape[1])
    logits.index_copy_(0, index, sub)
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
