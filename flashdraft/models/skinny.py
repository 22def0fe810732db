"""Triton GEMMs for few rows: y = act(x) @ W^T (+ bias) with x [M, K], M <= 32 (a decode batch, a
verify or draft block), W [N, K] row-major as nn.Linear stores it. At these M a GEMM only streams W:
a Qwen3-8B decode step reads 15 GB of weights for 0.03 TFLOP, so its time is set by how close the
weight reads come to the memory bandwidth. Both kernels keep many programs in flight, each streaming
a strip of BLOCK_N weight rows over the whole K (no split-K: no second kernel, no atomics, the same
sum order on every call).

    gemv    M == 1: acc[BLOCK_N, BLOCK_K] += w * x in float32, one reduction at the end
    dot     M <= 32: "swap AB", acc[BLOCK_N, MPAD] += W_strip @ x^T on the tensor cores, MPAD 16 / 32

On an H100 (benchmarks/device/gemm_sweep.py, Qwen3-8B shapes, weights cold in L2) these read W at
0.85-1.06x of the measured copy bandwidth, 4-19% faster than cuBLAS at M = 1-16; the tile rules of
`_gemv_tiles` / `_dot_tiles` are within 5% of the best swept config on every shape.

act="silu_mul": x is a gate_up row [M, 2K] and the kernel multiplies silu(gate) * up while loading
it, rounded as fused.silu_mul rounds, so the MLP's down projection needs no separate kernel.
Accumulation is float32 (bias added in float32), rounded once to x's dtype. Grids depend on shapes only: CUDA-graph safe."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_ROWS = 32


@triton.jit
def _load_act(x_ptr, offs, mask, K, ACT: tl.constexpr, dt: tl.constexpr):
    """x at `offs` (row offsets + column k), or silu(x[k]) * x[K + k] rounded like fused.silu_mul."""
    if ACT:
        g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_ptr + offs + K, mask=mask, other=0.0).to(tl.float32)
        return ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * u).to(dt)
    return tl.load(x_ptr + offs, mask=mask, other=0.0)


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr, ACT: tl.constexpr,
                 HAS_BIAS: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if EVEN:
            w = tl.load(w_row + kk[None, :])
        else:
            w = tl.load(w_row + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
        x = _load_act(x_ptr, kk, kk < K, K, ACT, dt)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)
    tl.store(y_ptr + n, y.to(dt), mask=n < N)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MPAD: tl.constexpr, EVEN: tl.constexpr,
                ACT: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, MPAD)
    k = tl.arange(0, BLOCK_K)
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, MPAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if EVEN:
            w = tl.load(w_row + kk[None, :])
        else:
            w = tl.load(w_row + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
        xt = _load_act(x_ptr, m[None, :] * stride_xm + kk[:, None], (m[None, :] < M) & (kk[:, None] < K), K, ACT, dt)
        if IEEE:  # float32 weights or the interpreter: full-precision float32 products, not TF32
            acc = tl.dot(w.to(tl.float32), xt.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, xt.to(w.dtype), acc)
    if HAS_BIAS:
        acc = acc + tl.load(b_ptr + n, mask=n < N, other=0.0).to(tl.float32)[:, None]
    out = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(out, acc.to(dt), mask=(m[None, :] < M) & (n[:, None] < N))


def _ieee(w: torch.Tensor) -> bool:
    # the interpreter's bf16 dot gives garbage; float32 there is exact
    return w.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def _largest_dividing(K: int, options: tuple[int, ...]) -> int | None:
    return next((b for b in options if K % b == 0), None)


def _gemv_tiles(N: int, K: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, warps, stages): 4 x 1024 tiles, as swept best on the 8B shapes; a K that
    1024 does not divide takes the largest power of two that does, with BLOCK_N growing to match."""
    bk = _largest_dividing(K, (1024, 512, 256, 128, 64)) or min(1024, triton.next_power_of_2(K))
    return max(4, 4096 // bk), bk, 4, 3


def _dot_tiles(M: int, K: int) -> tuple[int, int, int, int]:
    bk = 256 if M <= 16 else 128
    bk = _largest_dividing(K, tuple(b for b in (256, 128, 64, 32, 16) if b <= bk)) or bk
    return 64, bk, 4, 5


def skinny_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, act: str | None = None,
                  tiles: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """act(x) [M, K] @ w[N, K]^T (+ bias) -> [M, N] for 1 <= M <= MAX_ROWS. act: None or
    "silu_mul" (then x is [M, 2K]). tiles (BLOCK_N, BLOCK_K, warps, stages) overrides the rules."""
    if act not in (None, "silu_mul"):
        raise ValueError(f"unknown act {act!r}")
    N, K = w.shape
    M = x.shape[0]
    width = 2 * K if act else K
    if x.dim() != 2 or x.shape[1] != width or not 1 <= M <= MAX_ROWS:
        raise ValueError(f"x {tuple(x.shape)} does not fit w {tuple(w.shape)} (act {act}, at most {MAX_ROWS} rows)")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if w.stride(-1) != 1:
        raise ValueError("w needs a unit last stride")
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    flags = dict(ACT=act is not None, HAS_BIAS=bias is not None)
    b = bias if bias is not None else w
    if M == 1:
        bn, bk, warps, stages = tiles or _gemv_tiles(N, K)
        _gemv_kernel[(triton.cdiv(N, bn),)](x, w, b, y, N, K, w.stride(0), BLOCK_N=bn, BLOCK_K=bk,
                                            EVEN=N % bn == 0 and K % bk == 0, **flags, num_warps=warps,
                                            num_stages=stages)
        return y
    bn, bk, warps, stages = tiles or _dot_tiles(M, K)
    _dot_kernel[(triton.cdiv(N, bn),)](x, w, b, y, M, N, K, x.stride(0), w.stride(0), y.stride(0), BLOCK_N=bn,
                                       BLOCK_K=bk, MPAD=16 if M <= 16 else 32, EVEN=N % bn == 0 and K % bk == 0,
                                       **flags, IEEE=_ieee(w), num_warps=warps, num_stages=stages)
    return y


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 4, block_k: int = 1024, num_warps: int = 4,
         num_stages: int = 3) -> torch.Tensor:
    """The M = 1 kernel with explicit tiles (sweeps)."""
    assert x.shape[0] == 1
    return skinny_linear(x, w, tiles=(block_n, block_k, num_warps, num_stages))


def dot(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 256, num_warps: int = 4,
        num_stages: int = 5) -> torch.Tensor:
    """The tensor-core kernel with explicit tiles, any M <= MAX_ROWS (sweeps)."""
    M, K = x.shape
    N = w.shape[0]
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    _dot_kernel[(triton.cdiv(N, block_n),)](x, w, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                            BLOCK_N=block_n, BLOCK_K=block_k, MPAD=16 if M <= 16 else 32,
                                            EVEN=N % block_n == 0 and K % block_k == 0, ACT=False, HAS_BIAS=False,
                                            IEEE=_ieee(w),
                                            num_warps=num_warps, num_stages=num_stages)
    return y
