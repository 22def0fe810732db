"""Bounded fuzzing of the JSON endpoints' request bodies: arbitrary JSON values, near-valid bodies (a valid
body with a few fields swapped for wrong types, out-of-range numbers, unknown fields, odd messages, tools and
constraints) and raw bytes (invalid UTF-8, truncated JSON). Every answer is below 500, every error is
OpenAI's error object, and afterwards the server still serves and the engine holds no request or KV page.
Deterministic (derandomized, no example database) and small: generation is capped at a few tokens.
In-process (Starlette's TestClient) on a tiny random model, CPU."""

from __future__ import annotations

import json
import math
import sys

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.server.app import build_app

NAME = "tiny"
COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
PATHS = [COMPLETIONS, CHAT, RESPONSES, "/tokenize", "/detokenize"]
JSON = {"Content-Type": "application/json"}
MAX_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


def fuzz(examples: int) -> settings:
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


# ---- values -----------------------------------------------------------------------------------------------
ODD_CHARS = "\x00\x1b\n\u2028\ufeff\U0001f600\\"
# (lone surrogates, sent escaped, are refused before anything else reads the body: rare here, to reach further)
strings = st.one_of(st.text(st.one_of(st.characters(), st.sampled_from(ODD_CHARS)), max_size=12),
                    st.sampled_from(["<|im_start|>", "<|im_end|>", "{{ x }}", "{%", "a\ud800b", "\udfff"]))
NUMBERS = [-1, 0, 1, 2, 3, -(2**63) - 1, 2**63, 2**64, 10**30, -(10**30), 0.0, -0.5, 0.5, 1.5, 2.5, 1e308,
           -1e308, 5e-324, math.nan, math.inf, -math.inf, True, False, "1", "", None, [], {}, ["x"], {"a": 1}]
OTHER_TYPES = [None, True, 0, -1, 2**64, 1.5, math.nan, "", "x", [], ["x"], {}, {"a": 1}]
FIELD_NAMES = ["prompt", "messages", "input", "tokens", "model", "max_tokens", "n", "stream", "tools",
               "response_format", "structured_outputs", "temperature", "role", "content", "type"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**200), 2**200), st.sampled_from(NUMBERS),
                    st.floats(), strings)
json_values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), strings), inner,
                                                  max_size=4)), max_leaves=12)
weird = st.one_of(st.sampled_from(NUMBERS), json_values)


def mixed(*fixed, more: st.SearchStrategy | None = None) -> st.SearchStrategy:
    """One of the fixed values, else `more`, else a value of another type, else anything."""
    return st.one_of(*([st.sampled_from(fixed)] if fixed else []), *([more] if more is not None else []),
                     st.sampled_from(NUMBERS), json_values)


SCHEMAS = [{"type": "object"}, {"type": "string"}, {"type": "nonsense"}, {"type": 5}, {"properties": []},
           {"$ref": "#/nope"}, {"type": "string", "pattern": "("}, {"enum": []}, {"type": "array", "items": 5},
           {"type": "integer", "minimum": "x"}, {"type": "string", "minLength": 9, "maxLength": 1}, {"anyOf": []},
           {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, {}]
schemas = mixed(*SCHEMAS)
REGEXES = ["[a-z]+", "(", "a{2,1}", "\\", "", "a{0,3}", "(?P<x>a)", "\\p{L}", "[", "(?=a)", "a|"]
GRAMMARS = ['root ::= "a"', "root ::=", "root ::= nope", 'x ::= "a"', "", "root ::= [", 'root ::= "a"*']
response_formats = mixed(
    {"type": "text"}, {"type": "json_object"}, {"type": "bogus"}, {}, {"type": ["json_object"]}, "json_object",
    {"type": "json_schema"}, {"type": "json_schema", "json_schema": 5}, {"type": "json_schema", "json_schema": {}},
    {"type": "structural_tag"}, {"type": "structural_tag", "format": {"type": "bogus"}},
    more=st.builds(lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}, schemas))
