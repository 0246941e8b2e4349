"""What differs when an upstream is a vLLM OpenAI server (`vllm=` in gateway/engine_kinds.py).

Everything else (tenants, budgets, rollouts, admission, retries, the ledger) is the same for both kinds; these are
the few places where vLLM speaks otherwise, each translated here:

- Load: vLLM has no GET /load. Its Prometheus /metrics has the running and waiting requests
  (`vllm:num_requests_running`, `vllm:num_requests_waiting`), the KV cache's use (`vllm:kv_cache_usage_perc`) and
  `vllm:lora_requests_info`: the adapters of its running and waiting requests and `max_lora`, its device's
  adapter slots. `poll` reads it as often as gateway/fleet.py reads a loragate engine's /load, into the same
  `Upstream` fields, so affinity, the load bound and spills work alike; the adapters it has loaded come from its
  /v1/models, which gateway/upstream.py's catalog reads from every engine.
  An adapter of a running or waiting request is on its device; vLLM does not say which idle ones are.
- Priority: X-Priority becomes the body's `priority` (lower first, as vLLM's priority scheduling policy orders:
  critical -1, standard 0, sheddable 1). vLLM honours it only when started with `--scheduling-policy priority`
  (the Helm chart does); otherwise it serves in arrival order.
- Catalog adapters: vLLM fetches nothing. Its `loragate vllm-agent` (vllm_agent/, given with `agent=PORT`)
  fetches the version the catalog pins with the same disk cache as a loragate engine and loads it by vLLM's
  runtime API; `ensure` asks it before the first request of an adapter vLLM does not list, with the headers a
  loragate engine would get. Its answers are a loragate engine's (503 `adapter_loading`, 502
  `adapter_fetch_failed`, 403 `adapter_source_not_allowed`). Versions `ID@N` are distinct vLLM LoRA names.
- Errors: vLLM's `{"error": {"message", "type": "BadRequestError", "param", "code"}}` becomes the gateway's
  `{"error": {"type", "message"}}` with its types (`invalid_request_error`, `adapter_not_found`, ...).
- Fields vLLM would silently drop where a loragate engine acts on them or refuses them: a `best_of` other than
  `n` and the legacy `functions` / `function_call` are a 400 naming the field, never dropped.
- Usage: vLLM answers usage as OpenAI does, and in a stream's last chunk when asked (the proxy always asks).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from starlette.responses import Response

from gateway.admission import EngineLoad, Upstream
from loragate_common.errors import error_response
from loragate_common.priority import Priority

logger = logging.getLogger(__name__)

PRIORITY = {Priority.CRITICAL: -1, Priority.STANDARD: 0, Priority.SHEDDABLE: 1}
POLL_TIMEOUT_S = 1.0
ENSURE_TIMEOUT_S = 120.0  # the agent answers 503 adapter_loading by its own --adapter-load-wait-s before this

# vLLM's error types and statuses -> the gateway's error types (loragate_common/errors.py)
_ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limited",
    500: "engine_error",
    501: "invalid_request_error",
    503: "service_unavailable",
}


@dataclass(frozen=True, slots=True)
class VllmMetrics:
    """What the gateway reads from one scrape of vLLM's /metrics."""

    running: int
    waiting: int
    kv_cache_usage: float | None
    adapters: frozenset[str]  # of its running and waiting requests
    max_lora: int | None


def parse_metrics(text: str) -> VllmMetrics:
    """One scrape, summed over vLLM's engines (data-parallel ranks) and models; ValueError if it is not vLLM's."""
    running = waiting = 0
    usage: list[float] = []
    found = False
    lora: tuple[float, dict[str, str]] | None = None  # the latest lora_requests_info sample (its value is a time)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "vllm:num_requests_running":
                running += int(sample.value)
                found = True
            elif sample.name == "vllm:num_requests_waiting":
                waiting += int(sample.value)
            elif sample.name in ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"):
                usage.append(float(sample.value))
            elif sample.name == "vllm:lora_requests_info" and (lora is None or sample.value >= lora[0]):
                lora = (sample.value, dict(sample.labels))
    if not found:
        raise ValueError("no vllm:num_requests_running in /metrics")
    adapters: frozenset[str] = frozenset()
    max_lora = None
    if lora is not None:
        labels = lora[1]
        names = f"{labels.get('running_lora_adapters', '')},{labels.get('waiting_lora_adapters', '')}"
        adapters = frozenset(n.strip() for n in names.split(",") if n.strip())
        text_max = labels.get("max_lora", "")
        max_lora = int(text_max) if text_max.isdigit() and int(text_max) > 0 else None
    return VllmMetrics(running, waiting, max(usage) if usage else None, adapters, max_lora)


