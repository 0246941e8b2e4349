"""Tool calls: grammar-constrained (`tool_choice` "required" or a named function) and parsed from a chat
template's markup (`auto`).

A constrained answer is one JSON object `{"name": <tool name>, "arguments": <that tool's parameters>}`: for
"required" any of the tools, for a named function only it. `parse_tool_call` turns it into (name, arguments JSON).
`auto` lets the model choose, so it needs a chat template that renders `tools` and the model's own call markup;
`parse_auto_tool_calls` reads the Hermes/Qwen form `<tool_call>{"name": ..., "arguments": ...}</tool_call>`.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from engine.structured.grammars import CompiledGrammar, CompileTimeoutError, compile_grammar
from engine.structured.keywords import relocate_refs
from engine.structured.response_format import check_name
from engine.structured.schema import SchemaError, check_schema

# OpenAI: "Omitting parameters defines a function with an empty parameter list."
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_TOOLS_VARIABLE = re.compile(r"\btools\b")


def validate_tools(tools: Any) -> list[tuple[str, Any]]:
    """(name, parameters schema) per tool; SchemaError with a path under `tools` for a malformed one. The schemas
    themselves are checked by `check_tool_schemas` (inside the compile's time bound)."""
    if not isinstance(tools, list) or not tools:
        raise SchemaError("tools", "must be a non-empty array of function tools")
    out: list[tuple[str, Any]] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise SchemaError(at, "must be an object")
        if tool.get("type") != "function":
            raise SchemaError(f"{at}.type", f"must be 'function', got {tool.get('type')!r}")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise SchemaError(f"{at}.function", "must be an object with a 'name'")
        name = check_name(f"{at}.function.name", function.get("name"))
        if name in seen:
            raise SchemaError(f"{at}.function.name", f"duplicate tool name {name!r}")
        seen.add(name)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise SchemaError(f"{at}.function.description", "must be a string")
        if function.get("strict") is not None and not isinstance(function["strict"], bool):
            raise SchemaError(f"{at}.function.strict", "must be a boolean")
        parameters = function.get("parameters", NO_PARAMETERS)
        if not isinstance(parameters, dict):
            raise SchemaError(f"{at}.function.parameters", "must be a JSON schema object")
        if "type" in parameters and parameters["type"] != "object":
            raise SchemaError(f"{at}.function.parameters.type", "the parameters of a function must be an object")
        out.append((name, parameters))
    return out


def chosen_tools(tools: list[tuple[str, Any]], tool_choice: Any) -> list[int]:
    """Indices of the tools an answer may call under `tool_choice` ("required" or a named function)."""
    if tool_choice == "required":
        return list(range(len(tools)))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        for i, (tool_name, _) in enumerate(tools):
            if tool_name == name:
                return [i]
        raise SchemaError("tool_choice.function.name", f"no tool named {name!r} in tools")
    raise SchemaError(
        "tool_choice", "a constrained tool call needs 'required' or {'type': 'function', 'function': {'name': ...}}"
    )


def call_schema(tools: list[tuple[str, Any]], indices: list[int]) -> dict[str, Any]:
    """The JSON schema of one call to any of `tools[indices]`; each tool's `$ref`s are moved to where its
    parameters land, so `$defs` and recursion keep working."""
    if len(indices) == 1:
        name, parameters = tools[indices[0]]
        return _one_call(name, relocate_refs(parameters, "/properties/arguments"))
    options = []
    for k, i in enumerate(indices):
        name, parameters = tools[i]
        options.append(_one_call(name, relocate_refs(parameters, f"/anyOf/{k}/properties/arguments")))
    return {"anyOf": options}


def _one_call(name: str, parameters: Any) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def compile_tool_call(tools: Any, tool_choice: Any, tokenizer: Any, *, timeout_s: float = 5.0) -> CompiledGrammar:
    """The grammar of one tool call (`{"name": ..., "arguments": ...}`) for `tool_choice` "required" or a named
    function; SchemaError with a path under `tools` or `tool_choice` for anything wrong, or a compile past
    `timeout_s` (the whole call's bound: locating a refusal in one tool fits in it too)."""
    deadline = time.monotonic() + timeout_s
    parsed = validate_tools(tools)
    indices = chosen_tools(parsed, tool_choice)

    def check() -> None:
        for i in indices:
            check_schema(parsed[i][1], f"tools[{i}].function.parameters")

    schema = call_schema(parsed, indices)
    try:
        return compile_grammar(
            "tool_call", schema, tokenizer, path="tools", timeout_s=timeout_s, check=check, salt=repr(indices)
        )
    except SchemaError as exc:
        path = _tool_path(exc.path, indices)
        if path != "tools" or len(indices) == 1 or isinstance(exc, CompileTimeoutError):
            raise type(exc)(path, exc.message) from None
        # The engine refused the union as a whole without saying where: compile the tools alone to name the one at
        # fault, in what is left of the time bound (then the refusal stays on `tools`). Under a salt of their own:
        # a part cut short by the remaining time must not be a cached timeout for requests naming that tool.
        for i in indices:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            one = call_schema(parsed, [i])
            try:
                compile_grammar("tool_call", one, tokenizer, path="tools", timeout_s=left, salt=f"locate {[i]!r}")
            except CompileTimeoutError:
                break
            except SchemaError as alone:
                raise SchemaError(_tool_path(alone.path, [i]), alone.message) from None
        raise


def _tool_path(path: str, indices: list[int]) -> str:
    """A path into the call schema (`tools.anyOf[k].properties.arguments...`) as a path into the request's
    `tools[i].function.parameters...`; the call schema of one tool as a whole (compiled past its bound, or
    unsatisfiable) is that tool's parameters."""
    if len(indices) == 1 and path.startswith("tools.properties.arguments"):
        return f"tools[{indices[0]}].function.parameters" + path.removeprefix("tools.properties.arguments")
    if len(indices) == 1 and path == "tools":
        return f"tools[{indices[0]}].function.parameters"
    for k, i in enumerate(indices):
        prefix = f"tools.anyOf[{k}].properties.arguments"
        if path.startswith(prefix):
            return f"tools[{i}].function.parameters" + path[len(prefix) :]
    return path


def parse_tool_call(text: str) -> tuple[str, str]:
    """(name, arguments as a JSON string) from a constrained answer; ValueError if it is not one (cut short by
    max_tokens, say)."""
    try:
        call = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not a complete tool call: {exc}") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        raise ValueError("a tool call must be an object with 'name' and 'arguments'")
    return call["name"], json.dumps(call["arguments"], ensure_ascii=False)


def parse_auto_tool_calls(text: str) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments JSON)]) from a free answer in Hermes/Qwen markup: each
    `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the closing tag may be missing at the very end) is
    a call; a block that is not a valid call stays in the content. Content is the rest, stripped."""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for match in _TOOL_CALL.finditer(text):
        call = _markup_call(match.group(1))
        if call is None:
            continue
        kept.append(text[last : match.start()])
        last = match.end()
        calls.append(call)
    kept.append(text[last:])
    return "".join(kept).strip(), calls


def _markup_call(body: str) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string already
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def template_supports_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template renders a `tools` list (so `tool_choice: auto` can work)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        return any(isinstance(t, str) and _TOOLS_VARIABLE.search(t) is not None for t in template.values())
    return isinstance(template, str) and _TOOLS_VARIABLE.search(template) is not None
