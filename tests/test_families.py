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
    "qwen3-next": ("qwen3_next", dict()),
    "qwen3.5": ("qwen3_5_text", dict()),
    "qwen3.5-moe": ("qwen3_5_moe_text", dict()),
    "qwen3.5-composite": ("qwen3_5", dict()),
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
                                  "gpt-oss", "qwen3-next", "qwen3.5"])
def test_dflash_on_new_targets(built, tmp_path, name):
    """A random drafter, oracle drafts (every draft right: tau = B) and preemption under a tight KV cache
    all give plain decoding's tokens on targets whose layers slide, route to experts or carry recurrent
    state; token trees asked for fall back to the chain on sliding and hybrid targets."""
    folder = built(name)
    plain = LLM(str(folder), draft=None, device="cpu", dtype="float32")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    drafter = build_random_drafter(tmp_path / "d", folder, block_size=4)
    spec = LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32",
               speculative_tree_size=3 if "sliding" in name or name.startswith(("gpt-oss", "qwen3-next", "qwen3.5"))
               else None)
    assert spec.engine.spec.tree_size is None  # asked for on sliding and hybrid targets, which verify chains
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
    with pytest.raises(ValueError, match="quant_method 'fp8' without weight_block_size"):
        LLM(str(quant), draft=None, device="cpu", dtype="float32")


def gguf_writer(folder, path, arch: str):
    """A GGUFWriter for the tiny model in `folder` with the fields every family's file has (sizes, heads,
    norm epsilon, rope base) and its byte-level BPE tokenizer, as llama.cpp's converter writes them;
    returns (writer, the folder's config)."""
    import json

    import gguf
    from transformers import AutoTokenizer

    cfg = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"])
    tok = AutoTokenizer.from_pretrained(folder)
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t, _ in vocab])
    merges = json.loads((folder / "tokenizer.json").read_text())["model"]["merges"]
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    return w, cfg


GGUF_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
            "lm_head.weight": "output.weight"}


def gguf_close(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_qwen3_moe_gguf(folder, path, renorm: bool) -> None:
    """A GGUF file of the tiny Qwen3-MoE folder, laid out as llama.cpp's converter writes one: float32
    tensors under GGUF names, each layer's experts stacked [E, I, H], the byte-level BPE tokenizer."""
    import numpy as np
    from safetensors.torch import load_file

    w, cfg = gguf_writer(folder, path, "qwen3moe")
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    if not renorm:
        w.add_expert_weights_norm(False)
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}
    experts: dict[tuple, dict[int, object]] = {}
    for name, t in load_file(str(folder / "model.safetensors")).items():
        t = t.float().numpy()
        if name in GGUF_TOP:
            w.add_tensor(GGUF_TOP[name], t)
        elif ".mlp.experts." in name:  # transformers writes one tensor per expert
            parts = name.split(".")
            experts.setdefault((parts[2], parts[6]), {})[int(parts[5])] = t
        else:
            _, _, layer, rest = name.split(".", 3)
            stem, _, kind = rest.rpartition(".")
            w.add_tensor(f"blk.{layer}.{names[stem]}.{kind}", t)
    gguf_proj = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}
    for (layer, proj), per in experts.items():
        w.add_tensor(f"blk.{layer}.{gguf_proj[proj]}.weight", np.stack([per[e] for e in range(len(per))]))
    gguf_close(w)


@pytest.mark.parametrize("renorm", [True, False])
def test_qwen3_moe_gguf(tmp_path, monkeypatch, renorm):
    """A Qwen3-MoE GGUF file (experts stacked, expert width and top-k renormalisation in GGUF fields)
    gives the tokens transformers gives for the folder it was written from."""
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / "hf", "qwen3_moe", norm_topk_prob=renorm, moe_intermediate_size=24)
    path = tmp_path / "tiny-moe.gguf"
    write_qwen3_moe_gguf(folder, path, renorm)
    ref = hf_model(folder)
    llm = LLM(str(path), draft=None, device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p) for p in PROMPTS]


