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


@pytest.mark.parametrize("with_drafter", [False, True, "sampled", "gated"])
def test_graphed_engine_matches_eager_torch(tiny_llama, tmp_path, with_drafter, monkeypatch):
    """Same tokens and, with a drafter, the same drafts fed to every verify and the same acceptance
    counts. With graphs the whole DFlash step is one replay; acceptance then reads the verify's
    static input buffer on the device, after the replay (graphs share one memory pool, so an
    intermediate result read after a later replay could have been overwritten)."""
    from fixtures import build_random_drafter, record_fed_drafts

    from flashdraft import LLM, SamplingParams

    fed = record_fed_drafts(monkeypatch)
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)) if with_drafter else None
    # 3 then 2 then 1 running sequences (buckets 4, 2, 1, padded), prompts of different lengths
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 14, 20)]
    if with_drafter == "sampled":  # two sampled requests: their drafts come from the sampled draft graph
        params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=5 + n)
                  for n, t in zip((6, 14, 20), (1.0, 0.0, 0.8))]
    gate = {"speculative_min_acceptance_length": None}
    if with_drafter == "gated":
        # the random drafter's tau (~1) is under 3: after 4 verifies a request decodes without drafts
        # for 16 tokens. A fourth prompt, prefilled over two steps of 64 rows, verifies one step behind
        # the others, so steps hold its block beside their single rows.
        prompts.append(list(range(200, 260)))
        params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (6, 14, 20, 24)]
        gate = {"speculative_min_acceptance_length": 3.0, "max_num_batched_tokens": 64}
    eager = LLM(str(tiny_llama), draft=draft, device=DEVICE, dtype="float32", attention_backend="torch",
                cuda_graphs=False, kv_block_size=8, async_scheduling=False, **gate)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    want_fed, fed[:] = list(fed), []
    # both step by step (fed drafts are recorded per step; overlapped steps: the next test)
    graphed = LLM(str(tiny_llama), draft=draft, device=DEVICE, dtype="float32", attention_backend="triton",
                  kv_block_size=8, async_scheduling=False, **gate)
    runner = graphed.engine.runner
    if not runner.use_graphs:  # on CUDA the engine captured at start; the interpreter replays eagerly
        runner.use_graphs = True
        runner.capture_graphs(("target", ()), 1, True, runner.attn, runner.target_step(()), 3)
        if with_drafter:
            graphed.engine.spec.capture_graphs()
    captured, ragged = set(runner.graphs), set(runner.ragged_graphs)
    assert INTERPRET or ragged  # on CUDA the prefill steps replay ragged graphs captured at start
    got = [o.token_ids for o in graphed.generate(prompts, params)]
    assert set(runner.graphs) == captured  # every step shape was captured before serving
    assert set(runner.ragged_graphs) == ragged
    assert got == want
    kinds = {key[0][0] for key in runner.graphs}
    spec_kinds = {"target", "dflash", "dflash-sampled", "decode", "draft", "draft-sampled"}
    assert kinds == (spec_kinds if with_drafter else {"target"}), runner.graphs.keys()
    assert {key[1] for key in runner.graphs} >= {1, 2, 4}
    if with_drafter:
        assert graphed.engine.spec_totals()["num_drafts"] > 0 and fed
        assert fed == want_fed
        assert graphed.engine.spec_totals() == eager.engine.spec_totals()
        assert (graphed.engine.spec_totals()["gated_steps"] > 0) == (with_drafter == "gated")


