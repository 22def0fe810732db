"""The DFlash step as CUDA graphs.

At start, every kernel variant an eager step can meet is compiled and, per batch bucket, captured as
graphs: the whole step (draft, drafts into the verify input, verify, context write) when every request
verifies, for each draft count the policy may choose; the decode step that still writes the context
(paused speculation, requests near max_model_len), the draft blocks alone for ragged steps (prefill
chunks beside verify blocks), and the target with the context write over (sequences, rows) buckets.
Nothing compiles or captures mid-serving. A step the graphs do not cover runs the same functions
eagerly (speculative/dflash.py). On a CPU the "graphs" run eagerly over the same static buffers, so all
of this is tested without a GPU.

A speculative graph keeps its own buffers beside the draft block's (StepGraph.buffers, a SpecBuffers):
the verify's rows and metadata, the draws of sampled drafts, and for greedy chains the outcome the host
reads and the post graph that fills it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import torch

from flashdraft.attention.base import DeviceMeta
from flashdraft.engine.graphs import Graph, StepGraph, capture, to_device
from flashdraft.engine.model_runner import WARM_ROWS, ModelRunner
from flashdraft.engine.pipeline import InFlight
from flashdraft.engine.sampler import greedy_tokens
from flashdraft.engine.sequence import Sequence
from flashdraft.kernels.dispatch import fused_enabled
from flashdraft.speculative.drafts import DraftTokens
from flashdraft.speculative.plan import Plan, Verified
from flashdraft.speculative.verify import accepted_lengths


@dataclass
class SpecBuffers:
    """A speculative step graph's own buffers. draw_temp, draw_seed [S]: sampled drafts' temperature and
    seed (None: argmax drafts). The verify (None in a draft-only graph): `rows` a request, its input ids
    and positions [S * rows], its metadata; row_seq [S * B]: each draft-block row's sequence. Greedy
    chains: `outcome` [S + S * rows], the accepted drafts then the target's tokens, and the post graph
    that fills it. tree: a token-tree step (speculative/trees.py); moves_kv: its graph moves the accepted
    rows' K/V and packs the outcome itself."""
    draw_temp: torch.Tensor | None = None
    draw_seed: torch.Tensor | None = None
    rows: int = 0
    ids: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    meta: DeviceMeta | None = None
    row_seq: torch.Tensor | None = None
    block_offsets: torch.Tensor | None = None
    outcome: torch.Tensor | None = None
    post: Graph | None = None
    tree: bool = False
    moves_kv: bool = False

    @property
    def drawn(self) -> bool:
        return self.draw_temp is not None


def add_draws(g: StepGraph) -> None:
    """A sampled graph's per-sequence temperature and seed buffers."""
    b = g.buffers = g.buffers or SpecBuffers()
    b.draw_temp = torch.zeros(g.num_seqs, dtype=torch.float32, device=g.device)
    b.draw_seed = torch.zeros(g.num_seqs, dtype=torch.int64, device=g.device)


def fill_draws(g: StepGraph, seqs: list[Sequence], drafts: DraftTokens) -> None:
    g.copy_into(g.buffers.draw_temp, [float(s.params.temperature) if drafts.draws(s) else 0.0 for s in seqs])
    g.copy_into(g.buffers.draw_seed, [s.seed for s in seqs])


