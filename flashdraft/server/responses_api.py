"""OpenAI's Responses API, POST /v1/responses, on the chat path: a request becomes a chat completion request
(instructions as the first message, input items as messages, flat function tools in chat's shape, text.format
as response_format), and the chat completion, or its chunks, becomes a Response object, or its stream of typed
events. Errors name the Responses field.

Nothing is stored: previous_response_id, conversation, background and item references are refused. An
earlier response's reasoning items in the input are dropped, as chat templates drop earlier turns' reasoning."""

from __future__ import annotations

import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from flashdraft.server.errors import APIError, bad_request
from flashdraft.server.serving import SSE_HEADERS, AbortingStreamingResponse, Serving

log = logging.getLogger(__name__)

# Responses fields that change nothing here: accepted and logged
IGNORED = {"store", "metadata", "user", "include", "service_tier", "reasoning", "safety_identifier",
           "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options", "stream_options"}
# fields that need what this server does not do, refused unless at a value that asks for nothing
REFUSED = {
    "previous_response_id": "this server stores no responses; send the whole conversation as input",
    "conversation": "this server stores no conversations; send the whole conversation as input",
    "background": "background responses are not supported (this server stores no responses)",
    "prompt": "stored prompt templates are not supported; send instructions and input",
    "context_management": "context management (compaction) is not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "log-probabilities are not supported at /v1/responses; use /v1/chat/completions",
    "truncation": "only 'disabled' is supported: the input must fit the context",
}
# chat fields with a Responses spelling (or none): refused, naming what to send instead
CHAT_ONLY = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
             "response_format": "text.format", "functions": "tools", "function_call": "tool_choice",
             "n": None, "echo": None, "logprobs": None}
TRANSLATED = {"input", "instructions", "tools", "tool_choice", "text", "max_output_tokens"}
TEXT_PARTS = {"input_text", "output_text", "text"}
ROLES = {"user", "system", "developer", "assistant"}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def chat_body(data: dict) -> dict:
    """The chat completion request a Responses request asks for."""
    for name, why in REFUSED.items():
        if data.get(name) not in (None, False, 0) and (name, data[name]) != ("truncation", "disabled"):
            raise bad_request(f"{name}: {why}", name)
    for name, instead in CHAT_ONLY.items():
        if name in data:
            raise bad_request(f"{name} is not a Responses field" + (f"; send {instead}" if instead else ""), name)
    ignored = sorted(k for k in IGNORED if data.get(k) is not None)
    if ignored:
        log.debug("responses fields that change nothing here, ignored: %s", ", ".join(ignored))
    # the rest (model, temperature, top_p, parallel_tool_calls, stream, and vLLM's extensions: top_k, seed, stop,
    # ...) go to the chat path as they are, which logs those it does not know
    body = {k: v for k, v in data.items() if k not in TRANSLATED | IGNORED | set(REFUSED)}
    body["messages"] = messages(data.get("input"), data.get("instructions"))
    if data.get("tools") is not None:
        body["tools"] = chat_tools(data["tools"])
    if data.get("tool_choice") is not None:
        body["tool_choice"] = chat_tool_choice(data["tool_choice"])
    if data.get("max_output_tokens") is not None:
        body["max_completion_tokens"] = data["max_output_tokens"]
    fmt = text_format(data.get("text"))
    if fmt is not None:
        body["response_format"] = fmt
    if data.get("stream"):
        body["stream_options"] = {"include_usage": True}
    return body


def _text(content: Any, where: str) -> str:
    """A message's content (or a tool's output): a string, or text parts joined as chat joins them."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str) or kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: only text parts are supported, got {kind!r}", f"{where}[{j}]")
        texts.append(part["text"])
    return "\n".join(texts)


def _field(item: dict, name: str, where: str) -> str:
    if not isinstance(item.get(name), str):
        raise bad_request(f"{where}.{name} must be a string", f"{where}.{name}")
    return item[name]


def messages(input: Any, instructions: Any) -> list[dict]:
    """The input items as chat messages, the instructions first; a function call joins the assistant
    message before it (consecutive calls make one message's tool_calls)."""
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string", "instructions")
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input, str):
        return out + [{"role": "user", "content": input}]
    if not isinstance(input, list):
        raise bad_request("input must be a string or a list of items", "input")
    for i, item in enumerate(input):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in ROLES:
                raise bad_request(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
            out.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": _field(item, "arguments", where)}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                        "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise bad_request(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                              "function_call_output, reasoning)", where)
    return out


def chat_tools(tools: Any) -> list[dict]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported, got {kind!r}", f"tools[{i}]")
        if "name" not in t:
            raise bad_request(f"tools[{i}].name is required", f"tools[{i}].name")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                     if t.get(k) is not None}})
    return out


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request("tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": ...}",
                              "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def text_format(text: Any) -> dict | None:
    """text.format as chat's response_format."""
    if text is not None and not isinstance(text, dict):
        raise bad_request("text must be an object", "text")
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise bad_request("text.format.schema must be a JSON schema object", "text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "description", "schema", "strict")
                                                        if k in fmt}}
    raise bad_request(f"text.format type {kind!r} is not supported (text, json_object, json_schema)", "text.format")


