"""GGUF -> HF-layout folder (config.json, tokenizer, model.safetensors), done once per file and
cached under the user cache dir. Architectures: llama (Mistral models too, which llama.cpp writes as
llama), qwen2, qwen3, qwen3moe, gpt-oss. Config and tokenizer come from transformers' GGUF readers; the
weights are dequantised here with the `gguf` package (transformers would keep a quantizer marker
that refuses to serialise). With FLASHDRAFT_INT4_GEMM=1 the attention and MLP projections held in Q4_0, Q4_1
or Q4_K are kept at 4 bits instead, in a folder of their own (gguf_int4.py; Int4Linear serves them, quant.py
would dequantize them at load bit for bit as gguf does). Qwen3-MoE files hold each layer's experts stacked
(`ffn_*_exps`); they are written in flashdraft's stacked layout (models/moe.py), and the fields transformers' reader
leaves out are read here: the expert width, and the top-k renormalisation llama.cpp applies.

GPT-OSS files (llama.cpp's `gpt-oss`: attention biases and sinks, the router's bias, experts split
into gate and up, or fused, with their biases, often in MXFP4, dequantized here like every other
type) are written back as an HF GPT-OSS checkpoint (gate and up interleaved, as published). Their
config is read here from the GGUF fields: transformers' reader fails on the yarn fields every such
file carries. Yarn's `truncate` is not in the format; it is set to False, the published models'
value; the activation's alpha and limit are the published 1.702 and 7.0 (GptOssConfig's defaults,
as llama.cpp fixes them). Rope-scaling fields this reader does not know are refused by name."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm import tqdm

from flashdraft import settings
from flashdraft.kernels.int4_layout import pack_int4
from flashdraft.models.checks import check_config, read_gguf
from flashdraft.models.gguf_int4 import GROUP, Q4_TYPES, q4_layout

log = logging.getLogger(__name__)

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GPT_OSS_NAMES = {  # where llama.cpp's gpt-oss tensors differ from the table above
    "ffn_gate_inp": "mlp.router", "post_attention_norm": "post_attention_layernorm",
    "attn_sinks": "self_attn.sinks", "ffn_gate_up_exps": "mlp.experts.gate_up_proj",
}
SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen3", "qwen3moe", "gpt-oss")
# a layer's attention and MLP projections, kept at 4 bits when the file holds them in Q4_0 / Q4_1 / Q4_K
_PROJECTION = re.compile(r"layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$")
# the GGUF fields of a model's sizes, as config.json names them (checked before transformers reads the file)
_SIZE_FIELDS = {"embedding_length": "hidden_size", "block_count": "num_hidden_layers",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "attention.key_length": "head_dim", "feed_forward_length": "intermediate_size",
                "context_length": "max_position_embeddings", "rope.freq_base": "rope_theta"}
# yarn fields of a gpt-oss file and the rope_parameters key each sets (None: read elsewhere)
_YARN_FIELDS = {"type": None, "factor": "factor", "original_context_length": "original_max_position_embeddings",
                "attn_factor": "attention_factor", "yarn_beta_fast": "beta_fast", "yarn_beta_slow": "beta_slow"}


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        names = {**_LAYER_NAMES, **_GPT_OSS_NAMES} if arch == "gpt-oss" else _LAYER_NAMES
        if m.group(2) not in names:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        if m.group(2) == "attn_sinks":  # a parameter of its own in HF (`self_attn.sinks`)
            return f"model.layers.{m.group(1)}.self_attn.sinks"
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _TOP_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_TOP_NAMES[stem]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves q/k rows for its rotary layout; undo it for rotate_half.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(path: str | os.PathLike, out_dir: Path | None = None, four_bit: bool | None = None) -> Path:
    """Return a folder holding the dequantised model; builds it on the first call. four_bit (default:
    settings.INT4_GEMM): the Q4_0 / Q4_1 / Q4_K projections kept at 4 bits instead, in a folder of its own
    (only flashdraft reads it: HF transformers, the trainer's target, reads the dequantised one)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    four_bit = settings.INT4_GEMM if four_bit is None else four_bit
    out = out_dir or settings.cache_root() / "gguf" / f"{path.stem}-{_file_key(path)}{'-q4' if four_bit else ''}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    reader = read_gguf(path)
    if "general.architecture" not in reader.fields:
        raise ValueError(f"GGUF file {path} has no general.architecture field")
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: {SUPPORTED_GGUF_ARCHS}")
    check_config(_size_fields(reader, arch), f"GGUF file {path}")
    if arch == "gpt-oss":
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
        config = _gpt_oss_config(reader, len(tokenizer), any(t.name == "output.weight" for t in reader.tensors))
    else:
        config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if arch == "llama" and getattr(config, "sliding_window", None) is not None:
        # transformers reads a llama file named "mistral" as Mistral, whose config defaults to a 4,096-key
        # window; the file holds no window field and llama.cpp attends to every key
        log.info("%s: GGUF llama file read as %s; no sliding window (the file has none)", path.name,
                 config.model_type)
        config.sliding_window = None
    if arch == "qwen3moe":
        fields = reader.fields
        config.moe_intermediate_size = int(fields[f"{arch}.expert_feed_forward_length"].parts[-1][0])
        norm = fields.get(f"{arch}.expert_weights_norm")  # llama.cpp renormalises qwen3moe's top-k unless told
        config.norm_topk_prob = bool(norm.parts[-1][0]) if norm is not None else True
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {}
    kept = []  # the projections kept at 4 bits (gguf_int4.py)
    for t in tqdm(reader.tensors, desc=f"dequantising {path.name}", unit="tensor"):
        name = hf_name(t.name, arch)
        shape = tuple(int(d) for d in reversed(t.shape))
        heads = n_head if name.endswith("q_proj.weight") else n_kv if name.endswith("k_proj.weight") else None
        kind = t.tensor_type.name
        if four_bit and kind in Q4_TYPES and _PROJECTION.search(name) and len(shape) == 2 and shape[1] % GROUP == 0:
            module = name.removesuffix(".weight")
            for part, v in q4_layout(t.data, kind, *shape).items():
                v = v.numpy()
                if arch == "llama" and heads is not None:  # (a row permutation: every part's rows alike)
                    v = _unpermute(v, heads)
                v = torch.from_numpy(np.ascontiguousarray(v))
                tensors[f"{module}.{part}"] = pack_int4(v) if part == "values" else v
            tensors[f"{module}.qweight"] = tensors.pop(f"{module}.values")
            kept.append(module.removeprefix("model."))
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        if arch == "llama" and heads is not None:
            w = _unpermute(w, heads)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
    if kept:  # (read back by quant.py's GGUF4: kept for Int4Linear, or dequantized at load)
        config.quantization_config = {"quant_method": "gguf", "bits": 4, "group_size": GROUP, "modules": kept}
    if arch == "gpt-oss":
        _gpt_oss_experts(tensors)
    for key in [k for k in tensors if k.endswith("mlp.experts.gate_proj.weight")]:  # [E, I, H] each
        stem = key.removesuffix("gate_proj.weight")
        tensors[stem + "gate_up_proj"] = torch.cat([tensors.pop(key), tensors.pop(stem + "up_proj.weight")], 1)
        tensors[stem + "down_proj"] = tensors.pop(stem + "down_proj.weight")
    # each process writes its own folder and renames it into place: processes that convert the same
    # file at once (several workers on a first start) never write into each other's files
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp-"))
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    gen = {"eos_token_id": config.eos_token_id, "bos_token_id": config.bos_token_id}
    (tmp / "generation_config.json").write_text(json.dumps(gen))
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    if out.exists() and not (out / "model.safetensors").exists():
        shutil.rmtree(out, ignore_errors=True)  # an incomplete folder from an older version
    try:
        tmp.rename(out)
    except OSError:  # another process got there first with the same conversion
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "model.safetensors").exists():
            raise
    log.info("converted %s -> %s", path, out)
    return out


