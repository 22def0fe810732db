"""Grammar masks at the rows that choose a target token (engine/logits.py `process` calls them).

A row's mask is the one plain decoding would apply at its position: the request's matcher holds the state
after its committed output, and a verify row's drafts before it (a chain's earlier rows, from `Seen`) are
walked through the matcher first, then rolled back. A draft the grammar forbids cannot be the target's
token at the row before it, so acceptance ends there; the rows past it are never committed, and take the
mask after the last allowed draft."""

from __future__ import annotations

import time

import torch


def apply_grammars(logits: torch.Tensor, seqs: list, rows: list[int], seen) -> None:
    """Mask logits [R, V] in place at `rows` (each a row of a request with a grammar), row r of seqs[r]."""
    import xgrammar as xgr  # (only requests with a grammar reach here: grammar.py imported it)

    started = time.perf_counter()
    paths: dict[int, list[int]] = {}  # logits row -> indices into the step's input ids, in path order
    if seen is not None:
        for r, src in zip(seen.rows, seen.src):
            paths.setdefault(r, []).append(src)
    wanted = sorted({i for r in rows for i in paths.get(r, ())})
    tokens = dict(zip(wanted, seen.ids[torch.tensor(wanted, dtype=torch.long, device=seen.ids.device)].tolist())) \
        if wanted else {}
    mask = xgr.allocate_token_bitmask(len(rows), logits.shape[1])
    walked: dict[int, int] = {}  # request -> drafts its matcher advanced over, rolled back at the end
    for k, r in enumerate(rows):  # a request's rows come in path order (each path extends the last)
        s = seqs[r]
        if s.grammar.error is None:
            try:
                walked[id(s)] = _walk(s.grammar.matcher, [tokens[i] for i in paths.get(r, [])],
                                      walked.get(id(s), 0), mask, k)
                continue
            except Exception as e:  # (this request's grammar failed: it ends, the step goes on)
                s.grammar.fail(f"the grammar failed: {e}")
        mask[k] = -1  # (a failed grammar masks nothing; its request ends at its commit)
    for s in {id(seqs[r]): seqs[r] for r in rows}.values():
        d = walked.get(id(s), 0)
        d = -d - 1 if d < 0 else d
        if d and s.grammar.error is None:
            s.grammar.matcher.rollback(d)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)  # (its rows only: others pay nothing)
    sub = logits.index_select(0, index)
    xgr.apply_token_bitmask_inplace(sub, mask.to(logits.device), vocab_size=sub.shape[1])
    logits.index_copy_(0, index, sub)
    owners = {id(seqs[r]): seqs[r].grammar for r in rows}
    share = (time.perf_counter() - started) / len(owners)
    for g in owners.values():
        g.mask_s += share


def _walk(m, path: list[int], done: int, mask: torch.Tensor, k: int) -> int:
    """Advance matcher m over the drafts of path not walked yet (done of them were, or -done - 1 when one
    was forbidden: the state stays there), then fill mask row k; the new count."""
    while 0 <= done < len(path):
        if not m.accept_token(path[done]):
            done = -done - 1  # (a forbidden draft: later rows keep this state)
            break
        done += 1
    m.fill_next_token_bitmask(mask, k)
    return done
