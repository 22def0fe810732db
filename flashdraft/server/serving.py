"""The generation endpoints, /v1/completions and /v1/chat/completions: request in, OpenAI-shaped
JSON or server-sent events out. A client that goes away aborts its request, freeing its KV pages."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable

import jinja2
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from flashdraft.engine.engine import LLMEngine
from flashdraft.engine.sequence import Output
from flashdraft.sampling_params import SamplingParams
from flashdraft.server.async_engine import AsyncEngine, RequestStream, Update
from flashdraft.server.metrics import ServerMetrics
from flashdraft.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    parse_request,
)

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
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ResponseFormat:
    """OpenAI's response and chunk shapes for one request."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat = request_id, model, chat
        self.created = int(time.time())

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def full(self, out: Output) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": out.text}, "logprobs": None,
                      "finish_reason": out.finish_reason}
        else:
            choice = {"index": 0, "text": out.text, "logprobs": None, "finish_reason": out.finish_reason}
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": [choice],
                "usage": usage(out), "metrics": out.metrics}

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

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist; this server serves `{self.model_name}`",
                           "model", code="model_not_found")

    def _checked(self, ids: list[int]) -> list[int]:
        if self.max_prompt_tokens is not None and len(ids) > self.max_prompt_tokens:
            raise ValueError(f"prompt has {len(ids)} tokens; this server accepts at most {self.max_prompt_tokens}")
        return ids

    async def completions(self, request: Request, data: dict) -> Response:
        req = parse_request(CompletionRequest, data)
        self._check_model(req.model)
        params = req.sampling_params()
        prompt = req.single_prompt()
        make_ids = lambda engine: self._checked(engine.tokenize(prompt))
        return await self._generate(request, req, params, make_ids, chat=False)

    async def chat(self, request: Request, data: dict) -> Response:
        req = parse_request(ChatCompletionRequest, data)
        self._check_model(req.model)
        params = req.sampling_params()
        conversation = req.conversation()
        make_ids = lambda engine: self._checked(engine.apply_chat_template(conversation))
        return await self._generate(request, req, params, make_ids, chat=True)

    async def _generate(self, request: Request, req: CompletionRequest | ChatCompletionRequest,
                        params: SamplingParams, make_ids: Callable[[LLMEngine], list[int]], chat: bool) -> Response:
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            stream = await self.aengine.add(make_ids, params, request_id, bool(req.stream))
        except (ValueError, jinja2.TemplateError) as e:
            raise bad_request(str(e), "messages" if chat else "prompt") from None
        fmt = ResponseFormat(request_id, self.model_name, chat)
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
                yield sse({**fmt.chunk(u.text, out.finish_reason), "usage": usage(out), "metrics": out.metrics})
                if include_usage:
                    yield sse(fmt.usage_chunk(out))
            yield "data: [DONE]\n\n"
        finally:
            self.aengine.abort(stream)  # a no-op when it finished
