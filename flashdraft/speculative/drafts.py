"""Draft blocks through the drafter, and draft tokens from its final hidden states.

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

from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.graphs import to_device
from flashdraft.engine.model_runner import ModelRunner
from flashdraft.engine.sampler import draw_candidates, draw_drafts, greedy_tokens, gumbel_noise
from flashdraft.engine.sequence import Sequence
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.speculative.context import DrafterContext
from flashdraft.speculative.tree import Trees, build_trees, use_kernels

# (temperature [S], seed [S], positions of the block rows [S * B]): how a step's sampled drafts are drawn
Draw = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


class DraftTokens:
    """The drafter's forward over draft blocks and its tokens. draw_sampled: sampled requests draw their
    drafts (settings.DRAW_SAMPLED; off, they draft the argmax too, for A/B runs)."""

    def __init__(self, drafter: DFlashDraftModel, runner: ModelRunner, context: DrafterContext,
                 draw_sampled: bool = True):
        self.drafter, self.runner, self.context, self.draw_sampled = drafter, runner, context, draw_sampled
        self.block_size = drafter.spec.block_size
        self.mask_token_id = drafter.spec.mask_token_id
        self.embed = drafter.embed_tokens or runner.model.embed_tokens

    def draws(self, seq: Sequence) -> bool:
        """Whether this request's drafts are drawn (sampled requests) rather than the argmax."""
        return self.draw_sampled and seq.params.temperature > 0

    def blocks(self, seqs: list[Sequence]) -> list[list[int]]:
        """Each request's draft block: its last committed token, then masks."""
        return [[s.token_ids[-1]] + [self.mask_token_id] * (self.block_size - 1) for s in seqs]

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The drafter over draft blocks (ids at positions, meta: their attention), after the context."""
        return self.drafter(self.embed(ids), positions, self.context.kv, self.context.attn, meta)

    def eager(self, seqs: list[Sequence], bm: BlockManager
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One eager non-causal drafter forward over each request's block: the final hidden states
        [S * B, H], the block ids and positions, and the block rows' cache slots (scratch)."""
        self.context.flush()
        ids, pos, batch = self.runner.build_batch(seqs, self.blocks(seqs), bm, causal=False)
        self.context.attn.prepare(batch, self.runner.device)
        return self.forward(ids, pos, batch)[: len(seqs) * self.block_size], ids, pos, batch.slot_mapping

    def draw_of(self, seqs: list[Sequence], positions: torch.Tensor) -> Draw | None:
        """How sampled requests' drafts are drawn (temperature 0 for the others); None when none is."""
        if not any(self.draws(s) for s in seqs):
            return None
        dev = self.runner.device
        return (to_device([float(s.params.temperature) if self.draws(s) else 0.0 for s in seqs], torch.float32, dev),
                to_device([s.seed for s in seqs], torch.int64, dev), positions[: len(seqs) * self.block_size])

    def slot_logits(self, rows: torch.Tensor, float32: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits of draft slots [..., H] -> ([..., V'], the target token id of each column or None
        when column j is token j)."""
        head, d2t, spec = self.drafter.lm_head, self.drafter.d2t, self.drafter.spec
        token_ids = None
        if head is None:  # the target's head; float32=False keeps the model dtype (no f32 copy)
            logits = self.runner.model.compute_logits(rows, float32=float32)
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

    def tokens(self, hidden: torch.Tensor, num_seqs: int, draw: Draw | None = None,
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
            logits, token_ids = self.slot_logits(hidden, float32=False)
            draft = greedy_tokens(logits)
            return draft if token_ids is None else token_ids[draft]
        temp, seeds, positions = draw
        logits, token_ids = self.slot_logits(hidden.reshape(-1, hidden.shape[-1]), float32=True)
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
        logits, _ = self.slot_logits(hidden, float32=draw is not None)
        if draw is None:
            return self.drafter.candidate_selector.select(logits, hidden, anchors)
        temp, seeds, positions = draw[0][:S], draw[1][:S], draw[2]
        slot_pos = positions[: S * (J + 1)].view(S, J + 1)[:, 1:]
        return self.drafter.candidate_selector.select(
            logits, hidden, anchors, temp, lambda j, cand: gumbel_noise(seeds, slot_pos[:, j], cand.shape[-1], cand))

    def trees(self, hidden: torch.Tensor, num_seqs: int, size: int, draw: Draw | None = None) -> Trees:
        """The drafter's final hidden [S * B, H] -> a tree of `size` drafts per request, from each
        slot's `size` best candidates; draw = (temperature [S], seed [S], positions of the block
        rows [S * B]) ranks sampled requests' candidates by the target's draw (sampler.draw_candidates).
        Nothing here reads a value back to the host (graph-safe)."""
        n, B, k = num_seqs, self.block_size, self.block_size - 1
        rows = hidden.view(n, B, -1)[:, 1:].reshape(n * k, -1)
        # greedy ranks by the drafter's own logits (the top-k kernel reads them in the model dtype)
        logits, token_ids = self.slot_logits(rows, float32=draw is not None)
        kw = {}
        if draw is not None:
            temp, seeds, positions = draw
            kw = dict(temperature=temp[:n].repeat_interleave(k), seeds=seeds[:n].repeat_interleave(k),
                      positions=positions[: n * B].view(n, B)[:, 1:].flatten(), token_ids=token_ids)
        logp, cols = draw_candidates(logits, size, **kw)
        cand = cols if token_ids is None else token_ids[cols]
        build = build_trees
        if use_kernels(logp):  # one kernel instead of ~70 small ones (GPU only: Triton)
            from flashdraft.kernels.tree_ops import build_trees as build
        return build(logp.view(n, k, -1), cand.view(n, k, -1), size)
