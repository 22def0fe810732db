"""The main job as a user runs it: `flashdraft generate` on the embedded default."""

from __future__ import annotations

import subprocess
import sys


def test_generate_streams_answer():
    r = subprocess.run([sys.executable, "-m", "flashdraft", "generate", "What is the capital of France?",
                        "--max-tokens", "16", "--no-spec"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "The capital of France is Paris."
    assert "tok/s" in r.stderr and "finish=stop" in r.stderr


def test_generate_raw_prompt():
    r = subprocess.run([sys.executable, "-m", "flashdraft", "generate", "The capital of France is", "--raw",
                        "--max-tokens", "4", "--no-spec"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "finish=length" in r.stderr and r.stdout.strip()


def test_generate_with_drafter_prints_tau(tmp_path):
    from fixtures import build_random_drafter

    from flashdraft.models.loader import resolve_model_dir

    draft = build_random_drafter(tmp_path / "d", resolve_model_dir(None), block_size=4, num_layers=1,
                                 target_layer_ids=[1, 27], head_dim=64, num_attention_heads=9,
                                 num_key_value_heads=3, mask_token_id=16)
    plain = subprocess.run([sys.executable, "-m", "flashdraft", "generate", "Name a fruit.", "--max-tokens", "12",
                            "--no-spec"], capture_output=True, text=True, timeout=300)
    spec = subprocess.run([sys.executable, "-m", "flashdraft", "generate", "Name a fruit.", "--max-tokens", "12",
                           "--draft", str(draft)], capture_output=True, text=True, timeout=300)
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    assert "tau=" in spec.stderr and "drafts=" in spec.stderr and "accepted=" in spec.stderr


def test_generate_speculates_by_default_with_the_shipped_drafter():
    args = [sys.executable, "-m", "flashdraft", "generate", "What is the capital of France?", "--max-tokens", "24"]
    spec = subprocess.run(args, capture_output=True, text=True, timeout=300)
    plain = subprocess.run(args + ["--no-spec"], capture_output=True, text=True, timeout=300)
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "Paris" in spec.stdout
    assert "tau=" in spec.stderr and "tau=" not in plain.stderr


def test_generate_verifies_fewer_drafts_when_asked():
    """--num-speculative-tokens K verifies K drafts a step (vLLM's name), same text; an impossible
    K is refused with a message naming the allowed range."""
    import re

    args = [sys.executable, "-m", "flashdraft", "generate", "What is the capital of France?", "--max-tokens", "24"]
    spec = subprocess.run(args + ["--num-speculative-tokens", "3"], capture_output=True, text=True, timeout=300)
    plain = subprocess.run(args + ["--no-spec"], capture_output=True, text=True, timeout=300)
    assert spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout
    drafts, draft_tokens = (int(re.search(rf"{k}=(\d+)", spec.stderr).group(1)) for k in ("drafts", "draft_tokens"))
    assert drafts > 0 and draft_tokens == 3 * drafts
    bad = subprocess.run(args + ["--num-speculative-tokens", "9"], capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "num_speculative_tokens must be in [1, 7], got 9" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_generate_verifies_token_trees():
    """The default on a CPU is a tree of the chain's size (7 drafts a verify); --speculative-tree-size N
    verifies N, off the chain; all with the same text. Bad sizes are refused with the range."""
    import re

    args = [sys.executable, "-m", "flashdraft", "generate", "What is the capital of France?", "--max-tokens", "24"]
    plain = subprocess.run(args + ["--no-spec"], capture_output=True, text=True, timeout=300)
    for extra, per_verify in (([], 7), (["--speculative-tree-size", "15"], 15),
                              (["--speculative-tree-size", "off"], 7)):
        r = subprocess.run(args + extra, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert r.stdout == plain.stdout
        drafts, draft_tokens = (int(re.search(rf"{k}=(\d+)", r.stderr).group(1)) for k in ("drafts", "draft_tokens"))
        assert drafts > 0 and draft_tokens == per_verify * drafts, (extra, r.stderr)
    for bad, message in (("64", "speculative_tree_size must be"), ("many", "expected a number of drafts")):
        r = subprocess.run(args + ["--speculative-tree-size", bad], capture_output=True, text=True, timeout=300)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


# ---- the flags are the EngineConfig fields ------------------------------------------------------
def _subparser(name: str):
    import argparse

    from flashdraft.cli import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_every_engine_field_is_a_flag_or_marked_not_one():
    """A new EngineConfig field needs flag(...) or no_flag(...): the CLI cannot forget it. The flag
    fields are the options of serve (which adds the opt-in --seed), by their option strings."""
    from dataclasses import fields

    from flashdraft.config import EngineConfig
    from flashdraft.config_flags import flag_spec

    options = {s for a in _subparser("serve")._actions for s in a.option_strings}
    not_flags = set()
    for f in fields(EngineConfig):
        spec = flag_spec(f)  # raises for a field declared with neither
        if spec is None:
            not_flags.add(f.name)
            continue
        names = spec.names if spec.names is not None else ("--" + f.name.replace("_", "-"),)
        assert set(names) | set(spec.off) <= options, f.name
        assert names or spec.off, f"{f.name}: a flag field without a flag"
    assert not_flags == {"kv_block_size", "max_graph_batch"}


def test_parsed_defaults_are_the_config_defaults():
    """Each subcommand's engine flags, given nothing, build EngineConfig() field by field; generate and
    bench leave the engine seed alone (their --seed is their requests')."""
    from dataclasses import fields

    from flashdraft.cli import serve_engine_kwargs
    from flashdraft.config import EngineConfig, engine_kwargs

    default = EngineConfig()
    for command, argv in (("serve", []), ("generate", ["hi"]), ("bench", [])):
        args = _subparser(command).parse_args(argv)
        kw = serve_engine_kwargs(args) if command == "serve" else engine_kwargs(args)
        flags = {f.name for f in fields(EngineConfig)} - {"kv_block_size", "max_graph_batch"}
        assert set(kw) == (flags if command == "serve" else flags - {"seed"}), command
        built = EngineConfig.from_kwargs(**kw)
        for f in fields(EngineConfig):
            assert getattr(built, f.name) == getattr(default, f.name), (command, f.name)


def test_engine_flags_set_their_fields():
    """The flags that are not --field-name VALUE: off switches, aliases, the engine seed, parsed values."""
    from flashdraft.cli import serve_engine_kwargs

    cases = [(["--no-spec"], "draft", None), (["--draft", "d", "--no-spec"], "draft", None),
             (["--no-cuda-graphs"], "cuda_graphs", False), (["--enforce-eager"], "cuda_graphs", False),
             (["-tp", "2"], "tensor_parallel_size", 2), (["--seed", "3"], "seed", 3),
             (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
             (["--async-scheduling"], "async_scheduling", True),
             (["--disable-custom-all-reduce"], "disable_custom_all_reduce", True),
             (["--speculative-tree-size", "off"], "speculative_tree_size", None),
             (["--speculative-min-acceptance-length", "2.5"], "speculative_min_acceptance_length", 2.5),
             (["--speculative-config", '{"model": "d"}'], "speculative_config", {"model": "d"}),
             (["--kv-cache-memory-gb", "1.5"], "kv_cache_memory_gb", 1.5), (["--max-num-seqs", "8"], "max_num_seqs", 8)]
    for argv, name, value in cases:
        assert serve_engine_kwargs(_subparser("serve").parse_args(argv))[name] == value, argv
