"""Drive one request's choices: SSE chunks for streaming, one body for non-streaming.

A request with n choices runs n engine sequences (one RequestHandle each). Both paths abort
every unfinished choice when the client goes away, so their KV blocks are freed within one
engine step. Chunks and bodies are built from the response models in `protocol.py`, and a
choice's pieces from the same per-choice builders, so a stream adds up to the plain answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field

from fastapi import Request
from pydantic import BaseModel

from ridgefill_runtime.async_engine import AsyncEngine, RequestHandle, StreamEvent
from ridgefill_runtime.sequence import TokenLogprobs

from .errors import engine_failure_status, error_body
from .logprobs import CompletionLogprobsBuilder, TokenStrings, chat_content
from .protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    DeltaMessage,
    FunctionCall,
    FunctionCallDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
    now,
    usage_of,
)
from .tool_parser import HermesParser
from .tools import ToolPlan, finish_reason


@dataclass
class Outcome:
    """One choice, gathered: its text, its generated tokens' logprobs, how it ended."""

    text: str = ""
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class Echo:
    """The prompt a completion choice repeats before its text (echo); None text: no echo."""

    text: str | None = None
    prompt_ids: tuple[int, ...] = ()


# NOTE: JSON leaves these raw inside strings, but clients that split lines like
# str.splitlines() (httpx's iter_lines) break an event at them; as \u escapes the JSON decodes
# to the same text and the event stays one line. They occur only inside JSON strings.
_LINE_BREAKERS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def sse(payload: BaseModel | dict | str) -> str:
    if isinstance(payload, BaseModel):
        data = payload.model_dump_json()
    elif isinstance(payload, dict):
        data = json.dumps(payload, ensure_ascii=False)
    else:
        data = payload
    return f"data: {data.translate(_LINE_BREAKERS)}\n\n"


async def choice_events(
    engine: AsyncEngine, handles: list[RequestHandle]
) -> AsyncGenerator[tuple[int, StreamEvent], None]:
    """Every choice's events, tagged with its index, as they arrive; if the consumer stops
    early (a disconnect, an error), abort every choice not yet finished."""
    open_choices = set(range(len(handles)))
    getters: dict[asyncio.Future, int] = {}
    try:
        while open_choices:
            if len(handles) == 1:  # NOTE: the common case needs no futures
                arrived = [(0, await handles[0].events.get())]
            else:
                for i in open_choices - set(getters.values()):
                    getters[asyncio.ensure_future(handles[i].events.get())] = i
                done, _ = await asyncio.wait(getters, return_when=asyncio.FIRST_COMPLETED)
                arrived = sorted(((getters.pop(f), f.result()) for f in done), key=lambda pair: pair[0])
            for i, event in arrived:
                if event.finished:
                    open_choices.discard(i)
                yield i, event
    finally:
        for getter in getters:
            getter.cancel()
        for i in open_choices:
            engine.abort(handles[i])


async def collect(engine: AsyncEngine, handles: list[RequestHandle], request: Request) -> list[Outcome]:
    """Non-streaming: gather every choice; a disconnect meanwhile aborts them all."""
    watcher = asyncio.create_task(_abort_on_disconnect(engine, handles, request))
    outs = [Outcome() for _ in handles]
    parts: list[list[str]] = [[] for _ in handles]
    try:
        async with aclosing(choice_events(engine, handles)) as events:
            async for i, event in events:
                parts[i].append(event.delta_text)
                outs[i].logprobs.extend(event.new_logprobs)
                if event.finished:
                    outs[i].finish_reason, outs[i].error = event.finish_reason, event.error
    finally:
        watcher.cancel()
    for out, texts in zip(outs, parts):
        out.text = "".join(texts)
    return outs


