"""Programmatic dependent launch (PDL) for flashdraft's Triton kernels, on Hopper and later.

A decode step is ~330 kernels in a row, each waiting for the one before. Launched with PDL, a kernel
may be scheduled while its predecessor is still running: every kernel here waits
(griddepcontrol.wait) until its predecessor has finished and its writes are visible before touching
memory, and signals (griddepcontrol.launch_dependents) that its own successor may be scheduled
once its main loop is done and only its stores are left. What overlaps is the launch and block
scheduling of the next kernel, and in "prefetch" mode the few-row GEMMs also pull the first weight
lines of each strip into L2 before they wait (weights are never written by a kernel); no read of
anything a kernel writes moves, so results are unchanged. Kernels of other libraries launched in
between (cuBLAS, torch) neither signal nor carry the launch attribute, and order as usual.

FLASHDRAFT_PDL=auto (default: "late" on CUDA devices of compute capability >= 9 when this Triton
has grid dependency control), off, late or prefetch. CUDA graphs record the launches with the
attribute. Measured on an H100 (benchmarks/device/gpu_roofline.py, Qwen3-8B shape, RESULTS
section 5): late made a one-row decode 2% faster (6.07 -> 5.95 ms) and the batch-1 DFlash step 1%
(7.89 -> 7.80 ms); signalling at the start of each kernel instead (an earlier variant) gained 3% on
the decode but lost 7% on the 16-row verify."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

PDL = os.environ.get("FLASHDRAFT_PDL", "auto")
_MODES = {"off": 0, "auto": 1, "late": 1, "prefetch": 2}
PREFETCH_COLS = 2048  # leading weight columns per strip row pulled into L2 before the wait
_capable: dict[torch.device, bool] = {}

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    _HAVE_GDC = True
except ImportError:  # older Triton
    _HAVE_GDC = False


def pdl_level(t: torch.Tensor) -> int:
    """0 (no PDL), 1 (late) or 2 (late + weight prefetch) for kernels over `t` (see PDL)."""
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
    """First statement of every kernel (after pdl_prefetch): wait for the previous kernel."""
    if USE_PDL > 0:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_trigger(USE_PDL: tl.constexpr):
    """Before a kernel's final stores: let the next kernel launch."""
    if USE_PDL > 0:
        tl.extra.cuda.gdc_launch_dependents()


@triton.jit
def pdl_prefetch(row_ptrs, K, USE_PDL: tl.constexpr):
    """Prefetch mode, before pdl_enter: one L2 prefetch per 64 elements of the first PREFETCH_COLS
    columns of every row at row_ptrs [R, 1] (read-only weights)."""
    if USE_PDL == 2:
        cols = tl.minimum(tl.arange(0, 32) * 64, K - 1)  # PREFETCH_COLS / 64 lines per row
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [row_ptrs + cols[None, :]],
                                  dtype=tl.int32, is_pure=False, pack=1)
