"""Overlapped DFlash steps (speculative/ahead.py): with async scheduling a graphed verify is left in
flight and the next one is launched on its outputs on the device before it is read. Everything
observable must equal the step-by-step engine's: tokens, stops, finish reasons, aborts, requests
joining mid-run, acceptance; and it must actually overlap. On a CPU the graph runner replays its
static buffers eagerly, so the device-side inputs are checked here without a GPU."""

from __future__ import annotations

import pytest
from test_graphs import _graphed_llm

from flashdraft import SamplingParams

PROMPTS = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12]]


def pair(tiny_llama, drafter, **cfg):
    kw = {**dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8,
                 draft=str(drafter)), **cfg}
    return [_graphed_llm(str(tiny_llama), {**kw, "async_scheduling": a})[0] for a in (False, True)]


@pytest.fixture(scope="module")
def engines(tiny_llama, drafter):
    return pair(tiny_llama, drafter)


@pytest.fixture(scope="module")
def tree_engines(tiny_llama, drafter):
    return pair(tiny_llama, drafter, speculative_tree_size=6)


def outputs(llm, prompts, params):
    return [(o.token_ids, o.finish_reason, o.text, o.metrics.get("acceptance_histogram"))
            for o in llm.generate(prompts, params)]


def oracle(llm, futures: dict[tuple, list[int]]):
    """Drafts the target's own future tokens: every draft accepted (tau = B), so blocks move by B."""
    import torch

    sp = llm.engine.spec
    real = sp.drafts.tokens

    def drafts(hidden, num_seqs, draw=None, blocks=None):
        real(hidden, num_seqs, draw, blocks)  # the graph's own work, then the oracle's tokens
        rows = []
        for s in sp._oracle_seqs[:num_seqs]:
            fut = futures[tuple(s.token_ids[: s.num_prompt_tokens])]
            k = s.num_output_tokens
            rows.append((fut[k: k + sp.block_size - 1] + [0] * sp.block_size)[: sp.block_size - 1])
        rows += [[0] * (sp.block_size - 1)] * (num_seqs - len(rows))
        return torch.tensor(rows, dtype=torch.long)

    sp.drafts.tokens = drafts


@pytest.mark.parametrize("kind", ["engines", "tree_engines"])
def test_overlapped_verify_equals_sync_greedy_and_sampled(request, kind, tiny_llama):
    """Both engines against each other (tokens, finish reasons, text, acceptance) and against plain
    decoding (tokens: seeded requests draw the same noise at every position on either path), chains
    and token trees (the next tree step launched on the in-flight one's outcome: its accepted path's
    last token and length, its rows' K/V already moved on the device)."""
    from flashdraft import LLM

    sync, overlap = request.getfixturevalue(kind)
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 21, 11, 1)]
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n, seed=7 + n, ignore_eos=True)
               for n in (9, 2, 17, 25)]
    mixed = [SamplingParams(temperature=t, max_tokens=n, seed=n, ignore_eos=True)
             for t, n in ((0, 14), (0.8, 19), (0, 6), (1.2, 22))]
    before = overlap.engine.stats["num_overlapped_steps"]
    for params in (greedy, sampled, mixed):
        got = outputs(overlap, PROMPTS, params)
        assert got == outputs(sync, PROMPTS, params)
        assert [g[0] for g in got] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert overlap.engine.stats["num_overlapped_steps"] - before > 15, "verify steps were meant to overlap"
    assert sync.engine.stats["num_overlapped_steps"] == 0
    assert overlap.engine.spec_totals() == sync.engine.spec_totals()
    assert overlap.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["engines", "tree_engines"])
