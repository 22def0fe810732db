"""Bad input gets a clear error naming the problem, and the engine stays usable."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from flashdraft import LLM, SamplingParams


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", max_model_len=64)


def test_missing_model_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"), draft=None)


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path), draft=None)


def test_malformed_config(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(tmp_path), draft=None)


def test_config_missing_fields(tmp_path, tiny_llama):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    del cfg["hidden_size"]
    cfg["hidden_size"] = -3
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(str(tmp_path), draft=None)


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "architectures": ["MambaForCausalLM"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'mamba'"):
        LLM(str(tmp_path), draft=None)


def test_not_a_gguf_file(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        LLM(str(f), draft=None)


def test_missing_weights(tmp_path, tiny_llama):
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((tiny_llama / name).read_text())
    with pytest.raises(FileNotFoundError, match="safetensors"):
        LLM(str(tmp_path), draft=None)


def test_unknown_engine_option(tiny_llama):
    with pytest.raises(TypeError, match="unknown engine option.*gpu_memory"):
        LLM(str(tiny_llama), draft=None, gpu_memory=0.5)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.5}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"top_k": 0}, "top_k"), ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"), ({"seed": "x"}, "seed"), ({"seed": 2**64}, "seed"),
    ({"temperature": float("nan")}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_k": 2**40}, "top_k"), ({"max_tokens": 2.5}, "max_tokens"),
])
def test_invalid_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_usable(llama):
    ok = [5, 6, 7]
    before = llama.generate([ok], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids
    with pytest.raises(ValueError, match="prompt is empty"):
        llama.generate([""], SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        llama.generate([[]], SamplingParams())
    with pytest.raises(ValueError, match="context window"):
        llama.generate([ok, [5] * 64], SamplingParams())  # the good prompt is not queued either
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llama.generate([[5, 10**6]], SamplingParams())
    with pytest.raises(ValueError, match="got 1 SamplingParams for 2 prompts"):
        llama.generate([ok, ok], [SamplingParams()])
    with pytest.raises(ValueError, match="conversation"):
        llama.chat([{"content": "no role"}])
    assert not llama.engine.has_unfinished()
    assert llama.generate([ok], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids == before


def test_cli_reports_errors_cleanly(tmp_path):
    r = subprocess.run([sys.executable, "-m", "flashdraft", "generate", "hi", "--model", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "does not exist" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "flashdraft", "generate", "hi", "--temperature", "-1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "temperature" in r.stderr
