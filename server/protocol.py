"""OpenAI-compatible request and response bodies (pydantic). Only what we serve.

Unknown request fields are ignored, as OpenAI clients send many optional ones; fields we
cannot honour (n > 1, logprobs, ...) are refused by name in `server/requests.py`.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ridgefill_runtime.async_engine import FillRows, RequestHandle


class RidgefillOptions(BaseModel):
    """Per-request fill control: `{"mode": "off"}` asks for exact prefill; "plain" or no mode
    takes the server's default. `selectors` (names from ridgefill_runtime.config.SELECTORS)
    replaces the server's exact-row selectors for this request; the other fill.rows settings
    stay as configured. `speculative` ("off", or "ngram": the server's method) and
    `num_tokens` (at most the server's speculative.num_tokens) set this request's speculative
    decoding; only greedy requests speculate. `recipe` (fill/recipes.py) sets this request's
    exact-row selectors (unless `selectors` is given) and whether the terminal-state correction
    is added; the split, tail, maps and value rescale stay the server's. On a looped model,
    `loops`, `cache`, `window`, `block`, `draft_loops` and `allow_short_window` override the
    operator's [looped] table (ridgefill_runtime/config.LoopConfig) within what it stores. Other
    values are refused in `server/requests.py` and the engine (a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid")
    mode: str | None = None
    selectors: list[str] | None = None
    speculative: str | None = None
    num_tokens: int | None = None
    recipe: str | None = None
    loops: int | None = None
    cache: str | None = None
    window: int | None = None
    block: int | None = None
    draft_loops: int | None = None
    allow_short_window: bool | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    # NOTE: Python's JSON parser accepts Infinity and NaN; no sampling setting means anything
    # with them, so every float field refuses them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # extension
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False  # extension
    logprobs: int | bool | None = None
    timeout: float | None = None  # extension: seconds until the request ends ("timeout"); capped by the server
    ridgefill: RidgefillOptions | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False


ChatRole = Literal["system", "user", "assistant", "developer", "tool"]


class ContentPart(BaseModel):
    """One OpenAI content part; only "text" parts are served (checked in `server/requests.py`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: ChatRole
    content: str | list[ContentPart] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


# -- responses -----------------------------------------------------------------------------


class FillUsage(BaseModel):
    filled_rows: int
    exact_prefix_rows: int
    tail_rows: int
    split: int


class SpeculationUsage(BaseModel):
    """Speculative decoding of one request: its verification steps and the tokens each emitted."""

    verifications: int
    tokens_per_verification: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # NOTE: present exactly when the request's prefix was filled
    ridgefill: FillUsage | None = Field(default=None, exclude_if=lambda v: v is None)
    # NOTE: present exactly when the request verified drafts (n-gram or a looped model's own)
    speculation: SpeculationUsage | None = Field(default=None, exclude_if=lambda v: v is None)


def make_usage(prompt_tokens: int, completion_tokens: int, fill: FillRows | None = None,
               verifications: int = 0, verified_tokens: int = 0) -> Usage:
    fill_usage = None if fill is None else FillUsage(
        filled_rows=fill.filled, exact_prefix_rows=fill.exact_prefix, tail_rows=fill.tail, split=fill.split)
    spec = None if not verifications else SpeculationUsage(
        verifications=verifications, tokens_per_verification=verified_tokens / verifications)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, ridgefill=fill_usage, speculation=spec)


def usage_of(handle: RequestHandle) -> Usage:
    """The usage of a finished request, streamed or not."""
    seq = handle.seq
    return make_usage(handle.num_prompt_tokens, handle.num_output_tokens, handle.fill_rows,
                      seq.verifications if seq is not None else 0, seq.verified_tokens if seq is not None else 0)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "ridgefill"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
