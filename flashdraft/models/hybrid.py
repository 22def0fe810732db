"""Hybrid linear-attention targets: Qwen3-Next and Qwen3.5 (dense and MoE, text-only or the text model
of the composite config). Most layers are Gated DeltaNet (GDN) mixers with a recurrent state per
sequence; every `full_attention_interval`-th layer is gated full attention over the paged KV cache.
Read as transformers reads them:

- GDN (models/gdn.py, with its recurrent state per sequence): Qwen3-Next checkpoints pack q/k/v/z and
  b/a per key-head group (in_proj_qkvz, in_proj_ba); they are unpacked at load.
- Gated attention: q_proj gives each head its query and an output gate, q and k RMS-normed, partial
  rotary (`partial_rotary_factor` of head_dim), output times sigmoid(gate) before o_proj.
- Norms are zero-centred, (1 + w), computed in float32; the MLP is dense or a mixture of experts with
  a shared expert behind a sigmoid gate."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn as nn

from flashdraft.attention.base import AttentionBackend, AttentionBatch
from flashdraft.attention.kv_scales import scaled_output, store_and_attend
from flashdraft.kernels.dispatch import fused_enabled
from flashdraft.models.gdn import GatedDeltaNet, RecurrentState
from flashdraft.models.layers import MLP, Embedding, Linear, activation
from flashdraft.models.moe import MoE, is_moe_layer, stack_experts
from flashdraft.models.rope import RotaryTable, apply_rope
from flashdraft.models.transformer import DecoderLM, load_packed

HYBRID_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # packed in this order (GatedDeltaNet.in_proj)


def text_config(cfg):
    """The language model's config: the composite Qwen3.5 config keeps it under text_config."""
    return getattr(cfg, "text_config", None) or cfg


class OffsetRMSNorm(nn.Module):
    """x / RMS(x) * (1 + w), all in float32, cast back to x's dtype at the end (zero-centred weight)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class GatedAttention(nn.Module):
    def __init__(self, cfg, rotary_dim: int):
        super().__init__()
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.rotary_dim = rotary_dim
        self.scale = self.head_dim**-0.5
        bias = bool(getattr(cfg, "attention_bias", False))
        h = cfg.hidden_size
        # HF's q_proj (per head its query, then its gate), k_proj and v_proj packed (load_packed)
        self.kv_size = self.n_kv * self.head_dim
        self.splits = [2 * self.n_heads * self.head_dim, self.kv_size, self.kv_size]
        self.qkv_proj = Linear(h, sum(self.splits), bias=bias)
        self.o_proj = Linear(self.n_heads * self.head_dim, h, bias=bias)
        self.q_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = OffsetRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.kv_scale = (1.0, 1.0)  # FP8 pages' (k_scale, v_scale): attention/kv_scales.py

    def forward(self, x, positions, rope: RotaryTable, k_cache, v_cache, attn: AttentionBackend,
                batch: AttentionBatch, parts: bool = False):
        """parts: on the fused path o_proj's result may be split-K parts (transformer.linear)."""
        proj = self.qkv_proj(x)
        qg = proj[:, :self.splits[0]]
        gate = qg.reshape(-1, self.n_heads, 2 * self.head_dim)[..., self.head_dim:]
        if fused_enabled(x):  # one kernel for the (1 + w) q/k norms, the partial RoPE and the K/V store
            from flashdraft.kernels import layer_ops

            q = layer_ops.qk_norm_rope_store(proj, positions, rope.cos, rope.sin, self.q_norm.weight,
                                             self.k_norm.weight, self.q_norm.eps, k_cache, v_cache,
                                             batch.slot_mapping, gated=True, offset=True, kv_scale=self.kv_scale)
            o = scaled_output(attn.forward(q, k_cache, v_cache, batch, self.scale * self.kv_scale[0]), self.kv_scale)
            o = layer_ops.sigmoid_gate(o, gate)
            return self.o_proj(o.reshape(-1, self.n_heads * self.head_dim), parts=parts)
        _, k, v = proj.split(self.splits, dim=-1)
        q = qg.reshape(-1, self.n_heads, 2 * self.head_dim)[..., :self.head_dim]
        k = k.reshape(-1, self.n_kv, self.head_dim)
        q, k = self.q_norm(q), self.k_norm(k)
        v = v.reshape(-1, self.n_kv, self.head_dim)
        cos, sin = rope.lookup(positions)
        r = self.rotary_dim
        q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], -1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], -1)
        o = store_and_attend(attn, q.contiguous(), k, v, k_cache, v_cache, batch, self.scale, self.kv_scale)
        o = o * torch.sigmoid(gate)
        return self.o_proj(o.reshape(-1, self.n_heads * self.head_dim))


