"""Launch helpers of flashdraft's Triton kernels: programmatic dependent launch (PDL) on Hopper and later,
the arrival counts of kernels whose last program finishes the work, and the device's SM count.

A decode step is ~330 kernels in a row, each waiting for the one before. Launched with PDL, a kernel
may be scheduled while its predecessor is still running: every kernel here waits
(griddepcontrol.wait) until its predecessor has finished and its writes are visible before touching
memory the step writes, and signals (griddepcontrol.launch_dependents) that its own successor may
be scheduled once its main loop is done and only its stores are left. What overlaps is the launch
and block scheduling of the next kernel, and the reads of memory that no kernel still running can
write, done before the wait: paged attention's metadata and the K/V cached by earlier steps
(qk_norm_rope_store, its predecessor, signals at its start so that this fetch overlaps it);
qk_norm_rope_store's cos/sin rows, slot and norm weights; the GDN recurrence's state block (the conv
before it signals right after its wait); the gated norm's z and the output gate's gate, which the
layer's input projection wrote before the kernel before them signalled. A kernel's predecessor
signals only after its own wait, so every kernel two back has finished by then. Results are
unchanged. Kernels of other libraries launched in between (cuBLAS, torch) neither signal nor
carry the launch attribute, and order as usual.

FLASHDRAFT_PDL=auto (settings.PDL; default: on for CUDA devices of compute capability >= 9 when this Triton has
grid dependency control) or off. CUDA graphs record the launches with the attribute. Measured on
an H100 (benchmarks/device/gpu_roofline.py, Qwen3-8B shape): it made a one-row
decode 2% faster (6.07 -> 5.95 ms) and the batch-1 DFlash step 1% (7.89 -> 7.80 ms). add_rmsnorm
alone signals at its start (settings.NORM_TRIGGER): the GEMM after it is scheduled while it runs
(H200, Qwen3.5-4B decode in graph 1.3% faster at batch 1 and 8). Variants measured worse and gone:
signalling at the start of every kernel (one-row decode 3% faster than without PDL, but the 16-row
verify 7% slower: waiting kernels chain up and hold the SMs; at the start of add_rmsnorm and the
split-K merge, the step 2% slower, H100); prefetching each GEMM strip's first weight lines into L2
before the wait (against the signal before the stores alone: batch-8 decode 9% slower, the step
10%; one or two K tiles only: no gain); loading the first weight tile into registers before the wait
(H200, Qwen3.5-4B decode in graph 7% slower: the peeled tile costs the pipeline a stage); with
add_rmsnorm's early signal, prefetching the first 2 or 4 weight tiles into L2 before the wait
(H200, Qwen3.5-4B / -0.8B decode in graph at batch 1 and 8: 2 tiles within -1.5..+0.1%, 4 tiles
1.5-3.4% slower); a whole later GEMM's weights bulk-prefetched into L2 by an earlier small kernel
(out_proj by the GDN conv, o_proj by qk_norm_rope_store; commit 3bf14b0): the GEMMs gained 12 us a
step, the issuing kernels lost 2.7 us a call (H200, Qwen3.5-4B in graph 2.504 -> 2.574 ms)."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from flashdraft import settings

INTERPRETER_SMS = 16  # stand-in SM count when kernels run on CPU tensors (TRITON_INTERPRET=1)
_MODES = {"off": 0, "auto": 1}
_capable: dict[torch.device, bool] = {}

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: F401

    _HAVE_GDC = True
except ImportError:  # older Triton
    _HAVE_GDC = False


def pdl_level(t: torch.Tensor) -> int:
    """0 (no PDL) or 1 for kernels over `t` (see settings.PDL)."""
    mode = settings.PDL
    if mode not in _MODES:
        raise ValueError(f"FLASHDRAFT_PDL must be one of {', '.join(_MODES)}, got {mode!r}")
    if mode == "off" or not _HAVE_GDC or t.device.type != "cuda" or settings.interpreted():
        return 0
    if t.device not in _capable:
        _capable[t.device] = torch.cuda.get_device_capability(t.device)[0] >= 9
    return _MODES[mode] if _capable[t.device] else 0


def launch_kwargs(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch over `t`: USE_PDL and, when on, launch_pdl."""
    level = pdl_level(t)
    return {"USE_PDL": level, "launch_pdl": True} if level else {"USE_PDL": 0}


@contextlib.contextmanager
def pdl_mode(mode: str):
    """Temporarily set settings.PDL (benchmarks). CUDA graphs keep the launches they were captured with."""
    old, settings.PDL = settings.PDL, mode
    try:
        yield
    finally:
        settings.PDL = old


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


_ARRIVALS: dict[torch.device, torch.Tensor] = {}
_SM_COUNTS: dict[torch.device, int] = {}


def arrival_counts(device: torch.device, n: int) -> torch.Tensor:
    """At least n int32 arrival counts for kernels whose last program to finish a piece of work
    completes it (skinny_gemm.py's split-K GEMMs, the attention's in-kernel split-K merge): zeros, and
    left at zero by every launch's last programs. One buffer a device, shared: the kernels of a
    stream count only after their PDL wait, when the kernel before has finished."""
    c = _ARRIVALS.get(device)
    if c is None or c.numel() < n:
        if c is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("arrival counts must be allocated before graph capture")
        c = _ARRIVALS[device] = torch.zeros(max(n, 1024), device=device, dtype=torch.int32)
    return c


def sm_count(device: torch.device) -> int:
    """The device's SM count (grids sized to fill it); INTERPRETER_SMS for CPU tensors."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    if device not in _SM_COUNTS:
        _SM_COUNTS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNTS[device]
