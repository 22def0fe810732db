"""Log-probabilities, penalties, echo and best_of through the official openai client, against a real server
on a local port (SmolLM2 with its shipped drafter, float32 on CPU): the same tokens and log-probabilities
with speculation on and off, streamed or not; penalties that change the output the same way on both paths;
echo, best_of and vLLM's prompt_logprobs as OpenAI and vLLM shape them; and the 400s that name the field."""

from __future__ import annotations

import math
from typing import NamedTuple

import openai
import pytest
from fixtures import Served

from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.server.app import DEFAULT_MODEL_NAME, build_app

MODEL = DEFAULT_MODEL_NAME
PROMPT = "The three primary colors are"
REPEATING = "List of fruits: apple, banana,"  # greedy: " pear, pear, apple, pear, ...", which penalties change
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model=None, device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def client(engine):
    served = Served(build_app(engine))
    yield openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    served.close()


class Run(NamedTuple):
    text: str
    entries: list  # (token, logprob, [(top token, logprob), ...] in the response's order)
    chunks: list  # (text, entries) of each chunk (one, unstreamed)
    metrics: dict


def legacy_entries(lp) -> list:
    return list(zip(lp.tokens, lp.token_logprobs, [list(t.items()) for t in lp.top_logprobs])) if lp else []


def generate(client, chat: bool, stream: bool = False, spec: bool = True, extra: dict | None = None,
             prompt: str = PROMPT, **kw) -> Run:
    body = {"speculative": spec, **(extra or {})}
    if chat:
        r = client.chat.completions.create(model=MODEL, messages=CHAT, stream=stream, extra_body=body, **kw)
        bodies = [c for c in r if c.choices] if stream else [r]
        parts = [(c.choices[0].delta.content or "", c.choices[0].logprobs) for c in bodies] if stream \
            else [(r.choices[0].message.content, r.choices[0].logprobs)]
        chunks = [(text, [(t.token, t.logprob, [(x.token, x.logprob) for x in t.top_logprobs])
                          for t in (lp.content if lp else [])]) for text, lp in parts]
    else:
        r = client.completions.create(model=MODEL, prompt=prompt, stream=stream, extra_body=body, **kw)
        bodies = list(r) if stream else [r]
        chunks = [(c.choices[0].text, legacy_entries(c.choices[0].logprobs)) for c in bodies]
    return Run("".join(t for t, _ in chunks), [e for _, c in chunks for e in c], chunks,
               bodies[-1].model_extra["metrics"])


def assert_close(a: list, b: list, tol: float = 1e-4) -> None:
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    for (_, lp_a, top_a), (_, lp_b, top_b) in zip(a, b):
        assert abs(lp_a - lp_b) < tol
        assert [t for t, _ in top_a] == [t for t, _ in top_b]
        assert all(abs(x - y) < tol for (_, x), (_, y) in zip(top_a, top_b))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_logprobs_equal_with_speculation_on_and_off(client, chat):
    """Greedy: the chosen token is the most likely one, its log-probability the top one's; tops sorted; the
    same tokens and log-probabilities (1e-4) with and without drafts, streamed or not; a stream's chunks
    carry the tokens of their text, and the stop string's tokens come last (its text trimmed)."""
    kw = dict(max_tokens=12, temperature=0, stop=["RGB c"])
    kw |= dict(logprobs=True, top_logprobs=3) if chat else dict(logprobs=3)
    runs = {(stream, spec): generate(client, chat, stream, spec, **kw) for stream in (False, True)
            for spec in (True, False)}
    text, entries = runs[False, False].text, runs[False, False].entries
    tokens = [t for t, _, _ in entries]
    assert text == "".join(tokens)[: len(text)]
    if not chat:  # the stop string's tokens are returned, its text is not
        assert text.endswith(" of the ") and tokens[-2:] == [" RGB", " color"]
    for token, lp, top in entries:
        assert len(top) == 3 and top[0][0] == token and abs(top[0][1] - lp) < 1e-6
        assert [x for _, x in top] == sorted((x for _, x in top), reverse=True)
    assert runs[False, True].metrics["num_accepted_tokens"] > 0  # the drafts' tokens were scored too
    for (stream, spec), run in runs.items():
        assert run.text == text, (stream, spec)
        assert_close(run.entries, entries)
        for i in range(len(run.chunks) - 1):  # the tokens streamed so far end inside the text streamed so far
            shown = "".join(t for t, _ in run.chunks[: i + 1])
            assert shown.startswith("".join(t for _, c in run.chunks[: i + 1] for t, _, _ in c))


