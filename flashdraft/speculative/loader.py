"""Loading a DFlash drafter for a target: its config read (speculative/formats.py), checked against
the target (hidden size, tap layers, mask token, vocabulary; errors name the mismatch), its weights
loaded, and the speculator that runs it built."""

from __future__ import annotations

from pathlib import Path

import torch

from flashdraft import settings
from flashdraft.engine.pipeline import StepContext
from flashdraft.hub import local_path
from flashdraft.models.checks import safetensors_header
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.models.loader import dummy_weights, load_weights
from flashdraft.speculative.dflash import DFlashSpeculator
from flashdraft.speculative.formats import DraftSpec, read_draft_spec


def checked_spec(folder: Path, target_config) -> DraftSpec:
    """The drafter's config.json read and checked against its target's config, and its safetensors headers
    against their files (no weights are read, so the engine runs this before the target loads too); errors
    name the mismatch."""
    if not folder.is_dir():
        raise ValueError(f"drafter path {str(folder)!r} must be a folder with config.json and safetensors")
    n_target = target_config.num_hidden_layers
    spec = read_draft_spec(folder, n_target)
    h_draft, h_target = spec.layer_config.hidden_size, target_config.hidden_size
    if h_draft != h_target:
        raise ValueError(f"drafter hidden_size {h_draft} does not match the target's {h_target}")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"drafter tap layer id(s) {bad} outside the target's {n_target} layers")
    if spec.fmt == "speculators" and n_target - 1 in spec.target_layer_ids:
        raise ValueError(f"aux_hidden_state_layer_ids {n_target} (the residual stream after the target's last "
                         "layer) is not a state vLLM or flashdraft taps; z-lab ids read the final-normed one")
    if not 0 <= spec.mask_token_id < target_config.vocab_size:
        raise ValueError(f"drafter mask_token_id {spec.mask_token_id} is outside the target vocabulary "
                         f"[0, {target_config.vocab_size})")
    if spec.selector is not None and spec.layer_config.vocab_size != target_config.vocab_size:
        raise ValueError(f"DFlash2 drafter vocab_size {spec.layer_config.vocab_size} differs from the target's "
                         f"{target_config.vocab_size}: its selector's codebooks index target tokens")
    if (folder / "mask_embedding.pt").exists():
        raise ValueError(f"{folder}/mask_embedding.pt replaces the mask token's embedding, which flashdraft "
                         "does not support")
    for f in sorted(folder.glob("*.safetensors")):
        safetensors_header(f)
    return spec


def load_drafter(folder: str | Path, target_config, device: torch.device, dtype: torch.dtype,
                 load_format: str = "auto", revision: str | None = None) -> DFlashDraftModel:
    """Load and validate a drafter (a folder or a hub id at `revision`) against its target; errors name the
    mismatch."""
    folder = local_path(folder, revision, "drafter", weights=load_format != "dummy")
    spec = checked_spec(folder, target_config)
    spec.layer_config.vocab_size = target_config.vocab_size
    weights = load_weights(folder) if load_format != "dummy" else {}
    domino = sorted(k for k in weights if k.startswith(("prefix_gru.", "embed_proj.", "domino_head.")))
    if domino:
        raise ValueError(f"{folder} is a Domino drafter ({domino[0]}, ...), which flashdraft does not support")
    has_embed = "embed_tokens.weight" in weights
    has_head = "lm_head.weight" in weights
    if spec.draft_vocab_size and not has_head:
        raise ValueError(f"drafter declares draft_vocab_size {spec.draft_vocab_size} but ships no lm_head")
    if spec.draft_vocab_size and "d2t" not in weights:
        raise ValueError(f"drafter declares draft_vocab_size {spec.draft_vocab_size} but ships no d2t map from "
                         "its vocabulary to the target's")
    if has_embed and weights["embed_tokens.weight"].shape[0] != target_config.vocab_size:
        raise ValueError("drafter embed_tokens rows do not match the target vocabulary")
    with torch.device("meta"):
        model = DFlashDraftModel(spec, has_embed, has_head)
    model = model.to_empty(device=device).to(dtype)
    if model.d2t is not None:
        model.d2t = torch.zeros_like(model.d2t, dtype=torch.long)
    if load_format == "dummy":  # random layers; embedding and head shared with the target
        dummy_weights(model)
    else:
        model.load(weights)
    return model.eval().requires_grad_(False)


def load_speculator(draft: str | Path, ctx: StepContext) -> DFlashSpeculator:
    runner, config = ctx.runner, ctx.config
    model = load_drafter(draft, runner.model.config, runner.device, runner.dtype, config.load_format,
                         config.draft_revision)
    return DFlashSpeculator(model, ctx, settings.DRAW_SAMPLED)
