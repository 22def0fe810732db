"""Per-request timings and per-arm summaries.

Latencies, per request: TTFT = first output token - request sent; E2E = finish - request sent;
TPOT = (E2E - TTFT) / (output tokens - 1).

ITL: a speculative step commits several tokens at one instant (a "chunk"). In process, ITL is
reported per token: the gap between a chunk and the one before it is divided evenly among the chunk's
tokens, and tokens that arrive with the first token count as 0. A request's per-token ITLs then sum to
E2E - TTFT (up to the finish bookkeeping) and their mean is its TPOT, so plain and DFlash arms compare
directly. The chunk intervals themselves (what a streaming client sees) are kept as `itl_chunk_ms`.
Over HTTP the tokens in each streamed chunk are not known, so there ITL is the chunk interval.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "gated_steps")
SPEC_LISTS = ("accepted_per_position", "acceptance_histogram")


@dataclass
class RequestResult:
    index: int  # position of the prompt in the prompt list
    prompt_tokens: int
    output_tokens: int
    ttft_s: float | None
    e2e_s: float
    chunk_times_s: list[float]  # since the request was sent, when each group of output tokens arrived
    chunk_tokens: list[int] | None  # tokens in each group; None when unknown (HTTP streams)
    output: list[int] | str  # token ids in process, text over HTTP: compared across arms
    finish_reason: str | None
    spec: dict | None = None  # this request's drafting counters, DFlash arm only
    grammar_mask_s: float | None = None  # host time of its grammar's masks (a constrained request, in process)

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def itl_s(self) -> list[float]:
        if self.chunk_tokens is None:
            return chunk_intervals(self.chunk_times_s)
        return per_token_intervals(self.chunk_times_s, self.chunk_tokens)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["tpot_s"] = self.tpot_s
        d["chunk_times_s"] = [round(t, 6) for t in self.chunk_times_s]
        return d


def group_times(times: list[float]) -> tuple[list[float], list[int]]:
    """Token timestamps -> (distinct times, tokens at each)."""
    out_t: list[float] = []
    out_n: list[int] = []
    for t in times:
        if out_t and t == out_t[-1]:
            out_n[-1] += 1
        else:
            out_t.append(t)
            out_n.append(1)
    return out_t, out_n


def chunk_intervals(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:])]


def per_token_intervals(times: list[float], counts: list[int]) -> list[float]:
    if not times:
        return []
    out = [0.0] * (counts[0] - 1)
    for gap, n in zip(chunk_intervals(times), counts[1:]):
        out.extend([gap / n] * n)
    return out


def distribution_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "p50": None, "p95": None, "p99": None}
    a = np.asarray(values_s, dtype=np.float64) * 1000.0
    p50, p95, p99 = np.percentile(a, [50, 95, 99])
    return {"mean": float(a.mean()), "p50": float(p50), "p95": float(p95), "p99": float(p99)}


def spec_delta(before: dict, after: dict) -> dict:
    """Drafting counters accumulated between two `spec_totals()` snapshots, with tau and rates."""
    d = {k: (after.get(k) or 0) - (before.get(k) or 0) for k in SPEC_COUNTERS}
    for k in SPEC_LISTS:
        a, b = list(after.get(k) or []), list(before.get(k) or [])
        b += [0] * (len(a) - len(b))
        d[k] = [x - y for x, y in zip(a, b)]
    return with_rates(d)


def sum_spec(items: list[dict]) -> dict:
    total: dict = {k: 0 for k in SPEC_COUNTERS} | {k: [] for k in SPEC_LISTS}
    for m in items:
        for k in SPEC_COUNTERS:
            total[k] += m.get(k) or 0  # servers without the acceptance gate report no gated_steps
        for k in SPEC_LISTS:
            a, b = total[k], list(m.get(k) or [])
            n = max(len(a), len(b))
            total[k] = [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)))]
    return with_rates(total)


def with_rates(d: dict) -> dict:
    """tau = (accepted + drafts) / drafts: tokens committed per verify step, bonus token included."""
    n = d["num_drafts"]
    d["acceptance_length"] = (d["num_accepted_tokens"] + n) / n if n else None
    d["acceptance_rate_per_position"] = [c / n for c in d["accepted_per_position"]] if n else []
    return d


def summarize(results: list[RequestResult], wall_s: float, spec: dict | None, steps: int | None = None) -> dict:
    """An arm's figures; steps: the engine steps it ran (in process), for the masks' host time per step."""
    completion = sum(r.output_tokens for r in results)
    per_token = all(r.chunk_tokens is not None for r in results)
    masks = [r.grammar_mask_s for r in results if r.grammar_mask_s is not None]
    return {
        "num_steps": steps,
        "grammar_mask_ms_per_step": 1e3 * sum(masks) / steps if masks and steps else None,
        "num_requests": len(results),
        "prompt_tokens": sum(r.prompt_tokens for r in results),
        "completion_tokens": completion,
        "wall_s": wall_s,
        "output_tok_s": completion / wall_s if wall_s > 0 else None,
        "requests_per_s": len(results) / wall_s if wall_s > 0 else None,
        "ttft_ms": distribution_ms([r.ttft_s for r in results if r.ttft_s is not None]),
        "tpot_ms": distribution_ms([r.tpot_s for r in results if r.tpot_s is not None]),
        "itl_ms": distribution_ms([x for r in results for x in r.itl_s()]),
        "itl_convention": "per-token" if per_token else "chunk",
        "itl_chunk_ms": distribution_ms([x for r in results for x in chunk_intervals(r.chunk_times_s)]),
        "e2e_ms": distribution_ms([r.e2e_s for r in results]),
        "spec": spec,
        "requests": [r.as_dict() for r in sorted(results, key=lambda r: r.index)],
    }


def same_outputs(plain: list[RequestResult], dflash: list[RequestResult]) -> dict:
    """How many prompts got byte-identical output in both arms (the losslessness check at T=0)."""
    a = {r.index: r.output for r in plain}
    b = {r.index: r.output for r in dflash}
    common = sorted(set(a) & set(b))
    differ = [i for i in common if a[i] != b[i]]
    n = len(common)
    return {"matched": n - len(differ), "total": n, "fraction": (n - len(differ)) / n if n else None,
            "differing_prompts": differ}
