"""`flashdraft serve` end to end: the official openai client against a real uvicorn server on a local
port, backed by the embedded SmolLM2-135M (plain decoding, float32, CPU). Greedy outputs must equal
the offline engine's, streamed or not, alone or 64 at a time."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest
from fixtures import Served

from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.sampling_params import SamplingParams
from flashdraft.server.app import DEFAULT_MODEL_NAME, build_app
from flashdraft.server.async_engine import visible_text

MODEL = DEFAULT_MODEL_NAME
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION = "The three primary colors are"
NUM_CONCURRENT = 64
CONCURRENT_TOKENS = 8


def concurrent_prompt(i: int) -> str:
    return f"Write one short sentence about the number {i}."


def offline(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list[str]:
    """Greedy reference outputs from the engine itself, run before the server starts."""
    seqs = [engine.add_request(None, params, prompt_token_ids=ids) for ids in prompts]
    while any(not s.is_finished for s in seqs):
        engine.step()
    return [engine.output(s).text for s in seqs]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=None, draft=None, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def reference(engine) -> dict:
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    short = SamplingParams(temperature=0.0, max_tokens=CONCURRENT_TOKENS)
    chat_ids = [engine.apply_chat_template([{"role": "user", "content": concurrent_prompt(i)}])
                for i in range(0, NUM_CONCURRENT, 2)]
    completion_ids = [engine.tokenize(concurrent_prompt(i)) for i in range(1, NUM_CONCURRENT, 2)]
    chat_out = offline(engine, chat_ids, short)
    completion_out = offline(engine, completion_ids, short)
    return {
        "chat": offline(engine, [engine.apply_chat_template(CHAT)], greedy)[0],
        "completion": offline(engine, [engine.tokenize(COMPLETION)], greedy)[0],
        "concurrent": [chat_out[i // 2] if i % 2 == 0 else completion_out[i // 2] for i in range(NUM_CONCURRENT)],
    }


@pytest.fixture(scope="module")
def server(engine, reference):
    served = Served(build_app(engine))
    yield served
    served.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_matches_offline(client, reference):
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=16)
    r = client.chat.completions.create(**kw)
    assert r.object == "chat.completion" and r.model == MODEL
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference["chat"] == "The capital of France is Paris."
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["metrics"]["num_output_tokens"] == r.usage.completion_tokens

    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == reference["chat"]
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "stop"
    assert finals[0].usage is None and "metrics" in finals[0].model_extra  # usage once: the chunk after it
    assert chunks[-1].choices == [] and chunks[-1].usage == r.usage
    assert sum(c.usage is not None for c in chunks) == 1


def test_completion_matches_offline(client, reference):
    kw = dict(model=MODEL, prompt=COMPLETION, temperature=0, max_tokens=16)
    r = client.completions.create(**kw)
    assert r.object == "text_completion"
    assert r.choices[0].text == reference["completion"]
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 16
    chunks = list(client.completions.create(**kw, stream=True))
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks) == reference["completion"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage in a stream unless include_usage asks for it


def test_stream_never_shows_stop_string(client):
    kw = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=16, stop=[" Paris"])
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**kw, stream=True))
    assert full == streamed == "The capital of France is"


def test_visible_text_holds_back():
    assert visible_text("abc\ufffd", []) == "abc"
    assert visible_text("The capital is Pa", [" Paris"]) == "The capital is"
    assert visible_text("The capital is", [" Paris"]) == "The capital is"


def test_concurrent_streams_share_batches(server, engine, reference):
    steps_before = engine.stats["num_steps"]

    async def one(aclient: openai.AsyncOpenAI, i: int) -> str:
        kw = dict(model=MODEL, temperature=0, max_tokens=CONCURRENT_TOKENS, stream=True)
        if i % 2 == 0:
            stream = await aclient.chat.completions.create(
                messages=[{"role": "user", "content": concurrent_prompt(i)}], **kw)
            return "".join([c.choices[0].delta.content or "" async for c in stream])
        stream = await aclient.completions.create(prompt=concurrent_prompt(i), **kw)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(NUM_CONCURRENT)))

    got = asyncio.run(main())
    assert got == reference["concurrent"]
    # one request alone would need CONCURRENT_TOKENS steps; 64 of them in shared batches need few more
    assert engine.stats["num_steps"] - steps_before < NUM_CONCURRENT * CONCURRENT_TOKENS // 4


def wait_until_idle(engine: LLMEngine, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.block_manager.num_used_blocks or engine.has_unfinished():
        assert time.monotonic() < deadline, "the engine kept the request"
        time.sleep(0.05)


def spy_on_add_request(engine: LLMEngine, monkeypatch) -> list:
    """The Sequences the engine thread creates, so a test can look at how they ended."""
    added = []
    real = engine.add_request

    def add_request(*args, **kwargs):
        added.append(real(*args, **kwargs))
        return added[-1]

    monkeypatch.setattr(engine, "add_request", add_request)
    return added


def test_disconnect_mid_stream_frees_kv(client, engine, monkeypatch):
    added = spy_on_add_request(engine, monkeypatch)
    stream = client.completions.create(model=MODEL, prompt=COMPLETION, max_tokens=200, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for _, _chunk in zip(range(3), stream):
        pass
    assert engine.block_manager.num_used_blocks > 0
    stream.close()
    wait_until_idle(engine)
    (seq,) = added
    assert seq.finish_reason == "abort" and seq.num_output_tokens < 200


def test_disconnect_while_waiting_frees_kv(server, engine, monkeypatch):
    added = spy_on_add_request(engine, monkeypatch)
    body = {"model": MODEL, "prompt": COMPLETION, "max_tokens": 200, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.0)
    wait_until_idle(engine)
    (seq,) = added
    assert seq.finish_reason == "abort" and seq.num_output_tokens < 200


COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"
BAD = [
    (COMPLETIONS, {"prompt": "hi", "temperature": -1}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETIONS, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "hi", "top_k": 0}, "top_k"),
    (COMPLETIONS, {"prompt": "hi", "seed": 2**70}, "seed"),
    (COMPLETIONS, {"prompt": "hi", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "logprobs": -1}, "logprobs"),
    (COMPLETIONS, {"prompt": "hi", "n": 3, "best_of": 2}, "best_of"),
    (COMPLETIONS, {"prompt": "hi", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": ["a", ""]}, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (COMPLETIONS, {"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "hi", "logit_bias": {"1.5": 5}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "hi", "min_tokens": -1}, "min_tokens"),
    (COMPLETIONS, {"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),
    (CHATS, {}, "messages"),
    (CHATS, {"messages": []}, "messages"),
    (CHATS, {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    (CHATS, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (CHATS, {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHATS, {"messages": CHAT, "logprobs": 1}, "logprobs"),
    (CHATS, {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "two words"}}]},
     "tools[0].function.name"),
    (CHATS, {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
             "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    (CHATS, {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),
    (CHATS, {"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
    (CHATS, {"messages": CHAT, "response_format": {"type": "xml"}}, "response_format"),
    (CHATS, {"messages": CHAT, "response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}},
     "response_format"),
    (COMPLETIONS, {"prompt": "hi", "guided_regex": "(unclosed"}, "guided_regex"),
    (COMPLETIONS, {"prompt": "hi", "guided_choice": ["a"], "regex": "a"}, "regex"),
    (CHATS, {"messages": CHAT, "stream_options": {"include_usage": True}}, "stream_options"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{k}" for p, _, k in BAD])
def test_bad_request_names_the_field(server, path, body, param):
    r = httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] is None
    assert err["message"]


JSON_TYPE = {"content-type": "application/json"}


def test_malformed_and_oversized_bodies(server, engine):
    r = httpx.post(server.url + COMPLETIONS, content=b'{"prompt": "hi",', timeout=30, headers=JSON_TYPE)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + COMPLETIONS, content=b"[" * 100_000, timeout=30, headers=JSON_TYPE)
    assert r.status_code == 400
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": "x" * (2 << 20)}, timeout=30)
    assert r.status_code == 413 and "error" in r.json()
    long_prompt = "hello " * engine.max_model_len
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": long_prompt}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "max_model_len" in r.json()["error"]["message"]


def test_openai_client_errors(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-0.5)
    assert e.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", n=1000)
    assert e.value.param == "n"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="hi")
    assert e.value.code == "model_not_found"


def test_models_health_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    assert httpx.get(server.url + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    text = httpx.get(server.url + "/metrics").text
    for name in ("flashdraft:spec_decode_num_drafts_total", "flashdraft:spec_decode_num_draft_tokens_total",
                 "flashdraft:spec_decode_num_accepted_tokens_total",
                 "flashdraft:spec_decode_num_accepted_tokens_per_pos", "flashdraft:num_requests_running",
                 "flashdraft:num_requests_waiting", "flashdraft:kv_cache_used_blocks",
                 "flashdraft:generation_tokens_total", 'flashdraft:request_success_total{finished_reason="length"',
                 'flashdraft:http_requests_total{endpoint="/v1/completions",status="200"}',
                 "flashdraft:spec_decode_num_paused_steps_total", "flashdraft:spec_decode_num_gated_steps_total"):
        assert name in text, name


def test_metrics_paused_steps_read_the_spec_totals():
    """The paused- and gated-steps counters carry the engine snapshot's spec total (what a paused step
    adds is tested in tests/test_dflash.py)."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, generate_latest

    from flashdraft.server.metrics import EngineCollector

    snap = {"running": 0, "waiting": 0, "kv_used_blocks": 0, "kv_total_blocks": 1, "stats": {},
            "prompt_tokens": 0, "finished": {}, "spec": {"paused_steps": 7, "num_drafts": 3, "gated_steps": 5},
            "prefix_cache_queries": 40, "prefix_cache_hits": 16}
    reg = CollectorRegistry()
    reg.register(EngineCollector(SimpleNamespace(snapshot=snap), "m"))
    text = generate_latest(reg).decode()
    assert 'flashdraft:spec_decode_num_paused_steps_total{model_name="m"} 7.0' in text
    assert 'flashdraft:spec_decode_num_drafts_total{model_name="m"} 3.0' in text
    assert 'flashdraft:spec_decode_num_gated_steps_total{model_name="m"} 5.0' in text
    assert 'flashdraft:prefix_cache_hits_total{model_name="m"} 16.0' in text


