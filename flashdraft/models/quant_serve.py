"""Quantized checkpoints served at their own bytes: the attention and MLP projections of a quantized checkpoint
that keep their quantized weights, multiplied by kernels that dequantize in the GEMM (models/layers.py), where
quant.py would otherwise dequantize them at load.

    FP8 (block-scaled, compressed-tensors per channel or tensor)  BlockFP8Linear, kernels/fp8_gemm.py
        settings.FP8_GEMM (FLASHDRAFT_FP8_GEMM=1); per-tensor scales are held per channel; a block-FP8
        mixture of experts' experts: FP8Experts (models/moe.py), kernels/moe_experts.py's scaled path
    4-bit int (AWQ, GPTQ, pack-quantized, GGUF Q4_0 / Q4_1 / Q4_K)  Int4Linear, kernels/int4_gemm.py
        settings.INT4_GEMM (FLASHDRAFT_INT4_GEMM=1); every format repacked at load into the kernel's layout

Both off by default: their kernels are not yet faster than the bf16 GEMMs of the dequantized weights
(docs/performance.md section 6). Not with tensor parallelism (the layers are not split). On a CPU these layers
dequantize at each call (the tests' check of the layouts; dequantizing at load is faster there)."""

from __future__ import annotations

import re
from collections.abc import Iterator

import torch

from flashdraft import settings
from flashdraft.kernels.int4_layout import check_int4_layout, pack_int4
from flashdraft.models.quant import GGUF4, channel_scales, int_bits, int_values, kept_unquantized, scheme_format

# a checkpoint's projections -> the packed one of this model that holds them (transformer.load_packed)
PACKED_PARTS = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
                "up_proj": "gate_up_proj"}
LEAVES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


_EXPERT = re.compile(r"(.*\.experts)\.\d+\.(?:gate_proj|up_proj|down_proj)")


def _net_name(module: str) -> str:
    """A checkpoint module's name as this model's packed module (model.language_model.layers.0.mlp.up_proj ->
    layers.0.mlp.gate_up_proj; an expert's projection -> its layer's stacked experts, layers.0.mlp.experts)."""
    module = module.removeprefix("model.").removeprefix("language_model.")
    if (m := _EXPERT.fullmatch(module)) is not None:
        return m[1]
    prefix, _, leaf = module.rpartition(".")
    return f"{prefix}.{PACKED_PARTS.get(leaf, leaf)}"


class Serving:
    """The swapped modules of one model (net names) and how their checkpoint tensors are laid out for them."""

    def __init__(self, scheme, swapped: set[str]):
        self.scheme, self.swapped = scheme, swapped

    def takes(self, module: str) -> bool:
        return _net_name(module) in self.swapped

    def tensors(self, module: str, have: dict[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        """A checkpoint module's tensors, all in, as its quantized layer's parameters (named as the checkpoint's
        module: load_packed joins q / k / v and gate / up along the rows). Floats are held as their bits."""
        kind = scheme_format(self.scheme)
        if kind == "int":
            q, zero, scale, _ = int_values(self.scheme, have, module + ".weight")
            yield module + ".qweight", pack_int4(q)
            yield module + ".scales", scale.float().contiguous().view(torch.int32)
            yield module + ".zeros", zero.float().contiguous().view(torch.int32)
            if isinstance(self.scheme, GGUF4):
                yield module + ".offsets", have["offsets"].float().contiguous().view(torch.int32)
            return
        scale = have["weight_scale_inv"] if kind == "fp8-block" else channel_scales(have, module + ".weight")
        yield module + ".weight", have["weight"].view(torch.uint8)
        yield module + ".weight_scale_inv", scale.float().contiguous().view(torch.int32)


def _rows(parent, leaf: str) -> tuple[int, ...]:
    """The row counts of a packed projection's parts (q / k / v; gate / up), () for one of a single part."""
    if leaf == "qkv_proj":
        if hasattr(parent, "splits"):  # (hybrids' gated attention: query and gate, k, v)
            return tuple(parent.splits)
        return (parent.q_size, parent.kv_size, parent.kv_size)
    return (parent.inter, parent.inter) if leaf == "gate_up_proj" else ()


def _layer(mod: torch.nn.Linear, scheme, rows: tuple[int, ...]) -> torch.nn.Module | None:
    """The quantized layer that takes mod's place, or None where its kernel cannot take it."""
    from flashdraft.models.layers import BlockFP8Linear, Int4Linear

    n, k = mod.out_features, mod.in_features
    kind = scheme_format(scheme)
    if kind == "fp8-block":
        if any(r % scheme.block[0] for r in rows) or scheme.block[1] % 16:
            return None  # (a part ending inside a scale block; columns the kernel's tiles do not take)
        return BlockFP8Linear(k, n, scheme.block, mod.bias is not None)
    if kind == "float-quantized":
        return BlockFP8Linear(k, n, (1, k), mod.bias is not None) if k % 16 == 0 else None
    group = scheme.group if isinstance(getattr(scheme, "group", None), int) and scheme.group > 0 else k
    if int_bits(scheme) != 4 or check_int4_layout(n, k, group) is not None:
        return None
    return Int4Linear(k, n, group, mod.bias is not None, offsets=isinstance(scheme, GGUF4))


def _swap_experts(parent, name: str, scheme) -> bool:
    """A mixture of experts' stacked experts kept in block FP8 (FP8Experts, the grouped kernels' scaled path)
    where gate and up each fill whole scale blocks and no expert is kept unquantized."""
    from flashdraft.models.moe import Experts, FP8Experts

    ex = getattr(parent, "experts", None)
    if type(ex) is not Experts or ex.gate_up_proj_bias is not None:
        return False
    E, two_i, hidden = ex.gate_up_proj.shape
    if (two_i // 2) % scheme.block[0] or scheme.block[1] % 16:
        return False
    if any(kept_unquantized(f"model.{name}.experts.{e}.{p}", scheme) for e in range(E)
           for p in ("gate_proj", "up_proj", "down_proj")):
        return False
    parent.experts = FP8Experts(E, hidden, two_i // 2, scheme.block)
    return True


def serve_quantized(net: torch.nn.Module, scheme, tp=None) -> Serving | None:
    """Swap the dense attention and MLP projections of a quantized checkpoint for their quantized layers where
    its switch is on (see above), in one process. Returns what was swapped, for quant.dequantized; None when
    nothing is."""
    from flashdraft.models.layers import Linear

    if scheme is None or tp is not None:
        return None
    kind = scheme_format(scheme)
    if not (settings.INT4_GEMM if kind == "int" else settings.FP8_GEMM):
        return None
    swapped = set()
    for name, parent in list(net.named_modules()):
        if kind == "fp8-block" and _swap_experts(parent, name, scheme):
            swapped.add(f"{name}.experts")
        for leaf in LEAVES:
            mod = getattr(parent, leaf, None)
            if type(mod) is not Linear:
                continue
            parts = [k for k, v in PACKED_PARTS.items() if v == leaf] or [leaf]
            if any(kept_unquantized(f"model.{name}.{p}", scheme) for p in parts):
                continue
            layer = _layer(mod, scheme, _rows(parent, leaf))
            if layer is not None:
                setattr(parent, leaf, layer)
                swapped.add(f"{name}.{leaf}")
    return Serving(scheme, swapped) if swapped else None

