"""Mixture-of-experts MLP (Qwen3-MoE): a router picks each token's top-k experts, each a gated MLP of
`moe_intermediate_size`, and the token's output is their sum weighted by the router's softmax
probabilities (renormalised over the k when `norm_topk_prob`). Experts are stored stacked, as
transformers holds them: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I]; checkpoints
with one tensor per expert (`experts.{e}.gate_proj.weight`, ...) are stacked at load (stack_experts).

On CPU the experts a step hits run one after another (transformers' loop). On the fused GPU path
the routed rows are sorted by expert and go through grouped Triton GEMMs (models/moe_triton.py), with
shapes fixed by the row count, so decode, verify and draft blocks replay inside CUDA graphs."""

from __future__ import annotations

import re

import torch
import torch.nn as nn
import torch.nn.functional as F


def is_moe_layer(cfg, i: int) -> bool:
    """transformers' rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    n = getattr(cfg, "num_experts", 0) or 0
    return i not in (getattr(cfg, "mlp_only_layers", None) or []) and n > 0 and \
        (i + 1) % (getattr(cfg, "decoder_sparse_step", 1) or 1) == 0


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))


class MoE(nn.Module):
    def __init__(self, cfg, act):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.num_experts_per_tok
        self.norm_topk_prob = bool(getattr(cfg, "norm_topk_prob", False))
        self.inter = cfg.moe_intermediate_size
        self.act = act
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # the router
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] in x's dtype, expert ids [T, k])."""
        probs = F.linear(x, self.gate.weight).softmax(-1, dtype=torch.float32)
        w, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return w.to(x.dtype), idx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, idx = self.route(x)
        out = torch.zeros_like(x)
        if x.device.type != "cpu":  # no host reads: every expert over every row, weighted 0 where unrouted
            for e in range(self.num_experts):
                we = (w * (idx == e)).sum(-1, keepdim=True)
                out += self._expert(x, e) * we
            return out
        for e in idx.unique().tolist():  # the experts this step hits, as transformers loops
            rows, slot = torch.where(idx == e)
            out.index_add_(0, rows, self._expert(x[rows], e) * w[rows, slot, None])
        return out

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        gate, up = F.linear(x, self.experts.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.experts.down_proj[e])

    def forward_fused(self, x: torch.Tensor) -> torch.Tensor:
        from flashdraft.models.moe_triton import fused_moe

        if self.act is not F.silu:  # the kernels compute silu
            return self.forward(x)
        w, idx = self.route(x)
        return fused_moe(x, self.experts.gate_up_proj, self.experts.down_proj, w, idx, self.act)


_EXPERT = re.compile(r"(.*mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def stack_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert checkpoint tensors -> the stacked gate_up_proj / down_proj of each layer."""
    per: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = {}
    for name, w in weights.items():
        m = _EXPERT.match(name)
        if m is None:
            out[name] = w
            continue
        per.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = w
    for prefix, parts in per.items():
        n = 1 + max(max(p) for p in parts.values())
        missing = [f"{prefix}.{e}.{k}" for k in ("gate_proj", "up_proj", "down_proj") for e in range(n)
                   if e not in parts.get(k, {})]
        if missing:
            raise ValueError(f"checkpoint is missing expert weights: {', '.join(missing[:4])}")
        out[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([parts["gate_proj"][e], parts["up_proj"][e]])
                                                     for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts["down_proj"][e] for e in range(n)])
    return out
