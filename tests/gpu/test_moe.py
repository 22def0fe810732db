"""The Triton expert kernels (flashdraft/models/moe_triton.py) against the torch MoE path (itself checked
against transformers in tests/test_families.py): decode-sized and prefill-sized batches, experts hit by
no row, by one, by many; float32 and bf16; Qwen3-MoE's silu and GPT-OSS's biases and clamped SwiGLU.
Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashdraft.models.moe import GptOssMoE, MoE  # noqa: E402
from flashdraft.models.moe_triton import sort_by_expert  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def moe(E=8, k=2, H=96, inter=80, norm=True, dtype=torch.float32, seed=0, family="qwen3_moe"):
    cfg = SimpleNamespace(num_experts=E, num_local_experts=E, num_experts_per_tok=k, norm_topk_prob=norm,
                          moe_intermediate_size=inter, intermediate_size=inter, hidden_size=H, swiglu_alpha=1.702,
                          swiglu_limit=1.5)  # a low limit: the clamps bite at these scales
    torch.manual_seed(seed)
    m = MoE(cfg, torch.nn.functional.silu) if family == "qwen3_moe" else GptOssMoE(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.to(DEVICE, dtype).eval()


def test_sort_by_expert_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[3, 1], [3, 0], [1, 3]], device=DEVICE)
    rows, block_expert = sort_by_expert(ids, 5, block=4)
    rows, block_expert = rows.tolist(), block_expert.tolist()
    assert len(rows) == 4 * len(block_expert) and len(rows) >= 6 + 5 * 3
    slots = [r for r in rows if r >= 0]
    assert sorted(slots) == list(range(6))
    flat = ids.flatten().tolist()
    for b, e in enumerate(block_expert):
        members = [r for r in rows[4 * b: 4 * b + 4] if r >= 0]
        assert all(flat[r] == e for r in members) and (e >= 0 or not members)
    assert [e for e in block_expert if e >= 0] == [0, 1, 3, 3][: len([e for e in block_expert if e >= 0])]


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 8, 2), (16, 6, 3), (70, 8, 2), (5, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_fused_moe_matches_torch(T, E, k, dtype, family):
    m = moe(E=E, k=k, dtype=dtype, seed=T, family=family)
    x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype) * 3
    with torch.inference_mode():
        want = m.forward(x)  # CPU: the experts hit, one by one; CUDA: every expert, weighted
        got = m.forward_fused(x)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    err = (got.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
    assert err < tol, err
