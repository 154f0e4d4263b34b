"""Drive one request: SSE chunks for streaming, one body for non-streaming.

Both paths abort the engine request when the client goes away, so its KV blocks are freed
within one engine step.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request

from ridgefill_runtime.async_engine import AsyncEngine, RequestHandle, StreamEvent

from .errors import error_body
from .protocol import now, usage_of


@dataclass
class Outcome:
    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


async def events_until_done(engine: AsyncEngine, handle: RequestHandle) -> AsyncIterator[StreamEvent]:
    """Yield the request's events; if the consumer stops early (disconnect), abort it."""
    done = False
    try:
        while not done:
            event = await handle.events.get()
            done = event.finished
            yield event
    finally:
        if not done:
            engine.abort(handle)


async def collect(engine: AsyncEngine, handle: RequestHandle, request: Request) -> Outcome:
    """Non-streaming: gather all text; a disconnect meanwhile aborts the request."""
    watcher = asyncio.create_task(_abort_on_disconnect(engine, handle, request))
    parts: list[str] = []
    event = None
    try:
        async for event in events_until_done(engine, handle):
            parts.append(event.delta_text)
    finally:
        watcher.cancel()
    return Outcome("".join(parts), event.finish_reason, handle.num_prompt_tokens,
                   handle.num_output_tokens, event.error)


async def _abort_on_disconnect(engine: AsyncEngine, handle: RequestHandle, request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            engine.abort(handle)
            return


async def stream_completion(engine: AsyncEngine, handle: RequestHandle, rid: str, model: str,
                            include_usage: bool) -> AsyncIterator[str]:
    created = now()

    def chunk(text: str, finish_reason: str | None) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}

    async for event in events_until_done(engine, handle):
        if event.error:
            yield sse(error_body(500, event.error))
            break
        if event.finished:
            yield sse(chunk(event.delta_text, event.finish_reason))
        elif event.delta_text:
            yield sse(chunk(event.delta_text, None))
    else:
        if include_usage:
            yield sse(_usage_chunk(rid, "text_completion", created, model, handle))
    yield sse("[DONE]")


async def stream_chat(engine: AsyncEngine, handle: RequestHandle, rid: str, model: str,
                      include_usage: bool) -> AsyncIterator[str]:
    created = now()

    def chunk(delta: dict, finish_reason: str | None) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}

    yield sse(chunk({"role": "assistant", "content": ""}, None))
    async for event in events_until_done(engine, handle):
        if event.error:
            yield sse(error_body(500, event.error))
            break
        if event.delta_text:
            yield sse(chunk({"content": event.delta_text}, None))
        if event.finished:
            yield sse(chunk({}, event.finish_reason))
    else:
        if include_usage:
            yield sse(_usage_chunk(rid, "chat.completion.chunk", created, model, handle))
    yield sse("[DONE]")


def _usage_chunk(rid: str, obj: str, created: int, model: str, handle: RequestHandle) -> dict:
    usage = usage_of(handle).model_dump(exclude_none=True)
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage}
