"""Async scheduling (engine.step): the next decode step is launched before the last one's samples
are read, its input ids those samples on the device. Everything observable must equal the step-by-step
engine's: tokens, stops, finish reasons, aborts, preemption, requests joining mid-run; and it must
actually overlap (the engine counts the steps it launched ahead)."""

from __future__ import annotations

import pytest

from flashdraft import LLM, SamplingParams

PROMPTS = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12]]


def engines(folder, **cfg):
    return [LLM(str(folder), draft=None, device="cpu", dtype="float32", async_scheduling=a, **cfg)
            for a in (False, True)]


def outputs(llm, prompts, params):
    return [(o.token_ids, o.finish_reason, o.text) for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def pair(tiny_llama):
    return engines(tiny_llama)


def test_async_equals_sync_greedy_sampled_and_mixed_lengths(pair):
    sync, overlap = pair
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 20, 11, 1)]
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n, seed=7 + n, ignore_eos=True)
               for n in (9, 2, 17, 5)]
    before = overlap.engine.stats["num_overlapped_steps"]
    for params in (greedy, sampled):
        assert outputs(overlap, PROMPTS, params) == outputs(sync, PROMPTS, params)
    assert overlap.engine.stats["num_overlapped_steps"] - before > 20, "decode steps were meant to overlap"
    assert sync.engine.stats["num_overlapped_steps"] == 0
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_no_token_past_a_stop(pair):
    """A request that stops at step N had a row in step N+1 (launched before N was read): that row's
    token is never committed, and the other requests go on exactly as without overlap."""
    sync, overlap = pair
    base = sync.generate([PROMPTS[2]], SamplingParams(max_tokens=24, ignore_eos=True))[0].token_ids
    stop_tok = base[6]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=[stop_tok]),
              SamplingParams(max_tokens=24, ignore_eos=True)]
    prompts = [PROMPTS[2], PROMPTS[0]]
    got = outputs(overlap, prompts, params)
    assert got == outputs(sync, prompts, params)
    assert got[0][0] == base[: base.index(stop_tok) + 1] and got[0][1] == "stop"
    text = sync.generate([PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0].text
    stop = [SamplingParams(max_tokens=30, ignore_eos=True, stop=[text[4:7]])]
    assert outputs(overlap, [PROMPTS[1]], stop) == outputs(sync, [PROMPTS[1]], stop)
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_a_request_ending_unforeseen_leaves_the_others_overlapped(pair):
    """Stops the launched step could not foresee: the step after it is launched for the others all the
    same (its rows gathered from the in-flight step's samples), so every decode step but the first
    of each request's prefill goes ahead."""
    sync, overlap = pair
    base = [o.token_ids for o in sync.generate(PROMPTS, SamplingParams(max_tokens=30, ignore_eos=True))]
    params = [SamplingParams(max_tokens=30, ignore_eos=True, stop_token_ids=[b[at]]) for b, at in
              zip(base, (4, 20, 11, 26))]
    sync_steps, before = sync.engine.stats["num_steps"], overlap.engine.stats["num_overlapped_steps"]
    got = outputs(overlap, PROMPTS, params)
    assert got == outputs(sync, PROMPTS, params)
    assert [g[1] for g in got] == ["stop"] * 4
    steps = sync.engine.stats["num_steps"] - sync_steps
    assert overlap.engine.stats["num_overlapped_steps"] - before >= steps - 2, "each stop broke the overlap"
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_requests_joining_behind_a_step_in_flight(tiny_llama):
    """Two running at most, six requests: each waiting request is admitted while a decode step is in
    flight, its whole prompt prefilled by a step of its own queued behind the next one, and it decodes
    in the step after, launched ahead too (its first token the prefill's sample, on the device). One
    joiner ends at its first token. Greedy and sampled: the tokens are the step-by-step engine's."""
    sync, overlap = engines(tiny_llama, max_num_seqs=2)
    plain_steps = overlap.engine.pipeline.steps
    real, joined = plain_steps.prefill, []

    def launch(batch):
        flight = real(batch)
        joined.append(len(flight.seqs))
        return flight

    prompts = PROMPTS + [[9, 8, 7, 6, 5], list(range(3, 23))]
    plain_steps.prefill = launch
    try:
        for t in (0.0, 1.0):
            params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=n)
                      for n in (7, 13, 1, 16, 30, 9)]
            steps, ahead = sync.engine.stats["num_steps"], overlap.engine.stats["num_overlapped_steps"]
            assert outputs(overlap, prompts, params) == outputs(sync, prompts, params)
            # every decode step but the first two went ahead (each request's prefill was its own step)
            decode_steps = sync.engine.stats["num_steps"] - steps - len(prompts)
            assert overlap.engine.stats["num_overlapped_steps"] - ahead >= decode_steps - 2
    finally:
        del plain_steps.prefill
    assert sum(joined) >= 6, joined
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_abort_while_a_step_is_in_flight(pair):
    sync, overlap = pair
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in sync.generate(PROMPTS, params)]
    eng = overlap.engine
    seqs = [eng.add_request(None, params, prompt_token_ids=p) for p in PROMPTS]
    for _ in range(6):
        eng.step()
    assert eng.pipeline.inflight is not None, "a decode step was meant to be in flight"
    victim = seqs[1]
    kept = list(victim.output_token_ids)
    eng.abort(victim)
    while eng.has_unfinished():
        eng.step()
    assert victim.finish_reason == "abort" and victim.output_token_ids == kept
    assert kept == want[1][: len(kept)]
    assert [s.output_token_ids for i, s in enumerate(seqs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    assert eng.block_manager.num_used_blocks == 0


def joining_late(eng, params, steps: int) -> list[list[int]]:
    """PROMPTS[0] alone for `steps` engine steps, then the others join; every output, in order."""
    first = eng.add_request(None, params, prompt_token_ids=PROMPTS[0])
    for _ in range(steps):
        eng.step()
    late = [eng.add_request(None, params, prompt_token_ids=p) for p in PROMPTS[1:]]
    while eng.has_unfinished():
        eng.step()
    return [s.output_token_ids for s in [first, *late]]


def test_requests_joining_and_preemption(tiny_llama):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    sync, overlap = engines(tiny_llama, num_kv_blocks=12, kv_block_size=8)
    assert outputs(overlap, PROMPTS, params) == outputs(sync, PROMPTS, params)
    assert overlap.engine.stats["num_preemptions"] > 0 and overlap.engine.stats["num_overlapped_steps"] > 0
    want = [o.token_ids for o in sync.generate(PROMPTS, params)]
    assert joining_late(overlap.engine, params, 5) == want


def test_hybrid_target(tmp_path_factory):
    from fixtures import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("qwen3.5"), "qwen3_5_text")
    sync, overlap = engines(folder)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 5, 9, 1)]
    assert outputs(overlap, PROMPTS, params) == outputs(sync, PROMPTS, params)
    assert overlap.engine.stats["num_overlapped_steps"] > 0


