"""Read a DFlash drafter checkpoint's config, in any published layout, as its reference reads it.

z-lab (`DFlashDraftModel`, `DFlash2DraftModel`; PyPI `dflash`, `dflash/model.py`): a Qwen3 config,
parsed by transformers' Qwen3Config as the reference does (so `layer_types`, `sliding_window`,
`use_sliding_window` and the rope fields mean what they mean there). DFlash fields are looked up in
`dflash_config` first, then at the top level: `target_layer_ids` (0-based decoder-layer outputs;
the last layer's is the final-normed state, HF's last `hidden_states` entry), `block_size` (16),
`mask_token_id`, `input_embedding_scale` (1), `output_multiplier` (1), `final_logit_softcapping`,
and for DFlash2 `conv_kernel_size`, `conv_group_size`, `selector_rank`, `selector_top_k`. Attention
per layer: `is_causal` if set, else causal exactly on `sliding_attention` layers; those layers see
`sliding_window` keys back (and forward, when non-causal).

speculators (`speculators_model_type` "dflash" or "dflash2"): `transformer_layer_config` (built as
transformers builds it for its model_type), `aux_hidden_state_layer_ids` (HF hidden_states indices:
z-lab ids + 1), `mask_token_id`, `block_size` (8), `draft_vocab_size` (a reduced vocabulary needs
its `d2t` map), `sliding_window_non_causal` (sliding layers bidirectional; default True for
dflash2), `target_hidden_size`, and for dflash2 the conv and selector fields (defaults 2, 16, 256,
16). A field that would change the drafts and is not implemented (`sample_from_anchor`, Domino's
`projector_type` / `shift_label`, MiMo's attention sinks, ...) is refused by name; fields that
change nothing are accepted and logged.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from flashdraft.models.checks import check_config
from flashdraft.models.loader import read_config_json

log = logging.getLogger("flashdraft")

# fields no layout defines that change the drafts where other engines read them: refused unless at
# the value that means "off" (None: refused whenever present)
UNSUPPORTED = {
    "sample_from_anchor": False, "projector_type": "dflash", "shift_label": False, "use_aux_hidden_state": True,
    "use_swa": False, "swa_window_size": None, "attention_sink_bias": False, "add_swa_attention_sink_bias": False,
    "attention_value_scale": None, "is_neox_style": True, "rope_is_neox_style": True, "logit_scale": 1.0,
    "partial_rotary_factor": 1.0, "mlp_bias": False, "causal": None, "pure_draft_prefix_len": None,
    "gru_hidden_dim": None, "emb_dim": None,
}
DFLASH_FIELDS = ("target_layer_ids", "block_size", "mask_token_id", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# the draft layers' sizes a config must give (the vocabulary is the target's)
LAYER_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
# fields read elsewhere or that describe the file, not the math
METADATA = {"architectures", "auto_map", "dflash_config", "num_target_layers", "speculators_model_type",
            "speculators_version", "speculators_config", "transformer_layer_config", "aux_hidden_state_layer_ids",
            "draft_vocab_size", "target_hidden_size", "sliding_window_non_causal", "torch_dtype", "dtype",
            "transformers_version", "rope_scaling", "rope_theta", "_name_or_path", "auf", "lambda_base_start",
            "lambda_base_decay_ratio", "initializer_range", "attention_dropout"}


def default_target_layer_ids(num_target_layers: int, num_taps: int) -> list[int]:
    """z-lab's spread: [L//2] for one tap, else round(1 + i*(L-4)/(n-1))."""
    if num_taps == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_taps - 1)) for i in range(num_taps)]


@dataclass
class DraftSpec:
    layer_config: object  # the draft layers' transformers config (or the same fields in a namespace)
    block_size: int
    mask_token_id: int
    target_layer_ids: list[int]  # 0-based target decoder layers, concatenated in this order
    draft_vocab_size: int | None  # None: the target's vocabulary
    fmt: str  # "z-lab" or "speculators"
    input_embedding_scale: float = 1.0  # the block's embeddings are multiplied by this
    output_multiplier: float = 1.0  # draft logits * this, then ...
    final_logit_softcapping: float | None = None  # ... c * tanh(logits / c)
    layer_masks: list[tuple[bool, int | None]] | None = None  # per layer (causal, window); None: all bidirectional
    conv: tuple[int, int] | None = None  # DFlash2: (kernel_size, group_size) of its grouped dynamic convolutions
    selector: tuple[int, int] | None = None  # DFlash2: (rank, top_k) of its candidate selector

    @property
    def kind(self) -> str:
        return "dflash2" if self.selector is not None else "dflash"


