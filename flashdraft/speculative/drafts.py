"""Draft tokens from the drafter's final hidden states (a mixin of DFlashSpeculator).

Greedy requests draft each slot's argmax. Sampled requests draw each slot the way the target will
draw that position's token: argmax(logits / T + the noise of the request's (seed, position)) over
the drafter's most likely tokens (sampler.draw_drafts), so wherever the drafter's distribution
matches the target's the draft is the target's own sample (a Gumbel-max coupling). Which token is
proposed never changes what is committed: the verify keeps only drafts equal to the target's token.

A drafter without its own lm_head uses the target's; one with a reduced vocabulary maps its column
j to target token j + d2t[j] (speculators format). The logits are the reference's `compute_logits`:
times `output_multiplier`, then capped by `final_logit_softcapping`. A DFlash2 drafter's drafts come
from its candidate selector (models/dflash2.py): slot by slot, each slot's top-k re-scored given the
token chosen before it; sampled requests draw among them with the target's noise."""

from __future__ import annotations

import torch

from flashdraft.engine.sampler import draw_drafts, greedy_tokens, gumbel_noise
from flashdraft.engine.sequence import Sequence

# (temperature [S], seed [S], positions of the block rows [S * B]): how a step's sampled drafts are drawn
Draw = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DraftTokens:
    def _draws(self, seq: Sequence) -> bool:
        """Whether this request's drafts are drawn (sampled requests) rather than the argmax."""
        return self.draw_sampled and seq.params.temperature > 0

    def _slot_logits(self, rows: torch.Tensor, float32: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of draft slots [..., H] -> ([..., V'], the target token id of each column or None
        when column j is token j)."""
        head, d2t, spec = self.drafter.lm_head, self.drafter.d2t, self.drafter.spec
        token_ids = None
        if head is None:  # the target's head; float32=False keeps the model dtype (no f32 copy)
            logits = self.engine.runner.model.compute_logits(rows, float32=float32)
        else:
            logits = head(rows)
            logits = logits.float() if float32 else logits
            if d2t is not None:
                token_ids = torch.arange(logits.shape[-1], device=logits.device) + d2t
        if spec.output_multiplier != 1.0:
            logits = logits * spec.output_multiplier
        if spec.final_logit_softcapping is not None:
            cap = spec.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits, token_ids

    def _draft_tokens(self, hidden: torch.Tensor, num_seqs: int, draw: Draw | None = None,
                      blocks: torch.Tensor | None = None) -> torch.Tensor:
        """The drafter's final hidden [S * B, H] -> drafts of slots 1..B-1, [S, B-1]: the argmax, or
        with `draw` each slot drawn with the noise the target's sampler uses at that slot's position
        (temperature 0: argmax). blocks: the block input ids [>= S * B] (DFlash2's selector starts
        from each block's anchor). Nothing here reads a value back to the host (graph-safe)."""
        B = self.block_size
        hidden = hidden.view(num_seqs, B, -1)[:, 1:]
        if self.drafter.candidate_selector is not None:
            return self._select(hidden, blocks[: num_seqs * B].view(num_seqs, B)[:, 0], draw)
        if draw is None:
            logits, token_ids = self._slot_logits(hidden, float32=False)
            draft = greedy_tokens(logits)
            return draft if token_ids is None else token_ids[draft]
        temp, seeds, positions = draw
        logits, token_ids = self._slot_logits(hidden.reshape(-1, hidden.shape[-1]), float32=True)
        k = B - 1
        draft = draw_drafts(logits, temp[:num_seqs, None].expand(num_seqs, k).flatten(),
                            seeds[:num_seqs, None].expand(num_seqs, k).flatten(),
                            positions.view(num_seqs, B)[:, 1:].flatten(), token_ids).view(num_seqs, k)
        return draft if token_ids is None else token_ids[draft]

    def _select(self, hidden: torch.Tensor, anchors: torch.Tensor, draw: Draw | None) -> torch.Tensor:
        """DFlash2: hidden [S, B-1, H] of the draft slots, anchors [S] -> [S, B-1] drafts from the
        candidate selector. With `draw`, sampled requests take argmax(score / T + the target's noise for
        that position and candidate token): a draw from softmax(score / T) over the candidates, coupled
        to the target's own draw."""
        S, J = hidden.shape[:2]
        logits, _ = self._slot_logits(hidden, float32=draw is not None)
        if draw is None:
            return self.drafter.candidate_selector.select(logits, hidden, anchors)
        temp, seeds, positions = draw[0][:S], draw[1][:S], draw[2]
        slot_pos = positions[: S * (J + 1)].view(S, J + 1)[:, 1:]
        return self.drafter.candidate_selector.select(
            logits, hidden, anchors, temp, lambda j, cand: gumbel_noise(seeds, slot_pos[:, j], cand.shape[-1], cand))
