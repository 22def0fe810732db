"""The drafter a training run starts from and what it writes: a new drafter's shape from its target
(drafter_spec, init_drafter, init_from_target), a saved one continued with more taps, layers or
narrower MLPs (widen_fc, grow_layers), and the z-lab-format checkpoint (save_checkpoint)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING

import torch
from safetensors.torch import save_file

from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.models.rope import rope_parameters
from flashdraft.speculative.formats import DraftSpec, default_target_layer_ids

if TYPE_CHECKING:
    from flashdraft.train.config import TrainConfig


def drafter_spec(target_cfg, cfg: TrainConfig, mask_token_id: int) -> DraftSpec:
    n_taps = len(cfg.target_layer_ids) if cfg.target_layer_ids else max(cfg.num_layers, 2)
    ids = cfg.target_layer_ids or default_target_layer_ids(target_cfg.num_hidden_layers, n_taps)
    layer = SimpleNamespace(
        hidden_size=target_cfg.hidden_size, intermediate_size=cfg.intermediate_size or target_cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=getattr(target_cfg, "head_dim", None) or target_cfg.hidden_size // target_cfg.num_attention_heads,
        rms_norm_eps=target_cfg.rms_norm_eps, attention_bias=False, rope_theta=_rope_theta(target_cfg),
        rope_scaling=None, rope_parameters=None, max_position_embeddings=target_cfg.max_position_embeddings,
        vocab_size=target_cfg.vocab_size, model_type="qwen3")
    return with_arch(DraftSpec(layer, cfg.block_size or 16, mask_token_id, list(ids), None, "z-lab"), cfg)


def with_arch(spec: DraftSpec, cfg: TrainConfig) -> DraftSpec:
    """The spec as `cfg.arch` asks: DFlash2 adds the convolutions and the selector of cfg's sizes."""
    if cfg.arch not in ("dflash", "dflash2"):
        raise ValueError(f"unknown arch {cfg.arch!r}; use dflash or dflash2")
    if cfg.arch == "dflash":
        if spec.selector is not None:
            raise ValueError("the saved drafter is a DFlash2 drafter: pass arch dflash2 to continue it")
        return spec
    if spec.selector is not None:
        return spec  # a saved DFlash2 drafter keeps its sizes
    h, vocab = spec.layer_config.hidden_size, spec.layer_config.vocab_size
    if cfg.conv_group_size < 1 or h % cfg.conv_group_size:
        raise ValueError(f"conv_group_size {cfg.conv_group_size} must divide the hidden size {h}")
    if not 1 <= cfg.conv_kernel_size <= spec.block_size:
        raise ValueError(f"conv_kernel_size {cfg.conv_kernel_size} must lie in [1, block_size {spec.block_size}]")
    if cfg.selector_rank < 1 or not 1 <= cfg.selector_top_k <= vocab:
        raise ValueError(f"selector_rank {cfg.selector_rank} must be >= 1 and selector_top_k {cfg.selector_top_k} "
                         f"in [1, {vocab}]")
    return replace(spec, conv=(cfg.conv_kernel_size, cfg.conv_group_size),
                   selector=(cfg.selector_rank, cfg.selector_top_k))


def wider_taps(saved: list[int], wanted: list[int], n_target: int) -> list[int]:
    """The tap list a continued drafter may take: every saved tap kept, new ones added (any order)."""
    wanted = [int(i) for i in wanted]
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"target_layer_ids {wanted} repeats a layer")
    if not set(saved) <= set(wanted):
        raise ValueError(f"target_layer_ids {wanted} drop tap(s) {sorted(set(saved) - set(wanted))} of the saved "
                         f"drafter (taps {saved}); a continued drafter can add taps, not lose them")
    bad = [i for i in wanted if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"target_layer_ids {bad} outside the target's {n_target} layers")
    return wanted


def widen_fc(w: torch.Tensor, saved: list[int], wanted: list[int]) -> torch.Tensor:
    """fc.weight [H, len(saved) * H] as fc over the taps `wanted` (a superset): each saved tap's columns
    move to its place in the new order, the added taps' columns are zero, so fc(taps) is unchanged."""
    if list(saved) == list(wanted):
        return w
    h = w.shape[1] // len(saved)
    out = w.new_zeros(w.shape[0], h * len(wanted))
    for j, layer in enumerate(saved):
        k = wanted.index(layer)
        out[:, k * h:(k + 1) * h] = w[:, j * h:(j + 1) * h]
    return out


def grown_spec(spec: DraftSpec, add_layers: int, inter: int | None) -> DraftSpec:
    """The spec of a saved drafter given `add_layers` more layers and MLPs narrowed to `inter` channels."""
    c = spec.layer_config
    if add_layers < 0:
        raise ValueError(f"add_layers must be 0 or more, not {add_layers}")
    if inter is not None and not 0 < inter <= c.intermediate_size:
        raise ValueError(f"intermediate_size {inter}: a continued drafter can narrow its MLPs (the saved "
                         f"drafter's is {c.intermediate_size}), not widen them")
    if not add_layers and inter in (None, c.intermediate_size):
        return spec
    layer = copy.copy(c)
    layer.num_hidden_layers = c.num_hidden_layers + add_layers
    layer.intermediate_size = inter or c.intermediate_size
    return replace(spec, layer_config=layer)


