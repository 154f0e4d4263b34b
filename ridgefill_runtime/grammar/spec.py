"""What a request's structured output asks for, as plain data: no grammar engine here, so the
server and the scheduler can carry it without importing one."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError

# json_schema: a JSON Schema (json_object is the schema {"type": "object"}); regex: the whole
# output matches it; choice: the output is one of the strings; lark: a Lark grammar (llguidance's).
GRAMMAR_KINDS = ("json_schema", "regex", "choice", "lark")


@dataclass(frozen=True)
class GrammarSpec:
    """`source`: the schema as canonical JSON text, the regex, the choices as a JSON list, or
    the Lark text. `param`: the request field it came from, named in errors (not part of the
    identity: one schema is compiled once whichever field carried it)."""

    kind: str
    source: str
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InputError(f"{self.param}: unknown grammar kind {self.kind!r} (known: {', '.join(GRAMMAR_KINDS)})")

    @property
    def size(self) -> int:
        """Bytes of the source: what structured.max_schema_bytes bounds."""
        return len(self.source.encode("utf-8"))


def json_schema_spec(schema: Any, param: str) -> GrammarSpec:
    """A JSON Schema (an object, or true for any JSON value) as a spec. Its keys keep their
    order: the grammar writes an object's properties in the order the schema declares them
    (a "reasoning" before its "answer" is the point of many schemas)."""
    if schema is True:
        schema = {}
    if not isinstance(schema, dict):
        raise InputError(f"{param}: a JSON Schema must be an object, got {type(schema).__name__}")
    return GrammarSpec("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), param)


def choice_spec(choices: Any, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise InputError(f"{param}: must be a non-empty list of non-empty strings")
    return GrammarSpec("choice", json.dumps(choices, ensure_ascii=False), param)
