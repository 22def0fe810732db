"""Mixture-of-experts routing on the GPU: each token's top-k experts and their weights from the router's
logits (route_topk, or inside moe_experts.py's gate_up kernel on its direct path: _route_row), and the
router's logits fused with the add + RMSNorm before it (norm_router).

After attention, a layer of up to NORM_ROUTER_ROWS rows takes three kernels (MoE.norm_forward_fused):
norm_router (the residual add, the RMSNorm and the router's split-K logits), gate_up (on the direct
path each routed row's program routes itself from those logits: _route_row, the top-k kernel's code)
and down; five before (add_rmsnorm, router GEMM, top-k, gate_up, down)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft.kernels.launch import launch_kwargs, pdl_enter, pdl_trigger


@triton.jit
def _route_row(lp, E, wdt: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
               SOFTMAX_ALL: tl.constexpr, NORM: tl.constexpr, PARTS: tl.constexpr):
    """One token's routing from its router logits at lp: (weights [KP] in float32, expert ids [KP]; past
    K: 0). SOFTMAX_ALL (Qwen3-MoE) the top-k of the softmax over every expert, renormalised over the k
    when NORM; else (GPT-OSS) the softmax over the top-k logits. Ties go to the lower expert index.
    PARTS > 0: the logits come as a split-K router GEMM's float32 parts [PARTS, E], added here in slot
    order and rounded to wdt, as the GEMM's own last program would have (skinny_gemm.py)."""
    e = tl.arange(0, EP)
    if PARTS > 0:
        vals = tl.load(lp + e, mask=e < E, other=0.0)
        for p in tl.static_range(1, PARTS):
            vals += tl.load(lp + p * E + e, mask=e < E, other=0.0)
        vals = tl.where(e < E, vals.to(wdt).to(tl.float32), float("-inf"))
    else:
        vals = tl.load(lp + e, mask=e < E, other=float("-inf")).to(tl.float32)
    if SOFTMAX_ALL:
        z = tl.exp(vals - tl.max(vals, axis=0))
        vals = z / tl.sum(z, axis=0)
    # NaN (a padding row's garbage) ranks highest, as in torch.topk: every id stays a real expert, so
    # such a row spoils only its own output, never the sort of the others
    vals = tl.where((vals != vals) & (e < E), float("inf"), vals)
    j = tl.arange(0, KP)
    top = tl.full([KP], float("-inf"), tl.float32)
    ids = tl.zeros([KP], tl.int32)
    for r in tl.static_range(K):
        best = tl.max(vals, axis=0)
        arg = tl.min(tl.where(vals == best, e, EP), axis=0)
        top = tl.where(j == r, best, top)
        ids = tl.where(j == r, arg, ids)
        vals = tl.where(e == arg, float("-inf"), vals)
    if SOFTMAX_ALL:
        w = tl.where(j < K, top, 0.0)
        if NORM:
            w = w / tl.sum(w, axis=0)
    else:
        z = tl.where(j < K, tl.exp(top - tl.max(top, axis=0)), 0.0)
        w = z / tl.sum(z, axis=0)
    return w, ids


@triton.jit
def _topk_kernel(logits_ptr, w_ptr, idx_ptr, E, stride, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr,
                 SOFTMAX_ALL: tl.constexpr, NORM: tl.constexpr, PARTS: tl.constexpr, USE_PDL: tl.constexpr):
    """One token's routing a program (_route_row)."""
    pdl_enter(USE_PDL)
    t = tl.program_id(0)
    w, ids = _route_row(logits_ptr + t * stride, E, w_ptr.dtype.element_ty, K, KP, EP, SOFTMAX_ALL, NORM, PARTS)
    j = tl.arange(0, KP)
    pdl_trigger(USE_PDL)
    tl.store(w_ptr + t * K + j, w.to(w_ptr.dtype.element_ty), mask=j < K)
    tl.store(idx_ptr + t * K + j, ids.to(tl.int64), mask=j < K)


