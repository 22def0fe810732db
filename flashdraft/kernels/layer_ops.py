"""Fused Triton kernels for the elementwise work around the GEMMs of a decoder layer. In a bf16
decode step the torch path launches ~52 kernels per layer (RMSNorm alone is six: cast, pow, mean,
add, rsqrt, mul, plus the weight multiply and cast back; q/k norms, rotate-half RoPE with neg/cat,
the K/V store, residual adds, silu * mul). With these a layer is 9 launches (10 when attention
splits K): add_rmsnorm, qkv GEMM, qk_norm_rope_store, attention, o GEMM, add_rmsnorm, gate_up GEMM,
silu_mul, down GEMM. The DFlash context write of all drafter layers drops from ~17 per layer to 4.

    add_rmsnorm         r = x + residual; weight * rmsnorm(r)            one program per row
    qk_norm_rope_store  packed qkv -> q (q_norm, RoPE) into a new tensor,  (token, group of heads)
                        K (k_norm, RoPE) and V straight into the cache
    silu_mul            [T, 2I] -> silu(gate) * up                         (row, 1024 columns)
    context_kv_store    the DFlash context write: every drafter layer's    (token, group of
                        k_norm + RoPE + K/V store after one stacked GEMM   (layer, kv head) rows)

Head kernels work on [heads, head_dim] tiles of up to HEAD_TILE elements; a lane's rotate-half
partner is loaded from memory (the row is in L1) instead of shuffled in registers. Rounding follows
the torch modules of models/layers.py / rope.py op by op: float32 math, rounded to the activation
dtype wherever a torch op's result is (the normalised row before and after the weight multiply,
RoPE's two products and their sum, silu before the multiply). In float32 the results equal the
torch path's up to reduction order; in bf16 an occasional last bit differs.

Only masked loads/stores, reductions and scalar branches; grids depend on shapes only, never on
values, so every launch is CUDA-graph safe. Slots < 0 are not stored. Importing this module needs
triton; the switch that decides whether the models use it is kernels/dispatch.py's `fused_enabled`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flashdraft import settings
from flashdraft.kernels.attention import to_page
from flashdraft.kernels.launch import launch_kwargs, pdl_enter, pdl_trigger

SILU_BLOCK = 1024  # columns per silu_mul program
HEAD_TILE = 2048  # elements (heads x padded head_dim) per q/k/context program


def _heads_per_program(rows: int, block_d: int) -> int:
    return max(1, min(triton.next_power_of_2(rows), HEAD_TILE // block_d))


@triton.jit
def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps,
                        stride_x, stride_r, stride_o, stride_ro,
                        N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr, OFFSET: tl.constexpr,
                        PARTS: tl.constexpr, EARLY: tl.constexpr, USE_PDL: tl.constexpr):
    """One row: r = x + res (rounded to the residual dtype, stored), out = w * rmsnorm(r); OFFSET:
    out = rmsnorm(r) * (1 + w) in float32, rounded once (the zero-centred norms of hybrid targets).
    PARTS > 1 (with a residual): x is that many consecutive rows of N, summed in order in float32 and
    rounded to the residual's dtype first.
    EARLY: the next kernel (a GEMM) may launch at once and wait on the GPU for this one (its blocks
    scheduled meanwhile; the GEMMs here signal only before their stores, so no chain of waiting
    kernels builds up)."""
    if EARLY:
        pdl_trigger(USE_PDL)
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < N
    x = tl.load(x_ptr + row * stride_x + d, mask=ok, other=0.0)
    if PARTS > 1:
        xs = x.to(tl.float32)
        for p in tl.static_range(1, PARTS):
            xs += tl.load(x_ptr + row * stride_x + p * N + d, mask=ok, other=0.0).to(tl.float32)
        x = xs.to(res_out_ptr.dtype.element_ty)  # the residual's dtype (float32 split-K parts: bf16)
    if HAS_RES:
        dt = res_out_ptr.dtype.element_ty
        r = tl.load(res_ptr + row * stride_r + d, mask=ok, other=0.0)
        s = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * stride_ro + d, s, mask=ok)
        h = s.to(tl.float32)
    else:
        dt = x_ptr.dtype.element_ty
        h = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(h * h, 0) / N + eps)
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    if OFFSET:
        y = h * inv * (1.0 + w)
    else:
        y = w * (h * inv).to(dt).to(tl.float32)
    if not EARLY:
        pdl_trigger(USE_PDL)
    tl.store(out_ptr + row * stride_o + d, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_rope(x, xr, w, wr, c, s, lo, eps, HEAD_DIM: tl.constexpr, HAS_NORM: tl.constexpr,
               OFFSET: tl.constexpr = False):
    """Head rows x [rows, BLOCK_D] as loaded (activation dtype) and their rotate-half partners xr
    (lane d holds x[d + R/2] where `lo`, else x[d - R/2], R the rotary dims): optional RMSNorm with
    weights w / wr (at the same lanes; OFFSET: times (1 + w) in float32, rounded once), then RoPE with
    cos/sin c, s (1 and 0 past the rotary dims). Loading the partners directly avoids register
    shuffles. Returns the rows in the activation dtype."""
    dt = x.dtype
    xf = x.to(tl.float32)
    xrf = xr.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(xf * xf, 1) / HEAD_DIM + eps)[:, None]
        if OFFSET:
            xf = (xf * inv * (1.0 + w.to(tl.float32))).to(dt).to(tl.float32)
            xrf = (xrf * inv * (1.0 + wr.to(tl.float32))).to(dt).to(tl.float32)
        else:
            xf = (w.to(tl.float32) * (xf * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
            xrf = (wr.to(tl.float32) * (xrf * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    xrf = tl.where(lo, -xrf, xrf)
    return ((xf * c.to(tl.float32)).to(dt).to(tl.float32) + (xrf * s.to(tl.float32)).to(dt).to(tl.float32)).to(dt)


@triton.jit
def _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, stride_cos, stride_sin, d, ROT: tl.constexpr):
    """The rotary cos/sin rows [1, BLOCK_D] of token t's position; 1 and 0 past the ROT rotary dims."""
    pos = tl.load(pos_ptr + t).to(tl.int64)
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=d < ROT, other=1.0)[None, :]
    s = tl.load(sin_ptr + pos * stride_sin + d, mask=d < ROT, other=0.0)[None, :]
    return c, s


