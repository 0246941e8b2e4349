"""Structured outputs: JSON-schema and tool-call grammars that constrain what a request may generate.

The HTTP layer turns `response_format` or `tools` + `tool_choice` into a `CompiledGrammar` (checked, time-bounded,
cached by digest) and puts `grammar.constraint` in `SamplingParams.constraint`; the engine makes one
`GrammarConstraint` per request and, each decoding step, has it fill the request's bitmask row and advances it by
the accepted token. A refusal is a SchemaError (an HTTP 400 naming its `.path`); CompilerBusy (compiles queued
past their time bound) is a 503.

Parts: `keywords` (what each JSON Schema keyword means to the engine), `schema` (checking a schema), `vocabulary`
(the tokenizer as the engine sees it, tokens JSON never needs taken out), `grammars` (xgrammar: compile, cache, the
per-request constraint), `worker` (the compile child process, killed past a time bound), `automata` and `dead_ends`
(what a compiled grammar could start but never finish, such as a `pattern` that matches nothing, and where in the
schema: refused before generation, not dead-ended during it), `response_format`, `tools` (constrained and `auto`
tool calls).
"""

from engine.structured.grammars import CompiledGrammar, GrammarConstraint, prepare_tokenizer
from engine.structured.response_format import compile_response_format, needs_grammar
from engine.structured.schema import SchemaError
from engine.structured.tools import (
    compile_tool_call,
    parse_auto_tool_calls,
    parse_tool_call,
    template_supports_tools,
)
from engine.structured.worker import CompilerBusy

__all__ = [
    "CompiledGrammar",
    "CompilerBusy",
    "GrammarConstraint",
    "SchemaError",
    "compile_response_format",
    "compile_tool_call",
    "needs_grammar",
    "parse_auto_tool_calls",
    "parse_tool_call",
    "prepare_tokenizer",
    "template_supports_tools",
]
