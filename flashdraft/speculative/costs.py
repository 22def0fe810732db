"""What a step costs by batch size, with drafts and without: where speculation stops paying.

A DFlash step (draft blocks, the verify of B rows a request, the context write, the head over
every verify row) commits a request's tau tokens; the step without drafts (the target over one row
a request and the context write, the head over those rows) commits one. With n requests running,
a request's drafts pay when its tau is above

    break_even(n) = spec_ms(n) / plain_ms(n)

(the step's price is shared by its requests either way: at small n both steps read the same
weights and the ratio is near 1 plus the drafter's share; at large n a verify's rows are real work
and the ratio grows towards B). The acceptance gate (gate.py) pauses a request's drafts below it.

On CUDA the costs are measured once at start, after the step graphs are captured: each batch
bucket's whole-DFlash-step graph and its decode graph (the one paused steps replay) are replayed,
each followed by the head and the greedy choice over its rows, timed with CUDA events, with random
tokens in their rows (a mixture of experts routes each row by its token). A batch of n runs in the
smallest bucket holding it, and so takes that bucket's ratio. Where several draft counts have graphs
(speculative/gate.py DepthProfile), the whole step of each is timed; with token trees, the whole tree
step's graph (draft, tree, verify, head, acceptance and the accepted rows' moves).

That is GPU time. While serving, the engine also times its steps (Observed): a DFlash step waits for
its accepted lengths, so its wall time is host and GPU together; steps without drafts overlap the
host (engine.step), so their pace is the time between launches in a run of them, and without async
scheduling (a CPU) a step's wall time. Once a bucket has been seen both ways (the engine runs a step
without drafts to time it, once per bucket), the larger of graph and observed cost counts for each:
a small target whose verify steps wait on the host (the shipped pair at 64 requests: 0.89-0.93x plain
with drafts) shows a break-even the graphs miss.

Where nothing is captured to time at start (a CPU, eager CUDA), the costs are the
observed ones alone (StepCosts.unmeasured): a bucket not yet seen both ways takes the nearest bucket's
ratio that has been, and drafts until one has.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from flashdraft.engine.model_runner import ModelRunner

log = logging.getLogger("flashdraft")


@dataclass(frozen=True)
class StepCosts:
    batches: tuple[int, ...]  # graph buckets, ascending
    plain_ms: tuple[float, ...]
    spec_ms: tuple[float, ...]  # verifying the whole draft block
    fewer: dict[int, tuple[float, ...]] = field(default_factory=dict)  # verifying k < the block's drafts

    def bucket(self, n: int) -> int:
        """The index of the smallest bucket holding n requests (the largest past them all)."""
        return next((i for i, b in enumerate(self.batches) if n <= b), len(self.batches) - 1)

    @classmethod
    def unmeasured(cls, max_batch: int) -> StepCosts:
        """Buckets of powers of two up to max_batch and no cost measured: Observed supplies them."""
        batches = [1]
        while batches[-1] < max_batch:
            batches.append(2 * batches[-1])
        return cls(tuple(batches), (0.0,) * len(batches), (0.0,) * len(batches))

    @property
    def measured(self) -> bool:
        return any(p > 0 for p in self.plain_ms)

    def break_even(self, n: int, seen: Observed | None = None, k: int | None = None) -> float:
        """The tau from which a request's drafts pay with n requests running; with `seen`, each
        step's cost is the larger of the graphs' and the one observed while serving. Unmeasured: the
        observed ratio of n's bucket, else of the nearest bucket seen both ways, else 1. k: a step
        verifying k drafts of `fewer` (seen only whole blocks: their observed cost scaled by the
        graphs' ratio of the two steps)."""
        i = self.bucket(n)
        spec, plain = self.spec_ms[i], self.plain_ms[i]
        if not self.measured:
            if seen is None:
                return 1.0
            both = sorted((abs(j - i), j) for j in seen.spec if j in seen.plain)
            if not both:
                return 1.0
            i = both[0][1]
        scale = self.fewer[k][i] / spec if k in self.fewer and spec > 0 else 1.0
        spec *= scale
        if seen is not None and i in seen.spec and i in seen.plain:  # both seen: host time on both sides
            spec, plain = max(spec, scale * seen.spec[i]), max(plain, seen.plain[i])
        return max(1.0, spec / plain)

    def as_dict(self) -> dict:
        d = {"batches": list(self.batches), "plain_ms": [round(x, 4) for x in self.plain_ms],
             "spec_ms": [round(x, 4) for x in self.spec_ms],
             "break_even": [round(self.break_even(b), 3) for b in self.batches]}
        for k, ms in self.fewer.items():
            d[f"spec_ms_{k}_drafts"] = [round(x, 4) for x in ms]
            d[f"break_even_{k}_drafts"] = [round(self.break_even(b, k=k), 3) for b in self.batches]
        return d


@dataclass
class Observed:
    """Step costs seen while serving, ms by bucket index (StepCosts.bucket): running averages of
    whole DFlash steps' wall times and of the pace of steps without drafts (overlapped: the time
    between launches; else a step's wall time), and the steps without drafts run to time that pace."""
    weight: float = 0.2
    spec: dict[int, float] = field(default_factory=dict)
    plain: dict[int, float] = field(default_factory=dict)
    tries: dict[int, int] = field(default_factory=dict)  # steps without drafts run to time a bucket's pace
    max_tries: int = 8  # (a run may never form: requests arriving, prefills; then the graphs decide)
    spike: float = 3.0  # a sample counts at most this many times the average (add)
    warm: set = field(default_factory=set)  # (spec?, bucket) whose first sample was dropped (add)

    def wants_plain(self, bucket: int) -> bool:
        """Whether to run steps without drafts now to time this bucket's pace: not timed yet, and the
        tries are not spent. Timed before its first DFlash step, so that one verify step (a batch's
        worth of blocks) can decide: on a CPU a 12-request verify costs four plain steps."""
        return bucket not in self.plain and self.tries.get(bucket, 0) < self.max_tries

    def add(self, table: dict[int, float], bucket: int, ms: float, skip_first: bool = False) -> None:
        """One step's cost into a bucket's average. A sample counts at most `spike` times the average,
        and with skip_first (the graphs' costs were measured at start, so the gate need not wait for
        it) a bucket's first sample is dropped: a one-off stall (a collection pass, a kernel's first
        load: 20 ms and more on a GPU) must not pause drafts for hundreds of steps. Without graph
        costs the first sample is the average (a CPU's gate decides from its first verify)."""
        key = (table is self.spec, bucket)
        if skip_first and key not in self.warm:
            self.warm.add(key)
            return
        old = table.get(bucket)
        table[bucket] = ms if old is None else old + self.weight * (min(ms, self.spike * old) - old)


def at_start(runner: ModelRunner, spec_keys: list[tuple], plain_key: tuple, counts: tuple[int, ...],
             block_size: int, tree: bool, max_num_seqs: int) -> StepCosts:
    """The step gate's costs at start: measured over the captured graphs (logged), else unmeasured
    buckets up to max_num_seqs that serving fills in."""
    costs = measure(runner, spec_keys, plain_key, counts, block_size, tree)
    if costs is None:
        return StepCosts.unmeasured(max_num_seqs)
    log.info("speculation pays from tau %s at %s running requests (step costs measured at start)",
             "/".join(f"{costs.break_even(b):.2f}" for b in costs.batches), "/".join(map(str, costs.batches)))
    for k in costs.fewer:
        log.info("verifying %d of %d drafts: from tau %s", k, counts[0],
                 "/".join(f"{costs.break_even(b, k=k):.2f}" for b in costs.batches))
    return costs


def measure(runner: ModelRunner, spec_keys: list[tuple], plain_key: tuple, counts: tuple[int, ...], block_size: int,
            tree: bool, replays: int = 5) -> StepCosts | None:
    """Each captured bucket's DFlash step (spec_keys: one graph kind a draft count of `counts`) and decode
    step (graph, head, greedy choice), the median of `replays` timed replays after one untimed; None
    without captured graphs (CPU, eager runs). A token tree's step graph holds its head and acceptance:
    it is timed alone. The replays rerun what capture ran: placeholder rows, no request's pages."""
    if runner.device.type != "cuda":
        return None
    buckets = sorted(b for (k, b, q), g in runner.graphs.items() if k == spec_keys[0] and g.captured)
    model = runner.model
    found = []
    gen = torch.Generator(runner.device).manual_seed(0)
    with torch.inference_mode():
        for b in buckets:
            gp = runner.graphs.get((plain_key, b, 1))
            gs = [runner.graphs.get((key, b, block_size)) for key in spec_keys]
            if gp is None or not gp.captured or any(g is None or not g.captured for g in gs):
                continue
            for g, q in [(gp, 1)] + [(g, block_size) for g in gs]:
                _spread(g, q, model.config.vocab_size, gen)
            found.append((b, _time(lambda g=gp, r=b: _head(model, g.replay()[:r]), replays),
                          *(_time(g.replay if tree else lambda g=g, r=b * (k + 1): _head(model, g.replay()[:r]),
                                  replays) for g, k in zip(gs, counts))))
    if not found:
        return None
    b, p, s, *fewer = zip(*found)
    return StepCosts(tuple(b), tuple(p), tuple(s), dict(zip(counts[1:], fewer)))


def _spread(g, q: int, vocab: int, gen: torch.Generator) -> None:
    """Random tokens as the first of each sequence's q rows (a draft block's others stay masks): the
    placeholder rows of a capture are all token 0, which a mixture of experts routes to the same
    experts in every row, a fraction of what real rows read."""
    first = g.input_ids.view(-1, q)[:, 0]
    first.copy_(torch.randint(vocab, first.shape, generator=gen, device=first.device))


def _head(model, hidden: torch.Tensor) -> torch.Tensor:
    return model.compute_logits(hidden, float32=False).argmax(-1)


def _time(fn, replays: int) -> float:
    fn()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]