def write_gpt_oss_gguf(folder, path, mxfp4: bool, fused: bool, extra: dict | None = None) -> None:
    """A GGUF file of the tiny GPT-OSS folder, laid out as llama.cpp's converter writes one: attention
    biases and sinks (`attn_sinks.weight`), the router with its bias, the interleaved gate_up experts
    split into `ffn_gate_exps` / `ffn_up_exps` [E, I, H] with their biases (or, fused, one
    `ffn_gate_up_exps` of gate rows then up rows), down [E, H, I]; yarn rope and the window as GGUF
    fields. mxfp4: the expert weights in GGML's MXFP4 (gguf's own quantizer), and the folder's experts
    replaced by what those blocks decode to, so that the folder stays the reference. extra: more float
    fields."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    w, cfg = gguf_writer(folder, path, "gpt-oss")
    rope = cfg["rope_parameters"]
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_sliding_window(cfg["sliding_window"])
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rope["factor"])
    w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    for key, value in (extra or {}).items():
        w.add_float32(key, value)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "post_attention_norm", "mlp.router": "ffn_gate_inp"}

    def experts(name, t):  # float32 [E, rows, in] as GGUF stores it (MXFP4 over `in`); the decoded values
        if not mxfp4:
            w.add_tensor(name, t)
            return t
        q = gguf.quants.quantize(t, gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        return gguf.quants.dequantize(q, gguf.GGMLQuantizationType.MXFP4).reshape(t.shape)

    weights = load_file(str(folder / "model.safetensors"))
    for name, t in list(weights.items()):
        a = t.float().numpy()
        if name in GGUF_TOP:
            w.add_tensor(GGUF_TOP[name], a)
        elif name.endswith("self_attn.sinks"):
            w.add_tensor(f"blk.{name.split('.')[2]}.attn_sinks.weight", a)
        elif name.endswith("experts.gate_up_proj"):  # [E, H, 2I], gate at even columns
            blk = f"blk.{name.split('.')[2]}"
            gate, up = a.transpose(0, 2, 1)[:, 0::2], a.transpose(0, 2, 1)[:, 1::2]
            if fused:
                both = experts(f"{blk}.ffn_gate_up_exps.weight", np.ascontiguousarray(np.concatenate([gate, up], 1)))
                gate, up = both[:, :gate.shape[1]], both[:, gate.shape[1]:]
            else:
                gate = experts(f"{blk}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
                up = experts(f"{blk}.ffn_up_exps.weight", np.ascontiguousarray(up))
            inter = np.empty_like(a.transpose(0, 2, 1))
            inter[:, 0::2], inter[:, 1::2] = gate, up
            weights[name] = torch.from_numpy(inter.transpose(0, 2, 1).copy()).to(t.dtype)
        elif name.endswith("experts.gate_up_proj_bias"):
            blk = f"blk.{name.split('.')[2]}"
            if fused:
                w.add_tensor(f"{blk}.ffn_gate_up_exps.bias", np.concatenate([a[:, 0::2], a[:, 1::2]], 1))
            else:
                w.add_tensor(f"{blk}.ffn_gate_exps.bias", np.ascontiguousarray(a[:, 0::2]))
                w.add_tensor(f"{blk}.ffn_up_exps.bias", np.ascontiguousarray(a[:, 1::2]))
        elif name.endswith("experts.down_proj"):  # [E, I, H]
            down = experts(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", np.ascontiguousarray(a.transpose(0, 2, 1)))
            weights[name] = torch.from_numpy(down.transpose(0, 2, 1).copy()).to(t.dtype)
        elif name.endswith("experts.down_proj_bias"):
            w.add_tensor(f"blk.{name.split('.')[2]}.ffn_down_exps.bias", a)
        else:
            _, _, layer, rest = name.split(".", 3)
            stem, _, kind = rest.rpartition(".")
            w.add_tensor(f"blk.{layer}.{names[stem]}.{kind}", a)
    gguf_close(w)
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("mxfp4,fused", [(False, False), (True, False), (True, True)])
def test_gpt_oss_gguf(tmp_path, monkeypatch, mxfp4, fused):
    """A GPT-OSS GGUF file (sinks, biases, router bias, split or fused gate/up experts, in float32 or
    MXFP4, yarn rope and the window in GGUF fields) gives the tokens transformers gives for the folder
    it was written from; the converted folder is an HF GPT-OSS checkpoint (transformers loads it)."""
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / "hf", "gpt_oss", hidden_size=64, intermediate_size=64, head_dim=32)
    path = tmp_path / "tiny-oss.gguf"
    write_gpt_oss_gguf(folder, path, mxfp4, fused)
    ref = hf_model(folder)
    want = [hf_greedy(ref, p) for p in PROMPTS]
    llm = LLM(str(path), draft=None, device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == want
    converted = next((tmp_path / "cache" / "gguf").iterdir())
    assert [hf_greedy(hf_model(converted), p) for p in PROMPTS[:1]] == want[:1]


def test_gpt_oss_gguf_refuses_rope_fields_it_does_not_read(tmp_path, monkeypatch):
    """A gpt-oss rope-scaling field the reader does not map would change the rotary tables: refused by
    name, not ignored."""
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / "hf", "gpt_oss")
    path = tmp_path / "ext.gguf"
    write_gpt_oss_gguf(folder, path, False, False, extra={"gpt-oss.rope.scaling.yarn_ext_factor": 0.5})
    with pytest.raises(ValueError, match="rope scaling field.*yarn_ext_factor"):
        LLM(str(path), draft=None, device="cpu", dtype="float32")


def write_llama_gguf(folder, path, name: str, arch: str = "llama") -> None:
    """A GGUF file of a tiny Llama-layout folder as llama.cpp writes Mistral models: architecture `llama`,
    general.name naming the model, q and k rows permuted for its rotary layout, no window field; or
    as it writes Qwen2 models (`qwen2`: q/k/v biases, rows as they are)."""
    import numpy as np
    from safetensors.torch import load_file

    w, cfg = gguf_writer(folder, path, arch)
    w.add_name(name)
    w.add_rope_dimension_count(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}

    def permute(a, heads):  # llama.cpp's converter: each head's rotary halves interleaved
        return a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)

    for key, t in load_file(str(folder / "model.safetensors")).items():
        a = t.float().numpy()
        if key in GGUF_TOP:
            w.add_tensor(GGUF_TOP[key], a)
        else:
            _, _, layer, rest = key.split(".", 3)
            stem, _, kind = rest.rpartition(".")
            if arch == "llama" and stem == "self_attn.q_proj":
                a = permute(a, cfg["num_attention_heads"])
            elif arch == "llama" and stem == "self_attn.k_proj":
                a = permute(a, cfg["num_key_value_heads"])
            w.add_tensor(f"blk.{layer}.{names[stem]}.{kind}", np.ascontiguousarray(a))
    gguf_close(w)


@pytest.mark.parametrize("name", ["Mistral 7B Instruct v0.3", "mistral"])
def test_mistral_gguf(tmp_path, monkeypatch, name):
    """A Mistral model in GGUF (llama.cpp writes it as `llama`, naming it) gives transformers' tokens for
    its folder, without a window: the format has no window field and llama.cpp attends to every key.
    transformers reads a file named exactly "mistral" as Mistral, whose config would otherwise default
    to a 4,096-key window."""
    import json

    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / "hf", "mistral", sliding_window=None)
    path = tmp_path / "tiny-mistral.gguf"
    write_llama_gguf(folder, path, name)
    ref = hf_model(folder)
    llm = LLM(str(path), draft=None, device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p) for p in PROMPTS]
    cfg = json.loads((next((tmp_path / "cache" / "gguf").iterdir()) / "config.json").read_text())
    assert cfg["model_type"] == ("mistral" if name == "mistral" else "llama") and cfg.get("sliding_window") is None


def test_qwen2_gguf(tmp_path, monkeypatch):
    """A Qwen2 GGUF file (q/k/v biases) gives the tokens transformers gives for its folder."""
    monkeypatch.setenv("FLASHDRAFT_CACHE", str(tmp_path / "cache"))
    folder = build_tiny_model(tmp_path / "hf", "qwen2")
    path = tmp_path / "tiny-qwen2.gguf"
    write_llama_gguf(folder, path, "Qwen2.5 Tiny", arch="qwen2")
    ref = hf_model(folder)
    llm = LLM(str(path), draft=None, device="cpu", dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == [hf_greedy(ref, p) for p in PROMPTS]


HYBRIDS = ["qwen3-next", "qwen3.5", "qwen3.5-moe", "qwen3.5-composite"]


@pytest.mark.parametrize("name", HYBRIDS)
def test_hybrid_dflash_one_at_a_time_sampled_and_stopped_mid_block(built, tmp_path, name):
    """Hybrid targets under DFlash, one request at a time and batched, sampled (seeded) and with stop
    tokens that end requests inside a verified block: plain decoding's tokens every time."""
    folder = built(name)
    plain = LLM(str(folder), draft=None, device="cpu", dtype="float32")
    drafter = build_random_drafter(tmp_path / "d", folder, block_size=4)
    spec = LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32")
    sampled = SamplingParams(max_tokens=NEW, temperature=0.8, seed=3, ignore_eos=True)
    greedy = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(PROMPTS, greedy)]
    stops = [w[5] for w in want]  # a token each output reaches mid-way
    for params in (sampled, SamplingParams(max_tokens=NEW, stop_token_ids=stops)):
        batched = [o.token_ids for o in plain.generate(PROMPTS, params)]
        assert [o.token_ids for o in spec.generate(PROMPTS, params)] == batched
        assert [spec.generate([p], params)[0].token_ids for p in PROMPTS] == batched


