"""The generation endpoints, /v1/completions and /v1/chat/completions, and vLLM's /tokenize and
/detokenize: request in, OpenAI-shaped JSON or server-sent events out (shaped by responses.py). A client
that goes away aborts its request, freeing its KV pages.

Log-probabilities are the target's raw ones (vLLM's default). `best_of` runs that many samples of each
prompt and returns the n of the highest cumulative log-probability."""

from __future__ import annotations

import asyncio
import copy
import logging
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
from flashdraft.server.chat import ChatOptions, ChoiceParser, plan_chat
from flashdraft.server.constraints import constraint_field
from flashdraft.server.messages import chat_tools
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
from flashdraft.server.responses import ResponseFormat, TokenText, best_of, choice_params, sse, usage

log = logging.getLogger(__name__)
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
MAX_LOGGED_FIELDS = 16
MAX_LOGGED_NAME = 64  # characters of each field name


def logged_names(names: list[str]) -> str:
    """Field names a client chose, as a log line may show them: escaped (a "\\n" in a name must not start a
    forged line of its own), each cut short, and the first MAX_LOGGED_FIELDS of them."""
    shown = [ascii(n) if len(n) <= MAX_LOGGED_NAME else ascii(n[:MAX_LOGGED_NAME]) + "..."
             for n in names[:MAX_LOGGED_FIELDS]]
    more = len(names) - len(shown)
    return ", ".join(shown) + (f" and {more} more" if more else "")


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


async def wait_for_disconnect(request: Request) -> None:
    # once the body is read, the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Serving:
    def __init__(self, aengine: AsyncEngine, model_name: str, metrics: ServerMetrics,
                 max_prompt_tokens: int | None = None, chat_options: ChatOptions | None = None):
        self.aengine = aengine
        self.chat_options = chat_options or ChatOptions()
        self.model_name = model_name
        self.metrics = metrics
        self.max_prompt_tokens = max_prompt_tokens
        engine = aengine.engine
        self.max_model_len, self.vocab_size = engine.max_model_len, engine.vocab_size
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
            log.warning("request fields not used by this server, ignored: %s", logged_names(ignored))
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
        messages = req.conversation()
        plan = plan_chat(self.chat_options, self.tokenizer.chat_template, req.chat_tools, messages)
        gen_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
        tools = req.chat_tools.tools if req.chat_tools is not None else None
        max_tokens, max_name = req.requested_max_tokens()
        try:
            ids = await self.tokenized(lambda tok: self.check_ids(encode_chat(
                tok, messages, self.model_name, add_generation_prompt=gen_prompt,
                add_special_tokens=bool(req.add_special_tokens), template_kwargs=req.chat_template_kwargs,
                tools=tools, chat_template=plan.template), max_tokens, max_name))
            prompt_end = await self.tokenized(lambda tok: tok.decode(ids[-16:]))
        except (ValueError, RecursionError, jinja2.TemplateError) as e:
            # (RecursionError: messages, tools or template variables nested deeper than the template renders)
            raise bad_request(str(e), "messages") from None
        params = plan.sampling_params(params, prompt_end)
        if plan.tools is not None and plan.tools.forced:  # a schema in the tools that does not compile: theirs
            grammars = self.aengine.engine.grammars()
            try:
                await self.tokenized(lambda tok: grammars.request(params.structured_outputs))
            except ValueError as e:
                raise bad_request(f"the tools' parameters do not compile into a grammar: {e}", "tools") from None
        # vLLM's echo: the last message's content when its role is the reply's (the last message's own
        # without a generation prompt)
        last = messages[-1]
        echoes = [last["content"] if not gen_prompt or last["role"] == "assistant" else ""] if req.echo else None
        return await self._generate(request, req, params, [lambda tok: ids], echoes,
                                    lambda: plan.parser(prompt_end))

    async def tokenize(self, data: dict) -> dict:
        """vLLM's /tokenize: the ids a prompt (or a conversation, through the chat template) becomes."""
        req = parse_request(TokenizeRequest, data)
        self._check_model(req.model)
        if req.prompt is not None:
            special = True if req.add_special_tokens is None else req.add_special_tokens
            encode = lambda tok: encode_text(tok, req.prompt, special)
        else:
            messages = conversation(req.messages)
            tools = chat_tools(req.tools, None, None)
            plan = plan_chat(self.chat_options, self.tokenizer.chat_template, tools, messages)
            gen_prompt = True if req.add_generation_prompt is None else req.add_generation_prompt
            encode = lambda tok: encode_chat(tok, messages, self.model_name, add_generation_prompt=gen_prompt,
                                             add_special_tokens=bool(req.add_special_tokens),
                                             template_kwargs=req.chat_template_kwargs,
                                             tools=tools.tools if tools else None, chat_template=plan.template)
        try:
            ids = await self.tokenized(encode)
            strs = await self.tokenized(lambda tok: tok.convert_ids_to_tokens(ids)) if req.return_token_strs else None
        except (ValueError, RecursionError, jinja2.TemplateError) as e:
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
                        echoes: list[str | None] | None,
                        parser: Callable[[], ChoiceParser | None] | None = None) -> Response:
        """Each prompt's samples (n, or best_of) as requests of their own (their prompt's cached pages shared),
        prompt-major; every prompt is tokenized and checked before any request starts. `echoes`: what each
        prompt's choices echo, None for a prompt's decoded token ids (vLLM's echo of a token-id prompt)."""
        chat = isinstance(req, ChatCompletionRequest)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        max_tokens, max_name = req.requested_max_tokens()
        samples = req.samples
        streams: list[RequestStream] = []
        if params.constrained:  # compiled here, off the engine thread (the engine reads it from the cache)
            grammars = self.aengine.engine.grammars()
            try:
                await self.tokenized(lambda tok: grammars.request(params.structured_outputs))
            except ValueError as e:
                raise bad_request(str(e), constraint_field(req.constraint_fields())) from None
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
        parsers = [parser() for _ in streams] if parser is not None else None
        fmt = ResponseFormat(request_id, self.model_name, req, prompts, self.token_text, echoes, parsers)
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
        broken = next((out.error for out in outs if out.finish_reason == "error"), None)
        if broken is not None:  # (this request's grammar failed; the others in the batch went on)
            raise APIError(500, f"generation failed: {broken}", type="server_error")
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
                if u.output.finish_reason == "error":
                    yield sse(APIError(500, f"generation failed: {u.output.error}", type="server_error").body())
                    break
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
