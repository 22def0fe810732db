"""The DFlash step, for a continuously batched set of requests. Read top to bottom:

1. schedule: the draft policy (policy.py) says how many drafts each decoding request verifies (0: it
   decodes plainly); a verifying request asks for the rows of its block, prefill chunks and plain
   requests as usual. A step where no request drafts decodes, writes the drafter's context and may
   stay in flight.
2. draft: one non-causal drafter forward over `[x_start, MASK x (B-1)]` per verifying request over the
   context K/V of every committed position (drafts.py), the drafts written into the verify's input ids
   on the device.
3. verify: one causal target forward over every scheduled row; its taps' K/V go into the drafter's
   context (context.py; rejected rows' too: the next block rewrites them before anything reads them).
4. accept, on the device: the target's token at every verify slot, chosen as plain decoding chooses it,
   and a = leading drafts equal to the target's token one slot earlier (verify.py). One device->host
   transfer reads them; a step whose every request verifies through its graph may stay in flight, the
   next verify launched on its outputs (ahead.py).
5. commit: t_0..t_a one by one (stops end a request exactly where plain decoding would), pages past the
   committed length freed, a hybrid target's recurrent state moved to the last accepted row.

Its parts: the draft policy, the drafter's context, the draft tokens, the step graphs (graphs.py), the
tree verifier (trees.py: token trees instead of chains) and the steps launched ahead (ahead.py).
"""

from __future__ import annotations

import torch

from flashdraft import settings
from flashdraft.engine.deferred import DeferredChoice, deferred
from flashdraft.engine.graphs import to_device
from flashdraft.engine.logits import choose
from flashdraft.engine.pipeline import Flight, InFlight, StepContext, commit_samples
from flashdraft.engine.scheduler import ScheduledBatch
from flashdraft.engine.sequence import Sequence
from flashdraft.models.dflash_draft import DFlashDraftModel
from flashdraft.speculative import costs as step_costs
from flashdraft.speculative.ahead import VerifyAhead
from flashdraft.speculative.context import DrafterContext
from flashdraft.speculative.drafts import DraftTokens
from flashdraft.speculative.grammar_check import check_outcome, checked
from flashdraft.speculative.grammar_drafts import GrammarDrafts
from flashdraft.speculative.graphs import StepGraphs
from flashdraft.speculative.metrics import SpecStats
from flashdraft.speculative.plan import Committed, Plan, Verified, VerifyFlight
from flashdraft.speculative.policy import DraftPolicy, draft_choices
from flashdraft.speculative.trees import TreeVerifier
from flashdraft.speculative.verify import accept_plans, target_tokens


