"""Paged attention's split-K count over batch sizes, query lengths and context lengths: every forced
count against the one the kernel's heuristic picks, timed inside CUDA graphs as a step replays it.

    python benchmarks/device/attn_splits.py OUT_DIR [--shapes smollm2,qwen3-8b]

A graph holds `calls` launches of one configuration, each over its own layer's caches (a step's
layers read distinct K/V: nothing stays in L2 between them), replayed in rounds after warm replays, timed
with CUDA events. The step's meta is sized as a serving graph's: max_seq_len is the graph bucket's
bound (8,192), not the batch's keys, so each program cuts its own keys into at most the count's
partitions of 64 keys or more (kernels/attention.py). Reported beside each time: the
K/V bytes read over the copy bandwidth measured in the same run. Prints a table (per configuration, the
heuristic's count and time, and the best count and time) and one JSON line, also written to
OUT_DIR/attn_splits.json.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from timing import Clock, copy_bandwidth, graph_ms, log, report  # noqa: E402

from flashdraft import settings  # noqa: E402
from flashdraft.attention.base import AttentionBatch, DeviceMeta  # noqa: E402
from flashdraft.kernels import attention  # noqa: E402

SHAPES = {"smollm2": (9, 3, 64), "qwen3-8b": (32, 8, 128)}  # query heads, kv heads, head_dim
PAGE, BOUND = 16, 8192


def setup(shape, S: int, q_len: int, L: int, layers: int, dev, causal: bool = True):
    H, n_kv, D = SHAPES[shape]
    pages = -(-L // PAGE)
    caches = [(torch.randn(S * pages, PAGE, n_kv, D, device=dev, dtype=torch.bfloat16),
               torch.randn(S * pages, PAGE, n_kv, D, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
    tables = [list(range(s * pages, (s + 1) * pages)) for s in range(S)]
    batch = AttentionBatch(slot_mapping=torch.full((S * q_len,), -1, dtype=torch.long),
                           query_start_loc=[s * q_len for s in range(S + 1)], seq_lens=[L] * S,
                           block_tables=tables, block_size=PAGE, causal=causal)
    meta = replace(DeviceMeta.from_batch(batch, dev), max_seq_len=BOUND)
    q = torch.randn(S * q_len, H, D, device=dev, dtype=torch.bfloat16)
    return q, caches, meta, H, n_kv, D


def time_graph(q, caches, meta, splits: int | None, clock: Clock) -> float:
    """Microseconds a layer: one CUDA graph of every layer's call, timed by `clock` (timing.graph_ms)."""
    out = torch.empty_like(q)

    def calls():
        for k, v in caches:
            attention.paged_attention(q, k, v, meta, 0.125, out=out, num_splits=splits, zero_padding=True)

    return 1e3 * graph_ms(calls, clock, inner=1)["ms"] / len(caches)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--shapes", default="smollm2,qwen3-8b")
    ap.add_argument("--batches", default="1,8,16,32,64")
    ap.add_argument("--q-lens", default="1,8,16")
    ap.add_argument("--keys", default="256,512,1024,2048,4096")
    ap.add_argument("--counts", default="1,2,3,4,6,8,12,16,32,64")
    ap.add_argument("--merge", default="4", help="MERGE_SPLITS values to try (in-kernel merge up to this many)")
    ap.add_argument("--layers", type=int, default=16)
    a = ap.parse_args()
    dev = torch.device("cuda")
    clock = Clock(dev, round_s=0.05)
    bw = copy_bandwidth(dev) / 1e9
    log(f"copy {bw:.0f} GB/s, {torch.cuda.get_device_name()}")
    rows = []
    default_merge = settings.MERGE_SPLITS
    for shape in a.shapes.split(","):
        for S in map(int, a.batches.split(",")):
            for q_len in map(int, a.q_lens.split(",")):
                for L in map(int, a.keys.split(",")):
                    q, caches, meta, H, n_kv, D = setup(shape, S, q_len, L, a.layers, dev)
                    kv_bytes = S * L * n_kv * D * 2 * 2
                    settings.MERGE_SPLITS = default_merge
                    block_m = attention._tiles(D, H // n_kv, q_len)[1]
                    programs = -(-q_len // (block_m // (H // n_kv))) * S * n_kv
                    picked = attention.auto_splits(D, H // n_kv, q_len, S, n_kv, BOUND, dev)
                    times = {}
                    for merge in map(int, a.merge.split(",")):
                        settings.MERGE_SPLITS = merge
                        for c in map(int, a.counts.split(",")):
                            lo, hi = sorted((merge, default_merge))
                            if merge != default_merge and not lo < c <= hi:
                                continue  # merged where the default count merges it: the same launch
                            times[f"{c}/m{merge}"] = time_graph(q, caches, meta, c, clock)
                    settings.MERGE_SPLITS = default_merge
                    now = times.get(f"{picked}/m{default_merge}") or time_graph(q, caches, meta, picked, clock)
                    best = min(times, key=times.get)
                    floor = kv_bytes / (bw * 1e3)  # us
                    rows.append(dict(shape=shape, S=S, q_len=q_len, keys=L, programs=programs, picked=picked,
                                     picked_us=now, best=best, best_us=times[best], kv_floor_us=floor, times=times))
                    log(f"{shape:8s} S={S:3d} q={q_len:2d} L={L:5d} programs={programs:4d} "
                        f"heuristic {picked:2d}: {now:7.2f} us  best {best:>6s}: {times[best]:7.2f} us  "
                        f"({now / times[best]:.2f}x)  K/V floor {floor:6.2f} us")
                    del q, caches
    Path(a.out).mkdir(parents=True, exist_ok=True)
    report(f"paged attention, us a layer by split count (copy {bw:,.0f} GB/s)", rows,
           {"bench": "attn_splits", "copy_gbps": bw, "rows": rows}, Path(a.out) / "attn_splits.json",
           ["shape", "S", "q_len", "keys", "programs", "picked", "picked_us", "best", "best_us", "kv_floor_us"], dev)


if __name__ == "__main__":
    main()
