"""What the generation endpoints send back, in OpenAI's shapes: the response and its chunks
(ResponseFormat), usage, SGLang's meta_info, the log-probability objects (each token's text decoded on
its own, as vLLM does: the legacy object of /v1/completions, chat's content list, vLLM's prompt_logprobs),
best_of's choice of samples and the server-sent event lines."""

from __future__ import annotations

import dataclasses
import json
import time

from flashdraft.engine.sequence import Output, TokenLogprob
from flashdraft.sampling_params import SamplingParams
from flashdraft.server.chat import ChoiceParser
from flashdraft.server.protocol import ChatCompletionRequest, CompletionRequest


def usage(outs: list[Output], n: int = 1) -> dict:
    """OpenAI's usage of a request's samples (n per prompt): each prompt's tokens counted once. best_of's
    samples all count, returned or not (OpenAI bills them; vLLM counted the returned ones)."""
    firsts = outs[::n]
    prompt, completion = sum(len(o.prompt_token_ids) for o in firsts), sum(len(o.token_ids) for o in outs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(o.metrics.get("num_cached_tokens", 0) for o in firsts)}}


def meta_info(out: Output) -> dict:
    """SGLang's meta_info (return_meta_info): token counts and, for a request that verified drafts, its
    verify steps and acceptance length (tokens committed per verify, the server's own tau)."""
    m = out.metrics
    info = {"id": out.request_id, "finish_reason": {"type": out.finish_reason},
            "prompt_tokens": len(out.prompt_token_ids), "completion_tokens": len(out.token_ids),
            "cached_tokens": m.get("num_cached_tokens", 0), "e2e_latency": m.get("e2e_s")}
    if m.get("num_drafts"):
        info |= {"spec_verify_ct": m["num_drafts"], "spec_accept_length": m["acceptance_length"],
                 "spec_accept_token_num": m["num_accepted_tokens"], "spec_draft_token_num": m["num_draft_tokens"],
                 "spec_accept_histogram": m["acceptance_histogram"]}
    return info


LOGPROB_FLOOR = -9999.0  # what OpenAI and vLLM send for -inf, which JSON cannot hold


class TokenText:
    """Each token id's text decoded on its own (vLLM's token strings), cached. It has its own tokenizer: the
    event loop calls it, and a tokenizer must not be used by two threads at once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


def legacy_logprobs(entries: list[tuple[int, TokenLogprob | None]], top: int, token: TokenText, offset: int) -> dict:
    """/v1/completions' logprobs object for (token id, entry) pairs, the first at character `offset`: each
    token's top `top` and itself (OpenAI: up to top + 1 entries, most likely first; tokens of the same text
    keep the likelier's); a None entry (the prompt's first) has no log-probability. text_offset adds up the
    tokens' texts, as vLLM's."""
    body: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, e in entries:
        text = token(token_id)
        body["tokens"].append(text)
        body["text_offset"].append(offset)
        offset += len(text)
        if e is None:
            body["token_logprobs"].append(None)
            body["top_logprobs"].append(None)
            continue
        best: dict[str, float] = {}
        for t, lp in [*e.top[:top], (token_id, e.logprob)]:  # the chosen one, if not a top one, is the least likely
            best.setdefault(token(t), max(lp, LOGPROB_FLOOR))
        body["token_logprobs"].append(max(e.logprob, LOGPROB_FLOOR))
        body["top_logprobs"].append(best)
    return body


def chat_logprobs(entries: list[TokenLogprob], top: int, token: TokenText) -> dict:
    """Chat's logprobs object: each token with its top `top`, most likely first."""
    def item(token_id: int, logprob: float) -> dict:
        text = token(token_id)
        return {"token": text, "logprob": max(logprob, LOGPROB_FLOOR), "bytes": list(text.encode("utf-8"))}

    return {"content": [item(e.token_id, e.logprob) | {"top_logprobs": [item(t, lp) for t, lp in e.top[:top]]}
                        for e in entries]}


def vllm_prompt_logprobs(out: Output, top: int, token: TokenText) -> list[dict | None]:
    """vLLM's prompt_logprobs: None for the first token, then {token id: {logprob, rank, decoded_token}} of
    the prompt's token and the top `top`. rank is a token's place among the top ones the engine returned,
    so None for a prompt token outside them (vLLM ranks it in the whole vocabulary)."""
    def item(token_id: int, logprob: float, rank: int | None) -> dict:
        return {"logprob": max(logprob, LOGPROB_FLOOR), "rank": rank, "decoded_token": token(token_id)}

    body: list[dict | None] = [None]
    for token_id, e in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:]):
        ranks = {t: r for r, (t, _) in enumerate(e.top, 1)}
        position = {str(token_id): item(token_id, e.logprob, ranks.get(token_id))}
        for r, (t, lp) in enumerate(e.top[:top], 1):
            position.setdefault(str(t), item(t, lp, r))
        body.append(position)
    return body


