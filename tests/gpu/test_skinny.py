"""The few-row Triton GEMMs of kernels/skinny_gemm.py against a float64 reference (M = 1..32,
even and ragged N and K, bias, the gate/up GEMM with its silu * up epilogue), their tile rules,
their errors, and the model and engine paths that use them against the torch path.

Runs on CUDA, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1); skipped when
neither is available."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashdraft import settings  # noqa: E402
from flashdraft.kernels import skinny_gemm  # noqa: E402
from flashdraft.kernels.dispatch import fused_mode, gemm_mode, skinny_enabled  # noqa: E402
from flashdraft.kernels.launch import arrival_counts  # noqa: E402
from flashdraft.models.layers import MLP  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
# bf16: inputs are exact bf16 values, products summed in float32, one rounding at the end; the
# interpreter's bf16 casts truncate, which the silu * up epilogue's roundings feel
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2 if INTERPRET else 1e-2}


def reference(x, w, bias=None, glu=False):
    """float64 from the same (rounded) inputs; for glu, gate and up rounded to x's dtype and silu *
    up computed as the torch MLP computes it."""
    y = x.double() @ w.double().T
    if bias is not None:
        y = y + bias.double()
    if glu:
        g, u = y.to(x.dtype).chunk(2, dim=-1)
        y = (F.silu(g) * u).double()
    return y


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 2, 7, 16, 17, 32])
@pytest.mark.parametrize("N,K", [(64, 256), (50, 96), (33, 576), (300, 1000)])
@pytest.mark.parametrize("variant", ["plain", "bias", "glu"])
def test_matches_float64(dtype, M, N, K, variant):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    glu = variant == "glu"
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(2 * N if glu else N, K, generator=g) / K**0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if variant == "bias" else None
    got = skinny_gemm.skinny_linear(x, w, b, glu=glu)
    want = reference(x, w, b, glu)
    assert got.shape == (M, N) and got.dtype == dtype
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[dtype] * max(1.0, want.abs().max().item()), f"max abs diff {err:.3g}"


@pytest.mark.parametrize("M", [33, 64, 100, 128])
@pytest.mark.parametrize("N,K,variant", [(64, 256, "plain"), (300, 1000, "plain"), (64, 256, "glu"),
                                         (300, 1000, "glu"), (64, 1024, "split")])
def test_more_rows_when_raised(monkeypatch, M, N, K, variant):
    """With the row cap raised (settings.SKINNY_ROWS 64 or 128, for A/B runs), 33-128 rows take
    x^T tiles of 64 / 128 and still match float64, split-K included."""
    monkeypatch.setattr(settings, "SKINNY_ROWS", 128)
    g = torch.Generator().manual_seed(M + N + K)
    glu = variant == "glu"
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(2 * N if glu else N, K, generator=g) / K**0.5).to(DEVICE, torch.bfloat16)
    got = skinny_gemm.skinny_linear(x, w, glu=glu, split=2 if variant == "split" else None,
                               tiles=(32, 128, 4, 3) if variant == "split" else None)
    want = reference(x, w, glu=glu)
    assert got.shape == (M, N)
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[torch.bfloat16] * max(1.0, want.abs().max().item()), f"max abs diff {err:.3g}"
    assert skinny_gemm._mpad(M) == (64 if M <= 64 else 128)


@pytest.mark.parametrize("M", [33, 64, 100, 128])
@pytest.mark.parametrize("N,K,glu", [(960, 576, False), (576, 576, False), (3072, 576, True), (96, 64, True)])
def test_mid_rows(M, N, K, glu, monkeypatch):
    """Blocks of 33-128 rows on the mid-row tiles (skinny_gemm.mid_tiles: SmolLM2's qkv, o and gate_up
    shapes; past 64 rows with FLASHDRAFT_MID_ROWS=128) match float64; shapes the rule leaves to cuBLAS
    (wider inputs, taller weights) are refused past 32 rows, and skinny_enabled sends them to cuBLAS."""
    monkeypatch.setattr(settings, "MID_ROWS", 128)
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, torch.bfloat16)
    assert skinny_gemm.mid_tiles(N, K, glu) is not None
    got = skinny_gemm.skinny_linear(x, w, glu=glu)
    want = reference(x, w, glu=glu)
    assert got.shape == (M, N // 2 if glu else N)
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[torch.bfloat16] * max(1.0, want.abs().max().item()), f"max abs diff {err:.3g}"
    with gemm_mode("triton"), fused_mode("on"), torch.inference_mode():
        assert skinny_enabled(x, w, glu)
        assert not skinny_enabled(x)  # no weight: no shape to decide by
        wide = torch.zeros(N, 1536, device=DEVICE, dtype=torch.bfloat16)
        assert skinny_gemm.mid_tiles(N, 1536, glu) is None
        assert not skinny_enabled(torch.zeros(M, 1536, device=DEVICE, dtype=torch.bfloat16), wide, glu)
        assert not skinny_enabled(torch.zeros(129, K, device=DEVICE, dtype=torch.bfloat16), w, glu)
    with pytest.raises(ValueError, match="at most 32 rows"):
        skinny_gemm.skinny_linear(torch.zeros(M, 1536, device=DEVICE, dtype=torch.bfloat16), wide, glu=glu)


@pytest.mark.parametrize("variant", ["plain", "bias", "glu"])
def test_one_row_gemv_kernel(variant):
    g = torch.Generator().manual_seed(7)
    glu = variant == "glu"
    x = torch.randn(1, 576, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(2 * 96 if glu else 96, 576, generator=g) / 24).to(DEVICE, torch.bfloat16)
    b = torch.randn(96, generator=g).to(DEVICE, torch.bfloat16) if variant == "bias" else None
    want = reference(x, w, b, glu)
    got = skinny_gemm.skinny_linear(x, w, b, glu=glu, kernel="gemv")
    assert (got.double() - want).abs().max().item() <= TOL[torch.bfloat16] * max(1.0, want.abs().max().item())
    with pytest.raises(ValueError, match="for one row"):
        skinny_gemm.skinny_linear(torch.cat([x, x]), w, b, glu=glu, kernel="gemv")


@pytest.mark.parametrize("N,K", [(4096, 1024), (6144, 1024), (96, 576)])
def test_rows_do_not_depend_on_batch(N, K):
    """A row's output is bitwise the same alone, in a block of 8 or of 16 (the same tiles): a batch-1
    decode step and the verify block checking the same position round alike."""
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(16, K, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, torch.bfloat16)
    full = skinny_gemm.skinny_linear(x, w)
    assert torch.equal(skinny_gemm.skinny_linear(x[:8], w), full[:8])
    for i in (0, 5, 15):
        assert torch.equal(skinny_gemm.skinny_linear(x[i:i + 1], w), full[i:i + 1])


@pytest.mark.parametrize("N,K,split", [(64, 1024, 2), (96, 768, 3), (64, 2048, 4)])
def test_split_k(N, K, split):
    """K split over `split` programs a strip: float64's values, bitwise the same for a row alone or in a
    block of 8 or 16 and from call to call whichever program ends last, and the arrival counts left at zero
    for the next call (CUDA graphs replay the same counts)."""
    g = torch.Generator().manual_seed(N + K + split)
    x = torch.randn(16, K, generator=g).to(DEVICE, torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, torch.bfloat16)
    b = torch.randn(N, generator=g).to(DEVICE, torch.bfloat16)
    tiles = (32, 128, 4, 3)
    full = skinny_gemm.skinny_linear(x, w, b, tiles=tiles, split=split)
    want = reference(x, w, b)
    assert (full.double() - want).abs().max().item() <= TOL[torch.bfloat16] * max(1.0, want.abs().max().item())
    for _ in range(3):
        assert torch.equal(skinny_gemm.skinny_linear(x, w, b, tiles=tiles, split=split), full)
    assert torch.equal(skinny_gemm.skinny_linear(x[:8], w, b, tiles=tiles, split=split), full[:8])
    for i in (0, 15):
        assert torch.equal(skinny_gemm.skinny_linear(x[i:i + 1], w, b, tiles=tiles, split=split), full[i:i + 1])
    assert not arrival_counts(x.device, 1).any()
    x32, w32 = x.float(), w.float()
    got = skinny_gemm.skinny_linear(x32, w32, tiles=tiles, split=split)
    assert (got.double() - reference(x32, w32)).abs().max().item() < 1e-4
    with pytest.raises(ValueError, match="split-K"):
        skinny_gemm.skinny_linear(x, w, tiles=(32, 128, 4, 3), split=5)


def test_strided_rows_and_explicit_tiles():
    """A row view with a stride past its width (a slice of a wider buffer) and every swept tile
    shape of the benchmark give the same values."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(6, 300, generator=g).to(DEVICE)
    x = big[:, :256]
    w = torch.randn(40, 256, generator=g).to(DEVICE)
    want = reference(x, w)
    for got in (skinny_gemm.skinny_linear(x, w), skinny_gemm.dot(x.contiguous(), w, 16, 64, 4, 2),
                skinny_gemm.gemv(x[:1].contiguous(), w, 8, 128, 4, 1)):
        assert (got.double() - want[: got.shape[0]]).abs().max().item() < 1e-4


