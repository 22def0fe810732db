"""A checkpoint checked against what it claims before anything large is allocated: config sizes in range
(read raw, before transformers parses them: a billion layers hangs its config classes), each safetensors
file holding the bytes its header declares, a GGUF file holding every tensor it lists, weights finite.
Every failure is one ValueError naming the file or the config field."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import torch

# far above every published model (hidden_size 16384, 126 layers, a 262k vocabulary, 10M positions) and
# far below what hangs or fails in the allocator: a value past one is a corrupt config, refused by name
SIZE_LIMITS = {"hidden_size": 1 << 16, "num_hidden_layers": 1024, "num_attention_heads": 1024,
               "num_key_value_heads": 1024, "head_dim": 1024, "intermediate_size": 1 << 20,
               "vocab_size": 1 << 21, "max_position_embeddings": 1 << 24,
               # mixtures of experts (512 experts the most published, 22 of them routed per token)
               "num_experts": 1 << 14, "num_local_experts": 1 << 14, "num_experts_per_tok": 1 << 14,
               "moe_intermediate_size": 1 << 20}
MOE_FIELDS = ("num_experts", "num_local_experts", "num_experts_per_tok", "moe_intermediate_size")
# bits per element of each safetensors dtype (the format's own table)
DTYPE_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "I16": 16, "U16": 16,
              "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64,
              "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
HEADER_LIMIT = 100_000_000  # the safetensors library refuses a longer header


def check_config(fields: Mapping, where: str, required: Sequence[str] = ()) -> None:
    """A model's sizes as config.json spells them: positive integers within SIZE_LIMITS where present (and
    where `required`), attention heads in whole groups of KV heads, no more experts routed than there are,
    a positive rope_theta."""
    for name, limit in SIZE_LIMITS.items():
        value = fields.get(name)
        if (value is None or (value == 0 and name in MOE_FIELDS)) and name not in required:
            continue  # (some dense configs say 0 experts)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{where}: {name} must be a positive integer, got {value!r}")
        if value > limit:
            raise ValueError(f"{where}: {name} {value} is over {limit}, more than any real model has")
    heads, kv = fields.get("num_attention_heads"), fields.get("num_key_value_heads")
    if heads and kv and heads % kv:
        raise ValueError(f"{where}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}")
    experts = fields.get("num_experts") or fields.get("num_local_experts")
    routed = fields.get("num_experts_per_tok")
    if experts and routed and routed > experts:
        raise ValueError(f"{where}: num_experts_per_tok {routed} is more than the {experts} experts")
    for name, theta in _rope_thetas(fields):
        if not isinstance(theta, (int, float)) or isinstance(theta, bool) or not math.isfinite(theta) \
                or theta <= 0:
            raise ValueError(f"{where}: {name} must be a positive number, got {theta!r}")


def _rope_thetas(fields: Mapping) -> Iterator[tuple[str, object]]:
    """(name, value) of every rope_theta given: at the top level, in rope_parameters, or in its entries per
    layer type."""
    if fields.get("rope_theta") is not None:
        yield "rope_theta", fields["rope_theta"]
    params = fields.get("rope_parameters")
    if not isinstance(params, dict):
        return
    nested = [(f"rope_parameters.{k}", v) for k, v in params.items() if isinstance(v, dict)]
    for name, entry in [("rope_parameters", params), *nested]:
        if entry.get("rope_theta") is not None:
            yield f"{name}.rope_theta", entry["rope_theta"]


def check_vocab_size(vocab_size: int, where: str, tokenizer_size: int, embedding: tuple[str, int] | None) -> None:
    """vocab_size against the tokenizer's length and the embedding's rows (name, rows) in the weights:
    a smaller vocabulary would index past the embedding, or mis-shape it."""
    if tokenizer_size > vocab_size:
        raise ValueError(f"{where}: vocab_size {vocab_size} is smaller than the tokenizer's vocabulary of "
                         f"{tokenizer_size} tokens")
    if embedding is not None and embedding[1] != vocab_size:
        raise ValueError(f"{where}: vocab_size {vocab_size} does not match the {embedding[1]} rows of {embedding[0]}")


def safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors a safetensors file declares (name -> dtype, shape, data_offsets), checked against the file:
    an 8-byte header length, a JSON header, every tensor's bytes inside the file and as many as its dtype and
    shape need. Reads the header only."""
    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"safetensors file {path} is empty (0 bytes)")
    if size < 8:
        raise ValueError(f"safetensors file {path} is truncated: {size} bytes, less than its 8-byte header length")
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        text = f.read(length) if 2 <= length <= HEADER_LIMIT else b""
    if not 2 <= length <= HEADER_LIMIT or text[:1] not in (b"{", b""):
        raise ValueError(f"{path} is not a safetensors file: it does not start with a header length and a JSON "
                         "header")
    if 8 + length > size:
        raise ValueError(f"safetensors file {path} is truncated: its header needs {8 + length} bytes, the file "
                         f"has {size}")
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not a safetensors file: its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path} is not a safetensors file: its header is not a JSON object")
    tensors = {name: info for name, info in header.items() if name != "__metadata__"}
    data_bytes = size - 8 - length
    for name, info in tensors.items():
        need, (begin, end) = _tensor_bytes(path, name, info), info["data_offsets"]
        if need is not None and end - begin != need:
            raise ValueError(f"{path} is not a safetensors file: tensor {name!r} ({info['dtype']} "
                             f"{info['shape']}) needs {need} bytes, its data_offsets hold {end - begin}")
        if end > data_bytes:
            raise ValueError(f"safetensors file {path} is truncated: tensor {name!r} ends {end - data_bytes} "
                             f"bytes past the end of the file ({size} bytes)")
    return tensors


