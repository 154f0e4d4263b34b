"""The HTTP routes (one APIRouter over the app's ServerState, `request.app.state.ridgefill`).

/v1/completions and /v1/chat/completions run one flow, `generate`: check the request, resolve
its fill and sampling settings, tokenize, submit one engine sequence per choice, then stream
or collect the answer. What differs, how the prompt is built and how the answer is shaped, is
a `Generation` each (COMPLETIONS, CHAT).

With an API key, /v1/*, /tokenize, /detokenize and /metrics (unless server.metrics_public) need
it; /health stays open for supervisors.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.routing import APIRoute
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ridgefill_runtime.async_engine import AsyncEngine, EngineOverloaded, EngineStopped
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.grammar.spec import GrammarSpec
from ridgefill_runtime.loop_plan import field_of
from ridgefill_runtime.sequence import SamplingParams

from . import requests as rq
from .access import deadline_for, note_usage
from .config import ServerConfig
from .errors import HTTPError, engine_failure_status, parse_json_int
from .logprobs import TokenStrings
from .metrics import CONTENT_TYPE
from .tools import check_tools, template_tools, tool_format_of, tool_plan
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
    TokenizerInfoResponse,
    TokenizeResponse,
    new_id,
    usage_of,
)
from .structured import compile_grammar, grammar_of, metric_kind
from .streaming import (
    ChatShape,
    CompletionChoiceStream,
    Echo,
    chat_choice,
    collect,
    completion_choice,
    stream_chat,
    stream_completion,
)


def _state(request: Request):
    """The app's ServerState (server/app.py)."""
    return request.app.state.ridgefill


async def require_key(request: Request) -> None:
    key = _state(request).config.api_key
    if key is None:
        return
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), key.encode()):
        raise HTTPError(401, "missing or invalid API key (send 'Authorization: Bearer <key>')")


async def require_metrics_key(request: Request) -> None:
    """/metrics needs the key too, unless server.metrics_public."""
    if not _state(request).config.metrics_public:
        await require_key(request)


