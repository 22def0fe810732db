"""kernels/fp8_gemm.py's W8A16 block-scaled GEMM against a float64 computation from the same FP8 weights and
block factors (even and ragged shapes, blocks of 128 x 128 and 16 x 32, M = 1..64), and its refusals.

Runs on CUDA (skipped elsewhere: the Triton interpreter has no float8)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from flashdraft.kernels.fp8_gemm import fp8_linear  # noqa: E402
from flashdraft.models.quant import dequantize_block_fp8  # noqa: E402


def _quantized(N, K, block, gen):
    w = torch.randn(N, K, generator=gen, dtype=torch.float64) * 0.05
    bn, bk = block
    s = torch.rand(-(-N // bn), -(-K // bk), generator=gen, dtype=torch.float64) * 2e-3 + 1e-4
    full = s.repeat_interleave(bn, 0)[:N].repeat_interleave(bk, 1)[:, :K]
    return (w / full).clamp(-448, 448).to(torch.float8_e4m3fn), s.float()


@pytest.mark.parametrize("M", [1, 5, 16, 17, 64])
@pytest.mark.parametrize("N,K,block", [(256, 512, (128, 128)), (300, 200, (16, 32)), (130, 384, (128, 128))])
def test_matches_float64(M, N, K, block):
    gen = torch.Generator().manual_seed(M * 7 + N)
    w, s = _quantized(N, K, block, gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    want = x.double() @ dequantize_block_fp8(w, s, block, "w").double().T
    got = fp8_linear(x.cuda(), w.cuda(), s.cuda(), block).double().cpu()
    assert got.dtype == torch.float64 and got.shape == (M, N)
    assert torch.allclose(got, want, rtol=1e-2, atol=1e-2 * want.abs().max().item())


def test_refusals():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.zeros(32, 64, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv must be"):
        fp8_linear(x, w, torch.ones(1, 2, device="cuda"), (32, 64))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_linear(x, w.bfloat16(), torch.ones(1, 1, device="cuda"), (32, 64))
