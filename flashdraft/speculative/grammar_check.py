"""Greedy constrained requests verified unmasked, their tokens checked through the grammar afterwards.

A request that decodes greedily and whose only logits processor is its grammar (SamplingParams.grammar_only)
takes, in plain decoding, the argmax among the tokens its grammar allows. Where the grammar allows the
plain argmax, that is the token. So such a request verifies like an unconstrained greedy one: drafts from
the drafter, the verify and its acceptance in the step graphs, nothing filled on the host while the step
runs. Before the commit the host takes the tokens the step would commit (the accepted drafts, then the
target's token) through the request's matcher. At the first one the grammar forbids, say at verify row j,
the row's masked argmax replaces it and the rows past it are dropped: the draft after row j was that
forbidden token (it equals the target's unmasked token there), so plain decoding's acceptance ends at row
j too. The committed tokens are plain decoding's; a step pays one mask fill and one device read per such
row, none when the grammar allows every token (most steps: the drafter follows the target's format).

Drafts are not walked through the grammar (grammar_drafts.py) for such requests: the walk reads the drafts
on the host between the draft and the verify, and fills a mask per slot, which cost more than the walk's
higher acceptance gave (docs/performance.md section 9). Token trees keep their masked verify."""

from __future__ import annotations

import time

import torch

from flashdraft import settings
from flashdraft.engine.graphs import to_device
from flashdraft.engine.sampler import greedy_tokens
from flashdraft.engine.sequence import Sequence
from flashdraft.speculative.plan import Committed, Plan


def checked(seq: Sequence) -> bool:
    """Whether this request's verify rows go unmasked and its tokens are checked before the commit."""
    g = seq.grammar
    return settings.GRAMMAR_CHECK and g is not None and g.error is None and seq.params.grammar_only


def check_outcome(model, plans: list[Plan], out: Committed, hidden: torch.Tensor) -> Committed:
    """The outcome `out` of a step over `plans` (hidden: the target's final hidden states of its rows, each
    plan's from p.row) with every checked request's tokens made plain decoding's: its committed run cut at
    the first token its grammar forbids, that token replaced by the row's masked argmax. Changes `out`
    in place and returns it; every matcher ends where it began."""
    import xgrammar as xgr  # (a constrained request made the engine import it)

    verifying = {i: v for v, i in enumerate(i for i, p in enumerate(plans) if p.verify)}
    bad = []  # (plan index, index of its first forbidden token, its row, the mask row filled for it)
    masks = None
    for i, p in enumerate(plans):
        s = p.seq
        if i not in out.chosen or s.is_finished or not checked(s):
            continue
        started = time.perf_counter()
        toks = out.chosen[i][: out.accepted[verifying[i]] + 1] if p.verify else out.chosen[i]
        m, taken = s.grammar.matcher, 0
        try:
            for t in toks:
                if m.is_terminated():  # (its stop token was taken: the commit ends the request there)
                    break
                if not m.accept_token(t):
                    if masks is None:
                        masks = xgr.allocate_token_bitmask(len(plans), s.grammar.vocab_size)
                    m.fill_next_token_bitmask(masks, len(bad))
                    first = p.row + p.n - len(out.chosen[i])  # the row that chose out.chosen[i][0]
                    bad.append((i, taken, first + taken))
                    break
                taken += 1
        except Exception as e:  # (xgrammar's own failure: this request's, not the step's)
            s.grammar.fail(f"the grammar failed: {e}")
        if taken and s.grammar.error is None:
            m.rollback(taken)
        s.grammar.mask_s += time.perf_counter() - started
    if not bad:
        return out
    rows = to_device([r for _, _, r in bad], torch.long, hidden.device)
    logits = model.compute_logits(hidden.index_select(0, rows), float32=False)
    xgr.apply_token_bitmask_inplace(logits, masks[: len(bad)].to(logits.device), vocab_size=logits.shape[1])
    for (i, j, _), tok in zip(bad, greedy_tokens(logits).tolist()):
        out.chosen[i] = out.chosen[i][:j] + [tok]
        if plans[i].verify:
            out.accepted[verifying[i]] = j
    return out