def test_async_scheduling_option_is_checked():
    from flashdraft.config import EngineConfig

    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="yes")


# ---- DFlash engines: steps without drafts overlap too (speculative/dflash.py, step) ------------
def spec_engines(folder, drafter, **cfg):
    return [LLM(str(folder), draft=str(drafter), device="cpu", dtype="float32", async_scheduling=a, **cfg)
            for a in (False, True)]


@pytest.mark.parametrize("pause", ["gate", "step", "batch"])
def test_dflash_steps_without_drafts_overlap(tiny_llama, drafter, pause):
    """A random drafter's requests paused by their acceptance gates (tau ~1 under min_tau 3: four
    warm-up verifies, then probes on the clock's multiples), by the step gate (the default, at a
    break-even tau of 3), or every step paused by speculative_disable_batch_size: with async
    scheduling each step without drafts is launched before
    the one before it is read. Tokens, finish reasons and texts equal plain decoding's, greedy and
    sampled, with stops; the drafting statistics equal the step-by-step DFlash engine's while no
    request stops early (a stop that a launched step could not foresee costs that step a row, and
    the gates' step clock moves on one more than without overlap)."""
    cfg = {"gate": {"speculative_min_acceptance_length": 3}, "step": {},
           "batch": {"speculative_disable_batch_size": 1}}[pause]
    sync, overlap = spec_engines(tiny_llama, drafter, **cfg)
    if pause == "step":
        from fixtures import step_gated

        sync, overlap = step_gated(sync, 3.0), step_gated(overlap, 3.0)
    (plain,) = [LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")]
    greedy = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 40, 27, 1)]
    sampled = [SamplingParams(temperature=1.0, top_p=0.9, max_tokens=n, seed=7 + n, ignore_eos=True)
               for n in (33, 2, 40, 5)]
    base = plain.generate([PROMPTS[2]], SamplingParams(max_tokens=40, ignore_eos=True))[0].token_ids
    stopping = [SamplingParams(max_tokens=40, ignore_eos=True, stop_token_ids=[base[30]])] + greedy[1:]
    for params in (greedy, sampled, stopping):
        want = outputs(plain, PROMPTS, params)
        assert outputs(overlap, PROMPTS, params) == want
        assert outputs(sync, PROMPTS, params) == want
        if params is sampled:
            assert overlap.engine.spec_totals() == sync.engine.spec_totals()
            assert overlap.engine.spec_totals()["num_drafts"] > 0 or pause == "batch"
    assert overlap.engine.stats["num_overlapped_steps"] > 30, "steps without drafts were meant to overlap"
    assert sync.engine.stats["num_overlapped_steps"] == 0
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_requests_joining_steps_without_drafts(tiny_llama, drafter):
    """A DFlash engine serving requests that do not speculate (the bench's plain arm), two at most:
    each waiting request joins behind a step in flight (its prefill a step of its own, through a
    ragged graph) and decodes in the step after, launched ahead. Tokens as plain decoding's."""
    from test_graphs import _graphed_llm

    kw = dict(device="cpu", dtype="float32", attention_backend="torch", kv_block_size=8, max_num_seqs=2,
              draft=str(drafter), async_scheduling=True)
    overlap = _graphed_llm(str(tiny_llama), kw)[0]
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    real, joined = overlap.engine.spec.prefill, []

    def launch(batch):
        flight = real(batch)
        joined.append(len(flight.seqs))
        return flight

    prompts = PROMPTS + [[9, 8, 7, 6, 5], list(range(3, 23))]
    overlap.engine.spec.prefill = launch
    for t in (0.0, 1.0):
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=n, speculative=False)
                  for n in (7, 13, 1, 16, 30, 9)]
        assert outputs(overlap, prompts, params) == outputs(plain, prompts, params)
    assert sum(joined) >= 6, joined
    assert overlap.engine.stats["num_overlapped_steps"] > 40
    assert overlap.engine.block_manager.num_used_blocks == 0


