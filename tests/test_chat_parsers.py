"""Tool-call and reasoning parsers (flashdraft/chat/): each format read whole and streamed in pieces of every
size, the streamed deltas adding up to the whole response's content, calls and arguments; malformed calls
left as content; the forcing grammars compiled by xgrammar and walked by the outputs they must accept."""

import json

import pytest

from flashdraft.chat.reasoning import PARSERS, ReasoningStream, reasoning_format, split_reasoning
from flashdraft.chat.tool_calls import FORMATS, ToolCallStream, infer_format, parse_tool_calls, tool_format

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}

CASES = [  # (format, text, content, [(name, arguments)])
    ("hermes", 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "x": {"a": "}\\""}}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
     "Checking.", [("get_weather", '{"city": "Paris", "x": {"a": "}\\""}}'), ("get_time", "{}")]),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}', "",
     [("get_weather", '{"city": "Rome"}')]),  # (the end of the response closes the call)
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", '
                    '"parameters": {"zone": "UTC"}}', "", [("get_weather", '{"city": "Oslo"}'),
                                                         ("get_time", '{"zone": "UTC"}')]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "CET"}}', "",
     [("get_time", '{"zone": "CET"}')]),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Lima"}}, '
                '{"name": "get_time", "arguments": {"zone": "PET"}}]', "",
     [("get_weather", '{"city": "Lima"}'), ("get_time", '{"zone": "PET"}')]),
]
MALFORMED = [("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'),
             ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
             ("hermes", "I compare a < b and <tool"),
             ("llama3_json", 'Sure: {"name": "get_time", "parameters": {}}'),
             ("mistral", '[TOOL_CALLS] {"name": "x"}')]


def _streamed(fmt, text, size):
    stream, content, calls = ToolCallStream(fmt), "", {}
    pieces = [text[i:i + size] for i in range(0, len(text), size)]
    for d in [stream.feed(p) for p in pieces] + [stream.finish()]:
        content += d.content
        for c in d.tool_calls:
            entry = calls.setdefault(c["index"], {"name": None, "arguments": "", "id": None})
            if "id" in c:
                assert entry["id"] is None and c["type"] == "function", "a call's first delta comes once"
                entry["id"], entry["name"] = c["id"], c["function"]["name"]
            entry["arguments"] += c["function"]["arguments"]
    return content, [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_calls_whole_and_streamed(name, text, content, calls):
    fmt = tool_format(name)
    got_content, got = parse_tool_calls(text, fmt)
    assert got_content.strip() == content and [(c.name, c.arguments) for c in got] == calls
    assert all(json.loads(c.arguments) is not None for c in got)
    assert len({c.id for c in got}) == len(got)
    for size in (1, 2, 3, 7, len(text)):
        streamed_content, streamed = _streamed(fmt, text, size)
        assert streamed == calls, size
        assert streamed_content.strip() == content, size


@pytest.mark.parametrize("name,text", MALFORMED)
def test_malformed_calls_are_content(name, text):
    assert parse_tool_calls(text, tool_format(name)) == (text, [])


def test_text_without_calls_streams_as_it_comes():
    fmt = FORMATS["hermes"]
    stream = ToolCallStream(fmt)
    assert stream.feed("Hello <to").content == "Hello "  # (the start of a marker waits)
    assert stream.feed("day").content == "<today"
    assert stream.finish().content == ""


def test_formats_by_name_and_from_templates():
    for refused in ("openai", "harmony", "pythonic"):
        with pytest.raises(ValueError, match="not supported"):
            tool_format(refused)
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        tool_format("nope")
    assert infer_format("{{ '<tool_call>' }}") == "hermes"
    assert infer_format("[TOOL_CALLS]") == "mistral"
    assert infer_format("<|python_tag|>") == "llama3_json"
    assert infer_format("<|channel|>analysis") is None and infer_format(None) is None


@pytest.mark.parametrize("text,opened,reasoning,answer", [
    ("<think>\nhmm, 2+2\n</think>\n\nIt is 4.", False, "hmm, 2+2\n", "It is 4."),
    ("It is 4.", False, None, "It is 4."),
    ("<think>\nstill thinking", False, "still thinking", ""),
    ("<thi", False, None, "<thi"),
    ("weighing it</think>\n\nyes", True, "weighing it", "yes"),
    ("<think></think>{\"a\": 1}", False, "", '{"a": 1}'),
])
def test_reasoning_whole_and_streamed(text, opened, reasoning, answer):
    fmt = PARSERS["qwen3"]
    assert split_reasoning(text, fmt, opened) == (reasoning, answer)
    for size in (1, 2, 5, len(text)):
        stream = ReasoningStream(fmt, opened)
        parts = [stream.feed(text[i:i + size]) for i in range(0, len(text), size)] + [stream.finish()]
        assert "".join(p[0] for p in parts) == (reasoning or "") and "".join(p[1] for p in parts) == answer
    assert split_reasoning("first</think>then", PARSERS["deepseek_r1"]) == ("first", "then")
    with pytest.raises(ValueError, match="not supported"):
        reasoning_format("gpt_oss")


def test_forcing_grammars_accept_what_they_force_and_nothing_else(smollm2):
    """Each format's forcing grammar (xgrammar structural tag) takes a well-formed call of one of its tools,
    in the format the parser reads, and refuses free text or another function's name."""
    from flashdraft.chat.grammars import after_reasoning, constraint_format, tool_call_format
    from flashdraft.sampling_params import StructuredOutputsParams

    grammars, tok = smollm2.engine.grammars(), smollm2.engine.tokenizer

    def accepts(spec, text):
        m = grammars.request(spec).matcher
        return all(m.accept_token(t) for t in tok(text, add_special_tokens=False).input_ids)

    calls = {"hermes": '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>',
             "llama3_json": '{"name": "get_time", "parameters": {"zone": "UTC"}}',
             "mistral": '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}}]'}
    for name, text in calls.items():
        fmt = FORMATS[name]
        spec = after_reasoning(tool_call_format(fmt, [WEATHER, CLOCK]), None, False)
        assert accepts(spec, text), name
        assert parse_tool_calls(text, fmt)[1][0].name == "get_time"
        assert not accepts(spec, "Hello"), name
        only_weather = after_reasoning(tool_call_format(fmt, [WEATHER]), None, False)
        assert not accepts(only_weather, text), name
    json_spec = StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    thinking = after_reasoning(constraint_format(json_spec), PARSERS["qwen3"], False)
    assert accepts(thinking, '<think>\nany text { here\n</think>\n\n{"a": 1}')
    assert accepts(thinking, '{"a": 1}')  # (the reasoning block is optional when the prompt did not open it)
    assert not accepts(thinking, "<think>\nx\n</think>\n\nnot json")
    opened = after_reasoning(constraint_format(json_spec), PARSERS["qwen3"], True)
    assert accepts(opened, 'thinking</think>{"a": 2}') and not accepts(opened, 'thinking</think>nope')
