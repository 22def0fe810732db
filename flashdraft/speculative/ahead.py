"""DFlash steps launched before the step in flight is read (engine/pipeline.py launches them).

After a step without drafts in flight, the next one decodes the same requests without drafts again
when the draft policy says so: launched on the in-flight step's samples on the device.

After a whole-step verify in flight (every request verifying its block through the step's graph), the
next verify of the same requests is launched first, its inputs derived on the device from the
in-flight step's outputs: each block starts one past the accepted drafts (start + a + 1), its first
token the target's token at slot a, its slots read in the graph from the block tables, which the host
filled with pages for the longest block the in-flight step could leave (start + k + 1 + block slots).
A greedy step's post graph (graphs.py) has already chosen its tokens, accepted and moved the inputs on
by then: the launch is the tables' fill, two replays and one copy to the host. Sampled steps choose
their tokens and move the inputs with eager ops here.

Pages past a request's committed length are kept while a step in flight may use them. A hybrid
target's recurrent state takes the in-flight step's accepted rows on the device before the next verify
is launched (its commit graph, fed the accepted counts there). Once requests have left (finished or
aborted), the next verify is launched ahead for the others all the same: their blocks are gathered on
the device into the first rows of the graph for as many requests (StepGraphs.keep_rows; a hybrid
target's recurrent-state slots follow them, ModelRunner.verify_rows, and the rows of those that left
commit nothing into their freed slots). A request admitted behind the step in flight (the pipeline's
join) gets its block written into the graph beside the others' (its prompt's end, the prefill's token
first). A step whose draft count differs from the in-flight one's (the policy chose another) is
launched ahead the same way: every count's graph holds whole blocks, so the blocks move to the graph of
the new count. A token-tree step stays in flight too: its acceptance and the accepted rows' K/V moves
run on the device, and the next tree step starts at each accepted path's end (trees.py).
Steps the graphs do not cover (ragged steps, the per-request gate) run one at a time, and so does the
step after a probe of the step gate (gate.py): launching a verify behind a probe that then pauses
drafting would cost a whole DFlash step where the probe's read costs the host's time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashdraft.engine.decode import decode_rows
from flashdraft.engine.deferred import deferred
from flashdraft.engine.graphs import to_device
from flashdraft.engine.pipeline import Flight, InFlight, StepContext, kept_rows
from flashdraft.speculative.graphs import StepGraphs
from flashdraft.speculative.plan import Plan, VerifyFlight
from flashdraft.speculative.policy import DraftPolicy
from flashdraft.speculative.trees import TreeVerifier
from flashdraft.speculative.verify import accept_plans, target_tokens


class VerifyAhead:
    def __init__(self, ctx: StepContext, policy: DraftPolicy, graphs: StepGraphs, trees: TreeVerifier | None,
                 block_slots: int, decode: Callable[..., InFlight]):
        self.ctx, self.policy, self.graphs, self.trees = ctx, policy, graphs, trees
        self.block_slots, self.decode = block_slots, decode

    def launch(self, prev: Flight) -> Flight | None:
        """The step after `prev`, launched on its outputs; None when it must wait for prev's read."""
        if isinstance(prev, InFlight):
            return self._decode_after(prev)
        if deferred(self.ctx.scheduler.running):  # (a verify chooses at its launch: not ahead of such requests)
            return None
        plans = self._plan_verify(prev)
        if plans is None:
            return None
        flight = self._verify_after(prev, plans)
        flight.launched = self.policy.clock()
        if plans[0].n == prev.plans[0].n == self.policy.num_draft + 1 and len(plans) == len(prev.plans):
            self.policy.observe(True, len(plans), 1e3 * (flight.launched - prev.launched))  # whole steps: the pace
        return flight

    def _decode_after(self, prev: InFlight) -> InFlight | None:
        """A step without drafts after one in flight, when the policy decodes every request without drafts."""
        ctx = self.ctx
        choice = self.policy.plain_after(ctx.scheduler.running,
                                         lambda s: s.num_tokens + self.block_slots <= ctx.max_model_len)
        if choice is None:
            return None
        seqs = decode_rows(ctx)
        if seqs is None:
            return None
        self.policy.take_plain(choice, seqs)
        flight = self.decode(seqs, [[0]] * len(seqs), prev.next_ids(seqs), defer=True)
        self.policy.launched_plain(len(seqs), len(seqs) == len(prev.seqs) and prev.joining is None)
        return flight

    def _plan_verify(self, prev: VerifyFlight) -> list[Plan] | None:
        """The plans of the verify after the in-flight `prev`: prev's requests in order, less any that left
        since, then those admitted behind it (their prefill in flight), all verifying the count of drafts
        the policy chooses through that count's graph, each with room for the longest block prev (or the
        prefill) can leave; its pages allocated and the policy's clock advanced. None otherwise."""
        ctx, bm = self.ctx, self.ctx.block_manager
        if prev.graph is None:
            return None
        seqs, joining = ctx.scheduler.running, prev.joining.seqs if prev.joining is not None else []
        rows = kept_rows(prev.seqs, seqs[: len(seqs) - len(joining)])
        rows_before, n = prev.plans[0].n, len(seqs)
        k = self.policy.verify_after(n)
        if k is None:
            return None
        if (len(rows) < len(prev.seqs) or joining or k != rows_before - 1) and \
                self.graphs.graph_of(prev.graph, n, any(self.graphs.drafts.draws(s) for s in seqs), k) is None:
            return None  # (the requests or the count changed since prev's launch: its rows move to that graph)
        # prev's longest commit then a block; a request admitted behind prev: its prompt, then a block
        ends = [s.num_computed_tokens + rows_before + self.block_slots for s in seqs[: len(rows)]] + \
               [s.num_computed_tokens + self.block_slots for s in joining]
        if any(not s.params.speculative or end > ctx.max_model_len for s, end in zip(seqs, ends)) or \
                sum(bm.extra_blocks_for(s.seq_id, end) for s, end in zip(seqs, ends)) > bm.num_free_blocks:
            return None
        for s, end in zip(seqs, ends):
            bm.allocate(s.seq_id, end)
        self.policy.take_verify(n, k)
        return [Plan(s, k + 1, i * (k + 1), True) for i, s in enumerate(list(seqs))]

    def _verify_after(self, prev: VerifyFlight, plans: list[Plan]) -> VerifyFlight:
        """Queue the verify after `prev` over prev's graph, its inputs derived on the device (the
        module's docstring; the graph derives the slots), then its target tokens and acceptance;
        nothing waits for the GPU."""
        g, rows, S = prev.graph, plans[0].n, len(plans)
        ctx, graphs, runner = self.ctx, self.graphs, self.ctx.runner
        if runner.hybrid:  # prev's accepted rows into the recurrent state, on the device
            take = (prev.accepted + 1).to(torch.int32)
            if S < len(prev.plans):  # requests that left since take nothing: their slots are free
                alive = {id(p.seq) for p in plans}
                take = take * to_device([int(id(s) in alive) for s in prev.seqs], torch.int32, take.device)
            runner.commit_states_from(take)
        if not graphs.greedy_post(prev.plans, g):  # (a greedy step's post graph moved them on already)
            graphs.next_blocks(g, prev.accepted, prev.toks.view(len(prev.plans), -1))
        joining = prev.joining.seqs if prev.joining is not None else []
        if S < len(prev.plans) or joining or rows != prev.plans[0].n:
            # requests left or joined, or another count: the rows to the graph of S requests and rows - 1 drafts
            old = [p.seq for p in plans[: S - len(joining)]]
            g = graphs.keep_rows(g, kept_rows(prev.seqs, old), plans, prev.joining)
            if runner.hybrid:  # the state slots of the requests kept, in their new rows
                runner.verify_rows(g, [p.seq for p in plans], ctx.block_manager)
        g.fill(block_tables=[ctx.block_manager.table(p.seq.seq_id) for p in plans])
        now = self.policy.clock()
        if g.buffers.tree:  # token trees: their acceptance and moves on the device too
            flight = self.trees.flight(plans, g, now, True)
        elif graphs.greedy_post(plans, g):
            g.replay()
            owner = [i for i in range(S) for _ in range(rows)]
            flight = VerifyFlight(plans, graphs.run_post(g), g.num_seqs, owner, now, True, g)
        else:
            hidden = g.replay()[: S * rows]
            toks, owner, _ = target_tokens(ctx, plans, hidden, g.buffers.positions)  # (no logprobs: no such request)
            flight = VerifyFlight(plans, torch.cat([accept_plans(plans, g.buffers.ids, toks), toks]), S, owner, now,
                                  True, g)
        flight.stays = True
        return flight
