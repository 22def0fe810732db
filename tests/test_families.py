"""Target families and the config fields that change their math, against HF transformers (float32):
greedy tokens equal transformers' for prompts longer than any sliding window, and DFlash on them
(a random drafter, oracle drafts, preemption) gives plain decoding's tokens. Each catalogue entry is a
field some published config sets; a field flashdraft would read wrongly must fail here."""

from __future__ import annotations

import pytest
import torch
from fixtures import build_random_drafter, build_tiny_model, hf_model

from flashdraft import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12] * 3]
NEW = 24

CATALOGUE = {  # name: (model_type, config fields)
    "llama-gelu": ("llama", dict(hidden_act="gelu")),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "llama-mlp-bias": ("llama", dict(mlp_bias=True)),
    "llama-tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen3-sliding-upper-layers": ("qwen3", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "qwen3-sliding-all-bias": ("qwen3", dict(use_sliding_window=True, sliding_window=5, max_window_layers=0,
                                             attention_bias=True)),
    "qwen2": ("qwen2", dict()),
    "qwen2-sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=6, max_window_layers=1)),
    "mistral-sliding": ("mistral", dict(sliding_window=7)),
    "mistral-full": ("mistral", dict(sliding_window=None)),
    "qwen3-moe": ("qwen3_moe", dict()),
    "qwen3-moe-sparse-step-dense-layer-unnormed": ("qwen3_moe", dict(decoder_sparse_step=2, mlp_only_layers=[2],
                                                                     norm_topk_prob=False, num_experts_per_tok=3)),
}


def hf_greedy(model, prompt: list[int]) -> list[int]:
    x = torch.tensor([prompt])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW, do_sample=False, eos_token_id=None,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            kind, fields = CATALOGUE[name]
            cache[name] = build_tiny_model(tmp_path_factory.mktemp(name), kind, **fields)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CATALOGUE))
def test_greedy_tokens_match_transformers(built, name):
    folder = built(name)
    ref = hf_model(folder)
    llm = LLM(str(folder), draft=None, device="cpu", dtype="float32", kv_block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p) for p in PROMPTS]


def test_the_window_changes_the_tokens(built):
    """The catalogue's sliding windows matter on these prompts: without them transformers decodes other
    tokens (so a window read wrongly cannot pass the test above)."""
    folder = built("mistral-sliding")
    ref = hf_model(folder)
    windowed = [hf_greedy(ref, p) for p in PROMPTS]
    ref.config.sliding_window = None
    for layer in ref.model.layers:
        layer.self_attn.sliding_window = None
    assert [hf_greedy(ref, p) for p in PROMPTS] != windowed


@pytest.mark.parametrize("name", ["qwen3-sliding-upper-layers", "mistral-sliding", "qwen2-sliding", "qwen3-moe"])
def test_dflash_on_new_targets(built, tmp_path, name):
    """A random drafter, oracle drafts (every draft right: tau = B) and preemption under a tight KV cache
    all give plain decoding's tokens on a target whose layers slide; token trees fall back to the chain."""
    folder = built(name)
    plain = LLM(str(folder), draft=None, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    drafter = build_random_drafter(tmp_path / "d", folder, block_size=4)
    spec = LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32",
               speculative_tree_size=3 if "sliding" in name else None)
    assert spec.engine.spec.tree_size is None  # asked for on sliding targets, which verify chains
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.engine.spec_totals()["num_drafts"] > 0
    futures = {tuple(p): w + [0] * 8 for p, w in zip(PROMPTS, want)}
    sp = spec.engine.spec
    sp.propose = lambda seqs: [futures[tuple(s.token_ids[: s.num_prompt_tokens])][s.num_output_tokens:][: 3]
                               for s in seqs]
    outs = spec.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == want
    assert all(o.metrics["acceptance_length"] == 4 for o in outs[:3])  # the last may end mid-block
    del sp.propose
    tight = LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32", num_kv_blocks=12, kv_block_size=8)
    assert [o.token_ids for o in tight.generate(PROMPTS, params)] == want
    assert tight.engine.stats["num_preemptions"] > 0
