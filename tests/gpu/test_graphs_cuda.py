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
    from flashdraft.attention.triton_backend import TritonAttention

    return TritonAttention()


@pytest.mark.parametrize("backend", ["torch_static", "triton"])
def test_captured_graph_matches_model_runner(backend):
    torch.backends.cuda.matmul.allow_tf32 = False
    attn = StaticTorchAttention() if backend == "torch_static" else _triton()
    check_graph_matches_runner(attn, device="cuda", tol=1e-3)


def test_host_values_reach_the_gpu_without_waiting_for_queued_work():
    """`torch.tensor(list, device="cuda")` returns only after everything queued on the stream has
    run; the engine's host values (to_device, StepGraph.fill) are staged pinned and copied
    asynchronously, so they return while a kernel still runs and arrive after it, in stream order."""
    from flashdraft.engine.graphs import StepGraph, to_device

    g = StepGraph(lambda g: g.input_ids * 2, num_seqs=4, q_len=2, max_blocks=4, block_size=16, device="cuda")
    values = list(range(8))

    def fill_and_index():
        g.fill(values, values, values, [2, 2, 2, 2], [[0], [1], [2], [3]])
        return to_device(values, torch.long, "cuda")

    fill_and_index()  # the pinned blocks exist after this
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU spin
    idx = fill_and_index()
    still_running = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_running, "host->device staging waited for the queued kernel"
    assert idx.tolist() == values and g.input_ids.tolist() == values and g.meta.slot_mapping[:8].tolist() == values
