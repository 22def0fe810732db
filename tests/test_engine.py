"""Engine behaviour: continuous batching, chunked prefill, preemption, stops, the sampler."""

from __future__ import annotations

import pytest
import torch

from flashdraft import LLM, SamplingParams
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.sampler import SamplingBatch, filter_logits, gumbel_noise, sample

PROMPTS = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12]]


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")


def reference(folder, prompts, params, **cfg):
    llm = LLM(str(folder), draft=None, device="cpu", dtype="float32", **cfg)
    return [llm.generate([p], params)[0].token_ids for p in prompts]


def test_block_manager_append_truncate_free():
    bm = BlockManager(num_blocks=6, block_size=4)
    bm.allocate(1, 9)
    assert len(bm.table(1)) == 3 and bm.num_free_blocks == 3
    bm.allocate(1, 12)
    assert len(bm.table(1)) == 3
    bm.allocate(1, 13)
    assert len(bm.table(1)) == 4
    bm.truncate(1, 5)
    assert len(bm.table(1)) == 2 and bm.num_free_blocks == 4
    assert not bm.can_fit(2, 17) and bm.can_fit(2, 16)
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.allocate(2, 17)
    bm.free(1)
    assert bm.num_free_blocks == 6 and bm.table(1) == []


def test_chunked_prefill_matches_whole_prefill(tiny_llama):
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    long_prompt = [list(range(3, 200))]
    whole = reference(tiny_llama, long_prompt, params)
    chunked = reference(tiny_llama, long_prompt, params, max_num_batched_tokens=24)
    assert chunked == whole


def test_batch_equals_one_by_one_and_order(llama, tiny_llama):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    solo = reference(tiny_llama, PROMPTS, params)
    assert [o.token_ids for o in llama.generate(PROMPTS, params)] == solo


def test_new_requests_join_running_batch(llama, tiny_llama):
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    solo = reference(tiny_llama, PROMPTS, params)
    eng = llama.engine
    first = eng.add_request(None, params, prompt_token_ids=PROMPTS[0])
    for _ in range(5):
        eng.step()
    assert 0 < first.num_output_tokens < 20
    late = [eng.add_request(None, params, prompt_token_ids=p) for p in PROMPTS[1:]]
    eng.step()
    assert all(s.num_output_tokens == 1 for s in late) and first.num_output_tokens == 6  # one shared step
    while eng.has_unfinished():
        eng.step()
    assert [s.output_token_ids for s in [first, *late]] == solo


def test_preemption_under_tiny_kv_budget(tiny_llama):
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    ample = reference(tiny_llama, PROMPTS, params)
    tight = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", num_kv_blocks=12, kv_block_size=8)
    outs = tight.generate(PROMPTS, params)
    assert tight.engine.stats["num_preemptions"] > 0, "the budget was meant to force preemption"
    assert [o.token_ids for o in outs] == ample
    assert tight.engine.block_manager.num_used_blocks == 0


def test_preemption_real_model(smollm2):
    from flashdraft.engine.engine import LLMEngine

    prompts = [smollm2.engine.apply_chat_template([{"role": "user", "content": q}])
               for q in ("Name three colors.", "Count from one to ten.", "What is a cat?", "Say hello.")]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    ample = [o.token_ids for o in smollm2.generate(prompts, params)]
    cfg = smollm2.engine.config
    tight = LLMEngine(type(cfg)(**{**cfg.__dict__, "num_kv_blocks": 14, "kv_block_size": 16}))
    seqs = [tight.add_request(None, params, prompt_token_ids=p) for p in prompts]
    while tight.has_unfinished():
        tight.step()
    assert tight.stats["num_preemptions"] > 0
    assert [s.output_token_ids for s in seqs] == ample


