"""What the gateway learns from one generation request before it spends anything on it.

`loragate_common.http_io.read_json` enforces the size limit and the JSON-object shape; `GenerationBody.parse`
checks the few fields the gateway itself acts on (`model`, `stream`, `stream_options`, `max_tokens`, `n`,
`adapter_mix`: loragate_common/adapter_mix.py); everything else in the body is the engine's to validate, and is
forwarded untouched but for `model` and `adapter_mix` (`upstream_body`). `resolve_priority` and `estimate_tokens`
turn headers and body into the admission priority and the rate-limit reservation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.policy import Policy, Tenant
from loragate_common.adapter_mix import BODY_FIELD as MIX_FIELD
from loragate_common.adapter_mix import MixPart, mix_from_body
from loragate_common.errors import bad_request, error_response
from loragate_common.http_server import MAX_HEADER_BYTES  # the request's headers, names and values together
from loragate_common.priority import Priority

DEFAULT_MAX_TOKENS = 256  # reserved for a request that names no max_tokens (the engine's own default may differ)
BYTES_PER_TOKEN = 4  # the prompt estimate: UTF-8 bytes / 4, rounded up (about right for BPE on English)


class HeaderLimit:
    """ASGI middleware: 431 when a request's headers total more than `limit` bytes.

    uvicorn's h11 limit (loragate_common/http_server.py) only bounds a head that is still incomplete; one that arrives
    in a single read passes it, so the app checks the parsed headers too.
    """

    def __init__(self, app: ASGIApp, limit: int = MAX_HEADER_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > self.limit:
            response = error_response(
                431, "request_header_fields_too_large", f"headers: larger than {self.limit} bytes"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _optional(data: dict[str, Any], key: str, kinds: tuple[type, ...], what: str) -> Any:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        raise bad_request(f"{key}: must be {what}")
    return value


@dataclass(frozen=True, slots=True)
class GenerationBody:
    """The fields of a /v1/completions or /v1/chat/completions body the gateway acts on."""

    model: str | None
    stream: bool
    include_usage: bool  # the client asked for the final usage chunk
    max_tokens: int | None  # per choice; 0 (completions): scoring the prompt, nothing generated
    prompt_tokens: int  # the estimate, see estimate_tokens
    n: int = 1  # choices: each may generate max_tokens
    adapter_mix: tuple[MixPart, ...] | None = None  # the body's `adapter_mix` (None: absent or null)

    @classmethod
    def parse(cls, data: dict[str, Any], chat: bool) -> GenerationBody:
        model = _optional(data, "model", (str,), "a string")
        stream = bool(_optional(data, "stream", (bool,), "a boolean"))
        options = _optional(data, "stream_options", (dict,), "an object")
        include_usage = bool(options and options.get("include_usage") is True)
        max_tokens = _optional(data, "max_tokens", (int,), "an integer")
        if chat and max_tokens is None:
            max_tokens = _optional(data, "max_completion_tokens", (int,), "an integer")
        if max_tokens is not None and max_tokens < 1 and not (max_tokens == 0 and _scores_prompt(data, chat)):
            raise bad_request("max_tokens: must be at least 1 (0 only with echo and logprobs, to score a prompt)")
        n = _optional(data, "n", (int,), "an integer")
        if n is not None and n < 1:
            raise bad_request("n: must be at least 1")
        if chat:
            messages = data.get("messages")
            if not isinstance(messages, list) or not messages:
                raise bad_request("messages: must be a non-empty list")
            prompt_tokens = _text_tokens(messages) + _text_tokens(data.get("tools"))  # a template may render tools
        else:
            if "prompt" not in data:
                raise bad_request("prompt: field required")
            prompt_tokens = _prompt_tokens(data["prompt"])
        mix = mix_from_body(data[MIX_FIELD]) if data.get(MIX_FIELD) is not None else None
        return cls(model, stream, stream and include_usage, max_tokens, prompt_tokens, 1 if n is None else n, mix)

    @property
    def reserve_tokens(self) -> int:
        """Tokens to reserve against the tenant's budget: the prompt estimate (computed once, whatever n) + n x
        max_tokens (or 256)."""
        max_tokens = self.max_tokens if self.max_tokens is not None else DEFAULT_MAX_TOKENS
        return self.prompt_tokens + self.n * max_tokens


def _scores_prompt(data: dict[str, Any], chat: bool) -> bool:
    """A completions request that scores its prompt (echo + logprobs): it may generate nothing (max_tokens 0)."""
    return not chat and data.get("echo") is True and data.get("logprobs") is not None


def estimate_tokens(text: str) -> int:
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / BYTES_PER_TOKEN)


def _text_tokens(value: Any) -> int:
    """Estimated tokens of every string inside `value` (chat messages: contents, names, text parts; tools:
    names, descriptions, the strings of their schemas)."""
    if isinstance(value, str):
        return estimate_tokens(value)
    if isinstance(value, list):
        return sum(_text_tokens(item) for item in value)
    if isinstance(value, dict):
        return sum(_text_tokens(item) for item in value.values())
    return 0


def _prompt_tokens(prompt: Any) -> int:
    """A completions prompt: text is estimated; token ids (a list of ints, or a batch of them) count exactly."""
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):
        return sum(_prompt_tokens(p) for p in prompt)
    if isinstance(prompt, str):
        return estimate_tokens(prompt)
    raise bad_request("prompt: must be a string, a list of strings or a list of token ids")


def upstream_body(data: dict[str, Any], adapter: str | None) -> dict[str, Any]:
    """The body an engine gets: the client's, with `model` naming the adapter the gateway authorised (a mix:
    its canonical name), or removed for the base model, and without `adapter_mix` (a mix travels as its name,
    however the client wrote it). With X-Adapter-ID set the same way, an engine can never pick another
    adapter than the one checked against the tenant's globs (the engine reads either)."""
    body = {key: value for key, value in data.items() if key not in ("model", MIX_FIELD)}
    if adapter is not None:
        body["model"] = adapter
    return body


def resolve_priority(header: str | None, policy: Policy, tenant: Tenant) -> Priority:
    """X-Priority (or the policy default), capped to the tenant's max_priority; 400 on an unknown name."""
    if header is None or not header.strip():
        priority = policy.default_priority
    else:
        try:
            priority = Priority.parse(header.strip())
        except ValueError as exc:
            raise bad_request(str(exc)) from None
    return tenant.cap(priority)
