"""vLLM users' habits: `serve MODEL`, --speculative-config, --gpu-memory-utilization, --seed,
--enforce-eager, --version, defaults in --help, the start-up line, a bad drafter refused before the
target's weights load, and vLLM's prompt dicts in LLM.generate."""

from __future__ import annotations

import argparse
import json
import re

import pytest
import torch
from fixtures import build_random_drafter

from flashdraft import LLM, SamplingParams
from flashdraft.cli import build_parser, main, package_version, serve_engine_kwargs
from flashdraft.config import EngineConfig, engine_kwargs
from flashdraft.engine import memory
from flashdraft.engine.memory import KV_SHARE, memory_budget, utilization_budget

GIB = 1 << 30


def serve_config(*argv: str) -> EngineConfig:
    return EngineConfig.from_kwargs(**serve_engine_kwargs(build_parser().parse_args(["serve", *argv])))


# ---- serve MODEL -------------------------------------------------------------------------------
def test_serve_takes_the_model_as_vllm_serve_does():
    assert serve_config("org/model").model == "org/model"
    assert serve_config("--model", "org/model").model == "org/model"
    assert serve_config("org/model", "--model", "org/model").model == "org/model"
    assert serve_config().model is None  # the embedded default
    with pytest.raises(ValueError, match="the model is given twice, as 'a' and as --model 'b'"):
        serve_config("a", "--model", "b")


def test_serve_refuses_two_models_before_starting(capsys):
    assert main(["serve", "a", "--model", "b"]) == 2
    assert "given twice" in capsys.readouterr().err


# ---- --speculative-config ----------------------------------------------------------------------
def test_speculative_config_sets_the_drafter_fields():
    spec = {"method": "dflash", "model": "org/drafter", "num_speculative_tokens": 3, "revision": "v2"}
    cfg = serve_config("--speculative-config", json.dumps(spec))
    assert (cfg.draft, cfg.num_speculative_tokens, cfg.draft_revision) == ("org/drafter", 3, "v2")
    assert cfg.speculative_config == spec
    # the same values given twice agree; the dict is vLLM's LLM(speculative_config=...) too
    same = EngineConfig(draft="org/drafter", num_speculative_tokens=3, speculative_config=spec)
    assert (same.draft, same.num_speculative_tokens) == ("org/drafter", 3)
    cfg = EngineConfig(speculative_config={"model": "d", "disable_by_batch_size": 8})  # method defaults to dflash
    assert (cfg.draft, cfg.speculative_disable_batch_size) == ("d", 8)


