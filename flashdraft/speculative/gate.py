"""Acceptance gates: stop drafting for a request (AcceptanceGate) or for whole steps (StepGate)
whose drafts do not pay.

A verify step commits tau tokens (the accepted drafts and the target's own) for the price of a
block of rows; plain decoding commits one token for one row. Where rows are not free (a CPU, a
large batch) a verify costs several plain steps, and a request whose tau is below that ratio runs
slower with its drafter than without it: sampled requests on a CPU with the shipped drafter do.

The gate keeps an exponential average of each request's tau over its verify steps. Once the
request has verified `warmup` blocks and the average is below the step's threshold `min_tau`
(on a CPU it rises with the number of running requests), it decodes without
drafts for at least `pause` engine steps, then verifies one block again as a probe. A probe that
leaves the average below `min_tau` doubles the pause (up to `max_pause`); one that lifts it over
ends the pausing and resets the pause. A pause ends at a multiple of its length on the engine's
step clock, so requests paused alike probe in the same steps: on a CPU most of a verify's price is
paid once per step (the drafter's and the vocabulary head's weights are read once for any number of
blocks), and scattered probes would make every step a verify step.

Tokens never depend on the gate: a paused request takes the plain decode step, which draws the
same token as a verify slot would (same sampler, same noise), and the drafter's context is
written on that path too, so the request can draft again at any token.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AcceptanceGate:
    weight: float = 0.25  # of the newest verify step in the average
    warmup: int = 4  # verify steps before the first pause
    first_pause: int = 16  # engine steps
    max_pause: int = 64  # a pause on a passing dip costs at most this many steps of drafting
    tau: float = 0.0  # the running average (meaningful once verifies > 0)
    verifies: int = 0
    pause: int = 0  # the next pause (0: first_pause)
    resume_at: int = 0  # the engine step from which the request drafts again

    def drafts(self, step: int) -> bool:
        return step >= self.resume_at

    def record(self, committed: int, step: int, min_tau: float) -> bool:
        """A verify in engine step `step` committed `committed` tokens. Returns True when the
        request now pauses (until the first multiple of the pause at least a pause away)."""
        self.tau = committed if self.verifies == 0 else self.tau + self.weight * (committed - self.tau)
        self.verifies += 1
        if self.tau >= min_tau:
            self.pause = self.first_pause
            return False
        if self.verifies < self.warmup:
            return False
        pause = self.pause or self.first_pause
        self.resume_at = resume_step(step, pause)
        self.pause = min(2 * pause, self.max_pause)
        return True


def gate_record(seq, committed: int, step: int, min_tau: float) -> None:
    """A request's verify committed `committed` tokens: update its gate (made on its first verify)."""
    if seq.spec_gate is None:
        seq.spec_gate = AcceptanceGate()
    seq.spec_gate.record(committed, step, min_tau)