def route_topk(logits: torch.Tensor, k: int, softmax_all: bool, norm: bool,
               dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]), one program a
    token (see _topk_kernel), as models/moe.py routes with torch ops. Logits may also come as a split-K
    GEMM's float32 parts [T, P, E] (skinny_linear(parts=True)): their sum, rounded to `dtype`, is used,
    and the weights come in `dtype`."""
    parts = logits.shape[1] if logits.dim() == 3 else 0
    if parts and (dtype is None or logits.dtype != torch.float32 or not logits.is_contiguous()):
        raise ValueError("router parts need float32 [T, P, E] contiguous and the dtype to round their sum to")
    T, E = logits.shape[0], logits.shape[-1]
    w = torch.empty(T, k, device=logits.device, dtype=dtype if parts else logits.dtype)
    idx = torch.empty(T, k, device=logits.device, dtype=torch.int64)
    _topk_kernel[(T,)](logits, w, idx, E, logits.stride(0), K=k, KP=triton.next_power_of_2(k),
                       EP=max(16, triton.next_power_of_2(E)), SOFTMAX_ALL=softmax_all, NORM=norm, PARTS=parts,
                       num_warps=1, **launch_kwargs(logits))
    return w, idx


# norm_router takes up to this many rows (decode batches, a batch-1 verify block) and experts; more go
# through add_rmsnorm, the router GEMM and the top-k kernel
NORM_ROUTER_ROWS = 32
NORM_ROUTER_EXPERTS = 256


@triton.jit
def _residual_sum(x_ptr, res_ptr, row, d, ok, stride_x, stride_r, N, PARTS: tl.constexpr, dt: tl.constexpr):
    """x + residual at columns d of a row, rounded to dt, in float32 (x: PARTS float32 parts of N,
    summed in order and rounded to dt first), as layer_ops._add_rmsnorm_kernel forms it."""
    x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
    if PARTS > 1:
        xs = x.to(tl.float32)
        for p in tl.static_range(1, PARTS):
            xs += tl.load(x_ptr + row * stride_x + p * N + d, mask=ok, other=0.0).to(tl.float32)
        x = xs.to(dt)
    r = tl.load(res_ptr + row * stride_r + d, mask=ok, other=0.0)
    return (x.to(tl.float32) + r.to(tl.float32)).to(dt).to(tl.float32)


@triton.jit
def _norm_router_kernel(x_ptr, res_ptr, nw_ptr, out_ptr, res_out_ptr, rw_ptr, rb_ptr, logits_ptr, eps, E,
                        stride_x, stride_r, stride_o, stride_ro, stride_rw, N: tl.constexpr, BLOCK: tl.constexpr,
                        PARTS: tl.constexpr, PART_K: tl.constexpr, BK: tl.constexpr, EB: tl.constexpr,
                        BIAS: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, s): the row's residual add and RMSNorm (layer_ops._add_rmsnorm_kernel's; program s = 0
    stores them), then the router's float32 partial logits over the normed row's columns
    [s * PART_K, (s + 1) * PART_K) (the bias in part 0), for the top-k to add in part order."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    dt = res_out_ptr.dtype.element_ty
    odt = out_ptr.dtype.element_ty
    d = tl.arange(0, BLOCK)
    h = _residual_sum(x_ptr, res_ptr, row, d, d < N, stride_x, stride_r, N, PARTS, dt)
    inv = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    e = tl.arange(0, EB)
    acc = tl.zeros([EB, BK], tl.float32)
    for k0 in tl.static_range(0, PART_K, BK):
        kk = s * PART_K + k0 + tl.arange(0, BK)
        hk = _residual_sum(x_ptr, res_ptr, row, kk, kk < N, stride_x, stride_r, N, PARTS, dt)
        yk = (tl.load(nw_ptr + kk).to(tl.float32) * (hk * inv).to(dt).to(tl.float32)).to(odt).to(tl.float32)
        wt = tl.load(rw_ptr + e[:, None] * stride_rw + kk[None, :], mask=(e < E)[:, None], other=0.0)
        acc += wt.to(tl.float32) * yk[None, :]
    logit = tl.sum(acc, 1)
    if BIAS:
        if s == 0:
            logit += tl.load(rb_ptr + e, mask=e < E, other=0.0).to(tl.float32)
    pdl_trigger(USE_PDL)
    tl.store(logits_ptr + (row * tl.num_programs(1) + s) * E + e, logit, mask=e < E)
    if s == 0:
        y = tl.load(nw_ptr + d, mask=d < N, other=0.0).to(tl.float32) * (h * inv).to(dt).to(tl.float32)
        tl.store(res_out_ptr + row * stride_ro + d, h.to(dt), mask=d < N)
        tl.store(out_ptr + row * stride_o + d, y.to(odt), mask=d < N)


def router_parts(hidden: int) -> tuple[int, int] | None:
    """(parts, BK) of norm_router over a row of `hidden`: the most parts, at most 16, each a whole
    number of 64-wide tiles (Qwen3-30B-A3B's 2,048: 16 of 128; GPT-OSS-20B's 2,880: 15 of 192); None
    when 64 does not divide it."""
    if hidden % 64:
        return None
    tiles = hidden // 64
    return max(s for s in range(1, 17) if tiles % s == 0), 64


def norm_router_fits(rows: int, hidden: int, experts: int) -> bool:
    """Whether norm_router takes a step of `rows` rows of `hidden` and a router of `experts` outputs."""
    return rows <= NORM_ROUTER_ROWS and experts <= NORM_ROUTER_EXPERTS and router_parts(hidden) is not None


def norm_router(x: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor, eps: float,
                router_w: torch.Tensor, router_b: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """layer_ops.add_rmsnorm(x, residual, norm_w, eps) and the router's logits over its output, in one kernel:
    (normed [T, H], new residual [T, H], float32 logit parts [T, P, E]; their sum in order, rounded
    to the residual's dtype, is the router GEMM's result). x may be split-K parts [T, P', H] as
    add_rmsnorm takes them. For up to NORM_ROUTER_ROWS rows and hidden sizes router_parts cuts."""
    T, H = residual.shape
    E = router_w.shape[0]
    if not norm_router_fits(T, H, E):
        raise ValueError(f"norm_router takes up to {NORM_ROUTER_ROWS} rows, a hidden size of whole 64s and "
                         f"at most {NORM_ROUTER_EXPERTS} experts; got {T} x {H}, {E} experts")
    parts_in = x.shape[1] if x.dim() == 3 else 1
    if x.shape[0] != T or x.shape[-1] != H:
        raise ValueError(f"x {tuple(x.shape)} does not fit the residual {tuple(residual.shape)}")
    x2 = x.reshape(T, parts_in * H)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    residual = residual if residual.stride(-1) == 1 else residual.contiguous()
    dtype = residual.dtype
    out = torch.empty(T, H, device=x.device, dtype=torch.promote_types(norm_w.dtype, dtype))
    new_res = torch.empty(T, H, device=x.device, dtype=dtype)
    parts, bk = router_parts(H)
    logits = torch.empty(T, parts, E, device=x.device, dtype=torch.float32)
    if router_w.stride(-1) != 1:
        raise ValueError("the router weight needs a unit last stride")
    rb = router_b if router_b is not None else router_w
    _norm_router_kernel[(T, parts)](x2, residual, norm_w, out, new_res, router_w, rb, logits, eps, E, x2.stride(0),
                                    residual.stride(0), out.stride(0), new_res.stride(0), router_w.stride(0), N=H,
                                    BLOCK=triton.next_power_of_2(H), PARTS=parts_in, PART_K=H // parts, BK=bk,
                                    EB=max(16, triton.next_power_of_2(E)), BIAS=router_b is not None,
                                    num_warps=4, **launch_kwargs(x2))
    return out, new_res, logits