def test_stop_token_ids_max_tokens_and_ignore_eos(llama):
    base = llama.generate([PROMPTS[2]], SamplingParams(max_tokens=20, ignore_eos=True))[0].token_ids
    stop_at = base[7]
    first = base.index(stop_at)
    out = llama.generate([PROMPTS[2]], SamplingParams(max_tokens=20, stop_token_ids=[stop_at], ignore_eos=True))[0]
    assert out.token_ids == base[: first + 1] and out.finish_reason == "stop"
    out = llama.generate([PROMPTS[2]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
    assert out.token_ids == base[:5] and out.finish_reason == "length"
    eos = llama.engine.eos_token_ids[0]
    forced = llama.generate([PROMPTS[2]], SamplingParams(max_tokens=6, stop_token_ids=[], ignore_eos=False))[0]
    assert eos not in forced.token_ids[:-1]


def test_stop_string_cuts_text(llama):
    out = llama.generate([PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True))[0]
    assert len(out.text) > 6
    needle = out.text[3:6]
    cut = llama.generate([PROMPTS[1]], SamplingParams(max_tokens=30, ignore_eos=True, stop=[needle]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == out.text[: out.text.find(needle)]
    assert out.token_ids[: len(cut.token_ids)] == cut.token_ids


def test_seeded_sampling_reproducible_and_batch_invariant(llama):
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=1234, ignore_eos=True)
    a = llama.generate([PROMPTS[0]], p)[0].token_ids
    b = llama.generate(PROMPTS, p)[0].token_ids
    c = llama.generate([PROMPTS[0]], SamplingParams(temperature=1.0, max_tokens=20, seed=99, ignore_eos=True))
    assert a == b and c[0].token_ids != a


def test_filter_logits_against_float64_reference():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    temp = torch.tensor([0.7, 1.0, 1.3, 2.0])
    top_k = torch.tensor([50, 5, 50, 10])
    top_p = torch.tensor([0.8, 1.0, 0.5, 0.9])
    got = filter_logits(logits, temp, top_k, top_p)
    for i in range(4):
        x = logits[i].double() / temp[i].item()
        order = x.argsort(descending=True)
        keep = torch.zeros(50, dtype=torch.bool)
        mass = 0.0
        probs = torch.where(torch.arange(50) < top_k[i], x[order], torch.tensor(float("-inf"))).softmax(0)
        for r, tok in enumerate(order.tolist()):
            if r >= top_k[i] or (r > 0 and mass >= top_p[i].item()):
                break
            keep[tok] = True
            mass += probs[r].item()
        assert torch.equal(torch.isfinite(got[i]), keep), i


def test_gumbel_sampling_matches_softmax():
    """Over many seeds the sampled token frequencies follow softmax(logits / T)."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 3.0]])
    n = 40000
    sb = SamplingBatch(temperature=torch.full((n,), 0.8), top_k=torch.full((n,), 6), top_p=torch.ones(n),
                       seeds=torch.arange(n), positions=torch.full((n,), 17), all_greedy=False)
    toks = sample(logits.expand(n, -1).contiguous(), sb)
    freq = torch.bincount(toks, minlength=6).double() / n
    exact = (logits[0].double() / 0.8).softmax(0)
    assert 0.5 * (freq - exact).abs().sum() < 0.01
    g = gumbel_noise(torch.tensor([5]), torch.tensor([3]), 1000)
    assert torch.isfinite(g).all() and torch.equal(g, gumbel_noise(torch.tensor([5]), torch.tensor([3]), 1000))


def test_gumbel_noise_is_the_documented_hash():
    """The noise is pinned to its definition, computed here with Python integers and float64: u from
    the lowbias32 hash of (seed, position, token id), -log(-log(u)). Seeds past 2**32, large positions,
    per-row token ids; any rewrite of the hash (it runs in place, in int64) must keep every bit."""
    import math

    m32 = 0xFFFFFFFF

    def mix(x):
        x ^= x >> 16
        x = x * 0x7FEB352D & m32
        x ^= x >> 15
        x = x * 0x846CA68B & m32
        return x ^ (x >> 16)

    def ref(seed, pos, tok):
        key = mix((seed & m32) ^ mix((seed >> 32) & m32 ^ 0x9E3779B9))
        key = mix(key ^ mix(pos & m32))
        u = ((mix(key ^ mix(tok * 0x9E3779B1 & m32)) >> 8) + 0.5) / (1 << 24)
        return -math.log(-math.log(u))

    seeds, positions = [0, 5, 2**32 + 7, 2**40 + 12345, 2**62 + 3], [0, 3, 4095, 70000, 2**31 + 1]
    vocab = 300
    g = gumbel_noise(torch.tensor(seeds), torch.tensor(positions), vocab)
    ids = torch.tensor([[(7 * r + 31 * j) % 49152 for j in range(vocab)] for r in range(len(seeds))])
    g_ids = gumbel_noise(torch.tensor(seeds), torch.tensor(positions), vocab, ids)
    for r, (s, p) in enumerate(zip(seeds, positions)):
        for j in range(vocab):
            for noise, tok in ((g, j), (g_ids, int(ids[r, j]))):
                want = ref(s, p, tok)
                assert math.isclose(float(noise[r, j]), want, rel_tol=1e-5, abs_tol=1e-5), (r, j, tok)
    assert torch.equal(g[:, 40:41], gumbel_noise(torch.tensor(seeds), torch.tensor(positions), 1,
                                                 torch.full((len(seeds), 1), 40)))
    # the token hash of a vocabulary is made once and kept: a second call draws the same noise
    assert torch.equal(g, gumbel_noise(torch.tensor(seeds), torch.tensor(positions), vocab))


def test_sampling_noise_in_row_chunks_draws_the_same_tokens(monkeypatch):
    """sample() makes its noise a few rows at a time (a bound on its memory): the tokens equal
    filtered logits + the whole batch's noise at once, greedy rows included."""
    from flashdraft.engine import sampler

    g = torch.Generator().manual_seed(0)
    n, vocab = 37, 50
    logits = torch.randn(n, vocab, generator=g) * 3
    temp = torch.rand(n, generator=g) + 0.2
    temp[::5] = 0.0
    sb = SamplingBatch(temperature=temp, top_k=torch.randint(1, vocab + 1, (n,), generator=g),
                       top_p=torch.rand(n, generator=g) * 0.5 + 0.5, seeds=torch.randint(0, 2 ** 40, (n,), generator=g),
                       positions=torch.randint(0, 4000, (n,), generator=g), all_greedy=False)
    whole = (filter_logits(logits, sb.temperature, sb.top_k, sb.top_p)
             + gumbel_noise(sb.seeds, sb.positions, vocab)).argmax(-1)
    want = torch.where(temp > 0, whole, logits.argmax(-1))
    monkeypatch.setattr(sampler, "NOISE_CHUNK", 4 * vocab)  # ten chunks, the last of one row
    got = sample(logits, sb)
    assert torch.equal(got, want)
    assert (got != logits.argmax(-1)).sum() > 5  # rows that sampled something else than the argmax


def test_sampling_reads_nothing_back_when_the_host_knows_the_filters(llama):
    """The engine's SamplingBatch says on the host whether any row filters by top-k / top-p, and
    sample() then never reads those tensors back (a read waits for the device: the step in flight
    would stop overlapping the next). Tensors on the meta device fail on any read."""
    from flashdraft.engine.sequence import Sequence

    vocab = llama.engine.runner.model.config.vocab_size
    seqs = [Sequence([5, 6], SamplingParams(temperature=0.7)), Sequence([7], SamplingParams(temperature=1.0)),
            Sequence([8], SamplingParams(temperature=0.5, top_k=5)), Sequence([9], SamplingParams(top_p=0.9))]
    flags = [(b.any_top_k, b.any_top_p) for b in (llama.engine.runner.sampling_batch(seqs[:n], [1] * n)
                                                    for n in (2, 3, 4))]
    assert flags == [(False, False), (True, False), (True, True)]
    n = 3
    logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(0))
    kw = dict(temperature=torch.tensor([0.7, 1.0, 0.0]), seeds=torch.arange(n), positions=torch.full((n,), 4),
              all_greedy=False)
    meta = SamplingBatch(top_k=torch.empty(n, device="meta"), top_p=torch.empty(n, device="meta"),
                         any_top_k=False, any_top_p=False, **kw)
    plain = SamplingBatch(top_k=torch.full((n,), vocab), top_p=torch.ones(n), **kw)
    assert torch.equal(sample(logits, meta), sample(logits, plain))


def test_greedy_tie_breaks_to_lowest_id():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0]])
    sb = SamplingBatch(torch.zeros(1), torch.tensor([4]), torch.ones(1), torch.zeros(1, dtype=torch.long),
                       torch.zeros(1, dtype=torch.long), True)
    assert sample(logits, sb).item() == 1


