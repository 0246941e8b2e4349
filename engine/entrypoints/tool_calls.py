"""Tool calls in chat answers, in OpenAI's shape: `message.tool_calls` and `finish_reason: "tool_calls"`, and
the streamed deltas the official client's stream helpers accumulate.

Two sources (engine/entrypoints/guided.py ToolPlan): for `tool_choice` "required" or a named function the
output is the grammar's JSON object `{"name": ..., "arguments": {...}}` (engine/structured parse_tool_call);
for "auto", the chat template's tool-call markup inside free text (parse_auto_tool_calls).

Streamed, a constrained call is sent as it is generated: once the text holds `{"name": "<name>", "arguments": `,
a first delta with the call's index, id, type and name, then the arguments in fragments. The text's trailing
`}` and whitespace are held back until more text follows, since the last `}` closes the outer object rather
than the arguments. An `auto` answer is held back whole and sent at its end (content, then every call), since
text cannot be shown as content before it is known not to be markup.
"""

from __future__ import annotations

import re
import uuid
from typing import Any

from engine.entrypoints.guided import ToolPlan
from engine.structured import parse_auto_tool_calls, parse_tool_call

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')
_TAIL = " \t\r\n}"  # what may close the outer object: held back while streaming


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _parse(plan: ToolPlan, text: str, finish: str | None) -> tuple[str | None, list[tuple[str, str]]] | None:
    """(content, [(name, arguments JSON)]) of a whole answer, or None if it holds no complete call."""
    if plan.constrained:
        if finish != "stop":  # cut short (length): the grammar's object is incomplete
            return None
        try:
            return None, [parse_tool_call(text)]
        except ValueError:  # a stop string cut it: shown as text
            return None
    content, calls = parse_auto_tool_calls(text)
    if not calls:
        return None
    return (content if content.strip() else None), calls if plan.parallel else calls[:1]


def tool_message(plan: ToolPlan, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message of a whole answer and its finish_reason ("tool_calls" when it holds calls)."""
    parsed = _parse(plan, text, finish)
    if parsed is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parsed
    tool_calls = [
        {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls
    ]
    return {"role": "assistant", "content": content, "tool_calls": tool_calls}, "tool_calls"


def _first_delta(index: int, name: str, arguments: str) -> dict[str, Any]:
    """A call's first streamed delta: the only one with its id, type and name (the client concatenates strings)."""
    return {"index": index, "id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


class ToolCallStream:
    """One choice's text, turned into streamed `content` / `tool_calls` deltas."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self._sent: int | None = None  # characters of `text` sent (set once the call's head was sent)

    def feed(self, new_text: str) -> dict[str, Any]:
        """The delta fields to send for `new_text` (empty: nothing yet)."""
        self.text += new_text
        if not self.plan.constrained:
            return {}
        if self._sent is None:
            head = _HEAD.match(self.text)
            if head is None:
                return {}
            self._sent = head.end()
            return {"tool_calls": [_first_delta(0, head.group(1), self._fragment(len(self.text.rstrip(_TAIL))))]}
        return _with_arguments({}, self._fragment(len(self.text.rstrip(_TAIL))))

    def finish(self, delta: dict[str, Any], finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The last chunk's delta (`delta`, what `feed` gave for the last text, completed) and finish_reason."""
        if self._sent is not None:  # a constrained call, streamed as it came
            body = self.text.rstrip()
            if finish != "stop" or not body.endswith("}"):  # cut short (max_tokens, a stop string): as it is
                return _with_arguments(delta, self._fragment(len(self.text))), finish
            return _with_arguments(delta, self._fragment(len(body[:-1].rstrip()))), "tool_calls"
        parsed = _parse(self.plan, self.text, finish)
        if parsed is None:
            return ({"content": self.text} if self.text else {}), finish
        content, calls = parsed
        delta = {"content": content} if content else {}
        delta["tool_calls"] = [_first_delta(i, name, arguments) for i, (name, arguments) in enumerate(calls)]
        return delta, "tool_calls"

    def _fragment(self, end: int) -> str:
        assert self._sent is not None
        fragment = self.text[self._sent : max(end, self._sent)]
        self._sent += len(fragment)
        return fragment


def _with_arguments(delta: dict[str, Any], fragment: str) -> dict[str, Any]:
    """`delta` with `fragment` appended to call 0's arguments."""
    if not fragment:
        return delta
    calls = delta.get("tool_calls")
    if calls:
        calls[0]["function"]["arguments"] += fragment
        return delta
    return {**delta, "tool_calls": [{"index": 0, "function": {"arguments": fragment}}]}