def test_tile_rules():
    assert skinny_gemm._gemv_tiles(4096, 4096) == (4, 1024, 4, 3)
    assert skinny_gemm._gemv_tiles(1536, 576) == (64, 64, 4, 3)  # SmolLM2: 576 = 9 x 64
    assert skinny_gemm._dot_tiles(16, 4096, 12288)[:2] == (32, 256)  # down: 128 strips of 32 rows
    assert skinny_gemm._dot_tiles(16, 6144, 4096)[:2] == (64, 128)  # qkv
    assert skinny_gemm._dot_tiles(32, 151936, 4096)[:2] == (64, 256)  # vocabulary heads
    for M in (1, 16, 32):  # the same K blocking for every M: rows round alike
        assert skinny_gemm._dot_tiles(M, 151936, 4096)[:3] == skinny_gemm._dot_tiles(1, 151936, 4096)[:3]
    assert skinny_gemm._dot_tiles(8, 1536, 576)[:2] == (32, 64)  # SmolLM2: 576 = 9 x 64
    assert skinny_gemm._dot_tiles(1, 5120, 2880)[:2] == (64, 128)  # GPT-OSS: 2,880 = 22.5 x 128, a masked last tile
    assert skinny_gemm._dot_tiles(1, 32, 2880)[:2] == (16, 128)  # its router
    # what does not fit in shared memory pipelines less: float32, the glu's two strips
    assert skinny_gemm._dot_tiles(16, 4096, 4096, elem=4) == (32, 256, 4, 4)
    assert skinny_gemm._dot_tiles(16, 4096, 4096, glu=True) == (32, 128, 4, 3)
    for (M, elem, glu), N in itertools.product(((1, 2, True), (16, 4, True), (32, 4, True), (32, 2, False),
                                                (32, 4, False)), (4096, 151936)):
        bn, bk, _, st = skinny_gemm._dot_tiles(M, N, 4096, elem, glu)
        assert st * (bn * (2 if glu else 1) + (16 if M <= 16 else 32)) * bk * elem <= skinny_gemm.SMEM_BUDGET


