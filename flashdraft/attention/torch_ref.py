"""Pure-torch paged attention: the CPU path and the reference every fast kernel is tested against.
It gathers each sequence's K/V pages into a contiguous tensor and computes softmax(q k^T) v with the
GQA group folded into the query rows and an explicit offset-causal mask (never SDPA's `is_causal`,
which is top-left aligned and wrong when q_len < kv_len). Softmax runs in float32.

Two layouts, same math: many short sequences are padded into one [S, Q, L] batch (Python per
sequence would dominate); large ones loop over sequences so padding never blows up memory."""

from __future__ import annotations

import torch

from flashdraft.attention.base import AttentionBackend, AttentionBatch

PADDED_MAX_ELEMENTS = 1 << 22  # S * Q_max * L_max above this: loop per sequence


class TorchAttention(AttentionBackend):
    def __init__(self, padded_max_elements: int = PADDED_MAX_ELEMENTS) -> None:
        self.padded_max_elements = padded_max_elements
        self.padded = False

    def prepare(self, batch: AttentionBatch, device: torch.device) -> None:
        bs = batch.block_size
        qsl = batch.query_start_loc
        q_lens = [qsl[s + 1] - qsl[s] for s in range(batch.num_seqs)]
        q_max, l_max = max(q_lens), max(batch.seq_lens)
        self.padded = batch.num_seqs > 1 and batch.num_seqs * q_max * l_max <= self.padded_max_elements
        slots = []
        for s, seq_len in enumerate(batch.seq_lens):
            blocks = torch.tensor(batch.block_tables[s][: -(-seq_len // bs)], dtype=torch.long)
            slots.append((blocks[:, None] * bs + torch.arange(bs)).flatten()[:seq_len])
        if self.padded:
            S = batch.num_seqs
            lens = torch.tensor(batch.seq_lens)
            ql = torch.tensor(q_lens)
            self.key_slots = torch.nn.utils.rnn.pad_sequence(slots, batch_first=True).to(device)
            key_pos = torch.arange(l_max)
            q_idx = torch.arange(q_max)
            visible = key_pos[None, None, :] < lens[:, None, None]  # [S, 1, L]
            if batch.causal:
                q_pos = lens[:, None] - ql[:, None] + q_idx[None, :]  # [S, Q]
                visible = visible & (key_pos[None, None, :] <= q_pos[:, :, None])
            visible = visible.expand(S, q_max, l_max).clone()
            visible[:, :, 0] = True  # padded query rows attend to something; their output is dropped
            self.mask = ~visible  # True = hidden
            rows = torch.tensor(qsl[:-1])[:, None] + q_idx[None, :]
            valid = q_idx[None, :] < ql[:, None]
            self.q_gather = torch.where(valid, rows, 0).flatten().to(device)  # padded layout <- flat rows
            self.out_rows = (torch.arange(S)[:, None] * q_max + q_idx[None, :])[valid].to(device)
            self.mask = self.mask.to(device)
            self.q_max = q_max
        else:
            self.slots = [s.to(device) for s in slots]
            self.masks = []
            for s, seq_len in enumerate(batch.seq_lens):
                q_len = q_lens[s]
                if batch.causal and q_len > 1:
                    q_pos = torch.arange(seq_len - q_len, seq_len)
                    self.masks.append((torch.arange(seq_len)[None, :] > q_pos[:, None]).to(device))
                else:
                    self.masks.append(None)

    def store_kv(self, k_cache, v_cache, k, v, batch):
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, batch.slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, batch.slot_mapping, v)

    def forward(self, q, k_cache, v_cache, batch, scale):
        if self.padded:
            return self._forward_padded(q, k_cache, v_cache, scale)
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        n_kv, hd = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // n_kv
        out = torch.empty_like(q)
        for s in range(batch.num_seqs):
            a, b = batch.query_start_loc[s], batch.query_start_loc[s + 1]
            q_len = b - a
            k = k_flat.index_select(0, self.slots[s]).transpose(0, 1)  # [n_kv, L, hd]
            v = v_flat.index_select(0, self.slots[s]).transpose(0, 1)
            # rows ordered (group member, query row) inside each kv head
            qg = q[a:b].view(q_len, n_kv, group, hd).permute(1, 2, 0, 3).reshape(n_kv, group * q_len, hd)
            scores = torch.matmul(qg, k.transpose(1, 2)).float() * scale
            if self.masks[s] is not None:
                scores.masked_fill_(self.masks[s].repeat(group, 1), float("-inf"))
            o = torch.matmul(scores.softmax(-1).to(v.dtype), v)
            out[a:b] = o.view(n_kv, group, q_len, hd).permute(2, 0, 1, 3).reshape(q_len, n_kv * group, hd)
        return out

    def _forward_padded(self, q, k_cache, v_cache, scale):
        n_kv, hd = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // n_kv
        S, L = self.key_slots.shape
        Q = self.q_max
        k = k_cache.view(-1, n_kv, hd)[self.key_slots].permute(0, 2, 1, 3)  # [S, n_kv, L, hd]
        v = v_cache.view(-1, n_kv, hd)[self.key_slots].permute(0, 2, 1, 3)
        qp = q[self.q_gather].view(S, Q, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(S, n_kv, group * Q, hd)
        scores = torch.matmul(qp, k.transpose(-1, -2)).float() * scale  # [S, n_kv, group*Q, L]
        scores.masked_fill_(self.mask.repeat(1, group, 1)[:, None], float("-inf"))
        o = torch.matmul(scores.softmax(-1).to(v.dtype), v)  # [S, n_kv, group*Q, hd]
        o = o.view(S, n_kv, group, Q, hd).permute(0, 3, 1, 2, 4).reshape(S * Q, n_kv * group, hd)
        return o[self.out_rows]
