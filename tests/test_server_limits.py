"""Request limits against a real uvicorn server on a local port, spoken to over raw sockets.

Headers that stop arriving (a new connection's, a kept-alive one's next request, or dripped) close the
connection and are logged, and the server still serves. A body that stops arriving gets a 408 (OpenAI's
error object) and its connection closed, then the server still serves; a client that leaves mid-body is one
log line and never a 500; reads after the body (a stream waiting for the disconnect) are not timed out;
`uvicorn_limits` gives arguments uvicorn takes. Socket timeouts are hang guards only: no assertion here is
on a measured duration."""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import socket
import threading
import time
from contextlib import contextmanager

import fixtures
import pytest
import uvicorn
from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse

from flashdraft.server.limits import BodyTimeout, uvicorn_limits

BODY_TIMEOUT_S = 0.5
HEADER_TIMEOUT_S = 0.5
HANG_GUARD_S = 10.0
STALLED = b'POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{"prompt":"x"}'


class Recorder:
    """What the app's `Guard` sees (statuses from `send`, a 500 for an escaping exception), what its
    exception handler gets, and the disconnects `BodyTimeout` reports."""

    def __init__(self):
        self.statuses: list[int] = []
        self.server_errors: list[Exception] = []
        self.disconnects: list[str] = []

    def middleware(self, app):
        async def guard(scope, receive, send):
            started = False

            async def counting_send(message):
                nonlocal started
                if message["type"] == "http.response.start":
                    started = True
                    self.statuses.append(message["status"])
                await send(message)

            try:
                await app(scope, receive, counting_send)
            except Exception:
                if not started:
                    self.statuses.append(500)
                raise

        return guard


def build(recorder: Recorder, limited: bool = True) -> FastAPI:
    """A tiny app that reads its JSON body as flashdraft's routes do, middleware in build_app's order."""
    app = FastAPI()

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        recorder.server_errors.append(e)
        return JSONResponse({"error": {"message": "internal server error"}}, status_code=500)

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
        return json.loads(body)

    @app.post("/linger")
    async def linger(request: Request) -> dict:
        await request.body()
        try:  # past the body, the next message is the disconnect: no timeout may stand in for it
            message = await asyncio.wait_for(request.receive(), 2 * BODY_TIMEOUT_S)
        except asyncio.TimeoutError:
            return {"next": "none yet"}
        return {"next": message["type"]}

    if limited:
        app.add_middleware(BodyTimeout, body_timeout_s=BODY_TIMEOUT_S,
                           on_disconnect=lambda scope: recorder.disconnects.append(scope["path"]))
    app.add_middleware(recorder.middleware)
    return app


class Logged(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def serving(app, header_timeout_s: float = HEADER_TIMEOUT_S, http: str | None = None):
    """uvicorn on a free loopback port in a background thread, with `uvicorn_limits`; yields the server,
    its port and a handler holding what the limits and uvicorn log (attached to them directly: another
    test's uvicorn log config may stop them propagating)."""
    logged = Logged()
    loggers = [logging.getLogger(name) for name in ("flashdraft.server.limits", "uvicorn.error")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(logged)
        lg.setLevel(logging.INFO)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    limits = uvicorn_limits(max_connections=64, header_timeout_s=header_timeout_s)
    if http is not None:  # (uvicorn's own protocol, for the controls)
        limits["http"] = http
    config = uvicorn.Config(app, log_config=None, log_level="info", access_log=False, **limits)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive())
        assert server.started, "server did not start"
        yield server, sock.getsockname()[1], logged
    finally:
        server.should_exit = True
        thread.join(HANG_GUARD_S)
        for lg, level in zip(loggers, levels):
            lg.removeHandler(logged)
            lg.setLevel(level)


def wait_until(done) -> None:
    fixtures.wait_until(done, HANG_GUARD_S)


def connect(port: int) -> socket.socket:
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(HANG_GUARD_S)
    return conn


def read_until_closed(conn: socket.socket) -> bytes:
    """All the server sends until it closes the connection; socket.timeout if it never does."""
    data = bytearray()
    while chunk := conn.recv(65536):
        data += chunk
    return bytes(data)


def read_response(conn: socket.socket) -> bytes:
    """One response with a Content-Length, leaving the connection open."""
    data = bytearray()
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    length = int(next(ln.split(b":")[1] for ln in head.lower().split(b"\r\n") if ln.startswith(b"content-length")))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def post(port: int, path: str, body: bytes) -> tuple[int, dict]:
    with connect(port) as conn:
        conn.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (path.encode(), len(body), body))
        return parse(read_until_closed(conn))


def parse(response: bytes) -> tuple[int, dict]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), json.loads(body)


def no_tasks(server: uvicorn.Server) -> bool:
    return not server.server_state.tasks


