"""The FastAPI app: OpenAI-compatible routes over one AsyncEngine.

The model loads in a background thread after the server starts listening, so /health can
say 503 ("loading") and then 200. Routes that need the model answer 503 until it is ready.
Shutdown (ServerState.begin_shutdown, from the SIGTERM handler or the lifespan's end) stops
admission at once and gives running requests server.shutdown_grace_s, then aborts them.

With an API key, /v1/*, /tokenize, /detokenize and /metrics (unless server.metrics_public) need
it; /health stays open for supervisors, and /docs, /redoc and /openapi.json are not served at all.

A request with n choices runs n engine sequences from one prompt (server/streaming.py).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ridgefill_runtime.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from ridgefill_runtime.config import EngineConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.errors import InputError, RidgefillError
from ridgefill_runtime.loop_plan import field_of

from . import requests as rq
from .access import HostAllowList, RequestContext, deadline_for, note_usage
from .config import FillSettings, ServerConfig
from .connections import SHUTDOWN_BACKSTOP_S
from .errors import HTTPError, describe_invalid, error_body, error_response
from .limits import BodyReadTimeout, BodySizeLimit, RateLimit
from .metrics import CONTENT_TYPE, ServerMetrics
from .logprobs import TokenStrings
from .protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    new_id,
    usage_of,
)
from .streaming import (
    CompletionChoiceStream,
    Echo,
    chat_choice,
    collect,
    completion_choice,
    stream_chat,
    stream_completion,
)

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
            await asyncio.to_thread(self._stopper.join, max(0.0, self._stop_by - time.monotonic()))


def create_app(
    engine_config: EngineConfig,
    server_config: ServerConfig,
    fill: FillSettings,
    build: Callable[[], Engine] | None = None,
    on_load_failure: Callable[[str], None] | None = None,
) -> FastAPI:
    """`build`: makes the Engine (tests share one model); None loads it from engine_config.
    `on_load_failure(cause)`: called (on the loading thread) when the model cannot load, e.g.
    to end the process; None keeps serving 503 with the cause on /health."""
    state = ServerState(server_config, ServerMetrics())

    def load() -> None:
        try:
            from ridgefill_runtime.llm import build_engine

            built = build() if build is not None else build_engine(engine_config)
            async_engine = AsyncEngine(built, server_config.max_queued_requests, state.metrics)
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
    app.add_middleware(BodyReadTimeout, timeout_s=server_config.body_timeout_s, draining=lambda: state.draining)
    app.add_middleware(RateLimit, per_minute=server_config.rate_limit_per_minute)
    app.add_middleware(HostAllowList, allowed=server_config.allowed_hosts)
    app.add_middleware(
        RequestContext,
        on_done=lambda route, status: state.metrics.http_requests.labels(route=route, status=str(status)).inc(),
    )
    _install_error_handlers(app)

    async def require_key(request: Request) -> None:
        key = server_config.api_key
        if key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
            raise HTTPError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")

    def check_model(name: str | None) -> None:
        if name is not None and name != server_config.served_model_name:
            raise HTTPError(
                404, f"model {name!r} does not exist; this server serves {server_config.served_model_name!r}", "model"
            )

    def fill_for(body, eng: AsyncEngine):
        """The request's (exact-row selectors, terminal-state correction, prefix-cache reuse of
        filled blocks) over the server's."""
        tok = eng.engine.tokenizer
        rows = rq.request_rows(body, eng.engine.fill.rows, tok is not None and hasattr(tok, "token_type"))
        return rows, rq.request_terminal_state(body, eng.engine), rq.request_reuse(body)

    def submit(request: Request, body, prompt_ids, params, fill: bool, rows, terminal, reuse):
        """One engine sequence per choice (n); if one cannot be queued, those already are aborted."""
        eng = state.ready()
        deadline = deadline_for(body.timeout, server_config.request_timeout_s)
        note_usage(request, len(prompt_ids))
        handles = []
        try:
            for choice in rq.choice_params(params, body.n):
                handles.append(
                    eng.submit(
                        prompt_ids, choice, fill, rows, deadline=deadline, terminal_state=terminal, reuse_filled=reuse
                    )
                )
        except InputError as e:
            _abort_all(eng, handles)
            raise HTTPError(400, str(e), field_of(str(e)) or "prompt") from None
        except (EngineOverloaded, EngineStopped) as e:
            _abort_all(eng, handles)
            raise HTTPError(503, str(e), headers={"Retry-After": str(server_config.retry_after_s)}) from None
        return handles

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if state.engine is None:
            status = "error" if state.load_error else "loading"
            return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)
        engine_health = state.engine.health()
        if engine_health.status != "ok":  # "stalled": no step finished for a while with work in flight
            return JSONResponse(
                {
                    "status": engine_health.status,
                    "detail": (
                        f"no engine progress for {engine_health.seconds_since_progress:.0f} s with "
                        f"{engine_health.in_flight} requests in flight"
                    ),
                },
                status_code=503,
            )
        return {"status": "ok"}

    metrics_guard = [] if server_config.metrics_public else [Depends(require_key)]

    @app.get("/metrics", dependencies=metrics_guard)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models():
        eng = state.ready()
        return ModelList(data=[ModelCard(id=server_config.served_model_name, max_model_len=eng.engine.max_model_len)])

    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        eng = state.ready()
        tok = eng.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "send exactly one of 'prompt' or 'messages'", "prompt")
        # NOTE: tokenizing megabytes takes seconds; a worker thread keeps the loop serving.
        if body.messages is not None:
            rq.check_messages(body.messages)
            ids = await asyncio.to_thread(rq.chat_prompt, body.messages, tok)
        else:
            rq.check_text(body.prompt, "prompt")
            ids = await asyncio.to_thread(rq.tokenize_text, tok, body.prompt, body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=eng.engine.max_model_len)

    @app.post("/detokenize", dependencies=[Depends(require_key)])
    async def detokenize(body: DetokenizeRequest):
        check_model(body.model)
        eng = state.ready()
        text = await asyncio.to_thread(rq.detokenize_ids, eng.engine.tokenizer, body.tokens)
        return DetokenizeResponse(prompt=text)

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        rq.check_common(body)
        rq.check_best_of(body)
        logprobs = rq.completion_logprobs(body)
        scores_prompt = body.echo and logprobs is not None
        fill = rq.wants_fill(body, scores_prompt)
        eng = state.ready()
        strings = state.token_strings(logprobs)
        rows, terminal, reuse = fill_for(body, eng)
        rq.check_completion_prompt(body, eng.engine.max_model_len)
        params = rq.sampling_params(body, body.max_tokens, rq.DEFAULT_MAX_TOKENS, server_config.max_stop_strings)
        params = rq.with_logprobs(params, logprobs, prompt=scores_prompt)
        params = rq.with_speculation(body, params, eng.engine.speculative)
        params = rq.with_loops(body, params)
        # NOTE: every cheap check is done; tokenizing may take seconds, in a worker thread.
        prompt = await asyncio.to_thread(rq.completion_prompt, body, eng.engine.tokenizer)
        echo = Echo(rq.echo_text(body, prompt, eng.engine.tokenizer), tuple(prompt)) if body.echo else Echo()
        handles = submit(request, body, prompt, params, fill, rows, terminal, reuse)
        choices = [CompletionChoiceStream(i, h, strings, echo) for i, h in enumerate(handles)]
        rid, model = new_id("cmpl"), server_config.served_model_name
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse_response(request, handles, stream_completion(eng, handles, rid, model, usage, choices))
        outs = await collect(eng, handles, request)
        note_usage(request, len(prompt), sum(h.num_output_tokens for h in handles))
        _raise_if_failed(outs)
        return CompletionResponse(
            id=rid,
            model=model,
            usage=usage_of(handles),
            choices=[completion_choice(c, out) for c, out in zip(choices, outs)],
        )

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        rq.check_common(body)
        logprobs = rq.chat_logprobs(body)
        fill = rq.wants_fill(body)
        eng = state.ready()
        strings = state.token_strings(logprobs)
        rows, terminal, reuse = fill_for(body, eng)
        rq.check_messages(body.messages)
        params = rq.chat_sampling_params(body, server_config.default_chat_max_tokens, server_config.max_stop_strings)
        params = rq.with_logprobs(params, logprobs)
        params = rq.with_speculation(body, params, eng.engine.speculative)
        params = rq.with_loops(body, params)
        # NOTE: every cheap check is done; the template and tokenizer may take seconds, in a thread.
        prompt = await asyncio.to_thread(rq.chat_prompt, body.messages, eng.engine.tokenizer)
        params = rq.fit_default_limit(body, params, len(prompt), eng.engine.max_model_len)
        handles = submit(request, body, prompt, params, fill, rows, terminal, reuse)
        rid, model = new_id("chatcmpl"), server_config.served_model_name
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse_response(request, handles, stream_chat(eng, handles, rid, model, usage, strings))
        outs = await collect(eng, handles, request)
        note_usage(request, len(prompt), sum(h.num_output_tokens for h in handles))
        _raise_if_failed(outs)
        return ChatCompletionResponse(
            id=rid,
            model=model,
            usage=usage_of(handles),
            choices=[chat_choice(i, strings, out) for i, out in enumerate(outs)],
        )

    return app


def _raise_if_failed(outs) -> None:
    for out in outs:
        if out.error:
            raise HTTPError(500, out.error)


def _abort_all(eng: AsyncEngine, handles) -> None:
    for handle in handles:
        eng.abort(handle)


def _sse_response(request: Request, handles, chunks) -> StreamingResponse:
    async def counted():
        try:
            async for chunk in chunks:
                yield chunk
        finally:  # NOTE: before the access log line, which is written when the response ends
            note_usage(request, handles[0].num_prompt_tokens, sum(h.num_output_tokens for h in handles))

    return StreamingResponse(
        counted(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


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
