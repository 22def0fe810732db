"""Pure-torch paged attention: the CPU path and the reference every fast kernel is tested against.
Per sequence it gathers the K/V pages into a contiguous tensor and computes softmax(q k^T) v with
the GQA group folded into the query rows and an explicit offset-causal mask (never SDPA's
`is_causal`, which is top-left aligned and wrong when q_len < kv_len). Softmax runs in float32."""

from __future__ import annotations

import torch

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
                self._masks.append((torch.arange(seq_len)[None, :] > q_pos[:, None]).to(device))
            else:
                self._masks.append(None)

    def store_kv(self, k_cache, v_cache, k, v, batch):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, batch.slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, batch.slot_mapping, v)

    def forward(self, q, k_cache, v_cache, batch, scale):
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        n_kv, hd = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // n_kv
        out = torch.empty_like(q)
        for s in range(batch.num_seqs):
            a, b = batch.query_start_loc[s], batch.query_start_loc[s + 1]
            q_len = b - a
            k = k_flat.index_select(0, self._slots[s]).transpose(0, 1)  # [n_kv, L, hd]
            v = v_flat.index_select(0, self._slots[s]).transpose(0, 1)
            # rows ordered (group member, query row) inside each kv head
            qg = q[a:b].view(q_len, n_kv, group, hd).permute(1, 2, 0, 3).reshape(n_kv, group * q_len, hd)
            scores = torch.matmul(qg, k.transpose(1, 2)).float() * scale
            if self._masks[s] is not None:
                scores.masked_fill_(self._masks[s].repeat(group, 1), float("-inf"))
            o = torch.matmul(scores.softmax(-1).to(v.dtype), v)
            out[a:b] = o.view(n_kv, group, q_len, hd).permute(2, 0, 1, 3).reshape(q_len, n_kv * group, hd)
        return out