def test_no_token_past_a_stop(request, kind):
    """A request that stops inside step N's block had a block in step N+1 (launched before N was read):
    none of it is committed, and the other requests go on exactly as without overlap."""
    sync, overlap = request.getfixturevalue(kind)
    base = sync.generate([PROMPTS[2]], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    for at in (5, 6, 7, 13):
        params = [SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[base[at]]),
                  SamplingParams(max_tokens=30, ignore_eos=True)]
        prompts = [PROMPTS[2], PROMPTS[0]]
        got = outputs(overlap, prompts, params)
        assert got == outputs(sync, prompts, params)
        assert got[0][0] == base[: base.index(base[at]) + 1] and got[0][1] == "stop"
    text = sync.generate([PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    stop = [SamplingParams(max_tokens=30, ignore_eos=True, stop=[text[4:7]])]
    assert outputs(overlap, [PROMPTS[1]], stop) == outputs(sync, [PROMPTS[1]], stop)
    assert overlap.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("kind", ["engines", "tree_engines"])
def test_requests_ending_apart_leave_the_others_overlapped(request, kind, tiny_llama):
    """A request that ends (a stop the launched step could not foresee, or max_tokens) leaves the
    others' next verify launched ahead all the same: their blocks move on the device to the first
    rows of the same graph (4 -> 3 requests) or of the graph of fewer (3 -> 2 -> 1). Chains (greedy
    through the post graph, sampled through the eager acceptance) and token trees; tokens as step by
    step and plain decoding."""
    from flashdraft import LLM

    sync, overlap = request.getfixturevalue(kind)
    sp = overlap.engine.spec
    real, shrunk = sp.ahead._verify_after, []

    def launch(prev, plans):
        flight = real(prev, plans)
        if len(plans) < len(prev.plans):
            shrunk.append((len(prev.plans), len(plans), flight.graph is prev.graph, plans[0].seq.params.temperature))
        return flight

    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    base = plain.generate([PROMPTS[1]], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    stop = next(t for i, t in enumerate(base) if i >= 16 and t not in base[:i])  # ends it at 17-40 tokens
    sp.ahead._verify_after = launch
    try:
        for t in (0.0, 1.0):
            params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=n) for n in (9, 31, 15, 27)]
            params[1] = SamplingParams(max_tokens=40, ignore_eos=True, temperature=t, seed=3,
                                       stop_token_ids=[stop] if t == 0 else [])
            got = outputs(overlap, PROMPTS, params)
            assert got == outputs(sync, PROMPTS, params)
            assert [g[0] for g in got] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    finally:
        del sp.ahead._verify_after
    for t in (0.0, 1.0):
        seen = {(a, b, same) for a, b, same, temp in shrunk if temp == t}
        assert (4, 3, True) in seen and (2, 1, False) in seen, shrunk
    assert overlap.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("tree", [None, 6])
def test_requests_joining_behind_a_verify_in_flight(tiny_llama, drafter, tree):
    """Two running at most, six requests: each waiting request is admitted while a verify is in flight,
    its whole prompt prefilled by a step of its own queued behind the next verify, and it verifies in
    the step after, launched ahead too (its block's first token the prefill's, on the device). One
    joiner ends at its first token (max_tokens=1), one at a stop. Greedy and seeded, chains and token
    trees: the tokens are the step-by-step engine's and plain decoding's, and so are a chain's
    acceptance counts (the step-by-step engine's trees beside a prefill chunk decode without drafts
    that step: speculative/dflash.py)."""
    from flashdraft import LLM

    sync, overlap = pair(tiny_llama, drafter, max_num_seqs=2, speculative_tree_size=tree)
    sp = overlap.engine.spec
    real, joined = sp.prefill, []

    def launch(batch):
        flight = real(batch)
        joined.append(len(flight.seqs))
        return flight

    prompts = PROMPTS + [[9, 8, 7, 6, 5], list(range(3, 23))]
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    base = plain.generate([prompts[4]], SamplingParams(max_tokens=30, ignore_eos=True))[0].token_ids
    stop = next(t for i, t in enumerate(base) if i >= 6 and t not in base[:i])
    sp.prefill = launch
    try:
        for t in (0.0, 0.8):
            params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=n)
                      for n in (7, 13, 1, 16, 30, 9)]
            params[4] = SamplingParams(max_tokens=30, ignore_eos=True, temperature=t, seed=4,
                                       stop_token_ids=[stop] if t == 0 else [])
            ahead = overlap.engine.stats["num_overlapped_steps"]
            got, want = outputs(overlap, prompts, params), outputs(sync, prompts, params)
            assert [g[:3] for g in got] == [w[:3] for w in want]
            assert tree is not None or got == want
            assert [g[0] for g in got] == [o.token_ids for o in plain.generate(prompts, params)]
            assert got[2][0] == got[2][0][:1] and got[2][1] == "length"
            assert overlap.engine.stats["num_overlapped_steps"] - ahead > 10
    finally:
        del sp.prefill
    assert sum(joined) >= 6, joined  # every waiting request joined behind a verify at least once
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_full_acceptance_moves_blocks_by_b(tiny_llama, drafter):
    """Oracle drafts (tau = B): each overlapped step starts B positions on, its first token the
    in-flight step's last; every draft is accepted and the tokens are plain decoding's."""
    sync, overlap = pair(tiny_llama, drafter)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    # what plain decoding commits (the sync engine before the oracle: its tokens are plain decoding's)
    futures = {tuple(p): o.token_ids + [0] * 8 for p, o in zip(PROMPTS, sync.generate(PROMPTS, params))}
    seen = []
    for llm in (sync, overlap):
        oracle(llm, futures)
        sp = llm.engine.spec
        real_forward, real_launch = sp.forward, sp.ahead._verify_after

        def forward(plans, sp=sp, real_forward=real_forward):
            sp._oracle_seqs = [p.seq for p in plans]
            return real_forward(plans)

        def launch(prev, plans, sp=sp, real_launch=real_launch):
            sp._oracle_seqs = [p.seq for p in plans]
            # the oracle reads the next block's committed length: what prev will commit (all accepted)
            for p in plans:
                p.seq.token_ids.extend(futures[tuple(p.seq.token_ids[: p.seq.num_prompt_tokens])]
                                       [p.seq.num_output_tokens: p.seq.num_output_tokens + sp.block_size])
            try:
                return real_launch(prev, plans)
            finally:
                for p in plans:
                    del p.seq.token_ids[-sp.block_size:]

        sp.forward, sp.ahead._verify_after = forward, launch
        got = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == [futures[tuple(p)][:24] for p in PROMPTS]
        seen.append([o.metrics["acceptance_histogram"] for o in got])
    assert seen[0] == seen[1]
    for h in seen[1]:  # every block accepted whole
        assert sum(h) == h[-1] > 0, h
    assert overlap.engine.stats["num_overlapped_steps"] >= 4


