"""Checking a JSON schema before it is compiled, so a refusal names the offending part.

The grammar engine (xgrammar) silently ignores what it does not implement, so this module only lets through
what it enforces, measured keyword by keyword (tests/engine/test_structured.py holds the walks that prove it):
1. the JSON Schema metaschema (Draft 2020-12 unless `$schema` names another draft), through `jsonschema`;
2. standard keywords the engine cannot enforce (`not`, `if`, `allOf`, `uniqueItems`, ...), formats it does not
   check, `multipleOf` off integers, a keyword of one type without that `type` beside it (`minimum` alone),
   `$ref` or `anyOf`/`oneOf` with sibling assertions, `required` names that `properties` lacks, remote `$ref`s,
   and a `oneOf` whose options may overlap (one told apart by a required `const` property is an `anyOf`);
3. contradictions (`minimum` above `maximum`, an empty `enum`, a `const` outside its own `type`), and what the
   engine would get wrong without a word: `minLength`/`maxLength` beside a `pattern` or `format` (it ignores
   the length), number bounds with no number of at most 6 decimal places between them (an empty value), a `^` or
   `$` away from the ends of a pattern (it drops anchors: `a^`, which matches nothing, would let "a" through).
A pattern that matches nothing (`[^\\s\\S]`), or whose matches need what the engine cannot write in a string, is
found in the compiled grammar instead (worker.py, automata.py), with a path too.
Each raises `SchemaError` with a path into the request (`response_format.json_schema.schema.properties.age.
minimum`). Keywords JSON Schema does not define are annotations by the spec, and are ignored.
"""

from __future__ import annotations

import json
import re
from decimal import ROUND_CEILING, Decimal, localcontext
from typing import Any

import jsonschema

from engine.structured.keywords import (
    ANNOTATIONS,
    BOUNDS,
    FORMAT_PATTERNS,
    FORMATS,
    MISREAD_REGEX,
    TYPED,
    UNSUPPORTED,
    Path,
    misplaced_anchor,
    resolve_ref,
    subschemas,
)

_NAME = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$-]*$")


