"""Tool calls in what a model writes: the formats our families emit, a parser that reads them as the text
streams (OpenAI's `tool_calls` deltas) or whole, and the grammar that forces them (tool_choice "required"
or a named function), as an xgrammar structural tag.

    hermes       Qwen3 / Hermes / ChatML:  <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
    llama3_json  Llama 3.x:                {"name": "f", "parameters": {...}}; {"name": ...}
    mistral      Mistral:                  [TOOL_CALLS][{"name": "f", "arguments": {...}}, {...}]

A call's arguments stream as the model writes them (the raw JSON text, scanned for its closing brace), so
the streamed deltas add up to the arguments of the whole response. Whole, a response whose calls do not
parse (unclosed, or arguments that are not JSON) is all content, as vLLM's parsers leave it."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

import regex


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # what opens the calls ("" for llama3_json: a call opens the response)
    open: str  # before each call's object
    close: str  # after each call's object
    separator: str  # between two calls
    end: str  # after the last call
    args_key: str  # the key of the arguments in a call's object


FORMATS = {
    "hermes": ToolFormat("hermes", "<tool_call>", "<tool_call>\n", "\n</tool_call>", "\n", "", "arguments"),
    "llama3_json": ToolFormat("llama3_json", "", "", "", "; ", "", "parameters"),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", "", "", ", ", "]", "arguments"),
}
REFUSED = {"openai": "GPT-OSS's harmony format", "harmony": "GPT-OSS's harmony format",
           "pythonic": "pythonic tool calls"}


def by_name(kind: str, known: dict, refused: dict[str, str], name: str):
    """known[name]; a ValueError naming the parser otherwise (a refused one with what it would read)."""
    if name in refused:
        raise ValueError(f"{kind} {name!r} ({refused[name]}) is not supported; supported: {', '.join(known)}")
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; supported: {', '.join(known)}")
    return known[name]


def tool_format(name: str) -> ToolFormat:
    return by_name("tool-call parser", FORMATS, REFUSED, name)


def infer_format(chat_template: str | None) -> str | None:
    """The tool-call format a chat template teaches its model, from the markers it writes; None when it
    writes none of ours (a template without tools, or GPT-OSS's harmony channels)."""
    t = chat_template or ""
    if "<|channel|>" in t:
        return None
    if "<tool_call>" in t:
        return "hermes"
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<|python_tag|>" in t or ('"parameters"' in t and "<|eot_id|>" in t):
        return "llama3_json"
    return None


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # the JSON text the model wrote

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


@dataclass
class Delta:
    """What one piece of streamed text adds: content, and tool-call deltas in OpenAI's chunk shape."""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


CALL_HEAD = regex.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(arguments|parameters)"\s*:\s*')
# where the reader is: in content; before a mistral call list's bracket; before a call's name; in its
# arguments; before the call object's brace; before its close marker; before another call or the end
TEXT, LIST, HEAD, ARGS, OBJECT_END, CLOSE, NEXT, BROKEN = range(8)


class ToolCallStream:
    """Reads a response's text piece by piece (`feed`, then `finish`) into content and tool calls."""

    def __init__(self, fmt: ToolFormat):
        self.fmt = fmt
        self.state = TEXT
        self.buf = ""  # text not consumed yet
        self.calls: list[ToolCall] = []
        self.content: list[str] = []
        self.args = _JSONScan()
        self.opened = False  # llama3_json: calls open only the response

    def feed(self, text: str) -> Delta:
        self.buf += text
        out = Delta()
        while self._advance(out):
            pass
        return out

    def finish(self) -> Delta:
        """The end of the response: what was held back (a marker's possible start) is content."""
        out = Delta()
        if self.state in (TEXT, BROKEN):
            self._content(out, self.buf)
            self.buf = ""
        return out

    @property
    def complete(self) -> bool:
        """Whether every call the response opened was closed, its arguments JSON."""
        closing = self.state == CLOSE and self.fmt.close.strip().startswith(self.buf.strip())
        if not (self.state in (TEXT, NEXT) or closing):
            return False
        for c in self.calls:
            try:
                json.loads(c.arguments)
            except ValueError:
                return False
        return True

    def _content(self, out: Delta, text: str) -> None:
        if text:
            out.content += text
            self.content.append(text)

    def _broken(self) -> bool:
        self.state = BROKEN
        return True

    def _advance(self, out: Delta) -> bool:
        """Consume what can be consumed of buf; whether to go on."""
        fmt, buf = self.fmt, self.buf
        if self.state == BROKEN:  # the rest is content
            self._content(out, buf)
            self.buf = ""
            return False
        if self.state == TEXT and not fmt.start:  # llama3_json: a call opens the response, or none comes
            rest = buf.lstrip().removeprefix("<|python_tag|>")
            if self.opened or (rest and not "<|python_tag|>".startswith(rest) and rest[0] != "{"):
                self.opened = True
                self._content(out, buf)
                self.buf = ""
                return False
            if not rest or rest[0] != "{":
                return False
            self.buf, self.state, self.opened = rest, HEAD, True
            return True
        if self.state == TEXT:
            at = buf.find(fmt.start)
            if at < 0:
                keep = partial_suffix(buf, fmt.start)
                self._content(out, buf[: len(buf) - keep])
                self.buf = buf[len(buf) - keep:]
                return False
            self._content(out, buf[:at])
            self.buf, self.state = buf[at + len(fmt.start):], LIST if fmt.end else HEAD
            return True
        rest = buf.lstrip()
        if self.state == LIST:
            if not rest:
                return False
            if rest[0] != "[":
                return self._broken()
            self.buf, self.state = rest[1:], HEAD
            return True
        if self.state == HEAD:
            m = CALL_HEAD.match(buf, partial=True)
            if m is None:
                return self._broken()
            if m.partial:
                return False
            call = ToolCall(new_call_id(), json.loads(f'"{m.group(1)}"'), "")
            self.calls.append(call)
            out.tool_calls.append({"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                   "function": {"name": call.name, "arguments": ""}})
            self.buf, self.state, self.args = buf[m.end():], ARGS, _JSONScan()
            return True
        if self.state == ARGS:
            if not self.args.started:  # (the arguments' text starts at their value)
                buf = buf.lstrip()
            n = self.args.scan(buf)
            piece, self.buf = buf[:n], buf[n:]
            if piece:
                self.calls[-1].arguments += piece
                out.tool_calls.append({"index": len(self.calls) - 1, "function": {"arguments": piece}})
            if self.args.failed:
                return self._broken()
            if self.args.done:
                self.state = OBJECT_END
                return True
            return False
        if not rest:
            return False
        if self.state == OBJECT_END:
            if rest[0] != "}":
                return self._broken()
            self.buf, self.state = rest[1:], CLOSE if fmt.close else NEXT
            return True
        if self.state == CLOSE:  # hermes: text, or another call, may follow
            close = fmt.close.strip()
            if len(rest) < len(close):
                return False if close.startswith(rest) else self._broken()
            if not rest.startswith(close):
                return self._broken()
            self.buf, self.state = rest[len(close):], TEXT
            return True
        sep, end = fmt.separator.strip(), fmt.end.strip()  # NEXT
        if rest.startswith(sep):
            self.buf, self.state = rest[len(sep):], HEAD
            return True
        if end and rest.startswith(end):
            self.buf, self.state = rest[len(end):], TEXT
            return True
        return self._broken()


class _JSONScan:
    """Finds where a JSON value ends in text that arrives piece by piece (strings and escapes aware)."""

    def __init__(self):
        self.depth, self.in_string, self.escape = 0, False, False
        self.started = self.done = self.failed = False

    def scan(self, text: str) -> int:
        """How many characters of text belong to the value (all of them while it goes on)."""
        for i, ch in enumerate(text):
            if not self.started:
                if ch.isspace():
                    continue
                if ch not in "{[\"":
                    self.failed = True
                    return i
                self.started = True
                if ch == '"':
                    self.in_string = True
                else:
                    self.depth = 1
                continue
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.depth == 0:
                        self.done = True
                        return i + 1
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of text that begins marker (held back: the marker may be coming)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, list[ToolCall]]:
    """A whole response's content and tool calls; all content when a call does not parse."""
    stream = ToolCallStream(fmt)
    stream.feed(text)
    stream.finish()
    if not stream.calls or not stream.complete:
        return text, []
    return "".join(stream.content), stream.calls
