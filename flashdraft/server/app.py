"""The FastAPI app (`build_app`) and `run_server`, which `flashdraft serve` calls.

Safe by default: binds 127.0.0.1 and answers only Host headers that name the loopback; with an API key
every route but the load balancer's probe (OPEN_PATHS) needs `Authorization: Bearer KEY`; JSON bodies must
say so (415 otherwise, so no web page posts one without a CORS preflight), and CORS is off unless origins
are allowed. Request bodies are capped (413) and every malformed request gets a 400 with OpenAI's error
object naming the field."""

from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from flashdraft import __version__
from flashdraft.config import EngineConfig
from flashdraft.engine.engine import LLMEngine
from flashdraft.server.async_engine import AsyncEngine
from flashdraft.server.chat import ChatOptions
from flashdraft.server.limits import DEFAULT_BODY_TIMEOUT_S, DEFAULT_HEADER_TIMEOUT_S, BodyTimeout, uvicorn_limits
from flashdraft.server.metrics import ServerMetrics
from flashdraft.server.protocol import APIError, bad_request, parse_json
from flashdraft.server.responses_api import create_response
from flashdraft.server.serving import Serving

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_MAX_BODY_BYTES = 1 << 20
OPEN_PATHS = frozenset({"/health"})  # with an API key, every other path needs it: a new route is keyed
LOOPBACK = {"127.0.0.1", "localhost", "::1"}  # bind addresses
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")  # the Host header names of those, any port
ENDPOINTS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
             "/tokenize", "/detokenize", "/version", "/reset_prefix_cache", "/flush_cache"}


def default_model_name(model: str | None) -> str:
    """The local file's or folder's name; a hub id as given (vLLM's: `Qwen/Qwen3-8B`)."""
    if model is None:
        return DEFAULT_MODEL_NAME
    path = Path(model).expanduser()
    if not path.exists():
        return str(model)
    return path.stem if path.suffix == ".gguf" else path.name


def check_api_key(api_key: str | None) -> None:
    if api_key is not None and not api_key.strip():  # an empty key would otherwise switch auth off
        raise ValueError("the API key is empty (--api-key '' or FLASHDRAFT_API_KEY=''): give a key, or leave "
                         "both unset to serve without one")


def host_name(host: str) -> str:
    """A Host header without its port: `[::1]:8000` -> `[::1]`, `Localhost:8000` -> `localhost`."""
    host = host.strip().lower()
    return host[: host.find("]") + 1] if host.startswith("[") else host.partition(":")[0]


def is_json(content_type: str) -> bool:
    """`application/json` or `application/*+json`, parameters (charset) allowed."""
    kind, _, subtype = content_type.partition(";")[0].strip().lower().partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


