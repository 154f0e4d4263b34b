"""Turn a validated request body into (prompt ids, SamplingParams), refusing what we cannot serve."""

from __future__ import annotations

from ridgefill_runtime.config import SELECTORS, RowsConfig
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.fill.settings import needs_counts
from ridgefill_runtime.sequence import SamplingParams

from .errors import HTTPError
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_common(req: _SamplingFields) -> None:
    if req.n != 1:
        raise HTTPError(400, f"n={req.n} is not supported: this server returns exactly one choice (n=1)", "n")
    if req.logprobs not in (None, False, 0):
        raise HTTPError(400, "logprobs are not supported", "logprobs")


def wants_fill(req: _SamplingFields) -> bool:
    """False when the request asks for exact prefill; True leaves it to the server's fill mode."""
    mode = req.ridgefill.mode if req.ridgefill is not None else None
    if mode not in (None, "off", "plain"):
        raise HTTPError(400, f"ridgefill.mode must be \"off\" (exact prefill) or \"plain\" "
                             f"(the server's fill), got {mode!r}", "ridgefill.mode")
    return mode != "off"


def request_rows(req: _SamplingFields, configured: RowsConfig, has_token_table: bool) -> RowsConfig | None:
    """The request's exact-row selectors over the server's `configured` rows, or None (use the
    configured ones). Only the selectors change; budgets, windows and counts stay configured."""
    selectors = req.ridgefill.selectors if req.ridgefill is not None else None
    if selectors is None:
        return None
    for name in selectors:
        if name not in SELECTORS:
            raise HTTPError(400, f"ridgefill.selectors: unknown selector {name!r} "
                                 f"(known: {', '.join(SELECTORS)})", "ridgefill.selectors")
    if not has_token_table and set(selectors) - {"special"}:
        raise HTTPError(400, "ridgefill.selectors: this model has no tokenizer, so only 'special' "
                             "(position 0) can be chosen", "ridgefill.selectors")
    if configured.unigram is None and needs_counts(selectors):
        raise HTTPError(400, f"ridgefill.selectors: {' and '.join(repr(s) for s in needs_counts(selectors))} "
                             f"needs unigram counts, and this server has none configured (fill.rows.unigram)",
                        "ridgefill.selectors")
    return configured.replace(selectors=tuple(selectors))


def sampling_params(req: _SamplingFields, max_tokens: int | None, default_max: int) -> SamplingParams:
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    try:
        return SamplingParams(
            max_tokens=default_max if max_tokens is None else max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_k=req.top_k or 0,
            top_p=1.0 if req.top_p is None else req.top_p,
            seed=req.seed,
            stop=stop,
            ignore_eos=req.ignore_eos,
        )
    except InputError as e:
        raise HTTPError(400, str(e), _param_of(str(e))) from None


def completion_prompt(req: CompletionRequest, tokenizer) -> list[int]:
    p = req.prompt
    if isinstance(p, str):
        return _encode(tokenizer, p)
    if p and all(isinstance(t, int) for t in p):
        return list(p)
    if len(p) == 1:  # a batch of one: ["text"] or [[ids]]
        one = p[0]
        return _encode(tokenizer, one) if isinstance(one, str) else list(one)
    raise HTTPError(400, "prompt must be one string or one list of token ids (batches are not supported)", "prompt")


def chat_prompt(req: ChatCompletionRequest, tokenizer) -> list[int]:
    messages = [_message_dict(m) for m in req.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except InputError as e:
        raise HTTPError(400, str(e), "messages") from None
    # NOTE: the template already writes any BOS it wants; do not add another.
    return _encode(tokenizer, text, add_special_tokens=False)


def _message_dict(m: ChatMessage) -> dict:
    content = m.content
    if isinstance(content, list):  # OpenAI content parts: keep only the text ones
        if any(part.get("type") != "text" for part in content):
            raise HTTPError(400, "only text content parts are supported", "messages")
        content = "".join(part.get("text", "") for part in content)
    return {"role": m.role, "content": content or ""}


def _encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if tokenizer is None:
        raise HTTPError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _param_of(message: str) -> str | None:
    for name in ("max_tokens", "temperature", "top_k", "top_p", "stop"):
        if message.startswith(name):
            return name
    return None
