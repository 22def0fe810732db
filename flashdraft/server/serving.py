"""The generation endpoints, /v1/completions and /v1/chat/completions: request in, OpenAI-shaped
JSON or server-sent events out. A client that goes away aborts its request, freeing its KV pages.

Log-probabilities are the target's raw ones (vLLM's default), each token's text decoded on its own as vLLM
does: the legacy object of /v1/completions (`logprobs`, with `echo` the prompt's first), chat's content
list (`logprobs`, `top_logprobs`), and vLLM's `prompt_logprobs`. `best_of` runs that many samples of each
prompt and returns the n of the highest cumulative log-probability."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from flashdraft.engine.prompts import encode_chat, encode_text
from flashdraft.engine.sequence import Output, TokenLogprob
from flashdraft.sampling_params import SamplingParams
from flashdraft.server.async_engine import AsyncEngine, RequestStream, Update
from flashdraft.server.metrics import ServerMetrics
from flashdraft.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    bad_request,
    conversation,
    parse_request,
)

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class AbortingStreamingResponse(StreamingResponse):
    """Calls `on_close` however the response ends. Starlette cancels the streaming task when the
    client disconnects, which may leave the body generator suspended rather than closed; this
    does not depend on when that generator is finalized."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


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
                 prompts: list[list[int]], token: TokenText, echoes: list[str] | None = None):
        self.id, self.model, self.chat = request_id, model, isinstance(req, ChatCompletionRequest)
        self.with_meta_info, self.n = bool(req.return_meta_info), req.n or 1
        self.prompts, self.choices = prompts, len(prompts) * self.n
        self.logprobs, self.prompt_logprobs, self.token = req.returned_logprobs, req.prompt_logprobs, token
        self.echoes = echoes
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
                choice = {"index": k, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                          "finish_reason": out.finish_reason}
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
        return self._chunk(k, ({"content": text} if text else {}) if self.chat else text, logprobs, finish_reason)

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