async def poll(client: httpx.AsyncClient, upstream: Upstream) -> None:
    """Read a vLLM engine's /metrics once into `upstream`; an engine that does not answer keeps its last (the
    breaker and the catalog notice engines that are down; this is only a hint)."""
    try:
        resp = await client.get(f"{upstream.url}/metrics", timeout=POLL_TIMEOUT_S)
        resp.raise_for_status()
        m = parse_metrics(resp.text)
    except (httpx.HTTPError, ValueError):
        return
    upstream.reported = EngineLoad(m.running, m.waiting, time.monotonic())
    upstream.kv_cache_usage = m.kv_cache_usage
    upstream.on_device = m.adapters
    upstream.device_slots = m.max_lora if m.max_lora is not None else upstream.device_slots


def unsupported(body: Mapping[str, Any]) -> str | None:
    """Why a vLLM engine cannot serve this body as a loragate engine would (a 400's message), or None."""
    best_of, n = body.get("best_of"), body.get("n") or 1
    if best_of is not None and best_of != n:
        return (
            f"best_of: must equal n ({n}): generating best_of candidates and returning the n most likely is not "
            "supported; ask for n choices instead"
        )
    for key in ("functions", "function_call"):
        if body.get(key) is not None:
            return f"{key}: the legacy functions API is not supported; use tools and tool_choice"
    return None


def request_body(body: dict[str, Any], priority: Priority) -> dict[str, Any]:
    """The body a vLLM engine gets: the gateway's, with the request's priority in vLLM's terms."""
    return {**body, "priority": PRIORITY[priority]}


def error_answer(resp: httpx.Response, adapter: str | None) -> tuple[bytes, str]:
    """A vLLM error answer as the gateway's JSON error (its body and type). 404 on a named adapter is
    `adapter_not_found`, as a loragate engine says it."""
    message = ""
    try:
        data = resp.json()
        error = data.get("error") if isinstance(data, dict) else None
        if isinstance(error, dict):
            message = str(error.get("message", ""))
        elif isinstance(data, dict):  # older vLLM: the fields at the top level; FastAPI's own: {"detail": ...}
            message = str(data.get("message") or data.get("detail") or "")
    except ValueError:
        message = resp.text[:2000]
    status = resp.status_code
    type_ = _ERROR_TYPES.get(status, "engine_error" if status >= 500 else "invalid_request_error")
    if status == 404 and adapter is not None:
        type_ = "adapter_not_found"
    body = json.dumps({"error": {"type": type_, "message": message or f"the vLLM engine answered {status}"}})
    return body.encode(), type_


async def ensure(
    client: httpx.AsyncClient, upstream: Upstream, adapter: str, headers: Mapping[str, str]
) -> Response | None:
    """Have the engine's agent fetch and load catalog adapter `adapter` (its source `headers`); None once vLLM
    serves it, else the answer the client gets (the agent's, as a loragate engine gives it). Raises
    httpx.HTTPError when the agent cannot be reached."""
    if upstream.agent is None:
        return error_response(
            503,
            "service_unavailable",
            f"adapter {adapter!r} is a catalog adapter and the vLLM engine {upstream.url} has no agent to load it "
            "(give it one: vllm=URL,agent=PORT)",
            {"Retry-After": "1", "X-Loragate-Reason": "no_upstream"},
        )
    resp = await client.post(
        f"{upstream.agent}/v1/adapters/ensure",
        headers={"X-Adapter-ID": adapter, **headers},
        timeout=httpx.Timeout(ENSURE_TIMEOUT_S, connect=2.0),
    )
    if resp.status_code == 200:
        upstream.serves = upstream.serves | {adapter}
        return None
    keep = {k: v for k, v in resp.headers.items() if k.lower() in ("retry-after", "x-loragate-reason")}
    media_type = resp.headers.get("content-type", "application/json")
    return Response(resp.content, status_code=resp.status_code, headers=keep, media_type=media_type)
