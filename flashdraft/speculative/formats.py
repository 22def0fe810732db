"""Read a DFlash drafter checkpoint in either published layout and normalise it.

z-lab: a Qwen3 config with architectures ["DFlashDraftModel"], `block_size` (top level, or in
`dflash_config` in newer checkpoints), `num_target_layers`, `dflash_config: {mask_token_id,
target_layer_ids}` (0-based decoder-layer outputs). speculators: `speculators_model_type: "dflash"`,
`transformer_layer_config`, `aux_hidden_state_layer_ids` (HF hidden_states indices = z-lab ids + 1),
`mask_token_id`, `block_size`, `draft_vocab_size`, optionally its own embed_tokens / lm_head and a
`d2t` reduced-vocabulary map."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from flashdraft.models.loader import read_config_json


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's spread: [L//2] for one tap, else round(1 + i*(L-4)/(n-1))."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass
class DraftSpec:
    layer_config: SimpleNamespace  # Qwen3-style fields of the draft layers
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]  # 0-based target decoder layers, concatenated in this order
    draft_vocab_size: int | None  # None: the target's vocabulary
    fmt: str  # "z-lab" or "speculators"


_LAYER_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "rms_norm_eps", "attention_bias", "rope_theta",
               "rope_scaling", "rope_parameters", "max_position_embeddings", "vocab_size")


def _layer_config(d: dict) -> SimpleNamespace:
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
               if not isinstance(d.get(k), int)]
    if missing:
        raise ValueError(f"drafter config lacks {', '.join(missing)}")
    cfg = {k: d.get(k) for k in _LAYER_KEYS}
    cfg["num_key_value_heads"] = cfg["num_key_value_heads"] or cfg["num_attention_heads"]
    cfg["head_dim"] = cfg["head_dim"] or cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["rms_norm_eps"] = cfg["rms_norm_eps"] or 1e-6
    cfg["rope_theta"] = cfg["rope_theta"] or (cfg["rope_parameters"] or {}).get("rope_theta", 10000.0)
    cfg["model_type"] = "qwen3"
    return SimpleNamespace(**cfg)


def read_draft_spec(folder: Path, num_target_layers: int) -> DraftSpec:
    data = read_config_json(folder)
    if data.get("speculators_model_type") == "dflash":
        layer = _layer_config(data.get("transformer_layer_config") or {})
        aux = data.get("aux_hidden_state_layer_ids")
        if not aux:
            raise ValueError(f"{folder}: speculators config lacks aux_hidden_state_layer_ids")
        ids = [int(i) - 1 for i in aux]
        mask = data.get("mask_token_id")
        block = data.get("block_size", 8)
        dvs = data.get("draft_vocab_size")
        fmt = "speculators"
    elif "DFlashDraftModel" in (data.get("architectures") or []) or "dflash_config" in data:
        layer = _layer_config(data)
        dcfg = data.get("dflash_config") or {}
        mask = dcfg.get("mask_token_id", data.get("mask_token_id"))
        block = dcfg.get("block_size", data.get("block_size", 16))
        n_taps = layer.num_hidden_layers
        ids = dcfg.get("target_layer_ids") or default_target_layer_ids(
            data.get("num_target_layers") or num_target_layers, n_taps)
        dvs = None
        fmt = "z-lab"
    else:
        arch = data.get("architectures") or data.get("speculators_model_type") or data.get("model_type")
        raise ValueError(f"unknown drafter architecture {arch!r} in {folder}; expected a z-lab "
                         "DFlashDraftModel config or a speculators config with speculators_model_type 'dflash'")
    if not isinstance(mask, int):
        raise ValueError(f"{folder}: drafter config has no integer mask_token_id")
    if not isinstance(block, int) or block < 2:
        raise ValueError(f"{folder}: block_size must be an integer >= 2, got {block!r}")
    if dvs is not None and dvs == layer.vocab_size:
        dvs = None
    return DraftSpec(layer, block, mask, [int(i) for i in ids], dvs, fmt)
