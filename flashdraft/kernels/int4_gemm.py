"""4-bit weights times bf16 / fp16 activations (W4A16), for few rows: y = x @ dequant(W)^T with W held in
kernels/int4_layout.py's layout (AWQ, GPTQ, compressed-tensors' pack-quantized int4 and GGUF's 4-bit types,
repacked at load by models/quant_serve.py): `qweight` [N, K / 8] int32, eight 4-bit values 0..15 a word, and per
group of `group` input columns a `scale` and a `zero` (and for GGUF an `offset`) [N, K / group] (float32):
w = (q - zero) * scale (+ offset).

A decode or verify GEMM at these rows streams its weight: a 4-bit one reads a quarter of the bf16 bytes (plus
8 bytes a group for its scale and zero). Each program streams a strip of BLOCK_N weight rows over the whole K
("swap AB", as kernels/skinny_gemm.py's `dot`): a K-tile of packed words widened in registers to [BLOCK_N,
BLOCK_K] values, dequantized in float32 and rounded to x's dtype (the weights the dequantized-at-load path
holds, bit for bit), times x^T on the tensor cores, summed in float32; one rounding at the end. A K-tile lies
inside one group (BLOCK_K divides the group, or equals it). Grids depend on shapes only: CUDA-graph safe.
models/layers.py's Int4Linear calls it for the dense layers of an int4 checkpoint on CUDA."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft import settings
from flashdraft.kernels.int4_layout import check_int4_layout


@triton.jit
def _int4_dot_kernel(x_ptr, q_ptr, s_ptr, z_ptr, o_ptr, y_ptr, M, N, K, CHUNK, stride_xm, stride_qn, stride_sn,
                     stride_ym, stride_yp, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MPAD: tl.constexpr, STAGES: tl.constexpr, PARTS: tl.constexpr, F32_DOT: tl.constexpr,
                     OFFSET: tl.constexpr):
    dt = x_ptr.dtype.element_ty
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * MPAD + tl.arange(0, MPAD)
    k_lo = tl.program_id(2) * CHUNK  # (split-K: this program's part of K, a multiple of BLOCK_K)
    k_hi = tl.minimum(k_lo + CHUNK, K)
    k = tl.arange(0, BLOCK_K)
    words = tl.arange(0, BLOCK_K // 8)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    n_ok, m_ok = n < N, m < M
    q_rows = q_ptr + n.to(tl.int64)[:, None] * stride_qn
    x_cols = x_ptr + m.to(tl.int64)[None, :] * stride_xm
    g_rows = n.to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_N, MPAD], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=STAGES):
        w_ok = (k0 // 8 + words) < tl.cdiv(K, 8)
        packed = tl.load(q_rows + (k0 // 8 + words)[None, :], mask=n_ok[:, None] & w_ok[None, :], other=0)
        vals = tl.reshape((packed[:, :, None] >> shifts) & 0xF, (BLOCK_N, BLOCK_K))
        scale = tl.load(s_ptr + g_rows + k0 // GROUP, mask=n_ok, other=0.0)
        zero = tl.load(z_ptr + g_rows + k0 // GROUP, mask=n_ok, other=0.0)
        w = (vals.to(tl.float32) - zero[:, None]) * scale[:, None]
        if OFFSET:  # (GGUF's 4-bit types)
            w += tl.load(o_ptr + g_rows + k0 // GROUP, mask=n_ok, other=0.0)[:, None]
        w = w.to(dt)
        kk = k0 + k
        xt = tl.load(x_cols + kk[:, None], mask=m_ok[None, :] & (kk < k_hi)[:, None], other=0.0)
        if F32_DOT:  # (the interpreter multiplies bf16 bit patterns as integers in tl.dot)
            acc += tl.dot(w.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(w, xt)
    out = y_ptr + tl.program_id(2).to(tl.int64) * stride_yp + m.to(tl.int64)[None, :] * stride_ym + n[:, None]
    if PARTS:
        tl.store(out, acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        tl.store(out, acc.to(dt), mask=n_ok[:, None] & m_ok[None, :])


def int4_tiles(M: int, N: int, K: int, group: int) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_N, BLOCK_K, stages, split, MPAD, num_warps): K-tiles of the group's width up to 128 columns, x^T
    tiles of 16 / 32 / 64 rows, strips of 64 weight rows, K split over 4 programs where there are fewer than 256
    strips. Not yet swept on a GPU: the FP8 kernel's shape (kernels/fp8_gemm.py) with a pipelined loop."""
    bk = min(group, 128)
    mpad = 16 if M <= 16 else 32 if M <= 32 else 64
    split = 1 if -(-N // 64) >= 256 else 4
    while split > 1 and K // split < 2 * bk:
        split //= 2
    return 64, bk, 3, split, mpad, 4


def int4_linear(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                offset: torch.Tensor | None = None, tiles: tuple[int, int, int, int, int, int] | None = None
                ) -> torch.Tensor:
    """x [M, K] (bf16 or fp16) @ dequant(W)^T -> [M, N] in x's dtype; qweight [N, K / 8] int32, scale, zero (and
    offset) float32 [N, ceil(K / group)]. With K split, each part's float32 sum is added in a fixed order."""
    M, K = x.shape
    N = qweight.shape[0]
    why = check_int4_layout(N, K, group)
    if why:
        raise ValueError(f"int4_linear: {why}")
    groups = -(-K // group)
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (N, K // 8):
        raise ValueError(f"int4_linear: qweight must be int32 [{N}, {K // 8}], got {qweight.dtype} "
                         f"{tuple(qweight.shape)}")
    for name, t in (("scale", scale), ("zero", zero)) + ((("offset", offset),) if offset is not None else ()):
        if t.dtype != torch.float32 or tuple(t.shape) != (N, groups):
            raise ValueError(f"int4_linear: {name} must be float32 [{N}, {groups}], got {t.dtype} {tuple(t.shape)}")
    if M == 0:
        return torch.empty(0, N, dtype=x.dtype, device=x.device)
    bn, bk, stages, split, mpad, warps = tiles or int4_tiles(M, N, K, group)
    chunk = -(-K // split // bk) * bk  # (each part a whole number of K-tiles)
    split = -(-K // chunk)
    x, q = x.contiguous(), qweight.contiguous()
    y = torch.empty(split, M, N, dtype=torch.float32 if split > 1 else x.dtype, device=x.device)
    grid = (triton.cdiv(N, bn), triton.cdiv(M, mpad), split)
    scale, zero = scale.contiguous(), zero.contiguous()
    _int4_dot_kernel[grid](x, q, scale, zero, zero if offset is None else offset.contiguous(), y, M, N, K, chunk,
                           x.stride(0), q.stride(0), scale.stride(0), y.stride(1), y.stride(0), GROUP=group,
                           BLOCK_N=bn, BLOCK_K=bk, MPAD=mpad, STAGES=stages, PARTS=split > 1,
                           F32_DOT=settings.interpreted(), OFFSET=offset is not None, num_warps=warps)
    return y[0] if split == 1 else y.sum(0).to(x.dtype)
