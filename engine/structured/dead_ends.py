"""Where a compiled grammar can start a value it can never finish, and what to tell the client.

The compile child (worker.py) asks `unsatisfiable` after xgrammar compiled a schema: automata.py reads xgrammar's own
byte automata and says whether the grammar is empty or has a dead end. When it has, this module finds where: the
deepest subschema whose own grammar has the fault, compiled alone on a vocabulary of the 256 bytes (the automata do
not depend on the vocabulary), and the keyword without which it has none, following a local `$ref` into the
definition it names and a `patternProperties` fault to the name at fault. `options` are the compile options the
engine's grammars use (worker.py JSON_OPTIONS).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from engine.structured.automata import ALL_BYTES, DEAD_END, EMPTY, Automata

logger = logging.getLogger(__name__)  # in the compile child, unconfigured: warnings reach its stderr


def unsatisfiable(
    compiled: Any, schema_json: str, xgrammar: Any, options: dict[str, Any]
) -> tuple[list[str | int] | None, str] | None:
    """(path or None, message) when the compiled grammar can start a value it can never finish, else None. A
    grammar whose automata cannot be read is let through (logged): the check never refuses on its own failure."""
    try:
        problem = Automata.of(compiled.grammar).problem()
    except Exception as exc:
        logger.warning("the dead-end check was skipped: %r", exc)
        return None
    if problem is None:
        return None
    schema = json.loads(schema_json)
    try:
        located = _locate_dead_end(schema, xgrammar, options)
    except Exception as exc:
        logger.warning("locating a dead end failed: %r", exc)
        located = None
    return located or (None, _message(None, problem))


def _locate_dead_end(schema: Any, xgrammar: Any, options: dict[str, Any]) -> tuple[list[str | int], str] | None:
    """The deepest subschema whose own grammar has a dead end, and the keyword without which it has none; a fault
    that a local `$ref` brings in is followed into the definition it names."""
    from engine.structured.keywords import subschemas

    shared = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema}
    nodes = sorted(subschemas(schema), key=lambda item: len(item[0]), reverse=True)

    def fixed(node: dict[str, Any]) -> bool:
        return _problem({**shared, **node}, xgrammar, options) is None

    def blame(under: tuple[str, ...], seen: frozenset[str]) -> tuple[list[str | int], str] | None:
        for path, node in nodes:
            steps = tuple(str(step) for step in path)
            if steps[: len(under)] != under or (path[-2:-1] in (("$defs",), ("definitions",)) and steps != under):
                continue  # a definition is searched where a $ref leads to it
            problem = _problem({**shared, **node}, xgrammar, options)
            if problem not in (EMPTY, DEAD_END):
                continue
            for key in sorted(node, key=lambda k: k == "type"):
                if key in shared or not fixed({k: v for k, v in node.items() if k != key}):
                    continue
                ref = node[key] if key == "$ref" and isinstance(node[key], str) else ""
                if ref.startswith("#/") and ref not in seen:
                    target = tuple(step.replace("~1", "/").replace("~0", "~") for step in ref[2:].split("/"))
                    inner = blame(target, seen | {ref})
                    if inner is not None:
                        return inner
                if key == "patternProperties" and isinstance(node[key], dict):
                    for name in node[key]:
                        if fixed({**node, key: {n: v for n, v in node[key].items() if n != name}}):
                            return [*path, key, name], _pattern_message(key, name, xgrammar, options)
                if key == "pattern" and isinstance(node[key], str):
                    return [*path, key], _pattern_message(key, node[key], xgrammar, options)
                return [*path, key], _message(key, problem)
            return list(path), _message(None, problem)
        return None

    return blame((), frozenset())


_byte_compiler: Any = None
UNCOMPILED = "uncompiled"  # _problem: the schema does not compile alone


def _compiler(xgrammar: Any) -> Any:
    """A compiler for a vocabulary of the 256 bytes (the automata do not depend on the vocabulary)."""
    global _byte_compiler
    if _byte_compiler is None:
        info = xgrammar.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], stop_token_ids=[256])
        _byte_compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    return _byte_compiler


def _problem(schema: Any, xgrammar: Any, options: dict[str, Any]) -> str | None:
    """The dead-end check of `schema` alone (Automata.problem over the bytes a vocabulary writes), or UNCOMPILED."""
    try:
        compiled = _compiler(xgrammar).compile_json_schema(json.dumps(schema), **options)
        return Automata.of(compiled.grammar).problem()
    except Exception:
        return UNCOMPILED


def _pattern_message(key: str, pattern: str, xgrammar: Any, options: dict[str, Any]) -> str:
    """What is wrong with `pattern` (that of `pattern`, or a `patternProperties` name when `key` says so): it
    matches nothing even read alone, or what it needs is what xgrammar cannot write inside a JSON string (there it
    matches no character that JSON escapes: it writes `"`, `\\` and control characters raw in some patterns, in
    none in others, and the vocabulary never writes a control character)."""
    what = f"the {'property-name ' if key == 'patternProperties' else ''}pattern {json.dumps(pattern)}"
    try:
        alone = Automata.of(_compiler(xgrammar).compile_regex(pattern).grammar).problem(ALL_BYTES)
    except Exception:
        alone = None
    if alone == EMPTY:
        return f"{what} matches no string: nothing fits"
    if alone == DEAD_END:
        return (
            f"part of {what} can match nothing (an empty character class such as [^\\s\\S]?): the grammar engine "
            "could start a string there and never finish it"
        )
    escaped = 'a character JSON text must escape (", \\ or a control character, U+0000 to U+001F), which the '
    escaped += "grammar engine cannot write in a string"
    if _problem({"type": "string", "pattern": pattern}, xgrammar, options) == EMPTY:
        return f"every string {what} matches holds {escaped}: nothing fits"
    return f"some strings {what} matches hold {escaped}: the engine could start one and never finish it"


def _message(key: str | None, writable: str | None) -> str:
    """What is wrong, for a dead end found at keyword `key` (None: the schema as a whole); `writable` is
    Automata.problem over the bytes a vocabulary writes."""
    where = "this schema" if key is None else f"{key} with the rest of this schema"
    if writable == EMPTY:
        return f"no JSON value fits {where} as the grammar engine reads it: nothing fits"
    return f"part of {where} can match nothing: the grammar engine could start a value there and never finish it"
