"""A block-FP8 checkpoint served on CUDA at its own bytes (models/quant.py serve_quantized, models/layers.py
BlockFP8Linear over kernels/fp8_gemm.py): its dense projections keep their FP8 weights (a module the config
keeps unquantized stays bf16), its greedy tokens start as those of the same weights dequantized at load,
and DFlash on it equals its plain decoding. Runs on CUDA only."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from test_quantized import _write_fp8  # noqa: E402

from flashdraft import LLM, SamplingParams, settings  # noqa: E402
from flashdraft.models.layers import BlockFP8Linear, Linear  # noqa: E402

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