def error_response(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


class Guard:
    """Each request's Host header must be one of `allowed_hosts` (a page whose domain is rebound to
    127.0.0.1 sends its own), then its API key unless the path is in OPEN_PATHS; and requests are counted
    by endpoint and status."""

    def __init__(self, app: ASGIApp, api_key: str | None, metrics: ServerMetrics,
                 allowed_hosts: Sequence[str] = LOOPBACK_HOSTS):
        check_api_key(api_key)  # b"" would match a bare "Bearer "
        self.app = app
        self.api_key = api_key.encode() if api_key is not None else None
        self.metrics = metrics
        self.allowed_hosts = None if "*" in allowed_hosts else frozenset(h.strip().lower() for h in allowed_hosts)

    def host_allowed(self, scope: Scope) -> bool:
        if self.allowed_hosts is None:
            return True
        host = next((value for name, value in scope.get("headers", []) if name == b"host"), b"")
        return host_name(host.decode("latin-1")) in self.allowed_hosts

    def authorized(self, scope: Scope) -> bool:
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.http_requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        if not self.host_allowed(scope):
            err = APIError(400, "this server does not answer to that Host header; start it with --allowed-hosts "
                           "naming the host clients use", code="invalid_host")
            await error_response(err)(scope, receive, counting_send)
            return
        if self.api_key is not None and path not in OPEN_PATHS and not self.authorized(scope):
            err = APIError(401, "invalid or missing API key; send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key")
            await error_response(err)(scope, receive, counting_send)
            return
        try:
            await self.app(scope, receive, counting_send)
        except Exception:
            if not started:
                self.metrics.http_requests.labels(endpoint, "500").inc()
            raise


async def read_json(request: Request, limit: int) -> dict:
    if not is_json(request.headers.get("content-type", "")):
        raise APIError(415, "the request body must be JSON, sent with the header 'Content-Type: application/json'",
                       code="unsupported_media_type")
    too_large = APIError(413, f"the request body is larger than the limit of {limit} bytes")
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return parse_json(bytes(body))


def build_app(engine: LLMEngine | AsyncEngine, api_key: str | None = None, served_model_name: str | None = None,
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_prompt_tokens: int | None = None,
              chat_options: ChatOptions | None = None, allowed_hosts: Sequence[str] = LOOPBACK_HOSTS,
              allowed_origins: Sequence[str] = (), body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S) -> FastAPI:
    """An app serving `engine`. Several apps may share one engine: they share its loop thread.
    chat_options: the chat template, tool-call and reasoning parsers (server/chat.py).
    allowed_hosts: the Host header names it answers (any port; "*": any). allowed_origins: the web origins
    that CORS lets read its answers ("*": any; none: no CORS headers)."""
    check_api_key(api_key)
    aengine = engine if isinstance(engine, AsyncEngine) else AsyncEngine.of(engine)
    name = served_model_name or default_model_name(aengine.engine.config.model)
    max_model_len = aengine.engine.max_model_len
    metrics = ServerMetrics(aengine, name)
    serving = Serving(aengine, name, metrics, max_prompt_tokens, chat_options)
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        aengine.acquire()
        try:
            yield
        finally:
            await asyncio.to_thread(aengine.release)

    app = FastAPI(title="flashdraft", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    # added before Guard, so inside it: Guard counts the 408, and a client gone mid-body is no 500
    app.add_middleware(BodyTimeout, body_timeout_s=body_timeout_s)
    app.add_middleware(Guard, api_key=api_key, metrics=metrics, allowed_hosts=allowed_hosts)
    if allowed_origins:  # added last, so outside Guard: a browser's preflight carries no API key
        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])
    app.state.async_engine = aengine
    app.state.serving = serving

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        err = (e.errors() or [{}])[0]
        loc = [str(p) for p in err.get("loc", ()) if p not in ("body", "query", "path", "header")]
        param = loc[0] if loc else None
        return error_response(bad_request(f"{param}: {err.get('msg', 'invalid value')}", param))

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def _server_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("unhandled error in %s %s", request.method, request.url.path)
        return error_response(APIError(500, "internal server error", type="server_error"))

    def model_card() -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "flashdraft",
                "max_model_len": max_model_len}

    @app.get("/health")
    async def health() -> Response:
        if not aengine.alive:
            return JSONResponse({"status": "engine thread is not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict:
        if model_id != name:
            raise APIError(404, f"The model `{model_id}` does not exist", "model", code="model_not_found")
        return model_card()

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/reset_prefix_cache")  # vLLM's
    @app.post("/flush_cache")  # SGLang's (z-lab's benchmark client calls it between runs)
    async def reset_prefix_cache() -> Response:
        await aengine.reset_prefix_cache()
        return Response(status_code=200)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        return await serving.tokenize(await read_json(request, max_body_bytes))

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        return await serving.detokenize(await read_json(request, max_body_bytes))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request, await read_json(request, max_body_bytes))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat(request, await read_json(request, max_body_bytes))

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await create_response(serving, request, await read_json(request, max_body_bytes))

    return app


SHUTDOWN_GRACE_S = 5.0  # running requests' time to finish after a stop, then they are aborted
# the engine reads the aborts after the step it is in; requests it has still not ended this long after the stop
# are ended from the loop (AsyncEngine.end_stranded), before uvicorn cancels its handlers (a plain-text 500)
STRANDED_AFTER_S = SHUTDOWN_GRACE_S + 6
UVICORN_GRACE_S = int(SHUTDOWN_GRACE_S) + 10


def _server_class():
    import uvicorn

    class Server(uvicorn.Server):
        """On Ctrl-C or SIGTERM, running requests get a few seconds to finish, then are aborted so that
        each ends cleanly (a 503, or finish_reason "abort" then [DONE]) instead of being cancelled; those
        the engine has not ended by STRANDED_AFTER_S (inside a long step) are ended from the loop."""

        aengine: AsyncEngine

        async def shutdown(self, sockets=None) -> None:
            loop = asyncio.get_running_loop()
            timers = [loop.call_later(SHUTDOWN_GRACE_S, self.aengine.abort_all),
                      loop.call_later(STRANDED_AFTER_S, self.aengine.end_stranded)]
            try:
                await super().shutdown(sockets)
            finally:
                for timer in timers:
                    timer.cancel()

    return Server


def run_server(engine_kwargs: dict, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
               served_model_name: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               max_prompt_tokens: int | None = None, log_level: str = "info",
               chat_options: ChatOptions | None = None, allowed_hosts: Sequence[str] | None = None,
               allowed_origins: Sequence[str] = (), body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
               header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S, max_connections: int | None = None) -> None:
    """Load the engine (so load errors surface before anything binds), then serve until interrupted.
    allowed_hosts None: the loopback's names when bound to a loopback address, else any. body_timeout_s:
    a request body must arrive within it (else 408); header_timeout_s: a request's headers must (else the
    connection closes); max_connections: uvicorn's concurrency limit (limits.py)."""
    import uvicorn

    logging.basicConfig(level=log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    check_api_key(api_key)
    limits = uvicorn_limits(max_connections, header_timeout_s=header_timeout_s)  # (bad values refused before the load)
    if not body_timeout_s > 0:
        raise ValueError(f"body_timeout_s must be > 0, got {body_timeout_s}")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be >= 1, got {max_body_bytes}")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError(f"max_prompt_tokens must be >= 1, got {max_prompt_tokens}")
    if allowed_hosts is None:
        allowed_hosts = LOOPBACK_HOSTS if host in LOOPBACK else ("*",)
    if api_key is None and host not in LOOPBACK:
        log.warning("serving on %s without an API key: anyone who can reach this port can use it", host)
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs))
    name = served_model_name or default_model_name(engine.config.model)
    app = build_app(engine, api_key=api_key, served_model_name=name, max_body_bytes=max_body_bytes,
                    max_prompt_tokens=max_prompt_tokens, chat_options=chat_options, allowed_hosts=allowed_hosts,
                    allowed_origins=allowed_origins, body_timeout_s=body_timeout_s)
    log.info("serving %s on http://%s:%d (max_model_len %d)", name, host, port, engine.max_model_len)
    # this process serves the engine until it exits: what start-up made (modules, tokenizer, graphs) moves
    # to the permanent generation, so no garbage-collection pass walks it mid-serving (a full pass over
    # ~350k objects took 0.24 s on a 2-core CPU after loading SmolLM2: a stall in some step)
    gc.collect()
    gc.freeze()
    server = _server_class()(uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                            timeout_graceful_shutdown=UVICORN_GRACE_S,
                                            **limits))
    server.aengine = app.state.async_engine
    server.run()