def derive_slots(g: StepGraph, kernel: bool = False) -> None:
    """Every block row's cache slot from its position and its sequence's block table (rows of
    sequences without rows: -1, not stored): what the host fills, derived in the graph, so that
    a step launched ahead needs only its positions and tables. kernel: in one kernel
    (token_ops.block_slots) on the fused path, instead of ~10 torch ops (H200, the shipped pair's
    chain step graph 0.851 -> 0.839 ms at c=1, 1.000 -> 0.979 ms at c=8)."""
    m, bs, seq = g.meta, g.meta.block_size, g.buffers.row_seq
    if kernel and fused_enabled(g.positions):  # (GPU only: Triton)
        from flashdraft.kernels.token_ops import block_slots

        block_slots(g.positions, m.seq_lens, m.block_tables, bs, m.slot_mapping)
        return
    page = m.block_tables[seq, g.positions // bs].long()
    m.slot_mapping.copy_(torch.where(m.seq_lens[seq] > 0, page * bs + g.positions % bs, -1))


class StepGraphs:
    def __init__(self, runner: ModelRunner, drafts: DraftTokens, tap_layers: tuple[int, ...], num_draft: int,
                 max_num_seqs: int, max_num_batched_tokens: int):
        self.runner, self.drafts, self.taps, self.num_draft = runner, drafts, tap_layers, num_draft
        self.context = drafts.context
        self.block_size = drafts.block_size
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens

    def key(self, kind: str, k: int | None = None) -> tuple:
        """The graph key of a step of `kind`; a whole step verifying k drafts a request (not the block's)
        has k in it."""
        return (kind, self.taps) if k is None or k == self.num_draft else (kind, self.taps, k)

    # ---- capture -----------------------------------------------------------------------------
    def compile_and_capture(self, choices: tuple[int, ...], num_draft: int,
                            capture_trees: Callable[[], None] | None = None) -> None:
        """Compile every kernel variant eager steps use, then capture the step's graphs (capture)."""
        runner, drafter, dev = self.runner, self.drafts.drafter, self.runner.device
        if runner.backend_name == "triton" and dev.type == "cuda":  # ragged steps draft eagerly (GPU only)
            from flashdraft.kernels.attention import compile_variants

            c = drafter.config
            for causal, window in dict.fromkeys(drafter.spec.layer_masks or [(False, None)]):
                compile_variants(c.num_attention_heads, c.num_key_value_heads, drafter.head_dim,
                                 runner.block_size, runner.dtype, dev, causal=causal, window=window,
                                 kv_dtype=runner.kv_dtype)
            if capture_trees is not None:  # the target's attention under tree masks
                t = runner.model.config
                compile_variants(t.num_attention_heads, t.num_key_value_heads, runner.model.head_dim,
                                 runner.block_size, runner.dtype, dev, tree=True, sinks=runner.model.has_sinks,
                                 kv_dtype=runner.kv_dtype)
        with torch.inference_mode():  # the acceptance kernel is compiled now, not mid-serving
            z = torch.zeros(1, num_draft + 1, dtype=torch.long, device=dev)
            accepted_lengths(z[:, 1:], z)
            if fused_enabled(z):  # every kernel variant of eager drafts and context writes
                self.warm_eager()
        self.capture(choices, capture_trees)

    def capture(self, choices: tuple[int, ...], capture_trees: Callable[[], None] | None = None) -> None:
        """Capture before serving, at every batch bucket: the whole DFlash step of each draft count in
        `choices` (with token trees, capture_trees captures theirs instead: speculative/trees.py), the
        decode step that still writes the context (paused speculation, one-token prompts, requests near
        max_model_len), and for ragged steps (prefill chunks beside verify blocks) the draft blocks alone
        and the target with the context write over (sequences, rows) buckets."""
        runner, n, B, tree = self.runner, self.max_num_seqs, self.block_size, capture_trees is not None
        if tree:
            capture_trees()
        for k in () if tree else choices:
            greedy = self.key("dflash", k)
            runner.capture_graphs(greedy, B, False, self.context.attn, self.graph_step, n,
                                  setup=partial(self.setup_verify, k=k))
            for (key, _, q_len), g in runner.graphs.items():
                if key == greedy and q_len == B:
                    g.buffers.post = self._capture_post(g)
            runner.capture_graphs(self.key("dflash-sampled", k), B, False, self.context.attn, self.graph_step, n,
                                  setup=partial(self.setup_verify, k=k, drawn=True))
        pair = runner.graphs.get((self.key("dflash-tree" if tree else "dflash"), 2, B))
        if pair is not None:
            # the gather of a step launched past a request that left (keep_rows) runs once now, over
            # placeholder buffers that every fresh step fills again: its first call in a process had
            # stalled a step by 46-57 ms in the middle of serving (H200; no Triton compile)
            self.keep_rows(pair, [1], [])
        runner.capture_graphs(self.key("decode"), 1, True, runner.attn, self.decode_step, n)
        runner.capture_ragged_graphs(self.key("decode"), self.decode_step, n, self.max_num_batched_tokens)
        if tree:  # a step with prefill chunks decodes without trees, through the ragged decode graphs
            return
        runner.capture_graphs(self.key("draft"), B, False, self.context.attn, self.draft_block, n,
                              setup=self._setup_draft)
        runner.capture_graphs(self.key("draft-sampled"), B, False, self.context.attn, self.draft_block, n,
                              setup=add_draws)

    def warm_eager(self) -> None:
        """Placeholder steps (nothing stored) through the context write, the draft and its head."""
        runner, B, ctx = self.runner, self.block_size, self.context
        for n in WARM_ROWS:
            ids, pos, batch = runner.placeholder_batch(n)
            self.drafts.drafter.write_context(runner.run(ids, pos, batch, self.taps)[1], pos, ctx.kv, ctx.attn, batch)
            if n < B:
                continue
            ids, pos, batch = runner.placeholder_batch(n // B * B, causal=False)
            ctx.attn.prepare(batch, runner.device)
            hidden = self.drafts.forward(ids, pos, batch)
            self.drafts.tokens(hidden, n // B, blocks=ids)
            ones = torch.ones(n // B, device=pos.device)
            self.drafts.tokens(hidden, n // B, (ones, ones.long(), pos), ids)

    # ---- replays -----------------------------------------------------------------------------
    def whole_step(self, plans: list[Plan], tokens: list[list[int]], bm) -> Verified | None:
        """A step where every request verifies its whole draft block of a captured count, or every
        request decodes, as one graph replay; None when no graph covers the step."""
        seqs = [p.seq for p in plans]
        verifying = [p for p in plans if p.verify]
        k = plans[0].n - 1
        if verifying and len(verifying) == len(plans) and all(p.n == k + 1 for p in plans):
            blocks = [t + [self.drafts.mask_token_id] * (self.block_size - len(t)) for t in tokens]
            drawn = any(self.drafts.draws(s) for s in seqs)  # the same step with drafts drawn in the graph
            g = self.runner.filled_graph(self.key("dflash-sampled" if drawn else "dflash", k), seqs, blocks, bm,
                                         False, self.context.attn, self.graph_step,
                                         setup=partial(self.setup_verify, k=k, drawn=drawn))
            if g is None:
                return None
            if drawn:
                fill_draws(g, seqs, self.drafts)
            return Verified(g.replay()[: len(plans) * plans[0].n], g.buffers.ids, g)
        if not verifying:
            out = self.runner.graphed(self.key("decode"), seqs, tokens, bm, True, self.runner.attn, self.decode_step)
            if out is not None:
                return Verified(out[0], None)
        return None

    def draft_only(self, seqs: list[Sequence], bm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The draft blocks alone as a graph replay: [S, B-1] drafts and the drafter's final hidden states
        [S * B, H], or None when no graph covers them. Read them before any other replay: graphs share one
        memory pool."""
        drawn = any(self.drafts.draws(s) for s in seqs)
        g = self.runner.filled_graph(self.key("draft-sampled" if drawn else "draft"), seqs, self.drafts.blocks(seqs),
                                     bm, False, self.context.attn, self.draft_block,
                                     setup=add_draws if drawn else self._setup_draft)
        if g is None:
            return None
        if drawn:
            fill_draws(g, seqs, self.drafts)
        drafts, hidden = g.replay()
        return drafts[: len(seqs)], hidden[: len(seqs) * self.block_size]

    def decode(self, seqs: list[Sequence], tokens: list[list[int]], bm, ids: torch.Tensor | None = None
               ) -> torch.Tensor | None:
        """A step without drafts (the target over one row a request, the context write) as a graph
        replay: the rows' final hidden states, or None when no graph covers it."""
        out = self.runner.graphed(self.key("decode"), seqs, tokens, bm, True, self.runner.attn, self.decode_step,
                                  input_ids=ids)
        return None if out is None else out[0]

    def graph_of(self, g: StepGraph, n: int, drawn: bool | None = None, k: int | None = None) -> StepGraph | None:
        """The captured graph of g's whole step (its kind, or the one with drafts drawn when `drawn`; its
        draft count, or k) for n requests."""
        bucket, b = 1 << (n - 1).bit_length(), g.buffers
        if b.tree:  # token trees keep g's kind: its requests' temperatures are the step's
            return self.runner.graphs.get((self.key("dflash-tree-sampled" if b.drawn else "dflash-tree"), bucket,
                                           self.block_size))
        drawn = b.drawn if drawn is None else drawn
        k = b.rows - 1 if k is None else k
        return self.runner.graphs.get((self.key("dflash-sampled" if drawn else "dflash", k), bucket, self.block_size))

    def keep_rows(self, g: StepGraph, rows: list[int], plans: list[Plan], joining: InFlight | None = None
                  ) -> StepGraph:
        """The next blocks of the requests still running (the in-flight step's `rows`) moved from g's
        buffers into the first rows of the graph for `plans` (g itself when it is that graph), on the
        device; then the blocks of the requests admitted behind it (`joining`: each starts at the end of
        its prompt, its first token the prefill's on the device); the sequences past them padding (no
        rows, no stores). Returns that graph."""
        k = plans[0].n - 1 if plans else None  # (none: the warm-up's call, capture)
        to = self.graph_of(g, len(plans), any(self.drafts.draws(p.seq) for p in plans), k)
        B, n, S = self.block_size, len(rows), len(plans)
        index = to_device(rows, torch.long, g.device)
        blocks = [buf.view(-1, B).index_select(0, index) for buf in (g.input_ids, g.positions)]
        lens = g.meta.seq_lens.index_select(0, index)
        for buf, kept in zip((to.input_ids, to.positions), blocks):
            buf.view(-1, B)[:n].copy_(kept)
            buf.view(-1, B)[S:].zero_()
        to.meta.seq_lens[:n].copy_(lens)
        to.meta.seq_lens[S:].zero_()
        if joining is not None:
            starts = [s.num_computed_tokens for s in joining.seqs]  # the prompt's end
            host = to_device([[t + j for t in starts for j in range(B)], [t + B for t in starts]
                              + [0] * (len(starts) * (B - 1))], torch.long, g.device)
            to.positions[n * B: S * B].copy_(host[0])
            to.meta.seq_lens[n:S].copy_(host[1][: S - n])
            first = to.input_ids.view(-1, B)[n:S]
            first.fill_(self.drafts.mask_token_id)
            first[:, 0] = joining.tokens
        to.fill(query_start_loc=[i * B for i in range(S + 1)])
        if to.buffers.drawn:
            fill_draws(to, [p.seq for p in plans], self.drafts)
        return to

    @staticmethod
    def greedy_post(plans: list[Plan], g: StepGraph | None, checked=None) -> bool:
        """Whether a whole step over graph g takes its tokens and acceptance from g's post graph
        (_post_step): a greedy chain's graph, every request greedy, none reading its logits (but those
        `checked` after the step: grammar_check.py)."""
        return g is not None and g.buffers.outcome is not None and all(
            p.seq.params.temperature == 0 and (not p.seq.params.needs_logits or (checked and checked(p.seq)))
            for p in plans)

    def run_post(self, g: StepGraph) -> torch.Tensor:
        """_post_step after a greedy step's replay (its graph's replay on CUDA); returns the outcome."""
        if g.buffers.post is not None:
            g.buffers.post.replay()
        else:
            with torch.inference_mode():
                self._post_step(g)
        return g.buffers.outcome

    def next_blocks(self, g: StepGraph, acc: torch.Tensor, toks: torch.Tensor) -> None:
        """Move the first n = len(acc) sequences' draft blocks on after a verify that accepted acc [n]
        drafts, the target's tokens toks [n, k+1]: each block starts one past the accepted drafts, its
        first token the target's token there; sequences without rows (length 0) keep theirs."""
        if fused_enabled(toks):  # (GPU only: Triton)
            from flashdraft.kernels.token_ops import advance_blocks

            advance_blocks(g.positions, g.input_ids, g.meta.seq_lens, toks, acc=acc)
            return
        n, B, m = acc.shape[0], self.block_size, g.meta
        live, lens = m.seq_lens[:n] > 0, m.seq_lens[:n]
        pos, first = g.positions[: n * B].view(n, B), g.input_ids[: n * B].view(n, B)[:, 0]
        start = pos[:, :1] + acc[:, None] + 1
        pos.copy_(torch.where(live[:, None], start + g.buffers.block_offsets, pos))
        lens.copy_(torch.where(live, start[:, 0].to(torch.int32) + B, lens))
        first.copy_(torch.where(live, toks.gather(1, acc[:, None])[:, 0], first))

    # ---- functions of a StepGraph's static buffers ------------------------------------------
    def setup_verify(self, g: StepGraph, k: int | None = None, drawn: bool = False) -> None:
        """The verify's own buffers beside the draft block's, for k drafts a request (default: the
        block's): its input ids, and positions and metadata that are the draft's when it verifies all
        B rows (else derived in the graph); a greedy chain's outcome."""
        S, B, dev = g.num_seqs, self.block_size, g.device
        rows = (self.num_draft if k is None else k) + 1
        b = g.buffers = SpecBuffers(rows=rows, ids=torch.zeros(S * rows, dtype=torch.long, device=dev),
                                    row_seq=torch.arange(S * B, device=dev) // B,
                                    block_offsets=torch.arange(B, device=dev))
        if drawn:
            add_draws(g)
        else:  # what the host reads of a greedy step (_post_step): accepted drafts [S], then the tokens [S * rows]
            b.outcome = torch.zeros(S + S * rows, dtype=torch.long, device=dev)
        if rows == B:
            b.positions = g.positions
            b.meta = replace(g.meta, causal=True)
        else:
            b.positions = torch.zeros(S * rows, dtype=torch.long, device=dev)
            b.meta = replace(g.meta, slot_mapping=torch.full((S * rows,), -1, dtype=torch.long, device=dev),
                             query_start_loc=torch.zeros_like(g.meta.query_start_loc),
                             seq_lens=torch.zeros_like(g.meta.seq_lens), max_query_len=rows, causal=True)
        g.attn = [(self.context.attn, g.meta), (self.runner.attn, b.meta)]

    def graph_step(self, g: StepGraph) -> torch.Tensor:
        """One DFlash step over a graph's buffers: g.input_ids holds the draft blocks
        [x_start, MASK ...]; returns the verify's final hidden states [S * rows, H]."""
        S, B, b = g.num_seqs, self.block_size, g.buffers
        rows, vm, pos, ids = b.rows, b.meta, b.positions, b.ids
        derive_slots(g, True)
        if rows < B:  # the verify reads the first rows of every block
            m = g.meta
            pos.copy_(g.positions.view(S, B)[:, :rows].flatten())
            vm.slot_mapping.copy_(m.slot_mapping.view(S, B)[:, :rows].flatten())
            vm.seq_lens.copy_((m.seq_lens - (B - rows)).clamp_min(0))
            vm.query_start_loc.copy_(m.query_start_loc // B * rows)
        drafts = self.draft_step(g)
        ids.view(S, rows)[:, 0] = g.input_ids.view(S, B)[:, 0]
        ids.view(S, rows)[:, 1:] = drafts[:, : rows - 1]
        runner = self.runner
        hidden, taps = runner.model(ids, pos, runner.kv, runner.attn, vm, self.taps)
        self.drafts.drafter.write_context(taps, pos, self.context.kv, self.context.attn, vm)
        return hidden

    def _setup_draft(self, g: StepGraph) -> None:
        g.buffers = SpecBuffers()

    def draft_step(self, g: StepGraph) -> torch.Tensor:
        """The draft blocks over a graph's buffers: [S, B-1] drafts (drawn in a sampled graph)."""
        return self.draft_block(g)[0]

    def draft_block(self, g: StepGraph) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft blocks over a graph's buffers: [S, B-1] drafts (drawn in a sampled graph) and the
        drafter's final hidden states [S * B, H] they come from."""
        hidden = self.drafts.forward(g.input_ids, g.positions, g.meta)
        b = g.buffers
        draw = (b.draw_temp, b.draw_seed, g.positions) if b.drawn else None
        return self.drafts.tokens(hidden, g.num_seqs, draw, g.input_ids), hidden

    def decode_step(self, g: StepGraph) -> torch.Tensor:
        """A step without drafts over a graph's buffers: the target, then every row's context."""
        runner = self.runner
        hidden, taps = runner.model(g.input_ids, g.positions, runner.kv, runner.attn, g.meta, self.taps)
        self.drafts.drafter.write_context(taps, g.positions, self.context.kv, self.context.attn, g.meta)
        return hidden

    def _post_step(self, g: StepGraph) -> None:
        """After a greedy whole step's replay: the target's token at every verify row and the accepted
        drafts into the outcome (the host's one read), then the next step's blocks in the input
        buffers, for a step that verifies the same requests again: each one past its accepted drafts,
        its first token the target's token there (sequences without rows keep theirs). A step the
        host schedules otherwise fills every buffer again."""
        S, b = g.num_seqs, g.buffers
        hidden = g.outputs[: S * b.rows]
        toks = greedy_tokens(self.runner.model.compute_logits(hidden, float32=False)).view(S, b.rows)
        drafts, out = b.ids.view(S, b.rows)[:, 1:], b.outcome
        if fused_enabled(toks):  # count, outcome and next blocks in one kernel (GPU only: Triton)
            from flashdraft.kernels.token_ops import advance_blocks

            advance_blocks(g.positions, g.input_ids, g.meta.seq_lens, toks, drafts=drafts, outcome=out)
            return
        acc = accepted_lengths(drafts, toks)
        out[:S].copy_(acc)
        out[S:].copy_(toks.flatten())
        self.next_blocks(g, acc, toks)

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
        with capture(graph, self.runner.graph_pool), torch.inference_mode():
            self._post_step(g)
        for t, s in zip((g._rows, g._ints), saved):
            t.copy_(s)
        torch.cuda.synchronize(g.device)
        return graph