structured_outputs = st.one_of(st.dictionaries(
    st.sampled_from(["json", "json_object", "regex", "choice", "grammar", "structural_tag", "whitespace_pattern",
                     "bogus"]),
    st.one_of(st.sampled_from(REGEXES + GRAMMARS), schemas, st.sampled_from([["a", "b"], [], [""], [1], True])),
    max_size=2), weird)
function_names = mixed("get_weather", "f", "", "bad name!", "x" * 65, "a.b-c_d")
chat_tool = st.fixed_dictionaries({"type": mixed("function", "code_interpreter")}, optional={
    "function": st.one_of(st.fixed_dictionaries({"name": function_names}, optional={
        "parameters": schemas, "description": weird, "strict": weird}), weird)})
flat_tool = st.fixed_dictionaries({"type": mixed("function", "web_search")}, optional={
    "name": function_names, "parameters": schemas, "description": weird, "strict": weird})
tool_choices = mixed("none", "auto", "required", "bogus", {"type": "function", "function": {"name": "get_weather"}},
                     {"type": "function", "function": {"name": "missing"}}, {"type": "function", "function": "x"},
                     {"type": "function", "function": ["get_weather"]}, {"type": "function", "name": "get_weather"},
                     {"type": ["function"]}, {})
text_parts = st.lists(st.fixed_dictionaries({"type": mixed("text", "input_text", "output_text", "image_url",
                                                           ["text"])}, optional={"text": mixed("hi", more=strings)}),
                      max_size=3)
tool_call = st.fixed_dictionaries({"function": mixed(more=st.fixed_dictionaries(
    {"name": function_names}, optional={"arguments": mixed("{}", '{"a": 1}', "{bad", "", 5)}))},
    optional={"id": mixed("call_1", None, 5), "type": mixed("function")})
ROLE_VALUES = ("user", "system", "assistant", "developer", "tool", "function", "bot", "", None, 5, ["user"],
               {"role": "user"})
message = st.fixed_dictionaries({"role": mixed(*ROLE_VALUES)}, optional={
    "content": mixed("hi", "", None, more=st.one_of(strings, text_parts)),
    "tool_calls": st.one_of(st.lists(tool_call, max_size=2), weird), "tool_call_id": mixed("call_1", None, 5),
    "name": weird, "function_call": weird, "reasoning_content": weird, "bogus": weird})
messages = mixed([{"role": "user", "content": "hi"}], [], more=st.lists(message, min_size=1, max_size=3))
input_item = st.fixed_dictionaries({}, optional={
    "type": mixed("message", "function_call", "function_call_output", "reasoning", "item_reference", ["message"]),
    "role": mixed(*ROLE_VALUES), "content": mixed("hi", more=st.one_of(strings, text_parts)),
    "call_id": mixed("call_1", 5), "name": function_names, "arguments": mixed("{}", "{bad", {}),
    "output": mixed("sunny", more=text_parts)})
inputs = mixed("hi", "", [], more=st.lists(input_item, min_size=1, max_size=3))
prompts = mixed("hi", "", [], [1, 2], [-1], [10**6], [2**64], ["a", ""], [[1], []], [1, "a"], [[1, 2], [3]],
                ["a", "b", "c"], [True], more=strings)
numbers = mixed(0, 1, -1, 2**63)

