"""Faults one client can cause, through the shared stack (gateway + two engines + Redis): a poisoned
adapter, a corrupt one, another tenant's adapter named every way there is, hostile ids, clients that
leave mid-stream, and clients too slow to send their request."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path

import httpx
import pytest

from processes import start_engine_server, stop_process
from rawhttp import gather_tally, post_json, request
from stack import GREEDY, MAX_MODEL_LEN, PROMPT, SCALE, Stack, auth

BODY = {"prompt": PROMPT, **GREEDY}


def _text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _post(
    stack: Stack, tenant: str, headers: dict[str, str] | list[tuple[str, str]] = (), body: dict | None = None
) -> httpx.Response:
    pairs = list(headers.items()) if isinstance(headers, dict) else list(headers)
    return httpx.post(
        f"{stack.url}/v1/completions", json=body or BODY, timeout=60, headers=[*auth(tenant).items(), *pairs]
    )


def test_a_poisoned_adapter_fails_alone_and_never_opens_a_breaker(
    stack: Stack, references: dict[str | None, str]
) -> None:
    """acme keeps asking for acme-bad (NaN weights) while globex's traffic runs beside it."""

    def bad():
        return post_json(stack.url, "/v1/completions", BODY, {**auth("acme"), "X-Adapter-ID": "acme-bad"}, tag="bad")

    def good(adapter: str | None):
        headers = {**auth("globex"), **({"X-Adapter-ID": adapter} if adapter else {})}
        return lambda: post_json(stack.url, "/v1/completions", BODY, headers, tag=adapter)

    calls = [bad] * (6 * SCALE) + [good("globex-a"), good(None)] * (20 * SCALE)
    tally = asyncio.run(gather_tally(calls, concurrency=8))
    assert not tally.failures
    for answer in tally.answers:
        if answer.tag == "bad":  # a 500 naming the adapter: the request's failure, not the engine's
            assert answer.status == 500 and answer.error_type == "adapter_error", answer.body
            assert answer.headers["x-loragate-adapter"] == "acme-bad"
            assert "non-finite" in answer.json()["error"]["message"]
        else:
            assert answer.status == 200, answer.body
            assert answer.json()["choices"][0]["text"] == references[answer.tag]
    assert set(stack.breakers().values()) == {"closed"}
    for engine in stack.engines:
        assert httpx.get(f"{engine.url}/readyz", timeout=30).status_code == 200
    stack.wait_idle()


def test_a_corrupt_adapter_is_skipped_at_start_and_never_served(stack: Stack) -> None:
    resp = _post(stack, "initech", {"X-Adapter-ID": "broken"})
    assert resp.status_code == 404 and resp.json()["error"]["type"] == "adapter_not_found"
    for engine in stack.engines:
        assert "skipping" in engine.log.read_text() and "broken" in engine.log.read_text()


