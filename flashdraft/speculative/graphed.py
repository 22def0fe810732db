"""The DFlash step as CUDA graphs (a mixin of DFlashSpeculator).

At start, every kernel variant an eager step can meet is compiled and, per batch bucket, captured as
graphs: the whole step (draft, drafts into the verify input, verify, context write) when every request
verifies, the decode step that still writes the context (paused speculation, requests near
max_model_len), the draft blocks alone for ragged steps (prefill chunks beside verify blocks), and the
target with the context write over (sequences, rows) buckets. Nothing compiles or captures mid-serving.
A step the graphs do not cover runs the same functions eagerly (speculative/dflash.py). On a CPU the
"graphs" run eagerly over the same static buffers, so all of this is tested without a GPU.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING

import torch

from flashdraft.engine.graphs import Graph, StepGraph, capture
from flashdraft.engine.model_runner import WARM_ROWS
from flashdraft.engine.sampler import greedy_tokens
from flashdraft.engine.sequence import Sequence
from flashdraft.models.transformer import fused_enabled
from flashdraft.speculative.verify import accepted_lengths

if TYPE_CHECKING:
    from flashdraft.speculative.plan import Plan


class GraphedSteps:
    def _compile_and_capture(self) -> None:
        """Compile every kernel variant eager steps use, then capture the step's graphs."""
        engine, runner, c = self.engine, self.engine.runner, self.drafter.config
        if runner.backend_name == "triton" and engine.device.type == "cuda":  # ragged steps draft eagerly
            from flashdraft.attention.triton_paged import compile_variants

            for causal, window in dict.fromkeys(self.drafter.spec.layer_masks or [(False, None)]):
                compile_variants(c.num_attention_heads, c.num_key_value_heads, self.drafter.head_dim,
                                 runner.block_size, engine.dtype, engine.device, causal=causal, window=window)
            if self.tree_size is not None:  # the target's attention under tree masks
                t = engine.model_config
                compile_variants(t.num_attention_heads, t.num_key_value_heads, runner.model.head_dim,
                                 runner.block_size, engine.dtype, engine.device, tree=True,
                                 sinks=runner.model.has_sinks)
        with torch.inference_mode():  # the acceptance kernel is compiled now, not mid-serving
            z = torch.zeros(1, self.num_draft + 1, dtype=torch.long, device=engine.device)
            accepted_lengths(z[:, 1:], z)
            if fused_enabled(z):  # every kernel variant of eager drafts and context writes
                self._warm_eager()
        self.capture_graphs()

    def _warm_eager(self) -> None:
        """Placeholder steps (nothing stored) through the context write, the draft and its head."""
        runner, B = self.engine.runner, self.block_size
        for n in WARM_ROWS:
            ids, pos, batch = runner.placeholder_batch(n)
            self.drafter.write_context(runner.run(ids, pos, batch, self.tap_layers)[1], pos, self.kv, self.attn,
                                       batch)
            if n < B:
                continue
            ids, pos, batch = runner.placeholder_batch(n // B * B, causal=False)
            self.attn.prepare(batch, self.engine.device)
            hidden = self.drafter(self.embed(ids), pos, self.kv, self.attn, batch)
            self._draft_tokens(hidden, n // B, blocks=ids)
            ones = torch.ones(n // B, device=pos.device)
            self._draft_tokens(hidden, n // B, (ones, ones.long(), pos), ids)

    def capture_graphs(self) -> None:
        """Capture before serving, at every batch bucket: the whole DFlash step (draft, drafts into
        the verify input, verify, context write) as one graph, and the decode step that still
        writes the context (paused speculation, one-token prompts, requests near max_model_len),
        and for ragged steps (prefill chunks beside verify blocks) the draft blocks alone and the
        target with the context write over (sequences, rows) buckets."""
        runner, n = self.engine.runner, self.engine.config.max_num_seqs
        if self.tree_size is not None:  # whole tree steps; a step with prefill chunks decodes without trees
            # through the ragged decode graphs (dflash.py _step); eagerly where those are not captured
            runner.capture_graphs(("dflash-tree", self.tap_layers), self.block_size, False, self.attn,
                                  self._tree_graph_step, n, setup=self._setup_tree_graph)
            runner.capture_graphs(("dflash-tree-sampled", self.tap_layers), self.block_size, False, self.attn,
                                  self._tree_graph_step, n, setup=self._setup_sampled_tree_graph)
            runner.capture_graphs(("decode", self.tap_layers), 1, True, runner.attn, self._decode_step, n)
            runner.capture_ragged_graphs(("decode", self.tap_layers), self._decode_step, n,
                                         self.engine.config.max_num_batched_tokens)
            pair = runner.graphs.get((("dflash-tree", self.tap_layers), 2, self.block_size))
            if pair is not None:  # the gather of a step launched past a request that left, once now (below)
                self._keep_rows(pair, [1], [])
            return
        for k in self.draft_counts:  # the whole step verifying k drafts a request (DepthProfile chooses k)
            greedy = self.verify_key("dflash", k)
            runner.capture_graphs(greedy, self.block_size, False, self.attn, self._graph_step, n,
                                  setup=partial(self._setup_graph, k=k))
            for (key, _, q_len), g in runner.graphs.items():
                if key == greedy and q_len == self.block_size:
                    g.aux["post"] = self._capture_post(g)
            runner.capture_graphs(self.verify_key("dflash-sampled", k), self.block_size, False, self.attn,
                                  self._graph_step, n, setup=partial(self._setup_sampled_graph, k=k))
        pair = runner.graphs.get((self.verify_key("dflash", self.num_draft), 2, self.block_size))
        if pair is not None:
            # the gather of a step launched past a request that left (overlap.py _keep_rows) runs once
            # now, over placeholder buffers that every fresh step fills again: its first call in a
            # process had stalled a step by 46-57 ms in the middle of serving (H200; no Triton compile)
            self._keep_rows(pair, [1], [])
        runner.capture_graphs(("decode", self.tap_layers), 1, True, runner.attn, self._decode_step, n)
        runner.capture_ragged_graphs(("decode", self.tap_layers), self._decode_step, n,
                                     self.engine.config.max_num_batched_tokens)
        runner.capture_graphs(("draft", self.tap_layers), self.block_size, False, self.attn, self._draft_step, n)
        runner.capture_graphs(("draft-sampled", self.tap_layers), self.block_size, False, self.attn,
                              self._sampled_draft_step, n, setup=self._setup_draw)

    def _graphed_forward(self, plans: list[Plan], tokens: list[list[int]]) -> tuple | None:
        """A step where every request verifies its whole draft block, or every request decodes, as one
        graph replay: (the target's final hidden states, the verify's input ids or None); None when no
        graph covers the step."""
        eng, runner = self.engine, self.engine.runner
        seqs = [p.seq for p in plans]
        verifying = [p for p in plans if p.verify]
        k = plans[0].n - 1
        if verifying and len(verifying) == len(plans) and k in self.draft_counts and all(p.n == k + 1 for p in plans):
            blocks = [t + [self.mask_token_id] * (self.block_size - len(t)) for t in tokens]
            drawn = any(self._draws(s) for s in seqs)  # the same step with drafts drawn in the graph
            g = runner.filled_graph(self.verify_key("dflash-sampled" if drawn else "dflash", k), seqs, blocks,
                                    eng.block_manager, False, self.attn, self._graph_step,
                                    setup=partial(self._setup_sampled_graph if drawn else self._setup_graph, k=k))
            if g is not None:
                if drawn:
                    g.fill(draft_temp=[float(s.params.temperature) for s in seqs], draft_seed=[s.seed for s in seqs])
                self._verify_graph = g  # a step after this one may be launched on it (overlap.py)
                return g.replay()[: len(plans) * plans[0].n], g.extra["verify_ids"]
        elif not verifying:
            out = runner.graphed(("decode", self.tap_layers), seqs, tokens, eng.block_manager, True,
                                 runner.attn, self._decode_step)
            if out is not None:
                return out[0], None
        return None

    def _graphed_drafts(self, seqs: list[Sequence], blocks: list[list[int]], sampled: bool) -> torch.Tensor | None:
        """The draft blocks alone as a graph replay: [S, B-1] drafts, or None when no graph covers them."""
        eng = self.engine
        if sampled:
            g = eng.runner.filled_graph(("draft-sampled", self.tap_layers), seqs, blocks, eng.block_manager,
                                        False, self.attn, self._sampled_draft_step, setup=self._setup_draw)
            if g is not None:
                g.fill(draft_temp=[float(s.params.temperature) for s in seqs], draft_seed=[s.seed for s in seqs])
        else:
            g = eng.runner.filled_graph(("draft", self.tap_layers), seqs, blocks, eng.block_manager, False,
                                        self.attn, self._draft_step)
        # read before any other replay: graphs share one memory pool
        return None if g is None else g.replay()[: len(seqs)]

    def verify_key(self, kind: str, k: int) -> tuple:
        """The graph key of a whole step of `kind` verifying k drafts a request."""
        return (kind, self.tap_layers) if k == self.num_draft else (kind, self.tap_layers, k)

    # ---- functions of a StepGraph's static buffers ------------------------------------------
    def _setup_graph(self, g: StepGraph, k: int | None = None) -> None:
        """The verify's own buffers beside the draft block's, for k drafts a request (default: the
        step's): its input ids, and positions and metadata that are the draft's when it verifies all
        B rows (else derived in the graph)."""
        S, B, dev = g.num_seqs, self.block_size, g.device
        k1 = g.aux["k1"] = (self.num_draft if k is None else k) + 1
        g.extra["verify_ids"] = torch.zeros(S * k1, dtype=torch.long, device=dev)
        g.aux["row_seq"] = torch.arange(S * B, device=dev) // B  # each draft-block row's sequence
        g.aux["block_offsets"] = torch.arange(B, device=dev)
        # what the host reads of a greedy step (_post_step): accepted drafts [S], then the target's tokens [S * k1]
        g.extra["outcome"] = torch.zeros(S + S * k1, dtype=torch.long, device=dev)
        if k1 == B:
            g.extra["verify_positions"] = g.positions
            meta = replace(g.meta, causal=True)
        else:
            g.extra["verify_positions"] = torch.zeros(S * k1, dtype=torch.long, device=dev)
            meta = replace(g.meta, slot_mapping=torch.full((S * k1,), -1, dtype=torch.long, device=dev),
                           query_start_loc=torch.zeros_like(g.meta.query_start_loc),
                           seq_lens=torch.zeros_like(g.meta.seq_lens), max_query_len=k1, causal=True)
        g.aux["verify_meta"] = meta
        g.attn = [(self.attn, g.meta), (self.engine.runner.attn, meta)]

    def _graph_step(self, g: StepGraph) -> torch.Tensor:
        """One DFlash step over a graph's buffers: g.input_ids holds the draft blocks
        [x_start, MASK ...]; returns the verify's final hidden states [S * (k+1), H]."""
        S, B, k1 = g.num_seqs, self.block_size, g.aux["k1"]
        vm, pos, ids = g.aux["verify_meta"], g.extra["verify_positions"], g.extra["verify_ids"]
        self._derive_slots(g, True)
        if k1 < B:  # the verify reads the first k+1 rows of every block
            m = g.meta
            pos.copy_(g.positions.view(S, B)[:, :k1].flatten())
            vm.slot_mapping.copy_(m.slot_mapping.view(S, B)[:, :k1].flatten())
            vm.seq_lens.copy_((m.seq_lens - (B - k1)).clamp_min(0))
            vm.query_start_loc.copy_(m.query_start_loc // B * k1)
        drafts = self._sampled_draft_step(g) if "draft_temp" in g.extra else self._draft_step(g)
        ids.view(S, k1)[:, 0] = g.input_ids.view(S, B)[:, 0]
        ids.view(S, k1)[:, 1:] = drafts[:, : k1 - 1]
        runner = self.engine.runner
        hidden, taps = runner.model(ids, pos, runner.kv, runner.attn, vm, self.tap_layers)
        self.drafter.write_context(taps, pos, self.kv, self.attn, vm)
        return hidden

    def _derive_slots(self, g: StepGraph, kernel: bool = False) -> None:
        """Every block row's cache slot from its position and its sequence's block table (rows of
        sequences without rows: -1, not stored): what the host fills, derived in the graph, so that
        an overlapped step needs only its positions and tables (overlap.py). kernel: in one kernel
        (fused_tokens.block_slots) on the fused path, instead of ~10 torch ops (H200, the shipped pair's
        chain step graph 0.851 -> 0.839 ms at c=1, 1.000 -> 0.979 ms at c=8)."""
        m, bs, seq = g.meta, g.meta.block_size, g.aux["row_seq"]
        if kernel and fused_enabled(g.positions):  # one kernel for the ~10 ops below
            from flashdraft.models.fused_tokens import block_slots

            block_slots(g.positions, m.seq_lens, m.block_tables, bs, m.slot_mapping)
            return
        page = m.block_tables[seq, g.positions // bs].long()
        m.slot_mapping.copy_(torch.where(m.seq_lens[seq] > 0, page * bs + g.positions % bs, -1))

    def _post_step(self, g: StepGraph) -> None:
        """After a greedy whole step's replay: the target's token at every verify row and the accepted
        drafts into g.extra["outcome"] (the host's one read), then the next step's blocks in the input
        buffers, for a step that verifies the same requests again: each one past its accepted drafts,
        its first token the target's token there (sequences without rows keep theirs). A step the
        host schedules otherwise fills every buffer again."""
        S, k1 = g.num_seqs, g.aux["k1"]
        hidden = g.outputs[: S * k1]
        toks = greedy_tokens(self.engine.runner.model.compute_logits(hidden, float32=False)).view(S, k1)
        drafts, out = g.extra["verify_ids"].view(S, k1)[:, 1:], g.extra["outcome"]
        if fused_enabled(toks):  # count, outcome and next blocks in one kernel
            from flashdraft.models.fused_tokens import advance_blocks

            advance_blocks(g.positions, g.input_ids, g.meta.seq_lens, toks, drafts=drafts, outcome=out)
            return
        acc = accepted_lengths(drafts, toks)
        out[:S].copy_(acc)
        out[S:].copy_(toks.flatten())
        self._next_blocks(g, acc, toks)

    def _next_blocks(self, g: StepGraph, acc: torch.Tensor, toks: torch.Tensor) -> None:
        """Move the first n = len(acc) sequences' draft blocks on after a verify that accepted acc [n]
        drafts, the target's tokens toks [n, k+1]: each block starts one past the accepted drafts, its
        first token the target's token there; sequences without rows (length 0) keep theirs."""
        if fused_enabled(toks):
            from flashdraft.models.fused_tokens import advance_blocks

            advance_blocks(g.positions, g.input_ids, g.meta.seq_lens, toks, acc=acc)
            return
        n, B, m = acc.shape[0], self.block_size, g.meta
        live, lens = m.seq_lens[:n] > 0, m.seq_lens[:n]
        pos, first = g.positions[: n * B].view(n, B), g.input_ids[: n * B].view(n, B)[:, 0]
        start = pos[:, :1] + acc[:, None] + 1
        pos.copy_(torch.where(live[:, None], start + g.aux["block_offsets"], pos))
        lens.copy_(torch.where(live, start[:, 0].to(torch.int32) + B, lens))
        first.copy_(torch.where(live, toks.gather(1, acc[:, None])[:, 0], first))

    def _capture_post(self, g: StepGraph) -> Graph | None:
        """_post_step as a CUDA graph over a captured step graph's buffers (None off CUDA: it runs
        eagerly); warmed up with the step's buffers saved and restored (the warm-up advances them)."""
        if not g.captured:
            return None
        saved = [t.clone() for t in (g._rows, g._ints)]
        side = torch.cuda.Stream(g.device)
        side.wait_stream(torch.cuda.current_stream(g.device))
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                self._post_step(g)
        torch.cuda.current_stream(g.device).wait_stream(side)
        graph = Graph()
        with capture(graph, self.engine.runner.graph_pool), torch.inference_mode():
            self._post_step(g)
        for t, s in zip((g._rows, g._ints), saved):
            t.copy_(s)
        torch.cuda.synchronize(g.device)
        return graph

    def _run_post(self, g: StepGraph) -> torch.Tensor:
        """_post_step after a greedy step's replay (its graph's replay on CUDA); returns the outcome."""
        post = g.aux.get("post")
        if post is not None:
            post.replay()
        else:
            with torch.inference_mode():
                self._post_step(g)
        return g.extra["outcome"]

    def _draft_step(self, g: StepGraph) -> torch.Tensor:
        """The draft blocks alone over a graph's buffers: [S, B-1] drafts."""
        return self._draft_tokens(self.drafter(self.embed(g.input_ids), g.positions, self.kv, self.attn, g.meta),
                                  g.num_seqs, blocks=g.input_ids)

    def _setup_sampled_graph(self, g: StepGraph, k: int | None = None) -> None:
        self._setup_graph(g, k)
        self._setup_draw(g)

    def _setup_draw(self, g: StepGraph) -> None:
        """The sampled draft graph's per-sequence temperature and seed buffers."""
        g.extra["draft_temp"] = torch.zeros(g.num_seqs, dtype=torch.float32, device=g.device)
        g.extra["draft_seed"] = torch.zeros(g.num_seqs, dtype=torch.int64, device=g.device)

    def _sampled_draft_step(self, g: StepGraph) -> torch.Tensor:
        """The draft blocks of sampled requests over a graph's buffers: [S, B-1] drawn drafts."""
        hidden = self.drafter(self.embed(g.input_ids), g.positions, self.kv, self.attn, g.meta)
        return self._draft_tokens(hidden, g.num_seqs, (g.extra["draft_temp"], g.extra["draft_seed"], g.positions),
                                  g.input_ids)

    def _decode_step(self, g: StepGraph) -> torch.Tensor:
        """A step without drafts over a graph's buffers: the target, then every row's context."""
        runner = self.engine.runner
        hidden, taps = runner.model(g.input_ids, g.positions, runner.kv, runner.attn, g.meta, self.tap_layers)
        self.drafter.write_context(taps, g.positions, self.kv, self.attn, g.meta)
        return hidden
