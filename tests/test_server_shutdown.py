"""Shutdown cannot strand a client: every request in flight when the server is told to stop ends with a
503 (OpenAI's error object) or, streamed, a chunk with finish_reason "abort" then [DONE]; never uvicorn's
plain-text 500 for a handler it cancels.

Two ways in: `flashdraft serve` on the embedded SmolLM2, SIGTERM while long prompts prefill on this CPU
(the engine reads the aborts at the next chunk boundary); and an in-process server whose engine is held
inside one step past the grace, so that only the loop-side backstop (AsyncEngine.end_stranded) can
answer. Timeouts are hang guards only: no assertion here is on a measured duration."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading

import fixtures
import pytest
import uvicorn

from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.server import app as app_module
from flashdraft.server.app import build_app

HANG_GUARD_S = 240.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(done, what: str, every_s: float = 0.05) -> None:
    fixtures.wait_until(done, HANG_GUARD_S, what, every_s)


def post(port: int, body: dict, results: dict, key: str) -> None:
    """POST /v1/completions; results[key] = (status, content type, body text)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=HANG_GUARD_S)
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        results[key] = (r.status, r.getheader("content-type", ""), r.read().decode())
    except Exception as e:  # the server closed the connection without an answer
        results[key] = (None, "", repr(e))
    finally:
        conn.close()


def get(port: int, path: str) -> str | None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    except OSError:
        return None
    finally:
        conn.close()


def assert_ended_cleanly(result: tuple, streamed: bool) -> None:
    status, ctype, text = result
    assert status is not None, f"no answer: {text}"
    if streamed and status == 200:
        assert ctype.startswith("text/event-stream"), result
        events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", text[-300:]
        reasons = [c["finish_reason"] for e in events[:-1] for c in json.loads(e).get("choices", [])]
        assert reasons[-1] == "abort", reasons
        return
    assert status == 503, result
    assert ctype.startswith("application/json"), result
    err = json.loads(text)["error"]
    assert err["type"] == "server_error" and "shutting down" in err["message"], err


def running(port: int) -> int:
    text = get(port, "/metrics") or ""
    line = next((ln for ln in text.splitlines() if ln.startswith("flashdraft:num_requests_running")), "x 0")
    return int(float(line.split()[-1]))


def test_sigterm_during_long_cpu_prefills_answers_every_client(tmp_path):
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "flashdraft", "serve", "--device", "cpu", "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: proc.poll() is not None or get(port, "/health") is not None, what="the server")
        assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-2000:]
        results: dict = {}
        # three prompts of 4000 tokens: 24 prefill chunks of 512 tokens on a CPU
        clients = [threading.Thread(target=post, args=(port, {
            "prompt": [(1000 + 37 * i + j) % 40000 + 100 for j in range(4000)], "max_tokens": 8,
            "stream": i == 2}, results, i)) for i in range(3)]
        for c in clients:
            c.start()
        wait_until(lambda: running(port) > 0, what="a running request", every_s=0.2)  # past the first chunk
        proc.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(HANG_GUARD_S)
        # (uvicorn re-raises the signal it caught once it has shut down)
        assert proc.wait(HANG_GUARD_S) in (0, -signal.SIGTERM)
    finally:
        if proc.poll() is None:
            proc.kill()
        log.close()
    served = (tmp_path / "serve.log").read_text()
    for i in range(3):
        assert_ended_cleanly(results[i], streamed=i == 2)
    assert "Internal Server Error" not in served and "timeout graceful shutdown exceeded" not in served, served


class HeldStep:
    """Wraps engine.step: once `hold` is set, the next step with `count` requests in it waits for `release`
    (a step that outlasts the grace, as a long CPU prefill chunk can)."""

    def __init__(self, engine: LLMEngine, count: int):
        self.engine, self.count, self.step = engine, count, engine.step
        self.entered, self.release = threading.Event(), threading.Event()
        engine.step = self

    def __call__(self):
        s = self.engine.scheduler
        if not self.entered.is_set() and len(s.running) + len(s.waiting) >= self.count:
            self.entered.set()
            self.release.wait(HANG_GUARD_S)
        return self.step()


@pytest.fixture
def short_grace(monkeypatch):
    monkeypatch.setattr(app_module, "SHUTDOWN_GRACE_S", 0.2)
    monkeypatch.setattr(app_module, "STRANDED_AFTER_S", 1.0)


def test_requests_held_behind_a_step_past_the_grace_are_answered(tiny_llama, short_grace):
    engine = LLMEngine(EngineConfig(model=str(tiny_llama), draft=None, device="cpu", dtype="float32"))
    held = HeldStep(engine, count=2)
    app = build_app(engine)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # uvicorn's own grace far longer than the backstop's: a cancelled handler would answer 500
    server = app_module._server_class()(uvicorn.Config(app, log_config=None, access_log=False,
                                                       timeout_graceful_shutdown=int(HANG_GUARD_S)))
    server.aengine = app.state.async_engine
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    results: dict = {}
    try:
        wait_until(lambda: server.started or not thread.is_alive(), what="the server")
        body = {"prompt": "hello there", "max_tokens": 200, "ignore_eos": True}
        first = [threading.Thread(target=post, args=(port, dict(body, stream=k == "streamed"), results, k))
                 for k in ("plain", "streamed")]
        for c in first:
            c.start()
        assert held.entered.wait(HANG_GUARD_S), "the held step never came"
        # a third request arrives while the engine is inside the held step: its add is still queued
        late = threading.Thread(target=post, args=(port, body, results, "queued"))
        late.start()
        wait_until(lambda: not app.state.async_engine._inbox.empty(), what="the queued add")
        server.should_exit = True
        for c in [*first, late]:
            c.join(HANG_GUARD_S)
        assert set(results) == {"plain", "streamed", "queued"}
    finally:
        held.release.set()
        server.should_exit = True
        thread.join(HANG_GUARD_S)
    assert_ended_cleanly(results["plain"], streamed=False)
    assert_ended_cleanly(results["streamed"], streamed=True)
    assert_ended_cleanly(results["queued"], streamed=False)
