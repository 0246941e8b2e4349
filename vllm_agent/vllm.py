"""vLLM's OpenAI server as the agent uses it: the LoRAs it lists, loading and unloading one at run time, its health.

vLLM loads adapters at run time only when started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; without it the load and
unload routes do not exist (404 `{"detail": "Not Found"}`). Its answers, as vLLM 0.32 gives them:

  POST /v1/load_lora_adapter {"lora_name", "lora_path"}   200 text "Success: ...";
                                                          400 "... has already been loaded ..." (InvalidUserInput);
                                                          404 "Loading lora NAME failed: No adapter found for PATH"
  POST /v1/unload_lora_adapter {"lora_name"}              200; 404 when NAME is not loaded
  GET /v1/models                                          the base (`"parent": null`) and each LoRA (`parent` the base,
                                                          `root` the path it was loaded from)
  GET /health                                             200 when up
"""

from __future__ import annotations

from typing import Any

import httpx

RUNTIME_UPDATING_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"
_ALREADY_LOADED = "has already been loaded"
_MAX_MESSAGE = 500  # of vLLM's own error text, quoted in the agent's answers


class VllmUnavailable(Exception):
    """vLLM did not answer: not listening, timed out, or 503."""


class VllmRefused(Exception):
    """vLLM answered with an error; the message is vLLM's own. `reason`: "vllm_refused", or
    "runtime_updating_off" when the runtime LoRA routes do not exist."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class VllmClient:
    """One pooled HTTP client to one vLLM server."""

    def __init__(
        self, base_url: str, timeout_s: float, load_timeout_s: float, transport: httpx.AsyncBaseTransport | None = None
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.load_timeout_s = load_timeout_s
        self._client = httpx.AsyncClient(base_url=self.base_url, timeout=timeout_s, transport=transport)

    async def aclose(self) -> None:
        await self._client.aclose()

    async def loras(self) -> dict[str, str | None]:
        """{name: root} of every LoRA vLLM serves (the base model left out)."""
        resp = await self._send("GET", "/v1/models")
        if resp.status_code != 200:
            raise VllmRefused("vllm_refused", f"GET /v1/models: {_message(resp)}")
        try:
            cards = resp.json()["data"]
            return {
                str(c["id"]): (str(c["root"]) if c.get("root") is not None else None)
                for c in cards
                if c.get("parent") is not None
            }
        except (ValueError, KeyError, TypeError, AttributeError):
            raise VllmRefused(
                "vllm_refused", f"GET /v1/models: not a model list: {resp.text[:_MAX_MESSAGE]!r}"
            ) from None

    async def load(self, name: str, path: str) -> bool:
        """Load the adapter at `path` (as vLLM sees it) as `name`: True when loaded now, False when vLLM already
        had `name`."""
        body = {"lora_name": name, "lora_path": path}
        resp = await self._send("POST", "/v1/load_lora_adapter", body, self.load_timeout_s)
        if resp.status_code == 200:
            return True
        message = _message(resp)
        if resp.status_code == 400 and _ALREADY_LOADED in message:
            return False
        raise VllmRefused(_refusal_reason(resp), message)

    async def unload(self, name: str) -> bool:
        """Unload `name`: True when unloaded, False when vLLM did not have it."""
        resp = await self._send("POST", "/v1/unload_lora_adapter", {"lora_name": name})
        if resp.status_code == 200:
            return True
        reason = _refusal_reason(resp)
        if resp.status_code in (400, 404) and reason != "runtime_updating_off":
            return False
        raise VllmRefused(reason, _message(resp))

    async def healthy(self) -> bool:
        try:
            return (await self._client.get("/health")).status_code == 200
        except httpx.HTTPError:
            return False

    async def _send(
        self, method: str, path: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> httpx.Response:
        timeout = httpx.USE_CLIENT_DEFAULT if timeout_s is None else timeout_s
        try:
            resp = await self._client.request(method, path, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise VllmUnavailable(f"vLLM at {self.base_url} did not answer {method} {path}: {exc!r}") from None
        if resp.status_code == 503:
            raise VllmUnavailable(f"vLLM at {self.base_url} answered {method} {path} 503: {_message(resp)}")
        return resp


def _refusal_reason(resp: httpx.Response) -> str:
    """A 404 without vLLM's own error body is the route missing: runtime LoRA updating is off."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    if resp.status_code in (404, 405) and isinstance(body, dict) and "error" not in body:
        return "runtime_updating_off"
    return "vllm_refused"


def _message(resp: httpx.Response) -> str:
    """vLLM's error message (`{"error": {"message"}}`, `{"detail"}` or the text), cut to a bound."""
    try:
        body = resp.json()
    except ValueError:
        body = None
    text: Any = resp.text
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and "message" in error:
            text = error["message"]
        elif "detail" in body:
            text = body["detail"]
    text = str(text).strip() or f"HTTP {resp.status_code}"
    return f"HTTP {resp.status_code}: {text[:_MAX_MESSAGE]}"
