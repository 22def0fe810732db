"""Tensor parallelism for the decoder (Megatron's split): each of N ranks keeps 1/N of every layer.

- Attention: its share of the query heads and of the KV heads (qkv_proj's rows, o_proj's columns); the
  KV cache of a rank holds only its KV heads. o_proj's outputs are summed over the ranks (all-reduce).
- MLP: its share of the intermediate columns (gate_up_proj's rows, down_proj's columns); down_proj's
  outputs are summed over the ranks.
- Mixture of experts (vLLM's split): every expert, with its share of the expert's intermediate size
  (gate_up_proj's gate rows and up rows, down_proj's columns); the router whole, so every rank routes
  each token alike (its input is the same on every rank). The layer's combined output is summed over the
  ranks, once; a shared expert (Qwen3.5-MoE, Qwen3-Next) is split as an MLP and its part joins that sum.
- Hybrid targets: a gated attention layer as attention (a query head's rows carry its output gate); a Gated
  DeltaNet layer keeps its share of the key heads and of their value heads, so its recurrent state and conv
  window are per rank too (its q/k/v/z/b/a rows, conv channels, decays; out_proj's columns, summed).
- Embedding: its share of the vocabulary's rows (padded to N equal shares); a token outside the share looks
  up zeros, and the lookups are summed over the ranks (VocabParallelEmbedding). Norms: whole.
- LM head: its share of the vocabulary's rows, as the embedding's (a tied model's is the embedding's share);
  the logits are gathered, so every rank holds the whole row and chooses the same token.

Biases of the summed projections are added once: rank 0 keeps them, the other ranks hold zeros. A model
is split loaded or not: every share remembers how it is cut from the whole tensor (`model.tp_takes`), so
loaders split on the meta device first and each rank reads only its share onto its GPU (loader.load_model).
The engine drives the ranks (one process each, the scheduler on rank 0; engine/parallel.py); this module
splits a model and does its collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flashdraft.models.gdn import GatedDeltaNet
from flashdraft.models.hybrid import HYBRID_MODEL_TYPES, GatedAttention, HybridLM, SharedExpertMoE, text_config
from flashdraft.models.layers import MLP, Embedding, Linear, linear
from flashdraft.models.moe import MoE, is_moe_layer
from flashdraft.models.transformer import DecoderLM

log = logging.getLogger(__name__)
DENSE = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("qwen3_moe", "gpt_oss")  # the model types whose layers shard_decoder splits: DENSE + MOE_TYPES


# the largest message the one-shot all-reduce takes (32 rows of 4,096 bf16): up to it, TP 2 decode steps ran
# 2-3% faster end to end with it than with NCCL's alone on H200s; at 128 rows, between kernels, it ran 4% slower
# (docs/performance.md section 10); larger messages go to NCCL
ONE_SHOT_MAX_BYTES = 256 << 10


class OneShotAllReduce:
    """torch's one-shot all-reduce over symmetric memory, for small messages (a step's activations): each
    rank copies its part into a buffer that every rank of the host can read, and sums all parts itself. One
    kernel, against NCCL's ring; the ranks' GPUs must reach each other's memory (one host, NVLink or P2P).
    Building it is collective: every rank at the same point, right after the group starts.

    Once per process: torch keeps a group's symmetric-memory state (its store, its count of rendezvous) by
    the group's name for the life of the process, and a new default group takes the old one's name, so a
    second engine's rendezvous in the same process would wait forever for partners that count from zero.
    `built` says whether this process has tried it (engine/parallel.Ranks then sums through NCCL)."""

    built = False

    def __init__(self, device: torch.device, group: Any = None, max_bytes: int = ONE_SHOT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        OneShotAllReduce.built = True
        self.name = (group or dist.group.WORLD).group_name
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # (needed by older torch; newer ones need nothing)
            symm_mem.enable_symm_mem_for_group(self.name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.name)
        ops = torch.ops.symm_mem
        self.copying = getattr(ops, "one_shot_all_reduce_copy", None)  # (copies in its own kernel)
        self.reduce = ops.one_shot_all_reduce

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        """The sum of x over the ranks, or None where this does not take x (NCCL's then)."""
        n = x.numel() * x.element_size()
        if n > self.buffer.numel() or n % 16 or x.dtype not in (torch.bfloat16, torch.float32):
            return None
        part = self.buffer[:n].view(x.dtype).view(x.shape)
        if self.copying is not None:
            return self.copying(part, x.contiguous(), "sum", self.name)
        part.copy_(x)
        return self.reduce(part, "sum", self.name)


def one_shot_or_none(device: torch.device, size: int, group: Any = None) -> OneShotAllReduce | None:
    """The one-shot all-reduce for a group of `size` ranks on `device`'s kind, where torch has it: CUDA, more
    than one rank. Where it fails to build, the reason is logged and NCCL's all-reduce takes every message."""
    if device.type != "cuda" or size < 2:
        return None
    try:
        return OneShotAllReduce(device, group)
    except Exception as e:  # noqa: BLE001 (a torch or host without it: NCCL's all-reduce instead)
        log.warning("symmetric-memory all-reduce unavailable (%s: %s); using NCCL's", type(e).__name__, e)
        return None


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group (group: a torch.distributed group; None: the
    default one; one_shot: the one-shot all-reduce for small messages, on GPUs)."""

    rank: int
    size: int
    group: Any = None
    one_shot: OneShotAllReduce | None = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of x over the ranks (x itself summed in place, or a new tensor: use the result)."""
        if self.one_shot is not None and (out := self.one_shot(x)) is not None:
            return out
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side along the last dimension: [..., size * n]."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, -1)


class VocabParallelEmbedding(Embedding):
    """An embedding that holds its share of the vocabulary's rows: a token outside it looks up zeros, and
    the sum over the ranks is the whole lookup."""

    tp: TPGroup

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.tp.rank * self.num_embeddings
        inside = (local >= 0) & (local < self.num_embeddings)
        h = super().forward(torch.where(inside, local, 0))
        return self.tp.all_reduce(h * inside.unsqueeze(-1).to(h.dtype))


class RowParallelLinear(Linear):
    """A projection whose input is split over the ranks: its share of the columns, the sum over ranks."""

    tp: TPGroup

    def forward(self, x: torch.Tensor, parts: bool = False) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight, self.bias))  # (whole rows: the sum needs them)


