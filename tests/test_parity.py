"""Model parity against HF transformers (float32): prefill logits, then step-by-step decode over
the paged cache, on tiny random Llama (llama3 rope scaling) and Qwen3 configs."""

from __future__ import annotations

import pytest
import torch
from fixtures import engine_logits, hf_model

from flashdraft import LLM, SamplingParams


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3"])
def test_logits_match_hf(kind, request):
    folder = request.getfixturevalue(kind)
    llm = LLM(str(folder), draft=None, device="cpu", dtype="float32", kv_block_size=4)
    ref_model = hf_model(folder)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, llm.engine.vocab_size, (40,), generator=gen).tolist()
    ours = engine_logits(llm, ids, prefill=23)
    with torch.no_grad():
        ref = ref_model(torch.tensor([ids])).logits[0].float()
    rel = (ours - ref).abs().max() / ref.abs().max()
    assert rel < 1e-4, f"max relative error {rel:.2e}"
    # a second prompt through the same (now dirty, reshuffled) cache
    ids2 = torch.randint(3, llm.engine.vocab_size, (70,), generator=gen).tolist()
    ours2 = engine_logits(llm, ids2, prefill=5)
    with torch.no_grad():
        ref2 = ref_model(torch.tensor([ids2])).logits[0].float()
    assert (ours2 - ref2).abs().max() / ref2.abs().max() < 1e-4


def test_llama3_rope_scaling_is_active(tiny_llama):
    from flashdraft.models.loader import load_config
    from flashdraft.models.rope import inv_freq_and_scale

    cfg = load_config(tiny_llama)
    inv, _ = inv_freq_and_scale(cfg, 16)
    plain = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(inv, plain), "llama3 scaling should change the low frequencies"


@pytest.mark.parametrize("kind", ["tiny_llama", "tiny_qwen3"])
def test_greedy_generate_matches_hf(kind, request):
    folder = request.getfixturevalue(kind)
    llm = LLM(str(folder), draft=None, device="cpu", dtype="float32")
    ref_model = hf_model(folder)
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    for p, o in zip(prompts, outs):
        x = torch.tensor([p])
        ref = ref_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=24, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert o.token_ids == ref[0, len(p):].tolist()
