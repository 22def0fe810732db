"""What a chat request's tools and the server's chat flags make of it (vLLM's `--chat-template`,
`--tool-call-parser`, `--enable-auto-tool-choice`, `--reasoning-parser`): the template that renders it,
the grammar its output takes, and how each choice's text becomes reasoning, content and tool calls
(streamed as deltas, or whole).

Tool choice: "none" renders the tools and parses nothing; "auto" lets the model choose, its calls parsed;
"required" and a named function are forced by a grammar in the model's own call format. A model whose
template writes no tools gets flashdraft's ChatML-with-tools template when its template is ChatML;
otherwise a request with tools is refused, naming --chat-template. With a reasoning parser, a constraint
(response_format or a forced call) applies from the end of the reasoning on."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from flashdraft.chat.grammars import after_reasoning, constraint_format, tool_call_format
from flashdraft.chat.reasoning import (
    ReasoningFormat,
    ReasoningStream,
    prompt_opens_reasoning,
    reasoning_format,
    split_reasoning,
)
from flashdraft.chat.template import CHATML_TOOLS, load_chat_template
from flashdraft.chat.tool_calls import ToolCallStream, ToolFormat, infer_format, parse_tool_calls, tool_format
from flashdraft.sampling_params import SamplingParams
from flashdraft.server.errors import bad_request
from flashdraft.server.messages import ChatTools


@dataclass
class ChatOptions:
    """The server's chat flags, checked at start."""

    chat_template: str | None = None  # the template's text, in place of the tokenizer's
    tool_call_parser: str | None = None  # None: the one the template's markers name
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None:
            tool_format(self.tool_call_parser)  # (ValueError naming a parser we do not have)
        if self.reasoning_parser is not None:
            reasoning_format(self.reasoning_parser)


@dataclass
class ChatPlan:
    """One chat request's template (None: the tokenizer's), its tools' format, and its reasoning parser."""

    template: str | None
    tools: ChatTools | None
    tool_fmt: ToolFormat | None
    reasoning: ReasoningFormat | None

    @property
    def parses_calls(self) -> bool:
        return self.tools is not None and self.tools.choice != "none"

    def sampling_params(self, params: SamplingParams, prompt_text: str) -> SamplingParams:
        """params with the grammar the request's output takes: a forced tool call, or its own constraint
        after the reasoning."""
        opened = self.reasoning is not None and prompt_opens_reasoning(prompt_text, self.reasoning)
        forced = self.tools.forced if self.tools is not None else None
        if forced:
            if params.structured_outputs is not None:
                raise bad_request("a forced tool call (tool_choice) and response_format cannot be combined",
                                  "tool_choice")
            content = tool_call_format(self.tool_fmt, forced, self.tools.parallel and not self.tools.named)
        elif params.structured_outputs is not None and self.reasoning is not None:
            content = constraint_format(params.structured_outputs)
        else:
            return params
        return dataclasses.replace(params, structured_outputs=after_reasoning(content, self.reasoning, opened))

    def parser(self, prompt_text: str) -> ChoiceParser | None:
        if self.reasoning is None and not self.parses_calls:
            return None
        opened = self.reasoning is not None and prompt_opens_reasoning(prompt_text, self.reasoning)
        return ChoiceParser(self.tool_fmt if self.parses_calls else None, self.reasoning, opened,
                            self.tools is not None and self.tools.named)


def plan_chat(options: ChatOptions, tokenizer_template: str | None, tools: ChatTools | None,
              messages: list[dict]) -> ChatPlan:
    template = options.chat_template
    uses_tools = tools is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    own = template or tokenizer_template or ""
    if uses_tools and "tool" not in own:
        if "<|im_start|>" not in own:
            raise bad_request("this model's chat template does not write tools or tool calls; start the server "
                              "with --chat-template naming one that does", "tools" if tools else "messages")
        template = load_chat_template(CHATML_TOOLS)
    fmt = None
    if tools is not None and tools.choice != "none":
        name = options.tool_call_parser or infer_format(template or own) or \
            ("hermes" if "<|im_start|>" in own else None)
        if name is None:
            raise bad_request("no tool-call parser is known for this model's chat template; start the server "
                              "with --tool-call-parser", "tools")
        fmt = tool_format(name)
    reasoning = reasoning_format(options.reasoning_parser) if options.reasoning_parser else None
    return ChatPlan(template, tools, fmt, reasoning)


class ChoiceParser:
    """One choice's text as reasoning, content and tool calls: as it streams (`delta`), or whole."""

    def __init__(self, tool_fmt: ToolFormat | None, reasoning: ReasoningFormat | None, opened: bool, named: bool):
        self.tool_fmt, self.reasoning, self.opened, self.named = tool_fmt, reasoning, opened, named
        self.thinking = ReasoningStream(reasoning, opened) if reasoning is not None else None
        self.calls = ToolCallStream(tool_fmt) if tool_fmt is not None else None

    def delta(self, text: str, last: bool = False) -> dict:
        """The chunk delta's fields that text adds (last: the choice's final text, held-back text too)."""
        reasoning, answer = self.thinking.feed(text) if self.thinking is not None else ("", text)
        if last and self.thinking is not None:
            r, a = self.thinking.finish()
            reasoning, answer = reasoning + r, answer + a
        out: dict = {}
        if reasoning:
            out["reasoning_content"] = reasoning
        if self.calls is None:
            if answer:
                out["content"] = answer
            return out
        d = self.calls.feed(answer)
        content, calls = d.content, list(d.tool_calls)
        if last:
            tail = self.calls.finish()
            content, calls = content + tail.content, calls + tail.tool_calls
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def message(self, text: str) -> dict:
        """A whole choice's message fields: content (None when empty beside tool calls), reasoning_content
        with a reasoning parser, tool_calls when the model made any."""
        reasoning, answer = split_reasoning(text, self.reasoning, self.opened) if self.reasoning else (None, text)
        out: dict = {"content": answer}
        if self.reasoning is not None:
            out["reasoning_content"] = reasoning
        if self.tool_fmt is not None:
            content, calls = parse_tool_calls(answer, self.tool_fmt)
            if calls:
                out["content"] = content.strip() or None
                out["tool_calls"] = [c.as_openai() for c in calls]
        return out

    def finish_reason(self, reason: str | None, made_calls: bool) -> str | None:
        return "tool_calls" if made_calls and reason == "stop" and not self.named else reason
