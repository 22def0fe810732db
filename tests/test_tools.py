"""Tool calling, reasoning and JSON answers through a real server on the shipped pair (DFlash chains, float32
CPU), with the official openai client: forced and required calls whose arguments validate against the
tool's parameters, auto tool choice parsed, streamed tool-call deltas reassembled, a two-turn tool
conversation, parse() into a Pydantic model, reasoning apart from the answer (streamed too), the grammar
applied after the reasoning; and offline, the same forcing grammars give plain decoding's tokens."""

import json

import httpx
import jsonschema
import pytest
from fixtures import Served

from flashdraft import LLM, SamplingParams
from flashdraft.chat.grammars import after_reasoning, constraint_format, tool_call_format
from flashdraft.chat.reasoning import PARSERS
from flashdraft.chat.tool_calls import FORMATS
from flashdraft.sampling_params import StructuredOutputsParams
from flashdraft.server.app import build_app
from flashdraft.server.chat import ChatOptions

openai = pytest.importorskip("openai")

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 24}},
                                                "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone",
                                          "parameters": {"type": "object", "properties": {
                                              "zone": {"type": "string", "enum": ["UTC", "CET", "EST"]}},
                                              "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What's the weather in Paris?"}]


def few_shot_calls(question: str) -> list[dict]:
    """Two earlier turns where the assistant called get_weather: the small model then calls it too."""
    msgs = []
    for i, city in enumerate(("Rome", "Berlin")):
        msgs += [{"role": "user", "content": f"What's the weather in {city}?"},
                 {"role": "assistant", "content": None, "tool_calls": [{"id": f"c{i}", "type": "function", "function": {
                     "name": "get_weather", "arguments": json.dumps({"city": city})}}]}]
    return msgs + [{"role": "user", "content": question}]


def few_shot_thinking(question: str) -> list[dict]:
    msgs = []
    for q, r, a in (("Is ice cold?", "Ice is frozen water.", "Yes."), ("Is the sun dark?", "The sun shines.", "No.")):
        msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": f"<think>\n{r}\n</think>\n\n{a}"}]
    return msgs + [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def spec():
    return LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def clients(spec):
    """A server without a reasoning parser and one with qwen3's, on one engine."""
    served = [Served(build_app(spec.engine)), Served(build_app(spec.engine, chat_options=ChatOptions(
        reasoning_parser="qwen3")))]
    yield [openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=300) for s in served]
    for s in served:
        s.close()


def _tool(name):
    return {t["function"]["name"]: t for t in (WEATHER, CLOCK)}[name]