SAMPLING = {
    **{name: numbers for name in ("temperature", "top_p", "top_k", "min_p", "seed", "n", "presence_penalty",
                                  "frequency_penalty", "repetition_penalty", "min_tokens", "prompt_logprobs",
                                  *MAX_FIELDS)},
    "stop": mixed("\n", "", ["a", ""], [5]), "stop_token_ids": mixed([2], [-1], [2**70], [True]),
    "logit_bias": mixed({"1": 5}, {"abc": 1}, {"9" * 30: 1}, {"1": "x"}, {"-1": 1}, {"1": 1e308}),
    "stream": mixed(True, False), "stream_options": mixed({"include_usage": True}, {"continuous_usage_stats": True},
                                                          {"bogus": 1}),
    **{name: mixed(True, False) for name in ("ignore_eos", "skip_special_tokens", "speculative",
                                             "add_special_tokens", "return_meta_info", "use_beam_search")},
    "model": mixed(NAME, "other", ""), "user": weird, "metadata": weird, "frobnicate": weird,
    **{name: weird for name in ("length_penalty", "allowed_token_ids", "bad_words", "chat_template",
                                "truncate_prompt_tokens")},
    "response_format": response_formats, "structured_outputs": structured_outputs,
    "guided_json": mixed("{bad", "{}", '{"type": "string"}', more=schemas),
    "guided_regex": mixed(*REGEXES), "guided_choice": mixed(["a", "b"], [], [""], [1], "a"),
    "guided_grammar": mixed(*GRAMMARS), "json_schema": mixed("{bad", more=schemas), "regex": mixed(*REGEXES),
    "ebnf": mixed(*GRAMMARS), "structural_tag": mixed("{bad", "{}", {"type": "bogus"}),
}
template_kwargs = mixed({"enable_thinking": True}, {"messages": 1}, {"tools": []}, {"add_generation_prompt": 1})
FIELDS = {
    COMPLETIONS: {**SAMPLING, "prompt": prompts, "echo": mixed(True), "best_of": numbers,
                  "logprobs": mixed(0, 1, 20, 21, -1), "suffix": mixed("", "x")},
    CHAT: {**SAMPLING, "messages": messages, "chat_template_kwargs": template_kwargs,
           "add_generation_prompt": mixed(True, False), "echo": mixed(True), "logprobs": mixed(True, False),
           "top_logprobs": mixed(0, 5, 21, -1), "tools": mixed(more=st.lists(chat_tool, max_size=3)),
           "tool_choice": tool_choices, "parallel_tool_calls": mixed(True, False),
           "functions": mixed(more=st.lists(st.fixed_dictionaries({"name": function_names}), max_size=2)),
           "function_call": mixed("auto", "none", {"name": "get_weather"}, {"name": 5})},
    RESPONSES: {**{k: v for k, v in SAMPLING.items() if k not in ("n", "max_tokens", "max_completion_tokens")},
                "input": inputs, "instructions": mixed("be brief", ""), "tools": mixed(more=st.lists(flat_tool,
                                                                                                     max_size=3)),
                "tool_choice": mixed("auto", {"type": "function", "name": "get_weather"}, {"type": "function"},
                                     more=tool_choices),
                "text": mixed({"format": {"type": "text"}}, {"format": {"type": "json_object"}}, {"format": 5},
                              {"format": {"type": "json_schema"}}, {"format": {"type": "bogus"}},
                              more=st.builds(lambda s: {"format": {"type": "json_schema", "name": "x", "schema": s}},
                                             schemas)),
                **{name: weird for name in ("previous_response_id", "conversation", "background", "truncation",
                                            "messages", "max_tokens", "reasoning", "include", "parallel_tool_calls")}},
    "/tokenize": {"prompt": prompts, "messages": messages, "tools": mixed(more=st.lists(chat_tool, max_size=2)),
                  "add_special_tokens": mixed(True), "add_generation_prompt": mixed(False),
                  "chat_template_kwargs": template_kwargs, "return_token_strs": mixed(True), "model": mixed(NAME)},
    "/detokenize": {"tokens": mixed([1, 2], [], [-1], [10**6], [2**64], [1.0], [True]), "model": mixed(NAME)},
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "the weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TURNS = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]}, {"role": "user", "content": "hi"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
ITEMS = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be brief"}]},
         {"role": "user", "content": "hi"},
         {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
         {"type": "function_call_output", "call_id": "call_1", "output": [{"type": "input_text", "text": "sunny"}]}]
SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]}}
BASES = {
    COMPLETIONS: [{"prompt": "the quick", "max_tokens": 2},
                  {"prompt": [[5, 6, 7], [8]], "max_tokens": 2, "temperature": 0, "logit_bias": {"5": 1.5},
                   "stop": ["\n"], "stream": True, "stream_options": {"include_usage": True}}],
    CHAT: [{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
           {"messages": TURNS, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {
               "name": "get_weather"}}, "max_tokens": 2},
           {"messages": TURNS[:2], "response_format": SCHEMA_FORMAT, "logprobs": True, "top_logprobs": 2,
            "max_completion_tokens": 2}],
    RESPONSES: [{"input": "hi", "max_output_tokens": 2},
                {"input": ITEMS, "instructions": "be brief", "max_output_tokens": 2,
                 "tools": [{"type": "function", **WEATHER["function"]}],
                 "tool_choice": {"type": "function", "name": "get_weather"}, "stream": True},
                {"input": ITEMS[:2], "text": {"format": {"type": "json_schema", **SCHEMA_FORMAT["json_schema"]}},
                 "max_output_tokens": 2}],
    "/tokenize": [{"prompt": "the quick"}, {"messages": TURNS, "tools": [WEATHER], "return_token_strs": True}],
    "/detokenize": [{"tokens": [5, 6, 7]}],
}


