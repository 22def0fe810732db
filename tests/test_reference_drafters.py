"""Published drafters draft exactly as their reference: random checkpoints built by z-lab's own code
(PyPI `dflash==0.1.0`, `dflash/model.py`, installed without its dependencies), one per config field
the reference reads, run by the reference's `dflash_generate` and by flashdraft on the same tiny
Qwen3 target in float32; the drafts fed to the target at every verify step must be equal, and so
must the outputs. The same checkpoints converted to the speculators layout must draft the same."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

ref = pytest.importorskip("dflash.model")

from fixtures import build_tiny_model  # noqa: E402

from flashdraft import LLM, SamplingParams  # noqa: E402

TARGET_LAYERS = 6
BLOCK = 4
PROMPTS = [[5, 17, 33, 80, 41, 9, 120, 77], [7, 8] * 6 + [200], list(range(40, 71))]
MAX_NEW = 40


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("ref-target"), "qwen3", num_hidden_layers=TARGET_LAYERS)


def zlab_config(target_dir: Path, num_layers: int = 2, **fields):
    """A z-lab DFlash drafter config for the target; `fields` go to the top level, except those given
    as dflash_config={...}."""
    from transformers import Qwen3Config

    t = json.loads((target_dir / "config.json").read_text())
    dflash_config = {"mask_token_id": 3, "target_layer_ids": [1, 4], "block_size": BLOCK}
    dflash_config.update(fields.pop("dflash_config", {}))
    base = dict(vocab_size=t["vocab_size"], hidden_size=t["hidden_size"], intermediate_size=96,
                num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_target_layers=TARGET_LAYERS, architectures=["DFlashDraftModel"], dflash_config=dflash_config)
    base.update(fields)
    return Qwen3Config(**base)


def build_reference_drafter(folder: Path, config, dflash2: bool = False, seed: int = 0) -> Path:
    """Random weights through the reference's own classes, saved with save_pretrained."""
    torch.manual_seed(seed)
    cls = ref.DFlash2DraftModel if dflash2 else ref.DFlashDraftModel
    model = cls(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("base_kernel"):
                p.copy_(torch.randn_like(p) * 0.3 + (torch.arange(p.shape[1])[None, :, None] == 0))
            elif p.dim() == 2:
                p.normal_(0, 0.15)
            else:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    model.save_pretrained(folder)
    if dflash2:  # published z-lab files store the selector's codebooks bare (the reference maps them back)
        from safetensors.torch import load_file, save_file

        w = load_file(str(folder / "model.safetensors"))
        save_file({k.removesuffix(".weight") if "_codebook." in k else k: v for k, v in w.items()},
                  str(folder / "model.safetensors"))
    return folder


def reference_run(target_dir: Path, drafter_dir: Path, prompt: list[int], dflash2: bool = False):
    """The reference's generate loop, greedy: (output ids, the drafts of every full verify block)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    cls = ref.DFlash2DraftModel if dflash2 else ref.DFlashDraftModel
    drafter = cls.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    blocks: list[list[int]] = []
    real_forward = hf.forward

    def forward(input_ids=None, **kw):
        if input_ids.shape[1] == drafter.block_size and blocks is not None and kw.get("past_key_values") is not None \
                and kw["past_key_values"].get_seq_length() > 0:
            blocks.append(input_ids[0, 1:].tolist())
        return real_forward(input_ids=input_ids, **kw)

    hf.forward = forward
    out = ref.dflash_generate(drafter, hf, torch.tensor([prompt]), MAX_NEW, stop_token_ids=None)
    return out[0, len(prompt):].tolist(), blocks


def flashdraft_run(target_dir: Path, drafter_dir: Path, monkeypatch) -> tuple[list, list]:
    """flashdraft on the same prompts, greedy, the chain: (outputs, each request's fed drafts by step)."""
    import flashdraft.speculative.dflash as dflash

    fed: dict[int, list[list[int]]] = {}
    real_accept = dflash.accept_plans

    def accept(plans, ids, toks):
        for p in plans:
            if p.verify:
                fed.setdefault(p.seq.seq_id, []).append(ids[p.row + 1: p.row + p.n].tolist())
        return real_accept(plans, ids, toks)

    monkeypatch.setattr(dflash, "accept_plans", accept)
    llm = LLM(str(target_dir), draft=str(drafter_dir), device="cpu", dtype="float32",
              speculative_tree_size=None, speculative_min_acceptance_length=None)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True))
    return [o.token_ids for o in outs], [fed[k] for k in sorted(fed)]


def compare(target_dir: Path, drafter_dir: Path, monkeypatch, dflash2: bool = False) -> None:
    ours, fed = flashdraft_run(target_dir, drafter_dir, monkeypatch)
    for prompt, got, mine in zip(PROMPTS, ours, fed):
        want, blocks = reference_run(target_dir, drafter_dir, prompt, dflash2)
        assert got == want[: len(got)], "outputs differ from the reference's"
        assert len(blocks) >= 5 and len(mine) >= len(blocks)
        same = sum(a == b for a, b in zip(mine, blocks))
        assert same == len(blocks), f"{same}/{len(blocks)} verify blocks equal to the reference's"


