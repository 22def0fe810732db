"""OpenAI's Responses API (/v1/responses) through a real server on the shipped pair (float32 CPU), with the
official openai client: text equal to /v1/chat/completions' for the same conversation, streamed as events
whose deltas add up to it (each event valid against the SDK's types), completed or cut by max_output_tokens,
aborted when the client goes;
a forced function call whose arguments validate, streamed; a two-turn tool conversation rendered as chat
renders it; text.format's JSON schema; reasoning as its own item; the fields we refuse, named; and an
openai-agents Agent calling a tool through OpenAIResponsesModel (when openai-agents is installed)."""

import asyncio
import json

import httpx
import jsonschema
import pytest
from fixtures import Served
from pydantic import TypeAdapter

from flashdraft import LLM
from flashdraft.server.app import build_app
from flashdraft.server.chat import ChatOptions

openai = pytest.importorskip("openai")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402

MODEL = "smollm2-135m-instruct"
CLOCK = {"type": "function", "name": "get_time", "description": "The time in a time zone",
         "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "EST"]}},
                        "required": ["zone"], "additionalProperties": False}}
FORCED = dict(input="What time is it?", tools=[CLOCK], tool_choice={"type": "function", "name": "get_time"})
EVENT = TypeAdapter(ResponseStreamEvent)


@pytest.fixture(scope="module")
def spec():
    return LLM(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def servers(spec):
    """A server without a reasoning parser and one with qwen3's, on one engine."""
    served = [Served(build_app(spec.engine)),
              Served(build_app(spec.engine, chat_options=ChatOptions(reasoning_parser="qwen3")))]
    yield [s.url for s in served]
    for s in served:
        s.close()


@pytest.fixture(scope="module")
def client(servers):
    return openai.OpenAI(base_url=servers[0] + "/v1", api_key="unused", max_retries=0, timeout=300)


def raw_events(url: str, body: dict) -> list:
    """The SSE events of a streamed request, each checked against the SDK's event types (pydantic
    validation, stricter than the client's own parsing) and against its `event:` line."""
    events = []
    with httpx.stream("POST", url + "/v1/responses", json=body | {"stream": True}, timeout=300) as r:
        assert r.status_code == 200
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line.removeprefix("event: ")
            elif line.startswith("data: "):
                events.append(EVENT.validate_python(json.loads(line.removeprefix("data: "))))
                assert events[-1].type == kind
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    return events


def deltas(events, kind: str = "response.output_text.delta") -> str:
    return "".join(e.delta for e in events if e.type == kind)


@pytest.mark.parametrize("instructions,prompt,status", [(None, "Say hi", "incomplete"),
                                                        ("You are terse.", "Say only: yes", "completed")])
def test_text_is_the_chat_completions_text_whole_and_streamed(client, servers, instructions, prompt, status):
    kw = dict(model=MODEL, max_output_tokens=16, temperature=0)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + \
        [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    want = chat.choices[0].message.content
    raw = httpx.post(servers[0] + "/v1/responses", json=kw | {"input": prompt, "instructions": instructions},
                     timeout=300).json()
    r = Response.model_validate(raw)
    assert r.output_text == want and r.status == status and r.id.startswith("resp_")
    assert (r.incomplete_details.reason if r.incomplete_details else None) == \
        ("max_output_tokens" if status == "incomplete" else None)
    assert [o.type for o in r.output] == ["message"] and r.output[0].status == status
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens and r.instructions == instructions
    assert client.responses.create(input=prompt, instructions=instructions, **kw).output_text == want
    events = raw_events(servers[0], kw | {"input": prompt, "instructions": instructions})
    assert deltas(events) == want
    last = events[-1]
    assert last.type == f"response.{status}" and last.response.output_text == want
    assert (last.response.usage.input_tokens, last.response.usage.output_tokens) == \
        (r.usage.input_tokens, r.usage.output_tokens)
    with client.responses.stream(input=prompt, instructions=instructions, **kw) as stream:
        assert deltas(stream) == want


def test_a_forced_function_call_validates_and_streams_the_same(client, servers):
    r = client.responses.create(model=MODEL, max_output_tokens=40, temperature=0, **FORCED)
    assert r.status == "completed" and r.output_text == ""
    [call] = r.output
    assert (call.type, call.name, call.status) == ("function_call", "get_time", "completed")
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), CLOCK["parameters"])
    events = raw_events(servers[0], dict(model=MODEL, max_output_tokens=40, temperature=0, **FORCED))
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [(a.type, a.name, a.arguments) for a in added] == [("function_call", "get_time", "")]
    assert deltas(events, "response.function_call_arguments.delta") == call.arguments
    assert [e.arguments for e in events if e.type == "response.function_call_arguments.done"] == [call.arguments]
    assert events[-1].type == "response.completed" and events[-1].response.output[0].arguments == call.arguments