def test_stalled_bodies_get_408_and_close_then_the_server_still_serves():
    recorder = Recorder()
    with serving(build(recorder)) as (server, port, logged):
        conns = [connect(port) for _ in range(20)]
        for conn in conns:
            conn.sendall(STALLED)
        replies = [read_until_closed(conn) for conn in conns]  # returns only once the server closes
        for conn in conns:
            conn.close()
        for reply in replies:
            status, body = parse(reply)
            assert status == 408
            assert body["error"]["type"] == "invalid_request_error"
            assert body["error"]["code"] == "request_timeout"
            assert b"connection: close" in reply.lower()
        assert post(port, "/echo", b'{"prompt": "x"}') == (200, {"prompt": "x"})
        wait_until(lambda: no_tasks(server))
    assert recorder.statuses == [408] * 20 + [200]
    assert recorder.server_errors == [] and recorder.disconnects == []
    assert sum("stalled" in r.getMessage() for r in logged.records) == 20
    assert not [r for r in logged.records if r.levelno >= logging.ERROR]


def test_a_client_leaving_mid_body_is_one_log_line_not_a_500():
    recorder = Recorder()
    with serving(build(recorder)) as (server, port, logged):
        with connect(port) as conn:
            conn.sendall(STALLED[:-5])
        wait_until(lambda: recorder.disconnects and no_tasks(server))
        assert post(port, "/echo", b'{"prompt": "y"}') == (200, {"prompt": "y"})
    assert recorder.disconnects == ["/echo"]
    assert recorder.statuses == [200] and recorder.server_errors == []
    left = [r for r in logged.records if "disconnected" in r.getMessage()]
    assert len(left) == 1 and left[0].levelno == logging.INFO and left[0].exc_info is None
    assert "POST /echo from 127.0.0.1:" in left[0].getMessage()
    assert not [r for r in logged.records if r.levelno >= logging.ERROR]


def test_without_the_middleware_a_client_leaving_mid_body_is_a_500():
    """The control: what the test above rules out is what happens without BodyTimeout."""
    recorder = Recorder()
    with serving(build(recorder, limited=False)) as (server, port, _):
        with connect(port) as conn:
            conn.sendall(STALLED[:-5])
        wait_until(lambda: recorder.server_errors and no_tasks(server))
    assert recorder.statuses == [500]
    assert type(recorder.server_errors[0]).__name__ == "ClientDisconnect"


def test_reads_after_the_body_are_not_timed_out():
    recorder = Recorder()
    with serving(build(recorder)) as (_, port, _):
        assert post(port, "/linger", b"{}") == (200, {"next": "none yet"})
    assert recorder.statuses == [200]


def test_uvicorn_limits_are_arguments_uvicorn_takes():
    kwargs = uvicorn_limits(max_connections=32, keep_alive_s=7, max_header_bytes=8192)
    assert set(kwargs) <= set(inspect.signature(uvicorn.Config).parameters)
    config = uvicorn.Config(build(Recorder()), **kwargs)
    assert (config.limit_concurrency, config.timeout_keep_alive, config.h11_max_incomplete_event_size) == \
        (32, 7, 8192)
    assert uvicorn_limits(max_connections=None)["limit_concurrency"] is None


@pytest.mark.parametrize("kwargs", [{"max_connections": 0}, {"max_connections": None, "keep_alive_s": 0},
                                    {"max_connections": None, "max_header_bytes": 0}])
def test_uvicorn_limits_refuse_values_that_bound_nothing(kwargs):
    with pytest.raises(ValueError):
        uvicorn_limits(**kwargs)


def test_body_timeout_must_be_positive():
    with pytest.raises(ValueError, match="body_timeout_s"):
        BodyTimeout(build(Recorder(), limited=False), body_timeout_s=0)


def test_the_server_app_times_out_a_stalled_body(tiny_llama):
    """build_app's own stack (BodyTimeout inside Guard): a stalled /v1/completions body gets the 408 and
    Guard counts it, and the next request is served."""
    from flashdraft.config import EngineConfig
    from flashdraft.engine.engine import LLMEngine
    from flashdraft.server.app import build_app

    engine = LLMEngine(EngineConfig(model=str(tiny_llama), draft=None, device="cpu", dtype="float32"))
    app = build_app(engine, body_timeout_s=BODY_TIMEOUT_S, allowed_hosts=["*"])
    with serving(app) as (server, port, logged):
        conn = connect(port)
        conn.sendall(STALLED.replace(b"/echo", b"/v1/completions").replace(
            b"Host: x\r\n", b"Host: x\r\nContent-Type: application/json\r\n"))
        status, body = parse(read_until_closed(conn))
        assert status == 408 and body["error"]["code"] == "request_timeout"
        status, body = post(port, "/v1/completions", b'{"prompt": "hi", "max_tokens": 2}')
        assert status == 200, body


