"""Turn a validated request body into (prompt ids, SamplingParams), refusing what we cannot serve."""

from __future__ import annotations

import dataclasses
import json

from ridgefill_runtime.config import SELECTORS, LoopOverrides, RowsConfig, SpeculativeConfig
from ridgefill_runtime.errors import InputError
from ridgefill_runtime.config import REUSE_POLICIES
from ridgefill_runtime.fill.recipes import RECIPES
from ridgefill_runtime.fill.settings import needs_counts
from ridgefill_runtime.loader.piece_bound import fewest_tokens
from ridgefill_runtime.sequence import MAX_LOGPROBS, SamplingParams

from .errors import HTTPError
from .protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, ToolCall, _SamplingFields

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Every generated token is checked against every stop string: long ones, like many ones
# (server.max_stop_strings), slow the whole batch, everyone's latency included.
MAX_STOP_CHARS = 256
MAX_MESSAGES = 2048  # OpenAI's limit; each message is rendered by the chat template
# Each choice is one engine sequence (its own slot, blocks and decode row); 16 covers pass@k-style
# evaluation without letting one request take a whole batch.
MAX_CHOICES = 16


def check_common(req: _SamplingFields) -> None:
    if not 1 <= req.n <= MAX_CHOICES:
        raise HTTPError(400, f"n must be in 1..{MAX_CHOICES}, got {req.n}", "n")


def check_best_of(req: CompletionRequest) -> None:
    if req.best_of not in (None, 1):
        # NOTE: suggest n=best_of only where that n is one we serve (not "ask n=-1").
        hint = (
            f"ask n={req.best_of} and choose among them"
            if 1 < req.best_of <= MAX_CHOICES
            else "leave best_of out (or 1) and ask n choices to choose among"
        )
        raise HTTPError(
            400, f"best_of={req.best_of} is not supported: this server does not rank choices; {hint}", "best_of"
        )


def completion_logprobs(req: CompletionRequest) -> int | None:
    """/v1/completions' logprobs: how many alternatives per token (0..20), or None (none asked)."""
    asked = req.logprobs
    if asked is None or asked is False:
        return None
    if asked is True:
        raise HTTPError(
            400,
            f"logprobs on /v1/completions is a number of alternatives per token (0..{MAX_LOGPROBS}), got true",
            "logprobs",
        )
    return _logprob_count(asked, "logprobs")


def chat_logprobs(req: ChatCompletionRequest) -> int | None:
    """/v1/chat/completions' logprobs (true/false) with top_logprobs: how many alternatives per
    token (0..20), or None (none asked)."""
    asked = req.logprobs
    if asked is not None and not isinstance(asked, bool) and asked != 0:
        raise HTTPError(
            400,
            f"logprobs on /v1/chat/completions must be true or false (top_logprobs "
            f"sets the alternatives per token), got {asked}",
            "logprobs",
        )
    if not asked:
        if req.top_logprobs is not None:
            raise HTTPError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return None
    return _logprob_count(req.top_logprobs or 0, "top_logprobs")


def _logprob_count(count: int, name: str) -> int:
    if not 0 <= count <= MAX_LOGPROBS:
        raise HTTPError(400, f"{name} must be in 0..{MAX_LOGPROBS}, got {count}", name)
    return count


def with_logprobs(params: SamplingParams, top: int | None, prompt: bool = False) -> SamplingParams:
    """params recording each generated token's logprob and `top` alternatives (None: none);
    `prompt`: the prompt's rows too, with as many alternatives (echo)."""
    if top is None:
        return params
    return dataclasses.replace(params, logprobs=top, prompt_logprobs=prompt, prompt_top_logprobs=top if prompt else 0)


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """One SamplingParams per choice: with a seed, choice i samples with seed + i (so choice 0
    is what the same request with n = 1 gives); without one, each draws its own. Only choice 0
    scores the prompt (echo with logprobs): the others echo its scores, and, scoring nothing,
    start from the prompt blocks it publishes instead of computing the prompt again (issue 32)."""
    if params.seed is None:
        choices = [params] * n
    else:
        try:
            choices = [dataclasses.replace(params, seed=params.seed + i) for i in range(n)]
        except InputError as e:
            raise HTTPError(400, f"{e} (choice i samples with seed + i, up to seed + {n - 1})", "seed") from None
    return choices[:1] + [dataclasses.replace(c, prompt_logprobs=False, prompt_top_logprobs=0) for c in choices[1:]]