@pytest.mark.parametrize("spec, message", [
    ({"method": "eagle3", "model": "d"}, "method 'eagle3' is not supported"),
    ({"method": "dflash2", "model": "d"}, "DFlash2 drafter loads as method 'dflash'"),
    ({"method": "dflash", "model": "d", "speculative_token_tree": "[(0,)]"}, "key 'speculative_token_tree'"),
    ({"method": "dflash", "model": "d", "draft_tensor_parallel_size": 2}, "key 'draft_tensor_parallel_size'"),
    ({"method": "dflash", "model": "d", "quantization": "fp8"}, "key 'quantization'"),
    ({"method": "dflash", "model": "d", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer"),
    ({"method": "dflash", "model": 5}, "model and revision must be strings"),
    ([1, 2], "must be a JSON object"),
])
def test_speculative_config_refusals_name_the_key(spec, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=spec)


@pytest.mark.parametrize("argv, message", [
    (["--draft", "x"], r"draft \(--draft\) is 'x'"),
    (["--num-speculative-tokens", "2"], r"num_speculative_tokens \(--num-speculative-tokens\) is 2"),
    (["--draft-revision", "main"], r"draft_revision \(--draft-revision\) is 'main'"),
    (["--no-spec"], "draft=None"),
])
def test_speculative_config_conflicts_with_explicit_flags(argv, message):
    spec = json.dumps({"method": "dflash", "model": "d", "num_speculative_tokens": 3, "revision": "v2"})
    with pytest.raises(ValueError, match=message):
        serve_config("--speculative-config", spec, *argv)


def test_speculative_config_no_ops_are_logged(caplog):
    with caplog.at_level("INFO", logger="flashdraft"):
        EngineConfig(speculative_config={"method": "dflash", "model": "d", "draft_tensor_parallel_size": 1})
    assert "draft_tensor_parallel_size=1 changes nothing" in caplog.text


def test_speculative_config_must_be_json(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", "{method: dflash}"])
    assert "not valid JSON" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--speculative-config", '["dflash"]'])
    assert "expected a JSON object" in capsys.readouterr().err


def test_speculative_config_runs_the_drafter(tiny_llama, drafter, plain):
    llm = LLM(str(tiny_llama), device="cpu", dtype="float32",
              speculative_config={"method": "dflash", "model": str(drafter), "num_speculative_tokens": 2})
    assert llm.engine.spec is not None and llm.engine.spec.num_draft == 2
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert llm.generate([[5, 6, 7]], params)[0].token_ids == plain.generate([[5, 6, 7]], params)[0].token_ids


# ---- --gpu-memory-utilization ------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, 0.0, -0.1, 1.01, float("nan"), True, "0.9"])
def test_gpu_memory_utilization_is_a_fraction(value):
    with pytest.raises(ValueError, match="gpu_memory_utilization must be a fraction in"):
        EngineConfig(gpu_memory_utilization=value)


@pytest.mark.parametrize("explicit", [{"kv_cache_memory_gb": 4.0}, {"num_kv_blocks": 100}])
def test_gpu_memory_utilization_or_an_explicit_kv_size(explicit):
    with pytest.raises(ValueError, match="both size the KV cache"):
        EngineConfig(gpu_memory_utilization=0.9, **explicit)


def test_utilization_budget_arithmetic():
    total = 80 * GIB
    # the whole device on an idle GPU is the default: KV_SHARE of what the weights leave free
    assert utilization_budget(1.0, total, 70 * GIB, 10 * GIB) == pytest.approx(KV_SHARE * 70 * GIB)
    assert utilization_budget(0.5, total, 70 * GIB, 10 * GIB) == pytest.approx(KV_SHARE * 30 * GIB)
    # another process holds memory: never more than is free
    assert utilization_budget(0.9, total, 20 * GIB, 10 * GIB) == pytest.approx(KV_SHARE * 20 * GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization 0.1 allows 8.00 GiB, but the engine holds 10.00"):
        utilization_budget(0.1, total, 70 * GIB, 10 * GIB)


def test_memory_budget_reads_the_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 10 * GIB)
    cuda = torch.device("cuda")
    assert memory_budget(EngineConfig(gpu_memory_utilization=0.5), cuda) == pytest.approx(KV_SHARE * 30 * GIB)
    assert memory_budget(EngineConfig(), cuda) == pytest.approx(KV_SHARE * 70 * GIB)
    cpu = memory_budget(EngineConfig(gpu_memory_utilization=0.5), torch.device("cpu"))
    assert cpu == memory_budget(EngineConfig(), torch.device("cpu")) == memory.CPU_KV_BYTES


def test_gpu_memory_utilization_is_ignored_on_cpu(tiny_llama, caplog):
    assert serve_config("--gpu-memory-utilization", "0.8").gpu_memory_utilization == 0.8
    with caplog.at_level("INFO", logger="flashdraft"):
        llm = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", gpu_memory_utilization=0.8)
    assert "gpu_memory_utilization 0.8 is ignored on cpu" in caplog.text
    default = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    assert llm.engine.block_manager.num_blocks == default.engine.block_manager.num_blocks


# ---- --seed, --enforce-eager -------------------------------------------------------------------
def test_seed_is_the_engine_seed_on_serve_and_the_sampling_seed_on_generate():
    assert serve_config("--seed", "7").seed == 7
    assert serve_config().seed == 0
    g = build_parser().parse_args(["generate", "hi", "--seed", "7"])
    assert g.seed == 7 and "seed" not in engine_kwargs(g)  # SamplingParams(seed=7); the engine's stays 0


def test_enforce_eager_turns_cuda_graphs_off():
    assert serve_config().cuda_graphs is True
    assert serve_config("--enforce-eager").cuda_graphs is False
    assert serve_config("--no-cuda-graphs").cuda_graphs is False
    assert EngineConfig.from_kwargs(enforce_eager=True).cuda_graphs is False  # LLM(model, enforce_eager=True)
    assert EngineConfig.from_kwargs(enforce_eager=False).cuda_graphs is True
    with pytest.raises(ValueError, match="disagree"):
        EngineConfig.from_kwargs(enforce_eager=True, cuda_graphs=True)


def test_disable_custom_all_reduce_keeps_nccl_alone():
    """vLLM's --disable-custom-all-reduce: the one-shot all-reduce is never built; on a CPU it never is."""
    from flashdraft.engine.parallel import tp_group

    assert serve_config().disable_custom_all_reduce is False
    assert serve_config("--disable-custom-all-reduce", "-tp", "2").disable_custom_all_reduce is True
    assert tp_group(0, 2, torch.device("cpu"), EngineConfig()).one_shot is None  # (CUDA only)


# ---- --version, --help -------------------------------------------------------------------------
def test_version(capsys, monkeypatch):
    from importlib import metadata

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"flashdraft {metadata.version('flashdraft')}\n"

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)  # a source tree that is not installed
    assert re.fullmatch(r"\d+\.\d+\.\d+\S*", package_version())


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


@pytest.mark.parametrize("command", ["generate", "serve", "bench", "train-drafter"])
def test_help_shows_every_default(command):
    sub = subparsers()[command]
    flags = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._HelpAction)
    for action in sub._actions:
        if not action.option_strings or action.required or isinstance(action, flags):
            continue
        text = sub._get_formatter()._format_action(action)
        assert "default" in text, (command, action.option_strings, text)


def test_help_words_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for shown in ("--max-num-seqs MAX_NUM_SEQS requests running at once (default: 64)",
                  "(default: embedded SmolLM2-135M)", "(default: 8000)", "(default: 0)",
                  "--attention-backend {auto,torch,triton} auto: triton on CUDA when it imports, else torch "
                  "(default: auto)"):
        assert shown in text
    assert "(default: None)" not in text


# ---- the start-up line -------------------------------------------------------------------------
def test_startup_line(tiny_llama, drafter, caplog):
    with caplog.at_level("INFO", logger="flashdraft"):
        llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32", max_model_len=256)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready"))
    pages = llm.engine.block_manager.num_blocks
    assert f"target {tiny_llama} (llama), float32 on cpu" in line
    assert f"drafter {drafter} (dflash, block 4, taps [0, 1], chain of 3 drafts per verify)" in line
    assert f"KV cache {pages} pages x 16 tokens = " in line
    assert f"{pages * 16 // 256} sequences of max_model_len 256; CUDA graphs off" in line
    caplog.clear()
    with caplog.at_level("INFO", logger="flashdraft"):
        LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    assert "; no drafter; KV cache" in caplog.text


