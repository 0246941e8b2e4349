"""What JSON Schema keywords mean to the grammar engine (xgrammar), and walking a schema's subschemas.

The tables say which keywords the engine enforces, which it would ignore (refused by `schema.py`), which formats it
checks, and which regex constructs it misreads; they were measured keyword by keyword against xgrammar 0.2 (a
violating document accepted = ignored). `engine_schema` is a checked schema as the engine compiles it;
`relocate_refs` moves a schema's `$ref`s when it is embedded in another (the tool-call grammar).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

Path = tuple[str | int, ...]

ANNOTATIONS = frozenset(
    {
        "$schema",
        "$id",
        "id",
        "$anchor",
        "$comment",
        "$vocabulary",
        "$defs",
        "definitions",
        "title",
        "description",
        "default",
        "examples",
        "readOnly",
        "writeOnly",
        "deprecated",
        "contentMediaType",
        "contentEncoding",
        "discriminator",  # OpenAPI's, as Pydantic writes it beside oneOf
    }
)
# Standard keywords the grammar cannot enforce, with what to do instead.
UNSUPPORTED = {
    "not": "",
    "if": "",
    "then": "",
    "else": "",
    "allOf": "merge the parts into one schema",
    "contains": "",
    "minContains": "",
    "maxContains": "",
    "uniqueItems": "",
    "propertyNames": "",
    "dependentRequired": "",
    "dependentSchemas": "",
    "dependencies": "",
    "unevaluatedProperties": "use additionalProperties",
    "unevaluatedItems": "use items",
    "additionalItems": "use prefixItems with items",
    "$dynamicRef": "",
    "$dynamicAnchor": "",
    "$recursiveRef": "",
    "$recursiveAnchor": "",
}
# Formats the engine checks (the others it would let through unchecked).
FORMATS = frozenset(
    {
        "date",
        "time",
        "date-time",
        "duration",
        "email",
        "hostname",
        "ipv4",
        "ipv6",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    }
)
# Formats the engine checks only loosely (any day 01-31 in any month): compiled as exact patterns instead.
_YEAR = r"(000[1-9]|00[1-9][0-9]|0[1-9][0-9]{2}|[1-9][0-9]{3})"
_LEAP_YEAR = r"([0-9]{2}(0[48]|[2468][048]|[13579][26])|(0[48]|[2468][048]|[13579][26])00)"
_DATE = (
    rf"({_YEAR}-((0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|(0[469]|11)-(0[1-9]|[12][0-9]|30)|02-(0[1-9]|1[0-9]|2[0-8]))"
    rf"|{_LEAP_YEAR}-02-29)"
)
_TIME = r"([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
FORMAT_PATTERNS = {"date": f"^{_DATE}$", "time": f"^{_TIME}$", "date-time": f"^{_DATE}T{_TIME}$"}

# Keywords of one JSON type: they need that type in `type` beside them.
TYPED = {
    "minimum": ("integer", "number"),
    "maximum": ("integer", "number"),
    "exclusiveMinimum": ("integer", "number"),
    "exclusiveMaximum": ("integer", "number"),
    "multipleOf": ("integer",),
    "minLength": ("string",),
    "maxLength": ("string",),
    "pattern": ("string",),
    "format": ("string",),
    "items": ("array",),
    "prefixItems": ("array",),
    "minItems": ("array",),
    "maxItems": ("array",),
    "required": ("object",),
    "additionalProperties": ("object",),
    "patternProperties": ("object",),
    "minProperties": ("object",),
    "maxProperties": ("object",),
}
BOUNDS = (
    ("minimum", "maximum"),
    ("exclusiveMinimum", "maximum"),
    ("minimum", "exclusiveMaximum"),
    ("exclusiveMinimum", "exclusiveMaximum"),
    ("minLength", "maxLength"),
    ("minItems", "maxItems"),
    ("minProperties", "maxProperties"),
)
# Keywords whose value is one subschema / a list of them / a name -> subschema map.
_ONE = ("additionalProperties", "items")
_MANY = ("anyOf", "oneOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions")

# Regex constructs xgrammar accepts but does not honour: look-around is dropped, POSIX classes match nothing, and
# `\u` escapes outside a class are read as letters.
MISREAD_REGEX = (
    (re.compile(r"\(\?<?[=!]"), "look-ahead and look-behind"),
    (re.compile(r"\[\[:"), "POSIX character classes ([[:alpha:]]); use ranges such as [a-zA-Z]"),
    (re.compile(r"(?<!\\)(?:\\\\)*\\u"), "\\u escapes; write the character itself"),
)


def misplaced_anchor(pattern: str) -> tuple[int, str] | None:
    """(index, "^" or "$") of the first anchor xgrammar would misread, or None. It drops every anchor and matches
    a pattern against the whole string, which is right only for a `^` that no match can reach after reading a
    character (nothing but zero-width items before it, in no repeated group), and a `$` likewise before nothing
    more: `a^` matches nothing, but read as `a` it would let "a" through."""
    items, end = _regex_sequence_alternatives(pattern, 0)
    if end != len(pattern):
        return None  # unbalanced: xgrammar refuses it itself
    return _first_misplaced(items, before=True, after=True, repeated=False)


# A parsed regex item: ("anchor", index, char), ("atom", least, most), ("group", alternatives, least, most)
# (most None: unbounded); alternatives are lists of items.
_QUANTIFIER = re.compile(r"\*|\+|\?|\{(\d+)(,(\d*))?\}")


def _regex_sequence_alternatives(pattern: str, i: int) -> tuple[list[list[tuple[Any, ...]]], int]:
    """The alternatives from `i` up to an unmatched ")" or the end, and the index there."""
    alternatives: list[list[tuple[Any, ...]]] = [[]]
    while i < len(pattern) and pattern[i] != ")":
        char = pattern[i]
        if char == "|":
            alternatives.append([])
            i += 1
            continue
        if char in "^$":
            alternatives[-1].append(("anchor", i, char))
            i += 1
            continue
        if char == "(":
            i += 1
            if pattern.startswith("?", i):  # (?:...), (?<name>...); look-around is refused before this
                named = pattern.startswith("?<", i) and pattern[i + 2 : i + 3] not in ("=", "!")
                close = pattern.find(">", i) if named else -1
                i = close + 1 if close >= 0 else i + 2 + pattern.startswith("?<", i)
            inner, i = _regex_sequence_alternatives(pattern, i)
            if i >= len(pattern):
                return alternatives, -1  # unbalanced
            least, most, i = _regex_quantifier(pattern, i + 1)
            alternatives[-1].append(("group", inner, least, most))
            continue
        if char == "\\":
            i += 2
        elif char == "[":
            i += 1
            i += pattern[i : i + 1] == "^"
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        else:
            i += 1
        least, most, i = _regex_quantifier(pattern, i)
        alternatives[-1].append(("atom", least, most))
    return alternatives, i


def _regex_quantifier(pattern: str, i: int) -> tuple[int, int | None, int]:
    """(least, most, index after it) of the quantifier at `i`: (1, 1, i) when there is none."""
    match = _QUANTIFIER.match(pattern, i)
    if match is None:
        return 1, 1, i
    end = match.end() + pattern.startswith("?", match.end())  # a lazy quantifier matches the same strings
    text = match.group(0)
    if text in "*+?":
        return (0 if text != "+" else 1), (1 if text == "?" else None), end
    least = int(match.group(1))
    most = least if match.group(2) is None else (int(match.group(3)) if match.group(3) else None)
    return least, most, end


def _zero_width(item: tuple[Any, ...]) -> bool:
    """The item can read no character."""
    if item[0] == "anchor":
        return True
    if item[-1] == 0:  # at most 0 repetitions
        return True
    return item[0] == "group" and all(all(_zero_width(x) for x in alt) for alt in item[1])


def _first_misplaced(
    alternatives: list[list[tuple[Any, ...]]], *, before: bool, after: bool, repeated: bool
) -> tuple[int, str] | None:
    for items in alternatives:
        for k, item in enumerate(items):
            clear_before = before and all(_zero_width(x) for x in items[:k])
            clear_after = after and all(_zero_width(x) for x in items[k + 1 :])
            if item[0] == "anchor":
                if repeated or not (clear_before if item[2] == "^" else clear_after):
                    return item[1], item[2]
            elif item[0] == "group":
                again = repeated or ((item[3] is None or item[3] > 1) and not _zero_width(item))
                found = _first_misplaced(item[1], before=clear_before, after=clear_after, repeated=again)
                if found is not None:
                    return found
    return None


def subschemas(node: Any, path: Path = ()) -> Iterator[tuple[Path, dict[str, Any]]]:
    """Every object subschema under `node` with its path, parents first (boolean schemas need no check)."""
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _ONE:
        if isinstance(node.get(key), dict):
            yield from subschemas(node[key], (*path, key))
    for key in _MANY:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from subschemas(sub, (*path, key, i))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from subschemas(sub, (*path, key, name))


def resolve_ref(root: Any, ref: str) -> Any:
    """The subschema a local JSON-pointer `$ref` names in `root`, or None."""
    node = root
    for raw in ref.removeprefix("#").split("/")[1:]:
        step = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and step in node:
            node = node[step]
        elif isinstance(node, list) and step.isdigit() and int(step) < len(node):
            node = node[int(step)]
        else:
            return None
    return node


def relocate_refs(node: Any, pointer: str) -> Any:
    """A copy of schema `node` whose local JSON-pointer `$ref`s ("#", "#/...") point into `pointer` (a JSON pointer
    such as "/properties/arguments"), for embedding a whole schema inside another. Only schema positions are
    rewritten: `const`, `enum`, `default` and other values are copied as they are."""
    if not isinstance(node, dict):
        return node
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            out[key] = "#" + pointer + value[1:]
        elif key in _ONE:
            out[key] = relocate_refs(value, pointer)
        elif key in _MANY and isinstance(value, list):
            out[key] = [relocate_refs(sub, pointer) for sub in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: relocate_refs(sub, pointer) for name, sub in value.items()}
        else:
            out[key] = value
    return out


def engine_schema(schema: Any) -> Any:
    """The schema as the engine compiles it: a checked `schema` with the loosely checked formats as exact patterns."""
    if not isinstance(schema, dict):
        return {} if schema is True else schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "format" and value in FORMAT_PATTERNS:
            out["pattern"] = FORMAT_PATTERNS[value]
        elif key in _ONE:
            out[key] = engine_schema(value) if isinstance(value, dict) else value
        elif key in _MANY and isinstance(value, list):
            out[key] = [engine_schema(sub) for sub in value]
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: engine_schema(sub) for name, sub in value.items()}
        else:
            out[key] = value
    return out
