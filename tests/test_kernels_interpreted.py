"""The quantized paths of the Triton kernels (FP8 KV pages in the paged attention kernel and its stores, the
W4A16 GEMM, FP8 experts in the grouped expert GEMMs) run on CPU tensors under the Triton interpreter, in a
process of their own (TRITON_INTERPRET is read when the kernels are defined): tests/gpu's own checks of them
against the torch paths, so that a CPU machine runs them too. The rest of tests/gpu takes minutes there (see
README); on a GPU, tests/gpu runs them on the device."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[1]
SELECTIONS = {  # file under tests/gpu -> its -k selection
    "test_triton_attention.py": "fp8",
    "test_int4_gemm.py": "",
    "test_moe.py": "fp8",
}


@pytest.mark.parametrize("name", list(SELECTIONS))
def test_under_the_interpreter(name):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    args = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "gpu" / name)]
    if SELECTIONS[name]:
        args += ["-k", SELECTIONS[name]]
    run = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout, run.stdout[-1000:]
