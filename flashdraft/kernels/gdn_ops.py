"""Gated DeltaNet layers on the GPU: the causal conv and the recurrence of every sequence of a step in
three Triton launches, reading and writing the state slots in place (models/gdn.py has the math
and the torch reference; this file follows it operation for operation, in float32 inside the kernels).

A step's sequences are described by two device tensors, so the launches need no host values and
can be captured in CUDA graphs: `qsl` [S + 1] (row offsets, int32) and `seq` [S, 3] (slot, fresh,
keep; slot -1 = a padding sequence). Per step:

    conv      mixed[t] = silu(sum_j w[:, j] x[t - K + 1 + j])     grid (rows, channel blocks)
              x before the sequence's first row comes from its slot's conv window (zeros when fresh)
    window    the slot's conv window <- the last K - 1 inputs         grid (sequences, channel blocks)
    recur     S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; o = S^T q, per row in order
                                                                      grid (sequences, heads_v, d_v blocks)

A decode step (no sequence with more than one row) moves the windows inside the conv launch, whose
program for a row owns its channels' window: two launches. The recurrence also zeroes the output rows
that belong to no sequence (a graph's padding), so no row of its output is left unwritten.

The third column of `seq` is the sequence's mode: KEEP (its rows may be rejected: a DFlash verify)
leaves the slot as it was, and `commit` runs the window and recur launches again over the first
`take` rows of that step (their conv outputs kept from the step), which stores exactly the state
after the last accepted row. CHUNKED (a long committed chunk: a prefill) has its conv and window
here and its recurrence by fla-core's chunked kernel (`chunked`), which reads the slot's state and
writes the state after the chunk, as transformers prefills these layers on a GPU. COMMIT (the rest:
decode rows, short chunks) runs the recurrent form here, one row after another inside each program.

The layer's gated RMSNorm (w * rmsnorm(o) * silu(z)) is one more kernel (gated_norm)."""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from flashdraft import settings
from flashdraft.kernels.launch import launch_kwargs, pdl_enter, pdl_trigger

BLOCK_C = 128  # conv channels per program (the recurrence's value columns a program: settings.GDN_BLOCK_V)
COMMIT, KEEP, CHUNKED = 0, 1, 2  # a sequence's mode (seq[:, 2])
CHUNKED_MIN_ROWS = 64  # a committed chunk of at least this many rows takes the chunked kernel (one fla chunk)


@triton.jit
def _spread(flag, like):
    """A scalar condition as a mask of `like`'s shape: Triton's interpreter takes no scalar in a block
    mask (compiled, the two are the same)."""
    return (like * 0 + flag.to(tl.int32)) != 0


