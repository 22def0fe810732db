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
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


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
    prompts = [[1, 5, 9, 14, 20], [1, 7, 7, 30]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(ref), draft=None, device="cpu", dtype="float32").generate(prompts, params)]
    got = LLM(str(model), draft=None, device="cpu", dtype="float32").generate(prompts, params)
    assert [o.token_ids for o in got] == want
    spec = LLM(str(model), draft=str(drafter), device="cpu", dtype="float32")
    outs = spec.generate(prompts, params)
    assert [o.token_ids for o in outs] == want and spec.engine.spec_totals()["num_drafts"] > 0


def test_the_dequantization_is_not_a_no_op(fp8, tiny_llama):
    """The quantized model's tokens differ from the unquantized original somewhere (else the test above
    would pass reading the FP8 weights as anything close enough)."""
    model, ref = fp8
    a = load_file(ref / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    b = load_file(tiny_llama / "model.safetensors")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.1 * b.abs().max()


@pytest.mark.parametrize("change, match", [
    (dict(quant_method="awq"), "quant_method 'awq' is not supported"),
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
