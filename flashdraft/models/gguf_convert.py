"""GGUF -> HF-layout folder (config.json, tokenizer, model.safetensors), done once per file and
cached under the user cache dir. Config and tokenizer come from transformers' GGUF readers; the
weights are dequantised here with the `gguf` package (transformers would keep a quantizer marker
that refuses to serialise). Qwen3-MoE files hold each layer's experts stacked (`ffn_*_exps`); they
are written in flashdraft's stacked layout (models/moe.py), and the fields transformers' reader
leaves out are read here: the expert width, and the top-k renormalisation llama.cpp applies."""

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
SUPPORTED_GGUF_ARCHS = ("llama", "qwen3", "qwen3moe")


def cache_root() -> Path:
    base = os.environ.get("FLASHDRAFT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache"), "flashdraft")
    return Path(base)


def _file_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.name}:{st.st_size}".encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


def hf_name(gguf_name: str) -> str:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", gguf_name)
    if m:
        if m.group(2) not in _LAYER_NAMES:
            raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem not in _TOP_NAMES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r}")
    return f"{_TOP_NAMES[stem]}.{kind}"


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp's converter interleaves q/k rows for its rotary layout; undo it for rotate_half.
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(path: str | os.PathLike, out_dir: Path | None = None) -> Path:
    """Return a folder holding the dequantised model; builds it on the first call."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    out = out_dir or cache_root() / "gguf" / f"{path.stem}-{_file_key(path)}"
    if (out / "model.safetensors").exists() and (out / "config.json").exists():
        return out
    reader = gguf.GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise ValueError(f"unsupported GGUF architecture {arch!r} in {path}; supported: {SUPPORTED_GGUF_ARCHS}")
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if arch == "qwen3moe":
        fields = reader.fields
        config.moe_intermediate_size = int(fields[f"{arch}.expert_feed_forward_length"].parts[-1][0])
        norm = fields.get(f"{arch}.expert_weights_norm")  # llama.cpp renormalises qwen3moe's top-k unless told
        config.norm_topk_prob = bool(norm.parts[-1][0]) if norm is not None else True
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    n_head, n_kv = config.num_attention_heads, config.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(reader.tensors, desc=f"dequantising {path.name}", unit="tensor"):
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape(tuple(int(d) for d in reversed(t.shape)))
        name = hf_name(t.name)
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = _unpermute(w, n_head)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            w = _unpermute(w, n_kv)
        tensors[name] = torch.from_numpy(np.ascontiguousarray(w))
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