def _reassembled(stream) -> tuple[str, list[dict], str]:
    """Content, tool calls and finish reason of a streamed chat completion (OpenAI's delta rules)."""
    content, calls, reason = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                if tc.id:
                    entry["id"] = tc.id
                if tc.function and tc.function.name:
                    entry["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
            reason = ch.finish_reason or reason
    return content, [calls[i] for i in sorted(calls)], reason


def _check_calls(calls, tools=(WEATHER, CLOCK)):
    names = {t["function"]["name"] for t in tools}
    for c in calls:
        name, args = (c.function.name, c.function.arguments) if hasattr(c, "function") else (c["name"], c["arguments"])
        assert name in names
        jsonschema.validate(json.loads(args), _tool(name)["function"]["parameters"])


def test_forced_named_call_validates_and_streams_the_same(clients):
    client = clients[0]
    model = client.models.list().data[0].id
    kw = dict(model=model, messages=ASK, tools=[WEATHER, CLOCK], max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_time"}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None
    assert [c.function.name for c in msg.tool_calls] == ["get_time"] and msg.tool_calls[0].id.startswith("call_")
    _check_calls(msg.tool_calls)
    content, calls, reason = _reassembled(client.chat.completions.create(**kw, stream=True))
    assert reason == "stop" and not content.strip()
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_time", msg.tool_calls[0].function.arguments)]


def test_required_calls_one_of_the_tools(clients):
    client = clients[0]
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=ASK, tools=[WEATHER, CLOCK],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=60,
                                       temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    _check_calls(ch.message.tool_calls)


def test_auto_tool_choice_parses_the_models_calls(clients):
    """The model calls get_weather after two turns that did (auto: nothing forces it); its call parsed whole
    and streamed; with tool_choice none the same text comes back as content."""
    client = clients[0]
    kw = dict(model="smollm2-135m-instruct", messages=few_shot_calls("What's the weather in Paris?"),
              tools=[WEATHER, CLOCK], max_tokens=40, temperature=0)
    r = client.chat.completions.create(**kw)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls", ch.message
    assert [c.function.name for c in ch.message.tool_calls] == ["get_weather"]
    assert json.loads(ch.message.tool_calls[0].function.arguments) == {"city": "Paris"}
    _check_calls(ch.message.tool_calls)
    content, calls, reason = _reassembled(client.chat.completions.create(**kw, stream=True))
    assert reason == "tool_calls" and [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", {"city": "Paris"})]
    none = client.chat.completions.create(**kw, tool_choice="none").choices[0]
    assert none.message.tool_calls is None and "<tool_call>" in none.message.content
    assert none.finish_reason == "stop"


def test_two_turn_tool_conversation(clients):
    """A history with the assistant's call (content null) and the tool's result is rendered (the result in
    the prompt) and answered."""
    client = clients[0]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    msgs = ASK + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model="smollm2-135m-instruct", messages=msgs, tools=[WEATHER],
                                       max_tokens=24, temperature=0)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    base = str(client.base_url).removesuffix("/v1/")
    toks = httpx.post(base + "/tokenize", json={"messages": msgs, "tools": [WEATHER]}, timeout=60).json()["tokens"]
    text = httpx.post(base + "/detokenize", json={"tokens": toks}, timeout=60).json()["prompt"]
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"get_weather"' in text


def test_parse_into_a_pydantic_model(clients):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    client = clients[0]
    r = client.chat.completions.parse(model="smollm2-135m-instruct", temperature=0, max_tokens=60,
                                      messages=[{"role": "user", "content": "Name a city in France as JSON."}],
                                      response_format=City)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name


def test_reasoning_apart_from_the_answer(clients):
    plain, thinking = clients
    kw = dict(model="smollm2-135m-instruct", messages=few_shot_thinking("Is fire hot?"), max_tokens=40, temperature=0)
    raw = plain.chat.completions.create(**kw).choices[0].message.content
    assert raw.startswith("<think>") and "</think>" in raw
    msg = thinking.chat.completions.create(**kw).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert raw == f"<think>\n{reasoning}</think>\n\n{msg.content}" and reasoning.strip() and msg.content
    streamed_r, streamed_c = "", ""
    for chunk in thinking.chat.completions.create(**kw, stream=True):
        for ch in chunk.choices:
            streamed_r += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_c += ch.delta.content or ""
    assert (streamed_r, streamed_c) == (reasoning, msg.content)


def test_the_grammar_applies_after_the_reasoning(clients):
    schema = {"type": "object", "properties": {"hot": {"type": "boolean"}}, "required": ["hot"],
              "additionalProperties": False}
    msg = clients[1].chat.completions.create(
        model="smollm2-135m-instruct", messages=few_shot_thinking("Is fire hot? Answer in JSON."), max_tokens=60,
        temperature=0, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    ).choices[0].message
    assert msg.model_extra["reasoning_content"].strip()
    jsonschema.validate(json.loads(msg.content), schema)


def test_forcing_grammars_are_lossless_under_speculation(spec, smollm2):
    """The tool-call and after-reasoning grammars, greedy and seeded, alone and beside unconstrained
    requests: the tokens of plain decoding."""
    prompts = [spec.engine.apply_chat_template(m) for m in (ASK, few_shot_thinking("Is fire hot? In JSON."))] * 2
    calls = after_reasoning(tool_call_format(FORMATS["hermes"], [WEATHER, CLOCK]), None, False)
    after = after_reasoning(constraint_format(StructuredOutputsParams(json_object=True)), PARSERS["qwen3"], False)
    params = [SamplingParams(max_tokens=40, structured_outputs=calls),
              SamplingParams(max_tokens=40, structured_outputs=after),
              SamplingParams(max_tokens=40, temperature=1.0, seed=3, structured_outputs=calls),
              SamplingParams(max_tokens=40)]
    want = [o.token_ids for o in smollm2.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.token_ids for o in got] == want
    assert spec.engine.spec_totals()["num_drafts"] > 0


def test_a_forced_call_cut_by_max_tokens_ends_length(clients):
    r = clients[0].chat.completions.create(model="smollm2-135m-instruct", messages=ASK, tools=[WEATHER],
                                           tool_choice="required", max_tokens=6, temperature=0)
    ch = r.choices[0]
    assert ch.finish_reason == "length" and ch.message.tool_calls is None
    assert ch.message.content.startswith("<tool_call>")  # (an unclosed call is content, as vLLM leaves it)


def test_offline_chat_with_tools(spec):
    """LLM.chat(tools=, chat_template=) renders the tools (vLLM's offline names); a forced call's grammar
    as structured_outputs makes the text one call the hermes parser reads."""
    from flashdraft.chat.tool_calls import parse_tool_calls

    so = after_reasoning(tool_call_format(FORMATS["hermes"], [WEATHER], parallel=False), None, False)
    out = spec.chat(ASK, SamplingParams(max_tokens=40, structured_outputs=so), tools=[WEATHER],
                    chat_template="chatml_tools")[0]
    (call,) = parse_tool_calls(out.text, FORMATS["hermes"])[1]
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    prompt = spec.engine.tokenizer.decode(out.prompt_token_ids)
    assert "<tools>" in prompt and '"get_weather"' in prompt
