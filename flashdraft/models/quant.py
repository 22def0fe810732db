"""Quantized checkpoints: what a config's `quantization_config` says, and the weights it describes turned
into the model's dtype at load (the reference path, and the default on every device: results are those of the
dequantized weights); a block-FP8 checkpoint's dense layers may instead keep their FP8 weights on CUDA
(quant_serve.py).

Formats: HF fine-grained FP8 (`quant_method: "fp8"`, Qwen's `-FP8` checkpoints: float8_e4m3fn weights in
`weight_block_size` blocks, each block's `weight_scale_inv` the factor that restores it; the modules of
`modules_to_not_convert` kept as they are); compressed-tensors (`quant_method: "compressed-tensors"`,
RedHatAI's checkpoints: `float-quantized` FP8 weights with a per-channel or per-tensor `weight_scale`, and
`pack-quantized` int weights of 2-8 bits, eight 4-bit values an int32 word, a `weight_scale` per group or
channel and, asymmetric, a `weight_zero_point` packed along the rows: w = (q - zero point) * scale; `ignore`
kept as they are); AWQ (AutoAWQ's GEMM layout) and GPTQ (v1 and v2 zero points, no act-order) 4-bit
`qweight` / `qzeros` / `scales`; and GPT-OSS's MXFP4 experts (moe.py). Activations are not quantized (a dynamic
activation scheme is taken as a W8A16 / W4A16 computation: the dequantized weights' results); a static
one, any other method or format, or a field this reader does not know is refused by name."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

FP8_FIELDS = {"quant_method", "activation_scheme", "weight_block_size", "modules_to_not_convert", "fmt"}


@dataclass(frozen=True)
class BlockFP8:
    """HF fine-grained FP8: weights in [block_n, block_k] blocks of float8_e4m3fn."""
    block: tuple[int, int]
    keep: tuple[str, ...]  # modules_to_not_convert: names (or name prefixes) stored unquantized


# vLLM's --quantization names of the methods read here (its kernel-specific names included)
METHOD_NAMES = {"fp8": "fp8", "compressed-tensors": "compressed-tensors", "compressed_tensors": "compressed-tensors",
                "gguf": "gguf",
                "awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq", "mxfp4": "mxfp4"}


def _config_dict(cfg) -> dict:
    """The config's quantization_config as a dict ({} without one)."""
    quant = getattr(cfg, "quantization_config", None)
    if not quant:
        return {}
    return quant if isinstance(quant, dict) else quant.to_dict() if hasattr(quant, "to_dict") else vars(quant)


def check_method(cfg, asked: str | None) -> None:
    """vLLM's --quantization against the checkpoint's quant_method: refused when they differ, or when the
    checkpoint is not quantized (quantizing at load is not supported)."""
    if asked is None:
        return
    if asked not in METHOD_NAMES:
        raise ValueError(f"quantization {asked!r} is not supported (supported: {', '.join(sorted(METHOD_NAMES))})")
    method = _config_dict(cfg).get("quant_method")
    if method is None:
        raise ValueError(f"quantization {asked!r}: the checkpoint is not quantized, and quantizing at load is not "
                         "supported")
    if METHOD_NAMES.get(method, method) != METHOD_NAMES[asked]:
        raise ValueError(f"quantization {asked!r} does not match the checkpoint's quant_method {method!r}")


def scheme_of(cfg):
    """The quantization a config declares (BlockFP8, CompressedTensors; None: none, or GPT-OSS's MXFP4
    experts, which moe.py reads); ValueError naming what is not supported."""
    q = _config_dict(cfg)
    if not q:
        return None
    method = q.get("quant_method")
    if method == "mxfp4" and getattr(cfg, "model_type", None) == "gpt_oss":
        return None
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method in ("awq", "gptq"):
        return _int4(q, method)
    if method == "gguf":
        return _gguf(q)
    if method != "fp8":
        raise ValueError(f"quantization_config with quant_method {method!r} is not supported (supported: 'fp8' "
                         "block-scaled, 'compressed-tensors', 'awq', 'gptq', GPT-OSS's 'mxfp4'); pass an unquantized "
                         "(bf16/fp16/fp32) checkpoint")
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
    return weight.float() * _spread(scale_inv.float(), bn, bk, n, k)


