"""The token-tree kernels (kernels/tree_ops.py) against the torch reference (speculative/tree.py,
itself tested against brute force in tests/test_tree.py) and against the host's K/V moves.

Runs on CUDA, or on CPU tensors under the Triton interpreter (TRITON_INTERPRET=1)."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

from flashdraft.kernels import tree_ops  # noqa: E402
from flashdraft.speculative import tree  # noqa: E402

DEVICE = torch.device("cpu" if INTERPRET else "cuda")


def candidates(S: int, D: int, K: int, vocab: int, seed: int, peaked: bool = False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, D, vocab, generator=g) * (8 if peaked else 2)
    logp, cand = logits.log_softmax(-1).topk(K, dim=-1)
    return logp.to(DEVICE), cand.to(DEVICE)


@pytest.mark.parametrize("S, D, N", [(3, 7, 15), (2, 7, 7), (4, 3, 6), (1, 15, 31), (2, 7, 63), (1, 1, 5)])
@pytest.mark.parametrize("peaked", [False, True])
def test_build_trees_equals_the_torch_reference(S, D, N, peaked):
    logp, cand = candidates(S, D, N, 200, S * 1000 + D * 10 + N, peaked)
    want = tree.build_trees(logp, cand, N)
    got = tree_ops.build_trees(logp, cand, N)
    for field in ("tokens", "parents", "depths", "valid"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert torch.equal(got.masks(), tree.ancestor_masks(want.parents, D))
    assert got.max_depth == D and got.valid.all()


def test_build_trees_with_fewer_candidates_than_nodes():
    """K < N: only the 2 + 4 paths that exist are valid, in the reference's order; the kernel puts the
    padding nodes last (where the reference puts them depends on how its top-k breaks ties)."""
    logp, cand = candidates(2, 2, 2, 50, 3)
    want, got = tree.build_trees(logp, cand, 9), tree_ops.build_trees(logp, cand, 9)
    assert want.valid.sum(1).tolist() == [6, 6]
    assert got.valid.tolist() == [[True] * 6 + [False] * 3] * 2
    for field in ("tokens", "parents", "depths"):
        assert torch.equal(getattr(got, field)[got.valid], getattr(want, field)[want.valid]), field


@pytest.mark.parametrize("follow", [0.3, 0.8, "deepest"])
def test_accept_paths_equals_the_torch_walk(follow):
    """Targets that follow each branch with probability `follow`, or the path to a deepest node."""
    S, D, N = 6, 7, 15
    logp, cand = candidates(S, D, N, 300, 11)
    trees = tree_ops.build_trees(logp, cand, N)
    g = torch.Generator().manual_seed(7)
    target = torch.randint(0, 300, (S, N + 1), generator=g)
    tok, par, dep = trees.tokens.cpu(), trees.parents.cpu(), trees.depths.cpu()
    for s in range(S):
        if follow == "deepest":
            row = int(dep[s].argmax()) + 1
            while row:
                target[s, par[s, row - 1]] = tok[s, row - 1]
                row = int(par[s, row - 1])
            continue
        for i in range(N):
            if torch.rand((), generator=g) < follow:
                target[s, par[s, i]] = tok[s, i]
    target = target.to(DEVICE)
    a, path = tree.accept(trees, target)
    got_a, got_path, got_commit = tree_ops.accept_paths(trees, target)
    assert torch.equal(got_a, a) and torch.equal(got_path, path)
    assert torch.equal(got_commit, target.gather(1, path))
    if follow == "deepest":
        assert a.tolist() == dep.max(1).values.tolist()


@pytest.mark.parametrize("lens", [[13, 40, 9], [21, 0, 0, 0], [8], [30, 17, 0]])
@pytest.mark.parametrize("N", [7, 15])
def test_verify_meta_and_rows_equal_the_torch_ops(lens, N):
    """verify_meta and verify_rows (a graphed tree step's verify inputs, tree_step.py) against the torch
    ops they replace: slots, lengths, row offsets and starts from the draft blocks' lengths and block
    tables (padding requests, seq_len 0, included), then ids, positions and ancestor masks from the trees."""
    from flashdraft.engine.sampler import draw_candidates

    B, page, S, N1 = 8, 4, len(lens), N + 1
    g = torch.Generator().manual_seed(sum(lens) + N)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    tables = torch.randperm(64, generator=g)[: S * 12].view(S, 12).to(DEVICE, torch.int32)
    # the torch ops of tree_step._tree_graph_step
    real = seq_lens > 0
    start = (seq_lens.long() - B).clamp_min(0)
    q = start[:, None] + torch.arange(N1, device=DEVICE)
    pages = tables.long().gather(1, (q // page).clamp(max=tables.shape[1] - 1))
    want_slots = torch.where(real[:, None], pages * page + q % page, -1).flatten()
    want_lens = torch.where(real, start + N1, 0).int()
    want_qsl = torch.cat([torch.zeros(1, dtype=torch.long, device=DEVICE), torch.cumsum(real * N1, 0)]).int()
    slots = torch.full((S * N1,), 99, dtype=torch.long, device=DEVICE)
    vlens = torch.full((S,), 99, dtype=torch.int32, device=DEVICE)
    qsl = torch.full((S + 1,), 99, dtype=torch.int32, device=DEVICE)
    first = tree_ops.verify_meta(seq_lens, tables, page, B, N1, slots, vlens, qsl)
    assert torch.equal(slots, want_slots) and torch.equal(vlens, want_lens) and torch.equal(qsl, want_qsl)
    assert torch.equal(first, torch.where(real, start, -1))
    # the rows
    logp, cand = draw_candidates(torch.randn(S * (B - 1), 50, generator=g).to(DEVICE), N)
    trees = tree_ops.build_trees(logp.view(S, B - 1, -1), cand.view(S, B - 1, -1), N)
    blocks = torch.randint(0, 50, (S * B,), generator=g).to(DEVICE)
    ids = torch.zeros(S * N1, dtype=torch.long, device=DEVICE)
    pos, mask = torch.zeros_like(ids), torch.zeros_like(ids)
    tree_ops.verify_rows(blocks, B, first, trees, ids, pos, mask)
    want_ids = torch.cat([blocks.view(S, B)[:, :1], trees.tokens], 1).flatten()
    want_pos = torch.cat([start[:, None], start[:, None] + trees.depths], 1).flatten()
    assert torch.equal(ids, want_ids) and torch.equal(pos, want_pos) and torch.equal(mask, trees.masks().flatten())


def test_moves_equal_the_host_moves():
    """The accepted rows' (from slot, to slot) pairs of accept_paths are those the host computes from the
    path and the block table; move_slots copies them with every read before any write (a row's source
    can be another's destination); padding requests (start < 0) and unaccepted depths move nothing."""
    S, D, N, page = 4, 7, 15, 4
    logp, cand = candidates(S, D, N, 300, 5, peaked=True)
    trees = tree_ops.build_trees(logp, cand, N)
    target = torch.randint(0, 300, (S, N + 1))
    t_host, p_host = trees.tokens.cpu(), trees.parents.cpu()
    for s in range(S):
        for i in range(N):
            target[s, p_host[s, i]] = t_host[s, i]  # take the last sibling of each depth: rows move
    target = target.to(DEVICE)
    tables = torch.tensor([[3, 0, 7, 1, 9, 2], [4, 5, 6, 8, 10, 11], [0, 0, 0, 0, 0, 0], [12, 13, 14, 15, 16, 17]],
                          dtype=torch.int32)
    start = torch.tensor([2, 5, -1, 0])  # request 2: padding
    a, path, _, src, dst = tree_ops.accept_paths(trees, target, start.to(DEVICE), tables.to(DEVICE), page)
    slot = lambda s, q: int(tables[s, q // page]) * page + q % page  # noqa: E731
    moves = []
    for s in range(S):
        want = {(slot(s, int(start[s]) + r), slot(s, int(start[s]) + d))
                for d, r in enumerate(path[s, 1: int(a[s]) + 1].tolist(), start=1) if r != d and start[s] >= 0}
        got = {(int(x), int(y)) for x, y in zip(src[s].tolist(), dst[s].tolist()) if x >= 0}
        assert got == want
        moves += sorted(want)
    assert moves and any(m[0] in {d for _, d in moves} for m in moves)  # a source that is also a destination
    # the torch twin (graphed tree steps off the fused path) computes the same pairs, slot for slot
    t_src, t_dst = tree.path_moves(path, a, start.to(DEVICE), tables.to(DEVICE), page)
    assert torch.equal(t_src, src) and torch.equal(t_dst, dst)
    L, H, Dh = 3, 2, 8
    k = torch.randn(L, 18, page, H, Dh, device=DEVICE)
    v = torch.randn(L, 18, page, H, Dh, device=DEVICE)
    want_k, want_v = k.clone(), v.clone()
    idx = torch.tensor(moves, device=DEVICE)
    for c in (want_k, want_v):
        flat = c.view(L, -1, H, Dh)
        flat[:, idx[:, 1]] = flat[:, idx[:, 0]]
    tree_ops.move_slots(k, v, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)


@pytest.mark.skipif(not INTERPRET, reason="CPU graph harness; on CUDA test_engine_graphs runs these kernels")
@pytest.mark.parametrize("oracle,overlap", [(False, False), (True, False), (False, True)])
def test_graphed_tree_steps_through_the_kernels(tiny_llama, tmp_path, monkeypatch, oracle, overlap):
    """The engine's graphed tree step (CPU harness: eager replays of the static buffers) with the trees
    built, accepted and their rows' K/V moved by these kernels: plain decoding's tokens and the eager
    torch engine's counts; with oracle trees (the right path behind a wrong sibling) every verify
    accepts to the full depth, so rows move and the next steps read them; overlapped, each next step
    launched on the outcome the graph packed before it is read."""
    from fixtures import build_random_drafter
    from test_graphs import _graphed_llm
    from test_tree import use_oracle_graph_trees

    import flashdraft.speculative.drafts as drafts_mod
    import flashdraft.speculative.graphs as graphs_mod
    import flashdraft.speculative.trees as trees_mod
    from flashdraft import LLM, SamplingParams

    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8)
    ref = LLM(str(tiny_llama), draft=None, **kw).generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    kw.update(draft=str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)), speculative_tree_size=6)
    if oracle:
        use_oracle_graph_trees(monkeypatch, prompts, ref)
    eager = LLM(str(tiny_llama), **kw)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert want == [o.token_ids[:24] for o in ref]
    graphed, replays = _graphed_llm(str(tiny_llama), {**kw, "async_scheduling": overlap})
    moved = []
    real_move = tree_ops.move_slots
    monkeypatch.setattr(tree_ops, "move_slots", lambda k, v, src, dst: moved.append(int((src >= 0).sum()))
                        or real_move(k, v, src, dst))
    monkeypatch.setattr(graphs_mod, "fused_enabled", lambda x: True)  # the models stay on the torch path
    for module in (trees_mod, drafts_mod):
        monkeypatch.setattr(module, "use_kernels", lambda x: True)
    outs = graphed.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert graphed.engine.spec_totals() == eager.engine.spec_totals()
    assert replays["dflash-tree"] > 0 and moved, replays
    if overlap:
        assert graphed.engine.stats["num_overlapped_steps"] > 0
    if oracle:
        assert sum(moved) > 0  # the right path sat behind a wrong sibling: its rows moved
        depth = graphed.engine.spec.max_accepted
        for o in outs:
            h = o.metrics["acceptance_histogram"]
            assert h[depth] >= o.metrics["num_drafts"] - 1, h