def _size_fields(reader, arch: str) -> dict:
    """The model's sizes among the file's fields, under config.json's names (a field given per layer, as a
    list, is left to transformers' reader)."""
    fields = {hf: reader.fields[f"{arch}.{key}"].contents() for key, hf in _SIZE_FIELDS.items()
              if f"{arch}.{key}" in reader.fields}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None:
        fields["vocab_size"] = len(tokens.data)
    return {k: v for k, v in fields.items() if isinstance(v, (int, float))}


def _gpt_oss_config(reader, vocab_size: int, own_head: bool):
    """GptOssConfig from a gpt-oss file's fields (see the module docstring)."""
    from transformers import GptOssConfig

    def field(key, default=None, required=True):
        f = reader.fields.get(f"gpt-oss.{key}")
        if f is None and required and default is None:
            raise ValueError(f"GGUF gpt-oss file lacks the field gpt-oss.{key}")
        return default if f is None else f.contents()

    rope = {"rope_type": "default", "rope_theta": float(field("rope.freq_base"))}
    scaling = {k.removeprefix("gpt-oss.rope.scaling."): f.contents() for k, f in reader.fields.items()
               if k.startswith("gpt-oss.rope.scaling.")}
    unknown = sorted(set(scaling) - set(_YARN_FIELDS))
    if unknown:
        raise ValueError(f"GGUF gpt-oss rope scaling field(s) not supported: {', '.join(unknown)}")
    if scaling:
        if scaling.get("type") != "yarn":
            raise ValueError(f"GGUF gpt-oss rope.scaling.type {scaling.get('type')!r} is not supported (yarn is)")
        rope.update(rope_type="yarn", beta_fast=32.0, beta_slow=1.0, truncate=False)
        rope.update({_YARN_FIELDS[k]: v for k, v in scaling.items() if _YARN_FIELDS[k]})
    tok = {k: f.contents() for k, f in reader.fields.items() if k in ("tokenizer.ggml.bos_token_id",
                                                                       "tokenizer.ggml.eos_token_id")}
    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=int(field("embedding_length")),
        intermediate_size=int(field("expert_feed_forward_length", field("feed_forward_length", required=False))),
        num_hidden_layers=int(field("block_count")), num_attention_heads=int(field("attention.head_count")),
        num_key_value_heads=int(field("attention.head_count_kv")), head_dim=int(field("attention.key_length")),
        rms_norm_eps=float(field("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(field("context_length")), num_local_experts=int(field("expert_count")),
        num_experts_per_tok=int(field("expert_used_count")), sliding_window=int(field("attention.sliding_window")),
        rope_parameters=rope, tie_word_embeddings=not own_head,
        bos_token_id=tok.get("tokenizer.ggml.bos_token_id"), eos_token_id=tok.get("tokenizer.ggml.eos_token_id"))


def _gpt_oss_experts(tensors: dict[str, torch.Tensor]) -> None:
    """llama.cpp's gpt-oss experts (gate and up [E, I, H] with biases [E, I], or fused [E, 2I, H] gate rows
    first; down [E, H, I]) -> HF's layout in place: gate_up_proj [E, H, 2I] and its bias [E, 2I] with
    gate at even columns, down_proj [E, I, H], down_proj_bias [E, H]."""
    for key in [k for k in tensors if k.endswith("mlp.experts.down_proj.weight")]:
        stem = key.removesuffix("down_proj.weight")
        if stem + "gate_up_proj.weight" in tensors:
            both, both_b = tensors.pop(stem + "gate_up_proj.weight"), tensors.pop(stem + "gate_up_proj.bias")
            inter = both.shape[1] // 2
            gate, up, gate_b, up_b = both[:, :inter], both[:, inter:], both_b[:, :inter], both_b[:, inter:]
        else:
            gate, up = tensors.pop(stem + "gate_proj.weight"), tensors.pop(stem + "up_proj.weight")
            gate_b, up_b = tensors.pop(stem + "gate_proj.bias"), tensors.pop(stem + "up_proj.bias")
        E, inter, hidden = gate.shape
        tensors[stem + "gate_up_proj"] = torch.stack([gate, up], 2).reshape(E, 2 * inter, hidden).transpose(1, 2) \
            .contiguous()
        tensors[stem + "gate_up_proj_bias"] = torch.stack([gate_b, up_b], 2).reshape(E, 2 * inter)
        tensors[stem + "down_proj"] = tensors.pop(key).transpose(1, 2).contiguous()
        tensors[stem + "down_proj_bias"] = tensors.pop(stem + "down_proj.bias")