def test_dflash_abort_preemption_and_hybrid_while_in_flight(tiny_llama, drafter, tmp_path_factory):
    from fixtures import build_random_drafter, build_tiny_model

    params = SamplingParams(max_tokens=30, ignore_eos=True)
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    _, overlap = spec_engines(tiny_llama, drafter, speculative_disable_batch_size=1)
    eng = overlap.engine
    seqs = [eng.add_request(None, params, prompt_token_ids=p) for p in PROMPTS]
    for _ in range(8):
        eng.step()
    assert eng.pipeline.inflight is not None, "a step was meant to be in flight"
    victim = seqs[1]
    kept = list(victim.output_token_ids)
    eng.abort(victim)
    while eng.has_unfinished():
        eng.step()
    assert victim.finish_reason == "abort" and victim.output_token_ids == kept == want[1][: len(kept)]
    assert [s.output_token_ids for i, s in enumerate(seqs) if i != 1] == [w for i, w in enumerate(want) if i != 1]
    assert eng.block_manager.num_used_blocks == 0
    # preemption under KV pressure
    _, tight = spec_engines(tiny_llama, drafter, speculative_min_acceptance_length=3, num_kv_blocks=14,
                            kv_block_size=8)
    assert [o.token_ids for o in tight.generate(PROMPTS, params)] == want
    assert tight.engine.stats["num_preemptions"] > 0 and tight.engine.stats["num_overlapped_steps"] > 0
    # a hybrid target: its recurrent state advances in the overlapped steps as in plain decoding's
    folder = build_tiny_model(tmp_path_factory.mktemp("qwen3.5-async"), "qwen3_5_text")
    hd = build_random_drafter(tmp_path_factory.mktemp("qwen3.5-async-draft"), folder, block_size=4)
    hplain = LLM(str(folder), draft=None, device="cpu", dtype="float32")
    _, hover = spec_engines(folder, hd, speculative_min_acceptance_length=3)
    hp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (30, 5, 24, 1)]
    assert outputs(hover, PROMPTS, hp) == outputs(hplain, PROMPTS, hp)
    assert hover.engine.stats["num_overlapped_steps"] > 0


def test_step_gate_under_kv_pressure_and_requests_joining(tiny_llama, drafter):
    """The step gate (at a break-even of 3, a random drafter) with async scheduling: preemption under
    KV pressure and requests joining while steps are in flight still give plain decoding's tokens."""
    from fixtures import step_gated

    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    want = [o.token_ids for o in plain.generate(PROMPTS, params)]
    _, tight = spec_engines(tiny_llama, drafter, num_kv_blocks=14, kv_block_size=8)
    step_gated(tight, 3.0)
    assert [o.token_ids for o in tight.generate(PROMPTS, params)] == want
    eng = tight.engine
    assert eng.stats["num_preemptions"] > 0 and eng.stats["num_overlapped_steps"] > 0
    assert eng.spec_totals()["gated_steps"] > 0
    assert joining_late(eng, params, 9) == want
    assert eng.block_manager.num_used_blocks == 0


