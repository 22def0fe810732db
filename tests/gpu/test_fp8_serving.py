"""Quantized checkpoints served on CUDA at their own bytes (models/quant_serve.py): a block-FP8 one through
BlockFP8Linear over kernels/fp8_gemm.py, an AWQ one through Int4Linear over kernels/int4_gemm.py. Their dense
projections keep their quantized weights (a module the config keeps unquantized stays bf16), their greedy tokens
start as those of the same weights dequantized at load, and DFlash on them equals their plain decoding. Runs on
CUDA only."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from test_quantized import _write_fp8, _write_int4  # noqa: E402

from flashdraft import LLM, SamplingParams, settings  # noqa: E402
from flashdraft.models.layers import BlockFP8Linear, Int4Linear, Linear  # noqa: E402

PROMPTS = [[1, 5, 9, 14, 20], [1, 7, 7, 30], [1, 11, 3]]


@pytest.fixture(scope="module")
def fp8(tiny_llama, tmp_path_factory):
    return _write_fp8(tiny_llama, tmp_path_factory.mktemp("fp8-gpu") / "model")


def test_fp8_weights_are_served_by_the_kernel(fp8, drafter, monkeypatch):
    model, ref = fp8
    monkeypatch.setattr(settings, "FP8_GEMM", True)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    llm = LLM(str(model), draft=None, device="cuda", dtype="bfloat16")
    net = llm.engine.runner.model
    assert isinstance(net.layers[0].self_attn.qkv_proj, BlockFP8Linear)
    assert isinstance(net.layers[1].mlp.down_proj, BlockFP8Linear)
    assert type(net.layers[0].mlp.down_proj) is Linear  # (modules_to_not_convert)
    assert net.layers[0].self_attn.qkv_proj.weight.dtype == torch.uint8
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    want = [o.token_ids for o in LLM(str(ref), draft=None, device="cuda", dtype="bfloat16").generate(PROMPTS, params)]
    # (not the same roundings: the kernel scales its float32 partial sums, the reference rounds each dequantized
    # weight to bf16; on the H200 the third prompt parted at its 16th token)
    assert [g[:8] for g in got] == [w[:8] for w in want]
    spec = LLM(str(model), draft=str(drafter), device="cuda", dtype="bfloat16")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == got
    assert spec.engine.spec_totals()["num_drafts"] > 0
    monkeypatch.setattr(settings, "FP8_GEMM", False)  # dequantized at load instead (the default)
    off = LLM(str(model), draft=None, device="cuda", dtype="bfloat16")
    assert type(off.engine.runner.model.layers[0].self_attn.qkv_proj) is Linear
    assert [o.token_ids for o in off.generate(PROMPTS, params)] == want


def test_awq_weights_are_served_by_the_int4_kernel(tiny_llama, drafter, tmp_path, monkeypatch):
    model, _ = _write_int4(tiny_llama, tmp_path / "awq", "awq")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(model), draft=None, device="cuda", dtype="bfloat16").generate(PROMPTS, params)]
    monkeypatch.setattr(settings, "INT4_GEMM", True)
    llm = LLM(str(model), draft=None, device="cuda", dtype="bfloat16")
    net = llm.engine.runner.model
    assert isinstance(net.layers[0].self_attn.qkv_proj, Int4Linear) and isinstance(net.layers[2].mlp.down_proj,
                                                                                  Int4Linear)
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    # (the kernel rounds each dequantized weight to bf16 as the load path does; the sums' order differs)
    assert [g[:8] for g in got] == [w[:8] for w in want]
    spec = LLM(str(model), draft=str(drafter), device="cuda", dtype="bfloat16")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == got
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_fp8_experts_are_served_by_the_scaled_grouped_kernels(tmp_path, monkeypatch):
    """A block-FP8 Qwen3-MoE: its experts kept in FP8 (FP8Experts through kernels/moe_experts.py's scaled path),
    the greedy tokens of its dequantized weights to begin with, and DFlash on it equal to its plain decoding."""
    from fixtures import build_random_drafter, build_tiny_model

    from flashdraft.models.moe import FP8Experts

    src = build_tiny_model(tmp_path / "src", "qwen3_moe")
    model, _ = _write_fp8(src, tmp_path / "fp8", keep=())
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(model), draft=None, device="cuda", dtype="bfloat16").generate(PROMPTS, params)]
    monkeypatch.setattr(settings, "FP8_GEMM", True)
    llm = LLM(str(model), draft=None, device="cuda", dtype="bfloat16")
    assert type(llm.engine.runner.model.layers[0].mlp.experts) is FP8Experts
    got = [o.token_ids for o in llm.generate(PROMPTS, params)]
    assert [g[:8] for g in got] == [w[:8] for w in want]
    spec = LLM(str(model), draft=str(build_random_drafter(tmp_path / "d", src, block_size=4)), device="cuda",
               dtype="bfloat16")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == got