class SharedExpertMoE(MoE):
    """Routed experts plus a shared expert scaled by sigmoid(shared_expert_gate x)."""

    def __init__(self, cfg, act):
        super().__init__(cfg, act)
        if cfg.model_type == "qwen3_5_moe_text":  # Qwen3.5-MoE always renormalises its top-k
            self.norm_topk_prob = True
        self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, cfg.hidden_act)
        self.shared_expert_gate = Linear(cfg.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shared = torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return MoE._summed(self, super().forward(x) + shared)

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        shared = self.shared_expert.forward_fused(x)
        return MoE._summed(self, super().forward_fused(x) + torch.sigmoid(self.shared_expert_gate(x)) * shared)

    def _summed(self, out: torch.Tensor) -> torch.Tensor:
        """The routed experts' output as it is: under tensor parallelism each rank's part, summed over the
        ranks with the shared expert's part (forward), one all-reduce a layer."""
        return out


class HybridLayer(nn.Module):
    def __init__(self, cfg, i: int, rotary_dim: int):
        super().__init__()
        self.kind = cfg.layer_types[i]
        self.input_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.kind == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg, rotary_dim)
        self.post_attention_layernorm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if is_moe_layer(cfg, i):
            self.mlp = SharedExpertMoE(cfg, activation(cfg.hidden_act))
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, h, positions, rope, cache, attn, batch):
        x = self.input_layernorm(h)
        h = h + self.mixer(x, positions, rope, cache, attn, batch)
        x = self.post_attention_layernorm(h)
        return h + self.mlp(x)

    def forward_fused(self, y, h, positions, rope, cache, attn, batch):
        """The fused path: y the last layer's output, h its residual stream (None at the first layer);
        each residual add and (1 + w) norm in one kernel. Returns this layer's (output, residual)."""
        from flashdraft.kernels import layer_ops

        n1, n2 = self.input_layernorm, self.post_attention_layernorm
        x, h = layer_ops.add_rmsnorm(y, h, n1.weight, n1.eps, offset=True)
        x, h = layer_ops.add_rmsnorm(self.mixer(x, positions, rope, cache, attn, batch, parts=True), h, n2.weight,
                                 n2.eps, offset=True)
        if isinstance(self.mlp, MLP):
            return self.mlp.forward_fused(x, parts=True), h
        return self.mlp.forward_fused(x), h

    def mixer(self, x, positions, rope, cache, attn, batch, parts: bool = False):
        """parts: the output projection's result may be split-K parts, for an add_rmsnorm."""
        if self.kind == "linear_attention":
            return self.linear_attn(x, cache, batch, parts=parts)
        return self.self_attn(x, positions, rope, cache[0], cache[1], attn, batch, parts=parts)


def _joined(parts: dict[str, torch.Tensor]) -> torch.Tensor:
    """A GDN layer's in_proj: its four parts in IN_PROJ's order."""
    return torch.cat([parts[n] for n in IN_PROJ], 0)