def wants_fill(req: _SamplingFields, scores_prompt: bool = False) -> bool:
    """False when the request asks for exact prefill; True leaves it to the server's fill mode.
    `scores_prompt`: the request needs every prompt row's logits (echo with logprobs), which
    filled rows do not have, so it runs an exact prefill."""
    mode = req.ridgefill.mode if req.ridgefill is not None else None
    if mode not in (None, "off", "plain"):
        raise HTTPError(
            400,
            f'ridgefill.mode must be "off" (exact prefill) or "plain" (the server\'s fill), got {mode!r}',
            "ridgefill.mode",
        )
    if scores_prompt and mode == "plain":
        raise HTTPError(
            400,
            "echo with logprobs needs every prompt row's logits, and filled rows have none: "
            'send ridgefill.mode "off" or leave it out (such requests run exactly)',
            "ridgefill.mode",
        )
    return mode != "off" and not scores_prompt


def _recipe(req: _SamplingFields):
    """The request's ridgefill.recipe (fill/recipes.py) or None; unknown names are refused."""
    name = req.ridgefill.recipe if req.ridgefill is not None else None
    if name is not None and name not in RECIPES:
        raise HTTPError(
            400, f"ridgefill.recipe: unknown recipe {name!r} (known: {', '.join(RECIPES)})", "ridgefill.recipe"
        )
    return None if name is None else RECIPES[name]


def request_reuse(req: _SamplingFields) -> str | None:
    """The request's ridgefill.reuse_filled (None: the server's fill.reuse_filled)."""
    policy = req.ridgefill.reuse_filled if req.ridgefill is not None else None
    if policy is not None and policy not in REUSE_POLICIES:
        raise HTTPError(
            400,
            f"ridgefill.reuse_filled must be one of {', '.join(REUSE_POLICIES)}, got {policy!r}",
            "ridgefill.reuse_filled",
        )
    return policy


def request_terminal_state(req: _SamplingFields, engine) -> bool | None:
    """Whether the request's recipe adds the terminal-state correction (None: no recipe, the
    server's setting). Only a server whose maps hold ΔM can honour a recipe that asks for it."""
    recipe = _recipe(req)
    if recipe is None:
        return None
    wanted = bool(recipe[0].get("terminal_state", False))
    try:
        engine.check_terminal_request(wanted)
    except InputError as e:
        raise HTTPError(400, f"ridgefill.recipe {req.ridgefill.recipe!r}: {e}", "ridgefill.recipe") from None
    return wanted


def request_rows(req: _SamplingFields, configured: RowsConfig, has_token_table: bool) -> RowsConfig | None:
    """The request's exact-row selectors over the server's `configured` rows, or None (use the
    configured ones). Only the selectors change; budgets, windows and counts stay configured."""
    selectors = req.ridgefill.selectors if req.ridgefill is not None else None
    recipe = _recipe(req)
    if selectors is None and recipe is not None:
        selectors = recipe[1]["selectors"]  # NOTE: `selectors`, when given too, wins
    if selectors is None:
        return None
    for name in selectors:
        if name not in SELECTORS:
            raise HTTPError(
                400,
                f"ridgefill.selectors: unknown selector {name!r} (known: {', '.join(SELECTORS)})",
                "ridgefill.selectors",
            )
    if not has_token_table and set(selectors) - {"special"}:
        raise HTTPError(
            400,
            "ridgefill.selectors: this model has no tokenizer, so only 'special' (position 0) can be chosen",
            "ridgefill.selectors",
        )
    if configured.unigram is None and needs_counts(selectors):
        raise HTTPError(
            400,
            f"ridgefill.selectors: {' and '.join(repr(s) for s in needs_counts(selectors))} "
            f"needs unigram counts, and this server has none configured (fill.rows.unigram)",
            "ridgefill.selectors",
        )
    return configured.replace(selectors=tuple(selectors))


