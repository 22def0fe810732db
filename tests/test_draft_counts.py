"""How many drafts a step verifies (speculative/gate.py DepthProfile): the count whose expected tokens
per unit of the step's measured price is highest, among the block's drafts and a half and a quarter
of them, or none (the step gate's pause). Tokens never depend on the choice. On a CPU the graph
runner replays its static buffers eagerly, so the count's graphs are exercised here without a GPU;
the step costs are set by hand, as if measured at start."""

from __future__ import annotations

import random

import pytest
from fixtures import build_random_drafter
from test_graphs import _graphed_llm

from flashdraft import LLM, SamplingParams
from flashdraft.speculative.costs import Observed, StepCosts
from flashdraft.speculative.gate import DepthProfile, StepGate

PROMPTS = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12]]
PRICES = {7: 2.5, 3: 1.5}  # a step verifying k drafts costs this many plain steps


def test_the_profile_expects_what_the_blocks_accepted():
    """Once each depth's first sample is in, the profile's expected tokens at k drafts are the blocks'
    own mean of 1 + min(accepted, k): the conditional rates multiply back to the share of blocks that
    reached each depth (counted directly here)."""
    rng = random.Random(0)
    for _ in range(20):
        accepted = [rng.choice([0, 0, 1, 2, 3, 5, 7]) for _ in range(rng.randint(1, 12))]
        p = DepthProfile((7, 3))
        p.record(accepted, 7)
        for k in (1, 3, 7):
            want = 1 + sum(min(a, k) for a in accepted) / len(accepted)
            assert p.tau(k) == pytest.approx(want)


def test_the_profile_chooses_by_hand():
    """A depth never reached counts as accepted (a count below the block's is chosen only once the
    depths it drops were seen missing); 8 blocks before a shorter count; the whole block again every
    probe_every steps while a shorter one is chosen; a probe of 8 blocks replaces the averages."""
    p = DepthProfile((7, 3))
    assert p.count == 7 and p.tau(7) == 8.0
    p.record([2, 2, 2, 2], 7)  # two drafts accepted, the third missed: depths 4-7 unseen
    assert p.tau(7) == p.tau(3) == 3.0 and p.seen == [True] * 3 + [False] * 4
    assert p.choose(PRICES.get, 1) == (3.0, 2.5) and p.count == 7  # 4 of 8 warm-up blocks
    p.record([2, 2, 2, 2], 7)
    assert p.choose(PRICES.get, 2) == (3.0, 1.5) and p.count == 3 and p.next_probe == 130
    p.record([1, 3, 2, 0], 3)
    assert p.accept[0] == pytest.approx(1 - (1 - 0.95**4) * 0.25)  # one of four missed depth 1
    assert p.choose(PRICES.get, 3)[1] == 1.5 and p.count == 3
    assert p.choose(PRICES.get, 130)[1] == 1.5 and p.count == 7 and p.next_probe == 258  # the whole block once
    p.record([7] * 8, 7, probe=True)  # the drafts hit now: a probe of 8 blocks replaces every depth
    assert p.tau(7) == 8.0 and p.choose(PRICES.get, 131) == (8.0, 2.5) and p.count == 7


def test_step_costs_by_draft_count():
    """A step of k drafts costs its graph's time; seen while serving (whole blocks only), the
    observed cost scaled by the graphs' ratio of the two steps."""
    c = StepCosts((1, 8), (1.0, 2.0), (1.5, 5.0), {3: (1.2, 3.0)})
    assert c.break_even(1, k=3) == pytest.approx(1.2) and c.break_even(8, k=3) == pytest.approx(1.5)
    assert c.break_even(8, k=7) == c.break_even(8) == 2.5
    seen = Observed()
    seen.spec[1], seen.plain[1] = 10.0, 2.0
    assert c.break_even(8, seen) == 5.0 and c.break_even(8, seen, 3) == pytest.approx(3.0)
    assert c.as_dict()["break_even_3_drafts"] == [1.2, 1.5]


@pytest.fixture(scope="module")
def drafter(tiny_llama, tmp_path_factory):
    return build_random_drafter(tmp_path_factory.mktemp("draft8"), tiny_llama, block_size=8)


