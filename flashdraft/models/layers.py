"""The building blocks every family's layers share: the RMSNorm, the embedding, the linear layer with its
few-row GEMM dispatch, the gated MLP, and each one's fused path (the kernels of flashdraft/kernels/ where
kernels/dispatch.py says they run)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashdraft.kernels.dispatch import fused_enabled, skinny_enabled


class Embedding(nn.Embedding):
    """nn.Embedding; on the fused path the lookup is token_ops.embedding (one Triton kernel)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if fused_enabled(self.weight):
            from flashdraft.kernels import token_ops

            return token_ops.embedding(ids, self.weight)
        return super().forward(ids)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / RMS(x), the statistics in float32 at least, normalised x cast back to x's dtype
    before the weight multiply (the result takes the promoted dtype of the two)."""
    h = x.to(torch.promote_types(x.dtype, torch.float32))
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           parts: bool = False) -> torch.Tensor:
    """F.linear, except for few rows: on CUDA the Triton kernels of kernels/skinny_gemm.py (see settings.GEMM), and for
    2-64 rows on CPU (verify and draft blocks, small batches) W @ x^T, which MKL computes up to ~2x
    faster than x @ W^T (SmolLM2 shapes, fp32, cache-cold weights: gate_up at 8 rows 0.62 against
    0.88 ms, the 49k-row lm_head 10.8 against 21.3 ms); one row and long prefills gain nothing there.
    parts: the result may come as a split-K GEMM's float32 parts [rows, P, out] (skinny_linear), for
    a caller whose result goes straight into layer_ops.add_rmsnorm (which adds them)."""
    if skinny_enabled(x, weight):
        from flashdraft.kernels.skinny_gemm import skinny_linear

        return skinny_linear(x, weight, bias, parts=parts)
    if x.device.type == "cpu" and x.dim() == 2 and 1 < x.shape[0] <= 64:
        y = (weight @ x.T).T.contiguous()
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor, parts: bool = False) -> torch.Tensor:
        """parts: the result may be split-K parts, for an add_rmsnorm (see linear)."""
        return linear(x, self.weight, self.bias, parts)


class BlockFP8Linear(nn.Module):
    """A linear layer whose weight stays in its checkpoint's FP8 (models/quant_serve.py): float8_e4m3fn [N, K] in
    `block` blocks, each block's float32 factor in weight_scale_inv (per channel: blocks of (1, K)), multiplied
    by kernels/fp8_gemm.py on CUDA: half the bytes of a bf16 weight. Both are held as their bits, uint8 and int32
    parameters, so that casting the model to its dtype leaves them as they are."""

    def __init__(self, in_features: int, out_features: int, block: tuple[int, int], bias: bool):
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.uint8), requires_grad=False)
        scales = (-(-out_features // block[0]), -(-in_features // block[1]))
        self.weight_scale_inv = nn.Parameter(torch.empty(scales, dtype=torch.int32), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor, parts: bool = False) -> torch.Tensor:
        """parts: accepted for the callers of Linear; the result is always whole."""
        w, s = self.weight.view(torch.float8_e4m3fn), self.weight_scale_inv.view(torch.float32)
        flat = x.reshape(-1, x.shape[-1])
        if x.device.type == "cuda":
            from flashdraft.kernels.fp8_gemm import fp8_linear

            half = flat if flat.dtype in (torch.bfloat16, torch.float16) else flat.to(torch.bfloat16)
            y = fp8_linear(half, w, s, self.block).to(x.dtype)
        else:  # (dequantized at each call, then Linear's GEMM: the tests' check of the layout)
            from flashdraft.models.quant import dequantize_block_fp8

            y = linear(flat, dequantize_block_fp8(w, s, self.block, "weight").to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    """A linear layer whose weight stays at 4 bits (models/quant_serve.py): kernels/int4_layout.py's qweight
    [N, K / 8] int32 and a float32 scale and zero point a group of `group` input columns (held as int32 bits),
    multiplied by kernels/int4_gemm.py on CUDA: a quarter of the bytes of a bf16 weight."""

    def __init__(self, in_features: int, out_features: int, group: int, bias: bool, offsets: bool = False):
        super().__init__()
        self.in_features, self.out_features, self.group = in_features, out_features, group
        groups = -(-in_features // group)
        self.qweight = nn.Parameter(torch.empty(out_features, in_features // 8, dtype=torch.int32), requires_grad=False)
        self.scales = nn.Parameter(torch.empty(out_features, groups, dtype=torch.int32), requires_grad=False)
        self.zeros = nn.Parameter(torch.empty(out_features, groups, dtype=torch.int32), requires_grad=False)
        # (GGUF's 4-bit types: w = (q - zero) * scale + offset)
        self.offsets = nn.Parameter(torch.empty(out_features, groups, dtype=torch.int32), requires_grad=False) \
            if offsets else None
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def dequantized(self) -> torch.Tensor:
        """The float32 weight [N, K]: (q - zero) * scale (+ offset)."""
        from flashdraft.kernels.int4_layout import dequantize_int, unpack_int4

        return dequantize_int(unpack_int4(self.qweight), self.zeros.view(torch.float32),
                              self.scales.view(torch.float32), self.group,
                              None if self.offsets is None else self.offsets.view(torch.float32))

    def forward(self, x: torch.Tensor, parts: bool = False) -> torch.Tensor:
        """parts: accepted for the callers of Linear; the result is always whole."""
        flat = x.reshape(-1, x.shape[-1])
        if x.device.type == "cuda":
            from flashdraft.kernels.int4_gemm import int4_linear

            half = flat if flat.dtype in (torch.bfloat16, torch.float16) else flat.to(torch.bfloat16)
            y = int4_linear(half, self.qweight, self.scales.view(torch.float32), self.zeros.view(torch.float32),
                            self.group, None if self.offsets is None else self.offsets.view(torch.float32)
                            ).to(x.dtype)
        else:  # (dequantized at each call, then Linear's GEMM: the tests' check of the layout)
            y = linear(flat, self.dequantized().to(x.dtype))
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)


def activation(name: str):
    """The gate activation `hidden_act` names, as transformers defines it (silu: F.silu)."""
    if name == "silu":
        return F.silu
    from transformers.activations import ACT2FN

    if name not in ACT2FN:
        raise ValueError(f"unsupported hidden_act {name!r}")
    return ACT2FN[name]


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.inter = inter
        self.act_name = act
        self.act = activation(act)
        self.gate_up_proj = Linear(hidden, 2 * inter, bias=bias)
        self.down_proj = Linear(inter, hidden, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(self.act(gate) * up)

    def forward_fused(self, x, parts: bool = False):
        """parts: the down projection's result may be split-K parts (see linear), for an add_rmsnorm."""
        from flashdraft.kernels import layer_ops

        if self.act_name != "silu":  # the fused kernels compute silu
            return self.forward(x)
        if isinstance(self.gate_up_proj, Linear) and skinny_enabled(x, self.gate_up_proj.weight, glu=True) and \
                self.gate_up_proj.bias is None:  # silu * up in the GEMM's epilogue
            from flashdraft.kernels.skinny_gemm import skinny_linear

            h = skinny_linear(x, self.gate_up_proj.weight, glu=True)
        else:
            h = layer_ops.silu_mul(self.gate_up_proj(x))
        return self.down_proj(h, parts=parts)