@triton.jit
def _conv_kernel(x_ptr, w_ptr, win_ptr, out_ptr, qsl_ptr, seq_ptr, S, C, stride_x, stride_out,
                 K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_C: tl.constexpr, WINDOW: tl.constexpr,
                 USE_PDL: tl.constexpr):
    """WINDOW (every sequence has at most one row: decode): the row's program also moves its
    channels' conv window on by its input, as _window_kernel would (entry i - 1 <- tap i, each
    entry written after the tap that reads it). Signals right after its wait: the recurrence after it
    loads its state meanwhile."""
    pdl_enter(USE_PDL)
    pdl_trigger(USE_PDL)
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    ends = tl.load(qsl_ptr + 1 + tl.arange(0, BLOCK_S), mask=tl.arange(0, BLOCK_S) < S, other=2**30)
    s = tl.sum((ends <= t).to(tl.int32))  # the row's sequence
    if s >= S:
        return  # a padding row
    j = t - tl.load(qsl_ptr + s)  # the row's index in its sequence
    slot = tl.load(seq_ptr + 3 * s)
    from_slot = (slot >= 0) & (tl.load(seq_ptr + 3 * s + 1) == 0)
    if WINDOW:
        move = (slot >= 0) & (tl.load(seq_ptr + 3 * s + 2) != 1)  # not a kept row (KEEP waits for the commit)
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for i in tl.static_range(K):
        idx = j - (K - 1) + i  # < 0: in the conv window before the step's rows
        xv = tl.load(x_ptr + (t - (K - 1) + i) * stride_x + c, mask=cm & _spread(idx >= 0, c), other=0.0).to(tl.float32)
        wv = tl.load(win_ptr + (slot * C + c) * (K - 1) + (K - 1) + idx, mask=cm & _spread((idx < 0) & from_slot, c),
                     other=0.0).to(tl.float32)
        acc += tl.load(w_ptr + c * K + i, mask=cm, other=0.0).to(tl.float32) * (xv + wv)
        if WINDOW and i > 0:
            tl.store(win_ptr + (slot * C + c) * (K - 1) + i - 1, (xv + wv).to(win_ptr.dtype.element_ty),
                     mask=cm & _spread(move, c))
    acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + t * stride_out + c, acc.to(out_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _window_kernel(x_ptr, win_ptr, qsl_ptr, seq_ptr, take_ptr, C, stride_x, K: tl.constexpr, COMMIT: tl.constexpr,
                   BLOCK_C: tl.constexpr, USE_PDL: tl.constexpr):
    """The slot's conv window after n more inputs (n: the step's rows, or in a commit `take`)."""
    pdl_enter(USE_PDL)
    s = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cm = c < C
    slot = tl.load(seq_ptr + 3 * s)
    r0 = tl.load(qsl_ptr + s)
    if COMMIT:
        n = tl.load(take_ptr + s)
    else:
        n = tl.load(qsl_ptr + s + 1) - r0
        n = tl.where(tl.load(seq_ptr + 3 * s + 2) == 1, 0, n)  # kept rows (KEEP) wait for the commit
    if (slot < 0) | (n == 0):
        return
    from_slot = tl.load(seq_ptr + 3 * s + 1) == 0
    pdl_trigger(USE_PDL)
    # in place: entry i of the new window reads entry i + n > i of the old one, so filling i upwards
    # never reads an entry already written (each program owns its channels)
    for i in tl.static_range(K - 1):
        pos = n - (K - 1) + i
        xv = tl.load(x_ptr + (r0 + pos) * stride_x + c, mask=cm & _spread(pos >= 0, c), other=0.0)
        wv = tl.load(win_ptr + (slot * C + c) * (K - 1) + (K - 1) + pos, mask=cm & _spread((pos < 0) & from_slot, c),
                     other=0.0)
        tl.store(win_ptr + (slot * C + c) * (K - 1) + i, (xv.to(tl.float32) + wv.to(tl.float32))
                 .to(win_ptr.dtype.element_ty), mask=cm)


@triton.jit
def _recur_kernel(mixed_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, out_ptr, qsl_ptr, seq_ptr, take_ptr,
                  stride_m, stride_ab, stride_out, key_dim, HV, rep, scale, T, DK: tl.constexpr, DV: tl.constexpr,
                  BLOCK_V: tl.constexpr, COMMIT: tl.constexpr, USE_PDL: tl.constexpr):
    """Program (sequence, value head, BLOCK_V value columns). The last sequence's programs also zero
    the output rows past every sequence's (a graph's padding rows), so no row is left unwritten.
    Before waiting for the previous kernel (PDL, launch.py) a program reads what no kernel of the
    step writes: the step's metadata (copied in before it), its state block (written by this layer's
    launch of an earlier step) and the layer's constants; the conv launch before it signals right
    after its own wait, so this load overlaps the conv. Everything else comes after the wait, and every program
    waits (the grid completes only after its predecessor)."""
    s = tl.program_id(0)
    hv = tl.program_id(1)
    v0 = tl.program_id(2) * BLOCK_V
    vv = v0 + tl.arange(0, BLOCK_V)
    slot = tl.load(seq_ptr + 3 * s)
    fresh = tl.load(seq_ptr + 3 * s + 1) != 0
    r0 = tl.load(qsl_ptr + s)
    if COMMIT:  # the first `take` rows of the step (0: the sequence is not committed here)
        r1 = r0 + tl.load(take_ptr + s)
        store = slot >= 0
    else:  # the step's rows; none for a CHUNKED sequence (the chunked kernel's)
        mode = tl.load(seq_ptr + 3 * s + 2)
        r1 = tl.where(mode == 2, r0, tl.load(qsl_ptr + s + 1))
        store = (slot >= 0) & (mode == 0)
    kk = tl.arange(0, DK)
    sp = state_ptr + ((tl.maximum(slot, 0) * HV + hv) * DK + kk[:, None]) * DV + vv[None, :]
    tile = kk[:, None] + vv[None, :]
    st = tl.load(sp, mask=_spread((slot >= 0) & ~fresh & (r1 > r0), tile), other=0.0)  # [DK, BLOCK_V] float32
    hk = hv // rep
    neg_a = -tl.exp(tl.load(alog_ptr + hv).to(tl.float32))
    dtb = tl.load(dtb_ptr + hv).to(tl.float32)
    pdl_enter(USE_PDL)
    if not COMMIT:
        if s == tl.num_programs(0) - 1:
            for t in range(tl.load(qsl_ptr + s + 1), T):
                tl.store(out_ptr + t * stride_out + hv * DV + vv, tl.zeros([BLOCK_V], dtype=out_ptr.dtype.element_ty))
    if r1 == r0:
        return
    for t in range(r0, r1):
        row = mixed_ptr + t * stride_m
        q = tl.load(row + hk * DK + kk).to(tl.float32)
        k = tl.load(row + key_dim + hk * DK + kk).to(tl.float32)
        v = tl.load(row + 2 * key_dim + hv * DV + vv).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q) + 1e-6) * scale
        k = k * tl.rsqrt(tl.sum(k * k) + 1e-6)
        beta = tl.sigmoid(tl.load(b_ptr + t * stride_ab + hv).to(tl.float32))
        x = tl.load(a_ptr + t * stride_ab + hv).to(tl.float32) + dtb
        g = neg_a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # softplus, threshold 20 as torch's
        st = st * tl.exp(g)
        delta = (v - tl.sum(st * k[:, None], 0)) * beta
        st = st + k[:, None] * delta[None, :]
        if not COMMIT:
            o = tl.sum(st * q[:, None], 0)
            tl.store(out_ptr + t * stride_out + hv * DV + vv, o.to(out_ptr.dtype.element_ty))
    pdl_trigger(USE_PDL)
    tl.store(sp, st, mask=_spread(store, tile))


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def conv_rows(qkv: torch.Tensor, weight: torch.Tensor, window: torch.Tensor, qsl: torch.Tensor,
              seq: torch.Tensor, out: torch.Tensor | None = None, window_too: bool = False) -> torch.Tensor:
    """silu(causal depthwise conv) of every row of the step: [T, C] in qkv's dtype (into `out` when
    given); padding rows are left unwritten. window_too (only when no sequence has more than one
    row): the conv windows move on in the same launch, as advance_windows would move them."""
    T, C = qkv.shape
    K = weight.shape[-1]
    if out is None:  # padding rows stay unwritten: the recurrence reads only its sequences' rows
        out = torch.empty(T, C, device=qkv.device, dtype=qkv.dtype)
    S = seq.shape[0]
    if T and S:
        _conv_kernel[(T, triton.cdiv(C, BLOCK_C))](qkv, weight, window, out, qsl, seq, S, C, qkv.stride(0),
                                                   out.stride(0), K=K, BLOCK_S=_pow2(S), BLOCK_C=BLOCK_C,
                                                   WINDOW=window_too, **launch_kwargs(qkv))
    return out


