"""The Triton attention backend: `AttentionBackend` over the paged-attention kernels of kernels/attention.py
(CUDA, or CPU tensors under TRITON_INTERPRET=1). Importing this module needs triton."""

from __future__ import annotations

import torch

from flashdraft.attention.base import AttentionBackend, AttentionBatch, DeviceMeta
from flashdraft.kernels.attention import paged_attention, store_kv


class TritonAttention(AttentionBackend):
    """Triton kernels over a DeviceMeta, built by `prepare` or installed by a graph runner with
    `set_meta`. With an installed meta, output rows past its last sequence (a graph bucket's
    padding rows) are zero; `batch` arguments are then ignored except as store_kv describes."""

    def __init__(self) -> None:
        self.meta: DeviceMeta | None = None
        self.zero_padding_rows = False

    def prepare(self, batch: AttentionBatch, device: torch.device) -> None:
        self.meta = DeviceMeta.from_batch(batch, device)
        self.zero_padding_rows = False  # every row of a built batch belongs to a sequence

    def set_meta(self, meta: DeviceMeta) -> None:
        self.meta = meta
        self.zero_padding_rows = True

    def store_kv(self, k_cache, v_cache, k, v, batch):
        """Slots: a DeviceMeta's or a store-only AttentionBatch's own (no sequences: the DFlash
        context write), else the installed meta's (None included)."""
        if isinstance(batch, DeviceMeta) or (batch is not None and (batch.num_seqs == 0 or self.meta is None)):
            slots = batch.slot_mapping
        else:
            slots = self.meta.slot_mapping
        store_kv(k_cache, v_cache, k, v, slots)

    def forward(self, q, k_cache, v_cache, batch, scale, sinks=None):
        if self.meta is None:
            self.prepare(batch, q.device)
        return paged_attention(q, k_cache, v_cache, self.meta, scale, zero_padding=self.zero_padding_rows,
                               sinks=sinks)
