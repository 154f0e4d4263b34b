"""A chat request's tools: checked against the model's chat template, rendered into its prompt,
constrained when the client requires a call, and read back out of the answer (tool_parser.py).

tool_choice "auto" (the default with tools) generates freely and parses whatever calls the model
writes; "required" constrains the answer to calls (one, with parallel_tool_calls false) whose
arguments keep to their function's schema, and a named function to one call of it, so a call is
always valid (a call cut off by max_tokens stays content, with finish_reason "length"); "none" leaves the tools out of the prompt: a model that was never shown them cannot
call them (vLLM renders them anyway unless told not to; we chose the guarantee).

The one tool format served is Hermes's `<tool_call>` JSON, the format of Qwen2.5's template (and
of many fine-tunes); a template that takes tools in another format is refused by name rather
than parsed wrongly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ridgefill_runtime.grammar.book import JSON_OPTIONS
from ridgefill_runtime.grammar.spec import GrammarSpec

from .errors import HTTPError
from .protocol import ChatCompletionRequest, ToolDefinition
from .tool_parser import HermesParser

NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a function's name
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass(frozen=True)
class ToolFormat:
    """How a chat template writes a call: the tags around its JSON object."""

    open_tag: str
    close_tag: str

    def lark(self, tokenizer, schema: dict, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for one call, or several one per line; a tag
        the tokenizer spells as one token is that token (the template's rendering), which a
        string literal would not match when the token is a special one."""
        call = f'{_literal(tokenizer, self.open_tag)} "\\n" args "\\n" {_literal(tokenizer, self.close_tag)}'
        start = 'call ("\\n" call)*' if parallel else "call"
        return f"start: {start}\ncall: {call}\nargs: %json {json.dumps(schema, ensure_ascii=False)}\n"


HERMES = ToolFormat("<tool_call>", "</tool_call>")


def tool_format_of(tokenizer) -> ToolFormat:
    """The model's tool format; HTTPError 400 naming `tools` if its template has none we parse."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if "tools" not in template:
        raise HTTPError(400, "tools: this model's chat template has no tool format, so it cannot call tools", "tools")
    if HERMES.open_tag not in template:
        raise HTTPError(
            400, "tools: this model's chat template writes tool calls in a format ridgefill does not parse", "tools"
        )
    return HERMES


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's checked tools. `choice`: "auto", "none", "required" or "function"
    (then `name` is the function)."""

    tools: tuple[ToolDefinition, ...]
    choice: str
    name: str | None
    parallel: bool
    format: ToolFormat

    def template_tools(self) -> list[dict] | None:
        """The tools as the chat template reads them (OpenAI's shape), or None for "none"."""
        return None if self.choice == "none" else template_tools(self.tools)

    def grammar(self, tokenizer) -> GrammarSpec | None:
        """The constraint of a required or named call; None when the model chooses."""
        if self.choice not in ("required", "function"):
            return None
        chosen = [t for t in self.tools if self.choice == "required" or t.function.name == self.name]
        options = [_call_schema(t) for t in chosen]
        # NOTE: the JSON written as structured outputs write it (book.JSON_OPTIONS): no free whitespace
        schema = {**(options[0] if len(options) == 1 else {"anyOf": options}), "x-guidance": JSON_OPTIONS}
        # NOTE: a named function is one call (as vLLM's): more than one would only repeat it
        parallel = self.parallel and self.choice == "required"
        return GrammarSpec("lark", self.format.lark(tokenizer, schema, parallel), "tools")

    def parser(self) -> HermesParser | None:
        """A fresh parser for one choice's text; None when no call can come ("none")."""
        if self.choice == "none":
            return None
        names = frozenset(t.function.name for t in self.tools)
        return HermesParser(names, self.format.open_tag, self.format.close_tag)


def tool_plan(body: ChatCompletionRequest, tokenizer) -> ToolPlan | None:
    """The request's tools checked (400 naming the field), or None when it has none."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise HTTPError(400, "tool_choice: needs tools; the request lists none", "tool_choice")
        return None
    check_tools(body.tools)
    fmt = tool_format_of(tokenizer)
    names = [t.function.name for t in body.tools]
    if choice is None or isinstance(choice, str):
        return ToolPlan(tuple(body.tools), choice or "auto", None, body.parallel_tool_calls, fmt)
    if choice.function.name not in names:
        raise HTTPError(
            400,
            f"tool_choice.function.name: {choice.function.name!r} is not one of the request's tools ({', '.join(names)})",
            "tool_choice.function.name",
        )
    return ToolPlan(tuple(body.tools), "function", choice.function.name, body.parallel_tool_calls, fmt)


def check_tools(tools: list[ToolDefinition]) -> None:
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        param = f"tools[{i}].function.name"
        if not NAME.match(name):
            raise HTTPError(400, f"{param}: {name!r} is not a function name (1 to 64 of a-z, A-Z, 0-9, _ and -)", param)
        if name in seen:
            raise HTTPError(400, f"{param}: {name!r} is listed twice", param)
        seen.add(name)


def template_tools(tools) -> list[dict]:
    return [
        {"type": "function", "function": t.function.model_dump(exclude_none=True, exclude={"strict"})} for t in tools
    ]


def finish_reason(reason: str | None, calls: int) -> str | None:
    """OpenAI's "tool_calls" for a choice that ended on its own after calling tools."""
    return "tool_calls" if calls and reason == "stop" else reason


def _call_schema(tool: ToolDefinition) -> dict:
    """One call's JSON: the function's name, then its arguments (key order as the template writes them)."""
    return {
        "type": "object",
        "properties": {
            "name": {"const": tool.function.name},
            "arguments": tool.function.parameters or NO_ARGUMENTS,
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _literal(tokenizer, tag: str) -> str:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    return f"<[{ids[0]}]>" if len(ids) == 1 else json.dumps(tag)
