"""Rotary embedding tables. The inverse frequencies come from transformers' own rope initialisers,
so every rope type it knows (default, llama3, linear, yarn, ...) matches HF exactly."""

from __future__ import annotations

import torch


def rope_parameters(config) -> dict:
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    out = {"rope_type": "default", "rope_theta": getattr(config, "rope_theta", 10000.0)}
    scaling = getattr(config, "rope_scaling", None)
    if scaling:
        out.update(scaling)
        out["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    return out


def inv_freq_and_scale(config, head_dim: int) -> tuple[torch.Tensor, float]:
    params = rope_parameters(config)
    kind = params.get("rope_type", "default")
    if kind == "default":
        theta = float(params["rope_theta"])
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope_type {kind!r}; supported: default, {', '.join(ROPE_INIT_FUNCTIONS)}")
    if not hasattr(config, "to_dict"):  # a plain namespace: the initialisers want a transformers config
        from transformers import PretrainedConfig

        config = PretrainedConfig(**vars(config))
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv.float(), float(scale)


class RotaryTable:
    """cos/sin for positions [0, max_len), rotate-half layout: [max_len, head_dim]."""

    def __init__(self, config, head_dim: int, max_len: int, device: torch.device, dtype: torch.dtype):
        inv, scale = inv_freq_and_scale(config, head_dim)
        t = torch.arange(max_len, dtype=torch.float32)
        freqs = torch.outer(t, inv)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * scale).to(device=device, dtype=dtype)
        self.sin = (emb.sin() * scale).to(device=device, dtype=dtype)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions], self.sin[positions]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