class _BoundedIntsRequest(Request):
    """A request whose JSON body reads integer literals past MAX_INT_DIGITS as OversizedInt,
    so the field holding one is refused by name (not the whole body, vaguely)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = json.loads(await self.body(), parse_int=parse_json_int)
        return self._json


class _BoundedIntsRoute(APIRoute):
    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def bounded(request: Request):
            return await handler(_BoundedIntsRequest(request.scope, request.receive))

        return bounded


router = APIRouter(route_class=_BoundedIntsRoute)
keyed = [Depends(require_key)]


@router.get("/health")
async def health(request: Request):
    state = _state(request)
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


@router.get("/metrics", dependencies=[Depends(require_metrics_key)])
async def metrics(request: Request):
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


@router.get("/v1/models", dependencies=keyed)
async def models(request: Request):
    state = _state(request)
    eng = state.ready()
    return ModelList(data=[ModelCard(id=state.config.served_model_name, max_model_len=eng.engine.max_model_len)])


@router.post("/tokenize", dependencies=keyed)
async def tokenize(body: TokenizeRequest, request: Request):
    state = _state(request)
    _check_model(state.config, body.model)
    eng = state.ready()
    tok = eng.engine.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise HTTPError(400, "send exactly one of 'prompt' or 'messages'", "prompt")
    # NOTE: tokenizing megabytes takes seconds; a worker thread keeps the loop serving.
    if body.messages is not None:
        rq.check_messages(body.messages)
        tools = _tokenize_tools(body, tok)
        ids = await asyncio.to_thread(rq.chat_prompt, body.messages, tok, tools)
    else:
        rq.check_text(body.prompt, "prompt")
        ids = await asyncio.to_thread(rq.tokenize_text, tok, body.prompt, body.add_special_tokens)
    return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=eng.engine.max_model_len)


def _tokenize_tools(body: TokenizeRequest, tokenizer) -> list[dict] | None:
    """/tokenize's tools (with messages), checked as a chat request's are."""
    if not body.tools:
        return None
    check_tools(body.tools)
    tool_format_of(tokenizer)
    return template_tools(body.tools)


@router.post("/detokenize", dependencies=keyed)
async def detokenize(body: DetokenizeRequest, request: Request):
    state = _state(request)
    _check_model(state.config, body.model)
    eng = state.ready()
    text = await asyncio.to_thread(rq.detokenize_ids, eng.engine.tokenizer, body.tokens)
    return DetokenizeResponse(prompt=text)


@router.get("/tokenizer_info", dependencies=keyed)
async def tokenizer_info(request: Request):
    """The served tokenizer's special-token spellings and chat template, in vLLM's shape: what
    lm-eval's remote tokenizer backend reads (with /tokenize and /detokenize for the ids)."""
    state = _state(request)
    eng = state.ready()
    tok = eng.engine.tokenizer
    if not hasattr(tok, "template_tokens"):
        raise HTTPError(404, "this model is served as token ids: it has no tokenizer to describe")
    return TokenizerInfoResponse(
        tokenizer_class="PreTrainedTokenizerFast",
        model_max_length=eng.engine.max_model_len,
        vocab_size=tok.vocab_size,
        chat_template=tok.chat_template,
        **{name: tok.template_tokens.get(name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")},
    )


# -- generation: one flow, two shapes ---------------------------------------------------------------


@dataclass(frozen=True)
class Generation:
    """What a generation route does its own way; `generate` runs the rest.

    logprobs(body) -> (top logprobs asked or None, whether the prompt rows are scored), after
      the route's own checks of the body; check_prompt(body, max_model_len) before tokenizing;
      prompt_bytes(body) the UTF-8 bytes of the text the tokenizer will read (0 for token ids),
      which refuse a prompt too long for the context before it is tokenized;
      sampling(body, server config) the base sampling parameters; prompt(body, tokenizer) the
      token ids (run in a worker thread); fit(body, params, prompt length, max_model_len) the
      parameters once the prompt length is known; shape(body, prompt, tokenizer, strings) what
      `stream` and `respond` shape the answer with (made before anything is submitted);
      constraint(body, tokenizer) the request's one structured-output constraint, or None."""

    id_prefix: str
    logprobs: Callable[[Any], tuple[int | None, bool]]
    check_prompt: Callable[[Any, int], None]
    prompt_param: str  # the field an error about the prompt names
    prompt_bytes: Callable[[Any], int]
    sampling: Callable[[Any, ServerConfig], SamplingParams]
    prompt: Callable[[Any, Any], list[int]]
    fit: Callable[[Any, SamplingParams, int, int], SamplingParams]
    shape: Callable[[Any, list[int], Any, TokenStrings | None], Any]
    stream: Callable[..., AsyncIterator[str]]  # (eng, handles, id, model, usage, shape) -> SSE chunks
    respond: Callable[..., Any]  # (id, model, handles, outs, shape) -> the response body
    constraint: Callable[[Any, Any], GrammarSpec | None]


@dataclass(frozen=True)
class _CompletionShape:
    """A completion's answer: the echoed prompt (if asked) before each choice's text."""

    echo: Echo
    strings: TokenStrings | None

    def choices(self, handles) -> list[CompletionChoiceStream]:
        # NOTE: choice 0 scored the prompt for all (requests.choice_params)
        return [CompletionChoiceStream(i, h, self.strings, self.echo, handles[0]) for i, h in enumerate(handles)]


def _completion_logprobs(body: CompletionRequest) -> tuple[int | None, bool]:
    rq.check_best_of(body)
    logprobs = rq.completion_logprobs(body)
    return logprobs, bool(body.echo and logprobs is not None)


def _completion_shape(body: CompletionRequest, prompt, tokenizer, strings) -> _CompletionShape:
    echo = Echo(rq.echo_text(body, prompt, tokenizer), tuple(prompt)) if body.echo else Echo()
    return _CompletionShape(echo, strings)


COMPLETIONS = Generation(
    id_prefix="cmpl",
    logprobs=_completion_logprobs,
    check_prompt=rq.check_completion_prompt,
    prompt_param="prompt",
    prompt_bytes=rq.completion_prompt_bytes,
    sampling=lambda body, config: rq.sampling_params(
        body, body.max_tokens, rq.DEFAULT_MAX_TOKENS, config.max_stop_strings
    ),
    prompt=rq.completion_prompt,
    fit=lambda body, params, prompt_len, max_model_len: params,
    shape=_completion_shape,
    stream=lambda eng, handles, rid, model, usage, shape: stream_completion(
        eng, handles, rid, model, usage, shape.choices(handles)
    ),
    respond=lambda rid, model, handles, outs, shape: CompletionResponse(
        id=rid,
        model=model,
        usage=usage_of(handles),
        choices=[completion_choice(c, out) for c, out in zip(shape.choices(handles), outs)],
    ),
    constraint=lambda body, tokenizer: grammar_of(body),
)


def _chat_tools(body: ChatCompletionRequest, tokenizer) -> list[dict] | None:
    plan = tool_plan(body, tokenizer)
    return plan.template_tools() if plan else None


def _chat_constraint(body: ChatCompletionRequest, tokenizer) -> GrammarSpec | None:
    plan = tool_plan(body, tokenizer)
    return grammar_of(body, plan.grammar(tokenizer) if plan else None)


CHAT = Generation(
    id_prefix="chatcmpl",
    logprobs=lambda body: (rq.chat_logprobs(body), False),
    check_prompt=lambda body, max_model_len: rq.check_messages(body.messages),
    prompt_param="messages",
    prompt_bytes=lambda body: rq.messages_bytes(body.messages),
    sampling=lambda body, config: rq.chat_sampling_params(
        body, config.default_chat_max_tokens, config.max_stop_strings
    ),
    prompt=lambda body, tokenizer: rq.chat_prompt(body.messages, tokenizer, _chat_tools(body, tokenizer)),
    fit=rq.fit_default_limit,
    shape=lambda body, prompt, tokenizer, strings: ChatShape(strings, tool_plan(body, tokenizer)),
    stream=stream_chat,
    respond=lambda rid, model, handles, outs, shape: ChatCompletionResponse(
        id=rid,
        model=model,
        usage=usage_of(handles),
        choices=[chat_choice(i, shape.strings, out, shape.parser()) for i, out in enumerate(outs)],
    ),
    constraint=_chat_constraint,
)


@router.post("/v1/completions", dependencies=keyed)
async def completions(body: CompletionRequest, request: Request):
    return await generate(COMPLETIONS, body, request)


@router.post("/v1/chat/completions", dependencies=keyed)
async def chat_completions(body: ChatCompletionRequest, request: Request):
    return await generate(CHAT, body, request)


async def generate(route: Generation, body, request: Request):
    """Check, settle the sampling and fill settings, tokenize, submit, then stream or collect."""
    state = _state(request)
    config: ServerConfig = state.config
    _check_model(config, body.model)
    rq.check_common(body)
    logprobs, scores_prompt = route.logprobs(body)
    fill = rq.wants_fill(body, scores_prompt)
    eng = state.ready()
    strings = state.token_strings(logprobs)
    rows, terminal, reuse = _fill_for(body, eng)
    route.check_prompt(body, eng.engine.max_model_len)
    rq.check_prompt_bytes(route.prompt_bytes(body), eng.engine.tokenizer, eng.engine.max_model_len, route.prompt_param)
    params = rq.with_logprobs(route.sampling(body, config), logprobs, prompt=scores_prompt)
    params = rq.with_speculation(body, params, eng.engine.speculative)
    params = rq.with_loops(body, params)
    grammar = route.constraint(body, eng.engine.tokenizer)
    # NOTE: every cheap check is done; the template, tokenizer and grammar may take seconds, in threads.
    if grammar is not None:
        await compile_grammar(eng.engine, grammar)
        state.metrics.structured_requests.labels(kind=metric_kind(grammar)).inc()
        params = dataclasses.replace(params, grammar=grammar)
    prompt = await asyncio.to_thread(route.prompt, body, eng.engine.tokenizer)
    params = route.fit(body, params, len(prompt), eng.engine.max_model_len)
    shape = route.shape(body, prompt, eng.engine.tokenizer, strings)
    handles = _submit(state, request, body, prompt, params, fill, rows, terminal, reuse)
    rid, model = new_id(route.id_prefix), config.served_model_name
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return _sse_response(request, handles, route.stream(eng, handles, rid, model, usage, shape))
    outs = await collect(eng, handles, request)
    note_usage(request, len(prompt), sum(h.num_output_tokens for h in handles))
    _raise_if_failed(outs)
    return route.respond(rid, model, handles, outs, shape)


def _check_model(config: ServerConfig, name: str | None) -> None:
    if name is not None and name != config.served_model_name:
        raise HTTPError(404, f"model {name!r} does not exist; this server serves {config.served_model_name!r}", "model")


def _fill_for(body, eng: AsyncEngine):
    """The request's (exact-row selectors, terminal-state correction, prefix-cache reuse of
    filled blocks) over the server's."""
    tok = eng.engine.tokenizer
    rows = rq.request_rows(body, eng.engine.fill.rows, tok is not None and hasattr(tok, "token_type"))
    return rows, rq.request_terminal_state(body, eng.engine), rq.request_reuse(body)


def _submit(state, request: Request, body, prompt_ids, params, fill: bool, rows, terminal, reuse):
    """One engine sequence per choice (n); if one cannot be queued, those already are aborted."""
    eng = state.ready()
    deadline = deadline_for(body.timeout, state.config.request_timeout_s)
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
        raise HTTPError(503, str(e), headers={"Retry-After": str(state.config.retry_after_s)}) from None
    return handles


def _raise_if_failed(outs) -> None:
    for out in outs:
        if out.error:
            raise HTTPError(engine_failure_status(out.finish_reason), out.error)


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
