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
many requests (`_keep_rows`; not for hybrid targets, whose state rows would have to follow). Steps
the graphs do not cover (ragged steps, trees, the per-request gate) run as before, one at a time, and
so does a step whose draft count differs from the in-flight one's, or one a waiting request joins.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from flashdraft.engine.graphs import StepGraph, to_device
from flashdraft.engine.scheduler import kept_rows
from flashdraft.speculative.plan import Plan

if TYPE_CHECKING:
    from flashdraft.engine.sequence import Sequence


class VerifyInFlight:
    """A launched whole-step verify not read yet: its plans and graph, its outcome on the device (the
    accepted drafts [S] at 0, the target's tokens [S * (k+1)] at toks_at) and its copy to the host
    behind the step."""

    def __init__(self, plans: list[Plan], graph: StepGraph, outcome: torch.Tensor, toks_at: int,
                 owner: list[int], started: float, whole: bool):
        from flashdraft.engine.engine import InFlight  # the engine module imports this one

        self.plans, self.graph, self.outcome, self.toks_at, self.owner = plans, graph, outcome, toks_at, owner
        self.seqs = [p.seq for p in plans]
        self.started, self.whole = started, whole  # the step costs' clock: when it began, all requests in it
        self.launched = time.perf_counter()
        self._read = InFlight(self.seqs, outcome)

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
                and self.tree_size is None and self.min_tau_rule is None)

    def _next_verify(self, prev: VerifyInFlight) -> list[Plan] | None:
        """The plans of the step after the in-flight verify `prev` when it can be launched before prev is
        read: the same requests, in order, all verifying whole blocks again (no request waiting that
        could be admitted, no pause by speculative_disable_batch_size or the step gate at the next step
        of its clock, prev not the gate's probe), each with room for the longest block prev can leave;
        its pages allocated and the clock advanced. None otherwise."""
        eng, sched = self.engine, self.engine.scheduler
        seqs, rows = sched.running, kept_rows(prev.seqs, sched.running)
        if rows is None or (sched.waiting and len(seqs) < sched.max_num_seqs):
            return None
        if len(rows) < len(prev.seqs) and (eng.runner.hybrid or self._graph_of(prev.graph, len(rows)) is None):
            return None  # (requests left since prev's launch: its rows move to the graph of fewer)
        step, n = self.steps + 1, len(seqs)
        if self.pause_at is not None and n >= self.pause_at:
            return None
        # (a probe's result decides whether the next step drafts: it is read first)
        if self.step_gate is not None and (not self.step_gate.drafts(step) or self.step_gate.probing
                                           or self._times_plain(n)):
            return None
        k1, bm = prev.plans[0].n, eng.block_manager
        if self._verify_count() != k1 - 1:  # the gate chose another count: the graph changes
            return None
        ends = [s.num_computed_tokens + k1 + self.span for s in seqs]  # prev's longest commit, then a block
        if any(not s.params.speculative or end > eng.max_model_len for s, end in zip(seqs, ends)) or \
                sum(bm.extra_blocks_for(s.seq_id, end) for s, end in zip(seqs, ends)) > bm.num_free_blocks:
            return None
        for s, end in zip(seqs, ends):
            bm.allocate(s.seq_id, end)
        self.steps, self.num_running, self.paused, self.gated, self.count = step, n, False, False, k1 - 1
        return [Plan(s, k1, i * k1, True) for i, s in enumerate(list(seqs))]

    def _launch_next_verify(self, prev: VerifyInFlight, plans: list[Plan]) -> VerifyInFlight:
        """Queue the verify after `prev` over prev's graph, its inputs derived on the device (the
        module's docstring; the graph derives the slots), then its target tokens and acceptance;
        nothing waits for the GPU. A greedy step's post graph already moved the inputs on."""
        g, k1, S = prev.graph, plans[0].n, len(plans)
        if self.engine.runner.hybrid:  # prev's accepted rows into the recurrent state, on the device
            self.engine.runner.commit_states_from((prev.accepted + 1).to(torch.int32))
        if not self._greedy_post(prev.plans, g):  # (a greedy step's post graph moved them on already)
            self._next_blocks(g, prev.accepted, prev.toks.view(len(prev.plans), k1))
        if S < len(prev.plans):  # requests left since prev's launch: the others' rows to the graph of S
            g = self._keep_rows(g, kept_rows(prev.seqs, [p.seq for p in plans]), plans)
        g.fill(block_tables=[self.engine.block_manager.table(p.seq.seq_id) for p in plans])
        if self._greedy_post(plans, g):
            g.replay()
            owner = [i for i in range(S) for _ in range(k1)]
            return VerifyInFlight(plans, g, self._run_post(g), g.num_seqs, owner, time.perf_counter(), True)
        hidden = g.replay()[: S * k1]
        toks, owner = self._target_tokens(plans, hidden, g.extra["verify_positions"])
        accepted = self._accept(plans, g.extra["verify_ids"], toks)
        return VerifyInFlight(plans, g, torch.cat([accepted, toks]), S, owner, time.perf_counter(), True)

    def _graph_of(self, g: StepGraph, n: int) -> StepGraph | None:
        """The captured graph of the same whole step as g (its kind and draft count) for n requests."""
        kind = "dflash-sampled" if "draft_temp" in g.extra else "dflash"
        return self.engine.runner.graphs.get((self.verify_key(kind, g.aux["k1"] - 1), 1 << (n - 1).bit_length(),
                                              self.block_size))

    def _keep_rows(self, g: StepGraph, rows: list[int], plans: list[Plan]) -> StepGraph:
        """The next blocks of the requests still running (prev's `rows`) moved from g's buffers into
        the first rows of the graph for as many requests (g itself when the bucket holds), on the
        device; the sequences past them padding (no rows, no stores). Returns that graph."""
        to, B, n = self._graph_of(g, len(rows)), self.block_size, len(rows)
        index = to_device(rows, torch.long, g.device)
        blocks = [buf.view(-1, B).index_select(0, index) for buf in (g.input_ids, g.positions)]
        lens = g.meta.seq_lens.index_select(0, index)
        for buf, kept in zip((to.input_ids, to.positions), blocks):
            buf.view(-1, B)[:n].copy_(kept)
            buf.view(-1, B)[n:].zero_()
        to.meta.seq_lens[:n].copy_(lens)
        to.meta.seq_lens[n:].zero_()
        to.fill(query_start_loc=[i * B for i in range(n + 1)])
        if "draft_temp" in to.extra:
            to.fill(draft_temp=[float(p.seq.params.temperature) for p in plans], draft_seed=[p.seq.seed for p in plans])
        return to

    def _greedy_post(self, plans: list[Plan], g: StepGraph | None) -> bool:
        """Whether a whole step over graph g takes its tokens and acceptance from g's post graph
        (graphed.py _post_step): every request greedy."""
        return g is not None and "post" in g.aux and all(p.seq.params.temperature == 0 for p in plans)

    def _complete_verify(self, prev: VerifyInFlight, ahead: VerifyInFlight | None) -> list[Sequence]:
        """Read an in-flight verify and commit it; `ahead`: the verify launched after it, whose pages
        stay. A request finished or aborted since prev's launch takes nothing."""
        accepted, toks = prev.read()
        for p, a in zip(prev.plans, accepted):
            p.accepted = a
        chosen: dict[int, list[int]] = {}
        for i, t in zip(prev.owner, toks):
            chosen.setdefault(i, []).append(t)
        # a step followed by one launched ahead was timed at that launch (the pace of launches)
        self._step_start, self._step_whole = prev.started, prev.whole and ahead is None
        return self._commit(prev.plans, chosen, ahead={id(s) for s in ahead.seqs} if ahead is not None else ())