def grow_layers(state: dict[str, torch.Tensor], n_saved: int, add_layers: int, inter: int | None,
                energy: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """A saved drafter's weights (DFlashDraftModel names) for a deeper and/or narrower drafter.
    inter: each layer's MLP keeps the `inter` channels with the largest sqrt(energy[i, j]) * |down_j|,
    energy from `mlp_channel_energy` (what each channel puts into the layer's output on real text), or
    without it |gate_j| * |up_j| * |down_j| (row / column norms, blind to which inputs the layer meets);
    the others are dropped, which changes the drafts a little, and training has to win that back.
    add_layers: copies of the last layer appended with o_proj and down_proj at zero, so each adds nothing
    to the residual stream (same drafts) until training moves them."""
    state = dict(state)
    for i in range(n_saved):
        key = f"layers.{i}.mlp."
        gate, up = state[key + "gate_up_proj.weight"].chunk(2)
        down = state[key + "down_proj.weight"]
        if inter is None or inter == gate.shape[0]:
            continue
        if energy is not None:
            score = energy[i].to(down.device).sqrt() * down.float().norm(dim=0)
        else:
            score = gate.float().norm(dim=1) * up.float().norm(dim=1) * down.float().norm(dim=0)
        keep = score.topk(inter).indices.sort().values
        state[key + "gate_up_proj.weight"] = torch.cat([gate[keep], up[keep]])
        state[key + "down_proj.weight"] = down[:, keep].contiguous()
    last = f"layers.{n_saved - 1}."
    for j in range(n_saved, n_saved + add_layers):
        for name in [k for k in state if k.startswith(last)]:
            t = state[name].clone()
            if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
                t.zero_()
            state[f"layers.{j}." + name[len(last):]] = t
    return state


def _rope_theta(cfg) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(cfg, "rope_theta", None) or 10000.0)


def init_drafter(spec: DraftSpec, device, seed: int) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(spec).to(device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_conv." in name:
                identity_conv_(p, name)
            elif name.endswith("successor_codebook"):  # zero: the selector starts as the drafter's argmax
                p.zero_()
            elif p.dim() == 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(1.0)  # RMSNorm weights
    return model


def identity_conv_(p: torch.Tensor, name: str) -> None:
    """DFlash2's convolutions start as the identity (base kernel 1 on the slot itself, no dynamic part),
    so a DFlash2 drafter starts drafting as the DFlash drafter it grows from."""
    p.zero_()
    if name.endswith("base_kernel"):
        p[:, 0] = 1.0


def init_from_target(drafter: DFlashDraftModel, weights: dict[str, torch.Tensor], first_layer: int) -> None:
    """Start the drafter's layers from target layers first_layer.. (same shapes; q/k norms stay 1)."""
    with torch.no_grad():
        for j, layer in enumerate(drafter.layers):
            src = f"model.layers.{first_layer + j}."
            a, mlp = layer.self_attn, layer.mlp
            a.qkv_proj.weight.copy_(torch.cat([weights[src + f"self_attn.{n}_proj.weight"] for n in "qkv"]))
            a.o_proj.weight.copy_(weights[src + "self_attn.o_proj.weight"])
            mlp.gate_up_proj.weight.copy_(torch.cat([weights[src + "mlp.gate_proj.weight"],
                                                     weights[src + "mlp.up_proj.weight"]]))
            mlp.down_proj.weight.copy_(weights[src + "mlp.down_proj.weight"])
            layer.input_layernorm.weight.copy_(weights[src + "input_layernorm.weight"])
            layer.post_attention_layernorm.weight.copy_(weights[src + "post_attention_layernorm.weight"])


def save_checkpoint(model: DFlashDraftModel, target_cfg, out: Path, dtype=torch.bfloat16,
                    fc_scale: torch.Tensor | None = None) -> None:
    """z-lab layout: unpacked projections, a Qwen3 config with the DFlash keys. fc_scale (the
    training-time tap preconditioner) is folded into fc's input columns."""
    spec, c = model.spec, model.spec.layer_config
    rope = rope_parameters(c)
    tensors = {}
    for name, t in model.state_dict().items():
        if name == "d2t":
            continue
        if name == "fc.weight" and fc_scale is not None:
            t = t.float() * fc_scale.to(t.device)[None, :]
        t = t.detach().to("cpu", dtype)
        if ".qkv_proj." in name:
            a = model.layers[0].self_attn
            for part, chunk in zip(("q_proj", "k_proj", "v_proj"), t.split([a.q_size, a.kv_size, a.kv_size])):
                tensors[name.replace("qkv_proj", part)] = chunk.contiguous()
        elif ".gate_up_proj." in name:
            for part, chunk in zip(("gate_proj", "up_proj"), t.chunk(2)):
                tensors[name.replace("gate_up_proj", part)] = chunk.contiguous()
        else:
            tensors[name] = t.contiguous()
    dflash_config = {"mask_token_id": spec.mask_token_id, "target_layer_ids": spec.target_layer_ids,
                     "block_size": spec.block_size}
    if spec.selector is not None:  # DFlash2; the codebooks are stored bare, as z-lab's files store them
        dflash_config |= dict(zip(("conv_kernel_size", "conv_group_size"), spec.conv)) | \
            dict(zip(("selector_rank", "selector_top_k"), spec.selector))
    config = {
        "architectures": ["DFlash2DraftModel" if spec.selector is not None else "DFlashDraftModel"],
        "model_type": "qwen3", "block_size": spec.block_size, "num_target_layers": target_cfg.num_hidden_layers,
        "dflash_config": dflash_config,
        "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "hidden_act": getattr(c, "hidden_act", "silu") or "silu",
        "attention_bias": bool(getattr(c, "attention_bias", False)),
        "rms_norm_eps": c.rms_norm_eps, "rope_theta": rope["rope_theta"],
        "rope_scaling": None if rope.get("rope_type", "default") == "default" else rope,
        "max_position_embeddings": c.max_position_embeddings, "vocab_size": c.vocab_size,
        "tie_word_embeddings": False, "layer_types": ["full_attention"] * c.num_hidden_layers,
        "use_sliding_window": False, "sliding_window": None, "dtype": str(dtype).removeprefix("torch."),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
