"""The Triton expert kernels (kernels/moe_experts.py) against the torch MoE path (itself checked
against transformers in tests/test_families.py): decode-sized and prefill-sized batches, experts hit by
no row, by one, by many; float32 and bf16; Qwen3-MoE's silu and GPT-OSS's biases and clamped SwiGLU.
Runs on CUDA, or on CPU tensors under TRITON_INTERPRET=1."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashdraft import settings  # noqa: E402
from flashdraft.kernels import layer_ops, moe_routing  # noqa: E402
from flashdraft.kernels.moe_experts import fused_moe, sort_by_expert  # noqa: E402
from flashdraft.models.moe import GptOssMoE, MoE  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def moe(E=8, k=2, H=96, inter=80, norm=True, dtype=torch.float32, seed=0, family="qwen3_moe"):
    cfg = SimpleNamespace(num_experts=E, num_local_experts=E, num_experts_per_tok=k, norm_topk_prob=norm,
                          moe_intermediate_size=inter, intermediate_size=inter, hidden_size=H, swiglu_alpha=1.702,
                          swiglu_limit=1.5)  # a low limit: the clamps bite at these scales
    torch.manual_seed(seed)
    m = MoE(cfg, torch.nn.functional.silu) if family == "qwen3_moe" else GptOssMoE(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2)
    return m.to(DEVICE, dtype).eval()


def test_sort_by_expert_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[3, 1], [3, 0], [1, 3]], device=DEVICE)
    rows, block_expert = sort_by_expert(ids, 5, block=4)
    rows, block_expert = rows.tolist(), block_expert.tolist()
    assert len(rows) == 4 * len(block_expert) and len(rows) >= 6 + 5 * 3
    slots = [r for r in rows if r >= 0]
    assert sorted(slots) == list(range(6))
    flat = ids.flatten().tolist()
    for b, e in enumerate(block_expert):
        members = [r for r in rows[4 * b: 4 * b + 4] if r >= 0]
        assert all(flat[r] == e for r in members) and (e >= 0 or not members)
    assert [e for e in block_expert if e >= 0] == [0, 1, 3, 3][: len([e for e in block_expert if e >= 0])]


@pytest.mark.parametrize("M,E,block", [(1, 8, 16), (8, 128, 16), (4, 32, 16), (64, 32, 16), (256, 128, 16),
                                        (13, 5, 4), (200, 3, 16)])
def test_one_program_sort_equals_the_torch_ops(M, E, block):
    """The one-program sort of small batches (decode, small verify blocks) gives the torch ops' rows and
    block experts exactly, experts hit by none, one and many rows included."""
    g = torch.Generator().manual_seed(M * 31 + E)
    ids = torch.randint(0, E, (M,), generator=g)
    if M > 8:
        ids[: M // 3] = ids[0]  # one expert takes many rows
    ids = ids.to(DEVICE).view(-1, 1)
    small = sort_by_expert(ids, E, block, small=True)
    ops = sort_by_expert(ids, E, block, small=False)
    assert torch.equal(small[0], ops[0]) and torch.equal(small[1], ops[1])


@pytest.mark.parametrize("family,norm", [("qwen3_moe", True), ("qwen3_moe", False), ("gpt_oss", False)])
@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 128, 8), (33, 32, 4), (7, 6, 3)])
def test_fused_routing_matches_torch(family, norm, T, E, k):
    """The top-k kernel (after the router GEMM) picks the torch routing's experts, in its order, with its
    weights (float32 logits: no ties)."""
    m = moe(E=E, k=k, norm=norm, seed=T + E, family=family)
    x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T)).to(DEVICE)
    with torch.inference_mode():
        w, idx = m.route(x)
        fw, fidx = m.route_fused(x)
    assert torch.equal(idx, fidx)
    torch.testing.assert_close(fw, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("T", [1, 5, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,K,bias,parts", [(128, 2048, False, 8), (32, 2880, True, 9)])
def test_split_router_parts_route_as_the_merged_logits(T, dtype, E, K, bias, parts):
    """A router GEMM split over K (Qwen3-30B-A3B's 128 x 2,048; GPT-OSS-20B's 32 x 2,880 with its bias)
    leaves its float32 parts to the top-k kernel, which adds them in slot order and rounds them as the
    GEMM's own last program does: the same experts and weights, bit for bit, as top-k over the GEMM's
    merged logits with the same tiles."""
    from flashdraft.kernels import skinny_gemm
    from flashdraft.kernels.moe_routing import route_topk

    g = torch.Generator().manual_seed(T)
    x = torch.randn(T, K, generator=g).to(DEVICE, dtype)
    w = (torch.randn(E, K, generator=g) * 0.05).to(DEVICE, dtype)
    b = (torch.randn(E, generator=g) * 0.5).to(DEVICE, dtype) if bias else None
    got_parts = skinny_gemm.skinny_linear(x, w, b, parts=True)
    assert got_parts.shape == (T, parts, E) and got_parts.dtype == torch.float32  # the split the rule picks
    tiles = skinny_gemm._router_tiles(E, K)
    merged = skinny_gemm.skinny_linear(x, w, b, tiles=tiles[:4], split=tiles[4])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(merged.float(), x.float() @ w.float().T + (0 if b is None else b.float()),
                               rtol=tol, atol=tol)
    for softmax_all, norm in ((True, True), (True, False), (False, False)):
        want = route_topk(merged, 8, softmax_all, norm)
        got = route_topk(got_parts, 8, softmax_all, norm, dtype)
        assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])


def test_router_tiles_rule(monkeypatch):
    """Routers whose parts go to the top-k kernel cut K into the most parts of at least ROUTER_PART_K, in
    whole tiles; wide outputs, ragged strips or a K no tile divides keep the general rules."""
    from flashdraft.kernels import skinny_gemm

    assert skinny_gemm._router_tiles(128, 2048) == (16, 128, 4, 3, 8)  # Qwen3-30B-A3B: 8 parts of 256
    assert skinny_gemm._router_tiles(32, 2880) == (16, 64, 4, 3, 9)  # GPT-OSS-20B: 9 parts of 5 x 64
    assert skinny_gemm._router_tiles(512, 2048) is None and skinny_gemm._router_tiles(24, 2048) is None
    assert skinny_gemm._router_tiles(32, 96) is None  # no 64-wide tile divides K
    assert skinny_gemm._router_tiles(64, 200 * 64)[4] == 50  # 50 parts of 4 tiles
    monkeypatch.setattr(settings, "ROUTER_PART_K", 0)
    assert skinny_gemm._router_tiles(128, 2048) is None


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 8, 2), (16, 6, 3), (70, 8, 2), (5, 4, 4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("direct", [None, 0, 10**6])
def test_fused_moe_matches_torch(T, E, k, dtype, family, direct, monkeypatch):
    """The expert kernels on the torch routing (bf16 router logits tie often, and the two paths may
    break a tie apart); in float32 the whole fused forward, routing kernels included. direct: up to
    that many tokens take the unsorted path (0: always the sort; None: the default rule)."""
    if direct is not None:
        monkeypatch.setattr(settings, "MOE_DIRECT", direct)
    m = moe(E=E, k=k, dtype=dtype, seed=T, family=family)
    x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype) * 3
    ex = m.experts
    with torch.inference_mode():
        want = m.forward(x)  # CPU: the experts hit, one by one; CUDA: every expert, weighted
        w, idx = m.route(x)
        got = fused_moe(x, ex.gate_up_proj, ex.down_proj, w, idx, m.kernel_act(), ex.gate_up_proj_bias,
                        ex.down_proj_bias)
        whole = m.forward_fused(x) if dtype == torch.float32 else got
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for out in (got, whole):
        err = (out.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
        assert err < tol, err


@pytest.mark.parametrize("T", [1, 6])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_slot_outputs_summed_by_the_next_norm(T, dtype):
    """slots=True: the k weighted expert outputs, unsummed; layer_ops.add_rmsnorm given them beside a
    residual sums them in slot order first, as their torch sum (rounded to the dtype) would be added.
    A layer stack through forward_layers_fused hands its MoE outputs over this way."""
    m = moe(E=8, k=3, dtype=dtype, seed=T)
    x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype) * 3
    res = torch.randn(T, 96, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    weight = (1 + 0.2 * torch.randn(96, generator=torch.Generator().manual_seed(2))).to(DEVICE, dtype)
    with torch.inference_mode():
        parts = m.forward_fused(x, slots=True)
        summed = m.forward_fused(x)
        assert parts.shape == (T, 3, 96)
        torch.testing.assert_close(parts.float().sum(1).to(dtype), summed, rtol=0, atol=0)
        out, new_res = layer_ops.add_rmsnorm(parts, res, weight, 1e-6)
        want, want_res = layer_ops.add_rmsnorm(summed, res, weight, 1e-6)
    if INTERPRET and dtype == torch.bfloat16:  # the interpreter casts float32 to bf16 by truncation
        torch.testing.assert_close(new_res, want_res, rtol=2 ** -6, atol=2 ** -5)  # two truncations
    else:
        assert torch.equal(new_res, want_res) and torch.equal(out, want)
    with pytest.raises(ValueError, match="do not fit the residual"):
        layer_ops.add_rmsnorm(parts[:, :, :64], res, weight, 1e-6)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_garbage_row_spoils_only_itself(family):
    """A padding row's activations are garbage, NaN included (the attention kernels leave padding rows
    unwritten): its routing still names real experts, so the sort and every other row's output stay
    what they are without it."""
    m = moe(E=8, k=2, seed=3, family=family)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.inference_mode():
        want = m.forward_fused(x)
        _, ids = m.route_fused(x)
        x[[5, 17, 30]] = float("nan")
        _, nan_ids = m.route_fused(x)
        got = m.forward_fused(x)
    assert ((nan_ids >= 0) & (nan_ids < 8)).all()
    keep = [i for i in range(40) if i not in (5, 17, 30)]
    assert torch.equal(nan_ids[keep], ids[keep])
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)  # blocks shared differently


@pytest.mark.parametrize("T", [1, 5, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family,H,parts_in", [("qwen3_moe", 128, 1), ("qwen3_moe", 192, 2), ("gpt_oss", 192, 3)])
def test_norm_router_is_add_rmsnorm_then_the_router(T, dtype, family, H, parts_in):
    """norm_router: the residual add and RMSNorm as layer_ops.add_rmsnorm gives them (bit for bit: the same
    elementwise steps), and router logit parts whose sum is the router GEMM over that output (the bias
    in the first part); the top-k over them picks the torch routing's experts (float32: no ties)."""
    m = moe(E=8, k=2, H=H, dtype=dtype, seed=T, family=family)
    g = torch.Generator().manual_seed(T + H)
    a = torch.randn(T, parts_in, H, generator=g).to(DEVICE) if parts_in > 1 else \
        torch.randn(T, H, generator=g).to(DEVICE, dtype)
    res = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    nw = (1 + 0.2 * torch.randn(H, generator=g)).to(DEVICE, dtype)
    weight, bias, softmax_all, norm = m.routing()
    with torch.inference_mode():
        out, new_res, logits = moe_routing.norm_router(a, res, nw, 1e-6, weight, bias)
        want, want_res = layer_ops.add_rmsnorm(a, res, nw, 1e-6)
        assert torch.equal(new_res, want_res) and torch.equal(out, want)
        assert logits.shape == (T, moe_routing.router_parts(H)[0], 8) and logits.dtype == torch.float32
        ref = torch.nn.functional.linear(out.double(), weight.double(), None if bias is None else bias.double())
        torch.testing.assert_close(logits.double().sum(1), ref, rtol=1e-4, atol=1e-4)
        if dtype == torch.float32:
            w, ids = moe_routing.route_topk(logits, 2, softmax_all, norm, dtype)
            want_w, want_ids = m.route(out)
            assert torch.equal(ids, want_ids)
            torch.testing.assert_close(w, want_w, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="norm_router takes"):
        moe_routing.norm_router(torch.randn(T, 100).to(DEVICE, dtype), torch.randn(T, 100).to(DEVICE, dtype),
                               nw[:100], 1e-6, weight[:, :100], bias)


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (3, 16, 2), (6, 8, 3)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("direct", [None, 0])
def test_routing_in_the_gate_up_kernel(T, E, k, dtype, family, direct, monkeypatch):
    """fused_moe(route=...): on the direct path the gate_up kernel routes each row from the router's
    logit parts itself; the expert outputs equal, bit for bit, those of the same kernels given the top-k
    kernel's routing (and the sorted path routes with the top-k kernel)."""
    if direct is not None:
        monkeypatch.setattr(settings, "MOE_DIRECT", direct)
    m = moe(E=E, k=k, H=128, dtype=dtype, seed=T + E, family=family)
    g = torch.Generator().manual_seed(T)
    a = torch.randn(T, 2, 128, generator=g).to(DEVICE)
    res = torch.randn(T, 128, generator=g).to(DEVICE, dtype)
    nw = (1 + 0.2 * torch.randn(128, generator=g)).to(DEVICE, dtype)
    weight, bias, softmax_all, norm = m.routing()
    ex = m.experts
    with torch.inference_mode():
        x, _, logits = moe_routing.norm_router(a, res, nw, 1e-6, weight, bias)
        w, ids = moe_routing.route_topk(logits, k, softmax_all, norm, dtype)
        args = (x, ex.gate_up_proj, ex.down_proj)
        want = fused_moe(*args, w, ids, m.kernel_act(), ex.gate_up_proj_bias, ex.down_proj_bias, slots=True)
        got = fused_moe(*args, None, None, m.kernel_act(), ex.gate_up_proj_bias, ex.down_proj_bias, slots=True,
                        route=(logits, k, softmax_all, norm))
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("T", [1, 4, 40])
def test_layer_after_attention_in_three_kernels(family, T, monkeypatch):
    """MoE.norm_forward_fused (the post-attention norm, router, top-k and experts as the layer runs them
    on the fused path; up to NORM_ROUTER_ROWS rows in three kernels, more as before) against the norm and
    the torch MoE, float32; FLASHDRAFT_ROUTE_IN_NORM=0 gives the same."""
    from flashdraft.models.layers import RMSNorm

    m = moe(E=8, k=2, H=128, seed=T, family=family)
    norm = RMSNorm(128, 1e-6).to(DEVICE)
    g = torch.Generator().manual_seed(T)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.2 * torch.randn(128, generator=g))
    a = torch.randn(T, 128, generator=g).to(DEVICE)
    res = torch.randn(T, 128, generator=g).to(DEVICE)
    with torch.inference_mode():
        want_res = a + res
        want = m.forward(norm(want_res))
        outs = []
        for on in (True, False):
            monkeypatch.setattr(settings, "ROUTE_IN_NORM", on)
            slots, new_res = m.norm_forward_fused(a, res, norm)
            assert slots.shape == (T, 2, 128)
            torch.testing.assert_close(new_res, want_res, rtol=0, atol=0)
            torch.testing.assert_close(slots.sum(1), want, rtol=1e-4, atol=1e-4)
            outs.append(slots)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)


