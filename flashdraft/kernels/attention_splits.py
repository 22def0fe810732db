"""The split-K partitions of paged attention (kernels/attention.py): how many, their float32 workspace,
and the merge of their partials.

Split-K (flash-decoding): a program walks its keys BLOCK_N at a time, each tile's loads waiting
on the block table's, so a grid of few programs is bound by that walk, not by bandwidth: one
program (query tile x sequence x kv head) per SM leaves most of an H200 idle even at 192 programs
(SmolLM2 at 64 requests). The key range is cut into partitions (_num_splits: about settings.SPLIT_WAVES
programs an SM; a tile larger than 32 rows x 64 keys counts as that many of them) that write
unnormalised partials (acc, running max, running sum) to a float32 workspace, merged in partition
order. Counts below 2 x settings.MERGE_SPLITS are rounded down to a power of two of at most that
(even partitions) and merge in the kernel: the tile's last partition to finish (an arrival count,
as skinny_gemm.py's split-K GEMMs keep) reads the others' partials (one partition holding keys writes
`out` itself). Larger counts leave the merge to `_reduce_kernel`, a program per (token, head
group): one program reading 17 partials one after another took 9.6 us a layer where the merge
kernel's launch and run took 6.3 (H200, Qwen3-8B decode at 1k keys), while at 3 partitions the
in-kernel merge saved SmolLM2's c = 32 decode and verify graphs 9-10% (no launch a layer). The
split count is fixed by the grid (a CUDA graph's, sized for its longest sequence), but each
program cuts its own tile's key range (the window on sliding layers) into at most that many
partitions of at least MIN_SPLIT_KEYS: a 1k-key decode in a graph sized for 40k keys spreads over
16 partitions, not over the first two. Partitions past the tile's keys end at once and write
nothing; the first writes how many hold keys for _reduce_kernel, which reads only those (H200,
SmolLM2 shapes, 64 sequences of 8 verify rows and 256 keys at 64 partitions: 116 us with every
partition's partial written and read, 36 with these; benchmarks/device/attn_splits.py).

Measured in CUDA graphs on an H200 (attn_splits.py, 2026-11-28), this rule against the one before
it (one partition from one program an SM on, else 2 x SMs / programs of them): SmolLM2 heads
(9 / 3, D 64) at 64 sequences and 256-4,096 keys, decode 10.2-109.9 -> 9.2-71.3 us a layer and an
8-row verify 11.9-126.4 -> 10.3-80.5; at 32 sequences both 10-19% faster; Qwen3-8B heads
(32 / 8, D 128) at 8 sequences, a 16-row verify 25.6-122.8 -> 15.8-78.3 us (5 partitions through
`_reduce_kernel` before, 4 merged in the kernel now) and a decode 10.5-64.1 -> 7.8-45.0."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft import settings
from flashdraft.kernels.launch import pdl_enter, pdl_trigger, sm_count

MAX_SPLITS = 64
MIN_SPLIT_KEYS = 64  # a KV partition holds at least this many keys
REDUCE_SPLITS = 64  # (partition, head) rows per load of _reduce_kernel
NEG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima: no inf - inf = nan on empty rows

_workspaces: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}


@triton.jit
def _merge_partials(out_ptr, ws_o_ptr, ws_m_ptr, ws_l_ptr, used, num_tokens, num_heads, q_start, q_len, tile, kv_head,
                    stride_ot, stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_M: tl.constexpr, MERGE_M: tl.constexpr):
    """The `used` partials of a query tile's first MERGE_M rows merged into normalised output, in
    partition order. Read past L1 (.cg): other programs wrote them."""
    ROWS: tl.constexpr = BLOCK_M // GROUP
    m = tl.arange(0, MERGE_M)
    row = tile * ROWS + m // GROUP
    head = kv_head * GROUP + m % GROUP
    valid = (m < ROWS * GROUP) & (row < q_len)
    d = tl.arange(0, BLOCK_D)
    mask = valid[:, None] & (d < HEAD_DIM)[None, :]
    m_i = tl.full([MERGE_M], NEG, tl.float32)
    l_i = tl.zeros([MERGE_M], tl.float32)
    acc = tl.zeros([MERGE_M, BLOCK_D], tl.float32)
    for s in range(0, used):
        idx = (s * num_tokens + q_start + row) * num_heads + head
        m_p = tl.load(ws_m_ptr + idx, mask=valid, other=NEG, cache_modifier=".cg")
        l_p = tl.load(ws_l_ptr + idx, mask=valid, other=0.0, cache_modifier=".cg")
        o = tl.load(ws_o_ptr + idx[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m_i, m_p)
        alpha = tl.exp2(m_i - m_new)
        w = tl.exp2(m_p - m_new)
        l_i = l_i * alpha + l_p * w
        acc = acc * alpha[:, None] + o * w[:, None]
        m_i = m_new
    out = out_ptr + (q_start + row)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(out, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_seqs", "num_tokens"])
def _reduce_kernel(out_ptr, ws_o_ptr, ws_m_ptr, ws_l_ptr, used_ptr, qsl_ptr, num_seqs, num_tokens, num_heads,
                   stride_ot, stride_oh, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ZERO_PADDING: tl.constexpr, USE_PDL: tl.constexpr):
    """Grid (token, head group): merges the split-K partials of that token's GROUP query heads into
    normalised output, BLOCK_S partitions per load (one load for <= BLOCK_S splits), where a query
    tile's own last partition would merge too many (_attn_kernel's MERGE). Small programs over
    tokens rather than a loop over the partitions per query tile: a 16-row verify at batch 1 has 128
    of them instead of 8 (H100: 14.7 us per layer before)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    head = tl.program_id(1) * GROUP + tl.arange(0, BLOCK_G)  # [G]
    h_ok = tl.arange(0, BLOCK_G) < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    out = out_ptr + t * stride_ot + head[:, None] * stride_oh + d[None, :]
    out_mask = h_ok[:, None] & d_ok[None, :]
    if t >= tl.load(qsl_ptr + num_seqs):  # a graph bucket's padding rows: zeros when asked
        if ZERO_PADDING:
            tl.store(out, tl.zeros([BLOCK_G, BLOCK_D], tl.float32).to(out_ptr.dtype.element_ty), mask=out_mask)
        return
    m_i = tl.full([BLOCK_G], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    used = tl.load(used_ptr + t)  # the token's partitions holding keys (the first ones)
    for s0 in range(0, used, BLOCK_S):
        sp = s0 + tl.arange(0, BLOCK_S)
        ok = (sp < used)[:, None] & h_ok[None, :]  # [S, G]
        idx = (sp[:, None] * num_tokens + t) * num_heads + head[None, :]
        m = tl.load(ws_m_ptr + idx, mask=ok, other=NEG)
        l_p = tl.load(ws_l_ptr + idx, mask=ok, other=0.0)
        o = tl.load(ws_o_ptr + idx[:, :, None] * HEAD_DIM + d[None, None, :], mask=ok[:, :, None] & d_ok[None, None, :],
                    other=0.0)  # [S, G, D]
        m_new = tl.maximum(m_i, tl.max(m, 0))
        w = tl.where(ok, tl.exp2(m - m_new[None, :]), 0.0)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(l_p * w, 0)
        acc = acc * alpha[:, None] + tl.sum(o * w[:, :, None], 0)
        m_i = m_new
    pdl_trigger(USE_PDL)
    tl.store(out, (acc / tl.where(l_i > 0, l_i, 1.0)[:, None]).to(out_ptr.dtype.element_ty), mask=out_mask)


def _num_splits(programs: int, max_seq_len: int, device: torch.device) -> int:
    """About settings.SPLIT_WAVES programs an SM (module docstring): a power of two up to
    settings.MERGE_SPLITS where that asks for fewer than twice that many partitions, else as many as it
    asks for."""
    merge = settings.MERGE_SPLITS
    want = settings.SPLIT_WAVES * sm_count(device) // programs
    if want < 2 * merge:
        want = min(1 << (max(want, 1).bit_length() - 1), merge)
    return max(1, min(want, max_seq_len // MIN_SPLIT_KEYS, MAX_SPLITS))


def _workspace(device: torch.device, splits: int, T: int, H: int, D: int):
    key = (device, splits, T, H, D)
    if key not in _workspaces:
        _workspaces[key] = (torch.empty(splits, T, H, D, device=device, dtype=torch.float32),
                            torch.empty(splits, T, H, device=device, dtype=torch.float32),
                            torch.empty(splits, T, H, device=device, dtype=torch.float32),
                            torch.empty(T, device=device, dtype=torch.int32))  # partitions holding keys, a row
    return _workspaces[key]
