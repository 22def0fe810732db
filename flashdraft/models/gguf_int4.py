"""GGUF's 4-bit tensor types kept at 4 bits: a Q4_0, Q4_1 or Q4_K matrix read block by block into
kernels/int4_layout.py's layout (quant.py's GGUF4): the 4-bit values and, a group of 32 columns, a float32
scale, zero and offset with w = (q - zero) * scale + offset, which is the file's own arithmetic (gguf's
dequantization, bit for bit in float32):

    Q4_0   blocks of 32: d (fp16), 16 bytes of values      w = d * (q - 8)         zero 8, offset 0
    Q4_1   blocks of 32: d, m (fp16), 16 bytes              w = d * q + m           zero 0, offset m
    Q4_K   super-blocks of 256: d, dmin (fp16), 12 bytes of 6-bit sub-block scales and minimums (gguf's
           own unpacking), 128 bytes; eight sub-blocks of 32   w = (d sc) q - dmin m   zero 0, offset -dmin m

Within a block of 32, byte j holds value j (low nibble) and value j + 16 (high nibble); a Q4_K super-block's
128 bytes are four runs of 32, each the low nibbles of one sub-block and the high nibbles of the next."""

from __future__ import annotations

import numpy as np
import torch

GROUP = 32  # columns a scale, zero and offset (every 4-bit GGUF type's block or sub-block)
Q4_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """[B, R * run / 2] bytes -> [B, R * run] values: each run of run/2 bytes its low nibbles, then its high."""
    b = qs.reshape(qs.shape[0], -1, 1, run // 2) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (b & np.uint8(0x0F)).reshape(qs.shape[0], -1)


def q4_layout(data: np.ndarray, kind: str, rows: int, cols: int) -> dict[str, torch.Tensor]:
    """A [rows, cols] matrix of GGUF type `kind` (its raw bytes) -> {values [rows, cols] int32, scales, zeros,
    offsets [rows, cols / 32] float32}."""
    import gguf

    qtype = getattr(gguf.GGMLQuantizationType, kind)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    if cols % block:
        raise ValueError(f"a {kind} matrix of {cols} columns is not whole {block}-column blocks")
    blocks = np.asarray(data, dtype=np.uint8).reshape(-1, size)
    if blocks.shape[0] != rows * cols // block:
        raise ValueError(f"{kind} data of {blocks.shape[0]} blocks for a {rows} x {cols} matrix")
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # [B, 1]
    if kind == "Q4_K":
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mn = gguf.quants.Q4_K.get_scale_min(blocks[:, 4:16].copy())
        scale = d * sc.astype(np.float32)  # [B, 8]: a sub-block each
        offset = -(dmin * mn.astype(np.float32))
        zero = np.zeros_like(scale)
        q = _nibbles(blocks[:, 16:], 64)  # (runs of 32 bytes: two sub-blocks each)
    elif kind == "Q4_1":
        scale, offset = d, blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        zero = np.zeros_like(scale)
        q = _nibbles(blocks[:, 4:], 32)
    else:
        scale, zero, offset = d, np.full_like(d, 8.0), np.zeros_like(d)
        q = _nibbles(blocks[:, 2:], 32)
    groups = cols // GROUP
    out = {"values": q.reshape(rows, cols).astype(np.int32)}
    out |= {k: v.reshape(rows, groups) for k, v in (("scales", scale), ("zeros", zero), ("offsets", offset))}
    return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in out.items()}
