"""Token-tree steps (a mixin of DFlashSpeculator; the trees themselves are speculative/tree.py).

A chain verifies each draft slot's first choice; a tree of N drafts verifies the N rank paths with the
highest summed log-probability over the block's slot distributions, in one target forward: each row
sits at position start + depth and sees the context and its ancestors' rows. The target's own token
picks, row by row, the child that continues the accepted path (the chain's rule), so the output is
plain decoding's; the accepted rows' K/V then move to their positions' slots. On the fused GPU path a
greedy tree step's construction, acceptance and K/V moves run inside its graph (speculative/tree_triton.py).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from flashdraft.engine.graphs import StepGraph, to_device
from flashdraft.engine.sampler import draw_candidates, greedy_tokens
from flashdraft.engine.sequence import Sequence
from flashdraft.speculative.kv_slots import move_rows, poison_slots, position_slots
from flashdraft.speculative.overlap import VerifyInFlight
from flashdraft.speculative.tree import Trees, accept, build_trees, path_moves, use_kernels

if TYPE_CHECKING:
    from flashdraft.speculative.drafts import Draw
    from flashdraft.speculative.plan import Plan


class TreeSteps:
    def _tree_step(self, plans: list[Plan]) -> list[Sequence]:
        """A step where requests verify token trees: draft and build the trees, one target forward
        over every row (tree rows at their depths' positions, each seeing its ancestors), the
        target's token at every row, the accepted path of each tree; one device->host transfer;
        commit, moving the accepted rows' K/V to their positions' slots. A whole step replayed as a
        graph does all of it on the device (_graphed_tree_step) and may stay in flight (overlap.py)."""
        flight = self._graphed_tree_step(plans)
        if flight is not None:
            if self._may_overlap(plans):  # in flight until the next step() (overlap.py)
                self._inflight = flight
                return []
            return self._complete_verify(flight, None)
        hidden, positions, trees, ids, masks = self._forward_tree(plans)
        verifying = [p for p in plans if p.verify]
        V, N = len(verifying), self.num_draft
        toks, owner, logprobs = self._target_tokens(plans, hidden, positions, ids, masks)
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
        k = 0
        for i, p in enumerate(plans):
            if p.verify:
                p.accepted = host[k]
                p.path = host[V + k * D1: V + (k + 1) * D1][1: p.accepted + 1]
                chosen[i] = host[V + V * D1 + k * D1: V + V * D1 + k * D1 + p.accepted + 1]
                k += 1
        for i, t in zip(owner, host[V + 2 * V * D1:]):
            if not plans[i].verify:
                chosen.setdefault(i, []).append(t)
        entries = self._logprob_entries(plans, owner, host[V + 2 * V * D1:], logprobs)
        if entries is not None:  # a tree's committed tokens are its rows along the accepted path
            for i, p in enumerate(plans):
                if p.verify:
                    entries[i] = [entries[i][r] for r in [0] + p.path]
        return self._commit(plans, chosen, logprobs=entries)

    def _graphed_tree_step(self, plans: list[Plan]) -> VerifyInFlight | None:
        """A step where every request verifies a whole tree, as its graph's replay (None when no graph
        covers it): launched, its outcome left on the device (_tree_flight)."""
        eng, runner = self.engine, self.engine.runner
        seqs = [p.seq for p in plans]
        self._verify_graph = None
        if self.poison_rejected or not all(p.verify and p.n == self.num_draft + 1 for p in plans):
            return None
        blocks = [p.seq.token_ids[-1:] + [self.mask_token_id] * (self.block_size - 1) for p in plans]
        # the target's tokens drawn (or processed) after the replay
        sampled = any(s.params.temperature > 0 or s.params.needs_logits for s in seqs)
        g = runner.filled_graph(("dflash-tree-sampled" if sampled else "dflash-tree", self.tap_layers), seqs, blocks,
                                eng.block_manager, False, self.attn, self._tree_graph_step,
                                setup=self._setup_sampled_tree_graph if sampled else self._setup_tree_graph)
        if g is None:
            return None
        if sampled:
            g.fill(draft_temp=[float(s.params.temperature) if self._draws(s) else 0.0 for s in seqs],
                   draft_seed=[s.seed for s in seqs])
        self._verify_graph = g
        return self._tree_flight(plans, g, self._step_start, self._step_whole)

    def _tree_flight(self, plans: list[Plan], g: StepGraph, started: float, whole: bool) -> VerifyInFlight:
        """Replay the whole tree step of graph g (its inputs filled, or moved on by the step before),
        then, all on the device: the target's tokens of a sampled step, the acceptance (a greedy
        step's is in the graph), the accepted rows' K/V moved to their positions' slots (in the
        graph on the fused GPU path); returns the step in flight, its outcome the accepted drafts [S]
        and the target's tokens along each accepted path [S, D + 1], read as a chain's (overlap.py)."""
        out = g.replay()  # read before any other replay: graphs share one memory pool
        n, N1 = len(plans), self.num_draft + 1
        owner = [i for i in range(n) for _ in range(self.block_size)]  # D + 1 tokens a request
        if g.aux.get("moves_kv", False) and "draft_temp" not in g.extra:  # greedy on the fused path:
            # the graph did it all and packed its outcome ([S] accepted, then [S, D + 1] tokens)
            return VerifyInFlight(plans, g, out[9], g.num_seqs, owner, started, whole)
        trees = Trees(*(t[:n] for t in out[2:6]), self.block_size - 1)
        m = g.meta
        start = m.seq_lens[:n].long() - self.block_size  # each root's position
        logprobs = None
        if "draft_temp" in g.extra:  # sampled: acceptance after the target's draws
            toks, _, logprobs = self._target_tokens(plans, out[0][: n * N1], out[1][: n * N1], g.extra["verify_ids"],
                                                    g.aux["verify_meta"].tree_mask)
            target = toks.view(n, N1)
            if use_kernels(target):
                from flashdraft.speculative.tree_triton import accept_paths

                a, path, committed, src, dst = accept_paths(trees, target, start, m.block_tables[:n], m.block_size)
                self._move_rows(src, dst, kernel=True)
            else:
                a, path = accept(trees, target)
                committed = target.gather(1, path)
                self._move_path(path, a, start, m)
            if logprobs is not None:  # the rows along each accepted path, as `committed`
                logprobs = logprobs.select((path + torch.arange(n, device=path.device)[:, None] * N1).flatten())
        else:
            a, path, committed = (t[:n] for t in out[6:9])
            self._move_path(path, a, start, m)
        return VerifyInFlight(plans, g, torch.cat([a, committed.flatten()]), n, owner, started, whole, logprobs)

    def _move_rows(self, src: torch.Tensor, dst: torch.Tensor, kernel: bool = False) -> None:
        """Every target and draft layer's K/V from slots src to slots dst (kv_slots.move_rows: [S, D] per
        request, -1 none, in speculative/tree_triton.py's kernel when kernel; else flat slot lists)."""
        self.engine.runner.move_kv(src, dst, kernel)
        move_rows(self.k_cache, self.v_cache, src, dst, kernel)

    def _move_path(self, path: torch.Tensor, a: torch.Tensor, start: torch.Tensor, meta) -> None:
        """The accepted rows' K/V to their positions' slots with torch ops (tree.path_moves): off the
        fused GPU path (the selection of the moves waits for the device there)."""
        src, dst = path_moves(path, a, start, meta.block_tables[: path.shape[0]], meta.block_size)
        keep = src >= 0
        self._move_rows(src[keep], dst[keep])

    def _forward_tree(self, plans: list[Plan]) -> tuple[torch.Tensor, torch.Tensor, Trees, torch.Tensor, torch.Tensor]:
        """The trees of the verifying requests (propose_tree), then the target over every row with
        its taps, tree rows at positions start + depth under their ancestor masks, then the context
        K/V of every row into the draft cache (written at the rows' slots: the accepted rows' move
        with the target's at commit). Returns the final hidden states, the rows' positions, the
        trees, and the rows' input ids and ancestor masks."""
        eng, runner = self.engine, self.engine.runner
        seqs = [p.seq for p in plans]
        verifying = [p for p in plans if p.verify]
        trees = self.propose_tree([p.seq for p in verifying])
        tokens = [p.seq.token_ids[-1:] + [self.mask_token_id] * (p.n - 1) if p.verify else
                  p.seq.token_ids[p.seq.num_computed_tokens:][:p.n] for p in plans]
        ids, positions, batch = runner.build_batch(seqs, tokens, eng.block_manager)
        N = trees.size
        dst = [p.row + 1 + i for p in verifying for i in range(p.n - 1)]
        src = [k * N + i for k, p in enumerate(verifying) for i in range(p.n - 1)]
        start = [p.seq.num_computed_tokens for p in verifying for _ in range(p.n - 1)]
        idx = to_device([dst, src, start, [p.row for p in verifying] + [0] * (len(dst) - len(verifying))],
                        torch.long, eng.device)
        ids[idx[0]] = trees.tokens.flatten()[idx[1]]
        positions[idx[0]] = idx[2] + trees.depths.flatten()[idx[1]]
        tree_mask = torch.zeros(ids.shape[0], dtype=torch.long, device=eng.device)
        tree_mask[idx[3, : len(verifying)]] = 1  # the root row sees the context and itself
        tree_mask[idx[0]] = trees.masks()[:, 1:].flatten()[idx[1]]
        batch.tree_mask = tree_mask
        hidden, taps = runner.run(ids, positions, batch, self.tap_layers)
        self._write_context(taps, positions, batch.slot_mapping)
        return hidden, positions, trees, ids, tree_mask

    def propose_tree(self, seqs: list[Sequence]) -> Trees:
        """One non-causal drafter forward over each request's block, then its tree of tree_size
        drafts from every slot's tree_size best candidates (sampler.draw_candidates; sampled
        requests rank them by the draw the target will make)."""
        eng, B = self.engine, self.block_size
        self._flush_context()
        blocks = [[s.token_ids[-1]] + [self.mask_token_id] * (B - 1) for s in seqs]
        ids, pos, batch = eng.runner.build_batch(seqs, blocks, eng.block_manager, causal=False)
        self.attn.prepare(batch, eng.device)
        n = len(seqs)
        hidden = self.drafter(self.embed(ids), pos, self.kv, self.attn, batch)[: n * B]
        draw = None
        if any(self._draws(s) for s in seqs):
            draw = (to_device([float(s.params.temperature) if self._draws(s) else 0.0 for s in seqs], torch.float32,
                              eng.device), to_device([s.seed for s in seqs], torch.int64, eng.device), pos[: n * B])
        trees = self._trees(hidden, n, draw)
        if self.poison_rejected:  # the block's scratch K/V must never be read again
            poison_slots((self.k_cache, self.v_cache), batch.slot_mapping)
        return trees

    def _trees(self, hidden: torch.Tensor, num_seqs: int, draw: Draw | None = None) -> Trees:
        """The drafter's final hidden [S * B, H] -> a tree of tree_size drafts per request, from each
        slot's tree_size best candidates; draw = (temperature [S], seed [S], positions of the block
        rows [S * B]) ranks sampled requests' candidates by the target's draw (sampler.draw_candidates).
        Nothing here reads a value back to the host (graph-safe)."""
        n, B, k = num_seqs, self.block_size, self.block_size - 1
        rows = hidden.view(n, B, -1)[:, 1:].reshape(n * k, -1)
        # greedy ranks by the drafter's own logits (the top-k kernel reads them in the model dtype)
        logits, token_ids = self._slot_logits(rows, float32=draw is not None)
        kw = {}
        if draw is not None:
            temp, seeds, positions = draw
            kw = dict(temperature=temp[:n].repeat_interleave(k), seeds=seeds[:n].repeat_interleave(k),
                      positions=positions[: n * B].view(n, B)[:, 1:].flatten(), token_ids=token_ids)
        logp, cols = draw_candidates(logits, self.num_draft, **kw)
        cand = cols if token_ids is None else token_ids[cols]
        build = build_trees
        if use_kernels(logp):  # one kernel instead of ~70 small ones (speculative/tree_triton.py)
            from flashdraft.speculative.tree_triton import build_trees as build
        return build(logp.view(n, k, -1), cand.view(n, k, -1), self.num_draft)

    def _setup_tree_graph(self, g: StepGraph) -> None:
        """A tree step's verify buffers beside the draft block's: input ids, positions and metadata
        of tree_size + 1 rows per sequence (derived from the block's inside the graph), the tree masks."""
        S, N1, dev = g.num_seqs, self.num_draft + 1, g.device
        g.aux["tree"] = True
        g.aux["row_seq"] = torch.arange(S * self.block_size, device=dev) // self.block_size
        g.aux["block_offsets"] = torch.arange(self.block_size, device=dev)
        g.extra["verify_ids"] = torch.zeros(S * N1, dtype=torch.long, device=dev)
        g.extra["verify_positions"] = torch.zeros(S * N1, dtype=torch.long, device=dev)
        m = g.meta
        meta = replace(m, slot_mapping=torch.full((S * N1,), -1, dtype=torch.long, device=dev),
                       query_start_loc=torch.zeros_like(m.query_start_loc), seq_lens=torch.zeros_like(m.seq_lens),
                       max_query_len=N1, causal=True, tree_mask=torch.zeros(S * N1, dtype=torch.long, device=dev))
        g.aux["verify_meta"] = meta
        g.attn = [(self.attn, m), (self.engine.runner.attn, meta)]

    def _setup_sampled_tree_graph(self, g: StepGraph) -> None:
        self._setup_tree_graph(g)
        self._setup_draw(g)

    def _tree_graph_step(self, g: StepGraph) -> tuple[torch.Tensor, ...]:
        """One tree step over a graph's buffers: g.input_ids holds the draft blocks [x_start, MASK ...]
        at positions start..start+B-1. The verify's slots, lengths and row offsets follow from the
        block's (start = seq_len - B; padding sequences, seq_len 0, get no rows and store nothing).
        Returns the verify's final hidden states and positions [S * (N + 1)] and the trees' tokens,
        parents, depths and valid flags [S, N]; greedy graphs also the acceptance (tree.accept): a [S],
        path [S, D + 1] and the target's tokens along the path [S, D + 1], and with the tree kernels
        those two packed as the outcome the host reads ([S], then [S * (D + 1)]; no op after the
        replay)."""
        m, vm = g.meta, g.aux["verify_meta"]
        S, B, N1 = g.num_seqs, self.block_size, self.num_draft + 1
        kernels = use_kernels(g.positions)
        self._derive_slots(g, kernels)  # the draft block's slots (a step launched ahead fills only its tables)
        if kernels:  # one kernel for the verify's metadata, one for its rows (below), instead of ~30 ops
            from flashdraft.speculative import tree_triton

            first = tree_triton.verify_meta(m.seq_lens, m.block_tables, m.block_size, B, N1, vm.slot_mapping,
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
        hidden = self.drafter(self.embed(g.input_ids), g.positions, self.kv, self.attn, m)
        draw = (g.extra["draft_temp"], g.extra["draft_seed"], g.positions) if "draft_temp" in g.extra else None
        trees = self._trees(hidden, S, draw)
        ids, pos = g.extra["verify_ids"].view(S, N1), g.extra["verify_positions"].view(S, N1)
        if kernels:
            tree_triton.verify_rows(g.input_ids, B, first, trees, ids, pos, vm.tree_mask)
        else:
            ids[:, 0] = g.input_ids.view(S, B)[:, 0]
            ids[:, 1:] = trees.tokens
            pos[:, 0] = start
            pos[:, 1:] = start[:, None] + trees.depths
            vm.tree_mask.copy_(trees.masks().flatten())
        runner = self.engine.runner
        out, taps = runner.model(ids.flatten(), pos.flatten(), runner.kv, runner.attn, vm, self.tap_layers)
        self.drafter.write_context(taps, pos.flatten(), self.kv, self.attn, vm)
        result = (out, pos.flatten(), trees.tokens, trees.parents, trees.depths, trees.valid)
        if draw is not None:  # sampled steps choose the target's tokens after the replay
            return result
        target = greedy_tokens(runner.model.compute_logits(out, float32=False)).view(S, N1)
        if not kernels:
            a, path = accept(trees, target)
            return result + (a, path, target.gather(1, path))
        # the acceptance and the accepted rows' K/V moves in the graph too (padding requests move nothing)
        from flashdraft.speculative.tree_triton import accept_paths

        a, path, committed, src, dst = accept_paths(trees, target, first, m.block_tables, m.block_size)
        self._move_rows(src, dst, kernel=True)
        g.aux["moves_kv"] = True
        return result + (a, path, committed, torch.cat([a, committed.flatten()]))  # the host's one read

    def _path_moves(self, seq: Sequence, start: int, path: list[int]) -> list[tuple[int, int]]:
        """(from slot, to slot) of each accepted tree row whose K/V must move to its position's slot:
        the row at depth d lies at slot start + row, and belongs at slot start + d."""
        moves = [(start + r, start + d) for d, r in enumerate(path, start=1) if r != d]
        src = position_slots(self.engine.block_manager, seq.seq_id, [m[0] for m in moves])
        dst = position_slots(self.engine.block_manager, seq.seq_id, [m[1] for m in moves])
        return list(zip(src, dst))

    def _move_kv(self, moves: list[tuple[int, int]]) -> None:
        """Copy K/V of every target and draft layer between slots (all reads before any write)."""
        self._flush_context()
        idx = to_device([m[0] for m in moves] + [m[1] for m in moves], torch.long, self.engine.device)
        self._move_rows(idx[: len(moves)], idx[len(moves):])
