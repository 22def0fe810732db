"""OpenAI request bodies: validation, the policy for fields we do not support, and the mapping onto
SamplingParams. Every problem becomes an `APIError` that names the offending field.

Defaults follow OpenAI, not the offline API: temperature 1.0, and 16 tokens for /v1/completions."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError

from flashdraft.engine.prompts import TEMPLATE_ARGUMENTS
from flashdraft.sampling_params import MAX_LOGPROBS, SamplingParams
from flashdraft.server.constraints import FIELDS as CONSTRAINT_FIELDS
from flashdraft.server.constraints import ConstraintError, constraint
from flashdraft.server.errors import APIError, bad_request
from flashdraft.server.messages import ChatTools, chat_tools, conversation

Int64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # seeds and top_k end up in int64 tensors


def parse_json(raw: bytes) -> dict:
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError too
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    where = _unpaired_surrogate(data, "")
    if where is not None:
        # JSON may escape half a UTF-16 pair ("\ud800"); such a string has no UTF-8 form to tokenize
        raise bad_request(f"{where or 'the request body'} holds an unpaired UTF-16 surrogate, which is not text",
                          where.split(".")[0].split("[")[0] or None)
    return data


def _unpaired_surrogate(value: Any, path: str) -> str | None:
    """The path of the first string (or key) holding a lone surrogate, else None."""
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return p
        elif isinstance(v, dict):
            for k, item in v.items():
                sub = f"{p}.{k}" if p else str(k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return p
                stack.append((item, sub))
        elif isinstance(v, list):
            stack.extend((item, f"{p}[{i}]") for i, item in enumerate(v))
    return None


def validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    loc = [str(p) for p in err.get("loc", ())]
    param = loc[0] if loc else None
    if err.get("type") == "missing":
        return bad_request(f"{param} is required", param)
    return bad_request(f"{param}: {err.get('msg', 'invalid value')}", param)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


# Other servers' extensions that change what is generated, refused unless at the value that changes nothing
# (a field this server does not know at all is accepted and logged, as vLLM does: it cannot change the output)
NOT_IMPLEMENTED: dict[str, Callable[[Any], bool]] = {
    **{name: lambda v: v in (None, 1, 1.0) for name in ("length_penalty",)},
    **{name: lambda v: v in (None, False) for name in (
        "use_beam_search", "include_stop_str_in_output", "no_stop_trim", "return_tokens_as_token_ids",
        "return_hidden_states", "continue_final_message")},
    **{name: lambda v: v in (None, True) for name in ("spaces_between_special_tokens",)},
    **{name: lambda v: v is None or v == [] or v == {} for name in (
        "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "logits_processors",
        "stop_regex", "chat_template", "documents", "lora_path", "lora_request")},
}


MAX_CHOICES = 128  # choices a request may ask for: prompts x n


class _Request(BaseModel):
    # strict: no "1" -> 1 or true -> 1 coercions; unknown fields are collected in check()
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # accepted and ignored: they do not change what is generated
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # extensions (vLLM's names)
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    prompt_logprobs: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    speculative: bool | None = None
    add_special_tokens: bool | None = None
    return_meta_info: bool | None = None  # SGLang's: a meta_info object with the speculative counts
    response_format: dict[str, Any] | None = None  # (and the other spellings of a constraint: constraints.py)

    def constraint_fields(self) -> dict[str, Any]:
        """The fields an output constraint may come in (server/constraints.py), with their values."""
        return {**(self.model_extra or {}), "response_format": self.response_format}

    def ignored_fields(self) -> list[str]:
        """Fields this server does not know: accepted, and logged by the caller."""
        return sorted(set(self.model_extra or {}) - set(NOT_IMPLEMENTED) - CONSTRAINT_FIELDS)

    def check(self) -> None:
        """Refuse features we would otherwise silently ignore."""
        extra = self.model_extra or {}
        for name in sorted(extra):
            if name in NOT_IMPLEMENTED and not NOT_IMPLEMENTED[name](extra[name]):
                raise bad_request(f"{name} is not supported", name)
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise bad_request(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            # checked here too: echo may raise the count SamplingParams sees (engine_logprobs)
            raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs}",
                              "prompt_logprobs")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM: chunks have no place for them
            raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            raise bad_request("stream_options.continuous_usage_stats is not supported", "stream_options")

    def default_max_tokens(self, defaults: dict) -> int | None:
        return defaults.get("max_tokens")  # (None: up to the context window)

    def requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    @property
    def samples(self) -> int:
        """Requests run per prompt."""
        return self.n or 1

    @property
    def returned_logprobs(self) -> int | None:
        """The top log-probabilities each returned token carries; None: no log-probabilities."""
        return None

    def engine_logprobs(self) -> tuple[int | None, int | None]:
        """SamplingParams' logprobs and prompt_logprobs: what the response returns, and what it needs besides."""
        return self.returned_logprobs, self.prompt_logprobs

    def logit_bias_ids(self, vocab_size: int) -> dict[int, float] | None:
        """OpenAI's logit_bias (token-id strings to biases) with int keys, biases clamped to [-100, 100] as
        OpenAI documents (and vLLM does)."""
        if not self.logit_bias:
            return None
        biases = {}
        for key, bias in self.logit_bias.items():
            try:
                token_id = int(key)
            except ValueError:
                token_id = -1
            if not 0 <= token_id < vocab_size:
                raise bad_request(f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}", "logit_bias")
            biases[token_id] = min(max(bias, -100.0), 100.0)
        return biases

    def sampling_params(self, vocab_size: int, defaults: dict | None = None) -> SamplingParams:
        """defaults: the model's sampling defaults (LLMEngine.sampling_defaults), for the fields the request
        leaves unset, before OpenAI's."""
        max_tokens, max_name = self.requested_max_tokens()
        logprobs, prompt_logprobs = self.engine_logprobs()
        d = defaults or {}

        def given(value, name: str, default):
            return value if value is not None else d.get(name, default)

        fields = dict(
            temperature=given(self.temperature, "temperature", 1.0),
            top_p=given(self.top_p, "top_p", 1.0),
            top_k=given(self.top_k, "top_k", -1),
            max_tokens=self.default_max_tokens(d) if max_tokens is None else max_tokens,
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=bool(self.ignore_eos),
            seed=self.seed, speculative=True if self.speculative is None else self.speculative,
            skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=given(self.repetition_penalty, "repetition_penalty", 1.0),
            min_p=given(self.min_p, "min_p", 0.0), min_tokens=self.min_tokens or 0,
            logit_bias=self.logit_bias_ids(vocab_size),
            logprobs=logprobs, prompt_logprobs=prompt_logprobs,
        )
        try:
            fields["structured_outputs"] = constraint(self.constraint_fields())
        except ConstraintError as e:
            raise bad_request(str(e), e.param) from None
        try:
            return SamplingParams(**fields)
        except ValueError as e:
            # SamplingParams' messages start with the field name
            param = str(e).split(" ", 1)[0]
            if param not in fields:
                param = None
            elif param == "max_tokens":
                param = max_name
            raise bad_request(str(e), param) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    suffix: str | None = None
    echo: bool | None = None
    best_of: int | None = None
    logprobs: int | None = None

    def check(self) -> None:
        super().check()
        n = self.n or 1
        if self.best_of is not None and not n <= self.best_of <= MAX_CHOICES:
            raise bad_request(f"best_of must be in [n, {MAX_CHOICES}] (n is {n}), got {self.best_of}", "best_of")
        if self.samples > n and self.stream:
            raise bad_request("best_of can't be used with stream", "best_of")  # OpenAI's words
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    @property
    def samples(self) -> int:
        return self.best_of or self.n or 1

    @property
    def returned_logprobs(self) -> int | None:
        return self.logprobs

    def engine_logprobs(self) -> tuple[int | None, int | None]:
        logprobs, prompt_logprobs = self.logprobs, self.prompt_logprobs
        if logprobs is None and self.samples > (self.n or 1):
            logprobs = 0  # best_of keeps the samples of the highest cumulative log-probability
        if self.echo and self.logprobs is not None:  # the echoed prompt's tokens come with theirs
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        return logprobs, prompt_logprobs

    def default_max_tokens(self, defaults: dict) -> int | None:
        return 16  # OpenAI's default for the legacy completions endpoint (vLLM's too, whatever the model's)

    def prompts(self) -> list[str | list[int]]:
        """The prompt, or each of a list of prompts (texts or token-id lists)."""
        p = self.prompt
        items = list(p) if isinstance(p, list) and p and isinstance(p[0], (str, list)) else [p]
        for j, item in enumerate(items):
            if not item:
                raise bad_request("prompt is empty" if len(items) == 1 else f"prompt[{j}] is empty", "prompt")
        if len(items) * self.samples > MAX_CHOICES:
            raise bad_request(f"{len(items)} prompts x {self.samples} samples; at most {MAX_CHOICES}", "prompt")
        return items




class ChatCompletionRequest(_Request):
    messages: list[Any]
    chat_template_kwargs: dict[str, Any] | None = None  # variables for the template, e.g. enable_thinking
    add_generation_prompt: bool | None = None
    echo: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    _tools: ChatTools | None = PrivateAttr(default=None)  # (check: tools and tool_choice, checked)

    def check(self) -> None:
        super().check()
        clash = sorted(TEMPLATE_ARGUMENTS & set(self.chat_template_kwargs or {}))
        if clash:
            raise bad_request(f"chat_template_kwargs cannot set the chat template's own argument {clash[0]!r}",
                              "chat_template_kwargs")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}", "top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        self._tools = chat_tools(self.tools, self.tool_choice, self.parallel_tool_calls, self.functions,
                                     self.function_call)

    @property
    def returned_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def chat_tools(self) -> ChatTools | None:
        return self._tools

    def requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def conversation(self) -> list[dict]:
        return conversation(self.messages)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or messages rendered by the chat template."""
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise bad_request("send either prompt or messages", "prompt")


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


def parse_request(cls: type, data: dict):
    try:
        req = cls.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from None
    req.check()
    return req