def nodes(value, at: tuple = ()) -> list[tuple]:
    """The path of every value in a JSON tree, the root's () first."""
    found = [at]
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found += nodes(item, (*at, key))
    return found


def replaced(value, at: tuple, new):
    if not at:
        return new
    copy = dict(value) if isinstance(value, dict) else list(value)
    copy[at[0]] = replaced(value[at[0]], at[1:], new)
    return copy


@st.composite
def near_valid(draw, path: str) -> dict:
    """A valid body with up to three fields set to something else, maybe one of its own dropped, and maybe
    a value somewhere inside it (a message's role, a tool's name, a content part) of another type."""
    body = dict(draw(st.sampled_from(BASES[path])))
    fields = FIELDS[path]
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=3, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 0:
        body.pop(draw(st.sampled_from(sorted(body))))
    for _ in range(draw(st.integers(0, 3)) if body else 0):
        at = draw(st.sampled_from(nodes(body)[1:]))
        body = replaced(body, at, draw(st.one_of(st.sampled_from(OTHER_TYPES), json_values)))
    return body


def bounded(path: str, body):
    """`body` with generation kept short: max tokens, n and best_of capped (values the server refuses as too
    large are left as they are), a few tokens asked for when nothing is."""
    if path not in (COMPLETIONS, CHAT, RESPONSES) or not isinstance(body, dict):
        return body
    body = dict(body)
    for name in (*MAX_FIELDS, "n", "best_of"):
        v = body.get(name)
        cap = 3 if name in MAX_FIELDS else 2
        if isinstance(v, int) and not isinstance(v, bool) and cap < v <= 1024:
            body[name] = cap
    if all(body.get(name) is None for name in MAX_FIELDS):
        body["max_output_tokens" if path == RESPONSES else "max_tokens"] = 2
    return body


def dumps(body) -> bytes:
    # NaN and Infinity as Python's json writes them; lone surrogates escaped (ensure_ascii)
    return json.dumps(body).encode()


def check(r, path: str, sent: bytes) -> None:
    where = f"{path} {sent[:2000]!r}"
    assert r.status_code < 500, f"{where} -> {r.status_code} {r.text[:2000]}"
    if r.status_code >= 400:
        err = r.json().get("error")
        assert isinstance(err, dict), where
        assert isinstance(err.get("message"), str) and isinstance(err.get("type"), str), where
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        for line in r.text.splitlines():
            data = line.removeprefix("data: ")
            if line.startswith("data: ") and data != "[DONE]":
                event = json.loads(data)
                assert "error" not in event and event.get("type") != "response.failed", f"{where} -> {data}"
    else:
        r.json()


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), draft=None, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(build_app(engine, served_model_name=NAME), base_url="http://localhost",
                    raise_server_exceptions=False) as c:
        yield c


def post(client: TestClient, path: str, content: bytes) -> None:
    check(client.post(path, content=content, headers=JSON), path, content)


@fuzz(60)
@given(path=st.sampled_from(PATHS), body=st.one_of(
    st.dictionaries(st.one_of(st.sampled_from(FIELD_NAMES), strings), json_values, max_size=5), json_values))
