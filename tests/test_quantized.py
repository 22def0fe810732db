"""Quantized checkpoints (models/quant.py), served dequantized: a tiny model written in the format's own
layout gives the greedy tokens of an independent float64 dequantization of the same weights, loaded as a
plain checkpoint; DFlash on it equals plain decoding; what the reader does not know is refused by name."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from flashdraft import LLM, SamplingParams

BLOCK = [16, 32]  # (rows, columns) of a block: unequal, so a transposed scale shows
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
           "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "out_proj")  # (and GDN's projections)


PROMPTS = [[1, 5, 9, 14, 20], [1, 7, 7, 30]]


def _same_tokens(model, ref, draft, max_tokens=20):
    """The quantized checkpoint `model` gives the greedy tokens of its dequantization `ref`, plain and with
    DFlash (drafter folder `draft`)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(ref), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    assert [o.token_ids for o in LLM(str(model), draft=None, device="cpu", dtype="float32").generate(
        PROMPTS, params)] == want
    spec = LLM(str(model), draft=str(draft), device="cpu", dtype="float32")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    return spec


def _write_fp8(src, dst, keep=("model.layers.0.mlp.down_proj",)):
    """src's checkpoint in HF's fine-grained FP8 layout (each block's amax to 448, the factor stored as
    weight_scale_inv), but the modules in `keep`; and the float64 dequantization of the same weights, as a
    plain float32 checkpoint, in dst / "reference"."""
    shutil.copytree(src, dst)
    ref = dst / "reference"
    shutil.copytree(src, ref)
    weights = load_file(src / "model.safetensors")
    quant, plain = {}, {}
    bn, bk = BLOCK
    for name, w in weights.items():
        if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS) or name.removesuffix(".weight") in keep:
            quant[name] = plain[name] = w
            continue
        n, k = w.shape
        blocks = torch.nn.functional.pad(w.double(), (0, -k % bk, 0, -n % bn)).view(-(-n // bn), bn, -(-k // bk), bk)
        scale = blocks.abs().amax(dim=(1, 3)) / 448.0
        full = scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        q = (w.double() / full).to(torch.float8_e4m3fn)
        quant[name], quant[name + "_scale_inv"] = q, scale.float()
        plain[name] = (q.double() * scale.float().double().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
                       ).float()
    save_file(quant, dst / "model.safetensors")
    save_file(plain, ref / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                                  "weight_block_size": BLOCK, "modules_to_not_convert": list(keep)}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref


@pytest.fixture(scope="module")
def fp8(tiny_llama, tmp_path_factory):
    return _write_fp8(tiny_llama, tmp_path_factory.mktemp("fp8") / "model")


def test_block_fp8_gives_its_dequantized_tokens(fp8, drafter):
    model, ref = fp8
    spec = _same_tokens(model, ref, drafter, max_tokens=24)
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_the_dequantization_is_not_a_no_op(fp8, tiny_llama):
    """The quantized model's tokens differ from the unquantized original somewhere (else the test above
    would pass reading the FP8 weights as anything close enough)."""
    model, ref = fp8
    a = load_file(ref / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    b = load_file(tiny_llama / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.1 * b.abs().max()


@pytest.mark.parametrize("change, match", [
    (dict(quant_method="hqq"), "quant_method 'hqq' is not supported"),
    (dict(activation_scheme="static"), "activation_scheme 'static' is not supported"),
    (dict(fmt="e5m2"), "fmt 'e5m2' is not supported"),
    (dict(weight_block_size=[128]), "weight_block_size must be two positive integers"),
    (dict(some_new_field=1), "field\\(s\\) some_new_field of quant_method 'fp8' are not supported"),
])
def test_what_the_reader_does_not_know_is_refused(fp8, tmp_path, change, match):
    model, _ = fp8
    bad = tmp_path / "bad"
    shutil.copytree(model, bad, ignore=shutil.ignore_patterns("reference"))
    cfg = json.loads((bad / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(bad), draft=None, device="cpu", dtype="float32")


@pytest.mark.parametrize("drop", ["model.layers.1.self_attn.k_proj.weight_scale_inv",
                                  "model.layers.1.self_attn.k_proj.weight"])
def test_a_missing_half_is_named(fp8, tmp_path, drop):
    model, _ = fp8
    bad = tmp_path / "bad"
    shutil.copytree(model, bad, ignore=shutil.ignore_patterns("reference"))
    weights = load_file(bad / "model.safetensors")
    del weights[drop]
    save_file(weights, bad / "model.safetensors")
    with pytest.raises(ValueError, match="model.layers.1.self_attn.k_proj.weight"):
        LLM(str(bad), draft=None, device="cpu", dtype="float32")


def _write_compressed(src, dst, fmt, weights, compressor, quantize):
    """src's checkpoint in compressed-tensors' layout, every linear layer quantized by `quantize` (scale,
    zero point) and compressed by the library's own compressor; the library's decompression of the same
    tensors as a plain float32 checkpoint in dst / "reference"."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    shutil.copytree(src, dst)
    ref = dst / "reference"
    shutil.copytree(src, ref)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    quant, plain = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS):
            quant[name] = plain[name] = w
            continue
        state = {"weight": w, **quantize(w)}
        packed = compressor.compress(state, scheme)
        module = name.removesuffix(".weight")
        quant.update({f"{module}.{k}": v.contiguous() for k, v in packed.items()})
        plain[name] = compressor.decompress(packed, scheme)["weight"].float()
    save_file(quant, dst / "model.safetensors")
    save_file(plain, ref / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": fmt, "ignore": ["lm_head"],
                                  "quantization_status": "compressed",
                                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                "input_activations": None}}}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref


def _int_groups(group, symmetric):
    def quantize(w):
        g = w.view(w.shape[0], -1, group)
        if symmetric:
            return {"weight_scale": g.abs().amax(-1) / 7.0}
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo) / 15.0
        return {"weight_scale": scale, "weight_zero_point": torch.round(-8 - lo / scale).clamp(-8, 7).to(torch.int8)}
    return quantize


def _fp8_channels(strategy):
    def quantize(w):
        amax = w.abs().amax(-1, keepdim=True) if strategy == "channel" else w.abs().amax().reshape(1)
        return {"weight_scale": amax / 448.0}
    return quantize


COMPRESSED = {
    "w4a16-symmetric": ("pack-quantized", dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                               group_size=16), _int_groups(16, True)),
    "w4a16-zero-points": ("pack-quantized", dict(num_bits=4, type="int", symmetric=False, strategy="group",
                                                 group_size=16), _int_groups(16, False)),
    "fp8-channel": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
                    _fp8_channels("channel")),
    "fp8-tensor": ("float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor"),
                   _fp8_channels("tensor")),
}


@pytest.mark.parametrize("kind", list(COMPRESSED))
def test_compressed_tensors_give_the_library_s_dequantized_tokens(kind, tiny_llama, drafter, tmp_path):
    """Each compressed-tensors layout, written by the library's own compressor, gives the greedy tokens of
    the library's decompression loaded as a plain checkpoint; DFlash on it equals them too."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import FloatQuantizationCompressor, PackedQuantizationCompressor

    fmt, weights, quantize = COMPRESSED[kind]
    compressor = PackedQuantizationCompressor if fmt == "pack-quantized" else FloatQuantizationCompressor
    model, ref = _write_compressed(tiny_llama, tmp_path / "model", fmt, weights, compressor, quantize)
    _same_tokens(model, ref, drafter)


def test_unpacking_matches_the_library():
    """unpack_int32 against compressed-tensors' unpack at 2..8 bits, ragged counts (values split across
    int32 words at 3, 5, 6, 7 bits)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    from flashdraft.models.quant import unpack_int32

    gen = torch.Generator().manual_seed(0)
    for bits in range(2, 9):
        q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (5, 77), generator=gen, dtype=torch.int8)
        packed = pack_to_int32(q, bits)
        assert torch.equal(unpack_int32(packed, bits, 77), q.int())
        assert torch.equal(unpack_from_int32(packed, bits, q.shape).int(), q.int())


@pytest.mark.parametrize("change, match", [
    (dict(format="marlin-24"), "format 'marlin-24' is not supported"),
    (dict(sparsity_config={"format": "sparse-24"}), "sparsity_config is not supported"),
    (dict(extra_field=1), "extra_field of compressed-tensors are not supported"),
    (dict(config_groups={"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group",
                                                                  "group_size": 16},
                               "input_activations": {"num_bits": 8, "type": "int", "dynamic": False}}}),
     "input_activations static quantization is not supported"),
    (dict(config_groups={"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
                                                                  "strategy": "group", "group_size": 16,
                                                                  "actorder": "group"}}}),
     "actorder 'group' is not supported"),
])
def test_compressed_tensors_fields_it_does_not_know_are_refused(tiny_llama, tmp_path, change, match):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import PackedQuantizationCompressor

    fmt, weights, quantize = COMPRESSED["w4a16-symmetric"]
    model, _ = _write_compressed(tiny_llama, tmp_path / "model", fmt, weights, PackedQuantizationCompressor, quantize)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(model), draft=None, device="cpu", dtype="float32")


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # (the AutoAWQ packer's column order within a word)


def _pack_cols(vals, order=tuple(range(8))):
    """[R, 8C] values 0..15 -> [R, C] int32, nibble i of word c holding column 8c + order[i]."""
    v = vals.to(torch.int64).view(vals.shape[0], -1, 8)
    word = sum(v[:, :, order[i]] << (4 * i) for i in range(8))
    return (word - ((word >> 31) << 32)).to(torch.int32).contiguous()  # (as a signed int32)


def _pack_rows(vals):
    """[8R, C] values 0..15 -> [R, C] int32, nibble i of word r holding row 8r + i."""
    return _pack_cols(vals.t().contiguous()).t().contiguous()


def _write_int4(src, dst, method, group=16, checkpoint_format="gptq"):
    """src's checkpoint in AutoAWQ's GEMM or GPTQ's layout (asymmetric 4-bit, groups of `group` inputs,
    fp16 scales), packed here from the format's description; the float64 dequantization as a plain
    float32 checkpoint in dst / "reference"."""
    shutil.copytree(src, dst)
    ref = dst / "reference"
    shutil.copytree(src, ref)
    quant, plain = {}, {}
    for name, w in load_file(src / "model.safetensors").items():
        if not (name.endswith(".weight") and name.split(".")[-2] in LINEARS):
            quant[name] = plain[name] = w
            continue
        wt = w.t().double()  # [K, N]
        K, N = wt.shape
        g = wt.view(K // group, group, N)
        lo, hi = g.amin(1), g.amax(1)
        scale = ((hi - lo) / 15).half()
        z = torch.round(-lo / scale.double()).clamp(0, 15)
        idx = torch.arange(K) // group
        q = (torch.round(wt / scale.double()[idx]) + z[idx]).clamp(0, 15)
        plain[name] = ((q - z[idx]) * scale.double()[idx]).t().float().contiguous()
        module = name.removesuffix(".weight")
        quant[f"{module}.scales"] = scale
        if method == "awq":
            quant[f"{module}.qweight"], quant[f"{module}.qzeros"] = _pack_cols(q, AWQ_ORDER), _pack_cols(z, AWQ_ORDER)
        else:
            stored = z - 1 if checkpoint_format == "gptq" else z
            quant[f"{module}.qweight"], quant[f"{module}.qzeros"] = _pack_rows(q), _pack_cols(stored)
            quant[f"{module}.g_idx"] = idx.to(torch.int32)
    save_file(quant, dst / "model.safetensors")
    save_file(plain, ref / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = ({"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                   "version": "gemm"} if method == "awq" else
                                  {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                   "sym": False, "checkpoint_format": checkpoint_format, "damp_percent": 0.01})
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst, ref


@pytest.mark.parametrize("method, fmt", [("awq", None), ("gptq", "gptq"), ("gptq", "gptq_v2")])
def test_awq_and_gptq_give_their_dequantized_tokens(method, fmt, tiny_llama, drafter, tmp_path):
    model, ref = _write_int4(tiny_llama, tmp_path / "model", method, checkpoint_format=fmt or "gptq")
    _same_tokens(model, ref, drafter)


@pytest.mark.parametrize("method, change, match", [
    ("gptq", dict(desc_act=True), "desc_act"),
    ("gptq", dict(bits=3), "bits 3 is not supported"),
    ("gptq", dict(checkpoint_format="marlin"), "checkpoint_format 'marlin' is not supported"),
    ("awq", dict(version="gemv"), "AWQ version 'gemv' is not supported"),
    ("awq", dict(brand_new=True), "brand_new of quant_method 'awq' are not supported"),
])
def test_int4_fields_it_does_not_know_are_refused(tiny_llama, tmp_path, method, change, match):
    model, _ = _write_int4(tiny_llama, tmp_path / "model", method)
    cfg = json.loads((model / "config.json").read_text())
    cfg["quantization_config"].update(change)
    (model / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=match):
        LLM(str(model), draft=None, device="cpu", dtype="float32")


def test_vllm_s_quantization_flag_is_checked_against_the_checkpoint(fp8, tiny_llama):
    """--quantization (vLLM's): the checkpoint's own method (or vLLM's kernel name for it) loads; another,
    or a method given for an unquantized checkpoint (quantizing at load), is refused by name."""
    from flashdraft.cli import build_parser

    model, _ = fp8
    LLM(str(model), draft=None, device="cpu", dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match="'awq_marlin' does not match the checkpoint's quant_method 'fp8'"):
        LLM(str(model), draft=None, device="cpu", dtype="float32", quantization="awq_marlin")
    with pytest.raises(ValueError, match="the checkpoint is not quantized"):
        LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", quantization="fp8")
    with pytest.raises(ValueError, match="quantization 'bitsandbytes' is not supported"):
        LLM(str(model), draft=None, device="cpu", dtype="float32", quantization="bitsandbytes")
    args = build_parser().parse_args(["generate", "hi", "--quantization", "gptq_marlin"])
    assert args.quantization == "gptq_marlin"


@pytest.mark.parametrize("kind", ["qwen3_moe", "qwen3_next"])
def test_block_fp8_of_experts_and_hybrid_projections(kind, tmp_path):
    """Block FP8 where every family keeps its weights: a MoE's experts (stacked at load) and a hybrid
    target's GDN projections and shared expert; the tokens of the float64 dequantization, plain and with
    DFlash."""
    from fixtures import build_random_drafter, build_tiny_model

    src = build_tiny_model(tmp_path / "src", kind)
    model, ref = _write_fp8(src, tmp_path / "fp8", keep=())
    weights = load_file(model / "model.safetensors")
    quantized = [n for n, w in weights.items() if w.dtype == torch.float8_e4m3fn]
    assert any(".experts." in n for n in quantized)
    if kind == "qwen3_next":
        assert any("in_proj_qkvz" in n for n in quantized) and any("shared_expert." in n for n in quantized)
    draft = build_random_drafter(tmp_path / "draft", src, block_size=4)
    _same_tokens(model, ref, draft, max_tokens=16)
