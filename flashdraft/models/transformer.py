"""Llama / Qwen2 / Qwen3 / Mistral / Qwen3-MoE / GPT-OSS decoders over a paged KV cache. One class
serves them all: Qwen3 adds per-head q/k RMSNorm, Qwen2 q/k/v biases, the MoE families a mixture of
experts for the MLP (models/moe.py), GPT-OSS attention sinks; `attention_bias`, `mlp_bias`,
`hidden_act` and sliding-window layers (`sliding_window` with `layer_types`, as transformers derives
them from `use_sliding_window` / `max_window_layers`, or on every Mistral layer) are read from the
config, and fields flashdraft does not implement are refused (check_config). q/k/v and gate/up are
packed into one matmul each."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashdraft.attention.base import AttentionBackend, AttentionBatch, layer_backend
from flashdraft.models.moe import GptOssMoE, MoE, gpt_oss_experts, is_moe_layer, stack_experts
from flashdraft.models.rope import RotaryTable, apply_rope

SUPPORTED_MODEL_TYPES = ("llama", "qwen3", "qwen2", "mistral", "qwen3_moe", "gpt_oss")

# The fused Triton kernels of flashdraft/models/fused.py (add+RMSNorm, q/k norm + RoPE + K/V store,
# silu*mul) replace the elementwise torch ops: "auto" for CUDA activations when triton imports, "on"
# also for CPU tensors under TRITON_INTERPRET=1 (tests), "off" never. No backward: never with grad.
FUSED = os.environ.get("FLASHDRAFT_FUSED", "auto")
_triton_ok: bool | None = None


def fused_enabled(x: torch.Tensor) -> bool:
    """Whether a forward over activations like `x` takes the fused path (see FUSED)."""
    global _triton_ok
    if FUSED == "off" or torch.is_grad_enabled():
        return False
    if FUSED not in ("auto", "on"):
        raise ValueError(f"FLASHDRAFT_FUSED must be auto, on or off, got {FUSED!r}")
    if FUSED == "auto" and x.device.type != "cuda":
        return False
    if _triton_ok is None:
        try:
            import flashdraft.models.fused  # noqa: F401
            _triton_ok = True
        except ImportError:
            _triton_ok = False
    if FUSED == "on" and not (_triton_ok and (x.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")):
        raise RuntimeError("FLASHDRAFT_FUSED=on needs triton and CUDA tensors (or TRITON_INTERPRET=1)")
    return _triton_ok


@contextlib.contextmanager
def _switch(name: str, mode: str):
    old, globals()[name] = globals()[name], mode
    try:
        yield
    finally:
        globals()[name] = old


def fused_mode(mode: str):
    """Temporarily set FUSED (tests, benchmarks). CUDA graphs keep the path they were captured with."""
    return _switch("FUSED", mode)


class Embedding(nn.Embedding):
    """nn.Embedding; on the fused path the lookup is fused_tokens.embedding (one Triton kernel)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if fused_enabled(self.weight):
            from flashdraft.models import fused_tokens

            return fused_tokens.embedding(ids, self.weight)
        return super().forward(ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / RMS(x), the statistics in float32 at least, normalised x cast back to x's dtype
    before the weight multiply (the result takes the promoted dtype of the two)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


# Few-row GEMMs (decode batches, verify and draft blocks: <= SKINNY_ROWS rows) on the Triton kernels
# of flashdraft/models/skinny.py, which read the weights closer to the memory bandwidth than cuBLAS
# does at these shapes: "auto" for CUDA activations in bf16/fp16 when triton imports, "triton" also
# for CPU tensors under TRITON_INTERPRET=1 (tests), "cublas" never. No backward: never with grad.
GEMM = os.environ.get("FLASHDRAFT_GEMM", "auto")
# the most rows the few-row tiles take: 32; 64-256 (FLASHDRAFT_SKINNY_ROWS) only for sweeps and A/B runs:
# with those tiles the shipped pair's 64-row verify blocks ran 9% slower than on cuBLAS (H200), which the
# mid-row tiles below beat instead
SKINNY_ROWS = int(os.environ.get("FLASHDRAFT_SKINNY_ROWS", "32"))
if SKINNY_ROWS not in (32, 64, 128, 256):
    raise ValueError(f"FLASHDRAFT_SKINNY_ROWS must be 32, 64, 128 or 256, got {SKINNY_ROWS}")


# Blocks of SKINNY_ROWS + 1 to MID_ROWS rows (a small target's verify and draft blocks at concurrency 5-8:
# SmolLM2's 64 rows of 8) take the Triton GEMMs too where skinny.mid_tiles has tiles for the weight's shape
# (widths up to 1,024), cuBLAS elsewhere. FLASHDRAFT_MID_ROWS=32: never; 128: up to 128 (A/B runs: the
# shipped pair's 128-row step graph at concurrency 16 took 1.318 ms against 1.145 on cuBLAS, H200).
MID_ROWS = int(os.environ.get("FLASHDRAFT_MID_ROWS", "64"))
if MID_ROWS not in (32, 64, 128):
    raise ValueError(f"FLASHDRAFT_MID_ROWS must be 32, 64 or 128, got {MID_ROWS}")


def skinny_enabled(x: torch.Tensor, weight: torch.Tensor | None = None, glu: bool = False) -> bool:
    """Whether a 2-D activation `x` takes the few-row Triton GEMM (see GEMM); past SKINNY_ROWS rows
    only with the weight given (its [gate; up] matrix for glu) and a shape skinny.mid_tiles takes."""
    if GEMM not in ("auto", "triton", "cublas"):
        raise ValueError(f"FLASHDRAFT_GEMM must be auto, triton or cublas, got {GEMM!r}")
    most = max(SKINNY_ROWS, MID_ROWS)
    if GEMM == "cublas" or torch.is_grad_enabled() or x.dim() != 2 or not 1 <= x.shape[0] <= most:
        return False
    if GEMM == "auto" and (x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16)):
        return False
    if GEMM == "triton" and x.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return False
    if not (fused_enabled(x) or GEMM == "triton"):
        return False
    if x.shape[0] <= SKINNY_ROWS:
        return True
    from flashdraft.models.skinny import mid_tiles

    return weight is not None and mid_tiles(*weight.shape, glu) is not None


