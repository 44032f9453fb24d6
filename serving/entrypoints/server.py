"""``hyjax serve``: the OpenAI-compatible HTTP server (FastAPI + uvicorn). No jax here.

::

    client --HTTP--> _Gate (503 while draining, 401 API key, 413 body size)
                     -> FastAPI routes (entrypoints/openai_api.py: validate, tokenize, stream)
                     -> EngineClient --messages--> engine process (engine/engine_process.py)

The port is bound first (a taken one is reported before anything loads), then the engine
process starts; the server answers once its model is loaded, while the engine compiles its
step buckets in the background (a request whose bucket is not compiled yet waits for it).
On SIGTERM or SIGINT the server drains: new requests get 503, requests in flight may finish
for up to ``--shutdown-timeout`` seconds, the rest are aborted (their streams end with finish
reason "abort"), the engine process is stopped and the server exits 0. A second SIGINT forces
exit.

If the engine process dies (killed, out of memory, a failed step), the requests in flight get
an error, new ones 503, and the server exits with code 1 as soon as they are answered: a
supervisor (systemd, Kubernetes, a shell loop) restarts the whole server, as vLLM's users
expect of theirs. It never lingers answering 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyjax.tokenizer import Tokenizer, load_tokenizer
from serving.engine.engine_client import EngineClient, EngineDeadError
from serving.entrypoints.chat_output import ChatParsing
from serving.entrypoints.http_metrics import CONTENT_TYPE, ServerMetrics
from serving.entrypoints.openai_api import ApiError, OpenAIServing
from serving.entrypoints.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from serving.entrypoints.protocol import error_body as _body

log = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
# A scrape waits this long for the engine's answer, then shows the newest stats it has.
STATS_TIMEOUT_S = 2.0


class ServerState:
    """What the routes and the drain share."""

    def __init__(
        self,
        client: EngineClient,
        model_name: str,
        model_dir: str,
        *,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        tokenizer: Tokenizer | None = None,
        chat_parsing: ChatParsing | None = None,
    ) -> None:
        self.client = client
        self.model_name = model_name
        self.model_dir = model_dir
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes
        self.metrics = ServerMetrics(model_name)
        self.serving = OpenAIServing(client, tokenizer, model_name, self.metrics, chat_parsing)
        self.draining = False
        self.in_flight = 0  # HTTP requests inside the app
        self.loop: asyncio.AbstractEventLoop | None = None


# ------------------------------------------------------------------------------ middleware


async def _send_error(send, status: int, body: dict, headers: list | None = None) -> None:
    resp = JSONResponse(body, status_code=status, headers=dict(headers or []))
    await resp({"type": "http"}, None, send)  # type: ignore[arg-type]


class _Gate:
    """Pure ASGI middleware in front of the app: drain, API key, body size, in-flight count.

    The body is read here (up to the limit) and replayed to the app, so an oversized body is
    a 413 whether or not it announces its length.
    """

    def __init__(self, app: Any, state: ServerState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        st = self.state
        if st.draining:
            body = _body("the server is shutting down", "service_unavailable_error")
            return await _send_error(send, 503, body, [("connection", "close")])
        headers = dict(scope["headers"])
        if st.api_key is not None and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), st.api_key.encode()
            ):
                body = _body(
                    "missing or invalid API key (send 'Authorization: Bearer <key>')",
                    "invalid_request_error",
                    code="invalid_api_key",
                )
                return await _send_error(send, 401, body, [("www-authenticate", "Bearer")])
        too_large = _body(
            f"request body exceeds {st.max_request_bytes} bytes",
            "invalid_request_error",
            code="request_too_large",
        )
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > st.max_request_bytes:
            return await _send_error(send, 413, too_large, [("connection", "close")])
        chunks, size = [], 0
        more = scope["method"] in ("POST", "PUT", "PATCH")
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > st.max_request_bytes:
                return await _send_error(send, 413, too_large, [("connection", "close")])
            more = message.get("more_body", False)
        replay = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def receive_replayed():
            return replay.pop() if replay else await receive()

        st.in_flight += 1
        try:
            await self.app(scope, receive_replayed, send)
        finally:
            st.in_flight -= 1


# ------------------------------------------------------------------------------------ app


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    e = errors[0]
    loc = [str(p) for p in e.get("loc", ()) if p != "body"]
    if e.get("type") == "json_invalid":
        return f"malformed JSON body: {e.get('msg', '')}".rstrip(": "), None
    param = ".".join(loc) or None
    msg = e.get("msg", "invalid value")
    return (f"{param}: {msg}" if param else msg), param


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over a started ``EngineClient`` (``state.client``)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        state.loop = asyncio.get_running_loop()
        state.client.attach(state.loop)
        yield
        await asyncio.to_thread(state.client.close)

    app = FastAPI(title="hyjax", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        message, param = _validation_message(exc)
        return JSONResponse(_body(message, "invalid_request_error", param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(
            _body(str(exc.detail), "invalid_request_error", code=str(exc.status_code)),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(_body(f"internal error: {exc!r}", "server_error"), status_code=500)

    @app.get("/health")
    async def health():
        if not state.client.alive:
            reason = state.client.dead_reason or "the engine is not running"
            return JSONResponse(_body(reason, "service_unavailable_error"), status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        info = state.client.info
        card = ModelCard(
            id=state.model_name,
            root=state.model_dir,
            max_model_len=info.max_model_len if info else None,
        )
        return ModelList(data=[card]).model_dump()

    @app.get("/metrics")
    async def metrics():
        stats = None
        with contextlib.suppress(EngineDeadError, asyncio.TimeoutError):
            stats = await asyncio.wait_for(state.client.stats(), STATS_TIMEOUT_S)
        if stats is None and state.client.alive:  # busy in a long step: the newest stats known
            stats = state.client.last_stats
        return Response(state.metrics.render(stats), media_type=CONTENT_TYPE)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await state.serving.completions(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        return await state.serving.chat_completions(req, raw)

    return _Gate(app, state)  # type: ignore[return-value]


# ---------------------------------------------------------------------------------- running


class _DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM/SIGINT drain first (see the module docstring) and that
    the signal is not re-raised after shutdown, so a drained server exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout: float):
        super().__init__(config)
        self.state = state
        self.drain_timeout = drain_timeout
        self._drain_started = False
        self.exit_code = 0

    def handle_exit(self, sig: int, frame) -> None:
        if self._drain_started:
            if sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
            return
        self._drain_started = True
        log.info("received %s: draining", signal.Signals(sig).name)
        loop = self.state.loop
        if loop is None:
            self.should_exit = True
        else:
            loop.call_soon_threadsafe(lambda: loop.create_task(self._drain()))

    async def _drain(self) -> None:
        st = self.state
        st.draining = True
        deadline = loop_time() + self.drain_timeout
        while st.in_flight and loop_time() < deadline:
            await asyncio.sleep(0.05)
        if st.in_flight:
            n = st.client.abort_all()
            log.warning("drain timeout: aborted %d requests", n)
            deadline = loop_time() + 5.0
            while st.in_flight and loop_time() < deadline:
                await asyncio.sleep(0.05)
        self.should_exit = True

    def engine_died(self, reason: str) -> None:
        """``EngineClient.on_dead``: answer what is in flight (errors), then exit 1."""
        if self._drain_started:  # shutting down anyway; the drain finishes the job
            return
        self._drain_started = True
        self.exit_code = 1
        log.error("%s: the server exits with code 1 (restart it)", reason)
        self.state.draining = True
        asyncio.get_running_loop().create_task(self._exit_when_answered())

    async def _exit_when_answered(self) -> None:
        deadline = loop_time() + 5.0
        while self.state.in_flight and loop_time() < deadline:
            await asyncio.sleep(0.05)
        self.should_exit = True


def loop_time() -> float:
    return asyncio.get_running_loop().time()


def serve(
    engine_kwargs: dict,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    shutdown_timeout: float = 30.0,
    log_level: str = "info",
    chat_parsing: ChatParsing | None = None,
) -> int:
    """Binds the port, starts the engine process, then serves until SIGTERM/SIGINT. Returns
    the exit code (1: the port is taken, the engine failed or died)."""
    model_dir = engine_kwargs["model"]
    name = served_model_name or os.path.basename(os.path.normpath(model_dir))
    tokenizer = load_tokenizer(model_dir, dummy=engine_kwargs.get("load_format") == "dummy")
    try:  # before the engine loads and compiles: a taken port is reported at once
        sock = bind_socket(host, port)
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", host, port, e.strerror or e)
        return 1
    client = EngineClient(engine_kwargs)
    try:
        info = client.start()
        log.info("engine ready: %s", info)
        state = ServerState(
            client,
            name,
            model_dir,
            api_key=api_key,
            max_request_bytes=max_request_bytes,
            tokenizer=tokenizer,
            chat_parsing=chat_parsing,
        )
        config = uvicorn.Config(
            build_app(state),
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=5,
            lifespan="on",
        )
        server = _DrainingServer(config, state, shutdown_timeout)
        client.on_dead = server.engine_died
        server.run(sockets=[sock])
        return server.exit_code if server.started else 1
    finally:
        client.close()
        sock.close()


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (IPv6 when ``host`` is an IPv6 address), as uvicorn
    would bind it; raises OSError when the address is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock
