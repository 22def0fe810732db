"""The draft policy: per step and per request, how many drafts a verify checks (0: a plain decode step).

One object decides, from what is configured and what it observes:

- `speculative_disable_batch_size`: a step of at least that many running requests decodes without
  drafts (`paused`);
- a number for `speculative_min_acceptance_length`: each request's AcceptanceGate (gate.py) pauses
  its drafts while its recent tau is below it;
- "auto" (settings.STEP_GATE): the StepGate pauses whole steps while the batch's tau is below the
  break-even tau of what steps cost with and without drafts (costs.py: measured at start where graphs
  are captured, and observed while serving on this policy's clock), and where costs were measured for
  shorter counts the DepthProfile picks how many of the block's drafts a verify checks.

Its clock (time.perf_counter unless given) times the steps it observes: tests inject one, so that
what a step costs is theirs to say.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from flashdraft import settings
from flashdraft.config import EngineConfig
from flashdraft.engine.sequence import Sequence
from flashdraft.speculative.costs import Observed, StepCosts
from flashdraft.speculative.gate import DepthProfile, StepGate, gate_record
from flashdraft.speculative.metrics import SpecStats


def draft_choices(config: EngineConfig, num_draft: int, tree: bool, hybrid: bool, graphed: bool,
                  device: torch.device) -> tuple[int, ...]:
    """The draft counts a whole step may verify, each with its graphs: the block's, and where the
    step gate chooses among measured costs (graphed chains on CUDA, no count given, an attention-only
    target) a half and a quarter of it."""
    counts = (num_draft,)
    if config.num_speculative_tokens is None and not tree and not hybrid and device.type == "cuda" and graphed \
            and config.speculative_min_acceptance_length == "auto" and settings.STEP_GATE:
        counts += tuple(c for c in (num_draft // 2, num_draft // 4) if c >= 2)
    return counts


class DraftPolicy:
    def __init__(self, config: EngineConfig, device: torch.device, num_draft: int, max_accepted: int,
                 choices: tuple[int, ...], costs: StepCosts | None, stats: SpecStats,
                 clock: Callable[[], float] = time.perf_counter):
        self.num_draft, self.max_accepted, self.stats, self.clock = num_draft, max_accepted, stats, clock
        self.pause_at = config.speculative_disable_batch_size
        # the per-request gate's threshold given (running requests, temperature), when a number is configured
        self.min_tau_rule = config.min_acceptance_length(device)
        self.costs = costs
        self.step_gate = StepGate() if costs is not None else None
        self.choices = choices if costs is not None and costs.fewer else choices[:1]
        self.profile = DepthProfile(self.choices) if len(self.choices) > 1 else None
        self.seen = Observed()  # step costs while serving
        self.steps = 0  # the engine's step clock
        self.num_running = 0
        self.paused = False  # this step decodes without drafts (speculative_disable_batch_size)
        self.gated = False  # this step decodes without drafts (the step gate)
        self.step_drafts = num_draft  # drafts this step's verifies check
        self.last_launch: float | None = None  # when the last step without drafts launched ahead

    # ---- a step the host schedules -----------------------------------------------------------
    def begin_step(self, num_running: int) -> None:
        """Advance the clock to a step the host schedules now, num_running requests running."""
        self.steps += 1
        self.num_running = num_running
        self.paused = self.pause_at is not None and num_running >= self.pause_at
        self.gated = self._gate_closed(self.steps, num_running, count_try=True)
        self.step_drafts = self._verify_count()
        self.stats.paused_steps += self.paused

    def drafts(self, seq: Sequence, fits: bool) -> int:
        """Drafts a decoding request verifies this step (0: it decodes without). fits: its block fits
        the context window."""
        if self.paused or not seq.params.speculative or not fits:
            return 0
        gate = seq.spec_gate
        if self.gated or (gate is not None and not gate.drafts(self.steps)):
            for st in (self.request_stats(seq), self.stats):
                st.gated_steps += 1
            return 0
        return self.step_drafts

    def request_stats(self, seq: Sequence) -> SpecStats:
        if seq.spec_stats is None:
            seq.spec_stats = SpecStats(self.max_accepted)
        return seq.spec_stats

    # ---- the step after one in flight ---------------------------------------------------------
    def plain_after(self, running: list[Sequence], fits: Callable[[Sequence], bool]) -> tuple | None:
        """Whether the next step of the clock decodes every running request without drafts (paused,
        gated, or no request whose gate lets it draft): the choice to `take_plain`, or None."""
        step, n = self.steps + 1, len(running)
        paused = self.pause_at is not None and n >= self.pause_at
        whole = self._gate_closed(step, n)
        gated = [s for s in running if s.params.speculative and fits(s)]
        if not (paused or whole) and any(s.spec_gate is None or s.spec_gate.drafts(step) for s in gated):
            return None
        return step, n, paused, whole, gated

    def take_plain(self, choice: tuple, seqs: list[Sequence]) -> None:
        """The clock advanced to a step without drafts launched ahead over `seqs` (plain_after's choice)."""
        step, n, paused, whole, gated = choice
        if whole and self.step_gate.drafts(step):  # closed to time the pace of steps without drafts
            self._count_try(n)
        self.steps, self.num_running, self.paused, self.gated = step, n, paused, whole
        self.stats.paused_steps += paused
        if not paused:
            rows = {id(s) for s in seqs}
            for s in gated:
                if id(s) in rows:
                    for st in (self.request_stats(s), self.stats):
                        st.gated_steps += 1

    def verify_after(self, n: int) -> int | None:
        """Drafts the verify after one in flight checks, n requests running; None where that step
        does not verify them all: paused, the step gate closed at the next step of its clock, the
        in-flight step its probe (whose result decides: it is read first), or its pace to time."""
        if self.pause_at is not None and n >= self.pause_at:
            return None
        gate = self.step_gate
        if gate is not None and (not gate.drafts(self.steps + 1) or gate.probing or self._times_plain(n)):
            return None
        return self._verify_count()

    def take_verify(self, n: int, drafts: int) -> None:
        self.steps, self.num_running, self.paused, self.gated, self.step_drafts = self.steps + 1, n, False, False, \
            drafts

    def next_drafts(self) -> int:
        """The count the next verify checks, as verify_after would choose it."""
        return self._verify_count()

    # ---- what steps show ----------------------------------------------------------------------
    def observe(self, spec: bool, n: int, ms: float) -> None:
        """A step's cost seen while serving (whole DFlash steps or steps without drafts, n requests)."""
        if self.costs is not None:
            self.seen.add(self.seen.spec if spec else self.seen.plain, self.costs.bucket(n), ms, self.costs.measured)

    def launched_plain(self, n: int, run: bool) -> None:
        """A step without drafts of n requests launched ahead; run: it continues a run of them over the
        same requests, so the time since the last launch is their pace."""
        last, self.last_launch = self.last_launch, self.clock()
        if run and last is not None:
            self.observe(False, n, 1e3 * (self.last_launch - last))

    def record_verifies(self, verified: list[int], drafts: int) -> None:
        """One step's verifies, `verified` the tokens each committed, `drafts` each checked: the step
        gate's average (through the depth profile, where it picks the count)."""
        if self.step_gate is None or not verified:
            return
        n = max(self.num_running, 1)
        if self.profile is None:
            self.step_gate.record(sum(verified) / len(verified), self.steps, self.costs.break_even(n, self.seen),
                                  len(verified))
            return
        self.profile.record([a - 1 for a in verified], drafts, self.step_gate.probing)
        tau, min_tau = self.profile.choose(lambda k: self.costs.break_even(n, self.seen, k), self.steps)
        # a probe verifies the whole block (_verify_count): its price sizes the pauses
        probe = (self.profile.tau(self.num_draft), self.costs.break_even(n, self.seen))
        self.step_gate.record(tau, self.steps, min_tau, len(verified), averaged=True, probe=probe)

    def record_request(self, seq: Sequence, committed: int) -> None:
        """A request's verify committed `committed` tokens: its own gate, when a threshold is configured."""
        min_tau = self.min_tau_rule and self.min_tau_rule(max(self.num_running, 1), seq.params.temperature)
        if min_tau is not None:
            gate_record(seq, committed, self.steps, min_tau)

    # ---- the step gate's rules ----------------------------------------------------------------
    def _verify_count(self) -> int:
        """Drafts a request's verify checks in the next step: the profile's count, the whole block
        for the step gate's probe."""
        if self.profile is None or self.step_gate.probing:
            return self.num_draft
        return self.profile.count

    def _gate_closed(self, step: int, n: int, count_try: bool = False) -> bool:
        """Whether engine step `step`, n requests running, decodes without drafts by the step gate:
        paused, or timing the pace of steps without drafts (costs.Observed; count_try: this step is
        one of the tries)."""
        if self.step_gate is None:
            return False
        if not self.step_gate.drafts(step):
            return True
        if self._times_plain(n):
            if count_try:
                self._count_try(n)
            return True
        return False

    def _count_try(self, n: int) -> None:
        i = self.costs.bucket(max(n, 1))
        self.seen.tries[i] = self.seen.tries.get(i, 0) + 1

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
