"""A bad checkpoint fails fast with one ValueError naming the file or the config field, before anything large
is allocated: safetensors files truncated, empty or not safetensors at all (target and drafter), GGUF files
cut short or empty, config sizes out of range or heads that do not group, a vocabulary smaller than the
tokenizer's or the embedding's, a rope_theta <= 0, NaN weights; and the CLI says each in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from fixtures import build_random_drafter
from safetensors.torch import load_file, save_file

from flashdraft import LLM


def load(model: Path, draft: Path | None = None) -> LLM:
    return LLM(str(model), draft=None if draft is None else str(draft), device="cpu", dtype="float32")


def copy(folder: Path, to: Path) -> Path:
    return Path(shutil.copytree(folder, to))


def edit_config(folder: Path, edit) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    edit(cfg)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.fixture
def no_model_built(monkeypatch):
    """Building the target model (or reading its weights) fails the test: the checks come first."""
    import flashdraft.models.loader as loader

    def built(*args, **kwargs):
        raise AssertionError("the model was built before the checkpoint was refused")

    monkeypatch.setattr(loader, "DecoderLM", built)
    monkeypatch.setattr(loader, "HybridLM", built)


@pytest.fixture
def no_target_weights(monkeypatch):
    import flashdraft.models.loader as loader

    def read(folder):
        raise AssertionError(f"weights of {folder} read before the drafter was refused")

    monkeypatch.setattr(loader, "stream_weights", read)


# ---- safetensors files against their headers -----------------------------------------------------
def truncated(data: bytes) -> bytes:
    return data[: len(data) // 2]


def header_cut(data: bytes) -> bytes:
    return data[:40]


BAD_FILES = [
    pytest.param(truncated, "is truncated", id="truncated"),
    pytest.param(header_cut, "is truncated", id="header-cut"),
    pytest.param(lambda data: b"", "is empty", id="empty"),
    pytest.param(lambda data: b"garbage!" * 64, "is not a safetensors file", id="garbage"),
    pytest.param(lambda data: b"\x01" + bytes(7), "is not a safetensors file", id="one-byte-header"),
]


@pytest.mark.parametrize("spoil, words", BAD_FILES)
def test_bad_target_safetensors(tiny_llama, tmp_path, no_model_built, spoil, words):
    folder = copy(tiny_llama, tmp_path / "m")
    f = folder / "model.safetensors"
    f.write_bytes(spoil(f.read_bytes()))
    with pytest.raises(ValueError, match=words) as err:
        load(folder)
    assert str(f) in str(err.value)


@pytest.mark.parametrize("spoil, words", BAD_FILES)
def test_bad_drafter_safetensors(tiny_llama, drafter, tmp_path, no_target_weights, spoil, words):
    folder = copy(drafter, tmp_path / "d")
    f = folder / "model.safetensors"
    f.write_bytes(spoil(f.read_bytes()))
    with pytest.raises(ValueError, match=words) as err:
        load(tiny_llama, folder)
    assert str(f) in str(err.value)


def test_tensor_bytes_match_dtype_and_shape(tiny_llama, tmp_path, no_model_built):
    folder = copy(tiny_llama, tmp_path / "m")
    f = folder / "model.safetensors"
    data = f.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8: 8 + length])
    name = next(k for k in header if k != "__metadata__")
    header[name]["shape"] = [header[name]["shape"][0] + 1, *header[name]["shape"][1:]]
    text = json.dumps(header, separators=(",", ":")).encode().ljust(length)
    assert len(text) == length
    f.write_bytes(data[:8] + text + data[8 + length:])
    with pytest.raises(ValueError, match=f"not a safetensors file: tensor '{name}'") as err:
        load(folder)
    assert str(f) in str(err.value)


def test_library_errors_name_the_file(tiny_llama, tmp_path):
    """Bytes past the last tensor pass the header check; the safetensors library refuses them, named."""
    folder = copy(tiny_llama, tmp_path / "m")
    f = folder / "model.safetensors"
    f.write_bytes(f.read_bytes() + bytes(16))
    with pytest.raises(ValueError, match="cannot read safetensors file") as err:
        load(folder)
    assert str(f) in str(err.value)


@pytest.mark.parametrize("which", ["target", "drafter"])
def test_nan_weight(tiny_llama, drafter, tmp_path, which):
    folder = copy(tiny_llama if which == "target" else drafter, tmp_path / which)
    f = folder / "model.safetensors"
    weights = load_file(str(f))
    name = sorted(weights)[1]
    weights[name].view(-1)[3] = float("nan")
    save_file(weights, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"tensor '{name}' in .* holds NaN or infinite values") as err:
        load(folder) if which == "target" else load(tiny_llama, folder)
    assert str(f) in str(err.value)


# ---- config fields ---------------------------------------------------------------------------------
def rope_theta(value):
    def edit(cfg):
        cfg["rope_parameters"]["rope_theta"] = value
    return edit


BAD_CONFIGS = [
    pytest.param(lambda c: c.update(num_hidden_layers=10**9), "num_hidden_layers 1000000000 is over 1024",
                 id="layers-1e9"),
    pytest.param(lambda c: c.update(hidden_size=2**40), "hidden_size 1099511627776 is over 65536", id="hidden-2^40"),
    pytest.param(lambda c: c.update(vocab_size=2**30), "vocab_size 1073741824 is over", id="vocab-2^30"),
    pytest.param(lambda c: c.update(num_key_value_heads=3),
                 "num_attention_heads 4 is not a multiple of num_key_value_heads 3", id="kv-heads"),
    pytest.param(lambda c: c.update(num_key_value_heads=0), "num_key_value_heads must be a positive integer, got 0",
                 id="kv-heads-0"),
    pytest.param(lambda c: c.update(head_dim=-16), "head_dim must be a positive integer, got -16", id="head-dim"),
    pytest.param(lambda c: c.update(max_position_embeddings=0),
                 "max_position_embeddings must be a positive integer, got 0", id="positions-0"),
    pytest.param(rope_theta(-10000.0), "rope_parameters.rope_theta must be a positive number, got -10000.0",
                 id="rope-theta-negative"),
    pytest.param(rope_theta(float("nan")), "rope_theta must be a positive number", id="rope-theta-nan"),
    pytest.param(lambda c: c.update(num_local_experts=2**20), "num_local_experts 1048576 is over", id="experts-2^20"),
    pytest.param(lambda c: c.update(num_local_experts=4, num_experts_per_tok=8),
                 "num_experts_per_tok 8 is more than the 4 experts", id="routed-over-experts"),
    pytest.param(lambda c: c.update(vocab_size=10),
                 "vocab_size 10 is smaller than the tokenizer's vocabulary of 320 tokens", id="vocab-10"),
    pytest.param(lambda c: c.update(vocab_size=400),
                 "vocab_size 400 does not match the 320 rows of model.embed_tokens.weight", id="vocab-400"),
]


@pytest.mark.parametrize("edit, message", BAD_CONFIGS)
def test_bad_target_config(tiny_llama, tmp_path, no_model_built, edit, message):
    folder = edit_config(copy(tiny_llama, tmp_path / "m"), edit)
    with pytest.raises(ValueError, match=message) as err:
        load(folder)
    assert str(folder / "config.json") in str(err.value)


@pytest.mark.parametrize("fmt", ["z-lab", "speculators"])
@pytest.mark.parametrize("overrides, message", [
    (dict(num_hidden_layers=10**9), "num_hidden_layers 1000000000 is over 1024"),
    (dict(num_key_value_heads=3), "num_attention_heads 4 is not a multiple of num_key_value_heads 3"),
    (dict(max_position_embeddings=0), "max_position_embeddings must be a positive integer, got 0"),
    (dict(rope_theta=-1.0), "rope_theta must be a positive number, got -1.0"),
])
def test_bad_drafter_config(tiny_llama, tmp_path, no_target_weights, fmt, overrides, message):
    folder = build_random_drafter(tmp_path / "d", tiny_llama, fmt=fmt)
    layer = (lambda c: c["transformer_layer_config"]) if fmt == "speculators" else (lambda c: c)
    edit_config(folder, lambda c: layer(c).update(overrides))
    with pytest.raises(ValueError, match=message) as err:
        load(tiny_llama, folder)
    assert str(folder / "config.json") in str(err.value)


# ---- GGUF files --------------------------------------------------------------------------------------
def write_gguf(path: Path, block_count: int = 3) -> Path:
    """A hand-written llama GGUF of two float32 tensors: enough for the reader, not a model."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_embedding_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_context_length(512)
    w.add_rope_freq_base(10000.0)
    w.add_tensor("token_embd.weight", np.ones((320, 64), np.float32))
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture
def gguf_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("keep, message", [
    (lambda n: n // 2, "truncated GGUF file"),  # in the first tensor's data
    (lambda n: n - 8, "truncated GGUF file"),  # in the last tensor's
    (lambda n: 100, "truncated GGUF file"),  # in the metadata
    (lambda n: 0, "empty GGUF file"),
])
def test_bad_gguf(tmp_path, gguf_cache, keep, message):
    f = write_gguf(tmp_path / "tiny.gguf")
    data = f.read_bytes()
    f.write_bytes(data[: keep(len(data))])
    with pytest.raises(ValueError, match=message) as err:
        load(f)
    assert str(f) in str(err.value)
    assert not gguf_cache.exists() or not any(gguf_cache.rglob("*.safetensors"))


def test_gguf_sizes_checked_before_transformers_reads_them(tmp_path, gguf_cache, monkeypatch):
    import transformers

    def parsed(*args, **kwargs):
        raise AssertionError("transformers read the GGUF file before its sizes were checked")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", parsed)
    f = write_gguf(tmp_path / "deep.gguf", block_count=10**9)
    with pytest.raises(ValueError, match="num_hidden_layers 1000000000 is over 1024") as err:
        load(f)
    assert str(f) in str(err.value)


def test_checks_pass_a_good_checkpoint(tiny_llama, drafter):
    """The checks refuse nothing honest: the tiny model and its drafter load and decode."""
    from flashdraft import SamplingParams

    llm = load(tiny_llama, drafter)
    out = llm.generate(["the quick brown fox"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(out[0].token_ids) == 4


@pytest.mark.parametrize("spoil, words", [
    pytest.param(lambda f: f.write_bytes(truncated(f.read_bytes())), "is truncated", id="truncated"),
    pytest.param(lambda f: edit_config(f.parent, lambda c: c.update(num_hidden_layers=10**9)),
                 "num_hidden_layers 1000000000 is over 1024", id="layers-1e9"),
    pytest.param(lambda f: (f.unlink(), f.mkdir()), "model.safetensors", id="a-folder"),
])
def test_the_cli_says_one_line(tiny_llama, tmp_path, capsys, spoil, words):
    """`flashdraft generate` on a bad checkpoint: exit status 2 and one `flashdraft: error:` line, no traceback."""
    from flashdraft.cli import main

    folder = copy(tiny_llama, tmp_path / "m")
    spoil(folder / "model.safetensors")
    assert main(["generate", "hi", "--model", str(folder), "--no-spec", "--device", "cpu", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("flashdraft: error: ") and words in err[0], err