def overlap_on_and_off(target, draft: str, temps: tuple, **kw) -> tuple[list, list[int], list[list[int]]]:
    """The engine with async scheduling off and on over prompts whose requests are greedy or seeded
    (temps), one stopped mid-run by a token plain decoding gives: each run's (tokens, finish reason,
    acceptance histogram) per request and overlapped steps, and plain decoding's tokens."""
    from flashdraft import LLM, SamplingParams

    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12]]
    base = LLM(str(target), draft=None, device=DEVICE, dtype="float32", kv_block_size=8)
    stop = base.generate([prompts[2]], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids[9]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=n, stop_token_ids=s)
              for n, t, s in zip((6, 30, 25, 17), temps + (0.0,), ([], [], [stop], []))]
    outs, overlapped = [], []
    for a in (False, True):
        cfg = dict(draft=draft, device=DEVICE, dtype="float32", kv_block_size=8, async_scheduling=a,
                   speculative_min_acceptance_length=None, **kw)
        if INTERPRET:  # the CPU graph harness: eager replays of the static buffers through the kernels
            from test_graphs import _graphed_llm

            llm = _graphed_llm(str(target), {"attention_backend": "torch", "max_num_seqs": 8, **cfg})[0]
        else:
            llm = LLM(str(target), **cfg)
        outs.append([(o.token_ids, o.finish_reason, o.metrics["acceptance_histogram"])
                     for o in llm.generate(prompts, params)])
        overlapped.append(llm.engine.stats["num_overlapped_steps"])
        assert llm.engine.block_manager.num_used_blocks == 0
    return outs, overlapped, [o.token_ids for o in base.generate(prompts, params)]


@pytest.mark.skipif(INTERPRET, reason="real graphs; the CPU harness runs the same code (test_verify_overlap.py)")
@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0), (1.0, 0.0, 0.7)])
def test_overlapped_verify_matches_the_step_by_step_engine(tiny_llama, tmp_path, temps):
    """With async scheduling the graphed engine launches each verify before reading the last one, its
    inputs derived on the device (speculative/overlap.py): the same tokens, finish reasons and
    acceptance as the engine that reads every step first, greedy and seeded, stops included."""
    from fixtures import build_random_drafter

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    outs, overlapped, _ = overlap_on_and_off(tiny_llama, draft, temps, attention_backend="triton")
    assert outs[0] == outs[1]
    assert overlapped[0] == 0 and overlapped[1] > 10, overlapped


@pytest.mark.skipif(INTERPRET, reason="real graphs; the CPU harness runs the same code (test_verify_overlap.py)")
@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0), (1.0, 0.0, 0.7)])
def test_overlapped_verifies_with_requests_joining(tiny_llama, tmp_path, monkeypatch, temps):
    """Two requests at most: the other two join while a verify is in flight, their prompts prefilled
    through a ragged graph behind the next verify and their blocks written into the graph of the step
    after (engine/pipeline.py's join, StepGraphs.keep_rows): the same tokens, finish reasons and acceptance as
    the step-by-step engine, and plain decoding's tokens."""
    from fixtures import build_random_drafter

    from flashdraft.speculative.dflash import DFlashSpeculator

    real, joined = DFlashSpeculator.prefill, []

    def launch(self, batch):
        flight = real(self, batch)
        joined.append(len(flight.seqs))
        return flight

    monkeypatch.setattr(DFlashSpeculator, "prefill", launch)
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    outs, overlapped, plain = overlap_on_and_off(tiny_llama, draft, temps, attention_backend="triton", max_num_seqs=2)
    assert outs[0] == outs[1]
    assert [o[0] for o in outs[1]] == plain
    assert overlapped[0] == 0 and overlapped[1] > 10 and sum(joined) >= 1, (overlapped, joined)