def test_head_and_choice_run_in_inference_mode(pair, monkeypatch):
    """The plain step's head and sampler run in inference mode, as the target's forward does: with
    autograd on, the fused head and greedy kernels are skipped on CUDA (fused_enabled) for cuBLAS and
    torch's argmax."""
    import torch

    for llm in pair:
        model = llm.engine.runner.model
        seen = []
        real = model.compute_logits

        def logits(*a, seen=seen, real=real, **k):
            seen.append(torch.is_inference_mode_enabled())
            return real(*a, **k)

        monkeypatch.setattr(model, "compute_logits", logits)
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, ignore_eos=True))
        monkeypatch.undo()
        assert seen and all(seen)


def test_steps_launched_ahead_run_in_inference_mode(tiny_llama, drafter, monkeypatch):
    """A DFlash engine's steps launched ahead (the bench's plain arm: requests that do not speculate, and
    verifies paused by speculative_disable_batch_size) choose their tokens in inference mode too: one
    launched outside it ran its eager sampling with autograd on (80 us more a SmolLM2 step on an H200)."""
    import torch

    (overlap,) = spec_engines(tiny_llama, drafter)[1:]
    model = overlap.engine.runner.model
    seen, real = [], model.compute_logits
    monkeypatch.setattr(model, "compute_logits",
                        lambda *a, **k: seen.append(torch.is_inference_mode_enabled()) or real(*a, **k))
    overlap.generate(PROMPTS[:2], SamplingParams(max_tokens=12, ignore_eos=True, speculative=False))
    assert overlap.engine.stats["num_overlapped_steps"] > 5
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} heads ran with autograd on"


def test_admit_takes_whole_prompts_only():
    """Scheduler.admit (requests joining behind a step in flight): whole prompts, in order, each with
    `reserve` free slots past it, within the token budget and max_num_seqs; it stops at the first that
    does not fit whole (no chunk, no skipping ahead), where schedule() would admit a chunk of it."""
    from flashdraft.config import EngineConfig
    from flashdraft.engine.block_manager import BlockManager
    from flashdraft.engine.scheduler import Scheduler
    from flashdraft.engine.sequence import Sequence

    def fresh(lengths, blocks=6, budget=64, most=8):
        sched = Scheduler(EngineConfig(max_num_seqs=most, max_num_batched_tokens=budget), BlockManager(blocks, 8))
        seqs = [Sequence(list(range(1, n + 1)), SamplingParams()) for n in lengths]
        for s in seqs:
            sched.add(s)
        return sched, seqs

    sched, seqs = fresh([10, 20, 5])  # 6 pages of 8: 10 (+4) and 20 (+4) fit; 5 + 4 slots not in the page left
    out = sched.admit(reserve=4)
    assert out.seqs == seqs[:2] and out.num_new_tokens == [10, 20] and list(sched.waiting) == seqs[2:]
    assert sched.running == seqs[:2]
    sched, seqs = fresh([40, 3], budget=32)  # over the budget: not admitted, nor the one behind it
    assert not sched.admit().seqs and list(sched.waiting) == seqs
    assert sched.schedule().num_new_tokens == [32]  # the step-by-step scheduler takes a chunk
    sched, seqs = fresh([4, 4, 4], most=2)
    assert sched.admit().seqs == seqs[:2] and list(sched.waiting) == seqs[2:]


def test_processed_requests_decode_ahead_their_choice_deferred(pair):
    """Requests whose tokens come from processed logits (penalties, logit_bias, min_tokens, min_p) or
    that read their log-probabilities: the decode step after one in flight is launched before it is read,
    its choice made once that step is committed (engine/deferred.py), so the output counts the penalties
    read are current. Tokens, finish reasons and log-probabilities equal the step-by-step engine's."""
    sync, overlap = pair
    params = [SamplingParams(max_tokens=14, temperature=1.0, seed=3, presence_penalty=0.8, logprobs=2),
              SamplingParams(max_tokens=18, repetition_penalty=50.0, frequency_penalty=2.0, ignore_eos=True),
              SamplingParams(max_tokens=12, min_tokens=6, logit_bias={5: 3.0, 9: -2.0}, logprobs=0),
              SamplingParams(max_tokens=16, temperature=0.9, min_p=0.1, seed=4, ignore_eos=True, logprobs=1)]
    before = overlap.engine.stats["num_overlapped_steps"]
    got, want = overlap.generate(PROMPTS, params), sync.generate(PROMPTS, params)
    assert [(o.token_ids, o.finish_reason) for o in got] == [(o.token_ids, o.finish_reason) for o in want]
    for g, w in zip(got[::2], want[::2]):
        assert [lp.token_id for lp in g.logprobs] == [lp.token_id for lp in w.logprobs]
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-6)
    assert overlap.engine.stats["num_overlapped_steps"] - before > 10, "processed requests were meant to overlap"
    assert overlap.engine.block_manager.num_used_blocks == 0
