"""A request as the engine sees it. Lengths live here and nowhere else: `num_computed_tokens` is how
many of `token_ids` have K/V in the target cache (the block manager owns the pages)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from flashdraft.sampling_params import SamplingParams
from flashdraft.speculative.gate import AcceptanceGate
from flashdraft.speculative.metrics import SpecStats
from flashdraft.structured.grammar import RequestGrammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    """The target's raw log-probability of one token at its position, and its `logprobs` most likely
    tokens there (token id, log-probability), most likely first (ties: the lower id)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Output:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort", "error" or None while running
    metrics: dict = field(default_factory=dict)
    # SamplingParams.logprobs set: one per generated token; prompt_logprobs: one per prompt token, the first None
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: str | None = None  # finish_reason "error": what failed (this request only)

    @property
    def cumulative_logprob(self) -> float | None:
        return None if self.logprobs is None else sum(t.logprob for t in self.logprobs)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


_ids = itertools.count()


class Sequence:
    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                 request_id: str | None = None, seed: int = 0):
        self.seq_id = next(_ids)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.seed = params.seed if params.seed is not None else seed
        self.status = SeqStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache when first admitted
        self.finish_reason: str | None = None
        self.text = ""
        self.num_preemptions = 0
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.token_times: list[float] = []
        # with SamplingParams.logprobs / prompt_logprobs: an entry per generated / prompt token (the first None)
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = \
            [None] if params.prompt_logprobs is not None else None
        # speculative decoding: this request's counters, and its own gate (a per-request threshold configured)
        self.spec_stats: SpecStats | None = None
        self.spec_gate: AcceptanceGate | None = None
        # structured_outputs: the request's grammar matcher, at the state after its committed output
        self.grammar: RequestGrammar | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def metrics(self) -> dict:
        m = {"num_prompt_tokens": self.num_prompt_tokens, "num_output_tokens": self.num_output_tokens,
             "num_cached_tokens": self.num_cached_tokens or 0, "num_preemptions": self.num_preemptions}
        if self.first_token_time is not None:
            m["ttft_s"] = self.first_token_time - self.arrival_time
        if self.finish_time is not None:
            m["e2e_s"] = self.finish_time - self.arrival_time
            if self.num_output_tokens > 1 and self.first_token_time is not None:
                m["tpot_s"] = (self.finish_time - self.first_token_time) / (self.num_output_tokens - 1)
        if self.grammar is not None:
            m["grammar_mask_s"] = self.grammar.mask_s
        return m

    def to_output(self) -> Output:
        return Output(self.request_id, self.prompt, self.token_ids[: self.num_prompt_tokens], self.text,
                      self.output_token_ids, self.finish_reason, self.metrics(),
                      None if self.logprobs is None else list(self.logprobs),
                      None if self.prompt_logprobs is None else list(self.prompt_logprobs),
                      self.grammar.error if self.grammar is not None else None)