async def wait_for_disconnect(request: Request) -> None:
    # once the body is read, the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Serving:
    def __init__(self, aengine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 max_prompt_tokens: int | None = None):
        self.aengine = aengine
        self.model_name = model_name
        self.metrics = metrics
        self.max_prompt_tokens = max_prompt_tokens
        engine = aengine.engine
        self.max_model_len, self.vocab_size, self.model_dir = engine.max_model_len, engine.vocab_size, engine.model_dir
        # prompts are tokenized here, one at a time, on a copy of the tokenizer: a long prompt must not stall
        # the engine thread (every running stream waits on it), and the engine's copy stays its own
        self.tokenizer = copy.deepcopy(engine.tokenizer)
        self.token_text = TokenText(copy.deepcopy(engine.tokenizer))
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashdraft-tokenize")

    async def tokenized(self, encode: Callable[[Any], list[int]]) -> list[int]:
        """encode(tokenizer) run on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode, self.tokenizer)

    def check_ids(self, ids: list[int], max_tokens: int | None, max_name: str) -> list[int]:
        """What add_request would refuse, refused before the request reaches the engine thread; and, as vLLM
        does, a max_tokens that the context cannot hold."""
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt_tokens}")
        self.aengine.engine.check_prompt(ids)  # reads only what the engine fixed at start: safe off its thread
        if max_tokens is not None and len(ids) + max_tokens > self.max_model_len:
            raise bad_request(f"{max_name} is too large: {max_tokens}. This model's maximum context length is "
                              f"{self.max_model_len} tokens and your request has {len(ids)} input tokens "
                              f"({max_tokens} > {self.max_model_len} - {len(ids)})", max_name)
        return ids

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "model", code="model_not_found")

    def _parsed(self, cls: type[CompletionRequest | ChatCompletionRequest], data: dict):
        req = parse_request(cls, data)
        self._check_model(req.model)
        ignored = req.ignored_fields()
        if ignored:
            log.warning("request fields not used by this server, ignored: %s", ", ".join(ignored))
        return req, req.sampling_params(self.vocab_size, self.aengine.engine.sampling_defaults)

    async def completions(self, request: Request, data: dict) -> Response:
        req, params = self._parsed(CompletionRequest, data)
        special = True if req.add_special_tokens is None else req.add_special_tokens
        prompts = req.prompts()
        encodes = [(lambda tok, p=p: encode_text(tok, p, special)) if isinstance(p, str) else (lambda tok, p=p: p)
                   for p in prompts]
        echoes = [p if isinstance(p, str) else None for p in prompts] if req.echo else None
        return await self._generate(request, req, params, encodes, echoes)

    async def chat(self, request: Request, data: dict) -> Response:
        req, params = self._parsed(ChatCompletionRequest, data)
        conversation = req.conversation()
        gen_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
        encode = lambda tok: encode_chat(tok, conversation, self.model_dir, add_generation_prompt=gen_prompt,
                                         add_special_tokens=bool(req.add_special_tokens),
                                         template_kwargs=req.chat_template_kwargs)
        # vLLM's echo: the last message's content when its role is the reply's (the last message's own
        # without a generation prompt)
        last = conversation[-1]
        echoes = [last["content"] if not gen_prompt or last["role"] == "assistant" else ""] if req.echo else None
        return await self._generate(request, req, params, [encode], echoes)

    async def tokenize(self, data: dict) -> dict:
        """vLLM's /tokenize: the ids a prompt (or a conversation, through the chat template) becomes."""
        req = parse_request(TokenizeRequest, data)
        self._check_model(req.model)
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            encode = lambda tok: encode_text(tok, req.prompt, special)
        else:
            messages = conversation(req.messages)
            gen_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
            encode = lambda tok: encode_chat(tok, messages, self.model_dir, add_generation_prompt=gen_prompt,
                                             add_special_tokens=bool(req.add_special_tokens),
                                             template_kwargs=req.chat_template_kwargs)
        try:
            ids = await self.tokenized(encode)
            strs = await self.tokenized(lambda tok: tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        except (ValueError, jinja2.TemplateError) as e:
            raise bad_request(str(e), "prompt" if req.prompt is not None else "messages") from None
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, data: dict) -> dict:
        req = parse_request(DetokenizeRequest, data)
        self._check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})", "tokens")
        return {"prompt": await self.tokenized(lambda tok: tok.decode(req.tokens))}

    async def _generate(self, request: Request, req: CompletionRequest | ChatCompletionRequest,
                        params: SamplingParams, encodes: list[Callable[[Any], list[int]]],
                        echoes: list[str | None] | None) -> Response:
        """Each prompt's samples (n, or best_of) as requests of their own (their prompt's cached pages shared),
        prompt-major; every prompt is tokenized and checked before any request starts. `echoes`: what each
        prompt's choices echo, None for a prompt's decoded token ids (vLLM's echo of a token-id prompt)."""
        chat = isinstance(req, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        max_tokens, max_name = req.requested_max_tokens()
        samples = req.samples
        streams: list[RequestStream] = []
        try:
            prompts = [await self.tokenized(lambda tok, e=e: self.check_ids(e(tok), max_tokens, max_name))
                       for e in encodes]
            if echoes is not None:
                echoes = [e if e is not None else await self.tokenized(lambda tok, ids=ids: tok.decode(ids))
                          for e, ids in zip(echoes, prompts)]
            for p, ids in enumerate(prompts):
                for i in range(samples):
                    sub_id = request_id if len(prompts) * samples == 1 else f"{request_id}-{p * samples + i}"
                    streams.append(await self.aengine.add(lambda engine, ids=ids: ids, choice_params(params, i),
                                                          sub_id, bool(req.stream)))
        except (ValueError, jinja2.TemplateError) as e:
            for st in streams:
                self.aengine.abort(st)
            raise bad_request(str(e), "messages" if chat else "prompt") from None
        except BaseException:
            for st in streams:
                self.aengine.abort(st)
            raise
        fmt = ResponseFormat(request_id, self.model_name, req, prompts, self.token_text, echoes)
        if req.stream:  # never with best_of > n
            return AbortingStreamingResponse(self._events(streams, fmt, req.include_usage),
                                             on_close=lambda: [self.aengine.abort(st) for st in streams],
                                             media_type="text/event-stream", headers=SSE_HEADERS)
        finals = await self._wait(request, streams)
        if finals is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        failed = next((f.error for f in finals if f.error is not None), None)
        if failed is not None:
            raise APIError(500, f"generation failed: {failed}", type="server_error")
        outs = [f.output for f in finals]
        if any(out.finish_reason == "abort" for out in outs):
            raise APIError(503, "the request was aborted: the server is shutting down", type="server_error")
        for out in outs:
            self.metrics.observe(out.metrics)
        return JSONResponse(fmt.full(best_of(outs, samples, fmt.n), usage(outs, samples)))

    async def _wait(self, request: Request, streams: list[RequestStream]) -> list[Update] | None:
        """The final updates, or None when the client disconnected first (the requests are aborted)."""
        final = asyncio.ensure_future(asyncio.gather(*(st.final() for st in streams)))
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not final.done():
                final.cancel()
                for st in streams:
                    self.aengine.abort(st)
        return final.result() if final.done() and not final.cancelled() else None

    async def _events(self, streams: list[RequestStream], fmt: ResponseFormat,
                      include_usage: bool) -> AsyncIterator[str]:
        """The choices' chunks as they come, each with its index; [DONE] once every choice has ended."""
        merged: asyncio.Queue[tuple[int, Update]] = asyncio.Queue()

        async def pump(k: int, st: RequestStream) -> None:
            async for u in st.updates():
                merged.put_nowait((k, u))

        pumps = [asyncio.ensure_future(pump(k, st)) for k, st in enumerate(streams)]
        outs: list[Output | None] = [None] * len(streams)
        try:
            if fmt.chat:
                for k in range(len(streams)):
                    yield sse(fmt.role_chunk(k))
            ended = 0
            while ended < len(streams):
                k, u = await merged.get()
                if u.error is not None:
                    yield sse(APIError(500, f"generation failed: {u.error}", type="server_error").body())
                    break
                text, logprobs = fmt.content(k, u.text, u.logprobs, u.prompt_logprobs)
                if not u.finished:
                    yield sse(fmt.chunk(k, text, logprobs))
                    continue
                outs[k], ended = u.output, ended + 1
                self.metrics.observe(u.output.metrics)
                yield sse(fmt.last_chunk(k, text, logprobs, u.output))
            if include_usage and all(o is not None for o in outs):
                yield sse(fmt.usage_chunk(outs))
            yield "data: [DONE]\n\n"
        finally:
            for task in pumps:
                task.cancel()
            for st in streams:
                self.aengine.abort(st)  # a no-op when it finished
