"""StepGraph with the static-shape torch backend equals the normal model-runner path (TorchAttention)
for decode, a verify block with taps and a non-causal draft block, with the batch padded to a
bucket larger than the real batch. On CPU the step runs eagerly over the graph's static buffers."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from fixtures import tiny_config

from flashdraft.attention.torch_ref import StaticTorchAttention, TorchAttention
from flashdraft.config import EngineConfig
from flashdraft.engine.block_manager import BlockManager
from flashdraft.engine.graphs import StepGraph
from flashdraft.engine.model_runner import ModelRunner
from flashdraft.engine.sequence import Sequence
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.models.transformer import DecoderLM
from flashdraft.sampling_params import SamplingParams
from flashdraft.speculative.formats import DraftSpec

BS, N_BLOCKS, BUCKET, MAX_BLOCKS = 4, 96, 4, 16


def _random_init(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.15) if p.dim() == 2 else p.uniform_(0.9, 1.1)


def _setup(device: str = "cpu"):
    model = DecoderLM(tiny_config("qwen3", 97))
    _random_init(model, 0)
    model.eval().requires_grad_(False).to(device)
    runner = ModelRunner(model, EngineConfig(kv_block_size=BS, attention_backend="torch"), torch.device(device),
                         torch.float32, N_BLOCKS, 64)
    bm = BlockManager(N_BLOCKS, BS)
    bm.allocate(10**6, 7)  # a foreign sequence first, so pages are not simply 0, 1, 2, ...
    g = torch.Generator().manual_seed(1)
    seqs = [Sequence(torch.randint(3, 97, (n,), generator=g).tolist(), SamplingParams()) for n in (5, 11, 23)]
    for s in seqs:
        bm.allocate(s.seq_id, len(s.token_ids) + 16)
    runner.forward(seqs, [s.token_ids for s in seqs], bm)  # prefill through the normal path
    for s in seqs:
        s.num_computed_tokens = len(s.token_ids)
    return model, runner, bm, seqs


def _graph_inputs(runner, seqs, tokens, bm, causal=True):
    ids, pos, batch = runner.build_batch(seqs, tokens, bm, causal)
    return batch, dict(input_ids=ids, positions=pos, slot_mapping=batch.slot_mapping, seq_lens=batch.seq_lens,
                       block_tables=batch.block_tables, query_start_loc=batch.query_start_loc)


def check_graph_matches_runner(attn, device: str = "cpu", tol: float = 1e-4) -> None:
    """Decode and a 16-row verify with taps through StepGraph(attn) against runner.forward
    (TorchAttention); each graph is captured once (a no-op on CPU) and run twice, with 3 then 2
    real sequences in a bucket of 4, so a refilled step must re-derive everything from the buffers."""
    model, runner, bm, seqs = _setup(device)
    taps = (0, 2)
    for q_len in (1, 16):
        graph = StepGraph(lambda g: model(g.input_ids, g.positions, runner.kv, attn, g.meta, taps),
                          num_seqs=BUCKET, q_len=q_len, max_blocks=MAX_BLOCKS, block_size=BS, device=device,
                          attn=[attn])
        for step, batch_seqs in enumerate((seqs, seqs[1:][::-1])):
            tokens = [[(7 * i + 3 * j + step) % 90 + 5 for j in range(q_len)] for i in range(len(batch_seqs))]
            k0, v0 = runner.k_cache.clone(), runner.v_cache.clone()
            want_h, want_t, _ = runner.forward(batch_seqs, tokens, bm, taps)
            want_k, want_v = runner.k_cache.clone(), runner.v_cache.clone()
            runner.k_cache.copy_(k0)
            runner.v_cache.copy_(v0)
            _, inputs = _graph_inputs(runner, batch_seqs, tokens, bm)
            graph.fill(**inputs)
            if step == 0:
                graph.capture()  # warm-up and capture store this step's K/V too: same slots, same values
            hidden, tapped = graph.replay()
            n = sum(map(len, tokens))
            assert hidden.shape[0] == BUCKET * q_len > n
            assert (hidden[:n] - want_h).abs().max() < tol
            assert (tapped[:n] - want_t).abs().max() < tol
            assert (runner.k_cache - want_k).abs().max() < tol and (runner.v_cache - want_v).abs().max() < tol
            runner.k_cache.copy_(k0)
            runner.v_cache.copy_(v0)


def test_step_graph_matches_model_runner():
    check_graph_matches_runner(StaticTorchAttention())


def test_step_graph_draft_block_matches_eager():
    model, runner, bm, seqs = _setup()
    B = 8
    layer = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, attention_bias=False,
                            rope_theta=10000.0, rope_scaling=None, rope_parameters=None, max_position_embeddings=512,
                            vocab_size=97, model_type="qwen3")
    drafter = DFlashDraftModel(DraftSpec(layer, B, 96, [0, 2], None, "z-lab"))
    _random_init(drafter, 2)
    drafter.eval().requires_grad_(False)
    drafter.setup(96)
    shape = (2, N_BLOCKS, BS, 2, 16)
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    kv = [(k_cache[i], v_cache[i]) for i in range(2)]
    blocks = [[s.token_ids[-1]] + [96] * (B - 1) for s in seqs]
    batch, inputs = _graph_inputs(runner, seqs, blocks, bm, causal=False)
    k0, v0 = k_cache.clone(), v_cache.clone()
    ref = TorchAttention()
    ref.prepare(batch, torch.device("cpu"))
    with torch.inference_mode():
        want = drafter(model.embed_tokens(inputs["input_ids"]), inputs["positions"], kv, ref, batch)
    k_cache.copy_(k0)
    v_cache.copy_(v0)
    attn = StaticTorchAttention()
    graph = StepGraph(lambda g: drafter(model.embed_tokens(g.input_ids), g.positions, kv, attn, g.meta),
                      num_seqs=BUCKET, q_len=B, max_blocks=MAX_BLOCKS, block_size=BS, device="cpu", causal=False,
                      attn=[attn])
    got = graph.capture().run(**inputs)
    assert (got[: len(seqs) * B] - want).abs().max() < 1e-4


def _graphed_llm(model: str, kw: dict, draft_counts: tuple[int, ...] | None = None):
    """An LLM whose steps go through the graph runner (CPU: eager replays of the static buffers,
    static torch attention), and a counter of replays per graph kind; draft_counts: the whole-step
    graphs' draft counts (on CUDA the engine's own choice, speculative/dflash.py)."""
    from flashdraft import LLM

    llm = LLM(model, **kw)
    runner, sp = llm.engine.runner, llm.engine.spec
    runner.attn = StaticTorchAttention()
    runner.use_graphs = True
    if sp is not None:
        from flashdraft.attention.base import LayerMasks

        ctx = sp.context
        masked = isinstance(ctx.attn, LayerMasks)
        ctx.attn = LayerMasks(StaticTorchAttention, ctx.attn.masks) if masked else StaticTorchAttention()
        sp.capture(draft_counts or sp.policy.choices)
        # an eager replay (CPU) installs metadata only into the backends a graph lists; the ragged
        # graphs' context write also stores through the drafter's static backend, whose store plan is
        # cached per slot tensor: install it too, as a real capture does (set_meta before capturing)
        for g in runner.ragged_graphs.values():
            g.attn.append(ctx.attn)
    else:
        cfg, step = llm.engine.config, runner.target_step(())
        runner.capture_graphs(("target", ()), 1, True, runner.attn, step, cfg.max_num_seqs)
        runner.capture_ragged_graphs(("target", ()), step, cfg.max_num_seqs, cfg.max_num_batched_tokens)
    replays = Counter()
    graphs = [(key[0][0], g) for key, g in runner.graphs.items()]
    graphs += [("ragged", g) for g in runner.ragged_graphs.values()]
    for key, g in graphs:
        def counted(key=key, replay=g.replay):
            replays[key] += 1
            return replay()
        g.replay = counted
    return llm, replays


@pytest.mark.parametrize("num_spec,pause", [(None, None), (2, None), (None, 3)])
def test_graphed_dflash_step_matches_eager_engine(tiny_llama, tmp_path, monkeypatch, num_spec, pause):
    """The engine's DFlash step as one graph (draft, drafts into the verify input, verify with
    taps, context write; on CPU replayed eagerly over the same static buffers) commits the tokens
    and acceptance counts of the eager step. Drafts come from an oracle that goes wrong at a
    different slot per request, so every acceptance length occurs; with 2 of 3 drafts verified
    the verify metadata is derived inside the graph; with pausing, steps without drafts replay
    the decode-plus-context graph."""
    from fixtures import build_random_drafter

    from flashdraft import LLM
    from flashdraft.speculative.dflash import DFlashSpeculator
    from flashdraft.speculative.drafts import DraftTokens

    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71)), [100, 3, 9, 200], [9, 8]]
    lens = [9, 30, 24, 17, 26]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lens]
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8)
    ref = LLM(str(tiny_llama), draft=None, **kw).generate(prompts, SamplingParams(max_tokens=40, ignore_eos=True))
    futures = {tuple(p): o.token_ids for p, o in zip(prompts, ref)}
    B = 4
    wrong_at = {tuple(p): i % B for i, p in enumerate(prompts)}
    current: list = []
    real_forward = DFlashSpeculator.forward

    def forward(self, plans):
        current[:] = [p.seq for p in plans if p.verify]
        return real_forward(self, plans)

    def oracle(self, hidden, num_seqs, draw=None, blocks=None):
        rows = []
        for s in current:
            prompt = tuple(s.token_ids[: s.num_prompt_tokens])
            k, j = s.num_output_tokens, wrong_at[prompt]
            d = (futures[prompt][k: k + B - 1] + [0] * B)[: B - 1]
            rows.append([t if i < j else (t + 1) % 300 + 3 for i, t in enumerate(d)])
        rows += [[0] * (B - 1)] * (num_seqs - len(rows))  # a graph bucket's padding sequences
        return torch.tensor(rows, dtype=torch.long, device=hidden.device)

    monkeypatch.setattr(DFlashSpeculator, "forward", forward)
    monkeypatch.setattr(DraftTokens, "tokens", oracle)
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=B))
    kw.update(draft=draft, num_speculative_tokens=num_spec, speculative_disable_batch_size=pause)
    eager = LLM(str(tiny_llama), **kw)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert want == [o.token_ids[:n] for o, n in zip(ref, lens)]

    graphed, replays = _graphed_llm(str(tiny_llama), kw)
    outs = graphed.generate(prompts, params)
    assert [o.token_ids for o in outs] == want
    assert graphed.engine.spec_totals() == eager.engine.spec_totals()
    assert replays["dflash"] > 0 and (pause is None or replays["decode"] > 0), replays
    assert replays["ragged"] > 0, replays  # the first step: three prefills of different lengths
    if pause is None:  # request i's drafts go wrong at slot i % B: it accepts exactly that many
        for p, o in zip(prompts, outs):
            h = o.metrics["acceptance_histogram"]
            j = min(wrong_at[tuple(p)], len(h) - 1)
            assert sum(h) == o.metrics["num_drafts"] > 0 and h[j] == sum(h), (j, h)


@pytest.mark.parametrize("num_spec,temps", [(None, (0, 0, 0)), (2, (0, 0, 0)), (None, (1.0, 0, 0.7))])
def test_graphed_dflash_step_drafts_like_eager(tiny_llama, tmp_path, monkeypatch, num_spec, temps):
    """With a real (random) drafter the graphed step feeds the verify the drafts of the eager
    step, step for step: the context K/V the graph writes is the context the eager step writes.
    With sampled requests among them the drafts come from the sampled draft graph (temperature and
    seed in its buffers) and still equal the eager drafts; the tokens equal plain decoding's."""
    from fixtures import build_random_drafter, record_fed_drafts

    from flashdraft import LLM

    fed = record_fed_drafts(monkeypatch)
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8,
              draft=draft, num_speculative_tokens=num_spec)
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=40 + i)
              for i, (n, t) in enumerate(zip((8, 20, 14), temps))]
    want = [o.token_ids for o in LLM(str(tiny_llama), **kw).generate(prompts, params)]
    want_fed, fed[:] = list(fed), []
    graphed, replays = _graphed_llm(str(tiny_llama), kw)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    sampled = any(temps)
    assert replays["dflash-sampled" if sampled else "dflash"] > 0, replays
    assert fed == want_fed
    if sampled:
        plain = LLM(str(tiny_llama), **{**kw, "draft": None, "num_speculative_tokens": None})
        assert [o.token_ids for o in plain.generate(prompts, params)] == want
        return
    # a lone prompt's prefill (one sequence, 12 rows) runs eagerly: graphs exist for the step
    # kinds captured at start only (decode, the DFlash block), never one per prompt length
    graphed.generate([[7] * 12], SamplingParams(max_tokens=3, ignore_eos=True))
    assert {key[2] for key in graphed.engine.runner.graphs} == {1, 4}


