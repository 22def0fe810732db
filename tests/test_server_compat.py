"""What clients of vLLM and SGLang send and read, against a real server on a local port (CPU, float32): unknown
fields accepted and logged, other servers' output-changing extensions refused unless at their no-op value,
chat_template_kwargs, /tokenize, /detokenize, /version, SGLang's meta_info, and z-lab's own benchmark client
(dflash==0.1.0) reporting the acceptance length the server counts."""

from __future__ import annotations

import json
import re
import threading
from types import SimpleNamespace

import httpx
import pytest
from fixtures import Served

import flashdraft
from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.sampling_params import SamplingParams
from flashdraft.server.app import DEFAULT_MODEL_NAME, build_app

MODEL = DEFAULT_MODEL_NAME
CHAT = [{"role": "user", "content": "Name a primary color."}]
PROMPT = "The three primary colors are"
COMPLETIONS, CHATS = "/v1/completions", "/v1/chat/completions"
# SmolLM2's ChatML with one variable a request can set (Qwen3's templates read enable_thinking the same way)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking %}<think>\n{% endif %}"
            "{% endif %}")


def run_offline(engine: LLMEngine, ids: list[int], max_tokens: int) -> str:
    seq = engine.add_request(None, SamplingParams(temperature=0.0, max_tokens=max_tokens), prompt_token_ids=ids)
    while not seq.is_finished:
        engine.step()
    return engine.output(seq).text


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=None, draft=None, device="cpu", dtype="float32"))
    eng.tokenizer.chat_template = TEMPLATE
    return eng


@pytest.fixture(scope="module")
def reference(engine) -> dict:
    thinking = engine.apply_chat_template(CHAT, enable_thinking=True)
    return {"thinking_ids": thinking, "plain_ids": engine.apply_chat_template(CHAT),
            "thinking": run_offline(engine, thinking, 8), "completion": run_offline(engine, engine.tokenize(PROMPT), 8)}


@pytest.fixture(scope="module")
def server(engine, reference):
    served = Served(build_app(engine))
    yield served
    served.close()


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)


def test_unknown_fields_are_accepted_and_logged(server, reference, caplog):
    caplog.set_level("WARNING", logger="flashdraft.server.serving")
    r = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "frobnicate": {"a": 1},
                                   "priority": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == reference["completion"]
    assert any("frobnicate" in rec.getMessage() and "priority" in rec.getMessage() for rec in caplog.records)


OUTPUT_CHANGING = [
    (COMPLETIONS, "length_penalty", 0.5, 1.0),
    (COMPLETIONS, "allowed_token_ids", [1, 2], []),
    (COMPLETIONS, "include_stop_str_in_output", True, False),
    (COMPLETIONS, "use_beam_search", True, False),
    (COMPLETIONS, "bad_words", ["blue"], []),
    (COMPLETIONS, "structural_tag", {"type": "structural_tag"}, None),
    (CHATS, "chat_template", "{{ messages }}", None),
    (CHATS, "continue_final_message", True, False),
    (CHATS, "logits_processors", ["my.module:Processor"], None),
]


@pytest.mark.parametrize("path,name,changes,noop", OUTPUT_CHANGING, ids=[c[1] for c in OUTPUT_CHANGING])
def test_extensions_that_change_the_output_are_refused(server, path, name, changes, noop):
    body = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": CHAT}
    r = post(server, path, {**body, "max_tokens": 2, name: changes})
    assert r.status_code == 400 and r.json()["error"]["param"] == name, r.text
    r = post(server, path, {**body, "max_tokens": 2, name: noop})
    assert r.status_code == 200, r.text


