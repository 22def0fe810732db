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
        # everything is built on the device from one host->device copy of the tables and lengths
        bs = batch.block_size
        qsl = batch.query_start_loc
        S = batch.num_seqs
        q_lens = [qsl[s + 1] - qsl[s] for s in range(S)]
        q_max, l_max = max(q_lens), max(batch.seq_lens)
        n_blk = -(-l_max // bs)
        rows = [t[: n_blk] + [0] * (n_blk - len(t[: n_blk])) for t in batch.block_tables]
        host = torch.tensor([r + [n, q, o] for r, n, q, o in zip(rows, batch.seq_lens, q_lens, qsl[:-1])],
                            dtype=torch.long).to(device, non_blocking=True)
        table, lens, ql, q_off = host[:, :n_blk], host[:, n_blk], host[:, n_blk + 1], host[:, n_blk + 2]
        key_pos = torch.arange(l_max, device=device)
        key_slots = table[:, key_pos // bs] * bs + key_pos % bs  # [S, L]
        self.key_valid = key_pos[None, :] < lens[:, None]
        self.padded = S > 1 and S * q_max * l_max <= self.padded_max_elements
        if self.padded:
            q_idx = torch.arange(q_max, device=device)
            visible = self.key_valid[:, None, :].expand(S, q_max, l_max)
            if batch.causal:
                q_pos = lens[:, None] - ql[:, None] + q_idx[None, :]  # [S, Q]
                visible = visible & (key_pos[None, None, :] <= q_pos[:, :, None])
            # padded query rows attend to key 0; their output is dropped
            self.mask = ~(visible | (key_pos == 0)[None, None, :])
            valid = q_idx[None, :] < ql[:, None]
            self.q_gather = torch.where(valid, q_off[:, None] + q_idx[None, :], 0).flatten()
            self.out_rows = (torch.arange(S, device=device)[:, None] * q_max + q_idx[None, :])[valid]
            self.key_slots, self.q_max = key_slots, q_max
        else:
            self.slots = [key_slots[s, :n] for s, n in enumerate(batch.seq_lens)]
            self.masks = []
            for s, seq_len in enumerate(batch.seq_lens):
                q_len = q_lens[s]
                if batch.causal and q_len > 1:
                    pos = torch.arange(seq_len, device=device)
                    self.masks.append(pos[None, :] > pos[seq_len - q_len:, None])
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
        v = v_cache.view(-1, n_kv, hd)[self.key_slots]
        # padding keys point at other sequences' pages: zero them so a non-finite value there
        # cannot leak through a zero attention weight (0 * inf = nan)
        v = torch.where(self.key_valid[:, :, None, None], v, 0).permute(0, 2, 1, 3)
        qp = q[self.q_gather].view(S, Q, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(S, n_kv, group * Q, hd)
        scores = torch.matmul(qp, k.transpose(-1, -2)).float() * scale  # [S, n_kv, group*Q, L]
        scores.masked_fill_(self.mask.repeat(1, group, 1)[:, None], float("-inf"))
        o = torch.matmul(scores.softmax(-1).to(v.dtype), v)  # [S, n_kv, group*Q, hd]
        o = o.view(S, n_kv, group, Q, hd).permute(0, 3, 1, 2, 4).reshape(S * Q, n_kv * group, hd)
        return o[self.out_rows]
