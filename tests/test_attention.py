"""The torch attention backend against a float64 dense computation, both layouts, ragged batches,
causal (prefill chunk / decode / verify) and non-causal (draft block), GQA, shuffled pages; the
static-shape backend (CUDA-graph baseline) against it, with padding sequences and padding rows."""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.attention.base import AttentionBatch, DeviceMeta
from flashdraft.attention.torch_ref import StaticTorchAttention, TorchAttention


def reference(q, keys, vals, q_lens, seq_lens, causal, scale, tree_mask=None, window=None, sinks=None):
    """tree_mask: per row, None (the causal rule) or the set of the step's own rows it sees; window: a
    sliding window (keys p - k >= window hidden, and k - p >= window when non-causal)."""
    out = []
    row = 0
    for k, v, ql, sl in zip(keys, vals, q_lens, seq_lens):
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, 1)
        vv = v.double().repeat_interleave(group, 1)
        for i in range(ql):
            s = torch.einsum("hd,lhd->hl", q[row + i].double(), kk) * scale
            if tree_mask is not None and tree_mask[row + i] is not None:
                hidden = [sl - ql + j for j in range(ql) if j not in tree_mask[row + i]]
                s[:, hidden] = float("-inf")
            elif causal:
                s[:, sl - ql + i + 1:] = float("-inf")
            if window is not None:
                p = sl - ql + i
                far = [k for k in range(sl) if p - k >= window or (not causal and k - p >= window)]
                s[:, far] = float("-inf")
            if sinks is not None:  # one more logit per head, of value zero
                s = torch.cat([s, sinks.double()[:, None]], 1)
                vv_ = torch.cat([vv, vv.new_zeros(1, *vv.shape[1:])])
                out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv_))
                continue
            out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
        row += ql
    return torch.stack(out)


