"""Tensor parallelism on two GPUs over NCCL (models/parallel.py): the fused layer path with each rank's
share of the layers gives the whole model's hidden states and logits (tests/test_tensor_parallel.py's
check, on CUDA)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.multiprocessing as mp

if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
    pytest.skip("needs two GPUs", allow_module_level=True)


def in_own_process(request) -> bool:
    """Run the calling test again in a pytest process of its own and return True (the caller then returns),
    unless this is that process: torch builds the one-shot all-reduce once per process, so a tensor-parallel
    engine after the first one in a process sums through NCCL alone (models/parallel.OneShotAllReduce)."""
    if os.environ.get("FLASHDRAFT_OWN_TEST") == request.node.nodeid:
        return False
    env = {**os.environ, "FLASHDRAFT_OWN_TEST": request.node.nodeid}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                          cwd=request.config.rootpath, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-3000:]
    return True


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


def _one_shot_worker(rank: int, size: int, init: str) -> None:
    import torch.distributed as dist

    from flashdraft.models.parallel import ONE_SHOT_MAX_BYTES, one_shot_or_none

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size)
    try:
        one_shot = one_shot_or_none(torch.device("cuda", rank), size)
        assert one_shot is not None
        for rows, dtype in [(1, torch.bfloat16), (32, torch.bfloat16), (7, torch.float32), (16, torch.float32)]:
            parts = [torch.randn(rows, 4096, generator=torch.Generator().manual_seed(r)).to(dtype)
                     for r in range(size)]
            got = one_shot(parts[rank].cuda())
            exact = torch.stack(parts).double().sum(0)  # the ranks' parts summed in float64
            tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
            torch.testing.assert_close(got.double().cpu(), exact, atol=tol * 4, rtol=tol)
            same = [torch.empty_like(got) for _ in range(size)]
            dist.all_gather(same, got)  # every rank holds the same sum, bit for bit
            assert all(torch.equal(same[0], t) for t in same)
        # inside a CUDA graph: replays sum what the input holds then
        x = torch.zeros(8, 4096, device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        one_shot(x)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out = one_shot(x)
        for k in range(3):
            x.fill_(rank + k)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.all(out == sum(r + k for r in range(size)))
        # larger than its buffer, or a dtype it does not sum: left to NCCL
        assert one_shot(torch.zeros(ONE_SHOT_MAX_BYTES // 2 + 8, device="cuda", dtype=torch.bfloat16)) is None
        assert one_shot(torch.zeros(64, device="cuda", dtype=torch.float16)) is None
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    os._exit(0)  # (as test_tensor_parallel's workers: a passed rank leaves without torch's teardown)


def test_one_shot_all_reduce_sums_like_float64():
    """models/parallel.OneShotAllReduce (symmetric memory) on two GPUs: the float64 sum of the ranks' parts,
    the same bits on both ranks, eager and in a CUDA graph; what it does not take, it declines."""
    from test_tensor_parallel import tcp_init

    mp.spawn(_one_shot_worker, args=(2, tcp_init()), nprocs=2, join=True)


@pytest.mark.parametrize("draft", [False, True])
def test_engine_over_two_gpus_equals_one(request, tiny_llama, tmp_path, draft):
    """LLM(tensor_parallel_size=2) on two GPUs (eager steps) gives one GPU's eager tokens, plain and DFlash,
    greedy and seeded, batched; the plain case sums through NCCL alone (disable_custom_all_reduce), the
    DFlash case through the one-shot all-reduce."""
    if in_own_process(request):
        return
    from fixtures import build_random_drafter
    from test_tensor_parallel import PARAMS, PROMPTS

    from flashdraft import LLM

    d = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)) if draft else None
    kw = dict(draft=d, device="cuda", dtype="float32", speculative_min_acceptance_length=None, enforce_eager=True)
    want = [o.token_ids for o in LLM(str(tiny_llama), **kw).generate(PROMPTS, PARAMS)]
    two = LLM(str(tiny_llama), tensor_parallel_size=2, disable_custom_all_reduce=not draft, **kw)
    try:
        assert (two.engine.ranks.tp.one_shot is not None) == draft
        assert [o.token_ids for o in two.generate(PROMPTS, PARAMS)] == want
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("draft,tree", [(False, None), (True, None), (True, 3)])
def test_graphs_over_two_gpus_equal_one(request, tiny_llama, tmp_path, draft, tree):
    """With CUDA graphs (the default): every rank captures its graphs (the other rank's follow rank 0's
    replays) and the tokens are one GPU's graphed tokens; plain, DFlash chains and trees (their accepted
    rows' K/V moved on both ranks), greedy and seeded, batched."""
    if in_own_process(request):
        return
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
        assert two.engine.ranks.tp.one_shot is not None  # (graphs hold the one-shot all-reduce's kernels)
        assert [o.token_ids for o in two.generate(PROMPTS, PARAMS)] == want
    finally:
        two.engine.shutdown()


@pytest.mark.parametrize("draft", [False, True])
def test_hybrid_over_two_gpus_equals_one(request, tmp_path, draft):
    """A hybrid target (Gated DeltaNet layers: each rank's heads, their recurrent states and the GDN kernels)
    with CUDA graphs on both ranks: one GPU's graphed tokens, plain and DFlash (each rank's verify graphs keep
    their rows; each rank's commit graph, fed rank 0's accepted counts, commits them), greedy and seeded."""
    if in_own_process(request):
        return
    from fixtures import build_random_drafter, build_tiny_model
    from test_tensor_parallel import PARAMS, PROMPTS

    from flashdraft import LLM

    folder = build_tiny_model(tmp_path / "t", "qwen3_5_text")
    d = str(build_random_drafter(tmp_path / "d", folder, block_size=4)) if draft else None
    kw = dict(draft=d, device="cuda", dtype="float32", speculative_min_acceptance_length=None, max_num_seqs=4)
    want = [o.token_ids for o in LLM(str(folder), **kw).generate(PROMPTS, PARAMS)]
    two = LLM(str(folder), tensor_parallel_size=2, **kw)
    try:
        assert two.engine.runner.use_graphs
        assert [o.token_ids for o in two.generate(PROMPTS, PARAMS)] == want
    finally:
        two.engine.shutdown()


def test_a_second_engine_in_a_process_sums_through_nccl(request, tiny_llama):
    """After a tensor-parallel engine with the one-shot all-reduce has shut down, a second one in the same
    process (whose default group takes the first one's name) sums through NCCL alone and gives one GPU's
    tokens; building the one-shot again there waited forever in torch's rendezvous."""
    if in_own_process(request):
        return
    from test_tensor_parallel import PARAMS, PROMPTS

    from flashdraft import LLM

    kw = dict(device="cuda", dtype="float32", enforce_eager=True)
    want = [o.token_ids for o in LLM(str(tiny_llama), **kw).generate(PROMPTS, PARAMS)]
    for first in (True, False):
        two = LLM(str(tiny_llama), tensor_parallel_size=2, **kw)
        try:
            assert (two.engine.ranks.tp.one_shot is not None) == first
            assert [o.token_ids for o in two.generate(PROMPTS, PARAMS)] == want
        finally:
            two.engine.shutdown()
