"""Pure-torch paged attention: the CPU path and the reference every fast kernel is tested against.
Per sequence it gathers the K/V pages into a contiguous tensor and calls SDPA with an explicit
offset-causal mask (SDPA's `is_causal` is top-left aligned, wrong when q_len < kv_len)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flashdraft.attention.base import AttentionBackend, AttentionBatch


class TorchAttention(AttentionBackend):
    def __init__(self) -> None:
        self._slots: list[torch.Tensor] = []
        self._masks: list[torch.Tensor | None] = []

    def prepare(self, batch: AttentionBatch, device: torch.device) -> None:
        bs = batch.block_size
        self._slots, self._masks = [], []
        for s, seq_len in enumerate(batch.seq_lens):
            blocks = torch.tensor(batch.block_tables[s][: -(-seq_len // bs)], dtype=torch.long)
            slots = (blocks[:, None] * bs + torch.arange(bs)).flatten()[:seq_len]
            self._slots.append(slots.to(device))
            q_len = batch.query_start_loc[s + 1] - batch.query_start_loc[s]
            if batch.causal and q_len > 1:
                q_pos = torch.arange(seq_len - q_len, seq_len)
                self._masks.append((torch.arange(seq_len)[None, :] <= q_pos[:, None]).to(device))
            else:
                self._masks.append(None)

    def store_kv(self, k_cache, v_cache, k, v, batch):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, batch.slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, batch.slot_mapping, v)

    def forward(self, q, k_cache, v_cache, batch, scale):
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        out = torch.empty_like(q)
        group = q.shape[1] // k_cache.shape[2]
        for s in range(batch.num_seqs):
            a, b = batch.query_start_loc[s], batch.query_start_loc[s + 1]
            k = k_flat.index_select(0, self._slots[s]).transpose(0, 1)
            v = v_flat.index_select(0, self._slots[s]).transpose(0, 1)
            if group > 1:
                k = k.repeat_interleave(group, dim=0)
                v = v.repeat_interleave(group, dim=0)
            o = F.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), k, v, attn_mask=self._masks[s], scale=scale)
            out[a:b] = o.transpose(0, 1)
        return out