@pytest.mark.parametrize("kind", ["dflash2", "sliding", "dflash2-sliding"])
@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0), (1.0, 0.0, 0.7)])
def test_graphed_dflash2_and_masked_drafters_match_eager_torch(tiny_llama, tmp_path, monkeypatch, kind, temps):
    """DFlash2 drafters (convolutions, candidate selector) and drafters with causal sliding-window layers
    (the Triton kernels' window, one backend per mask) through the captured graphs: the eager torch
    engine's drafts at every verify, its counts, and plain decoding's tokens (float32)."""
    from fixtures import build_random_drafter, record_fed_drafts

    from flashdraft import LLM, SamplingParams

    fed = record_fed_drafts(monkeypatch)
    extra = {}
    if "sliding" in kind:
        extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5, use_sliding_window=True)
    d2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4, dflash2=d2 if "dflash2" in kind
                                     else None, **extra))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=5 + n)
              for n, t in zip((6, 14, 20), temps)]
    kw = dict(device=DEVICE, dtype="float32", kv_block_size=8, speculative_min_acceptance_length=None,
              async_scheduling=False)  # fed drafts are recorded per step
    eager = LLM(str(tiny_llama), draft=draft, attention_backend="torch", cuda_graphs=False, **kw)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    want_fed, fed[:] = list(fed), []
    graphed = LLM(str(tiny_llama), draft=draft, attention_backend="triton", **kw)
    runner = graphed.engine.runner
    if not runner.use_graphs:
        runner.use_graphs = True
        graphed.engine.spec.capture_graphs()
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert fed == want_fed and graphed.engine.spec_totals() == eager.engine.spec_totals()
    plain = LLM(str(tiny_llama), draft=None, attention_backend="torch", cuda_graphs=False, **kw)
    assert [o.token_ids for o in plain.generate(prompts, params)] == want


