"""Quantized checkpoints kept at their own bytes (models/quant_serve.py, FLASHDRAFT_FP8_GEMM / FLASHDRAFT_INT4_GEMM)
on a CPU, where the quantized layers dequantize at each call: every format's tensors, repacked at load into the
served layout, hold the weights the dequantized-at-load path holds, so the greedy tokens are the same (float32,
bit for bit), plain and with DFlash; what stays unquantized or unswapped (a module the config keeps, tensor
parallelism, the switch off) is as before. The GPU kernels over these layouts: tests/gpu."""

import pytest
import torch
from test_quantized import COMPRESSED, PROMPTS, _write_compressed, _write_fp8, _write_int4

from flashdraft import LLM, SamplingParams, settings
from flashdraft.models.layers import BlockFP8Linear, Int4Linear, Linear

KINDS = ["fp8-block", "fp8-channel", "fp8-tensor", "w4a16-symmetric", "w4a16-zero-points", "awq", "gptq", "gptq_v2"]


def _write(kind, src, dst):
    if kind == "fp8-block":
        return _write_fp8(src, dst)
    if kind in ("awq", "gptq", "gptq_v2"):
        return _write_int4(src, dst, kind[:4], checkpoint_format=kind if kind != "awq" else "gptq")
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor

    fmt, weights, quantize = COMPRESSED[kind]
    compressor = PackedQuantizationCompressor if fmt == "pack-quantized" else FloatQuantizationCompressor
    return _write_compressed(src, dst, fmt, weights, compressor, quantize)


def _switches(monkeypatch, on: bool):
    monkeypatch.setattr(settings, "FP8_GEMM", on)
    monkeypatch.setattr(settings, "INT4_GEMM", on)


@pytest.mark.parametrize("kind", KINDS)
def test_served_layouts_give_the_dequantized_tokens(kind, tiny_llama, drafter, tmp_path, monkeypatch):
    model, _ = _write(kind, tiny_llama, tmp_path / "model")
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    _switches(monkeypatch, False)
    want = [o.token_ids for o in LLM(str(model), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    _switches(monkeypatch, True)
    llm = LLM(str(model), draft=None, device="cpu", dtype="float32")
    layer = llm.engine.runner.model.layers
    served = Int4Linear if kind.startswith(("w4", "awq", "gptq")) else BlockFP8Linear
    for mod in (layer[1].self_attn.qkv_proj, layer[1].self_attn.o_proj, layer[1].mlp.gate_up_proj,
                layer[1].mlp.down_proj):
        assert type(mod) is served
    # (fp8-block keeps layer 0's down_proj unquantized: modules_to_not_convert)
    assert type(layer[0].mlp.down_proj) is (Linear if kind == "fp8-block" else served)
    if served is Int4Linear:
        assert layer[1].mlp.gate_up_proj.qweight.dtype == torch.int32
    else:
        assert layer[1].mlp.gate_up_proj.weight.dtype == torch.uint8
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    spec = LLM(str(model), draft=str(drafter), device="cpu", dtype="float32")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_a_hybrid_s_gated_attention_and_mlp_at_4_bits(tmp_path, monkeypatch):
    """Qwen3.5 (its gated attention's packed query-and-gate, k, v; its MLPs; the GDN projections stay
    dequantized): the served layouts give the dequantized tokens."""
    from fixtures import build_tiny_model

    src = build_tiny_model(tmp_path / "src", "qwen3_5_text")
    model, _ = _write("w4a16-zero-points", src, tmp_path / "model")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    _switches(monkeypatch, False)
    want = [o.token_ids for o in LLM(str(model), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    _switches(monkeypatch, True)
    llm = LLM(str(model), draft=None, device="cpu", dtype="float32")
    net = llm.engine.runner.model
    attn = [m for name, m in net.named_modules() if name.endswith("self_attn.qkv_proj")]
    assert attn and all(type(m) is Int4Linear for m in attn)
    assert not any(isinstance(m, Int4Linear) for name, m in net.named_modules() if "linear_attn" in name)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want


def test_nothing_is_swapped_with_the_switch_off_or_under_tensor_parallelism(tiny_llama, tmp_path, monkeypatch):
    from flashdraft.models.loader import load_config
    from flashdraft.models.quant import scheme_of
    from flashdraft.models.quant_serve import serve_quantized
    from flashdraft.models.transformer import DecoderLM

    model, _ = _write("awq", tiny_llama, tmp_path / "model")
    cfg = load_config(model)
    with torch.device("meta"):
        net = DecoderLM(cfg)
    _switches(monkeypatch, False)
    assert serve_quantized(net, scheme_of(cfg)) is None
    _switches(monkeypatch, True)
    assert serve_quantized(net, scheme_of(cfg), tp=object()) is None
    assert type(net.layers[0].mlp.down_proj) is Linear
    serving = serve_quantized(net, scheme_of(cfg))
    assert serving.takes("model.layers.2.self_attn.k_proj") and serving.takes("model.layers.0.mlp.up_proj")
    assert not serving.takes("lm_head")


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next"])
def test_block_fp8_experts_kept_in_fp8(kind, tmp_path, monkeypatch):
    """A block-FP8 mixture of experts: each layer's experts stacked as FP8Experts (their weights' bits and
    block factors), the shared expert and the attention as BlockFP8Linear; the dequantized tokens, plain
    and with DFlash."""
    from fixtures import build_random_drafter, build_tiny_model

    from flashdraft.models.moe import FP8Experts

    src = build_tiny_model(tmp_path / "src", kind)
    model, _ = _write_fp8(src, tmp_path / "fp8", keep=())
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    _switches(monkeypatch, False)
    want = [o.token_ids for o in LLM(str(model), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    _switches(monkeypatch, True)
    llm = LLM(str(model), draft=None, device="cpu", dtype="float32")
    net = llm.engine.runner.model
    experts = [m for name, m in net.named_modules() if name.endswith("mlp.experts")]
    assert experts and all(type(m) is FP8Experts for m in experts)
    assert experts[0].gate_up_proj.dtype == torch.uint8 and experts[0].down_proj_scale_inv.dtype == torch.int32
    if kind == "qwen3_next":
        assert any(type(m) is BlockFP8Linear for name, m in net.named_modules() if "shared_expert" in name)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    spec = LLM(str(model), draft=str(build_random_drafter(tmp_path / "d", src, block_size=4)), device="cpu",
               dtype="float32")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
