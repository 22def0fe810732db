"""Quantized checkpoints: what a config's `quantization_config` says, and the weights it describes turned
into the model's dtype at load (the reference path: every format is served dequantized for now, on every
device, so its results are those of its dequantized weights).

Formats: HF fine-grained FP8 (`quant_method: "fp8"`, Qwen's `-FP8` checkpoints: float8_e4m3fn weights in
`weight_block_size` blocks, each block's `weight_scale_inv` the factor that restores it; the modules of
`modules_to_not_convert` kept as they are), and GPT-OSS's MXFP4 experts (moe.py). Any other method, an FP8
activation scheme other than dynamic, or a field this reader does not know is refused by name."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

FP8_FIELDS = {"quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert", "fmt"}


@dataclass(frozen=True)
class BlockFP8:
    """HF fine-grained FP8: weights in [block_n, block_k] blocks of float8_e4m3fn."""
    block: tuple[int, int]
    keep: tuple[str, ...]  # modules_to_not_convert: names (or name prefixes) stored unquantized


def scheme_of(cfg) -> BlockFP8 | None:
    """The quantization a config declares (None: none, or GPT-OSS's MXFP4 experts, which moe.py reads);
    ValueError naming what is not supported."""
    quant = getattr(cfg, "quantization_config", None)
    if not quant:
        return None
    q = quant if isinstance(quant, dict) else quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)
    method = q.get("quant_method")
    if method == "mxfp4" and getattr(cfg, "model_type", None) == "gpt_oss":
        return None
    if method != "fp8":
        raise ValueError(f"quantization_config with quant_method {method!r} is not supported (supported: 'fp8' "
                         "block-scaled, GPT-OSS's 'mxfp4'); pass an unquantized (bf16/fp16/fp32) checkpoint")
    unknown = sorted(set(q) - FP8_FIELDS)
    if unknown:
        raise ValueError(f"quantization_config field(s) {', '.join(unknown)} of quant_method 'fp8' are not supported")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme {q['activation_scheme']!r} is not supported "
                         "(supported: 'dynamic')")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"quantization_config.fmt {q['fmt']!r} is not supported (supported: 'e4m3')")
    block = q.get("weight_block_size")
    if block is None:
        raise ValueError("quant_method 'fp8' without weight_block_size (per-tensor FP8 scales) is not supported "
                         "(supported: block-scaled FP8)")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}")
    keep = q.get("modules_to_not_convert") or []
    if not (isinstance(keep, list) and all(isinstance(k, str) for k in keep)):
        raise ValueError(f"quantization_config.modules_to_not_convert must be a list of names, got {keep!r}")
    return BlockFP8((block[0], block[1]), tuple(keep))


def dequantize_block_fp8(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str
                         ) -> torch.Tensor:
    """weight [N, K] float8_e4m3fn and its blocks' factors [ceil(N / bn), ceil(K / bk)] -> float32 [N, K]."""
    (n, k), (bn, bk) = weight.shape, block
    want = (-(-n // bn), -(-k // bk))
    if tuple(scale_inv.shape) != want:
        raise ValueError(f"{name}_scale_inv has shape {tuple(scale_inv.shape)}; {name} {tuple(weight.shape)} in "
                         f"{bn} x {bk} blocks needs {want}")
    full = scale_inv.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return weight.float() * full


def dequantized(pairs: Iterable[tuple[str, torch.Tensor]], scheme: BlockFP8 | None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each FP8 weight and its `_scale_inv` (in either order, in
    any file) turned into one float32 weight; others as they come. A weight or a factor left without its
    other half, or an FP8 tensor in a module kept unquantized, is an error naming it."""
    if scheme is None:
        yield from pairs
        return
    waiting: dict[str, torch.Tensor] = {}  # a weight's name -> the half of it that came first
    for name, w in pairs:
        base = name.removesuffix("_scale_inv")
        if base != name or w.dtype == torch.float8_e4m3fn:
            if any(base.removeprefix("model.").startswith(k.removeprefix("model.")) for k in scheme.keep):
                raise ValueError(f"{name} is quantized, but its module is in modules_to_not_convert")
            other = waiting.pop(base, None)
            if other is None:
                waiting[base] = w
                continue
            weight, scale = (other, w) if base != name else (w, other)
            if weight.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{base} is {weight.dtype}, but it has a block scale: float8_e4m3fn expected")
            yield base, dequantize_block_fp8(weight, scale, scheme.block, base)
            continue
        yield name, w
    if waiting:
        name = sorted(waiting)[0]
        half = "its weight" if waiting[name].dtype != torch.float8_e4m3fn else f"{name}_scale_inv"
        raise ValueError(f"{name}: {half} is missing from the checkpoint")
