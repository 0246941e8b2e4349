"""The OpenAI wire format of what the engine answers: response bodies and stream chunks.

A formatter belongs to one request: it fixes the response id, model name and creation time, keeps each of
the request's `n` choices' text so far, and builds either the whole response (`response`) or, when streaming,
one chunk per engine output (`chunk`, tagged with its choice's `index`) and the closing usage chunk
(`usage_chunk`). Logprobs are rendered per endpoint: /v1/completions uses the legacy {tokens, token_logprobs,
top_logprobs, text_offset} lists (with `echo`, the prompt's tokens first: the first one's logprob null, as
OpenAI's), /v1/chat/completions the per-token entries. Chat answers with tools carry `tool_calls`
(engine/entrypoints/tool_calls.py). Errors and SSE framing are shared with the gateway (loragate_common/errors.py,
loragate_common/http_io.py).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import AdapterStatus, RequestOutput
from engine.core.request import TokenLogprob
from engine.entrypoints.guided import ToolPlan
from engine.entrypoints.tool_calls import ToolCallStream, tool_message

_MIN_LOGPROB = -9999.0  # JSON has no -Infinity

TokenText = Callable[[int], str]  # token id -> its text, for logprobs


def usage(lasts: Sequence[RequestOutput]) -> dict[str, int]:
    """The prompt once, the completion tokens of every choice."""
    prompt = lasts[0].num_prompt_tokens
    completion = sum(out.num_output_tokens for out in lasts)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def model_card(model_id: str, created: int, parent: str | None, max_model_len: int) -> dict[str, Any]:
    """One entry of GET /v1/models: the base model (parent None) or an adapter on it."""
    return {
        "id": model_id,
        "object": "model",
        "created": created,
        "owned_by": "loragate",
        "root": model_id,
        "parent": parent,
        "max_model_len": max_model_len,
    }


def adapter_card(status: AdapterStatus, base_model: str) -> dict[str, Any]:
    """One entry of GET /v1/adapters (and the answer to POST /v1/adapters)."""
    return {
        "id": status.adapter_id,
        "object": "adapter",
        "version": status.version,
        "kind": status.kind,
        "rank": status.rank,
        "target_modules": list(status.target_modules),
        "residence": status.residence,
        "parent": base_model,
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


@dataclass(slots=True)
class _Choice:
    """One choice's output so far."""

    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: RequestOutput | None = None
    started: bool = False  # its first chunk was sent
    text_offset: int = 0  # completions logprobs: characters of text before the next token
    tool_stream: ToolCallStream | None = None  # chat with tools, streamed

    @property
    def text(self) -> str:
        return "".join(self.texts)


class _Formatter:
    """Builds one request's OpenAI JSON: the whole response, or stream chunks and the usage chunk."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, model: str, token_text: TokenText, want_logprobs: bool, n: int = 1) -> None:
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.want_logprobs = want_logprobs
        self.choices = [_Choice() for _ in range(n)]

    def add(self, index: int, out: RequestOutput) -> _Choice:
        """Record choice `index`'s output `out` (streamed or not)."""
        choice = self.choices[index]
        choice.texts.append(out.new_text)
        choice.logprobs.extend(out.new_logprobs)
        choice.last = out
        return choice

    @property
    def lasts(self) -> list[RequestOutput]:
        """Each choice's last output (all of them once the request is done)."""
        lasts = [c.last for c in self.choices if c.last is not None]
        assert len(lasts) == len(self.choices), "a choice has no output yet"
        return lasts

    def _shows(self, out: RequestOutput) -> bool:
        return bool(out.new_text or out.finished or (self.want_logprobs and out.new_logprobs))

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _chunk(self, choice: dict[str, Any], include_usage: bool) -> dict[str, Any]:
        chunk = self._envelope(self.chunk_object_name, [choice])
        return {**chunk, "usage": None} if include_usage else chunk

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage(self.lasts)}


@dataclass(frozen=True, slots=True)
class Echo:
    """A completion's prompt, shown before its text (`echo`)."""

    text: str
    token_ids: list[int]


