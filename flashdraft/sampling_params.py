"""Per-request sampling parameters (vLLM's names and defaults where they mean the same)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


MAX_LOGPROBS = 20  # the most log-probabilities a position may return (vLLM's default max_logprobs)


@dataclass
class StructuredOutputsParams:
    """vLLM's constraint on a request's output (exactly one field set): a JSON schema (`json`, a dict or its
    text), any JSON object (`json_object`), a regular expression, one of a list of strings (`choice`), an
    EBNF grammar (`grammar`, xgrammar's GBNF dialect), or an xgrammar structural tag (`structural_tag`, a
    dict or its JSON text: free text with tagged parts, as tool calls are forced). Compiled against the
    tokenizer when the request is added (flashdraft/structured/grammar.py); at every row that chooses a
    target token, verify rows included, the tokens it forbids are masked."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    structural_tag: str | dict | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar", "structural_tag") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs takes exactly one of json, json_object, regex, choice, grammar, "
                             f"structural_tag; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or any(not isinstance(c, str) or not c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{k} must be a non-empty string, got {v!r}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (a dict or its text), got {self.json!r}")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise ValueError(f"structured_outputs.structural_tag must be a dict or its JSON text, "
                             f"got {self.structural_tag!r}")


GuidedDecodingParams = StructuredOutputsParams  # vLLM's earlier name


@dataclass
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int | None = 256
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    speculative: bool = True
    skip_special_tokens: bool = True
    # the target's distribution at each position, processed in vLLM's order (engine/logits.py): logit_bias and
    # min_tokens, then the penalties (repetition over prompt and output, presence and frequency over the
    # output), the greedy choice, then temperature, min_p, top-k, top-p and the draw
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None
    # log-probabilities of the target's raw distribution (before any processing, vLLM's default): the
    # chosen token's and the `logprobs` most likely tokens' at every generated token, and at every prompt
    # token past the first with prompt_logprobs (such a prompt is computed whole, not read from the cache)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    # the output's grammar (JSON schema, regex, choice, EBNF): a mask at every row that chooses a token
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's earlier name for structured_outputs
    stops: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        self.stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("give structured_outputs or guided_decoding (its earlier name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the offending field; called on construction."""
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k < 1 and self.top_k != -1) or self.top_k >= 2**31:
            raise ValueError(f"top_k must be -1 (disabled) or in [1, 2**31), got {self.top_k!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise ValueError(f"seed must be a 64-bit integer, got {self.seed!r}")
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or any(
                    not _is_int(t) or t < 0 or not _is_number(b) for t, b in self.logit_bias.items()):
                raise ValueError(f"logit_bias must map token ids (integers >= 0) to finite numbers, "
                                 f"got {self.logit_bias!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalizes(self) -> bool:
        """Whether the penalties (repetition, frequency, presence) change the logits."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether the target's logits change before the choice (beyond temperature, top-k and top-p)."""
        return self.penalizes or bool(self.min_p or self.min_tokens or self.logit_bias) or self.constrained

    @property
    def constrained(self) -> bool:
        """Whether a grammar masks the tokens this request may take (structured_outputs)."""
        return self.structured_outputs is not None

    @property
    def grammar_only(self) -> bool:
        """Constrained and greedy, with nothing else that changes or reads its logits: its token is the argmax
        among the tokens its grammar allows, which is the plain argmax wherever the grammar allows that
        (a DFlash verify checks such a request's tokens after the fact: structured/check.py)."""
        return self.constrained and self.greedy and not (self.penalizes or self.min_p or self.min_tokens
                                                         or self.logit_bias or self.logprobs is not None
                                                         or self.prompt_logprobs is not None)

    @property
    def needs_logits(self) -> bool:
        """Whether a step's tokens for this request are chosen from logits the host's code processes or
        reads (processors or log-probabilities): outside the step graphs' own choice, and never in a step
        launched before the one ahead of it is read (the counts and lengths would be a step behind)."""
        return self.processes_logits or self.logprobs is not None or self.prompt_logprobs is not None
