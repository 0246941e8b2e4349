"""Operator actions (gateway/admin.py, gateway/overrides.py): suspend and resume tenants, drain and undrain
upstreams, reset breakers, act on rollouts; each through the HTTP API and through `loragate admin`, logged,
counted and idempotent; overrides shared by two gateways through a real Redis and cleared by a reload.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import build_app
from gateway.fleet_store import RedisFleetStore
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics

import policies
from gateway_testing import asgi, assert_error, run
from mock_upstream import BASE_MODEL, MockUpstream
from policies import ADMIN, ADMIN_KEY, bearer, tenant_yaml
from processes import serve_in_thread, start_gateway, stop_process
from redis_server import redis_url_fixture

redis_url = redis_url_fixture()

KEY, OTHER_KEY = "acme-secret", "globex-secret"
COMPLETION = {"prompt": "hello", "max_tokens": 4}
ROLLOUT = """  - name: support
    variants: [{adapter: a1, weight: 1}, {adapter: a2, weight: 1}]
    steps: [10, 100]
    hold_s: 60
    rollback: {max_error_rate: 0.2, max_ttft_p99_ms: 60000, min_requests: 10, window_s: 60}"""


def ops_yaml(breaker: str = "{failure_threshold: 5, open_seconds: 30, half_open_probes: 1}") -> str:
    return policies.policy_yaml(
        tenant_yaml("acme", KEY, '["*"]'),
        tenant_yaml("globex", OTHER_KEY, '["*"]'),
        rollouts=ROLLOUT,
        breaker=breaker,
        admission="{max_inflight_per_upstream: 8, max_queue: 16, queue_timeout_ms: 5000}",
    )


def make_app(upstreams: list[MockUpstream], text: str | None = None, **kwargs: Any) -> Any:
    return build_app(
        parse_policy(text or ops_yaml()),
        [m.url for m in upstreams],
        MemoryRateLimiter(),
        metrics=GatewayMetrics(),
        **kwargs,
    )


ACTIONS = [
    ("POST", "/admin/rollouts/support/pause", None),
    ("POST", "/admin/upstreams/drain", {"url": "x"}),
    ("POST", "/admin/tenants/acme/suspend", None),
    ("POST", "/admin/overrides/clear", None),
    ("POST", "/admin/reload", None),
    ("GET", "/admin/policy", None),
]


def test_no_action_without_the_admin_key(mock: MockUpstream) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock])) as gw:
            out = []
            for method, path, body in ACTIONS:
                for headers in ({}, bearer(KEY), {"Authorization": f"Basic {ADMIN_KEY}"}):
                    out.append(await gw.request(method, path, json=body, headers=headers))
            out.append(await gw.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)))  # still served
            return out

    *refused, served = run(scenario())
    for resp in refused:
        assert_error(resp, 401, "authentication_error")
        assert resp.headers["WWW-Authenticate"] == "Bearer"
    assert served.status_code == 200


def test_suspend_and_resume_a_tenant(mock: MockUpstream) -> None:
    async def scenario() -> dict[str, Any]:
        async with asgi(make_app([mock])) as gw:
            admin = {**ADMIN, "X-Loragate-Actor": "alice"}
            out: dict[str, Any] = {
                "suspend": await gw.post(
                    "/admin/tenants/acme/suspend", headers=admin, json={"reason": "invoice overdue <b>"}
                ),
                "again": await gw.post("/admin/tenants/acme/suspend", headers=admin),
                "refused": await gw.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)),
                "models": await gw.get("/v1/models", headers=bearer(KEY)),
                "other": await gw.post("/v1/completions", json=COMPLETION, headers=bearer(OTHER_KEY)),
                "state": (await gw.get("/admin/policy", headers=ADMIN)).json(),
                "metrics": (await gw.get("/metrics")).text,
                "resume": await gw.post("/admin/tenants/acme/resume", headers=admin),
                "resume_again": await gw.post("/admin/tenants/acme/resume", headers=admin),
            }
            out["served"] = await gw.post("/v1/completions", json=COMPLETION, headers=bearer(KEY))
            out["after"] = (await gw.get("/admin/policy", headers=ADMIN)).json()
            out["metrics_after"] = (await gw.get("/metrics")).text
            return out

    out = run(scenario())
    assert out["suspend"].status_code == 200 and out["suspend"].json()["changed"] is True
    assert out["again"].json()["changed"] is False  # idempotent: the first reason stands
    assert_error(out["refused"], 403, "tenant_suspended")
    assert "invoice overdue <b>" in out["refused"].json()["error"]["message"]
    assert_error(out["models"], 403, "tenant_suspended")
    assert out["other"].status_code == 200
    suspended = out["state"]["overrides"]["suspended_tenants"]
    assert [(s["target"], s["reason"]) for s in suspended] == [("acme", "invoice overdue <b>")]
    assert suspended[0]["by"].startswith("alice (key:") and len(suspended[0]["by"]) == len("alice (key:)") + 12
    assert out["state"]["tenants"]["acme"]["suspended"]["reason"] == "invoice overdue <b>"
    assert out["state"]["tenants"]["acme"]["requests"] == 1  # the refused completion (counted as the tenant's)
    assert out["state"]["tenants"]["globex"]["requests"] == 1
    assert 'loragate_gateway_tenant_suspended{tenant="acme"} 1.0' in out["metrics"]
    assert 'loragate_gateway_admin_actions_total{action="tenant.suspend",changed="true"} 1.0' in out["metrics"]
    assert 'loragate_gateway_admin_actions_total{action="tenant.suspend",changed="false"} 1.0' in out["metrics"]
    assert out["resume"].json()["changed"] is True and out["resume_again"].json()["changed"] is False
    assert out["served"].status_code == 200
    assert out["after"]["overrides"]["suspended_tenants"] == []
    assert 'loragate_gateway_tenant_suspended{tenant="acme"}' not in out["metrics_after"]
    actions = [(a["action"], a["target"], a["changed"]) for a in out["after"]["actions"]]
    assert actions == [
        ("tenant.resume", "acme", False),
        ("tenant.resume", "acme", True),
        ("tenant.suspend", "acme", False),
        ("tenant.suspend", "acme", True),
    ]  # newest first


def test_drain_takes_no_new_requests_and_lets_those_in_flight_finish(mock: MockUpstream, mock_b: MockUpstream) -> None:
    mock.behavior.pause_after_chunks = 1
    app = make_app([mock, mock_b])
    with serve_in_thread(app) as url, httpx.Client(base_url=url, timeout=30) as http:
        # One stream in flight on `mock` (the least loaded goes first; ties rotate from the first upstream).
        with http.stream("POST", "/v1/completions", json={**COMPLETION, "stream": True}, headers=bearer(KEY)) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            assert len(mock.received) == 1
            drained = http.post("/admin/upstreams/drain", headers=ADMIN, json={"url": mock.url + "/"})
            assert drained.json()["changed"] is True and drained.json()["state"]["drained"] is True
            assert drained.json()["state"]["inflight"] == 1
            for _ in range(6):  # base-model and adapter requests alike go to the other one
                assert http.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200
                assert (
                    http.post("/v1/completions", json={**COMPLETION, "model": "a1"}, headers=bearer(KEY)).status_code
                    == 200
                )
            assert len(mock.received) == 1 and len(mock_b.received) == 12
            mock.resume()
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]"  # the request in flight on the drained upstream finished
        state = http.get("/admin/policy", headers=ADMIN).json()
        assert [(u["url"], u["drained"]) for u in state["routing"]["upstreams"]] == [
            (mock.url, True),
            (mock_b.url, False),
        ]
        metrics = http.get("/metrics").text
        assert f'loragate_gateway_upstream_drained{{upstream="{mock.url}"}} 1.0' in metrics
        assert http.post("/admin/upstreams/drain", headers=ADMIN, json={"url": mock_b.url}).json()["changed"]
        assert_error(
            http.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)),
            503,
            "service_unavailable",
            "no_upstream",
        )
        assert http.post("/admin/upstreams/undrain", headers=ADMIN, json={"url": mock.url}).json()["changed"]
        assert not http.post("/admin/upstreams/undrain", headers=ADMIN, json={"url": mock.url}).json()["changed"]
        assert http.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200
        assert len(mock.received) == 2


def test_reset_breaker_closes_an_open_breaker(mock: MockUpstream) -> None:
    mock.behavior.fail_status = 502
    text = ops_yaml(breaker="{failure_threshold: 1, open_seconds: 300}")

    async def scenario() -> dict[str, Any]:
        async with asgi(make_app([mock], text)) as gw:
            out = {
                "failed": await gw.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)),
                "open": await gw.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)),
            }
            mock.behavior.fail_status = None  # the engine is fixed; nobody wants to wait 300 s
            out["reset"] = await gw.post("/admin/upstreams/reset-breaker", headers=ADMIN, json={"url": mock.url})
            out["again"] = await gw.post("/admin/upstreams/reset-breaker", headers=ADMIN, json={"url": mock.url})
            out["served"] = await gw.post("/v1/completions", json=COMPLETION, headers=bearer(KEY))
            return out

    out = run(scenario())
    assert out["failed"].status_code == 502
    assert_error(out["open"], 503, "service_unavailable", "circuit_open")
    assert out["reset"].json()["changed"] is True and out["reset"].json()["state"]["breaker"] == "closed"
    assert out["again"].json()["changed"] is False
    assert out["served"].status_code == 200


def test_rollout_actions_over_http(mock: MockUpstream) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock])) as gw:
            return [
                await gw.post(f"/admin/rollouts/support/{action}", headers=ADMIN)
                for action in ("pause", "pause", "resume", "promote", "rollback", "reset")
            ]

    pause, pause_again, resume, promote, rollback, reset = run(scenario())
    assert pause.json()["changed"] and pause.json()["state"]["control"]["status"] == "paused"
    assert pause.json()["state"]["control"]["by"].startswith("key:")
    assert pause_again.json()["changed"] is False
    assert resume.json()["state"]["control"]["status"] == "progressing"
    assert promote.json()["state"]["control"]["status"] == "promoted"
    assert [v["current_weight"] for v in promote.json()["state"]["variants"]] == [0.0, 100.0]
    assert rollback.json()["state"]["rolled_back"]["reason"] == "operator"
    assert [v["current_weight"] for v in rollback.json()["state"]["variants"]] == [100.0, 0.0]
    assert reset.json()["state"]["rolled_back"] is None
    assert reset.json()["state"]["control"]["step"] == 0 and reset.json()["state"]["control"]["weight"] == 10


def test_bad_admin_requests_get_clear_errors(mock: MockUpstream) -> None:
    fixed = ops_yaml().replace("    steps: [10, 100]\n    hold_s: 60\n", "")

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock], fixed)) as gw:
            return [
                await gw.post(path, headers=ADMIN, **kwargs)
                for path, kwargs in [
                    ("/admin/rollouts/nope/pause", {}),
                    ("/admin/rollouts/support/explode", {}),
                    ("/admin/rollouts/support/pause", {}),  # a fixed split has no steps to pause
                    ("/admin/tenants/nobody/suspend", {}),
                    ("/admin/tenants/acme/explode", {}),
                    ("/admin/tenants/acme/suspend", {"json": {"reason": 7}}),
                    ("/admin/tenants/acme/suspend", {"content": b"{not json"}),
                    ("/admin/upstreams/drain", {"json": {}}),
                    ("/admin/upstreams/drain", {"json": {"url": "http://127.0.0.1:1"}}),
                    ("/admin/upstreams/explode", {"json": {"url": mock.url}}),
                    ("/admin/upstreams/drain", {"content": b'{"url": "' + b"x" * 20000 + b'"}'}),
                ]
            ]

    (
        no_rollout,
        bad_action,
        fixed_pause,
        no_tenant,
        bad_tenant_action,
        bad_reason,
        bad_json,
        no_url,
        no_upstream,
        bad_upstream_action,
        too_big,
    ) = run(scenario())
    assert_error(no_rollout, 404, "not_found")
    assert_error(bad_action, 404, "not_found")
    assert "pause, resume, promote, rollback, reset" in bad_action.json()["error"]["message"]
    assert_error(fixed_pause, 409, "conflict")
    assert_error(no_tenant, 404, "not_found")
    assert_error(bad_tenant_action, 404, "not_found")
    assert_error(bad_reason, 400, "invalid_request_error")
    assert_error(bad_json, 400, "invalid_request_error")
    assert_error(no_url, 400, "invalid_request_error")
    assert_error(no_upstream, 404, "not_found")
    assert_error(bad_upstream_action, 404, "not_found")
    assert_error(too_big, 413)


def test_a_reload_and_the_clear_action_lift_every_override(mock: MockUpstream, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(ops_yaml())

    async def scenario() -> dict[str, Any]:
        async with asgi(make_app([mock], policy_path=path)) as gw:
            await gw.post("/admin/tenants/acme/suspend", headers=ADMIN)
            await gw.post("/admin/upstreams/drain", headers=ADMIN, json={"url": mock.url})
            out = {
                "reload": await gw.post("/admin/reload", headers=ADMIN),
                "served": await gw.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)),
            }
            await gw.post("/admin/tenants/globex/suspend", headers=ADMIN)
            out["clear"] = await gw.post("/admin/overrides/clear", headers=ADMIN)
            out["clear_again"] = await gw.post("/admin/overrides/clear", headers=ADMIN)
            out["other"] = await gw.post("/v1/completions", json=COMPLETION, headers=bearer(OTHER_KEY))
            return out

    out = run(scenario())
    assert out["reload"].status_code == 200 and out["served"].status_code == 200
    assert out["clear"].json()["changed"] is True and out["clear_again"].json()["changed"] is False
    assert out["clear"].json()["overrides"]["suspended_tenants"] == []
    assert out["other"].status_code == 200


def test_two_replicas_share_overrides_and_breaker_resets_through_redis(redis_url: str, mock: MockUpstream) -> None:
    mock.behavior.fail_status = 502
    text = ops_yaml(breaker="{failure_threshold: 1, open_seconds: 300}")

    async def scenario() -> dict[str, Any]:
        shares = [RedisFleetStore(redis_url), RedisFleetStore(redis_url)]
        apps = [make_app([mock], text, fleet_store=share) for share in shares]
        replicas = [app.state.gateway for app in apps]
        async with asgi(apps[0]) as one, asgi(apps[1]) as two:
            await replicas[0].fleet.clear_overrides()  # a clean Redis for this test
            out: dict[str, Any] = {}
            await one.post("/admin/tenants/acme/suspend", headers=ADMIN, json={"reason": "audit"})
            await two.post("/admin/upstreams/drain", headers=ADMIN, json={"url": mock.url})
            for replica in replicas:
                await replica.housekeeping()
            out["two_refuses"] = await two.post("/v1/completions", json=COMPLETION, headers=bearer(KEY))
            out["one_drained"] = await one.post("/v1/completions", json=COMPLETION, headers=bearer(OTHER_KEY))
            out["state_one"] = (await one.get("/admin/policy", headers=ADMIN)).json()
            await one.post("/admin/upstreams/undrain", headers=ADMIN, json={"url": mock.url})
            for replica in replicas:
                await replica.housekeeping()
            # Open both replicas' breakers, then reset through one of them: both close.
            for gw in (one, two):
                await gw.post("/v1/completions", json=COMPLETION, headers=bearer(OTHER_KEY))
            out["open"] = [u.breaker.state for r in replicas for u in r.fleet.admission.upstreams]
            await one.post("/admin/upstreams/reset-breaker", headers=ADMIN, json={"url": mock.url})
            await replicas[1].housekeeping()
            out["closed"] = [u.breaker.state for r in replicas for u in r.fleet.admission.upstreams]
            out["log_on_two"] = (await two.get("/admin/policy", headers=ADMIN)).json()["actions"]
            await replicas[0].fleet.clear_overrides()
            await replicas[1].housekeeping()
            out["cleared"] = replicas[1].fleet.overrides.describe()
        for share in shares:
            await share.aclose()
        return out

    out = run(scenario())
    assert_error(out["two_refuses"], 403, "tenant_suspended")  # suspended through the other replica
    assert_error(out["one_drained"], 503, "service_unavailable", "no_upstream")  # drained through the other
    assert [s["target"] for s in out["state_one"]["overrides"]["suspended_tenants"]] == ["acme"]
    assert out["state_one"]["overrides"]["shared"] is True
    assert out["open"] == ["open", "open"] and out["closed"] == ["closed", "closed"]
    assert [a["action"] for a in out["log_on_two"]][:4] == [
        "upstream.reset-breaker",
        "upstream.undrain",
        "upstream.drain",
        "tenant.suspend",
    ]
    assert out["cleared"]["suspended_tenants"] == [] and out["cleared"]["drained_upstreams"] == []


# ---- the CLI ------------------------------------------------------------------------------------------


def loragate_admin(url: str, *args: str, key: str | None = ADMIN_KEY) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "LORAGATE_ADMIN_KEY"}
    if key is not None:
        env["LORAGATE_ADMIN_KEY"] = key
    return subprocess.run(
        [sys.executable, "-m", "loragate", "admin", "--url", url, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_every_action_through_the_cli(tmp_path: Path, mock: MockUpstream, mock_b: MockUpstream) -> None:
    proc, url = start_gateway(tmp_path, "gw", ops_yaml(), [mock.url, mock_b.url])
    try:
        with httpx.Client(base_url=url, timeout=30) as http:

            def state() -> dict[str, Any]:
                return http.get("/admin/policy", headers=ADMIN).json()

            for action, status in [
                ("pause", "paused"),
                ("resume", "progressing"),
                ("promote", "promoted"),
                ("reset", "progressing"),
            ]:
                done = loragate_admin(url, "rollout", "support", action)
                assert done.returncode == 0, done.stderr
                assert json.loads(done.stdout)["changed"] is True
                assert state()["rollouts"][0]["control"]["status"] == status
            done = loragate_admin(url, "rollout", "support", "rollback")
            assert done.returncode == 0 and state()["rollouts"][0]["rolled_back"]["reason"] == "operator"

            assert loragate_admin(url, "tenant", "acme", "suspend", "--reason", "audit").returncode == 0
            resp = http.post("/v1/completions", json=COMPLETION, headers=bearer(KEY))
            assert_error(resp, 403, "tenant_suspended")
            assert "audit" in resp.json()["error"]["message"]
            assert loragate_admin(url, "tenant", "acme", "resume").returncode == 0
            assert http.post("/v1/completions", json=COMPLETION, headers=bearer(KEY)).status_code == 200

            assert loragate_admin(url, "upstream", "drain", mock.url).returncode == 0
            assert [u["drained"] for u in state()["routing"]["upstreams"]] == [True, False]
            assert loragate_admin(url, "upstream", "undrain", mock.url).returncode == 0
            done = loragate_admin(url, "upstream", "reset-breaker", mock_b.url)
            assert done.returncode == 0 and json.loads(done.stdout)["changed"] is False  # it was closed
            assert loragate_admin(url, "tenant", "globex", "suspend").returncode == 0
            assert json.loads(loragate_admin(url, "overrides", "clear").stdout)["changed"] is True
            status = loragate_admin(url, "status")
            assert status.returncode == 0 and json.loads(status.stdout)["overrides"]["suspended_tenants"] == []
            piped = subprocess.run(
                f"{sys.executable} -m loragate admin --url {url} status | head -c 1",
                shell=True,
                env={**os.environ, "LORAGATE_ADMIN_KEY": ADMIN_KEY},
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert piped.stdout == "{" and "Traceback" not in piped.stderr  # a reader that stops early
            assert loragate_admin(url, "reload").returncode == 0

            log = state()["actions"]
            assert log[0]["action"] == "reload" and log[0]["by"].endswith(")")  # "<login> (key:...)"
            assert {a["action"] for a in log} >= {
                "rollout.pause",
                "tenant.suspend",
                "upstream.drain",
                "upstream.reset-breaker",
                "overrides.clear",
            }

        unknown = loragate_admin(url, "tenant", "nobody", "suspend")
        assert unknown.returncode == 1 and "404" in unknown.stderr and "nobody" in unknown.stderr
        wrong_key = loragate_admin(url, "status", key="not-the-key")
        assert wrong_key.returncode == 1 and "401" in wrong_key.stderr
        no_key = loragate_admin(url, "status", key=None)
        assert no_key.returncode == 2 and "LORAGATE_ADMIN_KEY" in no_key.stderr
    finally:
        stop_process(proc)
    gone = loragate_admin(url, "status")
    assert gone.returncode == 1 and "cannot reach the gateway" in gone.stderr


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/models"])
def test_base_model_name_is_unaffected(mock: MockUpstream, path: str) -> None:
    """Overrides never touch a tenant that is not named (the base model keeps serving it)."""

    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock])) as gw:
            await gw.post("/admin/tenants/globex/suspend", headers=ADMIN)
            if path == "/v1/models":
                return await gw.get(path, headers=bearer(KEY))
            return await gw.post(path, json=COMPLETION, headers=bearer(KEY))

    resp = run(scenario())
    assert resp.status_code == 200
    if path == "/v1/models":
        assert BASE_MODEL in [m["id"] for m in resp.json()["data"]]