@pytest.mark.parametrize("with_drafter", [False, True, "sampled"])
def test_ragged_steps_replay_graphs_with_the_eager_tokens(tiny_llama, tmp_path, with_drafter, monkeypatch):
    """Steps that mix prefill chunks with decode (or verify) rows replay a graph of (rows,
    sequences) buckets, padding rows and sequences included, and give the eager engine's tokens;
    with a drafter, their draft blocks replay the draft-only graph (sampled requests: the sampled
    draft graph) and feed the eager drafts."""
    from fixtures import build_random_drafter, record_fed_drafts

    from flashdraft import LLM

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4)) if with_drafter else None
    # two running requests at a time, so later prompts are prefilled beside decoding ones; at most
    # 40 rows a step, so the 70-token prompt is prefilled in two chunks
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=2, kv_block_size=8,
              max_num_batched_tokens=40, draft=draft)
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 110)), [9, 8, 7], list(range(3, 33))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.9 if with_drafter == "sampled" else 0,
                             seed=n) for n in (9, 5, 7, 12, 6)]
    fed = record_fed_drafts(monkeypatch)
    want = [o.token_ids for o in LLM(str(tiny_llama), **kw).generate(prompts, params)]
    want_fed, fed[:] = list(fed), []
    graphed, replays = _graphed_llm(str(tiny_llama), kw)
    assert {key[1:] for key in graphed.engine.runner.ragged_graphs} == {(4, 32), (4, 64)}
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert replays["ragged"] >= 4, replays
    assert fed == want_fed
    assert (replays["draft"] > 0) == (with_drafter is True), replays
    assert (replays["draft-sampled"] > 0) == (with_drafter == "sampled"), replays