def advance_windows(qkv: torch.Tensor, window: torch.Tensor, qsl: torch.Tensor, seq: torch.Tensor,
                    take: torch.Tensor | None = None) -> None:
    """Each slot's conv window after its sequence's rows (the kept ones skipped), or with `take`
    after the first take[s] rows of each sequence (a commit)."""
    S, C, K = seq.shape[0], window.shape[1], window.shape[2] + 1
    if S:
        _window_kernel[(S, triton.cdiv(C, BLOCK_C))](qkv, window, qsl, seq, take if take is not None else qsl,
                                                     C, qkv.stride(0), K=K, COMMIT=take is not None,
                                                     BLOCK_C=BLOCK_C, **launch_kwargs(qkv))


def recur(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
          state: torch.Tensor, qsl: torch.Tensor, seq: torch.Tensor, key_dim: int, heads_k: int,
          take: torch.Tensor | None = None) -> torch.Tensor | None:
    """The gated delta rule over every sequence's rows from its slot's state (zeros when fresh):
    outputs [T, heads_v * d_v] in mixed's dtype, each slot's state stored after its rows (KEEP ones
    not stored; CHUNKED ones skipped, the chunked kernel's). With `take`: no outputs, each slot's
    state after its first take[s] rows."""
    T = mixed.shape[0]
    S = seq.shape[0]
    _, HV, DK, DV = state.shape
    out = None if take is not None else torch.empty(T, HV * DV, device=mixed.device, dtype=mixed.dtype)
    if S:
        if a.stride(-1) != 1 or b.stride(-1) != 1 or a.stride(0) != b.stride(0):  # else slices of one projection
            a, b = a.contiguous(), b.contiguous()
        block_v = settings.GDN_BLOCK_V
        _recur_kernel[(S, HV, triton.cdiv(DV, block_v))](
            mixed, a, b, A_log, dt_bias, state, out if out is not None else mixed, qsl, seq,
            take if take is not None else qsl, mixed.stride(0), a.stride(0), HV * DV, key_dim, HV, HV // heads_k,
            DK**-0.5, T, DK=DK, DV=DV, BLOCK_V=min(block_v, DV), COMMIT=take is not None, **launch_kwargs(mixed))
    elif out is not None:
        out.zero_()
    return out


