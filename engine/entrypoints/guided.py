"""Structured outputs and tool calls at the HTTP edge: `response_format`, `tools` and `tool_choice` checked (a
400 naming the field), then compiled into a grammar (engine/structured) off the event loop.

What a request asks for becomes at most one grammar: a JSON `response_format`, or, for `tool_choice`
"required" or a named function, the tool-call object `{"name": ..., "arguments": ...}` over the tools'
parameter schemas. `auto` needs no grammar: the model's chat template gets the tools and its tool-call markup
is parsed from the output (engine/entrypoints/tool_calls.py renders both kinds). The grammar's `constraint`
method goes into SamplingParams: the engine makes one matcher per engine request from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from engine.core.request import TokenConstraint
from engine.structured import CompilerBusy, SchemaError, compile_response_format, compile_tool_call
from engine.structured.tools import validate_tools
from loragate_common.errors import bad_request, shown, unavailable

COMPILE_TIMEOUT_S = 5.0  # a schema that takes longer to compile is refused (400), never a hung request

ConstraintFactory = Callable[[], TokenConstraint]


class FieldError(ValueError):
    """Bad input inside one field: `path` continues the field's name (".json_schema.name", "[2].function")."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """A JSON `response_format` ("text" is no format at all)."""

    type: Literal["json_object", "json_schema"]
    body: dict[str, Any]  # as the client sent it: compile_response_format's input


@dataclass(frozen=True, slots=True)
class Tool:
    name: str
    definition: dict[str, Any]  # as the client sent it: {"type": "function", "function": {"name", ...}}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: Literal["none", "auto", "required", "named"]
    name: str | None = None  # the function, for "named"

    def wire(self) -> str | dict[str, Any]:
        """OpenAI's spelling, as compile_tool_call takes it."""
        if self.mode == "named":
            return {"type": "function", "function": {"name": self.name}}
        return self.mode


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """Tools in use: `choice` is auto, required or named (never none, which is no plan)."""

    tools: tuple[Tool, ...]
    choice: ToolChoice
    parallel: bool  # parallel_tool_calls: `auto` answers may hold several calls; constrained ones hold one

    @property
    def constrained(self) -> bool:
        return self.choice.mode != "auto"

    def template_tools(self) -> list[dict[str, Any]]:
        return [tool.definition for tool in self.tools]


def parse_response_format(value: object) -> ResponseFormat | None:
    """`response_format`: None for text. Only its type is checked here; the rest (json_schema's name, schema,
    strict) when it is compiled, with the same paths."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise FieldError("", "must be an object")
    kind = value.get("type")
    if kind == "text":
        return None
    if kind not in ("json_object", "json_schema"):
        raise FieldError(".type", 'must be "text", "json_object" or "json_schema"')
    return ResponseFormat(kind, value)


def parse_tools(value: object) -> tuple[Tool, ...]:
    """`tools`: OpenAI function tools with distinct names (their parameter schemas are checked when compiled)."""
    if value is None:
        return ()
    try:
        parsed = validate_tools(value)
    except SchemaError as exc:  # its path starts with "tools"
        raise FieldError(exc.path.removeprefix("tools"), exc.message) from None
    assert isinstance(value, list)
    return tuple(Tool(name, definition) for (name, _), definition in zip(parsed, value, strict=True))


def parse_tool_choice(value: object) -> ToolChoice | None:
    """`tool_choice`: "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}."""
    if value is None:
        return None
    if value in ("none", "auto", "required"):
        return ToolChoice(value)
    if isinstance(value, dict) and value.get("type") == "function":
        fn = value.get("function")
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return ToolChoice("named", fn["name"])
        raise FieldError(".function.name", "must be a string")
    raise FieldError("", 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')


def plan_tools(
    tools: tuple[Tool, ...], choice: ToolChoice | None, parallel: bool, response_format: ResponseFormat | None
) -> ToolPlan | None:
    """The tools a request uses (None: none), or ValueError naming the field. Without a tool_choice, tools
    mean "auto" (OpenAI's default)."""
    if choice is None:
        choice = ToolChoice("auto" if tools else "none")
    if choice.mode == "none" or (choice.mode == "auto" and not tools):
        return None
    if not tools:
        raise ValueError(f"tool_choice: {choice.mode!r} needs tools")
    if choice.mode == "named" and choice.name not in {t.name for t in tools}:
        raise ValueError(f"tool_choice.function.name: no tool is named {shown(choice.name or '')}")
    if response_format is not None:
        raise ValueError(
            f'response_format: a JSON response_format cannot be combined with tool_choice "{choice.mode}" '
            '(use tool_choice "none", or a tool whose parameters are the schema)'
        )
    return ToolPlan(tools, choice, parallel)


async def compile_constraint(
    tokenizer: Any, response_format: ResponseFormat | None, tools: ToolPlan | None
) -> ConstraintFactory | None:
    """The grammar's constraint factory for SamplingParams.constraint (None: unconstrained), compiled in a
    worker thread (the grammar engine caches compiled grammars by schema digest). A schema that is invalid,
    unsupported or slower to compile than COMPILE_TIMEOUT_S is a 400 naming its JSON path in the request (the
    tools are passed in the client's order, so `tools[i]` in an error is the client's i-th tool)."""
    if tools is not None and tools.constrained:
        definitions = [tool.definition for tool in tools.tools]
        work = asyncio.to_thread(
            compile_tool_call, definitions, tools.choice.wire(), tokenizer, timeout_s=COMPILE_TIMEOUT_S
        )
        field = "tools"
    elif response_format is not None:
        work = asyncio.to_thread(compile_response_format, response_format.body, tokenizer, timeout_s=COMPILE_TIMEOUT_S)
        field = "response_format"
    else:
        return None
    try:
        # compile_* bound their own time; this bound only guards the request against one that does not.
        grammar = await asyncio.wait_for(work, COMPILE_TIMEOUT_S + 5)
    except SchemaError as exc:
        raise bad_request(str(exc)) from None  # "response_format.json_schema.schema.x: ..."
    except asyncio.TimeoutError:
        raise bad_request(f"{field}: the schema took longer than {COMPILE_TIMEOUT_S:g} s to compile") from None
    except CompilerBusy as exc:  # compiles queued past their time bound: not this schema's fault
        raise unavailable(f"{field}: the grammar compiler is busy ({exc}); retry shortly", "compiler_busy") from None
    except ValueError as exc:  # the served tokenizer cannot be constrained (not a fast tokenizer, no EOS)
        raise bad_request(f"{field}: structured outputs are not available for this model: {exc}") from None
    return grammar.constraint
