"""The acceptance gates (flashdraft/speculative/gate.py): a request (AcceptanceGate, a threshold
given) or a whole step (StepGate, the default, at the break-even tau of the step costs) whose drafts
do not pay decodes without them for a while, with the same tokens as plain decoding."""

from __future__ import annotations

import argparse

import pytest
from fixtures import StepClock, poison_rejected, step_gated
from test_dflash import MIXED, install_oracle

from flashdraft import LLM, SamplingParams, settings
from flashdraft.speculative.costs import Observed, StepCosts
from flashdraft.speculative.gate import AcceptanceGate, StepGate, first_pause, pause_cap


def test_gate_policy_by_hand():
    """Warm-up, the running average, pauses ending on multiples of their length, doubling, the
    reset and the cap, traced by hand (steps are the engine's step clock)."""
    g = AcceptanceGate()  # weight 0.25, warm-up 4, pauses 16, 32, 64
    assert g.drafts(0)
    for step in (11, 12, 13):  # three verifies of one token each: below 2, but inside the warm-up
        assert not g.record(1, step, 2.0) and g.drafts(step + 1)
    assert g.record(1, 14, 2.0) and g.resume_at == 32  # the fourth pauses: 14 + 16 = 30, up to a multiple of 16
    assert not g.drafts(31) and g.drafts(32)
    assert g.record(4, 32, 2.0)  # the probe: 1 + 0.25 * 3 = 1.75, still below: 32 + 32 = 64
    assert g.tau == pytest.approx(1.75) and g.resume_at == 64
    assert not g.record(8, 64, 2.0) and g.tau == pytest.approx(1.75 + 0.25 * 6.25)  # 3.3125: drafting again
    assert g.drafts(65)
    assert [g.record(1, step, 2.0) for step in (65, 66, 67)] == [False, False, True]  # 2.734, 2.301, 1.976
    assert g.resume_at == 96 and g.pause == 32  # 67 + 16 = 83 -> 96; the good verify had reset it
    assert not g.record(1, 96, 1.5)  # the threshold is the step's: 1.732 passes 1.5
    g.pause = 64
    assert g.record(1, 100, 3.0)
    assert g.resume_at == 192 and g.pause == 64  # 100 + 64 -> 192, and the cap


def test_gate_pauses_a_request_whose_drafts_miss(tiny_llama, drafter, plain):
    """Oracle drafts in one batch: request i's drafts go wrong at slot i (block of 4, so it commits
    i + 1 tokens per verify). At min_tau 2 only request 0 (1 token per verify) is gated. Hand trace
    for 60 tokens, step 1 the prefill: verifies in steps 2-5, a pause to step 32 (5 + 16 -> 32), a
    probe there, a pause to 64 (past the end): 5 verifies and 26 + 28 gated steps."""
    prompts = MIXED[:4]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = plain.generate(prompts, params)
    llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32",
              speculative_min_acceptance_length=2)
    wrong_at = {tuple(p): i for i, p in enumerate(prompts)}

    def corrupt(s, d):
        j = wrong_at[tuple(s.token_ids[: s.num_prompt_tokens])]
        return [t if i < j else (t + 1) % 300 + 3 for i, t in enumerate(d)]

    install_oracle(llm, {tuple(p): o.token_ids for p, o in zip(prompts, ref)}, corrupt)
    with poison_rejected(llm):
        outs = llm.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    m = [o.metrics for o in outs]
    assert (m[0]["num_drafts"], m[0]["gated_steps"]) == (5, 54)
    assert m[0]["acceptance_histogram"][0] == 5
    for i in (1, 2, 3):  # 2, 3, 4 tokens per verify: never gated
        assert m[i]["gated_steps"] == 0 and m[i]["acceptance_histogram"][i] == m[i]["num_drafts"]
    assert llm.engine.spec_totals()["gated_steps"] == 54


def test_gate_lets_a_request_draft_again(tiny_llama, drafter, plain):
    """Drafts that miss until the 20th output token, then the target's own. Step 1 prefills, steps
    2-5 verify one token each, 6-31 are gated (outputs 6-31); the probe in step 32 commits 4
    (average 1 + 0.25 * 3 = 1.75, over min_tau 1.5) and the request drafts to its end: outputs 35,
    39, ..., 59, 60 in steps 33-39: 4 + 1 + 7 verifies."""
    prompt = MIXED[2]
    params = SamplingParams(max_tokens=60, ignore_eos=True)
    ref = plain.generate([prompt], params)[0].token_ids
    llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32",
              speculative_min_acceptance_length=1.5)
    install_oracle(llm, {tuple(prompt): ref},
                   lambda s, d: d if s.num_output_tokens >= 20 else [(t + 1) % 300 + 3 for t in d])
    out = llm.generate([prompt], params)[0]
    assert out.token_ids == ref
    assert (out.metrics["num_drafts"], out.metrics["gated_steps"]) == (12, 26)