class DFlashSpeculator:
    def __init__(self, drafter: DFlashDraftModel, ctx: StepContext, draw_sampled: bool = True):
        self.drafter, self.ctx = drafter, ctx
        runner, config = ctx.runner, ctx.config
        self.block_size = drafter.spec.block_size
        self.tap_layers = tuple(drafter.spec.target_layer_ids)
        k = config.num_speculative_tokens
        if k is not None and not 1 <= k <= self.block_size - 1:
            raise ValueError(f"num_speculative_tokens must be in [1, {self.block_size - 1}], got {k}")
        why = "a DFlash2 drafter verifies its chain" if drafter.candidate_selector is not None else \
            "a sliding-window target verifies chains" if any(w for _, w in runner.model.layer_masks) else \
            "a hybrid (recurrent-state) target verifies chains" if runner.hybrid else None
        # token trees (speculative/tree.py): tree_size drafts per verify, at depths up to block_size - 1
        self.tree_size = config.tree_size(runner.device, self.block_size, why)
        self.num_draft = self.tree_size or k or self.block_size - 1  # drafts a verify checks
        self.max_accepted = min(self.num_draft, self.block_size - 1)
        # slots a verifying request holds from its last committed token: the draft block, or the tree's rows
        self.block_slots = max(self.block_size, self.num_draft + 1)
        self.join_reserve = self.block_slots  # (a request admitted behind a step in flight: its first block)
        self.defers = True  # (steps without drafts launched ahead choose after the commit before them)
        drafter.setup(ctx.max_model_len + 2 * self.block_size)
        self.context = DrafterContext(drafter, runner)
        self.drafts = DraftTokens(drafter, runner, self.context, draw_sampled)
        self.graphs = StepGraphs(runner, self.drafts, self.tap_layers, self.num_draft, config.max_num_seqs,
                                 config.max_num_batched_tokens)
        self.trees = TreeVerifier(ctx, self.drafts, self.graphs, self.num_draft) if self.tree_size else None
        # constrained requests' chain drafts walked through their grammars (not DFlash2's selector)
        self.grammar_drafts = GrammarDrafts(self.drafts) if not self.tree_size and \
            drafter.candidate_selector is None else None
        self.stats = SpecStats(self.max_accepted)
        choices = draft_choices(config, self.num_draft, self.trees is not None, runner.hybrid, runner.use_graphs,
                                runner.device)
        self.graphs.compile_and_capture(choices, self.num_draft, self.trees.capture if self.trees else None)
        costs = None
        if config.speculative_min_acceptance_length == "auto" and settings.STEP_GATE:  # the step gate's
            keys = [self.graphs.key("dflash-tree")] if self.trees else [self.graphs.key("dflash", c) for c in choices]
            costs = step_costs.at_start(runner, keys, self.graphs.key("decode"), choices[: len(keys)],
                                        self.block_size, self.trees is not None, config.max_num_seqs)
        self.policy = DraftPolicy(config, runner.device, self.num_draft, self.max_accepted, choices, costs, self.stats)
        self.ahead = VerifyAhead(ctx, self.policy, self.graphs, self.trees, self.block_slots, self.decode)

    def capture(self, choices: tuple[int, ...]) -> None:
        """Capture the step's graphs again (graphs.py), the whole step's for each draft count in `choices`."""
        self.graphs.capture(choices, self.trees.capture if self.trees else None)

    # ---- what the engine reads -------------------------------------------------------------
    def totals(self) -> dict:
        return self.stats.as_dict()

    def request_metrics(self, seq: Sequence) -> dict:
        return seq.spec_stats.as_dict() if seq.spec_stats is not None else {}

    # ---- the pipeline's steps (engine/pipeline.py) ------------------------------------------
    @torch.inference_mode()
    def launch(self) -> Flight | None:
        """1. schedule, then draft, verify and accept: the step launched (the host commits it)."""
        ctx, policy = self.ctx, self.policy
        started = policy.clock()
        policy.begin_step(len(ctx.scheduler.running))
        batch = ctx.scheduler.schedule(lambda s: policy.drafts(s, s.num_tokens - 1 + self.block_slots
                                                               <= ctx.max_model_len))
        ctx.stats["num_preemptions"] += len(batch.preempted)
        if not batch.seqs:
            if not ctx.scheduler.has_unfinished():
                self.context.idle(ctx.block_manager.prefix_caching)
            return None
        plans = self._plans(batch)
        whole = len(plans) == policy.num_running
        if self.trees is not None and any(p.verify for p in plans):
            return self._stays(self.trees.step(plans, started, whole))
        decoding = all(not p.verify and p.n == 1 and p.seq.num_computed_tokens + 1 == p.seq.num_tokens for p in plans)
        if ctx.async_scheduling and decoding:  # a step of decode rows without drafts: in flight
            return self.decode([p.seq for p in plans], [p.seq.token_ids[-1:] for p in plans])
        # drafts never leave the device: drafted, fed to the verify, compared with the target's
        # tokens there; one device->host transfer reads the accepted lengths and the tokens
        # (greedy requests whose only processor is a grammar verify unmasked, checked before the commit:
        # grammar_check.py)
        verified = self.forward(plans)
        g = verified.graph
        if self.graphs.greedy_post(plans, g, checked):  # tokens and acceptance from its post graph
            owner = [i for i in range(len(plans)) for _ in range(plans[0].n)]
            flight = VerifyFlight(plans, self.graphs.run_post(g), g.num_seqs, owner, started, whole, g)
        else:
            toks, owner, logprobs = target_tokens(ctx, plans, verified.hidden, ids=verified.ids, checked=checked)
            accepted = accept_plans(plans, verified.ids, toks)
            outcome = toks if accepted is None else torch.cat([accepted, toks])
            flight = VerifyFlight(plans, outcome, 0 if accepted is None else accepted.shape[0], owner, started,
                                  whole, g, logprobs)
            flight.decoding = decoding
        flight.hidden = verified.hidden
        return self._stays(flight)

    def launch_after(self, prev: Flight) -> Flight | None:
        return self.ahead.launch(prev)

    def may_join(self, seq: Sequence) -> bool:
        """Whether a waiting request may be admitted behind a step in flight: its whole prompt in one
        step, through a ragged graph, on an attention-only target (a hybrid one's recurrent rows are not
        moved on the device)."""
        runner = self.ctx.runner
        return (not runner.hybrid and bool(runner.ragged_graphs) and not seq.params.needs_logits
                and seq.num_tokens - seq.num_computed_tokens <= self.ctx.config.max_num_batched_tokens)

    @torch.inference_mode()
    def prefill(self, batch: ScheduledBatch) -> InFlight:
        """The prefill of requests admitted behind a step in flight, as a step of its own (the target over
        the prompts and the drafter's context, through a ragged graph; each first token chosen on the
        device)."""
        plans, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            plans.append(Plan(seq, n, row, False))
            row += n
        toks, _, _ = target_tokens(self.ctx, plans, self.forward(plans).hidden)  # (no logprobs: may_join)
        for p in plans:
            p.seq.num_computed_tokens += p.n
        self.ctx.stats["num_steps"] += 1
        return InFlight(batch.seqs, toks)

    def _plans(self, batch: ScheduledBatch) -> list[Plan]:
        """Each scheduled request's rows; a verifying request holds pages for its whole draft block, or
        decodes plainly this step."""
        plans, bm = [], self.ctx.block_manager
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            verify = seq.num_tokens - seq.num_computed_tokens == 1 and n > 1
            if verify:  # the draft block spans B positions even when fewer are verified
                need = seq.num_computed_tokens + self.block_slots
                if bm.can_fit(seq.seq_id, need):
                    bm.allocate(seq.seq_id, need)
                else:
                    verify, n = False, 1
            plans.append(Plan(seq, n, 0, verify))
        if self.trees is not None and self.ctx.runner.ragged_graphs and any(p.verify for p in plans) and \
                any(p.seq.num_tokens - p.seq.num_computed_tokens > 1 for p in plans):
            # prefill chunks beside token trees have no graph: such a step ran eagerly, 15-40 ms of host
            # time (the shipped pair: 0.97x plain decoding at 64 requests). The running requests decode
            # without drafts this once, in the ragged graph of decode rows beside prefill chunks; their
            # pages past the row stay theirs for the next step's tree.
            for p in plans:
                if p.verify:
                    p.verify, p.n = False, 1
        row = 0
        for p in plans:
            p.row, row = row, row + p.n
        return plans

    def _stays(self, flight: VerifyFlight) -> VerifyFlight:
        """A whole step replayed from its graph may stay in flight (no per-request gate, no request that
        reads logits); its launch time on the policy's clock."""
        flight.launched = self.policy.clock()
        flight.stays = flight.graph is not None and self.policy.min_tau_rule is None and \
            not any(s.params.needs_logits for s in flight.seqs)
        return flight

    # ---- 2-3. draft and verify -----------------------------------------------------------------
    def forward(self, plans: list[Plan]) -> Verified:
        """Draft (for verifying requests), then the target over every scheduled row with its taps, then
        the context K/V of every row into the draft cache; a step where every request verifies its block
        (or every request decodes) is one graph replay."""
        ctx, runner = self.ctx, self.ctx.runner
        seqs = [p.seq for p in plans]
        verifying = [p for p in plans if p.verify]
        tokens = [p.seq.token_ids[-1:] + [self.drafts.mask_token_id] * (p.n - 1) if p.verify else
                  p.seq.token_ids[p.seq.num_computed_tokens:][:p.n] for p in plans]
        # a walk through the grammars reads the drafts on the host before the verify: not one graph
        walked = self.grammar_drafts is not None and self.grammar_drafts.walked([p.seq for p in verifying])
        whole = None if walked else self.graphs.whole_step(plans, tokens, ctx.block_manager)
        if whole is not None:
            return whole
        drafts = self.propose([p.seq for p in verifying]) if verifying else None
        g = runner.ragged_graph(self.graphs.key("decode"), seqs, tokens, ctx.block_manager) \
            if runner.ragged_graphs else None
        if g is not None:
            ids = g.input_ids
        else:
            ids, positions, batch = runner.build_batch(seqs, tokens, ctx.block_manager, keep=[p.verify for p in plans])
        if verifying:  # the drafts into the verify rows, on the device
            if not isinstance(drafts, torch.Tensor):  # (oracle drafts in tests come as host lists)
                drafts = to_device(drafts, torch.long, ctx.device)
            w = drafts.shape[1]
            dst = [r for p in verifying for r in range(p.row + 1, p.row + p.n)]
            src = [k * w + i for k, p in enumerate(verifying) for i in range(p.n - 1)]
            idx = to_device([dst, src], torch.long, ctx.device)
            ids[idx[0]] = drafts.flatten()[idx[1]]
        if g is not None:
            return Verified(g.replay()[: sum(p.n for p in plans)], ids if verifying else None)
        hidden, taps = runner.run(ids, positions, batch, self.tap_layers)
        self.context.write(taps, positions, batch.slot_mapping)
        return Verified(hidden, ids if verifying else None)

    def propose(self, seqs: list[Sequence]) -> torch.Tensor:
        """Draft B-1 tokens per request in one non-causal drafter forward: [S, B-1] on the device; a
        constrained request's walked through its grammar (grammar_drafts.py)."""
        self.context.flush()
        out = self.graphs.draft_only(seqs, self.ctx.block_manager)
        if out is None:
            hidden, ids, pos, _ = self.drafts.eager(seqs, self.ctx.block_manager)
            out = self.drafts.tokens(hidden, len(seqs), self.drafts.draw_of(seqs, pos), ids), hidden
        drafts, hidden = out
        if self.grammar_drafts is not None and self.grammar_drafts.walked(seqs):
            return self.grammar_drafts.apply(seqs, drafts, hidden)
        return drafts

    def decode(self, seqs: list[Sequence], tokens: list[list[int]], ids: torch.Tensor | None = None,
               defer: bool = False) -> InFlight:
        """Queue a step without drafts (the target over one row a request and the context write) and the
        sampling of every request's next token; nothing waits for the GPU. ids: the rows' token ids already
        on the device, in place of `tokens`; defer: launched ahead, the sampling after the commit before it
        where a request needs its logits (engine/deferred.py)."""
        ctx, runner = self.ctx, self.ctx.runner
        hidden = self.graphs.decode(seqs, tokens, ctx.block_manager, ids)
        if hidden is None:
            rows, positions, batch = runner.build_batch(seqs, tokens, ctx.block_manager)
            if ids is not None:
                rows[: ids.shape[0]] = ids
            hidden, taps = runner.run(rows, positions, batch, self.tap_layers)
            self.context.write(taps, positions, batch.slot_mapping)
        for s in seqs:
            s.num_computed_tokens += 1
        ctx.stats["num_steps"] += 1
        positions = [s.num_computed_tokens for s in seqs]
        sb = runner.sampling_batch(seqs, positions)
        if defer and deferred(seqs):
            return DeferredChoice(runner.model, hidden[: len(seqs)], seqs, positions, sb, ctx.eos_token_ids)
        return InFlight(seqs, *choose(runner.model, hidden[: len(seqs)], seqs, positions, sb, ctx.eos_token_ids),
                        stays=True)

    # ---- 5. commit ----------------------------------------------------------------------------
    def commit(self, flight: Flight, ahead: Flight | None) -> list[Sequence]:
        """Read a launched step and commit it; `ahead`: the step launched after it, whose pages stay."""
        if not isinstance(ahead, InFlight):  # no step without drafts launched ahead: no run of them
            self.policy.last_launch = None
        if isinstance(flight, InFlight):
            advanced = commit_samples(self.ctx, flight)
        else:  # a step followed by one launched ahead was timed at that launch (the pace of launches)
            out = flight.read()
            if flight.hidden is not None and any(checked(p.seq) for p in flight.plans):
                out = check_outcome(self.ctx.runner.model, flight.plans, out, flight.hidden)
            advanced = self._commit(flight.plans, out, flight.started, flight.whole and ahead is None,
                                    flight.decoding, {id(s) for s in ahead.seqs} if ahead is not None else ())
        if not self.ctx.scheduler.has_unfinished():
            self.context.idle(self.ctx.block_manager.prefix_caching)
        return advanced

    def _commit(self, plans: list[Plan], out: Committed, started: float, whole: bool, decoding: bool, ahead=()
                ) -> list[Sequence]:
        """Commit a step's tokens (a request finished or aborted since the step's launch takes none).
        started, whole, decoding: the step's clock (whether it held every running request, and only
        decode rows without drafts); ahead: ids of the requests with a step launched after this one,
        whose block's pages stay."""
        ctx, policy, logprobs = self.ctx, self.policy, out.logprobs or {}
        for p, a in zip([p for p in plans if p.verify], out.accepted):
            p.accepted = a
        advanced, kept, moves, committed, verified = [], [], [], {}, []
        for i, p in enumerate(plans):
            s = p.seq
            if s.is_finished:
                continue
            if not p.verify:
                s.num_computed_tokens += p.n
                if i in out.chosen:
                    ctx.append_tokens(s, out.chosen[i], logprobs.get(i))
                    advanced.append(s)
                continue
            a = p.accepted
            for st in (policy.request_stats(s), self.stats):
                st.record(a, p.n - 1)
            verified.append(a + 1)
            start = s.num_computed_tokens
            s.num_computed_tokens = start + a + 1
            if ctx.runner.hybrid:  # the slot now: a sequence that finishes below gives it back
                committed[ctx.block_manager.slot(s.seq_id)] = a + 1
            ctx.append_tokens(s, out.chosen[i][: a + 1], logprobs.get(i))
            advanced.append(s)
            if not s.is_finished:
                if p.path:
                    moves += self.trees.path_moves(s, start, p.path)
                kept.append((s, a))
        drafts = max((p.n - 1 for p in plans if p.verify), default=0)  # (every verify of a step checks as many)
        if whole and len(verified) == len(plans) and drafts == self.num_draft:  # a whole DFlash step, timed
            policy.observe(True, len(plans), 1e3 * (policy.clock() - started))
        elif whole and decoding:  # a step of decode rows without drafts
            policy.observe(False, len(plans), 1e3 * (policy.clock() - started))
        policy.record_verifies(verified, drafts)
        if not ahead:  # hybrid targets: the accepted rows' state (with a step launched after: on the device)
            ctx.runner.commit_states(committed)
        if moves:  # before freeing what lies past the committed length
            self.trees.move_kv(moves)
        for s, a in kept:
            policy.record_request(s, a + 1)
            ctx.block_manager.truncate(s.seq_id, s.num_computed_tokens + (self.block_slots if id(s) in ahead else 0))
        ctx.stats["num_steps"] += 1
        return advanced
