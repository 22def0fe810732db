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