class SchemaError(ValueError):
    """An invalid or unsupported request schema. `path` is a JSON path into the request
    (`response_format.json_schema.schema.properties.age.minimum`); `str()` is "path: message"."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path
        self.message = message


def format_path(prefix: str, path: Path) -> str:
    """`prefix` followed by `.key`, `[index]` or `["odd key"]` for each step of `path`."""
    out = prefix
    for step in path:
        if isinstance(step, int):
            out += f"[{step}]"
        elif _NAME.match(step):
            out += f".{step}" if out else step
        else:
            out += f"[{json.dumps(step, ensure_ascii=False)}]"
    return out


def check_schema(schema: Any, prefix: str) -> None:
    """Raise SchemaError (a path under `prefix`) unless `schema` is a valid JSON Schema that the grammar engine
    enforces in full."""
    if schema is False:
        raise SchemaError(prefix, "the schema `false` allows nothing")
    if not isinstance(schema, (dict, bool)):
        raise SchemaError(prefix, f"a JSON schema must be an object, not {type(schema).__name__}")
    _check_metaschema(schema, prefix)
    for path, node in subschemas(schema):
        _Node(schema, node, path, prefix).check()


def _check_metaschema(schema: dict[str, Any] | bool, prefix: str) -> None:
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    # No format checker: `pattern` is the grammar engine's regex syntax to judge, not Python's.
    error = jsonschema.exceptions.best_match(cls(cls.META_SCHEMA).iter_errors(schema))
    if error is not None:
        raise SchemaError(format_path(prefix, tuple(error.absolute_path)), error.message)


class _Node:
    """The checks on one subschema (its children are checked as nodes of their own)."""

    def __init__(self, root: Any, node: dict[str, Any], path: Path, prefix: str) -> None:
        self.root, self.node, self.path, self.prefix = root, node, path, prefix
        declared = node.get("type")
        self.types = {declared} if isinstance(declared, str) else set(declared) if isinstance(declared, list) else None
        if self.types is None and "properties" in node:
            self.types = {"object"}  # the engine reads an untyped schema with properties as an object

    def fail(self, *keys: str | int, message: str) -> SchemaError:
        return SchemaError(format_path(self.prefix, (*self.path, *keys)), message)

    def check(self) -> None:
        node = self.node
        unsupported = sorted(key for key in node if key in UNSUPPORTED)
        if unsupported:
            names, advice = ", ".join(unsupported), UNSUPPORTED[unsupported[0]]
            many = len(unsupported) > 1
            message = f"unsupported keyword{'s' if many else ''} {names}: structured outputs cannot enforce "
            message += ("them" if many else "it") + (f"; {advice}" if advice else "")
            raise self.fail(unsupported[0], message=message)
        if isinstance(node.get("items"), list):
            raise self.fail("items", message="the array form of items is not supported; use prefixItems")
        self._check_combinators()
        self._check_types()
        self._check_values()
        self._check_object()

    def _check_types(self) -> None:
        for key, types in TYPED.items():
            if key not in self.node:
                continue
            if self.types is None or not self.types.intersection(types):
                wanted = " or ".join(f'"{t}"' for t in types)
                raise self.fail(
                    key, message=f'{key} needs "type": {wanted} beside it (the grammar would not enforce it)'
                )
        if "multipleOf" in self.node:
            step = self.node["multipleOf"]
            if self.types != {"integer"} or not float(step).is_integer():
                raise self.fail(
                    "multipleOf", message='multipleOf is enforced only with "type": "integer" and a whole step'
                )
        if isinstance(self.node.get("pattern"), str):
            self._check_pattern(self.node["pattern"], ("pattern",))
        for pattern in self.node.get("patternProperties") or {}:
            self._check_pattern(pattern, ("patternProperties", pattern))
        fmt = self.node.get("format")
        if fmt in FORMAT_PATTERNS and "pattern" in self.node:
            raise self.fail("format", message=f"format {fmt} beside a pattern is not supported; keep one of them")
        lengths = [key for key in ("minLength", "maxLength") if key in self.node]
        if lengths and ("pattern" in self.node or fmt in FORMATS):
            beside = "a pattern" if "pattern" in self.node else f"format {fmt}"
            raise self.fail(
                lengths[0],
                message=f"{' and '.join(lengths)} beside {beside} is not enforced by the grammar engine (it "
                "ignores the length there); write the length into a pattern, e.g. ^[a-z]{2,5}$",
            )
        if isinstance(fmt, str) and fmt not in FORMATS:
            raise self.fail("format", message=f"unsupported format {fmt!r}; supported: {', '.join(sorted(FORMATS))}")

    def _check_pattern(self, pattern: str, keys: Path) -> None:
        """Refuse the regex constructs the engine misreads without an error (its own errors come from compiling;
        a pattern that matches nothing is found in the compiled grammar: worker.py)."""
        for construct, name in MISREAD_REGEX:
            if construct.search(pattern):
                raise self.fail(*keys, message=f"unsupported in a pattern: {name}")
        anchor = misplaced_anchor(pattern)
        if anchor is not None:
            index, char = anchor
            where = "the start of every match" if char == "^" else "the end of every match"
            raise self.fail(
                *keys,
                message=f"unsupported in a pattern: {char} away from {where} (at index {index}); the grammar engine "
                "drops anchors and matches the whole string, so it would let through strings this pattern does not "
                "match (put ^ and $ only at the pattern's ends)",
            )

    def _check_values(self) -> None:
        node = self.node
        for low, high in BOUNDS:
            lo, hi = _number(node.get(low)), _number(node.get(high))
            if lo is None or hi is None:
                continue
            if lo > hi or (lo == hi and "exclusive" in low + high):
                message = f"{low} ({node[low]}) is above {high} ({node[high]}): nothing fits"
                raise self.fail(low, message=message)
            if low in NUMBER_BOUNDS and "number" in (self.types or ()) and not _decimal_between(node, low, high):
                raise self.fail(
                    low,
                    message=f"no number with at most {NUMBER_DECIMALS} decimal places lies between {low} "
                    f"({node[low]}) and {high} ({node[high]}), and the grammar engine writes no more: nothing fits",
                )
        if node.get("enum") == []:
            raise self.fail("enum", message="an empty enum allows no value")
        values = [("const", node["const"])] if "const" in node else []
        values += [("enum", v) for v in node.get("enum") or []]
        rest = {k: v for k, v in node.items() if k not in ("const", "enum") and k not in ANNOTATIONS}
        if values and rest and not {"$ref", "anyOf", "oneOf"}.intersection(rest):
            for key, value in values:  # the engine emits the listed values as they are
                if not jsonschema.Draft202012Validator(rest).is_valid(value):
                    raise self.fail(key, message=f"{json.dumps(value)} does not fit the schema beside it: nothing fits")

    def _check_combinators(self) -> None:
        node = self.node
        siblings = sorted(k for k in node if k not in ANNOTATIONS)
        ref = node.get("$ref")
        if isinstance(ref, str):
            if not (ref == "#" or ref.startswith("#/")):
                raise self.fail("$ref", message=f"only local JSON-pointer references ('#/...') are supported: {ref}")
            if resolve_ref(self.root, ref) is None:
                raise self.fail("$ref", message=f"{ref} does not resolve within the schema")
            if len(siblings) > 1:
                others = ", ".join(k for k in siblings if k != "$ref")
                raise self.fail(
                    "$ref", message=f"$ref with sibling keywords ({others}) is not supported: move them into it"
                )
        for key in ("anyOf", "oneOf"):
            if key in node and len(siblings) > 1:
                others = ", ".join(k for k in siblings if k != key)
                raise self.fail(
                    key, message=f"{key} with sibling keywords ({others}) is not supported: move them into each option"
                )
        if "oneOf" in node and not self._exclusive(node["oneOf"]):
            raise self.fail(
                "oneOf",
                message="oneOf is supported only when no value can fit two of its options (different types, a "
                "required property another option forbids, or different consts of a shared required property); "
                "use anyOf",
            )

    def _exclusive(self, options: list[Any]) -> bool:
        """True when no JSON value fits two of `options` (then the engine's anyOf reading of oneOf is exact)."""
        resolved = [resolve_ref(self.root, o["$ref"]) if isinstance(o, dict) and "$ref" in o else o for o in options]
        return all(_disjoint(a, b) for i, a in enumerate(resolved) for b in resolved[i + 1 :])

    def _check_object(self) -> None:
        required = self.node.get("required")
        if isinstance(required, list):
            properties = self.node.get("properties") or {}
            for i, name in enumerate(required):
                if name not in properties:
                    raise self.fail("required", i, message=f"{name!r} is required but not among properties")


def _disjoint(a: Any, b: Any) -> bool:
    """A sufficient test that no value fits both schemas: their types do not meet, or they are objects one of which
    requires a property the other forbids or pins to another const."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    types_a, types_b = _types(a), _types(b)
    if types_a is not None and types_b is not None and not _types_meet(types_a, types_b):
        return True
    if _const(a) is not None and _const(b) is not None:
        return _const(a) != _const(b)
    return _forbids(a, b) or _forbids(b, a) or _pins_apart(a, b)


def _types(schema: dict[str, Any]) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return set(declared)
    return {"object"} if "properties" in schema else None


def _types_meet(a: set[str], b: set[str]) -> bool:
    widen = {"integer": {"integer", "number"}, "number": {"integer", "number"}}
    return any(widen.get(t, {t}) & b for t in a)


def _forbids(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """`a` requires a property that `b` (closed: additionalProperties false, no patternProperties) does not list."""
    if b.get("additionalProperties") is not False or b.get("patternProperties"):
        return False
    listed = b.get("properties") or {}
    return any(name not in listed for name in a.get("required") or ())


def _pins_apart(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Both require a property whose const values differ (a discriminator)."""
    props_a, props_b = a.get("properties") or {}, b.get("properties") or {}
    for name in set(a.get("required") or ()) & set(b.get("required") or ()):
        const_a, const_b = _const(props_a.get(name)), _const(props_b.get(name))
        if const_a is not None and const_b is not None and const_a != const_b:
            return True
    return False


def _const(schema: Any) -> str | None:
    """The single value a property schema allows, as canonical JSON (None if it allows more)."""
    if not isinstance(schema, dict):
        return None
    if "const" in schema:
        return json.dumps(schema["const"], sort_keys=True)
    enum = schema.get("enum")
    return json.dumps(enum[0], sort_keys=True) if isinstance(enum, list) and len(enum) == 1 else None


def _number(value: Any) -> float | None:
    """A JSON number as parsed: an int stays exact (one past a float's range compares as it is, no OverflowError)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


# The grammar engine writes a bounded "number" with at most this many decimal places (xgrammar 0.2.9's range
# grammar); a range holding no such number compiles to an empty value, which would make invalid JSON.
NUMBER_DECIMALS = 6
NUMBER_BOUNDS = ("minimum", "exclusiveMinimum")
_DECIMAL_STEP = Decimal(1).scaleb(-NUMBER_DECIMALS)


def _decimal_between(node: dict[str, Any], low: str, high: str) -> bool:
    """Some number with at most NUMBER_DECIMALS decimal places fits node[low] .. node[high] (either exclusive)."""
    lo, hi = Decimal(repr(node[low])), Decimal(repr(node[high]))  # as written: 1e-07 stays 1E-7
    with localcontext() as context:
        context.prec = max(lo.adjusted(), hi.adjusted(), 0) + NUMBER_DECIMALS + 2  # exact: every integer digit
        first = lo.quantize(_DECIMAL_STEP, rounding=ROUND_CEILING)
        if first == lo and low.startswith("exclusive"):
            first += _DECIMAL_STEP
        return first < hi if high.startswith("exclusive") else first <= hi
