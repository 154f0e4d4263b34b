"""The FastAPI app: OpenAI-compatible routes (server/routes.py) over one AsyncEngine.

The model loads in a background thread after the server starts listening, so /health can
say 503 ("loading") and then 200. Routes that need the model answer 503 until it is ready.
Shutdown (ServerState.begin_shutdown, from the SIGTERM handler or the lifespan's end) stops
admission at once and gives running requests server.shutdown_grace_s, then aborts them.

With an API key, /docs, /redoc and /openapi.json are not served at all (the routes check the
key: server/routes.py). A request with n choices runs n engine sequences from one prompt
(server/streaming.py).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ridgefill_runtime.async_engine import AsyncEngine
from ridgefill_runtime.config import EngineConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.errors import RidgefillError

from .access import HostAllowList, RequestContext
from .config import FillSettings, ServerConfig
from .connections import SHUTDOWN_BACKSTOP_S
from .errors import HTTPError, describe_invalid, error_body, error_response
from .limits import BodyReadTimeout, BodySizeLimit, RateLimit
from .logprobs import TokenStrings
from .metrics import ServerMetrics
from .routes import router

log = logging.getLogger("ridgefill.server")


@dataclass
class ServerState:
    config: ServerConfig
    metrics: ServerMetrics
    engine: AsyncEngine | None = None  # None while loading
    _strings: TokenStrings | None = None  # the engine's token texts, made on the first logprobs request
    load_error: str | None = None
    draining: bool = False  # shutdown began: no new requests, /health says "draining"
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _stopper: threading.Thread | None = None  # runs AsyncEngine.stop(grace) off the event loop
    _stop_by: float | None = None  # monotonic time the shutdown stops waiting for the engine

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise HTTPError(503, why, headers={"Retry-After": str(self.config.retry_after_s)})
        return self.engine

    def token_strings(self, asked: int | None) -> TokenStrings | None:
        """The token texts logprobs are shown with; None when the request asked none."""
        if asked is None:
            return None
        tokenizer = self.ready().engine.tokenizer
        if tokenizer is None:
            raise HTTPError(400, "this model has no tokenizer, so logprobs cannot name their tokens", "logprobs")
        if self._strings is None:
            self._strings = TokenStrings(tokenizer)
        return self._strings

    def adopt(self, engine: AsyncEngine) -> bool:
        """Start serving a freshly loaded engine, unless shutdown began while it loaded."""
        with self._lock:
            if self.draining:
                return False
            engine.start()
            self.engine = engine
            return True

    def begin_shutdown(self) -> None:
        """Stop admission now and let running requests finish for shutdown_grace_s, then abort
        them; returns at once (safe in a signal handler). Idempotent."""
        with self._lock:
            if self.draining:
                return
            self.draining = True
            grace = self.config.shutdown_grace_s
            self._stop_by = time.monotonic() + grace + SHUTDOWN_BACKSTOP_S
            if self.engine is not None:
                self.engine.begin_drain()
                self._stopper = threading.Thread(
                    target=self.engine.stop, args=(grace,), name="ridgefill-drain", daemon=True
                )
                self._stopper.start()

    async def finish_shutdown(self) -> None:
        """The lifespan's end: wait for the drain, never past the grace plus the backstop (a
        step that hangs must not keep the process alive)."""
        self.begin_shutdown()
        if self._stopper is not None:
            assert self._stop_by is not None, "begin_shutdown sets the deadline with the stopper"
            await asyncio.to_thread(self._stopper.join, max(0.0, self._stop_by - time.monotonic()))


def create_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    fill: FillSettings,
    build: Callable[[], Engine] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
    on_engine_lost: Callable[[str], None] = lambda cause: None,
) -> FastAPI:
    """`build`: makes the Engine (tests share one model); None loads it from engine_config.
    `on_load_failure(cause)`: called (on the loading thread) when the model cannot load, e.g.
    to end the process; None keeps serving 503 with the cause on /health. `on_engine_lost(cause)`:
    the engine cannot go on (a tensor-parallel rank died); every request has had its error."""
    state = ServerState(server_config, ServerMetrics())

    def load() -> None:
        try:
            from ridgefill_runtime.llm import build_engine

            built = build() if build is not None else build_engine(engine_config)
            async_engine = AsyncEngine(built, server_config.max_queued_requests, state.metrics, on_fatal=on_engine_lost)
            if built.tokenizer is not None:
                _ = built.tokenizer.longest_piece_bytes  # NOTE: read once here, not on the event loop
        except Exception as e:  # noqa: BLE001 - any failure to load is reported, not raised
            state.load_error = str(e) if isinstance(e, RidgefillError) else f"{type(e).__name__}: {e}"
            log.debug("model load failed", exc_info=True)
            if on_load_failure is not None:
                on_load_failure(state.load_error)
            else:
                log.error("model load failed: %s", state.load_error)
            return
        if state.adopt(async_engine):
            log.info("model ready (max_model_len=%d)", built.max_model_len)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        # NOTE: a daemon thread, not the default executor: a shutdown during a long load must
        # not wait for it (asyncio.run joins executor threads at exit).
        threading.Thread(target=load, name="ridgefill-load", daemon=True).start()
        yield
        await state.finish_shutdown()

    keyed = server_config.api_key is not None
    # NOTE: with a key, the schema and docs are not served: they would list the API to anyone.
    app = FastAPI(title="ridgefill", lifespan=lifespan, openapi_url=None if keyed else "/openapi.json")
    app.state.ridgefill = state
    # NOTE: the last added runs first: request id and access log see every answer, including
    # the Host refusal (421), the stalled body (408) and the oversized body (413).
    app.add_middleware(BodySizeLimit, max_bytes=server_config.max_body_bytes)
    app.add_middleware(
        BodyReadTimeout,
        timeout_s=server_config.body_timeout_s,
        deadline_s=server_config.body_deadline_s,
        draining=lambda: state.draining,
    )
    app.add_middleware(RateLimit, per_minute=server_config.rate_limit_per_minute)
    app.add_middleware(HostAllowList, allowed=server_config.allowed_hosts)
    app.add_middleware(
        RequestContext,
        on_done=lambda route, status: state.metrics.http_requests.labels(route=route, status=str(status)).inc(),
    )
    _install_error_handlers(app)
    app.include_router(router)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, err: HTTPError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, err: StarletteHTTPException):
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        message, param = describe_invalid(list(err.errors()), err.body)
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(err).__name__}"), status_code=500)
