"""Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / GPT-OSS decoders over a paged KV cache. One class
serves them all: Qwen3 adds per-head q/k RMSNorm, Qwen2 q/k/v biases, the MoE families a mixture of
experts for the MLP (models/moe.py), GPT-OSS attention sinks; `attention_bias`, `mlp_bias`,
`hidden_act` and sliding-window layers (`sliding_window` with `layer_types`, as transformers derives
them from `use_sliding_window` / `max_window_layers`, or on every Mistral layer) are read from the
config, and fields flashdraft does not implement are refused (check_config). q/k/v and gate/up are
packed into one matmul each."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn as nn

from flashdraft.attention.base import AttentionBackend, AttentionBatch, layer_backend
from flashdraft.attention.kv_scales import scaled_output, store_and_attend
from flashdraft.kernels.dispatch import fused_enabled
from flashdraft.models.layers import MLP, Embedding, Linear, RMSNorm, activation, linear
from flashdraft.models.moe import GptOssMoE, MoE, gpt_oss_experts, is_moe_layer, stack_experts
from flashdraft.models.quant import scheme_of
from flashdraft.models.rope import RotaryTable, apply_rope

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "gpt_oss")

class Attention(nn.Module):
    def __init__(self, cfg, qk_norm: bool, bias: bool, o_bias: bool = False, sinks: bool = False):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        self.scale = self.head_dim**-0.5
        self.q_size, self.kv_size = self.n_heads * self.head_dim, self.n_kv * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.n_heads)) if sinks else None  # attention/base.py
        self.kv_scale = (1.0, 1.0)  # FP8 pages' (k_scale, v_scale): attention/kv_scales.py

    def forward(self, x, cos, sin, k_cache, v_cache, attn: AttentionBackend, batch: AttentionBatch):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.n_heads, self.head_dim)
        k = k.view(-1, self.n_kv, self.head_dim)
        v = v.view(-1, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = store_and_attend(attn, q, k, v, k_cache, v_cache, batch, self.scale, self.kv_scale, self.sinks)
        return self.o_proj(o.reshape(-1, self.q_size))

    def forward_fused(self, x, positions, rope: RotaryTable, k_cache, v_cache, attn: AttentionBackend, batch,
                      parts: bool = False):
        """One kernel for q/k norm, RoPE and the K/V store (the backend's store_kv is not called).
        parts: the o_proj's result may be split-K parts (see linear), for an add_rmsnorm."""
        from flashdraft.kernels import layer_ops

        norm = self.q_norm is not None
        q = layer_ops.qk_norm_rope_store(self.qkv_proj(x), positions, rope.cos, rope.sin,
                                         self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                                         self.q_norm.eps if norm else 0.0, k_cache, v_cache, step_slots(attn, batch),
                                         kv_scale=self.kv_scale)
        o = scaled_output(attn.forward(q, k_cache, v_cache, batch, self.scale * self.kv_scale[0], self.sinks),
                          self.kv_scale)
        return self.o_proj(o.reshape(-1, self.q_size), parts=parts)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, qk_norm: bool, bias: bool, o_bias: bool = False, index: int | None = None,
                 sinks: bool = False):
        """index: the layer's place in a target, which decides whether its MLP is a mixture of experts."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, qk_norm, bias, o_bias, sinks)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        act = getattr(cfg, "hidden_act", "silu") or "silu"
        if getattr(cfg, "model_type", None) == "gpt_oss":
            self.mlp = GptOssMoE(cfg)
        elif index is not None and is_moe_layer(cfg, index):
            self.mlp = MoE(cfg, activation(act))
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, act, bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, h, cos, sin, k_cache, v_cache, attn, batch):
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, attn, batch)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_fused(self, x, residual, positions, rope, k_cache, v_cache, attn, batch):
        """x: this layer's input_layernorm output; residual: the stream it was taken from. Returns
        (mlp output, residual): the layer's output is their sum, which the next add_rmsnorm forms (the
        mlp output may be parts it adds first: a split-K GEMM's, a MoE's experts')."""
        from flashdraft.kernels import layer_ops

        a = self.self_attn.forward_fused(x, positions, rope, k_cache, v_cache, attn, batch, parts=True)
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, MoE):  # its k expert outputs, summed by the next add_rmsnorm
            return self.mlp.norm_forward_fused(a, residual, norm)
        x, residual = layer_ops.add_rmsnorm(a, residual, norm.weight, norm.eps)
        return self.mlp.forward_fused(x, parts=True), residual


