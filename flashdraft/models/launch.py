"""Programmatic dependent launch (PDL) for flashdraft's Triton kernels, on Hopper and later.

A decode step is ~330 kernels in a row, each waiting for the one before. Launched with PDL, a kernel
may be scheduled while its predecessor is still running: every kernel here waits
(griddepcontrol.wait) until its predecessor has finished and its writes are visible before touching
memory the step writes, and signals (griddepcontrol.launch_dependents) that its own successor may
be scheduled once its main loop is done and only its stores are left. What overlaps is the launch
and block scheduling of the next kernel, and one read: paged attention fetches the metadata and the
K/V cached by earlier steps (memory no kernel of the step writes) before its wait, and
qk_norm_rope_store, its predecessor, signals at its start so that this fetch overlaps it. Results
are unchanged. Kernels of other libraries launched in between (cuBLAS, torch) neither signal nor
carry the launch attribute, and order as usual.

FLASHDRAFT_PDL=auto (default: on for CUDA devices of compute capability >= 9 when this Triton has
grid dependency control) or off. CUDA graphs record the launches with the attribute. Measured on
an H100 (benchmarks/device/gpu_roofline.py, Qwen3-8B shape): it made a one-row
decode 2% faster (6.07 -> 5.95 ms) and the batch-1 DFlash step 1% (7.89 -> 7.80 ms). add_rmsnorm
alone signals at its start (fused.NORM_TRIGGER): the GEMM after it is scheduled while it runs
(H200, Qwen3.5-4B decode in graph 1.3% faster at batch 1 and 8). Variants measured worse and gone:
signalling at the start of every kernel (one-row decode 3% faster than without PDL, but the 16-row
verify 7% slower: waiting kernels chain up and hold the SMs; at the start of add_rmsnorm and the
split-K merge, the step 2% slower, H100); prefetching each GEMM strip's first weight lines into L2
before the wait (against the signal before the stores alone: batch-8 decode 9% slower, the step
10%; one or two K tiles only: no gain); loading the first weight tile into registers before the wait
(H200, Qwen3.5-4B decode in graph 7% slower: the peeled tile costs the pipeline a stage); with
add_rmsnorm's early signal, prefetching the first 2 or 4 weight tiles into L2 before the wait
(H200, Qwen3.5-4B / -0.8B decode in graph at batch 1 and 8: 2 tiles within -1.5..+0.1%, 4 tiles
1.5-3.4% slower)."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

PDL = os.environ.get("FLASHDRAFT_PDL", "auto")
_MODES = {"off": 0, "auto": 1}
_capable: dict[torch.device, bool] = {}

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    _HAVE_GDC = True
except ImportError:  # older Triton
    _HAVE_GDC = False


def pdl_level(t: torch.Tensor) -> int:
    """0 (no PDL) or 1 for kernels over `t` (see PDL)."""
    if PDL not in _MODES:
        raise ValueError(f"FLASHDRAFT_PDL must be one of {', '.join(_MODES)}, got {PDL!r}")
    if PDL == "off" or not _HAVE_GDC or t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return 0
    if t.device not in _capable:
        _capable[t.device] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _MODES[PDL] if _capable[t.device] else 0


def launch_kwargs(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch over `t`: USE_PDL and, when on, launch_pdl."""
    level = pdl_level(t)
    return {"USE_PDL": level, "launch_pdl": True} if level else {"USE_PDL": 0}


@contextlib.contextmanager
def pdl_mode(mode: str):
    """Temporarily set PDL (benchmarks). CUDA graphs keep the launches they were captured with."""
    global PDL
    old, PDL = PDL, mode
    try:
        yield
    finally:
        PDL = old


@triton.jit
def pdl_enter(USE_PDL: tl.constexpr):
    """First statement of every kernel: wait for the previous kernel and its writes."""
    if USE_PDL > 0:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Before a kernel's final stores: let the next kernel launch."""
    if USE_PDL > 0:
        tl.extra.cuda.gdc_launch_dependents()



# L2 prefetch of the next GEMM's weights (see prefetch_args); FLASHDRAFT_L2_PREFETCH=off for A/B runs
L2_PREFETCH = os.environ.get("FLASHDRAFT_L2_PREFETCH", "auto")
PREFETCH_PROGRAMS = 64  # programs that share the prefetch (enough SMs issuing bulk copies at once)
PREFETCH_LANES = 128  # one lane per thread of a 4-warp program
PREFETCH_MAX_ROWS = 32  # only ahead of few-row GEMMs (models/skinny.py), which stream their weights


def prefetch_args(rows: int, programs: int, w: torch.Tensor | None, like: torch.Tensor) -> dict:
    """Keyword arguments for a kernel that may prefetch `w` (the weights of the GEMM a few kernels
    later) into L2 at its start: pf_ptr, pf_bytes, pf_chunk, pf_progs and PREFETCH. On when the
    step has at most PREFETCH_MAX_ROWS rows, on Hopper or later (a bulk L2 prefetch), and w is
    contiguous and a multiple of 16 bytes. The first min(programs, PREFETCH_PROGRAMS) programs of
    the launch each ask for PREFETCH_LANES contiguous chunks; like: a tensor of the launch (the
    pointer passed when nothing is prefetched)."""
    on = (w is not None and L2_PREFETCH != "off" and 0 < rows <= PREFETCH_MAX_ROWS and pdl_level(w) > 0
          and w.is_contiguous() and (w.numel() * w.element_size()) % 16 == 0)
    if L2_PREFETCH not in ("auto", "off"):
        raise ValueError(f"FLASHDRAFT_L2_PREFETCH must be auto or off, got {L2_PREFETCH!r}")
    if not on:
        return dict(pf_ptr=like, pf_bytes=0, pf_chunk=0, pf_progs=0, PREFETCH=False)
    nbytes = w.numel() * w.element_size()
    progs = max(1, min(programs, PREFETCH_PROGRAMS))
    chunk = -(-nbytes // (progs * PREFETCH_LANES * 16)) * 16
    return dict(pf_ptr=w, pf_bytes=nbytes, pf_chunk=chunk, pf_progs=progs, PREFETCH=True)


@triton.jit
def l2_prefetch(ptr, nbytes, chunk, progs, pid, PREFETCH: tl.constexpr):
    """Program pid's share of the bytes [ptr, ptr + nbytes) into L2 (prefetch_args): one bulk
    prefetch per lane, nothing waited for. The weights are read by a later kernel of the step;
    the kernels before it read little, so the memory would otherwise idle."""
    if PREFETCH:
        if pid < progs:
            lane = pid * 128 + tl.arange(0, 128)  # PREFETCH_LANES
            off = lane.to(tl.int64) * chunk
            size = tl.minimum(tl.maximum(nbytes - off, 0), chunk).to(tl.int32)
            addr = ptr.to(tl.pointer_type(tl.int8)) + off
            tl.inline_asm_elementwise(
                "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
                "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
