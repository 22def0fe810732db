"""The fused Triton kernels of kernels/layer_ops.py against the torch path they replace:
add + RMSNorm, q/k norm + RoPE + paged K/V store (Llama without q/k norm, Qwen3 with; head_dim 64
and 128; GQA; scaled rope tables; slot -1 rows), silu * mul, the DFlash context write (stacked and
separate caches); whole model forwards (hidden, taps, caches); the engine end to end (greedy
tokens, plain and DFlash, eager and through the graph runner's static buffers).

Runs on CUDA, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, where bf16 casts
truncate instead of rounding: bf16 tolerances are loose); skipped when neither is available."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from fixtures import tiny_config  # noqa: E402

from flashdraft.attention.base import AttentionBatch  # noqa: E402
from flashdraft.attention.torch_ref import TorchAttention  # noqa: E402
from flashdraft.kernels import layer_ops, token_ops  # noqa: E402
from flashdraft.kernels.dispatch import fused_enabled, fused_mode  # noqa: E402
from flashdraft.models.dflash_draft import DFlashDraftModel  # noqa: E402
from flashdraft.models.layers import MLP, Embedding, RMSNorm  # noqa: E402
from flashdraft.models.rope import RotaryTable, apply_rope  # noqa: E402
from flashdraft.models.transformer import DecoderLM  # noqa: E402
from flashdraft.speculative.formats import DraftSpec  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
TOL = {torch.float32: 2e-5, torch.bfloat16: 6e-2}


def randn(*shape, dtype=torch.float32, gen=None, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE, dtype)


def close(got, want, dtype, what=""):
    err = (got.float() - want.float()).abs().max().item() if got.numel() else 0.0
    bound = TOL[dtype] * max(1.0, want.float().abs().max().item())
    assert err <= bound, f"{what}: max abs diff {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 64), (5, 100), (3, 4096)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm(rows, n, with_residual, dtype):
    g = torch.Generator().manual_seed(n + rows)
    norm = RMSNorm(n, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + randn(n, gen=g, scale=0.2))
    x, res = randn(rows, n, dtype=dtype, gen=g), randn(rows, n, dtype=dtype, gen=g, scale=3.0)
    with torch.no_grad():
        want_res = x + res if with_residual else x
        want = norm(want_res)
    out, new_res = layer_ops.add_rmsnorm(x, res if with_residual else None, norm.weight, norm.eps)
    assert out.dtype == want.dtype and out.shape == want.shape and new_res.shape == x.shape
    close(new_res, want_res, dtype, "residual")
    close(out, want, dtype, "normed")
    if dtype == torch.float32:
        assert torch.equal(new_res, want_res)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n,with_residual", [(1, 1024, False), (7, 256, True), (3, 5120, True)])
def test_add_offset_rmsnorm(rows, n, with_residual, dtype):
    """offset=True against the hybrid targets' zero-centred norm, (1 + w) in float32, rounded once."""
    from flashdraft.models.hybrid import OffsetRMSNorm

    g = torch.Generator().manual_seed(n + rows)
    norm = OffsetRMSNorm(n, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(randn(n, gen=g, scale=0.2))
    x, res = randn(rows, n, dtype=dtype, gen=g), randn(rows, n, dtype=dtype, gen=g, scale=3.0)
    with torch.no_grad():
        want_res = x + res if with_residual else x
        want = norm(want_res)
    out, new_res = layer_ops.add_rmsnorm(x, res if with_residual else None, norm.weight, norm.eps, offset=True)
    assert out.dtype == want.dtype and out.shape == want.shape
    close(new_res, want_res, dtype, "residual")
    close(out, want, dtype, "normed")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape,dim", [((1,), 64), ((16,), 4096), ((3, 5), 100), ((0,), 64), ((2,), 2500)])
def test_embedding(shape, dim, dtype):
    """token_ops.embedding against nn.Embedding: exact copies of the rows, ids of any shape (int32 or
    int64), the module switch routing through it."""
    g = torch.Generator().manual_seed(dim)
    emb = Embedding(777, dim).to(DEVICE, dtype)
    with torch.no_grad():
        emb.weight.copy_(randn(777, dim, dtype=dtype, gen=g))
    ids = torch.randint(0, 777, shape, generator=g).to(DEVICE)
    ids[..., :1] = 776  # the last row too
    want = torch.nn.functional.embedding(ids, emb.weight)
    for t in (ids, ids.to(torch.int32)):
        got = token_ops.embedding(t, emb.weight)
        assert got.shape == (*shape, dim) and got.dtype == dtype and torch.equal(got, want)
    with fused_mode("on"), torch.no_grad():
        assert torch.equal(emb(ids), want)
    with pytest.raises(ValueError, match="embedding table"):
        token_ops.embedding(ids, emb.weight.t())


QK_CASES = {  # (model kind -> rope table and q/k norm, head_dim, heads, kv heads)
    "llama-d64-g2": ("llama", 64, 4, 2),
    "qwen3-d128-g4": ("qwen3", 128, 8, 2),
    "qwen3-d64-mha": ("qwen3", 64, 2, 2),
    "llama-d128-g8": ("llama", 128, 8, 1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7])
@pytest.mark.parametrize("case", list(QK_CASES))
def test_qk_norm_rope_store(case, T, dtype):
    kind, hd, H, KV = QK_CASES[case]
    g = torch.Generator().manual_seed(hd * 31 + H + T)
    rnd = random.Random(T + H)
    cfg = tiny_config(kind, 320, head_dim=hd, num_attention_heads=H, num_key_value_heads=KV)
    rope = RotaryTable(cfg, hd, 300, DEVICE, dtype)  # llama: the llama3-scaled table
    qk_norm = kind == "qwen3"
    q_norm, k_norm = RMSNorm(hd, 1e-6).to(DEVICE, dtype), RMSNorm(hd, 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        q_norm.weight.copy_(1 + randn(hd, gen=g, scale=0.3))
        k_norm.weight.copy_(1 + randn(hd, gen=g, scale=0.3))
    qkv = randn(T, (H + 2 * KV) * hd, dtype=dtype, gen=g, scale=2.0)
    positions = torch.tensor([rnd.randrange(300) for _ in range(T)], device=DEVICE)
    page, n_blocks = 8, 6
    slots = rnd.sample(range(page * n_blocks), T)
    if T > 1:
        slots[1] = slots[-1] = -1  # padding rows: not stored
    slot_mapping = torch.tensor(slots, device=DEVICE)
    kc, vc = randn(n_blocks, page, KV, hd, dtype=dtype, gen=g), randn(n_blocks, page, KV, hd, dtype=dtype, gen=g)

    with torch.no_grad():  # the torch path of Attention.forward
        q, k, v = qkv.split([H * hd, KV * hd, KV * hd], dim=-1)
        q, k, v = q.view(-1, H, hd), k.view(-1, KV, hd), v.view(-1, KV, hd)
        if qk_norm:
            q, k = q_norm(q), k_norm(k)
        cos, sin = rope.lookup(positions)
        want_q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        want_kc, want_vc = kc.clone(), vc.clone()
        keep = slot_mapping >= 0
        TorchAttention().store_kv(want_kc, want_vc, k[keep], v[keep], AttentionBatch(slot_mapping[keep], [], [], [],
                                                                                     page))
    got_kc, got_vc = kc.clone(), vc.clone()
    got_q = layer_ops.qk_norm_rope_store(qkv, positions, rope.cos, rope.sin, q_norm.weight if qk_norm else None,
                                     k_norm.weight if qk_norm else None, 1e-6, got_kc, got_vc, slot_mapping)
    assert got_q.shape == (T, H, hd)
    close(got_q, want_q, dtype, "q")
    close(got_kc, want_kc, dtype, "k cache")
    assert torch.equal(got_vc, want_vc)  # V is copied raw
    untouched = torch.ones(n_blocks * page, dtype=torch.bool, device=DEVICE)
    untouched[slot_mapping[keep]] = False
    assert torch.equal(got_kc.view(-1, KV, hd)[untouched], kc.view(-1, KV, hd)[untouched])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 7])