def test_a_two_turn_tool_conversation_is_rendered_as_chat_renders_it(client, servers):
    """The call and its output as input items: answered with a message, from the prompt /tokenize makes of
    the same conversation in chat's shape."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_time", "arguments": '{"zone": "CET"}'}
    items = [{"role": "user", "content": [{"type": "input_text", "text": "What time is it in Paris?"}]}, call,
             {"type": "function_call_output", "call_id": "call_1", "output": "14:05"}]
    r = client.responses.create(model=MODEL, input=items, tools=[CLOCK], max_output_tokens=24, temperature=0)
    assert [o.type for o in r.output] == ["message"] and r.output_text
    messages = [{"role": "user", "content": "What time is it in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_time",
                                                                      "arguments": '{"zone": "CET"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "14:05"}]
    tools = [{"type": "function", "function": {k: v for k, v in CLOCK.items() if k != "type"}}]
    toks = httpx.post(servers[0] + "/tokenize", json={"messages": messages, "tools": tools}, timeout=60).json()
    assert r.usage.input_tokens == toks["count"]


def test_text_format_json_schema(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: str = Field(max_length=20)

    r = client.responses.parse(model=MODEL, input="Name a city in France as JSON.", text_format=City,
                               max_output_tokens=60, temperature=0)
    assert isinstance(r.output_parsed, City) and r.output_parsed.name
    jsonschema.validate(json.loads(r.output_text), City.model_json_schema())
    assert r.text.format.type == "json_schema"


def test_reasoning_is_its_own_item(servers):
    """With a reasoning parser: a reasoning item with chat's reasoning_content, then the answer, streamed
    the same."""
    from test_tools import few_shot_thinking

    messages = few_shot_thinking("Is fire hot?")
    kw = dict(model=MODEL, max_output_tokens=40, temperature=0)
    thinking = openai.OpenAI(base_url=servers[1] + "/v1", api_key="unused", max_retries=0, timeout=300)
    msg = thinking.chat.completions.create(messages=messages, max_tokens=40, model=MODEL, temperature=0).choices[0]
    reasoning = msg.message.model_extra["reasoning_content"]
    r = thinking.responses.create(input=messages, **kw)
    assert [o.type for o in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == reasoning and r.output_text == msg.message.content
    events = raw_events(servers[1], kw | {"input": messages})
    assert deltas(events, "response.reasoning_text.delta") == reasoning and deltas(events) == msg.message.content


def test_a_stream_closed_early_aborts_its_request(client, spec, monkeypatch):
    from test_server import spy_on_add_request, wait_until_idle

    added = spy_on_add_request(spec.engine, monkeypatch)
    stream = client.responses.create(model=MODEL, input="Count to a thousand.", max_output_tokens=200, stream=True,
                                     temperature=0, extra_body={"ignore_eos": True})
    for _, _event in zip(range(6), stream):
        pass
    stream.close()
    wait_until_idle(spec.engine)
    (seq,) = added
    assert seq.finish_reason == "abort" and seq.num_output_tokens < 200


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"},
                                             {"type": "input_image", "image_url": "x"}]}]}, "input[0].content[1]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function", "name": "no spaces"}]}, "tools[0].name"),
    ({"input": "hi", "tools": [CLOCK], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": "hi", "max_output_tokens": 10**9}, "max_output_tokens"),
    ({"input": []}, "input"),
    ({"input": "hi", "messages": []}, "messages"),
])
def test_refusals_name_the_field(servers, body, param):
    r = httpx.post(servers[0] + "/v1/responses", json={"model": MODEL} | body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert param.split("[")[0].split(".")[0] in err["message"]


def test_an_agent_calls_a_tool_through_the_responses_model(servers):
    """openai-agents' default model: the forced call runs the tool, whose output goes back as an input
    item, and the agent's second turn answers; streamed the same way."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_time(zone: str) -> str:
        """The time in a time zone."""
        calls.append(zone)
        return f"12:00 in {zone}"

    async def run() -> tuple[str, str]:
        client = openai.AsyncOpenAI(base_url=servers[0] + "/v1", api_key="unused", max_retries=0, timeout=300)
        model = agents.OpenAIResponsesModel(model=MODEL, openai_client=client)
        agent = agents.Agent(name="clock", instructions="Answer with the time.", model=model, tools=[get_time],
                             model_settings=agents.ModelSettings(tool_choice="get_time", temperature=0,
                                                                 max_tokens=40))
        whole = await agents.Runner.run(agent, "What time is it in Paris?", max_turns=3)
        streamed = agents.Runner.run_streamed(agent, "What time is it in Paris?", max_turns=3)
        async for _ in streamed.stream_events():
            pass
        return whole.final_output, streamed.final_output

    whole, streamed = asyncio.run(run())
    assert len(calls) == 2 and calls[0] == calls[1]
    assert isinstance(whole, str) and whole and streamed == whole
