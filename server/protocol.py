"""OpenAI-compatible request and response bodies (pydantic). Only what we serve.

Unknown request fields are ignored, as OpenAI clients send many optional ones; values we
cannot honour (n out of 1..16, best_of, logprobs past 20, ...) are refused by name in
`server/requests.py`. The response models are what both the plain and the streamed answers
are built from (server/streaming.py), so the two cannot drift apart.

Request fields are strict (issue 31, finding 4): a number field takes a JSON number, a flag
JSON true/false, a token id a JSON integer; "yes", "5" or [true, false] are refused naming the
field, not read as true, 5 or token ids 1 and 0.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt

from ridgefill_runtime.async_engine import FillRows, RequestHandle


class RidgefillOptions(BaseModel):
    """Per-request fill control: `{"mode": "off"}` asks for exact prefill; "plain" or no mode
    takes the server's default. `selectors` (names from ridgefill_runtime.config.SELECTORS)
    replaces the server's exact-row selectors for this request; the other fill.rows settings
    stay as configured. `speculative` ("off", or "ngram": the server's method) and
    `num_tokens` (at most the server's speculative.num_tokens) set this request's speculative
    decoding; only greedy requests speculate. `recipe` (fill/recipes.py) sets this request's
    exact-row selectors (unless `selectors` is given) and whether the terminal-state correction
    is added; the split, tail, maps and value rescale stay the server's. `reuse_filled`
    ("reselect", "as-is", "never") sets what this request takes from the prefix cache's filled
    blocks (fill.reuse_filled). On a looped model,
    `loops`, `cache`, `window`, `block`, `draft_loops` and `allow_short_window` override the
    operator's [looped] table (ridgefill_runtime/config.LoopConfig) within what it stores. Other
    values are refused in `server/requests.py` and the engine (a 400 naming the field)."""

    model_config = ConfigDict(extra="forbid")
    mode: str | None = None
    selectors: list[str] | None = None
    speculative: str | None = None
    num_tokens: StrictInt | None = None
    recipe: str | None = None
    reuse_filled: str | None = None
    loops: StrictInt | None = None
    cache: str | None = None
    window: StrictInt | None = None
    block: StrictInt | None = None
    draft_loops: StrictInt | None = None
    allow_short_window: StrictBool | None = None


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's named schema. `strict` is accepted either way: the
    output always keeps to the schema (grammar-constrained), as OpenAI's strict mode promises."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: "text" (no constraint), "json_object" (any JSON object) or
    "json_schema" (the given schema)."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one of a JSON Schema (`json`; true: any JSON value),
    any JSON object (`json_object`), a regex the whole output matches, a choice among strings,
    or a Lark grammar (llguidance's dialect)."""

    model_config = ConfigDict(extra="forbid")
    json_: dict | StrictBool | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingFields(BaseModel):
    # NOTE: Python's JSON parser accepts Infinity and NaN; no sampling setting means anything
    # with them, so every float field refuses them.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None  # extension
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt = 1  # 1..16 choices; with a seed, choice i samples with seed + i
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False  # extension
    # completions: an int 0..20 (alternatives per token); chat: true/false, with top_logprobs
    logprobs: StrictInt | StrictBool | None = None
    timeout: StrictFloat | None = None  # extension: seconds until the request ends ("timeout"); capped by the server
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's extension
    ridgefill: RidgefillOptions | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    echo: StrictBool = False  # the prompt before the completion; with logprobs, the prompt's too
    best_of: StrictInt | None = None  # refused past 1 (server/requests.py)


ChatRole = Literal["system", "user", "assistant", "developer", "tool"]


class ContentPart(BaseModel):
    """One OpenAI content part; only "text" parts are served (checked in `server/requests.py`)."""

    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    """A call's function: `arguments` is JSON text, as OpenAI writes it."""

    name: str
    arguments: str


class ToolCall(BaseModel):
    """One tool call, in an assistant message sent back or in an answer."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: ChatRole
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON Schema for the arguments object; none: no arguments
    strict: StrictBool | None = None  # accepted either way: a required call always keeps to the schema


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    """tool_choice naming one function: the answer is a call to it."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: StrictInt | None = None
    top_logprobs: StrictInt | None = None  # 0..20 alternatives per token, with logprobs: true
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # default: auto with tools
    parallel_tool_calls: StrictBool = True  # false: at most one call per answer


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[StrictInt]


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # with messages: rendered by the chat template, as in a chat request
    add_special_tokens: StrictBool = True


# -- responses -----------------------------------------------------------------------------


class FillUsage(BaseModel):
    filled_rows: int
    exact_prefix_rows: int
    tail_rows: int
    split: int
    cached_filled_rows: int = 0  # of the filled rows, those taken from the prefix cache
    remade_exact_rows: int = 0  # cached filled rows this request's selectors chose and made exact


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens taken from the prefix cache (their K/V were not computed)


class SpeculationUsage(BaseModel):
    """Speculative decoding of one request: its verification steps and the tokens each emitted."""

    verifications: int
    tokens_per_verification: float


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = PromptTokensDetails(cached_tokens=0)
    # NOTE: present exactly when the request's prefix was filled
    ridgefill: FillUsage | None = Field(default=None, exclude_if=lambda v: v is None)
    # NOTE: present exactly when the request verified drafts (n-gram or a looped model's own)
    speculation: SpeculationUsage | None = Field(default=None, exclude_if=lambda v: v is None)


def make_usage(
    prompt_tokens: int,
    completion_tokens: int,
    fill: FillRows | None = None,
    verifications: int = 0,
    verified_tokens: int = 0,
    cached_tokens: int = 0,
) -> Usage:
    fill_usage = (
        None
        if fill is None
        else FillUsage(
            filled_rows=fill.filled,
            exact_prefix_rows=fill.exact_prefix,
            tail_rows=fill.tail,
            split=fill.split,
            cached_filled_rows=fill.cached_filled,
            remade_exact_rows=fill.remade,
        )
    )
    spec = (
        None
        if not verifications
        else SpeculationUsage(verifications=verifications, tokens_per_verification=verified_tokens / verifications)
    )
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
        ridgefill=fill_usage,
        speculation=spec,
    )


def usage_of(handles: Sequence[RequestHandle]) -> Usage:
    """The usage of a finished request, streamed or not: its choices share one prompt, counted
    once (and its fill, the same for each); their completion tokens add up."""
    seqs = [h.seq for h in handles if h.seq is not None]
    # NOTE: the prompt tokens none of the choices computed (the first computes what the others reuse)
    cached = min((s.prefix.num_cached for s in seqs), default=0)
    return make_usage(
        handles[0].num_prompt_tokens,
        sum(h.num_output_tokens for h in handles),
        handles[0].fill_rows,
        sum(s.spec.verifications for s in seqs),
        sum(s.spec.verified_tokens for s in seqs),
        cached,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """OpenAI's completions logprobs: one entry per token of the choice's text (the echoed
    prompt's first, whose first token has no logprob: null), each token's alternatives (the
    asked top ones and the token itself) and where its text starts in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]

    def __add__(self, more: CompletionLogprobs) -> CompletionLogprobs:
        return CompletionLogprobs(
            tokens=self.tokens + more.tokens,
            token_logprobs=self.token_logprobs + more.token_logprobs,
            top_logprobs=self.top_logprobs + more.top_logprobs,
            text_offset=self.text_offset + more.text_offset,
        )


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    """One streamed event of /v1/completions: a choice's new text (or, last, only usage)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = Field(default=None, exclude_if=lambda v: v is None)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes (a token may hold part of a character)


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None  # None: the answer is only tool calls
    # NOTE: present exactly when the answer calls tools
    tool_calls: list[ToolCall] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = Field(default=None, exclude_if=lambda v: v is None)
    arguments: str | None = Field(default=None, exclude_if=lambda v: v is None)


class ToolCallDelta(BaseModel):
    """A streamed call: the first delta of call `index` names its id, type and function."""

    index: int
    id: str | None = Field(default=None, exclude_if=lambda v: v is None)
    type: Literal["function"] | None = Field(default=None, exclude_if=lambda v: v is None)
    function: FunctionCallDelta


class DeltaMessage(BaseModel):
    # NOTE: a chunk's delta names only what it carries: {} in the last one
    role: Literal["assistant"] | None = Field(default=None, exclude_if=lambda v: v is None)
    content: str | None = Field(default=None, exclude_if=lambda v: v is None)
    tool_calls: list[ToolCallDelta] | None = Field(default=None, exclude_if=lambda v: v is None)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, exclude_if=lambda v: v is None)


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


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """GET /tokenizer_info, vLLM's fields: the tokenizer's class and its tokenizer_config.json
    entries (special-token spellings, the chat template, the context length)."""

    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    chat_template: str | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    unk_token: str | None = None
    pad_token: str | None = None


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