class HybridLM(nn.Module):
    """The DecoderLM interface (models/transformer.py) for hybrid targets. kv_layers: the layers with
    K/V pages; the others are given their RecurrentState in place of (k, v) by the runner."""

    has_sinks = False

    def __init__(self, cfg):
        super().__init__()
        self.full_config = cfg
        cfg = text_config(cfg)
        self.config = cfg
        bad = sorted({t for t in cfg.layer_types if t not in ("linear_attention", "full_attention")})
        if bad:
            raise ValueError(f"layer_types {bad} are not supported (linear_attention, full_attention)")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        params = getattr(cfg, "rope_parameters", None) or {}
        factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
        self.rotary_dim = int(head_dim * factor)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i, self.rotary_dim) for i in range(cfg.num_hidden_layers))
        self.norm = OffsetRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False) or
                         getattr(self.full_config, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryTable | None = None
        self.kv_layers = [i for i, t in enumerate(cfg.layer_types) if t == "full_attention"]
        self.layer_masks = [(True, None)] * cfg.num_hidden_layers
        self.head_dim = head_dim
        self.tp = None  # tensor parallelism: this rank's TPGroup (models/parallel.py)
        self.tp_takes: dict = {}

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def recurrent_layers(self) -> list[int]:
        return [i for i, layer in enumerate(self.layers) if layer.kind == "linear_attention"]

    def state_bytes_per_seq(self, dtype: torch.dtype) -> int:
        return sum(self.layers[i].linear_attn.state_bytes(dtype) for i in self.recurrent_layers())

    def kept_bytes_per_row(self, dtype: torch.dtype) -> int:
        """Bytes a graphed verify row keeps for the commit (RecurrentState.kept_rows), all GDN layers."""
        size = torch.finfo(dtype).bits // 8
        return sum(size * (sum(g.splits) + g.conv_dim) for g in (self.layers[i].linear_attn
                                                                  for i in self.recurrent_layers()))

    def make_states(self, num_slots: int, device: torch.device, dtype: torch.dtype) -> dict[int, RecurrentState]:
        return {i: self.layers[i].linear_attn.make_state(num_slots, device, dtype) for i in self.recurrent_layers()}

    def kernels_on(self, x: torch.Tensor) -> bool:
        """Whether steps over activations like x run the GDN kernels (what CUDA graphs need)."""
        return all(self.layers[i].linear_attn.kernels(x) for i in self.recurrent_layers())

    def commit_states(self, states: dict[int, RecurrentState], rows: dict[int, int]) -> None:
        """rows: slot -> the accepted rows of its sequence's last (kept) step."""
        takes: dict = {}
        for i, state in states.items():
            self.layers[i].linear_attn.commit(state, rows, takes)

    def commit_pending(self, states: dict[int, RecurrentState], pending: dict, take: torch.Tensor) -> None:
        """Every GDN layer's commit kernels over a graphed verify's kept rows (`pending`: layer -> its
        PendingRows), each sequence taking take[s] rows: what ModelRunner captures as a commit graph."""
        for i, p in pending.items():
            self.layers[i].linear_attn.commit_kernels(states[i], p, take)

    def setup_rope(self, max_len: int) -> None:
        p = self.embed_tokens.weight
        self.rope = RotaryTable(self.config, self.rotary_dim, max_len, p.device, p.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache, attn: AttentionBackend,
                batch: AttentionBatch, tap_layers=()):
        h = self.embed_tokens(input_ids)
        taps: dict[int, torch.Tensor] = {}
        if fused_enabled(h):  # each layer's residual add folded into the next layer's first norm
            from flashdraft.kernels import layer_ops

            y, res = h, None
            for i, layer in enumerate(self.layers):
                y, res = layer.forward_fused(y, res, positions, self.rope, kv_cache[i], attn, batch)
                if i in tap_layers:
                    taps[i] = layer_ops.join_parts(y, res) + res
            out = layer_ops.add_rmsnorm(y, res, self.norm.weight, self.norm.eps, offset=True)[0]
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, positions, self.rope, kv_cache[i], attn, batch)
                if i in tap_layers:
                    taps[i] = h
            out = self.norm(h)
        if len(self.layers) - 1 in taps:  # HF's last hidden_states entry: the final-normed state
            taps[len(self.layers) - 1] = out
        return out, (torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None)

    compute_logits = DecoderLM.compute_logits

    def load_hf_state_dict(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF names: model.* (Qwen3-Next, Qwen3.5 text) or model.language_model.* (the composite
        Qwen3.5); the vision tower and the multi-token-prediction head are not used here and skipped.
        weights: a dict, or (name, tensor) pairs read one at a time (loader.stream_weights): a GDN layer's
        in_proj parts are joined, and a layer's experts stacked, as soon as they are all in."""
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        load_packed(self, stack_experts(self._renamed(pairs), getattr(self.config, "num_experts", None)))

    def _renamed(self, pairs: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors under this module's names, a GDN layer's four in_proj parts (Qwen3-Next's
        two packed ones unpacked) joined into its in_proj once all are in."""
        skip = {"lm_head.weight"} if self.tied else set()
        parts: dict[str, dict[str, torch.Tensor]] = {}
        for name, w in pairs:
            if name.startswith(("model.visual.", "mtp.", "model.mtp.")) or name in skip:
                continue
            name = name.removeprefix("model.language_model.").removeprefix("model.")
            p = name.split(".")
            if len(p) >= 4 and p[2] == "linear_attn" and p[3] in ("in_proj_qkvz", "in_proj_ba", *IN_PROJ):
                key = ".".join(p[:3]) + ".in_proj." + p[-1]
                got = self._unpack_next(".".join(p[:3]), p[3], w) if p[3] in ("in_proj_qkvz", "in_proj_ba") \
                    else {p[3]: w}
                parts.setdefault(key, {}).update(got)
                if set(parts[key]) == set(IN_PROJ):
                    got = w = None  # (held here, the parts would outlive their join until the next tensor)
                    yield key, _joined(parts.pop(key))
                continue
            yield name, w
        for key, have in parts.items():
            raise ValueError(f"checkpoint has only {sorted(have)} of {key.replace('in_proj', '/'.join(IN_PROJ))}")

    def _unpack_next(self, prefix: str, kind: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Qwen3-Next packs per key-head group [q, k, v, z] (in_proj_qkvz) and [b, a] (in_proj_ba)."""
        gdn = self.layers[int(prefix.split(".")[1])].linear_attn
        # the whole layer's heads (a tensor-parallel share's are fewer: models/parallel.py)
        hk, hv = getattr(gdn, "whole_heads", (gdn.heads_k, gdn.heads_v))
        dk, dv, rep = gdn.d_k, gdn.d_v, hv // hk
        if kind == "in_proj_ba":
            b, a = w.view(hk, 2 * rep, -1).split([rep, rep], dim=1)
            return {"in_proj_b": b.reshape(hv, -1), "in_proj_a": a.reshape(hv, -1)}
        q, k, v, z = w.view(hk, 2 * dk + 2 * rep * dv, -1).split([dk, dk, rep * dv, rep * dv], dim=1)
        qkv = torch.cat([q.reshape(hk * dk, -1), k.reshape(hk * dk, -1), v.reshape(hv * dv, -1)])
        return {"in_proj_qkv": qkv, "in_proj_z": z.reshape(hv * dv, -1)}