@triton.jit
def _qk_norm_rope_store_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_ptr, kc_ptr, vc_ptr, slot_ptr,
                               eps, k_inv, v_inv, stride_t, stride_cos, stride_sin, stride_qt, stride_qh,
                               stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                               N_HEADS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr,
                               BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
                               HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr, ROT: tl.constexpr,
                               Q_WIDTH: tl.constexpr, OFFSET: tl.constexpr):
    """Program (token, group of BLOCK_H heads) over the packed row's q heads [0, N_HEADS) (Q_WIDTH
    apart: a gated head's output gate follows its query) and k heads [N_HEADS, N_HEADS + N_KV): q
    rows go to q, k rows (rotated) and the matching v rows (raw) to the caches at the token's slot,
    unless it is < 0. RoPE turns the first ROT dims of a head. Lets the next kernel (attention)
    launch at once: attention reads what this stores only after waiting for it to finish, and
    meanwhile fetches the K/V cached by earlier steps. Before its own wait it reads what no kernel
    of the step writes: the position's cos/sin rows, the token's slot (both copied in before the
    step) and the norm weights. (Its work done inside the attention kernel instead, or in the qkv
    GEMM's epilogue, made decode steps slower: docs/performance.md section 12.)"""
    pdl_trigger(USE_PDL)
    HALF: tl.constexpr = ROT // 2
    t = tl.program_id(0).to(tl.int64)
    r = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # head index in the packed row
    d = tl.arange(0, BLOCK_D)
    lo = (d < HALF)[None, :]
    rot = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))
    d_ok = (d < HEAD_DIM)[None, :]
    is_q = (r < N_HEADS)[:, None]
    is_k = ((r >= N_HEADS) & (r < N_HEADS + N_KV))[:, None]
    mask = (is_q | is_k) & d_ok
    start = tl.where(r < N_HEADS, r * Q_WIDTH, N_HEADS * Q_WIDTH + (r - N_HEADS) * HEAD_DIM)
    row = qkv_ptr + t * stride_t + start[:, None]
    c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, stride_cos, stride_sin, d, ROT)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if HAS_NORM:
        w = tl.where(is_q, tl.load(qw_ptr + d, mask=d < HEAD_DIM, other=0.0)[None, :],
                     tl.load(kw_ptr + d, mask=d < HEAD_DIM, other=0.0)[None, :])
        wr = tl.where(is_q, tl.load(qw_ptr + rot, mask=d < HEAD_DIM, other=0.0)[None, :],
                      tl.load(kw_ptr + rot, mask=d < HEAD_DIM, other=0.0)[None, :])
    pdl_enter(USE_PDL)
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    xr = tl.load(row + rot[None, :], mask=mask, other=0.0)
    if not HAS_NORM:
        w = x
        wr = xr
    out = _norm_rope(x, xr, w, wr, c, s, lo, eps, HEAD_DIM, HAS_NORM, OFFSET)
    tl.store(q_ptr + t * stride_qt + r[:, None] * stride_qh + d[None, :], out, mask=is_q & d_ok)
    # the slot test as a vector: the interpreter mis-types scalar & vector masks
    keep = is_k & d_ok & ((d * 0 + slot) >= 0)[None, :]
    page = slot // PAGE
    off = slot % PAGE
    j = (r - N_HEADS)[:, None]
    v = tl.load(row + N_KV * HEAD_DIM + d[None, :], mask=keep, other=0.0)
    # (FP8 pages: the k row rounded to the activations' dtype first, as the unfused path stores it)
    tl.store(kc_ptr + page * stride_kcb + off * stride_kcs + j * stride_kch + d[None, :],
             to_page(out.to(q_ptr.dtype.element_ty), k_inv, kc_ptr.dtype.element_ty), mask=keep)
    tl.store(vc_ptr + page * stride_vcb + off * stride_vcs + j * stride_vch + d[None, :],
             to_page(v, v_inv, vc_ptr.dtype.element_ty), mask=keep)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (row, chunk): out = silu(gate) * up, gate = x[:, :inter], up = x[:, inter:]."""
    pdl_enter(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = col < inter
    dt = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * stride_x + col, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + inter + col, mask=ok, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    pdl_trigger(USE_PDL)
    tl.store(out_ptr + row * stride_o + col, (s * u).to(dt), mask=ok)


@triton.jit
def _context_kv_kernel(kv_ptr, pos_ptr, cos_ptr, sin_ptr, kw_ptr, kc_ptr, vc_ptr, slot_ptr, eps,
                       stride_t, stride_cos, stride_sin, stride_kw,
                       stride_kcl, stride_kcb, stride_kcs, stride_kch, stride_vcl, stride_vcb, stride_vcs, stride_vch,
                       N_LAYERS: tl.constexpr, N_KV: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                       BLOCK_D: tl.constexpr, PAGE: tl.constexpr, HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (token, group of BLOCK_H (layer, kv head) rows) of the stacked projection, whose
    layer l chunk is [k heads | v heads]: K normed with layer l's k_norm and rotated, V raw, into
    layer l's caches (cache base + l * layer stride)."""
    pdl_enter(USE_PDL)
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    layer = (r // N_KV)[:, None]
    j = (r % N_KV)[:, None]
    d = tl.arange(0, BLOCK_D)
    lo = (d < HALF)[None, :]
    rot = tl.where(d < HALF, d + HALF, d - HALF)[None, :]
    mask = (r < N_LAYERS * N_KV)[:, None] & (d < HEAD_DIM)[None, :]
    row = kv_ptr + t * stride_t + (layer * 2 * N_KV + j) * HEAD_DIM
    x = tl.load(row + d[None, :], mask=mask, other=0.0)
    xr = tl.load(row + rot, mask=mask, other=0.0)
    if HAS_NORM:
        w = tl.load(kw_ptr + layer * stride_kw + d[None, :], mask=mask, other=0.0)
        wr = tl.load(kw_ptr + layer * stride_kw + rot, mask=mask, other=0.0)
    else:
        w = x
        wr = xr
    c, s = _cos_sin(pos_ptr, cos_ptr, sin_ptr, t, stride_cos, stride_sin, d, HEAD_DIM)
    k = _norm_rope(x, xr, w, wr, c, s, lo, eps, HEAD_DIM, HAS_NORM)
    v = tl.load(row + N_KV * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    lay = layer.to(tl.int64)
    page = slot // PAGE
    off = slot % PAGE
    pdl_trigger(USE_PDL)
    tl.store(kc_ptr + lay * stride_kcl + page * stride_kcb + off * stride_kcs + j * stride_kch + d[None, :],
             to_page(k.to(kv_ptr.dtype.element_ty), 1.0, kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + lay * stride_vcl + page * stride_vcb + off * stride_vcs + j * stride_vch + d[None, :],
             to_page(v, 1.0, vc_ptr.dtype.element_ty), mask=mask)


# ---- wrappers -------------------------------------------------------------------------------------
def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last dim] with a unit last stride (a view when possible)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                eps: float, offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight * rmsnorm(x + residual), x + residual), the sum rounded to x's dtype first, as
    `RMSNorm(h + a)` computes it. residual None: (weight * rmsnorm(x), x). Any row width.
    offset: (1 + weight) in float32 and the result in x's dtype, as hybrid.OffsetRMSNorm.
    x [..., P, n] beside residual [..., n]: P parts of each row (a MoE's weighted expert outputs, a
    split-K GEMM's float32 parts), summed in order in float32 and rounded to the residual's dtype
    before the add, as join_parts(x) would."""
    n = x.shape[-1]
    parts = 1
    dtype = x.dtype
    if residual is not None and x.dim() == residual.dim() + 1:
        if x.shape[:-2] != residual.shape[:-1] or x.shape[-1] != residual.shape[-1]:
            raise ValueError(f"parts {tuple(x.shape)} do not fit the residual {tuple(residual.shape)}")
        parts, dtype = x.shape[-2], residual.dtype
        x = x.reshape(*x.shape[:-2], parts * n)
    x2 = _rows(x)
    rows = x2.shape[0]
    shape = x.shape[:-1] + (n,)
    out = torch.empty(shape, device=x.device, dtype=dtype if offset else torch.promote_types(weight.dtype, dtype))
    new_res = torch.empty(shape, device=x.device, dtype=dtype) if residual is not None else x
    if rows == 0:
        return out, new_res
    r2 = _rows(residual) if residual is not None else x2
    nr2 = new_res.view(-1, n) if residual is not None else x2  # not written without a residual
    o2 = out.view(-1, n)
    block = triton.next_power_of_2(n)
    _add_rmsnorm_kernel[(rows,)](x2, r2, weight, o2, nr2, eps, x2.stride(0), r2.stride(0), o2.stride(0),
                                 nr2.stride(0), N=n, BLOCK=block, HAS_RES=residual is not None, OFFSET=offset,
                                 PARTS=parts, EARLY=settings.NORM_TRIGGER == "early",
                                 num_warps=8 if block >= 4096 else 4, **launch_kwargs(x2))
    return out, new_res


def join_parts(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """x as add_rmsnorm reads it beside a residual like `like`: parts [..., P, n] summed in slot order
    in float32 and rounded to like's dtype; anything else as it is."""
    if x.dim() != like.dim() + 1:
        return x
    acc = x[..., 0, :].float()
    for p in range(1, x.shape[-2]):
        acc = acc + x[..., p, :].float()
    return acc.to(like.dtype)


def _check_rope(cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int) -> None:
    if cos.shape[-1] != rotary_dim or sin.shape[-1] != rotary_dim or cos.stride(-1) != 1 or sin.stride(-1) != 1:
        raise ValueError(f"rope tables must be [max_len, {rotary_dim}] with unit last stride, "
                         f"got {tuple(cos.shape)} / {tuple(sin.shape)}")


def qk_norm_rope_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       q_norm_w: torch.Tensor | None, k_norm_w: torch.Tensor | None, eps: float,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       gated: bool = False, offset: bool = False, kv_scale: tuple[float, float] = (1.0, 1.0)
                       ) -> torch.Tensor:
    """qkv: [T, (H + 2 * KV) * D] packed projection (q heads, k heads, v heads; gated: each q head
    followed by its output gate, [T, (2 H + 2 KV) * D]); cos/sin: full tables [max_len, R]
    (RotaryTable.cos/.sin, R <= D the rotary dims) read at `positions` [T]; caches [blocks, page, KV,
    D]. Returns q [T, H, D] after q_norm (when given; offset: (1 + w) norms) and RoPE; K (k_norm,
    RoPE) and V are stored at slot_mapping [T] (< 0: skipped); FP8 pages hold them divided by kv_scale
    (attention/kv_scales.py). q_norm_w and k_norm_w are both given or both None."""
    n_kv, hd = k_cache.shape[2], k_cache.shape[3]
    T = qkv.shape[0]
    q_width = 2 * hd if gated else hd
    n_heads = (qkv.shape[1] - 2 * n_kv * hd) // q_width
    if n_heads < 1 or qkv.shape[1] != n_heads * q_width + 2 * n_kv * hd:
        raise ValueError(f"qkv width {qkv.shape[1]} is not ({'2 ' if gated else ''}H + 2 * {n_kv}) * {hd}")
    if (q_norm_w is None) != (k_norm_w is None):
        raise ValueError("give both q and k norm weights or neither")
    rotary = cos.shape[-1]
    if rotary > hd or rotary % 2:
        raise ValueError(f"rotary dims {rotary} must be even and at most the head dim {hd}")
    _check_rope(cos, sin, rotary)
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    q = torch.empty(T, n_heads, hd, device=qkv.device, dtype=qkv.dtype)
    if T == 0:
        return q
    has_norm = q_norm_w is not None
    block_d = triton.next_power_of_2(hd)
    block_h = _heads_per_program(n_heads + n_kv, block_d)
    _qk_norm_rope_store_kernel[(T, triton.cdiv(n_heads + n_kv, block_h))](
        qkv, positions, cos, sin, q_norm_w if has_norm else qkv, k_norm_w if has_norm else qkv, q, k_cache, v_cache,
        slot_mapping, eps, 1.0 / kv_scale[0], 1.0 / kv_scale[1], qkv.stride(0), cos.stride(0), sin.stride(0),
        q.stride(0), q.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], N_HEADS=n_heads, N_KV=n_kv, HEAD_DIM=hd, BLOCK_H=block_h,
        BLOCK_D=block_d, PAGE=k_cache.shape[1], HAS_NORM=has_norm, num_warps=4, ROT=rotary, Q_WIDTH=q_width,
        OFFSET=offset, **launch_kwargs(qkv))
    return q