def step_slots(attn: AttentionBackend, batch) -> torch.Tensor:
    """The cache slots of this step's rows: the batch's (AttentionBatch or DeviceMeta), or the
    backend's installed meta's when batch is None."""
    return (batch if batch is not None else attn.meta).slot_mapping


def forward_layers_fused(layers, h, positions, rope: RotaryTable, kv_cache, attn, batch, final_norm: RMSNorm,
                         tap_layers: Sequence[int] = ()) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """The fused path of a layer stack: every residual add is folded into the next RMSNorm, the
    last into `final_norm`. Returns final_norm(output) and {i: output of layer i} for tap_layers,
    the last layer's final-normed (HF's last hidden_states entry, as DFlash drafters read it)."""
    from flashdraft.kernels import layer_ops

    x, residual, taps = h, None, {}
    for i, layer in enumerate(layers):
        ln = layer.input_layernorm
        x, residual = layer_ops.add_rmsnorm(x, residual, ln.weight, ln.eps)
        if i > 0 and i - 1 in tap_layers:
            taps[i - 1] = residual
        x, residual = layer.forward_fused(x, residual, positions, rope, kv_cache[i][0], kv_cache[i][1],
                                          layer_backend(attn, i), batch)
    out, residual = layer_ops.add_rmsnorm(x, residual, final_norm.weight, final_norm.eps)
    if len(layers) - 1 in tap_layers:
        taps[len(layers) - 1] = out
    return out, taps


def check_config(cfg) -> None:
    """Refuse, by name, config fields that would change a target's math and that flashdraft does not
    implement (a field read wrongly gives other text without a word). The fields each family reads
    are implemented (module docstring); others, as in transformers, change nothing."""
    scheme_of(cfg)  # (a quantization this loader cannot read: refused by name)


def target_layer_masks(cfg) -> list[tuple[bool, int | None]]:
    """(causal, sliding window or None) of each layer, as transformers' attention applies them."""
    window = getattr(cfg, "sliding_window", None)
    types = getattr(cfg, "layer_types", None)
    if types is None:  # Mistral: every layer slides when a window is set; Llama has none
        return [(True, window)] * cfg.num_hidden_layers
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ValueError(f"layer_types {bad} are not supported (full_attention, sliding_attention)")
    return [(True, window if t == "sliding_attention" else None) for t in types]