@pytest.mark.parametrize("name", HYBRIDS)
def test_rejected_rows_leave_no_state_behind(built, tmp_path, name, monkeypatch):
    """The verify's rejected rows must not reach the recurrent state: with every row committed to the
    state instead (the bug the rollback exists to prevent), the same drafts give other tokens."""
    folder = built(name)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(folder), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    drafter = build_random_drafter(tmp_path / "d", folder, block_size=4)
    spec = LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32")
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] == want
    totals = spec.engine.spec_totals()
    assert totals["num_accepted_tokens"] < totals["num_draft_tokens"]  # drafts were rejected
    runner = spec.engine.runner
    build = runner.build_batch
    monkeypatch.setattr(runner, "build_batch", lambda *a, keep=None, **k: build(*a, **k))  # state advanced by all
    monkeypatch.setattr(runner, "commit_states", lambda *a: None)
    assert [o.token_ids for o in spec.generate(PROMPTS, params)] != want


def test_hybrid_state_slots_in_the_memory_plan(built, caplog):
    """Each running sequence of a hybrid target holds a state slot: when the slots of max_num_seqs
    sequences would take more than half the memory budget, fewer run at once, the engine says why,
    and the outputs are those of an unconstrained engine."""
    import logging

    from flashdraft.engine.memory import state_bytes_per_seq

    folder = built("qwen3.5")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(folder), draft=None, device="cpu", dtype="float32").generate(PROMPTS, params)]
    plain = LLM(str(folder), draft=None, device="cpu", dtype="float32", num_kv_blocks=64)
    per = state_bytes_per_seq(plain.engine.runner.model, torch.float32)
    with caplog.at_level(logging.WARNING):
        small = LLM(str(folder), draft=None, device="cpu", dtype="float32", num_kv_blocks=64,
                    kv_cache_memory_gb=5 * per / 2**30)
    assert small.engine.config.max_num_seqs == 2
    assert "max_num_seqs lowered from 64 to 2" in caplog.text
    assert [o.token_ids for o in small.generate(PROMPTS, params)] == want
    with pytest.raises(ValueError, match="recurrent state"):
        LLM(str(folder), draft=None, device="cpu", dtype="float32", kv_cache_memory_gb=per / 2**30)


