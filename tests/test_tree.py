"""Token trees (flashdraft/speculative/tree.py) against brute force in Python: the N best rank paths, their
ancestor masks, and the accepted path a walk with the target's tokens finds."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from flashdraft.speculative.tree import accept, ancestor_masks, build_trees, chain


def brute_best_paths(logp: list[list[float]], n: int) -> list[tuple[int, ...]]:
    """The n rank paths of highest summed log-probability over every path of every depth (ties: the
    shallower path first), by enumeration."""
    D, K = len(logp), len(logp[0])
    paths = [p for d in range(1, D + 1) for p in itertools.product(range(K), repeat=d)]
    return sorted(paths, key=lambda p: (-sum(logp[j][r] for j, r in enumerate(p)), len(p)))[:n]


@pytest.mark.parametrize("D, K, N", [(3, 4, 5), (4, 3, 12), (2, 5, 9), (4, 4, 4), (1, 6, 6)])
def test_build_trees_takes_the_best_paths(D, K, N):
    g = torch.Generator().manual_seed(D * 100 + K * 10 + N)
    S = 6
    logp = torch.randn(S, D, K, generator=g, dtype=torch.float64).mul(2).log_softmax(-1)
    logp = logp.sort(-1, descending=True).values
    tokens = torch.stack([torch.randperm(50, generator=g)[:K] for _ in range(S * D)]).view(S, D, K)
    t = build_trees(logp, tokens, N)
    assert t.valid.all() and t.max_depth == D
    for s in range(S):
        want = brute_best_paths(logp[s].tolist(), N)
        # rebuild each node's rank path from its parents and tokens
        got = []
        for i in range(N):
            path, row = [], i + 1
            while row:
                d = int(t.depths[s, row - 1])
                path.append(tokens[s, d - 1].tolist().index(int(t.tokens[s, row - 1])))
                row = int(t.parents[s, row - 1])
            got.append(tuple(reversed(path)))
        assert sorted(got) == sorted(want)
        # parents come before children, depths ascend
        assert all(int(t.parents[s, i]) <= i for i in range(N))
        assert t.depths[s].tolist() == sorted(t.depths[s].tolist())


def test_build_trees_with_fewer_candidates_than_nodes_marks_padding_invalid():
    logp = torch.tensor([[[0.0], [0.0]]]).log_softmax(-1)  # one candidate a slot: only 2 paths exist
    t = build_trees(logp, torch.tensor([[[7], [9]]]), 4)
    assert t.valid.tolist() == [[True, True, False, False]]
    assert t.tokens[0, :2].tolist() == [7, 9] and t.parents[0, :2].tolist() == [0, 1]


def test_ancestor_masks():
    parents = torch.tensor([[0, 0, 1, 3, 2]])  # rows 1, 2 under the root; 3 under 1; 4 under 3; 5 under 2
    m = ancestor_masks(parents, 3)[0].tolist()
    bits = [{j for j in range(6) if v >> j & 1} for v in m]
    assert bits == [{0}, {0, 1}, {0, 2}, {0, 1, 3}, {0, 1, 3, 4}, {0, 2, 5}]


def python_accept(tokens, parents, valid, target):
    """The walk from the root: at each row take the child whose token is the target's token there."""
    row, path = 0, [0]
    while True:
        kids = [i + 1 for i in range(len(tokens)) if parents[i] == row and valid[i] and tokens[i] == target[row]]
        if not kids:
            return len(path) - 1, path
        assert len(kids) == 1
        row = kids[0]
        path.append(row)


def test_accept_matches_a_python_walk():
    rng = random.Random(0)
    g = torch.Generator().manual_seed(1)
    S, D, K, N = 40, 4, 3, 10
    logp = torch.randn(S, D, K, generator=g).log_softmax(-1).sort(-1, descending=True).values
    tokens = torch.stack([torch.randperm(6, generator=g)[:K] for _ in range(S * D)]).view(S, D, K)
    t = build_trees(logp, tokens, N)
    for n in (N, 6, 1):  # a verify cut short checks the first n nodes
        target = torch.tensor([[rng.randrange(6) for _ in range(n + 1)] for _ in range(S)])
        # plant the tree's paths in half the targets: follow random children
        for s in range(0, S, 2):
            row = 0
            while True:
                kids = [i + 1 for i in range(n) if int(t.parents[s, i]) == row]
                if not kids:
                    break
                row_next = rng.choice(kids)
                target[s, row] = t.tokens[s, row_next - 1]
                row = row_next
        trimmed = type(t)(t.tokens[:, :n], t.parents[:, :n], t.depths[:, :n], t.valid[:, :n], t.max_depth)
        a, path = accept(trimmed, target)
        for s in range(S):
            want_a, want_path = python_accept(t.tokens[s, :n].tolist(), t.parents[s, :n].tolist(),
                                              t.valid[s, :n].tolist(), target[s].tolist())
            assert int(a[s]) == want_a
            assert path[s, : want_a + 1].tolist() == want_path and not path[s, want_a + 1:].any()
        assert (a[::2] > 0).all()


