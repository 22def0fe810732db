"""Triton GEMMs for few rows: y = x @ W^T with x [M, K], M <= 32 (a decode batch, a verify or draft
block), W [N, K] row-major as nn.Linear stores it. At these M a GEMM only streams W: a Qwen3-8B decode
step reads 15 GB of weights for 0.03 TFLOP. What decides its time is how close the weight reads come
to the memory bandwidth, so both kernels keep many programs in flight, each streaming a strip of
BLOCK_N weight rows over the whole K (no split-K: no second kernel, no atomics, deterministic).

    gemv    M == 1: acc[BLOCK_N, BLOCK_K] += w * x in float32, one reduction at the end
    dot     M <= 32: "swap AB", acc[BLOCK_N, MPAD] = W_strip @ x^T on the tensor cores, MPAD = 16 or 32

Accumulation is float32, the result rounded once to x's dtype. Grids depend on shapes only: every
launch is CUDA-graph safe."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_wn,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if EVEN:
            w = tl.load(w_row + kk[None, :])
            x = tl.load(x_ptr + kk)
        else:
            w = tl.load(w_row + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
            x = tl.load(x_ptr + kk, mask=kk < K, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, 1)
    tl.store(y_ptr + n, y.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _dot_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, MPAD: tl.constexpr, EVEN: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, MPAD)
    k = tl.arange(0, BLOCK_K)
    w_row = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_col = x_ptr + m[None, :] * stride_xm  # x^T tile [BLOCK_K, MPAD]
    acc = tl.zeros([BLOCK_N, MPAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k
        if EVEN:
            w = tl.load(w_row + kk[None, :])
        else:
            w = tl.load(w_row + kk[None, :], mask=(n[:, None] < N) & (kk[None, :] < K), other=0.0)
        xt = tl.load(x_col + kk[:, None], mask=(m[None, :] < M) & (kk[:, None] < K), other=0.0)
        acc = tl.dot(w, xt, acc)
    out = y_ptr + m[None, :] * stride_ym + n[:, None]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(m[None, :] < M) & (n[:, None] < N))


def gemv(x: torch.Tensor, w: torch.Tensor, block_n: int = 16, block_k: int = 512, num_warps: int = 4,
         num_stages: int = 2) -> torch.Tensor:
    """x [1, K] @ w[N, K]^T -> [1, N]."""
    N, K = w.shape
    assert x.shape == (1, K) and x.stride(-1) == 1 and w.stride(-1) == 1
    y = torch.empty(1, N, device=x.device, dtype=x.dtype)
    even = N % block_n == 0 and K % block_k == 0
    _gemv_kernel[(triton.cdiv(N, block_n),)](x, w, y, N, K, w.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
                                             EVEN=even, num_warps=num_warps, num_stages=num_stages)
    return y


def dot(x: torch.Tensor, w: torch.Tensor, block_n: int = 64, block_k: int = 128, num_warps: int = 4,
        num_stages: int = 4) -> torch.Tensor:
    """x [M, K] @ w[N, K]^T -> [M, N], M <= 32."""
    M, K = x.shape
    N = w.shape[0]
    assert w.shape[1] == K and M <= 32 and x.stride(-1) == 1 and w.stride(-1) == 1
    y = torch.empty(M, N, device=x.device, dtype=x.dtype)
    even = N % block_n == 0 and K % block_k == 0
    _dot_kernel[(triton.cdiv(N, block_n),)](x, w, y, M, N, K, x.stride(0), w.stride(0), y.stride(0),
                                            BLOCK_N=block_n, BLOCK_K=block_k, MPAD=16 if M <= 16 else 32,
                                            EVEN=even, num_warps=num_warps, num_stages=num_stages)
    return y