def test_tree_steps_beside_prefill_chunks_decode_through_ragged_graphs(tiny_llama, tmp_path, monkeypatch):
    """With token trees and graphs, a step that holds prefill chunks (a prompt longer than the step's
    rows, a request admitted beside running ones) has no tree graph: the running requests decode
    without drafts that step, through the ragged graph of decode rows beside prefill chunks, and
    verify trees again after it. The tokens are plain decoding's."""
    from fixtures import build_random_drafter

    from flashdraft import LLM
    from flashdraft.speculative.trees import TreeVerifier

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=2, kv_block_size=8,
              max_num_batched_tokens=40)
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 110)), [9, 8, 7], list(range(3, 33))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (9, 5, 7, 12, 6)]
    want = [o.token_ids for o in LLM(str(tiny_llama), draft=None, **kw).generate(prompts, params)]
    tree_steps = []
    real = TreeVerifier.step

    def recorded(self, plans, *args):
        tree_steps.append([(p.verify, p.seq.num_tokens - p.seq.num_computed_tokens) for p in plans])
        return real(self, plans, *args)

    monkeypatch.setattr(TreeVerifier, "step", recorded)
    graphed, replays = _graphed_llm(str(tiny_llama), dict(kw, draft=draft, speculative_tree_size=3))
    assert graphed.engine.spec.tree_size == 3
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert replays["ragged"] >= 4 and replays["dflash-tree"] > 0, replays
    assert tree_steps and all(v and left == 1 for step in tree_steps for v, left in step), tree_steps