def _spread(scale: torch.Tensor, rows: int, cols: int, n: int, k: int) -> torch.Tensor:
    """One factor per [rows, cols] block -> one per element of an [n, k] matrix (the last blocks cut)."""
    return scale.repeat_interleave(rows, 0)[:n].repeat_interleave(cols, 1)[:, :k]


CT_FIELDS = {"quant_method", "format", "config_groups", "ignore", "quantization_status", "kv_cache_scheme",
             "global_compression_ratio", "version", "sparsity_config", "transform_config"}
CT_WEIGHT_FIELDS = {"num_bits", "type", "symmetric", "group_size", "strategy", "dynamic", "actorder", "observer",
                    "observer_kwargs", "block_structure", "scale_dtype", "zp_dtype"}


@dataclass(frozen=True)
class CompressedTensors:
    """A compressed-tensors checkpoint of one weight scheme: `format` float-quantized (FP8, `strategy`
    channel or tensor) or pack-quantized (int of `bits`, per `group` columns or per channel when None,
    `symmetric` or with zero points)."""
    format: str
    bits: int
    strategy: str
    group: int | None
    symmetric: bool
    ignore: tuple[str, ...] = field(default=())


def _compressed_tensors(q: dict) -> CompressedTensors:
    unknown = sorted(set(q) - CT_FIELDS)
    if unknown:
        raise ValueError(f"quantization_config field(s) {', '.join(unknown)} of compressed-tensors are not supported")
    fmt = q.get("format")
    if fmt not in ("float-quantized", "pack-quantized"):
        raise ValueError(f"compressed-tensors format {fmt!r} is not supported (supported: 'float-quantized' FP8, "
                         "'pack-quantized' int)")
    for name in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if q.get(name):
            raise ValueError(f"compressed-tensors {name} is not supported")
    groups = q.get("config_groups") or {}
    schemes = {json.dumps(g.get("weights"), sort_keys=True) for g in groups.values() if isinstance(g, dict)}
    if len(groups) < 1 or len(schemes) != 1:
        raise ValueError("compressed-tensors config_groups must hold one weight scheme (mixed schemes are not "
                         "supported)")
    g = next(iter(groups.values()))
    for part in ("input_activations", "output_activations"):
        a = g.get(part)
        if a and (part == "output_activations" or not a.get("dynamic")):
            raise ValueError(f"compressed-tensors {part} {'' if a.get('dynamic') else 'static '}quantization is "
                             "not supported (dynamic input activations are served unquantized)")
    w = g.get("weights") or {}
    unknown = sorted(set(w) - CT_WEIGHT_FIELDS)
    if unknown:
        raise ValueError(f"compressed-tensors weights field(s) {', '.join(unknown)} are not supported")
    bits, kind, strategy = w.get("num_bits"), w.get("type"), w.get("strategy")
    if w.get("dynamic"):
        raise ValueError("compressed-tensors dynamic weight quantization is not supported")
    if w.get("actorder") not in (None, False, "static", "weight"):  # (group: a g_idx permutes the columns)
        raise ValueError(f"compressed-tensors weights actorder {w['actorder']!r} is not supported")
    if fmt == "float-quantized" and not (kind == "float" and bits == 8 and strategy in ("channel", "tensor")):
        raise ValueError(f"compressed-tensors float-quantized weights must be 8-bit float per channel or tensor, "
                         f"got {bits}-bit {kind} per {strategy}")
    if fmt == "pack-quantized" and not (kind == "int" and isinstance(bits, int) and 2 <= bits <= 8
                                        and strategy in ("group", "channel")):
        raise ValueError(f"compressed-tensors pack-quantized weights must be 2-8-bit int per group or channel, "
                         f"got {bits}-bit {kind} per {strategy}")
    group = w.get("group_size") if strategy == "group" else None
    if strategy == "group" and not (isinstance(group, int) and group > 0):
        raise ValueError(f"compressed-tensors group_size must be a positive integer, got {group!r}")
    return CompressedTensors(fmt, bits, strategy, group, bool(w.get("symmetric", True)), tuple(q.get("ignore") or ()))