def test_completion_logprobs_object(client):
    """OpenAI's legacy object: one entry per generated token, the chosen token among up to logprobs + 1,
    text_offset adding up the tokens' texts; logprobs=0 still names the chosen token."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 6
    assert [list(t) for t in lp.top_logprobs] == [[t] for t in lp.tokens]
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    assert all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(t.top_logprobs == [] for t in content)
    assert all(t.bytes == list(t.token.encode()) for t in content)


PENALTIES = {
    "presence_penalty": dict(presence_penalty=1.5),
    "frequency_penalty": dict(frequency_penalty=1.5),
    "repetition_penalty": dict(extra_body={"repetition_penalty": 1.5}),
    "logit_bias": dict(logit_bias={" banana": 100}),  # keyed by text here, by the text's token id when sent
    "min_p": dict(extra_body={"min_p": 0.3}, temperature=1.0, seed=5),
    "min_tokens": dict(extra_body={"min_tokens": 12}),
}


@pytest.mark.parametrize("name", list(PENALTIES))
def test_penalties_change_the_output_alike_with_and_without_drafts(client, engine, name):
    """Each processor changes the output (greedy, or seeded sampling for min_p), and the same way whether or
    not drafts are verified."""
    kw = dict(PENALTIES[name])
    base = dict(temperature=kw.pop("temperature", 0), seed=kw.pop("seed", None), max_tokens=16, prompt=REPEATING)
    extra = kw.pop("extra_body", {})
    if "logit_bias" in kw:
        kw["logit_bias"] = {str(engine.tokenize(text)[0]): bias for text, bias in kw["logit_bias"].items()}
    chat = name == "min_tokens"  # the chat answer ends (EOS) after fewer tokens than asked for
    plain = generate(client, chat, spec=False, **base)
    on = generate(client, chat, spec=True, extra=extra, **base, **kw)
    off = generate(client, chat, spec=False, extra=extra, **base, **kw)
    assert on.text == off.text != plain.text
    if name == "logit_bias":
        assert "banana" in on.text
    if name == "min_tokens":
        assert on.metrics["num_output_tokens"] >= 12 > plain.metrics["num_output_tokens"]


def test_echo(client, engine):
    """The prompt before the text (stream: in the first chunk); with logprobs its tokens come first, the first
    without a log-probability; a token-id prompt echoes as its text. Chat echoes the last message when it is
    the assistant's."""
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    plain = client.completions.create(prompt=PROMPT, **kw).choices[0].text
    assert client.completions.create(prompt=PROMPT, echo=True, **kw).choices[0].text == PROMPT + plain
    chunks = [c.choices[0].text for c in client.completions.create(prompt=PROMPT, echo=True, stream=True, **kw)]
    assert chunks[0].startswith(PROMPT) and "".join(chunks) == PROMPT + plain
    ids = engine.tokenize(PROMPT)
    assert client.completions.create(prompt=ids, echo=True, **kw).choices[0].text == PROMPT + plain

    r = client.completions.create(prompt=PROMPT, echo=True, logprobs=2, **kw)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + r.usage.completion_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None for x in lp.token_logprobs[1:]) and "".join(lp.tokens) == PROMPT + plain
    streamed = [c.choices[0].logprobs for c in client.completions.create(prompt=PROMPT, echo=True, logprobs=2,
                                                                         stream=True, **kw)]
    assert [t for c in streamed for t in c.tokens] == lp.tokens
    assert [x for c in streamed for x in c.text_offset] == lp.text_offset

    echo = {"echo": True}  # vLLM's, not in the client's signature
    turn = CHAT + [{"role": "assistant", "content": "The capital"}]
    reply = client.chat.completions.create(messages=turn, extra_body=echo, **kw).choices[0].message.content
    assert reply.startswith("The capital") and reply != "The capital"
    streamed = client.chat.completions.create(messages=turn, extra_body=echo, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == reply
    plain = client.chat.completions.create(messages=CHAT, **kw).choices[0].message.content
    assert client.chat.completions.create(messages=CHAT, extra_body=echo, **kw).choices[0].message.content == plain


def test_best_of_returns_the_most_likely_sample(client):
    """best_of=3, n=1 returns, of the 3 samples that n=3 with the same seed draws, the one of the highest
    cumulative log-probability; without logprobs asked for it returns none; usage counts all 3 samples."""
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=7)
    samples = client.completions.create(n=3, logprobs=0, **kw)
    totals = [sum(c.logprobs.token_logprobs) for c in samples.choices]
    assert len({c.text for c in samples.choices}) > 1
    best = samples.choices[max(range(3), key=totals.__getitem__)]
    r = client.completions.create(best_of=3, logprobs=0, **kw)
    assert [c.text for c in r.choices] == [best.text]
    assert math.isclose(sum(r.choices[0].logprobs.token_logprobs), max(totals), abs_tol=1e-4)
    r = client.completions.create(best_of=3, **kw)
    assert r.choices[0].text == best.text and r.choices[0].logprobs is None
    assert r.usage.completion_tokens == samples.usage.completion_tokens
    ranked = sorted(range(3), key=lambda i: -totals[i])
    two = client.completions.create(n=2, best_of=3, **kw)
    assert [c.text for c in two.choices] == [samples.choices[i].text for i in ranked[:2]]


