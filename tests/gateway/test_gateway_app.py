"""The gateway's HTTP app end to end: every status and reason of docs/reference.md with its headers, streaming
passthrough, retries, breakers and priorities against fake engines (tests/mock_upstream.py, real HTTP
servers on 127.0.0.1), the official `openai` client through the gateway to a real engine, and two gateway
processes sharing one real Redis.

In-process tests drive the app through httpx.ASGITransport; those where streaming, disconnects or
processes matter run it under a real uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.applications import Starlette

from gateway.app import build_app
from gateway.auth import hash_key
from gateway.policy import Policy, parse_policy
from gateway.proxy import Call, Exchange, Proxy
from gateway.ratelimit import MemoryRateLimiter, RateLimiter
from gateway.redis_limiter import RedisRateLimiter
from gateway.telemetry import GatewayMetrics
from loragate_common.priority import Priority

import policies
from gateway_testing import asgi, assert_error, run
from mock_upstream import BASE_MODEL, MockUpstream
from policies import ADMIN_KEY, tenant_yaml
from polling import poll, wait_until
from processes import serve_in_thread, start_engine_server, start_gateway, stop_process
from redis_server import redis_url_fixture

REPO = Path(__file__).resolve().parents[2]
KEY, OTHER_KEY = "acme-secret", "globex-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
COMPLETION = {"prompt": "hello", "max_tokens": 8}

redis_url = redis_url_fixture()


def policy_yaml(
    *,
    limits: str = "{requests_per_second: 100, burst: 100, tokens_per_minute: 1000000}",
    admission: str = "{max_inflight_per_upstream: 8, max_queue: 16, queue_timeout_ms: 5000}",
    breaker: str = "{failure_threshold: 5, open_seconds: 30, half_open_probes: 1}",
    max_priority: str = "critical",
    extra_tenant_key: str = "",
) -> str:
    return policies.policy_yaml(
        tenant_yaml("acme", KEY, '["a1", "sql-*", "support"]', max_priority=max_priority, limits=limits),
        tenant_yaml("globex", OTHER_KEY, '["*"]', limits=None, extra_keys=extra_tenant_key),
        rollouts="  - name: support\n    variants: [{adapter: a2, weight: 90}, {adapter: a1, weight: 10}]",
        admission=admission,
        breaker=breaker,
    )


def make_app(
    upstreams: list[MockUpstream], policy: Policy | None = None, limiter: RateLimiter | None = None, **kwargs: Any
) -> Starlette:
    return build_app(
        policy or parse_policy(policy_yaml()),
        [m.url for m in upstreams],
        limiter or MemoryRateLimiter(),
        metrics=GatewayMetrics(),
        **kwargs,
    )


def assert_ratelimit_headers(resp: httpx.Response) -> None:
    for name in ("RateLimit-Limit", "RateLimit-Remaining", "RateLimit-Reset"):
        assert int(resp.headers[name]) >= 0, name


# ---- 401, 400, 403, 404, 413 ----------------------------------------------------------------------------


def test_missing_or_unknown_key_is_401_with_www_authenticate(mock: MockUpstream) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock])) as gw:
            return [
                await gw.post("/v1/completions", json=COMPLETION),
                await gw.post("/v1/completions", json=COMPLETION, headers={"Authorization": "Bearer nope"}),
                await gw.post("/v1/completions", json=COMPLETION, headers={"Authorization": KEY}),
                await gw.get("/v1/models"),
            ]

    for resp in run(scenario()):
        assert_error(resp, 401, "authentication_error")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert mock.count == 0


@pytest.mark.parametrize(
    "content, headers, field",
    [
        (b"{not json", {}, "malformed JSON"),
        (b"[1, 2]", {}, "JSON object"),
        (json.dumps({"prompt": "x", "max_tokens": "8"}).encode(), {}, "max_tokens"),
        (json.dumps({"prompt": "x", "max_tokens": 0}).encode(), {}, "max_tokens"),
        (json.dumps({"prompt": "x", "stream": "yes"}).encode(), {}, "stream"),
        (json.dumps({"prompt": "x", "model": 5}).encode(), {}, "model"),
        (json.dumps({"max_tokens": 3}).encode(), {}, "prompt"),
        (json.dumps(COMPLETION).encode(), {"X-Priority": "urgent"}, "X-Priority"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(
    mock: MockUpstream, content: bytes, headers: dict[str, str], field: str
) -> None:
    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock])) as gw:
            return await gw.post(
                "/v1/completions", content=content, headers={**AUTH, "Content-Type": "application/json", **headers}
            )

    resp = run(scenario())
    assert_error(resp, 400, "invalid_request_error")
    assert field in resp.json()["error"]["message"]
    assert mock.count == 0


def test_adapter_not_allowed_is_403_and_unknown_is_404(mock: MockUpstream) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock])) as gw:
            return [
                await gw.post("/v1/completions", json={**COMPLETION, "model": "a2"}, headers=AUTH),
                await gw.post("/v1/completions", json=COMPLETION, headers={**AUTH, "X-Adapter-ID": "a2"}),
                await gw.post("/v1/completions", json={**COMPLETION, "model": "sql-nope"}, headers=AUTH),
                # the header wins over the body's model
                await gw.post(
                    "/v1/completions", json={**COMPLETION, "model": "a1"}, headers={**AUTH, "X-Adapter-ID": "sql-x"}
                ),
            ]

    forbidden, forbidden_header, unknown, unknown_header = run(scenario())
    assert_error(forbidden, 403, "permission_denied")
    assert_error(forbidden_header, 403, "permission_denied")
    assert_error(unknown, 404, "adapter_not_found")
    assert_error(unknown_header, 404, "adapter_not_found")
    assert "sql-x" in unknown_header.json()["error"]["message"]
    assert mock.count == 0


# Tenant isolation: acme may use a1, sql-* and the rollout `support` (a2 90 / a1 10), never a2 directly.
# Whatever names an adapter (X-Adapter-ID in any case, `model`, a rollout, an override), the engine gets
# exactly the adapter the gateway authorised, in X-Adapter-ID and `model` alike, or neither for the base.
@pytest.mark.parametrize(
    "path, headers, body, forwarded",
    [
        # The base model's name in the header, another tenant's adapter in the body: the base, and no `model`.
        ("/v1/completions", {"X-Adapter-ID": BASE_MODEL}, {"model": "a2"}, None),
        ("/v1/chat/completions", {"X-Adapter-ID": BASE_MODEL}, {"model": "a2"}, None),
        ("/v1/completions", {"X-Adapter-ID": BASE_MODEL}, {"model": "a2", "stream": True}, None),
        ("/v1/completions", {"x-ADAPTER-id": f"  {BASE_MODEL} "}, {"model": "a2"}, None),
        ("/v1/completions", {}, {"model": BASE_MODEL}, None),
        # An allowed adapter in the header wins over a forbidden one in the body, which is rewritten.
        ("/v1/completions", {"X-Adapter-ID": "a1"}, {"model": "a2"}, "a1"),
        ("/v1/chat/completions", {"x-adapter-id": "a1"}, {"model": "a2", "stream": True}, "a1"),
        # A rollout name: the variant it picks (acme by tenant -> a2), named as such upstream.
        ("/v1/completions", {"X-Adapter-ID": "support"}, {"model": "a1"}, "a2"),
        ("/v1/completions", {}, {"model": "support"}, "a2"),
    ],
)
def test_the_engine_gets_only_the_adapter_the_gateway_authorised(
    mock: MockUpstream, path: str, headers: dict[str, str], body: dict[str, Any], forwarded: str | None
) -> None:
    payload = {**({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else COMPLETION), **body}

    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock])) as gw:
            return await gw.post(path, json=payload, headers={**AUTH, **headers})

    resp = run(scenario())
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Loragate-Adapter"] == (forwarded or BASE_MODEL)
    (received,) = mock.received
    assert received.headers.get("x-adapter-id") == forwarded
    assert received.body.get("model") == forwarded
    assert {k: v for k, v in received.body.items() if k not in ("model", "stream_options")} == {
        k: v for k, v in payload.items() if k != "model"
    }


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Adapter-ID", "a1"), ("X-Adapter-ID", "a2")],
        [("X-Adapter-ID", BASE_MODEL), ("x-adapter-id", "a2")],
        [("X-Adapter-ID", ""), ("X-Adapter-ID", "a2")],
    ],
)
def test_a_repeated_adapter_header_is_400(mock: MockUpstream, headers: list[tuple[str, str]]) -> None:
    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock])) as gw:
            return await gw.post(
                "/v1/completions",
                json={**COMPLETION, "model": "a1"},
                headers=[("Authorization", f"Bearer {KEY}"), *headers],
            )

    resp = run(scenario())
    assert_error(resp, 400, "invalid_request_error")
    assert "X-Adapter-ID" in resp.json()["error"]["message"]
    assert mock.count == 0


@pytest.mark.parametrize(
    "content, field",
    [
        (b'{"prompt": "hi", "max_tokens": 4, "temperature": NaN}', "temperature"),
        (b'{"prompt": "hi", "max_tokens": 4, "top_p": Infinity}', "top_p"),
        (b'{"prompt": "hi", "max_tokens": 4, "presence_penalty": -Infinity}', "presence_penalty"),
        (b'{"prompt": "hi", "max_tokens": 4, "temperature": 1e999}', "temperature"),
        (b'{"prompt": "hi", "max_tokens": 4, "user": "\\udc00"}', "user"),
        (b'{"prompt": "\\ud800", "max_tokens": 4}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "\\ud800x"}]}', "messages[0].content"),
        (b'{"prompt": "hi", "extra": {"deep": [1, 2, NaN]}}', "extra.deep[2]"),
        (b'{"prompt": "hi", "\\udfff": 1}', "body"),
    ],
)
def test_json_that_cannot_be_re_encoded_is_400_naming_the_field(mock: MockUpstream, content: bytes, field: str) -> None:
    """Python's parser accepts NaN, Infinity, 1e999 and lone surrogates; re-encoding them for the engine
    used to fail with a 500."""
    path = "/v1/chat/completions" if b"messages" in content else "/v1/completions"

    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock])) as gw:
            return await gw.post(path, content=content, headers={**AUTH, "Content-Type": "application/json"})

    resp = run(scenario())
    assert_error(resp, 400, "invalid_request_error")
    assert resp.json()["error"]["message"].startswith(f"{field}: ")
    assert mock.count == 0


def test_body_over_the_limit_is_413_declared_or_streamed(mock: MockUpstream) -> None:
    big = json.dumps({"prompt": "x" * 5000, "max_tokens": 1}).encode()

    async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies to the bytes read
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock], max_body_bytes=4096)) as gw:
            return [
                await gw.post("/v1/completions", content=big, headers=AUTH),
                await gw.post("/v1/completions", content=chunked(), headers=AUTH),
            ]

    for resp in run(scenario()):
        assert_error(resp, 413, "request_too_large")
    assert mock.count == 0


def test_headers_over_the_limit_are_431(mock: MockUpstream) -> None:
    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock])) as gw:
            return await gw.post("/v1/completions", json=COMPLETION, headers={**AUTH, "X-Big": "x" * 70_000})

    assert_error(run(scenario()), 431, "request_header_fields_too_large")
    assert mock.count == 0


# ---- success: forwarding and headers ------------------------------------------------------------------


def test_success_forwards_adapter_and_capped_priority_with_headers(mock: MockUpstream) -> None:
    # A refill takes 100 s, so RateLimit-Remaining can only go down during the test.
    policy = parse_policy(
        policy_yaml(
            max_priority="standard", limits="{requests_per_second: 0.01, burst: 100, tokens_per_minute: 1000000}"
        )
    )

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock], policy)) as gw:
            return [
                await gw.post(
                    "/v1/completions", json={**COMPLETION, "model": "a1"}, headers={**AUTH, "X-Priority": "critical"}
                ),
                await gw.post(
                    "/v1/chat/completions",
                    headers={**AUTH, "X-Adapter-ID": "support"},
                    json={"messages": [{"role": "user", "content": "hi"}]},
                ),
                await gw.post("/v1/completions", json=COMPLETION, headers={**AUTH, "X-Priority": "sheddable"}),
            ]

    adapter, rollout, base = run(scenario())
    for resp in (adapter, rollout, base):
        assert resp.status_code == 200, resp.text
        assert_ratelimit_headers(resp)
    assert adapter.headers["X-Loragate-Adapter"] == "a1"
    assert adapter.json()["choices"][0]["text"] == "t0 t1 t2 t3 t4 t5 t6 t7 "
    assert rollout.headers["X-Loragate-Adapter"] == "a2"  # no X-User-ID: split by tenant, acme lands on a2 (90%)
    assert base.headers["X-Loragate-Adapter"] == BASE_MODEL
    assert int(adapter.headers["RateLimit-Remaining"]) > int(base.headers["RateLimit-Remaining"])
    first, second, third = mock.received
    assert (first.headers["x-adapter-id"], first.headers["x-priority"]) == ("a1", "standard")  # capped
    assert (second.path, second.headers["x-adapter-id"]) == ("/v1/chat/completions", "a2")
    assert "x-adapter-id" not in third.headers and third.headers["x-priority"] == "sheddable"
    assert first.body == {**COMPLETION, "model": "a1"}  # the body goes upstream untouched


def test_models_lists_base_adapters_and_rollouts_the_tenant_may_use(mock: MockUpstream) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock])) as gw:
            return [
                await gw.get("/v1/models", headers=AUTH),
                await gw.get("/v1/models", headers={"Authorization": f"Bearer {OTHER_KEY}"}),
            ]

    acme, globex = run(scenario())
    assert acme.json()["object"] == "list"
    assert [m["id"] for m in acme.json()["data"]] == [BASE_MODEL, "a1", "support"]
    assert [m["id"] for m in globex.json()["data"]] == [BASE_MODEL, "a1", "a2", "support"]
    assert all(m["object"] == "model" for m in acme.json()["data"])


def test_upstream_4xx_passes_through_and_is_not_a_breaker_failure(mock: MockUpstream) -> None:
    mock.behavior.fail_status = 400
    policy = parse_policy(policy_yaml(breaker="{failure_threshold: 1, open_seconds: 30}"))

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock], policy)) as gw:
            return [await gw.post("/v1/completions", json=COMPLETION, headers=AUTH) for _ in range(3)]

    for resp in run(scenario()):
        assert_error(resp, 400, "mock_error")
        assert resp.headers["X-Loragate-Adapter"] == BASE_MODEL  # an engine's answer names what it served
        assert_ratelimit_headers(resp)
    assert mock.count == 3  # the breaker (threshold 1) never opened


# ---- 429 ----------------------------------------------------------------------------------------------


def test_over_the_request_rate_is_429_rate_limited(mock: MockUpstream) -> None:
    policy = parse_policy(policy_yaml(limits="{requests_per_second: 0.01, burst: 2, tokens_per_minute: 100000}"))

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock], policy)) as gw:
            return [await gw.post("/v1/completions", json=COMPLETION, headers=AUTH) for _ in range(3)]

    ok1, ok2, limited = run(scenario())
    assert ok1.status_code == ok2.status_code == 200
    assert_error(limited, 429, "rate_limit_exceeded", "rate_limited")
    assert limited.headers["RateLimit-Limit"] == "2" and limited.headers["RateLimit-Remaining"] == "0"
    assert int(limited.headers["Retry-After"]) > 50  # 1 request per 100 s
    assert mock.count == 2


def test_over_the_token_budget_is_429_tokens_exhausted(mock: MockUpstream) -> None:
    policy = parse_policy(policy_yaml(limits="{requests_per_second: 100, burst: 100, tokens_per_minute: 300}"))

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock], policy)) as gw:
            return [
                await gw.post("/v1/completions", json={"prompt": "hello", "max_tokens": 200}, headers=AUTH),
                await gw.post("/v1/completions", json={"prompt": "hello", "max_tokens": 200}, headers=AUTH),
                await gw.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1000}, headers=AUTH),
            ]

    first, second, too_big = run(scenario())
    # first reserves 2 + 200 and uses 5 + 8: the unused tokens come back, so the second fits too
    assert first.status_code == second.status_code == 200
    assert_error(too_big, 429, "rate_limit_exceeded", "tokens_exhausted")
    assert_ratelimit_headers(too_big)
    assert mock.count == 2


# ---- 503 ----------------------------------------------------------------------------------------------


def test_queue_full_and_queue_timeout_are_503(mock: MockUpstream) -> None:
    full = parse_policy(policy_yaml(admission="{max_inflight_per_upstream: 1, max_queue: 0}"))
    slow = parse_policy(policy_yaml(admission="{max_inflight_per_upstream: 1, max_queue: 4, queue_timeout_ms: 200}"))

    async def scenario(policy: Policy) -> tuple[httpx.Response, httpx.Response]:
        mock.hold()
        async with asgi(make_app([mock], policy)) as gw:
            first = asyncio.ensure_future(gw.post("/v1/completions", json=COMPLETION, headers=AUTH))
            await wait_until(lambda: mock.count >= 1)
            shed = await gw.post("/v1/completions", json=COMPLETION, headers=AUTH)
            mock.release()
            return await first, shed

    served, shed = run(scenario(full))
    assert served.status_code == 200
    assert_error(shed, 503, "service_unavailable", "queue_full")
    assert_ratelimit_headers(shed)
    mock.reset()
    served, timed_out = run(scenario(slow))
    assert served.status_code == 200
    assert_error(timed_out, 503, "service_unavailable", "queue_timeout")
    assert mock.count == 1


@pytest.mark.parametrize("status", [502, 503, 504])
def test_breaker_opens_after_failure_threshold_then_circuit_open(mock: MockUpstream, status: int) -> None:
    mock.behavior.fail_status = status
    policy = parse_policy(policy_yaml(breaker="{failure_threshold: 2, open_seconds: 30}"))

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock], policy)) as gw:
            return [await gw.post("/v1/completions", json=COMPLETION, headers=AUTH) for _ in range(3)]

    fail1, fail2, refused = run(scenario())
    assert fail1.status_code == fail2.status_code == status  # one upstream: nothing to retry on
    assert_error(refused, 503, "service_unavailable", "circuit_open")
    assert 20 < int(refused.headers["Retry-After"]) <= 30
    assert mock.count == 2


def test_answered_500s_do_not_open_the_breaker_but_are_retried_elsewhere(
    mock: MockUpstream, mock_b: MockUpstream
) -> None:
    # a 500 is the request's failure (e.g. a broken adapter), not the engine's: it must not eject the engine
    mock.behavior.fail_status = 500
    policy = parse_policy(policy_yaml(breaker="{failure_threshold: 2, open_seconds: 30}"))

    async def scenario() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with asgi(make_app([mock], policy)) as gw:
            alone = [await gw.post("/v1/completions", json=COMPLETION, headers=AUTH) for _ in range(4)]
        async with asgi(make_app([mock, mock_b], policy)) as gw:
            paired = [await gw.post("/v1/completions", json=COMPLETION, headers=AUTH) for _ in range(4)]
        return alone, paired

    alone, paired = run(scenario())
    assert [r.status_code for r in alone] == [500] * 4  # never circuit_open: the engine kept answering
    assert [r.status_code for r in paired] == [200] * 4  # each failed attempt retried on the other engine
    assert mock_b.count == 4 and mock.count > 4  # `mock` was tried (and failed) in the pair too


def test_an_engine_503_is_passed_through_as_upstream_unavailable(mock: MockUpstream, mock_b: MockUpstream) -> None:
    """An engine's own reason (draining, engine_failure) describes the engine, not this gateway."""
    for upstream in (mock, mock_b):
        upstream.behavior.fail_status = 503

    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock, mock_b])) as gw:
            return await gw.post("/v1/completions", json=COMPLETION, headers=AUTH)

    resp = run(scenario())
    assert_error(resp, 503, reason="upstream_unavailable")
    assert mock.count == mock_b.count == 1  # tried on both engines


