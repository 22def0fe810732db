"""Mixture-of-experts MLPs: a router picks each token's top-k experts, each a gated MLP, and the
token's output is their sum weighted by the router's probabilities.

Qwen3-MoE: softmax over all experts, top-k (renormalised over the k when `norm_topk_prob`), experts of
`moe_intermediate_size` with `hidden_act`. Checkpoints with one tensor per expert
(`experts.{e}.gate_proj.weight`, ...) are stacked at load (stack_experts).

GPT-OSS: the router has a bias, takes the top-k logits and a softmax over those k; experts of
`intermediate_size` have biases and a clamped SwiGLU: gate clamped above at `swiglu_limit`, up to
[-limit, limit], out = (up + 1) * gate * sigmoid(`swiglu_alpha` * gate). Its checkpoints hold
gate_up transposed with gate and up interleaved ([E, H, 2I], gate at even columns), down [E, I, H],
in bf16 or MXFP4 (`*_blocks` / `*_scales`, dequantized at load: experts are served in the model's
dtype); gpt_oss_experts converts them.

Experts are stored stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], biases
gate_up_proj_bias [E, 2I] and down_proj_bias [E, H] when the family has them.

On CPU the experts a step hits run one after another (transformers' loop). On the fused GPU path
the routed rows are sorted by expert and go through grouped Triton GEMMs (kernels/moe_experts.py), with
shapes fixed by the row count, so decode, verify and draft blocks replay inside CUDA graphs.

Under tensor parallelism (models/parallel.py) each rank holds every expert's share of the intermediate size
and `tp`, which sums the layer's combined output over the ranks: one all-reduce per layer."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from flashdraft import settings
from flashdraft.models.layers import linear


def is_moe_layer(cfg, i: int) -> bool:
    """transformers' rule: sparse unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    n = getattr(cfg, "num_experts", 0) or 0
    return i not in (getattr(cfg, "mlp_only_layers", None) or []) and n > 0 and \
        (i + 1) % (getattr(cfg, "decoder_sparse_step", 1) or 1) == 0


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden: int, inter: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(num_experts, 2 * inter)) if bias else None
        self.down_proj_bias = nn.Parameter(torch.empty(num_experts, hidden)) if bias else None

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert e's (gate_up [2I, H], down [H, I]) in `dtype` (the torch path)."""
        return self.gate_up_proj[e], self.down_proj[e]

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """(gate_up, down, scales) as moe_experts.fused_moe takes them."""
        return self.gate_up_proj, self.down_proj, None


