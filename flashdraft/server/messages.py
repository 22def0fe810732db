"""A chat request's messages and tools, checked and put in the shape chat templates read: text content,
assistant `tool_calls` (their arguments as objects, which templates serialize themselves), `tool` messages
with their `tool_call_id`, and the legacy `functions` / `function_call` as tools and tool_choice."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from flashdraft.server.errors import bad_request

ROLES = {"system", "user", "assistant", "developer", "tool", "function"}
NAME = re.compile(r"^[a-zA-Z0-9_.\-]{1,64}$")  # OpenAI's function names


def conversation(messages: list[Any]) -> list[dict]:
    """`messages` as the chat template wants them."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: Any, where: str) -> dict:
    if not isinstance(m, dict):
        raise bad_request(f"{where} must be an object with role and content", where)
    role = m.get("role")
    if not isinstance(role, str) or role not in ROLES:  # (a list or an object is not hashable)
        raise bad_request(f"{where}.role must be one of {sorted(ROLES)}, got {role!r}", f"{where}.role")
    allowed = {"role", "content", "name"} | ({"tool_calls", "function_call", "refusal", "reasoning_content"}
                                              if role == "assistant" else set()) | \
        ({"tool_call_id"} if role == "tool" else set())
    extra = sorted(set(m) - allowed)
    if extra:
        raise bad_request(f"{where}.{extra[0]} is not supported", f"{where}.{extra[0]}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else "tool" if role == "function" else role}
    calls = m.get("tool_calls") or ([{"id": "call_0", "type": "function", "function": m["function_call"]}]
                                    if m.get("function_call") else None)
    content = m.get("content")
    if content is None and role == "assistant" and calls:
        out["content"] = ""  # (a template writes the calls; some write content too, so it is text)
    else:
        out["content"] = _text_content(content, f"{where}.content")
    if calls:
        out["tool_calls"] = _tool_calls(calls, f"{where}.tool_calls")
    if role == "tool":
        call_id = m.get("tool_call_id")
        if not isinstance(call_id, str):
            raise bad_request(f"{where}.tool_call_id is required for a tool message", f"{where}.tool_call_id")
        out["tool_call_id"] = call_id
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def _text_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") in ("text", "input_text", "output_text")
                    and isinstance(part.get("text"), str)):
                raise bad_request(f"{where}: only text content parts are supported", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad_request(f"{where} must be a string or a list of text parts", where)


def _tool_calls(calls: Any, where: str) -> list[dict]:
    if not isinstance(calls, list):
        raise bad_request(f"{where} must be a list", where)
    out = []
    for j, c in enumerate(calls):
        w = f"{where}[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise bad_request(f"{w}.function must be an object with a name", f"{w}.function")
        args = f.get("arguments", "{}")
        if isinstance(args, str):  # the arguments as an object: templates write them with tojson
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise bad_request(f"{w}.function.arguments is not JSON", f"{w}.function.arguments") from None
        out.append({"id": c.get("id") or f"call_{j}", "type": "function",
                    "function": {"name": f["name"], "arguments": args}})
    return out


@dataclass
class ChatTools:
    """What a request's tools ask: the tools (OpenAI's function shape), the choice ("none", "auto",
    "required", or a function's name) and whether one response may call several."""

    tools: list[dict]
    choice: str
    parallel: bool

    @property
    def forced(self) -> list[dict] | None:
        """The tools a grammar forces a call of (required, or the named one); None: the model chooses."""
        if self.choice == "required":
            return self.tools
        if self.choice not in ("none", "auto"):
            return [t for t in self.tools if t["function"]["name"] == self.choice]
        return None

    @property
    def named(self) -> bool:
        return self.choice not in ("none", "auto", "required")


def chat_tools(tools: Any, tool_choice: Any, parallel: bool | None, functions: Any = None,
               function_call: Any = None) -> ChatTools | None:
    """The request's tools checked (None when it has none); legacy functions as tools."""
    if functions:
        if tools:
            raise bad_request("give tools or functions (their earlier form), not both", "functions")
        tools = [{"type": "function", "function": f} for f in functions] if isinstance(functions, list) else functions
        tool_choice = function_call if not isinstance(function_call, dict) else \
            {"type": "function", "function": {"name": function_call.get("name")}}
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list", "tools")
    checked = []
    for i, t in enumerate(tools):
        w = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise bad_request(f"{w}: only function tools are supported", w)
        f = t.get("function")
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not NAME.match(f["name"]):
            raise bad_request(f"{w}.function.name must be 1-64 letters, digits, '_', '-' or '.'", f"{w}.function.name")
        params = f.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{w}.function.parameters must be a JSON schema object", f"{w}.function.parameters")
        checked.append({"type": "function", "function": {k: v for k, v in f.items()
                                                         if k in ("name", "description", "parameters", "strict")}})
    names = [t["function"]["name"] for t in checked]
    if len(set(names)) != len(names):
        raise bad_request("tools have two functions of one name", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise bad_request(f"tool_choice names a function that is not among the tools: {name!r}", "tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise bad_request(f"tool_choice must be none, auto, required or a named function, got {choice!r}",
                          "tool_choice")
    return ChatTools(checked, choice, True if parallel is None else parallel)