def resume_step(step: int, pause: int) -> int:
    """The first multiple of `pause` on the engine's step clock at least `pause` steps after `step`."""
    return -(-(step + pause) // pause) * pause


def pause_cap(min_tau: float) -> int:
    """The longest pause at a threshold: a power of two of at least 100 (min_tau - 1) steps, 64 to
    1024. A probe of a paused batch costs about min_tau - 1 plain steps more than the step it
    replaces, so probes at this interval cost about 1% of the steps."""
    steps = 64
    while steps < 1024 and steps < 100 * (min_tau - 1):
        steps *= 2
    return steps


def first_pause(tau: float, min_tau: float, least: int = 16) -> int:
    """The first pause of a batch whose average tau is below min_tau: a power of two of at least
    100 (min_tau - tau) steps (a probe then costs at most ~1% of them: it takes the price of min_tau
    plain steps for tau tokens), from `least` to pause_cap(min_tau). Near the break-even the pause
    is short, so drafting resumes soon where it starts to pay; far below it (a 12-request batch on
    a CPU, whose verify costs four plain steps) probes are rare from the start."""
    steps, cap = least, pause_cap(min_tau)
    while steps < cap and steps < 100 * (min_tau - tau):
        steps *= 2
    return steps


@dataclass
class StepGate:
    """Speculation on or off for whole steps, by what steps cost (speculative/costs.py): the
    default. Requests verify together or not at all: a step where some verify and others
    decode is a ragged step, outside the whole-step graph (the shipped pair on an H200 with
    per-request gates at the same thresholds: MT-Bench 0.87x plain at 16 requests, against 1.36x
    without a gate).

    It keeps an exponential average of the batch's tau (tokens committed per verifying request)
    over verify steps, each step weighing as many blocks as verified in it (`weight` a block: one
    request's tau is a noisy integer, so a lone request's average moves slowly, a batch's fast).
    Once `warmup` blocks have been verified (a step of 8 requests, or 8 steps of one) and the
    average is below min_tau (the break-even tau of the running batch), steps decode without drafts
    until the next multiple of the pause on the engine's step clock (first_pause), then one step
    verifies as a probe. A probe of `warmup` blocks or more replaces the average (the drafts may
    pay again: a new workload), a smaller one counts at least half; below min_tau the pause doubles,
    or becomes what first_pause asks for the new average if that is longer, up to pause_cap(min_tau);
    over it, drafting resumes and the pause resets. Its state lives with
    the engine, so requests that arrive while drafts miss for everyone (a drafter out of its domain)
    start without drafts too."""

    weight: float = 0.05  # of each block verified in the newest step, in the average
    warmup: int = 8  # verified blocks (requests x steps) before the first pause
    least_pause: int = 16  # engine steps
    tau: float = 0.0
    verifies: int = 0
    blocks: int = 0  # verified blocks
    pause: int = 0  # the next pause (0: first_pause)
    resume_at: int = 0  # the engine step from which steps verify again
    probing: bool = False  # the next verify step is a probe

    def drafts(self, step: int) -> bool:
        return step >= self.resume_at

    def record(self, tau: float, step: int, min_tau: float, blocks: int = 1, averaged: bool = False,
               probe: tuple[float, float] | None = None) -> bool:
        """A verify in engine step `step` committed `tau` tokens per verifying request, `blocks`
        requests verifying (averaged: tau is already an average over steps, DepthProfile's, which
        becomes the gate's). probe: (expected tau, break-even) of the probe's step where it verifies
        more drafts than the count min_tau is for (DepthProfile's whole block): the pauses are sized by
        what that step loses, as first_pause and pause_cap size them by min_tau. Returns True when the
        steps from the next one on decode without drafts."""
        w = 1.0 if averaged else sample_weight(self.weight, blocks, self.verifies == 0, self.probing, self.warmup)
        self.tau += w * (tau - self.tau)
        self.verifies += 1
        self.blocks += blocks
        self.probing = False
        if self.tau >= min_tau:
            self.pause = 0
            return False
        if self.blocks < self.warmup:
            return False
        probe_tau, probe_min = probe if probe is not None else (self.tau, min_tau)
        # doubled from the last pause, and never shorter than the average now asks for (a probe far below
        # the break-even lengthens the pause at once: its loss sizes the pause as the first one's did)
        pause = max(self.pause, first_pause(probe_tau, probe_min, self.least_pause))
        self.resume_at = resume_step(step, pause)
        self.pause = min(2 * pause, pause_cap(probe_min))
        self.probing = True
        return True


def sample_weight(weight: float, blocks: int, first: bool, probe: bool, warmup: int,
                  probed: int | None = None) -> float:
    """The weight in an exponential average of a step's sample over `blocks` blocks (`weight` a
    block): all of it for the first sample, or for a probe of `warmup` blocks or more (`probed`
    blocks; default `blocks`), which replaces the average (the drafts may pay again: a new
    workload); at least half for a smaller probe."""
    w = 1.0 - (1.0 - weight) ** blocks
    if first or probe and (blocks if probed is None else probed) >= warmup:
        return 1.0
    return max(w, 0.5) if probe else w


@dataclass
class DepthProfile:
    """How many of a block's drafts a verify step checks, where the step costs were measured at
    start for several counts (speculative/costs.py StepCosts.fewer): the count whose expected tokens
    a request per unit of the step's price is highest.

    A chain's drafts are accepted in order, so a verify of k drafts commits
    1 + sum_{j <= k} P(the first j drafts are accepted) tokens a request. The profile keeps, per
    depth j, an exponential average of the conditional acceptance P(draft j accepted | drafts
    1..j-1 accepted) over the blocks whose verify reached j (`weight` a block, as StepGate's tau: a
    first sample or a probe of `warmup` blocks replaces it, a smaller probe counts at least half).
    A depth not yet seen counts as accepted, so a count below the block's is chosen only once the
    depths it drops have been seen missing often enough. Depths past a shorter count are not
    verified, so every `probe_every` steps one step verifies the whole block again (a workload whose
    drafts improve)."""

    counts: tuple[int, ...]  # the draft counts with graphs and costs, the block's first
    weight: float = 0.05
    warmup: int = 8  # blocks verified before a count below the block's is chosen
    probe_every: int = 128  # engine steps between whole-block verifies while a shorter count is chosen
    accept: list[float] | None = None  # conditional acceptance by depth (index j - 1)
    seen: list[bool] | None = None
    blocks: int = 0
    count: int = 0  # the count the next verify step checks (0: not chosen yet, the block's)
    best: int = 0  # the count that pays best, by the last choice
    next_probe: int = 0

    def __post_init__(self) -> None:
        depth = self.counts[0]
        self.accept = self.accept or [1.0] * depth
        self.seen = self.seen or [False] * depth
        self.count = self.count or depth

    def record(self, accepted: list[int], drafts: int, probe: bool = False) -> None:
        """One verify step of `drafts` drafts a request: the accepted drafts of each request."""
        reached = [0] * (drafts + 2)  # reached[j]: blocks whose first j drafts were all accepted
        for a in accepted:
            reached[min(a, drafts)] += 1
        for j in range(drafts - 1, -1, -1):
            reached[j] += reached[j + 1]
        # depth j + 1 was tried by the blocks that accepted j drafts, and accepted by those that went on
        for j, (t, h) in enumerate(zip(reached[:drafts], reached[1:drafts + 1])):
            if not t:
                continue
            w = sample_weight(self.weight, t, not self.seen[j], probe, self.warmup, len(accepted))
            self.accept[j] += w * (h / t - self.accept[j])
            self.seen[j] = True
        self.blocks += len(accepted)

    def tau(self, k: int) -> float:
        """Expected tokens a verify of k drafts commits a request."""
        total, reach = 1.0, 1.0
        for c in self.accept[:k]:
            reach *= c
            total += reach
        return total

    def choose(self, break_even, step: int) -> tuple[float, float]:
        """Pick the count for the steps after engine step `step` by break_even(k), the tau from which
        a step of k drafts pays; returns (tau, break-even) at the best count, for the step gate."""
        full = self.counts[0]
        best = full if self.blocks < self.warmup else max(self.counts, key=lambda k: self.tau(k) / break_even(k))
        if best != self.best or best == full:
            self.next_probe = step + self.probe_every
        self.best = best
        self.count = best
        if best != full and step >= self.next_probe:  # the whole block once: the depths past best
            self.count, self.next_probe = full, step + self.probe_every
        return self.tau(best), break_even(best)