class FP8Experts(Experts):
    """Experts whose weights stay in their checkpoint's block-scaled FP8 (models/quant_serve.py): the stacked
    float8_e4m3fn matrices as uint8 bits and their blocks' float32 factors as int32 bits (gate_up_proj_scale_inv
    [E, 2I / bn, H / bk], down_proj_scale_inv [E, H / bn, I / bk]), so that casting the model leaves them; the
    kernels scale each K-tile's product, the torch path dequantizes the experts a step hits."""

    def __init__(self, num_experts: int, hidden: int, inter: int, block: tuple[int, int]):
        nn.Module.__init__(self)
        self.block = block
        bn, bk = block
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden, dtype=torch.uint8),
                                         requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter, dtype=torch.uint8), requires_grad=False)
        self.gate_up_proj_scale_inv = nn.Parameter(torch.empty(num_experts, -(-2 * inter // bn), -(-hidden // bk),
                                                               dtype=torch.int32), requires_grad=False)
        self.down_proj_scale_inv = nn.Parameter(torch.empty(num_experts, -(-hidden // bn), -(-inter // bk),
                                                            dtype=torch.int32), requires_grad=False)
        self.gate_up_proj_bias = self.down_proj_bias = None

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        from flashdraft.models.quant import dequantize_block_fp8

        return tuple(dequantize_block_fp8(w[e].view(torch.float8_e4m3fn), s[e].view(torch.float32), self.block,
                                          "expert").to(dtype)
                     for w, s in ((self.gate_up_proj, self.gate_up_proj_scale_inv),
                                  (self.down_proj, self.down_proj_scale_inv)))

    def kernel_args(self) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        return (self.gate_up_proj.view(torch.float8_e4m3fn), self.down_proj.view(torch.float8_e4m3fn),
                (self.gate_up_proj_scale_inv.view(torch.float32), self.down_proj_scale_inv.view(torch.float32),
                 self.block))


class MoE(nn.Module):
    tp = None  # tensor parallelism: this rank's models.parallel.TPGroup (its experts' outputs are partial sums)

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
        else:
            for e in idx.unique().tolist():  # the experts this step hits, as transformers loops
                rows, slot = torch.where(idx == e)
                out.index_add_(0, rows, self._expert(x[rows], e) * w[rows, slot, None])
        return self._summed(out)

    def _summed(self, out: torch.Tensor) -> torch.Tensor:
        return out if self.tp is None else self.tp.all_reduce(out)

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.act(gate) * up

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        ex = self.experts
        w_gate_up, w_down = ex.weights(e, x.dtype)
        gate_up = F.linear(x, w_gate_up)
        if ex.gate_up_proj_bias is not None:  # added after the product's rounding, as transformers adds it
            gate_up = gate_up + ex.gate_up_proj_bias[e]
        out = F.linear(self.glu(*gate_up.chunk(2, dim=-1)), w_down)
        return out if ex.down_proj_bias is None else out + ex.down_proj_bias[e]

    def kernel_act(self) -> tuple | None:
        """The gated activation as the Triton kernels name it (moe_experts.fused_moe), None if they lack it."""
        return ("silu",) if self.act is F.silu else None

    def route_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """route() on the fused path: the router GEMM (few-row Triton kernels; a split-K one leaves its
        parts to the top-k kernel, which adds them) and one top-k kernel."""
        from flashdraft.kernels.moe_routing import route_topk

        return route_topk(linear(x, self.gate.weight, parts=True), self.top_k, True, self.norm_topk_prob, x.dtype)

    def routing(self) -> tuple[torch.Tensor, torch.Tensor | None, bool, bool]:
        """The router's (weight, bias, softmax over all experts, renormalise the k): how route() routes."""
        return self.gate.weight, None, True, self.norm_topk_prob

    def norm_forward_fused(self, a: torch.Tensor, residual: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer after attention on the fused path: (the k weighted expert outputs [T, k, H] for the next
        add_rmsnorm to sum, the new residual) from the attention output `a` (or its split-K parts), the
        residual and the post-attention RMSNorm `norm`. Up to moe_routing.NORM_ROUTER_ROWS rows the add,
        norm and router GEMM are one kernel (norm_router) and, on the direct path, the top-k runs in the
        gate_up kernel: three launches where add_rmsnorm, router, top-k, gate_up and down were five."""
        from flashdraft.kernels import layer_ops, moe_experts, moe_routing

        act = self.kernel_act()
        weight, bias, softmax_all, renorm = self.routing()
        in_norm = act is not None and settings.ROUTE_IN_NORM
        if not (in_norm and moe_routing.norm_router_fits(*residual.shape, weight.shape[0])):
            x, residual = layer_ops.add_rmsnorm(a, residual, norm.weight, norm.eps)
            return self.forward_fused(x, slots=True), residual
        x, residual, logits = moe_routing.norm_router(a, residual, norm.weight, norm.eps, weight, bias)
        ex = self.experts
        w_gate_up, w_down, scales = ex.kernel_args()
        return self._summed(moe_experts.fused_moe(x, w_gate_up, w_down, None, None, act, ex.gate_up_proj_bias,
                                                  ex.down_proj_bias, slots=self.tp is None,
                                                  route=(logits, self.top_k, softmax_all, renorm),
                                                  scales=scales)), residual

    def forward_fused(self, x: torch.Tensor, slots: bool = False) -> torch.Tensor:
        """The kernel path: [T, H], or with slots the k weighted expert outputs [T, k, H] for the next
        layer_ops.add_rmsnorm to sum (the torch fallback, and tensor parallelism, then still return [T, H]:
        the k outputs are joined before the all-reduce, which then moves [T, H] rather than [T, k, H])."""
        from flashdraft.kernels.moe_experts import fused_moe

        act = self.kernel_act()
        if act is None:
            return self.forward(x)  # (all-reduced there)
        w, idx = self.route_fused(x)
        ex = self.experts
        w_gate_up, w_down, scales = ex.kernel_args()
        return self._summed(fused_moe(x, w_gate_up, w_down, w, idx, act, ex.gate_up_proj_bias, ex.down_proj_bias,
                                      slots=slots and self.tp is None, scales=scales))


class GptOssMoE(MoE):
    def __init__(self, cfg):
        nn.Module.__init__(self)
        self.num_experts, self.top_k = cfg.num_local_experts, cfg.num_experts_per_tok
        self.inter = cfg.intermediate_size
        # older transformers (5.17) fix alpha at 1.702 and the limit at 7.0, the published values
        self.alpha = float(getattr(cfg, "swiglu_alpha", 1.702))
        self.limit = float(getattr(cfg, "swiglu_limit", 7.0))
        self.router = nn.Linear(cfg.hidden_size, self.num_experts, bias=True)
        self.experts = Experts(self.num_experts, cfg.hidden_size, self.inter, bias=True)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, idx = F.linear(x, self.router.weight, self.router.bias).topk(self.top_k, dim=-1)
        return top.softmax(-1, dtype=top.dtype), idx

    def route_fused(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from flashdraft.kernels.moe_routing import route_topk

        return route_topk(linear(x, self.router.weight, self.router.bias, parts=True), self.top_k, False, False,
                          x.dtype)

    def routing(self) -> tuple[torch.Tensor, torch.Tensor | None, bool, bool]:
        return self.router.weight, self.router.bias, False, False

    def glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def kernel_act(self) -> tuple:
        return ("swiglu_oai", self.alpha, self.limit)


Named = tuple[str, torch.Tensor]  # a checkpoint tensor and its name


def gpt_oss_experts(weights: Iterable[Named], dtype: torch.dtype) -> Iterator[Named]:
    """GPT-OSS checkpoint experts (bf16, or MXFP4 `_blocks` + `_scales` dequantized to `dtype` by
    transformers' own routine) -> the stacked layout above: transposed, gate rows before up rows. Streamed:
    each (name, tensor) pair out as soon as it is in (an MXFP4 weight once both of its parts are)."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    packed: dict[str, dict[str, torch.Tensor]] = {}
    for name, w in weights:
        base, _, part = name.rpartition("_")
        if part in ("blocks", "scales") and base.endswith(("experts.gate_up_proj", "experts.down_proj")):
            parts = packed.setdefault(base, {})
            parts[part] = w
            if len(parts) < 2:
                continue
            del packed[base]
            name, w = base, convert_moe_packed_tensors(parts["blocks"], parts["scales"], dtype=dtype)
        if name.endswith("experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] gate rows first
            w = w.transpose(1, 2)
            w = torch.cat([w[:, 0::2], w[:, 1::2]], 1)
        elif name.endswith("experts.gate_up_proj_bias"):
            w = torch.cat([w[:, 0::2], w[:, 1::2]], 1)
        elif name.endswith("experts.down_proj"):  # [E, I, H] -> [E, H, I]
            w = w.transpose(1, 2).contiguous()
        yield name, w
    if packed:
        base = next(iter(packed))
        raise ValueError(f"MXFP4 expert weight {base!r} needs both {base}_blocks and {base}_scales")


# (a served FP8 checkpoint's experts keep their weight_scale_inv beside their weight: quant_serve.py)
_EXPERT = re.compile(r"(.*mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


def stack_experts(weights: Mapping[str, torch.Tensor] | Iterable[Named],
                  num_experts: int | None = None) -> Iterator[Named]:
    """Per-expert checkpoint tensors -> the stacked gate_up_proj / down_proj of each layer, out as soon as
    the layer's num_experts experts are in (None: at the end); every other tensor passes straight through."""
    per: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, w in weights.items() if isinstance(weights, Mapping) else weights:
        m = _EXPERT.match(name)
        if m is None:
            yield name, w
            continue
        parts = per.setdefault(m.group(1), {})
        parts.setdefault(m.group(3) + ("" if m.group(4) == "weight" else "_scale_inv"), {})[int(m.group(2))] = w
        if num_experts and all(len(parts.get(k, ())) == num_experts for k in _kinds(parts)):
            parts = w = None  # (held here, the layer's experts would outlive their stacking until the next layer's)
            yield from _stacked(m.group(1), per.pop(m.group(1)), num_experts)
    for prefix, parts in per.items():
        yield from _stacked(prefix, parts, num_experts)


def _kinds(parts: dict) -> tuple[str, ...]:
    """The per-expert tensors a layer needs: the three weights, and their FP8 scales once any came."""
    scaled = any(k.endswith("_scale_inv") for k in parts)
    return ("gate_proj", "up_proj", "down_proj") + (("gate_proj_scale_inv", "up_proj_scale_inv",
                                                     "down_proj_scale_inv") if scaled else ())


def _stacked(prefix: str, parts: dict[str, dict[int, torch.Tensor]], n: int | None) -> Iterator[Named]:
    n = n or 1 + max(max(p) for p in parts.values())
    missing = [f"{prefix}.{e}.{k}" for k in _kinds(parts) for e in range(n) if e not in parts.get(k, {})]
    if missing:
        raise ValueError(f"checkpoint is missing expert weights: {', '.join(missing[:4])}")
    for tail in ("", "_scale_inv") if "down_proj_scale_inv" in parts else ("",):
        gate, up, down = (parts[k + tail] for k in ("gate_proj", "up_proj", "down_proj"))
        yield f"{prefix}.gate_up_proj{tail}", torch.stack([torch.cat([gate[e], up[e]]) for e in range(n)])
        yield f"{prefix}.down_proj{tail}", torch.stack([down[e] for e in range(n)])