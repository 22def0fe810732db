"""Bounds on what one client can hold: the wait for a request's headers (`header_timeout_protocol`, uvicorn's
h11 protocol with a timer) and for its body (`BodyTimeout`, an ASGI middleware), and uvicorn's own limits on
connections, idle keep-alive and header size (`uvicorn_limits`).

uvicorn 0.55 bounds no header time itself: its h11 protocol starts no timer when a connection opens, and any
bytes that arrive cancel the keep-alive timer, so a request whose headers never end held its connection until
the client left (measured: open after 4 s with `timeout_keep_alive=1`, first request or a later one)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import h11
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from flashdraft.server.errors import APIError

log = logging.getLogger(__name__)

DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_HEADER_TIMEOUT_S = 10.0
H11_MAX_HEADER_BYTES = 16 * 1024  # h11's own default (DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)


def _who(scope: Scope) -> str:
    client = scope.get("client")
    where = f"{client[0]}:{client[1]}" if client else "unknown client"
    return f"{scope.get('method', '?')} {scope.get('path', '?')} from {where}"


class BodyTimeout:
    """A request's whole body must arrive within `body_timeout_s` of the app first asking for it (so a client
    dripping a byte at a time gets no longer than one that stalls).

    On a stall the client gets a 408 with OpenAI's error object and `Connection: close` (uvicorn then
    closes the socket), and the app is told the client is gone (`http.disconnect`); the app's own reply,
    if any, is dropped. A stall after the response has started only ends the app's read.
    A client that leaves mid-body is one log line; the `ClientDisconnect` the app raises stops here, so
    uvicorn and the app's error handlers never see it (no traceback, no 500). `on_disconnect(scope)` is
    called once for such a request: the metrics hook, since it gets no status to count.

    Add it inside any middleware that counts statuses from `send` (Starlette: add it first), so that the
    408 is counted and the `ClientDisconnect` is not counted as a 500.
    Reads after the last body message pass through unbounded: streaming responses wait there for the
    disconnect (`serving.wait_for_disconnect`) for as long as they stream."""

    def __init__(self, app: ASGIApp, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
                 on_disconnect: Callable[[Scope], None] | None = None):
        if not body_timeout_s > 0:
            raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
        self.app = app
        self.body_timeout_s = body_timeout_s
        self.on_disconnect = on_disconnect

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        more_body = True
        started = answered = gone = False  # answered: this middleware sent the 408; gone: the client left
        deadline: float | None = None  # the whole body's (a client dripping bytes gets no longer)

        async def bounded_receive() -> Message:
            nonlocal more_body, answered, gone, deadline
            if answered or gone:
                return {"type": "http.disconnect"}
            if not more_body:
                return await receive()
            now = asyncio.get_running_loop().time()
            deadline = now + self.body_timeout_s if deadline is None else deadline
            try:
                message = await asyncio.wait_for(receive(), max(deadline - now, 0.0))
            except asyncio.TimeoutError:
                log.warning("request body stalled for %g s: %s; %s", self.body_timeout_s, _who(scope),
                            "response already started, read ended" if started else "answered 408")
                if not started:
                    answered = True
                    await self.request_timeout(scope, receive, send)
                return {"type": "http.disconnect"}
            if message["type"] == "http.request":
                more_body = message.get("more_body", False)
            elif message["type"] == "http.disconnect":
                self.client_left(scope)
                gone = True
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if answered:  # the app's reply to a request already answered with the 408
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, bounded_receive, tracking_send)
        except ClientDisconnect:
            if not (gone or answered):  # raised without a disconnect passing through here
                self.client_left(scope)

    def client_left(self, scope: Scope) -> None:
        log.info("client disconnected before sending the whole request body: %s", _who(scope))
        if self.on_disconnect is not None:
            self.on_disconnect(scope)

    async def request_timeout(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(408, f"the request body did not arrive within {self.body_timeout_s:g} s",
                       code="request_timeout")
        await JSONResponse(err.body(), status_code=408, headers={"connection": "close"})(scope, receive, send)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, whose request line and headers must arrive within `header_timeout_s` of the
    connection opening or, on a kept-alive connection, of the next request's first byte; else the connection
    is closed (as uvicorn closes an idle keep-alive one: no response, since h11 answers only a request it has
    parsed) and the close logged. Built by `header_timeout_protocol`."""

    header_timeout_s = DEFAULT_HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        if self._header_timer is None and self.conn.their_state is h11.IDLE and (
                self.cycle is None or self.cycle.response_complete):
            self._await_headers()  # the first byte of a kept-alive connection's next request
        super().data_received(data)
        self._headers_done_if_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._await_headers()  # part of a pipelined request came with the last one
        else:
            self._headers_done_if_read()  # (a pipelined request, parsed from what was buffered)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_timed_out)

    def _headers_done_if_read(self) -> None:
        if self.conn.their_state is not h11.IDLE:
            self._cancel_header_timer()

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            where = f"{self.client[0]}:{self.client[1]}" if self.client else "unknown client"
            log.warning("request headers did not arrive within %g s: closed the connection from %s",
                        self.header_timeout_s, where)
            self.transport.close()


def header_timeout_protocol(header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> type[HeaderTimeoutH11Protocol]:
    """An `http=` protocol class for `uvicorn.Config` whose requests' headers must arrive within the timeout."""
    if not header_timeout_s > 0:
        raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
    return type("HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_s": header_timeout_s})


def uvicorn_limits(max_connections: int | None, keep_alive_s: int = 5,
                   max_header_bytes: int = H11_MAX_HEADER_BYTES,
                   header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S) -> dict:
    """`uvicorn.Config` keyword arguments bounding what clients can hold.

    max_connections -> `limit_concurrency`: once open connections or running requests reach it, each new
      request gets uvicorn's plain-text 503 (not OpenAI's error object). Sockets are still accepted, and
      connections stalled in their headers count until the header timeout closes them; None: off.
    keep_alive_s -> `timeout_keep_alive`: an idle keep-alive connection closes this long after a response.
    max_header_bytes -> `h11_max_incomplete_event_size`: the request line and headers larger than this
      get a 400.
    header_timeout_s -> `http`: h11 with a header timer (`header_timeout_protocol`), never httptools, which
      uvicorn's "auto" would pick when it is installed."""
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1 or None, got {max_connections}")
    if keep_alive_s < 1:
        raise ValueError(f"keep_alive_s must be >= 1, got {keep_alive_s}")
    if max_header_bytes < 1:
        raise ValueError(f"max_header_bytes must be >= 1, got {max_header_bytes}")
    return {"limit_concurrency": max_connections, "timeout_keep_alive": keep_alive_s,
            "h11_max_incomplete_event_size": max_header_bytes, "http": header_timeout_protocol(header_timeout_s)}