class ResponseFormat:
    """OpenAI's response and chunk shapes for one request: n choices per prompt, prompt-major. One choice
    carries its `metrics` (and SGLang's `meta_info`) beside `usage`, several each in their choice. A
    choice's first text follows what the request echoes (`echoes`, one per prompt); its log-probabilities
    are those of the tokens its text carries."""

    def __init__(self, request_id: str, model: str, req: CompletionRequest | ChatCompletionRequest,
                 prompts: list[list[int]], token: TokenText, echoes: list[str] | None = None,
                 parsers: list[ChoiceParser | None] | None = None):
        self.id, self.model, self.chat = request_id, model, isinstance(req, ChatCompletionRequest)
        self.with_meta_info, self.n = bool(req.return_meta_info), req.n or 1
        self.prompts, self.choices = prompts, len(prompts) * self.n
        self.logprobs, self.prompt_logprobs, self.token = req.returned_logprobs, req.prompt_logprobs, token
        self.echoes = echoes
        self.parsers = parsers or [None] * self.choices  # chat: each choice's reasoning and tool calls
        self.made_calls = [False] * self.choices
        self.started = [False] * self.choices
        self.offsets = [0] * self.choices  # completions: each choice's next text_offset
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _extras(self, out: Output) -> dict:
        return {"metrics": out.metrics} | ({"meta_info": meta_info(out)} if self.with_meta_info else {})

    def _echo(self, k: int) -> str:
        """Choice k's echo, the first time it is asked for."""
        first, self.started[k] = not self.started[k], True
        return self.echoes[k // self.n] if first and self.echoes else ""

    def content(self, k: int, text: str, entries: list[TokenLogprob] | None,
                prompt_entries: list[TokenLogprob | None] | None) -> tuple[str, dict | None]:
        """Choice k's next text and the logprobs object of the tokens it carries; the choice's first text
        begins with the echo (at /v1/completions, with logprobs, the prompt's tokens first)."""
        echo = self._echo(k)
        if self.logprobs is None:
            return echo + text, None
        if self.chat:
            return echo + text, chat_logprobs(entries, self.logprobs, self.token)
        pairs = [(e.token_id, e) for e in entries]
        if echo:
            pairs = list(zip(self.prompts[k // self.n], prompt_entries)) + pairs
        body = legacy_logprobs(pairs, self.logprobs, self.token, self.offsets[k])
        self.offsets[k] += sum(len(t) for t in body["tokens"])
        return echo + text, body

    def full(self, outs: list[Output], usage: dict) -> dict:
        choices = []
        for k, out in enumerate(outs):
            text, logprobs = self.content(k, out.text, out.logprobs, out.prompt_logprobs)
            if self.chat:
                message, parser, reason = {"role": "assistant", "content": text}, self.parsers[k], out.finish_reason
                if parser is not None:
                    message |= parser.message(text)
                    reason = parser.finish_reason(reason, "tool_calls" in message)
                choice = {"index": k, "message": message, "logprobs": logprobs, "finish_reason": reason}
            else:
                choice = {"index": k, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
                if self.prompt_logprobs is not None:  # vLLM's place for them: the choice at /v1/completions
                    choice["prompt_logprobs"] = vllm_prompt_logprobs(out, self.prompt_logprobs, self.token)
            choices.append(choice | (self._extras(out) if self.choices > 1 else {}))
        body = {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices,
                "usage": usage}
        if self.chat and self.prompt_logprobs is not None:  # and the response at /v1/chat/completions
            body["prompt_logprobs"] = vllm_prompt_logprobs(outs[0], self.prompt_logprobs, self.token)
        return body | (self._extras(outs[0]) if self.choices == 1 else {})

    def role_chunk(self, k: int) -> dict:
        """A chat stream's first chunk of choice k: the role, and the echo."""
        return self._chunk(k, {"role": "assistant", "content": self._echo(k)})

    def chunk(self, k: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None) -> dict:
        parser = self.parsers[k]
        if not self.chat:
            return self._chunk(k, text, logprobs, finish_reason)
        if parser is None:
            return self._chunk(k, {"content": text} if text else {}, logprobs, finish_reason)
        delta = parser.delta(text, last=finish_reason is not None)
        self.made_calls[k] |= "tool_calls" in delta
        if finish_reason is not None:
            finish_reason = parser.finish_reason(finish_reason, self.made_calls[k])
        return self._chunk(k, delta, logprobs, finish_reason)

    def last_chunk(self, k: int, text: str, logprobs: dict | None, out: Output) -> dict:
        body = self.chunk(k, text, logprobs, out.finish_reason)
        if self.choices > 1:
            body["choices"][0] |= self._extras(out)
            return body
        return body | self._extras(out)

    def _chunk(self, k: int, content: dict | str, logprobs: dict | None = None,
               finish_reason: str | None = None) -> dict:
        choice = {"index": k, "delta" if self.chat else "text": content, "logprobs": logprobs,
                  "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, outs: list[Output]) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(outs, self.n)}


def best_of(outs: list[Output], samples: int, n: int) -> list[Output]:
    """Each prompt's n samples (of `samples`) of the highest cumulative log-probability, best first."""
    if samples == n:
        return outs
    return [out for p in range(0, len(outs), samples)
            for out in sorted(outs[p: p + samples], key=lambda o: -o.cumulative_logprob)[:n]]


def choice_params(params: SamplingParams, i: int) -> SamplingParams:
    """The i-th of n samples of a prompt: a seeded request's seed mixed with i (each sample its own
    stream, the same on every run); without a seed the engine draws one per request."""
    if params.seed is None or i == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed * 0x9E3779B97F4A7C15 + i) % (1 << 63))


def sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