# ---- a bad drafter fails before the target's weights load --------------------------------------
def _broken(drafter_dir, change):
    cfg = json.loads((drafter_dir / "config.json").read_text())
    change(cfg)
    (drafter_dir / "config.json").write_text(json.dumps(cfg))
    return drafter_dir


@pytest.mark.parametrize("make, error, message", [
    (lambda t, d: d / "missing", FileNotFoundError, "drafter path .* does not exist"),
    (lambda t, d: (d / "empty").mkdir() or d / "empty", FileNotFoundError, "no config.json"),
    (lambda t, d: _broken(build_random_drafter(d / "eagle", t), lambda c: c.update(architectures=["EagleModel"])
                          or c.pop("dflash_config")), ValueError, "unknown drafter architecture"),
    (lambda t, d: _broken(build_random_drafter(d / "wide", t), lambda c: c.update(hidden_size=32)),
     ValueError, "drafter hidden_size 32 does not match the target's 64"),
    (lambda t, d: _broken(build_random_drafter(d / "taps", t), lambda c: c["dflash_config"].update(
        target_layer_ids=[0, 3])), ValueError, r"tap layer id\(s\) \[3\] outside"),
    (lambda t, d: _broken(build_random_drafter(d / "mask", t), lambda c: c["dflash_config"].update(
        mask_token_id=10**6)), ValueError, "mask_token_id 1000000 is outside"),
])
def test_bad_drafter_fails_before_the_target_weights(tiny_llama, tmp_path, monkeypatch, make, error, message):
    import flashdraft.models.loader as loader

    draft = make(tiny_llama, tmp_path)

    def no_weights(folder):
        raise AssertionError(f"weights of {folder} loaded before the drafter was checked")

    monkeypatch.setattr(loader, "load_weights", no_weights)
    with pytest.raises(error, match=message):
        LLM(str(tiny_llama), draft=str(draft), device="cpu", dtype="float32")


# ---- vLLM's prompt forms in LLM.generate --------------------------------------------------------
def test_generate_takes_vllm_prompt_dicts(plain):
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    text, ids = "the quick brown fox", [5, 17, 33, 80]

    def tokens(prompts):
        return [o.token_ids for o in plain.generate(prompts, params)]

    by_text, by_ids = tokens(text), tokens(ids)
    assert tokens({"prompt": text}) == tokens([{"prompt": text}]) == tokens([text]) == by_text
    assert tokens({"prompt_token_ids": ids}) == tokens([{"prompt_token_ids": ids}]) == tokens([ids]) == by_ids
    assert tokens([{"prompt": text}, ids, text, {"prompt_token_ids": ids}]) == by_text + by_ids + by_text + by_ids
    assert plain.generate({"prompt": text}, params)[0].prompt == text


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "hi", "multi_modal_data": {"image": None}}, "prompt key 'multi_modal_data' is not supported"),
    ({"prompt": "hi", "prompt_token_ids": [5, 6]}, "got both"),
    ({}, "got neither"),
    ({"prompt": [5, 6]}, "'prompt' must be a string"),
    ({"prompt_token_ids": "5 6"}, "'prompt_token_ids' must be a list of token ids"),
    ([{"prompt": "ok"}, {"text": "hi"}], "prompt key 'text'"),
])
def test_generate_refuses_other_prompt_dicts(plain, prompt, message):
    with pytest.raises(ValueError, match=message):
        plain.generate(prompt, SamplingParams(max_tokens=2))
    assert not plain.engine.has_unfinished()


def test_generate_refuses_other_types(plain):
    with pytest.raises(TypeError, match="prompts must be"):
        plain.generate(42, SamplingParams(max_tokens=2))