def test_chat_template_kwargs_reach_the_template(server, reference):
    thinking = post(server, "/tokenize", {"messages": CHAT, "chat_template_kwargs": {"enable_thinking": True}}).json()
    plain = post(server, "/tokenize", {"messages": CHAT}).json()
    assert thinking["tokens"] == reference["thinking_ids"] and plain["tokens"] == reference["plain_ids"]
    assert thinking["tokens"] != plain["tokens"]
    r = post(server, CHATS, {"messages": CHAT, "max_tokens": 8, "temperature": 0,
                             "chat_template_kwargs": {"enable_thinking": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == reference["thinking"]
    r = post(server, CHATS, {"messages": CHAT, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    no_prompt = post(server, "/tokenize", {"messages": CHAT, "add_generation_prompt": False}).json()
    assert no_prompt["tokens"] == reference["plain_ids"][: no_prompt["count"]] and no_prompt["count"] < plain["count"]


def test_tokenize_detokenize_version(server, engine):
    r = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == engine.tokenize(PROMPT) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == engine.max_model_len and len(r["token_strs"]) == r["count"]
    assert post(server, "/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": PROMPT}
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert post(server, "/tokenize", {}).status_code == 400
    assert httpx.get(server.url + "/version").json() == {"version": flashdraft.__version__}


def test_unpaired_surrogates_are_a_400(server):
    raw = b'{"model": "%s", "prompt": "abc\\ud800def", "max_tokens": 2}' % MODEL.encode()
    r = httpx.post(server.url + COMPLETIONS, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    raw = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x\udfff"}]}).encode()
    r = httpx.post(server.url + CHATS, content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert post(server, COMPLETIONS, {"prompt": "hi", "max_tokens": 1}).status_code == 200


def test_max_tokens_beyond_the_context_is_a_400(server, engine):
    r = post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": engine.max_model_len})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert f"maximum context length is {engine.max_model_len}" in r.json()["error"]["message"]
    r = post(server, CHATS, {"messages": CHAT, "max_completion_tokens": engine.max_model_len})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"


def test_prompts_are_tokenized_off_the_engine_thread(server):
    serving = server.server.config.app.state.serving
    threads = []
    real = serving.tokenizer.__class__.__call__

    def spy(self, *args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(self, *args, **kwargs)

    serving.tokenizer.__class__.__call__ = spy
    try:
        assert post(server, COMPLETIONS, {"prompt": PROMPT, "max_tokens": 1}).status_code == 200
    finally:
        serving.tokenizer.__class__.__call__ = real
    assert threads and all(t.startswith("flashdraft-tokenize") for t in threads)


@pytest.fixture(scope="module")
def spec_server():
    """SmolLM2 with the shipped drafter: what z-lab's client measures."""
    engine = LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32"))
    served = Served(build_app(engine))
    yield served
    served.close()


def test_meta_info(spec_server):
    body = {"messages": CHAT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = post(spec_server, CHATS, {**body, "return_meta_info": True}).json()
    meta, m = r["meta_info"], r["metrics"]
    assert meta["prompt_tokens"] == r["usage"]["prompt_tokens"] and meta["completion_tokens"] == 24
    assert meta["spec_verify_ct"] == m["num_drafts"] > 0 and meta["spec_accept_length"] == m["acceptance_length"]
    assert meta["finish_reason"] == {"type": "length"} and meta["cached_tokens"] == 0
    assert "meta_info" not in post(spec_server, CHATS, body).json()
    body |= {"stream": True, "return_meta_info": True}
    chunks = httpx.post(spec_server.url + CHATS, json={"model": MODEL, **body}, timeout=60).text
    finals = [json.loads(line[6:]) for line in chunks.splitlines() if line.startswith("data: {")
              and '"finish_reason":"length"' in line]
    assert len(finals) == 1 and finals[0]["meta_info"]["spec_verify_ct"] > 0


def spec_counters(url: str) -> tuple[float, float, float]:
    """(verify steps, accepted draft tokens, finished requests) from the server's Prometheus counters."""
    text = httpx.get(url + "/metrics").text

    def total(prefix: str) -> float:
        return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(prefix))

    return (total("flashdraft:spec_decode_num_drafts_total"), total("flashdraft:spec_decode_num_accepted_tokens_total"),
            total("flashdraft:request_success_total"))


def test_zlab_benchmark_client(spec_server, monkeypatch, capsys):
    """z-lab's OpenAI benchmark client (dflash==0.1.0, `dflash benchmark --backend openai`) against the
    server: it sends chat_template_kwargs and return_meta_info, and its reported acceptance length and
    verify count equal what the server's Prometheus counters say for the same requests."""
    benchmark = pytest.importorskip("dflash.benchmark")
    prompts = ["Write a Python function that adds two numbers.", "List three fruits.", "What is 2 + 2?"]
    monkeypatch.setattr(benchmark, "load_and_process_dataset", lambda name: [{"turns": [p]} for p in prompts])
    per_request = []
    real_send = benchmark.send_openai

    def send(*args, **kwargs):
        before = spec_counters(spec_server.url)
        out = real_send(*args, **kwargs)
        for _ in range(200):  # the engine thread updates the counters right after it answers
            after = spec_counters(spec_server.url)
            if after[2] > before[2]:
                break
        per_request.append((after[0] - before[0], after[1] - before[1]))
        return out

    monkeypatch.setattr(benchmark, "send_openai", send)
    args = SimpleNamespace(backend="openai", dataset="humaneval", num_prompts=2, concurrency=1, max_new_tokens=24,
                           base_url=spec_server.url, model=MODEL, temperature=0.0, top_p=1.0, top_k=0,
                           timeout_s=120, reasoning="off")
    benchmark._run_openai(args)
    printed = capsys.readouterr().out
    timed = per_request[-2:]  # after the warm-up request
    taus = [(verifies + accepted) / verifies for verifies, accepted in timed]
    reported = float(re.search(r"Accept length:\s+([0-9.]+)", printed).group(1))
    assert abs(reported - sum(taus) / len(taus)) < 5e-4, (printed, timed)
    assert int(re.search(r"Spec verify ct:\s+([0-9]+)", printed).group(1)) == sum(v for v, _ in timed)
    assert reported > 1.0


def test_served_model_name_defaults(tmp_path):
    from flashdraft.server.app import default_model_name

    folder = tmp_path / "my-model"
    folder.mkdir()
    assert default_model_name(str(folder)) == "my-model"
    assert default_model_name("Qwen/Qwen3-8B") == "Qwen/Qwen3-8B"  # a hub id, as vLLM names it
    assert default_model_name(None) == MODEL


def test_second_turn_through_the_server_hits_the_cache(spec_server):
    """A multi-turn conversation's second turn, through the server: cached tokens reported (usage, meta_info,
    Prometheus), and the same tokens and tau as the same turn after /reset_prefix_cache (float32)."""
    turn1 = {"messages": CHAT, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
    answer = post(spec_server, CHATS, turn1).json()["choices"][0]["message"]["content"]
    turn2 = {**turn1, "messages": CHAT + [{"role": "assistant", "content": answer},
                                          {"role": "user", "content": "Now name another one."}],
             "return_meta_info": True}
    hot = post(spec_server, CHATS, turn2).json()
    assert post(spec_server, "/reset_prefix_cache", {}).status_code == 200
    hits = sum(float(line.split()[-1]) for line in httpx.get(spec_server.url + "/metrics").text.splitlines()
               if line.startswith("flashdraft:prefix_cache_hits_total"))
    cold = post(spec_server, CHATS, turn2).json()
    cached = hot["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == hot["meta_info"]["cached_tokens"] >= 16 and hits >= cached
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hot["choices"][0]["message"]["content"] == cold["choices"][0]["message"]["content"]
    assert hot["meta_info"]["spec_accept_length"] == cold["meta_info"]["spec_accept_length"]
    assert httpx.post(spec_server.url + "/flush_cache", timeout=30).status_code == 200


def test_n_and_prompt_lists(server, engine, reference):
    """n samples and lists of prompts through the official client: prompt-major choices; greedy choices equal
    the offline greedy output; seeded samples are reproducible and differ from each other; usage counts each
    prompt once; streamed choices carry their index and the same texts."""
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    other = "Water boils at"
    r = client.completions.create(model=MODEL, prompt=[PROMPT, other], n=2, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == reference["completion"]
    assert r.choices[2].text == r.choices[3].text != r.choices[0].text
    prompt_tokens = len(engine.tokenize(PROMPT)) + len(engine.tokenize(other))
    assert r.usage.prompt_tokens == prompt_tokens and r.usage.completion_tokens == 4 * 8
    kw = dict(model=MODEL, messages=CHAT, n=3, max_tokens=12, temperature=1.0, seed=11)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    texts = [c.message.content for c in a.choices]
    assert texts == [c.message.content for c in b.choices] and len(set(texts)) > 1
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == k)
                for k in range(3)]
    assert streamed == texts
    assert sum(1 for c in chunks if c.choices and c.choices[0].finish_reason) == 3
    assert chunks[-1].usage.completion_tokens == a.usage.completion_tokens
