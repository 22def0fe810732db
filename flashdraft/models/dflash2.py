"""What DFlash2 adds to a DFlash drafter (z-lab `DFlash2DraftModel`): a grouped dynamic causal
convolution on each side of every layer's attention and MLP, and a candidate selector that
re-ranks the drafter's top-k tokens slot by slot.

Convolution (within each draft block, slot t of B; y[t - k] = 0 before the block's first slot):

    conv(y)[t, c] = sum_k (base[k, c] + D[t, k, c // group_size]) * y[t - k, c]

with one kernel projection of the sublayer's (normed) input giving D for both sides:
`x' = conv_in(x); out = conv_out(sublayer(x'))`. Selector, for draft slots j = 1..B-1 with the
drafter's logits u_j and final hidden h_j, the anchor (the block's first token) as the first
predecessor and each chosen token as the next one's:

    score_j[c] = u_j[c] + < pred[prev_j] * proj(h_j), succ[c] >   over the top_k candidates c of u_j

greedy slots take the best score; sampled slots draw from softmax(score / T) over the candidates
(flashdraft draws with the target's own noise for that position: sampler.draw_candidates' coupling).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from flashdraft.models.transformer import DecoderLayer


def grouped_causal_conv(y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block: int) -> torch.Tensor:
    """y [R, H] (R rows = whole blocks of `block` rows), delta [R, K, G], base [K, H] -> [R, H]."""
    R, H = y.shape
    K, G = base.shape[0], delta.shape[-1]
    slot = torch.arange(R, device=y.device) % block
    out = torch.zeros_like(y)
    for k in range(K):
        shifted = y if k == 0 else torch.cat([y.new_zeros(k, H), y[:-k]]) * (slot >= k)[:, None].to(y.dtype)
        dyn = delta[:, k, :].repeat_interleave(H // G, dim=1)  # [R, H]: each group's coefficient on its channels
        out = out + base[k].to(y.dtype) * shifted
        out = torch.addcmul(out, dyn, shifted)
    return out


class GroupedCausalConv(nn.Module):
    """A layer's convolutions around one sublayer: base kernels [2, K, H] (0: input side, 1: output
    side) and the projection of the sublayer's input to both sides' dynamic kernels."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int, block: int):
        super().__init__()
        self.kernel_size, self.groups, self.block = kernel_size, hidden // group_size, block
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The sublayer's input convolved, and the output side's dynamic kernel."""
        delta = self.kernel_projection(x).view(x.shape[0], 2, self.kernel_size, self.groups)
        return grouped_causal_conv(x, delta[:, 0], self.base_kernel[0], self.block), delta[:, 1]

    def finish(self, out: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return grouped_causal_conv(out, delta, self.base_kernel[1], self.block)


class ConvDecoderLayer(DecoderLayer):
    """A DFlash2 drafter layer: a DecoderLayer with a GroupedCausalConv around its attention and MLP."""

    def __init__(self, cfg, qk_norm: bool, bias: bool, o_bias: bool, kernel_size: int, group_size: int,
                 block: int):
        super().__init__(cfg, qk_norm, bias, o_bias)
        self.attention_conv = GroupedCausalConv(cfg.hidden_size, kernel_size, group_size, block)
        self.mlp_conv = GroupedCausalConv(cfg.hidden_size, kernel_size, group_size, block)

    def forward(self, h, cos, sin, k_cache, v_cache, attn, batch):
        x, delta = self.attention_conv.prepare(self.input_layernorm(h))
        h = h + self.attention_conv.finish(self.self_attn(x, cos, sin, k_cache, v_cache, attn, batch), delta)
        x, delta = self.mlp_conv.prepare(self.post_attention_layernorm(h))
        return h + self.mlp_conv.finish(self.mlp(x), delta)

    def forward_fused(self, x, residual, positions, rope, k_cache, v_cache, attn, batch):
        """As DecoderLayer.forward_fused (x: this layer's input_layernorm output), the convolutions
        between the fused kernels."""
        from flashdraft.kernels import layer_ops

        x, delta = self.attention_conv.prepare(x)
        a = self.self_attn.forward_fused(x, positions, rope, k_cache, v_cache, attn, batch)
        norm = self.post_attention_layernorm
        x, residual = layer_ops.add_rmsnorm(self.attention_conv.finish(a, delta), residual, norm.weight, norm.eps)
        x, delta = self.mlp_conv.prepare(x)
        return self.mlp_conv.finish(self.mlp.forward_fused(x), delta), residual


class CandidateSelector(nn.Module):
    def __init__(self, vocab: int, hidden: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab, rank))
        self.hidden_projection = nn.Linear(hidden, rank, bias=False)

    def candidates(self, logits: torch.Tensor, hidden: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """logits [S, J, V], hidden [S, J, H] of the draft slots -> (unary scores [S, J, k], candidate
        ids [S, J, k], projected hidden [S, J, r])."""
        unary, cand = logits.topk(min(self.top_k, logits.shape[-1]), dim=-1)
        return unary, cand, self.hidden_projection(hidden)

    def scores(self, unary: torch.Tensor, cand: torch.Tensor, proj: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        """One slot's candidate scores [S, k] given its predecessors prev [S]."""
        context = self.predecessor_codebook[prev] * proj.to(self.predecessor_codebook.dtype)  # [S, r]
        edge = (context[:, None, :] * self.successor_codebook[cand]).sum(-1)
        return unary + edge.to(unary.dtype)

    def select(self, logits: torch.Tensor, hidden: torch.Tensor, anchors: torch.Tensor,
               temperature: torch.Tensor | None = None,
               noise: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Drafts [S, J] for the draft slots' logits [S, J, V] and final hidden [S, J, H], slot by slot
        from anchors [S]: each slot's best candidate, or, for rows with temperature [S] > 0,
        argmax(score / T + noise(j, candidates [S, k])) (Gumbel noise: a draw from softmax(score / T)).
        Nothing here reads a value back to the host (graph-safe)."""
        unary, cand, proj = self.candidates(logits, hidden)
        prev, out = anchors, []
        for j in range(cand.shape[1]):
            score = self.scores(unary[:, j], cand[:, j], proj[:, j], prev)
            pick = score.argmax(-1)
            if temperature is not None:
                drawn = (score.float() / temperature.clamp_min(1e-6)[:, None] + noise(j, cand[:, j])).argmax(-1)
                pick = torch.where(temperature > 0, drawn, pick)
            prev = cand[:, j].gather(1, pick[:, None])[:, 0]
            out.append(prev)
        return torch.stack(out, 1)