def gemm_mode(mode: str):
    """Temporarily set GEMM (tests, benchmarks). CUDA graphs keep the kernels they were captured with."""
    return _switch("GEMM", mode)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           parts: bool = False) -> torch.Tensor:
    """F.linear, except for few rows: on CUDA the Triton kernels of skinny.py (see GEMM), and for
    2-64 rows on CPU (verify and draft blocks, small batches) W @ x^T, which MKL computes up to ~2x
    faster than x @ W^T (SmolLM2 shapes, fp32, cache-cold weights: gate_up at 8 rows 0.62 against
    0.88 ms, the 49k-row lm_head 10.8 against 21.3 ms); one row and long prefills gain nothing there.
    parts: the result may come as a split-K GEMM's float32 parts [rows, P, out] (skinny_linear), for
    a caller whose result goes straight into fused.add_rmsnorm (which adds them)."""
    if skinny_enabled(x, weight):
        from flashdraft.models.skinny import skinny_linear

        return skinny_linear(x, weight, bias, parts=parts)
    if x.device.type == "cpu" and x.dim() == 2 and 1 < x.shape[0] <= 64:
        y = (weight @ x.T).T.contiguous()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, parts: bool = False) -> torch.Tensor:
        """parts: the result may be split-K parts, for an add_rmsnorm (see linear)."""
        return linear(x, self.weight, self.bias, parts)


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

    def forward(self, x, cos, sin, k_cache, v_cache, attn: AttentionBackend, batch: AttentionBatch):
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.n_heads, self.head_dim)
        k = k.view(-1, self.n_kv, self.head_dim)
        v = v.view(-1, self.n_kv, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn.store_kv(k_cache, v_cache, k, v, batch)
        o = attn.forward(q, k_cache, v_cache, batch, self.scale, self.sinks)
        return self.o_proj(o.reshape(-1, self.q_size))

    def forward_fused(self, x, positions, rope: RotaryTable, k_cache, v_cache, attn: AttentionBackend, batch,
                      parts: bool = False):
        """One kernel for q/k norm, RoPE and the K/V store (the backend's store_kv is not called).
        parts: the o_proj's result may be split-K parts (see linear), for an add_rmsnorm."""
        from flashdraft.models import fused

        norm = self.q_norm is not None
        q = fused.qk_norm_rope_store(self.qkv_proj(x), positions, rope.cos, rope.sin,
                                     self.q_norm.weight if norm else None, self.k_norm.weight if norm else None,
                                     self.q_norm.eps if norm else 0.0, k_cache, v_cache, step_slots(attn, batch))
        o = attn.forward(q, k_cache, v_cache, batch, self.scale, self.sinks)
        return self.o_proj(o.reshape(-1, self.q_size), parts=parts)


def activation(name: str):
    """The gate activation `hidden_act` names, as transformers defines it (silu: F.silu)."""
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"unsupported hidden_act {name!r}")
    return ACT2FN[name]


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.inter = inter
        self.act_name = act
        self.act = activation(act)
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def forward_fused(self, x, parts: bool = False):
        """parts: the down projection's result may be split-K parts (see linear), for an add_rmsnorm."""
        from flashdraft.models import fused

        if self.act_name != "silu":  # the fused kernels compute silu
            return self.forward(x)
        if skinny_enabled(x, self.gate_up_proj.weight, glu=True) and self.gate_up_proj.bias is None:  # silu * up
            from flashdraft.models.skinny import skinny_linear

            h = skinny_linear(x, self.gate_up_proj.weight, glu=True)
        else:
            h = fused.silu_mul(self.gate_up_proj(x))
        return self.down_proj(h, parts=parts)


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
        from flashdraft.models import fused

        a = self.self_attn.forward_fused(x, positions, rope, k_cache, v_cache, attn, batch, parts=True)
        norm = self.post_attention_layernorm
        if isinstance(self.mlp, MoE):  # its k expert outputs, summed by the next add_rmsnorm
            return self.mlp.norm_forward_fused(a, residual, norm)
        x, residual = fused.add_rmsnorm(a, residual, norm.weight, norm.eps)
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
    from flashdraft.models import fused

    x, residual, taps = h, None, {}
    for i, layer in enumerate(layers):
        ln = layer.input_layernorm
        x, residual = fused.add_rmsnorm(x, residual, ln.weight, ln.eps)
        if i > 0 and i - 1 in tap_layers:
            taps[i - 1] = residual
        x, residual = layer.forward_fused(x, residual, positions, rope, kv_cache[i][0], kv_cache[i][1],
                                          layer_backend(attn, i), batch)
    out, residual = fused.add_rmsnorm(x, residual, final_norm.weight, final_norm.eps)
    if len(layers) - 1 in tap_layers:
        taps[len(layers) - 1] = out
    return out, taps


def check_config(cfg) -> None:
    """Refuse, by name, config fields that would change a target's math and that flashdraft does not
    implement (a field read wrongly gives other text without a word). The fields each family reads
    are implemented (module docstring); others, as in transformers, change nothing."""
    quant = getattr(cfg, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        if not (method == "mxfp4" and cfg.model_type == "gpt_oss"):  # GPT-OSS experts: dequantized at load
            raise ValueError(f"quantization_config with quant_method {method!r} is not supported: "
                             "pass an unquantized (bf16/fp16/fp32) checkpoint")


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
