"""Processors and log-probabilities (engine/logits.py). Each processor against transformers' own (a float64
formula for frequency and presence, which transformers lacks); log-probabilities against transformers'
forward; and under speculation, plain decoding's tokens and log-probabilities: with oracle drafts every
draft is accepted only if each verify row applies the processors exactly as plain decoding does at its
position (the drafts before it on its path counted as output), chains and token trees, eager and graphed,
with async scheduling."""

from __future__ import annotations

import pytest
import torch
from fixtures import hf_model
from test_dflash import install_oracle

from flashdraft import LLM, SamplingParams
from flashdraft.engine.logits import process
from flashdraft.engine.sampler import filter_logits
from flashdraft.engine.sequence import Sequence

V = 320
PROMPTS = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12]]
# each changes greedy decoding of the tiny model (checked below), alone or together
PROCESSED = [dict(repetition_penalty=1.8), dict(frequency_penalty=1.3, presence_penalty=0.6),
             dict(presence_penalty=-1.5), dict(logit_bias={17: 6.0, 40: -100.0}),
             dict(repetition_penalty=0.7, frequency_penalty=-0.4, logit_bias={5: 3.0})]


def _seq(prompt: list[int], output: list[int], **params) -> Sequence:
    s = Sequence(prompt, SamplingParams(**params))
    s.token_ids += output
    return s


@pytest.mark.parametrize("params", [dict(repetition_penalty=1.7), dict(repetition_penalty=0.6),
                                    dict(logit_bias={3: 5.5, 9: -100.0, 11: 0.25}),
                                    dict(min_tokens=4, stop_token_ids=[7]), dict(min_tokens=3)])
def test_processors_match_transformers(params):
    from transformers.generation.logits_process import (
        MinNewTokensLengthLogitsProcessor,
        RepetitionPenaltyLogitsProcessor,
        SequenceBiasLogitsProcessor,
    )

    g = torch.Generator().manual_seed(0)
    prompt, output = [4, 9, 9, 31], [2, 7, 31, 12, 2]
    eos = [2]
    for n in range(len(output) + 1):  # every output length: min_tokens bars below its minimum only
        seq = _seq(prompt, output[:n], **params)
        logits = torch.randn(1, 40, generator=g) * 3
        got = process(logits.clone(), [seq], torch.tensor([seq.num_tokens]), eos)
        ids = torch.tensor([seq.token_ids])
        if "repetition_penalty" in params:
            want = RepetitionPenaltyLogitsProcessor(params["repetition_penalty"])(ids, logits.clone())
        elif "logit_bias" in params:
            want = SequenceBiasLogitsProcessor({(t,): b for t, b in params["logit_bias"].items()})(ids, logits.clone())
        else:
            stops = sorted(set(eos) | set(params.get("stop_token_ids", [])))
            want = MinNewTokensLengthLogitsProcessor(len(prompt), params["min_tokens"], stops)(ids, logits.clone())
        assert torch.equal(got, want), (params, n)


def test_frequency_and_presence_match_float64():
    """OpenAI's definition: logit - frequency x count - presence x [count > 0], over output tokens only."""
    g = torch.Generator().manual_seed(1)
    prompt, output = [4, 9, 9, 31], [2, 7, 31, 12, 2, 2, 5]
    seqs = [_seq(prompt, output[:n], frequency_penalty=f, presence_penalty=p)
            for n, f, p in ((0, 1.0, 1.0), (3, 0.5, -1.0), (7, -2.0, 2.0), (7, 0.0, 0.3))]
    logits = torch.randn(len(seqs), 40, generator=g)
    got = process(logits.clone(), seqs, torch.tensor([s.num_tokens for s in seqs]), [2])
    want = logits.double()
    for r, s in enumerate(seqs):
        for t in set(s.output_token_ids):
            c = s.output_token_ids.count(t)
            want[r, t] -= s.params.frequency_penalty * c + s.params.presence_penalty
    assert torch.allclose(got.double(), want, atol=1e-6)


