"""The generation endpoints, /v1/completions and /v1/chat/completions: request in, OpenAI-shaped
JSON or server-sent events out. A client that goes away aborts its request, freeing its KV pages."""

from __future__ import annotations

import asyncio
import copy
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
from flashdraft.engine.sequence import Output
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


def usage(out: Output) -> dict:
    prompt, completion = len(out.prompt_token_ids), len(out.token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": out.metrics.get("num_cached_tokens", 0)}}


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


class ResponseFormat:
    """OpenAI's response and chunk shapes for one request."""

    def __init__(self, request_id: str, model: str, chat: bool, with_meta_info: bool = False):
        self.id, self.model, self.chat, self.with_meta_info = request_id, model, chat, with_meta_info
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, out: Output) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                      "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        body = {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(out), "metrics": out.metrics}
        return body | {"meta_info": meta_info(out)} if self.with_meta_info else body

    def last_chunk(self, text: str, out: Output) -> dict:
        body = {**self.chunk(text, out.finish_reason), "metrics": out.metrics}
        return body | {"meta_info": meta_info(out)} if self.with_meta_info else body

    def chunk(self, text: str, finish_reason: str | None = None, first: bool = False) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]}

    def usage_chunk(self, out: Output) -> dict:
        return {**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [],
                "usage": usage(out)}


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
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flashdraft-tokenize")

    async def tokenized(self, encode: Callable[[Any], list[int]]) -> list[int]:
        """encode(tokenizer) run on the tokenizing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._tokenizing, encode, self.tokenizer)

    def check_ids(self, ids: list[int], max_tokens: int | None, max_name: str) -> list[int]:
        """What add_request would refuse, refused before the request reaches the engine thread; and, as vLLM
        does, a max_tokens that the context cannot hold."""
        if not ids:
            raise ValueError("prompt is empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt_tokens}")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; the context window (max_model_len) is "
                             f"{self.max_model_len}, leaving no room to generate")
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
        return req, req.sampling_params()

    async def completions(self, request: Request, data: dict) -> Response:
        req, params = self._parsed(CompletionRequest, data)
        prompt = req.single_prompt()
        special = True if req.add_special_tokens is None else req.add_special_tokens
        encode = (lambda tok: encode_text(tok, prompt, special)) if isinstance(prompt, str) else (lambda tok: prompt)
        return await self._generate(request, req, params, encode, chat=False)

    async def chat(self, request: Request, data: dict) -> Response:
        req, params = self._parsed(ChatCompletionRequest, data)
        conversation = req.conversation()
        gen_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
        encode = lambda tok: encode_chat(tok, conversation, self.model_dir, add_generation_prompt=gen_prompt,
                                         add_special_tokens=bool(req.add_special_tokens),
                                         template_kwargs=req.chat_template_kwargs)
        return await self._generate(request, req, params, encode, chat=True)

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
                        params: SamplingParams, encode: Callable[[Any], list[int]], chat: bool) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        max_tokens, max_name = req.requested_max_tokens()
        try:
            ids = await self.tokenized(lambda tok: self.check_ids(encode(tok), max_tokens, max_name))
            stream = await self.aengine.add(lambda engine: ids, params, request_id, bool(req.stream))
        except (ValueError, jinja2.TemplateError) as e:
            raise bad_request(str(e), "messages" if chat else "prompt") from None
        fmt = ResponseFormat(request_id, self.model_name, chat, bool(req.return_meta_info))
        if req.stream:
            return AbortingStreamingResponse(self._events(stream, fmt, req.include_usage),
                                             on_close=lambda: self.aengine.abort(stream),
                                             media_type="text/event-stream", headers=SSE_HEADERS)
        final = await self._wait(request, stream)
        if final is None:
            return Response(status_code=499)  # the client is gone; nobody reads this
        if final.error is not None:
            raise APIError(500, f"generation failed: {final.error}", type="server_error")
        out = final.output
        if out.finish_reason == "abort":
            raise APIError(503, "the request was aborted: the server is shutting down", type="server_error")
        self.metrics.observe(out.metrics)
        return JSONResponse(fmt.full(out))

    async def _wait(self, request: Request, stream: RequestStream) -> Update | None:
        """The final update, or None when the client disconnected first (the request is aborted)."""
        final = asyncio.ensure_future(stream.final())
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({final, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not final.done():
                final.cancel()
                self.aengine.abort(stream)
        return final.result() if final.done() and not final.cancelled() else None

    async def _events(self, stream: RequestStream, fmt: ResponseFormat, include_usage: bool) -> AsyncIterator[str]:
        try:
            if fmt.chat:
                yield sse(fmt.chunk("", first=True))
            async for u in stream.updates():
                if u.error is not None:
                    yield sse(APIError(500, f"generation failed: {u.error}", type="server_error").body())
                    break
                if not u.finished:
                    yield sse(fmt.chunk(u.text))
                    continue
                out = u.output
                self.metrics.observe(out.metrics)
                yield sse(fmt.last_chunk(u.text, out))
                if include_usage:
                    yield sse(fmt.usage_chunk(out))
            yield "data: [DONE]\n\n"
        finally:
            self.aengine.abort(stream)  # a no-op when it finished
