"""Tensor parallelism for the dense decoder (Megatron's split): each of N ranks keeps 1/N of every layer.

- Attention: its share of the query heads and of the KV heads (qkv_proj's rows, o_proj's columns); the
  KV cache of a rank holds only its KV heads. o_proj's outputs are summed over the ranks (all-reduce).
- MLP: its share of the intermediate columns (gate_up_proj's rows, down_proj's columns); down_proj's
  outputs are summed over the ranks.
- Embedding and norms: whole on every rank (the embedding is a gather, not a matmul).
- LM head: its share of the vocabulary's rows (padded to N equal shares); the logits are gathered, so
  every rank holds the whole row and chooses the same token.

Biases of the summed projections stay on rank 0 only (added once). The engine drives the ranks (one
process each, the scheduler on rank 0); this module only splits a loaded model and does its collectives.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from flashdraft.models.transformer import MLP, DecoderLM, Linear, linear

DENSE = ("llama", "mistral", "qwen2", "qwen3")  # the model types whose layers shard_decoder splits


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a tensor-parallel group (group: a torch.distributed group; None: the
    default one)."""

    rank: int
    size: int
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x [..., n] side by side along the last dimension: [..., size * n]."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, -1)


class RowParallelLinear(Linear):
    """A projection whose input is split over the ranks: its share of the columns, the sum over ranks."""

    tp: TPGroup

    def forward(self, x: torch.Tensor, parts: bool = False) -> torch.Tensor:
        return self.tp.all_reduce(linear(x, self.weight, self.bias))  # (whole rows: the sum needs them)


def check_shardable(cfg, size: int) -> None:
    """Refuse, by name, a model that this split cannot divide into `size` shares."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    model_type = getattr(cfg, "model_type", None)
    if model_type not in DENSE:
        raise ValueError(f"tensor parallelism splits dense transformers ({', '.join(DENSE)}) so far, not "
                         f"{model_type!r} (mixture-of-experts and hybrid targets are not split yet)")
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
        n = getattr(cfg, name)
        if n % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {name} ({n})")


def shard_decoder(model: DecoderLM, tp: TPGroup) -> DecoderLM:
    """Keep rank tp.rank's share of a loaded DecoderLM (in place; returned)."""
    check_shardable(model.config, tp.size)
    if tp.size == 1:
        return model
    r, n = tp.rank, tp.size
    for layer in model.layers:
        a = layer.self_attn
        hd, q, kv = a.head_dim, a.n_heads // n, a.n_kv // n
        rows = torch.cat([torch.arange(r * q * hd, (r + 1) * q * hd),
                          a.q_size + torch.arange(r * kv * hd, (r + 1) * kv * hd),
                          a.q_size + a.kv_size + torch.arange(r * kv * hd, (r + 1) * kv * hd)])
        a.qkv_proj = _rows(a.qkv_proj, rows)
        a.o_proj = _columns(a.o_proj, torch.arange(r * q * hd, (r + 1) * q * hd), tp)
        if a.sinks is not None:
            a.sinks = nn.Parameter(a.sinks.data[r * q: (r + 1) * q].clone(), requires_grad=False)
        a.n_heads, a.n_kv, a.q_size, a.kv_size = q, kv, q * hd, kv * hd
        m = layer.mlp
        if not isinstance(m, MLP):
            raise ValueError(f"tensor parallelism splits dense MLPs only, not {type(m).__name__}")
        i = m.inter // n
        m.gate_up_proj = _rows(m.gate_up_proj, torch.cat([torch.arange(r * i, (r + 1) * i),
                                                          m.inter + torch.arange(r * i, (r + 1) * i)]))
        m.down_proj = _columns(m.down_proj, torch.arange(r * i, (r + 1) * i), tp)
        m.inter = i
    V = model.config.vocab_size
    share = -(-V // n)
    w = model.lm_head_weight.data
    head = torch.zeros(share, w.shape[1], dtype=w.dtype, device=w.device)
    mine = w[r * share: (r + 1) * share]
    head[: mine.shape[0]] = mine
    model.lm_head_shard = head
    model.tp = tp
    return model


def _rows(lin: Linear, rows: torch.Tensor) -> Linear:
    out = Linear(lin.in_features, rows.numel(), bias=lin.bias is not None, device="meta")
    out.weight = nn.Parameter(lin.weight.data[rows.to(lin.weight.device)].clone(), requires_grad=False)
    if lin.bias is not None:
        out.bias = nn.Parameter(lin.bias.data[rows.to(lin.bias.device)].clone(), requires_grad=False)
    return out


def _columns(lin: Linear, cols: torch.Tensor, tp: TPGroup) -> RowParallelLinear:
    out = RowParallelLinear(cols.numel(), lin.out_features, bias=lin.bias is not None and tp.rank == 0,
                            device="meta")
    out.weight = nn.Parameter(lin.weight.data[:, cols.to(lin.weight.device)].contiguous(), requires_grad=False)
    if out.bias is not None:
        out.bias = nn.Parameter(lin.bias.data.clone(), requires_grad=False)
    out.tp = tp
    return out
