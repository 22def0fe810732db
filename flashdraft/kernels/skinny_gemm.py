"""Triton GEMMs for few rows: y = x @ W^T (+ bias) with x [M, K], M <= SKINNY_ROWS (32; a decode batch,
a verify or draft block), W [N, K] row-major as nn.Linear stores it. At these M a GEMM only streams W: a
Qwen3-8B decode step reads 15 GB of weights for 0.03 TFLOP, so its time is set by how close the
weight reads come to the memory bandwidth. Both kernels keep many programs in flight, each streaming
a strip of BLOCK_N weight rows over the whole K, the same sum order on every call. A GEMM of few output
rows (2,560 columns are 40 strips of 64 on 132 SMs) splits K over two programs a strip instead
(`_dot_split`): each writes its float32 partial, and the strip's last program to finish (an atomic
count) adds them in a fixed order: one kernel, and still the same sums whatever the timing. Where
the result goes straight into the next residual add and norm (the o, out and down projections of
the fused layers), the partials themselves are the result (`parts=True`) and layer_ops.add_rmsnorm adds
them in the same order: the count, reload and store that end every strip cost a narrow GEMM 1.2-2.3
us at one row (H200), more than the add costs the norm.

    dot     M <= SKINNY_ROWS: "swap AB", acc[BLOCK_N, MPAD] += W_strip @ x^T on the tensor cores, MPAD
            16 / 32 (64 / 128 with settings.SKINNY_ROWS raised)
    gemv    M == 1: acc[BLOCK_N, BLOCK_K] += w * x in float32, one reduction at the end

Blocks of SKINNY_ROWS + 1 to MID_ROWS rows (64: a small target's verify and draft blocks at concurrency
5-8) take `dot` with x^T tiles of 64 where `mid_tiles` has tiles for the weight's shape (widths up to
1,024), cuBLAS elsewhere: on SmolLM2 the glu then saves the silu * up kernel, and every GEMM launched here
keeps the step's PDL chain (launch.py), which a cuBLAS kernel breaks. The shipped pair's DFlash step graph
went from 1.068 to 0.989 ms at concurrency 8 (64 rows; H200, benchmarks/device/pair_kernels.py, one
process a setting). Its 128-row tiles (FLASHDRAFT_MID_ROWS=128) lost at concurrency 16: 1.318 against 1.145 ms.

The model path uses `dot` for every M, one row included: a row's result then does not depend on how
many rows share the call (the tiles are the same for 1-16 rows), so a plain decode step at batch 1
and the verify block that checks the same position round alike in bf16. With `gemv` for one row
(2-8% faster on those GEMMs, ~1% of a decode step) SmolLM2's DFlash outputs at concurrency 1
matched plain decoding's on 5 of 32 HumanEval prompts, the rest parting at bf16 near-ties.

On an H100 (benchmarks/device/gemm_sweep.py, Qwen3-8B shapes, weights cold in L2) these read W at
0.85-1.06x of the measured copy bandwidth, 4-19% faster than cuBLAS at M = 1-16; the tile rules of
`_gemv_tiles` / `_dot_tiles` are within 5% of the best swept config on every shape.

glu=True: W is a packed [gate; up] matrix [2N, K] and y = silu(x @ gate^T) * (x @ up^T) [M, N]: each
program streams the gate strip and the matching up strip, so the MLP's activation costs no kernel
and no [M, 2N] round trip. Rounded as the torch MLP rounds: gate and up to x's dtype, silu to x's
dtype, then the product. Accumulation is float32 (bias added in float32), rounded once to x's
dtype. Grids depend on shapes only: CUDA-graph safe."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft import settings
from flashdraft.kernels.launch import arrival_counts, launch_kwargs, pdl_enter, pdl_trigger

# the rows these tiles take (settings.SKINNY_ROWS, settings.MID_ROWS) and the widest input of mid_tiles
# (settings.MID_MAX_K) are read at each call; the most weight rows mid_tiles takes:
MID_MAX_N = 4096
SMEM_BUDGET = 200 * 1024  # bytes of pipelined tiles per program (H100/H200 allow 227 KB)
# split-K (_dot_split): GEMMs of fewer output rows than settings.SPLIT_BELOW split K over 2 programs a strip,
# each streaming at least SPLIT_MIN_K of it
NARROW_BELOW = 3200  # outputs of 2,048 rows up to this many stream as 64-row strips (_dot_tiles)
SPLIT_MIN_K = 1024
# routers (at most ROUTER_MAX_N outputs) whose parts go to the top-k kernel (parts=True): K cut into parts
# of about settings.ROUTER_PART_K, each a program a 16-row strip (_router_tiles)
ROUTER_MAX_N = 256


@triton.jit
def _silu_mul(g, u, dt: tl.constexpr):
    g = g.to(dt).to(tl.float32)
    u = u.to(dt).to(tl.float32)
    return ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, GLU: tl.constexpr,
                 HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    up_row = w_row + N.to(tl.int64) * stride_wn  # GLU: the up strip, N rows below the gate strip
    pdl_enter(USE_PDL)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if EVEN:
            x = tl.load(x_ptr + kk).to(tl.float32)[None, :]
            acc += tl.load(w_row + kk[None, :]).to(tl.float32) * x
            if GLU:
                acc_up += tl.load(up_row + kk[None, :]).to(tl.float32) * x
        else:
            mask = (n[:, None] < N) & (kk[None, :] < K)
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_row + kk[None, :], mask=mask, other=0.0).to(tl.float32) * x
            if GLU:
                acc_up += tl.load(up_row + kk[None, :], mask=mask, other=0.0).to(tl.float32) * x
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    if GLU:
        y = _silu_mul(y, tl.sum(acc_up, 1), dt)
    pdl_trigger(USE_PDL)
    tl.store(y_ptr + n, y.to(dt), mask=n < N)


@triton.jit(do_not_specialize=["M"])  # any row count, one variant per MPAD: nothing compiles mid-serving
def _dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, part_ptr, count_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MPAD: tl.constexpr, EVEN: tl.constexpr,
                GLU: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr,
                PARTS: tl.constexpr, USE_PDL: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    tile = tl.program_id(0)
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, MPAD)
    k = tl.arange(0, BLOCK_K)
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    up_row = w_row + N.to(tl.int64) * stride_wn
    pdl_enter(USE_PDL)
    x_col = x_ptr + m[None, :] * stride_xm  # x^T tile [BLOCK_K, MPAD]
    acc = tl.zeros([BLOCK_N, MPAD], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, MPAD], dtype=tl.float32)
    k_len = K // SPLIT  # SPLIT > 1: this program's share of K (the caller makes it a multiple of BLOCK_K)
    k_lo = tl.program_id(1) * k_len
    for k0 in range(k_lo, k_lo + k_len, BLOCK_K):
        kk = k0 + k
        if EVEN:
            w = tl.load(w_row + kk[None, :])
            if GLU:
                wu = tl.load(up_row + kk[None, :])
        else:
            mask = (n[:, None] < N) & (kk[None, :] < K)
            w = tl.load(w_row + kk[None, :], mask=mask, other=0.0)
            if GLU:
                wu = tl.load(up_row + kk[None, :], mask=mask, other=0.0)
        xt = tl.load(x_col + kk[:, None], mask=(m[None, :] < M) & (kk[:, None] < K), other=0.0)
        if IEEE:  # float32 weights or the interpreter: full-precision float32 products, not TF32
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
            if GLU:
                acc_up = tl.dot(wu.to(tl.float32), xt.to(tl.float32), acc_up, input_precision="ieee")
        else:
            acc = tl.dot(w, xt.to(w.dtype), acc)
            if GLU:
                acc_up = tl.dot(wu, xt.to(w.dtype), acc_up)
    if SPLIT > 1 and HAS_BIAS:  # the bias joins the first part: (p0 + b) + p1 + ... in float32
        if tl.program_id(1) == 0:
            acc = acc + tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    if SPLIT > 1 and PARTS:
        # the float32 parts [M, SPLIT, N] are the result: the consumer (layer_ops.add_rmsnorm) adds them
        # in slot order, as the branch below does, without this kernel's arrival count and reload
        out = part_ptr + m[None, :] * (SPLIT * N) + tl.program_id(1) * N + n[:, None]
        pdl_trigger(USE_PDL)
        tl.store(out, acc, mask=(m[None, :] < M) & (n[:, None] < N))
    elif SPLIT > 1:
        # each program's float32 partial to its slot; the strip's last program to finish adds the
        # SPLIT partials in slot order (the same sums whichever finishes last) and stores the result
        tiles = tl.arange(0, BLOCK_N)[:, None] * MPAD + m[None, :]
        part = part_ptr + tile * SPLIT * BLOCK_N * MPAD
        tl.store(part + tl.program_id(1) * BLOCK_N * MPAD + tiles, acc)
        tl.debug_barrier()  # every thread's partial is written before the count (release) below
        done = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT - 1:
            acc = tl.load(part + tiles, cache_modifier=".cg")
            for j in range(1, SPLIT):
                acc += tl.load(part + j * BLOCK_N * MPAD + tiles, cache_modifier=".cg")
            tl.atomic_xchg(count_ptr + tile, 0)  # ready for the next call (CUDA graphs replay it)
            _dot_store(acc, acc_up, b_ptr, y_ptr, n, m, M, N, stride_ym, dt, GLU, False, USE_PDL)
    else:
        _dot_store(acc, acc_up, b_ptr, y_ptr, n, m, M, N, stride_ym, dt, GLU, HAS_BIAS, USE_PDL)


@triton.jit
def _dot_store(acc, acc_up, b_ptr, y_ptr, n, m, M, N, stride_ym, dt: tl.constexpr, GLU: tl.constexpr,
               HAS_BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    """The epilogue: bias, the glu's silu * up, one rounding to y's dtype."""
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    if GLU:
        acc = _silu_mul(acc, acc_up, dt)
    out = y_ptr + m[None, :] * stride_ym + n[:, None]
    pdl_trigger(USE_PDL)
    tl.store(out, acc.to(dt), mask=(m[None, :] < M) & (n[:, None] < N))


def _ieee(w: torch.Tensor) -> bool:
    # the interpreter's bf16 dot gives garbage; float32 there is exact
    return w.dtype == torch.float32 or settings.interpreted()


def _largest_dividing(K: int, options: tuple[int, ...]) -> int | None:
    return next((b for b in options if K % b == 0), None)


def _gemv_tiles(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages): 4 x 1024 tiles, as swept best on the 8B shapes; a K that
    1024 does not divide takes the largest power of two that does, with BLOCK_N growing to match."""
    bk = _largest_dividing(K, (1024, 512, 256, 128, 64)) or min(1024, triton.next_power_of_2(K))
    return max(4, 4096 // bk), bk, 4, 3


def _mpad(M: int) -> int:
    """The x^T tile's width: 16 or 32 rows (64, 128 for more)."""
    return max(16, triton.next_power_of_2(M))


def _dot_tiles(M: int, N: int, K: int, elem: int = 2, glu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages): 32 x 256 x 5 stages for N <= 4096, 64 x 256 x 4 for
    N > 16384 (vocabulary heads), else 64 x 128 x 5; glu two strips of 32 x 128 x 3: as swept best on
    the 8B shapes at M = 1-32 (within 1-3%). Narrow outputs (2,048 <= N < NARROW_BELOW) 64 x 256 x 5
    with K in halves, routers (N <= 256) 16 x 128 x 5: as swept best on the Qwen3.5-4B and MoE shapes
    at M = 1 (see _dot_split). Never a function of M: a row rounds the same in a one-row decode and in
    a verify block.
    Fewer stages (then a shorter BLOCK_K) when the pipelined W and x tiles would not fit in shared
    memory (float32)."""
    mpad = _mpad(M)
    if glu:
        bn, bk, stages = 32, 128, 3
    elif N <= 256:  # MoE routers: a few strips, latency-bound (H200, GPT-OSS's 32 x 2,880: 6.2 against 7.1 us)
        bn, bk, stages = 16, 128, 5
    elif 2048 <= N < NARROW_BELOW:  # narrow outputs: 32-48 strips of 64 rows, K split in two (_dot_split)
        bn, bk, stages = 64, 256, 5
    elif _quarters(N, K):  # hidden sizes of 1,024-2,047: 32-row strips, K in quarters of 128-wide tiles
        bn, bk, stages = 32, 128, 4
    elif N <= 4096:  # 64-row strips would leave SMs idle: 128 programs of 32 rows
        bn, bk, stages = 32, 256, 5
    elif N > 16384:  # vocabulary heads: 64 x 256 x 4 (H100, 151,936 x 4096: 410 against 413 us at M = 16)
        bn, bk, stages = 64, 256, 4
    else:
        bn, bk, stages = 64, 128, 5
    # a K that the tile does not divide: a smaller dividing tile of at least 128, else the tile with a
    # masked last step (GPT-OSS's K = 2,880 = 45 x 64: its 5,120 x 2,880 qkv took 12.1 us in 64-wide
    # tiles, 9.8 us in 128-wide ones, H200)
    bk = _largest_dividing(K, tuple(b for b in (256, 128) if b <= bk)) or \
        (bk if K >= 4 * bk else _largest_dividing(K, tuple(b for b in (64, 32, 16) if b <= bk)) or bk)
    while stages * (bn * (2 if glu else 1) + mpad) * bk * elem > SMEM_BUDGET:
        if stages > 3:
            stages -= 1
        elif bk > 16:
            bk //= 2
        else:
            break
    return bn, bk, 4, stages


def mid_tiles(N: int, K: int, glu: bool = False) -> tuple[int, int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, warps, stages, split) for SKINNY_ROWS + 1 to MID_ROWS rows (x^T tiles of 64, 128) of a
    weight [N, K] ([gate; up] for glu), or None where cuBLAS is as fast: the glu as strips of 16 x 64,
    the rest 64 x 64, for inputs up to settings.MID_MAX_K wide and weights of up to MID_MAX_N rows. Swept on an
    H200 at 64 rows against cuBLAS (benchmarks/device/gemm_sweep.py --model smollm2-135m --mid): SmolLM2's
    gate_up with its silu * up 4.8 against 6.1 us (cuBLAS and the silu * up kernel), qkv 2.9 against
    3.2, o 2.9 against 3.1; its down (K = 1,536) 4.9 against 4.6 and the drafter's fc (K = 2,880) 11.1
    against 7.5 stay on cuBLAS, as does every GEMM of wider models (not swept)."""
    if K > settings.MID_MAX_K or N > MID_MAX_N:
        return None
    if glu:
        return 16, 64, 4, 4, 1
    if K > 1024:  # SmolLM2's down: 16 x 64 strips, K in halves (4.9 us at 64 rows, the best Triton config)
        return (16, 64, 4, 4, 2) if K % 128 == 0 and N % 16 == 0 else None
    return 64, 64, 4, 4, 1


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, glu: bool = False,
                  tiles: tuple[int, int, int, int] | None = None, kernel: str = "dot",
                  split: int | None = None, parts: bool = False) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T (+ bias) -> [M, N] for 1 <= M <= SKINNY_ROWS; glu: w is [gate; up]
    [2N, K] and the result silu(gate) * up [M, N]. tiles (BLOCK_N, BLOCK_K, warps, stages)
    overrides the rules; split: programs per output strip (split-K; None: _dot_split's rule, 1 with
    explicit tiles); kernel="gemv" takes the one-row kernel (M == 1 only).
    parts: a split-K GEMM returns its float32 parts [M, split, N] (the bias in the first) instead of
    their sum, for a consumer that adds them in slot order (layer_ops.add_rmsnorm; layer_ops.join_parts):
    the same values, without the arrival count, reload and store at the end of every strip (H200,
    one row: the 4B's 2,560 x 4,096 8.9 -> 7.1 us, 2,560 x 9,216 14.4 -> 13.1 us). Without a split
    the [M, N] result as usual."""
    if kernel not in ("dot", "gemv") or (kernel == "gemv" and x.shape[0] != 1):
        raise ValueError(f"kernel must be 'dot' or, for one row, 'gemv'; got {kernel!r} for {x.shape[0]} rows")
    N, K = w.shape
    if glu:
        if N % 2 or bias is not None:
            raise ValueError(f"glu needs an even number of weight rows and no bias, got {tuple(w.shape)}")
        N //= 2
    M = x.shape[0]
    rows, mid_rows = settings.SKINNY_ROWS, settings.MID_ROWS
    mid = mid_tiles(*w.shape, glu) if tiles is None and M > rows and mid_rows > rows else None
    most = mid_rows if mid is not None else rows
    if x.dim() != 2 or x.shape[1] != K or not 1 <= M <= most:
        raise ValueError(f"x {tuple(x.shape)} does not fit w {tuple(w.shape)} (at most {most} rows)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        raise ValueError("w needs a unit last stride")
    flags = dict(GLU=glu, HAS_BIAS=bias is not None)
    b = bias if bias is not None else w
    if kernel == "gemv":
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
        bn, bk, warps, stages = tiles or _gemv_tiles(N, K)
        _gemv_kernel[(triton.cdiv(N, bn),)](x, w, b, y, N, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                            EVEN=N % bn == 0 and K % bk == 0, **flags, num_warps=warps,
                                            num_stages=stages, **launch_kwargs(x))
        return y
    if mid is not None:  # blocks of 33-128 rows (mid_tiles)
        tiles, split = mid[:4], mid[4] if split is None else split
    elif parts and tiles is None and split is None and (router := _router_tiles(N, K)) is not None:
        tiles, split = router[:4], router[4]
    bn, bk, warps, stages = tiles or _dot_tiles(M, N, K, x.element_size(), glu)
    if split is None:
        split = 1 if tiles is not None or glu else _dot_split(N, K, bn, bk)
    even = N % bn == 0 and K % bk == 0
    if split > 1 and (glu or not even or K % (split * bk)):
        raise ValueError(f"split-K {split} needs no glu and K a multiple of {split} x {bk}, N of {bn}; "
                         f"got N={N}, K={K}")
    tiles_n = triton.cdiv(N, bn)
    mpad = _mpad(M)
    parts = parts and split > 1
    if parts:  # the parts are the result: y_ptr only names the dtype, count is unused
        y = part = torch.empty(M, split, N, device=x.device, dtype=torch.float32)
        count = y
    else:
        y = torch.empty(M, N, device=x.device, dtype=x.dtype)
        part, count = y, y  # unused without split-K
    if split > 1 and not parts:
        part = torch.empty(tiles_n * split * bn * mpad, device=x.device, dtype=torch.float32)
        count = arrival_counts(x.device, tiles_n)
    _dot_kernel[(tiles_n, split)](x, w, b, y, part, count, M, N, K, x.stride(0), w.stride(0), N,
                                  BLOCK_N=bn, BLOCK_K=bk, MPAD=mpad, EVEN=even, **flags, IEEE=_ieee(w),
                                  SPLIT=split, PARTS=parts, num_warps=warps, num_stages=stages,
                                  **launch_kwargs(x))
    return y


def _dot_split(N: int, K: int, bn: int, bk: int) -> int:
    """Programs per output strip (split-K): 2 when a GEMM has fewer than settings.SPLIT_BELOW output
    rows, so that its strips alone would leave SMs idle, and each half of K still streams at least
    SPLIT_MIN_K; else 1. A function of the shapes only, never of M, like the tiles: rows round alike
    in any batch.
    Swept on an H200 at one row (benchmarks/device/gemm_sweep.py --split-tiles): 2,048-2,880 outputs
    read fastest as strips of 64 x 256 in two halves of K (Qwen3.5-4B's 2,560 x 4,096 in 8.2 us and
    2,560 x 9,216 in 14.6 us, against 10.0 and 17.3 us as 32-row strips in halves, 9.0 and 16.8 us
    as 64-row strips whole; Qwen3-30B-A3B's 2,048 x 4,096 7.5 against 8.1 us, GPT-OSS-20B's
    2,880 x 4,096 8.7-8.9 against 10.2 us); three or four parts were slower, and so were two for the
    27B's 5,120 outputs (80 strips of 64 rows)."""
    if _quarters(N, K) and N % bn == 0 and K % (4 * bk) == 0:
        return 4
    if N >= settings.SPLIT_BELOW or N % bn or K % (2 * bk) or K // 2 < SPLIT_MIN_K:
        return 1
    return 2


def _router_tiles(N: int, K: int) -> tuple[int, int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, warps, stages, split) of a router whose split-K parts a top-k kernel adds
    (moe_routing.route_topk): 16-row strips with K cut into the most parts of at least
    settings.ROUTER_PART_K, each a whole number of 128- (else 64-) wide tiles. A router reads almost
    nothing (GPT-OSS-20B's 32 x 2,880: 184 KB) and its few long strips are pure latency: 2 programs
    of 23 tiles took 6.2 us (H200). Qwen3-30B-A3B's 128 x 2,048: 8 strips x 8 parts of 256;
    GPT-OSS-20B's 32 x 2,880: 2 strips x 9 parts of 320. None (the general rules) past ROUTER_MAX_N
    outputs or when no tile divides K."""
    if not settings.ROUTER_PART_K or N > ROUTER_MAX_N or N % 16:
        return None
    bk = _largest_dividing(K, (128, 64))
    if bk is None:
        return None
    tiles = K // bk
    split = max((s for s in range(1, tiles + 1) if tiles % s == 0 and K // s >= settings.ROUTER_PART_K),
                default=1)
    return 16, bk, 4, 3, split


def _quarters(N: int, K: int) -> bool:
    """Outputs of 257-2,047 rows (Qwen3.5-0.8B's 1,024) with a K of whole 512s, a quarter at least
    512 long: K split over 4 programs a strip (_dot_split), 128 programs for 1,024 outputs. Swept on an
    H200 with the parts left to the consumer (skinny_linear(parts=True)): the 0.8B's 1,024 x 3,584 in
    4.6 us as 32 x 128 tiles in quarters, against 6.9 us for the halves of 32 x 256 with the
    in-kernel reduction."""
    return 256 < N < 2048 and K % 512 == 0 and K // 4 >= 512


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 4, block_k: int = 1024, num_warps: int = 4,
         num_stages: int = 3) -> torch.Tensor:
    """The one-row kernel with explicit tiles (sweeps)."""
    return skinny_linear(x, w, tiles=(block_n, block_k, num_warps, num_stages), kernel="gemv")


def dot(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 256, num_warps: int = 4,
        num_stages: int = 5, split: int = 1) -> torch.Tensor:
    """The tensor-core kernel with explicit tiles and split-K, any M <= SKINNY_ROWS (sweeps)."""
    return skinny_linear(x, w, tiles=(block_n, block_k, num_warps, num_stages), split=split)
