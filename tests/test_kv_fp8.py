"""kv_cache_dtype="fp8" (vLLM's): the target's and the drafter's KV pages in float8 e4m3 (scale 1, values
saturated at +-448), read back widened by the CPU reference attention. DFlash with FP8 pages gives the
tokens of plain decoding with FP8 pages (chains and trees, greedy and seeded, batched); the same memory
holds four times the float32 pages; what is not implemented (CUDA, other fp8 kinds) is refused by name."""

import pytest
import torch

from flashdraft import LLM, SamplingParams
from flashdraft.attention.torch_ref import from_pages, to_pages
from flashdraft.config import EngineConfig

PROMPTS = [[1, 5, 9, 14, 20], [1, 7, 7, 30, 2, 8], [1, 11, 3]]


@pytest.fixture(scope="module")
def plain_fp8(tiny_llama):
    return LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", kv_cache_dtype="fp8")


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_dflash_with_fp8_pages_equals_plain_decoding_with_them(tiny_llama, drafter, plain_fp8, monkeypatch, tree):
    from flashdraft import settings

    monkeypatch.setattr(settings, "CPU_TREE", tree)
    spec = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3")
    assert (spec.engine.spec.trees is not None) == tree
    assert spec.engine.runner.k_cache.dtype == torch.float8_e4m3fn
    assert spec.engine.spec.context.k_cache.dtype == torch.float8_e4m3fn
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=5),
              SamplingParams(max_tokens=24, ignore_eos=True)]
    want = [o.token_ids for o in plain_fp8.generate(PROMPTS, params)]
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_fp8_pages_change_the_tokens_and_hold_four_times_as_many(tiny_llama, plain_fp8):
    """Against float32 pages in the same budget: four times the pages; the tokens part somewhere (the
    pages are read as FP8, not as float32)."""
    f32 = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", kv_cache_memory_gb=0.002)
    fp8 = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", kv_cache_memory_gb=0.002,
              kv_cache_dtype="fp8")
    n32, n8 = f32.engine.runner.k_cache.shape[1], fp8.engine.runner.k_cache.shape[1]
    assert 4 * n32 <= n8 < 4 * (n32 + 1), (n32, n8)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    a = [o.token_ids for o in f32.generate(PROMPTS, params)]
    b = [o.token_ids for o in plain_fp8.generate(PROMPTS, params)]
    assert a != b and a[0][:2] == b[0][:2]


def test_stored_values_saturate_and_widen_exactly():
    x = torch.tensor([0.1, -3.3, 500.0, -1e4, 448.0])
    y = to_pages(x, torch.float8_e4m3fn)
    assert y.dtype == torch.float8_e4m3fn and torch.isfinite(y.float()).all()
    assert from_pages(y, torch.float32).tolist()[2:] == [448.0, -448.0, 448.0]
    assert from_pages(y, torch.float32)[1].item() == torch.tensor(-3.3).to(torch.float8_e4m3fn).float().item()


def test_what_is_not_implemented_is_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8' is not supported on CUDA yet"):
        EngineConfig(kv_cache_dtype="fp8").resolved_kv_dtype(torch.device("cuda"), torch.bfloat16)
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert EngineConfig().resolved_kv_dtype(torch.device("cpu"), torch.float32) == torch.float32


def test_a_checkpoint_s_kv_scales(tiny_llama, plain, tmp_path):
    """An FP8-KV checkpoint's k_scale / v_scale: with the model's own KV dtype they change nothing and are
    skipped (vLLM ignores them too), with FP8 pages they would scale them, which is not read yet: refused."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "kv-scales"
    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    for i in range(3):
        weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.5)
        weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(0.25)
    save_file(weights, folder / "model.safetensors")
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    got = LLM(str(folder), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    with pytest.raises(ValueError, match="model.layers.0.self_attn.k_scale: the checkpoint's FP8 KV-cache scales"):
        LLM(str(folder), draft=None, device="cpu", dtype="float32", kv_cache_dtype="fp8")