def test_hybrid_memory_plan_reserves_the_kept_verify_rows(built):
    """On CUDA, a hybrid target's verify graphs keep each row's projections and conv outputs for the commit
    (RecurrentState.kept_rows): with a drafter the KV plan leaves room for the largest batch bucket at
    VERIFY_ROWS rows a sequence, as many bytes a row as kept_rows allocates."""
    from flashdraft.config import EngineConfig
    from flashdraft.engine.memory import VERIFY_ROWS, kv_bytes_per_token, plan_num_blocks

    model = LLM(str(built("qwen3.5")), draft=None, device="cpu", dtype="float32").engine.runner.model
    n, allocated = 5, 0
    with torch.no_grad():
        for i in model.recurrent_layers():
            gdn = model.layers[i].linear_attn
            kept = gdn.make_state(1, torch.device("cpu"), torch.float32).kept_rows(
                gdn.in_proj(torch.zeros(n, model.config.hidden_size)), gdn.conv_dim)
            allocated += sum(t.numel() * t.element_size() for t in kept)
    assert model.kept_bytes_per_row(torch.float32) * n == allocated
    per_block = kv_bytes_per_token(model, torch.float32) * 16
    blocks = {draft: plan_num_blocks(EngineConfig(draft=draft, kv_cache_memory_gb=0.5, max_num_seqs=6),
                                     model, torch.device("cuda"), torch.float32, 10**7)
              for draft in (None, "a/drafter")}
    reserved = 8 * VERIFY_ROWS * model.kept_bytes_per_row(torch.float32)  # bucket of 6 sequences: 8
    assert abs((blocks[None] - blocks["a/drafter"]) * per_block - reserved) < per_block


