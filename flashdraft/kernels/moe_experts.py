"""Mixture-of-experts MLP on the GPU: the routed rows sorted by expert, then two grouped Triton GEMMs.

A step's T tokens route to k experts each: M = T * k (token, slot) rows. They are sorted by expert and
each expert's run is padded to a multiple of BLOCK_M rows (graph-safe: every shape follows from M and
the expert count, never from the routing), so a program owns BLOCK_M rows of one expert:

    gate_up   h[r] = act(x[token(r)] @ Wg[e]^T + bg[e], x[token(r)] @ Wu[e]^T + bu[e])
                                                                  grid (row blocks, I / BLOCK_N)
    down      y[slot(r)] = weight(slot) * (h[r] @ Wd[e]^T + bd[e])   grid (row blocks, H / BLOCK_N)

with act silu(gate) * up (Qwen3-MoE, no biases) or GPT-OSS's clamped SwiGLU (models/moe.py),

and the token's output is the sum of its k slots (in slot order: deterministic; with slots=True left to
the next layer_ops.add_rmsnorm). An expert's weights are read once per block of its rows; blocks past the
padded end return at once. At decode sizes (T * k at most half the experts) the rows are not sorted:
each routed row is a block of its own, its expert taken from the routing (DIRECT), so a batch-1 step
reads its k experts once, the memory floor, with no sort and no padding blocks. Rounding
follows the torch path (models/moe.py): gate and up (bias added) rounded to the activation dtype, the
activation's steps in float32, each rounded as torch rounds it; the routing weight is applied to the
down projection's rounded output (bias added).

The routing (the top-k kernel, and norm_router after attention) is moe_routing.py's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft import settings
from flashdraft.kernels.launch import launch_kwargs, pdl_enter, pdl_trigger
from flashdraft.kernels.moe_routing import _route_row, route_topk

INTERPRET = settings.interpreted()
BLOCK_M = 16  # sorted rows of one expert per program (tl.dot's least; a DIRECT block fills one of them)
# (BLOCK_N, BLOCK_K, pipeline stages) of the expert GEMMs: narrower strips and longer K tiles up to
# SMALL_ROWS routed rows (decode batches, small verify blocks: few rows per expert, the weights streamed
# by more programs), the wider tiles above. On an H200 at GPT-OSS-20B shapes the small tiles took decode
# at batch 1 / 8 / 32 from 3.54 / 8.46 / 12.33 to 3.09 / 7.99 / 11.34 ms and a 16-row verify at batch 1
# from 10.77 to 9.83 ms, but a batch-32 verify (2,048 rows) from 26.8 to 30.7 ms. A row's result never
# depends on the other rows of its call; across the two tile sets the K loop keeps its order, but
# bit-equality between them is not checked (a decode batch and a larger verify may then part at
# bf16 near-ties, as the dense GEMMs do at 32 rows). settings.MOE_TILES sets one triple for every row
# count (tile sweeps).
SMALL_ROWS = 128
SMALL_TILES, TILES = (32, 128, 4), (64, 64, 3)
if settings.MOE_TILES:
    SMALL_TILES = TILES = settings.MOE_TILES
# Direct (unsorted) path: while the routed rows T * k are at most half the experts, each routed row
# takes its own programs, its expert read straight from the routing: no sort, and no grid of padding
# blocks (Qwen3-30B-A3B pads 8 routed rows to 121 blocks of 16). Rows that share an expert read it
# once each, which stays rare below that bound. H200 (benchmarks/device/gemm_sweep.py --sections moe,
# sorted / direct, us): Qwen3-30B-A3B at 1 / 2 / 4 / 8 tokens 33.0 / 24.3, 49.2 / 41.7, 78.5 / 72.5,
# 128.5 / 122.8; GPT-OSS-20B 63.2 / 54.9, 102.2 / 99.0, 170.7 / 169.2, 254.4 / 277.7.
# The tiles of its gate_up and down GEMMs are settings.MOE_DIRECT_TILES; settings.MOE_DIRECT=N takes it up
# to N tokens instead.


@triton.jit
def _dot(a, b, F32_DOT: tl.constexpr):
    """F32_DOT: full float32 products (float32 data, and the interpreter, whose bf16 dot is not to be trusted)."""
    if F32_DOT:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _block_rows(b, rows_ptr, block_expert_ptr, BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """Program b's expert, its BLOCK_M rows of h and their slots (token * k + j; -1: padding).
    Sorted: block b of the expert-sorted rows (expert -1: past the last block). DIRECT: routed row b
    alone (block_expert_ptr holds the routing's expert ids), its one slot b at row b of h."""
    i = tl.arange(0, BLOCK_M)
    if DIRECT:
        return tl.load(block_expert_ptr + b).to(tl.int32), b + i, tl.where(i == 0, b, -1).to(tl.int64)
    m = b * BLOCK_M + i
    return tl.load(block_expert_ptr + b).to(tl.int32), m, tl.load(rows_ptr + m).to(tl.int64)


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, h_ptr, rows_ptr, block_expert_ptr, K, INTER, k_slots, stride_x,
                    stride_we, stride_wn, stride_be, stride_h, alpha, limit, logits_ptr, route_w_ptr, E, stride_l,
                    s_ptr, stride_se, stride_sn, SCALED: tl.constexpr, BQ_N: tl.constexpr, BQ_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr,
                    BIAS: tl.constexpr, OAI: tl.constexpr, DIRECT: tl.constexpr, ROUTE: tl.constexpr,
                    TOP_K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, SOFTMAX_ALL: tl.constexpr,
                    NORM: tl.constexpr, PARTS: tl.constexpr, USE_PDL: tl.constexpr):
    """ROUTE (DIRECT only): routed row b (token b // k, slot b % k) takes its expert from the token's
    router logits (parts), as _topk_kernel picks it; the strip-0 program stores that expert and its
    weight (block_expert_ptr, route_w_ptr) for the down kernel."""
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    if ROUTE:
        i = tl.arange(0, BLOCK_M)
        j = tl.arange(0, KP)
        wts, ids = _route_row(logits_ptr + (b // k_slots) * stride_l, E, route_w_ptr.dtype.element_ty, TOP_K, KP,
                              EP, SOFTMAX_ALL, NORM, PARTS)
        mine = j == b % k_slots
        e = tl.sum(tl.where(mine, ids, 0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(block_expert_ptr + b, e.to(tl.int64))
            tl.store(route_w_ptr + b, tl.sum(tl.where(mine, wts, 0.0), axis=0).to(route_w_ptr.dtype.element_ty))
        m, slot = b + i, tl.where(i == 0, b, -1).to(tl.int64)
    else:
        e, m, slot = _block_rows(b, rows_ptr, block_expert_ptr, BLOCK_M, DIRECT)
        if e < 0:
            return
    valid = slot >= 0
    token = tl.where(valid, slot // k_slots, 0)
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_ptr + token[:, None] * stride_x + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (INTER + n)[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                     other=0.0)
        if SCALED:  # FP8 weights: each K-tile inside one scale block, its columns' factors after the dot
            s_base = s_ptr + e.to(tl.int64) * stride_se + k0 // BQ_K
            sg = tl.load(s_base + (n // BQ_N) * stride_sn, mask=n_ok, other=0.0)
            su = tl.load(s_base + ((INTER + n) // BQ_N) * stride_sn, mask=n_ok, other=0.0)
            acc_g += _dot(a, wg.to(a.dtype), F32_DOT) * sg[None, :]
            acc_u += _dot(a, wu.to(a.dtype), F32_DOT) * su[None, :]
        else:
            acc_g += _dot(a, wg, F32_DOT)
            acc_u += _dot(a, wu, F32_DOT)
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    if BIAS:
        b_base = b_ptr + e.to(tl.int64) * stride_be
        g = (g + tl.load(b_base + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        u = (u + tl.load(b_base + INTER + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    if OAI:  # (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = (1.0 / (1.0 + tl.exp(-(g * alpha).to(dt).to(tl.float32)))).to(dt).to(tl.float32)
        glu = (g * sig).to(dt).to(tl.float32)
        h = ((u + 1.0).to(dt).to(tl.float32) * glu).to(dt)
    else:
        s = (g / (1.0 + tl.exp(-g))).to(dt)
        h = (s.to(tl.float32) * u).to(dt)
    pdl_trigger(USE_PDL)
    tl.store(h_ptr + m[:, None] * stride_h + n[None, :], h, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, b_ptr, y_ptr, rows_ptr, block_expert_ptr, weight_ptr, K, N, stride_h, stride_we,
                 stride_wn, stride_be, stride_y, s_ptr, stride_se, stride_sn, SCALED: tl.constexpr,
                 BQ_N: tl.constexpr, BQ_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, BIAS: tl.constexpr, DIRECT: tl.constexpr,
                 USE_PDL: tl.constexpr):
    pdl_enter(USE_PDL)
    b = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e, m, slot = _block_rows(b, rows_ptr, block_expert_ptr, BLOCK_M, DIRECT)
    if e < 0:
        return
    valid = slot >= 0
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(h_ptr + m[:, None] * stride_h + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if SCALED:
            sd = tl.load(s_ptr + e.to(tl.int64) * stride_se + (n // BQ_N) * stride_sn + k0 // BQ_K, mask=n_ok,
                         other=0.0)
            acc += _dot(a, w.to(a.dtype), F32_DOT) * sd[None, :]
        else:
            acc += _dot(a, w, F32_DOT)
    dt = y_ptr.dtype.element_ty
    wt = tl.load(weight_ptr + tl.where(valid, slot, 0), mask=valid, other=0.0).to(tl.float32)
    acc = acc.to(dt).to(tl.float32)
    if BIAS:
        acc = (acc + tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :])
        acc = acc.to(dt).to(tl.float32)
    y = (acc * wt[:, None]).to(dt)
    pdl_trigger(USE_PDL)
    tl.store(y_ptr + tl.where(valid, slot, 0)[:, None] * stride_y + n[None, :], y, mask=valid[:, None] & n_ok[None, :])


# up to this many routed rows one program sorts them (_sort_small_kernel): on an H200 it saved 0.4-1.0 ms
# a step at 64-128 rows (24-48 layers) but cost 1.5 ms at 256 rows (Qwen3-30B-A3B, batch 32), measured
# when it matched every padded slot against every row; the scatter since has not been timed at 256
SMALL_SORT = SMALL_ROWS


@triton.jit
def _sort_small_kernel(ids_ptr, rows_ptr, block_expert_ptr, M, E, P, BLOCK: tl.constexpr, EP: tl.constexpr,
                       CHUNK: tl.constexpr, BCHUNK: tl.constexpr, BM: tl.constexpr, USE_PDL: tl.constexpr):
    """sort_by_expert in one program for M <= BLOCK rows: per-expert counts, padded starts and each
    row's rank among its expert's rows from an [experts, rows] match matrix; then every output entry
    set to -1, and each row stored at its destination (a scatter, after a barrier); then each block's
    expert, from the padded ends."""
    pdl_enter(USE_PDL)
    i = tl.arange(0, BLOCK)
    ex = tl.arange(0, EP)
    ids = tl.load(ids_ptr + i, mask=i < M, other=EP)  # past M: an expert that matches none
    hit = ids[None, :] == ex[:, None]  # [EP, BLOCK]
    counts = tl.sum(hit.to(tl.int32), axis=1)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, axis=0)
    total = tl.max(ends, axis=0)
    starts = ends - padded
    # each row's place: its expert's start plus the rows of that expert before it (a running count)
    place = starts[:, None] + tl.cumsum(hit.to(tl.int32), axis=1) - 1
    dest = tl.sum(tl.where(hit, place, 0), axis=0)
    pdl_trigger(USE_PDL)
    for p0 in range(0, P, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        tl.store(rows_ptr + p, tl.full([CHUNK], -1, tl.int64), mask=p < P)
    tl.debug_barrier()  # every -1 is written before any row lands on its place
    tl.store(rows_ptr + dest, i.to(tl.int64), mask=i < M)
    for b0 in range(0, P // BM, BCHUNK):
        b = b0 + tl.arange(0, BCHUNK)
        bstart = b * BM
        e_of = tl.sum(((ends[None, :] <= bstart[:, None]) & (ex[None, :] < E)).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(bstart < total, e_of, -1), mask=bstart < P)


def sort_by_expert(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M,
                   small: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] expert of each (token, slot) -> (rows [P]: the slot (token * k + j) of each sorted row,
    -1 for padding; block_expert [P / block]: each block's expert, -1 past the last), where each expert's
    rows are padded to a multiple of `block` and P = M + E * (block - 1) rounded up to a block.
    Up to SMALL_SORT rows (decode batches, small verify blocks) one Triton program does it; more take
    the torch ops below (the same result); `small` forces either (tests)."""
    flat = ids.flatten()
    M, E = flat.shape[0], num_experts
    P = -(-(M + E * (block - 1)) // block) * block
    if small if small is not None else M <= SMALL_SORT and (flat.is_cuda or INTERPRET):
        rows = torch.empty(P, dtype=torch.int64, device=ids.device)
        block_expert = torch.empty(P // block, dtype=torch.int32, device=ids.device)
        _sort_small_kernel[(1,)](flat.contiguous(), rows, block_expert, M, E, P,
                                 BLOCK=max(16, triton.next_power_of_2(M)), EP=max(16, triton.next_power_of_2(E)),
                                 CHUNK=1024, BCHUNK=64, BM=block, num_warps=4 if M <= 64 else 8,
                                 **launch_kwargs(flat))
        return rows, block_expert
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    starts = ends - padded
    first = counts.cumsum(0) - counts
    e_sorted = flat[order]
    dest = starts[e_sorted] + torch.arange(M, device=ids.device) - first[e_sorted]
    rows = torch.full((P,), -1, dtype=torch.int64, device=ids.device)
    rows[dest] = order
    block_start = torch.arange(0, P, block, device=ids.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    return rows, block_expert


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor | None,
              ids: torch.Tensor | None, act: tuple = ("silu",), b_gate_up: torch.Tensor | None = None,
              b_down: torch.Tensor | None = None, slots: bool = False, route: tuple | None = None,
              scales: tuple | None = None) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], routing weights and expert ids [T, k], biases
    [E, 2I] and [E, H] or None -> [T, H]; slots: the k weighted expert outputs [T, k, H] unsummed
    (layer_ops.add_rmsnorm sums them in slot order, saving a launch). act: ("silu",) or
    ("swiglu_oai", alpha, limit). route (logits, k, softmax_all, norm) instead of weights and ids: the
    router's logits (or its float32 parts [T, P, E], norm_router's) routed as route_topk routes them;
    on the direct path inside the gate_up kernel (no top-k launch). scales (gate_up's, down's, block): FP8
    weights (float8_e4m3fn) in [bn, bk] blocks, each block's float32 factor in scales [E, rows / bn, cols / bk]
    (gate and up each a whole number of blocks), applied to each K-tile's float32 product."""
    if act[0] not in ("silu", "swiglu_oai"):
        raise NotImplementedError(f"the Triton expert kernels have no activation {act[0]!r}")
    oai = act[0] == "swiglu_oai"
    alpha, limit = (float(act[1]), float(act[2])) if oai else (0.0, 0.0)
    bias = b_gate_up is not None
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    inter = two_i // 2
    k = route[1] if route is not None else ids.shape[1]
    x = x.contiguous()
    direct = T * k <= E // 2 if settings.MOE_DIRECT is None else T <= settings.MOE_DIRECT
    in_kernel = route is not None and direct
    if route is not None:
        logits, _, softmax_all, norm = route
    if route is not None and not direct:
        weights, ids = route_topk(logits, k, softmax_all, norm, x.dtype if logits.dim() == 3 else None)
    if in_kernel:
        if logits.shape[0] != T or logits.shape[-1] != E or logits.stride(-1) != 1:
            raise ValueError(f"router logits {tuple(logits.shape)} do not fit {T} tokens and {E} experts")
        lparts = logits.shape[1] if logits.dim() == 3 else 0
        if lparts and (logits.dtype != torch.float32 or not logits.is_contiguous()):
            raise ValueError("router parts need float32 [T, P, E] contiguous")
        ids = torch.empty(T, k, device=x.device, dtype=torch.int64)  # written by the gate_up kernel
        weights = torch.empty(T, k, device=x.device, dtype=x.dtype)
    if direct:  # program row b = routed row b, its expert from ids
        rows = block_expert = ids.contiguous().view(-1)
        nb = T * k
        (bn, bk, stages), (bn_d, bk_d, stages_d) = settings.MOE_DIRECT_TILES
    else:
        rows, block_expert = sort_by_expert(ids, E)
        nb = rows.shape[0] // BLOCK_M
        bn, bk, stages = bn_d, bk_d, stages_d = SMALL_TILES if T * k <= SMALL_ROWS else TILES
    if scales is not None:
        s_gu, s_d, (bq_n, bq_k) = scales
        if w_gate_up.dtype != torch.float8_e4m3fn or inter % bq_n or bq_k % 16:
            raise ValueError(f"fused_moe: FP8 experts need float8_e4m3fn weights, gate and up of whole {bq_n}-row "
                             f"blocks and blocks of a multiple of 16 columns, got {w_gate_up.dtype}, {inter} rows, "
                             f"{bq_k} columns")
        fit = bq_k & -bq_k  # (the largest power of two dividing the block's columns: K-tiles inside one block)
        bk, bk_d = min(bk, fit), min(bk_d, fit)
        scaled = dict(SCALED=True, BQ_N=bq_n, BQ_K=bq_k)
        gu_s, d_s = (s_gu, s_gu.stride(0), s_gu.stride(1)), (s_d, s_d.stride(0), s_d.stride(1))
    else:
        scaled = dict(SCALED=False, BQ_N=1, BQ_K=1)
        gu_s = d_s = (x, 0, 0)  # (placeholders)
    h = torch.empty(nb * (1 if direct else BLOCK_M), inter, device=x.device, dtype=x.dtype)
    y = torch.empty(T * k, H, device=x.device, dtype=x.dtype)
    f32 = INTERPRET or x.dtype == torch.float32  # the interpreter's bf16 dot is not to be trusted
    bg = b_gate_up if bias else w_gate_up  # a placeholder pointer when there is no bias
    bd = b_down if bias else w_down
    weights = weights.contiguous().view(-1)
    route_args = (logits, weights, E, logits.stride(0)) if in_kernel else (x, weights, E, 0)
    route_flags = dict(ROUTE=in_kernel, TOP_K=k, KP=triton.next_power_of_2(k), EP=max(16, triton.next_power_of_2(E)),
                       SOFTMAX_ALL=in_kernel and bool(softmax_all), NORM=in_kernel and bool(norm),
                       PARTS=lparts if in_kernel else 0)
    _gate_up_kernel[(nb, triton.cdiv(inter, bn))](
        x, w_gate_up, bg, h, rows, block_expert, H, inter, k, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        bg.stride(0), h.stride(0), alpha, limit, *route_args, *gu_s, **scaled, BLOCK_M=BLOCK_M, BLOCK_N=bn,
        BLOCK_K=bk, F32_DOT=f32,
        BIAS=bias, OAI=oai, DIRECT=direct, **route_flags, num_warps=4, num_stages=stages, **launch_kwargs(x))
    _down_kernel[(nb, triton.cdiv(H, bn_d))](
        h, w_down, bd, y, rows, block_expert, weights, inter, H, h.stride(0), w_down.stride(0),
        w_down.stride(1), bd.stride(0), y.stride(0), *d_s, **scaled, BLOCK_M=BLOCK_M, BLOCK_N=bn_d, BLOCK_K=bk_d,
        F32_DOT=f32, BIAS=bias, DIRECT=direct, num_warps=4, num_stages=stages_d, **launch_kwargs(x))
    return y.view(T, k, H) if slots else y.view(T, k, H).sum(1)