def test_no_upstream_and_draining_are_503(mock: MockUpstream) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([])) as gw:
            none = await gw.post("/v1/completions", json=COMPLETION, headers=AUTH)
        app = make_app([mock])
        async with asgi(app) as gw:
            ready = await gw.get("/readyz")
            app.state.gateway.drain()
            return [
                none,
                ready,
                await gw.post("/v1/completions", json=COMPLETION, headers=AUTH),
                await gw.get("/readyz"),
                await gw.get("/healthz"),
            ]

    none, ready, draining, not_ready, alive = run(scenario())
    assert_error(none, 503, "service_unavailable", "no_upstream")
    assert ready.status_code == 200 and alive.status_code == 200
    assert_error(draining, 503, "service_unavailable", "draining")
    assert_error(not_ready, 503, "service_unavailable", "draining")
    assert mock.count == 0


def test_redis_down_with_fail_closed_is_503_and_not_ready(mock: MockUpstream) -> None:
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    policy = parse_policy(policy_yaml() + "ratelimit: {on_redis_error: closed}\n")

    async def scenario() -> list[httpx.Response]:
        limiter = RedisRateLimiter(f"redis://127.0.0.1:{port}/0", on_error="closed")
        async with asgi(make_app([mock], policy, limiter)) as gw:
            return [await gw.post("/v1/completions", json=COMPLETION, headers=AUTH), await gw.get("/readyz")]

    refused, not_ready = run(scenario())
    assert_error(refused, 503, "service_unavailable", "ratelimit_unavailable")
    assert_error(not_ready, 503, "service_unavailable", "ratelimit_unavailable")
    assert mock.count == 0


