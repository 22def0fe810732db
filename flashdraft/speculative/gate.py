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
    if not hasattr(seq, "spec_gate"):
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
    50 (min_tau - tau) steps (a probe then costs at most ~2% of them: it takes the price of min_tau
    plain steps for tau tokens), from `least` to pause_cap(min_tau). Near the break-even the pause
    is short, so drafting resumes soon where it starts to pay; far below it (a 12-request batch on
    a CPU, whose verify costs four plain steps) probes are rare from the start."""
    steps, cap = least, pause_cap(min_tau)
    while steps < cap and steps < 50 * (min_tau - tau):
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
    up to pause_cap(min_tau); over it, drafting resumes and the pause resets. Its state lives with
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

    def record(self, tau: float, step: int, min_tau: float, blocks: int = 1) -> bool:
        """A verify in engine step `step` committed `tau` tokens per verifying request, `blocks`
        requests verifying. Returns True when the steps from the next one on decode without drafts."""
        w = 1.0 - (1.0 - self.weight) ** blocks
        if self.verifies == 0 or self.probing and blocks >= self.warmup:
            w = 1.0
        elif self.probing:
            w = max(w, 0.5)
        self.tau += w * (tau - self.tau)
        self.verifies += 1
        self.blocks += blocks
        self.probing = False
        if self.tau >= min_tau:
            self.pause = 0
            return False
        if self.blocks < self.warmup:
            return False
        pause = self.pause or first_pause(self.tau, min_tau, self.least_pause)
        self.resume_at = resume_step(step, pause)
        self.pause = min(2 * pause, pause_cap(min_tau))
        self.probing = True
        return True
