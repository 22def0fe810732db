"""The layout of 4-bit weights that kernels/int4_gemm.py reads (models/quant_serve.py repacks every int4 format
into it at load): qweight [N, K / 8] int32, value i of word j at bits 4i (column 8j + i), values 0..15; a scale
and a zero point a group of input columns, float32 [N, K / group] (and for GGUF's 4-bit types an offset:
w = (q - zero) * scale + offset, the file's own arithmetic). Pure torch: no Triton needed to pack."""

from __future__ import annotations

import torch


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[N, K] integers 0..15 (K a multiple of 8) -> [N, K / 8] int32 in the kernel's layout."""
    v = values.to(torch.int64).reshape(values.shape[0], -1, 8)
    word = sum(v[:, :, i] << (4 * i) for i in range(8))
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()  # (the unsigned word as a signed int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[N, K / 8] int32 in the kernel's layout -> [N, K] int32 values 0..15."""
    words = packed.to(torch.int32)  # (an arithmetic shift: the mask drops the sign's copies)
    return torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], -1).reshape(packed.shape[0], -1)


def check_int4_layout(N: int, K: int, group: int) -> str | None:
    """Why the kernel cannot take a weight [N, K] in groups of `group` (None: it can)."""
    if K % 8:
        return f"its {K} input columns are not whole int32 words of eight"
    if group % 16 or (group > 128 and group % 128):
        return f"its groups of {group} columns are not a multiple of 16 (or, past 128, of 128)"
    return None


def dequantize_int(q: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, group: int,
                   offset: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 weight [N, K] of int values q [N, K] and a zero, scale (and offset) [N, ceil(K / group)] a
    group of columns: (q - zero) * scale (+ offset), the arithmetic the kernel and every format's own follow."""
    idx = torch.arange(q.shape[1], device=q.device) // group
    w = (q.float() - zero.float()[:, idx]) * scale.float()[:, idx]
    return w if offset is None else w + offset.float()[:, idx]
