"""L2 prefetch of the o projection's weights while attention runs, for few-row steps on Hopper.

At batch 1 a decoder layer streams its GEMM weights at close to the memory bandwidth, but between
the qkv and the o GEMM the memory bus idles: q/k norm + RoPE, the attention kernel and its split-K
merge are latency-bound (a 16-row verify over 1k keys reads 4 MB of K/V in ~14 us; the bus could
move ~40 MB in that time). This kernel, launched right after the qkv GEMM, issues
`cp.async.bulk.prefetch.L2` for the o projection's weight (Qwen3-8B: 33.5 MB of a 50 MB L2), so
the o GEMM then reads it from L2 instead of HBM. It waits for nothing before the prefetches: they
read only weights, which no kernel writes during inference, and the step's `seq_lens`, which the
host copies in before the step's first kernel. It then lets the next kernel launch and waits for
its predecessor, so the chain of programmatic dependent launches keeps its order (launch.py).

When the step's K/V would crowd the L2 (all sequences' keys x K/V bytes per key over KV_BUDGET)
the kernel issues nothing, decided on the device from `seq_lens`, so one captured graph serves
every context length. Only the first `cap` bytes of each weight row are fetched when the weight
is larger than the cap, so that every GEMM program (a strip of rows) finds the same share in L2.

Nothing here changes a result: a prefetch moves no data a kernel reads. FLASHDRAFT_PREFETCH=auto
(default: on for CUDA devices of compute capability >= 9, with a cap of 32 MiB per weight), off, or
a cap in MiB."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from flashdraft.models.launch import launch_kwargs, pdl_enter, pdl_trigger

PREFETCH = os.environ.get("FLASHDRAFT_PREFETCH", "auto")
DEFAULT_CAP_MIB = 32
KV_BUDGET = 16 << 20  # bytes of one layer's K/V (all sequences) above which nothing is prefetched
CHUNK = 16384  # bytes per bulk prefetch instruction
LANES = 32  # prefetch instructions per program
MAX_SEQS = 64  # sequences summed on the device; larger batches never prefetch
KIND = "bulk"  # or "line": prefetch.global.L2 per 128-byte line (sweeps)


def _cap_bytes() -> int | None:
    """The cap in bytes, or None when prefetching is off (see PREFETCH)."""
    if PREFETCH == "off":
        return None
    if PREFETCH == "auto":
        return DEFAULT_CAP_MIB << 20
    try:
        mib = float(PREFETCH)
    except ValueError:
        raise ValueError(f"FLASHDRAFT_PREFETCH must be auto, off or a size in MiB, got {PREFETCH!r}") from None
    if mib < 0:
        raise ValueError(f"FLASHDRAFT_PREFETCH must not be negative, got {PREFETCH!r}")
    return int(mib * (1 << 20)) if mib > 0 else None


@contextlib.contextmanager
def prefetch_mode(mode: str):
    """Temporarily set PREFETCH (benchmarks). CUDA graphs keep what they were captured with."""
    global PREFETCH
    old, PREFETCH = PREFETCH, mode
    try:
        yield
    finally:
        PREFETCH = old


@triton.jit(do_not_specialize=["num_seqs", "max_keys", "total"])
def _l2_prefetch_kernel(w_ptr, seq_lens_ptr, num_seqs, max_keys, total, row_bytes, part_bytes, chunks_per_row,
                        CHUNK: tl.constexpr, LANES: tl.constexpr, BLOCK_S: tl.constexpr, BULK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    """Lane i prefetches chunk i % chunks_per_row of row i // chunks_per_row: bytes
    [c * CHUNK, min((c + 1) * CHUNK, part_bytes)) of that row."""
    s = tl.arange(0, BLOCK_S)
    keys = tl.sum(tl.load(seq_lens_ptr + s, mask=s < num_seqs, other=0))
    if keys <= max_keys:
        i = tl.program_id(0) * LANES + tl.arange(0, LANES)
        i = tl.minimum(i, total - 1)  # lanes past the end repeat the last chunk
        row = i // chunks_per_row
        c = i % chunks_per_row
        size = tl.minimum(CHUNK, part_bytes - c * CHUNK)
        ptr = w_ptr + row.to(tl.int64) * row_bytes + c * CHUNK
        if BULK:
            tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                                      [ptr, size.to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)
        else:  # one prefetch per 128-byte line
            for j in range(0, CHUNK, 128):
                tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                          [ptr + tl.minimum(j, size - 1)], dtype=tl.int32, is_pure=False, pack=1)
    pdl_trigger(USE_PDL)
    pdl_enter(USE_PDL)  # the next kernel waits for this one: this one waits for its predecessor


def _capable(t: torch.Tensor) -> bool:
    return (t.device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(t.device)[0] >= 9)


def prefetch_l2(w: torch.Tensor, seq_lens: torch.Tensor, kv_bytes_per_key: int) -> bool:
    """Prefetch (up to the cap of) weight `w` [N, K] into L2 unless the step's K/V, sum(seq_lens) x
    kv_bytes_per_key, exceeds KV_BUDGET. Returns whether a kernel was launched."""
    cap = _cap_bytes()
    if cap is None or not _capable(w) or seq_lens.shape[0] > MAX_SEQS or w.dim() != 2:
        return False
    row_bytes = w.shape[1] * w.element_size()
    if w.stride(-1) != 1 or w.stride(0) != w.shape[1] or row_bytes % 16 or w.data_ptr() % 16:
        return False
    part = min(row_bytes, cap // w.shape[0] // 16 * 16)
    if part < 16:
        return False
    if part == row_bytes:  # whole rows: one contiguous range
        rows, row_b, part = 1, 0, w.numel() * w.element_size()
    else:
        rows, row_b = w.shape[0], row_bytes
    per_row = triton.cdiv(part, CHUNK)
    total = rows * per_row
    _l2_prefetch_kernel[(triton.cdiv(total, LANES),)](
        w.view(torch.uint8), seq_lens, seq_lens.shape[0], KV_BUDGET // max(kv_bytes_per_key, 1), total, row_b, part,
        per_row, CHUNK=CHUNK, LANES=LANES, BULK=KIND == "bulk",
        BLOCK_S=triton.next_power_of_2(max(seq_lens.shape[0], 1)), num_warps=1, **launch_kwargs(w))
    return True