def test_split_rule():
    """K is split only where the strips leave SMs idle, a function of the shapes alone."""
    assert skinny_gemm._dot_split(4096, 12288, 32, 256) == 1  # Qwen3-8B down: 128 strips
    assert skinny_gemm._dot_split(2560, 9216, 32, 256) == 2  # Qwen3.5-4B down: 80 strips
    assert skinny_gemm._dot_split(2560, 4096, 32, 256) == 2  # its attention and Gated DeltaNet outputs
    assert skinny_gemm._dot_tiles(1, 1024, 2048)[:2] == skinny_gemm._dot_tiles(16, 1024, 3584)[:2] == (32, 128)
    assert skinny_gemm._dot_split(1024, 2048, 32, 128) == 4  # Qwen3.5-0.8B: 32 strips, quarters of 512
    assert skinny_gemm._dot_split(1024, 3584, 32, 128) == 4  # its down projection: quarters of 896
    assert skinny_gemm._dot_split(576, 1536, 32, 256) == 1  # SmolLM2's down: quarters would be too short
    assert skinny_gemm._dot_split(128, 2048, 16, 128) == 2  # a 128 x 2,048 GEMM (a router's parts: _router_tiles)
    assert skinny_gemm._dot_split(2560, 512, 32, 256) == 1  # too short a K to share
    assert skinny_gemm._dot_split(2561, 4096, 32, 256) == 1  # ragged strips stay whole
    assert skinny_gemm._dot_split(5120, 6144, 64, 256) == 1  # Qwen3.5-27B: 80 strips of 64 rows stream well
    assert skinny_gemm._dot_split(2560, 4096, 64, 256) == 2  # the 4B's tiles: 40 strips of 64 rows in halves
    assert skinny_gemm._dot_tiles(1, 2560, 4096)[:2] == skinny_gemm._dot_tiles(32, 2560, 4096)[:2] == (64, 256)
    assert skinny_gemm._dot_tiles(1, 4096, 4096)[:2] == (32, 256)  # Qwen3-8B's o: 128 strips, whole
    for M in (1, 16, 32):  # what the model runs splits as the rule says, for any M
        bn, bk, _, _ = skinny_gemm._dot_tiles(M, 2560, 9216)
        assert skinny_gemm._dot_split(2560, 9216, bn, bk) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("M", [1, 5, 17])
