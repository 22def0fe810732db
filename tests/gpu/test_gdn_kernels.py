"""The Triton Gated DeltaNet kernels (kernels/gdn_ops.py) against the layer's torch path
(models/gdn.py, itself checked against transformers in tests/test_families.py): one step of fresh
prefills, decode rows from a slot's state and kept verify rows beside each other, then the commit of
some of the kept rows; states and conv windows as well as outputs. Runs on CUDA, or on CPU tensors
under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from fixtures import tiny_config  # noqa: E402

from flashdraft.attention.base import AttentionBatch  # noqa: E402
from flashdraft.models.gdn import GatedDeltaNet, RecurrentRows  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def layer_and_states(dtype, slots=6, seed=0, **overrides):
    cfg = tiny_config("qwen3_5_text", 128, **overrides)
    torch.manual_seed(seed)
    layer = GatedDeltaNet(cfg)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    layer = layer.to(DEVICE, dtype)
    states = [layer.make_state(slots, DEVICE, dtype) for _ in range(2)]  # torch path, kernels
    states[0].conv.normal_(0, 1.0)
    states[0].rec.normal_(0, 0.5)
    states[1].conv.copy_(states[0].conv)
    states[1].rec.copy_(states[0].rec)
    return cfg, layer, states


def run(layer, state, x, batch, kernels: bool):
    layer.kernels = lambda x: kernels
    with torch.inference_mode():
        return layer(x, state, batch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d_k, d_v", [(16, 8), (32, 64)])
def test_kernels_match_the_torch_layer(dtype, d_k, d_v):
    cfg, layer, (ref, got) = layer_and_states(dtype, linear_key_head_dim=d_k, linear_value_head_dim=d_v)
    # sequences: a fresh 7-row prefill, a 1-row decode, a kept 5-row verify, a 2-row chunk (fewer rows
    # than the conv window), a kept fresh 3-row step; then padding rows and a padding sequence
    lens, slots = [7, 1, 5, 2, 3, 0], [0, 3, 1, 5, 4, -1]
    rows = RecurrentRows(slots, [True, False, False, False, True, True], [False, False, True, False, True, False])
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1] + 3
    x = torch.randn(T, cfg.hidden_size, device=DEVICE, dtype=dtype)

    def batch():
        return AttentionBatch(torch.full((T,), -1, device=DEVICE), qsl, [0] * len(lens), [[]] * len(lens), 16,
                              recurrent=RecurrentRows(rows.slots, rows.fresh, rows.keep))

    want = run(layer, ref, x, batch(), False)
    out = run(layer, got, x, batch(), True)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=8e-2, rtol=5e-2)  # ~2 bf16 ulps
    n = qsl[-1]
    torch.testing.assert_close(out[:n], want[:n], **tol)
    torch.testing.assert_close(got.rec, ref.rec, **tol)
    torch.testing.assert_close(got.conv, ref.conv, atol=0, rtol=0)  # copies of inputs: exact
    assert (got.rec[1] == ref.rec[1]).all() and (got.conv[4] == ref.conv[4]).all()  # kept: untouched so far
    accepted = {1: 2, 4: 3}  # 2 of the verify's 5 rows, all 3 of the fresh kept step
    layer.commit(ref, accepted)
    layer.commit(got, accepted)
    torch.testing.assert_close(got.rec, ref.rec, **tol)
    torch.testing.assert_close(got.conv, ref.conv, atol=0, rtol=0)
    assert got.pending is None and ref.pending is None
    # the committed state is the one after the accepted rows: the same rows run as a plain step
    _, _, (again, _) = layer_and_states(dtype, linear_key_head_dim=d_k, linear_value_head_dim=d_v)
    r0 = qsl[2]
    one = AttentionBatch(torch.full((2,), -1, device=DEVICE), [0, 2], [0], [[]], 16,
                         recurrent=RecurrentRows([1], [False], [False]))
    run(layer, again, x[r0: r0 + 2], one, True)  # (its projections of 2 rows may round apart from 23 rows')
    torch.testing.assert_close(got.rec[1], again.rec[1], **tol)
    torch.testing.assert_close(got.conv[1], again.conv[1], **tol)


@pytest.mark.skipif(INTERPRET, reason="fla-core's kernels need a GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_long_chunks_take_the_chunked_kernel(dtype):
    """Committed chunks of CHUNKED_MIN_ROWS rows or more (prefill) run fla-core's chunked kernel beside
    the recurrent kernel's decode and kept rows in one step: outputs, states and windows as the torch
    layer's (transformers' chunked form for the chunks), and the commit afterwards as well."""
    from flashdraft.kernels import gdn_ops

    if not gdn_ops.chunked_available(DEVICE):
        pytest.skip("fla-core is not installed")
    cfg, layer, (ref, got) = layer_and_states(dtype, linear_key_head_dim=32, linear_value_head_dim=64)
    # a fresh 150-row prefill, a decode row, a kept 5-row verify, a 70-row chunk from its slot's state,
    # a short 9-row chunk (recurrent kernel), then padding
    lens, slots = [150, 1, 5, 70, 9], [0, 3, 1, 5, 4]
    rows = RecurrentRows(slots, [True, False, False, False, False], [False, False, True, False, False])
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    T = qsl[-1] + 3
    x = torch.randn(T, cfg.hidden_size, device=DEVICE, dtype=dtype)
    rec = RecurrentRows(rows.slots, rows.fresh, rows.keep)
    batch = AttentionBatch(torch.full((T,), -1, device=DEVICE), qsl, [0] * len(lens), [[]] * len(lens), 16,
                           recurrent=rec)
    want = run(layer, ref, x, AttentionBatch(batch.slot_mapping, qsl, batch.seq_lens, batch.block_tables, 16,
                                             recurrent=RecurrentRows(rows.slots, rows.fresh, rows.keep)), False)
    out = run(layer, got, x, batch, True)
    assert rec.spans.rows.tolist() == [*range(0, 150), *range(156, 226)] and rec.spans.slots.tolist() == [0, 5]
    # the other rows (decode, kept verify, the short chunk) ran the recurrent kernel: as tight as above
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=8e-2, rtol=5e-2)
    other = [*range(150, 156), *range(226, qsl[-1])]
    torch.testing.assert_close(out[other], want[other], **tol)
    # the chunks: fla-core sums by chunks of 64 rows with tf32 (float32) or bf16 products inside its
    # dots, so elements part by up to ~1e-2; the error over all of them stays at that rounding (a wrong
    # state, gate or row gives errors of order 1)
    bound = 1e-2 if dtype == torch.float32 else 3e-2

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    chunk_rows = [*range(0, 150), *range(156, 226)]
    errors = rel(out[chunk_rows], want[chunk_rows]), rel(got.rec[[0, 5]], ref.rec[[0, 5]])
    assert max(errors) < bound, errors
    others = [1, 3, 4, 2]  # the verify's slot untouched, the decode's and short chunk's by the recurrent kernel
    torch.testing.assert_close(got.rec[others], ref.rec[others], **tol)
    torch.testing.assert_close(got.conv, ref.conv, atol=0, rtol=0)
    layer.commit(ref, {1: 3})
    layer.commit(got, {1: 3})
    torch.testing.assert_close(got.rec[others], ref.rec[others], **tol)
    torch.testing.assert_close(got.conv, ref.conv, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_move_their_windows_in_the_conv_launch(dtype):
    """A step whose sequences have one row each (decode) moves the conv windows inside the conv launch
    (no window launch): windows, states and outputs as the torch layer's, a kept row's slot untouched,
    and the padding rows' outputs zero (the recurrence kernel writes them)."""
    from flashdraft.kernels import gdn_ops

    cfg, layer, (ref, got) = layer_and_states(dtype, linear_key_head_dim=32, linear_value_head_dim=64)
    calls = []
    real = gdn_ops.advance_windows
    gdn_ops.advance_windows = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        # a decode row from its slot, a fresh one, a kept one (a one-row verify), a padding sequence
        slots = [3, 0, 1, -1]
        rows = RecurrentRows(slots, [False, True, False, True], [False, False, True, False])
        qsl = [0, 1, 2, 3, 3]
        T = 5
        x = torch.randn(T, cfg.hidden_size, device=DEVICE, dtype=dtype)

        def batch():
            return AttentionBatch(torch.full((T,), -1, device=DEVICE), qsl, [0] * 4, [[]] * 4, 16,
                                  recurrent=RecurrentRows(rows.slots, rows.fresh, rows.keep))

        want = run(layer, ref, x, batch(), False)
        out = run(layer, got, x, batch(), True)
    finally:
        gdn_ops.advance_windows = real
    assert not calls
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=8e-2, rtol=5e-2)
    torch.testing.assert_close(out[:3], want[:3], **tol)
    assert (out[3:] == 0).all()
    torch.testing.assert_close(got.rec, ref.rec, **tol)
    torch.testing.assert_close(got.conv, ref.conv, atol=0, rtol=0)
    layer.commit(ref, {1: 1})
    layer.commit(got, {1: 1})
    torch.testing.assert_close(got.rec, ref.rec, **tol)
    torch.testing.assert_close(got.conv, ref.conv, atol=0, rtol=0)
