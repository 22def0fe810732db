"""kv_cache_dtype="fp8" (vLLM's): the target's and the drafter's KV pages in float8 e4m3 (values saturated at
+-448; divided by the checkpoint's per-layer k_scale / v_scale where it has them), read back widened by the
CPU reference attention (the Triton kernels: tests/gpu). DFlash with FP8 pages gives the tokens of plain
decoding with FP8 pages (chains and trees, greedy and seeded, batched); the same memory holds four times the
float32 pages; the scaled pages give HF transformers' logits over fake-quantized keys and values; other fp8
kinds and bad scales are refused by name."""

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


def test_fp8_pages_on_every_device_and_other_kinds_refused():
    assert EngineConfig(kv_cache_dtype="fp8").resolved_kv_dtype(torch.device("cuda"), torch.bfloat16) == \
        torch.float8_e4m3fn
    with pytest.raises(ValueError, match="kv_cache_dtype 'fp8_e5m2' is not supported"):
        EngineConfig(kv_cache_dtype="fp8_e5m2")
    assert EngineConfig().resolved_kv_dtype(torch.device("cpu"), torch.float32) == torch.float32


# per layer (k_scale, v_scale), not powers of two, as the float32 values a checkpoint holds
SCALES = {i: tuple(torch.tensor(s).item() for s in kv) for i, kv in enumerate([(0.37, 0.61), (1.9, 0.23), (0.55, 2.7)])}


def _with_scales(tiny_llama, folder, old_names: bool = False, extra=None):
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_llama, folder)
    weights = load_file(folder / "model.safetensors")
    for i, (ks, vs) in SCALES.items():
        pre = f"model.layers.{i}.self_attn."
        names = (pre + "k_proj.output_scale", pre + "v_proj.output_scale") if old_names else \
            (pre + "k_scale", pre + "v_scale")
        weights[names[0]], weights[names[1]] = torch.tensor([ks]), torch.tensor(vs)
        weights[pre + "q_scale"] = torch.tensor(3.0)  # (queries are not quantized: skipped)
    weights.update(extra or {})
    save_file(weights, folder / "model.safetensors")
    return folder


@pytest.fixture(scope="module")
def scaled(tiny_llama, tmp_path_factory):
    return _with_scales(tiny_llama, tmp_path_factory.mktemp("kv-scales") / "m")


class FakeQuantCache:
    """An HF cache whose stored keys and values are those of FP8 pages with per-layer scales: fp8(k / s) * s."""

    def __new__(cls, scales):
        from transformers import DynamicCache

        class Cache(DynamicCache):
            def update(self, k, v, layer_idx, *args, **kwargs):
                ks, vs = scales.get(layer_idx, (1.0, 1.0))
                return super().update(to_pages(k / ks, torch.float8_e4m3fn).float() * ks,
                                      to_pages(v / vs, torch.float8_e4m3fn).float() * vs, layer_idx, *args, **kwargs)
        return Cache()


@pytest.mark.parametrize("old_names", [False, True], ids=["k_scale", "output_scale"])
def test_checkpoint_scales_give_hf_logits_over_fake_quantized_keys_and_values(tiny_llama, tmp_path, old_names):
    """The engine's logits with FP8 pages and the checkpoint's scales (prefill, then one token a step, pages
    shuffled) against HF transformers whose cache holds fp8(k / k_scale) * k_scale and the same of v, float32.
    Without the scales (all 1) the engine's logits part from that reference."""
    from fixtures import engine_logits, hf_model

    folder = _with_scales(tiny_llama, tmp_path / "m", old_names)
    llm = LLM(str(folder), draft=None, device="cpu", dtype="float32", kv_block_size=4, kv_cache_dtype="fp8")
    attn = [layer.self_attn for layer in llm.engine.runner.model.layers]
    assert [a.kv_scale for a in attn] == [SCALES[i] for i in range(3)]
    ids = torch.randint(3, llm.engine.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = engine_logits(llm, ids, prefill=23)
    with torch.no_grad():
        ref = hf_model(tiny_llama)(torch.tensor([ids]), past_key_values=FakeQuantCache(SCALES)).logits[0].float()
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-4
    for a in attn:
        a.kv_scale = (1.0, 1.0)
    unscaled = engine_logits(llm, ids, prefill=23)
    assert (unscaled - ref).abs().max() / ref.abs().max() > 1e-3


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_dflash_with_scaled_fp8_pages_equals_plain_decoding_with_them(scaled, drafter, monkeypatch, tree):
    from flashdraft import settings

    monkeypatch.setattr(settings, "CPU_TREE", tree)
    params = [SamplingParams(max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=1.0, seed=5)]
    plain = LLM(str(scaled), draft=None, device="cpu", dtype="float32", kv_cache_dtype="fp8")
    spec = LLM(str(scaled), draft=str(drafter), device="cpu", dtype="float32", kv_cache_dtype="fp8")
    want = [o.token_ids for o in plain.generate(PROMPTS[:2], params)]
    assert [o.token_ids for o in spec.generate(PROMPTS[:2], params)] == want
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_checkpoint_scales_with_the_model_s_own_pages_change_nothing(scaled, plain):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    llm = LLM(str(scaled), draft=None, device="cpu", dtype="float32")
    assert all(layer.self_attn.kv_scale == (1.0, 1.0) for layer in llm.engine.runner.model.layers)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == \
        [o.token_ids for o in plain.generate(PROMPTS, params)]


@pytest.mark.parametrize("extra,match", [
    ({"model.layers.0.self_attn.k_scale": torch.tensor([0.5, 0.5])}, "has 2 values: only one scale a layer"),
    ({"model.layers.1.self_attn.v_scale": torch.tensor(-1.0)}, "is -1.0: a KV-cache scale must be positive"),
    ({"model.layers.7.self_attn.k_scale": torch.tensor(0.5)}, "the model has no attention layer 'layers.7"),
])
def test_bad_checkpoint_scales_are_refused_by_name(tiny_llama, tmp_path, extra, match):
    folder = _with_scales(tiny_llama, tmp_path / "m", extra=extra)
    with pytest.raises(ValueError, match=match):
        LLM(str(folder), draft=None, device="cpu", dtype="float32", kv_cache_dtype="fp8")