def _tensor_bytes(path: Path, name: str, info) -> int | None:
    """The bytes a header entry's dtype and shape need (None: a dtype this table does not know), the entry
    checked well-formed."""
    try:
        dtype, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        well_formed = isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape) \
            and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
    except (TypeError, KeyError, ValueError):
        well_formed = False
    if not well_formed:
        raise ValueError(f"{path} is not a safetensors file: tensor {name!r} has no valid dtype, shape and "
                         "data_offsets")
    bits = DTYPE_BITS.get(dtype)
    return None if bits is None else (math.prod(shape) * bits + 7) // 8


def check_finite(tensor: torch.Tensor, name: str, path: Path) -> None:
    """One reduction: a float32 sum is NaN or inf exactly when an element is (honest weights are far from
    overflowing it), and reads half-precision weights without an upcast copy (isfinite's mask would be one)."""
    if tensor.is_floating_point() and tensor.numel() and not torch.isfinite(tensor.sum(dtype=torch.float32)):
        raise ValueError(f"tensor {name!r} in {path} holds NaN or infinite values")


class TruncatedGGUF(ValueError):
    pass


def read_gguf(path: Path):
    """The gguf package's reader of `path`, every read checked inside the file first: a file cut short names
    itself here rather than failing in numpy ("cannot reshape array of size ...")."""
    import gguf
    import numpy as np

    size = path.stat().st_size
    if size == 0:
        raise ValueError(f"empty GGUF file {path} (0 bytes)")

    class SizedReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, *rest, **named):  # every read of the reader comes here
            end = int(offset) + np.dtype(dtype).itemsize * int(count)
            if end > size:
                raise TruncatedGGUF(f"truncated GGUF file {path}: its contents need at least {end} bytes, the file "
                                    f"has {size}")
            return super()._get(offset, dtype, count, *rest, **named)

    try:
        return SizedReader(str(path))
    except TruncatedGGUF:
        raise
    except Exception as e:  # the reader's own errors (magic, version, field types) name no file
        raise ValueError(f"cannot read GGUF file {path}: {e}") from None
