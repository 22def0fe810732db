"""The grammars chat requests put on their output, as xgrammar structural tags (plain dicts): a forced
tool call (tool_choice "required" or a named function) in the model's own format, and a constraint that
applies from the end of the reasoning on (the reasoning block free text, then the constrained answer)."""

from __future__ import annotations

import json
from typing import Any

from flashdraft.chat.reasoning import ReasoningFormat
from flashdraft.chat.tool_calls import ToolFormat
from flashdraft.sampling_params import StructuredOutputsParams


def _const(value: str) -> dict:
    return {"type": "const_string", "value": value}


def _sequence(elements: list[dict]) -> dict:
    return elements[0] if len(elements) == 1 else {"type": "sequence", "elements": elements}


def tool_call_format(fmt: ToolFormat, tools: list[dict], parallel: bool = True) -> dict:
    """One or more calls of `tools` (OpenAI function tools: {"type": "function", "function": {...}}),
    nothing else: each call's arguments valid against its parameters (any JSON object without them)."""
    tags = []
    for tool in tools:
        f = tool["function"]
        params = f.get("parameters")
        schema = params if isinstance(params, dict) and params and f.get("strict") is not False else {"type": "object"}
        tags.append({"type": "tag", "begin": f'{fmt.open}{{"name": {json.dumps(f["name"])}, "{fmt.args_key}": ',
                     "content": {"type": "json_schema", "json_schema": schema}, "end": "}" + fmt.close})
    calls = {"type": "tags_with_separator", "tags": tags, "separator": fmt.separator, "at_least_one": True,
             "stop_after_first": not parallel}
    start = fmt.start + "[" if fmt.end else ""  # (mistral: the list's bracket)
    return _sequence(([_const(start)] if start else []) + [calls] + ([_const(fmt.end)] if fmt.end else []))


def constraint_format(spec: StructuredOutputsParams) -> dict:
    """A request's constraint as a structural tag's format."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        return {"type": "json_schema", "json_schema": schema}
    if spec.json_object:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if spec.regex is not None:
        return {"type": "regex", "pattern": spec.regex}
    if spec.choice is not None:
        return {"type": "or", "elements": [_const(c) for c in spec.choice]}
    if spec.grammar is not None:
        return {"type": "grammar", "grammar": spec.grammar}
    tag = json.loads(spec.structural_tag) if isinstance(spec.structural_tag, str) else spec.structural_tag
    return tag["format"] if isinstance(tag, dict) and "format" in tag else tag


def after_reasoning(content: dict, fmt: ReasoningFormat | None, prompt_opened: bool) -> StructuredOutputsParams:
    """The constraint `content` from the end of the reasoning on: the reasoning block free text (required
    when the prompt opened it, else optional), then `content`. No reasoning parser: `content` alone."""
    if fmt is None:
        return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": content})
    opened = prompt_opened or fmt.opens
    block: dict[str, Any] = {"type": "tag", "begin": "" if opened else fmt.start,
                             "content": {"type": "any_text"}, "end": fmt.end}
    if not opened:
        block = {"type": "optional", "content": block}
    return StructuredOutputsParams(structural_tag={
        "type": "structural_tag",
        "format": _sequence([block, {"type": "regex", "pattern": "\n{0,2}"}, content])})