@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0), (1.0, 0.0, 0.7)])
def test_graphed_tree_steps_match_eager_torch(tiny_llama, tmp_path, temps):
    """Token-tree steps replayed from their captured graphs (draft, trees, verify under tree masks,
    context write; the sampled variant with temperatures and seeds in its buffers) give the eager
    torch engine's tokens and counts, and plain decoding's tokens."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=5 + n)
              for n, t in zip((6, 14, 20), temps)]
    kw = dict(device=DEVICE, dtype="float32", kv_block_size=8, speculative_tree_size=6,
              speculative_min_acceptance_length=None)
    want = [o.token_ids for o in LLM(str(tiny_llama), draft=None, **kw).generate(prompts, params)]
    eager = LLM(str(tiny_llama), draft=draft, attention_backend="torch", cuda_graphs=False, **kw)
    assert [o.token_ids for o in eager.generate(prompts, params)] == want
    graphed = LLM(str(tiny_llama), draft=draft, attention_backend="triton", **kw)
    runner = graphed.engine.runner
    if not runner.use_graphs:  # the interpreter replays the same static buffers eagerly
        runner.use_graphs = True
        graphed.engine.spec.capture_graphs()
    replays = []
    for key, g in runner.graphs.items():
        def counted(key=key, replay=g.replay):
            replays.append(key[0][0])
            return replay()
        g.replay = counted
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert graphed.engine.spec_totals() == eager.engine.spec_totals()
    assert ("dflash-tree-sampled" if any(temps) else "dflash-tree") in replays, set(replays)
    if graphed.engine.async_scheduling:  # (CUDA) each tree step launched on the last one's outcome
        assert graphed.engine.stats["num_overlapped_steps"] > 0


@pytest.mark.skipif(INTERPRET, reason="counts compiled kernels")
def test_serving_compiles_no_kernel_after_start(tiny_llama, tmp_path):
    """Every Triton kernel variant a step can pick (attention, GEMMs, fused norms, stores, argmax,
    embedding, acceptance) is compiled when the engine starts (the eager draft of ragged steps
    included): prefill chunks of every length, mixed prefill + decode steps and batches of 1 to 12
    then launch no compile."""
    import triton
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams
    from flashdraft.kernels import attention, attention_splits, layer_ops, skinny_gemm

    kernels = {name: fn for mod in (attention, attention_splits, layer_ops, skinny_gemm)
               for name, fn in vars(mod).items() if isinstance(fn, triton.runtime.jit.JITFunction)}

    def variants() -> dict[str, int]:
        return {name: sum(len(c[0]) for c in fn.device_caches.values()) for name, fn in kernels.items()}

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    # long prompts arrive in chunks, with short remainders; at most 4 x 4 rows in a graph: the
    # eager MLP's kernel (the graphs' few-row GEMMs fuse it) is first launched by a prefill
    llm = LLM(str(tiny_llama), draft=draft, device="cuda", dtype="bfloat16", kv_block_size=16,
              max_num_batched_tokens=64, max_num_seqs=4)
    before = variants()
    prompts = [list(range(3, 3 + n)) for n in (1, 5, 9, 16, 17, 33, 64, 100, 150, 7, 250, 2)]
    for group in (prompts[:1], prompts[:3], prompts):
        llm.generate(group, SamplingParams(max_tokens=20, ignore_eos=True))
    after = variants()
    assert after == before, {k: (before[k], after[k]) for k in after if after[k] != before[k]}


def test_eager_steps_padded_to_few_row_counts_give_the_same_tokens(tiny_llama, tmp_path, monkeypatch):
    """Eager steps of more than PAD_ROWS rows run padded to a multiple of it (a GEMM's kernel is
    picked and loaded per row count): tokens, drafts and acceptance as unpadded, and the padding
    rows store nothing (the DFlash engine's poison check reads every cache slot it must not)."""
    from fixtures import build_random_drafter, poison_rejected

    from flashdraft import LLM, SamplingParams
    from flashdraft.engine.model_runner import PAD_ROWS, ModelRunner

    rows: list[int] = []
    real = ModelRunner.build_batch

    def build_batch(self, *args, **kw):
        out = real(self, *args, **kw)
        rows.append((out[0].shape[0], out[2].query_start_loc[-1]))
        return out

    monkeypatch.setattr(ModelRunner, "build_batch", build_batch)
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    prompts = [list(range(3, 3 + n)) for n in (40, 5, 70, 9, 33)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    got = {}
    for pad in (PAD_ROWS, 0):
        # without prefix caching: these prompts are prefixes of each other, and hits would shrink the steps
        llm = LLM(str(tiny_llama), draft=draft, device=DEVICE, dtype="float32", attention_backend="triton",
                  kv_block_size=8, max_num_batched_tokens=96, cuda_graphs=False, enable_prefix_caching=False)
        assert llm.engine.runner.pad_rows == PAD_ROWS
        llm.engine.runner.pad_rows = pad
        rows.clear()
        with poison_rejected(llm):
            got[pad] = ([o.token_ids for o in llm.generate(prompts, params)], llm.engine.spec_totals())
        padded = [(t, n) for t, n in rows if t != n]
        if pad:
            assert padded and all(t % PAD_ROWS == 0 and n < t < n + PAD_ROWS for t, n in padded)
            assert all(t == n for t, n in rows if n <= PAD_ROWS)
        else:
            assert not padded
    assert got[PAD_ROWS] == got[0]


def _triton_engine_matches_eager_torch(tmp_path, target, with_drafter: bool, prepare=None, **extra) -> None:
    """A target's tokens on the Triton backend and fused kernels (prepare(llm) first, when given) equal
    the eager torch engine's (float32), and with a drafter so do the acceptance counts. extra: more of
    both engines' settings."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams

    draft = str(build_random_drafter(tmp_path / "d", target, block_size=4)) if with_drafter else None
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    kw = dict(device=DEVICE, dtype="float32", kv_block_size=8, draft=draft, **extra)
    eager = LLM(str(target), attention_backend="torch", cuda_graphs=False, **kw)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    fast = LLM(str(target), attention_backend="triton", **kw)
    if prepare is not None:
        prepare(fast)
    assert [o.token_ids for o in fast.generate(prompts, params)] == want
    if with_drafter:
        assert fast.engine.spec_totals() == eager.engine.spec_totals()


@pytest.mark.parametrize("kind", ["sliding", "moe", "gpt_oss"])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_new_targets_through_graphs(tmp_path, with_drafter, kind):
    """A target whose upper layers slide (Qwen3 use_sliding_window: the Triton kernels' windows, one backend
    per mask in the runner), a Qwen3-MoE target (the grouped expert kernels) and a GPT-OSS target (sinks,
    alternating windows, the kernels' biases and clamped SwiGLU) through the decode, verify and ragged
    graphs: the eager torch engine's tokens (float32), and with a drafter the same again."""
    from fixtures import build_tiny_model

    if kind == "sliding":
        target = build_tiny_model(tmp_path / "t", "qwen3", use_sliding_window=True, sliding_window=6,
                                  max_window_layers=1)
    else:
        target = build_tiny_model(tmp_path / "t", "qwen3_moe" if kind == "moe" else "gpt_oss")

    _triton_engine_matches_eager_torch(tmp_path, target, with_drafter, _graphs_on)


@pytest.mark.parametrize("kind", ["moe", "gpt_oss"])
def test_fused_moe_layers_through_graphs(tmp_path, kind, monkeypatch):
    """The fused MoE layer (norm_router, routing in the gate_up kernel) through decode, verify and draft
    graphs with a drafter reading the layers' outputs, on the fused path under the interpreter too: the
    eager torch engine's tokens and acceptance (float32)."""
    from fixtures import build_tiny_model

    from flashdraft import settings
    from flashdraft.kernels import moe_routing

    routed, real = [], moe_routing.norm_router
    monkeypatch.setattr(moe_routing, "norm_router", lambda *a, **k: routed.append(1) or real(*a, **k))
    experts = {"num_experts": 64} if kind == "moe" else {"num_local_experts": 64}  # decode and verify rows direct
    target = build_tiny_model(tmp_path / "t", "qwen3_moe" if kind == "moe" else "gpt_oss", **experts)

    def prepare(llm):  # the fused layers switched on after the eager reference ran (CUDA-only by default)
        monkeypatch.setattr(settings, "FUSED", "on")
        _graphs_on(llm)

    _triton_engine_matches_eager_torch(tmp_path, target, True, prepare)
    assert routed


def _graphs_on(llm) -> None:
    """Graphs on (under the interpreter too: the static buffers and padding, run eagerly)."""
    runner = llm.engine.runner
    if not runner.use_graphs:
        runner.use_graphs = True
        if llm.engine.spec is not None:
            llm.engine.spec.capture_graphs()
        else:
            runner.capture_graphs(("target", ()), 1, True, runner.attn, runner.target_step(()), 3)


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_text"])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_hybrid_targets_on_the_gpu_path(tmp_path, with_drafter, kind):
    """Hybrid targets (Gated DeltaNet state, gated attention, shared-expert MoE) on the Triton attention
    backend, the GDN kernels and graphs (decode, and with a drafter the whole DFlash step with its kept
    rows committed after the graph)."""
    from fixtures import build_tiny_model

    _triton_engine_matches_eager_torch(tmp_path, build_tiny_model(tmp_path / "t", kind), with_drafter, _graphs_on)


@pytest.mark.skipif(INTERPRET, reason="the interpreter's float8 cast does not round to nearest (0.49 -> 0.25)")
@pytest.mark.parametrize("kind", ["llama-scaled", "qwen3_5_text"])
@pytest.mark.parametrize("with_drafter", [False, True])
def test_fp8_kv_pages_through_graphs(tmp_path, with_drafter, kind):
    """kv_cache_dtype fp8 on the GPU path (Triton attention reading FP8 pages, the fused stores writing them,
    graphs): the tokens of the eager torch engine over FP8 pages (itself checked against HF transformers over
    fake-quantized keys and values in tests/test_kv_fp8.py), with a checkpoint's k_scale / v_scale (llama)."""
    from fixtures import build_tiny_model
    from safetensors.torch import load_file, save_file

    target = build_tiny_model(tmp_path / "t", kind.removesuffix("-scaled"))
    if kind.endswith("-scaled"):
        weights = load_file(target / "model.safetensors")
        for i in range(3):
            weights[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(0.37 + i)
            weights[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(2.9 - i)
        save_file(weights, target / "model.safetensors")
    _triton_engine_matches_eager_torch(tmp_path, target, with_drafter, _graphs_on, kv_cache_dtype="fp8")


@pytest.mark.skipif(DEVICE != "cuda", reason="fla-core's kernels need a GPU")
def test_hybrid_prefill_by_the_chunked_kernel(tmp_path, monkeypatch):
    """Prefill chunks of 8 rows or more through fla-core's chunked kernel (the prompts of 12 and 31 tokens),
    beside decode and verify rows: the eager torch engine's tokens and acceptance counts (float32)."""
    from fixtures import build_tiny_model

    from flashdraft.kernels import gdn_ops

    if not gdn_ops.chunked_available(torch.device(DEVICE)):
        pytest.skip("fla-core is not installed")
    monkeypatch.setattr(gdn_ops, "CHUNKED_MIN_ROWS", 8)
    calls = []
    real = gdn_ops.chunked
    monkeypatch.setattr(gdn_ops, "chunked", lambda *a, **k: calls.append(a[6]) or real(*a, **k))
    _triton_engine_matches_eager_torch(tmp_path, build_tiny_model(tmp_path / "t", "qwen3_5_text"), True, _graphs_on)
    assert any(31 in spans.cu_cpu.diff().tolist() for spans in calls)


@pytest.mark.parametrize("kind", ["llama", "qwen3_5_text", "gpt_oss"])
def test_async_scheduling_through_graphs(tmp_path, kind):
    """Decode steps launched before the last one's samples are read (their input ids copied on the
    device into the graph's buffer) give the step-by-step engine's tokens and finish reasons: greedy and
    sampled, different lengths, a stop token met mid-run, batch buckets shrinking as requests end."""
    from fixtures import build_tiny_model

    from flashdraft import LLM, SamplingParams

    target = build_tiny_model(tmp_path / "t", kind)
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [9, 8, 7]]
    kw = dict(device=DEVICE, dtype="float32", kv_block_size=8, draft=None, attention_backend="triton")
    sync, overlap = (LLM(str(target), async_scheduling=a, **kw) for a in (False, True))
    for llm in (sync, overlap):
        _graphs_on(llm)
    base = sync.generate([prompts[2]], SamplingParams(max_tokens=16, ignore_eos=True))[0].token_ids
    params = [SamplingParams(max_tokens=6, ignore_eos=True),
              SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0, seed=3),
              SamplingParams(max_tokens=16, ignore_eos=True, stop_token_ids=[base[5]]),
              SamplingParams(max_tokens=20, ignore_eos=True, temperature=0.7, top_p=0.9, seed=4)]
    want = [(o.token_ids, o.finish_reason) for o in sync.generate(prompts, params)]
    got = [(o.token_ids, o.finish_reason) for o in overlap.generate(prompts, params)]
    assert got == want and want[2] == (base[: base.index(base[5]) + 1], "stop")
    assert overlap.engine.stats["num_overlapped_steps"] > 10 and sync.engine.stats["num_overlapped_steps"] == 0
    assert overlap.engine.block_manager.num_used_blocks == 0


@pytest.mark.skipif(INTERPRET, reason="real graphs; the CPU harness runs the same code (test_draft_counts.py)")
def test_steps_of_fewer_drafts_through_their_own_graphs(tiny_llama, tmp_path, monkeypatch):
    """On CUDA with the step gate, whole steps verifying 7 and 3 drafts of a block of 8 are captured
    and timed at start (speculative/costs.py StepCosts.fewer). Steps switching between the counts,
    overlapped and step by step, give plain decoding's tokens (float32)."""

    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams, settings

    monkeypatch.setattr(settings, "STEP_GATE", True)
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=8))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200, 150, 11, 12]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = [o.token_ids for o in LLM(str(tiny_llama), draft=None, device=DEVICE, dtype="float32",
                                      kv_block_size=8).generate(prompts, params)]
    for a in (False, True):
        llm = LLM(str(tiny_llama), draft=draft, device=DEVICE, dtype="float32", attention_backend="triton",
                  kv_block_size=8, async_scheduling=a)
        sp = llm.engine.spec.policy
        assert sp.choices == (7, 3) and sp.profile is not None
        assert all(ms > 0 for ms in sp.costs.fewer[3]) and len(sp.costs.fewer[3]) == len(sp.costs.batches)
        graphs = llm.engine.runner.graphs.items()
        assert any(key == ("dflash", llm.engine.spec.tap_layers, 3) and g.captured for (key, _, _), g in graphs)
        sp.step_gate = None  # every step verifies, at the counts below
        sp._verify_count = lambda sp=sp: 7 if sp.steps // 4 % 2 else 3  # runs of 4 steps a count
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        t = llm.engine.spec_totals()
        assert 3 * t["num_drafts"] < t["num_draft_tokens"] < 7 * t["num_drafts"]
        assert (llm.engine.stats["num_overlapped_steps"] > 5) == a
        assert llm.engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize("temps", [(0.0, 0.0, 0.0), (1.0, 0.0, 0.7)])
