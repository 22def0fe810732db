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


def _dequantized_then_served(model, monkeypatch, max_tokens=16):
    """(the tokens of `model` dequantized at load, the model loaded with its quantized layers kept, params)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    _switches(monkeypatch, False)
    want = [o.token_ids for o in LLM(str(model), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    _switches(monkeypatch, True)
    return want, LLM(str(model), draft=None, device="cpu", dtype="float32"), params


@pytest.mark.parametrize("kind", KINDS)
def test_served_layouts_give_the_dequantized_tokens(kind, tiny_llama, drafter, tmp_path, monkeypatch):
    model, _ = _write(kind, tiny_llama, tmp_path / "model")
    want, llm, params = _dequantized_then_served(model, monkeypatch, max_tokens=20)
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
    want, llm, params = _dequantized_then_served(model, monkeypatch)
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
    want, llm, params = _dequantized_then_served(model, monkeypatch)
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


def _write_q4_gguf(folder, path):
    """The tiny Llama folder as a GGUF file whose projections are Q4_0 (attention) and Q4_1 (MLP), as gguf's
    quantizer writes them, but layer 0's q_proj in float32 (its packed qkv then stays dequantized)."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file
    from test_families import GGUF_TOP, gguf_close, gguf_writer

    w, cfg = gguf_writer(folder, path, "llama")
    w.add_name("tiny")
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

    def permute(a, heads):
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    for key, t in load_file(str(folder / "model.safetensors")).items():
        a = t.float().numpy()
        if key in GGUF_TOP:
            w.add_tensor(GGUF_TOP[key], a)
            continue
        _, _, layer, rest = key.split(".", 3)
        stem, _, kind = rest.rpartition(".")
        if stem in ("self_attn.q_proj", "self_attn.k_proj"):
            a = permute(a, cfg["num_attention_heads" if stem.endswith("q_proj") else "num_key_value_heads"])
        name = f"blk.{layer}.{names[stem]}.{kind}"
        if kind != "weight" or "norm" in stem or (layer == "0" and stem == "self_attn.q_proj"):
            w.add_tensor(name, np.ascontiguousarray(a))
            continue
        qtype = gguf.GGMLQuantizationType.Q4_0 if stem.startswith("self_attn") else gguf.GGMLQuantizationType.Q4_1
        w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(a), qtype), raw_dtype=qtype)
    gguf_close(w)


def test_gguf_4_bit_projections_kept_at_4_bits(tiny_llama, drafter, tmp_path, monkeypatch):
    """With FLASHDRAFT_INT4_GEMM a GGUF file's Q4_0 / Q4_1 projections are cached at 4 bits (gguf_int4.py, a
    folder of their own) and Int4Linear keeps them: transformers' tokens for the file (its own dequantization),
    plain and with DFlash; that folder dequantized at load gives them too; a packed module with a part in
    another type stays dequantized. Without the switch the folder is the dequantized one, as before."""
    import json

    from test_families import NEW, hf_greedy
    from transformers import AutoModelForCausalLM

    from flashdraft.models.gguf_convert import convert_gguf

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny-q4.gguf"
    _write_q4_gguf(tiny_llama, path)
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    with torch.no_grad():
        want = [hf_greedy(ref, p) for p in PROMPTS]
    _switches(monkeypatch, True)
    llm = LLM(str(path), draft=None, device="cpu", dtype="float32", quantization="gguf")
    layers = llm.engine.runner.model.layers
    assert type(layers[0].self_attn.qkv_proj) is Linear and type(layers[1].self_attn.qkv_proj) is Int4Linear
    assert type(layers[0].mlp.gate_up_proj) is Int4Linear and layers[0].mlp.gate_up_proj.offsets is not None
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == want
    spec = LLM(str(path), draft=str(drafter), device="cpu", dtype="float32")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    four_bit = convert_gguf(path)
    cfg = json.loads((four_bit / "config.json").read_text())["quantization_config"]
    assert four_bit.name.endswith("-q4") and cfg["quant_method"] == "gguf"
    assert "layers.0.self_attn.q_proj" not in cfg["modules"] and "layers.1.self_attn.q_proj" in cfg["modules"]
    _switches(monkeypatch, False)
    assert [o.token_ids for o in LLM(str(four_bit), draft=None, device="cpu", dtype="float32").generate(
        PROMPTS, params)] == want
    plain = convert_gguf(path)
    assert plain != four_bit and "quantization_config" not in json.loads((plain / "config.json").read_text())


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K"])
def test_gguf_4_bit_blocks_read_as_gguf_dequantizes_them(kind):
    """gguf_int4.q4_layout's values, scales, zeros and offsets give gguf's own dequantization bit for bit
    (float32): Q4_0 / Q4_1 from gguf's quantizer, Q4_K from random bytes (its 6-bit sub-block scales and
    minimums included; gguf has no Q4_K quantizer for these shapes)."""
    import gguf
    import numpy as np

    from flashdraft.models.gguf_int4 import q4_layout

    rng = np.random.default_rng(0)
    rows, cols = 6, 512
    qtype = getattr(gguf.GGMLQuantizationType, kind)
    if kind == "Q4_K":
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        n = rows * cols // block
        data = rng.integers(0, 256, (n, size), dtype=np.uint8)
        for at in (0, 2):  # d and dmin: small positive fp16
            data[:, at:at + 2] = (rng.random(n) * 0.01).astype(np.float16).view(np.uint8).reshape(n, 2)
        data = data.reshape(rows, -1)
    else:
        data = gguf.quants.quantize(rng.standard_normal((rows, cols)).astype(np.float32), qtype)
    want = torch.from_numpy(gguf.quants.dequantize(data, qtype).reshape(rows, cols).astype(np.float32))
    t = q4_layout(data, kind, rows, cols)
    idx = torch.arange(cols) // 32
    got = (t["values"] - t["zeros"][:, idx]).float() * t["scales"][:, idx] + t["offsets"][:, idx]
    assert torch.equal(got, want)


def test_a_plain_weight_where_the_config_quantizes_the_module_is_named(tiny_llama, tmp_path, monkeypatch):
    from safetensors.torch import load_file, save_file

    model, _ = _write("awq", tiny_llama, tmp_path / "model")
    weights = load_file(model / "model.safetensors")
    for part in ("qweight", "qzeros", "scales", "g_idx"):
        weights.pop(f"model.layers.1.mlp.down_proj.{part}", None)
    weights["model.layers.1.mlp.down_proj.weight"] = torch.zeros(64, 96)
    save_file(weights, model / "model.safetensors")
    _switches(monkeypatch, True)
    with pytest.raises(ValueError, match=r"model.layers.1.mlp.down_proj.weight is a plain torch.float32 weight, but "
                                         r"the config quantizes model.layers.1.mlp.down_proj \(.*qweight"):
        LLM(str(model), draft=None, device="cpu", dtype="float32")
