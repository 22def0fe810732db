"""kernels/int4_gemm.py's W4A16 GEMM against a float64 computation from the same 4-bit values, scales and zero
points (even and ragged shapes, groups of 16 to a whole row, M = 1..64, split K), its packing, and its refusals.

Runs on CUDA, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, where bf16 casts truncate)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashdraft.kernels.int4_gemm import int4_linear, int4_tiles  # noqa: E402
from flashdraft.kernels.int4_layout import pack_int4  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def _weights(N, K, group, gen):
    q = torch.randint(0, 16, (N, K), generator=gen)
    groups = -(-K // group)
    scale = torch.rand(N, groups, generator=gen) * 0.02 + 1e-3
    zero = torch.randint(0, 16, (N, groups), generator=gen).float()
    return q, scale, zero


def _dequantized(q, scale, zero, group, dtype):
    idx = torch.arange(q.shape[1]) // group
    return ((q.double() - zero.double()[:, idx]) * scale.double()[:, idx]).float().to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 5, 17, 64])
@pytest.mark.parametrize("N,K,group", [(256, 512, 128), (200, 96, 16), (130, 384, 64), (64, 1024, 1024),
                                       (96, 200, 32)])
def test_matches_float64(M, N, K, group, dtype):
    gen = torch.Generator().manual_seed(M * 7 + N + K)
    q, scale, zero = _weights(N, K, group, gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    want = x.double() @ _dequantized(q, scale, zero, group, dtype).double().T
    got = int4_linear(x.to(DEVICE), pack_int4(q).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), group)
    assert got.dtype == dtype and got.shape == (M, N)
    err = (got.double().cpu() - want).abs().max() / want.abs().max()
    assert err < 1e-2, err


def test_split_k_and_its_parts_agree():
    gen = torch.Generator().manual_seed(3)
    q, scale, zero = _weights(64, 2048, 128, gen)
    x = torch.randn(3, 2048, generator=gen).to(torch.bfloat16).to(DEVICE)
    args = (pack_int4(q).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 128)
    one = int4_linear(x, *args, tiles=(64, 128, 3, 1, 16, 4))
    four = int4_linear(x, *args, tiles=(64, 128, 3, 4, 16, 4))
    assert int4_tiles(3, 64, 2048, 128)[3] == 4
    assert torch.allclose(one.float(), four.float(), rtol=2e-2, atol=1e-2 * one.float().abs().max().item())
    assert torch.equal(four, int4_linear(x, *args, tiles=(64, 128, 3, 4, 16, 4)))  # the same sums every call


def test_packing_layout():
    vals = torch.arange(16).repeat(3, 1)  # [3, 16]: word 0 holds 0..7, word 1 holds 8..15
    packed = pack_int4(vals)
    assert packed.dtype == torch.int32 and packed.shape == (3, 2)
    assert packed[0, 0].item() == 0x76543210 and (packed[0, 1].item() & 0xFFFFFFFF) == 0xFEDCBA98


def test_refusals():
    x = torch.zeros(2, 64, dtype=torch.bfloat16, device=DEVICE)
    q = torch.zeros(32, 8, dtype=torch.int32, device=DEVICE)
    s = torch.ones(32, 4, device=DEVICE)
    with pytest.raises(ValueError, match="groups of 24 columns"):
        int4_linear(x, q, torch.ones(32, 3, device=DEVICE), torch.ones(32, 3, device=DEVICE), 24)
    with pytest.raises(ValueError, match="qweight must be int32"):
        int4_linear(x, q.float(), s, s, 16)
    with pytest.raises(ValueError, match="zero must be float32"):
        int4_linear(x, q, s, s.half(), 16)


@pytest.mark.parametrize("M", [1, 9])
def test_offsets_of_gguf_s_4_bit_types(M):
    """w = (q - zero) * scale + offset (GGUF's Q4_1 and Q4_K: a minimum a group), against float64."""
    gen = torch.Generator().manual_seed(M)
    q, scale, zero = _weights(96, 256, 32, gen)
    offset = torch.randn(96, 8, generator=gen) * 0.05
    x = torch.randn(M, 256, generator=gen).to(torch.bfloat16)
    idx = torch.arange(256) // 32
    w = ((q.double() - zero.double()[:, idx]) * scale.double()[:, idx] + offset.double()[:, idx]).float()
    want = x.double() @ w.to(torch.bfloat16).double().T
    got = int4_linear(x.to(DEVICE), pack_int4(q).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 32, offset.to(DEVICE))
    assert ((got.double().cpu() - want).abs().max() / want.abs().max()) < 1e-2
    plain = int4_linear(x.to(DEVICE), pack_int4(q).to(DEVICE), scale.to(DEVICE), zero.to(DEVICE), 32)
    assert ((plain.double().cpu() - want).abs().max() / want.abs().max()) > 1e-2  # (the offsets count)
