"""OpenAI's `response_format` -> a compiled grammar.

`{"type": "json_object"}`: any JSON object. `{"type": "json_schema", "json_schema": {"name", "schema", "strict"?,
"description"?}}`: a JSON value that fits `schema` (any JSON value when `schema` is absent). `{"type": "text"}` needs
no grammar: the caller skips it (`needs_grammar`).
"""

from __future__ import annotations

import re
from typing import Any

from engine.structured.grammars import CompiledGrammar, compile_grammar
from engine.structured.schema import SchemaError, check_schema

NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for schema and function names


def check_name(at: str, name: Any) -> str:
    """A schema's or function's name, or SchemaError at `at` when it breaks OpenAI's rule."""
    if not isinstance(name, str) or not NAME.match(name):
        raise SchemaError(at, "must be 1-64 characters of a-z, A-Z, 0-9, '_' or '-'")
    return name


JSON_OBJECT: dict[str, Any] = {"type": "object"}
PREFIX = "response_format"


def needs_grammar(response_format: Any) -> bool:
    """False for an absent or `{"type": "text"}` response_format (nothing to constrain)."""
    return response_format is not None and not (
        isinstance(response_format, dict) and response_format.get("type") == "text"
    )


def compile_response_format(response_format: Any, tokenizer: Any, *, timeout_s: float = 5.0) -> CompiledGrammar:
    """The grammar for `response_format` (json_object or json_schema), cached by digest. Raises SchemaError with a
    path under `response_format` for a malformed request, an invalid or unsupported schema, or a compile past
    `timeout_s`."""
    kind, schema = _parse(response_format)
    path = f"{PREFIX}.json_schema.schema" if kind == "json_schema" else PREFIX
    check = (lambda: check_schema(schema, path)) if kind == "json_schema" else None
    return compile_grammar(kind, schema, tokenizer, path=path, timeout_s=timeout_s, check=check)


def _parse(response_format: Any) -> tuple[str, Any]:
    if not isinstance(response_format, dict):
        raise SchemaError(PREFIX, "must be an object")
    kind = response_format.get("type")
    if kind == "json_object":
        return kind, JSON_OBJECT
    if kind != "json_schema":
        raise SchemaError(f"{PREFIX}.type", f"must be 'json_schema', 'json_object' or 'text', got {kind!r}")
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise SchemaError(f"{PREFIX}.json_schema", "must be an object with 'name' and 'schema'")
    check_name(f"{PREFIX}.json_schema.name", spec.get("name"))
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise SchemaError(f"{PREFIX}.json_schema.strict", "must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise SchemaError(f"{PREFIX}.json_schema.description", "must be a string")
    schema = spec.get("schema", {})
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(f"{PREFIX}.json_schema.schema", "must be a JSON schema object")
    return kind, schema