def test_greedy_on_model_dtype_logits_equals_float32():
    """All-greedy batches sample from bf16/fp16 logits without the float32 copy: the same token as
    the argmax of the exact float32 upcast, ties included (bf16 has many: 8 mantissa bits)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        logits = (torch.randn(64, 5000, generator=g) * 4).to(dtype)
        logits[:, 4000:] = logits[:, :1000]  # exact ties at higher ids
        sb = SamplingBatch(torch.zeros(64), torch.full((64,), 5000), torch.ones(64),
                           torch.zeros(64, dtype=torch.long), torch.zeros(64, dtype=torch.long), True)
        got = sample(logits, sb)
        assert torch.equal(got, sample(logits.float(), sb))
        assert torch.equal(got, logits.double().argmax(-1))


def test_drawn_drafts_are_the_targets_samples_for_the_same_logits(monkeypatch):
    """draw_drafts on the target's own logits picks the token sample() picks at the same (seed,
    position), greedy rows the argmax, in row chunks as one; on a drafter vocabulary that is a subset
    of the target's (columns standing for token_ids) it picks the same target token whenever the
    target's logits outside the subset are -inf."""
    from flashdraft.engine import sampler
    from flashdraft.engine.sampler import draw_drafts

    g = torch.Generator().manual_seed(1)
    n, vocab = 29, 60
    logits = torch.randn(n, vocab, generator=g) * 2
    temp = torch.rand(n, generator=g) + 0.3
    temp[::4] = 0.0
    seeds, positions = torch.randint(0, 2 ** 40, (n,), generator=g), torch.randint(0, 4000, (n,), generator=g)
    sb = SamplingBatch(temperature=temp, top_k=torch.full((n,), vocab), top_p=torch.ones(n), seeds=seeds,
                       positions=positions, all_greedy=False)
    want = sample(logits, sb)
    monkeypatch.setattr(sampler, "NOISE_CHUNK", 3 * vocab)
    assert torch.equal(draw_drafts(logits, temp, seeds, positions), want)
    assert (want != logits.argmax(-1)).sum() > 5
    sub = torch.randperm(vocab, generator=g)[:20].sort().values  # the drafter's 20 tokens
    masked = torch.full_like(logits, float("-inf"))
    masked[:, sub] = logits[:, sub]
    got = sub[draw_drafts(logits[:, sub], temp, seeds, positions, token_ids=sub)]
    assert torch.equal(got, sample(masked, sb))
    # among the drafter's 8 most likely tokens only: the target's sample whenever it is one of them
    monkeypatch.setattr(sampler, "DRAW_CANDIDATES", 8)
    few = draw_drafts(logits, temp, seeds, positions)
    inside = (logits.topk(8).indices == want[:, None]).any(1)
    assert torch.equal(few[inside], want[inside]) and 5 < inside.sum() < n
    assert (logits.topk(8).indices == few[:, None]).any(1).all()