async def _abort_on_disconnect(engine: AsyncEngine, handles: list[RequestHandle], request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            for handle in handles:
                engine.abort(handle)
            return


# -- completions ---------------------------------------------------------------------------------


class CompletionChoiceStream:
    """One completion choice's pieces: first the echoed prompt (once its prefill has scored
    it), then each event's new text with the logprobs of the tokens it carries. A token whose
    text is held back (a partial character, a possible stop string) has its logprobs held too,
    until the text that holds it goes out."""

    def __init__(
        self, index: int, handle: RequestHandle, strings: TokenStrings | None, echo: Echo, scorer: RequestHandle
    ):
        """`strings`: None when the request asked no logprobs; with an echo, the prompt's
        logprobs come too, from `scorer`, the choice whose sequence scored the prompt
        (SamplingParams.prompt_logprobs; one per request)."""
        self.index, self.handle, self.echo, self.scorer = index, handle, echo, scorer
        self.logprobs = strings is not None
        self._echoed = echo.text is None
        self._held: list[TokenLogprobs] = []
        generated_from = len(echo.text) if echo.text is not None else 0
        self._builder = CompletionLogprobsBuilder(strings, generated_from) if strings is not None else None

    def pieces(self, event: StreamEvent) -> list[CompletionChoice]:
        out = []
        if not self._echoed:
            self._echoed = True
            out.append(CompletionChoice(index=self.index, text=self.echo.text, logprobs=self._prompt_logprobs()))
        self._held.extend(event.new_logprobs)
        if event.delta_text or event.finished:
            logprobs = self._builder.generated(self._held) if self._builder else None
            self._held = []
            out.append(
                CompletionChoice(
                    index=self.index,
                    text=event.delta_text,
                    logprobs=logprobs,
                    finish_reason=event.finish_reason if event.finished else None,
                )
            )
        return out

    def _prompt_logprobs(self) -> CompletionLogprobs | None:
        if self._builder is None:
            return None
        # NOTE: the scorer's prefill is over (or abandoned): the engine writes no more scores. It is the
        # oldest of the request's sequences, so it is never preempted for them and finishes its
        # prefill no later than they do theirs, which start from its blocks.
        seq = self.scorer.seq
        scores = seq.logprobs.prompt if seq is not None else []
        top = seq.logprobs.prompt_top if seq is not None else []
        return self._builder.prompt(list(self.echo.prompt_ids), scores, top)


def completion_choice(stream: CompletionChoiceStream, out: Outcome) -> CompletionChoice:
    """The plain answer's choice: the stream's pieces of the whole outcome, joined."""
    event = StreamEvent(out.text, [], True, out.finish_reason, new_logprobs=out.logprobs)
    pieces = stream.pieces(event)
    logprobs = None
    if stream.logprobs:
        logprobs = sum((p.logprobs for p in pieces[1:]), pieces[0].logprobs)  # type: ignore[type-var]  # stream.logprobs: every piece has them
    return CompletionChoice(
        index=stream.index, text="".join(p.text for p in pieces), logprobs=logprobs, finish_reason=out.finish_reason
    )


async def stream_completion(
    engine: AsyncEngine,
    handles: list[RequestHandle],
    rid: str,
    model: str,
    include_usage: bool,
    choices: list[CompletionChoiceStream],
) -> AsyncIterator[str]:
    created = now()

    def chunk(choice: CompletionChoice | None, usage: Usage | None = None) -> str:
        return sse(
            CompletionChunk(
                id=rid, created=created, model=model, choices=[] if choice is None else [choice], usage=usage
            )
        )

    async for line in _choice_lines(engine, handles, choices, chunk, include_usage):
        yield line


# -- chat ------------------------------------------------------------------------------------------


class ChatChoiceStream:
    """One chat choice's pieces: its new text (and the logprobs of the tokens it carries, held
    with the text as in CompletionChoiceStream), then an empty delta with the finish reason.
    With tools (`parser`), the text goes through the tool-call parser: content as it is let
    out, each call as one delta when its block closes, and "tool_calls" as the finish reason
    of a choice that called any."""

    def __init__(self, index: int, strings: TokenStrings | None, parser: HermesParser | None = None):
        self.index, self.strings, self.parser = index, strings, parser
        self._held: list[TokenLogprobs] = []

    def opening(self) -> ChatChunkChoice:
        return ChatChunkChoice(index=self.index, delta=DeltaMessage(role="assistant", content=""))

    def pieces(self, event: StreamEvent) -> list[ChatChunkChoice]:
        self._held.extend(event.new_logprobs)
        out = [ChatChunkChoice(index=self.index, delta=delta, logprobs=self._take()) for delta in self._deltas(event)]
        if event.finished:
            reason = finish_reason(event.finish_reason, self.parser.calls if self.parser else 0)
            out.append(
                ChatChunkChoice(index=self.index, delta=DeltaMessage(), logprobs=self._take(), finish_reason=reason)
            )
        return out

    def _deltas(self, event: StreamEvent) -> list[DeltaMessage]:
        if self.parser is None:
            return [DeltaMessage(content=event.delta_text)] if event.delta_text else []
        parsed = self.parser.feed(event.delta_text) + (self.parser.finish() if event.finished else [])
        first_call = self.parser.calls - sum(p.call is not None for p in parsed)
        deltas = []
        for piece in parsed:
            if piece.call is None:
                deltas.append(DeltaMessage(content=piece.content))
                continue
            call = piece.call
            function = FunctionCallDelta(name=call.name, arguments=call.arguments)
            deltas.append(
                DeltaMessage(
                    tool_calls=[ToolCallDelta(index=first_call, id=call.id, type="function", function=function)]
                )
            )
            first_call += 1
        return deltas

    def _take(self) -> ChatLogprobs | None:
        """The held tokens' logprobs (None: none asked, or none held for a bare finish)."""
        if self.strings is None or not self._held:
            return None
        held, self._held = self._held, []
        return ChatLogprobs(content=chat_content(self.strings, held))


def chat_choice(
    index: int, strings: TokenStrings | None, out: Outcome, parser: HermesParser | None = None
) -> ChatChoice:
    """The plain answer's choice; with tools, the whole text through the stream's parser."""
    logprobs = None if strings is None else ChatLogprobs(content=chat_content(strings, out.logprobs))
    if parser is None:
        message = AssistantMessage(content=out.text)
    else:
        pieces = parser.feed(out.text) + parser.finish()
        calls = [
            ToolCall(id=p.call.id, function=FunctionCall(name=p.call.name, arguments=p.call.arguments))
            for p in pieces
            if p.call is not None
        ]
        content = "".join(p.content for p in pieces)
        message = AssistantMessage(content=content if content or not calls else None, tool_calls=calls or None)
    reason = finish_reason(out.finish_reason, parser.calls if parser else 0)
    return ChatChoice(index=index, message=message, logprobs=logprobs, finish_reason=reason)


@dataclass(frozen=True)
class ChatShape:
    """A chat answer's shape: the token texts for logprobs, and the request's tools (or None)."""

    strings: TokenStrings | None
    tools: ToolPlan | None = None

    def parser(self) -> HermesParser | None:
        return self.tools.parser() if self.tools else None


async def stream_chat(
    engine: AsyncEngine,
    handles: list[RequestHandle],
    rid: str,
    model: str,
    include_usage: bool,
    shape: ChatShape,
) -> AsyncIterator[str]:
    created = now()
    choices = [ChatChoiceStream(i, shape.strings, shape.parser()) for i in range(len(handles))]

    def chunk(choice: ChatChunkChoice | None, usage: Usage | None = None) -> str:
        return sse(
            ChatCompletionChunk(
                id=rid, created=created, model=model, choices=[] if choice is None else [choice], usage=usage
            )
        )

    for choice in choices:
        yield chunk(choice.opening())
    async for line in _choice_lines(engine, handles, choices, chunk, include_usage):
        yield line


async def _choice_lines(
    engine: AsyncEngine, handles: list[RequestHandle], choices, chunk, include_usage: bool
) -> AsyncIterator[str]:
    """The SSE lines of n choices' pieces as their events arrive, the usage chunk, [DONE]."""
    async with aclosing(choice_events(engine, handles)) as events:
        async for i, event in events:
            if event.error:  # NOTE: the stream ends here; closing `events` aborts the other choices
                yield sse(error_body(engine_failure_status(event.finish_reason), event.error))
                break
            for piece in choices[i].pieces(event):
                yield chunk(piece)
        else:
            if include_usage:
                yield chunk(None, usage_of(handles))
    yield sse("[DONE]")