@pytest.mark.parametrize("bias", [False, True])
def test_parts_add_up_to_the_split_result(dtype, M, bias):
    """parts=True returns a split-K GEMM's float32 parts; added in slot order (join_parts, and
    add_rmsnorm beside a residual) they give exactly the bf16 / fp32 result the kernel's own
    reduction stores."""
    from flashdraft.kernels import layer_ops

    g = torch.Generator().manual_seed(M + 7 * bias)
    N, K = 96, 1024
    x = torch.randn(M, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(N, K, generator=g) / K**0.5).to(DEVICE, dtype)
    b = torch.randn(N, generator=g).to(DEVICE, dtype) if bias else None
    res = torch.randn(M, N, generator=g).to(DEVICE, dtype)
    nw = (1 + 0.1 * torch.randn(N, generator=g)).to(DEVICE, dtype)
    for split in (2, 4):
        whole = skinny_gemm.skinny_linear(x, w, b, tiles=(32, 128, 4, 2), split=split)
        parts = skinny_gemm.skinny_linear(x, w, b, tiles=(32, 128, 4, 2), split=split, parts=True)
        assert parts.shape == (M, split, N) and parts.dtype == torch.float32
        if not (INTERPRET and dtype == torch.bfloat16):  # the interpreter's bf16 casts truncate, torch's round
            assert torch.equal(layer_ops.join_parts(parts, res), whole)
        want = reference(x, w, b)
        assert (whole.double() - want).abs().max().item() <= TOL[dtype] * max(1.0, want.abs().max().item())
        for offset in (False, True):
            a = layer_ops.add_rmsnorm(whole, res, nw, 1e-6, offset=offset)
            p = layer_ops.add_rmsnorm(parts, res, nw, 1e-6, offset=offset)
            assert p[0].dtype == a[0].dtype == dtype
            assert torch.equal(a[0], p[0]) and torch.equal(a[1], p[1])
    one = skinny_gemm.skinny_linear(x, w, b, tiles=(32, 128, 4, 2), split=1, parts=True)  # nothing to add
    assert one.shape == (M, N) and one.dtype == dtype


def test_bad_input_is_named():
    w = torch.zeros(8, 16, device=DEVICE)
    most = settings.MID_ROWS  # past 32 rows: the mid-row tiles' cap (64; FLASHDRAFT_MID_ROWS)
    with pytest.raises(ValueError, match=f"at most {most} rows"):
        skinny_gemm.skinny_linear(torch.zeros(most + 1, 16, device=DEVICE), w)
    with pytest.raises(ValueError, match="at most 32 rows"):  # a shape the mid-row tiles leave to cuBLAS
        skinny_gemm.skinny_linear(torch.zeros(33, 2048, device=DEVICE), torch.zeros(8, 2048, device=DEVICE))
    with pytest.raises(ValueError, match="does not fit"):
        skinny_gemm.skinny_linear(torch.zeros(2, 15, device=DEVICE), w)
    with pytest.raises(ValueError, match="glu needs"):
        skinny_gemm.skinny_linear(torch.zeros(2, 16, device=DEVICE), torch.zeros(7, 16, device=DEVICE), glu=True)