@dataclass(frozen=True)
class GGUF4:
    """A GGUF file's 4-bit tensors (Q4_0, Q4_1, Q4_K) as gguf_convert.py caches them: kernels/int4_layout.py's
    qweight, and a float32 scale, zero and offset a group of `group` columns: w = (q - zero) * scale + offset,
    the file's own arithmetic. `modules`: those held so (the others are the file's other types, dequantized)."""
    group: int
    modules: tuple[str, ...]


def _gguf(q: dict) -> GGUF4:
    unknown = sorted(set(q) - {"quant_method", "bits", "group_size", "modules"})
    if unknown or q.get("bits") != 4 or not isinstance(q.get("group_size"), int):
        raise ValueError(f"quant_method 'gguf' config {q!r} is not one this version wrote: delete the cached folder")
    return GGUF4(q["group_size"], tuple(q.get("modules") or ()))


def _parts(scheme) -> tuple[str, ...]:
    """The tensors of one quantized module, by suffix."""
    if isinstance(scheme, GGUF4):
        return ("qweight", "scales", "zeros", "offsets")
    if isinstance(scheme, BlockFP8):
        return ("weight", "weight_scale_inv")
    if isinstance(scheme, Int4):
        return ("qweight", "qzeros", "scales") + (("g_idx",) if scheme.method == "gptq" else ())
    if scheme.format == "float-quantized":
        return ("weight", "weight_scale")
    return ("weight_packed", "weight_scale", "weight_shape") + (() if scheme.symmetric else ("weight_zero_point",))


def kept_unquantized(module: str, scheme) -> bool:
    """Whether the config says this module is stored unquantized."""
    name = module.removeprefix("model.")
    if isinstance(scheme, GGUF4):
        return name not in scheme.modules
    if isinstance(scheme, (BlockFP8, Int4)):
        return any(name.startswith(k.removeprefix("model.")) for k in scheme.keep)
    return any(re.fullmatch(k[3:], module) if k.startswith("re:") else k in (module, name) for k in scheme.ignore)


