"""Overlapped DFlash steps (a mixin of DFlashSpeculator): the next verify launched before the last
one is read.

With async scheduling, a step where every request verifies its whole block through the step's graph
is left in flight. When the next step verifies the same requests again, it is launched first, its
inputs derived on the device from the in-flight step's outputs: each block starts one past the
accepted drafts (start + a + 1), its first token the target's token at slot a, its slots read in the
graph from the block tables, which the host filled with pages for the longest block the in-flight
step could leave (start + k + 1 + span). Only then does the host read the in-flight step and commit
it, so the GPU has the next step queued while the host commits, checks stops and streams. A greedy
step's post graph (graphed.py `_post_step`) has already chosen its tokens, accepted and moved the
inputs on by then: the launch is the tables' fill, two replays and one copy to the host. Sampled
steps choose their tokens and move the inputs with eager ops here.

What stays exact: a request that finishes (or is aborted) at step N had rows in step N+1; they are
computed and dropped, never committed, and its pages went back only after N+1 was queued, so
anything that reuses them runs after it on the stream. Pages past a request's committed length are
kept while a step in flight may use them. A hybrid target's recurrent state takes the in-flight step's
accepted rows on the device before the next verify is launched (its commit graph, fed the accepted
counts there). Once requests have left (finished or aborted), the next verify is launched ahead for the
others all the same: their blocks are gathered on the device into the first rows of the graph for as
many requests (`_keep_rows`; a hybrid target's recurrent-state slots follow them, ModelRunner.verify_rows,
and the rows of those that left commit nothing into their freed slots). A waiting
request whose whole prompt fits one step joins likewise (`_launch_joining`): admitted once the next
verify is launched, its prefill queued behind it as a step of its own (a ragged graph, the drafter's
context, the first token chosen on the device), and the verify after that takes its block too, written
into the graph beside the others' (its prompt's end, the prefill's token first). A step whose draft
count differs from the in-flight one's (the profile chose another, gate.py) is launched ahead the same
way: every count's graph holds whole blocks, so the blocks move to the graph of the new count. A token
tree step (tree_step.py) stays in flight too: its acceptance and the accepted rows' K/V moves run on the
device, and the next tree step starts at each accepted path's end, its first token the target's token
there (read as a chain's: the tokens along the path stand in for the verify rows'), its blocks moved to
the tree graph of another bucket when requests left or joined.
Steps the graphs do not cover (ragged steps, the per-request gate) run as before, one at a time, and so
does the step after a probe of the step gate (gate.py): launching a verify behind a probe that then
pauses drafting would cost a whole DFlash step where the probe's read costs the host's time.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from flashdraft.engine.graphs import StepGraph, to_device
from flashdraft.engine.scheduler import kept_rows
from flashdraft.speculative.plan import Plan

if TYPE_CHECKING:
    from flashdraft.engine.engine import InFlight
    from flashdraft.engine.logits import StepLogprobs
    from flashdraft.engine.sequence import Sequence


class VerifyInFlight:
    """A launched whole-step verify not read yet: its plans and graph, its outcome on the device (the
    accepted drafts [S] at 0, the target's tokens [S * (k+1)] at toks_at) and its copy to the host
    behind the step."""

    def __init__(self, plans: list[Plan], graph: StepGraph, outcome: torch.Tensor, toks_at: int,
                 owner: list[int], started: float, whole: bool, logprobs: StepLogprobs | None = None):
        from flashdraft.engine.engine import InFlight  # the engine module imports this one

        self.plans, self.graph, self.outcome, self.toks_at, self.owner = plans, graph, outcome, toks_at, owner
        self.logprobs = logprobs  # raw log-probabilities of the tokens, in their order (engine/logits.py)
        self.seqs = [p.seq for p in plans]
        self.started, self.whole = started, whole  # the step costs' clock: when it began, all requests in it
        self.launched = time.perf_counter()
        self._read = InFlight(self.seqs, outcome)
        self.joining: InFlight | None = None  # requests admitted behind it: their prefill's samples

    @property
    def accepted(self) -> torch.Tensor:
        return self.outcome[: len(self.plans)]

    @property
    def toks(self) -> torch.Tensor:
        return self.outcome[self.toks_at: self.toks_at + len(self.owner)]

    def read(self) -> tuple[list[int], list[int]]:
        """(accepted drafts, the target's tokens) on the host."""
        host = self._read.read()
        return host[: len(self.plans)], host[self.toks_at: self.toks_at + len(self.owner)]


class VerifyOverlap:
    def _may_overlap(self, plans: list[Plan]) -> bool:
        """Whether this graphed whole-step verify may stay in flight (step(): a successor may be
        launched on its outputs)."""
        eng = self.engine
        return (eng.async_scheduling and self._verify_graph is not None and not self.poison_rejected
                and self.min_tau_rule is None and not any(p.seq.params.needs_logits for p in plans))

    def _next_verify(self, prev: VerifyInFlight) -> list[Plan] | None:
        """The plans of the step after the in-flight verify `prev` when it can be launched before prev is
        read: prev's requests in order, less any that left since, then those admitted behind it (their
        prefill in flight), all verifying the count of drafts chosen now through that count's graph (no
        request waiting that could be admitted but not behind a verify, no pause by
        speculative_disable_batch_size or the step gate at the next step of its clock, prev not the
        gate's probe), each with room for the longest block prev (or the prefill) can leave; its pages
        allocated and the clock advanced. None otherwise."""
        eng, sched = self.engine, self.engine.scheduler
        seqs, joining = sched.running, prev.joining.seqs if prev.joining is not None else []
        if not eng.follows(prev) or any(s.params.needs_logits for s in seqs) or \
                (sched.waiting and len(seqs) < sched.max_num_seqs and not self._may_join(sched.waiting[0])):
            return None
        rows = kept_rows(prev.seqs, seqs[: len(seqs) - len(joining)])
        k1, k, bm = prev.plans[0].n, self._verify_count(), eng.block_manager
        if (len(rows) < len(prev.seqs) or joining or k != k1 - 1) and \
                self._graph_of(prev.graph, len(seqs), self._drawn(seqs), k) is None:
            return None  # (the requests or the count changed since prev's launch: its rows move to that graph)
        step, n = self.steps + 1, len(seqs)
        if self.pause_at is not None and n >= self.pause_at:
            return None
        # (a probe's result decides whether the next step drafts: it is read first)
        if self.step_gate is not None and (not self.step_gate.drafts(step) or self.step_gate.probing
                                           or self._times_plain(n)):
            return None
        # prev's longest commit then a block; a request admitted behind prev: its prompt, then a block
        ends = [s.num_computed_tokens + k1 + self.span for s in seqs[: len(rows)]] + \
               [s.num_computed_tokens + self.span for s in joining]
        if any(not s.params.speculative or end > eng.max_model_len for s, end in zip(seqs, ends)) or \
                sum(bm.extra_blocks_for(s.seq_id, end) for s, end in zip(seqs, ends)) > bm.num_free_blocks:
            return None
        for s, end in zip(seqs, ends):
            bm.allocate(s.seq_id, end)
        self.steps, self.num_running, self.paused, self.gated, self.count = step, n, False, False, k
        return [Plan(s, k + 1, i * (k + 1), True) for i, s in enumerate(list(seqs))]

    def _launch_next_verify(self, prev: VerifyInFlight, plans: list[Plan]) -> VerifyInFlight:
        """Queue the verify after `prev` over prev's graph, its inputs derived on the device (the
        module's docstring; the graph derives the slots), then its target tokens and acceptance;
        nothing waits for the GPU. A greedy step's post graph already moved the inputs on."""
        g, k1, S = prev.graph, plans[0].n, len(plans)
        runner = self.engine.runner
        if runner.hybrid:  # prev's accepted rows into the recurrent state, on the device
            take = (prev.accepted + 1).to(torch.int32)
            if S < len(prev.plans):  # requests that left since take nothing: their slots are free
                alive = {id(p.seq) for p in plans}
                take = take * to_device([int(id(s) in alive) for s in prev.seqs], torch.int32, take.device)
            runner.commit_states_from(take)
        if not self._greedy_post(prev.plans, g):  # (a greedy step's post graph moved them on already)
            self._next_blocks(g, prev.accepted, prev.toks.view(len(prev.plans), -1))
        joining = prev.joining.seqs if prev.joining is not None else []
        if S < len(prev.plans) or joining or k1 != prev.plans[0].n:
            # requests left or joined, or another count: the rows to the graph of S requests and k1 - 1 drafts
            old = [p.seq for p in plans[: S - len(joining)]]
            g = self._keep_rows(g, kept_rows(prev.seqs, old), plans, prev.joining)
            if runner.hybrid:  # the state slots of the requests kept, in their new rows
                runner.verify_rows(g, [p.seq for p in plans], self.engine.block_manager)
        g.fill(block_tables=[self.engine.block_manager.table(p.seq.seq_id) for p in plans])
        if g.aux.get("tree"):  # token trees: their acceptance and moves on the device too
            return self._tree_flight(plans, g, time.perf_counter(), True)
        if self._greedy_post(plans, g):
            g.replay()
            owner = [i for i in range(S) for _ in range(k1)]
            return VerifyInFlight(plans, g, self._run_post(g), g.num_seqs, owner, time.perf_counter(), True)
        hidden = g.replay()[: S * k1]
        toks, owner, _ = self._target_tokens(plans, hidden, g.extra["verify_positions"])  # (no logprobs: _next_verify)
        accepted = self._accept(plans, g.extra["verify_ids"], toks)
        return VerifyInFlight(plans, g, torch.cat([accepted, toks]), S, owner, time.perf_counter(), True)

    def _graph_of(self, g: StepGraph, n: int, drawn: bool | None = None, k: int | None = None) -> StepGraph | None:
        """The captured graph of g's whole step (its kind, or the one with drafts drawn when `drawn`; its
        draft count, or k) for n requests."""
        bucket = 1 << (n - 1).bit_length()
        if g.aux.get("tree"):  # token trees keep g's kind: its requests' temperatures are the step's (tree_step.py)
            kind = "dflash-tree-sampled" if "draft_temp" in g.extra else "dflash-tree"
            return self.engine.runner.graphs.get(((kind, self.tap_layers), bucket, self.block_size))
        drawn = "draft_temp" in g.extra if drawn is None else drawn
        k = g.aux["k1"] - 1 if k is None else k
        return self.engine.runner.graphs.get((self.verify_key("dflash-sampled" if drawn else "dflash", k),
                                              bucket, self.block_size))

    def _drawn(self, seqs: list[Sequence]) -> bool:
        """Whether a step of these requests draws its drafts (the graph kind _graphed_forward picks)."""
        return any(self._draws(s) for s in seqs)

    def _keep_rows(self, g: StepGraph, rows: list[int], plans: list[Plan],
                   joining: InFlight | None = None) -> StepGraph:
        """The next blocks of the requests still running (prev's `rows`) moved from g's buffers into
        the first rows of the graph for `plans` (g itself when it is that graph), on the device; then
        the blocks of the requests admitted behind prev (`joining`: each starts at the end of its
        prompt, its first token the prefill's on the device); the sequences past them padding (no
        rows, no stores). Returns that graph."""
        k = plans[0].n - 1 if plans else None  # (none: the warm-up's call, graphed.py)
        to, B, n, S = self._graph_of(g, len(plans), self._drawn([p.seq for p in plans]), k), self.block_size, \
            len(rows), len(plans)
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
            first.fill_(self.mask_token_id)
            first[:, 0] = joining.tokens
        to.fill(query_start_loc=[i * B for i in range(S + 1)])
        if "draft_temp" in to.extra:
            to.fill(draft_temp=[float(p.seq.params.temperature) if self._draws(p.seq) else 0.0 for p in plans],
                    draft_seed=[p.seq.seed for p in plans])
        return to

    def _may_join(self, seq: Sequence) -> bool:
        """Whether a waiting request may be admitted while a step is in flight, its prefill a step of its
        own (_launch_joining): its whole prompt in one step, through a ragged graph, on an attention-only
        target (a hybrid one's recurrent rows are not moved on the device)."""
        eng = self.engine
        return (not eng.runner.hybrid and bool(eng.runner.ragged_graphs) and not seq.params.needs_logits
                and seq.num_tokens - seq.num_computed_tokens <= eng.config.max_num_batched_tokens)

    def _launch_joining(self) -> InFlight | None:
        """Admit the waiting requests whose whole prompt fits now and queue their prefill as a step of
        its own (the target over the prompts and the drafter's context, through a ragged graph; each
        request's first token chosen on the device), their computed tokens moved on as at any launch;
        None when none is admitted."""
        from flashdraft.engine.engine import InFlight  # the engine module imports this one

        eng, sched = self.engine, self.engine.scheduler
        if not sched.waiting or not self._may_join(sched.waiting[0]):
            return None
        batch = sched.admit(reserve=self.span)
        if not batch.seqs:
            return None
        plans, row = [], 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            plans.append(Plan(seq, n, row, False))
            row += n
        hidden, _ = self._forward(plans)
        toks, _, _ = self._target_tokens(plans, hidden)  # (no logprobs: _may_join)
        for p in plans:
            p.seq.num_computed_tokens += p.n
        eng.stats["num_steps"] += 1
        return InFlight(batch.seqs, toks)

    def _greedy_post(self, plans: list[Plan], g: StepGraph | None) -> bool:
        """Whether a whole step over graph g takes its tokens and acceptance from g's post graph
        (graphed.py _post_step): every request greedy."""
        return g is not None and "post" in g.aux and all(p.seq.params.temperature == 0 and not p.seq.params.needs_logits
                                                         for p in plans)

    def _complete_verify(self, prev: VerifyInFlight, ahead: VerifyInFlight | None) -> list[Sequence]:
        """Read an in-flight verify and commit it; `ahead`: the verify launched after it, whose pages
        stay. A request finished or aborted since prev's launch takes nothing."""
        joined = self.engine._complete_joining(prev)  # the requests admitted behind prev: their first token
        accepted, toks = prev.read()
        for p, a in zip(prev.plans, accepted):
            p.accepted = a
        chosen: dict[int, list[int]] = {}
        for i, t in zip(prev.owner, toks):
            chosen.setdefault(i, []).append(t)
        # a step followed by one launched ahead was timed at that launch (the pace of launches)
        self._step_start, self._step_whole = prev.started, prev.whole and ahead is None
        return joined + self._commit(prev.plans, chosen, ahead={id(s) for s in ahead.seqs} if ahead is not None else (),
                                     logprobs=self._logprob_entries(prev.plans, prev.owner, toks, prev.logprobs))