def test_abort_and_late_requests_while_a_verify_is_in_flight(engines):
    sync, overlap = engines
    params = SamplingParams(max_tokens=18, ignore_eos=True)
    want = [o.token_ids for o in sync.generate(PROMPTS, params)]
    eng = overlap.engine
    seqs = [eng.add_request(None, params, prompt_token_ids=p) for p in PROMPTS[:3]]
    for _ in range(3):
        eng.step()
    from flashdraft.speculative.plan import VerifyFlight

    assert isinstance(eng.pipeline.inflight, VerifyFlight), "a verify was meant to be in flight"
    victim = seqs[1]
    kept = list(victim.output_token_ids)
    eng.abort(victim)
    late = eng.add_request(None, params, prompt_token_ids=PROMPTS[3])  # joins while a verify is in flight
    while eng.has_unfinished():
        eng.step()
    assert victim.finish_reason == "abort" and victim.output_token_ids == kept == want[1][: len(kept)]
    assert [seqs[0].output_token_ids, seqs[2].output_token_ids, late.output_token_ids] == \
        [want[0], want[2], want[3]]
    assert eng.block_manager.num_used_blocks == 0


def test_preemption_under_kv_pressure(tiny_llama, drafter):
    """Few pages: the overlapped launch needs pages for the longest block the in-flight step can leave;
    where they are missing the step is not launched ahead and the scheduler preempts as before. The
    tokens, finish reasons and texts are the step-by-step engine's; how many verifies each request took
    may differ: a preempted request that comes back behind a verify in flight is prefilled whole and
    verifies next, where the step-by-step engine may prefill it in chunks, the last one choosing a token."""
    sync, overlap = pair(tiny_llama, drafter, num_kv_blocks=14)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (26, 30, 22, 28)]
    assert [o[:3] for o in outputs(overlap, PROMPTS, params)] == [o[:3] for o in outputs(sync, PROMPTS, params)]
    assert overlap.engine.stats["num_preemptions"] > 0 and overlap.engine.block_manager.num_used_blocks == 0


def test_a_shorter_verify_than_the_block(tiny_llama, drafter):
    """num_speculative_tokens below B - 1: each verify reads the first k + 1 rows of its draft block
    (positions and metadata derived in the graph); overlapped, greedy and seeded, as step by step."""
    sync, overlap = pair(tiny_llama, drafter, num_speculative_tokens=2)
    for t in (0.0, 0.9):
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=n) for n in (9, 23, 14, 5)]
        assert outputs(overlap, PROMPTS, params) == outputs(sync, PROMPTS, params)
    assert overlap.engine.stats["num_overlapped_steps"] > 10
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_overlapped_oracle_trees_move_accepted_rows(tiny_llama, drafter, monkeypatch):
    """Trees whose right path sits behind a wrong sibling, accepted to the full depth at every step:
    the accepted rows' K/V are moved to their positions' slots on the device before the next step is
    launched on them, so the overlapped engine commits plain decoding's tokens, block by block."""
    from test_tree import use_oracle_graph_trees

    from flashdraft.speculative.ahead import VerifyAhead

    sync, overlap = pair(tiny_llama, drafter, speculative_tree_size=6)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    ref = sync.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True))
    use_oracle_graph_trees(monkeypatch, PROMPTS, ref)
    futures = {tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)}
    real_launch = VerifyAhead._verify_after

    def launch(self, prev, plans):
        # the oracle reads the committed length the next tree starts from: what prev will commit
        B = self.graphs.block_size
        for p in plans:
            p.seq.token_ids.extend(futures[tuple(p.seq.token_ids[: p.seq.num_prompt_tokens])]
                                   [p.seq.num_output_tokens: p.seq.num_output_tokens + B])
        try:
            return real_launch(self, prev, plans)
        finally:
            for p in plans:
                del p.seq.token_ids[-B:]

    monkeypatch.setattr(VerifyAhead, "_verify_after", launch)
    seen = []
    for llm in (sync, overlap):
        outs = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == [o.token_ids[:24] for o in ref]
        seen.append([o.metrics["acceptance_histogram"] for o in outs])
    assert seen[0] == seen[1]
    depth = overlap.engine.spec.max_accepted
    for h in seen[1]:
        assert sum(h) == h[depth] > 0, h  # every tree accepted to its full depth
    assert overlap.engine.stats["num_overlapped_steps"] >= 4
