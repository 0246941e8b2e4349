"""The OpenAI wire format of what the engine answers: response bodies and stream chunks.

A formatter belongs to one request: it fixes the response id, model name and creation time, and builds
either the whole response (`response`) or, when streaming, one chunk per engine output (`chunk`) and the
closing usage chunk (`usage_chunk`). Logprobs are rendered per endpoint: /v1/completions uses the legacy
{tokens, token_logprobs, top_logprobs, text_offset} lists, /v1/chat/completions the per-token entries.
Errors and SSE framing are shared with the gateway (loragate/errors.py, loragate/http_io.py).
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Any

from engine.core.outputs import AdapterStatus, RequestOutput
from engine.core.request import TokenLogprob

_MIN_LOGPROB = -9999.0  # JSON has no -Infinity

TokenText = Callable[[int], str]  # token id -> its text, for logprobs


def usage(out: RequestOutput) -> dict[str, int]:
    return {
        "prompt_tokens": out.num_prompt_tokens,
        "completion_tokens": out.num_output_tokens,
        "total_tokens": out.num_prompt_tokens + out.num_output_tokens,
    }


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
        "rank": status.rank,
        "target_modules": list(status.target_modules),
        "residence": status.residence,
        "parent": base_model,
    }


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else _MIN_LOGPROB


class _Formatter:
    """Builds one request's OpenAI JSON: the whole response, or stream chunks and the usage chunk."""

    object_name: str
    chunk_object_name: str
    id_prefix: str

    def __init__(self, model: str, token_text: TokenText, want_logprobs: bool) -> None:
        self.request_id = f"{self.id_prefix}-{uuid.uuid4().hex}"
        self.model = model
        self.created = int(time.time())
        self.token_text = token_text
        self.want_logprobs = want_logprobs

    def _envelope(self, object_name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def usage_chunk(self, last: RequestOutput) -> dict[str, Any]:
        return {**self._envelope(self.chunk_object_name, []), "usage": usage(last)}


class CompletionFormatter(_Formatter):
    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, model: str, token_text: TokenText, want_logprobs: bool) -> None:
        super().__init__(model, token_text, want_logprobs)
        self._text_offset = 0  # characters of completion text before the next logprobs token

    def _logprobs(self, items: list[TokenLogprob]) -> dict[str, list[Any]] | None:
        if not self.want_logprobs:
            return None
        tokens, offsets = [], []
        for item in items:
            tokens.append(self.token_text(item.token_id))
            offsets.append(self._text_offset)
            self._text_offset += len(tokens[-1])
        top = [self._top(i) for i in items]
        return {
            "tokens": tokens,
            "token_logprobs": [_finite(i.logprob) for i in items],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def _top(self, item: TokenLogprob) -> dict[str, float]:
        """The sampled token and the top alternatives; where two ids share a text the first wins."""
        top: dict[str, float] = {}
        for token_id, logprob in ((item.token_id, item.logprob), *item.top):
            top.setdefault(self.token_text(token_id), _finite(logprob))
        return top

    def _choice(self, text: str, logprobs: list[TokenLogprob], finish: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs), "finish_reason": finish}

    def chunk(self, out: RequestOutput, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk for one engine output, or None if it has nothing to show."""
        if not (out.new_text or out.finished or (self.want_logprobs and out.new_logprobs)):
            return None
        chunk = self._envelope(self.object_name, [self._choice(out.new_text, out.new_logprobs, out.finish_reason)])
        return {**chunk, "usage": None} if include_usage else chunk

    def response(self, text: str, logprobs: list[TokenLogprob], last: RequestOutput) -> dict[str, Any]:
        choice = self._choice(text, logprobs, last.finish_reason)
        return {**self._envelope(self.object_name, [choice]), "usage": usage(last)}


class ChatFormatter(_Formatter):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def __init__(self, model: str, token_text: TokenText, want_logprobs: bool) -> None:
        super().__init__(model, token_text, want_logprobs)
        self._role_sent = False

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

    def chunk(self, out: RequestOutput, include_usage: bool) -> dict[str, Any] | None:
        """The stream chunk for one engine output; the first one carries the assistant role."""
        if self._role_sent and not (out.new_text or out.finished or (self.want_logprobs and out.new_logprobs)):
            return None
        delta: dict[str, str] = {} if self._role_sent else {"role": "assistant"}
        self._role_sent = True
        if out.new_text or not delta:
            delta["content"] = out.new_text
        choice = {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(out.new_logprobs),
            "finish_reason": out.finish_reason,
        }
        chunk = self._envelope(self.chunk_object_name, [choice])
        return {**chunk, "usage": None} if include_usage else chunk

    def response(self, text: str, logprobs: list[TokenLogprob], last: RequestOutput) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(logprobs),
            "finish_reason": last.finish_reason,
        }
        return {**self._envelope(self.object_name, [choice]), "usage": usage(last)}


Formatter = CompletionFormatter | ChatFormatter