VARIANTS = {
    "plain": {},
    "input_embedding_scale": {"dflash_config": {"input_embedding_scale": 8.0}},
    "sliding_layers": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5,
                       "use_sliding_window": True},
    "is_causal": {"is_causal": True},
    "gelu": {"hidden_act": "gelu"},
    "top_level_taps": {"dflash_config": {"target_layer_ids": None}, "target_layer_ids": [0, 3]},
    "default_taps": {"dflash_config": {"target_layer_ids": None}},
    "last_layer_tap": {"dflash_config": {"target_layer_ids": [2, TARGET_LAYERS - 1]}},
    "attention_bias": {"attention_bias": True},
    "llama3_rope": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 64}},
    "yarn_rope": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 64}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_zlab_drafter_drafts_as_the_reference(target, tmp_path, monkeypatch, variant):
    fields = json.loads(json.dumps(VARIANTS[variant]))
    cfg = zlab_config(target, **fields)
    if cfg.dflash_config.get("target_layer_ids") is None:
        cfg.dflash_config.pop("target_layer_ids")
    drafter = build_reference_drafter(tmp_path / "d", cfg)
    compare(target, drafter, monkeypatch)


DFLASH2 = {"architectures": ["DFlash2DraftModel"],
           "dflash_config": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}}
DFLASH2_VARIANTS = {
    "dflash2": {},
    "dflash2_kernel3_sliding_scaled": {
        "dflash_config": {"conv_kernel_size": 3, "output_multiplier": 2.0, "final_logit_softcapping": 3.0,
                          "input_embedding_scale": 2.0},
        "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 6, "use_sliding_window": True},
}


def dflash2_fields(variant: str) -> dict:
    fields = json.loads(json.dumps(DFLASH2_VARIANTS[variant]))
    extra = fields.pop("dflash_config", {})
    return {**fields, "architectures": DFLASH2["architectures"],
            "dflash_config": {**DFLASH2["dflash_config"], **extra}}


@pytest.mark.parametrize("variant", list(DFLASH2_VARIANTS))
def test_zlab_dflash2_drafts_as_the_reference(target, tmp_path, monkeypatch, variant):
    """DFlash2: the convolutions around every sublayer and the candidate selector's slot-by-slot choice
    (with the logits' multiplier and soft cap feeding the selector's unary scores)."""
    drafter = build_reference_drafter(tmp_path / "d", zlab_config(target, **dflash2_fields(variant)), dflash2=True)
    compare(target, drafter, monkeypatch, dflash2=True)


def test_draft_logits_are_the_references(target, tmp_path):
    """output_multiplier and final_logit_softcapping leave the argmax alone but set the distribution sampled
    drafts are drawn from: the logits flashdraft draws with are the reference's compute_logits."""
    from transformers import AutoModelForCausalLM

    cfg = zlab_config(target, dflash_config={"output_multiplier": 3.0, "final_logit_softcapping": 2.5})
    folder = build_reference_drafter(tmp_path / "d", cfg)
    llm = LLM(str(target), draft=str(folder), device="cpu", dtype="float32")
    sp = llm.engine.spec
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    drafter = ref.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)
    rows = torch.randn(7, cfg.hidden_size)
    want = drafter.compute_logits(rows, hf.lm_head)
    got, token_ids = sp.drafts.slot_logits(rows, float32=True)
    assert token_ids is None and (got - want).abs().max() < 1e-5
    assert want.abs().max() <= 2.5 and not torch.allclose(want, hf.lm_head(rows))


def to_speculators(zlab: Path, out: Path, kind: str = "dflash") -> Path:
    """The layout speculators' converter writes for a z-lab checkpoint: the Qwen3 fields become
    transformer_layer_config (DFlash fields at its top level stay there), tap ids + 1, the same weights."""
    import shutil

    data = json.loads((zlab / "config.json").read_text())
    dcfg = data.get("dflash_config", {})
    tlc = {k: v for k, v in data.items() if k not in ("architectures", "auto_map", "block_size", "dflash_config",
                                                      "num_target_layers")}
    cfg = {"speculators_model_type": kind, "architectures": ["DFlashSpeculator"], "transformer_layer_config": tlc,
           "draft_vocab_size": data["vocab_size"], "block_size": dcfg.get("block_size", data.get("block_size")),
           "aux_hidden_state_layer_ids": [i + 1 for i in dcfg["target_layer_ids"]],
           "mask_token_id": dcfg["mask_token_id"], "sliding_window_non_causal": False,
           "target_hidden_size": data["hidden_size"]}
    if kind == "dflash2":
        cfg |= {k: dcfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(cfg))
    shutil.copy(zlab / "model.safetensors", out / "model.safetensors")
    return out


@pytest.mark.parametrize("variant", ["plain", "sliding_layers", "sliding_non_causal", "gelu", "attention_bias",
                                     "yarn_rope", "dflash2"])
def test_speculators_conversion_drafts_as_the_reference(target, tmp_path, monkeypatch, variant):
    """The same checkpoints in the speculators layout (converted as its converter converts them) draft
    what the reference drafts from the z-lab original. sliding_non_causal: bidirectional sliding layers,
    `is_causal: false` for the reference, `sliding_window_non_causal: true` in the speculators layout."""
    dflash2 = variant == "dflash2"
    if variant == "sliding_non_causal":
        fields = {**VARIANTS["sliding_layers"], "is_causal": False}
    else:
        fields = dflash2_fields(variant) if dflash2 else json.loads(json.dumps(VARIANTS[variant]))
    zlab = build_reference_drafter(tmp_path / "z", zlab_config(target, **fields), dflash2=dflash2)
    spec = to_speculators(zlab, tmp_path / "s", "dflash2" if dflash2 else "dflash")
    if variant == "sliding_non_causal":
        cfg = json.loads((spec / "config.json").read_text())
        del cfg["transformer_layer_config"]["is_causal"]
        cfg["sliding_window_non_causal"] = True
        (spec / "config.json").write_text(json.dumps(cfg))
    ours, fed = flashdraft_run(target, spec, monkeypatch)
    for prompt, got, mine in zip(PROMPTS, ours, fed):
        want, blocks = reference_run(target, zlab, prompt, dflash2)
        assert got == want[: len(got)]
        assert mine[: len(blocks)] == blocks