def with_speculation(req: _SamplingFields, params: SamplingParams, configured: SpeculativeConfig) -> SamplingParams:
    """params with the request's speculative decoding (ridgefill.speculative / num_tokens):
    it may turn the server's method off or verify fewer drafts, never ask for more."""
    opts = req.ridgefill
    method = opts.speculative if opts is not None else None
    num = opts.num_tokens if opts is not None else None
    if method not in (None, "off", "ngram"):
        raise HTTPError(400, f'ridgefill.speculative must be "off" or "ngram", got {method!r}', "ridgefill.speculative")
    if method == "off":
        return dataclasses.replace(params, speculative=0)
    if (method is not None or num is not None) and configured.method != "ngram":
        raise HTTPError(
            400,
            f"ridgefill.speculative: this server's speculative decoding is {configured.method!r} (speculative.method)",
            "ridgefill.speculative",
        )
    if num is None:
        return params
    if not 0 <= num <= configured.num_tokens:
        raise HTTPError(
            400,
            f"ridgefill.num_tokens must be in 0..{configured.num_tokens} (speculative.num_tokens), got {num}",
            "ridgefill.num_tokens",
        )
    return dataclasses.replace(params, speculative=num)


LOOP_FIELDS = ("loops", "cache", "window", "block", "draft_loops", "allow_short_window")


def with_loops(req: _SamplingFields, params: SamplingParams) -> SamplingParams:
    """params with the request's loop settings (a looped model's; the engine checks them)."""
    opts = req.ridgefill
    given = {} if opts is None else {k: getattr(opts, k) for k in LOOP_FIELDS if getattr(opts, k) is not None}
    return dataclasses.replace(params, looped=LoopOverrides(**given)) if given else params


def sampling_params(
    req: _SamplingFields,
    max_tokens: int | None,
    default_max: int,
    max_stop_strings: int,
    max_tokens_field: str = "max_tokens",
) -> SamplingParams:
    """`max_tokens_field` names the field `max_tokens` came from, for the error."""
    if max_tokens is not None and max_tokens < 0:
        raise HTTPError(400, f"{max_tokens_field} must be >= 0, got {max_tokens}", max_tokens_field)
    stop = _stop_strings(req.stop, max_stop_strings)
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


def chat_sampling_params(req: ChatCompletionRequest, default_max: int, max_stop_strings: int) -> SamplingParams:
    """The chat request's settings. An unset limit is `default_max` (server.default_chat_max_tokens,
    so a forgotten limit cannot hold a slot for a whole context) until `fit_default_limit`
    knows the prompt's length."""
    if req.max_completion_tokens is not None:
        return sampling_params(req, req.max_completion_tokens, 0, max_stop_strings, "max_completion_tokens")
    return sampling_params(req, req.max_tokens, default_max, max_stop_strings)


def fit_default_limit(
    req: ChatCompletionRequest, params: SamplingParams, prompt_len: int, max_model_len: int
) -> SamplingParams:
    """Clip an unset chat limit to the context the prompt leaves; a limit the client asked
    for stays, so a too-long request is refused by name instead of silently cut."""
    if req.max_completion_tokens is not None or req.max_tokens is not None:
        return params
    room = max(max_model_len - prompt_len, 0)
    return params if params.max_tokens <= room else dataclasses.replace(params, max_tokens=room)