class DecoderLM(nn.Module):
    """forward() returns the final-normed hidden states of every row and, when asked, the
    concatenated outputs of the decoder layers in `tap_layers` (DFlash taps) as HF's hidden_states
    give them: layer l's output, the last layer's after the final norm."""

    def __init__(self, cfg):
        super().__init__()
        model_type = getattr(cfg, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        check_config(cfg)
        self.config = cfg
        qk_norm = model_type in ("qwen3", "qwen3_moe")
        attention_bias = bool(getattr(cfg, "attention_bias", False))
        bias = attention_bias or model_type == "qwen2"
        o_bias = attention_bias and model_type != "qwen2"  # Qwen2's o_proj has none
        self.has_sinks = model_type == "gpt_oss"
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, qk_norm, bias, o_bias, i, self.has_sinks)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tied else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope: RotaryTable | None = None
        self.layer_masks = target_layer_masks(cfg)
        # tensor parallelism (models/parallel.py): this rank's group (its embedding and LM head then hold its
        # share of the vocabulary's rows)
        self.tp = None
        self.tp_takes: dict = {}  # parameter name -> how its share comes from a checkpoint's whole tensor

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.tied else self.lm_head.weight

    def setup_rope(self, max_len: int) -> None:
        p = self.embed_tokens.weight
        self.rope = RotaryTable(self.config, self.head_dim, max_len, p.device, p.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Sequence[tuple],
                attn: AttentionBackend, batch: AttentionBatch, tap_layers: Sequence[int] = ()):
        if fused_enabled(self.embed_tokens.weight):
            out, taps = forward_layers_fused(self.layers, self.embed_tokens(input_ids), positions, self.rope, kv_cache,
                                             attn, batch, self.norm, tap_layers)
            return out, (torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None)
        cos, sin = self.rope.lookup(positions)
        h = self.embed_tokens(input_ids)
        taps: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, kv_cache[i][0], kv_cache[i][1], layer_backend(attn, i), batch)
            if i in tap_layers:
                taps[i] = h
        out = self.norm(h)
        if len(self.layers) - 1 in taps:  # HF's last hidden_states entry: the final-normed state
            taps[len(self.layers) - 1] = out
        tapped = torch.cat([taps[i] for i in tap_layers], -1) if tap_layers else None
        return out, tapped

    def compute_logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """Logits of every row, in float32 for the sampler; float32=False keeps the activation dtype
        (an argmax over them picks the same token: the upcast is exact)."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        if self.tp is not None:  # each rank's share of the vocabulary (models/parallel.py), gathered
            logits = self.tp.all_gather_last(linear(flat, self.lm_head_weight))[:, : self.config.vocab_size]
            logits = logits.contiguous().view(*hidden.shape[:-1], -1)  # (the padding rows cut: one copy)
        else:
            logits = linear(flat, self.lm_head_weight).view(*hidden.shape[:-1], -1)
        return logits.float() if float32 else logits

    def load_hf_state_dict(self, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (model.* prefix), packing q/k/v and gate/up. weights: a dict, or (name,
        tensor) pairs read one at a time (loader.stream_weights): a model holds no more of them at once than
        a pack's parts, or one layer's experts (stacked as soon as they are in)."""
        skip = {"lm_head.weight"} if self.tied else set()
        pairs = weights.items() if isinstance(weights, Mapping) else weights
        pairs = ((k.removeprefix("model."), w) for k, w in pairs
                 if not k.endswith("rotary_emb.inv_freq") and k not in skip)
        if self.config.model_type == "gpt_oss":
            pairs = gpt_oss_experts(pairs, self.embed_tokens.weight.dtype)
        load_packed(self, stack_experts(pairs, getattr(self.config, "num_experts", None)))


_PACKS = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
          "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2)}


def load_packed(module: nn.Module, weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named weights (a dict, or (name, tensor) pairs) into `module`, concatenating q/k/v and
    gate/up into their packed matrices as soon as a pack's parts are in. Unknown, missing or mis-shaped
    tensors are errors that name the tensor."""
    own = dict(module.named_parameters()) | dict(module.named_buffers())
    takes = getattr(module, "tp_takes", None) or {}  # a split model's shares (models/parallel.py)
    loaded: set[str] = set()
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, w in weights.items() if isinstance(weights, Mapping) else weights:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _PACKS:
            fused, idx, want = _PACKS[parts[-2]]
            key = ".".join(parts[:-2] + [fused, parts[-1]])
            chunks = pending.setdefault(key, {})
            chunks[idx] = w
            if len(chunks) == want and key in own:
                _copy(own[key], torch.cat([chunks[i] for i in range(want)], 0), key, takes.get(key))
                del pending[key]
                loaded.add(key)
                chunks = w = None  # (held here, the parts would outlive their copy until the next pack's)
            continue
        if name not in own:
            raise ValueError(f"unexpected weight {name!r}")
        _copy(own[name], w, name, takes.get(name))
        loaded.add(name)
    if pending:
        raise ValueError(f"incomplete packed weight {next(iter(pending))!r}")
    missing = sorted(n for n in own if n not in loaded and n in dict(module.named_parameters()))
    if missing:
        raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")


def _copy(param: torch.Tensor, w: torch.Tensor, name: str, take=None) -> None:
    if take is not None:  # a tensor-parallel rank's share of it (models/parallel.py)
        w = take(w)
    if tuple(param.shape) != tuple(w.shape):
        raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(w.to(param.dtype))
