"""Structured outputs without a model: grammars compiled by engine/structured (xgrammar behind its checks and
vocabulary filter) drive random walks over the real tokenizers' vocabularies (the tiny model's 468 tokens and
SmolLM2's 49,152), and every finished document must validate against its schema with `jsonschema` (someone else's
validator). Each step picks a random token the bitmask allows (seeded, biased towards closing tokens after a while
so walks end), advances the constraint, and checks that EOS is allowed exactly when the grammar is complete. Such
walks found what the vocabulary filter and the format rewrites now prevent: raw control characters and invalid
UTF-8 inside strings, and dates such as 4310-11-31.

Also: json_object, constrained tool calls (required and named), refusals naming the exact JSON path (patterns that
can match nothing among them, which xgrammar alone would let a request start and then dead-end on, shown here too;
and through the `openai` client against a real engine), a compile killed at its time bound, a shared in-flight
compile, the digest cache, and `auto` tool-call markup.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import jsonschema
import numpy as np
import openai
import pytest
import torch
import xgrammar

from engine.model.sources import load_tokenizer
from engine.structured import (
    CompiledGrammar,
    SchemaError,
    compile_response_format,
    compile_tool_call,
    needs_grammar,
    parse_auto_tool_calls,
    parse_tool_call,
    prepare_tokenizer,
    template_supports_tools,
)
from engine.structured import grammars as grammars_module
from engine.structured.automata import ALL_BYTES, DEAD_END, EMPTY, Automata, AutomataFormatError
from engine.structured.dead_ends import unsatisfiable
from engine.structured.vocabulary import vocabulary
from engine.structured.worker import JSON_OPTIONS, CompileTimeout, WorkerRefusal

from processes import start_engine_server

MAX_STEPS = 3000
CLOSE_AFTER = 40  # steps after which a walk prefers closing tokens

OBJ = {"type": "object"}


def obj(properties: dict[str, Any], required: list[str] | None = None, **extra: Any) -> dict[str, Any]:
    """An object schema with additionalProperties false and every property required unless `required` says."""
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("string", obj({"s": {"type": "string"}})),
    ("integer", obj({"n": {"type": "integer"}})),
    ("number", obj({"x": {"type": "number"}})),
    ("boolean", obj({"b": {"type": "boolean"}})),
    ("null", obj({"z": {"type": "null"}})),
    ("int-bounds", obj({"age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("int-negative", obj({"t": {"type": "integer", "minimum": -40, "maximum": -5}})),
    ("int-exclusive", obj({"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}})),
    ("int-large", obj({"n": {"type": "integer", "minimum": 1000000, "maximum": 1000999}})),
    ("int-multiple", obj({"n": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}})),
    ("number-bounds", obj({"p": {"type": "number", "minimum": 0, "maximum": 1}})),
    ("number-negative", obj({"x": {"type": "number", "minimum": -2.5, "maximum": 2.5}})),
    ("number-min-only", obj({"price": {"type": "number", "minimum": 10}})),
    ("string-lengths", obj({"s": {"type": "string", "minLength": 3, "maxLength": 8}})),
    ("string-exact-length", obj({"code": {"type": "string", "minLength": 4, "maxLength": 4}})),
    ("string-max", obj({"s": {"type": "string", "maxLength": 2}})),
    ("pattern-sku", obj({"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}})),
    ("pattern-date", obj({"d": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}})),
    ("pattern-words", obj({"w": {"type": "string", "pattern": "^(yes|no|maybe)( please)?$"}})),
    ("pattern-hex", obj({"color": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}})),
    ("pattern-email-ish", obj({"e": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.(com|org)$"}})),
    ("format-uuid", obj({"id": {"type": "string", "format": "uuid"}})),
    ("format-date", obj({"d": {"type": "string", "format": "date"}})),
    ("enum-strings", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("enum-mixed", obj({"v": {"enum": ["a", 1, 2.5, True, None]}})),
    ("enum-typed", obj({"level": {"type": "string", "enum": ["low", "medium", "high"]}})),
    ("const-string", obj({"kind": {"const": "person"}})),
    ("const-object", obj({"meta": {"const": {"v": 1, "tags": ["x"]}}})),
    ("optional", obj({"a": {"type": "integer"}, "b": {"type": "string"}, "c": {"type": "boolean"}}, required=["a"])),
    ("all-optional", obj({"a": {"type": "integer"}, "b": {"type": "string"}}, required=[])),
    (
        "nested",
        obj({"user": obj({"name": {"type": "string", "maxLength": 20}, "address": obj({"city": {"type": "string"}})})}),
    ),
    ("nested-deep", obj({"a": obj({"b": obj({"c": obj({"d": {"type": "integer"}})})})})),
    ("array", obj({"xs": {"type": "array", "items": {"type": "integer"}}})),
    ("array-bounds", obj({"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 4}})),
    ("array-exact", obj({"xs": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}})),
    ("array-strings", obj({"tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 5}})),
    (
        "array-objects",
        obj(
            {
                "items": {
                    "type": "array",
                    "maxItems": 3,
                    "items": obj({"id": {"type": "integer"}, "ok": {"type": "boolean"}}),
                }
            }
        ),
    ),
    (
        "array-nested",
        obj(
            {
                "m": {
                    "type": "array",
                    "maxItems": 3,
                    "items": {"type": "array", "maxItems": 3, "items": {"type": "number"}},
                }
            }
        ),
    ),
    (
        "prefix-items",
        obj({"pt": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "string"}], "items": False}}),
    ),
    ("anyof-scalars", obj({"v": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 5}]}})),
    (
        "anyof-objects",
        obj(
            {
                "shape": {
                    "anyOf": [
                        obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}),
                        obj({"kind": {"const": "rect"}, "w": {"type": "integer"}, "h": {"type": "integer"}}),
                    ]
                }
            }
        ),
    ),
    ("nullable", obj({"n": {"type": ["string", "null"]}})),
    ("nullable-anyof", obj({"n": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "null"}]}})),
    ("type-union", obj({"v": {"type": ["integer", "boolean"]}})),
    ("additional-typed", {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3}),
    ("additional-open", {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}),
    (
        "pattern-properties",
        {"type": "object", "patternProperties": {"^x_[a-z]{1,5}$": {"type": "boolean"}}, "additionalProperties": False},
    ),
    (
        "min-properties",
        # Named optional keys: extra keys could repeat, and json.loads keeps one of each (so fewer than minimum).
        obj(
            {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3}, "c": {"type": "boolean"}},
            required=[],
            minProperties=2,
            maxProperties=2,
        ),
    ),
    (
        "defs-ref",
        {
            "$defs": {"point": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
            **obj({"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}}),
        },
    ),
    (
        "recursive",
        {
            "$defs": {
                "node": obj(
                    {
                        "value": {"type": "integer"},
                        "children": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/node"}},
                    }
                )
            },
            "$ref": "#/$defs/node",
        },
    ),
    (
        "discriminated-oneof",
        {
            "$defs": {
                "Cat": obj({"kind": {"const": "cat", "type": "string"}, "lives": {"type": "integer", "maximum": 9}}),
                "Dog": obj({"kind": {"const": "dog", "type": "string"}, "good": {"type": "boolean"}}),
            },
            **obj(
                {
                    "pet": {
                        "oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                        "discriminator": {"propertyName": "kind"},
                    }
                }
            ),
        },
    ),
    (
        "oneof-closed-objects",  # each option requires a property the other forbids
        obj({"shape": {"oneOf": [obj({"circle": {"type": "integer"}}), obj({"square": {"type": "boolean"}})]}}),
    ),
    ("oneof-types", obj({"v": {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]}})),
    ("untyped-object", {"properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}),
    (
        "pydantic-like",
        {
            "title": "Person",
            "description": "A person",
            "type": "object",
            "properties": {
                "name": {"title": "Name", "type": "string"},
                "age": {"title": "Age", "type": "integer", "minimum": 0},
                "pets": {"title": "Pets", "type": "array", "items": {"$ref": "#/$defs/Pet"}, "maxItems": 2},
            },
            "required": ["name", "age", "pets"],
            "additionalProperties": False,
            "$defs": {
                "Pet": {
                    "title": "Pet",
                    "type": "object",
                    "properties": {"kind": {"enum": ["cat", "dog"], "type": "string"}, "name": {"type": "string"}},
                    "required": ["kind", "name"],
                    "additionalProperties": False,
                }
            },
        },
    ),
    (
        "everything",
        obj(
            {
                "id": {"type": "integer", "minimum": 1},
                "name": {"type": "string", "minLength": 1, "maxLength": 30},
                "email": {"type": "string", "pattern": "^[a-z]{1,10}@example\\.com$"},
                "active": {"type": "boolean"},
                "score": {"type": "number", "minimum": 0, "maximum": 100},
                "role": {"enum": ["admin", "user", "guest"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
                "manager": {"anyOf": [{"type": "null"}, obj({"id": {"type": "integer"}})]},
            },
            required=["id", "name", "email", "role"],
        ),
    ),
    ("top-array", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3}),
    ("top-enum", {"enum": ["alpha", "beta"]}),
    ("unicode-keys", obj({"prénom": {"type": "string", "maxLength": 10}, "名前": {"type": "integer"}})),
]
assert len(SCHEMAS) >= 50


@pytest.fixture(scope="module")
def tiny_tokenizer(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)
    prepare_tokenizer(tokenizer)
    return tokenizer


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir):
    tokenizer = load_tokenizer(smollm2_dir)
    prepare_tokenizer(tokenizer)
    return tokenizer


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=pytest.mark.smollm2)])
def tokenizer(request):
    return request.getfixturevalue(f"{request.param}_tokenizer")


def json_schema_format(schema: Any, name: str = "answer") -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


class Walker:
    """Random walks through a grammar over one tokenizer's vocabulary."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.eos = tokenizer.eos_token_id
        self.words = (len(tokenizer) + 31) // 32
        # Closing a string first (a quote), then an object or array, then the next item; "}" in a string is text.
        self.closers = [tokenizer.convert_tokens_to_ids(t) for t in ('"', "}", "]", ",", "0")]
        assert all(isinstance(i, int) and i != tokenizer.unk_token_id for i in self.closers)

    def allowed(self, bitmask: torch.Tensor) -> np.ndarray:
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
        return np.flatnonzero(bits)

    def walk(self, grammar: CompiledGrammar, seed: int) -> str:
        """Generate until the grammar is complete; return the text (EOS excluded)."""
        rng = random.Random(seed)
        constraint = grammar.constraint()
        bitmask = torch.zeros(self.words, dtype=torch.int32)
        ids: list[int] = []
        for step in range(MAX_STEPS):
            constraint.fill_bitmask(bitmask)
            allowed = self.allowed(bitmask)
            assert len(allowed) > 0, f"empty mask after {self.text(ids)!r}"
            eos_allowed = self.eos in set(allowed.tolist())
            assert eos_allowed == constraint.is_accepting(), f"EOS allowed={eos_allowed} after {self.text(ids)!r}"
            if eos_allowed and (rng.random() < 0.5 or step > CLOSE_AFTER):
                constraint.advance(self.eos)
                assert constraint.is_finished()
                return self.text(ids)
            token = self.pick(allowed, rng, closing=step > CLOSE_AFTER or rng.random() < 0.15)
            assert token != self.eos
            constraint.advance(token)
            ids.append(token)
            if constraint.is_finished():
                constraint.fill_bitmask(bitmask)
                assert self.allowed(bitmask).tolist() == [self.eos], "a complete grammar allows EOS only"
                return self.text(ids)
        raise AssertionError(f"walk not finished after {MAX_STEPS} steps: {self.text(ids)[:200]!r}")

    def pick(self, allowed: np.ndarray, rng: random.Random, *, closing: bool) -> int:
        allowed_set = set(allowed.tolist())
        allowed_set.discard(self.eos)
        if closing:
            for token in self.closers:
                if token in allowed_set:
                    return token
        return rng.choice(sorted(allowed_set))

    def text(self, ids: list[int]) -> str:
        # No clean-up: HF's clean_up_tokenization_spaces would edit the JSON strings' contents.
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def validate(document: str, schema: Any) -> Any:
    value = json.loads(document)
    jsonschema.validate(value, schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return value


@pytest.mark.parametrize("name,schema", SCHEMAS, ids=[name for name, _ in SCHEMAS])
def test_random_walks_fit_the_schema(tokenizer, name, schema):
    grammar = compile_response_format(json_schema_format(schema), tokenizer)
    walker = Walker(tokenizer)
    for seed in range(3):
        validate(walker.walk(grammar, seed), schema)


def test_json_object_gives_objects(tokenizer):
    grammar = compile_response_format({"type": "json_object"}, tokenizer)
    walker = Walker(tokenizer)
    for seed in range(8):
        assert isinstance(validate(walker.walk(grammar, seed), OBJ), dict)


def test_constrained_walk_is_reproducible_and_independent(tiny_tokenizer):
    grammar = compile_response_format(json_schema_format(SCHEMAS[-4][1]), tiny_tokenizer)
    walker = Walker(tiny_tokenizer)
    first = walker.walk(grammar, 7)
    assert walker.walk(grammar, 8) != first  # another request's walk ...
    assert walker.walk(grammar, 7) == first  # ... left the compiled grammar's template untouched


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": obj(
                {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                required=["city"],
            ),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add-points",
            "parameters": {
                "$defs": {"pt": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
                **obj({"points": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "minItems": 1, "maxItems": 3}}),
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: arguments are {}
]
EMPTY_ARGUMENTS = {"type": "object", "maxProperties": 0}


def tool_parameters(name: str) -> dict[str, Any]:
    for tool in TOOLS:
        if tool["function"]["name"] == name:
            return tool["function"].get("parameters", EMPTY_ARGUMENTS)
    raise AssertionError(f"unknown tool {name}")


def test_required_tool_calls_fit_their_tool(tokenizer):
    grammar = compile_tool_call(TOOLS, "required", tokenizer)
    walker = Walker(tokenizer)
    names = set()
    for seed in range(12):
        name, arguments = parse_tool_call(walker.walk(grammar, seed))
        jsonschema.validate(json.loads(arguments), tool_parameters(name))
        names.add(name)
    assert len(names) >= 2  # the walks reach more than one tool


@pytest.mark.parametrize("tool", ["get_weather", "add-points", "now"])
def test_named_tool_calls_call_that_tool(tokenizer, tool):
    choice = {"type": "function", "function": {"name": tool}}
    grammar = compile_tool_call(TOOLS, choice, tokenizer)
    walker = Walker(tokenizer)
    for seed in range(3):
        name, arguments = parse_tool_call(walker.walk(grammar, seed))
        assert name == tool
        jsonschema.validate(json.loads(arguments), tool_parameters(tool))


REFUSED_FORMATS = [
    ("not-object", "json", "response_format", "must be an object"),
    ({"type": "yaml"}, None, "response_format.type", "must be"),
    ({"type": "json_schema"}, None, "response_format.json_schema", "must be an object"),
    (
        {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": OBJ}},
        None,
        "response_format.json_schema.name",
        "characters",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": OBJ, "strict": "yes"}},
        None,
        "response_format.json_schema.strict",
        "boolean",
    ),
    (
        {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}},
        None,
        "response_format.json_schema.schema",
        "JSON schema",
    ),
]
S = "response_format.json_schema.schema"
REFUSED_SCHEMAS = [
    # the metaschema
    (obj({"age": {"type": "integer", "minimum": "ten"}}), f"{S}.properties.age.minimum", "not of type 'number'"),
    (obj({"age": {"type": "integr"}}), f"{S}.properties.age.type", "integr"),
    ({"type": "object", "required": "name"}, f"{S}.required", "not of type 'array'"),
    (obj({"first name": {"type": "string", "maxLength": -1}}), f'{S}.properties["first name"].maxLength', "minimum"),
    (obj({"items": {"type": "array", "items": [{"type": "string"}]}}), f"{S}.properties.items.items", "not of type"),
    # keywords the grammar cannot enforce
    (obj({"xs": {"type": "array", "uniqueItems": True}}), f"{S}.properties.xs.uniqueItems", "uniqueItems"),
    (obj({"v": {"not": {"type": "string"}}}), f"{S}.properties.v.not", "not"),
    (obj({"v": {"if": {"type": "integer"}, "then": {"minimum": 1}}}), f"{S}.properties.v.if", "if, then"),
    (obj({"xs": {"type": "array", "contains": {"type": "integer"}}}), f"{S}.properties.xs.contains", "contains"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, f"{S}.propertyNames", "propertyNames"),
    ({"type": "object", "unevaluatedProperties": False}, f"{S}.unevaluatedProperties", "unevaluatedProperties"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, f"{S}.allOf", "merge"),
    (
        obj({"xs": {"type": "array", "prefixItems": [{}], "additionalItems": False}}),
        f"{S}.properties.xs.additionalItems",
        "prefixItems",
    ),
    (obj({"s": {"type": "string", "format": "credit-card"}}), f"{S}.properties.s.format", "credit-card"),
    (obj({"n": {"minimum": 3}}), f"{S}.properties.n.minimum", '"type": "integer" or "number"'),
    (obj({"xs": {"items": {"type": "integer"}}}), f"{S}.properties.xs.items", '"type": "array"'),
    (obj({"x": {"type": "number", "multipleOf": 0.5}}), f"{S}.properties.x.multipleOf", "integer"),
    ({"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, f"{S}.required[1]", "'b'"),
    (
        {"$defs": {"n": {"type": "integer"}}, **obj({"a": {"$ref": "#/$defs/n", "minimum": 3}})},
        f"{S}.properties.a.$ref",
        "minimum",
    ),
    (obj({"a": {"$ref": "#/$defs/missing"}}), f"{S}.properties.a.$ref", "does not resolve"),
    (obj({"r": {"$ref": "https://example.com/schema.json"}}), f"{S}.properties.r.$ref", "local"),
    (obj({"v": {"type": "integer", "anyOf": [{"type": "integer", "minimum": 5}]}}), f"{S}.properties.v.anyOf", "type"),
    (obj({"v": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}), f"{S}.properties.v.oneOf", "anyOf"),
    # patterns: misread constructs (refused before compiling), then ones the engine itself refuses (located)
    (obj({"s": {"type": "string", "pattern": "(?=a)b"}}), f"{S}.properties.s.pattern", "look-ahead"),
    (obj({"s": {"type": "string", "pattern": "[[:alpha:]]+"}}), f"{S}.properties.s.pattern", "POSIX"),
    (obj({"s": {"type": "string", "pattern": "(a)\\1"}}), f"{S}.properties.s.pattern", "Backreference"),
    (obj({"s": {"type": "string", "pattern": "\\bword"}}), f"{S}.properties.s.pattern", "Word boundary"),
    (
        {"type": "object", "patternProperties": {"^(x": {"type": "integer"}}, "additionalProperties": False},
        f"{S}.patternProperties",
        "parenthesis",
    ),
    # contradictions
    (obj({"n": {"type": "integer", "minimum": 5, "maximum": 2}}), f"{S}.properties.n.minimum", "above"),
    (obj({"s": {"type": "string", "minLength": 9, "maxLength": 3}}), f"{S}.properties.s.minLength", "above"),
    (obj({"e": {"enum": []}}), f"{S}.properties.e.enum", "enum"),
    (obj({"k": {"type": "string", "const": 3}}), f"{S}.properties.k.const", "does not fit"),
    (False, S, "allows nothing"),
    # what the engine would get wrong without a word (test_silent_gaps_of_the_engine_are_refused shows it would)
    (obj({"s": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}}), f"{S}.properties.s.maxLength", "pattern"),
    (obj({"s": {"type": "string", "format": "uuid", "minLength": 40}}), f"{S}.properties.s.minLength", "format uuid"),
    (obj({"x": {"type": "number", "minimum": 1e-7, "maximum": 2e-7}}), f"{S}.properties.x.minimum", "6 decimal"),
    # past a float's range: refused, not an OverflowError
    (obj({"x": {"type": "number", "minimum": -(10**310), "maximum": 5}}), f"{S}.properties.x.minimum", "cannot"),
    (
        obj({"x": {"type": ["number", "null"], "exclusiveMinimum": 0.5, "maximum": 0.5000005}}),
        f"{S}.properties.x.exclusiveMinimum",
        "6 decimal",
    ),
]


@pytest.mark.parametrize("response_format,_,path,words", REFUSED_FORMATS)
def test_malformed_response_format_names_the_field(tiny_tokenizer, response_format, _, path, words):
    with pytest.raises(SchemaError) as info:
        compile_response_format(response_format, tiny_tokenizer)
    assert info.value.path == path
    assert words in info.value.message
    assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize(
    "schema,path,words", REFUSED_SCHEMAS, ids=[p.removeprefix(S) or "root" for _, p, _ in REFUSED_SCHEMAS]
)
def test_invalid_or_unsupported_schema_names_the_path(tiny_tokenizer, schema, path, words):
    for _ in range(2):  # the second refusal may come from the cache: the same path
        with pytest.raises(SchemaError) as info:
            compile_response_format(json_schema_format(schema), tiny_tokenizer)
        assert info.value.path == path, info.value
        assert words in info.value.message


# (schema, a document xgrammar's own grammar for it accepts though the schema does not, or None: accepted by the
# checks, and every walk fits). The refused ones are what the checks above add to xgrammar: it would ignore a
# length beside a pattern or format, and write an empty value for number bounds with no 6-decimal number between.
SILENT_GAPS = [
    ({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, '"abcdef"'),
    ({"type": "string", "pattern": "^a+$", "minLength": 2}, '"a"'),
    ({"type": "string", "format": "date", "maxLength": 4}, '"2024-01-31"'),
    ({"type": "string", "format": "ipv4", "minLength": 10}, '"1.2.3.4"'),
    ({"type": "string", "minLength": 2, "maxLength": 3}, None),
    ({"type": "string", "pattern": "^[a-z]{2,3}$"}, None),
    ({"type": "number", "minimum": 1e-7, "maximum": 2e-7}, ""),
    ({"type": "number", "minimum": 0.1234567, "maximum": 0.1234568}, ""),
    ({"type": "number", "exclusiveMinimum": 0.000001, "exclusiveMaximum": 0.000002}, ""),
    ({"type": "number", "minimum": 0.000001, "maximum": 0.000001}, None),
    ({"type": "number", "exclusiveMinimum": 0.0000015, "maximum": 0.000002}, None),
    ({"type": "number", "minimum": 1e-7, "maximum": 1}, None),
    ({"type": "number", "minimum": -1e30, "maximum": 1e30}, None),
]


@pytest.mark.parametrize("schema,accepted_anyway", SILENT_GAPS, ids=[json.dumps(s) for s, _ in SILENT_GAPS])
def test_silent_gaps_of_the_engine_are_refused(tiny_tokenizer, schema, accepted_anyway):
    from xgrammar.testing import _is_grammar_accept_string

    from engine.structured.worker import JSON_OPTIONS

    if accepted_anyway is not None:
        raw = xgrammar.Grammar.from_json_schema(json.dumps(schema), **JSON_OPTIONS)
        assert _is_grammar_accept_string(raw, accepted_anyway)  # xgrammar alone lets it through...
        with pytest.raises((ValueError, jsonschema.ValidationError)):  # ...though not JSON that fits the schema
            jsonschema.validate(json.loads(accepted_anyway), schema)
        with pytest.raises(SchemaError) as info:
            compile_response_format(json_schema_format(schema), tiny_tokenizer)
        assert info.value.path.startswith(S)
        return
    grammar = compile_response_format(json_schema_format(schema), tiny_tokenizer)
    walker = Walker(tiny_tokenizer)
    for seed in range(3):
        validate(walker.walk(grammar, seed), schema)


# Patterns xgrammar compiles but no request can finish: its matcher allows a token when it continues what the grammar
# can read, without asking whether anything can complete it, so a value is started and then no token at all is
# allowed, mid-generation. Refused up front (engine/structured/automata.py reads xgrammar's own automata), at the
# keyword's path: (schema, path, words in the message).
P = f"{S}.properties.s"
NO_NAME = "^[^\\s\\S]$"  # a property-name pattern that matches nothing
UNMATCHABLE = [
    (obj({"s": {"type": "string", "pattern": "[^\\s\\S]"}}), f"{P}.pattern", "matches no string"),
    ({"type": "string", "pattern": "^[^\\d\\D]+$"}, f"{S}.pattern", "matches no string"),
    (obj({"s": {"type": "string", "pattern": "^ab[^\\w\\W]$"}}, required=[]), f"{P}.pattern", "matches no string"),
    (obj({"s": {"type": "string", "pattern": "^(yes|no[^\\s\\S])$"}}), f"{P}.pattern", "part of the pattern"),
    (obj({"s": {"type": "string", "pattern": "^a\nb$"}}), f"{P}.pattern", "every string"),  # a raw newline
    (obj({"s": {"type": "string", "pattern": "^a\\tb$"}}), f"{P}.pattern", "control character"),
    (obj({"s": {"type": "string", "pattern": "^(a\\tx|b)$"}}), f"{P}.pattern", "some strings"),
    (obj({"s": {"type": "string", "pattern": '^(a"x|b)$'}}), f"{P}.pattern", "must escape"),
    (
        obj({"xs": {"type": "array", "items": {"type": "string", "pattern": "[^\\s\\S]"}, "maxItems": 2}}),
        f"{S}.properties.xs.items.pattern",
        "matches no string",
    ),
    (
        obj({"v": {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": "[^\\s\\S]"}]}}),
        f"{S}.properties.v.anyOf[1].pattern",
        "matches no string",
    ),
    (
        {"$defs": {"word": {"type": "string", "pattern": "^x[^\\s\\S]$"}}, **obj({"w": {"$ref": "#/$defs/word"}})},
        f"{S}.$defs.word.pattern",
        "matches no string",
    ),
    (
        {"type": "object", "patternProperties": {NO_NAME: {"type": "integer"}}, "additionalProperties": False},
        f"{S}.patternProperties[{json.dumps(NO_NAME)}]",
        "property-name pattern",
    ),
    # anchors away from the ends: xgrammar drops them, so `a^` (nothing matches) would be read as "a"
    (obj({"s": {"type": "string", "pattern": "a^"}}), f"{P}.pattern", "^ away from the start"),
    (obj({"s": {"type": "string", "pattern": "^a$b"}}), f"{P}.pattern", "$ away from the end"),
    (obj({"s": {"type": "string", "pattern": "^(^ab)+$"}}), f"{P}.pattern", "(at index 2)"),
    # contradictions the checks already refused before compiling: a length beside a pattern, enum against pattern
    (obj({"s": {"type": "string", "pattern": "^[a-z]{2}$", "minLength": 5}}), f"{P}.minLength", "pattern"),
    (obj({"s": {"type": "string", "pattern": "^[a-z]+$", "enum": ["ok", "NO"]}}), f"{P}.enum", '"NO" does not fit'),
    (obj({"s": {"type": "string", "pattern": "^[0-9]+$", "const": "x"}}), f"{P}.const", "does not fit"),
]
# Their satisfiable neighbours: accepted, and every walk fits the schema.
MATCHABLE = [
    obj({"s": {"type": "string", "pattern": "^(yes|no)$"}}),
    obj({"s": {"type": "string", "pattern": "^a\\n?b$"}}),  # the newline is optional: "ab"
    obj({"s": {"type": "string", "pattern": "^a(\\t|b)$"}}),  # the tab is never written: "ab"
    obj({"s": {"type": "string", "pattern": "^a[^\\s\\S]*b$"}}),  # an empty class, zero times: "ab"
    obj({"s": {"type": "string", "pattern": "^a$|^bc$"}}),  # anchors at both ends of each alternative
    obj({"s": {"type": "string", "pattern": "^(^a$|^bc$)$"}}),
    obj({"s": {"type": "string", "pattern": "^[\\^$]{1,3}$"}}),  # ^ and $ in a class are characters
    obj({"s": {"type": "string", "pattern": "^[a-z]{2}$", "enum": ["ok", "no"]}}),
    {"type": "object", "patternProperties": {"^x[0-9]$": {"type": "integer"}}, "additionalProperties": False},
]


@pytest.mark.parametrize("schema,path,words", UNMATCHABLE, ids=[p.removeprefix(S) + w for _, p, w in UNMATCHABLE])
def test_a_pattern_that_can_match_nothing_is_refused_at_its_path(tiny_tokenizer, schema, path, words):
    for _ in range(2):  # the second refusal may come from the cache: the same path
        with pytest.raises(SchemaError) as info:
            compile_response_format(json_schema_format(schema), tiny_tokenizer)
        assert info.value.path == path, info.value
        assert words in info.value.message, info.value
        assert str(info.value).startswith(f"{path}: ")


@pytest.mark.parametrize("schema", MATCHABLE, ids=[json.dumps(s)[-40:] for s in MATCHABLE])
def test_a_pattern_that_can_match_is_accepted_and_kept_to(tokenizer, schema):
    grammar = compile_response_format(json_schema_format(schema), tokenizer)
    walker = Walker(tokenizer)
    for seed in range(3):
        validate(walker.walk(grammar, seed), schema)


@pytest.mark.parametrize(
    "pattern,optional,prefix",
    [
        ("[^\\s\\S]", False, '{"s": "'),
        ("[^\\s\\S]", True, '{"s": "'),  # {} would fit, yet "s" may be started
        ("^(yes|no[^\\s\\S])$", False, '{"s": "no'),
        ("^a\\tb$", False, '{"s": "a'),  # the vocabulary never writes a raw tab
    ],
)
def test_without_the_check_xgrammar_starts_them_and_dead_ends(tiny_tokenizer, pattern, optional, prefix):
    """What the refusals above prevent: xgrammar's own grammar for such a schema lets the value start, then allows
    no token at all (not even EOS): the request would fail mid-generation."""
    vocab = vocabulary(tiny_tokenizer)
    schema = obj({"s": {"type": "string", "pattern": pattern}}, required=[] if optional else None)
    compiled = xgrammar.GrammarCompiler(vocab.info, max_threads=1, cache_enabled=False).compile_json_schema(
        json.dumps(schema), **JSON_OPTIONS
    )
    matcher = xgrammar.GrammarMatcher(compiled)
    assert matcher.accept_string(prefix)
    mask = torch.zeros(vocab.words, dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask)
    assert not bool(mask.any())
    with pytest.raises(SchemaError):
        compile_response_format(json_schema_format(schema), tiny_tokenizer)


def test_without_the_check_xgrammar_reads_a_misplaced_anchor_as_nothing():
    """`a^` matches no string, but xgrammar drops the anchor and accepts "a"."""
    import re

    from xgrammar.testing import _is_grammar_accept_string

    raw = xgrammar.Grammar.from_json_schema(json.dumps({"type": "string", "pattern": "a^"}), **JSON_OPTIONS)
    assert _is_grammar_accept_string(raw, '"a"')
    assert re.search("a^", "a") is None
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("a", {"type": "string", "pattern": "a^"})


def _byte_compiler() -> xgrammar.GrammarCompiler:
    info = xgrammar.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[256])
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)


@pytest.mark.parametrize(
    "pattern,writable,anything",
    [
        ("[^\\s\\S]", EMPTY, EMPTY),
        ("(a|b[^\\s\\S])", DEAD_END, DEAD_END),
        ("(ab|ab[^\\s\\S])", DEAD_END, DEAD_END),  # a part that matches nothing, beside one that does
        ("a\\nb", EMPTY, None),  # only control characters, which no vocabulary writes
        ("(a\\nb|c)", DEAD_END, None),  # "a" can be written, and then nothing
        ("a(\\n|b)", None, None),  # "a" then "b"
        ("a\\n?b", None, None),
        ("a[^\\s\\S]*b", None, None),
        ("(ab){2,3}x?", None, None),
        ("[a-z]{1,300}", None, None),
        ("é+|[^a]", None, None),
    ],
)
def test_automata_tell_empty_and_dead_end_grammars(pattern, writable, anything):
    grammar = _byte_compiler().compile_regex(pattern).grammar
    automata = Automata.of(grammar)
    assert automata.problem() == writable
    assert automata.problem(ALL_BYTES) == anything


def test_automata_read_every_byte_xgrammar_prints():
    """Every byte an edge can hold, in each of xgrammar's escapes (\\0, \\a, \\x1f, \\", \\', \\?, \\\\, \\xc3 ...),
    is read back as that byte."""
    ascii_bytes = " | ".join(f'"\\x{b:02x}" "z"' for b in range(128))
    automata = Automata.parse(_print(_byte_compiler().compile_grammar(f"root ::= {ascii_bytes}").grammar))
    assert _bytes_on_edges(automata) == set(range(128))
    automata = Automata.parse(_print(_byte_compiler().compile_grammar("root ::= [\\u0080-\\u07ff]").grammar))
    assert _bytes_on_edges(automata) == set(range(0xC2, 0xE0)) | set(range(0x80, 0xC0))


def _print(grammar: Any) -> str:
    from xgrammar.testing import _print_grammar_fsms

    return _print_grammar_fsms(grammar)


def _bytes_on_edges(automata: Automata) -> set[int]:
    return {
        b
        for edges in automata.edges.values()
        for kind, low, high, _ in edges
        if kind == 0
        for b in range(low, high + 1)
    }


def test_automata_in_an_unknown_form_are_an_error_and_the_check_lets_the_schema_through(monkeypatch):
    header = "Rule 0: root, FSM: CompactFSM(num_states=1, start=0, end=[0], edges=["
    for text in ("not automata", f"{header}\n0: [Token(5)->0]\n])", "Rule 0: other, FSM: None\n"):
        with pytest.raises(AutomataFormatError):
            Automata.parse(text).problem()
    # In the compile child: a grammar whose automata cannot be read is compiled, not refused (the check fails open).
    schema = json.dumps(obj({"s": {"type": "string", "pattern": "[^\\s\\S]"}}))
    compiled = _byte_compiler().compile_json_schema(schema, **JSON_OPTIONS)
    assert unsatisfiable(compiled, schema, xgrammar, JSON_OPTIONS) is not None

    def unreadable(grammar: Any) -> Automata:
        raise AutomataFormatError("a new xgrammar")

    monkeypatch.setattr(Automata, "of", staticmethod(unreadable))
    assert unsatisfiable(compiled, schema, xgrammar, JSON_OPTIONS) is None


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory):
    proc, base = start_engine_server(tmp_path_factory.mktemp("engine") / "engine.log", "--max-model-len", "256")
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_unmatchable_patterns_are_a_400_through_the_openai_client(engine_url):
    client = openai.OpenAI(base_url=f"{engine_url}/v1", api_key="x", max_retries=0, timeout=120)
    ask: dict[str, Any] = {"model": "tiny-random", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40}
    unmatchable = obj({"s": {"type": "string", "pattern": "^(yes|no[^\\s\\S])$"}})
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**ask, response_format=json_schema_format(unmatchable))
    assert info.value.status_code == 400
    assert info.value.body["type"] == "invalid_request_error"
    assert info.value.body["message"].startswith(f"{P}.pattern: part of the pattern")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**ask, tools=[_tool("f", unmatchable)], tool_choice="required")
    assert info.value.status_code == 400
    assert info.value.body["message"].startswith("tools[0].function.parameters.properties.s.pattern: ")
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model="tiny-random",
            prompt="hi",
            max_tokens=10,
            extra_body={"response_format": json_schema_format(obj({"s": {"type": "string", "pattern": "a^"}}))},
        )
    assert info.value.status_code == 400 and info.value.body["message"].startswith(f"{P}.pattern: ")
    # The satisfiable neighbour is served, and its answer fits.
    matchable = obj({"s": {"type": "string", "pattern": "^(yes|no)$"}})
    answer = client.chat.completions.create(**ask, response_format=json_schema_format(matchable), temperature=0)
    assert answer.choices[0].finish_reason == "stop"
    assert validate(answer.choices[0].message.content or "", matchable)["s"] in ("yes", "no")