CHAT_PARAMS = [(re.compile(r"^messages\b.*"), "input"), (re.compile(r"^max_completion_tokens$"), "max_output_tokens"),
               (re.compile(r"^response_format$"), "text.format"), (re.compile(r"^(tools\[\d+\])\.function"), r"\1")]


def responses_param(param: str | None) -> str | None:
    """The Responses field a chat field came from."""
    for pattern, repl in CHAT_PARAMS:
        if param is not None and pattern.match(param):
            return pattern.sub(repl, param)
    return param


def usage(u: dict | None) -> dict | None:
    """Chat's usage in the Responses shape (reasoning tokens are not counted apart from the output's)."""
    if u is None:
        return None
    details = {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0}
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"], "input_tokens_details": details,
            "output_tokens_details": {"reasoning_tokens": 0}}


class ResponseShell:
    """What every Response object of one request carries: its id, the request's settings echoed."""

    def __init__(self, data: dict, model: str, defaults: dict):
        text = data.get("text") or {}

        def given(name: str, default: Any) -> Any:
            return data[name] if data.get(name) is not None else default

        self.head = {
            "id": _id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": data.get("instructions"), "max_output_tokens": data.get("max_output_tokens"),
            "parallel_tool_calls": given("parallel_tool_calls", True),
            "temperature": given("temperature", defaults.get("temperature", 1.0)),
            "top_p": given("top_p", defaults.get("top_p", 1.0)),
            "tool_choice": data.get("tool_choice") or "auto",
            "tools": [{k: v for k, v in t.items() if k in ("type", "name", "description", "parameters", "strict")}
                      for t in data.get("tools") or []],
            "text": {"format": text.get("format") or {"type": "text"}}, "reasoning": data.get("reasoning"),
            "truncation": "disabled", "metadata": data.get("metadata") or {}, "store": False, "background": False,
            "previous_response_id": None, "user": data.get("user"),
        }

    def response(self, status: str, output: list[dict], chat_usage: dict | None = None,
                 error: dict | None = None) -> dict:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {**self.head, "status": status, "output": output, "usage": usage(chat_usage), "error": error,
                "incomplete_details": incomplete,
                "completed_at": int(time.time()) if status == "completed" else None}


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def reasoning_item(text: str) -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str) -> dict:
    return {"type": "message", "id": _id("msg"), "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict, status: str) -> list[dict]:
    """A chat message as output items: its reasoning, its text, its calls; the last one cut short when the
    response is incomplete."""
    items = [reasoning_item(message["reasoning_content"])] if message.get("reasoning_content") else []
    calls = message.get("tool_calls") or []
    content = message.get("content")
    if content is not None and (content or not calls):
        items.append(message_item(content, "completed"))
    items += [call_item(c["id"], c["function"]["name"], c["function"]["arguments"], "completed") for c in calls]
    if items and "status" in items[-1]:
        items[-1]["status"] = status
    return items


class EventStream:
    """One response's stream events, from its chat chunks: a delta opens the item it belongs to (closing the
    one before) and grows it; the end closes the last and sends the whole response. Whitespace before any
    text is held back, and dropped when tool calls follow (as the whole message drops it)."""

    def __init__(self, shell: ResponseShell):
        self.shell, self.seq = shell, 0
        self.output: list[dict] = []  # the items so far, as their done events show them
        self.open: dict | None = None
        self.held = ""
        self.finish_reason: str | None = None
        self.usage: dict | None = None

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _add(self, item: dict) -> Iterator[str]:
        """Open item (closing the one open): a message or reasoning item with its one part, or a call."""
        yield from self._close("completed")
        self.open, at = item, len(self.output)
        self.output.append(item)
        parts = item.get("content")
        yield self.event("response.output_item.added", output_index=at,
                         item=dict(item, content=[]) if parts is not None else item)
        if parts is not None:
            yield self.event("response.content_part.added", item_id=item["id"], output_index=at, content_index=0,
                             part=parts[0])

    def _close(self, status: str) -> Iterator[str]:
        item, self.open = self.open, None
        if item is None:
            return
        at, where = len(self.output) - 1, {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] == "function_call":
            yield self.event("response.function_call_arguments.done", **where, arguments=item["arguments"])
        else:
            part = item["content"][0]
            if item["type"] == "message":
                yield self.event("response.output_text.done", **where, content_index=0, text=part["text"],
                                 logprobs=[])
            else:
                yield self.event("response.reasoning_text.done", **where, content_index=0, text=part["text"])
            yield self.event("response.content_part.done", **where, content_index=0, part=part)
        if "status" in item:
            item["status"] = status
        yield self.event("response.output_item.done", output_index=at, item=item)

    def _grow(self, kind: str, text: str) -> Iterator[str]:
        """Text of the open item's kind (opened if another is open), as its delta event."""
        if self.open is None or self.open["type"] != kind:
            yield from self._add(message_item("", "in_progress") if kind == "message" else reasoning_item(""))
        where = {"item_id": self.open["id"], "output_index": len(self.output) - 1, "content_index": 0}
        self.open["content"][0]["text"] += text
        if not text:
            return
        if kind == "message":
            yield self.event("response.output_text.delta", **where, delta=text, logprobs=[])
        else:
            yield self.event("response.reasoning_text.delta", **where, delta=text)

    def feed(self, chunk: dict) -> Iterator[str]:
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                yield from self._grow("reasoning", delta["reasoning_content"])
            text = delta.get("content") or ""
            if text and (self.open is not None and self.open["type"] == "message" or text.strip()):
                text, self.held = self.held + text, ""
                yield from self._grow("message", text)
            else:
                self.held += text
            for call in delta.get("tool_calls") or []:
                self.held = ""
                if call.get("id"):
                    yield from self._add(call_item(call["id"], call["function"]["name"], "", "in_progress"))
                args = (call.get("function") or {}).get("arguments")
                if args and self.open is not None and self.open["type"] == "function_call":
                    self.open["arguments"] += args
                    yield self.event("response.function_call_arguments.delta", item_id=self.open["id"],
                                     output_index=len(self.output) - 1, delta=args)
            self.finish_reason = choice.get("finish_reason") or self.finish_reason

    def finish(self) -> Iterator[str]:
        if not any(item["type"] != "reasoning" for item in self.output):  # (the whole message has its text)
            yield from self._grow("message", self.held)
        status = status_of(self.finish_reason)
        yield from self._close(status)
        yield self.event(f"response.{status}", response=self.shell.response(status, self.output, self.usage))

    def fail(self, message: str) -> Iterator[str]:
        yield from self._close("incomplete")
        error = {"code": "server_error", "message": message}
        yield self.event("response.failed", response=self.shell.response("failed", self.output, error=error))


async def _events(chat: StreamingResponse, stream: EventStream) -> AsyncIterator[str]:
    """The chat stream's chunks (each `data: {...}` lines) as Responses events."""
    chunks, started = chat.body_iterator, stream.shell.response("in_progress", [])
    try:
        yield stream.event("response.created", response=started)
        yield stream.event("response.in_progress", response=started)
        async for block in chunks:
            for line in block.splitlines():
                data = line.removeprefix("data: ").strip() if line.startswith("data: ") else ""
                if not data or data == "[DONE]":
                    continue
                chunk = json.loads(data)
                if "error" in chunk:
                    for e in stream.fail(chunk["error"]["message"]):
                        yield e
                    return
                for e in stream.feed(chunk):
                    yield e
        aborted = stream.finish_reason == "abort"
        for e in stream.fail("the request was aborted: the server is shutting down") if aborted else stream.finish():
            yield e
    finally:
        await chunks.aclose()


async def create_response(serving: Serving, request: Request, data: dict) -> Response:
    """POST /v1/responses: the chat path's answer as a Response object, or as its events when streamed."""
    body = chat_body(data)
    try:
        chat = await serving.chat(request, body)
    except APIError as e:
        param = responses_param(e.param)
        if e.param is not None and param != e.param:
            e.message, e.param = e.message.replace(e.param, param), param
        raise
    shell = ResponseShell(data, serving.model_name, serving.aengine.engine.sampling_defaults)
    if isinstance(chat, AbortingStreamingResponse):
        return AbortingStreamingResponse(_events(chat, EventStream(shell)), on_close=chat.on_close,
                                         media_type="text/event-stream", headers=SSE_HEADERS)
    if not isinstance(chat, JSONResponse):
        return chat  # (the client is gone)
    completion = json.loads(chat.body)
    choice = completion["choices"][0]
    status = status_of(choice["finish_reason"])
    return JSONResponse(shell.response(status, output_items(choice["message"], status), completion["usage"]))
