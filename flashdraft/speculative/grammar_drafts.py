"""Drafts of constrained requests, walked through their grammars (structured/walk.py): each slot's draft is
the drafter's best candidate the grammar allows after the slots before it, so a verify no longer ends at
the first draft the grammar forbids (a JSON key's quote, a tool call's brace). The candidates are each
slot's `CANDIDATES` best tokens by the drafter, ranked as the slot's draft is chosen (the argmax, or a
sampled request's draw: sampler.draw_candidates); one device->host read takes them. Chains only (a token
tree verifies its drafts unmasked, as do DFlash2's candidate selector and requests whose grammar failed);
settings.GRAMMAR_DRAFTS off: every request drafts as if unconstrained (A/B runs)."""

from __future__ import annotations

import torch

from flashdraft import settings
from flashdraft.engine.graphs import to_device
from flashdraft.engine.sampler import draw_candidates
from flashdraft.engine.sequence import Sequence
from flashdraft.speculative.drafts import DraftTokens
from flashdraft.speculative.grammar_check import checked
from flashdraft.structured.walk import walk_drafts

CANDIDATES = 32  # a slot's candidates the walk may take, best first


class GrammarDrafts:
    def __init__(self, drafts: DraftTokens):
        self.drafts = drafts

    @staticmethod
    def walks(seq: Sequence) -> bool:
        """Whether this request's drafts are walked through its grammar (not one whose tokens are checked
        after the verify: grammar_check.py)."""
        return settings.GRAMMAR_DRAFTS and seq.grammar is not None and seq.grammar.error is None and \
            not checked(seq)

    def walked(self, seqs: list[Sequence]) -> bool:
        """Whether any of these requests' drafts are walked through its grammar."""
        return any(self.walks(s) for s in seqs)

    def apply(self, seqs: list[Sequence], drafts: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """drafts [S, B-1] of seqs from the drafter's final hidden states [S * B, H] -> the same with each
        constrained request's row walked through its grammar."""
        idx = [i for i, s in enumerate(seqs) if self.walks(s)]
        B, H = self.drafts.block_size, hidden.shape[-1]
        dev = hidden.device
        rows = hidden[: len(seqs) * B].view(len(seqs), B, H)[to_device(idx, torch.long, dev), 1:].reshape(-1, H)
        sampled = [seqs[i] for i in idx if self.drafts.draws(seqs[i])]
        logits, token_ids = self.drafts.slot_logits(rows, float32=bool(sampled))
        kw = {}
        if sampled:  # (temperature 0 rows rank by the drafter's logits)
            k = B - 1
            rep = [seqs[i] for i in idx for _ in range(k)]
            kw = dict(temperature=to_device([float(s.params.temperature) if self.drafts.draws(s) else 0.0
                                             for s in rep], torch.float32, dev),
                      seeds=to_device([s.seed for s in rep], torch.int64, dev),
                      positions=to_device([seqs[i].num_tokens - 1 + j for i in idx for j in range(1, B)],
                                          torch.int64, dev),
                      token_ids=token_ids)
        _, cols = draw_candidates(logits, CANDIDATES, **kw)
        cand = cols if token_ids is None else token_ids[cols]
        walked = walk_drafts([seqs[i].grammar for i in idx], cand.view(len(idx), B - 1, -1).tolist())
        out = drafts.clone()
        out[to_device(idx, torch.long, dev)] = to_device(walked, torch.long, dev)
        return out