def test_overlapped_verify_of_a_hybrid_target(tmp_path, monkeypatch, temps):
    """A hybrid target's verify stays in flight too: the next one is launched right after the in-flight
    one's accepted rows are committed into the recurrent state from the device (its commit graph fed the
    accepted counts on the device, ModelRunner.commit_states_from), also once requests have finished:
    the kept requests' blocks move to the graph for fewer requests with their state slots
    (ModelRunner.verify_rows), and those that left commit nothing into their freed slots. The same
    tokens, finish reasons and acceptance as the step-by-step engine, and plain decoding's tokens
    (float32), stops included."""
    from fixtures import build_random_drafter, build_tiny_model

    from flashdraft.engine.model_runner import ModelRunner

    folder = build_tiny_model(tmp_path / "t", "qwen3_5_text")
    draft = str(build_random_drafter(tmp_path / "d", folder, block_size=4))
    moved = []
    real = ModelRunner.verify_rows
    monkeypatch.setattr(ModelRunner, "verify_rows", lambda self, g, seqs, bm: moved.append(len(seqs))
                        or real(self, g, seqs, bm))
    outs, overlapped, want = overlap_on_and_off(folder, draft, temps)
    assert outs[0] == outs[1] and [o[0] for o in outs[1]] == want
    assert overlapped[0] == 0 and overlapped[1] > 10, overlapped
    assert moved and min(moved) < 4, moved  # launched ahead for fewer requests than the step before


