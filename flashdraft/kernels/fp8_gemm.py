"""Block-scaled FP8 weights times bf16 activations (W8A16), for few rows: y = x @ dequant(W)^T with W
[N, K] float8_e4m3fn in [BN_Q, BK_Q] blocks (HF fine-grained FP8: 128 x 128) and scale_inv [ceil(N / BN_Q),
ceil(K / BK_Q)] the factor that restores each block (models/quant.py reads the layout).

A decode or verify GEMM at these rows only streams its weight, so FP8 weights halve what it reads. Each
program streams a strip of BLOCK_N weight rows over the whole K, "swap AB" as kernels/skinny_gemm.py's
`dot`: a K-tile of W (BLOCK_K columns, inside one scale block) widened to bf16 (every e4m3 value is a bf16
value) times x^T on the tensor cores, the float32 partial scaled by its rows' block factors and summed in
float32; one rounding to x's dtype at the end. The activations stay bf16 (not quantized per 1 x 128 group
as a W8A8 GEMM would): the result is that of the dequantized weights, as the reference path's. Grids
depend on shapes only: CUDA-graph safe. Timed by benchmarks/device/fp8_gemm.py; models/layers.py's
BlockFP8Linear calls it for the dense layers of a block-FP8 checkpoint on CUDA."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_dot_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, CHUNK, stride_xm, stride_wn, stride_sn, stride_ym,
                    stride_yp, BN_Q: tl.constexpr, BK_Q: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SUB: tl.constexpr, MPAD: tl.constexpr, PARTS: tl.constexpr):
    dt = y_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * MPAD + tl.arange(0, MPAD)
    k_lo = tl.program_id(2) * CHUNK  # (split-K: this program's part of K, a multiple of BLOCK_K * SUB)
    k_hi = tl.minimum(k_lo + CHUNK, K)
    k = tl.arange(0, BLOCK_K)
    n_ok, m_ok = n < N, m < M
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn
    x_cols = x_ptr + m.to(tl.int64)[None, :] * stride_xm
    s_rows = s_ptr + (n // BN_Q).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, MPAD], dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K * SUB):
        for j in tl.static_range(SUB):  # SUB K-tiles in flight, each inside one scale block
            kk = k0 + j * BLOCK_K + k
            k_ok = kk < k_hi
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_cols + kk[:, None], mask=m_ok[None, :] & k_ok[:, None], other=0.0)
            part = tl.dot(w.to(tl.bfloat16), xt.to(tl.bfloat16))
            s = tl.load(s_rows + (k0 + j * BLOCK_K) // BK_Q, mask=n_ok & (k0 + j * BLOCK_K < k_hi), other=0.0)
            acc += part * s[:, None]
    out = y_ptr + tl.program_id(2).to(tl.int64) * stride_yp + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    if PARTS:
        tl.store(out, acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(out, acc.to(dt), mask=n_ok[:, None] & m_ok[None, :])


def fp8_tiles(M: int, N: int, K: int, block: tuple[int, int]) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, SUB, split, MPAD, num_warps): K-tiles inside one scale block (BLOCK_K divides BK_Q),
    two of them in flight a loop, x^T tiles of 16 / 32 / 64 rows, strips of 64 weight rows; K split over 4
    programs where there are fewer than 256 strips. The best of a sweep on Qwen3-8B's GEMMs at M = 1 and 32
    (H200, benchmarks/device/fp8_gemm.py --sweep) on every shape (qkv at 32 rows: within 1%)."""
    bk = next(t for t in (128, 64, 32, 16) if block[1] % t == 0)
    mpad = 16 if M <= 16 else 32 if M <= 32 else 64
    split = 1 if -(-N // 64) >= 256 else 4
    while split > 1 and K // split < 2 * bk:
        split //= 2
    return 64, bk, 2, split, mpad, 4


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int],
               tiles: tuple[int, int, int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) @ dequant(w)^T -> [M, N] in x's dtype; w [N, K] float8_e4m3fn, scale_inv
    float32 [ceil(N / block[0]), ceil(K / block[1])]. With K split, each part's float32 sum is added in a
    fixed order (the same result on every call)."""
    M, K = x.shape
    N = w.shape[0]
    if w.dtype != torch.float8_e4m3fn or w.shape[1] != K:
        raise ValueError(f"fp8_linear: w must be float8_e4m3fn [N, {K}], got {w.dtype} {tuple(w.shape)}")
    want = (-(-N // block[0]), -(-K // block[1]))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"fp8_linear: scale_inv must be {want} for blocks {block}, got {tuple(scale_inv.shape)}")
    if block[1] % 16:
        raise ValueError(f"fp8_linear: block columns must be a multiple of 16, got {block[1]}")
    if M == 0:
        return torch.empty(0, N, dtype=x.dtype, device=x.device)
    bn, bk, sub, split, mpad, warps = tiles or fp8_tiles(M, N, K, block)
    step = bk * sub
    chunk = -(-K // split // step) * step  # (each part a whole number of loop steps)
    split = -(-K // chunk)
    x, w, s = x.contiguous(), w.contiguous(), scale_inv.float().contiguous()
    y = torch.empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, mpad), split)
    _fp8_dot_kernel[grid](x, w, s, y, M, N, K, chunk, x.stride(0), w.stride(0), s.stride(0), y.stride(1),
                          y.stride(0), BN_Q=block[0], BK_Q=block[1], BLOCK_N=bn, BLOCK_K=bk, SUB=sub, MPAD=mpad,
                          PARTS=split > 1, num_warps=warps)
    return y[0] if split == 1 else y.sum(0).to(x.dtype)