def test_ragged_graph_placeholders_stay_inside_the_model(tiny_llama, tmp_path):
    """Ragged graphs are warmed up and captured over a placeholder step before serving. A bucket
    may hold more rows than one sequence can (256 rows against a 96-token model): the placeholder
    then spreads them over sequences of at most max_model_len rows, as a real step would, so the
    warm-up reads no RoPE row or block-table entry past its end (on a GPU such reads went unseen
    until the memory past a table was unmapped). On CPU an out-of-range row raises."""
    from fixtures import build_random_drafter

    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4))
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=4, kv_block_size=8,
              max_model_len=96, max_num_batched_tokens=256, draft=draft)
    llm, _ = _graphed_llm(str(tiny_llama), kw)
    runner = llm.engine.runner
    assert {key[2] for key in runner.ragged_graphs} == {32, 64, 128, 256}
    for (_, nseq, rows), g in runner.ragged_graphs.items():
        qsl = g.meta.query_start_loc.tolist()
        lens = (g.meta.seq_lens[: nseq]).tolist()
        per_seq = [b - a for a, b in zip(qsl, qsl[1:])]
        assert per_seq == lens and max(lens) <= 96 and sum(lens) == min(rows, nseq * 96)
        assert int(g.positions.max()) < 96 and bool((g.meta.slot_mapping == -1).all())
        g._install()
        hidden = g._call()
        assert hidden.shape[0] == rows and torch.isfinite(hidden[: sum(lens)]).all()


