"""The DFlash step, for a continuously batched set of requests. Read top to bottom:

1. schedule: a decoding request with speculation on asks for B slots (its last committed token,
   still without K/V, plus B-1 drafts); prefill chunks and plain requests ask as usual, and so do
   requests whose acceptance gate has paused their drafts, or all of them while the step gate
   finds that drafts do not pay at this batch size (speculative/gate.py, speculative/costs.py).
   A step where no request drafts skips 2-5: it decodes and writes the context, and with async
   scheduling it stays in flight while the next such step is launched (step()).
2. draft: one non-causal drafter forward over `[x_start, MASK x (B-1)]` per verifying request,
   attending to the context K/V of every committed position; argmax of slots 1..B-1 (sampled
   requests: drawn with the noise the target will draw that position's token with, see
   speculative/drafts.py), written straight into the verify's input ids on the device.
3. verify: one causal target forward over everything scheduled, returning the tapped layers.
4. context: K/V of every verify row goes into the draft cache, from its taps. Rows of drafts
   that turn out rejected are written too: they lie at or past the new committed length, where
   the next draft block (B scratch slots) or verify rewrites them before anything reads them.
   Off CUDA the rows of every step wait, in order, until a draft next reads the cache
   (_write_context): while drafts are paused most of them are never needed.
5. accept, on the device: the target's token at every verify slot (same sampler as plain
   decoding, same (seed, position) noise), a = leading drafts equal to the target's token one
   slot earlier. The step's one device->host transfer reads every a and the tokens; the host
   commits t_0..t_a one by one (stops end the request exactly where plain decoding would) and
   frees target pages past the committed length. A hybrid target's recurrent state, left as it was
   by the verify, becomes the state after the last accepted row (models/hybrid.py).

Beside this file: graphed.py (steps 2-4 as CUDA graphs), overlap.py (with async scheduling, the next
graphed verify launched on the last one's outputs before they are read), tree_step.py (token trees
instead of chains), drafts.py (the drafter's hidden states -> drafts), loader.py (a drafter checked and
loaded).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from flashdraft import config
from flashdraft.attention.base import AttentionBatch, LayerMasks
from flashdraft.engine.graphs import to_device
from flashdraft.engine.logits import Seen, StepLogprobs, choose, prompt_logprobs
from flashdraft.engine.model_runner import make_backend
from flashdraft.engine.sequence import Sequence
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.speculative import costs as step_costs
from flashdraft.speculative.drafts import DraftTokens
from flashdraft.speculative.gate import DepthProfile, StepGate, gate_record
from flashdraft.speculative.graphed import GraphedSteps
from flashdraft.speculative.kv_slots import poison_slots, position_slots
from flashdraft.speculative.metrics import SpecStats
from flashdraft.speculative.overlap import VerifyInFlight, VerifyOverlap
from flashdraft.speculative.plan import Plan
from flashdraft.speculative.tree_step import TreeSteps
from flashdraft.speculative.verify import accepted_lengths, ragged_accepted_lengths

if TYPE_CHECKING:
    from flashdraft.engine.engine import InFlight, LLMEngine

log = logging.getLogger("flashdraft")
CONTEXT_BYTES = 64 << 20  # waiting context taps (off CUDA) written at once even when no draft needs them yet


class DFlashSpeculator(DraftTokens, GraphedSteps, TreeSteps, VerifyOverlap):
    def __init__(self, drafter: DFlashDraftModel, engine: LLMEngine):
        self.drafter = drafter
        self.engine = engine
        self.block_size = drafter.spec.block_size
        k = engine.config.num_speculative_tokens
        if k is not None and not 1 <= k <= self.block_size - 1:
            raise ValueError(f"num_speculative_tokens must be in [1, {self.block_size - 1}], got {k}")
        # token trees (speculative/tree.py): tree_size drafts per verify, at depths up to block_size - 1
        why = "a DFlash2 drafter verifies its chain" if drafter.candidate_selector is not None else \
            "a sliding-window target verifies chains" if any(w for _, w in engine.runner.model.layer_masks) else \
            "a hybrid (recurrent-state) target verifies chains" if engine.runner.hybrid else None
        self.tree_size = engine.config.tree_size(engine.device, self.block_size, why)
        self.num_draft = self.tree_size or k or self.block_size - 1
        self.depth = min(self.num_draft, self.block_size - 1)  # the deepest draft a verify can accept
        # slots a verifying request holds from its last committed token: the draft block, or the tree's rows
        self.span = max(self.block_size, self.num_draft + 1)
        # the draft counts a whole step may verify, each with its graphs: the block's, and where the step
        # gate chooses among measured costs (graphed chains, no count given, an attention-only target)
        # a half and a quarter of it (DepthProfile)
        self.draft_counts = (self.num_draft,)
        if k is None and self.tree_size is None and not engine.runner.hybrid and engine.device.type == "cuda" \
                and engine.runner.use_graphs and engine.config.speculative_min_acceptance_length == "auto" \
                and config.STEP_GATE:
            self.draft_counts += tuple(c for c in (self.num_draft // 2, self.num_draft // 4) if c >= 2)
        self.mask_token_id = drafter.spec.mask_token_id
        self.tap_layers = tuple(drafter.spec.target_layer_ids)
        drafter.setup(engine.max_model_len + 2 * self.block_size)
        runner, c = engine.runner, drafter.config
        shape = (c.num_hidden_layers, runner.k_cache.shape[1], runner.block_size, c.num_key_value_heads,
                 drafter.head_dim)
        self.k_cache = torch.zeros(shape, device=engine.device, dtype=engine.dtype)
        self.v_cache = torch.zeros(shape, device=engine.device, dtype=engine.dtype)
        self.kv = [(self.k_cache[i], self.v_cache[i]) for i in range(c.num_hidden_layers)]
        masks = drafter.spec.layer_masks
        if masks and any(m != (False, None) for m in masks):  # causal or sliding-window drafter layers
            self.attn = LayerMasks(lambda: make_backend(runner.backend_name), masks)
        else:
            self.attn = make_backend(runner.backend_name)
        self.embed = drafter.embed_tokens or runner.model.embed_tokens
        self.stats = SpecStats(self.depth)
        self.poison_rejected = False  # tests: fill every slot a rejected draft touched with NaN
        self.draw_sampled = True  # False: sampled requests draft the argmax too (A/B measurements)
        self.pause_at = engine.config.speculative_disable_batch_size
        self.paused = False  # this step decodes without drafts (too many requests running)
        self.num_running = 0
        self.steps = 0
        self._inflight: InFlight | VerifyInFlight | None = None  # a step not read yet (step())
        self._verify_graph = None  # the graph of this step's whole verify, when one ran it
        # Off CUDA the drafter's context K/V of eager steps waits until it is next needed (a draft, or
        # the drafter's cache slots moved or poisoned), then goes in as one write, the steps' rows
        # in the order they ran: the cache holds then what writing each step at once would have left.
        # While the step gate pauses drafts, most of it is never needed: the rows of requests that
        # end before the next draft are dropped once no request is left (step()). On CUDA every
        # step writes at once (in its graph, where it has one), and so does every step while graphs
        # run off CUDA (the tests' graph harness): a graph's drafter reads the cache as it stands.
        self._defer_context = engine.device.type != "cuda"
        self._context: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # taps, positions, slots
        self._context_bytes = 0
        self._step_start = 0.0  # when this step began (the step costs' clock)
        self._step_whole = False  # every running request has rows in this step
        self._compile_and_capture()
        # the per-request acceptance gate (a number given): its threshold given (running requests,
        # temperature); the step gate (the default) at the break-even tau of the step costs, measured
        # now where graphs are captured, else as they are seen; their clock
        self.min_tau_rule = engine.config.min_acceptance_length(engine.device)
        auto = engine.config.speculative_min_acceptance_length == "auto"
        self.costs = None
        if auto and config.STEP_GATE:
            self.costs = step_costs.measure(self) or step_costs.StepCosts.unmeasured(engine.config.max_num_seqs)
        self.step_gate = StepGate() if self.costs is not None else None
        if self.costs is None or not self.costs.fewer:
            self.draft_counts = self.draft_counts[:1]
        self.profile = DepthProfile(self.draft_counts) if len(self.draft_counts) > 1 else None
        self.count = self.num_draft  # drafts this step's verifies check
        self.seen = step_costs.Observed()  # step costs while serving (the step gate's)
        self._last_launch: float | None = None  # when the last overlapped step without drafts launched
        self.gated = False  # this step decodes without drafts (the step gate)
        if self.costs is not None and self.costs.measured:
            log.info("speculation pays from tau %s at %s running requests (step costs measured at start)",
                     "/".join(f"{self.costs.break_even(b):.2f}" for b in self.costs.batches),
                     "/".join(map(str, self.costs.batches)))
            for k in self.costs.fewer:
                log.info("verifying %d of %d drafts: from tau %s", k, self.num_draft,
                         "/".join(f"{self.costs.break_even(b, k=k):.2f}" for b in self.costs.batches))

    # ---- hooks the engine calls -----------------------------------------------------------
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
        if self.gated or (gate is not None and not gate.drafts(self.steps)):
            for st in (self._stats(seq), self.stats):
                st.gated_steps += 1
            return 0
        return self.count

    def _stats(self, seq: Sequence) -> SpecStats:
        if not hasattr(seq, "spec_stats"):
            seq.spec_stats = SpecStats(self.depth)
        return seq.spec_stats

    # ---- the step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One engine step. With async scheduling, a step in which no request drafts (all paused by
        their gates or by speculative_disable_batch_size) is left in flight, as the engine's plain
        decode steps are (engine.step): when the step after it decodes the same requests without
        drafts too, it is launched first, on the in-flight step's samples on the device, and only
        then are those samples read and committed. A graphed step where every request verifies is
        left in flight the same way, its successor's inputs derived on the device (overlap.py)."""
        advanced = self._overlapped_step()
        if self._context and not self.engine.has_unfinished():
            if self.engine.block_manager.prefix_caching:  # cached pages: a later request's drafts read them
                self._flush_context()
            else:  # no waiting row will be read: a new request's drafts read only positions its steps write
                self._context, self._context_bytes = [], 0
        return advanced

    def _overlapped_step(self) -> list[Sequence]:
        """step() before its end: the in-flight step's successor launched, then the step read, or a new step."""
        prev, self._inflight = self._inflight, None
        if prev is None:
            return self._step()
        last, self._last_launch = self._last_launch, None
        if isinstance(prev, VerifyInFlight):
            plans = self._next_verify(prev)
            if plans is not None:  # launched before prev is read, on prev's outputs on the device
                self._inflight = self._launch_next_verify(prev, plans)
                self._inflight.joining = self._launch_joining()  # waiting requests' prefill behind it
                self.engine.stats["num_overlapped_steps"] += 1
                if self.costs is not None and plans[0].n == prev.plans[0].n == self.num_draft + 1 \
                        and len(plans) == len(prev.plans):  # a whole step's cost: the pace
                    self._observe(True, len(plans), 1e3 * (self._inflight.launched - prev.launched))
            advanced = self._complete_verify(prev, self._inflight)
        else:
            nxt = self._next_paused(prev)
            if nxt is not None:  # launched before prev is read: the GPU never waits on the host
                self._inflight = self._launch_decode(nxt, [[0]] * len(nxt), prev.next_ids(nxt))
                self.engine.stats["num_overlapped_steps"] += 1
                self._last_launch = time.perf_counter()
                if last is not None and self.costs is not None and len(nxt) == len(prev.seqs) \
                        and prev.joining is None:  # a run's pace
                    self._observe(False, len(nxt), 1e3 * (self._last_launch - last))
                self._inflight.joining = self._launch_joining()  # waiting requests' prefill behind it
            advanced = self.engine._complete_joining(prev) + self.engine._complete(prev)
        if self._inflight is not None or not self.engine.has_unfinished():
            return advanced  # (no empty step: the gates' clock counts the steps a sync engine runs)
        return advanced + self._step()

    # ---- the drafter's context ----------------------------------------------------------------
    def _write_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """The context K/V of a step's rows (their taps) at `slots`: now on CUDA or with graphs, else when
        next needed."""
        if not self._defer_context or self.engine.runner.use_graphs:
            self._store_context(taps, positions, slots)
            return
        self._context.append((taps, positions, slots))
        self._context_bytes += taps.numel() * taps.element_size()
        if self._context_bytes >= CONTEXT_BYTES:
            self._flush_context()

    def _flush_context(self) -> None:
        """Write every waiting step's context rows, in the order the steps ran."""
        if self._context:
            taps, positions, slots = (torch.cat(x) for x in zip(*self._context))
            self._context, self._context_bytes = [], 0
            self._store_context(taps, positions, slots)

    def _store_context(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        store = AttentionBatch(slots, [], [], [], self.engine.runner.block_size)  # store-only: slots
        self.drafter.write_context(taps, positions, self.kv, self.attn, store)

    def _next_paused(self, prev: InFlight) -> list[Sequence] | None:
        """The requests of the step after the in-flight `prev` when that step decodes all of them
        without drafts (engine._next_decode's conditions, and no request drafting at the next step
        of the gates' clock); the clock advanced to it. None otherwise."""
        sched = self.engine.scheduler
        if not self.engine.follows(prev) or any(s.params.needs_logits for s in sched.running):
            return None  # (prev's requests, less any gone since, then joiners; processors read prev's tokens)
        step, n = self.steps + 1, len(sched.running)
        paused = self.pause_at is not None and n >= self.pause_at
        whole = self._gated(step, n)
        gated = [s for s in sched.running
                 if s.params.speculative and s.num_tokens + self.span <= self.engine.max_model_len]
        if not (paused or whole) and any(getattr(s, "spec_gate", None) is None or s.spec_gate.drafts(step)
                                         for s in gated):
            return None
        seqs = self.engine._next_decode(prev, join=True)  # (prev's requests less any gone, then joiners)
        if seqs is None:
            return None
        self.steps, self.num_running, self.paused, self.gated = step, n, paused, whole
        self.stats.paused_steps += paused
        if not paused:
            rows = {id(s) for s in seqs}
            for s in gated:
                if id(s) in rows:
                    for st in (self._stats(s), self.stats):
                        st.gated_steps += 1
        return seqs

    def _observe(self, spec: bool, n: int, ms: float) -> None:
        """A step's cost seen while serving (whole DFlash steps or steps without drafts, n requests)."""
        self.seen.add(self.seen.spec if spec else self.seen.plain, self.costs.bucket(n), ms, self.costs.measured)

    def _verify_count(self) -> int:
        """Drafts a request's verify checks in the next step: the profile's count, the whole block
        for the step gate's probe."""
        if self.profile is None or self.step_gate.probing:
            return self.num_draft
        return self.profile.count

    def _gated(self, step: int, n: int) -> bool:
        """Whether engine step `step`, n requests running, decodes without drafts by the step gate:
        paused, or timing the pace of steps without drafts (costs.Observed)."""
        if self.step_gate is None:
            return False
        if not self.step_gate.drafts(step):
            return True
        if self._times_plain(n):
            i = self.costs.bucket(max(n, 1))
            self.seen.tries[i] = self.seen.tries.get(i, 0) + 1
            return True
        return False

    def _times_plain(self, n: int) -> bool:
        """Whether steps without drafts run now to time their pace (costs.Observed) with n requests.
        With graph costs measured at start, only where the pace can change the gate's decision: once
        the batch's tau is known and below the break-even that counts the DFlash step's observed cost
        against the plain graph's (timing the plain pace can only lower it). A batch that drains
        through every bucket (requests ending one by one) would otherwise decode up to max_tries
        steps without drafts in each, drafts paying or not."""
        i = self.costs.bucket(max(n, 1))
        if not self.seen.wants_plain(i):
            return False
        if self.costs.measured and self.costs.plain_ms[i] > 0:
            gate = self.step_gate
            worst = max(self.costs.spec_ms[i], self.seen.spec.get(i, 0.0)) / self.costs.plain_ms[i]
            if self.profile is not None:  # at the count the gate's tau is for
                worst *= self.costs.break_even(n, k=self.profile.best) / self.costs.break_even(n)
            return gate.verifies > 0 and gate.tau < worst
        return True

    def _launch_decode(self, seqs: list[Sequence], tokens: list[list[int]], ids: torch.Tensor | None = None
                       ) -> InFlight:
        """Queue a step without drafts (the target over one row a request and the context write)
        and the sampling of every request's next token; nothing waits for the GPU. ids: the rows'
        token ids already on the device, in place of `tokens`."""
        from flashdraft.engine.engine import InFlight  # the engine module imports this one

        eng, runner = self.engine, self.engine.runner
        out = runner.graphed(("decode", self.tap_layers), seqs, tokens, eng.block_manager, True, runner.attn,
                             self._decode_step, input_ids=ids)
        if out is not None:
            hidden = out[0]
        else:
            rows, positions, batch = runner.build_batch(seqs, tokens, eng.block_manager)
            if ids is not None:
                rows[: ids.shape[0]] = ids
            hidden, taps = runner.run(rows, positions, batch, self.tap_layers)
            self._write_context(taps, positions, batch.slot_mapping)
        for s in seqs:
            s.num_computed_tokens += 1
        eng.stats["num_steps"] += 1
        positions = [s.num_computed_tokens for s in seqs]
        sb = runner.sampling_batch(seqs, positions)
        return InFlight(seqs, *choose(runner.model, hidden[: len(seqs)], seqs, positions, sb, eng.eos_token_ids))

    def _step(self) -> list[Sequence]:
        eng = self.engine
        start = time.perf_counter()
        self.steps += 1
        self.num_running = len(eng.scheduler.running)
        self.paused = self.pause_at is not None and self.num_running >= self.pause_at
        self.gated = self._gated(self.steps, self.num_running)
        self.count = self._verify_count()
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
            plans.append(Plan(seq, n, 0, verify))
        if self.tree_size is not None and eng.runner.ragged_graphs and any(p.verify for p in plans) and \
                any(p.seq.num_tokens - p.seq.num_computed_tokens > 1 for p in plans):
            # prefill chunks beside token trees have no graph: such a step ran eagerly, 15-40 ms of
            # host time (the shipped pair: 0.97x plain decoding at 64 requests). The running
            # requests decode without drafts this once, in the ragged graph of decode rows beside
            # prefill chunks; their pages past the row stay theirs for the next step's tree. (A large
            # target's long chunk takes as long on the GPU as that host time: there the running
            # requests give up one step's drafts, never more than plain decoding would.)
            for p in plans:
                if p.verify:
                    p.verify, p.n = False, 1
        row = 0
        for p in plans:
            p.row = row
            row += p.n
        self._step_start, self._step_whole = start, len(plans) == self.num_running
        if self.tree_size is not None and any(p.verify for p in plans):
            return self._tree_step(plans)
        decoding = all(not p.verify and p.n == 1 and p.seq.num_computed_tokens + 1 == p.seq.num_tokens
                       for p in plans)
        if eng.async_scheduling and not self.poison_rejected and decoding:
            # a step of decode rows without drafts: in flight until the next step() (step's docstring)
            self._inflight = self._launch_decode([p.seq for p in plans], [p.seq.token_ids[-1:] for p in plans])
            return []
        # drafts never leave the device: drafted, fed to the verify, compared with the target's
        # tokens there; one device->host transfer reads the accepted lengths and the tokens
        hidden, ids = self._forward(plans)
        logprobs = None
        if self._greedy_post(plans, self._verify_graph):  # tokens and acceptance from its post graph
            k1 = plans[0].n
            owner = [i for i in range(len(plans)) for _ in range(k1)]
            g = self._verify_graph
            flight = VerifyInFlight(plans, g, self._run_post(g), g.num_seqs, owner, start, self._step_whole)
        else:
            toks, owner, logprobs = self._target_tokens(plans, hidden, ids=ids)
            accepted = self._accept(plans, ids, toks)
            flight = None
            if self._verify_graph is not None:
                flight = VerifyInFlight(plans, self._verify_graph, torch.cat([accepted, toks]), len(plans), owner,
                                        start, self._step_whole, logprobs)
        if flight is not None:
            if self._may_overlap(plans):  # in flight until the next step() (overlap.py)
                self._inflight = flight
                return []
            return self._complete_verify(flight, None)
        host = [] if toks is None else (toks if accepted is None else torch.cat([accepted, toks])).tolist()
        verifying = [p for p in plans if p.verify]
        for p, a in zip(verifying, host):
            p.accepted = a
        chosen: dict[int, list[int]] = {}
        for i, t in zip(owner, host[len(verifying):]):
            chosen.setdefault(i, []).append(t)
        advanced = self._commit(plans, chosen, logprobs=self._logprob_entries(plans, owner, host[len(verifying):],
                                                                              logprobs))
        if self.costs is not None and self._step_whole and decoding:  # a step of decode rows without drafts
            self._observe(False, len(plans), 1e3 * (time.perf_counter() - start))
        return advanced

    def _forward(self, plans: list[Plan]) -> tuple[torch.Tensor, torch.Tensor | None]:
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
        self._verify_graph = None
        tokens = [p.seq.token_ids[-1:] + [self.mask_token_id] * (p.n - 1) if p.verify else
                  p.seq.token_ids[p.seq.num_computed_tokens:][:p.n] for p in plans]
        if not self.poison_rejected:
            out = self._graphed_forward(plans, tokens)
            if out is not None:
                return out
        drafts = self.propose([p.seq for p in verifying]) if verifying else None
        g = None
        if not self.poison_rejected and runner.ragged_graphs:
            g = runner.ragged_graph(("decode", self.tap_layers), seqs, tokens, eng.block_manager)
        if g is not None:
            ids = g.input_ids
        else:
            ids, positions, batch = runner.build_batch(seqs, tokens, eng.block_manager,
                                                       keep=[p.verify for p in plans])
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
        self._write_context(taps, positions, batch.slot_mapping)
        return hidden, ids if verifying else None

    def propose(self, seqs: list[Sequence]) -> torch.Tensor:
        """Draft B-1 tokens per request in one non-causal drafter forward: [S, B-1] on the device.
        Greedy requests draft the argmax; sampled ones draw with their temperature and the noise of
        their (seed, position), as the target will (speculative/drafts.py)."""
        eng, B = self.engine, self.block_size
        self._flush_context()
        blocks = [[s.token_ids[-1]] + [self.mask_token_id] * (B - 1) for s in seqs]
        sampled = any(self._draws(s) for s in seqs)
        if not self.poison_rejected:
            drafts = self._graphed_drafts(seqs, blocks, sampled)
            if drafts is not None:
                return drafts
        ids, pos, batch = eng.runner.build_batch(seqs, blocks, eng.block_manager, causal=False)
        self.attn.prepare(batch, eng.device)
        n = len(seqs)
        hidden = self.drafter(self.embed(ids), pos, self.kv, self.attn, batch)[: n * B]  # no padding rows
        draw = None
        if sampled:  # greedy steps need neither temperatures nor seeds
            draw = (to_device([float(s.params.temperature) for s in seqs], torch.float32, eng.device),
                    to_device([s.seed for s in seqs], torch.int64, eng.device), pos[: n * B])
        draft = self._draft_tokens(hidden, n, draw, ids)
        if self.poison_rejected:  # the block's scratch K/V must never be read again
            poison_slots((self.k_cache, self.v_cache), batch.slot_mapping)
        return draft

    # ---- choose and accept ------------------------------------------------------------------
    def _target_tokens(self, plans: list[Plan], hidden: torch.Tensor, row_positions: torch.Tensor | None = None,
                       ids: torch.Tensor | None = None, tree_masks: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor | None, list[int], StepLogprobs | None]:
        """The target's tokens on the device (every verify slot of a verifying request, the last
        row of other requests that reach their end), the plan index of each, and their raw
        log-probabilities when a request asks for them (engine/logits.py). row_positions: every
        row's position on the device (token trees: a row's token is drawn for its position + 1).
        ids, tree_masks: every row's input id and (trees) ancestor mask on the device, for the
        processors of a verify row, which count the drafts on its path as output."""
        rows, seqs, positions, owner = [], [], [], []
        seen = Seen([], [], ids, [] if tree_masks is not None else None)
        for i, p in enumerate(plans):
            s, start = p.seq, p.seq.num_computed_tokens
            if s.prompt_logprobs is not None and not p.verify:
                prompt_logprobs(self.engine.runner.model, hidden[p.row: p.row + p.n], s, start)
            if p.verify:
                width = p.n
                if s.params.penalizes:
                    if ids is None:  # (every path that verifies a penalized request passes them)
                        raise RuntimeError("a penalized request's verify rows need the step's input ids")
                    for j in range(p.n):  # row j counts the drafts of rows 1..j (a tree: of its ancestors)
                        for d in range(1, p.n if tree_masks is not None else j + 1):
                            seen.rows.append(len(rows) + j)
                            seen.src.append(p.row + d)
                            if tree_masks is not None:
                                seen.weights.append((p.row + j, d))
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
            return None, owner, None
        eng = self.engine
        sb = eng.runner.sampling_batch(seqs, positions)
        if len(rows) < hidden.shape[0]:  # rows ascend: as many as hidden has means all of them
            picked = to_device(rows, torch.long, eng.device)
            hidden = hidden[picked]
        else:
            picked = slice(None)
        drawn_at: list[int] | torch.Tensor = positions
        if row_positions is not None:
            drawn_at = row_positions[picked][: len(rows)] + 1
            if not sb.all_greedy:
                sb.positions = drawn_at
        if seen.weights:  # each tree pair counts where the row's ancestor mask has the draft row's bit
            at = to_device([list(x) for x in zip(*seen.weights)], torch.long, eng.device)
            seen.weights = tree_masks[at[0]].bitwise_right_shift(at[1]).bitwise_and(1)
        toks, logprobs = choose(eng.runner.model, hidden, seqs, drawn_at, sb, eng.eos_token_ids,
                                seen if seen.rows else None)
        return toks, owner, logprobs

    def _logprob_entries(self, plans: list[Plan], owner: list[int], toks: list[int],
                         logprobs: StepLogprobs | None) -> dict[int, list] | None:
        """The host's TokenLogprob entries of a step's chosen tokens `toks` (read), by plan index, in the
        order of its tokens; None when no request asked for them."""
        if logprobs is None:
            return None
        out: dict[int, list] = {}
        for i, e in zip(owner, logprobs.read(toks, [plans[i].seq for i in owner])):
            out.setdefault(i, []).append(e)
        return out

    def _accept(self, plans: list[Plan], ids: torch.Tensor | None, toks: torch.Tensor) -> torch.Tensor | None:
        """Accepted drafts of each verifying request, [V] on the device: the leading verify inputs
        (the drafts the target was fed) equal to the target's token one slot earlier."""
        verifying = [p for p in plans if p.verify]
        if not verifying:
            return None
        if len(verifying) == len(plans) and all(p.n == plans[0].n for p in plans):  # rows [S, n], all sampled
            n = plans[0].n
            return accepted_lengths(ids[: len(plans) * n].view(-1, n)[:, 1:], toks.view(-1, n))
        rows, first = [], 0  # ragged: (first draft row in ids, first target token in toks, drafts) each
        for p in plans:
            if p.verify:
                rows.append((p.row + 1, first, p.n - 1))
            first += p.n if p.verify else int(p.seq.num_computed_tokens + p.n == p.seq.num_tokens)
        return ragged_accepted_lengths(ids, toks, rows)

    def _commit(self, plans: list[Plan], chosen: dict[int, list[int]], ahead=(),
                logprobs: dict[int, list] | None = None) -> list[Sequence]:
        """Commit a step's tokens (a request finished or aborted since the step's launch takes none);
        ahead: ids of the requests with a step launched after this one, whose block's pages stay;
        logprobs: the tokens' TokenLogprob entries by plan, as `chosen`, where requests asked for them."""
        logprobs = logprobs or {}
        eng = self.engine
        advanced, kept, moves, committed, verified = [], [], [], {}, []
        for i, p in enumerate(plans):
            s = p.seq
            if s.is_finished:
                continue
            if not p.verify:
                s.num_computed_tokens += p.n
                if i in chosen:
                    eng.append_tokens(s, chosen[i], logprobs.get(i))
                    advanced.append(s)
                continue
            target, a = chosen[i], p.accepted
            for st in (self._stats(s), self.stats):
                st.record(a, p.n - 1)
            verified.append(a + 1)
            start = s.num_computed_tokens
            s.num_computed_tokens = start + a + 1
            if eng.runner.hybrid:  # the slot now: a sequence that finishes below gives it back
                committed[eng.block_manager.slot(s.seq_id)] = a + 1
            eng.append_tokens(s, target[: a + 1], logprobs.get(i))
            advanced.append(s)
            if not s.is_finished:
                if p.path:
                    moves += self._path_moves(s, start, p.path)
                kept.append((s, start + p.n, a))
        drafts = max((p.n - 1 for p in plans if p.verify), default=0)  # (every verify of a step checks as many)
        if self.costs is not None and self._step_whole and len(verified) == len(plans) and drafts == self.num_draft:
            # a whole DFlash step, host and device, timed before the gate reads it
            self._observe(True, len(plans), 1e3 * (time.perf_counter() - self._step_start))
        if self.step_gate is not None and verified:
            n = max(self.num_running, 1)
            if self.profile is None:
                self.step_gate.record(sum(verified) / len(verified), self.steps, self.costs.break_even(n, self.seen),
                                      len(verified))
            else:  # the profile averages and picks the count; the gate pauses where none pays
                self.profile.record([a - 1 for a in verified], drafts, self.step_gate.probing)
                tau, min_tau = self.profile.choose(lambda k: self.costs.break_even(n, self.seen, k), self.steps)
                # a probe verifies the whole block (_verify_count): its price sizes the pauses
                probe = (self.profile.tau(self.num_draft), self.costs.break_even(n, self.seen))
                self.step_gate.record(tau, self.steps, min_tau, len(verified), averaged=True, probe=probe)
        if not ahead:  # hybrid targets: the accepted rows' state (with a step launched after: on the device)
            eng.runner.commit_states(committed)
        if moves:  # before poisoning or freeing what lies past the committed length
            self._move_kv(moves)
        for s, end, a in kept:
            min_tau = self.min_tau_rule and self.min_tau_rule(max(self.num_running, 1), s.params.temperature)
            if min_tau is not None:
                gate_record(s, a + 1, self.steps, min_tau)
            if self.poison_rejected:
                self._poison_tail(s, end)
            eng.block_manager.truncate(s.seq_id, s.num_computed_tokens + (self.span if id(s) in ahead else 0))
        eng.stats["num_steps"] += 1
        return advanced

    def _poison_tail(self, seq: Sequence, end: int) -> None:
        """Tests: NaN into the target's and the drafter's K/V at every slot past the committed length."""
        self._flush_context()
        slots = position_slots(self.engine.block_manager, seq.seq_id, range(seq.num_computed_tokens, end))
        r, idx = self.engine.runner, to_device(slots, torch.long, self.engine.device)
        poison_slots((r.k_cache, r.v_cache, self.k_cache, self.v_cache), idx)