def _check_fields(where: str, fields: dict) -> None:
    for name, off in UNSUPPORTED.items():
        if name in fields and fields[name] is not None and (off is None or fields[name] != off):
            raise ValueError(f"{where}: {name}={fields[name]!r} changes the drafts and is not supported "
                             "by flashdraft")


def _log_unknown(where: str, fields: dict, known: set[str]) -> None:
    unknown = sorted(k for k in fields if k not in known and k not in METADATA and k not in DFLASH_FIELDS)
    if unknown:
        log.info("%s: ignoring fields that do not change the drafts: %s", where, ", ".join(unknown))


def _hf_config(model_type: str, fields: dict):
    from transformers import AutoConfig

    try:
        return AutoConfig.for_model(model_type, **fields)
    except Exception as e:  # transformers raises many types for malformed configs
        raise ValueError(f"cannot parse the drafter's {model_type} config: {e}") from None


def _known(cfg) -> set[str]:
    """The fields transformers itself defines for this config class."""
    return set(type(cfg)().to_dict())


def _layer_masks(cfg, causal_sliding: bool) -> list[tuple[bool, int | None]]:
    """(causal, window) per layer: `is_causal` if set, else causal_sliding on sliding layers."""
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if len(types) != cfg.num_hidden_layers:
        raise ValueError(f"layer_types lists {len(types)} layers for {cfg.num_hidden_layers}")
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ValueError(f"drafter layer_types {bad} are not supported (full_attention, sliding_attention)")
    forced = getattr(cfg, "is_causal", None)
    masks = []
    for t in types:
        window = cfg.sliding_window if t == "sliding_attention" else None
        causal = bool(forced) if forced is not None else (t == "sliding_attention" and causal_sliding)
        masks.append((causal, window))
    return masks