def test_training_features_of_a_hybrid_target(built):
    """train-drafter's target features on a hybrid target: a padded batch's taps equal each sequence's
    own (the padding reaches no recurrent state)."""
    from flashdraft.train.features import target_features

    model = hf_model(built("qwen3.5"))
    a, b = list(range(5, 25)), list(range(40, 50))
    taps, _ = target_features(model, torch.tensor([a, b + [0] * 10]), torch.tensor([20, 10]), [1, 3], None, False)
    for row, ids in enumerate((a, b)):
        alone, _ = target_features(model, torch.tensor([ids]), torch.tensor([len(ids)]), [1, 3], None, False)
        torch.testing.assert_close(taps[row, : len(ids)], alone[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "gpt_oss", "qwen3_next"])
def test_dummy_weights_from_config_alone(tmp_path, kind):
    """load_format="dummy" (vLLM's name): a target and drafter folder with config.json (and tokenizer)
    but no weights run on random weights, uniform in +-1e-3, target and drafter alike; without it the
    missing weights are an error; an unknown load_format is refused by name."""
    target = build_tiny_model(tmp_path / "t", kind)
    drafter = build_random_drafter(tmp_path / "d", target, block_size=4)
    for f in [*target.glob("*.safetensors"), *drafter.glob("*.safetensors")]:
        f.unlink()
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        LLM(str(target), draft=None, device="cpu")
    with pytest.raises(ValueError, match="load_format 'random'"):
        LLM(str(target), draft=None, device="cpu", load_format="random")
    llm = LLM(str(target), draft=str(drafter), device="cpu", load_format="dummy")
    out = llm.generate([[5, 6, 7], [9] * 5], SamplingParams(max_tokens=6, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [6, 6]
    for net in (llm.engine.runner.model, llm.engine.spec.drafter):
        values = torch.cat([p.flatten() for p in net.parameters()])
        assert values.abs().max() <= 1e-3 and values.std() > 1e-4