def test_chain_accepts_like_the_chain_rule():
    drafts = torch.tensor([[5, 6, 7], [5, 6, 9], [1, 6, 7], [5, 1, 7]])
    target = torch.tensor([[5, 6, 7, 8]] * 4)
    a, path = accept(chain(drafts), target)
    assert a.tolist() == [3, 2, 0, 1]
    assert target.gather(1, path)[0].tolist() == [5, 6, 7, 8]
    assert path[1].tolist() == [0, 1, 2, 0]


# ---- the engine with token trees ------------------------------------------------------------
MIXED = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12], [9], [250, 251] * 9,
         list(range(3, 60, 2)), [42, 43, 44], [12, 99, 12, 99, 12], [300, 1, 301], list(range(100, 140)), [5, 6]]


@pytest.fixture(scope="module")
def tiny(tiny_llama, tmp_path_factory):
    from fixtures import build_random_drafter

    from flashdraft import LLM

    drafter = build_random_drafter(tmp_path_factory.mktemp("tree-draft"), tiny_llama, block_size=4)
    return tiny_llama, drafter, LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")


def tree_llm(tiny, size, **kw):
    from fixtures import poison_rejected

    from flashdraft import LLM

    model, drafter, _ = tiny
    llm = LLM(str(model), draft=str(drafter), device="cpu", dtype="float32", speculative_tree_size=size, **kw)
    poison_rejected(llm)  # any read of a rejected row's K/V turns the tokens into NaN's
    return llm


@pytest.mark.parametrize("size", [1, 2, 6, 13])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_tree_verify_is_lossless(tiny, size, temperature):
    """Plain decoding's tokens, greedy and seeded sampling, trees smaller and larger than the block,
    in one batch and one at a time; rejected rows poisoned."""
    from flashdraft import SamplingParams

    params = [SamplingParams(max_tokens=30, ignore_eos=True, temperature=temperature, seed=11 + i)
              for i in range(len(MIXED))]
    ref = [o.token_ids for o in tiny[2].generate(MIXED, params)]
    llm = tree_llm(tiny, size)
    assert [o.token_ids for o in llm.generate(MIXED, params)] == ref
    assert [llm.generate([p], [sp])[0].token_ids for p, sp in zip(MIXED[:4], params)] == ref[:4]
    tot = llm.engine.spec_totals()
    assert tot["num_drafts"] > 0 and tot["num_draft_tokens"] == size * tot["num_drafts"]


def oracle_trees(sp, futures, branch):
    """A propose_tree for speculator sp: each tree holds the target's continuation at depth-1 rank
    `branch` (wrong tokens at the ranks before it), as a chain under it. Returns it and the depth
    every verify should accept."""
    from flashdraft.speculative.tree import Trees

    N, D = sp.num_draft, sp.max_accepted

    def propose(seqs):
        toks, parents, depths, valid = [], [], [], []
        for s in seqs:
            fut = futures[tuple(s.token_ids[: s.num_prompt_tokens])][s.num_output_tokens:] + [0] * (N + D)
            t = [(fut[0] + 1 + j) % 300 + 3 for j in range(branch)] + [fut[0]]  # wrong siblings, then right
            p, d = [0] * (branch + 1), [1] * (branch + 1)
            for k in range(1, min(D, N - branch)):  # the rest of the continuation under the right one
                t.append(fut[k])
                p.append(len(t) - 1)
                d.append(k + 1)
            pad = N - len(t)
            toks.append(t + [3] * pad)
            parents.append(p + [0] * pad)
            depths.append(d + [D] * pad)
            valid.append([True] * len(t) + [False] * pad)
        return Trees(torch.tensor(toks), torch.tensor(parents), torch.tensor(depths), torch.tensor(valid), D)

    return propose, min(D, N - branch)


@pytest.mark.parametrize("size, branch", [(6, 0), (6, 2), (5, 4), (13, 1)])
def test_oracle_trees_accept_the_planted_path(tiny, size, branch):
    """The target's own continuation planted off the first branch: every verify accepts it to its
    depth, with plain decoding's tokens; rows that moved to their positions' slots are read next."""
    from flashdraft import SamplingParams

    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = tiny[2].generate(MIXED, SamplingParams(max_tokens=80, ignore_eos=True))
    llm = tree_llm(tiny, size)
    llm.engine.spec.trees.propose, depth = oracle_trees(llm.engine.spec, {tuple(p): o.token_ids
                                                                         for p, o in zip(MIXED, ref)}, branch)
    outs = llm.generate(MIXED, params)
    assert [o.token_ids for o in outs] == [o.token_ids[:30] for o in ref]
    for o in outs:
        h = o.metrics["acceptance_histogram"]
        assert h[depth] >= o.metrics["num_drafts"] - 1, h  # the last step may stop at max_tokens


