"""vLLM engines behind the gateway (`vllm=URL[,agent=PORT]`, gateway/vllm.py), against fake vLLM servers and
agents that answer as vLLM 0.32 and `loragate vllm-agent` do (their bodies as a real vLLM wrote them). The same
paths against a real vLLM are in tests/vllm/test_vllm_fleet.py.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from gateway.app import build_app
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics
from gateway.vllm import parse_metrics

from gateway_testing import asgi, assert_error, run
from policies import ADMIN, bearer, policy_yaml, tenant_yaml
from processes import serve_in_thread

KEY = "acme-key"
POLICY = policy_yaml(
    tenant_yaml("acme", KEY, '["*"]'), admission="{max_inflight_per_upstream: 8, max_queue: 8, queue_timeout_ms: 5000}"
)
SHA = "ab" * 32
# vLLM 0.32's /metrics, as it writes the lines the gateway reads (a LoRA gauge sample per state change, its value
# the time of the change)
METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="smollm2"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="smollm2"} 2.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="smollm2"} 0.25
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",waiting_lora_adapters=""} 1.7965479224e+09
vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",waiting_lora_adapters="c"} 1.7965479225e+09
"""


def vllm_error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": status}}, status)


@dataclass
class FakeVllm:
    """What a vLLM server answers, and what it received."""

    loras: set[str] = field(default_factory=lambda: {"static-a"})
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    fail: list[Response] = field(default_factory=list)  # the next answers, instead of a completion
    metrics: str = METRICS
    unloaded: list[str] = field(default_factory=list)

    def app(self) -> Starlette:
        async def completions(request: Request) -> Response:
            body = await request.json()
            self.received.append(body)
            self.headers.append(dict(request.headers))
            if self.fail:
                return self.fail.pop(0)
            model = body.get("model", "smollm2")
            if model != "smollm2" and model not in self.loras:
                return vllm_error(404, f"The model `{model}` does not exist. Valid aliases: smollm2.", "NotFoundError")
            choice = {"index": 0, "text": f" from {model}", "finish_reason": "length"}
            usage = {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}
            return JSONResponse({"id": "cmpl-1", "object": "text_completion", "choices": [choice], "usage": usage})

        async def models(request: Request) -> Response:
            cards = [{"id": "smollm2", "object": "model", "parent": None}]
            cards += [{"id": name, "object": "model", "parent": "smollm2"} for name in sorted(self.loras)]
            return JSONResponse({"object": "list", "data": cards})

        async def metrics(request: Request) -> Response:
            return PlainTextResponse(self.metrics)

        async def unload(request: Request) -> Response:
            name = (await request.json())["lora_name"]
            self.unloaded.append(name)
            if name not in self.loras:
                return vllm_error(404, f"The lora adapter '{name}' cannot be found.", "NotFoundError")
            self.loras.discard(name)
            return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

        return Starlette(
            routes=[
                Route("/v1/completions", completions, methods=["POST"]),
                Route("/v1/models", models),
                Route("/metrics", metrics),
                Route("/v1/unload_lora_adapter", unload, methods=["POST"]),
            ]
        )


@dataclass
class FakeAgent:
    """`loragate vllm-agent`'s POST /v1/adapters/ensure: its next answers, then it loads into `vllm`."""

    vllm: FakeVllm
    answers: list[Response] = field(default_factory=list)
    calls: list[dict[str, str]] = field(default_factory=list)

    def app(self) -> Starlette:
        async def ensure(request: Request) -> Response:
            self.calls.append(dict(request.headers))
            if self.answers:
                return self.answers.pop(0)
            adapter = request.headers["x-adapter-id"]
            self.vllm.loras.add(adapter)
            return JSONResponse({"id": adapter, "state": "loaded", "download_s": 0.1, "load_s": 0.2})

        async def cards(request: Request) -> Response:
            loaded = [
                {"id": name, "sha256": SHA, "state": "loaded", "error": None, "last_used": 1.0}
                for name in sorted(self.vllm.loras - {"static-a"})
            ]
            return JSONResponse({"object": "list", "data": loaded})

        return Starlette(routes=[Route("/v1/adapters/ensure", ensure, methods=["POST"]), Route("/v1/adapters", cards)])


