"""The step costs measured at start on CUDA (flashdraft/speculative/costs.py) and the acceptance gate
they set by default: a drafter whose drafts miss stops drafting, its steps overlapped as plain
decoding's are, with plain decoding's tokens."""

from __future__ import annotations

import pytest
import torch

if not torch.cuda.is_available():
    pytest.skip("step costs are measured over captured CUDA graphs", allow_module_level=True)


def totals_of_plain_tokens(llm, tiny_llama) -> dict:
    """Generate three prompts with llm, check its tokens are plain decoding's, return its speculative totals."""
    from flashdraft import LLM, SamplingParams

    plain = LLM(str(tiny_llama), draft=None, device="cuda", dtype="float32")
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in llm.generate(prompts, params)] == want
    return llm.engine.spec_totals()


def test_measured_costs_gate_a_random_drafter(tiny_llama, tmp_path, monkeypatch):
    from fixtures import build_random_drafter

    from flashdraft import LLM, settings

    monkeypatch.setattr(settings, "STEP_GATE", True)  # the default, off in tests
    draft = build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)
    llm = LLM(str(tiny_llama), draft=str(draft), device="cuda", dtype="float32", max_num_seqs=8)
    costs = llm.engine.spec.policy.costs
    assert costs is not None and costs.batches == (1, 2, 4, 8)
    assert all(p > 0 for p in costs.plain_ms) and all(s > 0 for s in costs.spec_ms)
    # a DFlash step drafts, verifies 4 rows a request and writes their context: dearer than a decode
    assert all(s > p for p, s in zip(costs.plain_ms, costs.spec_ms))
    assert llm.engine.spec.policy.min_tau_rule is None and llm.engine.spec.policy.step_gate is not None  # whole steps
    tot = totals_of_plain_tokens(llm, tiny_llama)
    assert tot["gated_steps"] > 0 and tot["num_drafts"] >= 4  # the warm-up verify steps, then none
    assert llm.engine.stats["num_overlapped_steps"] > 0  # paused steps launched ahead (async scheduling)

    monkeypatch.setattr(settings, "STEP_GATE", False)
    off = LLM(str(tiny_llama), draft=str(draft), device="cuda", dtype="float32", max_num_seqs=8)
    assert off.engine.spec.policy.costs is None and off.engine.spec.policy.step_gate is None


def test_measured_costs_gate_a_random_drafters_trees(tiny_llama, tmp_path, monkeypatch):
    """Token trees: each bucket's whole tree step graph is timed at start as well, so the gate decides
    from graph costs (a first step's stall is dropped, not taken as the bucket's cost), and a drafter
    whose trees miss stops drafting, with plain decoding's tokens."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, settings

    monkeypatch.setattr(settings, "STEP_GATE", True)
    draft = build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)
    llm = LLM(str(tiny_llama), draft=str(draft), device="cuda", dtype="float32", max_num_seqs=8,
              speculative_tree_size=6)
    sp = llm.engine.spec.policy
    assert llm.engine.spec.tree_size == 6 and sp.costs is not None and sp.costs.measured
    assert sp.costs.batches == (1, 2, 4, 8) and not sp.costs.fewer
    # a tree step drafts, verifies 7 rows a request, accepts and moves their K/V: dearer than a decode
    assert all(s > p > 0 for p, s in zip(sp.costs.plain_ms, sp.costs.spec_ms))
    tot = totals_of_plain_tokens(llm, tiny_llama)
    assert tot["gated_steps"] > 0 and tot["num_drafts"] >= 6
