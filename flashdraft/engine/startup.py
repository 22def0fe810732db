"""What the engine checks before it loads weights, and what it says once it is ready."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from flashdraft.config import EngineConfig

if TYPE_CHECKING:
    from flashdraft.engine.engine import LLMEngine

log = logging.getLogger("flashdraft")


def check_drafter(draft: str, config: EngineConfig) -> None:
    """The drafter's folder and config.json, checked against the target's config.json before any weights
    load, so that a bad `draft` fails in seconds rather than after a large target has loaded. The same
    checks and messages as speculative/loader.py load_drafter, which repeats them beside the weights."""
    from flashdraft.hub import local_path
    from flashdraft.models.hybrid import text_config
    from flashdraft.models.loader import load_config, resolve_model_dir
    from flashdraft.speculative.formats import read_draft_spec

    folder = local_path(draft, config.draft_revision, "drafter", weights=False)
    if not folder.is_dir():
        raise ValueError(f"drafter path {str(folder)!r} must be a folder with config.json and safetensors")
    target = text_config(load_config(resolve_model_dir(config.model, config.revision, weights=False)))
    n_target = target.num_hidden_layers
    spec = read_draft_spec(folder, n_target)
    h_draft, h_target = spec.layer_config.hidden_size, target.hidden_size
    if h_draft != h_target:
        raise ValueError(f"drafter hidden_size {h_draft} does not match the target's {h_target}")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"drafter tap layer id(s) {bad} outside the target's {n_target} layers")
    if spec.fmt == "speculators" and n_target - 1 in spec.target_layer_ids:
        raise ValueError(f"aux_hidden_state_layer_ids {n_target} (the residual stream after the target's last "
                         "layer) is not a state vLLM or flashdraft taps; z-lab ids read the final-normed one")
    if not 0 <= spec.mask_token_id < target.vocab_size:
        raise ValueError(f"drafter mask_token_id {spec.mask_token_id} is outside the target vocabulary "
                         f"[0, {target.vocab_size})")
    if spec.selector is not None and spec.layer_config.vocab_size != target.vocab_size:
        raise ValueError(f"DFlash2 drafter vocab_size {spec.layer_config.vocab_size} differs from the target's "
                         f"{target.vocab_size}: its selector's codebooks index target tokens")
    if (folder / "mask_embedding.pt").exists():
        raise ValueError(f"{folder}/mask_embedding.pt replaces the mask token's embedding, which flashdraft "
                         "does not support")


def log_ready(engine: LLMEngine, draft: str | None) -> None:
    """One INFO line of what was loaded and how much fits, as a server log's first word on the engine."""
    config, runner = engine.config, engine.runner
    if config.gpu_memory_utilization is not None and engine.device.type != "cuda":
        log.info("gpu_memory_utilization %s is ignored on %s: the KV cache takes kv_cache_memory_gb (default 2 GiB)",
                 config.gpu_memory_utilization, engine.device.type)
    target = config.model if config.model is not None else "the embedded SmolLM2-135M-Instruct"
    spec = engine.spec
    if spec is None:
        drafter = "no drafter"
    else:
        shape = f"tree of {spec.tree_size}" if spec.tree_size else f"chain of {spec.num_draft}"
        drafter = (f"drafter {draft} ({spec.drafter.spec.kind}, block {spec.block_size}, taps "
                   f"{list(spec.tap_layers)}, {shape} drafts per verify)")
    pages, size = runner.k_cache.shape[1], runner.block_size
    gib = (runner.k_cache.nbytes + runner.v_cache.nbytes) / 2**30
    log.info("engine ready: target %s (%s), %s on %s; %s; KV cache %d pages x %d tokens = %.2f GiB, %d sequences "
             "of max_model_len %d; CUDA graphs %s", target, engine.model_config.model_type,
             str(engine.dtype).removeprefix("torch."), engine.device, drafter, pages, size, gib,
             pages * size // engine.max_model_len, engine.max_model_len, "on" if runner.use_graphs else "off")
