"""The engine's CUDA-graph path (decode, verify and draft steps replayed from captured graphs over
static buffers, batches padded to power-of-two buckets) gives the tokens of the eager torch path.
On a GPU the graphs are real; under the Triton interpreter (TRITON_INTERPRET=1) the same static
buffers and padding run eagerly on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("needs CUDA or TRITON_INTERPRET=1", allow_module_level=True)

DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.mark.parametrize("with_drafter", [False, True])
def test_graphed_engine_matches_eager_torch(tiny_llama, tmp_path, with_drafter, monkeypatch):
    """Same tokens and, with a drafter, the same acceptance counts; and in every step the drafts the
    host reads back (to count acceptance) are the drafts the verify was fed: graphs share one memory
    pool, so a graph output read after a later replay can be overwritten."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams
    from flashdraft.spec.dflash import DFlashSpeculator

    fed, checked = {}, []
    real_input, real_tokens = DFlashSpeculator._verify_input, DFlashSpeculator._target_tokens

    def verify_input(self, plans, drafting):
        ids, tokens, draft_t = real_input(self, plans, drafting)
        fed["ids"] = ids.tolist()
        return ids, tokens, draft_t

    def target_tokens(self, plans, hidden, draft_t, drafting):
        out = real_tokens(self, plans, hidden, draft_t, drafting)
        for p in drafting:
            assert p.drafts == fed["ids"][p.row + 1: p.row + p.n]
            checked.append(len(p.drafts))
        return out

    monkeypatch.setattr(DFlashSpeculator, "_verify_input", verify_input)
    monkeypatch.setattr(DFlashSpeculator, "_target_tokens", target_tokens)

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)) if with_drafter else None
    # 3 then 2 then 1 running sequences (buckets 4, 2, 1, padded), prompts of different lengths
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 14, 20)]
    eager = LLM(str(tiny_llama), draft=draft, device=DEVICE, dtype="float32", attention_backend="torch",
                cuda_graphs=False, kv_block_size=8)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    graphed = LLM(str(tiny_llama), draft=draft, device=DEVICE, dtype="float32", attention_backend="triton",
                  kv_block_size=8)
    runner = graphed.engine.runner
    if not runner.use_graphs:  # on CUDA the engine captured at start; the interpreter replays eagerly
        runner.use_graphs = True
        runner.capture_graphs(("target", ()), 1, True, runner.attn, runner.target_step(()), 3)
        if with_drafter:
            sp = graphed.engine.spec
            runner.capture_graphs(("target", sp.tap_layers), sp.num_draft + 1, True, runner.attn,
                                  runner.target_step(sp.tap_layers), 3)
            runner.capture_graphs(("draft",), sp.block_size, False, sp.attn, sp._draft_step, 3)
    captured = set(runner.graphs)
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert set(runner.graphs) == captured  # every step shape was captured before serving
    assert got == want
    kinds = {key[0][0] for key in runner.graphs}
    assert kinds == ({"target", "draft"} if with_drafter else {"target"}), runner.graphs.keys()
    assert {key[1] for key in runner.graphs} >= {1, 2, 4}
    if with_drafter:
        assert graphed.engine.spec_totals()["num_drafts"] > 0 and checked
        assert graphed.engine.spec_totals() == eager.engine.spec_totals()


@pytest.mark.skipif(INTERPRET, reason="counts compiled kernels")
def test_serving_compiles_no_attention_kernel_after_start(tiny_llama, tmp_path):
    """Every attention, greedy-argmax and embedding variant a step can pick is compiled when the
    engine starts: prefill chunks of every length, mixed prefill + decode steps and batches of 1 to
    12 then launch no compile."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams
    from flashdraft.attention import triton_paged
    from flashdraft.models import fused

    def variants() -> int:
        return sum(len(c[0]) for fn in (triton_paged._attn_kernel, triton_paged._reduce_kernel,
                                        fused._argmax_part_kernel, fused._argmax_final_kernel, fused._embedding_kernel)
                   for c in fn.device_caches.values())

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    llm = LLM(str(tiny_llama), draft=draft, device="cuda", dtype="bfloat16", kv_block_size=16,
              max_num_batched_tokens=64)  # long prompts arrive in chunks, with short remainders
    before = variants()
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 9, 16, 17, 33, 64, 100, 150, 7, 250, 2)]
    for group in (prompts[:1], prompts[:3], prompts):
        llm.generate(group, SamplingParams(max_tokens=20, ignore_eos=True))
    assert variants() == before