class CompletionFormatter(_Formatter):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(
        self, model: str, token_text: TokenText, want_logprobs: bool, n: int = 1, echo: Echo | None = None
    ) -> None:
        super().__init__(model, token_text, want_logprobs, n)
        self.echo = echo
        # The prompt's logprobs (entry 0 None) as the first choice's first output brought them; every choice
        # echoes the same prompt, and only the first choice computes them (engine/entrypoints/choices.py).
        self.prompt_logprobs: list[TokenLogprob | None] | None = None

    def add(self, index: int, out: RequestOutput) -> _Choice:
        if out.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = out.prompt_logprobs
        return super().add(index, out)

    def _top(self, item: TokenLogprob) -> dict[str, float]:
        """The token and the top alternatives; where two ids share a text the first wins."""
        top: dict[str, float] = {}
        for token_id, logprob in ((item.token_id, item.logprob), *item.top):
            top.setdefault(self.token_text(token_id), _finite(logprob))
        return top

    def _logprobs(self, choice: _Choice, items: list[TokenLogprob], with_prompt: bool) -> dict[str, list[Any]] | None:
        """The legacy lists for `items`, after the prompt's tokens if `with_prompt` (echo, first chunk)."""
        if not self.want_logprobs:
            return None
        entries: list[tuple[int, TokenLogprob | None]] = [(item.token_id, item) for item in items]
        if with_prompt and self.echo is not None:
            prompt = self.prompt_logprobs
            assert prompt is not None and len(prompt) == len(self.echo.token_ids), "echo without prompt logprobs"
            entries = [*zip(self.echo.token_ids, prompt, strict=True), *entries]
        lists: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, item in entries:
            token = self.token_text(token_id)
            lists["tokens"].append(token)
            lists["token_logprobs"].append(None if item is None else _finite(item.logprob))
            lists["top_logprobs"].append(None if item is None else self._top(item))
            lists["text_offset"].append(choice.text_offset)
            choice.text_offset += len(token)
        return lists

    def _choice(
        self, index: int, text: str, logprobs: dict[str, list[Any]] | None, finish: str | None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, index: int, out: RequestOutput, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk for choice `index`'s engine output, or None if it has nothing to show."""
        choice = self.add(index, out)
        first = not choice.started
        if not (self._shows(out) or (first and self.echo is not None)):  # an echo starts with the prompt
            return None
        choice.started = True
        text = self.echo.text + out.new_text if first and self.echo is not None else out.new_text
        logprobs = self._logprobs(choice, out.new_logprobs, with_prompt=first)
        return self._chunk(self._choice(index, text, logprobs, out.finish_reason), include_usage)

    def response(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            assert choice.last is not None
            text = self.echo.text + choice.text if self.echo is not None else choice.text
            logprobs = self._logprobs(choice, choice.logprobs, with_prompt=True)
            choices.append(self._choice(index, text, logprobs, choice.last.finish_reason))
        return {**self._envelope(self.object_name, choices), "usage": usage(self.lasts)}


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(
        self, model: str, token_text: TokenText, want_logprobs: bool, n: int = 1, tools: ToolPlan | None = None
    ) -> None:
        super().__init__(model, token_text, want_logprobs, n)
        self.tools = tools

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.token_text(token_id)
        return {"token": token, "logprob": _finite(logprob), "bytes": list(token.encode("utf-8"))}

    def _logprobs(self, items: list[TokenLogprob]) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        return {
            "content": [
                {**self._entry(i.token_id, i.logprob), "top_logprobs": [self._entry(t, lp) for t, lp in i.top]}
                for i in items
            ]
        }

    def start_chunks(self, include_usage: bool) -> list[dict[str, Any]]:
        """Each choice's first chunk, in index order, before any of their text: the assistant role (content null
        when the answer is a constrained tool call). The official client's stream helpers need the choices to
        appear in order."""
        content = None if self.tools is not None and self.tools.constrained else ""
        chunks = []
        for index, choice in enumerate(self.choices):
            choice.started = True
            if self.tools is not None:
                choice.tool_stream = ToolCallStream(self.tools)
            delta = {"role": "assistant", "content": content}
            chunks.append(
                self._chunk({"index": index, "delta": delta, "logprobs": None, "finish_reason": None}, include_usage)
            )
        return chunks

    def chunk(self, index: int, out: RequestOutput, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk for choice `index`'s engine output (after `start_chunks`), or None if it has nothing
        to show. With tools, text is held back until it is known to be content or a tool call."""
        choice = self.add(index, out)
        finish = out.finish_reason
        delta: dict[str, Any]
        if choice.tool_stream is not None:
            delta = choice.tool_stream.feed(out.new_text)
            if out.finished:
                delta, finish = choice.tool_stream.finish(delta, finish)
        else:
            delta = {"content": out.new_text} if out.new_text else {}
        if not (delta or out.finished or (self.want_logprobs and out.new_logprobs)):  # held-back text shows nothing
            return None
        if out.finished and not delta:
            delta = {"content": ""} if choice.tool_stream is None else {}
        body = {"index": index, "delta": delta, "logprobs": self._logprobs(out.new_logprobs), "finish_reason": finish}
        return self._chunk(body, include_usage)

    def response(self) -> dict[str, Any]:
        choices = []
        for index, choice in enumerate(self.choices):
            assert choice.last is not None
            finish = choice.last.finish_reason
            message: dict[str, Any] = {"role": "assistant", "content": choice.text}
            if self.tools is not None:
                message, finish = tool_message(self.tools, choice.text, finish)
            logprobs = self._logprobs(choice.logprobs)
            choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish})
        return {**self._envelope(self.object_name, choices), "usage": usage(self.lasts)}


Formatter = CompletionFormatter | ChatFormatter