@triton.jit
def _sigmoid_gate_kernel(o_ptr, g_ptr, out_ptr, heads, stride_gt, stride_gh, N: tl.constexpr, BLOCK: tl.constexpr,
                         USE_PDL: tl.constexpr):
    """Program (row, head): out = o * sigmoid(g), the sigmoid rounded to the activation dtype first.
    Signals at its start, as add_rmsnorm does: the o_proj GEMM after it is scheduled meanwhile. The
    gate (the layer's input projection, finished before the kernel before this one signalled) is
    read before the wait."""
    pdl_trigger(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < N
    dt = out_ptr.dtype.element_ty
    g = tl.load(g_ptr + t * stride_gt + h * stride_gh + d, mask=ok, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    o = tl.load(o_ptr + (t * heads + h) * N + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + (t * heads + h) * N + d, (o * tl.sigmoid(g).to(dt).to(tl.float32)).to(dt), mask=ok)


def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(gate) as torch rounds it, o [T, H, D] and gate [T, H, D] (rows and heads strided)."""
    o = o.contiguous()
    T, heads, n = o.shape
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    out = torch.empty_like(o)
    if T:
        _sigmoid_gate_kernel[(T, heads)](o, gate, out, heads, gate.stride(0), gate.stride(1), N=n,
                                         BLOCK=triton.next_power_of_2(n), **launch_kwargs(o))
    return out


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]: silu(gate) * up, gate the first half of the last dim."""
    inter = gate_up.shape[-1] // 2
    x2 = _rows(gate_up)
    out = torch.empty(*gate_up.shape[:-1], inter, device=gate_up.device, dtype=gate_up.dtype)
    if x2.shape[0] == 0 or inter == 0:
        return out
    o2 = out.view(-1, inter)
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, SILU_BLOCK))](x2, o2, inter, x2.stride(0), o2.stride(0),
                                                                   BLOCK=SILU_BLOCK, num_warps=4, **launch_kwargs(x2))
    return out