def test_tree_verify_cut_by_the_token_budget_and_preempted(tiny):
    """Few tokens a step (verifies check only their trees' first nodes) and few KV pages (preemption)."""
    from flashdraft import SamplingParams

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in tiny[2].generate(MIXED, params)]
    llm = tree_llm(tiny, 9, max_num_batched_tokens=24, num_kv_blocks=12, kv_block_size=8)
    assert [o.token_ids for o in llm.generate(MIXED, params)] == ref
    assert llm.engine.stats["num_preemptions"] > 0
    tot = llm.engine.spec_totals()
    assert tot["num_draft_tokens"] < 9 * tot["num_drafts"]  # some verifies were cut short


def test_cpu_default_is_a_tree_of_the_chains_size(smollm2, monkeypatch):
    """On a CPU the engine's default verifies a tree of B - 1 drafts (the chain's rows), with plain
    decoding's tokens; num_speculative_tokens, off, or a device other than the CPU keep the chain."""
    from flashdraft import LLM, SamplingParams, settings
    from flashdraft.config import EngineConfig

    monkeypatch.setattr(settings, "CPU_TREE", True)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert EngineConfig().tree_size(cpu, 8) == 7 and EngineConfig().tree_size(cuda, 8) is None
    assert EngineConfig(num_speculative_tokens=3).tree_size(cpu, 8) is None
    assert EngineConfig(speculative_tree_size=None).tree_size(cpu, 8) is None
    assert EngineConfig(speculative_tree_size=12).tree_size(cuda, 8) == 12
    llm = LLM(device="cpu", dtype="float32")  # the embedded default and its shipped drafter
    assert llm.engine.spec.tree_size == llm.engine.spec.block_size - 1
    prompts = [llm.engine.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Name three fruits.", "What is 12 times 12?")]
    params = SamplingParams(max_tokens=32)
    assert [o.token_ids for o in llm.generate(prompts, params)] == \
        [o.token_ids for o in smollm2.generate(prompts, params)]
    assert llm.engine.spec_totals()["num_drafts"] > 0


@pytest.mark.parametrize("kw, message", [
    (dict(speculative_tree_size=0), "speculative_tree_size"), (dict(speculative_tree_size=64), "speculative_tree_size"),
    (dict(speculative_tree_size=True), "speculative_tree_size"), (dict(speculative_tree_size="big"), "'auto'"),
    (dict(speculative_tree_size=4, num_speculative_tokens=2), "choose one"),
])
def test_tree_size_validation(kw, message):
    from flashdraft.config import EngineConfig

    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_shipped_drafter_with_a_tree_on_smollm2(smollm2):
    """The real pair: a 15-node tree gives plain decoding's tokens and commits more per verify than
    the chain on the same prompts."""
    from flashdraft import LLM, SamplingParams
    from flashdraft.bench.datasets import load_prompts

    convs = [p.messages for p in load_prompts("mt-bench", 4)]
    params = [SamplingParams(max_tokens=48)] * len(convs)
    ref = [o.token_ids for o in smollm2.chat(convs, params)]
    taus = {}
    for size in (None, 15):
        llm = LLM(device="cpu", dtype="float32", speculative_tree_size=size)
        assert [o.token_ids for o in llm.chat(convs, params)] == ref
        taus[size] = llm.engine.spec_totals()["acceptance_length"]
    assert taus[15] > taus[None] + 0.2, taus


@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0), (1.0, 0.0, 0.7)])
def test_graphed_tree_step_matches_the_eager_engine(tiny, temps):
    """The tree step as one graph (draft, trees, verify under tree masks, context write; on CPU
    replayed eagerly over the same static buffers, static torch attention) commits the eager tree
    step's tokens and counts; with sampled requests among them, from the sampled tree graph."""
    from test_graphs import _graphed_llm

    from flashdraft import LLM, SamplingParams

    model, drafter, plain = tiny
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=40 + i)
              for i, (n, t) in enumerate(zip((8, 20, 14), temps))]
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8,
              draft=str(drafter), speculative_tree_size=6)
    eager = LLM(str(model), **kw)
    assert [o.token_ids for o in eager.generate(prompts, params)] == ref
    graphed, replays = _graphed_llm(str(model), kw)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == ref
    assert graphed.engine.spec_totals() == eager.engine.spec_totals()
    assert replays["dflash-tree-sampled" if any(temps) else "dflash-tree"] > 0, replays


