"""The paged attention kernel alone over one prefill's shapes, float32 and bf16, by KV partition count: 47 or
230 new rows over 230 keys (SmolLM2's heads: 9 query, 3 KV, dimension 64; pages of 16), the graph's
max_seq_len at 230 and 8192 (which sets the default partition count). Host-inclusive microseconds a call.

    python benchmarks/device/attn_f32.py"""
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from flashdraft.attention.base import AttentionBatch, DeviceMeta  # noqa: E402
from flashdraft.attention.triton_paged import _tiles, auto_splits, paged_attention  # noqa: E402

H, KV, D, PAGE = 9, 3, 64, 16
dev = "cuda"
for dtype in (torch.float32, torch.bfloat16):
    for q_len, seq_len, max_seq in ((47, 230, 230), (230, 230, 230), (47, 230, 8192), (230, 230, 8192)):
        pages = triton.cdiv(max_seq, PAGE)
        k = torch.randn(pages, PAGE, KV, D, device=dev, dtype=dtype)
        v = torch.randn_like(k)
        batch = AttentionBatch(slot_mapping=torch.full((q_len,), -1, dtype=torch.long), query_start_loc=[0, q_len],
                               seq_lens=[seq_len], block_tables=[list(range(pages))], block_size=PAGE, causal=True)
        meta = DeviceMeta.from_batch(batch, dev)
        meta.max_seq_len = max_seq
        q = torch.randn(q_len, H, D, device=dev, dtype=dtype)
        tiles = triton.cdiv(q_len, _tiles(D, H // KV, q_len)[1] // (H // KV))
        auto = auto_splits(D, H // KV, q_len, 1, KV, max_seq, torch.device(dev))
        for splits in sorted({1, 2, 8, auto}):
            for _ in range(3):
                paged_attention(q, k, v, meta, 0.125, num_splits=splits)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(50):
                paged_attention(q, k, v, meta, 0.125, num_splits=splits)
            torch.cuda.synchronize()
            us = (time.perf_counter() - t) / 50 * 1e6
            print(f"{str(dtype)[6:]:9s} rows {q_len:4d} keys {seq_len} max_seq {max_seq:5d} tiles {tiles} "
                  f"splits {splits:3d}{' (default)' if splits == auto else ''}: {us:8.1f} us")
