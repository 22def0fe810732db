"""Token-tree steps (the trees themselves are speculative/tree.py).

A chain verifies each draft slot's first choice; a tree of N drafts verifies the N rank paths with the
highest summed log-probability over the block's slot distributions, in one target forward: each row
sits at position start + depth and sees the context and its ancestors' rows. The target's own token
picks, row by row, the child that continues the accepted path (the chain's rule), so the output is
plain decoding's; the accepted rows' K/V then move to their positions' slots. On the fused GPU path a
greedy tree step's construction, acceptance and K/V moves run inside its graph (kernels/tree_ops.py).
A whole step launched from its graph stays on the device: its outcome reads as a chain's, the tokens
along each accepted path.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashdraft.engine.graphs import StepGraph, to_device
from flashdraft.engine.pipeline import StepContext
from flashdraft.engine.sampler import greedy_tokens
from flashdraft.engine.sequence import Sequence
from flashdraft.speculative.drafts import DraftTokens, Draw
from flashdraft.speculative.graphs import SpecBuffers, StepGraphs, add_draws, derive_slots, fill_draws
from flashdraft.speculative.kv_slots import move_rows, position_slots
from flashdraft.speculative.plan import Committed, Plan, ReadFlight, VerifyFlight
from flashdraft.speculative.tree import Trees, accept, path_moves, use_kernels
from flashdraft.speculative.verify import target_tokens


class TreeVerifier:
    def __init__(self, ctx: StepContext, drafts: DraftTokens, graphs: StepGraphs, size: int):
        self.ctx, self.drafts, self.graphs, self.size = ctx, drafts, graphs, size
        self.block_size = drafts.block_size
        self.context = drafts.context

    def capture(self) -> None:
        """The whole tree step's graphs, greedy and sampled, at every batch bucket."""
        for kind, drawn in (("dflash-tree", False), ("dflash-tree-sampled", True)):
            self.ctx.runner.capture_graphs(self.graphs.key(kind), self.block_size, False, self.context.attn,
                                           self.graph_step, self.ctx.config.max_num_seqs,
                                           setup=lambda g, d=drawn: self.setup_graph(g, d))

    # ---- a step of trees -----------------------------------------------------------------------
    def step(self, plans: list[Plan], started: float, whole: bool) -> VerifyFlight:
        """A step where requests verify token trees: draft and build the trees, one target forward
        over every row (tree rows at their depths' positions, each seeing its ancestors), the
        target's token at every row, the accepted path of each tree; one device->host transfer. A
        whole step replayed as a graph does all of it on the device and may stay in flight."""
        flight = self.graphed(plans, started, whole)
        if flight is not None:
            return flight
        hidden, positions, trees, ids, masks = self.forward(plans)
        verifying = [p for p in plans if p.verify]
        V, N = len(verifying), self.size
        toks, owner, logprobs = target_tokens(self.ctx, plans, hidden, positions, ids, masks)
        # each tree's target tokens as [V, 1 + N]; rows a short verify did not check never match
        t_idx, first = [], 0
        for p in plans:
            if p.verify:
                t_idx.append([first + i if i < p.n else toks.shape[0] for i in range(N + 1)])
            first += p.n if p.verify else int(p.seq.num_computed_tokens + p.n == p.seq.num_tokens)
        idx = to_device([i for row in t_idx for i in row] + [int(i < p.n - 1) for p in verifying
                                                             for i in range(N)], torch.long, toks.device)
        target = torch.cat([toks, toks.new_full((1,), -2)])[idx[: V * (N + 1)]].view(V, N + 1)
        a, path = accept(replace(trees, valid=trees.valid & idx[V * (N + 1):].view(V, N).bool()), target)
        committed = target.gather(1, path)
        D1 = path.shape[1]
        host = torch.cat([a, path.flatten(), committed.flatten(), toks]).tolist()
        chosen: dict[int, list[int]] = {}
        accepted, k = [], 0
        for i, p in enumerate(plans):
            if p.verify:
                accepted.append(host[k])
                p.path = host[V + k * D1: V + (k + 1) * D1][1: host[k] + 1]
                chosen[i] = host[V + V * D1 + k * D1: V + V * D1 + k * D1 + host[k] + 1]
                k += 1
        rest = host[V + 2 * V * D1:]
        for i, t in zip(owner, rest):
            if not plans[i].verify:
                chosen.setdefault(i, []).append(t)
        entries = None
        if logprobs is not None:  # a tree's committed tokens are its rows along the accepted path
            entries = {}
            for i, e in zip(owner, logprobs.read(rest, [plans[i].seq for i in owner])):
                entries.setdefault(i, []).append(e)
            for i, p in enumerate(plans):
                if p.verify:
                    entries[i] = [entries[i][r] for r in [0] + p.path]
        return ReadFlight(plans, Committed(accepted, chosen, entries), started, whole)

    def graphed(self, plans: list[Plan], started: float, whole: bool) -> VerifyFlight | None:
        """A step where every request verifies a whole tree, as its graph's replay (None when no graph
        covers it): launched, its outcome left on the device (flight)."""
        seqs = [p.seq for p in plans]
        if not all(p.verify and p.n == self.size + 1 for p in plans):
            return None
        # the target's tokens drawn (or processed) after the replay
        sampled = any(s.params.temperature > 0 or s.params.needs_logits for s in seqs)
        g = self.ctx.runner.filled_graph(self.graphs.key("dflash-tree-sampled" if sampled else "dflash-tree"), seqs,
                                         self.drafts.blocks(seqs), self.ctx.block_manager, False, self.context.attn,
                                         self.graph_step, setup=lambda g: self.setup_graph(g, sampled))
        if g is None:
            return None
        if sampled:
            fill_draws(g, seqs, self.drafts)
        return self.flight(plans, g, started, whole)

    def flight(self, plans: list[Plan], g: StepGraph, started: float, whole: bool) -> VerifyFlight:
        """Replay the whole tree step of graph g (its inputs filled, or moved on by the step before),
        then, all on the device: the target's tokens of a sampled step, the acceptance (a greedy
        step's is in the graph), the accepted rows' K/V moved to their positions' slots (in the
        graph on the fused GPU path); returns the step in flight, its outcome the accepted drafts [S]
        and the target's tokens along each accepted path [S, D + 1], read as a chain's."""
        out = g.replay()  # read before any other replay: graphs share one memory pool
        n, N1, b = len(plans), self.size + 1, g.buffers
        owner = [i for i in range(n) for _ in range(self.block_size)]  # D + 1 tokens a request
        if b.moves_kv and not b.drawn:  # greedy on the fused path: the graph did it all and packed its
            # outcome ([S] accepted, then [S, D + 1] tokens)
            return VerifyFlight(plans, out[9], g.num_seqs, owner, started, whole, g)
        trees = Trees(*(t[:n] for t in out[2:6]), self.block_size - 1)
        m = g.meta
        start = m.seq_lens[:n].long() - self.block_size  # each root's position
        logprobs = None
        if b.drawn:  # sampled: acceptance after the target's draws
            toks, _, logprobs = target_tokens(self.ctx, plans, out[0][: n * N1], out[1][: n * N1], b.ids,
                                              b.meta.tree_mask)
            target = toks.view(n, N1)
            if use_kernels(target):  # (GPU only: Triton)
                from flashdraft.kernels.tree_ops import accept_paths

                a, path, committed, src, dst = accept_paths(trees, target, start, m.block_tables[:n], m.block_size)
                self.move_rows(src, dst, kernel=True)
            else:
                a, path = accept(trees, target)
                committed = target.gather(1, path)
                self._move_path(path, a, start, m)
            if logprobs is not None:  # the rows along each accepted path, as `committed`
                logprobs = logprobs.select((path + torch.arange(n, device=path.device)[:, None] * N1).flatten())
        else:
            a, path, committed = (t[:n] for t in out[6:9])
            self._move_path(path, a, start, m)
        return VerifyFlight(plans, torch.cat([a, committed.flatten()]), n, owner, started, whole, g, logprobs)

    def forward(self, plans: list[Plan]) -> tuple[torch.Tensor, torch.Tensor, Trees, torch.Tensor, torch.Tensor]:
        """The trees of the verifying requests (propose), then the target over every row with its taps,
        tree rows at positions start + depth under their ancestor masks, then the context K/V of every
        row into the draft cache (written at the rows' slots: the accepted rows' move with the target's
        at commit). Returns the final hidden states, the rows' positions, the trees, and the rows' input
        ids and ancestor masks."""
        runner, dev = self.ctx.runner, self.ctx.device
        seqs = [p.seq for p in plans]
        verifying = [p for p in plans if p.verify]
        trees = self.propose([p.seq for p in verifying])
        tokens = [p.seq.token_ids[-1:] + [self.drafts.mask_token_id] * (p.n - 1) if p.verify else
                  p.seq.token_ids[p.seq.num_computed_tokens:][:p.n] for p in plans]
        ids, positions, batch = runner.build_batch(seqs, tokens, self.ctx.block_manager)
        N = trees.size
        dst = [p.row + 1 + i for p in verifying for i in range(p.n - 1)]
        src = [k * N + i for k, p in enumerate(verifying) for i in range(p.n - 1)]
        start = [p.seq.num_computed_tokens for p in verifying for _ in range(p.n - 1)]
        idx = to_device([dst, src, start, [p.row for p in verifying] + [0] * (len(dst) - len(verifying))],
                        torch.long, dev)
        ids[idx[0]] = trees.tokens.flatten()[idx[1]]
        positions[idx[0]] = idx[2] + trees.depths.flatten()[idx[1]]
        tree_mask = torch.zeros(ids.shape[0], dtype=torch.long, device=dev)
        tree_mask[idx[3, : len(verifying)]] = 1  # the root row sees the context and itself
        tree_mask[idx[0]] = trees.masks()[:, 1:].flatten()[idx[1]]
        batch.tree_mask = tree_mask
        hidden, taps = runner.run(ids, positions, batch, self.graphs.taps)
        self.context.write(taps, positions, batch.slot_mapping)
        return hidden, positions, trees, ids, tree_mask

    def propose(self, seqs: list[Sequence]) -> Trees:
        """One non-causal drafter forward over each request's block, then its tree of `size` drafts
        from every slot's `size` best candidates (sampled requests rank them by the draw the target
        will make)."""
        hidden, _, pos, _ = self.drafts.eager(seqs, self.ctx.block_manager)
        return self.drafts.trees(hidden, len(seqs), self.size, self.drafts.draw_of(seqs, pos))

    # ---- K/V moves of the accepted rows ---------------------------------------------------------
    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, kernel: bool = False) -> None:
        """Every target and draft layer's K/V from slots src to slots dst (kv_slots.move_rows: [S, D] per
        request, -1 none, in kernels/tree_ops.py's kernel when kernel; else flat slot lists)."""
        self.ctx.runner.move_kv(src, dst, kernel)
        move_rows(self.context.k_cache, self.context.v_cache, src, dst, kernel)

    def _move_path(self, path: torch.Tensor, a: torch.Tensor, start: torch.Tensor, meta) -> None:
        """The accepted rows' K/V to their positions' slots with torch ops (tree.path_moves): off the
        fused GPU path (the selection of the moves waits for the device there)."""
        src, dst = path_moves(path, a, start, meta.block_tables[: path.shape[0]], meta.block_size)
        keep = src >= 0
        self.move_rows(src[keep], dst[keep])

    def path_moves(self, seq: Sequence, start: int, path: list[int]) -> list[tuple[int, int]]:
        """(from slot, to slot) of each accepted tree row whose K/V must move to its position's slot:
        the row at depth d lies at slot start + row, and belongs at slot start + d."""
        bm = self.ctx.block_manager
        moves = [(start + r, start + d) for d, r in enumerate(path, start=1) if r != d]
        return list(zip(position_slots(bm, seq.seq_id, [m[0] for m in moves]),
                        position_slots(bm, seq.seq_id, [m[1] for m in moves])))

    def move_kv(self, moves: list[tuple[int, int]]) -> None:
        """Copy K/V of every target and draft layer between slots (all reads before any write)."""
        self.context.flush()
        idx = to_device([m[0] for m in moves] + [m[1] for m in moves], torch.long, self.ctx.device)
        self.move_rows(idx[: len(moves)], idx[len(moves):])

    # ---- the graph's buffers and step ------------------------------------------------------------
    def setup_graph(self, g: StepGraph, drawn: bool = False) -> None:
        """A tree step's verify buffers beside the draft block's: input ids, positions and metadata
        of size + 1 rows per sequence (derived from the block's inside the graph), the tree masks."""
        S, N1, dev, m = g.num_seqs, self.size + 1, g.device, g.meta
        meta = replace(m, slot_mapping=torch.full((S * N1,), -1, dtype=torch.long, device=dev),
                       query_start_loc=torch.zeros_like(m.query_start_loc), seq_lens=torch.zeros_like(m.seq_lens),
                       max_query_len=N1, causal=True, tree_mask=torch.zeros(S * N1, dtype=torch.long, device=dev))
        g.buffers = SpecBuffers(rows=N1, ids=torch.zeros(S * N1, dtype=torch.long, device=dev),
                                positions=torch.zeros(S * N1, dtype=torch.long, device=dev), meta=meta,
                                row_seq=torch.arange(S * self.block_size, device=dev) // self.block_size,
                                block_offsets=torch.arange(self.block_size, device=dev), tree=True)
        if drawn:
            add_draws(g)
        g.attn = [(self.context.attn, m), (self.ctx.runner.attn, meta)]

    def graph_step(self, g: StepGraph) -> tuple[torch.Tensor, ...]:
        """One tree step over a graph's buffers: g.input_ids holds the draft blocks [x_start, MASK ...]
        at positions start..start+B-1. The verify's slots, lengths and row offsets follow from the
        block's (start = seq_len - B; padding sequences, seq_len 0, get no rows and store nothing).
        Returns the verify's final hidden states and positions [S * (N + 1)] and the trees' tokens,
        parents, depths and valid flags [S, N]; greedy graphs also the acceptance (tree.accept): a [S],
        path [S, D + 1] and the target's tokens along the path [S, D + 1], and with the tree kernels
        those two packed as the outcome the host reads ([S], then [S * (D + 1)]; no op after the
        replay)."""
        m, b = g.meta, g.buffers
        vm, S, B, N1 = b.meta, g.num_seqs, self.block_size, self.size + 1
        kernels = use_kernels(g.positions)
        derive_slots(g, kernels)  # the draft block's slots (a step launched ahead fills only its tables)
        if kernels:  # one kernel for the verify's metadata, one for its rows (below), instead of ~30 ops
            from flashdraft.kernels import tree_ops  # (GPU only: Triton)

            first = tree_ops.verify_meta(m.seq_lens, m.block_tables, m.block_size, B, N1, vm.slot_mapping,
                                            vm.seq_lens, vm.query_start_loc)  # -1: a padding request
        else:
            real = m.seq_lens > 0
            start = (m.seq_lens.long() - B).clamp_min(0)
            q = start[:, None] + torch.arange(N1, device=g.device)
            tables = m.block_tables.long()
            page = tables.gather(1, (q // m.block_size).clamp(max=tables.shape[1] - 1))
            vm.slot_mapping.copy_(torch.where(real[:, None], page * m.block_size + q % m.block_size, -1).flatten())
            vm.seq_lens.copy_(torch.where(real, start + N1, 0))
            vm.query_start_loc[1:].copy_(torch.cumsum(real * N1, 0))
        hidden = self.drafts.forward(g.input_ids, g.positions, m)
        draw: Draw | None = (b.draw_temp, b.draw_seed, g.positions) if b.drawn else None
        trees = self.drafts.trees(hidden, S, self.size, draw)
        ids, pos = b.ids.view(S, N1), b.positions.view(S, N1)
        if kernels:
            tree_ops.verify_rows(g.input_ids, B, first, trees, ids, pos, vm.tree_mask)
        else:
            ids[:, 0] = g.input_ids.view(S, B)[:, 0]
            ids[:, 1:] = trees.tokens
            pos[:, 0] = start
            pos[:, 1:] = start[:, None] + trees.depths
            vm.tree_mask.copy_(trees.masks().flatten())
        runner = self.ctx.runner
        out, taps = runner.model(ids.flatten(), pos.flatten(), runner.kv, runner.attn, vm, self.graphs.taps)
        self.drafts.drafter.write_context(taps, pos.flatten(), self.context.kv, self.context.attn, vm)
        result = (out, pos.flatten(), trees.tokens, trees.parents, trees.depths, trees.valid)
        if draw is not None:  # sampled steps choose the target's tokens after the replay
            return result
        target = greedy_tokens(runner.model.compute_logits(out, float32=False)).view(S, N1)
        if not kernels:
            a, path = accept(trees, target)
            return result + (a, path, target.gather(1, path))
        # the acceptance and the accepted rows' K/V moves in the graph too (padding requests move nothing)
        from flashdraft.kernels.tree_ops import accept_paths  # (GPU only: Triton)

        a, path, committed, src, dst = accept_paths(trees, target, first, m.block_tables, m.block_size)
        self.move_rows(src, dst, kernel=True)
        b.moves_kv = True
        return result + (a, path, committed, torch.cat([a, committed.flatten()]))  # the host's one read