def counted(tiny_llama, drafter, async_scheduling: bool):
    """The graphed engine with whole-step graphs of 7 and 3 drafts and the step gate at PRICES."""
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8,
              draft=str(drafter), async_scheduling=async_scheduling)
    llm, _ = _graphed_llm(str(tiny_llama), kw, draft_counts=(7, 3))
    policy = llm.engine.spec.policy
    policy.costs = StepCosts((64,), (1e6,), (PRICES[7] * 1e6,), {3: (PRICES[3] * 1e6,)})
    policy.step_gate, policy.profile, policy.seen.max_tries = StepGate(), DepthProfile((7, 3)), 0
    return llm


def right_for(llm, futures: dict[tuple, list[int]], m: int):
    """Drafts right for their first m slots (the target's own future tokens) and wrong after: every
    block accepts m drafts and commits m + 1 tokens."""
    import torch

    sp, vocab = llm.engine.spec, llm.engine.model_config.vocab_size
    real_draft, real_forward, real_launch = sp.drafts.tokens, sp.forward, sp.ahead._verify_after

    def drafts(hidden, num_seqs, draw=None, blocks=None):
        real_draft(hidden, num_seqs, draw, blocks)  # the graph's own work, then these tokens
        rows = []
        for s in sp._seqs[:num_seqs]:
            fut = futures[tuple(s.token_ids[: s.num_prompt_tokens])][s.num_output_tokens:][: sp.block_size - 1]
            rows.append(fut[:m] + [(t + 1) % vocab for t in fut[m:]])
        rows += [[0] * (sp.block_size - 1)] * (num_seqs - len(rows))
        return torch.tensor(rows, dtype=torch.long)

    def forward(plans):
        sp._seqs = [p.seq for p in plans]
        return real_forward(plans)

    def launch(prev, plans):  # the next block starts past what prev will commit: m + 1 tokens
        sp._seqs = [p.seq for p in plans]
        for p in plans:
            fut = futures[tuple(p.seq.token_ids[: p.seq.num_prompt_tokens])]
            p.seq.token_ids.extend(fut[p.seq.num_output_tokens: p.seq.num_output_tokens + m + 1])
        try:
            return real_launch(prev, plans)
        finally:
            for p in plans:
                del p.seq.token_ids[-(m + 1):]

    sp.drafts.tokens, sp.forward, sp.ahead._verify_after = drafts, forward, launch


def launches_seen(sp) -> list[tuple[int, int]]:
    """(drafts of the verify in flight, drafts of the one launched ahead on it), filled as steps launch."""
    counts, launch = [], sp.ahead._verify_after

    def launch_seen(prev, plans):
        counts.append((prev.plans[0].n - 1, plans[0].n - 1))
        return launch(prev, plans)

    sp.ahead._verify_after = launch_seen
    return counts


@pytest.mark.parametrize("m,drafted", [(2, 3), (7, 7)])
def test_the_step_verifies_the_count_that_pays(tiny_llama, drafter, m, drafted):
    """Drafts right for 2 slots: a verify of 3 drafts commits what one of 7 does for 1.5 plain steps
    against 2.5, so after the warm-up steps verify 3 (the whole block at the warm-up and the deep
    probes); right for all 7 (an oracle), whole blocks. Overlapped and step by step alike, and the
    tokens are plain decoding's."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    futures = {tuple(p): w + [0] * 16 for p, w in zip(PROMPTS, want)}
    totals = []
    for async_scheduling in (False, True):
        llm = counted(tiny_llama, drafter, async_scheduling)
        right_for(llm, futures, m)
        counts = launches_seen(llm.engine.spec)
        got = llm.generate(PROMPTS, params)
        assert [o.token_ids for o in got] == want
        t = llm.engine.spec_totals()
        for o in got:  # m accepted in every block but perhaps the last (drafts past the known future)
            assert o.metrics["acceptance_histogram"][m] >= o.metrics["num_drafts"] - 1 > 0
        per_verify = t["num_draft_tokens"] / t["num_drafts"]
        if drafted == 7:
            assert per_verify == 7 and llm.engine.spec.policy.profile.best == 7
        else:
            # the warm-up's 8 blocks verify 7 drafts (overlapped, one more step of 4: launched before
            # the choice was read), every other block 3
            whole = (t["num_draft_tokens"] - 3 * t["num_drafts"]) / 4
            assert whole == (12 if async_scheduling else 8) and llm.engine.spec.policy.profile.best == 3
        assert llm.engine.block_manager.num_used_blocks == 0
        if async_scheduling:  # the change of count itself launched ahead of the last 7-draft step
            assert (7, 3) in counts and (3, 3) in counts if drafted == 3 else set(counts) == {(7, 7)}
        totals.append(t)
    assert totals[0]["num_accepted_tokens"] == totals[1]["num_accepted_tokens"]
    assert llm.engine.stats["num_overlapped_steps"] >= 4


def test_a_drafter_that_misses_gets_no_verifies(tiny_llama, drafter):
    """A random drafter (tau near 1): no count pays, so the steps decode without drafts, and the
    tokens are still plain decoding's."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    llm = counted(tiny_llama, drafter, False)
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(PROMPTS, params)]
    t = llm.engine.spec_totals()
    assert t["gated_steps"] > 3 * t["num_drafts"] > 0
    # the pause is sized by what its probe, a whole block (2.5 plain steps for 1 token), loses: 256 steps
    # (as the gate's by-hand test below), not by the 3-draft count's 1.5 (64 steps)
    gate = llm.engine.spec.policy.step_gate
    assert gate.pause == 256 and gate.resume_at % 256 == 0