def check_shardable(cfg, size: int) -> None:
    """Refuse, by name, a model that this split cannot divide into `size` shares."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    cfg = text_config(cfg)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in DENSE + MOE_TYPES + HYBRID_MODEL_TYPES:
        raise ValueError(f"tensor parallelism splits {', '.join(DENSE + MOE_TYPES + HYBRID_MODEL_TYPES)}, not "
                         f"{model_type!r}")
    sizes = ["intermediate_size"]  # dense MLPs' and GPT-OSS experts'; Qwen3-MoE and hybrids: those its layers have
    if model_type == "qwen3_moe" or model_type in HYBRID_MODEL_TYPES:
        moe = [is_moe_layer(cfg, i) for i in range(cfg.num_hidden_layers)]
        shared = ["shared_expert_intermediate_size"] if model_type in HYBRID_MODEL_TYPES else []
        sizes = (["moe_intermediate_size", *shared] if any(moe) else []) + ["intermediate_size"] * (not all(moe))
    if model_type in HYBRID_MODEL_TYPES:  # the Gated DeltaNet layers' heads
        sizes += ["linear_num_key_heads", "linear_num_value_heads"]
    for name in ["num_attention_heads", "num_key_value_heads", *sizes]:
        n = getattr(cfg, name)
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {name} ({n})")


def shard_decoder(model: DecoderLM | HybridLM, tp: TPGroup) -> DecoderLM | HybridLM:
    """Keep rank tp.rank's share of a DecoderLM or HybridLM, loaded or on the meta device (in place;
    returned)."""
    check_shardable(model.config, tp.size)
    if tp.size == 1:
        return model
    for layer in model.layers:
        if getattr(layer, "kind", None) == "linear_attention":
            _split_gdn(layer.linear_attn, tp)
        elif isinstance(layer.self_attn, GatedAttention):
            _split_gated_attention(layer.self_attn, tp)
        else:
            _split_attention(layer.self_attn, tp)
        m = layer.mlp
        if isinstance(m, SharedExpertMoE):  # the routed experts' and the shared expert's parts, summed once
            _split_experts(m, tp)
            _split_mlp(m.shared_expert, tp, summed=False)
        elif isinstance(m, MoE):
            _split_experts(m, tp)
        elif isinstance(m, MLP):
            _split_mlp(m, tp)
        else:
            raise ValueError(f"tensor parallelism splits MLPs and mixtures of experts, not {type(m).__name__}")
    model.tp = tp
    rows = partial(_vocab_rows, tp=tp)  # the embedding's and the LM head's (a tied model's are one)
    whole = model.embed_tokens
    model.embed_tokens = VocabParallelEmbedding(-(-whole.num_embeddings // tp.size), whole.embedding_dim,
                                                device="meta")
    model.embed_tokens.weight = _share(whole.weight, rows)
    model.embed_tokens.tp = tp
    if not model.tied:
        model.lm_head.weight = _share(model.lm_head.weight, rows)
    # by name: moving the module (to_empty) makes new parameters, without the attribute
    model.tp_takes = {name: p.tp_take for name, p in model.named_parameters() if hasattr(p, "tp_take")}
    return model


def _split_attention(a, tp: TPGroup) -> None:
    """Its share of the query and KV heads (q/k/v rows, o_proj's columns) and of the attention sinks."""
    r = tp.rank
    hd, q, kv = a.head_dim, a.n_heads // tp.size, a.n_kv // tp.size
    rows = torch.cat([torch.arange(r * q * hd, (r + 1) * q * hd),
                      a.q_size + torch.arange(r * kv * hd, (r + 1) * kv * hd),
                      a.q_size + a.kv_size + torch.arange(r * kv * hd, (r + 1) * kv * hd)])
    a.qkv_proj = _rows(a.qkv_proj, rows)
    a.o_proj = _columns(a.o_proj, torch.arange(r * q * hd, (r + 1) * q * hd), tp)
    if a.sinks is not None:
        a.sinks = _share(a.sinks, lambda w, heads=slice(r * q, (r + 1) * q): w[heads])
    a.n_heads, a.n_kv, a.q_size, a.kv_size = q, kv, q * hd, kv * hd


def _split_gated_attention(a: GatedAttention, tp: TPGroup) -> None:
    """A hybrid's gated attention: its share of the heads, each query head with its output gate (q_proj
    gives a head 2 x head_dim rows), of the KV heads, and o_proj's columns."""
    r = tp.rank
    hd, q, kv = a.head_dim, a.n_heads // tp.size, a.n_kv // tp.size
    rows = torch.cat([torch.arange(r * q * 2 * hd, (r + 1) * q * 2 * hd),
                      a.splits[0] + torch.arange(r * kv * hd, (r + 1) * kv * hd),
                      a.splits[0] + a.kv_size + torch.arange(r * kv * hd, (r + 1) * kv * hd)])
    a.qkv_proj = _rows(a.qkv_proj, rows)
    a.o_proj = _columns(a.o_proj, torch.arange(r * q * hd, (r + 1) * q * hd), tp)
    a.n_heads, a.n_kv, a.kv_size = q, kv, kv * hd
    a.splits = [2 * q * hd, kv * hd, kv * hd]


def _split_gdn(g: GatedDeltaNet, tp: TPGroup) -> None:
    """A Gated DeltaNet layer's share of its key heads and of their value heads (a value head reads key head
    j // (heads_v / heads_k): equal shares keep each with its key head). in_proj's rows of those heads' q, k,
    v, z, b and a, their conv channels, decays and dt biases, out_proj's columns; the gated norm is per head,
    whole. Each rank's recurrent state then holds its heads only."""
    r = tp.rank
    hk, hv = g.heads_k // tp.size, g.heads_v // tp.size
    kd, vd = hk * g.d_k, hv * g.d_v
    q = torch.arange(r * kd, (r + 1) * kd)
    conv = torch.cat([q, g.key_dim + q, 2 * g.key_dim + torch.arange(r * vd, (r + 1) * vd)])
    z = g.conv_dim + torch.arange(r * vd, (r + 1) * vd)
    b = g.conv_dim + g.value_dim + torch.arange(r * hv, (r + 1) * hv)
    g.in_proj = _rows(g.in_proj, torch.cat([conv, z, b, b + g.heads_v]))
    g.conv1d.weight = _share(g.conv1d.weight, lambda w: w[conv.to(w.device)])
    heads = slice(r * hv, (r + 1) * hv)
    g.dt_bias = _share(g.dt_bias, lambda w: w[heads])
    g.A_log = _share(g.A_log, lambda w: w[heads])
    g.out_proj = _columns(g.out_proj, torch.arange(r * vd, (r + 1) * vd), tp)
    g.whole_heads = (g.heads_k, g.heads_v)  # (a Qwen3-Next checkpoint's packing is by the whole layer's heads)
    g.heads_k, g.heads_v, g.key_dim, g.value_dim, g.conv_dim = hk, hv, kd, vd, 2 * kd + vd
    g.splits = [g.conv_dim, vd, hv, hv]


def _split_mlp(m: MLP, tp: TPGroup, summed: bool = True) -> None:
    """Its share of the intermediate columns (gate and up rows, down_proj's columns). summed: down_proj sums
    its output over the ranks; else the caller sums it with others (a shared expert's, with the experts')."""
    r, i = tp.rank, m.inter // tp.size
    m.gate_up_proj = _rows(m.gate_up_proj, torch.cat([torch.arange(r * i, (r + 1) * i),
                                                      m.inter + torch.arange(r * i, (r + 1) * i)]))
    m.down_proj = _columns(m.down_proj, torch.arange(r * i, (r + 1) * i), tp, summed)
    m.inter = i


def _vocab_rows(w: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Rank tp.rank's share of a [vocab, hidden] table's rows: the vocabulary in equal shares, the last one
    padded with zero rows."""
    share = -(-w.shape[0] // tp.size)
    head = torch.zeros(share, w.shape[1], dtype=w.dtype, device=w.device)
    mine = w[tp.rank * share: (tp.rank + 1) * share]
    head[: mine.shape[0]] = mine
    return head


def _share(whole: torch.Tensor, take) -> nn.Parameter:
    """This rank's share take(whole) of a parameter, as a parameter that remembers `take`: a model split
    before its weights are loaded (on the meta device, so that no rank holds more than its share) loads
    each checkpoint tensor through it (model.tp_takes, transformer.load_packed)."""
    share = nn.Parameter(take(whole.data).contiguous().clone(), requires_grad=False)
    share.tp_take = take
    return share


def _split_experts(m: MoE, tp: TPGroup) -> None:
    """Keep every expert's share of its intermediate size (gate and up rows, down columns); m.tp then sums
    the layer's output over the ranks."""
    ex, inter, i = m.experts, m.inter, m.inter // tp.size
    s = slice(tp.rank * i, (tp.rank + 1) * i)
    gate_up = lambda w: w.unflatten(1, (2, inter))[:, :, s].flatten(1, 2)  # noqa: E731 ([E, 2I, ...])
    ex.gate_up_proj = _share(ex.gate_up_proj, gate_up)
    if ex.gate_up_proj_bias is not None:
        ex.gate_up_proj_bias = _share(ex.gate_up_proj_bias, gate_up)
    ex.down_proj = _share(ex.down_proj, lambda w: w[:, :, s])
    if ex.down_proj_bias is not None and tp.rank:  # added once; zeros, not None: the Triton experts take both
        ex.down_proj_bias = _share(ex.down_proj_bias, torch.zeros_like)  # biases or neither
    m.inter, m.tp = i, tp


def _rows(lin: Linear, rows: torch.Tensor) -> Linear:
    out = Linear(lin.in_features, rows.numel(), bias=lin.bias is not None, device="meta")
    take = lambda w: w[rows.to(w.device)]  # noqa: E731
    out.weight = _share(lin.weight, take)
    if lin.bias is not None:
        out.bias = _share(lin.bias, take)
    return out


def _columns(lin: Linear, cols: torch.Tensor, tp: TPGroup, summed: bool = True) -> Linear:
    """Its share of lin's input columns: a RowParallelLinear (summed over the ranks), or with summed=False a
    Linear whose output is this rank's part of the sum."""
    out = (RowParallelLinear if summed else Linear)(cols.numel(), lin.out_features, bias=lin.bias is not None,
                                                    device="meta")
    out.weight = _share(lin.weight, lambda w: w[:, cols.to(w.device)])
    if out.bias is not None:  # added once: zeros on the other ranks (the checkpoint's tensor still has a place)
        out.bias = _share(lin.bias, (lambda w: w) if tp.rank == 0 else torch.zeros_like)
    if summed:
        out.tp = tp
    return out