def test_switch():
    """auto: CUDA bf16/fp16 activations of 1-32 rows only; cublas: never; never with grad."""
    with torch.inference_mode():
        for rows, dtype, want in ((1, torch.bfloat16, True), (32, torch.bfloat16, True), (33, torch.bfloat16, False),
                                  (4, torch.float32, False)):
            x = torch.zeros(rows, 8, device=DEVICE, dtype=dtype)
            with gemm_mode("auto"):
                assert skinny_enabled(x) == (want and DEVICE.type == "cuda"), (rows, dtype)
            with gemm_mode("cublas"):
                assert not skinny_enabled(x)
        with gemm_mode("triton"):
            assert skinny_enabled(torch.zeros(3, 8, device=DEVICE))
    with gemm_mode("triton"):
        assert not skinny_enabled(torch.zeros(3, 8, device=DEVICE))  # grad enabled


def test_mlp_fused_down_projection():
    """The fused MLP (gate/up GEMM with the silu * up epilogue, then down) equals the torch MLP."""
    torch.manual_seed(0)
    mlp = MLP(64, 96).to(DEVICE)
    for rows in (1, 5, 20):
        x = torch.randn(rows, 64, device=DEVICE)
        with torch.inference_mode():
            want = mlp(x)
            with gemm_mode("triton"), fused_mode("on"):
                got = mlp.forward_fused(x)
        assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("rows", [32, 64, "mid"])
def test_engine_tokens_match_cublas_path(tiny_qwen3, tmp_path, monkeypatch, rows):
    """Greedy DFlash generation with every few-row GEMM on the Triton kernels gives the tokens of
    the path without them (float32: no near-ties); also with the row cap raised to 64 (prefill
    chunks of up to 48 rows then take them too), and with 10 requests' verify and draft blocks of 40
    rows on the mid-row tiles (skinny_gemm.mid_tiles)."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams

    mid = rows == "mid"
    rows = 32 if mid else rows
    monkeypatch.setattr(settings, "SKINNY_ROWS", rows)
    draft = str(build_random_drafter(tmp_path / "d", tiny_qwen3, block_size=4))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 60))]
    if mid:
        prompts += [[i + 3, 2 * i + 1, 90 - i] for i in range(7)]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    kw = dict(draft=draft, device=str(DEVICE), dtype="float32", max_num_batched_tokens=24 if rows == 32 else 48,
              kv_block_size=8)
    calls = []
    real = skinny_gemm.skinny_linear

    def counted(*a, **k):
        calls.append(a[0].shape[0])
        return real(*a, **k)

    out = {}
    for mode in ("cublas", "triton"):
        with fused_mode("on"), gemm_mode(mode):
            skinny_gemm.skinny_linear = counted
            try:
                llm = LLM(str(tiny_qwen3), attention_backend="triton", **kw)
                out[mode] = [o.token_ids for o in llm.generate(prompts, params)]
            finally:
                skinny_gemm.skinny_linear = real
        if mode == "cublas":
            assert not calls
    assert out["triton"] == out["cublas"]
    most = max(rows, settings.MID_ROWS)  # past 32 rows: the mid-row tiles (graph captures of 16 blocks too)
    assert calls and max(calls) <= most and (rows == 32 and not mid or max(calls) > 32)


def test_pdl_switch():
    from flashdraft.kernels import launch

    x = torch.zeros(2, device=DEVICE)
    with launch.pdl_mode("bogus"), pytest.raises(ValueError, match="FLASHDRAFT_PDL"):
        launch.pdl_level(x)
    with launch.pdl_mode("auto"):
        assert launch.pdl_level(torch.zeros(2)) == 0  # CPU tensors never
    with launch.pdl_mode("off"):
        assert launch.launch_kwargs(x) == {"USE_PDL": 0}


@pytest.mark.skipif(DEVICE.type != "cuda", reason="programmatic dependent launch needs a GPU")
def test_pdl_changes_no_token(tiny_qwen3, tmp_path):
    """bf16 DFlash generation through CUDA graphs with every Triton kernel launched with PDL gives
    exactly the tokens of the launches without it (PDL only overlaps launches, never data)."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams
    from flashdraft.kernels import launch

    draft = str(build_random_drafter(tmp_path / "d", tiny_qwen3, block_size=4))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 60))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    out = {}
    mode = "auto"
    for m in ("off", mode):
        with launch.pdl_mode(m):
            llm = LLM(str(tiny_qwen3), draft=draft, device="cuda", dtype="bfloat16")
            if m != "off":
                assert launch.pdl_level(torch.zeros(1, device="cuda")) > 0 or not launch._HAVE_GDC
            out[m] = [o.token_ids for o in llm.generate(prompts, params)]
    assert out[mode] == out["off"]