def test_the_cpu_default_gates_the_shipped_drafter_where_it_does_not_pay(smollm2, monkeypatch):
    """The default on a CPU: the step gate with the costs it times while serving. Sampled requests
    with the shipped drafter (tau ~1.5 at T=1) cost more with drafts than without on a CPU (here: a
    clock on which a target forward costs 1 ms plus 0.25 ms a row, as rows cost on a CPU), so after
    its warm-up steps decode without drafts; every seeded output equals plain decoding's."""
    monkeypatch.setattr(settings, "STEP_GATE", True)
    qs = ["Write a short poem about the sea.", "Describe your ideal weekend.", "What is a hash table?"]
    prompts = [smollm2.engine.apply_chat_template([{"role": "user", "content": q}]) for q in qs]
    params = [SamplingParams(temperature=1.0, max_tokens=64, ignore_eos=True, seed=10 + i) for i in range(3)]
    want = [o.token_ids for o in smollm2.generate(prompts, params)]
    llm = LLM(device="cpu", dtype="float32")  # speculative_min_acceptance_length="auto"
    sp = llm.engine.spec.policy
    assert sp.min_tau_rule is None and sp.step_gate is not None and not sp.costs.measured
    StepClock(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    tot = llm.engine.spec_totals()
    assert tot["gated_steps"] > 0 and tot["num_drafts"] > 0
    i = sp.costs.bucket(3)
    assert sp.seen.spec[i] > sp.seen.plain[i] > 0 and sp.costs.break_even(3, sp.seen) > 1


def test_auto_is_the_step_gate_on_every_device():
    import torch

    from flashdraft.config import EngineConfig

    c = EngineConfig()
    assert c.speculative_min_acceptance_length == "auto"
    for device in ("cpu", "cuda"):  # no per-request gate: the step gate decides (STEP_GATE)
        assert c.min_acceptance_length(torch.device(device)) is None
    assert settings.STEP_GATE is False  # the suite's switch (tests/conftest.py)
    assert EngineConfig(speculative_min_acceptance_length=None).min_acceptance_length(torch.device("cpu")) is None
    fixed = EngineConfig(speculative_min_acceptance_length=3).min_acceptance_length(torch.device("cuda"))
    assert fixed(1, 0.0) == fixed(40, 1.0) == 3.0


@pytest.mark.parametrize("bad", [0.5, 0, "fast", True, float("nan"), float("inf"), [2]])
def test_bad_min_acceptance_length_is_refused(bad):
    from flashdraft.config import EngineConfig

    with pytest.raises(ValueError, match="speculative_min_acceptance_length must be"):
        EngineConfig(speculative_min_acceptance_length=bad)


def test_cli_min_acceptance_length():
    from flashdraft.config import add_engine_args, engine_kwargs

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = lambda *a: engine_kwargs(p.parse_args(list(a)))["speculative_min_acceptance_length"]  # noqa: E731
    assert kw() == "auto" and kw("--speculative-min-acceptance-length", "2.5") == 2.5
    assert kw("--speculative-min-acceptance-length", "off") is None
    assert kw("--speculative-min-acceptance-length", "0") is None
    for bad in ("x", "0.5", "nan"):
        with pytest.raises(SystemExit):
            p.parse_args(["--speculative-min-acceptance-length", bad])


def test_step_costs_break_even_by_bucket():
    """A batch of n takes the smallest bucket holding it (the graph its step replays), past the
    largest the largest; a verify cheaper than a plain step (timing noise) still asks tau >= 1."""
    c = StepCosts((1, 2, 4, 8), (1.0, 1.0, 1.2, 1.5), (1.3, 1.4, 2.4, 6.0))
    assert [c.break_even(n) for n in (1, 2, 3, 4, 5, 8, 64)] == pytest.approx([1.3, 1.4, 2.0, 2.0, 4.0, 4.0, 4.0])
    assert StepCosts((1,), (2.0,), (1.9,)).break_even(1) == 1.0
    assert c.as_dict()["break_even"] == [1.3, 1.4, 2.0, 4.0]


def test_pause_cap_and_the_step_gate_by_hand():
    """Pauses grow to a power of two of at least 100 (min_tau - 1) steps (a probe then costs about 1%
    of the steps), 64 to 1024; the first is a power of two of at least 100 (min_tau - tau), from 16.
    The step gate: a warm-up of 8 blocks, the average (0.05 a block), pauses on the clock's
    multiples, a probe of 8 blocks replacing the average and a smaller one counting half, doubling
    to the cap (or at once to what the new average asks for, if longer), the reset."""
    assert [pause_cap(t) for t in (1.0, 1.5, 1.64, 2.0, 3.0, 4.0, 9.0, 30.0)] == [64, 64, 64, 128, 256, 512, 1024, 1024]
    assert [first_pause(t, 3.0) for t in (2.9, 2.7, 2.5, 2.0, 1.0)] == [16, 32, 64, 128, 256]
    assert first_pause(1.0, 1.5) == 64 and first_pause(1.0, 30.0) == 1024 and first_pause(1.0, 4.1) == 512
    g = StepGate()
    assert g.drafts(0)
    assert not g.record(2.5, 1, 3.0, 4)  # the warm-up: 4 of 8 blocks
    assert g.record(2.5, 2, 3.0, 4) and g.resume_at == 128 and g.pause == 128  # first pause 64: 2 + 64 -> 128
    assert not g.drafts(127) and g.drafts(128)
    assert g.record(1.0, 128, 3.0, 8) and g.tau == 1.0  # a probe of 8 blocks replaces the average
    # far below the break-even: not the doubled 128 but what the new average asks for, 256 (the cap at 3)
    assert g.resume_at == 512 and g.pause == 256  # 128 + 256 -> 512
    assert g.record(1.0, 512, 3.0, 2) and g.resume_at == 768 and g.pause == 256
    assert g.record(1.0, 768, 3.0, 8) and g.resume_at == 1024 and g.pause == 256
    assert not g.record(4.0, 1024, 3.0, 8) and g.pause == 0 and g.drafts(1025)  # pays again
    w = 1 - 0.95**4  # a step of 4 blocks
    assert not g.record(2.5, 1025, 3.0, 4) and g.tau == pytest.approx(4 - w * 1.5)
    assert not g.record(1.0, 1026, 3.0, 4) and g.tau == pytest.approx(4 - w * 1.5 - w * (3 - w * 1.5))
    assert g.record(1.0, 1027, 3.0, 4) and g.tau == pytest.approx(2.806, abs=1e-3)
    assert g.resume_at == 1088 and g.pause == 64  # first pause 32: 1027 + 32 = 1059 -> 1088
    near = StepGate(tau=2.9, verifies=9, blocks=9, resume_at=64, pause=128, probing=True)
    assert near.record(2.9, 64, 3.0, 8) and near.resume_at == 256 and near.pause == 256  # near it: doubling, 128
    half = StepGate(tau=1.0, verifies=9, blocks=9, resume_at=64, pause=128, probing=True)
    assert not half.record(4.0, 64, 2.0) and half.tau == 2.5  # a lone request's probe counts half
    lone = StepGate()  # one request: 8 steps before the first pause
    assert [lone.record(1.0, s, 3.0) for s in range(1, 9)] == [False] * 7 + [True]
    far = StepGate()  # far below the break-even (a CPU's 12-request batch): a long first pause
    assert far.record(1.5, 7, 4.0, 12) and far.resume_at == 512 and far.pause == 512  # 7 + 256 -> 512


def test_the_step_gate_stops_drafts_that_miss_and_keeps_those_that_pay(tiny_llama, drafter, plain):
    """A random drafter (tau ~1) under a break-even tau of 2: two verify steps of four requests (the
    warm-up's 8 blocks), then steps without drafts for every request until a probe on the clock's
    multiple (256: a first pause of 128 from step 3); requests arriving later start without drafts.
    Oracle drafts (tau 4) under the same threshold: never gated. Tokens are plain decoding's
    throughout."""
    prompts = MIXED[:4]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    llm = step_gated(LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32"), 2.0)
    first = llm.generate(prompts, params)
    assert [o.token_ids for o in first] == ref
    # step 1 prefills, 2-3 verify (the warm-up), 4-40 decode (a request whose random drafts were
    # accepted somewhere ends a step earlier)
    for o in first:
        m = o.metrics
        assert m["num_drafts"] == 2 and 1 + m["num_drafts"] + m["num_accepted_tokens"] + m["gated_steps"] == 40
    assert llm.engine.spec.policy.steps == 40 and llm.engine.spec.policy.step_gate.resume_at == 256
    long = SamplingParams(max_tokens=240, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, long)]
    again = llm.generate(prompts, long)  # step 41 prefills, 42-255 decode, 256 probes, 257-280 decode
    assert [o.token_ids for o in again] == want
    for o in again:
        m = o.metrics
        assert m["num_drafts"] == 1 and 1 + m["num_drafts"] + m["num_accepted_tokens"] + m["gated_steps"] == 240
    assert llm.engine.spec.policy.step_gate.resume_at == 384  # the pause at the cap at tau 2: 128
    oracle = step_gated(LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32"), 3.0)
    install_oracle(oracle, {tuple(p): r for p, r in zip(prompts, ref)})
    outs = oracle.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert all(o.metrics["gated_steps"] == 0 for o in outs) and oracle.engine.spec.policy.step_gate.tau == 4.0


def test_unmeasured_step_costs_take_what_is_observed():
    """Nothing timed at start (a CPU): buckets of powers of two; a bucket's break-even is its observed
    ratio, else the nearest bucket's seen both ways, else 1 (drafts run until they are timed)."""
    c = StepCosts.unmeasured(12)
    assert c.batches == (1, 2, 4, 8, 16) and not c.measured and c.bucket(12) == 4
    seen = Observed()
    assert c.break_even(3) == c.break_even(3, seen) == 1.0
    seen.add(seen.spec, c.bucket(3), 30.0)
    assert c.break_even(3, seen) == 1.0 and seen.wants_plain(2)
    seen.add(seen.plain, 2, 10.0)
    assert c.break_even(3, seen) == c.break_even(4, seen) == pytest.approx(3.0)
    assert c.break_even(1, seen) == c.break_even(12, seen) == pytest.approx(3.0)  # the nearest seen: bucket 4
    seen.add(seen.spec, 0, 12.0)
    seen.add(seen.plain, 0, 8.0)
    assert c.break_even(1, seen) == pytest.approx(1.5) and c.break_even(2, seen) == pytest.approx(1.5)
    assert c.break_even(16, seen) == pytest.approx(3.0)


def test_observed_step_costs_raise_the_break_even():
    """While serving, once a bucket's DFlash steps (wall time) and steps without drafts (pace) have
    both been timed, the larger of graph and observed cost counts for each, as running averages."""
    c = StepCosts((1, 4), (1.0, 2.0), (1.5, 3.0))
    seen = Observed()
    assert c.break_even(3, seen) == 1.5 and c.bucket(3) == 1 and c.bucket(9) == 1
    assert seen.wants_plain(1)  # the pace without drafts is timed first
    seen.add(seen.spec, c.bucket(3), 6.0)  # a DFlash step of 3 requests took 6 ms, host included
    assert c.break_even(3, seen) == 1.5 and seen.wants_plain(1)  # its pace without drafts not seen yet
    seen.add(seen.plain, 1, 1.0)  # below the graph's 2 ms: the graph's counts
    assert c.break_even(3, seen) == 3.0 and c.break_even(1, seen) == 1.5 and not seen.wants_plain(1)
    seen.add(seen.spec, 1, 8.0)
    assert seen.spec[1] == pytest.approx(6.4)  # 6 + 0.2 * (8 - 6)
    seen.add(seen.plain, 1, 4.0)  # 1 + 0.2 * (4 - 1) = 1.6: still the graph's
    assert c.break_even(4, seen) == pytest.approx(3.2)
    seen.plain[1] = 3.2
    assert c.break_even(4, seen) == pytest.approx(2.0)
    seen.tries[0] = seen.max_tries
    seen.add(seen.spec, 0, 9.0)
    assert not seen.wants_plain(0)  # the tries are spent: the graphs decide


def test_the_step_gate_counts_what_steps_take_on_the_host(tiny_llama, drafter, plain):
    """Graph costs that call drafts free (break-even 1, so a random drafter's tau of ~1 would pay) on
    an engine whose steps take milliseconds of host and CPU time (a clock on which a target forward
    costs 1 ms plus 0.25 ms a row): it runs a few overlapped steps without drafts to time their pace,
    and the observed costs (a DFlash step dearer than one without drafts) make the gate stop the
    drafts, with plain decoding's tokens."""
    prompts = MIXED[:4]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32", async_scheduling=True)
    sp = step_gated(llm, 1.0).engine.spec.policy
    sp.costs, sp.seen.max_tries = StepCosts((64,), (0.01,), (0.01,)), 8
    StepClock(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    assert sp.seen.spec[0] > sp.seen.plain[0] > 0.01 and sp.costs.break_even(4, sp.seen) > 1.2
    assert 0 < sp.seen.tries[0] <= sp.seen.max_tries
    assert sp.step_gate.resume_at > 0 and llm.engine.spec_totals()["gated_steps"] > 4 * sp.seen.max_tries


def test_the_step_gate_times_the_steps_of_a_sync_engine(tiny_llama, drafter, plain):
    """Nothing measured at start (a CPU engine, steps read one at a time): the gate drafts until its
    DFlash steps are timed, runs a step without drafts to time that, and then stops the random
    drafter (tau ~1 against a DFlash step dearer than a plain one, on a clock where a target forward
    costs 1 ms plus 0.25 ms a row); plain decoding's tokens."""
    prompts = MIXED[:4]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ref = [o.token_ids for o in plain.generate(prompts, params)]
    llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32")
    sp = llm.engine.spec.policy
    assert not llm.engine.async_scheduling
    sp.costs, sp.step_gate = StepCosts.unmeasured(llm.engine.config.max_num_seqs), StepGate()
    StepClock(llm)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    i = sp.costs.bucket(4)
    assert sp.seen.spec[i] > sp.seen.plain[i] > 0 and sp.costs.break_even(4, sp.seen) > 1.2
    assert sp.seen.tries[i] == 1 and sp.step_gate.resume_at > 0
    tot = llm.engine.spec_totals()
    assert tot["num_drafts"] >= sp.step_gate.warmup and tot["gated_steps"] > 4 * 10


def test_one_stall_does_not_stop_the_drafts():
    """A step that stalls (25 ms against ~1: a collection pass, or on a GPU a kernel's first load)
    moves a bucket's observed cost by at most (spike - 1) x weight of it; with graph costs measured
    at start a bucket's first sample, where first loads happen, is dropped. Without graph costs (a
    CPU) the first sample is the average at once: the gate decides from its first verify."""
    c = StepCosts((1,), (0.8,), (0.9,))
    seen = Observed()
    seen.add(seen.spec, 0, 25.0, skip_first=True)
    assert 0 not in seen.spec
    seen.add(seen.spec, 0, 1.0, skip_first=True)
    seen.add(seen.plain, 0, 0.7, skip_first=True)
    seen.add(seen.plain, 0, 0.75, skip_first=True)
    assert seen.spec[0] == 1.0 and seen.plain[0] == 0.75
    seen.add(seen.spec, 0, 40.0, skip_first=True)
    assert seen.spec[0] == pytest.approx(1.0 + 0.2 * (3.0 - 1.0))
    assert c.break_even(1, seen) == pytest.approx(1.4 / 0.8)  # a drafter at tau 2 still drafts
    cpu = Observed()
    cpu.add(cpu.spec, 0, 25.0)
    assert cpu.spec[0] == 25.0


def test_steps_without_drafts_are_timed_only_where_their_pace_can_decide(tiny_llama, drafter, monkeypatch):
    """With graph costs measured at start, steps without drafts run to time their pace only once the
    batch's tau is known and below the break-even that counts the DFlash step's observed cost against
    the plain graph's (a faster plain pace could only lower it); without graph costs (a CPU) they are
    timed first, as before."""
    llm = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32")
    sp = step_gated(llm, 2.0).engine.spec.policy  # graphs: a plain step 1e6, a DFlash step 2e6
    sp.seen.max_tries = 8
    assert not sp._times_plain(4)  # no verify yet: the graphs decide the first steps
    sp.step_gate.verifies, sp.step_gate.tau = 3, 3.5
    assert not sp._times_plain(4)  # tau 3.5 over a break-even of at most 2: drafts pay at any pace
    sp.seen.spec[0] = 4e6  # DFlash steps seen at twice their graph's cost: at most 4
    assert sp._times_plain(4)
    sp.step_gate.tau = 1.2
    sp.seen.spec.clear()
    assert sp._times_plain(4)
    sp.seen.tries[0] = sp.seen.max_tries
    assert not sp._times_plain(4)  # the tries are spent
    monkeypatch.setattr(settings, "STEP_GATE", True)
    cpu = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32").engine.spec.policy
    assert not cpu.costs.measured and cpu.step_gate.verifies == 0 and cpu._times_plain(4)