def test_gated_attention_fused_path(T, dtype):
    """The hybrid targets' gated attention (per head a query and an output gate, (1 + w) q/k norms,
    RoPE over a quarter of the head): qk_norm_rope_store(gated, offset) and sigmoid_gate give the
    torch path's output and K/V cache."""
    from flashdraft.models.hybrid import GatedAttention

    cfg = tiny_config("qwen3_5_text", 64)
    torch.manual_seed(T)
    layer = GatedAttention(cfg, rotary_dim=cfg.head_dim // 4)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.5)
    layer = layer.to(DEVICE, dtype)
    rope = RotaryTable(cfg, cfg.head_dim // 4, 300, DEVICE, dtype)
    page, n_blocks = 8, 4
    rnd = random.Random(T)
    slot_mapping = torch.tensor(rnd.sample(range(page * n_blocks), T), device=DEVICE)
    positions = torch.tensor([rnd.randrange(300) for _ in range(T)], device=DEVICE)
    x = randn(T, cfg.hidden_size, dtype=dtype, scale=1.0)
    kv = randn(2, n_blocks, page, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype)
    batch = AttentionBatch(slot_mapping, [0, T], [T], [list(range(n_blocks))], page)  # one sequence, causal
    outs, caches = [], []
    attn = TorchAttention()
    attn.prepare(batch, DEVICE)
    for mode in ("off", "on"):
        kc, vc = kv[0].clone(), kv[1].clone()
        with fused_mode(mode), torch.inference_mode():
            outs.append(layer(x, positions, rope, kc, vc, attn, batch))
        caches.append((kc, vc))
    close(outs[1], outs[0], dtype, "output")
    close(caches[1][0], caches[0][0], dtype, "k cache")
    assert torch.equal(caches[1][1], caches[0][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,inter", [(1, 96), (3, 1500)])
def test_silu_mul(T, inter, dtype):
    g = torch.Generator().manual_seed(inter)
    mlp = MLP(8, inter)
    x = randn(T, 2 * inter, dtype=dtype, gen=g, scale=3.0)
    gate, up = x.split(inter, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    got = layer_ops.silu_mul(x)
    assert got.shape == (T, inter) and mlp.inter == inter
    close(got, want, dtype, "silu_mul")


def randomize(model, scale):
    """Norm weights around 1, everything else N(0, scale): far from the identity, so a wrong fused
    kernel cannot hide behind unit norms."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else scale * torch.randn_like(p))
    return model


def random_drafter(n_layers=3, hd=64, dtype=torch.float32, seed=0, H=4, KV=2):
    layer = SimpleNamespace(hidden_size=96, intermediate_size=160, num_hidden_layers=n_layers, num_attention_heads=H,
                            num_key_value_heads=KV, head_dim=hd, rms_norm_eps=1e-6, attention_bias=False,
                            rope_theta=10000.0, rope_scaling=None, rope_parameters=None, max_position_embeddings=512,
                            vocab_size=50, model_type="qwen3")
    spec = DraftSpec(layer, 4, 49, [0, 2], None, "z-lab")
    torch.manual_seed(seed)
    d = randomize(DFlashDraftModel(spec), 0.2).to(DEVICE, dtype).eval()
    d.setup(200)
    return d


@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("hd,dtype", [(64, torch.float32), (128, torch.float32), (64, torch.bfloat16)])
def test_context_write(hd, dtype, stacked):
    """DFlashDraftModel.write_context: fused (one launch over stacked caches, or one per layer for
    separate tensors) against the torch path; slot -1 rows stay unwritten."""
    drafter = random_drafter(hd=hd, dtype=dtype)
    L, KV, page, n_blocks, T = 3, 2, 8, 5, 6
    g = torch.Generator().manual_seed(hd)
    taps = randn(T, 2 * 96, dtype=dtype, gen=g)
    positions = torch.tensor([3, 17, 18, 100, 150, 7], device=DEVICE)
    slots = torch.tensor([5, 9, -1, 33, 0, 39], device=DEVICE)
    kc, vc = randn(L, n_blocks, page, KV, hd, dtype=dtype, gen=g), randn(L, n_blocks, page, KV, hd, dtype=dtype, gen=g)
    keep = slots >= 0

    def run(mode):
        k, v = kc.clone(), vc.clone()
        kv = [(k[i], v[i]) for i in range(L)] if stacked else [(k[i].clone(), v[i].clone()) for i in range(L)]
        rows = slice(None) if mode == "on" else keep  # the torch store takes real slots only
        with fused_mode(mode), torch.inference_mode():
            drafter.write_context(taps[rows], positions[rows], kv, TorchAttention(),
                                  AttentionBatch(slots[rows], [], [], [], page))
        return torch.stack([a for a, _ in kv]), torch.stack([b for _, b in kv])

    want_k, want_v = run("off")
    launches = []
    kernel = layer_ops._context_kv_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return kernel[grid]

    layer_ops._context_kv_kernel = Counted()
    try:
        got_k, got_v = run("on")
    finally:
        layer_ops._context_kv_kernel = kernel
    assert len(launches) == (1 if stacked else L)
    close(got_k, want_k, dtype, "k caches")
    close(got_v, want_v, dtype, "v caches")
    assert torch.equal(got_k.flatten(1, 2)[:, 2 * page + 2], kc.flatten(1, 2)[:, 2 * page + 2])  # row 2 untouched


def random_target(kind, dtype=torch.float32, seed=0, **overrides):
    cfg = tiny_config(kind, 120, **overrides)
    torch.manual_seed(seed)
    m = randomize(DecoderLM(cfg), 0.15).to(DEVICE, dtype).eval()
    m.setup_rope(128)
    return m


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_decoder_forward_matches_torch_path(kind):
    """A mixed step (prefill chunk after context, decode row, 3-row verify) through the whole model:
    final hidden, taps and every layer's caches agree with the torch path."""
    model = random_target(kind, head_dim=32, num_hidden_layers=3)
    page, n_blocks = 8, 12
    L, KV, hd = 3, 2, 32
    g = torch.Generator().manual_seed(5)
    kc, vc = randn(L, n_blocks, page, KV, hd, gen=g), randn(L, n_blocks, page, KV, hd, gen=g)
    tables = [[3, 7, 1], [0, 9], [4, 11, 2, 5]]
    q_lens, ctx = [5, 1, 3], [10, 4, 20]
    ids, pos, slots, qsl = [], [], [], [0]
    for t, q, c in zip(tables, q_lens, ctx):
        for p in range(c, c + q):
            ids.append((p * 7) % 120)
            pos.append(p)
            slots.append(t[p // page] * page + p % page)
        qsl.append(qsl[-1] + q)
    batch = AttentionBatch(torch.tensor(slots, device=DEVICE), qsl, [c + q for c, q in zip(ctx, q_lens)], tables, page)
    ids, pos = torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE)

    def run(mode):
        k, v = kc.clone(), vc.clone()
        attn = TorchAttention()
        attn.prepare(batch, DEVICE)
        with fused_mode(mode), torch.inference_mode():
            hidden, taps = model(ids, pos, [(k[i], v[i]) for i in range(L)], attn, batch, tap_layers=(0, 2))
        return hidden, taps, k, v

    want = run("off")
    got = run("on")
    for a, b, what in zip(got, want, ("hidden", "taps", "k caches", "v caches")):
        close(a, b, torch.float32, what)


@pytest.mark.parametrize("kind", ["dflash2", "masked"])
def test_drafter_blocks_match_torch_path(kind):
    """Draft blocks through a DFlash2 drafter (convolutions between the fused kernels) or one with a causal
    sliding-window layer (LayerMasks over the Triton kernels): the fused path's hidden states and caches
    equal the torch path's."""
    from dataclasses import replace

    from flashdraft.attention.base import LayerMasks
    from flashdraft.attention.triton_backend import TritonAttention

    base = random_drafter().spec
    spec = replace(base, conv=(2, 16), selector=(8, 5)) if kind == "dflash2" else \
        replace(base, layer_masks=[(True, 5), (False, None), (False, 3)])
    torch.manual_seed(7)
    drafter = randomize(DFlashDraftModel(spec), 0.2).to(DEVICE).eval()
    drafter.setup(200)
    page, n_blocks, L, KV, hd, B = 8, 12, 3, 2, 64, 4
    g = torch.Generator().manual_seed(3)
    kc, vc = randn(L, n_blocks, page, KV, hd, gen=g), randn(L, n_blocks, page, KV, hd, gen=g)
    tables, ctx = [[3, 7, 1], [0, 9, 4]], [10, 6]
    slots = [t[p // page] * page + p % page for t, c in zip(tables, ctx) for p in range(c, c + B)]
    pos = torch.tensor([p for c in ctx for p in range(c, c + B)], device=DEVICE)
    batch = AttentionBatch(torch.tensor(slots, device=DEVICE), [0, B, 2 * B], [c + B for c in ctx], tables, page,
                           causal=False)
    embeds = randn(2 * B, 96, gen=g)

    def run(mode, make):
        k, v = kc.clone(), vc.clone()
        attn = LayerMasks(make, spec.layer_masks) if spec.layer_masks else make()
        attn.prepare(batch, DEVICE)
        with fused_mode(mode), torch.inference_mode():
            h = drafter(embeds, pos, [(k[i], v[i]) for i in range(L)], attn, batch)
        return h, k, v

    want = run("off", TorchAttention)
    got = run("on", TritonAttention)
    for a, b, what in zip(got, want, ("hidden", "k caches", "v caches")):
        close(a, b, torch.float32, what)


def test_switch():
    """auto: only CUDA activations; off: never; never with grad (no backward)."""
    x = torch.zeros(2, device=DEVICE)
    with torch.inference_mode():
        with fused_mode("auto"):
            assert fused_enabled(x) == (DEVICE.type == "cuda")
        with fused_mode("off"):
            assert not fused_enabled(x)
        with fused_mode("on"):
            assert fused_enabled(x)
    with fused_mode("on"):
        assert not fused_enabled(x)  # grad enabled


@pytest.mark.parametrize("with_drafter,graphs,backend", [(False, False, "triton"), (True, False, "torch"),
                                                         (True, True, "triton")])
def test_engine_tokens_match_torch_path(tiny_qwen3, tmp_path, monkeypatch, with_drafter, graphs, backend):
    """Greedy generation with the fused path (DFlash draft, verify and context writes; optionally
    through the graph runner's static buffers; the torch attention backend beside it works too, as
    on a GPU with attention_backend="torch") gives the torch path's tokens."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams

    draft = str(build_random_drafter(tmp_path / "d", tiny_qwen3, block_size=4)) if with_drafter else None
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 60))]
    params = SamplingParams(max_tokens=7, ignore_eos=True)
    # one step at a time: with async scheduling a verify launched ahead for a request that then finished
    # is computed and dropped, and its drafts would be recorded too
    kw = dict(draft=draft, device=str(DEVICE), dtype="float32", max_num_batched_tokens=24, kv_block_size=8,
              async_scheduling=False)
    import flashdraft.speculative.dflash as dflash
    from flashdraft.speculative.graphs import StepGraphs

    drafts = []  # every verify's drafts: tokens are lossless whatever the drafter does, the drafts show it agrees
    real_accept = dflash.accept_plans

    def recorded(plans, ids, toks):
        drafts.append([ids[p.row + 1: p.row + p.n].tolist() for p in plans if p.verify])
        return real_accept(plans, ids, toks)

    monkeypatch.setattr(dflash, "accept_plans", recorded)
    # greedy graphed steps would take tokens and acceptance from their post graph, past accept_plans: here
    # they take the eager route that every other step takes, so that every verify's drafts are seen
    monkeypatch.setattr(StepGraphs, "greedy_post", staticmethod(lambda plans, g, checked=(): False))
    with fused_mode("off"):
        ref = LLM(str(tiny_qwen3), attention_backend="torch", **kw)
        want = [o.token_ids for o in ref.generate(prompts, params)]
    want_drafts, drafts[:] = list(drafts), []
    counts = {}

    def counting(name, fn):
        def counted(*a, **k):
            counts[name] = counts.get(name, 0) + 1
            return fn(*a, **k)
        return counted

    for name in ("add_rmsnorm", "qk_norm_rope_store", "silu_mul", "context_kv_store"):
        monkeypatch.setattr(layer_ops, name, counting(name, getattr(layer_ops, name)))
    with fused_mode("on"):
        llm = LLM(str(tiny_qwen3), attention_backend=backend, **kw)
        llm.engine.runner.use_graphs = graphs  # on CPU the graph runner replays eagerly over its buffers
        got = [o.token_ids for o in llm.generate(prompts, params)]
    assert got == want
    assert counts["qk_norm_rope_store"] > 0 and counts["silu_mul"] > 0 and counts["add_rmsnorm"] > 0
    assert ("context_kv_store" in counts) == with_drafter
    if graphs:
        assert llm.engine.runner.graphs
    if with_drafter:
        assert llm.engine.spec_totals()["num_drafts"] > 0
        assert drafts == want_drafts


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 100), (16, 5000), (3, 2048), (2, 4097)])
def test_argmax(rows, n, dtype):
    """token_ops.argmax against torch.argmax: ties (bf16 has many) to the lowest index, rows whose
    maximum sits in the first, a middle or the last entry; the sampler's greedy path through it."""
    from flashdraft.engine.sampler import greedy_tokens

    g = torch.Generator().manual_seed(rows * n)
    x = randn(rows, n, dtype=dtype, gen=g, scale=3.0)
    x[:, n // 2:] = x[:, : n - n // 2]  # every value twice: the first copy must win
    x[0, -1] = 100.0
    if rows > 1:
        x[1, 0] = 100.0
    want = x.argmax(-1)
    assert torch.equal(token_ops.argmax(x), want)
    assert torch.equal(token_ops.argmax(x.t().contiguous().t()), want)  # strided rows
    with fused_mode("on"):
        assert torch.equal(greedy_tokens(x.view(rows, 1, n)), want.view(rows, 1))
    with pytest.raises(ValueError, match="argmax takes"):
        token_ops.argmax(x.view(-1))


@pytest.mark.parametrize("rows,n,k", [(7, 49152, 15), (3, 2049, 7), (2, 300, 15), (1, 5, 5), (4, 151936, 3)])
def test_topk_log_softmax(rows, n, k):
    """token_ops.topk_log_softmax against torch's log_softmax + topk in float64: the same
    log-probabilities, the same columns where values differ, ties to the lower column (the largest
    value twice in row 0, once at a part's edge), values spanning a part boundary; the tree
    sampler's candidates through it."""
    from flashdraft.engine.sampler import draw_candidates

    g = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64) * 4
    top = float(x.max()) + 1
    x[0, min(n - 1, 2047)] = top
    x[0, min(n - 1, 2047) - 1] = top  # a tie: the lower column first
    x32 = x.float().to(DEVICE)
    want_lp, want_ix = x.float().double().log_softmax(-1).topk(k)
    lp, ix = token_ops.topk_log_softmax(x32, k)
    assert lp.dtype == torch.float32 and ix.dtype == torch.int64 and lp.shape == ix.shape == (rows, k)
    torch.testing.assert_close(lp.double().cpu(), want_lp, atol=2e-5, rtol=0)
    assert torch.equal(x32.cpu().gather(1, ix.cpu()), x.float().gather(1, want_ix))  # the same values, in order
    assert ix[0, :2].tolist() == [min(n - 1, 2047) - 1, min(n - 1, 2047)]
    assert (ix.cpu() == want_ix)[:, 2:].all() or n == 5  # distinct values: the same columns
    with fused_mode("on"), torch.no_grad():
        c_lp, c_ix = draw_candidates(x32, k)
    assert torch.equal(c_ix, ix) and torch.equal(c_lp, lp)
    with pytest.raises(ValueError, match="topk_log_softmax takes"):
        token_ops.topk_log_softmax(x32, n + 1)


@pytest.mark.parametrize("lens", [[13, 40, 9], [21, 0, 0, 0], [8]])
def test_block_slots(lens):
    """token_ops.block_slots against graphed.py's torch ops: each draft-block row's slot from its
    position and its request's block table, -1 for the rows of requests without rows."""
    B, page, S = 8, 4, len(lens)
    g = torch.Generator().manual_seed(sum(lens))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    tables = torch.randperm(64, generator=g)[: S * 12].view(S, 12).to(DEVICE, torch.int32)
    positions = (torch.clamp(seq_lens.long() - B, min=0)[:, None] + torch.arange(B, device=DEVICE)).flatten()
    seq = torch.arange(S * B, device=DEVICE) // B
    page_of = tables[seq, positions // page].long()
    want = torch.where(seq_lens[seq] > 0, page_of * page + positions % page, -1)
    out = torch.full((S * B,), 99, dtype=torch.long, device=DEVICE)
    token_ops.block_slots(positions, seq_lens, tables, page, out)
    assert torch.equal(out, want)


@pytest.mark.parametrize("k1", [8, 4])
@pytest.mark.parametrize("count", [True, False])
def test_advance_blocks(k1, count):
    """token_ops.advance_blocks against the rule written out per request: a live request's block
    starts one past its accepted drafts (its positions, its length = start + B), its first id the
    target's token at that row, the other ids untouched; a request without rows (length 0) keeps
    everything; counting from the drafts, the outcome holds the counts, then every target token."""
    B, lens = 8, [40, 0, 17, 9, 0, 25]
    S = len(lens)
    g = torch.Generator().manual_seed(k1 * 10 + count)
    toks = torch.randint(0, 50, (S, k1), generator=g)
    want_acc = [s % k1 for s in range(S)]  # 0 .. k1 - 1 accepted (k1 - 1: every draft)
    drafts = torch.randint(50, 99, (S, k1 - 1), generator=g)  # never the target's token ...
    for s, a in enumerate(want_acc):
        drafts[s, :a] = toks[s, :a]  # ... but for the accepted ones
    positions = torch.cat([torch.arange(max(n - B, 0), max(n - B, 0) + B) for n in lens])
    ids = torch.randint(0, 50, (S * B,), generator=g)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    want_pos, want_ids, want_lens = positions.clone(), ids.clone(), seq_lens.clone()
    for s, (n, a) in enumerate(zip(lens, want_acc)):
        if n:
            start = int(positions[s * B]) + a + 1
            want_pos[s * B: (s + 1) * B] = torch.arange(start, start + B)
            want_lens[s] = start + B
            want_ids[s * B] = toks[s, a]
    pos_d, ids_d, lens_d = positions.to(DEVICE), ids.to(DEVICE), seq_lens.to(DEVICE)
    if count:
        rows = torch.cat([ids.view(S, B)[:, :1], drafts], 1).to(DEVICE)  # a verify's input: the drafts a view
        outcome = torch.full((S + S * k1,), -7, dtype=torch.long, device=DEVICE)
        token_ops.advance_blocks(pos_d, ids_d, lens_d, toks.to(DEVICE), drafts=rows[:, 1:], outcome=outcome)
        assert outcome[:S].tolist() == want_acc
        assert torch.equal(outcome[S:].cpu(), toks.flatten())
    else:
        acc = torch.tensor(want_acc, device=DEVICE)
        token_ops.advance_blocks(pos_d, ids_d, lens_d, toks.to(DEVICE), acc=acc)
    assert torch.equal(pos_d.cpu(), want_pos) and torch.equal(ids_d.cpu(), want_ids)
    assert torch.equal(lens_d.cpu(), want_lens)


@pytest.mark.skipif(not INTERPRET, reason="CPU graph harness; on CUDA test_engine_graphs runs this kernel")
@pytest.mark.parametrize("overlap", [False, True])
def test_graphed_chain_steps_advance_blocks_in_the_kernel(tiny_llama, tmp_path, monkeypatch, overlap):
    """The engine's graphed chain steps (CPU harness: eager replays of the static buffers) with each
    greedy step's acceptance, outcome and next blocks from advance_blocks: plain decoding's tokens,
    step by step and overlapped (each next step launched on the blocks the kernel moved on)."""
    from fixtures import build_random_drafter
    from test_graphs import _graphed_llm

    import flashdraft.speculative.graphs as graphs_mod
    from flashdraft import LLM, SamplingParams

    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8)
    ref = [o.token_ids for o in LLM(str(tiny_llama), draft=None, **kw).generate(prompts, params)]
    kw.update(draft=str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)), async_scheduling=overlap)
    counted, real = [], token_ops.advance_blocks
    monkeypatch.setattr(token_ops, "advance_blocks",
                        lambda *a, **k: counted.append(k.get("drafts") is not None) or real(*a, **k))
    monkeypatch.setattr(graphs_mod, "fused_enabled", lambda x: True)  # the models stay on the torch path
    graphed, replays = _graphed_llm(str(tiny_llama), kw)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == ref
    assert replays["dflash"] > 0 and any(counted), (replays, counted)
    if overlap:
        assert graphed.engine.stats["num_overlapped_steps"] > 0


@pytest.mark.parametrize("S,k", [(1, 15), (5, 3), (32, 15), (3, 1), (2, 20)])
def test_accepted_lengths(S, k):
    """The acceptance kernel against the torch rule on [S, k] drafts whose first mismatch sits
    anywhere (none included), on strided views like the engine's verify rows."""
    from flashdraft.speculative.verify import accepted_lengths

    g = torch.Generator().manual_seed(S * 100 + k)
    target = torch.randint(0, 50, (S, k + 1), generator=g)
    rows = torch.cat([target[:, :1], target[:, :-1]], 1)  # a verify's input: x_start then the drafts
    for s in range(S):
        j = s % (k + 1)  # first wrong draft, k: all right
        if j < k:
            rows[s, 1 + j] = target[s, j] + 1
        rows[s, 2 + j:] = torch.randint(0, 50, (max(0, k - 1 - j),), generator=g)
    want = (rows[:, 1:] == target[:, :-1]).long().cumprod(1).sum(1)
    assert want.tolist() == [s % (k + 1) for s in range(S)]
    got = token_ops.accepted_lengths(rows.to(DEVICE)[:, 1:], target.to(DEVICE))
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    with fused_mode("on"), torch.inference_mode():
        assert accepted_lengths(rows.to(DEVICE)[:, 1:], target.to(DEVICE)).tolist() == want.tolist()