def _int(where: str, name: str, value, low: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{where}: {name} must be an integer >= {low}, got {value!r}")
    return value


def _read_zlab(folder: Path, data: dict, num_target_layers: int) -> DraftSpec:
    where = f"{folder}/config.json"
    dcfg = data.get("dflash_config") or {}
    if not isinstance(dcfg, dict):
        raise ValueError(f"{where}: dflash_config must be an object")
    _check_fields(where, data)
    _check_fields(f"{where} dflash_config", dcfg)
    model_type = data.get("model_type") or "qwen3"
    if model_type != "qwen3":
        raise ValueError(f"{where}: a z-lab drafter is a Qwen3 config, got model_type {model_type!r}")
    check_config(data, where, LAYER_FIELDS)
    cfg = _hf_config("qwen3", {k: v for k, v in data.items() if k not in ("model_type", "dflash_config")})
    _log_unknown(where, data, _known(cfg))

    def value(name, default=None):  # the reference's _draft_value: dflash_config, then the top level
        return dcfg[name] if name in dcfg else data.get(name, default)

    n = cfg.num_hidden_layers
    ids = value("target_layer_ids") or default_target_layer_ids(data.get("num_target_layers") or num_target_layers, n)
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{where}: target_layer_ids must be a list of layer numbers, got {ids!r}")
    dflash2 = "DFlash2DraftModel" in (data.get("architectures") or []) or value("selector_top_k") is not None
    conv = selector = None
    if dflash2:
        conv = (_int(where, "conv_kernel_size", value("conv_kernel_size")),
                _int(where, "conv_group_size", value("conv_group_size")))
        selector = (_int(where, "selector_rank", value("selector_rank")),
                    _int(where, "selector_top_k", value("selector_top_k")))
    return DraftSpec(cfg, value("block_size", 16), value("mask_token_id"), list(ids), None, "z-lab",
                     input_embedding_scale=float(value("input_embedding_scale", 1.0)),
                     output_multiplier=float(value("output_multiplier", 1.0)),
                     final_logit_softcapping=value("final_logit_softcapping"),
                     layer_masks=_layer_masks(cfg, causal_sliding=True), conv=conv, selector=selector)


def _read_speculators(folder: Path, data: dict) -> DraftSpec:
    where = f"{folder}/config.json"
    kind = data["speculators_model_type"]
    tlc = data.get("transformer_layer_config")
    if not isinstance(tlc, dict):
        raise ValueError(f"{where}: speculators config lacks transformer_layer_config")
    _check_fields(where, data)
    _check_fields(f"{where} transformer_layer_config", tlc)
    check_config(tlc, f"{where} transformer_layer_config", LAYER_FIELDS)
    cfg = _hf_config(tlc.get("model_type") or "qwen3", {k: v for k, v in tlc.items() if k != "model_type"})
    _log_unknown(where, data, set())
    _log_unknown(f"{where} transformer_layer_config", tlc, _known(cfg))
    aux = data.get("aux_hidden_state_layer_ids")
    if not aux:
        raise ValueError(f"{where}: speculators config lacks aux_hidden_state_layer_ids")
    th = data.get("target_hidden_size")
    if th is not None and th != cfg.hidden_size:
        raise ValueError(f"{where}: target_hidden_size {th} differs from the drafter's hidden_size "
                         f"{cfg.hidden_size}; flashdraft drafts with the target's own embeddings")
    dvs = data.get("draft_vocab_size")
    default_nc = kind == "dflash2"
    non_causal = bool(data.get("sliding_window_non_causal", default_nc))

    def scalar(name, default=None):  # converted z-lab fields land in transformer_layer_config
        return tlc.get(name, data.get(name, default))

    conv = selector = None
    if kind == "dflash2":
        conv = (_int(where, "conv_kernel_size", data.get("conv_kernel_size", 2)),
                _int(where, "conv_group_size", data.get("conv_group_size", 16)))
        selector = (_int(where, "selector_rank", data.get("selector_rank", 256)),
                    _int(where, "selector_top_k", data.get("selector_top_k", 16)))
    masks = []
    forced = getattr(cfg, "is_causal", None)
    for causal, window in _layer_masks(cfg, causal_sliding=True):
        if forced is None:  # speculators: a layer with a window is causal unless sliding_window_non_causal
            causal = window is not None and not non_causal
        masks.append((causal, window))
    return DraftSpec(cfg, data.get("block_size", 8), data.get("mask_token_id"), [int(i) - 1 for i in aux],
                     None if dvs in (None, cfg.vocab_size) else dvs, "speculators",
                     input_embedding_scale=float(scalar("input_embedding_scale", 1.0)),
                     output_multiplier=float(scalar("output_multiplier", 1.0)),
                     final_logit_softcapping=scalar("final_logit_softcapping"), layer_masks=masks, conv=conv,
                     selector=selector)


def read_draft_spec(folder: Path, num_target_layers: int) -> DraftSpec:
    data = read_config_json(folder)
    if data.get("speculators_model_type") in ("dflash", "dflash2"):
        spec = _read_speculators(folder, data)
    elif data.get("speculators_model_type") is not None:
        raise ValueError(f"unknown speculators_model_type {data['speculators_model_type']!r} in {folder}; "
                         "expected 'dflash' or 'dflash2'")
    elif {"DFlashDraftModel", "DFlash2DraftModel"} & set(data.get("architectures") or []) or "dflash_config" in data:
        spec = _read_zlab(folder, data, num_target_layers)
    else:
        arch = data.get("architectures") or data.get("model_type")
        raise ValueError(f"unknown drafter architecture {arch!r} in {folder}; expected a z-lab DFlashDraftModel "
                         "or DFlash2DraftModel config, or a speculators config of type 'dflash' or 'dflash2'")
    where = f"{folder}/config.json"
    if not isinstance(spec.mask_token_id, int):
        raise ValueError(f"{where}: drafter config has no integer mask_token_id")
    _int(where, "block_size", spec.block_size, low=2)
    cap = spec.final_logit_softcapping
    if cap is not None and (not isinstance(cap, (int, float)) or cap < 0):
        raise ValueError(f"{where}: final_logit_softcapping must be a number >= 0, got {cap!r}")
    if cap is not None and cap <= 0:
        spec.final_logit_softcapping = None  # the reference caps only when > 0
    if spec.output_multiplier <= 0:
        raise ValueError(f"{where}: output_multiplier must be > 0, got {spec.output_multiplier}")
    if spec.conv is not None:
        k, group = spec.conv
        if spec.layer_config.hidden_size % group:
            raise ValueError(f"{where}: conv_group_size {group} does not divide hidden_size "
                             f"{spec.layer_config.hidden_size}")
        if k > spec.block_size:
            raise ValueError(f"{where}: conv_kernel_size {k} exceeds block_size {spec.block_size}")
        if spec.draft_vocab_size is not None:
            raise ValueError(f"{where}: a DFlash2 drafter needs the target's whole vocabulary (draft_vocab_size)")
    return spec