def _stop_strings(stop: str | list[str] | None, max_strings: int) -> tuple[str, ...]:
    strings = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if len(strings) > max_strings:
        raise HTTPError(
            400,
            f"stop holds {len(strings)} strings; at most {max_strings} are allowed (server.max_stop_strings)",
            "stop",
        )
    for s in strings:
        if len(s) > MAX_STOP_CHARS:
            raise HTTPError(
                400, f"stop strings must be at most {MAX_STOP_CHARS} characters, got one of {len(s)}", "stop"
            )
        check_text(s, "stop")
    return strings


def check_text(text: str, param: str) -> None:
    """Refuse a lone UTF-16 surrogate ("\\ud800" sent as a JSON escape): it is no character,
    cannot be tokenized or written back as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise HTTPError(
            400,
            f"{param} holds an unpaired UTF-16 surrogate (\\u{ord(text[e.start]):04x}) "
            f"at character {e.start}: send valid Unicode text",
            param,
        ) from None


# -- prompts: the check_* functions are cheap and run first; the tokenizing ones are slow on long
# -- text, and the app runs them in a worker thread.


def check_completion_prompt(req: CompletionRequest, max_model_len: int) -> None:
    p = req.prompt
    if isinstance(p, str):
        check_text(p, "prompt")
        return
    if not p:
        raise HTTPError(400, "prompt is empty", "prompt")
    if all(isinstance(t, int) for t in p):
        _check_id_count(len(p), max_model_len)
        return
    if len(p) != 1:
        raise HTTPError(400, "prompt must be one string or one list of token ids (batches are not supported)", "prompt")
    if isinstance(p[0], str):  # a batch of one: ["text"], or [[ids]]
        check_text(p[0], "prompt[0]")
    else:
        _check_id_count(len(p[0]), max_model_len)


def _check_id_count(count: int, max_model_len: int) -> None:
    # NOTE: refused here, before the ids are copied and each is checked against the vocabulary.
    if count > max_model_len:
        raise HTTPError(
            400, f"prompt ({count} token ids) exceeds the context length of {max_model_len} tokens", "prompt"
        )


def completion_prompt_bytes(req: CompletionRequest) -> int:
    """UTF-8 bytes of a completion prompt's text; 0 for token ids."""
    p = req.prompt
    text = p if isinstance(p, str) else p[0] if len(p) == 1 and isinstance(p[0], str) else ""
    return len(text.encode("utf-8"))


def messages_bytes(messages: list[ChatMessage]) -> int:
    """UTF-8 bytes of a conversation's contents (the chat template only adds to them)."""
    return sum(len(_message_text(m, i).encode("utf-8")) for i, m in enumerate(messages))


def check_prompt_bytes(text_bytes: int, tokenizer, max_model_len: int, param: str) -> None:
    """Refuse a prompt text that cannot fit the context whatever its tokens, before tokenizing it:
    no token stands for more than the tokenizer's longest piece (loader/piece_bound.py), so B bytes
    are at least B / longest tokens. A prompt under that bound is tokenized and judged by its
    token count, as before."""
    longest = getattr(tokenizer, "longest_piece_bytes", None)
    if longest is None or not text_bytes:
        return
    fewest = fewest_tokens(text_bytes, longest)
    if fewest > max_model_len:
        raise HTTPError(
            400,
            f"prompt ({text_bytes} bytes, so at least {fewest} tokens: no token of this model stands for "
            f"more than {longest} bytes) exceeds the context length of {max_model_len} tokens",
            param,
        )


def completion_prompt(req: CompletionRequest, tokenizer) -> list[int]:
    """Token ids of a prompt `check_completion_prompt` accepted."""
    p = req.prompt
    if isinstance(p, str):
        return _encode(tokenizer, p)
    if all(isinstance(t, int) for t in p):
        return list(p)
    one = p[0]  # a batch of one: ["text"] or [[ids]]
    return _encode(tokenizer, one) if isinstance(one, str) else list(one)


def check_messages(messages: list[ChatMessage]) -> None:
    if not messages:
        raise HTTPError(400, "messages is empty: send at least one message", "messages")
    if len(messages) > MAX_MESSAGES:
        raise HTTPError(400, f"messages holds {len(messages)} messages; at most {MAX_MESSAGES} are allowed", "messages")
    for i, m in enumerate(messages):
        _message_dict(m, i)  # refuses bad content now, before any slow work


