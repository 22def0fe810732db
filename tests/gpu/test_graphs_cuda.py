"""StepGraph captured in a real CUDA graph equals the model-runner path, with the static torch
backend and (when importable) the Triton backend; the same check as tests/test_graphs.py, which
runs the graph code eagerly on CPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from test_graphs import check_graph_matches_runner  # noqa: E402

from flashdraft.attention.torch_ref import StaticTorchAttention  # noqa: E402


def _triton():
    pytest.importorskip("triton")
    from flashdraft.attention.triton_paged import TritonAttention

    return TritonAttention()


@pytest.mark.parametrize("backend", ["torch_static", "triton"])
def test_captured_graph_matches_model_runner(backend):
    torch.backends.cuda.matmul.allow_tf32 = False
    attn = StaticTorchAttention() if backend == "torch_static" else _triton()
    check_graph_matches_runner(attn, device="cuda", tol=1e-3)