D2 = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 6}


@pytest.mark.parametrize("kind", ["dflash2", "sliding", "dflash2-sliding"])
@pytest.mark.parametrize("temps", [(0, 0, 0), (1.0, 0, 0.7)])
def test_graphed_steps_of_dflash2_and_masked_drafters(tiny_llama, tmp_path, monkeypatch, kind, temps):
    """DFlash2 drafters (convolutions, the candidate selector; sampled slots drawn with the target's noise)
    and drafters with causal sliding-window layers (a LayerMasks backend per mask) through the graphed
    step feed the eager step's drafts, step for step, and give plain decoding's tokens, greedy and seeded."""
    from fixtures import build_random_drafter, record_fed_drafts

    from flashdraft import LLM

    fed = record_fed_drafts(monkeypatch)
    extra = {}
    if "sliding" in kind:
        extra = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=5, use_sliding_window=True)
    draft = str(build_random_drafter(tmp_path / "d", tiny_llama, block_size=4, dflash2=D2 if "dflash2" in kind
                                     else None, **extra))
    kw = dict(device="cpu", dtype="float32", attention_backend="torch", max_num_seqs=8, kv_block_size=8, draft=draft)
    prompts = [[5, 17, 33, 80], [7] * 12, list(range(40, 71))]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=t, seed=40 + i)
              for i, (n, t) in enumerate(zip((8, 20, 14), temps))]
    eager = LLM(str(tiny_llama), **kw)
    want = [o.token_ids for o in eager.generate(prompts, params)]
    assert eager.engine.spec_totals()["num_drafts"] > 0
    want_fed, fed[:] = list(fed), []
    graphed, replays = _graphed_llm(str(tiny_llama), kw)
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert replays["dflash-sampled" if any(temps) else "dflash"] > 0, replays
    assert fed == want_fed
    plain = LLM(str(tiny_llama), **{**kw, "draft": None})
    assert [o.token_ids for o in plain.generate(prompts, params)] == want


def test_capture_holds_the_garbage_collector_off(monkeypatch):
    """No cyclic collection while a graph is captured (a finaliser's CUDA calls would invalidate the
    capture); the collector is back on after it, also when the captured code raises."""
    import contextlib
    import gc

    from flashdraft.engine import graphs

    seen = []

    @contextlib.contextmanager
    def recording(graph, pool=None):
        seen.append(gc.isenabled())
        yield

    monkeypatch.setattr(graphs.torch.cuda, "graph", recording)
    assert gc.isenabled()
    with graphs.capture(object()):
        seen.append(gc.isenabled())
    assert seen == [False, False] and gc.isenabled()
    with pytest.raises(RuntimeError), graphs.capture(object()):
        raise RuntimeError("in the capture")
    assert gc.isenabled()
