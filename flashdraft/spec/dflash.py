"""The DFlash step, for a continuously batched set of requests. Read top to bottom:

1. schedule: a decoding request with speculation on asks for B slots (its last committed token,
   still without K/V, plus B-1 drafts); prefill chunks and plain requests ask as usual, and so do
   requests whose acceptance gate has paused their drafts (spec/gate.py).
2. draft: one non-causal drafter forward over `[x_start, MASK x (B-1)]` per verifying request,
   attending to the context K/V of every committed position; argmax of slots 1..B-1 (sampled
   requests: drawn with the noise the target will draw that position's token with, see
   sampler.draw_drafts), written straight into the verify's input ids on the device.
3. verify: one causal target forward over everything scheduled, returning the tapped layers.
4. context: K/V of every verify row goes into the draft cache, from its taps. Rows of drafts
   that turn out rejected are written too: they lie at or past the new committed length, where
   the next draft block (B scratch slots) or verify rewrites them before anything reads them.
5. accept, on the device: the target's token at every verify slot (same sampler as plain
   decoding, same (seed, position) noise), a = leading drafts equal to the target's token one
   slot earlier. The step's one device->host transfer reads every a and the tokens; the host
   commits t_0..t_a one by one (stops end the request exactly where plain decoding would) and
   frees target pages past the committed length.

With CUDA graphs, a step where every request verifies (or every request decodes) replays steps
2-4 as one graph over metadata built once for the step; ragged steps (prefill chunks beside
verifies) replay the draft blocks alone as a graph of their batch bucket, then steps 3-4 as a
graph of their (sequences, rows) bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flashdraft.attention.base import AttentionBatch
from flashdraft.engine.graphs import StepGraph, to_device
from flashdraft.engine.model_runner import WARM_ROWS, make_backend
from flashdraft.engine.sampler import draw_candidates, draw_drafts, greedy_tokens, sample
from flashdraft.engine.sequence import Sequence
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.models.loader import load_weights
from flashdraft.models.transformer import fused_enabled
from flashdraft.spec.formats import read_draft_spec
from flashdraft.spec.gate import AcceptanceGate
from flashdraft.spec.metrics import SpecStats
from flashdraft.spec.tree import Trees, accept, build_trees, use_kernels
from flashdraft.spec.verify import accepted_lengths

if TYPE_CHECKING:
    from flashdraft.engine.engine import LLMEngine


def load_drafter(folder: str | Path, target_config, device: torch.device, dtype: torch.dtype) -> DFlashDraftModel:
    """Load and validate a drafter against its target; errors name the mismatch."""
    folder = Path(folder).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"drafter path {str(folder)!r} does not exist")
    if not folder.is_dir():
        raise ValueError(f"drafter path {str(folder)!r} must be a folder with config.json and safetensors")
    n_target = target_config.num_hidden_layers
    spec = read_draft_spec(folder, n_target)
    h_draft, h_target = spec.layer_config.hidden_size, target_config.hidden_size
    if h_draft != h_target:
        raise ValueError(f"drafter hidden_size {h_draft} does not match the target's {h_target}")
    bad = [i for i in spec.target_layer_ids if not 0 <= i < n_target]
    if bad:
        raise ValueError(f"drafter tap layer id(s) {bad} outside the target's {n_target} layers")
    if not 0 <= spec.mask_token_id < target_config.vocab_size:
        raise ValueError(f"drafter mask_token_id {spec.mask_token_id} is outside the target vocabulary "
                         f"[0, {target_config.vocab_size})")
    spec.layer_config.vocab_size = target_config.vocab_size
    weights = load_weights(folder)
    has_embed = "embed_tokens.weight" in weights
    has_head = "lm_head.weight" in weights
    if spec.draft_vocab_size and not has_head:
        raise ValueError(f"drafter declares draft_vocab_size {spec.draft_vocab_size} but ships no lm_head")
    if has_embed and weights["embed_tokens.weight"].shape[0] != target_config.vocab_size:
        raise ValueError("drafter embed_tokens rows do not match the target vocabulary")
    with torch.device("meta"):
        model = DFlashDraftModel(spec, has_embed, has_head)
    model = model.to_empty(device=device).to(dtype)
    if model.d2t is not None:
        model.d2t = torch.zeros_like(model.d2t, dtype=torch.long)
    model.load(weights)
    return model.eval().requires_grad_(False)


def load_speculator(draft: str | Path, engine: LLMEngine) -> DFlashSpeculator:
    model = load_drafter(draft, engine.model_config, engine.device, engine.dtype)
    return DFlashSpeculator(model, engine)


@dataclass
class _Plan:
    seq: Sequence
    n: int  # rows the target computes this step
    row: int  # first row of this request in the flattened batch
    verify: bool  # the rows are [x_start, d_1 .. d_{n-1}]: a draft block under verification
    accepted: int = 0  # leading drafts the target agreed with
    path: list[int] | None = None  # token trees: the verify rows of the accepted drafts to move, by depth


class DFlashSpeculator:
    def __init__(self, drafter: DFlashDraftModel, engine: LLMEngine):
        self.drafter = drafter
        self.engine = engine
        self.block_size = drafter.spec.block_size
        k = engine.config.num_speculative_tokens
        if k is not None and not 1 <= k <= self.block_size - 1:
            raise ValueError(f"num_speculative_tokens must be in [1, {self.block_size - 1}], got {k}")
        # token trees (spec/tree.py): tree_size drafts per verify, at depths up to block_size - 1
        self.tree_size = engine.config.tree_size(engine.device, self.block_size)
        self.num_draft = self.tree_size or k or self.block_size - 1
        depth = min(self.num_draft, self.block_size - 1)  # the deepest draft a verify can accept
        # slots a verifying request holds from its last committed token: the draft block, or the tree's rows
        self.span = max(self.block_size, self.num_draft + 1)
        self.mask_token_id = drafter.spec.mask_token_id
        self.tap_layers = tuple(drafter.spec.target_layer_ids)
        drafter.setup(engine.max_model_len + 2 * self.block_size)
        runner = engine.runner
        c = drafter.config
        shape = (c.num_hidden_layers, runner.k_cache.shape[1], runner.block_size, c.num_key_value_heads,
                 drafter.head_dim)
        self.k_cache = torch.zeros(shape, device=engine.device, dtype=engine.dtype)
        self.v_cache = torch.zeros(shape, device=engine.device, dtype=engine.dtype)
        self.kv = [(self.k_cache[i], self.v_cache[i]) for i in range(c.num_hidden_layers)]
        self.attn = make_backend(engine.runner.backend_name)
        self.embed = drafter.embed_tokens or runner.model.embed_tokens
        self.depth = depth
        self.stats = SpecStats(depth)
        self.poison_rejected = False  # tests: fill every slot a rejected draft touched with NaN
        self.draw_sampled = True  # False: sampled requests draft the argmax too (A/B measurements)
        self.pause_at = engine.config.speculative_disable_batch_size
        self.paused = False  # this step decodes without drafts (too many requests running)
        # the per-request acceptance gate: its threshold given (running requests, temperature), its clock
        self.min_tau_rule = engine.config.min_acceptance_length(engine.device)
        self.num_running = 0
        self.steps = 0
        if runner.backend_name == "triton" and engine.device.type == "cuda":  # ragged steps draft eagerly
            from flashdraft.attention.triton_paged import compile_variants

            compile_variants(c.num_attention_heads, c.num_key_value_heads, drafter.head_dim, runner.block_size,
                             engine.dtype, engine.device, causal=False)
            if self.tree_size is not None:  # the target's attention under tree masks
                t = engine.model_config
                compile_variants(t.num_attention_heads, t.num_key_value_heads, runner.model.head_dim,
                                 runner.block_size, engine.dtype, engine.device, tree=True)
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
            self._draft_tokens(hidden, n // B)
            ones = torch.ones(n // B, device=pos.device)
            self._draft_tokens(hidden, n // B, (ones, ones.long(), pos))

    def capture_graphs(self) -> None:
        """Capture before serving, at every batch bucket: the whole DFlash step (draft, drafts into
        the verify input, verify, context write) as one graph, and the decode step that still
        writes the context (paused speculation, one-token prompts, requests near max_model_len),
        and for ragged steps (prefill chunks beside verify blocks) the draft blocks alone and the
        target with the context write over (sequences, rows) buckets."""
        runner, n = self.engine.runner, self.engine.config.max_num_seqs
        if self.tree_size is not None:  # whole tree steps; ragged ones (prefill chunks beside trees) run eagerly
            runner.capture_graphs(("dflash-tree", self.tap_layers), self.block_size, False, self.attn,
                                  self._tree_graph_step, n, setup=self._setup_tree_graph)
            runner.capture_graphs(("dflash-tree-sampled", self.tap_layers), self.block_size, False, self.attn,
                                  self._tree_graph_step, n, setup=self._setup_sampled_tree_graph)
            runner.capture_graphs(("decode", self.tap_layers), 1, True, runner.attn, self._decode_step, n)
            runner.capture_ragged_graphs(("decode", self.tap_layers), self._decode_step, n,
                                         self.engine.config.max_num_batched_tokens)
            return
        runner.capture_graphs(("dflash", self.tap_layers), self.block_size, False, self.attn, self._graph_step, n,
                              setup=self._setup_graph)
        runner.capture_graphs(("dflash-sampled", self.tap_layers), self.block_size, False, self.attn,
                              self._graph_step, n, setup=self._setup_sampled_graph)
        runner.capture_graphs(("decode", self.tap_layers), 1, True, runner.attn, self._decode_step, n)
        runner.capture_ragged_graphs(("decode", self.tap_layers), self._decode_step, n,
                                     self.engine.config.max_num_batched_tokens)
        runner.capture_graphs(("draft", self.tap_layers), self.block_size, False, self.attn, self._draft_step, n)
        runner.capture_graphs(("draft-sampled", self.tap_layers), self.block_size, False, self.attn,
                              self._sampled_draft_step, n, setup=self._setup_draw)

    # ---- public hooks used by the engine ----------------------------------------------------
    def totals(self) -> dict:
        return self.stats.as_dict()

    def request_metrics(self, seq: Sequence) -> dict:
        st = getattr(seq, "spec_stats", None)
        return st.as_dict() if st is not None else {}

    def release(self, seq: Sequence) -> None:
        """Nothing to free: draft K/V lives in the target's pages, freed with them."""

    def lookahead(self, seq: Sequence) -> int:
        """Draft slots a decoding request verifies this step (0: a plain decode step)."""
        if self.paused or not seq.params.speculative or \
                seq.num_tokens - 1 + self.span > self.engine.max_model_len:
            return 0
        gate = getattr(seq, "spec_gate", None)
        if gate is not None and not gate.drafts(self.steps):
            for st in (self._stats(seq), self.stats):
                st.gated_steps += 1
            return 0
        return self.num_draft

    def _stats(self, seq: Sequence) -> SpecStats:
        if not hasattr(seq, "spec_stats"):
            seq.spec_stats = SpecStats(self.depth)
        return seq.spec_stats

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        eng = self.engine
        self.steps += 1
        self.num_running = len(eng.scheduler.running)
        self.paused = self.pause_at is not None and self.num_running >= self.pause_at
        self.stats.paused_steps += self.paused
        batch = eng.scheduler.schedule(self.lookahead)
        eng.stats["num_preemptions"] += len(batch.preempted)
        if not batch.seqs:
            return []
        plans = []
        bm = eng.block_manager
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            verify = seq.num_tokens - seq.num_computed_tokens == 1 and n > 1
            if verify:  # the draft block spans B positions even when fewer are verified
                need = seq.num_computed_tokens + self.span
                if bm.can_fit(seq.seq_id, need):
                    bm.allocate(seq.seq_id, need)
                else:  # no page for the block: plain decoding for this request this step
                    verify, n = False, 1
            plans.append(_Plan(seq, n, 0, verify))
        row = 0
        for p in plans:
            p.row = row
            row += p.n
        if self.tree_size is not None and any(p.verify for p in plans):
            return self._tree_step(plans)
        # drafts never leave the device: drafted, fed to the verify, compared with the target's
        # tokens there; one device->host transfer reads the accepted lengths and the tokens
        hidden, ids = self._forward(plans)
        toks, owner = self._target_tokens(plans, hidden)
        accepted = self._accept(plans, ids, toks)
        host = [] if toks is None else (toks if accepted is None else torch.cat([accepted, toks])).tolist()
        verifying = [p for p in plans if p.verify]
        for p, a in zip(verifying, host):
            p.accepted = a
        chosen: dict[int, list[int]] = {}
        for i, t in zip(owner, host[len(verifying):]):
            chosen.setdefault(i, []).append(t)
        return self._commit(plans, chosen)

    def _forward(self, plans: list[_Plan]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft (for verifying requests), then the target over every scheduled row with its taps,
        then the context K/V of every row into the draft cache. Returns the target's final hidden
        states and the verify's input ids on the device (None when no request verifies).

        Every row's context is written, rejected drafts' rows included: those positions lie at or
        past the new committed length, so the next step's draft block (B scratch slots from there)
        or verify rewrites them before anything reads them. Acceptance is thus not needed until the
        step's end, and a step where every request verifies B rows (or every request decodes) is
        one graph replay."""
        eng, runner = self.engine, self.engine.runner
        seqs = [p.seq for p in plans]
        verifying = [p for p in plans if p.verify]
        tokens = [p.seq.token_ids[-1:] + [self.mask_token_id] * (p.n - 1) if p.verify else
                  p.seq.token_ids[p.seq.num_computed_tokens:][:p.n] for p in plans]
        if not self.poison_rejected and len(verifying) in (0, len(plans)):
            if verifying and all(p.n == self.num_draft + 1 for p in plans):
                blocks = [t + [self.mask_token_id] * (self.block_size - len(t)) for t in tokens]
                drawn = any(self._draws(s) for s in seqs)  # the same step with drafts drawn in the graph
                g = runner.filled_graph(("dflash-sampled" if drawn else "dflash", self.tap_layers), seqs, blocks,
                                        eng.block_manager, False, self.attn, self._graph_step,
                                        setup=self._setup_sampled_graph if drawn else self._setup_graph)
                if g is not None:
                    if drawn:
                        g.fill(draft_temp=[float(s.params.temperature) for s in seqs],
                               draft_seed=[s.seed for s in seqs])
                    return g.replay()[: len(plans) * plans[0].n], g.extra["verify_ids"]
            elif not verifying:
                out = runner.graphed(("decode", self.tap_layers), seqs, tokens, eng.block_manager, True,
                                     runner.attn, self._decode_step)
                if out is not None:
                    return out[0], None
        drafts = self.propose([p.seq for p in verifying]) if verifying else None
        g = None
        if not self.poison_rejected and runner.ragged_graphs:
            g = runner.ragged_graph(("decode", self.tap_layers), seqs, tokens, eng.block_manager)
        if g is not None:
            ids = g.input_ids
        else:
            ids, positions, batch = runner.build_batch(seqs, tokens, eng.block_manager)
        if verifying:  # the drafts into the verify rows, on the device
            if not isinstance(drafts, torch.Tensor):  # tests propose host lists
                drafts = to_device(drafts, torch.long, eng.device)
            w = drafts.shape[1]
            dst = [r for p in verifying for r in range(p.row + 1, p.row + p.n)]
            src = [k * w + i for k, p in enumerate(verifying) for i in range(p.n - 1)]
            idx = to_device([dst, src], torch.long, eng.device)
            ids[idx[0]] = drafts.flatten()[idx[1]]
        if g is not None:
            return g.replay()[: sum(p.n for p in plans)], ids if verifying else None
        hidden, taps = runner.run(ids, positions, batch, self.tap_layers)
        store = AttentionBatch(batch.slot_mapping, [], [], [], batch.block_size)  # store-only: slots
        self.drafter.write_context(taps, positions, self.kv, self.attn, store)
        return hidden, ids if verifying else None

    def propose(self, seqs: list[Sequence]) -> torch.Tensor:
        """Draft B-1 tokens per request in one non-causal drafter forward: [S, B-1] on the device.
        Greedy requests draft the argmax; sampled ones draw with their temperature and the noise of
        their (seed, position), as the target will (sampler.draw_drafts)."""
        eng, B = self.engine, self.block_size
        blocks = [[s.token_ids[-1]] + [self.mask_token_id] * (B - 1) for s in seqs]
        sampled = any(self._draws(s) for s in seqs)
        if sampled:  # greedy steps need neither
            temps, seeds = [float(s.params.temperature) for s in seqs], [s.seed for s in seqs]
        if not self.poison_rejected:
            if sampled:
                g = eng.runner.filled_graph(("draft-sampled", self.tap_layers), seqs, blocks, eng.block_manager,
                                            False, self.attn, self._sampled_draft_step, setup=self._setup_draw)
                if g is not None:
                    g.fill(draft_temp=temps, draft_seed=seeds)
            else:
                g = eng.runner.filled_graph(("draft", self.tap_layers), seqs, blocks, eng.block_manager, False,
                                            self.attn, self._draft_step)
            if g is not None:  # read before any other replay: graphs share one memory pool
                return g.replay()[: len(seqs)]
        ids, pos, batch = eng.runner.build_batch(seqs, blocks, eng.block_manager, causal=False)
        self.attn.prepare(batch, eng.device)
        n = len(seqs)
        hidden = self.drafter(self.embed(ids), pos, self.kv, self.attn, batch)[: n * B]  # no padding rows
        draw = None
        if sampled:
            draw = (to_device(temps, torch.float32, eng.device), to_device(seeds, torch.int64, eng.device),
                    pos[: n * B])
        draft = self._draft_tokens(hidden, n, draw)
        if self.poison_rejected:  # the block's scratch K/V must never be read again
            self._poison(self.k_cache, self.v_cache, batch.slot_mapping)
        return draft

    def _draws(self, seq: Sequence) -> bool:
        return self.draw_sampled and seq.params.temperature > 0

    def _draft_tokens(self, hidden: torch.Tensor, num_seqs: int,
                      draw: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The drafter's final hidden [S * B, H] -> drafts of slots 1..B-1, [S, B-1]: the argmax, or
        with draw = (temperature [S], seed [S], positions of the block rows [S * B]) each slot drawn
        with the noise the target's sampler uses at that slot's position (temperature 0: argmax)."""
        B, d2t = self.block_size, self.drafter.d2t
        hidden = hidden.view(num_seqs, B, -1)[:, 1:]
        if draw is None:
            if self.drafter.lm_head is None:
                return greedy_tokens(self.engine.runner.model.compute_logits(hidden, float32=False))  # no f32 copy
            draft = greedy_tokens(self.drafter.lm_head(hidden))
            return draft + d2t[draft] if d2t is not None else draft
        temp, seeds, positions = draw
        rows = hidden.reshape(-1, hidden.shape[-1])
        token_ids = None
        if self.drafter.lm_head is None:
            logits = self.engine.runner.model.compute_logits(rows, float32=True)
        else:
            logits = self.drafter.lm_head(rows).float()
            if d2t is not None:  # column j of the drafter's vocabulary is target token j + d2t[j]
                token_ids = torch.arange(logits.shape[1], device=logits.device) + d2t
        k = B - 1
        draft = draw_drafts(logits, temp[:num_seqs, None].expand(num_seqs, k).flatten(),
                            seeds[:num_seqs, None].expand(num_seqs, k).flatten(),
                            positions.view(num_seqs, B)[:, 1:].flatten(), token_ids).view(num_seqs, k)
        return draft + d2t[draft] if d2t is not None else draft

    # ---- token trees (spec/tree.py) ---------------------------------------------------------
    def _tree_step(self, plans: list[_Plan]) -> list[Sequence]:
        """A step where requests verify token trees: draft and build the trees, one target forward
        over every row (tree rows at their depths' positions, each seeing its ancestors), the
        target's token at every row, the accepted path of each tree; one device->host transfer;
        commit, moving the accepted rows' K/V to their positions' slots. A greedy step replayed as a
        graph brings its acceptance along (_tree_graph_step), and on the fused GPU path its K/V moves."""
        hidden, positions, trees, accepted = self._forward_tree(plans)
        verifying = [p for p in plans if p.verify]
        V, N = len(verifying), self.num_draft
        moved = False  # the accepted rows' K/V already at their positions' slots
        if accepted is not None:
            (a, path, committed, moved), toks, owner = accepted, hidden.new_zeros(0, dtype=torch.long), []
        else:
            toks, owner = self._target_tokens(plans, hidden, positions)
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
                rows = host[V + k * D1: V + (k + 1) * D1]
                p.path = None if moved else rows[1: p.accepted + 1]
                chosen[i] = host[V + V * D1 + k * D1: V + V * D1 + k * D1 + p.accepted + 1]
                k += 1
        for i, t in zip(owner, host[V + 2 * V * D1:]):
            if not plans[i].verify:
                chosen.setdefault(i, []).append(t)
        return self._commit(plans, chosen)

    def _forward_tree(self, plans: list[_Plan]) -> tuple[torch.Tensor, torch.Tensor, Trees, tuple | None]:
        """The trees of the verifying requests (propose_tree), then the target over every row with
        its taps, tree rows at positions start + depth under their ancestor masks, then the context
        K/V of every row into the draft cache (written at the rows' slots: the accepted rows' move
        with the target's at commit). Returns the final hidden states, the rows' positions, the trees,
        and for a greedy step replayed as a graph its acceptance (a, path, committed tokens, and whether
        the graph moved the accepted rows' K/V already; else None)."""
        eng, runner = self.engine, self.engine.runner
        seqs = [p.seq for p in plans]
        verifying = [p for p in plans if p.verify]
        if not self.poison_rejected and len(verifying) == len(plans) and all(p.n == self.num_draft + 1 for p in plans):
            blocks = [p.seq.token_ids[-1:] + [self.mask_token_id] * (self.block_size - 1) for p in plans]
            drawn = any(self._draws(s) for s in seqs)
            g = runner.filled_graph(("dflash-tree-sampled" if drawn else "dflash-tree", self.tap_layers), seqs, blocks,
                                    eng.block_manager, False, self.attn, self._tree_graph_step,
                                    setup=self._setup_sampled_tree_graph if drawn else self._setup_tree_graph)
            if g is not None:
                if drawn:
                    g.fill(draft_temp=[float(s.params.temperature) if self._draws(s) else 0.0 for s in seqs],
                           draft_seed=[s.seed for s in seqs])
                out = g.replay()  # read before any other replay: graphs share one memory pool
                n, rows = len(plans), len(plans) * plans[0].n
                trees = Trees(*(t[:n] for t in out[2:6]), self.block_size - 1)
                accepted = None if drawn else tuple(t[:n] for t in out[6:]) + (g.aux.get("moves_kv", False),)
                return out[0][:rows], out[1][:rows], trees, accepted
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
        store = AttentionBatch(batch.slot_mapping, [], [], [], batch.block_size)  # store-only: slots
        self.drafter.write_context(taps, positions, self.kv, self.attn, store)
        return hidden, positions, trees, None

    def propose_tree(self, seqs: list[Sequence]) -> Trees:
        """One non-causal drafter forward over each request's block, then its tree of tree_size
        drafts from every slot's tree_size best candidates (sampler.draw_candidates; sampled
        requests rank them by the draw the target will make)."""
        eng, B = self.engine, self.block_size
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
            self._poison(self.k_cache, self.v_cache, batch.slot_mapping)
        return trees

    def _trees(self, hidden: torch.Tensor, num_seqs: int,
               draw: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> Trees:
        """The drafter's final hidden [S * B, H] -> a tree of tree_size drafts per request, from each
        slot's tree_size best candidates; draw = (temperature [S], seed [S], positions of the block
        rows [S * B]) ranks sampled requests' candidates by the target's draw (sampler.draw_candidates).
        Nothing here reads a value back to the host (graph-safe)."""
        n, B, k = num_seqs, self.block_size, self.block_size - 1
        rows = hidden.view(n, B, -1)[:, 1:].reshape(n * k, -1)
        token_ids, d2t = None, self.drafter.d2t
        if self.drafter.lm_head is None:
            logits = self.engine.runner.model.compute_logits(rows, float32=True)
        else:
            logits = self.drafter.lm_head(rows).float()
            if d2t is not None:  # column j of the drafter's vocabulary is target token j + d2t[j]
                token_ids = torch.arange(logits.shape[1], device=logits.device) + d2t
        kw = {}
        if draw is not None:
            temp, seeds, positions = draw
            kw = dict(temperature=temp[:n].repeat_interleave(k), seeds=seeds[:n].repeat_interleave(k),
                      positions=positions[: n * B].view(n, B)[:, 1:].flatten(), token_ids=token_ids)
        logp, cols = draw_candidates(logits, self.num_draft, **kw)
        cand = cols if token_ids is None else token_ids[cols]
        build = build_trees
        if use_kernels(logp):  # one kernel instead of ~70 small ones (spec/tree_triton.py)
            from flashdraft.spec.tree_triton import build_trees as build
        return build(logp.view(n, k, -1), cand.view(n, k, -1), self.num_draft)

    def _setup_tree_graph(self, g: StepGraph) -> None:
        """A tree step's verify buffers beside the draft block's: input ids, positions and metadata
        of tree_size + 1 rows per sequence (derived from the block's inside the graph), the tree masks."""
        S, N1, dev = g.num_seqs, self.num_draft + 1, g.device
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
        path [S, D + 1] and the target's tokens along the path [S, D + 1]."""
        m, vm = g.meta, g.aux["verify_meta"]
        S, B, N1 = g.num_seqs, self.block_size, self.num_draft + 1
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
        if not use_kernels(out):
            a, path = accept(trees, target)
            return result + (a, path, target.gather(1, path))
        # the acceptance and the accepted rows' K/V moves in the graph too (padding requests move nothing)
        from flashdraft.spec.tree_triton import accept_paths, move_slots

        a, path, committed, src, dst = accept_paths(trees, target, torch.where(real, start, -1), m.block_tables,
                                                    m.block_size)
        move_slots(runner.k_cache, runner.v_cache, src, dst)
        move_slots(self.k_cache, self.v_cache, src, dst)
        g.aux["moves_kv"] = True
        return result + (a, path, committed)

    def _path_moves(self, seq: Sequence, start: int, path: list[int]) -> list[tuple[int, int]]:
        """(from slot, to slot) of each accepted tree row whose K/V must move to its position's slot:
        the row at depth d lies at slot start + row, and belongs at slot start + d."""
        bs = self.engine.block_manager.block_size
        table = self.engine.block_manager.table(seq.seq_id)
        slot = lambda q: table[q // bs] * bs + q % bs  # noqa: E731
        return [(slot(start + r), slot(start + d)) for d, r in enumerate(path, start=1) if r != d]

    def _move_kv(self, moves: list[tuple[int, int]]) -> None:
        """Copy K/V of every target and draft layer between slots (all reads before any write)."""
        idx = to_device([m[0] for m in moves] + [m[1] for m in moves], torch.long, self.engine.device)
        src, dst = idx[: len(moves)], idx[len(moves):]
        r = self.engine.runner
        for cache in (r.k_cache, r.v_cache, self.k_cache, self.v_cache):
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
            flat[:, dst] = flat[:, src]

    # ---- the graphed steps: functions of a StepGraph's static buffers ------------------------
    def _setup_graph(self, g: StepGraph) -> None:
        """The verify's own buffers beside the draft block's: its input ids, and positions and
        metadata that are the draft's when it verifies all B rows (else derived in the graph)."""
        S, B, k1, dev = g.num_seqs, self.block_size, self.num_draft + 1, g.device
        g.extra["verify_ids"] = torch.zeros(S * k1, dtype=torch.long, device=dev)
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
        S, B, k1 = g.num_seqs, self.block_size, self.num_draft + 1
        vm, pos, ids = g.aux["verify_meta"], g.extra["verify_positions"], g.extra["verify_ids"]
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

    def _draft_step(self, g: StepGraph) -> torch.Tensor:
        """The draft blocks alone over a graph's buffers: [S, B-1] drafts."""
        return self._draft_tokens(self.drafter(self.embed(g.input_ids), g.positions, self.kv, self.attn, g.meta),
                                  g.num_seqs)

    def _setup_sampled_graph(self, g: StepGraph) -> None:
        self._setup_graph(g)
        self._setup_draw(g)

    def _setup_draw(self, g: StepGraph) -> None:
        """The sampled draft graph's per-sequence temperature and seed buffers."""
        g.extra["draft_temp"] = torch.zeros(g.num_seqs, dtype=torch.float32, device=g.device)
        g.extra["draft_seed"] = torch.zeros(g.num_seqs, dtype=torch.int64, device=g.device)

    def _sampled_draft_step(self, g: StepGraph) -> torch.Tensor:
        """The draft blocks of sampled requests over a graph's buffers: [S, B-1] drawn drafts."""
        hidden = self.drafter(self.embed(g.input_ids), g.positions, self.kv, self.attn, g.meta)
        return self._draft_tokens(hidden, g.num_seqs, (g.extra["draft_temp"], g.extra["draft_seed"], g.positions))

    def _decode_step(self, g: StepGraph) -> torch.Tensor:
        """A step without drafts over a graph's buffers: the target, then every row's context."""
        runner = self.engine.runner
        hidden, taps = runner.model(g.input_ids, g.positions, runner.kv, runner.attn, g.meta, self.tap_layers)
        self.drafter.write_context(taps, g.positions, self.kv, self.attn, g.meta)
        return hidden

    # ---- choose and accept ------------------------------------------------------------------
    def _target_tokens(self, plans: list[_Plan], hidden: torch.Tensor,
                       row_positions: torch.Tensor | None = None) -> tuple[torch.Tensor | None, list[int]]:
        """The target's tokens on the device (every verify slot of a verifying request, the last
        row of other requests that reach their end) and the plan index of each. row_positions: every
        row's position on the device (token trees: a row's token is drawn for its position + 1)."""
        rows, seqs, positions, owner = [], [], [], []
        for i, p in enumerate(plans):
            s, start = p.seq, p.seq.num_computed_tokens
            if p.verify:
                width = p.n
            elif start + p.n == s.num_tokens:
                width = 1
            else:
                continue  # a prefill chunk that does not reach the end samples nothing
            first = p.row + p.n - width
            rows.extend(range(first, first + width))
            positions.extend(range(start + p.n - width + 1, start + p.n + 1))
            seqs.extend([s] * width)
            owner.extend([i] * width)
        if not rows:
            return None, owner
        eng = self.engine
        sb = eng.runner.sampling_batch(seqs, positions)
        if len(rows) < hidden.shape[0]:  # rows ascend: as many as hidden has means all of them
            picked = to_device(rows, torch.long, eng.device)
            hidden = hidden[picked]
        else:
            picked = slice(None)
        if row_positions is not None and not sb.all_greedy:
            sb.positions = row_positions[picked][: len(rows)] + 1
        return sample(eng.runner.model.compute_logits(hidden, float32=not sb.all_greedy), sb), owner

    def _accept(self, plans: list[_Plan], ids: torch.Tensor | None, toks: torch.Tensor) -> torch.Tensor | None:
        """Accepted drafts of each verifying request, [V] on the device: the leading verify inputs
        (the drafts the target was fed) equal to the target's token one slot earlier."""
        verifying = [p for p in plans if p.verify]
        if not verifying:
            return None
        if len(verifying) == len(plans) and all(p.n == plans[0].n for p in plans):  # rows [S, n], all sampled
            n = plans[0].n
            return accepted_lengths(ids[: len(plans) * n].view(-1, n)[:, 1:], toks.view(-1, n))
        # ragged: gather each request's drafts and tokens into [V, w] rows, padding that never matches
        w = max(p.n for p in verifying) - 1
        pad_d, pad_t = ids.shape[0], toks.shape[0]
        d_idx, t_idx, first = [], [], 0
        for p in plans:
            if p.verify:
                d_idx.append([p.row + 1 + i if i < p.n - 1 else pad_d for i in range(w)])
                t_idx.append([first + i if i < p.n - 1 else pad_t for i in range(w + 1)])
            first += p.n if p.verify else int(p.seq.num_computed_tokens + p.n == p.seq.num_tokens)
        idx = to_device([d for row in d_idx for d in row] + [t for row in t_idx for t in row], torch.long,
                        ids.device)
        dev_ids = torch.cat([ids, ids.new_full((1,), -1)])[idx[: len(d_idx) * w]].view(-1, w)
        dev_toks = torch.cat([toks, toks.new_full((1,), -2)])[idx[len(d_idx) * w:]].view(-1, w + 1)
        return accepted_lengths(dev_ids, dev_toks)

    def _commit(self, plans: list[_Plan], chosen: dict[int, list[int]]) -> list[Sequence]:
        eng = self.engine
        advanced, kept, moves = [], [], []
        for i, p in enumerate(plans):
            s = p.seq
            if not p.verify:
                s.num_computed_tokens += p.n
                if i in chosen:
                    eng.append_tokens(s, chosen[i])
                    advanced.append(s)
                continue
            target, a = chosen[i], p.accepted
            for st in (self._stats(s), self.stats):
                st.record(a, p.n - 1)
            start = s.num_computed_tokens
            s.num_computed_tokens = start + a + 1
            eng.append_tokens(s, target[: a + 1])
            advanced.append(s)
            if not s.is_finished:
                if p.path:
                    moves += self._path_moves(s, start, p.path)
                kept.append((s, start + p.n, a))
        if moves:  # before poisoning or freeing what lies past the committed length
            self._move_kv(moves)
        for s, end, a in kept:
            if self.min_tau_rule is not None:
                self._gate(s, a + 1)
            if self.poison_rejected:
                self._poison_tail(s, end)
            eng.block_manager.truncate(s.seq_id, s.num_computed_tokens)
        eng.stats["num_steps"] += 1
        return advanced

    def _gate(self, seq: Sequence, committed: int) -> None:
        min_tau = self.min_tau_rule(max(self.num_running, 1), seq.params.temperature)
        if min_tau is not None:
            if not hasattr(seq, "spec_gate"):
                seq.spec_gate = AcceptanceGate()
            seq.spec_gate.record(committed, self.steps, min_tau)

    # ---- test support: make any read of rejected state visible ----------------------------
    def _poison_tail(self, seq: Sequence, end: int) -> None:
        bm, bs = self.engine.block_manager, self.engine.block_manager.block_size
        table = bm.table(seq.seq_id)
        slots = [table[q // bs] * bs + q % bs for q in range(seq.num_computed_tokens, end)]
        idx = to_device(slots, torch.long, self.engine.device)
        r = self.engine.runner
        self._poison(r.k_cache, r.v_cache, idx)
        self._poison(self.k_cache, self.v_cache, idx)

    @staticmethod
    def _poison(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
        slots = slots[slots >= 0]  # not the padding rows' -1
        for cache in (k_cache, v_cache):
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
            flat[:, slots] = float("nan")
