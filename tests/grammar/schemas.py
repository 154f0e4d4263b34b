"""JSON Schemas the structured-output tests run: nested objects, arrays, enums, anyOf,
patterns, bounded numbers, formats, optional keys, $defs; each with a prompt that invites it."""

from __future__ import annotations

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person", PERSON),
    ("a boolean answer", {"type": "boolean"}),
    ("an integer between 1 and 10", {"type": "integer", "minimum": 1, "maximum": 10}),
    ("a temperature in Celsius", {"type": "number", "minimum": -50, "maximum": 60}),
    ("a colour", {"type": "string", "enum": ["red", "green", "blue"]}),
    ("a short word", {"type": "string", "minLength": 2, "maxLength": 8}),
    ("a US zip code", {"type": "string", "pattern": "^[0-9]{5}$"}),
    ("a date", {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}),
    ("three prime numbers", {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 3}),
    ("some tags", {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 4}),
    (
        "a point",
        {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"]},
    ),
    (
        "a book",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 30},
                "author": PERSON,
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            },
            "required": ["title", "author", "year"],
            "additionalProperties": False,
        },
    ),
    ("a list of people", {"type": "array", "items": PERSON, "minItems": 1, "maxItems": 2}),
    ("an id, a number or a name", {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 12}]}),
    (
        "a shape",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"circle": {"type": "number", "minimum": 0}},
                    "required": ["circle"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"square": {"type": "number", "minimum": 0}},
                    "required": ["square"],
                    "additionalProperties": False,
                },
            ]
        },
    ),
    ("a nullable name", {"type": ["string", "null"], "maxLength": 10}),
    ("a constant", {"const": "fixed"}),
    (
        "a status",
        {
            "type": "object",
            "properties": {"status": {"enum": ["ok", "error", 404]}},
            "required": ["status"],
            "additionalProperties": False,
        },
    ),
    (
        "a matrix",
        {
            "type": "array",
            "items": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
            "minItems": 2,
            "maxItems": 2,
        },
    ),
    ("an email", {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}),
    (
        "a price",
        {
            "type": "object",
            "properties": {
                "amount": {"type": "number", "exclusiveMinimum": 0, "maximum": 1000},
                "currency": {"enum": ["USD", "EUR"]},
            },
            "required": ["amount", "currency"],
            "additionalProperties": False,
        },
    ),
    (
        "a tree",
        {
            "$defs": {
                "leaf": {
                    "type": "object",
                    "properties": {"value": {"type": "integer"}},
                    "required": ["value"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"left": {"$ref": "#/$defs/leaf"}, "right": {"$ref": "#/$defs/leaf"}},
            "required": ["left", "right"],
            "additionalProperties": False,
        },
    ),
    (
        "a settings object",
        {
            "type": "object",
            "properties": {"debug": {"type": "boolean"}, "level": {"type": "integer", "minimum": 0, "maximum": 5}},
            "required": ["debug"],
            "additionalProperties": False,
        },
    ),
    ("a version string", {"type": "string", "pattern": "^v[0-9]\\.[0-9]\\.[0-9]$"}),
    (
        "a pair",
        {
            "type": "array",
            "prefixItems": [{"type": "string", "maxLength": 8}, {"type": "integer"}],
            "items": False,
            "minItems": 2,
        },
    ),
    (
        "a rating",
        {
            "type": "object",
            "properties": {
                "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                "comment": {"type": "string", "maxLength": 40},
            },
            "required": ["stars", "comment"],
            "additionalProperties": False,
        },
    ),
    (
        "an address",
        {
            "type": "object",
            "properties": {
                "street": {"type": "string", "maxLength": 30},
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city", "zip"],
            "additionalProperties": False,
        },
    ),
    ("a small even number", {"type": "integer", "multipleOf": 2, "minimum": 0, "maximum": 20}),
    ("a weekday", {"enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday"]}),
    (
        "a coordinate with bounds",
        {
            "type": "object",
            "properties": {
                "lat": {"type": "number", "minimum": -90, "maximum": 90},
                "lon": {"type": "number", "minimum": -180, "maximum": 180},
            },
            "required": ["lat", "lon"],
            "additionalProperties": False,
        },
    ),
    (
        "an order",
        {
            "type": "object",
            "properties": {
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                        },
                        "required": ["sku", "qty"],
                        "additionalProperties": False,
                    },
                    "minItems": 1,
                    "maxItems": 2,
                }
            },
            "required": ["items"],
            "additionalProperties": False,
        },
    ),
    ("any JSON object", {"type": "object"}),
]