def chat_prompt(messages: list[ChatMessage], tokenizer, tools: list[dict] | None = None) -> list[int]:
    """Token ids of the conversation `check_messages` accepted, rendered by the chat template
    (with the request's tools, in OpenAI's shape, where it has any: server/tools.py)."""
    if tokenizer is None:
        raise HTTPError(400, "this model has no tokenizer: send a completion prompt as token ids", "messages")
    rendered = [_message_dict(m, i) for i, m in enumerate(messages)]
    try:
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tools=tools)
    except InputError as e:
        raise HTTPError(400, str(e), "messages") from None
    # NOTE: the template already writes any BOS it wants; do not add another.
    return _encode(tokenizer, text, add_special_tokens=False)


def tokenize_text(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """/tokenize's prompt: `check_text` first, then this in a worker thread."""
    return _encode(tokenizer, text, add_special_tokens)


def detokenize_ids(tokenizer, ids: list[int]) -> str:
    """/detokenize's text: special tokens stay in it (it is the text those ids stand for)."""
    if tokenizer is None:
        raise HTTPError(400, "this model has no tokenizer, so it cannot turn token ids into text", "tokens")
    vocab = getattr(tokenizer, "decodable_ids", tokenizer.vocab_size)  # a padded model's rows decode to ""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab:
            raise HTTPError(400, f"tokens[{i}]: token id {token} is outside the vocabulary (size {vocab})", "tokens")
    return tokenizer.decode(ids)


def echo_text(req: CompletionRequest, prompt_ids: list[int], tokenizer) -> str:
    """The prompt as echoed: the text the client sent, or its token ids decoded (special
    tokens kept: they are part of the prompt)."""
    p = req.prompt
    if isinstance(p, str):
        return p
    if p and isinstance(p[0], str):
        return p[0]
    return tokenizer.decode(prompt_ids) if tokenizer is not None else ""


def _message_dict(m: ChatMessage, index: int) -> dict:
    # NOTE: "developer" is OpenAI's newer name for the system role; templates know only "system".
    role = "system" if m.role == "developer" else m.role
    message: dict = {"role": role, "content": _message_text(m, index)}
    if m.tool_calls:
        if m.role != "assistant":
            param = f"messages[{index}].tool_calls"
            raise HTTPError(400, f"{param}: only an assistant message has tool calls", param)
        message["tool_calls"] = [_template_call(call, index, j) for j, call in enumerate(m.tool_calls)]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _template_call(call: ToolCall, index: int, j: int) -> dict:
    """An earlier call as chat templates read it: arguments an object (they write it with tojson)."""
    param = f"messages[{index}].tool_calls[{j}].function.arguments"
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        raise HTTPError(400, f"{param}: is not JSON text", param) from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def _message_text(m: ChatMessage, index: int) -> str:
    content = m.content
    if isinstance(content, list):  # OpenAI content parts: text ones only
        for j, part in enumerate(content):
            if part.type != "text":
                raise HTTPError(
                    400,
                    f'messages[{index}].content[{j}].type: only "text" content parts are supported, got {part.type!r}',
                    f"messages[{index}].content[{j}].type",
                )
            if part.text is None:
                raise HTTPError(
                    400,
                    f"messages[{index}].content[{j}].text is required for a text part",
                    f"messages[{index}].content[{j}].text",
                )
        content = "".join(part.text for part in content)
    check_text(content or "", f"messages[{index}].content")
    return content or ""


def _encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    if tokenizer is None:
        raise HTTPError(400, "this model has no tokenizer: send the prompt as token ids", "prompt")
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _param_of(message: str) -> str | None:
    for name in ("max_tokens", "temperature", "top_k", "top_p", "stop", "seed"):
        if message.startswith(name):
            return name
    return None
