"""Programmatic dependent launch (PDL) for flashdraft's Triton kernels, on Hopper and later.

A decode step is ~330 kernels in a row, each waiting for the one before. Launched with PDL, a kernel
may be scheduled while its predecessor is still running: every kernel here first signals that its
dependents may launch, then waits (griddepcontrol.wait) until its predecessor has finished and its
writes are visible, before touching memory. What overlaps is the launch and block scheduling of the
next kernel, not any data access, so results are unchanged. Kernels of other libraries launched in
between (cuBLAS, torch) neither signal nor carry the launch attribute, and order as usual.

FLASHDRAFT_PDL=auto (default: CUDA devices of compute capability >= 9 when this Triton has grid
dependency control) or off. CUDA graphs record the launches with the attribute."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

PDL = os.environ.get("FLASHDRAFT_PDL", "auto")
_capable: dict[torch.device, bool] = {}

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    _HAVE_GDC = True
except ImportError:  # older Triton
    _HAVE_GDC = False


def use_pdl(t: torch.Tensor) -> bool:
    """Whether kernels over `t` are launched with PDL (see PDL)."""
    if PDL not in ("auto", "off"):
        raise ValueError(f"FLASHDRAFT_PDL must be auto or off, got {PDL!r}")
    if PDL == "off" or not _HAVE_GDC or t.device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if t.device not in _capable:
        _capable[t.device] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _capable[t.device]


def launch_kwargs(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch over `t`: USE_PDL and, when on, launch_pdl."""
    on = use_pdl(t)
    return {"USE_PDL": True, "launch_pdl": True} if on else {"USE_PDL": False}


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
    """First statement of every kernel: let the next kernel launch, then wait for the previous one."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