def use_oracle_graph_trees(monkeypatch, prompts, ref) -> None:
    """Make graphed tree steps verify oracle_trees (branch 1) built from the plain outputs `ref` of
    `prompts`: the real requests' trees, then a batch bucket's padding trees."""
    from types import SimpleNamespace

    from flashdraft.speculative.drafts import DraftTokens
    from flashdraft.speculative.trees import TreeVerifier

    futures = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    current: list = []
    real_flight, real_forward = TreeVerifier.flight, TreeVerifier.forward

    def tree_flight(self, plans, *args):  # every graphed tree step, launched ahead or not
        current[:] = [p.seq for p in plans]
        return real_flight(self, plans, *args)

    def forward_tree(self, plans):  # eager tree steps
        current[:] = [p.seq for p in plans if p.verify]
        return real_forward(self, plans)

    def trees(self, hidden, num_seqs, size, draw=None):
        shape = SimpleNamespace(num_draft=size, max_accepted=min(size, self.block_size - 1))
        t = oracle_trees(shape, futures, 1)[0](current)
        pad = num_seqs - t.tokens.shape[0]
        cat = lambda x, v: torch.cat([x, x.new_full((pad, x.shape[1]), v)])  # noqa: E731
        return type(t)(cat(t.tokens, 3), cat(t.parents, 0), cat(t.depths, 1), cat(t.valid, False), t.max_depth)

    monkeypatch.setattr(TreeVerifier, "flight", tree_flight)
    monkeypatch.setattr(TreeVerifier, "forward", forward_tree)
    monkeypatch.setattr(DraftTokens, "trees", trees)


def test_graphed_tree_step_with_oracle_trees(tiny, monkeypatch):
    """Through the graph too, trees whose right path sits behind a wrong sibling are accepted to their
    depth, and the rows moved to their positions' slots are what the next steps read."""
    from test_graphs import _graphed_llm

    from flashdraft import SamplingParams

    model, drafter, plain = tiny
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = plain.generate(prompts, SamplingParams(max_tokens=60, ignore_eos=True))
    use_oracle_graph_trees(monkeypatch, prompts, ref)
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8,
              draft=str(drafter), speculative_tree_size=6)
    graphed, replays = _graphed_llm(str(model), kw)
    outs = graphed.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids[:24] for o in ref]
    assert replays["dflash-tree"] > 0, replays
    depth = graphed.engine.spec.max_accepted
    for o in outs:
        h = o.metrics["acceptance_histogram"]
        assert h[depth] >= o.metrics["num_drafts"] - 1, h


def test_tree_kernels_switch(monkeypatch):
    """FLASHDRAFT_TREE_KERNELS=off keeps tree work on torch ops; a bad value is named in the error."""
    import flashdraft.speculative.tree as tree
    from flashdraft import settings

    x = torch.zeros(2)
    monkeypatch.setattr(settings, "TREE_KERNELS", "off")
    assert tree.use_kernels(x) is False
    monkeypatch.setattr(settings, "TREE_KERNELS", "yes")
    with pytest.raises(ValueError, match="FLASHDRAFT_TREE_KERNELS"):
        tree.use_kernels(x)
    monkeypatch.setattr(settings, "TREE_KERNELS", "auto")
    assert tree.use_kernels(x) is False  # a CPU tensor: no fused path


def test_path_moves_from_the_block_tables():
    """tree.path_moves: the row at depth d <= a lies at the slot of position start + path[d] and moves to
    start + d's, through each request's block table; rows in place, depths past a and padding requests
    (start < 0) move nothing (-1)."""
    from flashdraft.speculative.tree import path_moves

    page = 4
    tables = torch.tensor([[3, 0, 7, 1], [4, 5, 6, 8], [0, 0, 0, 0]], dtype=torch.int32)
    path = torch.tensor([[0, 2, 5, 6], [0, 1, 3, 0], [0, 2, 4, 6]])
    a = torch.tensor([3, 2, 3])
    start = torch.tensor([2, 6, -1])
    src, dst = path_moves(path, a, start, tables, page)
    slot = lambda s, q: int(tables[s, q // page]) * page + q % page  # noqa: E731
    want_src = [[slot(0, 4), slot(0, 7), slot(0, 8)], [-1, slot(1, 9), -1], [-1, -1, -1]]
    want_dst = [[slot(0, 3), slot(0, 4), slot(0, 5)], [-1, slot(1, 8), -1], [-1, -1, -1]]
    assert src.tolist() == want_src and dst.tolist() == want_dst
