"""What the engine checks before it loads weights, and what it says once it is ready."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any

from flashdraft.config import EngineConfig
from flashdraft.hub import local_path
from flashdraft.models.hybrid import text_config
from flashdraft.models.loader import default_model_path, load_config, resolve_model_dir
from flashdraft.speculative.loader import checked_spec

log = logging.getLogger("flashdraft")


def shipped_drafter(model: str | None) -> str | None:
    """The drafter this project trained and ships for `model`: only the embedded default has one,
    whether named by None or given as its GGUF file (any path or name of the same file)."""
    path = Path(__file__).resolve().parent.parent / "drafters" / "smollm2-135m-dflash"
    if not (path / "config.json").exists():
        return None
    return str(path) if model is None or _is_default_model(Path(model).expanduser()) else None


def _fingerprint(path) -> tuple[int, bytes]:
    """Size and the first and last MiB: tells the embedded GGUF from others without reading it all."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(1 << 20)
        f.seek(max(0, size - (1 << 20)))
        return size, hashlib.sha256(head + f.read()).digest()


def _is_default_model(path) -> bool:
    if not path.is_file() or path.suffix != ".gguf":
        return False
    try:
        default = default_model_path()
    except FileNotFoundError:
        return False
    return path.stat().st_size == default.stat().st_size and _fingerprint(path) == _fingerprint(default)


def check_drafter(draft: str, config: EngineConfig) -> None:
    """The drafter's folder and config.json, checked against the target's config.json before any weights
    load, so that a bad `draft` fails in seconds rather than after a large target has loaded
    (speculative/loader.py checked_spec, which load_drafter runs again beside the weights)."""
    folder = local_path(draft, config.draft_revision, "drafter", weights=False)
    checked_spec(folder, text_config(load_config(resolve_model_dir(config.model, config.revision, weights=False))))


def log_ready(engine: Any, draft: str | None) -> None:
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