@contextlib.contextmanager
def fakes(count: int = 1) -> Iterator[list[tuple[FakeVllm, FakeAgent, str, int]]]:
    """`count` fake vLLM servers, each with its agent: (vllm, agent, vllm URL, agent port)."""
    with contextlib.ExitStack() as stack:
        out = []
        for _ in range(count):
            server = FakeVllm()
            agent = FakeAgent(server)
            url = stack.enter_context(serve_in_thread(server.app()))
            agent_url = stack.enter_context(serve_in_thread(agent.app()))
            out.append((server, agent, url, int(agent_url.rsplit(":", 1)[1])))
        yield out


def gateway(upstreams: list[str]) -> Starlette:
    return build_app(parse_policy(POLICY), upstreams, MemoryRateLimiter(), metrics=GatewayMetrics())


def completion(model: str | None = None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": "hello", "max_tokens": 3, **extra}
    if model is not None:
        body["model"] = model
    return body


def test_metrics_are_read_as_vllm_writes_them() -> None:
    m = parse_metrics(METRICS)
    assert (m.running, m.waiting, m.kv_cache_usage, m.max_lora) == (3, 2, 0.25, 4)
    assert m.adapters == {"a", "b", "c"}  # the latest sample's running and waiting adapters
    with pytest.raises(ValueError):
        parse_metrics("# a page without vLLM's gauges\nprocess_cpu_seconds_total 1.0\n")


def test_priorities_and_the_body_vllm_gets() -> None:
    with fakes() as [(server, _, url, _)]:

        async def go() -> None:
            async with asgi(gateway([f"vllm={url}"])) as gw:
                for priority, expected in (("critical", -1), ("standard", 0), ("sheddable", 1)):
                    headers = {**bearer(KEY), "X-Priority": priority, "X-Adapter-ID": "static-a"}
                    resp = await gw.post("/v1/completions", json=completion(), headers=headers)
                    assert resp.status_code == 200, resp.text
                    assert server.received[-1]["priority"] == expected
                    assert server.received[-1]["model"] == "static-a"
                base = await gw.post("/v1/completions", json=completion(), headers=bearer(KEY))
                assert base.json()["choices"][0]["text"] == " from smollm2"

        run(go())


def test_fields_vllm_would_drop_are_refused_before_it_sees_them() -> None:
    with fakes() as [(server, _, url, _)]:

        async def go() -> None:
            async with asgi(gateway([f"vllm={url}"])) as gw:
                for extra, field_name in (
                    ({"best_of": 2}, "best_of"),
                    ({"functions": [{"name": "f"}]}, "functions"),
                    ({"function_call": "auto"}, "function_call"),
                ):
                    resp = await gw.post("/v1/completions", json=completion(**extra), headers=bearer(KEY))
                    assert_error(resp, 400, "invalid_request_error")
                    assert resp.json()["error"]["message"].startswith(f"{field_name}:")
                assert server.received == []
                same = await gw.post("/v1/completions", json=completion(best_of=2, n=2), headers=bearer(KEY))
                assert same.status_code == 200 and server.received[-1]["best_of"] == 2  # best_of = n changes nothing

        run(go())


def test_vllm_errors_become_the_gateways() -> None:
    with fakes(2) as [(first, _, url1, _), (second, _, url2, _)]:

        async def go() -> None:
            async with asgi(gateway([f"vllm={url1}"])) as gw:
                first.fail = [vllm_error(400, "suffix is only supported for FIM models", "BadRequestError", "suffix")]
                resp = await gw.post("/v1/completions", json=completion(), headers=bearer(KEY))
                assert resp.json() == {
                    "error": {"type": "invalid_request_error", "message": "suffix is only supported for FIM models"}
                }
                assert resp.status_code == 400
                first.fail = [vllm_error(500, "EngineCore died", "InternalServerError")] * 2
                resp = await gw.post("/v1/completions", json=completion(), headers=bearer(KEY))
                assert_error(resp, 500, "engine_error")
                first.fail = [PlainTextResponse("Internal Server Error", 500)] * 2
                assert_error(await gw.post("/v1/completions", json=completion(), headers=bearer(KEY)), 500)
            async with asgi(gateway([f"vllm={url1}", f"vllm={url2}"])) as gw:  # a 500 is retried once elsewhere
                first.received.clear()
                for _ in range(6):  # until the failing engine has been tried first once
                    first.fail = [vllm_error(500, "EngineCore died", "InternalServerError")]
                    resp = await gw.post("/v1/completions", json=completion(), headers=bearer(KEY))
                    assert resp.status_code == 200
                    if first.received:
                        break
                assert len(first.received) == 1 and not first.fail and second.received

        run(go())


def test_load_adapters_and_slots_come_from_vllms_metrics_and_models() -> None:
    with fakes() as [(server, _, url, _)]:

        async def go() -> None:
            app = gateway([f"vllm={url}"])
            fleet = app.state.gateway.fleet
            await fleet.poll_loads()
            await fleet.catalog.models()  # the engines' /v1/models, each one's kept
            [upstream] = fleet.admission.upstreams
            assert (upstream.reported.running, upstream.reported.waiting) == (3, 2)
            assert upstream.on_device == {"a", "b", "c"} and upstream.device_slots == 4
            assert upstream.kv_cache_usage == 0.25 and upstream.serves == {"static-a"}
            server.metrics = "not prometheus {{{"
            server.loras.add("later")
            await fleet.poll_loads()  # a page it cannot read keeps the last load; /v1/models still counts
            fleet.catalog.invalidate()
            await fleet.catalog.models()
            assert (upstream.reported.running, upstream.reported.waiting) == (3, 2)
            assert upstream.serves == {"static-a", "later"}
            async with asgi(app) as gw:
                state = (await gw.get("/admin/policy", headers=ADMIN)).json()["routing"]["upstreams"][0]
                assert (state["kind"], state["kv_cache_usage"], state["reported"]) == (
                    "vllm",
                    0.25,
                    {"running": 3, "waiting": 2},
                )

        run(go())


async def register(gw: httpx.AsyncClient, name: str = "support") -> str:
    body = {"id": name, "source": "s3://bucket/support/v1", "sha256": SHA, "size": 1000}
    resp = await gw.post("/admin/adapters", json=body, headers=ADMIN)
    assert resp.status_code == 201, resp.text
    return str(resp.json()["ref"])


def test_catalog_adapters_are_loaded_by_the_agent_on_their_first_request() -> None:
    with fakes() as [(server, agent, url, agent_port)]:

        async def go() -> None:
            async with asgi(gateway([f"vllm={url},agent={agent_port}"])) as gw:
                assert await register(gw) == "support@1"
                headers = {**bearer(KEY), "X-Adapter-ID": "support"}
                loading = JSONResponse(
                    {"error": {"type": "service_unavailable", "message": "being fetched"}},
                    503,
                    headers={"Retry-After": "2", "X-Loragate-Reason": "adapter_loading"},
                )
                agent.answers = [loading]
                resp = await gw.post("/v1/completions", json=completion(), headers=headers)
                assert_error(resp, 503, reason="adapter_loading")
                assert server.received == []  # nothing reached vLLM before its adapter was there
                resp = await gw.post("/v1/completions", json=completion(), headers=headers)
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == " from support@1"
                assert resp.headers["x-loragate-adapter"] == "support@1"
                call = agent.calls[-1]
                assert (call["x-adapter-id"], call["x-adapter-source"], call["x-adapter-sha256"]) == (
                    "support@1",
                    "s3://bucket/support/v1",
                    SHA,
                )
                assert len(agent.calls) == 2
                await gw.post("/v1/completions", json=completion(), headers=headers)
                assert len(agent.calls) == 2  # vLLM has it: straight there
                server.loras.discard("support@1")  # vLLM restarted and lost it
                resp = await gw.post("/v1/completions", json=completion(), headers=headers)
                assert resp.status_code == 200 and len(agent.calls) == 3
                failed = JSONResponse(
                    {"error": {"type": "adapter_fetch_failed", "message": "vLLM refused it: rank 64 > 16"}},
                    502,
                    headers={"Retry-After": "60", "X-Loragate-Reason": "adapter_fetch_failed"},
                )
                server.loras.discard("support@1")
                app_upstream = gw._transport.app.state.gateway.fleet.admission.upstreams[0]  # type: ignore[attr-defined]
                app_upstream.serves = frozenset()
                agent.answers = [failed]
                resp = await gw.post("/v1/completions", json=completion(), headers=headers)
                assert_error(resp, 502, "adapter_fetch_failed", reason="adapter_fetch_failed")
                assert "rank 64" in resp.json()["error"]["message"]

        run(go())


def test_a_catalog_adapter_never_goes_to_a_vllm_engine_without_an_agent() -> None:
    with fakes(2) as [(bare, _, bare_url, _), (served, _, url, agent_port)]:

        async def go() -> None:
            async with asgi(gateway([f"vllm={bare_url}", f"vllm={url},agent={agent_port}"])) as gw:
                await register(gw)
                for _ in range(4):
                    resp = await gw.post(
                        "/v1/completions", json=completion(), headers={**bearer(KEY), "X-Adapter-ID": "support"}
                    )
                    assert resp.status_code == 200
                assert bare.received == [] and len(served.received) == 4
            async with asgi(gateway([f"vllm={bare_url}"])) as gw:
                await register(gw)
                resp = await gw.post(
                    "/v1/completions", json=completion(), headers={**bearer(KEY), "X-Adapter-ID": "support"}
                )
                assert_error(resp, 503, reason="no_upstream")

        run(go())


def test_an_unreachable_agent_fails_over_to_another_engine() -> None:
    with fakes(1) as [(server, _, url, _)], fakes(1) as [(other, other_agent, url2, agent_port2)]:

        async def go() -> None:
            dead_agent = 1  # nothing listens on port 1
            async with asgi(gateway([f"vllm={url},agent={dead_agent}", f"vllm={url2},agent={agent_port2}"])) as gw:
                await register(gw)
                headers = {**bearer(KEY), "X-Adapter-ID": "support"}
                for _ in range(3):
                    resp = await gw.post("/v1/completions", json=completion(), headers=headers)
                    assert resp.status_code == 200, resp.text
                assert server.received == [] and len(other.received) == 3
                assert json.loads(json.dumps(other_agent.calls[0]))["x-adapter-id"] == "support@1"

        run(go())


def test_the_catalog_shows_and_unloads_versions_on_vllm_engines() -> None:
    with fakes(2) as [(bare, _, bare_url, _), (server, _, url, agent_port)]:

        async def go() -> None:
            async with asgi(gateway([f"vllm={bare_url}", f"vllm={url},agent={agent_port}"])) as gw:
                await register(gw)
                headers = {**bearer(KEY), "X-Adapter-ID": "support"}
                assert (await gw.post("/v1/completions", json=completion(), headers=headers)).status_code == 200
                entry = (await gw.get("/admin/adapters/support", headers=ADMIN)).json()
                engines = entry["versions"][0]["engines"]
                assert engines[url]["state"] == "loaded"  # the agent's card
                assert engines[bare_url]["state"] == "unknown" and "without an agent" in engines[bare_url]["error"]
                assert (await gw.delete("/admin/adapters/support@1", headers=ADMIN)).status_code == 200
                assert server.unloaded == ["support@1"] and "support@1" not in server.loras
                assert bare.unloaded == ["support@1"]  # asked too: it answered that it has no such adapter

        run(go())