def _tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


REFUSED_TOOLS = [
    ([], "required", "tools", "non-empty"),
    ([{"type": "retrieval"}], "required", "tools[0].type", "function"),
    ([_tool("ok"), {"type": "function"}], "required", "tools[1].function", "name"),
    ([_tool("ok"), _tool("has space")], "required", "tools[1].function.name", "characters"),
    ([_tool("ok"), _tool("x" * 65)], "required", "tools[1].function.name", "characters"),
    ([_tool("ok"), _tool("ok")], "required", "tools[1].function.name", "duplicate"),
    ([_tool("ok", {"type": "string"})], "required", "tools[0].function.parameters.type", "object"),
    (
        [_tool("ok"), _tool("b", obj({"x": {"type": "integer", "maximum": "9"}}))],
        "required",
        "tools[1].function.parameters.properties.x.maximum",
        "number",
    ),
    (
        [_tool("ok"), _tool("b", obj({"x": {"type": "array", "uniqueItems": True}}))],
        "required",
        "tools[1].function.parameters.properties.x.uniqueItems",
        "unsupported",
    ),
    (
        [_tool("ok"), _tool("b", obj({"x": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}))],
        "required",
        "tools[1].function.parameters.properties.x.oneOf",
        "anyOf",
    ),
    (  # refused by the engine itself, in the union of the tools: located in the tool
        [_tool("ok"), _tool("b", obj({"x": {"type": "string", "pattern": "(a)\\1"}}))],
        "required",
        "tools[1].function.parameters.properties.x.pattern",
        "Backreference",
    ),
    (
        [_tool("a", obj({"x": {"type": "string", "pattern": "\\bx"}})), _tool("b")],
        {"type": "function", "function": {"name": "a"}},
        "tools[0].function.parameters.properties.x.pattern",
        "Word boundary",
    ),
    (  # a pattern that matches nothing, found in the union of the tools' grammar: located in the tool
        [_tool("ok"), _tool("b", obj({"x": {"type": "string", "pattern": "[^\\s\\S]"}}))],
        "required",
        "tools[1].function.parameters.properties.x.pattern",
        "matches no string",
    ),
    (
        [_tool("a", obj({"x": {"type": "string", "pattern": "^(a|b[^\\d\\D])$"}}, required=[])), _tool("b")],
        {"type": "function", "function": {"name": "a"}},
        "tools[0].function.parameters.properties.x.pattern",
        "can match nothing",
    ),
    ([_tool("ok")], {"type": "function", "function": {"name": "missing"}}, "tool_choice.function.name", "missing"),
    ([_tool("ok")], "auto", "tool_choice", "required"),
]


