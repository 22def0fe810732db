"""Bounds on what one client can hold: the wait for a request body (`BodyTimeout`, an ASGI middleware)
and uvicorn's own limits on connections, idle keep-alive and header size (`uvicorn_limits`).

Header reading has no time bound: uvicorn 0.55's h11 protocol starts no timer when a connection opens,
and any bytes that arrive cancel the keep-alive timer, so a request whose headers never end holds its
connection until the client leaves (measured: open after 4 s with `timeout_keep_alive=1`, first request
or a later one). `BodyTimeout` needs no header timeout: it starts when the app first reads the body."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashdraft.server.errors import APIError

log = logging.getLogger(__name__)

DEFAULT_BODY_TIMEOUT_S = 30.0
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


def uvicorn_limits(max_connections: int | None, keep_alive_s: int = 5,
                   max_header_bytes: int = H11_MAX_HEADER_BYTES) -> dict:
    """`uvicorn.Config` keyword arguments bounding what clients can hold; none bounds header time (above).

    max_connections -> `limit_concurrency`: once open connections or running requests reach it, each new
      request gets uvicorn's plain-text 503 (not OpenAI's error object). Sockets are still accepted, and
      connections stalled in their headers count until the client leaves, so behind no proxy that times
      headers out (nginx's client_header_timeout) a few hundred idle sockets turn everyone away; None: off.
    keep_alive_s -> `timeout_keep_alive`: an idle keep-alive connection closes this long after a response.
    max_header_bytes -> `h11_max_incomplete_event_size`: the request line and headers larger than this
      get a 400 (h11 only: uvicorn's "auto" picks httptools instead when it is installed)."""
    if max_connections is not None and max_connections < 1:
        raise ValueError(f"max_connections must be >= 1 or None, got {max_connections}")
    if keep_alive_s < 1:
        raise ValueError(f"keep_alive_s must be >= 1, got {keep_alive_s}")
    if max_header_bytes < 1:
        raise ValueError(f"max_header_bytes must be >= 1, got {max_header_bytes}")
    return {"limit_concurrency": max_connections, "timeout_keep_alive": keep_alive_s,
            "h11_max_incomplete_event_size": max_header_bytes}
