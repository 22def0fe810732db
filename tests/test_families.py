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
    "gpt-oss": ("gpt_oss", dict()),
    "gpt-oss-full-attention": ("gpt_oss", dict(layer_types=["full_attention"] * 3, swiglu_limit=1.0)),
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


def test_the_sinks_change_the_tokens(built):
    """GPT-OSS's attention sinks matter on these prompts (a dropped sink cannot pass the tests above)."""
    folder = built("gpt-oss")
    ref = hf_model(folder)
    with_sinks = [hf_greedy(ref, p) for p in PROMPTS]
    with torch.no_grad():
        for layer in ref.model.layers:
            layer.self_attn.sinks.fill_(-1e4)  # a sink of no weight
    assert [hf_greedy(ref, p) for p in PROMPTS] != with_sinks


@pytest.mark.parametrize("name", ["qwen3-sliding-upper-layers", "mistral-sliding", "qwen2-sliding", "qwen3-moe",
                                  "gpt-oss"])
def test_dflash_on_new_targets(built, tmp_path, name):
    """A random drafter, oracle drafts (every draft right: tau = B) and preemption under a tight KV cache
    all give plain decoding's tokens on a target whose layers slide; token trees fall back to the chain."""
    folder = built(name)
    plain = LLM(str(folder), draft=None, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    drafter = build_random_drafter(tmp_path / "d", folder, block_size=4)
    spec = LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32",
               speculative_tree_size=3 if "sliding" in name or name == "gpt-oss" else None)
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


def test_token_trees_on_a_target_with_sinks(built, tmp_path):
    """A GPT-OSS target with no sliding layers verifies token trees: sinks under tree masks."""
    folder = built("gpt-oss-full-attention")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(folder), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    drafter = build_random_drafter(tmp_path / "d", folder, block_size=4)
    spec = LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32", speculative_tree_size=5)
    assert spec.engine.spec.tree_size == 5
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    assert spec.engine.spec_totals()["num_drafts"] > 0


FP4 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_pack(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random MXFP4 codes shaped like HF's expert tensor w [E, in, out] (OCP MX: 32 values of one
    block share a power-of-two scale, biased by 127; two 4-bit codes a byte, the even element in the
    low nibble) -> (blocks [E, out, in/32, 16], scales [E, out, in/32], the values they decode to,
    in w's layout), written from the format's definition."""
    E, n_in, n_out = w.shape
    codes = torch.randint(0, 16, (E, n_out, n_in // 32, 32), generator=gen)
    scales = torch.randint(124, 128, (E, n_out, n_in // 32), generator=gen)
    values = FP4[codes] * torch.exp2(scales.float() - 127)[..., None]
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, scales.to(torch.uint8), values.reshape(E, n_out, n_in).transpose(1, 2).contiguous()


def test_mxfp4_experts_load(tmp_path):
    """A GPT-OSS checkpoint with MXFP4 experts (as published) gives the tokens transformers gives for
    the same weights held in float32."""
    import json

    from safetensors.torch import load_file, save_file

    folder = build_tiny_model(tmp_path / "f32", "gpt_oss", hidden_size=64, intermediate_size=64)
    gen = torch.Generator().manual_seed(0)
    weights = load_file(str(folder / "model.safetensors"))
    packed = {}
    for name in list(weights):
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales, weights[name] = mxfp4_pack(weights[name], gen)
            packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        else:
            packed[name] = weights[name]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    quant = tmp_path / "mxfp4"
    quant.mkdir()
    for f in folder.iterdir():
        if f.name != "model.safetensors":
            (quant / f.name).write_bytes(f.read_bytes())
    save_file(packed, str(quant / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    (quant / "config.json").write_text(json.dumps(cfg))
    ref = hf_model(folder)
    llm = LLM(str(quant), draft=None, device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p) for p in PROMPTS]
    cfg["quantization_config"] = {"quant_method": "fp8"}
    (quant / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="quant_method 'fp8' is not supported"):
        LLM(str(quant), draft=None, device="cpu", dtype="float32")
