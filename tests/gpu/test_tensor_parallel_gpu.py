"""Tensor parallelism on two GPUs over NCCL (models/parallel.py): the fused layer path with each rank's
share of the layers gives the whole model's hidden states and logits (tests/test_tensor_parallel.py's
check, on CUDA)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)


@pytest.mark.parametrize("kind", ["llama", "qwen3", "qwen3_moe", "gpt_oss", "tied"])
def test_two_gpus_equal_the_unsplit_model(kind, tmp_path, tiny_llama, tiny_qwen3):
    """(the fused path's experts under the split too; tied: a tied vocabulary of 321 rows, shares padded)"""
    from fixtures import build_tiny_model
    from test_tensor_parallel import _worker, tcp_init

    if kind in ("qwen3_moe", "gpt_oss"):
        folder = build_tiny_model(tmp_path / "m", kind)
    elif kind == "tied":
        folder = build_tiny_model(tmp_path / "m", "qwen3", vocab_size=321, tie_word_embeddings=True)
    else:
        folder = {"llama": tiny_llama, "qwen3": tiny_qwen3}[kind]
    mp.spawn(_worker, args=(2, tcp_init(), str(folder), "nccl"), nprocs=2, join=True)


@pytest.mark.parametrize("draft", [False, True])
def test_engine_over_two_gpus_equals_one(tiny_llama, tmp_path, draft):
    """LLM(tensor_parallel_size=2) on two GPUs over NCCL (eager steps) gives one GPU's eager tokens, plain and
    DFlash, greedy and seeded, batched."""
    from fixtures import build_random_drafter
    from test_tensor_parallel import PARAMS, PROMPTS

    from flashdraft import LLM

    d = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)) if draft else None
    kw = dict(draft=d, device="cuda", dtype="float32", speculative_min_acceptance_length=None, enforce_eager=True)
    want = [o.token_ids for o in LLM(str(tiny_llama), **kw).generate(PROMPTS, PARAMS)]
    two = LLM(str(tiny_llama), tensor_parallel_size=2, **kw)
    try:
        assert [o.token_ids for o in two.generate(PROMPTS, PARAMS)] == want
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("draft,tree", [(False, None), (True, None), (True, 3)])
def test_graphs_over_two_gpus_equal_one(tiny_llama, tmp_path, draft, tree):
    """With CUDA graphs (the default): every rank captures its graphs (the other rank's follow rank 0's
    replays) and the tokens are one GPU's graphed tokens; plain, DFlash chains and trees (their accepted
    rows' K/V moved on both ranks), greedy and seeded, batched."""
    from fixtures import build_random_drafter
    from test_tensor_parallel import PARAMS, PROMPTS

    from flashdraft import LLM

    d = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)) if draft else None
    kw = dict(draft=d, device="cuda", dtype="float32", speculative_min_acceptance_length=None,
              speculative_tree_size=tree, max_num_seqs=4)  # (few graphs to capture)
    want = [o.token_ids for o in LLM(str(tiny_llama), **kw).generate(PROMPTS, PARAMS)]
    two = LLM(str(tiny_llama), tensor_parallel_size=2, **kw)
    try:
        runner = two.engine.runner
        # every kind runs the split target or its LM head (the drafts are chosen through it): all followed
        kinds = {key[0][0]: g.graph.follower is not None for key, g in runner.graphs.items() if g.captured}
        assert kinds and all(kinds.values()), kinds
        assert [o.token_ids for o in two.generate(PROMPTS, PARAMS)] == want
    finally:
        two.engine.shutdown()