def test_min_p_matches_transformers():
    from transformers.generation.logits_process import MinPLogitsWarper

    g = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=g) * 2
    temp, min_p = torch.tensor([1.0, 0.7, 1.3, 1.0]), torch.tensor([0.05, 0.2, 0.5, 0.0])
    got = filter_logits(logits, temp, torch.full((4,), 50), torch.ones(4), min_p=min_p)
    for r in range(4):
        scaled = logits[r: r + 1] / temp[r]
        want = MinPLogitsWarper(float(min_p[r]))(None, scaled.clone()) if min_p[r] > 0 else scaled
        assert torch.equal(got[r: r + 1].isinf(), want.isinf()), r
        keep = ~want.isinf()
        assert torch.allclose(got[r: r + 1][keep], want[keep])


def _same_logprobs(a, b, atol=1e-4):
    """Two runs' TokenLogprob lists agree: tokens and top ids exactly, values within atol."""
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is y
            continue
        assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
        assert abs(x.logprob - y.logprob) < atol and all(abs(u - v) < atol for (_, u), (_, v) in zip(x.top, y.top))


def test_processors_change_greedy_decoding(plain):
    """(so that the tests below, which compare with plain decoding, can fail)"""
    base = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))]
    for kw in PROCESSED:
        outs = plain.generate(PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True, **kw))
        assert sum(o.token_ids != b for o, b in zip(outs, base)) >= 2, kw


@pytest.mark.parametrize("kw", PROCESSED)
def test_oracle_verify_rows_process_as_plain_decoding(plain, spec, kw):
    """Oracle drafts of the processed greedy decoding: every draft of every block is accepted (tau = B),
    which needs each verify row to count the drafts before it as output, as plain decoding counted
    those tokens once committed; the tokens and log-probabilities are plain decoding's."""
    params = SamplingParams(max_tokens=30, ignore_eos=True, logprobs=3, **kw)
    ref = plain.generate(PROMPTS, SamplingParams(max_tokens=60, ignore_eos=True, logprobs=3, **kw))
    install_oracle(spec, {tuple(p): o.token_ids for p, o in zip(PROMPTS, ref)})
    try:
        outs = spec.generate(PROMPTS, params)
    finally:
        del spec.engine.spec.propose
    B = spec.engine.spec.block_size
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids[:30]
        _same_logprobs(o.logprobs, r.logprobs[:30])
        assert o.metrics["acceptance_length"] == B, o.metrics


def test_min_tokens_under_speculation(plain, spec):
    """A stop token barred until min_tokens, then allowed: the request ends where plain decoding's does."""
    first = plain.generate(PROMPTS, SamplingParams(max_tokens=1))
    for o, p in zip(first, PROMPTS):
        params = SamplingParams(max_tokens=40, stop_token_ids=[o.token_ids[0]], min_tokens=9)
        want = plain.generate([p], params)[0]
        got = spec.generate([p], params)[0]
        assert got.token_ids == want.token_ids and len(got.token_ids) >= 9
        assert o.token_ids[0] not in got.token_ids[:9]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_random_drafter_sampled_and_greedy(plain, spec, temperature):
    """A random drafter (most drafts rejected at different depths), a batch of processed and unprocessed
    requests, seeded sampling with min_p: plain decoding's tokens and log-probabilities."""
    params = [SamplingParams(max_tokens=20, ignore_eos=True, temperature=temperature, seed=i, logprobs=2,
                             min_p=0.05 * i, **kw) for i, kw in enumerate(PROCESSED[:3] + [{}])]
    for o, r in zip(spec.generate(PROMPTS, params), plain.generate(PROMPTS, params)):
        assert o.token_ids == r.token_ids
        _same_logprobs(o.logprobs, r.logprobs)


