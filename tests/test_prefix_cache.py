"""Prefix caching: full KV pages shared between requests by a hash chain of their tokens, reference counted,
evicted least recently used; a cached prefix gives the target and the drafter exactly the context they would
have computed. The multi-turn test runs SmolLM2 with the shipped drafter (CPU, float32, the CPU default
token tree): turn 2 hits the cache and gives the tokens and the tau of the same turn without it."""

from __future__ import annotations

import pytest
import torch

from flashdraft.config import EngineConfig
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.engine import LLMEngine
from flashdraft.sampling_params import SamplingParams


def test_register_match_share_and_evict():
    bm = BlockManager(num_blocks=6, block_size=4, prefix_caching=True)
    a = list(range(100, 111))  # 11 tokens: two full blocks and three more
    bm.allocate(1, len(a))
    bm.register(1, a, num_computed=11)
    assert len(bm.cached) == 2
    b = a[:8] + [7, 7, 7]  # same two first blocks
    assert bm.match(2, b) == 8 and bm.table(2) == bm.table(1)[:2]
    assert [bm.refs[p] for p in bm.table(1)[:2]] == [2, 2]
    bm.free(1)  # the shared pages stay with 2; 1's third page is free again
    assert bm.num_free_blocks == 4 and not bm.evictable
    bm.free(2)  # now nobody holds them: cached, evictable, counted free
    assert bm.num_free_blocks == 6 and list(bm.evictable) == bm_pages(bm)
    assert bm.match(3, a[:8]) == 4  # the last token is always computed: one block of 8 tokens' two
    assert bm.match(4, [1, 2, 3, 4, 5]) == 0 and bm.num_hit_tokens == 12
    bm.free(3)
    bm.allocate(5, 6 * 4)  # every page: the cached ones are evicted, least recently used first
    assert not bm.cached and not bm.evictable and bm.num_free_blocks == 0


def bm_pages(bm: BlockManager) -> list[int]:
    return sorted(bm.page_hash, key=list(bm.evictable).index)


def test_hybrid_slots_and_reset_turn_it_off():
    assert not BlockManager(4, 4, num_state_slots=2, prefix_caching=True).prefix_caching
    bm = BlockManager(4, 4, prefix_caching=True)
    bm.allocate(1, 8)
    bm.register(1, list(range(8)), 8)
    bm.free(1)
    bm.reset_prefix_cache()
    assert bm.match(2, list(range(9))) == 0 and bm.num_free_blocks == 4


CHAT = [{"role": "user", "content": "Write a Python function that returns the squares of a list of numbers."}]
FOLLOW_UP = {"role": "user", "content": "Now make it return only the even squares."}


def run(engine: LLMEngine, ids: list[int], tokens: int = 48):
    seq = engine.add_request(None, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True),
                             prompt_token_ids=ids)
    while not seq.is_finished:
        engine.step()
    return seq, engine.output(seq)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32"))


def test_second_turn_hits_the_cache_with_the_same_tokens_and_tau(engine):
    first, out1 = run(engine, engine.apply_chat_template(CHAT))
    turn2 = engine.apply_chat_template(CHAT + [{"role": "assistant", "content": out1.text}, FOLLOW_UP])
    engine.reset_prefix_cache()
    _, cold = run(engine, turn2)  # the reference: nothing cached
    engine.reset_prefix_cache()
    run(engine, engine.apply_chat_template(CHAT))  # turn 1 again fills the cache
    hot_seq, hot = run(engine, turn2)
    assert cold.metrics["num_cached_tokens"] == 0
    cached = hot.metrics["num_cached_tokens"]
    assert cached >= len(engine.apply_chat_template(CHAT)) // 16 * 16 > 0, cached
    assert hot.token_ids == cold.token_ids
    assert hot.metrics["acceptance_length"] == cold.metrics["acceptance_length"] > 1.5
    assert hot.metrics["num_drafts"] == cold.metrics["num_drafts"]


def test_drafter_context_of_cached_pages_is_what_it_would_compute(engine):
    """The drafter's context K/V in a cached page equal the ones a cold prefill writes; and a wiped cached
    context changes the drafts (the check above would see stale context)."""
    ids = engine.apply_chat_template(CHAT)
    spec, B = engine.spec, engine.block_manager.block_size
    engine.reset_prefix_cache()
    run(engine, ids, 4)
    full = len(ids) // B  # the prompt's full blocks (registered in order)
    pages = list(engine.block_manager.cached.values())[:full]
    hot_k = torch.stack([spec.context.k_cache[:, p].clone() for p in pages])
    engine.reset_prefix_cache()
    # the same prompt prefilled cold into other pages (the cached ones are forgotten, not reused: pages are
    # handed out first-in first-out)
    seq2 = engine.add_request(None, SamplingParams(temperature=0.0, max_tokens=1), prompt_token_ids=ids)
    while not seq2.is_finished:
        engine.step()
    cold_pages = list(engine.block_manager.cached.values())[:full]
    cold_k = torch.stack([spec.context.k_cache[:, p] for p in cold_pages])
    assert len(cold_pages) == full > 0 and not set(cold_pages) & set(pages)
    torch.testing.assert_close(hot_k, cold_k, rtol=1e-5, atol=1e-5)

    _, clean = run(engine, ids + [1, 2, 3], 24)
    for p in engine.block_manager.cached.values():
        spec.context.k_cache[:, p] = 0
        spec.context.v_cache[:, p] = 0
    _, wiped = run(engine, ids + [1, 2, 3], 24)
    assert wiped.metrics["num_cached_tokens"] > 0
    assert wiped.token_ids == clean.token_ids  # the target's K/V are intact: plain decoding's tokens
    assert wiped.metrics["acceptance_length"] != clean.metrics["acceptance_length"]


def test_switched_by_flag_and_config(tiny_llama):
    from flashdraft import LLM
    from flashdraft.cli import build_parser, serve_engine_kwargs

    def parsed(*flags):
        return EngineConfig.from_kwargs(**serve_engine_kwargs(build_parser().parse_args(["serve", *flags])))

    assert parsed().enable_prefix_caching is None
    assert parsed("--enable-prefix-caching").enable_prefix_caching is True
    assert parsed("--no-enable-prefix-caching").enable_prefix_caching is False
    off = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32", enable_prefix_caching=False)
    prompt = list(range(3, 40))
    off.generate([prompt, prompt])
    assert not off.engine.block_manager.prefix_caching and off.engine.block_manager.num_hit_tokens == 0
    on = LLM(str(tiny_llama), draft=None, device="cpu", dtype="float32")
    first = on.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))[0]
    second = on.generate(prompt, SamplingParams(temperature=0.0, max_tokens=4))[0]
    assert second.metrics["num_cached_tokens"] == 32 and second.token_ids == first.token_ids
    on.reset_prefix_cache()
    assert on.generate(prompt, SamplingParams(max_tokens=1))[0].metrics["num_cached_tokens"] == 0
