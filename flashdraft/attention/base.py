"""The attention backend interface. Every attention call in flashdraft reads a paged KV cache
through one `AttentionBatch`, built once per step by the model runner.

Query rows of sequence s are the last `query_lens[s]` positions of its `seq_lens[s]` keys (the
tokens of this step are stored before attention runs). Causal: a row at position p sees keys
[0, p]. Non-causal (the DFlash draft block): every row of s sees all `seq_lens[s]` keys.

Token trees (speculative/tree.py): `tree_mask[t]`, when given and non-zero for row t, replaces the causal
rule for that row: it sees every key before its sequence's first query row (the context) and, of
the step's own rows of its sequence, row j iff bit j of the mask is set. Zero keeps the causal rule
(prefill chunks and decode rows beside tree verifies).

Sliding window: with `window` W set, a row at position p sees key k only when p - k < W, and, when
non-causal, k - p < W too (the DFlash reference's sliding drafter layers).

Attention sinks (GPT-OSS): `sinks` [n_heads], when given to forward, is one more logit per head in every
row's softmax, in the units of the scaled scores, whose value is zero: softmax([q k^T * scale, sink])
with the sink's share dropped."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch


@dataclass
class AttentionBatch:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (block * block_size + offset)
    query_start_loc: list[int]  # [S+1] row offsets of each sequence in the flattened batch
    seq_lens: list[int]  # [S] keys visible to sequence s, this step's tokens included
    block_tables: list[list[int]]  # [S][n] KV blocks of each sequence
    block_size: int
    causal: bool = True
    tree_mask: torch.Tensor | None = None  # [T] int64 ancestor bits per row (module docstring)
    window: int | None = None  # sliding window (module docstring)
    recurrent: object | None = None  # hybrid targets: models.hybrid.RecurrentRows of the step

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass
class DeviceMeta:
    """The same step description as device tensors only, for kernels and CUDA graphs: a graph
    runner owns one of these as static buffers and refills it in place before each replay.
    Padding sequences have seq_len 0 and no query rows; padding rows have slot -1 (not stored)."""

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not store
    query_start_loc: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32
    max_query_len: int  # static bound on query rows per sequence
    max_seq_len: int  # static bound on seq_lens (sizes split-K grids)
    block_size: int
    causal: bool = True
    tree_mask: torch.Tensor | None = None  # [T] int64, as in AttentionBatch
    window: int | None = None  # as in AttentionBatch
    recurrent: torch.Tensor | None = None  # hybrid targets: [S, 3] int32 (slot, fresh, keep), kernels/gdn_ops.py

    @classmethod
    def from_batch(cls, batch: AttentionBatch, device: torch.device, max_blocks: int | None = None) -> DeviceMeta:
        """The list-based batch as device tensors, through one host->device copy; tables are padded
        to max_blocks (default: the longest table)."""
        S, qsl = batch.num_seqs, batch.query_start_loc
        width = max_blocks or max([len(t) for t in batch.block_tables] + [1])
        # each part starts 16-byte aligned whatever S is: kernels are compiled per pointer alignment,
        # so a batch-size-dependent offset would compile new variants mid-serving
        a_lens = -(-(S + 1) // 4) * 4
        a_tables = a_lens + -(-S // 4) * 4
        host = list(qsl) + [0] * (a_lens - S - 1) + list(batch.seq_lens) + [0] * (a_tables - a_lens - S)
        for t in batch.block_tables:
            host += list(t[:width]) + [0] * (width - len(t[:width]))
        packed = torch.tensor(host, dtype=torch.int32, pin_memory=torch.device(device).type == "cuda")
        packed = packed.to(device, non_blocking=True)  # from pinned memory: no wait for queued work
        return cls(slot_mapping=batch.slot_mapping.to(device=device, dtype=torch.long),
                   query_start_loc=packed[: S + 1], seq_lens=packed[a_lens: a_lens + S],
                   block_tables=packed[a_tables:].view(S, width),
                   max_query_len=max([qsl[s + 1] - qsl[s] for s in range(S)] + [1]),
                   max_seq_len=max(list(batch.seq_lens) + [1]), block_size=batch.block_size, causal=batch.causal,
                   tree_mask=None if batch.tree_mask is None else batch.tree_mask.to(device), window=batch.window)


class AttentionBackend(ABC):
    """Stores new K/V into a paged cache and attends over it."""

    def prepare(self, batch: AttentionBatch, device: torch.device) -> None:
        """Build per-step metadata once, before the layers run."""

    @abstractmethod
    def store_kv(self, k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, batch: AttentionBatch) -> None:
        """k, v: [T, n_kv, head_dim]; caches: [num_blocks, block_size, n_kv, head_dim]."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                batch: AttentionBatch, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, n_heads, head_dim] -> [T, n_heads, head_dim]."""


class LayerMasks(AttentionBackend):
    """Backends for a layer stack whose layers attend under different masks (a DFlash drafter with
    causal or sliding-window layers): one backend per distinct (causal, window), each prepared with
    (or installed) the step's batch under that mask. Keys are stored the same way by all of them."""

    def __init__(self, make: Callable[[], AttentionBackend], masks: list[tuple[bool, int | None]]):
        self.masks = list(masks)
        self.by_mask = {m: make() for m in dict.fromkeys(self.masks)}

    def layer(self, i: int) -> AttentionBackend:
        return self.by_mask[self.masks[i]]

    @property
    def meta(self):
        return next(iter(self.by_mask.values())).meta

    def prepare(self, batch: AttentionBatch, device: torch.device) -> None:
        for (causal, window), backend in self.by_mask.items():
            backend.prepare(replace(batch, causal=causal, window=window), device)

    def set_meta(self, meta: DeviceMeta) -> None:
        for (causal, window), backend in self.by_mask.items():
            backend.set_meta(replace(meta, causal=causal, window=window))

    def store_kv(self, k_cache, v_cache, k, v, batch) -> None:
        next(iter(self.by_mask.values())).store_kv(k_cache, v_cache, k, v, batch)

    def forward(self, q, k_cache, v_cache, batch, scale, sinks=None):
        raise TypeError("LayerMasks attends through layer(i)")


def layer_backend(attn: AttentionBackend, i: int) -> AttentionBackend:
    """The backend layer i of a stack attends with: LayerMasks' per-layer choice, else attn itself."""
    return attn.layer(i) if isinstance(attn, LayerMasks) else attn