def _fp8_experts(m, block):
    """m's experts quantized to block FP8 (each block's amax to 448): an FP8Experts in their place."""
    from flashdraft.models.moe import FP8Experts

    ex = m.experts
    E, two_i, H = ex.gate_up_proj.shape
    fp8 = FP8Experts(E, H, two_i // 2, block).to(DEVICE)
    bn, bk = block
    for name in ("gate_up_proj", "down_proj"):
        w = getattr(ex, name).detach().float().cpu()
        n, k = w.shape[1:]
        pad = torch.nn.functional.pad(w, (0, -k % bk, 0, -n % bn)).view(E, -(-n // bn), bn, -(-k // bk), bk)
        scale = pad.abs().amax(dim=(2, 4)) / 448.0
        full = scale.repeat_interleave(bn, 1)[:, :n].repeat_interleave(bk, 2)[:, :, :k]
        q = (w / full).to(torch.float8_e4m3fn)
        getattr(fp8, name).data.copy_(q.view(torch.uint8).to(DEVICE))
        getattr(fp8, name + "_scale_inv").data.copy_(scale.contiguous().view(torch.int32).to(DEVICE))
    m.experts = fp8
    return m


@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (16, 6, 3), (70, 8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("direct", [None, 0])
def test_fp8_experts_match_their_dequantized_torch_path(T, E, k, dtype, direct, monkeypatch):
    """Block-FP8 experts (blocks of 16 x 32: the down projection's 80 columns end inside a block): the
    grouped kernels' scaled path against the torch path over the same weights dequantized, direct and
    sorted, through fused_moe and the layer's forward_fused."""
    if direct is not None:
        monkeypatch.setattr(settings, "MOE_DIRECT", direct)
    m = _fp8_experts(moe(E=E, k=k, dtype=dtype, seed=T), (16, 32))
    x = torch.randn(T, 96, generator=torch.Generator().manual_seed(T)).to(DEVICE, dtype) * 3
    with torch.inference_mode():
        want = m.forward(x)
        w, idx = m.route(x)
        got = fused_moe(x, *m.experts.kernel_args()[:2], w, idx, m.kernel_act(), scales=m.experts.kernel_args()[2])
        whole = m.forward_fused(x) if dtype == torch.float32 else got
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for out in (got, whole):
        err = (out.float() - want.float()).abs().max().item() / max(want.float().abs().max().item(), 1e-6)
        assert err < tol, err
    with pytest.raises(ValueError, match="FP8 experts need"):
        fused_moe(x, *m.experts.kernel_args()[:2], w, idx, m.kernel_act(), scales=(*m.experts.kernel_args()[2][:2],
                                                                                    (24, 32)))