@pytest.mark.parametrize("window, sinks", [(None, False), (3, False), (9, False), (None, True), (5, True)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded_limit", [0, 1 << 22])
@pytest.mark.parametrize("q_lens, ctx", [([1, 1, 1], [5, 17, 33]), ([4, 4], [0, 21]), ([7, 1, 4], [0, 30, 9]),
                                         ([16], [40]), ([1, 40, 1, 3], [20, 0, 9, 50])])
def test_backend_matches_float64(causal, padded_limit, q_lens, ctx, window, sinks):
    torch.manual_seed(0)
    bs, n_blocks, n_kv, group, hd = 4, 64, 2, 3, 8
    k_cache = torch.randn(n_blocks, bs, n_kv, hd)
    v_cache = torch.randn(n_blocks, bs, n_kv, hd)
    free = list(range(n_blocks))
    random.Random(1).shuffle(free)
    tables, seq_lens, slots, keys, vals = [], [], [], [], []
    q = torch.randn(sum(q_lens), n_kv * group, hd)
    new_k = torch.randn(sum(q_lens), n_kv, hd)
    new_v = torch.randn(sum(q_lens), n_kv, hd)
    row = 0
    for ql, c in zip(q_lens, ctx):
        sl = c + ql
        table = [free.pop() for _ in range(-(-sl // bs))]
        tables.append(table)
        seq_lens.append(sl)
        slots += [table[p // bs] * bs + p % bs for p in range(c, sl)]
        flat_k = k_cache.view(-1, n_kv, hd)
        flat_v = v_cache.view(-1, n_kv, hd)
        idx = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)], dtype=torch.long)
        keys.append(torch.cat([flat_k[idx], new_k[row:row + ql]]))
        vals.append(torch.cat([flat_v[idx], new_v[row:row + ql]]))
        row += ql
    qsl = [0]
    for ql in q_lens:
        qsl.append(qsl[-1] + ql)
    batch = AttentionBatch(torch.tensor(slots), qsl, seq_lens, tables, bs, causal, window=window)
    be = TorchAttention(padded_max_elements=padded_limit)
    be.prepare(batch, torch.device("cpu"))
    assert be.padded == (padded_limit > 0 and sum(q <= 32 for q in q_lens) > 1)
    be.store_kv(k_cache, v_cache, new_k, new_v, batch)
    sink = torch.randn(n_kv * group) * 2 if sinks else None
    got = be.forward(q, k_cache, v_cache, batch, hd**-0.5, sink)
    want = reference(q, keys, vals, q_lens, seq_lens, causal, hd**-0.5, window=window, sinks=sink)
    assert (got.double() - want).abs().max() < 1e-5


@pytest.mark.parametrize("padded_limit", [0, 1 << 22])
def test_backend_token_trees_match_float64(padded_limit):
    """Tree verify blocks (rows see the context and their ancestors' rows) beside a causal prefill
    chunk and a decode row, in one step."""
    torch.manual_seed(3)
    bs, n_blocks, n_kv, group, hd = 4, 64, 2, 2, 8
    parents = [[0, 0, 1, 1, 2, 4, 3], [0, 1, 2, 0, 4], None, None]  # None: a causal sequence
    q_lens, ctx = [8, 6, 9, 1], [13, 0, 5, 22]
    k_cache, v_cache = torch.randn(n_blocks, bs, n_kv, hd), torch.randn(n_blocks, bs, n_kv, hd)
    free = list(range(n_blocks))
    random.Random(4).shuffle(free)
    q = torch.randn(sum(q_lens), n_kv * group, hd)
    new_k, new_v = torch.randn(sum(q_lens), n_kv, hd), torch.randn(sum(q_lens), n_kv, hd)
    tables, seq_lens, slots, keys, vals, sees, masks, qsl = [], [], [], [], [], [], [], [0]
    for par, ql, c in zip(parents, q_lens, ctx):
        sl = c + ql
        table = [free.pop() for _ in range(-(-sl // bs))]
        tables.append(table)
        seq_lens.append(sl)
        slots += [table[p // bs] * bs + p % bs for p in range(c, sl)]
        idx = torch.tensor([table[p // bs] * bs + p % bs for p in range(c)], dtype=torch.long)
        keys.append(torch.cat([k_cache.view(-1, n_kv, hd)[idx], new_k[qsl[-1]: qsl[-1] + ql]]))
        vals.append(torch.cat([v_cache.view(-1, n_kv, hd)[idx], new_v[qsl[-1]: qsl[-1] + ql]]))
        qsl.append(qsl[-1] + ql)
        if par is None:
            sees += [None] * ql
            masks += [0] * ql
            continue
        for i in range(ql):  # row i's ancestors, itself included, by walking the parents
            rows, r = {i}, i
            while r:
                r = par[r - 1]
                rows.add(r)
            sees.append(rows)
            masks.append(sum(1 << j for j in rows))
    batch = AttentionBatch(torch.tensor(slots), qsl, seq_lens, tables, bs, True, torch.tensor(masks))
    be = TorchAttention(padded_max_elements=padded_limit)
    be.prepare(batch, torch.device("cpu"))
    be.store_kv(k_cache, v_cache, new_k, new_v, batch)
    got = be.forward(q, k_cache, v_cache, batch, hd**-0.5)
    want = reference(q, keys, vals, q_lens, seq_lens, True, hd**-0.5, sees)
    assert (got.double() - want).abs().max() < 1e-5
    causal = reference(q, keys, vals, q_lens, seq_lens, True, hd**-0.5)
    assert (got.double() - causal)[:14].abs().max() > 1e-2  # the tree rows differ from a causal read


def _paged_case(q_lens, ctx, causal, bs=4, n_blocks=64, n_kv=2, group=3, hd=8, seed=0, window=None):
    """Random caches with shuffled pages, and a ragged step over them."""
    torch.manual_seed(seed)
    k_cache = torch.randn(n_blocks, bs, n_kv, hd)
    v_cache = torch.randn(n_blocks, bs, n_kv, hd)
    free = list(range(n_blocks))
    random.Random(seed + 1).shuffle(free)
    tables, seq_lens, slots, qsl = [], [], [], [0]
    for ql, c in zip(q_lens, ctx):
        sl = c + ql
        table = [free.pop() for _ in range(-(-sl // bs) + 1)]  # one page more than needed, like a draft block
        tables.append(table)
        seq_lens.append(sl)
        slots += [table[p // bs] * bs + p % bs for p in range(c, sl)]
        qsl.append(qsl[-1] + ql)
    T = sum(q_lens)
    q, k, v = torch.randn(T, n_kv * group, hd), torch.randn(T, n_kv, hd), torch.randn(T, n_kv, hd)
    batch = AttentionBatch(torch.tensor(slots, dtype=torch.long), qsl, seq_lens, tables, bs, causal, window=window)
    return k_cache, v_cache, q, k, v, batch, free


@pytest.mark.parametrize("window, sinks", [(None, False), (5, False), (5, True)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("q_lens, ctx", [([1, 1, 1], [5, 17, 33]), ([16, 16], [0, 21]), ([16, 16, 16], [40, 3, 9]),
                                         ([7, 1, 4], [0, 30, 9])])
def test_static_backend_matches_torch(causal, q_lens, ctx, window, sinks):
    """Bucketed static shapes: a padding sequence (seq_len 0, no rows) in the middle and at the end,
    padding rows (slot -1) after the real ones, more pages per table than needed, and padding table
    entries pointing at a NaN page that no real sequence owns."""
    k_cache, v_cache, q, k, v, batch, free = _paged_case(q_lens, ctx, causal, window=window)
    hd = q.shape[-1]
    poison = free.pop()
    k_cache[poison] = float("nan")
    v_cache[poison] = float("nan")
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = TorchAttention()
    ref.prepare(batch, torch.device("cpu"))
    ref.store_kv(ref_k, ref_v, k, v, batch)
    sink = torch.randn(q.shape[1]) * 2 if sinks else None
    want = ref.forward(q, ref_k, ref_v, batch, hd**-0.5, sink)

    S, T, pad_rows, n_blk, Q = len(q_lens), len(q), 5, 24, 16
    order = list(range(S // 2)) + [None] + list(range(S // 2, S)) + [None]  # None: padding sequence
    tables = torch.full((len(order), n_blk), poison, dtype=torch.int32)
    lens = torch.zeros(len(order), dtype=torch.int32)
    qsl = [0]
    for i, s in enumerate(order):
        if s is not None:
            tables[i, : len(batch.block_tables[s])] = torch.tensor(batch.block_tables[s], dtype=torch.int32)
            lens[i] = batch.seq_lens[s]
        qsl.append(qsl[-1] + (q_lens[s] if s is not None else 0))
    extra = [torch.randn(pad_rows, *x.shape[1:]) for x in (q, k, v)]
    slots = torch.cat([batch.slot_mapping, torch.full((pad_rows,), -1, dtype=torch.long)])
    meta = DeviceMeta(slots, torch.tensor(qsl, dtype=torch.int32), lens, tables, max_query_len=Q,
                      max_seq_len=n_blk * 4, block_size=4, causal=causal, window=window)
    be = StaticTorchAttention()
    be.set_meta(meta)
    be.store_kv(k_cache, v_cache, torch.cat([k, extra[1]]), torch.cat([v, extra[2]]), meta)
    got = be.forward(torch.cat([q, extra[0]]), k_cache, v_cache, meta, hd**-0.5, sink)
    assert got.shape == (T + pad_rows, *q.shape[1:])
    assert (got[:T] - want).abs().max() < 1e-5
    assert torch.equal(got[T:], torch.zeros_like(got[T:]))
    torch.testing.assert_close(k_cache, ref_k, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, ref_v, rtol=0, atol=0, equal_nan=True)


def test_static_backend_prepare_and_all_padding():
    """prepare() from an AttentionBatch equals TorchAttention; a step of only padding stores
    nothing and returns zeros."""
    k_cache, v_cache, q, k, v, batch, _ = _paged_case([16, 1, 3], [8, 20, 0], True, seed=3)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    ref = TorchAttention()
    ref.prepare(batch, torch.device("cpu"))
    ref.store_kv(ref_k, ref_v, k, v, batch)
    want = ref.forward(q, ref_k, ref_v, batch, 0.3)
    be = StaticTorchAttention()
    be.prepare(batch, torch.device("cpu"))
    be.store_kv(k_cache, v_cache, k, v, batch)
    assert (be.forward(q, k_cache, v_cache, batch, 0.3) - want).abs().max() < 1e-5
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)

    meta = DeviceMeta(torch.full((8,), -1, dtype=torch.long), torch.zeros(3, dtype=torch.int32),
                      torch.zeros(2, dtype=torch.int32), torch.zeros(2, 5, dtype=torch.int32), 4, 20, 4, True)
    be.set_meta(meta)
    be.store_kv(k_cache, v_cache, torch.randn(8, *k.shape[1:]), torch.randn(8, *v.shape[1:]), None)
    out = be.forward(torch.randn(8, *q.shape[1:]), k_cache, v_cache, None, 0.3)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    assert torch.equal(out, torch.zeros_like(out))
