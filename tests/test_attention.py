"""The torch attention backend against a float64 dense computation, both layouts, ragged batches,
causal (prefill chunk / decode / verify) and non-causal (draft block), GQA, shuffled pages."""

from __future__ import annotations

import random

import pytest
import torch

from flashdraft.attention.base import AttentionBatch
from flashdraft.attention.torch_ref import TorchAttention


def reference(q, keys, vals, q_lens, seq_lens, causal, scale):
    out = []
    row = 0
    for k, v, ql, sl in zip(keys, vals, q_lens, seq_lens):
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, 1)
        vv = v.double().repeat_interleave(group, 1)
        for i in range(ql):
            s = torch.einsum("hd,lhd->hl", q[row + i].double(), kk) * scale
            if causal:
                s[:, sl - ql + i + 1:] = float("-inf")
            out.append(torch.einsum("hl,lhd->hd", s.softmax(-1), vv))
        row += ql
    return torch.stack(out)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("padded_limit", [0, 1 << 22])
@pytest.mark.parametrize("q_lens, ctx", [([1, 1, 1], [5, 17, 33]), ([4, 4], [0, 21]), ([7, 1, 4], [0, 30, 9]),
                                         ([16], [40]), ([1, 40, 1, 3], [20, 0, 9, 50])])
def test_backend_matches_float64(causal, padded_limit, q_lens, ctx):
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
    batch = AttentionBatch(torch.tensor(slots), qsl, seq_lens, tables, bs, causal)
    be = TorchAttention(padded_max_elements=padded_limit)
    be.prepare(batch, torch.device("cpu"))
    assert be.padded == (padded_limit > 0 and sum(q <= 32 for q in q_lens) > 1)
    be.store_kv(k_cache, v_cache, new_k, new_v, batch)
    got = be.forward(q, k_cache, v_cache, batch, hd**-0.5)
    want = reference(q, keys, vals, q_lens, seq_lens, causal, hd**-0.5)
    assert (got.double() - want).abs().max() < 1e-5
