"""Triton paged attention and KV store against the torch reference backend: decode, verify (causal),
draft (non-causal), prefill chunks after context, ragged batches, GQA, page sizes, shuffled pages,
padding sequences and rows, split-K over long context, fp32 and bf16; the engine end to end.

Runs on CUDA, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1, small shapes);
skipped when triton is missing or neither is available."""

from __future__ import annotations

import os
import random

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashdraft import settings  # noqa: E402
from flashdraft.attention.base import AttentionBatch, DeviceMeta  # noqa: E402
from flashdraft.attention.torch_ref import FP8, TorchAttention, to_pages  # noqa: E402
from flashdraft.attention.triton_backend import TritonAttention  # noqa: E402
from flashdraft.kernels import attention, attention_splits  # noqa: E402
from flashdraft.kernels.attention import paged_attention, store_kv  # noqa: E402
from flashdraft.kernels.launch import arrival_counts, sm_count  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def make_case(q_lens, ctx, *, n_kv=2, group=2, hd=64, page=16, dtype=torch.float32, causal=True, pad_rows=0,
              seed=0, n_blocks=None, window=None, kv_dtype=None):
    """Random caches with shuffled pages; sequence s has ctx[s] cached keys and q_lens[s] new rows.
    A (0, 0) entry is a padding sequence; pad_rows extra rows at the end have slot -1. kv_dtype: the
    pages' (default dtype; FP8 pages hold the random values as to_pages stores them)."""
    g = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    seq_lens = [c + q for q, c in zip(q_lens, ctx)]
    n_blocks = n_blocks or sum(-(-sl // page) for sl in seq_lens) + 3
    free = list(range(n_blocks))
    rnd.shuffle(free)
    tables = [[free.pop() for _ in range(-(-sl // page))] for sl in seq_lens]
    slots = [t[p // page] * page + p % page for t, c, sl in zip(tables, ctx, seq_lens) for p in range(c, sl)]
    T = sum(q_lens) + pad_rows
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE, dtype)

    def pages():
        return rand(n_blocks, page, n_kv, hd) if kv_dtype in (None, dtype) else \
            to_pages(rand(n_blocks, page, n_kv, hd), kv_dtype)

    return dict(
        k_cache=pages(), v_cache=pages(),
        q=rand(T, n_kv * group, hd), k=rand(T, n_kv, hd), v=rand(T, n_kv, hd),
        batch=AttentionBatch(torch.tensor(slots + [-1] * pad_rows, device=DEVICE), qsl, seq_lens, tables, page,
                             causal, window=window),
        rows=qsl[-1], scale=hd**-0.5,
    )


def reference(c):
    """Caches after the store and the output rows of the torch backend."""
    b = c["batch"]
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    keep = b.slot_mapping >= 0
    ref_batch = AttentionBatch(b.slot_mapping[keep], b.query_start_loc, b.seq_lens, b.block_tables, b.block_size,
                               b.causal, b.tree_mask, b.window)
    be = TorchAttention()
    be.prepare(ref_batch, DEVICE)
    be.store_kv(kc, vc, c["k"][keep], c["v"][keep], ref_batch)
    return kc, vc, be.forward(c["q"], kc, vc, ref_batch, c["scale"])[: c["rows"]]


def run_triton(c, num_splits=None, meta=None):
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    meta = meta or DeviceMeta.from_batch(c["batch"], DEVICE)
    store_kv(kc, vc, c["k"], c["v"], meta.slot_mapping)
    out = paged_attention(c["q"], kc, vc, meta, c["scale"], num_splits=num_splits)
    return kc, vc, out[: c["rows"]]


def same_pages(got, want):
    """Equal pages (FP8 ones bytewise)."""
    if got.dtype == FP8:
        return torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    return torch.equal(got, want)


def on_fp8_grid(x):
    """Under the interpreter, whose float8 cast does not round to nearest (0.49 -> 0.25): x's values below
    448 moved onto e4m3's grid, so that storing them needs no rounding (those past 448 still saturate)."""
    return torch.where(x.abs() > 448, x, to_pages(x, FP8).to(x.dtype)) if INTERPRET else x


def check(c, tol=None, **kw):
    want_k, want_v, want = reference(c)
    got_k, got_v, got = run_triton(c, **kw)
    assert same_pages(got_k, want_k) and same_pages(got_v, want_v)
    assert got.dtype == c["q"].dtype
    err = (got.float() - want.float()).abs().max().item() if want.numel() else 0.0
    assert err < (tol or TOL[c["q"].dtype]) * max(1.0, want.abs().max().item() if want.numel() else 0.0), err


SCENARIOS = {  # q_lens, ctx, causal, pad_rows
    "decode": ([1, 1, 1, 1], [5, 17, 40, 64], True, 0),
    "verify": ([16, 16, 1], [3, 37, 20], True, 0),
    "draft": ([16, 16], [9, 50], False, 0),
    "prefill": ([100, 1, 16], [30, 44, 0], True, 0),
    "padding": ([1, 0, 16, 0], [12, 0, 7, 0], True, 3),
}
CONFIGS = [  # n_kv, group, head_dim, page, dtype
    (2, 1, 64, 16, torch.float32),
    (2, 4, 128, 8, torch.float32),
    (1, 3, 64, 32, torch.bfloat16),
    (1, 8, 128, 16, torch.bfloat16),
    (8, 2, 32, 16, torch.float32),
    (2, 2, 96, 16, torch.float32),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"kv{c[0]}-g{c[1]}-d{c[2]}-p{c[3]}-{str(c[4])[6:]}")
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_matches_torch(scenario, config):
    q_lens, ctx, causal, pad_rows = SCENARIOS[scenario]
    n_kv, group, hd, page, dtype = config
    check(make_case(q_lens, ctx, n_kv=n_kv, group=group, hd=hd, page=page, dtype=dtype, causal=causal,
                    pad_rows=pad_rows))


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_pages(scenario, dtype):
    """kv_cache_dtype fp8: K/V stored saturated in float8 e4m3 pages (some new rows past +-448) and read
    widened, in every scenario, against the torch backend over the same pages."""
    q_lens, ctx, causal, pad_rows = SCENARIOS[scenario]
    c = make_case(q_lens, ctx, n_kv=2, group=3, hd=64, dtype=dtype, causal=causal, pad_rows=pad_rows, seed=12,
                  kv_dtype=FP8)
    c["k"][::5, :, :2] = 600.0  # key values past 448 (saturated), in dims the queries leave out: huge logits
    c["k"][2::5, :, 5] = -900.0  # would be rounded apart (bf16 scores)
    c["q"][:, :, [0, 1, 5]] = 0.0
    c["v"][1::4] *= 500
    c["k"], c["v"] = on_fp8_grid(c["k"]), on_fp8_grid(c["v"])
    check(c)
    if scenario == "verify":
        check(c, num_splits=4)


@pytest.mark.parametrize("num_splits", [None, 4])
def test_fp8_pages_under_tree_masks_and_windows(num_splits):
    from flashdraft.speculative.tree import ancestor_masks

    c = make_case([16, 1, 40], [70, 33, 9], n_kv=2, group=2, hd=64, dtype=torch.bfloat16, seed=13, kv_dtype=FP8)
    mask = ancestor_masks(torch.tensor([[0, 0, 1, 1, 2, 2, 3, 4, 5, 3, 9, 10, 6, 12, 7]]), 15)[0].tolist()
    c["batch"].tree_mask = torch.tensor(mask + [0] * 41, device=DEVICE)
    c["k"], c["v"] = on_fp8_grid(c["k"]), on_fp8_grid(c["v"])
    check(c, num_splits=num_splits)
    c = make_case([1, 16, 40], [90, 37, 20], n_kv=2, group=3, hd=64, window=7, seed=14, kv_dtype=FP8)
    c["k"], c["v"] = on_fp8_grid(c["k"]), on_fp8_grid(c["v"])
    check(c, num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("window", [7, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_sliding_window(causal, window, num_splits):
    """Sliding-window rows (the DFlash reference's sliding drafter layers, sliding-window targets):
    decode, verify or draft blocks and a prefill chunk, with split-K partitions wholly before a window."""
    check(make_case([1, 16, 40, 16], [90, 37, 20, 3], n_kv=2, group=3, hd=64, causal=causal, window=window,
                    seed=7), num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize("window", [None, 7])
def test_attention_sinks(window, num_splits):
    """GPT-OSS attention sinks (one more logit per head, value zero) in decode, verify and prefill rows,
    counted once across split-K partitions, beside a sliding window."""
    c = make_case([1, 16, 40, 16], [90, 37, 20, 3], n_kv=2, group=3, hd=64, window=window, seed=9)
    sinks = torch.randn(6, generator=torch.Generator().manual_seed(1)).to(DEVICE) * 2
    b = c["batch"]
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    ref = TorchAttention()
    ref.prepare(b, DEVICE)
    ref.store_kv(kc, vc, c["k"], c["v"], b)
    want = ref.forward(c["q"], kc, vc, b, c["scale"], sinks)
    got = paged_attention(c["q"], kc, vc, DeviceMeta.from_batch(b, DEVICE), c["scale"], num_splits=num_splits,
                          sinks=sinks)
    assert (got - want).abs().max().item() < TOL[torch.float32]
    plain = paged_attention(c["q"], kc, vc, DeviceMeta.from_batch(b, DEVICE), c["scale"], num_splits=num_splits)
    assert (plain - want).abs().max().item() > 1e-3  # the sinks change the output


@pytest.mark.parametrize("causal", [True, False])
def test_draft_and_verify_mixed_with_decode_bf16(causal):
    check(make_case([16, 1, 16, 1], [21, 33, 0, 2], n_kv=2, group=4, hd=64, dtype=torch.bfloat16, causal=causal,
                    seed=3))


@pytest.mark.parametrize("num_splits", [None, 1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_tree_rows(dtype, num_splits):
    """Token-tree verify blocks (rows see the context and their ancestors' rows: speculative/tree.py) beside
    a causal verify, a prefill chunk and a decode row, against the torch backend (itself checked
    against float64 in tests/test_attention.py)."""
    from flashdraft.speculative.tree import ancestor_masks

    c = make_case([16, 8, 16, 40, 1], [70, 3, 20, 9, 33], n_kv=2, group=3, hd=64, dtype=dtype, seed=5)
    parents = [[0, 0, 1, 1, 2, 2, 3, 4, 5, 3, 9, 10, 6, 12, 7], [0, 1, 1, 0, 4, 2, 6]]
    masks = [ancestor_masks(torch.tensor([p]), 15)[0].tolist() for p in parents]
    c["batch"].tree_mask = torch.tensor(masks[0] + masks[1] + [0] * (16 + 40 + 1), device=DEVICE)
    check(c, num_splits=num_splits)
    plain = dict(c, batch=AttentionBatch(**{**vars(c["batch"]), "tree_mask": None}))
    assert (run_triton(c)[2] - run_triton(plain)[2])[:24].abs().max() > 1e-2  # the mask changed the tree rows


@pytest.mark.parametrize("q_len, causal", [(1, True), (16, True), (16, False)])
def test_split_k_long_context(q_len, causal):
    """Batch 1 with 4k keys: the heuristic splits the key range; same result as one partition."""
    c = make_case([q_len], [4096 - q_len], n_kv=2, group=4, hd=64, causal=causal, seed=1)
    meta = DeviceMeta.from_batch(c["batch"], DEVICE)
    assert attention_splits._num_splits(2, 4096, DEVICE) > 1  # one 64-row query tile x 2 kv heads
    check(c)
    assert torch.allclose(run_triton(c, meta=meta)[2], run_triton(c, num_splits=1, meta=meta)[2], atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_k_ragged(dtype):
    """Sequences shorter than most partitions (neutral partials), a padding sequence, padding rows."""
    check(make_case([1, 16, 1, 0, 5], [900, 10, 0, 0, 300], n_kv=1, group=4, hd=64, page=32, dtype=dtype,
                    pad_rows=2, seed=2), num_splits=6)


def test_split_k_merge_over_several_loads():
    """40 partitions of 64+ keys, all holding keys: the merge takes them in three loads (16
    partitions x group 4 per load) and rescales between them."""
    check(make_case([1, 16], [3000, 2600], n_kv=1, group=4, hd=64, page=32, seed=5), num_splits=40)


@pytest.mark.parametrize("num_splits", [1, 6])
def test_zero_padding_rows(num_splits):
    """zero_padding: rows past the last sequence come out zero, through the split-K merge or the
    fill before a single partition, over an output that held garbage; the other rows as before."""
    c = make_case([1, 16, 1, 0, 5], [900, 10, 0, 0, 300], n_kv=1, group=4, hd=64, page=32, pad_rows=2, seed=2)
    meta = DeviceMeta.from_batch(c["batch"], DEVICE)
    want = attention.paged_attention(c["q"], c["k_cache"], c["v_cache"], meta, c["scale"], num_splits=num_splits)
    out = torch.full_like(c["q"], float("nan"))
    got = attention.paged_attention(c["q"], c["k_cache"], c["v_cache"], meta, c["scale"], out=out,
                                       num_splits=num_splits, zero_padding=True)
    rows = c["rows"]
    assert got.shape[0] == rows + 2
    assert torch.equal(got[:rows], want[:rows])
    assert torch.equal(got[rows:], torch.zeros_like(got[rows:]))


@pytest.mark.parametrize("num_splits", [1, 3, 40])
def test_zero_padding_rows_outnumbering_the_programs(num_splits):
    """More padding rows than the grid's sequences take in one pass (2 sequences x 8 rows of a
    32-row tile of group 4): each zeroes its share in turns; with 3 partitions the tiles' last
    partitions merge (and leave the arrival counts at zero), with 40 the merge kernel does."""
    c = make_case([1, 5], [700, 40], n_kv=2, group=4, hd=64, page=16, pad_rows=37, seed=9)
    meta = DeviceMeta.from_batch(c["batch"], DEVICE)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    store_kv(kc, vc, c["k"], c["v"], meta.slot_mapping)
    out = torch.full_like(c["q"], float("nan"))
    got = attention.paged_attention(c["q"], kc, vc, meta, c["scale"], out=out, num_splits=num_splits,
                                       zero_padding=True)
    rows = c["rows"]
    assert got.shape[0] == rows + 37 and torch.equal(got[rows:], torch.zeros_like(got[rows:]))
    _, _, want = reference(c)
    assert (got[:rows].float() - want.float()).abs().max().item() < TOL[c["q"].dtype]
    if num_splits == 3:
        assert not arrival_counts(c["q"].device, 1).any()


def test_static_bounds_larger_than_batch():
    """A graph runner's meta: max_query_len / max_seq_len / table width above the real batch."""
    c = make_case([1, 16, 3], [40, 5, 70], n_kv=2, group=3, hd=64, seed=4)
    m = DeviceMeta.from_batch(c["batch"], DEVICE)
    tables = torch.zeros(m.block_tables.shape[0], m.block_tables.shape[1] + 5, dtype=torch.int32, device=DEVICE)
    tables[:, : m.block_tables.shape[1]] = m.block_tables
    padded = DeviceMeta(m.slot_mapping, m.query_start_loc, m.seq_lens, tables, max_query_len=64, max_seq_len=2048,
                        block_size=m.block_size, causal=True)
    check(c, meta=padded)
    check(c, meta=padded, num_splits=4)


@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float32])
def test_store_kv_strided_and_cast(src_dtype):
    """Non-contiguous k/v (slices of a fused projection), slots -1 skipped, cast to the cache dtype
    (exact for bf16 -> bf16; one bf16 rounding for float32, which the interpreter truncates)."""
    torch.manual_seed(0)
    n_kv, hd, page = 3, 32, 8
    fused = torch.randn(7, 2 * n_kv * hd + 5, device=DEVICE, dtype=src_dtype)
    k = fused[:, : n_kv * hd].view(7, n_kv, hd)
    v = fused[:, n_kv * hd: 2 * n_kv * hd].view(7, n_kv, hd)
    kc = torch.zeros(4, page, n_kv, hd, device=DEVICE, dtype=torch.bfloat16)
    vc = torch.zeros_like(kc)
    slots = torch.tensor([3, -1, 31, 8, -1, 0, 17], device=DEVICE)
    store_kv(kc, vc, k, v, slots)
    keep = slots >= 0
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    want_k.view(-1, n_kv, hd)[slots[keep]] = k[keep].to(kc.dtype)
    want_v.view(-1, n_kv, hd)[slots[keep]] = v[keep].to(vc.dtype)
    tol = 0 if src_dtype == torch.bfloat16 else 2**-7
    torch.testing.assert_close(kc, want_k, rtol=tol, atol=0)
    torch.testing.assert_close(vc, want_v, rtol=tol, atol=0)


def test_backend_prepare_store_forward_and_store_only_batch():
    c = make_case([1, 16], [30, 9], n_kv=2, group=2, hd=64, seed=5)
    b = c["batch"]
    want_k, want_v, want = reference(c)
    be = TritonAttention()
    be.prepare(b, DEVICE)
    kc, vc = c["k_cache"].clone(), c["v_cache"].clone()
    be.store_kv(kc, vc, c["k"], c["v"], b)
    got = be.forward(c["q"], kc, vc, b, c["scale"])
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
    assert (got - want).abs().max().item() < TOL[torch.float32]
    # DFlash context write: a batch with only slot_mapping stores at its own slots, not the meta's
    ctx_batch = AttentionBatch(torch.tensor([5, 2], device=DEVICE), [], [], [], b.block_size)
    be.store_kv(kc, vc, c["k"][:2], c["v"][:2], ctx_batch)
    assert torch.equal(kc.view(-1, 2, 64)[[5, 2]], c["k"][:2])
    # a graph runner's meta replaces the prepared one; batch arguments are then ignored, and rows
    # past the last sequence (a bucket's padding) come out zero
    be.set_meta(DeviceMeta.from_batch(b, DEVICE))
    q = torch.cat([c["q"], torch.randn(3, *c["q"].shape[1:], device=DEVICE)])
    got = be.forward(q, want_k, want_v, None, c["scale"])
    assert (got[: c["rows"]] - want).abs().max().item() < TOL[torch.float32]
    assert not got[c["rows"]:].any()


@pytest.mark.parametrize("with_drafter", [False, True])
def test_engine_tokens_match_torch_backend(tiny_llama, tmp_path, with_drafter):
    """Greedy generation through the engine (chunked prefill, decode; DFlash draft, verify and
    context writes) gives the same tokens with either backend."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)) if with_drafter else None
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [9]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama), draft=draft, device=str(DEVICE), dtype="float32", attention_backend=backend,
                  max_num_batched_tokens=24, kv_block_size=8)
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outs["triton"] == outs["torch"]


@pytest.mark.parametrize("size", [3, 13])
def test_engine_token_trees_match_plain_decoding(tiny_llama, tmp_path, size):
    """Token-tree verifies through the Triton backend (steps without drafts replay graphs on CUDA) give
    plain decoding's tokens, greedy and seeded sampling, as the torch backend's do. Their acceptance
    counts may differ: with ragged graphs captured (Triton on CUDA), a step holding prefill chunks
    decodes its running requests without drafts (speculative/dflash.py _step), where the eager torch
    backend's step verifies their trees beside the chunks."""
    from fixtures import build_random_drafter, poison_rejected

    from flashdraft import LLM, SamplingParams

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [9], list(range(100, 140))]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=t, seed=3 + i)
              for i, t in enumerate((0.0, 0.8, 0.0, 1.0, 0.0))]
    kw = dict(device=str(DEVICE), dtype="float32", max_num_batched_tokens=40, kv_block_size=8)
    ref = [o.token_ids for o in LLM(str(tiny_llama), draft=None, **kw).generate(prompts, params)]
    counts = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama), draft=draft, attention_backend=backend, speculative_tree_size=size, **kw)
        with poison_rejected(llm):
            assert [o.token_ids for o in llm.generate(prompts, params)] == ref, backend
        tot = llm.engine.spec_totals()
        counts[backend] = (tot["num_drafts"], tot["num_accepted_tokens"])
    assert counts["triton"][0] > 0 and counts["torch"][0] > 0, counts


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replay_with_refilled_meta():
    """Capture once with static buffers, refill them in place for another batch, replay."""
    kw = dict(n_kv=2, group=4, hd=128, dtype=torch.bfloat16, n_blocks=200)
    cases = [make_case([1, 16, 1], [100, 30, 2000], seed=6, **kw), make_case([16, 1, 1], [7, 1500, 60], seed=7, **kw)]
    metas = [DeviceMeta.from_batch(c["batch"], DEVICE) for c in cases]
    width = max(m.block_tables.shape[1] for m in metas)
    static = DeviceMeta(torch.empty_like(metas[0].slot_mapping), torch.empty_like(metas[0].query_start_loc),
                        torch.empty_like(metas[0].seq_lens), torch.zeros(3, width, dtype=torch.int32, device=DEVICE),
                        max_query_len=16, max_seq_len=2048, block_size=16, causal=True)
    kc, vc = cases[0]["k_cache"].clone(), cases[0]["v_cache"].clone()
    q, k, v = cases[0]["q"].clone(), cases[0]["k"].clone(), cases[0]["v"].clone()

    def fill(c, m):
        static.slot_mapping.copy_(m.slot_mapping)
        static.query_start_loc.copy_(m.query_start_loc)
        static.seq_lens.copy_(m.seq_lens)
        static.block_tables.zero_()[:, : m.block_tables.shape[1]] = m.block_tables
        for dst, src in ((kc, "k_cache"), (vc, "v_cache"), (q, "q"), (k, "k"), (v, "v")):
            dst.copy_(c[src])

    def step():
        store_kv(kc, vc, k, v, static.slot_mapping)
        return paged_attention(q, kc, vc, static, cases[0]["scale"])

    fill(cases[0], metas[0])
    step()  # compile before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for c, m in zip(cases, metas):
        fill(c, m)
        graph.replay()
        torch.cuda.synchronize()
        _, _, want = reference(c)
        assert (out[: c["rows"]].float() - want.float()).abs().max().item() < TOL[torch.bfloat16]


def test_split_heuristic_fills_the_gpu_at_batch_one():
    """A 16-row verify at batch 1 (8 kv heads, 1k keys) is cut into partitions of >= 64 keys
    instead of 8 programs walking every key; a few partitions are a power of two merged in the
    kernel; very big grids are not split."""
    sms = sm_count(DEVICE)  # 132 on an H200: 49 partitions asked for, 1040 keys allow 16
    waves, merged = settings.SPLIT_WAVES, settings.MERGE_SPLITS
    n, want = attention_splits._num_splits(8, 1040, DEVICE), waves * sms // 8
    assert n > 1 and (n == min(want, 1040 // 64) if want >= 2 * merged else n <= merged)
    assert attention_splits._num_splits(10_000, 1040, DEVICE) == 1
    assert attention_splits._num_splits(8, 60, DEVICE) == 1  # too few keys to split
    for programs in range(max(1, waves * sms // (2 * merged) + 1), waves * sms + 1):  # fewer than 2 x merged
        n = attention_splits._num_splits(programs, 8192, DEVICE)
        assert n & (n - 1) == 0 and n <= merged and 2 * n * programs > waves * sms // 2, (programs, n)
    assert attention_splits._num_splits(waves * sms // (2 * merged), 8192, DEVICE) >= 2 * merged


def _compiled_variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)  # Triton >= 3.3: device -> (kernel cache, ...)
    if caches is None:
        pytest.skip("no compiled-kernel cache to inspect (interpreter or another Triton layout)")
    return sum(len(c[0]) for c in caches.values())


@pytest.mark.parametrize("q_len", [1, 16])
def test_new_lengths_and_token_counts_do_not_compile_new_variants(q_len):
    """Split-K sizes depend on the sequence length and the token count on the batch; both are
    runtime arguments that Triton does not specialise on, so steps with new lengths (every prefill
    chunk) or token counts (1, 15, 16, 17, 32, ...) reuse the compiled kernels instead of compiling
    a new variant mid-serving."""
    lengths = [300, 333, 420, 555, 640, 777, 901, 1000]
    check(make_case([q_len], [lengths[0]], n_kv=2, group=4, hd=64, dtype=torch.bfloat16, seed=7))
    check(make_case([q_len, q_len], [lengths[0]] * 2, n_kv=2, group=4, hd=64, dtype=torch.bfloat16, seed=7))
    # as the engine does at start: the variants of the split-K merges for many tokens too
    attention.compile_variants(8, 2, 64, 16, torch.bfloat16, DEVICE)
    before = _compiled_variants(attention._attn_kernel), _compiled_variants(attention_splits._reduce_kernel)
    for n, ctx in enumerate(lengths[1:]):
        check(make_case([q_len], [ctx], n_kv=2, group=4, hd=64, dtype=torch.bfloat16, seed=n))
    for n, batch in enumerate([3, 8, 15, 16, 17, 32]):  # token counts across the divisibility classes
        check(make_case([q_len] * batch, lengths[:1] * batch, n_kv=2, group=4, hd=64, dtype=torch.bfloat16,
                        seed=n))
    after = _compiled_variants(attention._attn_kernel), _compiled_variants(attention_splits._reduce_kernel)
    assert after == before