def _layer_stride(caches: list[torch.Tensor]) -> int | None:
    """Element stride between consecutive layers when the per-layer caches are equally spaced
    views of one storage (model runners allocate [L, blocks, page, KV, D] and hand out [i]);
    None when they are separate tensors."""
    base = caches[0]
    if len(caches) == 1:
        return 0
    step = caches[1].data_ptr() - base.data_ptr()
    if step % base.element_size():
        return None
    storage = base.untyped_storage().data_ptr()
    for i, c in enumerate(caches):
        if (c.data_ptr() - base.data_ptr() != i * step or c.shape != base.shape or c.stride() != base.stride()
                or c.dtype != base.dtype or c.untyped_storage().data_ptr() != storage):
            return None
    return step // base.element_size()


def context_kv_store(kv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     k_norm_w: torch.Tensor | None, eps: float, kv_cache, slot_mapping: torch.Tensor) -> None:
    """The DFlash context write after the stacked GEMM. kv: [T, L * 2 * KV * D], layer l's chunk is
    its k heads then its v heads; k_norm_w: [L, D] (or None); kv_cache: L (k_cache, v_cache) pairs.
    One launch when the caches are views of stacked [L, ...] tensors, else one per layer."""
    k_caches = [k for k, _ in kv_cache]
    v_caches = [v for _, v in kv_cache]
    n_layers = len(k_caches)
    n_kv, hd = k_caches[0].shape[2], k_caches[0].shape[3]
    T = kv.shape[0]
    if kv.shape[1] != n_layers * 2 * n_kv * hd:
        raise ValueError(f"kv width {kv.shape[1]} is not {n_layers} layers x 2 x {n_kv} x {hd}")
    _check_rope(cos, sin, hd)
    if T == 0:
        return
    if kv.stride(-1) != 1:
        kv = kv.contiguous()
    has_norm = k_norm_w is not None
    if has_norm:
        assert k_norm_w.shape == (n_layers, hd) and k_norm_w.stride(-1) == 1
    kw = k_norm_w if has_norm else kv
    kw_stride = kw.stride(0) if has_norm else 0
    block_d = triton.next_power_of_2(hd)
    consts = dict(N_KV=n_kv, HEAD_DIM=hd, BLOCK_D=block_d, PAGE=k_caches[0].shape[1], HAS_NORM=has_norm, num_warps=4)
    k_step, v_step = _layer_stride(k_caches), _layer_stride(v_caches)
    if k_step is not None and v_step is not None:
        launches = [(kv, kw, k_caches[0], v_caches[0], n_layers)]
    else:  # separate tensors: the same kernel, one layer per launch
        width = 2 * n_kv * hd
        launches = [(kv[:, i * width:], kw[i:] if has_norm else kw, k_caches[i], v_caches[i], 1)
                    for i in range(n_layers)]
        k_step = v_step = 0
    for src, w, kc, vc, layers in launches:
        assert kc.stride(-1) == 1 and vc.stride(-1) == 1
        block_h = _heads_per_program(layers * n_kv, block_d)
        _context_kv_kernel[(T, triton.cdiv(layers * n_kv, block_h))](
            src, positions, cos, sin, w, kc, vc, slot_mapping, eps, src.stride(0), cos.stride(0), sin.stride(0),
            kw_stride, k_step, *kc.stride()[:3], v_step, *vc.stride()[:3], N_LAYERS=layers, BLOCK_H=block_h, **consts,
            **launch_kwargs(kv))
