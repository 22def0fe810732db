"""Pure-torch paged attention: the CPU path and the reference every fast kernel is tested against.
It gathers each sequence's K/V pages into a contiguous tensor and computes softmax(q k^T) v with the
GQA group folded into the query rows and an explicit offset-causal mask (never SDPA's `is_causal`,
which is top-left aligned and wrong when q_len < kv_len). Softmax runs in float32.

Two layouts, same math: sequences with few query rows (decode, verify, draft) are padded into one
[S, Q, L] batch (Python per sequence would dominate); long prefill chunks loop over sequences so
padding never blows up memory. A mixed step uses both.

StaticTorchAttention (below) is the same math over a DeviceMeta with static shapes only, for CUDA
graphs: the plain-PyTorch graph baseline and the CPU stand-in for the Triton backend."""

from __future__ import annotations

import torch

from flashdraft.attention.base import AttentionBackend, AttentionBatch, DeviceMeta

PADDED_MAX_ELEMENTS = 1 << 24  # S * Q * L of the padded group above this: loop per sequence
SHORT_QUERY = 32  # sequences with at most this many query rows this step may be padded together


def store_plan(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, dst, keep) for storing rows at `slots` where rows with slot -1 store nothing, with no
    data-dependent shapes (graph-safe): such rows rewrite a real row's value to that row's slot
    (identical duplicate writes), or, when no row is real, slot 0's own value back to it."""
    T = slots.shape[0]
    valid = slots >= 0
    first = valid.to(torch.int32).argmax()  # first real row, 0 when there is none
    src = torch.where(valid, torch.arange(T, device=slots.device), first)
    dst = slots[src].clamp(min=0)
    return src, dst, valid[src][:, None, None]


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value: what is stored is saturated there (vLLM's cast)


def to_pages(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows in the pages' dtype: FP8 pages (kv_cache_dtype fp8, scale 1) take them saturated."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8) if dtype == FP8 and x.dtype != FP8 else x.to(dtype)


def from_pages(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Gathered K or V rows in the queries' dtype (FP8 pages widen exactly)."""
    return x.to(dtype) if x.dtype == FP8 else x


def store_rows(k_cache, v_cache, k, v, plan: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    src, dst, keep = plan
    for cache, new in ((k_cache, k), (v_cache, v)):
        flat = cache.view(-1, *cache.shape[2:])
        if flat.dtype == FP8:  # (torch.where does not take float8: select on the bytes)
            rows = to_pages(new[src], FP8).view(torch.uint8)
            flat.view(torch.uint8).index_copy_(0, dst, torch.where(keep, rows, flat.view(torch.uint8)[dst]))
            continue
        flat.index_copy_(0, dst, torch.where(keep, new[src].to(flat.dtype), flat[dst]))


def window_visible(q_pos: torch.Tensor, key_pos: torch.Tensor, window: int, causal: bool) -> torch.Tensor:
    """[..., Q, L] keys inside a sliding window of rows at q_pos [..., Q] (base.py): p - k < window,
    and k - p < window too when the rows are non-causal."""
    d = q_pos[..., :, None] - key_pos
    return (d < window) if causal else (d < window) & (-d < window)


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None, rows_per_kv: int) -> torch.Tensor:
    """softmax over the last dim of scores [..., n_kv, group * rows, L] (rows ordered (group member, row)
    in each kv head), with one more sink logit per query head when sinks [n_kv * group] is given."""
    if sinks is None:
        return scores.softmax(-1)
    n_kv = scores.shape[-3]
    group = sinks.shape[0] // n_kv
    col = sinks.to(scores.dtype).view(n_kv, group, 1).expand(n_kv, group, rows_per_kv).reshape(n_kv, -1, 1)
    full = torch.cat([scores, col.expand(*scores.shape[:-1], 1)], -1)
    return full.softmax(-1)[..., :-1]


def tree_visible(tree_mask: torch.Tensor, key_pos: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """[S, Q, L] visibility of keys key_pos [L] to rows of token trees: tree_mask [S, Q] ancestor bits,
    context [S] keys before each sequence's first query row (all visible); key context + j is
    visible iff bit j is set (base.py)."""
    rel = key_pos[None, None, :] - context[:, None, None]
    bit = tree_mask[:, :, None].bitwise_right_shift(rel.clamp(0, 63)).bitwise_and(1) != 0
    return (rel < 0) | (bit & (rel < 64))


class TorchAttention(AttentionBackend):
    def __init__(self, padded_max_elements: int = PADDED_MAX_ELEMENTS) -> None:
        self.padded_max_elements = padded_max_elements
        self.padded = False

    def prepare(self, batch: AttentionBatch, device: torch.device) -> None:
        # everything is built on the device from one host->device copy of the tables and lengths
        if batch.window is not None and batch.tree_mask is not None:
            raise NotImplementedError("sliding-window attention under token-tree masks")
        bs = batch.block_size
        qsl = batch.query_start_loc
        S = batch.num_seqs
        q_lens = [qsl[s + 1] - qsl[s] for s in range(S)]
        l_max = max(batch.seq_lens)
        n_blk = -(-l_max // bs)
        rows = [t[: n_blk] + [0] * (n_blk - len(t[: n_blk])) for t in batch.block_tables]
        host = torch.tensor([r + [n, q, o] for r, n, q, o in zip(rows, batch.seq_lens, q_lens, qsl[:-1])],
                            dtype=torch.long).to(device, non_blocking=True)
        table, lens, ql, q_off = host[:, :n_blk], host[:, n_blk], host[:, n_blk + 1], host[:, n_blk + 2]
        key_pos = torch.arange(l_max, device=device)
        key_slots = table[:, key_pos // bs] * bs + key_pos % bs  # [S, L]
        # short queries (decode, verify, draft blocks) go through one padded batch; long prefill
        # chunks loop, so one new prompt never drags hundreds of decoding sequences into the loop
        short = sorted((s for s in range(S) if q_lens[s] <= SHORT_QUERY), key=lambda s: q_lens[s])
        # the padded tensors grow with the group's longest query: its longest members go to the
        # loop until it fits (one 25-token prompt must not push 1,000 decoding rows into the loop)
        while short and len(short) * q_lens[short[-1]] * l_max > self.padded_max_elements:
            short.pop()
        q_max = q_lens[short[-1]] if short else 0
        if len(short) < 2:
            short = []
        short.sort()
        in_group = set(short)
        self.looped = [s for s in range(S) if s not in in_group]
        self.padded = bool(short)
        if short:
            idx = torch.tensor(short, device=device) if len(short) < S else torch.arange(S, device=device)
            g_lens, g_ql, g_off = lens[idx], ql[idx], q_off[idx]
            q_idx = torch.arange(q_max, device=device)
            self.key_valid = key_pos[None, :] < g_lens[:, None]
            visible = self.key_valid[:, None, :].expand(len(short), q_max, l_max)
            q_pos = g_lens[:, None] - g_ql[:, None] + q_idx[None, :]  # [S, Q]
            if batch.causal:
                visible = visible & (key_pos[None, None, :] <= q_pos[:, :, None])
            if batch.window is not None:
                visible = visible & window_visible(q_pos, key_pos, batch.window, batch.causal)
            valid = q_idx[None, :] < g_ql[:, None]
            self.q_gather = torch.where(valid, g_off[:, None] + q_idx[None, :], 0).flatten()
            if batch.tree_mask is not None:
                tm = torch.where(valid, batch.tree_mask[self.q_gather].view(len(short), q_max), 0)
                visible = torch.where(tm[:, :, None] != 0,
                                      self.key_valid[:, None, :] & tree_visible(tm, key_pos, g_lens - g_ql), visible)
            # padded query rows attend to key 0; their output is dropped
            self.mask = ~(visible | (~valid[:, :, None] & (key_pos == 0)[None, None, :]))
            self.out_rows = (torch.arange(len(short), device=device)[:, None] * q_max + q_idx[None, :])[valid]
            self.dest_rows = (g_off[:, None] + q_idx[None, :])[valid]
            self.key_slots, self.q_max = key_slots[idx], q_max
        self.slots, self.masks = {}, {}
        for s in self.looped:
            seq_len, q_len = batch.seq_lens[s], q_lens[s]
            self.slots[s] = key_slots[s, :seq_len]
            pos = torch.arange(seq_len, device=device)
            self.masks[s] = None
            if batch.causal and q_len > 1:
                self.masks[s] = pos[None, :] > pos[seq_len - q_len:, None]
                if batch.tree_mask is not None:
                    tm = batch.tree_mask[qsl[s]: qsl[s + 1]][None]
                    tree = ~tree_visible(tm, pos, torch.tensor([seq_len - q_len], device=device))[0]
                    self.masks[s] = torch.where(tm[0, :, None] != 0, tree, self.masks[s])
            if batch.window is not None:
                hidden = ~window_visible(pos[seq_len - q_len:], pos, batch.window, batch.causal)
                self.masks[s] = hidden if self.masks[s] is None else self.masks[s] | hidden

    def store_kv(self, k_cache, v_cache, k, v, batch):
        slots = batch.slot_mapping
        if slots.device.type == "cpu" and bool((slots >= 0).all()):
            for cache, new in ((k_cache, k), (v_cache, v)):
                flat, rows = cache.view(-1, *cache.shape[2:]), to_pages(new, cache.dtype)
                if flat.dtype == FP8:  # (index_copy_ does not take float8 on a CPU: copy the bytes)
                    flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
                flat.index_copy_(0, slots, rows)
        else:  # padding rows (slot -1: placeholder steps, padded eager steps on a GPU) store nothing
            store_rows(k_cache, v_cache, k, v, store_plan(slots))

    def forward(self, q, k_cache, v_cache, batch, scale, sinks=None):
        out = torch.empty_like(q)
        if self.padded:
            out[self.dest_rows] = self._forward_padded(q, k_cache, v_cache, scale, sinks)
        if not self.looped:
            return out
        k_flat = k_cache.view(-1, *k_cache.shape[2:])
        v_flat = v_cache.view(-1, *v_cache.shape[2:])
        n_kv, hd = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // n_kv
        for s in self.looped:
            a, b = batch.query_start_loc[s], batch.query_start_loc[s + 1]
            q_len = b - a
            k = from_pages(k_flat.index_select(0, self.slots[s]), q.dtype).transpose(0, 1)  # [n_kv, L, hd]
            v = from_pages(v_flat.index_select(0, self.slots[s]), q.dtype).transpose(0, 1)
            # rows ordered (group member, query row) inside each kv head
            qg = q[a:b].view(q_len, n_kv, group, hd).permute(1, 2, 0, 3).reshape(n_kv, group * q_len, hd)
            scores = torch.matmul(qg, k.transpose(1, 2))
            scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale  # float64 stays float64
            if self.masks[s] is not None:
                scores.masked_fill_(self.masks[s].repeat(group, 1), float("-inf"))
            o = torch.matmul(softmax_with_sinks(scores, sinks, q_len).to(v.dtype), v)
            out[a:b] = o.view(n_kv, group, q_len, hd).permute(2, 0, 1, 3).reshape(q_len, n_kv * group, hd)
        return out

    def _forward_padded(self, q, k_cache, v_cache, scale, sinks=None):
        n_kv, hd = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // n_kv
        S, L = self.key_slots.shape
        Q = self.q_max
        k = from_pages(k_cache.view(-1, n_kv, hd)[self.key_slots], q.dtype).permute(0, 2, 1, 3)  # [S, n_kv, L, hd]
        v = from_pages(v_cache.view(-1, n_kv, hd)[self.key_slots], q.dtype)
        # padding keys point at other sequences' pages: zero them so a non-finite value there
        # cannot leak through a zero attention weight (0 * inf = nan)
        v = torch.where(self.key_valid[:, :, None, None], v, 0).permute(0, 2, 1, 3)
        qp = q[self.q_gather].view(S, Q, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(S, n_kv, group * Q, hd)
        scores = torch.matmul(qp, k.transpose(-1, -2))  # [S, n_kv, group*Q, L]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
        scores.masked_fill_(self.mask.repeat(1, group, 1)[:, None], float("-inf"))
        o = torch.matmul(softmax_with_sinks(scores, sinks, Q).to(v.dtype), v)  # [S, n_kv, group*Q, hd]
        o = o.view(S, n_kv, group, Q, hd).permute(0, 3, 1, 2, 4).reshape(S * Q, n_kv * group, hd)
        return o[self.out_rows]


class StaticTorchAttention(AttentionBackend):
    """Pure-torch paged attention over a DeviceMeta with static shapes only: every sequence gathers
    all `max_blocks` pages of its table (keys past seq_len masked), query rows are padded to
    max_query_len per sequence, and nothing reads a value back to the host. One step can therefore
    be captured in a CUDA graph; it is the "plain PyTorch + CUDA graph" baseline and the CPU
    stand-in for the Triton backend. Same math as TorchAttention (float32 softmax, GQA folded into
    the query rows, offset-causal mask).

    `set_meta(meta)` installs the step description; the derived index tensors are built at the
    first forward after it (inside a captured graph, that build is part of the graph). Refill a
    meta in place only together with a new set_meta call outside graphs. store_kv takes the slots
    from its `batch` argument (an AttentionBatch or a DeviceMeta; the installed meta when None);
    rows with slot -1 are not stored. Output rows past the last sequence's rows are zero."""

    def __init__(self) -> None:
        self.meta: DeviceMeta | None = None
        self._plan: dict | None = None
        self._store: tuple | None = None

    def prepare(self, batch: AttentionBatch, device: torch.device) -> None:
        self.set_meta(DeviceMeta.from_batch(batch, device))

    def set_meta(self, meta: DeviceMeta) -> None:
        self.meta = meta
        self._plan = None
        self._store = None

    # ---- store -----------------------------------------------------------------------------------
    def store_kv(self, k_cache, v_cache, k, v, batch):
        slots = (batch if batch is not None else self.meta).slot_mapping
        if self._store is None or self._store[0] is not slots:  # planned once per slot tensor
            self._store = (slots, store_plan(slots))
        store_rows(k_cache, v_cache, k, v, self._store[1])

    # ---- attention -------------------------------------------------------------------------------
    def _build_plan(self, device: torch.device, group: int) -> dict:
        m = self.meta
        S, n_blk = m.block_tables.shape
        bs, Q, T = m.block_size, m.max_query_len, m.slot_mapping.shape[0]
        L = max(1, min(n_blk * bs, m.max_seq_len))
        key_pos = torch.arange(L, device=device)
        table = m.block_tables.long().clamp(min=0)
        key_slots = table[:, key_pos // bs] * bs + key_pos % bs  # [S, L]
        lens = m.seq_lens.long()
        qsl = m.query_start_loc.long()
        q_lens = qsl[1:] - qsl[:-1]
        key_valid = key_pos[None, :] < lens[:, None]  # [S, L]
        q_idx = torch.arange(Q, device=device)
        visible = key_valid[:, None, :].expand(S, Q, L)
        q_pos = lens[:, None] - q_lens[:, None] + q_idx[None, :]  # [S, Q]
        if m.causal:
            visible = visible & (key_pos[None, None, :] <= q_pos[:, :, None])
        if m.window is not None:
            if m.tree_mask is not None:
                raise NotImplementedError("sliding-window attention under token-tree masks")
            visible = visible & window_visible(q_pos, key_pos, m.window, m.causal)
        q_gather = (qsl[:-1, None] + q_idx[None, :]).clamp(max=max(T - 1, 0)).flatten()
        if m.causal and m.tree_mask is not None:
            tm = torch.where(q_idx[None, :] < q_lens[:, None], m.tree_mask[q_gather].view(S, Q), 0)
            visible = torch.where(tm[:, :, None] != 0, key_valid[:, None, :] & tree_visible(tm, key_pos, lens - q_lens),
                                  visible)
        rows = torch.arange(T, device=device)
        seq_of_row = torch.searchsorted(qsl[1:].contiguous(), rows, right=True).clamp(max=S - 1)
        local = rows - qsl[seq_of_row]
        row_valid = (rows < qsl[S]) & (local < Q)
        out_rows = (seq_of_row * Q + local.clamp(0, Q - 1))
        masked = (~visible).repeat(1, group, 1)[:, None]  # rows ordered (group member, query row)
        return dict(S=S, Q=Q, key_slots=key_slots, key_valid=key_valid[:, :, None, None], masked=masked,
                    q_gather=q_gather, out_rows=out_rows, row_valid=row_valid[:, None, None])

    def forward(self, q, k_cache, v_cache, batch, scale, sinks=None):
        n_kv, hd = k_cache.shape[2], k_cache.shape[3]
        group = q.shape[1] // n_kv
        if self._plan is None or self._plan["group"] != group:
            self._plan = self._build_plan(q.device, group) | {"group": group}
        p = self._plan
        S, Q = p["S"], p["Q"]
        k = from_pages(k_cache.view(-1, n_kv, hd)[p["key_slots"]], q.dtype).permute(0, 2, 1, 3)  # [S, n_kv, L, hd]
        # keys past seq_len are other pages' data: zero V so a non-finite value cannot leak
        v = torch.where(p["key_valid"], from_pages(v_cache.view(-1, n_kv, hd)[p["key_slots"]], q.dtype), 0
                        ).permute(0, 2, 1, 3)
        qp = q[p["q_gather"]].view(S, Q, n_kv, group, hd).permute(0, 2, 3, 1, 4).reshape(S, n_kv, group * Q, hd)
        scores = torch.matmul(qp, k.transpose(-1, -2))  # [S, n_kv, group*Q, L]
        scores = scores.to(torch.promote_types(scores.dtype, torch.float32)) * scale
        # a large finite fill (not -inf): rows with no visible key (padding sequences) get a uniform
        # softmax over zeroed V instead of NaN; masked_fill also overwrites non-finite scores
        scores.masked_fill_(p["masked"], -1e30)
        o = torch.matmul(softmax_with_sinks(scores, sinks, Q).to(v.dtype), v)  # [S, n_kv, group*Q, hd]
        o = o.view(S, n_kv, group, Q, hd).permute(0, 3, 1, 2, 4).reshape(S * Q, n_kv * group, hd)
        return torch.where(p["row_valid"], o[p["out_rows"]], 0)