def test_a_body_dripped_a_byte_at_a_time_gets_408():
    """The timeout is the whole body's: a client sending one byte every BODY_TIMEOUT_S / 3 (each part in
    time) is answered 408 all the same."""
    recorder = Recorder()
    body = b'{"prompt": "' + b"x" * 40 + b'"}'
    with serving(build(recorder)) as (server, port, logged):
        conn = connect(port)
        conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
                     % len(body))
        reply = b""
        for byte in body:
            try:
                conn.sendall(bytes([byte]))
            except OSError:  # (the server closed after its 408)
                break
            time.sleep(BODY_TIMEOUT_S / 3)
            if "stalled" in " ".join(r.getMessage() for r in logged.records):
                break
        reply = read_until_closed(conn)
        conn.close()
        assert parse(reply)[0] == 408
    assert recorder.statuses == [408]


PARTIAL_HEAD = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def header_timeouts(logged) -> int:
    return sum("headers did not arrive" in r.getMessage() for r in logged.records)


def test_stalled_headers_close_the_connection_then_the_server_still_serves():
    recorder = Recorder()
    with serving(build(recorder)) as (server, port, logged):
        silent = [connect(port) for _ in range(10)]  # connected, nothing sent
        partial = [connect(port) for _ in range(10)]
        for conn in partial:
            conn.sendall(PARTIAL_HEAD)
        for conn in silent + partial:
            assert read_until_closed(conn) == b""  # closed without a response (h11 parsed no request)
            conn.close()
        assert post(port, "/echo", b'{"prompt": "x"}') == (200, {"prompt": "x"})
    assert header_timeouts(logged) == 20
    assert recorder.statuses == [200] and recorder.server_errors == []


def test_a_kept_alive_connections_next_request_is_timed_too():
    recorder = Recorder()
    with serving(build(recorder)) as (server, port, logged):
        conn = connect(port)
        body = b'{"prompt": "a"}'
        conn.sendall(PARTIAL_HEAD + b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert parse(read_response(conn)) == (200, {"prompt": "a"})
        conn.sendall(PARTIAL_HEAD)  # the next request's headers never end
        assert read_until_closed(conn) == b""
        conn.close()
    assert header_timeouts(logged) == 1 and recorder.statuses == [200]


def test_headers_dripped_a_byte_at_a_time_are_cut_off():
    """The timeout runs from the request's first byte: bytes arriving in time each do not extend it."""
    with serving(build(Recorder())) as (server, port, logged):
        conn = connect(port)
        for byte in PARTIAL_HEAD * 4:
            try:
                conn.sendall(bytes([byte]))
            except OSError:  # (the server closed)
                break
            time.sleep(HEADER_TIMEOUT_S / 5)
            if header_timeouts(logged):
                break
        assert read_until_closed(conn) == b""
        conn.close()
    assert header_timeouts(logged) == 1


def test_a_slow_body_after_complete_headers_is_not_cut_by_the_header_timeout():
    recorder = Recorder()
    with serving(build(recorder, limited=False)) as (server, port, logged):
        conn = connect(port)
        body = b'{"prompt": "slow"}'
        conn.sendall(PARTIAL_HEAD + b"Content-Length: %d\r\n\r\n" % len(body))
        time.sleep(3 * HEADER_TIMEOUT_S)
        conn.sendall(body)
        assert parse(read_response(conn)) == (200, {"prompt": "slow"})
        conn.close()
    assert header_timeouts(logged) == 0 and recorder.statuses == [200]


def test_without_the_header_timer_stalled_headers_hold_the_connection():
    """The control: uvicorn's own h11 protocol leaves a request with unfinished headers open."""
    with serving(build(Recorder()), http="h11") as (server, port, logged):
        conn = connect(port)
        conn.sendall(PARTIAL_HEAD)
        conn.settimeout(4 * HEADER_TIMEOUT_S)
        with pytest.raises(socket.timeout):
            conn.recv(1)
        conn.close()
    assert header_timeouts(logged) == 0


def test_header_timeout_must_be_positive():
    with pytest.raises(ValueError, match="header_timeout_s"):
        uvicorn_limits(max_connections=None, header_timeout_s=0)


@pytest.mark.parametrize("kwargs, message", [({"header_timeout_s": 0}, "header_timeout_s"),
                                             ({"body_timeout_s": -1}, "body_timeout_s"),
                                             ({"max_connections": 0}, "max_connections")])
def test_serve_refuses_bad_limits_before_loading_the_model(kwargs, message, tmp_path):
    from flashdraft.server.app import run_server

    with pytest.raises(ValueError, match=message):  # (the model does not exist: loading it would fail otherwise)
        run_server({"model": str(tmp_path / "missing")}, **kwargs)