_fla = None


def chunked_available(device: torch.device) -> bool:
    """Whether fla-core's chunked gated delta rule can run here (CUDA, the package importable)."""
    global _fla
    if device.type != "cuda":
        return False
    if _fla is None:
        try:  # imported only on CUDA: the package queries the GPU driver at import
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule

            _fla = chunk_gated_delta_rule
        except ImportError as e:
            import logging

            logging.getLogger("flashdraft").warning(
                "fla-core is not importable (%s): GDN prefill runs the recurrent kernel", e)
            _fla = False
    return bool(_fla)


def chunked(mixed: torch.Tensor, a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
            state: torch.Tensor, spans: Any, key_dim: int, heads_k: int, out: torch.Tensor) -> None:
    """The recurrence of the CHUNKED sequences by fla-core's chunked kernel, in one varlen call: their
    outputs into out [T, heads_v * d_v], and each slot gets the state after its rows (the chunk
    starts from zeros when fresh). spans: the step's CHUNKED sequences (models/gdn.py ChunkedSpans)."""
    _, HV, DK, DV = state.shape
    N = spans.n
    m = spans.take(mixed)
    q = m[:, :key_dim].reshape(1, N, heads_k, DK)
    k = m[:, key_dim:2 * key_dim].reshape(1, N, heads_k, DK)
    v = m[:, 2 * key_dim:].reshape(1, N, HV, DV)
    if spans.placeholder:
        h0 = state.new_zeros(len(spans.cu_cpu) - 1, HV, DK, DV)
    else:
        h0 = state.index_select(0, spans.slots).masked_fill_(spans.fresh[:, None, None, None], 0.0)
    o, ht = _fla(q, k, v, spans.take(a)[None], spans.take(b)[None], initial_state=h0, output_final_state=True,
                 use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                 use_beta_sigmoid_in_kernel=True, cu_seqlens=spans.cu, cu_seqlens_cpu=spans.cu_cpu)
    spans.put(out, o[0].reshape(N, HV * DV).to(out.dtype))
    if not spans.placeholder:
        state.index_copy_(0, spans.slots, ht.to(state.dtype))


@triton.jit
def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, eps, heads, stride_z, N: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr):
    """One head row: w * rmsnorm(o) (each product rounded as torch rounds it) times silu(z) in float32.
    Signals at its start, as add_rmsnorm does: the out_proj GEMM after it is scheduled meanwhile.
    z (the layer's input projection, two kernels back, finished before the recurrence before this
    kernel signalled) and the weight are read before the wait."""
    pdl_trigger(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK)
    ok = d < N
    dt = out_ptr.dtype.element_ty
    w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + (row // heads) * stride_z + (row % heads) * N + d, mask=ok, other=0.0).to(tl.float32)
    pdl_enter(USE_PDL)
    h = tl.load(o_ptr + row * N + d, mask=ok, other=0.0).to(tl.float32)
    n = (h * tl.rsqrt(tl.sum(h * h, 0) / N + eps)).to(dt).to(tl.float32)
    hw = (w * n).to(dt).to(tl.float32)
    tl.store(out_ptr + row * N + d, (hw * (z * tl.sigmoid(z))).to(dt), mask=ok)


def gated_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GatedDeltaNet.gated_norm in one launch: o [T, heads, d_v], z [T, heads, d_v] (rows may be strided)."""
    o = o.contiguous()
    T, heads, n = o.shape
    if z.stride(2) != 1 or z.stride(1) != n:
        z = z.contiguous()
    out = torch.empty_like(o)
    if T:
        _gated_norm_kernel[(T * heads,)](o, z, weight, out, eps, heads, z.stride(0), N=n,
                                         BLOCK=triton.next_power_of_2(n), **launch_kwargs(o))
    return out