@pytest.mark.parametrize("tools,choice,path,words", REFUSED_TOOLS, ids=[p for _, _, p, _ in REFUSED_TOOLS])
def test_invalid_tools_name_the_path(tiny_tokenizer, tools, choice, path, words):
    with pytest.raises(SchemaError) as info:
        compile_tool_call(tools, choice, tiny_tokenizer)
    assert info.value.path == path, info.value
    assert words in info.value.message


def test_a_schema_sent_again_shares_the_running_compile(tiny_tokenizer, monkeypatch):
    release = threading.Event()
    calls = []
    real_compile = grammars_module.worker.compile

    def slow_compile(*args, **kwargs):
        calls.append(args)
        release.wait(10)
        return real_compile(*args, **kwargs)

    monkeypatch.setattr(grammars_module.worker, "compile", slow_compile)
    schema = obj({"shared": {"type": "integer", "minimum": 424242}})
    results: list[CompiledGrammar] = []
    threads = [
        threading.Thread(
            target=lambda: results.append(compile_response_format(json_schema_format(schema), tiny_tokenizer))
        )
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    release.set()
    for thread in threads:
        thread.join(10)
    assert len(calls) == 1 and len(results) == 3 and results[0] is results[1] is results[2]


def pathological_schema(properties: int) -> dict[str, Any]:
    """Nested counted repetitions, one per property: xgrammar expands each (0.5 to 2 s apiece on a 2-core CPU,
    xgrammar 0.2.9), with no limit of its own, so the compile takes about `properties` seconds."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"  # distinct patterns: nothing shared
    return obj(
        {
            f"p{i}": {"type": "string", "pattern": f"^({c}{{1,200}}){{1,200}}$"}
            for i, c in enumerate(letters[:properties])
        }
    )


def test_a_pathological_schema_returns_within_its_time_bound(tiny_tokenizer):
    schema = pathological_schema(12)  # ~12 s to compile: 24 times the bound below
    start = time.monotonic()
    with pytest.raises(SchemaError) as info:
        compile_response_format(json_schema_format(schema), tiny_tokenizer, timeout_s=0.5)
    assert time.monotonic() - start < 0.5 + 1.0
    assert info.value.path == S and "longer than 0.5 s" in info.value.message
    # The refusal is kept: the same schema again is refused at once, without compiling.
    start = time.monotonic()
    with pytest.raises(SchemaError, match="longer than 0.5 s"):
        compile_response_format(json_schema_format(schema, name="again"), tiny_tokenizer, timeout_s=0.5)
    assert time.monotonic() - start < 0.25
    # The worker was killed, not left compiling; a fresh one serves the next schema.
    grammar = compile_response_format(json_schema_format(obj({"after": {"type": "boolean"}})), tiny_tokenizer)
    assert Walker(tiny_tokenizer).walk(grammar, 0) in ('{"after": true}', '{"after": false}')


def test_tools_that_compile_past_the_bound_together_are_refused_within_it(tiny_tokenizer):
    """Eight tools of about a second each: their union passes the bound, and is refused on `tools` then; none is
    compiled again alone to locate a fault (that took eight more seconds, past any bound)."""
    letters = pathological_schema(8)["properties"]
    tools = [_tool(f"t{i}", obj({"p": pattern})) for i, pattern in enumerate(letters.values())]
    start = time.monotonic()
    with pytest.raises(SchemaError) as info:
        compile_tool_call(tools, "required", tiny_tokenizer, timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 1.0
    assert info.value.path == "tools" and "longer than 1 s" in info.value.message


def test_a_union_refused_as_a_whole_is_located_within_the_bound(tiny_tokenizer, monkeypatch):
    """When the engine refuses the tools' union without saying where, each tool is compiled alone to find the one
    at fault, in what is left of the bound; past it the refusal stays on `tools`. (The engine is stood in for: it
    refuses the union, refuses the tool named "bad" at its "x", and takes 0.3 s for every other tool.)"""
    real_compile = grammars_module.worker.compile

    def compile_(key: str, info: Any, schema_json: str, *, timeout_s: float) -> str:
        schema = json.loads(schema_json)
        if "anyOf" in schema:
            raise WorkerRefusal("the union is too large", None)
        if schema["properties"]["name"]["const"].startswith("bad"):
            raise WorkerRefusal("cannot enforce x", ["properties", "arguments", "properties", "x"])
        time.sleep(min(0.3, timeout_s))
        if timeout_s < 0.3:
            raise CompileTimeout()
        return real_compile(key, info, schema_json, timeout_s=timeout_s)

    monkeypatch.setattr(grammars_module.worker, "compile", compile_)
    args = obj({"x": {"type": "integer"}})
    located = [_tool("loc_a", args), _tool("bad_b", args), _tool("loc_c", args)]
    with pytest.raises(SchemaError) as info:
        compile_tool_call(located, "required", tiny_tokenizer)
    assert info.value.path == "tools[1].function.parameters.properties.x" and "cannot enforce x" in info.value.message

    many = [_tool(f"many_{i}", args) for i in range(6)]  # 1.8 s to compile one by one
    start = time.monotonic()
    with pytest.raises(SchemaError) as info:
        compile_tool_call(many, "required", tiny_tokenizer, timeout_s=1.0)
    assert time.monotonic() - start < 1.0 + 0.5
    assert info.value.path == "tools" and "the union is too large" in info.value.message
    # The tool cut short by what was left of the bound is no cached timeout for a request that names it.
    choice = {"type": "function", "function": {"name": "many_3"}}
    assert compile_tool_call(many, choice, tiny_tokenizer).kind == "tool_call"


def test_cache_returns_the_same_grammar(tiny_tokenizer, monkeypatch):
    schema = obj({"cached": {"type": "string", "maxLength": 7}})
    first = compile_response_format(json_schema_format(schema), tiny_tokenizer)
    again = compile_response_format(json_schema_format(json.loads(json.dumps(schema)), name="other"), tiny_tokenizer)
    assert again is first  # the schema's digest, not the request object or its name
    reordered = obj({"cached": {"maxLength": 7, "type": "string"}})
    assert compile_response_format(json_schema_format(reordered), tiny_tokenizer) is not first
    assert compile_tool_call(TOOLS, "required", tiny_tokenizer) is compile_tool_call(TOOLS, "required", tiny_tokenizer)
    # Bounded: past its size the least recently used grammar is compiled again.
    monkeypatch.setattr(grammars_module.cache, "size", 2)
    for n in range(3):
        compile_response_format(json_schema_format(obj({"n": {"type": "integer", "maximum": n}})), tiny_tokenizer)
    assert len(grammars_module.cache) == 2
    assert compile_response_format(json_schema_format(schema), tiny_tokenizer) is not first


def test_bitmask_rows_wider_than_the_vocabulary(tiny_tokenizer):
    grammar = compile_response_format({"type": "json_object"}, tiny_tokenizer)
    words = (len(tiny_tokenizer) + 31) // 32
    row = torch.full((words + 3,), -1, dtype=torch.int32)  # a padded LM head
    grammar.constraint().fill_bitmask(row)
    assert row[words:].eq(0).all() and row[:words].ne(0).any()
    with pytest.raises(ValueError):
        grammar.constraint().fill_bitmask(torch.zeros(words, dtype=torch.int64))
    with pytest.raises(ValueError):
        grammar.constraint().fill_bitmask(torch.zeros(words - 1, dtype=torch.int32))
    with pytest.raises(ValueError):
        grammar.constraint().fill_bitmask(torch.zeros(2 * words, dtype=torch.int32)[::2])  # a column, not a row


def test_parse_tool_call():
    assert parse_tool_call('{"name": "f", "arguments": {"a": [1, "é"]}}') == ("f", '{"a": [1, "é"]}')
    with pytest.raises(ValueError):
        parse_tool_call('{"name": "f", "arguments": {"a": ')  # cut short by max_tokens
    with pytest.raises(ValueError):
        parse_tool_call('{"arguments": {}}')


def test_parse_auto_tool_calls():
    text = (
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>'
    )
    content, calls = parse_auto_tool_calls(text)
    assert content == "Let me check."
    assert calls == [("get_weather", '{"city": "Paris"}'), ("now", "{}")]
    assert parse_auto_tool_calls("Just an answer.") == ("Just an answer.", [])
    # Not a call: stays in the content. An unclosed last block (EOS before the closing tag) is still a call.
    broken = "<tool_call>{not json}</tool_call> tail"
    assert parse_auto_tool_calls(broken) == (broken.strip(), [])
    assert parse_auto_tool_calls('<tool_call>{"name": "now", "arguments": {}}') == ("", [("now", "{}")])


def test_template_supports_tools(tiny_model_dir):
    tokenizer = load_tokenizer(tiny_model_dir)  # its own copy: the template is changed below
    assert not template_supports_tools(tokenizer)  # plain ChatML
    tokenizer.chat_template = "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages[0]['content'] }}"
    assert template_supports_tools(tokenizer)


def test_needs_grammar():
    assert not needs_grammar(None) and not needs_grammar({"type": "text"})
    assert needs_grammar({"type": "json_object"}) and needs_grammar({"type": "json_schema"})