def test_the_pause_is_sized_by_the_probe():
    """Where the gate's threshold is a shorter count's break-even but its probe verifies the whole block,
    the pauses follow the probe's loss (break-even - tau of the whole block), so probes cost ~1% of the
    steps: at 1.536 for 3 drafts against 2.67 for the block (the Qwen3-8B shape's step costs at 32
    requests on an H200), 256 steps, not 64."""
    alone, probed = StepGate(), StepGate()
    assert alone.record(1.0, 5, 1.536, 32, averaged=True) and alone.pause == 64 and alone.resume_at == 128
    assert probed.record(1.0, 5, 1.536, 32, averaged=True, probe=(1.0, 2.67))
    assert probed.pause == 256 and probed.resume_at == 512
    assert probed.record(1.0, 512, 1.536, 32, averaged=True, probe=(1.0, 2.67)) and probed.resume_at == 768
    # a block that would nearly pay: a shorter first pause, capped alike
    near = StepGate()
    assert near.record(1.5, 5, 1.536, 32, averaged=True, probe=(2.6, 2.67)) and near.resume_at == 32
    assert near.pause == 32  # doubled, under the cap of 256


def test_requests_joining_steps_of_fewer_drafts(tiny_llama, drafter):
    """Requests joining one by one while the others verify 3 drafts (prefill chunks beside verify
    blocks: ragged steps), overlapped: plain decoding's tokens, and the steps go on at 3 drafts."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = counted(tiny_llama, drafter, True)
    right_for(llm, {tuple(p): w + [0] * 16 for p, w in zip(PROMPTS, want)}, 2)
    eng, seqs = llm.engine, []
    for p in PROMPTS:  # each joins 5 steps after the one before
        seqs.append(eng.add_request(None, params, prompt_token_ids=p))
        for _ in range(5):
            eng.step()
    while eng.has_unfinished():
        eng.step()
    assert [s.output_token_ids for s in seqs] == want
    t = eng.spec_totals()
    assert eng.spec.policy.profile.best == 3 and t["num_draft_tokens"] < 4 * t["num_drafts"]
    assert eng.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_change_of_count_is_launched_ahead(tiny_llama, drafter, temperature):
    """The count changing from step to step (forced: 7, 7, 3, 3, 3, 7, 3, ...), overlapped: each step
    after a change is launched before the one in flight is read, its blocks moved to the other
    count's graph (greedy, and drafts drawn for seeded sampled requests: the sampled graph's kind);
    the tokens are plain decoding's (seeded requests draw the same noise at every position)."""
    import itertools

    params = [SamplingParams(temperature=temperature, max_tokens=n, seed=3 + n, ignore_eos=True)
              for n in (30, 23, 40, 9)]
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    llm = counted(tiny_llama, drafter, True)
    right_for(llm, {tuple(p): w + [0] * 16 for p, w in zip(PROMPTS, want)}, 7)
    sp = llm.engine.spec
    pattern = itertools.cycle([7, 7, 3, 3, 3, 7, 3])
    sp.policy._verify_count = lambda: next(pattern)
    counts, graphs = launches_seen(sp), sp.graphs.graph_of
    drawn = []
    sp.graphs.graph_of = lambda g, n, d=None, k=None: drawn.append(d) or graphs(g, n, d, k)  # the graph moved to
    got = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    assert {(7, 3), (3, 7)} <= set(counts) and set(drawn) == {temperature > 0}
    assert llm.engine.block_manager.num_used_blocks == 0