def test_logprobs_match_transformers(tiny_llama, plain, spec):
    """Generated and prompt tokens' log-probabilities (and the top 5) equal transformers' log-softmax of
    the same sequence, plain and speculative; the prompt's are computed whole, never read from the cache."""
    hf = hf_model(tiny_llama)
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5, prompt_logprobs=4)
    for llm in (plain, spec, spec):  # (the second speculative run's prompts are cached pages)
        for o in llm.generate(PROMPTS, params):
            ids = o.prompt_token_ids + o.token_ids
            with torch.no_grad():
                logp = hf(torch.tensor([ids])).logits[0].double().log_softmax(-1)
            assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(o.prompt_token_ids)
            entries = o.prompt_logprobs[1:] + o.logprobs
            assert len(entries) == len(ids) - 1 and o.metrics["num_cached_tokens"] == 0
            for i, e in enumerate(entries):
                assert e.token_id == ids[i + 1]
                assert abs(e.logprob - logp[i, ids[i + 1]].item()) < 1e-4
                top = logp[i].topk(len(e.top))
                assert [t for t, _ in e.top] == top.indices.tolist()
                assert max(abs(v - w) for (_, v), w in zip(e.top, top.values.tolist())) < 1e-4


def test_logprobs_survive_preemption(tiny_llama, drafter, spec):
    """Requests preempted for pages (and recomputed) keep one log-probability per token, as without."""
    tight = LLM(str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32", num_kv_blocks=14,
                kv_block_size=8)
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1, prompt_logprobs=1, repetition_penalty=1.3)
    got = tight.generate(PROMPTS, params)
    assert tight.engine.stats["num_preemptions"] > 0
    for o, r in zip(got, spec.generate(PROMPTS, params)):
        assert o.token_ids == r.token_ids
        _same_logprobs(o.logprobs, r.logprobs)
        _same_logprobs(o.prompt_logprobs, r.prompt_logprobs)


@pytest.mark.parametrize("tree", [None, 6])
def test_graphed_and_overlapped_steps(tiny_llama, drafter, plain, tree, monkeypatch):
    """Through the step graphs with async scheduling (processed requests leave the greedy post graph and
    are never launched behind an unread step), oracle drafts (trees: the right path behind a wrong
    sibling, so a row's ancestors are not all the rows before it): plain decoding's tokens and
    log-probabilities, every draft accepted, no step overlapped; unprocessed requests beside them change
    nothing."""
    from test_graphs import _graphed_llm
    from test_tree import use_oracle_graph_trees
    from test_verify_overlap import oracle

    prompts = PROMPTS[:3]
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2, **kw) for kw in PROCESSED[:3]]
    ref = plain.generate(prompts, [SamplingParams(max_tokens=60, ignore_eos=True, logprobs=2, **kw)
                                   for kw in PROCESSED[:3]])
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8,
              draft=str(drafter), speculative_tree_size=tree, async_scheduling=True)
    if tree:
        use_oracle_graph_trees(monkeypatch, prompts, ref)
    llm, replays = _graphed_llm(str(tiny_llama), kw)
    if not tree:
        futures = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
        sp = llm.engine.spec
        real = sp.graphs.whole_step

        def whole_step(plans, tokens, bm):
            sp._oracle_seqs = [p.seq for p in plans]
            return real(plans, tokens, bm)

        sp.graphs.whole_step = whole_step
        oracle(llm, futures)
    outs = llm.generate(prompts, params)
    for o, r in zip(outs, ref):
        assert o.token_ids == r.token_ids[:24]
        _same_logprobs(o.logprobs, r.logprobs[:24])
    assert replays["dflash-tree-sampled" if tree else "dflash"] > 0, replays
    depth = llm.engine.spec.max_accepted
    for o in outs:
        h = o.metrics["acceptance_histogram"]
        assert h[depth] >= o.metrics["num_drafts"] - 1, h
    assert llm.engine.stats["num_overlapped_steps"] == 0
    mixed = llm.generate(prompts + prompts, params + [SamplingParams(max_tokens=24, ignore_eos=True)] * 3)
    assert [o.token_ids for o in mixed[:3]] == [o.token_ids for o in outs]


def test_logit_bias_outside_the_vocabulary_is_refused(plain):
    """A bias for an id the model does not have would change nothing: refused by name, nothing queued."""
    with pytest.raises(ValueError, match="logit_bias token id 320 is outside the vocabulary"):
        plain.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(max_tokens=4),
                                                  SamplingParams(max_tokens=4, logit_bias={5: 1.0, 320: 2.0})])
    assert not plain.engine.has_unfinished()
    with pytest.raises(ValueError, match="logit_bias"):
        plain.engine.add_request(PROMPTS[0], SamplingParams(logit_bias={10**6: 1.0}))