def test_another_tenants_adapter_is_unreachable_by_every_naming_path(
    stack: Stack, references: dict[str | None, str]
) -> None:
    """acme may use acme-* only; globex-a must never answer it, whatever it sends."""
    base = references[None]
    # The base model's name in the header, globex-a in the body: served by the base model.
    model_name = httpx.get(f"{stack.engines[0].url}/v1/models", timeout=30).json()["data"][0]["id"]
    resp = _post(stack, "acme", {"X-Adapter-ID": model_name}, {**BODY, "model": "globex-a"})
    assert _text(resp) == base and resp.headers["x-loragate-adapter"] == model_name
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/completions",
        timeout=60,
        json={**BODY, "model": "globex-a", "stream": True},
        headers={**auth("acme"), "x-adapter-id": model_name},
    ) as stream:
        events = [
            json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == base
    chat = httpx.post(
        f"{stack.url}/v1/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "hi"}], "model": "globex-a", **GREEDY},
        headers={**auth("acme"), "X-Adapter-ID": model_name},
    )
    assert chat.status_code == 200 and chat.json()["model"] == model_name
    # Naming it directly, in any case or repeated: refused.
    for headers, body, status in [
        ({}, {**BODY, "model": "globex-a"}, 403),
        ({"X-Adapter-ID": "globex-a"}, BODY, 403),
        ({"x-ADAPTER-id": "globex-a"}, {**BODY, "model": "acme-a"}, 403),
        ([("X-Adapter-ID", "acme-a"), ("X-Adapter-ID", "globex-a")], BODY, 400),
        ([("X-Adapter-ID", model_name), ("X-Adapter-ID", "globex-a")], BODY, 400),
        # Through its own rollout, overriding to another tenant's adapter: not one of the variants.
        ({"X-Adapter-ID": "acme-support", "X-Variant": "globex-a"}, BODY, 400),
        ({"X-Adapter-ID": "acme-support", "X-Variant": "globex-a"}, {**BODY, "model": "globex-a"}, 400),
    ]:
        resp = _post(stack, "acme", headers, body)
        assert resp.status_code == status, (headers, body, resp.text)
        assert resp.headers.get("x-loragate-adapter") != "globex-a"
    # Its own rollout and override still work, and the override answers with the adapter it names.
    resp = _post(stack, "acme", {"X-Adapter-ID": "acme-support", "X-Variant": "acme-b"}, {**BODY, "model": "globex-a"})
    assert _text(resp) == references["acme-b"] and resp.headers["x-loragate-adapter"] == "acme-b"
    resp = _post(stack, "acme", {"X-Adapter-ID": "acme-support", "X-User-ID": "u7"})
    assert _text(resp) == references[resp.headers["x-loragate-adapter"]]


HOSTILE = [
    "../acme-a",
    "acme-a/../globex-a",
    "/etc/passwd",
    "..",
    ".hidden",
    "a" * 5000,
    "acme-a\x00",
    "acme-*",
    "*",
    "acme-a ",
    "ü",
    "a\\b",
    "%2e%2e%2f",
]


@pytest.mark.parametrize("where", ["header", "model"])
def test_hostile_adapter_ids_are_refused_without_a_5xx(stack: Stack, where: str) -> None:
    for adapter in HOSTILE:
        if where == "header" and (not adapter.isascii() or "\x00" in adapter or adapter != adapter.strip()):
            continue  # not sendable as an HTTP header value
        for tenant in ("initech", "acme"):
            headers = {"X-Adapter-ID": adapter} if where == "header" else {}
            body = {**BODY, "max_tokens": 2, "min_tokens": 0, "model": adapter} if where == "model" else None
            resp = _post(stack, tenant, headers, body)
            assert resp.status_code in (200, 400, 403, 404), (adapter, resp.status_code, resp.text)
            assert resp.headers.get("x-loragate-adapter") in (None, "acme-a", *_base(stack))
            assert len(resp.text) < 2000  # a hostile id is never echoed whole
        direct = httpx.post(
            f"{stack.engines[0].url}/v1/completions",
            timeout=60,
            json={**BODY, "max_tokens": 2, "min_tokens": 0, "model": adapter},
        )
        assert direct.status_code in (200, 400, 404), (adapter, direct.text)
    assert _post(stack, "initech", {"X-Adapter-ID": "acme-a"}).status_code == 200


def _base(stack: Stack) -> tuple[str]:
    return (httpx.get(f"{stack.engines[0].url}/v1/models", timeout=30).json()["data"][0]["id"],)


def test_clients_that_leave_mid_stream_free_the_engines(stack: Stack) -> None:
    async def leave_after_first_token(http: httpx.AsyncClient, adapter: str | None) -> None:
        headers = {**auth("initech"), **({"X-Adapter-ID": adapter} if adapter else {})}
        body = {"prompt": PROMPT, "max_tokens": MAX_MODEL_LEN - 16, "ignore_eos": True, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body, headers=headers) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    return  # gone, with the answer still streaming

    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            await asyncio.gather(*(leave_after_first_token(http, a) for a in ["acme-a", None, "globex-a"] * 3))

    asyncio.run(scenario())
    stack.wait_idle()  # every engine request aborted: nothing running, every KV block back
    assert sum(u["inflight"] for u in stack.admin_policy()["routing"]["upstreams"]) == 0


def test_slow_clients_time_out_while_everyone_else_is_served(tmp_path: Path) -> None:
    proc, url = start_engine_server(
        tmp_path / "engine.log",
        "--header-timeout-s",
        "1",
        "--body-timeout-s",
        "1",
        "--max-model-len",
        str(MAX_MODEL_LEN),
    )
    host, port = url.removeprefix("http://").split(":")
    try:
        silent = [socket.create_connection((host, int(port))) for _ in range(20)]
        trickling = [socket.create_connection((host, int(port))) for _ in range(10)]
        for sock in trickling:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 500\r\n\r\n{")

        async def served() -> list:
            calls = [lambda: post_json(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4})] * 20
            tally = await gather_tally(calls, concurrency=4)
            assert not tally.failures
            return [a.status for a in tally.answers]

        statuses = asyncio.run(served())
        assert statuses == [200] * 20
        for sock in silent + trickling:  # each was answered 408 and closed, none hangs
            sock.settimeout(30)
            data = b""
            while chunk := sock.recv(4096):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408"), data[:80]
            sock.close()
        assert asyncio.run(request(url, "GET", "/healthz")).status == 200
    finally:
        stop_process(proc)
