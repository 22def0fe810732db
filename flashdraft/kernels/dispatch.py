"""Whether a forward takes the Triton kernels: the fused path (kernels/layer_ops.py, token_ops.py and the
kernels the models call on it) and the few-row GEMMs (kernels/skinny_gemm.py), decided from
settings.FUSED and settings.GEMM and the tensors at hand. Imports without triton: the kernel modules are
imported only once a switch asks for them."""

from __future__ import annotations

import contextlib

import torch

from flashdraft import settings

_triton_ok: bool | None = None


def fused_enabled(x: torch.Tensor) -> bool:
    """Whether a forward over activations like `x` takes the fused path (see settings.FUSED)."""
    global _triton_ok
    mode = settings.FUSED
    if mode == "off" or torch.is_grad_enabled():
        return False
    if mode not in ("auto", "on"):
        raise ValueError(f"FLASHDRAFT_FUSED must be auto, on or off, got {mode!r}")
    if mode == "auto" and x.device.type != "cuda":
        return False
    if _triton_ok is None:
        try:
            import flashdraft.kernels.layer_ops  # noqa: F401
            _triton_ok = True
        except ImportError:
            _triton_ok = False
    if mode == "on" and not (_triton_ok and (x.device.type == "cuda" or settings.interpreted())):
        raise RuntimeError("FLASHDRAFT_FUSED=on needs triton and CUDA tensors (or TRITON_INTERPRET=1)")
    return _triton_ok


def skinny_enabled(x: torch.Tensor, weight: torch.Tensor | None = None, glu: bool = False) -> bool:
    """Whether a 2-D activation `x` takes the few-row Triton GEMM (see settings.GEMM); past
    settings.SKINNY_ROWS rows only with the weight given (its [gate; up] matrix for glu) and a shape
    skinny_gemm.mid_tiles takes."""
    mode = settings.GEMM
    if mode not in ("auto", "triton", "cublas"):
        raise ValueError(f"FLASHDRAFT_GEMM must be auto, triton or cublas, got {mode!r}")
    most = max(settings.SKINNY_ROWS, settings.MID_ROWS)
    if mode == "cublas" or torch.is_grad_enabled() or x.dim() != 2 or not 1 <= x.shape[0] <= most:
        return False
    if mode == "auto" and (x.device.type != "cuda" or x.dtype not in (torch.bfloat16, torch.float16)):
        return False
    if mode == "triton" and x.device.type != "cuda" and not settings.interpreted():
        return False
    if not (fused_enabled(x) or mode == "triton"):
        return False
    if x.shape[0] <= settings.SKINNY_ROWS:
        return True
    from flashdraft.kernels.skinny_gemm import mid_tiles

    return weight is not None and mid_tiles(*weight.shape, glu) is not None


@contextlib.contextmanager
def _switch(name: str, mode: str):
    old = getattr(settings, name)
    setattr(settings, name, mode)
    try:
        yield
    finally:
        setattr(settings, name, old)


def fused_mode(mode: str):
    """Temporarily set settings.FUSED (tests, benchmarks). CUDA graphs keep the path they were captured with."""
    return _switch("FUSED", mode)


def gemm_mode(mode: str):
    """Temporarily set settings.GEMM (tests, benchmarks). CUDA graphs keep the kernels they were captured with."""
    return _switch("GEMM", mode)