def test_queued_requests_are_served_by_priority(mock: MockUpstream) -> None:
    policy = parse_policy(policy_yaml(admission="{max_inflight_per_upstream: 1, max_queue: 8}"))

    async def scenario() -> list[httpx.Response]:
        app = make_app([mock], policy)
        admission = app.state.gateway.fleet.admission
        mock.hold()
        async with asgi(app) as gw:

            async def send(priority: str) -> httpx.Response:
                return await gw.post(
                    "/v1/completions", json={**COMPLETION, "prompt": priority}, headers={**AUTH, "X-Priority": priority}
                )

            tasks = [asyncio.ensure_future(send("standard"))]
            await wait_until(lambda: mock.count == 1)
            for i, priority in enumerate(("sheddable", "standard", "critical")):
                tasks.append(asyncio.ensure_future(send(priority)))
                await wait_until(lambda i=i: sum(admission.queue_depths().values()) == i + 1)
            mock.release()
            return list(await asyncio.gather(*tasks))

    assert all(r.status_code == 200 for r in run(scenario()))
    assert [r.body["prompt"] for r in mock.received] == ["standard", "critical", "standard", "sheddable"]


# ---- admin ------------------------------------------------------------------------------------------


def test_admin_policy_and_reload_keep_the_last_good_policy(mock: MockUpstream, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(policy_yaml())
    new_key = "new-globex-key"

    async def scenario() -> dict[str, httpx.Response]:
        app = make_app([mock], parse_policy(path.read_text()), policy_path=path)
        admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
        new = {"Authorization": f"Bearer {new_key}"}
        async with asgi(app) as gw:
            out = {
                "tenant": await gw.get("/admin/policy", headers=AUTH),
                "policy": await gw.get("/admin/policy", headers=admin),
            }
            path.write_text(policy_yaml().replace("burst: 100", "burst: 0"))
            out["bad"] = await gw.post("/admin/reload", headers=admin)
            out["mid"] = await gw.get("/admin/policy", headers=admin)
            out["still"] = await gw.post("/v1/completions", json=COMPLETION, headers=AUTH)
            out["new_before"] = await gw.get("/v1/models", headers=new)
            path.write_text(policy_yaml(extra_tenant_key=f', "{hash_key(new_key)}"'))
            out["good"] = await gw.post("/admin/reload", headers=admin)
            out["new_after"] = await gw.get("/v1/models", headers=new)
            out["after"] = await gw.get("/admin/policy", headers=admin)
            return out

    out = run(scenario())
    assert_error(out["tenant"], 401)
    body = out["policy"].json()
    assert body["policy"]["tenants"][0]["id"] == "acme" and len(body["sha256"]) == 64 and body["loaded_at"]
    assert_error(out["bad"], 400, "invalid_policy")
    assert "tenants[0].limits.burst" in out["bad"].json()["error"]["message"]
    assert out["still"].status_code == 200
    assert_error(out["new_before"], 401)
    assert out["good"].status_code == 200 and out["good"].json()["sha256"] != body["sha256"]
    assert out["new_after"].status_code == 200
    # The refused reload was shown until this one succeeded; the count of refusals stays.
    assert out["mid"].json()["last_error"]["message"] == out["bad"].json()["error"]["message"]
    assert out["after"].json()["last_error"] is None and out["after"].json()["reload_errors"] == 1


# ---- under a real uvicorn: streaming, retries, disconnects ----------------------------------------------


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The data of each SSE event."""
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def stream_body(**extra: Any) -> dict[str, Any]:
    return {**COMPLETION, "stream": True, **extra}


def test_stream_is_relayed_as_it_arrives_and_usage_only_when_asked(mock: MockUpstream) -> None:
    mock.behavior.pause_after_chunks = 1  # the upstream stops after one chunk until resumed
    with serve_in_thread(make_app([mock])) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=stream_body(), headers=AUTH) as resp:
            assert resp.status_code == 200 and resp.headers["X-Loragate-Adapter"] == BASE_MODEL
            assert resp.headers["content-type"].startswith("text/event-stream")
            assert_ratelimit_headers(resp)
            events = sse_events(resp.iter_lines())
            first = json.loads(next(events))
            assert first["choices"][0]["text"] == "t0 " and mock.streams_finished == 0  # upstream still going
            mock.resume()
            rest = list(events)
        with http.stream(
            "POST", "/v1/completions", headers=AUTH, json=stream_body(stream_options={"include_usage": True})
        ) as resp:
            with_usage = list(sse_events(resp.iter_lines()))
    assert rest[-1] == "[DONE]" and "[DONE]" not in rest[:-1]
    chunks = [first] + [json.loads(e) for e in rest[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "".join(f"t{i} " for i in range(8))
    assert all("usage" not in c for c in chunks)  # the gateway asked for usage; the client did not
    assert mock.received[0].body["stream_options"] == {"include_usage": True}
    assert with_usage[-1] == "[DONE]"
    usage = json.loads(with_usage[-2])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 8
    assert len(with_usage) == 8 + 2


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failure", ["status_500", "dropped"])
def test_failure_before_the_first_byte_is_retried_on_the_other_upstream(
    mock: MockUpstream, mock_b: MockUpstream, stream: bool, failure: str
) -> None:
    if failure == "status_500":
        mock.behavior.fail_status = 500
    else:
        mock.behavior.drop_before_first_byte = True
    sent = 0
    with serve_in_thread(make_app([mock, mock_b])) as url, httpx.Client(base_url=url, timeout=30) as http:
        while mock.count == 0 and sent < 4:  # admission alternates between equally idle upstreams
            sent += 1
            resp = http.post("/v1/completions", json=stream_body() if stream else COMPLETION, headers=AUTH)
            assert resp.status_code == 200, resp.text
            if stream:
                events = list(sse_events(resp.text.splitlines()))
                assert events[-1] == "[DONE]" and not any("error" in e for e in events)
                assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == "".join(
                    f"t{i} " for i in range(8)
                )
            else:
                assert resp.json()["choices"][0]["text"] == "".join(f"t{i} " for i in range(8))
    assert mock.count == 1  # the failing upstream saw the request once ...
    assert mock_b.count == sent  # ... and the other served every request exactly once


_CHUNKS = [  # stream chunks with the usage the gateway asked for: text that looks like the JSON around it
    {
        "id": "c1",
        "object": "text_completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "text": 'é "q" , "usage": null}', "logprobs": None, "finish_reason": None}],
        "usage": None,
    },
    {
        "id": "c2",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": {"content": "\n\n}"}, "finish_reason": "stop"}],
        "usage": None,
    },
]


@pytest.mark.parametrize("include_usage", [False, True], ids=["usage not asked", "usage asked"])
def test_stream_chunks_are_relayed_alike_in_the_engines_format_and_any_other(include_usage: bool) -> None:
    proxy = Proxy(None, None, None)  # type: ignore[arg-type]  # _event uses none of them
    call = Call(
        path="/v1/completions",
        body={},
        tenant="t",
        adapter=None,
        served="m",
        priority=Priority.STANDARD,
        stream=True,
        include_usage=include_usage,
        started_at=time.monotonic(),
    )
    for chunk in _CHUNKS:
        expected = {k: v for k, v in chunk.items() if include_usage or k != "usage"}
        engine_format = b"data: " + json.dumps(chunk, ensure_ascii=False).encode() + b"\n\n"
        compact = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        for event in (engine_format, compact):
            exchange = Exchange()
            out, done = proxy._event(call, event, exchange)
            assert not done and out.startswith(b"data: ") and out.endswith(b"\n\n")
            assert json.loads(out[len(b"data: ") :]) == expected
            assert exchange.ttft_s is not None  # a token reached the client


def test_upstream_dying_mid_stream_ends_with_an_error_event_and_no_duplicates(
    mock: MockUpstream, mock_b: MockUpstream
) -> None:
    mock.behavior.die_after_chunks = mock_b.behavior.die_after_chunks = 3
    with serve_in_thread(make_app([mock, mock_b])) as url, httpx.Client(base_url=url, timeout=30) as http:
        resp = http.post("/v1/completions", json=stream_body(), headers=AUTH)
    assert resp.status_code == 200
    events = list(sse_events(resp.text.splitlines()))
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    error = json.loads(events[-2])["error"]
    assert error["type"] == "upstream_error" and error["message"]
    assert [json.loads(e)["choices"][0]["text"] for e in events[:-2]] == ["t0 ", "t1 ", "t2 "]
    assert mock.count + mock_b.count == 1  # no retry once tokens reached the client


def test_client_disconnect_cancels_the_upstream_stream_and_frees_the_slot(mock: MockUpstream) -> None:
    mock.behavior.tokens, mock.behavior.token_interval_s = 400, 0.02
    app = make_app([mock])
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=stream_body(), headers=AUTH) as resp:
            events = sse_events(resp.iter_lines())
            assert json.loads(next(events))["choices"][0]["text"] == "t0 "
        poll(
            lambda: mock.streams_aborted and not sum(app.state.gateway.fleet.admission.inflight().values()),
            10,
            what="the upstream stream cancelled and the slot freed",
        )
    assert mock.streams_finished == 0 and mock.streams_aborted == 1


# ---- the official client through the gateway to a real engine --------------------------------------------


def test_openai_client_through_the_gateway_to_a_real_engine(tmp_path: Path, tiny_model_dir: Path) -> None:
    engine, engine_url = start_engine_server(tmp_path / "engine.log", "--max-model-len", "512")
    try:
        with serve_in_thread(build_app(parse_policy(policy_yaml()), [engine_url], MemoryRateLimiter())) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)
            args: dict[str, Any] = {
                "model": "tiny-random",
                "temperature": 0,
                "max_tokens": 6,
                "extra_body": {"ignore_eos": True},
            }
            full = client.completions.create(prompt="The quick brown fox", **args)
            chunks = list(client.completions.create(prompt="The quick brown fox", stream=True, **args))
            chat = list(
                client.chat.completions.create(
                    messages=[{"role": "user", "content": "hi"}],
                    stream=True,
                    stream_options={"include_usage": True},
                    **args,
                )
            )
            raw = client.completions.with_raw_response.create(prompt="x", **args)
            with pytest.raises(openai.AuthenticationError):
                openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).completions.create(
                    prompt="x", **args
                )
            with pytest.raises(openai.NotFoundError):
                client.completions.create(prompt="x", **{**args, "model": "sql-missing"})
            models = [m.id for m in client.models.list()]
    finally:
        engine.terminate()
        engine.wait(timeout=60)
    assert full.usage.completion_tokens == 6 and full.usage.prompt_tokens > 0
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert all(c.usage is None for c in chunks)
    assert chat[-1].usage is not None and chat[-1].usage.completion_tokens == 6
    assert "".join(c.choices[0].delta.content or "" for c in chat[:-1])
    assert raw.headers["X-Loragate-Adapter"] == "tiny-random" and "RateLimit-Remaining" in raw.headers
    assert models[0] == "tiny-random"


# ---- gateway processes -------------------------------------------------------------------------------


def test_bad_policy_file_exits_2_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(policy_yaml().replace("burst: 100", "burst: 0"))
    done = subprocess.run(
        [sys.executable, "-m", "loragate", "gateway", "--policy", str(path), "--upstream", "http://127.0.0.1:1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 2
    assert "tenants[0].limits.burst" in done.stderr


def test_two_gateways_share_one_redis_limit(tmp_path: Path, redis_url: str, mock: MockUpstream) -> None:
    burst, rps = 5, 10.0
    mock.behavior.tokens = 1
    policy = policy_yaml(limits=f"{{requests_per_second: {rps}, burst: {burst}, tokens_per_minute: 1000000}}")
    gateways = [start_gateway(tmp_path, f"gw{i}", policy, [mock.url], "--redis", redis_url) for i in range(2)]
    try:

        async def hammer() -> tuple[list[int], float]:
            async with httpx.AsyncClient(timeout=30) as http:

                async def one(i: int) -> int:
                    url = gateways[i % 2][1]
                    return (await http.post(f"{url}/v1/completions", json=COMPLETION, headers=AUTH)).status_code

                started = time.monotonic()
                statuses: list[int] = []
                for _ in range(6):  # 6 rounds of 8 concurrent requests, split over both gateways
                    statuses += await asyncio.gather(*(one(i) for i in range(8)))
                    await asyncio.sleep(0.2)  # the buckets refill a little between rounds
                return statuses, time.monotonic() - started

        statuses, window = run(hammer())
    finally:
        for proc, _ in gateways:
            stop_process(proc)
    admitted = statuses.count(200)
    assert set(statuses) <= {200, 429}
    # one shared budget: a limiter per process would admit about twice as many
    assert burst < admitted <= burst + rps * window + 2, (admitted, window)
    assert mock.count == admitted


def test_sigterm_drains_then_exits(tmp_path: Path, mock: MockUpstream) -> None:
    proc, url = start_gateway(tmp_path, "gw", policy_yaml(), [mock.url])
    try:
        huge_head = httpx.get(f"{url}/healthz", headers={"X-Big": "x" * 100_000}, timeout=5)
        assert huge_head.status_code in (400, 431)  # the HTTP layer's limit or the app's
        mock.hold()
        result: dict[str, httpx.Response] = {}
        inflight = threading.Thread(
            target=lambda: result.setdefault(
                "r", httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=AUTH, timeout=30)
            )
        )
        inflight.start()
        poll(lambda: mock.count, 10, what="the request in flight")
        proc.send_signal(signal.SIGTERM)
        poll(lambda: httpx.get(f"{url}/readyz", timeout=5).status_code == 503, 10, what="not ready (draining)")
        refused = httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=AUTH, timeout=5)
        mock.release()
        inflight.join(timeout=20)
        assert proc.wait(timeout=20) == 0
    finally:
        mock.release()
        stop_process(proc)
    assert_error(refused, 503, "service_unavailable", "draining")
    assert result["r"].status_code == 200
    assert mock.count == 1


def test_metrics_count_requests_by_reason_and_stream_timings(mock: MockUpstream) -> None:
    policy = parse_policy(policy_yaml(limits="{requests_per_second: 0.01, burst: 2, tokens_per_minute: 100000}"))

    async def scenario() -> str:
        async with asgi(make_app([mock], policy)) as gw:
            await gw.post("/v1/completions", json=stream_body(model="a1"), headers=AUTH)
            await gw.post("/v1/completions", json=COMPLETION, headers=AUTH)
            await gw.post("/v1/completions", json=COMPLETION, headers=AUTH)  # 429
            await gw.post("/v1/completions", json=COMPLETION)  # 401
            return (await gw.get("/metrics")).text

    text = run(scenario())
    assert 'loragate_gateway_requests_total{adapter="a1",reason="",status="200",tenant="acme"} 1.0' in text
    assert f'loragate_gateway_requests_total{{adapter="{BASE_MODEL}",reason="",status="200",tenant="acme"}} 1.0' in text
    assert (
        f'loragate_gateway_requests_total{{adapter="{BASE_MODEL}",reason="rate_limited",status="429",'
        'tenant="acme"} 1.0'
    ) in text
    assert 'status="401",tenant="unknown"} 1.0' in text
    assert 'loragate_gateway_time_to_first_token_seconds_count{adapter="a1"} 1.0' in text
    assert 'loragate_gateway_time_per_output_token_seconds_count{adapter="a1"} 1.0' in text


@pytest.mark.parametrize("probes", [False, True], ids=["default", "log-probes"])
def test_the_log_shows_requests_not_polls(tmp_path: Path, mock: MockUpstream, probes: bool) -> None:
    """At the default level the gateway logs each request it serves, but neither the probes it answers (/healthz,
    /readyz, /metrics) nor its own requests to the engines (the load poll every second, the proxied calls), unless
    --log-probes; `loragate up`'s banner stays on the screen."""
    extra = ["--log-level", "info", *(["--log-probes"] if probes else [])]
    mock.behavior.load = (0, 0, ())
    proc, url = start_gateway(tmp_path, "gw", policy_yaml(), [mock.url], *extra)
    try:
        for path in ("/healthz", "/readyz", "/metrics"):
            assert httpx.get(f"{url}{path}", timeout=5).status_code == 200
        assert httpx.post(f"{url}/v1/completions", json=COMPLETION, headers=AUTH, timeout=10).status_code == 200
        poll(lambda: mock.load_polls >= 2, 10, what="two load polls")
    finally:
        stop_process(proc)
    log = (tmp_path / "gw.log").read_text()
    assert '"POST /v1/completions HTTP/1.1" 200' in log
    assert ('"GET /readyz HTTP/1.1" 200' in log) == probes and ('"GET /metrics HTTP/1.1" 200' in log) == probes
    assert "HTTP Request:" not in log  # httpx's line per request to an engine
