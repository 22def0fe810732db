"""What the server refuses before any work: with an API key every route but the open probes (OPEN_PATHS) needs
it, a route added later included; an empty key is refused at start; JSON bodies must say they are JSON (415);
a Host header not naming the server gets 400 (DNS rebinding); CORS headers only for allowed origins; client
field names reach the log escaped and capped; errors name the model as served, not its path on disk.
In-process (Starlette's TestClient) on a tiny random model, CPU."""

from __future__ import annotations

import re

import pytest
from starlette.testclient import TestClient

from flashdraft.cli import main
from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.server.app import OPEN_PATHS, build_app, run_server

KEY = "sesame"
NAME = "tiny"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETIONS = "/v1/completions"
ORIGIN = "http://app.example"


@pytest.fixture(scope="module")
def engine(tiny_llama) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(tiny_llama), draft=None, device="cpu", dtype="float32"))


def client(engine: LLMEngine, **kwargs) -> TestClient:
    return TestClient(build_app(engine, served_model_name=NAME, **kwargs), base_url="http://localhost")


@pytest.fixture(scope="module")
def keyed(engine):
    with client(engine, api_key=KEY) as c:
        yield c


@pytest.fixture(scope="module")
def plain(engine):
    with client(engine) as c:
        yield c


def test_every_route_but_the_probes_needs_the_key(keyed):
    """Deny by default: the table is the app's own routes (plus a path no route has), so a new one is in it."""
    routes = [(method, re.sub(r"\{[^}]*\}", NAME, r.path)) for r in keyed.app.routes for method in sorted(r.methods)]
    routes.append(("GET", "/no-such-route"))
    assert {"/tokenize", "/detokenize", "/metrics", "/version", COMPLETIONS} <= {path for _, path in routes}
    assert OPEN_PATHS <= {path for _, path in routes}  # the open set names live routes only
    for method, path in routes:
        body = {"json": {}} if method == "POST" else {}
        without = keyed.request(method, path, **body)
        wrong = keyed.request(method, path, headers={"Authorization": "Bearer nope"}, **body)
        with_key = keyed.request(method, path, headers=AUTH, **body)
        if path in OPEN_PATHS:
            assert without.status_code == 200, (method, path)
            continue
        assert without.status_code == wrong.status_code == 401, (method, path)
        assert without.json()["error"]["code"] == "invalid_api_key"
        assert with_key.status_code != 401, (method, path, with_key.text)


def test_the_key_is_enough(keyed):
    r = keyed.post(COMPLETIONS, json={"prompt": "the quick", "max_tokens": 2, "ignore_eos": True}, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_an_empty_key_is_refused_at_start(engine, monkeypatch, capsys):
    for key in ("", "  "):
        with pytest.raises(ValueError, match="API key is empty"):
            build_app(engine, api_key=key)
        with pytest.raises(ValueError, match="API key is empty"):
            run_server({}, api_key=key)  # before the engine loads
    assert main(["serve", "--api-key", ""]) == 2
    monkeypatch.setenv("FLASHDRAFT_API_KEY", "")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.count("API key is empty") == 2


@pytest.mark.parametrize("path", [COMPLETIONS, "/v1/chat/completions", "/v1/responses", "/tokenize", "/detokenize"])
@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                                          None])
def test_json_endpoints_want_a_json_content_type(plain, path, content_type):
    """A web page posts text/plain, a form or a typeless blob without a CORS preflight: refused before reading."""
    headers = {"Content-Type": content_type} if content_type else {}
    r = plain.post(path, content=b'{"prompt": "hi", "max_tokens": 1}', headers=headers)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unsupported_media_type"


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.flashdraft+json"])
def test_json_content_types(plain, content_type):
    r = plain.post("/tokenize", content=b'{"prompt": "the quick"}', headers={"Content-Type": content_type})
    assert r.status_code == 200 and r.json()["count"] > 0


@pytest.mark.parametrize("host,ok", [("localhost", True), ("localhost:8000", True), ("127.0.0.1:8000", True),
                                     ("[::1]:8000", True), ("LocalHost", True), ("evil.example", False),
                                     ("evil.example:8000", False), ("localhost.evil.example", False),
                                     ("[::1", False), ("", False)])
def test_a_loopback_server_answers_only_loopback_hosts(plain, host, ok):
    r = plain.get("/health", headers={"Host": host})
    assert (r.status_code == 200) == ok
    if not ok:
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"


def test_allowed_hosts(engine):
    with client(engine, allowed_hosts=["api.example"]) as c:
        assert c.get("/health", headers={"Host": "api.example:443"}).status_code == 200
        assert c.get("/health", headers={"Host": "localhost"}).status_code == 400
    with client(engine, allowed_hosts=["*"]) as c:
        assert c.get("/health", headers={"Host": "anything.example"}).status_code == 200


def test_cors_is_closed_by_default(plain):
    r = plain.get("/health", headers={"Origin": ORIGIN})
    assert r.status_code == 200 and not any(h.startswith("access-control-") for h in r.headers)
    preflight = plain.options(COMPLETIONS, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


def test_cors_for_an_allowed_origin(engine):
    with client(engine, api_key=KEY, allowed_origins=[ORIGIN]) as c:
        # the preflight carries no key: it is answered before the key is asked for
        preflight = c.options(COMPLETIONS, headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization, content-type"})
        assert preflight.status_code == 200
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in preflight.headers["access-control-allow-methods"]
        r = c.get("/v1/models", headers={"Origin": ORIGIN, **AUTH})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN
        other = c.get("/v1/models", headers={"Origin": "http://evil.example", **AUTH})
        assert "access-control-allow-origin" not in other.headers


def ignored_fields_line(caplog) -> str:
    lines = [rec.getMessage() for rec in caplog.records if "ignored" in rec.getMessage()]
    assert len(lines) == 1, lines
    return lines[0]


def test_a_forged_field_name_is_logged_escaped(plain, caplog):
    caplog.set_level("WARNING", logger="flashdraft.server.serving")
    body = {"prompt": "hi", "max_tokens": 1, "a\nERROR forged": 1, "caf\u00e9": 2, "long" * 2500: 3}
    r = plain.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    line = ignored_fields_line(caplog)
    assert "\n" not in line and r"'a\nERROR forged'" in line and r"'caf\xe9'" in line
    assert "'" + "long" * 16 + "'..." in line and len(line) < 200


def test_a_thousand_fields_are_logged_capped(plain, caplog):
    caplog.set_level("WARNING", logger="flashdraft.server.serving")
    fields = {f"field{i:04d}": 0 for i in range(1000)}
    r = plain.post(COMPLETIONS, json={"prompt": "hi", "max_tokens": 1, **fields})
    assert r.status_code == 200, r.text
    line = ignored_fields_line(caplog)
    assert "'field0000'" in line and "'field0015'" in line and "field0016" not in line
    assert line.endswith(" and 984 more") and len(line) < 500


def test_errors_name_the_served_model_not_its_path(engine, tiny_llama):
    app = build_app(engine, served_model_name=NAME)
    app.state.serving.tokenizer.chat_template = None  # the server's own copy: the engine's keeps its template
    with TestClient(app, base_url="http://localhost") as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "no chat template" in message and NAME in message and str(tiny_llama) not in message
