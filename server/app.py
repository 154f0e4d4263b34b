"""The FastAPI app: OpenAI-compatible routes over one AsyncEngine.

The model loads in a background thread after the server starts listening, so /health can
say 503 ("loading") and then 200. Routes that need the model answer 503 until it is ready.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ridgefill_runtime.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from ridgefill_runtime.config import EngineConfig
from ridgefill_runtime.engine import Engine
from ridgefill_runtime.errors import InputError

from . import requests as rq
from .config import FillSettings, ServerConfig
from .errors import HTTPError, error_body, error_response
from .limits import BodySizeLimit
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (AssistantMessage, ChatChoice, ChatCompletionRequest, ChatCompletionResponse,
                       CompletionChoice, CompletionRequest, CompletionResponse, ModelCard, ModelList,
                       TokenizeRequest, TokenizeResponse, new_id, usage_of)
from .streaming import collect, stream_chat, stream_completion

log = logging.getLogger("ridgefill.server")


@dataclass
class ServerState:
    config: ServerConfig
    metrics: ServerMetrics
    engine: AsyncEngine | None = None  # None while loading
    load_error: str | None = None

    def ready(self) -> AsyncEngine:
        if self.engine is None:
            why = f"the model failed to load: {self.load_error}" if self.load_error else "the model is loading"
            raise HTTPError(503, why, headers={"Retry-After": str(self.config.retry_after_s)})
        return self.engine


def create_app(engine_config: EngineConfig, server_config: ServerConfig, fill: FillSettings,
               build: Callable[[], Engine] | None = None) -> FastAPI:
    """`build`: makes the Engine (tests share one model); None loads it from engine_config."""
    state = ServerState(server_config, ServerMetrics())

    def load() -> None:
        try:
            from ridgefill_runtime.llm import build_engine
            built = build() if build is not None else build_engine(engine_config)
            async_engine = AsyncEngine(built, server_config.max_queued_requests, state.metrics)
            async_engine.start()
            state.engine = async_engine
            log.info("model ready (max_model_len=%d)", built.max_model_len)
        except Exception as e:  # noqa: BLE001 - reported by /health, the process keeps serving 503
            log.exception("model load failed")
            state.load_error = str(e)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.get_running_loop().run_in_executor(None, load)
        yield
        await loading
        if state.engine is not None:
            state.engine.stop()

    app = FastAPI(title="ridgefill", lifespan=lifespan)
    app.state.ridgefill = state
    app.add_middleware(BodySizeLimit, max_bytes=server_config.max_body_bytes)
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
            raise HTTPError(404, f"model {name!r} does not exist; this server serves "
                                 f"{server_config.served_model_name!r}", "model")

    def rows_for(body, eng: AsyncEngine):
        tok = eng.engine.tokenizer
        return rq.request_rows(body, eng.engine.fill.rows, tok is not None and hasattr(tok, "token_type"))

    def submit(prompt_ids, params, fill: bool, rows):
        eng = state.ready()
        try:
            return eng.submit(prompt_ids, params, fill, rows)
        except InputError as e:
            raise HTTPError(400, str(e), "prompt") from None
        except (EngineOverloaded, EngineStopped) as e:
            raise HTTPError(503, str(e), headers={"Retry-After": str(server_config.retry_after_s)}) from None

    @app.get("/health")
    async def health():
        if state.engine is None or not state.engine.alive:
            status = "error" if state.load_error else "loading"
            return JSONResponse({"status": status, "detail": state.load_error}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=[Depends(require_key)])
    async def models():
        eng = state.ready()
        return ModelList(data=[ModelCard(id=server_config.served_model_name,
                                         max_model_len=eng.engine.max_model_len)])

    @app.post("/tokenize", dependencies=[Depends(require_key)])
    async def tokenize(body: TokenizeRequest):
        check_model(body.model)
        eng = state.ready()
        tok = eng.engine.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise HTTPError(400, "send exactly one of 'prompt' or 'messages'", "prompt")
        if body.messages is not None:
            ids = rq.chat_prompt(ChatCompletionRequest(messages=body.messages), tok)
        else:
            ids = rq._encode(tok, body.prompt, body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=eng.engine.max_model_len)

    @app.post("/v1/completions", dependencies=[Depends(require_key)])
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        rq.check_common(body)
        fill = rq.wants_fill(body)
        if body.echo:
            raise HTTPError(400, "echo is not supported", "echo")
        eng = state.ready()
        rows = rows_for(body, eng)
        prompt = rq.completion_prompt(body, eng.engine.tokenizer)
        params = rq.sampling_params(body, body.max_tokens, rq.DEFAULT_MAX_TOKENS)
        handle = submit(prompt, params, fill, rows)
        rid, model = new_id("cmpl"), server_config.served_model_name
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse_response(stream_completion(eng, handle, rid, model, usage))
        out = await collect(eng, handle, request)
        _raise_if_failed(out)
        return CompletionResponse(id=rid, model=model,
                                  choices=[CompletionChoice(text=out.text, finish_reason=out.finish_reason)],
                                  usage=usage_of(handle))

    @app.post("/v1/chat/completions", dependencies=[Depends(require_key)])
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        rq.check_common(body)
        fill = rq.wants_fill(body)
        eng = state.ready()
        rows = rows_for(body, eng)
        prompt = rq.chat_prompt(body, eng.engine.tokenizer)
        asked = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        # NOTE: like OpenAI, an unset limit means "up to the context length".
        default = max(eng.engine.max_model_len - len(prompt), 0)
        params = rq.sampling_params(body, asked, default)
        handle = submit(prompt, params, fill, rows)
        rid, model = new_id("chatcmpl"), server_config.served_model_name
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return _sse_response(stream_chat(eng, handle, rid, model, usage))
        out = await collect(eng, handle, request)
        _raise_if_failed(out)
        return ChatCompletionResponse(
            id=rid, model=model,
            choices=[ChatChoice(message=AssistantMessage(content=out.text), finish_reason=out.finish_reason)],
            usage=usage_of(handle))

    return app


def _raise_if_failed(out) -> None:
    if out.error:
        raise HTTPError(500, out.error)


def _sse_response(chunks) -> StreamingResponse:
    return StreamingResponse(chunks, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(HTTPError)
    async def _http_error(request: Request, err: HTTPError):
        return error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _starlette(request: Request, err: StarletteHTTPException):
        return JSONResponse(error_body(err.status_code, str(err.detail)), status_code=err.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        # NOTE: keep the field name only; pydantic appends union branch names ("prompt.str").
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else first.get("msg", "invalid request")
        return JSONResponse(error_body(400, message, param), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        log.exception("unhandled error")
        return JSONResponse(error_body(500, f"internal error: {type(err).__name__}"), status_code=500)