def unpack_int32(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """[R, W] int32 of densely packed `bits`-bit values (value i at bits i * bits, stored as q + 2^(bits-1))
    -> [R, count] int32 q."""
    words = packed.to(torch.int64) & 0xFFFFFFFF
    pos = torch.arange(count, dtype=torch.int64) * bits
    lo = (words[:, pos // 32] >> (pos % 32)[None, :])
    spill = (pos % 32 + bits - 32).clamp_min(0)  # bits past the word's end come from the next word
    nxt = words[:, (pos // 32 + 1).clamp_max(words.shape[1] - 1)] << (bits - spill)[None, :]
    value = torch.where((spill > 0)[None, :], lo | nxt, lo) & ((1 << bits) - 1)
    return (value - (1 << (bits - 1))).to(torch.int32)


def _dequantize(scheme, t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if isinstance(scheme, BlockFP8):
        return dequantize_block_fp8(t["weight"], t["weight_scale_inv"], scheme.block, name)
    if scheme_format(scheme) == "float-quantized":
        return t["weight"].float() * channel_scales(t, name)
    from flashdraft.kernels.int4_layout import dequantize_int

    q, zero, scale, group = int_values(scheme, t, name)
    return dequantize_int(q, zero, scale, group, t["offsets"] if isinstance(scheme, GGUF4) else None)


def scheme_format(scheme) -> str:
    """'fp8-block', 'float-quantized' (FP8 per channel or tensor) or 'int' (AWQ, GPTQ, pack-quantized)."""
    if isinstance(scheme, BlockFP8):
        return "fp8-block"
    return "int" if isinstance(scheme, (Int4, GGUF4)) or scheme.format == "pack-quantized" else "float-quantized"


def int_bits(scheme) -> int:
    return 4 if isinstance(scheme, (Int4, GGUF4)) else scheme.bits


def channel_scales(t: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """A compressed-tensors FP8 weight's scales as one float32 per row [N, 1] (a per-tensor one repeated)."""
    w, scale = t["weight"], t["weight_scale"].float()
    n = w.shape[0]
    if scale.numel() not in (1, n):
        raise ValueError(f"{name}_scale has {scale.numel()} values; {name} {tuple(w.shape)} needs 1 (per tensor) "
                         f"or {n} (per channel)")
    return scale.reshape(-1, 1).expand(n, 1).contiguous()


def int_values(scheme, t: dict[str, torch.Tensor], name: str
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """An int-quantized module's (q [N, K] int32, unsigned: 0 .. 2^bits - 1, zero [N, G] and scale [N, G]
    float32, group): w = (q - zero) * scale over groups of `group` input columns."""
    if isinstance(scheme, Int4):
        return _int4_values(scheme, t, name)
    if isinstance(scheme, GGUF4):  # (offsets: GGUF4's own, beside these)
        from flashdraft.kernels.int4_layout import unpack_int4

        return unpack_int4(t["qweight"]), t["zeros"].float(), t["scales"].float(), scheme.group
    scale = t["weight_scale"].float()
    shape = [int(v) for v in t["weight_shape"].tolist()]
    if len(shape) != 2:
        raise ValueError(f"{name}_shape must hold two sizes, got {shape}")
    n, k = shape
    group = scheme.group or k
    groups = -(-k // group)
    if tuple(scale.shape) != (n, groups):
        raise ValueError(f"{name}_scale has shape {tuple(scale.shape)}; {name} {tuple(shape)} needs {(n, groups)}")
    q = unpack_int32(t["weight_packed"], scheme.bits, k)
    if q.shape[0] != n:
        raise ValueError(f"{name}_packed has {q.shape[0]} rows; {name}_shape says {n}")
    mid = 1 << (scheme.bits - 1)  # (stored signed: q + mid unsigned, the symmetric zero point mid)
    if scheme.symmetric:
        zero = torch.full((n, groups), float(mid))
    else:
        zero = unpack_int32(t["weight_zero_point"].t().contiguous(), scheme.bits, n).t().float() + mid  # (by rows)
    return q + mid, zero, scale, group


def dequantized(pairs: Iterable[tuple[str, torch.Tensor]], scheme, serving=None) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs with each quantized module's tensors (in any order, in any file)
    turned into one float32 `weight`; others as they come. A module that `serving` takes (quant_serve.py) gets
    its tensors in the layout its quantized layer holds instead. A module left without one of its tensors, or a
    quantized tensor in a module the config keeps unquantized, is an error naming it."""
    if scheme is None:
        yield from pairs
        return
    parts = _parts(scheme)
    waiting: dict[str, dict[str, torch.Tensor]] = {}  # a module -> the tensors of it that came
    for name, w in pairs:
        module, _, part = name.rpartition(".")
        if part not in parts or (part == "weight" and w.dtype != torch.float8_e4m3fn):
            if serving is not None and part == "weight" and serving.takes(module):
                raise ValueError(f"{name} is a plain {w.dtype} weight, but the config quantizes {module} "
                                 f"({', '.join(module + '.' + p for p in parts)} expected)")
            yield name, w
            continue
        if kept_unquantized(module, scheme):
            raise ValueError(f"{name} is quantized, but the config keeps {module} unquantized")
        have = waiting.setdefault(module, {})
        have[part] = w
        if len(have) == len(parts):
            del waiting[module]
            if serving is not None and serving.takes(module):
                yield from serving.tensors(module, have)
            else:
                yield module + ".weight", _dequantize(scheme, have, module + ".weight")
    if waiting:
        module = sorted(waiting)[0]
        missing = [p for p in parts if p not in waiting[module]]
        raise ValueError(f"{module}.weight: {module}.{missing[0]} is missing from the checkpoint")


# AWQ and GPTQ: fields that only describe how the checkpoint was made or which kernel once ran it
INT4_INERT = {"quant_method", "bits", "group_size", "modules_to_not_convert", "backend", "version", "zero_point",
              "do_fuse", "fuse_max_seq_len", "modules_to_fuse", "exllama_config", "desc_act", "sym", "damp_percent",
              "true_sequential", "static_groups", "model_name_or_path", "model_file_base_name", "checkpoint_format",
              "lm_head", "dataset", "tokenizer", "use_exllama", "max_input_length", "cache_block_outputs",
              "modules_in_block_to_quantize", "batch_size", "pad_token_id", "use_cuda_fp16", "meta",
              "module_name_preceding_first_block", "damp_auto_increment", "quantizer", "pack_dtype", "format"}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]


@dataclass(frozen=True)
class Int4:
    """AutoAWQ's GEMM layout (`awq`) or GPTQ's (`gptq`; v1 zero points stored less one), 4-bit, groups of
    `group` input columns (-1: one group a row)."""
    method: str
    group: int
    zero_offset: int  # added to a stored zero point (GPTQ v1: 1)
    keep: tuple[str, ...] = field(default=())


def _int4(q: dict, method: str) -> Int4:
    unknown = sorted(set(q) - INT4_INERT)
    if unknown:
        raise ValueError(f"quantization_config field(s) {', '.join(unknown)} of quant_method {method!r} are not "
                         "supported")
    if q.get("bits") != 4:
        raise ValueError(f"quant_method {method!r} with bits {q.get('bits')!r} is not supported (supported: 4)")
    group = q.get("group_size", 128)
    if not (isinstance(group, int) and (group > 0 or group == -1)):
        raise ValueError(f"quantization_config.group_size must be a positive integer or -1, got {group!r}")
    if method == "awq":
        if q.get("version", "gemm").lower() != "gemm":
            raise ValueError(f"AWQ version {q.get('version')!r} is not supported (supported: 'gemm')")
        if q.get("zero_point", True) is not True:
            raise ValueError("AWQ without zero points is not supported")
        offset = 0
    else:
        if q.get("desc_act"):
            raise ValueError("GPTQ desc_act (act-order: a g_idx permutes the groups) is not supported")
        fmt = q.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported (supported: 'gptq', 'gptq_v2')")
        if q.get("lm_head"):
            raise ValueError("a GPTQ-quantized lm_head is not supported")
        offset = 1 if fmt == "gptq" else 0
    keep = q.get("modules_to_not_convert") or []
    return Int4(method, group, offset, tuple(keep))


def _nibbles(words: torch.Tensor, dim: int, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 words holding eight 4-bit values each (value i at bits 4i) -> the values along `dim`, eight
    per word, the i-th of a word placed at order[i]."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    vals = torch.stack([(w >> (4 * i)) & 0xF for i in range(8)], dim=-1)  # [..., 8] in nibble order
    vals = vals[..., [order.index(j) for j in range(8)]]  # (position j takes the nibble holding it)
    if dim == 0:
        vals = vals.movedim(-1, 1)  # [R, 8, C] -> rows r * 8 + i
        return vals.reshape(words.shape[0] * 8, words.shape[1]).to(torch.int32)
    return vals.reshape(words.shape[0], words.shape[1] * 8).to(torch.int32)


def _int4_values(scheme: Int4, t: dict[str, torch.Tensor], name: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    scales = t["scales"].float()  # [G, N]
    groups, n = scales.shape
    if scheme.method == "awq":
        q = _nibbles(t["qweight"], 1, AWQ_ORDER)  # [K, N]
        z = _nibbles(t["qzeros"], 1, AWQ_ORDER)
    else:
        q = _nibbles(t["qweight"], 0)  # packed along K: [K, N]
        z = _nibbles(t["qzeros"], 1) + scheme.zero_offset
        k = q.shape[0]
        group = scheme.group if scheme.group > 0 else k
        trivial = torch.arange(k, dtype=torch.int64) // group
        if not torch.equal(t["g_idx"].to(torch.int64).cpu(), trivial):
            raise ValueError(f"{name}: g_idx permutes the groups (act-order), which is not supported")
    k = q.shape[0]
    group = scheme.group if scheme.group > 0 else k
    if q.shape[1] != n or z.shape != (groups, n) or groups != -(-k // group):
        raise ValueError(f"{name}: qweight {tuple(t['qweight'].shape)}, qzeros {tuple(t['qzeros'].shape)} and "
                         f"scales {tuple(scales.shape)} do not describe one {scheme.method} matrix in groups of "
                         f"{group}")
    return q.t().contiguous(), z.t().float().contiguous(), scales.t().contiguous(), group  # [N, K], as nn.Linear