def test_arbitrary_json(client, path, body):
    post(client, path, dumps(bounded(path, body)))


@fuzz(500)
@given(case=st.one_of(*(st.tuples(st.just(p), near_valid(p)) for p in PATHS)))
# bodies that were a 500: a constraint's JSON text that does not parse; a role, a content part's type or a
# tool_choice's function of a type the checks did not expect
@example(case=(COMPLETIONS, {"prompt": "hi", "max_tokens": 2, "guided_json": "{bad"}))
@example(case=(CHAT, {"messages": [{"role": [], "content": "hi"}], "max_tokens": 2}))
@example(case=(CHAT, {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER],
                      "tool_choice": {"type": "function", "function": True}, "max_tokens": 2}))
@example(case=(RESPONSES, {"input": [{"role": []}], "max_output_tokens": 2}))
@example(case=(RESPONSES, {"input": [{"role": "user", "content": [{"type": [], "text": "hi"}]}],
                           "max_output_tokens": 2}))
def test_near_valid_bodies(client, case):
    path, body = case
    post(client, path, dumps(bounded(path, body)))


RAW = [b"", b"null", b"[]", b"{", b'{"prompt": "hi"', b"1" * 5000, b"[" * 100_000, b'{"a":' * 50_000,
       b"\xef\xbb\xbf{}", b'{"prompt": "hi", "prompt": 5, "max_tokens": 1}', b'{"prompt": "\\ud800"}', b"NaN",
       b'{"max_tokens": 1e999}', b'{"temperature": -Infinity, "prompt": "hi"}', b'{"prompt": "hi\xff"}',
       b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', b"\xc3", b'{"metadata": ' + b"[" * 900 +
       b"]" * 900 + b', "prompt": "hi", "max_tokens": 1}']


def texts(path: str) -> st.SearchStrategy:
    return near_valid(path).map(lambda body: dumps(bounded(path, body)))


raw_bodies = st.one_of(
    st.tuples(st.sampled_from(PATHS), st.one_of(st.sampled_from(range(len(RAW))).map(RAW.__getitem__),
                                                st.binary(max_size=64))),
    *(st.tuples(st.just(p), st.one_of(
        st.builds(lambda text, at: text[:at], texts(p), st.integers(0, 200)),  # truncated JSON
        st.builds(lambda text, at, bad: text[:at] + bad + text[at:], texts(p), st.integers(0, 200),
                  st.sampled_from([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\x80\x80", b"\x00", b"\xf4\x90\x80\x80"]))))
      for p in PATHS))


@fuzz(60)
@given(case=raw_bodies)
def test_raw_bytes(client, case):
    post(client, *case)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# deeper than the chat template renders, not deeper than the JSON parser reads (read here, at collection:
# hypothesis raises the recursion limit while its tests run, so these are no @example)
DEEP = sys.getrecursionlimit() * 4 // 5


@pytest.mark.parametrize("path,content", [
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "chat_template_kwargs": {"x": '
     + nested(DEEP) + b"}}"),
    ("/tokenize", b'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", '
     b'"arguments": ' + nested(DEEP) + b"}}]}]}"),
    (CHAT, b'{"messages": [{"role": "assistant", "content": null, "tool_calls": [{"function": {"name": "f", '
     b'"arguments": "' + nested(5 * DEEP) + b'"}}]}], "max_tokens": 2}'),
], ids=["template-variable", "tool-call-arguments", "arguments-text"])
def test_nesting_the_template_cannot_render(client, path, content):
    """Were a 500: a RecursionError from the chat template rendering a deep value, and from parsing tool-call
    arguments whose JSON text nests deeper than the parser reads."""
    post(client, path, content)


def test_the_server_is_healthy_after_the_fuzz(client, engine):
    """Run after the fuzz (file order): it still answers, and nothing the fuzz sent holds a request or a page."""
    assert client.get("/health").status_code == 200
    r = client.post(COMPLETIONS, json={"prompt": "the quick", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    # a command on the engine thread, queued behind any abort the fuzz's requests left it
    assert client.post("/reset_prefix_cache").status_code == 200
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
