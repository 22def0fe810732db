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
