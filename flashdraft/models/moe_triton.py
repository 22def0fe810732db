"""Mixture-of-experts MLP on the GPU: the routed rows sorted by expert, then two grouped Triton GEMMs.

A step's T tokens route to k experts each: M = T * k (token, slot) rows. They are sorted by expert and
each expert's run is padded to a multiple of BLOCK_M rows (graph-safe: every shape follows from M and
the expert count, never from the routing), so a program owns BLOCK_M rows of one expert:

    gate_up   h[r] = act(x[token(r)] @ Wg[e]^T + bg[e], x[token(r)] @ Wu[e]^T + bu[e])
                                                                  grid (row blocks, I / BLOCK_N)
    down      y[slot(r)] = weight(slot) * (h[r] @ Wd[e]^T + bd[e])   grid (row blocks, H / BLOCK_N)

with act silu(gate) * up (Qwen3-MoE, no biases) or GPT-OSS's clamped SwiGLU (models/moe.py),

and the token's output is the sum of its k slots (in slot order: deterministic). An expert's weights
are read once per block of its rows: at decode (one token, k experts of one row each) a step reads the
k experts' weights once, the memory floor; blocks past the padded end return at once. Rounding
follows the torch path (models/moe.py): gate and up (bias added) rounded to the activation dtype, the
activation's steps in float32, each rounded as torch rounds it; the routing weight is applied to the
down projection's rounded output (bias added)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # rows of one expert per program (decode routes one row per expert: padding dominates)
BLOCK_N = 64
BLOCK_K = 64


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, h_ptr, rows_ptr, block_expert_ptr, K, INTER, k_slots, stride_x,
                    stride_we, stride_wn, stride_be, stride_h, alpha, limit, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, BIAS: tl.constexpr,
                    OAI: tl.constexpr):
    b = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(rows_ptr + m)  # -1: padding
    valid = slot >= 0
    token = tl.where(valid, slot // k_slots, 0)
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < INTER
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(x_ptr + token[:, None] * stride_x + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        wg = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        wu = tl.load(w_base + (INTER + n)[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None],
                     other=0.0)
        if F32_DOT:
            acc_g += tl.dot(a.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
            acc_u += tl.dot(a.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    dt = h_ptr.dtype.element_ty
    g = acc_g.to(dt).to(tl.float32)
    u = acc_u.to(dt).to(tl.float32)
    if BIAS:
        b_base = b_ptr + e.to(tl.int64) * stride_be
        g = (g + tl.load(b_base + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
        u = (u + tl.load(b_base + INTER + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]).to(dt).to(tl.float32)
    if OAI:  # (clamp(up, +-limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit)
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = (1.0 / (1.0 + tl.exp(-(g * alpha).to(dt).to(tl.float32)))).to(dt).to(tl.float32)
        glu = (g * sig).to(dt).to(tl.float32)
        h = ((u + 1.0).to(dt).to(tl.float32) * glu).to(dt)
    else:
        s = (g / (1.0 + tl.exp(-g))).to(dt)
        h = (s.to(tl.float32) * u).to(dt)
    tl.store(h_ptr + m[:, None] * stride_h + n[None, :], h, mask=valid[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, b_ptr, y_ptr, rows_ptr, block_expert_ptr, weight_ptr, K, N, stride_h, stride_we,
                 stride_wn, stride_be, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, F32_DOT: tl.constexpr, BIAS: tl.constexpr):
    b = tl.program_id(0)
    n0 = tl.program_id(1) * BLOCK_N
    e = tl.load(block_expert_ptr + b)
    if e < 0:
        return
    m = b * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.load(rows_ptr + m)
    valid = slot >= 0
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + e.to(tl.int64) * stride_we
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < K
        a = tl.load(h_ptr + m[:, None] * stride_h + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + n[None, :] * stride_wn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
        if F32_DOT:
            acc += tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    dt = y_ptr.dtype.element_ty
    wt = tl.load(weight_ptr + tl.where(valid, slot, 0), mask=valid, other=0.0).to(tl.float32)
    acc = acc.to(dt).to(tl.float32)
    if BIAS:
        acc = (acc + tl.load(b_ptr + e.to(tl.int64) * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :])
        acc = acc.to(dt).to(tl.float32)
    y = (acc * wt[:, None]).to(dt)
    tl.store(y_ptr + tl.where(valid, slot, 0)[:, None] * stride_y + n[None, :], y, mask=valid[:, None] & n_ok[None, :])


def sort_by_expert(ids: torch.Tensor, num_experts: int, block: int = BLOCK_M) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] expert of each (token, slot) -> (rows [P]: the slot (token * k + j) of each sorted row,
    -1 for padding; block_expert [P / block]: each block's expert, -1 past the last), where each expert's
    rows are padded to a multiple of `block` and P = M + E * (block - 1) rounded up to a block."""
    flat = ids.flatten()
    M, E = flat.shape[0], num_experts
    P = -(-(M + E * (block - 1)) // block) * block
    order = flat.argsort(stable=True)
    counts = torch.zeros(E, dtype=torch.int64, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block - 1) // block * block
    ends = padded.cumsum(0)
    starts = ends - padded
    first = counts.cumsum(0) - counts
    e_sorted = flat[order]
    dest = starts[e_sorted] + torch.arange(M, device=ids.device) - first[e_sorted]
    rows = torch.full((P,), -1, dtype=torch.int64, device=ids.device)
    rows[dest] = order
    block_start = torch.arange(0, P, block, device=ids.device)
    block_expert = torch.searchsorted(ends, block_start, right=True)
    block_expert = torch.where(block_start < ends[-1], block_expert, -1).to(torch.int32)
    return rows, block_expert


def fused_moe(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, weights: torch.Tensor,
              ids: torch.Tensor, act: tuple = ("silu",), b_gate_up: torch.Tensor | None = None,
              b_down: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], routing weights and expert ids [T, k], biases
    [E, 2I] and [E, H] or None -> [T, H]. act: ("silu",) or ("swiglu_oai", alpha, limit)."""
    if act[0] not in ("silu", "swiglu_oai"):
        raise NotImplementedError(f"the Triton expert kernels have no activation {act[0]!r}")
    oai = act[0] == "swiglu_oai"
    alpha, limit = (float(act[1]), float(act[2])) if oai else (0.0, 0.0)
    bias = b_gate_up is not None
    T, H = x.shape
    E, two_i, _ = w_gate_up.shape
    inter, k = two_i // 2, ids.shape[1]
    x = x.contiguous()
    rows, block_expert = sort_by_expert(ids, E)
    P = rows.shape[0]
    h = torch.empty(P, inter, device=x.device, dtype=x.dtype)
    y = torch.empty(T * k, H, device=x.device, dtype=x.dtype)
    f32 = INTERPRET or x.dtype == torch.float32  # the interpreter's bf16 dot is not to be trusted
    nb = P // BLOCK_M
    bg = b_gate_up if bias else w_gate_up  # a placeholder pointer when there is no bias
    bd = b_down if bias else w_down
    _gate_up_kernel[(nb, triton.cdiv(inter, BLOCK_N))](
        x, w_gate_up, bg, h, rows, block_expert, H, inter, k, x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1),
        bg.stride(0), h.stride(0), alpha, limit, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, F32_DOT=f32,
        BIAS=bias, OAI=oai, num_warps=4)
    _down_kernel[(nb, triton.cdiv(H, BLOCK_N))](
        h, w_down, bd, y, rows, block_expert, weights.contiguous().view(-1), inter, H, h.stride(0), w_down.stride(0),
        w_down.stride(1), bd.stride(0), y.stride(0), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        F32_DOT=f32, BIAS=bias, num_warps=4)
    return y.view(T, k, H).sum(1)
