"""The messages of a chat request, as OpenAI clients send them: text (or text parts) from the system, developer,
user and assistant, the tool calls of earlier assistant turns and the tool results that answer them; each
rendered as the dict chat templates expect (`for_template`)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)  # as engine/entrypoints/protocol.py


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def for_template(self) -> dict[str, Any]:
        """Arguments as an object where they parse as one: what chat templates render (vLLM does the same)."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except ValueError:
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.function.name, "arguments": arguments}}


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this answers

    def for_template(self) -> dict[str, Any]:
        """The dict chat templates expect ("developer" is OpenAI's new "system")."""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            message["tool_calls"] = [call.for_template() for call in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            message["name"] = self.name
        return message
