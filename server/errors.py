"""HTTP errors with OpenAI-style bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import json
from typing import Any

from fastapi.responses import JSONResponse

from .protocol import ErrorInfo, ErrorResponse

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "invalid_request_error",
    421: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def engine_failure_status(finish_reason: str | None) -> int:
    """The status of a request the engine ended with an error message: an abort is the
    shutdown's (503, try again elsewhere or later), anything else a failure in the engine (500)."""
    return 503 if finish_reason == "abort" else 500


class HTTPError(Exception):
    """Raised anywhere in a route; the app turns it into the JSON body and status."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    info = ErrorInfo(
        message=_printable(message),
        type=_TYPES.get(status, "error"),
        param=None if param is None else _printable(param),
        code=status,
    )
    return ErrorResponse(error=info).model_dump()


def error_response(err: HTTPError) -> JSONResponse:
    return JSONResponse(error_body(err.status, err.message, err.param), status_code=err.status, headers=err.headers)


def _printable(text: str) -> str:
    # NOTE: a message may quote the client's input; a lone surrogate in it cannot be written as
    # UTF-8, and the error about it must not become a 500.
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


# -- request validation (pydantic) errors -> one message naming the field ---------------------

# Longest integer literal a request body may hold (digits): 2**64 has 20 and no setting needs
# more, but a value a little past a range is better refused by that range's own message; past
# Python's own limit (4,300) the whole parse failed with FastAPI's vague "error parsing the
# body" (issue 31, finding 4).
MAX_INT_DIGITS = 100


class OversizedInt:
    """Stands in for an integer literal past MAX_INT_DIGITS in a parsed body: never an int, so
    the field holding it fails validation and its error names the field."""

    def __init__(self, literal: str):
        self.digits = len(literal.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.digits} digits"


def parse_json_int(literal: str) -> int | OversizedInt:
    """json.loads' parse_int: an int, or an OversizedInt past MAX_INT_DIGITS."""
    return OversizedInt(literal) if len(literal.lstrip("-")) > MAX_INT_DIGITS else int(literal)


# What a field should have held, by pydantic error type.
_EXPECTED = {
    "string_type": "a string",
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "int_parsing_size": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number (not Infinity or NaN)",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "list_type": "a list",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
}
# What a union-typed field takes, by field name; pydantic reports one error per alternative.
_UNION_EXPECTED = {
    "prompt": "a string or a list of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of content parts",
    "logprobs": "an integer or true/false",
}


def describe_invalid(errors: list[dict], body: Any) -> tuple[str, str | None]:
    """(message, param) for a RequestValidationError: its first problem, in words, with the
    field's path in the body ("messages[0].role")."""
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first["type"] == "json_invalid":
        where = first["loc"][-1]
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', 'decode error')} "
            f"(at character {where})",
            None,
        )
    if tuple(first["loc"]) == ("body",):
        return _describe_body(first), None
    huge = next((e for e in errors if isinstance(e.get("input"), OversizedInt)), None)
    if huge is not None:  # before the first error: a union reports its other alternatives first
        where = _format_path(_walk(huge["loc"], body, huge["type"])[0])
        return _describe_field(huge, where), where
    chosen, path, branches = _pick(errors, body)
    param = _format_path(path)
    if chosen is not None:
        return _describe_field(chosen, param), param
    # the alternatives of a union all failed, none further into the value than the others
    name = path[-1] if path and isinstance(path[-1], str) else ""
    expected = _UNION_EXPECTED.get(name) or " or ".join(
        dict.fromkeys(_EXPECTED.get(e["type"], "another type") for e in branches)
    )
    return f"{param} must be {expected}, got {_shown(_at(body, path))}", param


def _describe_body(error: dict) -> str:
    if error["type"] == "missing":
        return "the request body is empty: send a JSON object (Content-Type: application/json)"
    if isinstance(error.get("input"), (bytes, bytearray)):
        return "the request body must be JSON: send it with Content-Type: application/json"
    return f"the request body must be a JSON object, got {_shown(error.get('input'))}"


def _describe_field(error: dict, param: str) -> str:
    kind = error["type"]
    if isinstance(error.get("input"), OversizedInt):
        return f"{param}: an integer of {error['input'].digits} digits is past the limit of {MAX_INT_DIGITS} digits"
    if kind == "missing":
        return f"{param} is required"
    if kind == "extra_forbidden":
        return f"{param} is not a known field"
    if kind == "literal_error":
        return (
            f"{param} must be {error.get('ctx', {}).get('expected', 'one of the listed values')}, "
            f"got {_shown(error.get('input'))}"
        )
    if kind in _EXPECTED:
        return f"{param} must be {_EXPECTED[kind]}, got {_shown(error.get('input'))}"
    return f"{param}: {error.get('msg', 'invalid value')}"


def _pick(errors: list[dict], body: Any) -> tuple[dict | None, list, list[dict]]:
    """The error to report, its path in the body, and the errors of its union's alternatives.
    pydantic reports a union field once per alternative, with the alternative's name in the
    loc: then the one error that got furthest into the value (a content part's bad "text"),
    when there is one; else None and the union field's own path."""
    first = errors[0]
    path, union_at = _walk(first["loc"], body, first["type"])
    if union_at is None:
        return first, path, [first]
    union_loc = tuple(first["loc"][:union_at])
    union_path, _ = _walk(union_loc, body, "")
    branches = [e for e in errors if tuple(e["loc"][:union_at]) == union_loc]
    walked = [(_walk(e["loc"], body, e["type"])[0], e) for e in branches]
    deepest = max(len(p) for p, _ in walked)
    furthest = [(p, e) for p, e in walked if len(p) == deepest]
    if deepest > len(union_path) and len(furthest) == 1:
        return furthest[0][1], furthest[0][0], branches
    return None, union_path, branches


def _walk(loc, body: Any, kind: str) -> tuple[list, int | None]:
    """The loc's keys that index the body (dict keys, list indices), and the position in the
    loc of the first other element (a union alternative's name), or None."""
    loc = list(loc)
    path, union_at, node = [], None, body
    for i, key in enumerate(loc):
        if i == 0 and key == "body":
            continue
        if isinstance(node, dict) and isinstance(key, str) and key in node:
            path.append(key)
            node = node[key]
        elif isinstance(node, list) and isinstance(key, int) and 0 <= key < len(node):
            path.append(key)
            node = node[key]
        elif i == len(loc) - 1 and kind == "missing":
            path.append(key)  # a required field the body lacks
        elif union_at is None:
            union_at = i
    return path, union_at


def _at(body: Any, path: list) -> Any:
    for key in path:
        body = body[key]
    return body


def _format_path(path: list) -> str:
    out = ""
    for key in path:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out


def _shown(value: Any, limit: int = 80) -> str:
    """The client's value as JSON (ASCII, so any surrogate is escaped), cut to `limit` chars."""
    try:
        text = json.dumps(value, ensure_ascii=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
