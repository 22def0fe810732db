"""The DFlash drafter: fc + hidden_norm over concatenated target taps, Qwen3-style layers whose
attention runs over [cached context K/V | the block] (bidirectional, or per layer causal and/or a
sliding window: DraftSpec.layer_masks), and a final norm; DFlash2 adds convolutions around each
sublayer and a candidate selector (models/dflash2.py). Embeddings and lm_head are the target's
unless the checkpoint (speculators format) ships its own."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashdraft.attention.base import AttentionBackend, AttentionBatch, layer_backend
from flashdraft.kernels.dispatch import fused_enabled
from flashdraft.models.dflash2 import CandidateSelector, ConvDecoderLayer
from flashdraft.models.layers import Embedding, Linear, RMSNorm, linear
from flashdraft.models.rope import RotaryTable, apply_rope
from flashdraft.models.transformer import DecoderLayer, forward_layers_fused, load_packed, step_slots
from flashdraft.speculative.formats import DraftSpec

# tensors some checkpoints carry that serving does not use
_IGNORED = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")


class DFlashDraftModel(nn.Module):
    def __init__(self, spec: DraftSpec, has_embed: bool = False, has_lm_head: bool = False):
        super().__init__()
        cfg = spec.layer_config
        self.spec = spec
        self.config = cfg
        h = cfg.hidden_size
        self.fc = Linear(len(spec.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        bias = bool(getattr(cfg, "attention_bias", False))  # the reference's q/k/v and o projections alike
        if spec.conv is None:
            make = lambda: DecoderLayer(cfg, qk_norm=True, bias=bias, o_bias=bias)  # noqa: E731
        else:  # DFlash2
            make = lambda: ConvDecoderLayer(cfg, True, bias, bias, *spec.conv, spec.block_size)  # noqa: E731
        self.layers = nn.ModuleList(make() for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.candidate_selector = None
        if spec.selector is not None:
            self.candidate_selector = CandidateSelector(cfg.vocab_size, h, *spec.selector)
        vocab = spec.draft_vocab_size or cfg.vocab_size
        self.embed_tokens = Embedding(cfg.vocab_size, h) if has_embed else None
        self.lm_head = nn.Linear(h, vocab, bias=False) if has_lm_head else None
        self.register_buffer("d2t", torch.zeros(vocab, dtype=torch.long) if spec.draft_vocab_size else None)
        self.rope: RotaryTable | None = None
        self._ctx_kv_weight: torch.Tensor | None = None

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def setup(self, max_len: int) -> None:
        p = self.fc.weight
        self.rope = RotaryTable(self.config, self.head_dim, max_len, p.device, p.dtype)
        # every layer's k and v rows stacked: one GEMM projects the context for all layers
        att = [layer.self_attn for layer in self.layers]
        self._ctx_kv_weight = torch.cat([a.qkv_proj.weight[a.q_size:] for a in att], 0)
        biases = [a.qkv_proj.bias[a.q_size:] for a in att if a.qkv_proj.bias is not None]
        self._ctx_kv_bias = torch.cat(biases) if biases else None
        self._ctx_k_norm_weight = torch.stack([a.k_norm.weight for a in att])  # [L, D], the fused context write

    def load(self, weights: dict[str, torch.Tensor]) -> None:
        weights = {k.removeprefix("model."): w for k, w in weights.items() if k not in _IGNORED}
        # z-lab files store the selector's codebooks bare, some speculators versions as Embedding weights
        weights = {k.removesuffix(".weight") if "_codebook." in k else k: w for k, w in weights.items()}
        load_packed(self, weights)

    def write_context(self, taps: torch.Tensor, positions: torch.Tensor, kv_cache, attn: AttentionBackend,
                      batch: AttentionBatch) -> None:
        """Context K/V for committed positions: K = rope(k_norm(k_proj(f))), V = v_proj(f) with
        f = hidden_norm(fc(taps)), for every layer, stored at batch.slot_mapping."""
        if fused_enabled(taps):
            from flashdraft.kernels import layer_ops

            f, _ = layer_ops.add_rmsnorm(self.fc(taps), None, self.hidden_norm.weight, self.hidden_norm.eps)
            kv = linear(f, self._ctx_kv_weight, self._ctx_kv_bias)
            layer_ops.context_kv_store(kv, positions, self.rope.cos, self.rope.sin, self._ctx_k_norm_weight,
                                       self.layers[0].self_attn.k_norm.eps, kv_cache, step_slots(attn, batch))
            return
        f = self.hidden_norm(self.fc(taps))
        kv = F.linear(f, self._ctx_kv_weight, self._ctx_kv_bias)
        cos, sin = self.rope.lookup(positions)
        per_layer = kv.split(2 * self.layers[0].self_attn.kv_size, dim=-1)
        for i, (layer, chunk) in enumerate(zip(self.layers, per_layer)):
            a = layer.self_attn
            k, v = chunk.view(-1, 2 * a.n_kv, a.head_dim).split(a.n_kv, dim=1)
            k = apply_rope(a.k_norm(k), cos, sin)
            attn.store_kv(kv_cache[i][0], kv_cache[i][1], k, v.contiguous(), batch)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, kv_cache, attn: AttentionBackend,
                batch: AttentionBatch) -> torch.Tensor:
        """Draft blocks (rows: whole blocks of block_size; attn a LayerMasks when the layers' masks
        differ): the block's K/V are written to scratch slots past the committed context, which the
        next context write overwrites; nothing of it is kept. embeds: the target's embeddings of the
        block tokens (times input_embedding_scale here)."""
        if self.spec.input_embedding_scale != 1.0:
            embeds = embeds * self.spec.input_embedding_scale
        if fused_enabled(embeds):
            return forward_layers_fused(self.layers, embeds, positions, self.rope, kv_cache, attn, batch, self.norm)[0]
        cos, sin = self.rope.lookup(positions)
        h = embeds
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i][0], kv_cache[i][1], layer_backend(attn, i), batch)
        return self.norm(h)
