"""A request's structured output: response_format (OpenAI) or structured_outputs (vLLM's names)
as one GrammarSpec, compiled off the event loop before the request is queued.

Errors are a 400 naming the field: two constraints at once, an empty choice list, a schema the
grammar engine cannot compile (or does not support), one larger than structured.max_schema_bytes
or slower to compile than structured.compile_timeout_s.
"""

from __future__ import annotations

import asyncio

from ridgefill_runtime.errors import InputError
from ridgefill_runtime.grammar.spec import GrammarSpec, choice_spec, json_schema_spec

from .errors import HTTPError
from .protocol import _SamplingFields

ANY_OBJECT = {"type": "object"}  # json_object: any JSON object


def grammar_of(req: _SamplingFields, tools: GrammarSpec | None = None) -> GrammarSpec | None:
    """The request's one structured-output constraint, or None. `tools`: a chat request's
    required or named tool call (server/tools.py), which the answer cannot keep to alongside
    another constraint."""
    specs = [s for s in (_response_format(req), *_structured_outputs(req), tools) if s is not None]
    if len(specs) > 1:
        names = " and ".join(s.param for s in specs)
        raise HTTPError(400, f"give one structured-output constraint, got {names}", specs[1].param)
    return specs[0] if specs else None


def metric_kind(spec: GrammarSpec) -> str:
    """ridgefill_structured_requests_total's label: the grammar kind, or "tools" for a tool call."""
    return "tools" if spec.param == "tools" else spec.kind


def _response_format(req: _SamplingFields) -> GrammarSpec | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise HTTPError(400, 'response_format.json_schema needs type "json_schema"', "response_format.type")
        return None
    if fmt.type == "json_object":
        return _spec(lambda: json_schema_spec(ANY_OBJECT, "response_format"))
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise HTTPError(
            400, 'response_format type "json_schema" needs json_schema.schema', "response_format.json_schema.schema"
        )
    return _spec(lambda: json_schema_spec(fmt.json_schema.schema_, "response_format.json_schema.schema"))


def _structured_outputs(req: _SamplingFields) -> list[GrammarSpec | None]:
    so = req.structured_outputs
    if so is None:
        return []
    param = "structured_outputs"
    return [
        None if so.json_ is None else _spec(lambda: json_schema_spec(so.json_, f"{param}.json")),
        None if not so.json_object else _spec(lambda: json_schema_spec(ANY_OBJECT, f"{param}.json_object")),
        None if so.regex is None else _spec(lambda: GrammarSpec("regex", so.regex, f"{param}.regex")),
        None if so.choice is None else _spec(lambda: choice_spec(so.choice, f"{param}.choice")),
        None if so.grammar is None else _spec(lambda: GrammarSpec("lark", so.grammar, f"{param}.grammar")),
    ]


def _spec(make) -> GrammarSpec:
    try:
        return make()
    except InputError as e:
        raise HTTPError(400, str(e), str(e).partition(":")[0]) from None


async def compile_grammar(engine, spec: GrammarSpec) -> None:
    """Compile spec in a worker thread (kept by the engine's GrammarBook for the request's
    sequences), within structured.compile_timeout_s; HTTPError 400 naming the field otherwise."""
    book = engine.grammars
    if book is None:
        raise HTTPError(
            400,
            f"{spec.param}: this model's tokenizer cannot spell a grammar in tokens, so it serves no structured outputs",
            spec.param,
        )
    limit = book.config.compile_timeout_s
    try:
        # NOTE: on a timeout the worker thread still finishes (llguidance's own fuel limits bound
        # it); the request is refused now and the grammar, once compiled, is kept for a retry
        await asyncio.wait_for(asyncio.to_thread(book.compile, spec), timeout=limit)
    except TimeoutError:
        raise HTTPError(
            400, f"{spec.param}: not compiled within structured.compile_timeout_s ({limit:g} s)", spec.param
        ) from None
    except InputError as e:
        raise HTTPError(400, str(e), spec.param) from None