def test_prompt_logprobs(client, engine):
    """vLLM's prompt_logprobs: None for the first prompt token, then the prompt token and the top ones by id,
    with their text; the same values echo's logprobs give. Chat puts them beside the choices."""
    ids = engine.tokenize(PROMPT)
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    r = client.completions.create(extra_body={"prompt_logprobs": 2}, **kw)
    prompt_lps = r.choices[0].model_extra["prompt_logprobs"]
    assert len(prompt_lps) == len(ids) and prompt_lps[0] is None and r.choices[0].logprobs is None
    echoed = client.completions.create(echo=True, logprobs=2, **kw).choices[0].logprobs
    for i, (token_id, position) in enumerate(zip(ids[1:], prompt_lps[1:]), 1):
        assert 1 <= len(position) <= 3 and str(token_id) in position
        mine = position[str(token_id)]
        assert mine["decoded_token"] == echoed.tokens[i] and abs(mine["logprob"] - echoed.token_logprobs[i]) < 1e-5
        assert sorted(p["rank"] for p in position.values() if p["rank"] is not None) == [1, 2]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 1


INVALID = [
    ("chat", dict(top_logprobs=2), "top_logprobs"),  # without logprobs=true
    ("chat", dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("completions", dict(logprobs=21), "logprobs"),
    ("completions", dict(n=2, best_of=1), "best_of"),
    ("completions", dict(best_of=2, stream=True), "best_of"),
    ("completions", dict(logit_bias={"abc": 1}), "logit_bias"),
    ("completions", dict(logit_bias={"-1": 1}), "logit_bias"),
    ("completions", dict(logit_bias={"10000000": 1}), "logit_bias"),
    ("completions", dict(presence_penalty=2.5), "presence_penalty"),
    ("completions", dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    ("completions", dict(extra_body={"min_p": 1.5}), "min_p"),
    ("completions", dict(max_tokens=4, extra_body={"min_tokens": 5}), "min_tokens"),
    ("completions", dict(extra_body={"prompt_logprobs": 21}), "prompt_logprobs"),
    ("completions", dict(stream=True, extra_body={"prompt_logprobs": 1}), "prompt_logprobs"),
]


@pytest.mark.parametrize("endpoint,kw,param", INVALID, ids=[f"{e}-{p}-{i}" for i, (e, _, p) in enumerate(INVALID)])
def test_invalid_values_are_a_400_naming_the_field(client, endpoint, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        if endpoint == "chat":
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, **kw)
        else:
            client.completions.create(model=MODEL, prompt=PROMPT, **{"max_tokens": 2, **kw})
    assert e.value.param == param, e.value.message