def test_api_key(engine, server):
    keyed = Served(build_app(engine, api_key="sesame"))  # shares the engine thread with `server`
    try:
        assert httpx.get(keyed.url + "/health").status_code == 200
        r = httpx.get(keyed.url + "/v1/models")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(keyed.url + COMPLETIONS, json={"prompt": "hi"}, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=keyed.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=keyed.url + "/v1", api_key="sesame", max_retries=0)
        r = good.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert httpx.post(keyed.url + "/flush_cache").status_code == 401  # it changes the server's state
        ok = httpx.post(keyed.url + "/reset_prefix_cache", headers={"Authorization": "Bearer sesame"}, timeout=30)
        assert ok.status_code == 200
    finally:
        keyed.close()
    # the unkeyed server still works after the keyed one shut down
    assert httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 1}, timeout=30).status_code == 200


def test_seeded_sampling_is_reproducible(client):
    kw = dict(model=MODEL, prompt=COMPLETION, max_tokens=8, temperature=0.9, seed=7)
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_engine_failure_fails_the_request_not_the_server(server, engine, monkeypatch):
    real_step = engine.step

    def broken_step():
        monkeypatch.setattr(engine, "step", real_step)
        raise RuntimeError("simulated kernel failure")

    monkeypatch.setattr(engine, "step", broken_step)
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    wait_until_idle(engine)
    r = httpx.post(server.url + COMPLETIONS, json={"prompt": "hi", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert httpx.get(server.url + "/health").status_code == 200


def test_speculative_metrics(tiny_llama, tmp_path):
    """A tiny random target with a random DFlash drafter: the per-request and the Prometheus
    speculative counters come through, and `speculative: false` switches drafting off."""
    from fixtures import build_random_drafter

    drafter = build_random_drafter(tmp_path / "draft", tiny_llama, block_size=4)
    spec_engine = LLMEngine(EngineConfig(model=str(tiny_llama), draft=str(drafter), device="cpu", dtype="float32"))
    served = Served(build_app(spec_engine))
    try:
        body = {"prompt": "the quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        on = httpx.post(served.url + COMPLETIONS, json=body, timeout=60).json()
        off = httpx.post(served.url + COMPLETIONS, json={**body, "speculative": False}, timeout=60).json()
        assert on["model"] == tiny_llama.name
        assert on["choices"][0]["text"] == off["choices"][0]["text"]  # greedy decoding is lossless
        assert on["metrics"]["num_drafts"] > 0 and "acceptance_length" in on["metrics"]
        assert off["metrics"].get("num_drafts", 0) == 0
        text = httpx.get(served.url + "/metrics").text
        drafts = [line for line in text.splitlines() if line.startswith("flashdraft:spec_decode_num_drafts_total")]
        assert len(drafts) == 1 and float(drafts[0].split()[-1]) == on["metrics"]["num_drafts"]
        assert 'flashdraft:spec_decode_num_accepted_tokens_per_pos_total{model_name="' in text
    finally:
        served.close()