@pytest.mark.parametrize("tree", [None, 6])
def test_processors_and_logprobs_through_graphs(tiny_llama, tmp_path, tree):
    """Requests with penalties, logit_bias, min_p and log-probabilities beside plain ones, through the
    captured step graphs (with async scheduling on CUDA): plain decoding's tokens and log-probabilities
    (eager torch, no drafter), greedy and seeded, chains and token trees."""
    from fixtures import build_random_drafter

    from flashdraft import LLM, SamplingParams

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [9, 8, 7]]
    params = [SamplingParams(max_tokens=18, ignore_eos=True, repetition_penalty=1.8, logprobs=3),
              SamplingParams(max_tokens=22, ignore_eos=True, temperature=1.0, seed=3, frequency_penalty=1.0,
                             min_p=0.05, logprobs=0),
              SamplingParams(max_tokens=16, ignore_eos=True),
              SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={17: 5.0}, presence_penalty=-1.0,
                             prompt_logprobs=2)]
    plain = LLM(str(tiny_llama), draft=None, device=DEVICE, dtype="float32", attention_backend="torch",
                cuda_graphs=False, async_scheduling=False, kv_block_size=8)
    want = plain.generate(prompts, params)
    graphed = LLM(str(tiny_llama), draft=draft, device=DEVICE, dtype="float32", attention_backend="triton",
                  kv_block_size=8, speculative_tree_size=tree, speculative_min_acceptance_length=None)
    runner = graphed.engine.runner
    if not runner.use_graphs:  # the interpreter replays the same static buffers eagerly
        runner.use_graphs = True
        graphed.engine.spec.capture_graphs()
    got = graphed.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert graphed.engine.spec_totals()["num_drafts"] > 0
    for o, w in zip(got, want):
        for a, b in ((o.logprobs or [], w.logprobs or []), ((o.prompt_logprobs or [None])[1:],
                                                             (w.prompt_logprobs or [None])[1:])):
            assert [e.token_id for e in a] == [e.token_id for e in b]
            assert all(abs(x.logprob - y.logprob) < 1e-3 and [t for t, _ in x.top] == [t for t, _ in y.top]
                       for x, y in zip(a, b))
