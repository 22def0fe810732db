"""Tensor parallelism on two GPUs over NCCL (models/parallel.py): the fused layer path with each rank's
share of the layers gives the whole model's hidden states and logits (tests/test_tensor_parallel.py's
check, on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_two_gpus_equal_the_unsplit_model(kind, tmp_path, tiny_llama, tiny_qwen3):
    from test_tensor_parallel import _worker

    folder = {"llama": tiny_llama, "qwen3": tiny_qwen3}[kind]
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(folder), "nccl"), nprocs=2, join=True)
