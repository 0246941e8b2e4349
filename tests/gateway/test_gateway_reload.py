"""Policy hot reload and adapter affinity through the gateway app, against fake engines on 127.0.0.1.

- A changed policy file is picked up by the gateway's background loop (called directly in process, and
  left to run in a real `loragate gateway` process), including a Kubernetes ConfigMap's symlink swap.
- A broken file (bad YAML, unknown key, weights summing to 0, a variant that is a pattern or that no
  upstream serves) is refused with a message naming the key; the gateway keeps serving the last good
  policy, counts the error and shows it in GET /admin/policy.
- A request finishes under the policy it started with.
- Affinity: each adapter's requests land on the engine rendezvous hashing names.
"""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.admission import rendezvous_order
from gateway.app import build_app
from gateway.auth import hash_key
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics

from gateway_testing import (
    AUTH,
    COMPLETION,
    OTHER_KEY,
    asgi,
    assert_error,
    canary_users,
    rollout_policy_yaml,
    run,
    support,
)
from mock_upstream import MockUpstream
from policies import ADMIN
from polling import poll, wait_until
from processes import start_gateway, stop_process

NEW_KEY = "brand-new-key"


@pytest.fixture
def mock() -> Iterator[MockUpstream]:
    with MockUpstream(adapters=("a1", "a2", "a3")) as upstream:
        upstream.behavior.tokens = 2
        yield upstream


def with_new_key(text: str) -> str:
    return text.replace(f'["{hash_key(OTHER_KEY)}"]', f'["{hash_key(OTHER_KEY)}", "{hash_key(NEW_KEY)}"]')


def app_on(path: Path, upstreams: list[MockUpstream]) -> Any:
    return build_app(
        parse_policy(path.read_text()),
        [m.url for m in upstreams],
        MemoryRateLimiter(),
        metrics=GatewayMetrics(),
        policy_path=path,
    )


BROKEN = {
    "bad YAML": ("version: 1\ntenants: [", "line"),
    "unknown key": (
        rollout_policy_yaml().replace('    adapters: ["*"]', '    adapters: ["*"]\n    colour: red'),
        "tenants[1].colour: unknown key",
    ),
    "weights sum to 0": (rollout_policy_yaml(weights=(0, 0)), "rollouts[0].variants: weights must sum to more than 0"),
    "variant is a pattern": (rollout_policy_yaml(variants=("a1", "a*")), "rollouts[0].variants[1].adapter"),
    "variant nobody serves": (
        rollout_policy_yaml(variants=("a1", "a9")),
        "rollouts[0].variants[1].adapter: unknown adapter 'a9'",
    ),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_file_is_refused_naming_the_key_and_the_gateway_keeps_serving(
    case: str, mock: MockUpstream, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(rollout_policy_yaml())
    broken, expected = BROKEN[case]

    async def scenario() -> dict[str, Any]:
        app = app_on(path, [mock])
        gw_state = app.state.gateway
        async with asgi(app) as gw:
            await gw.get("/v1/models", headers=AUTH)  # the catalog is known: variants can be checked
            before = (await gw.get("/admin/policy", headers=ADMIN)).json()
            path.write_text(broken)
            await gw_state.housekeeping()  # one round of the background loop: sees the change
            await gw_state.housekeeping()  # the same broken bytes: not retried, not counted again
            return {
                "before": before,
                "after": (await gw.get("/admin/policy", headers=ADMIN)).json(),
                "serves": await gw.post("/v1/completions", json=COMPLETION, headers=support("u1")),
                "api": await gw.post("/admin/reload", headers=ADMIN),
                "metrics": (await gw.get("/metrics")).text,
            }

    out = run(scenario())
    assert out["after"]["sha256"] == out["before"]["sha256"]  # the last good policy is still active
    assert expected in out["after"]["last_error"]["message"], out["after"]["last_error"]
    assert out["after"]["reload_errors"] == 1
    assert out["serves"].status_code == 200
    assert_error(out["api"], 400, "invalid_policy")
    assert expected in out["api"].json()["error"]["message"]
    assert "loragate_gateway_policy_reload_errors_total 2.0" in out["metrics"]  # the file's and the API's


def test_file_change_reloads_atomically_and_in_flight_requests_keep_their_policy(
    mock: MockUpstream, tmp_path: Path
) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(rollout_policy_yaml())
    new = {"Authorization": f"Bearer {NEW_KEY}"}

    async def scenario() -> dict[str, Any]:
        app = app_on(path, [mock])
        gw_state = app.state.gateway
        async with asgi(app) as gw:
            out = {"new_before": await gw.post("/v1/completions", json=COMPLETION, headers=new)}
            mock.hold()
            inflight = asyncio.create_task(gw.post("/v1/completions", json=COMPLETION, headers=support("u1")))
            while mock.count < 1:
                await asyncio.sleep(0.01)
            # acme loses the rollout (its key still works for a1), globex gains a key
            path.write_text(with_new_key(rollout_policy_yaml(acme_adapters='["a1"]')))
            await gw_state.housekeeping()
            mock.release()
            out["inflight"] = await inflight
            out["new_after"] = await gw.post("/v1/completions", json=COMPLETION, headers=new)
            out["acme_rollout"] = await gw.post("/v1/completions", json=COMPLETION, headers=support("u1"))
            out["policy"] = (await gw.get("/admin/policy", headers=ADMIN)).json()
            return out

    out = run(scenario())
    assert_error(out["new_before"], 401)
    assert out["inflight"].status_code == 200  # started under the old policy, finished under it
    assert out["new_after"].status_code == 200
    assert_error(out["acme_rollout"], 403)
    assert out["policy"]["last_error"] is None and out["policy"]["policy"]["tenants"][0]["adapters"] == ["a1"]


def configmap(root: Path, text: str, version: int) -> Path:
    """Write `text` the way the kubelet updates a ConfigMap volume; returns the path the gateway reads."""
    data = root / f"..2026_11_29_00_00_{version:02d}.000"
    data.mkdir()
    (data / "policy.yaml").write_text(text)
    tmp = root / "..data_tmp"
    tmp.symlink_to(data.name)
    os.replace(tmp, root / "..data")  # the atomic swap
    link = root / "policy.yaml"
    if not link.is_symlink():
        link.symlink_to("..data/policy.yaml")
    return link


def test_configmap_symlink_swap_is_reloaded_and_unchanged_rollouts_keep_their_rollback(
    mock: MockUpstream, tmp_path: Path
) -> None:
    text = rollout_policy_yaml(weights=(50, 50))
    path = configmap(tmp_path, text, 1)
    mock.behavior.fail_adapters = frozenset({"a2"})
    canary = canary_users(text, 11)
    new = {"Authorization": f"Bearer {NEW_KEY}"}

    async def scenario() -> dict[str, Any]:
        app = app_on(path, [mock])
        gw_state = app.state.gateway
        async with asgi(app) as gw:
            for user in canary[:10]:  # the canary fails min_requests times: rolled back
                await gw.post("/v1/completions", json=COMPLETION, headers=support(user))
            sha = (await gw.get("/admin/policy", headers=ADMIN)).json()["sha256"]
            configmap(tmp_path, with_new_key(text), 2)  # a tenant change; the rollout is the same
            await gw_state.housekeeping()
            out = {
                "new": await gw.post("/v1/completions", json=COMPLETION, headers=new),
                "kept": (await gw.get("/admin/policy", headers=ADMIN)).json(),
                "sha": sha,
            }
            configmap(tmp_path, with_new_key(rollout_policy_yaml(weights=(50, 51))), 3)  # the rollout changes
            await gw_state.housekeeping()
            out["fresh"] = (await gw.get("/admin/policy", headers=ADMIN)).json()
            out["canary"] = await gw.post("/v1/completions", json=COMPLETION, headers=support(canary[10]))
            return out

    out = run(scenario())
    assert out["new"].status_code == 200
    assert out["kept"]["sha256"] != out["sha"]
    assert out["kept"]["rollouts"][0]["rolled_back"]["variant"] == "a2"
    assert out["fresh"]["rollouts"][0]["rolled_back"] is None
    # The fresh rollout routes the canary user to a2 again (its failure answered by a1: fallback_call).
    assert out["canary"].status_code == 200 and [r.headers["x-adapter-id"] for r in mock.received[-2:]] == ["a2", "a1"]


def test_a_gateway_process_reloads_its_file_by_itself(tmp_path: Path, mock: MockUpstream) -> None:
    proc, url = start_gateway(tmp_path, "gw", rollout_policy_yaml(), [mock.url])
    path = tmp_path / "gw.yaml"
    new = {"Authorization": f"Bearer {NEW_KEY}"}
    try:
        with httpx.Client(timeout=30) as http:
            assert http.get(f"{url}/v1/models", headers=new).status_code == 401
            path.write_text("version: 1\ntenants: {")  # broken first: refused, still serving
            error = poll(lambda: http.get(f"{url}/admin/policy", headers=ADMIN).json()["last_error"])
            assert "invalid YAML" in error["message"]
            assert http.get(f"{url}/v1/models", headers=AUTH).status_code == 200
            path.write_text(with_new_key(rollout_policy_yaml()))
            poll(lambda: http.get(f"{url}/v1/models", headers=new).status_code == 200)
    finally:
        stop_process(proc)


# ---- adapter affinity across two engines ---------------------------------------------------------------


def test_each_adapter_lands_on_its_rendezvous_upstream_and_base_spreads(mock: MockUpstream) -> None:
    with MockUpstream(adapters=("a1", "a2", "a3")) as other:
        upstreams = [mock, other]
        urls = [m.url for m in upstreams]

        async def scenario() -> Any:
            async with asgi(build_app(parse_policy(rollout_policy_yaml()), urls, MemoryRateLimiter())) as gw:
                for _ in range(4):
                    for adapter in ("a1", "a2", "a3"):
                        resp = await gw.post(
                            "/v1/completions",
                            json=COMPLETION,
                            headers={"Authorization": f"Bearer {OTHER_KEY}", "X-Adapter-ID": adapter},
                        )
                        assert resp.status_code == 200
                    base = await gw.post("/v1/completions", json=COMPLETION, headers=AUTH)
                    assert base.status_code == 200
                return (await gw.get("/admin/policy", headers=ADMIN)).json()["routing"]

        routing = run(scenario())
        assert routing["affinity"] == {a: rendezvous_order(a, urls)[0] for a in ("a1", "a2", "a3")}
        assert [u["url"] for u in routing["upstreams"]] == urls and routing["spills"] == 0
        for adapter in ("a1", "a2", "a3"):
            where = Counter(m.url for m in upstreams for r in m.received if r.headers.get("x-adapter-id") == adapter)
            assert where == {rendezvous_order(adapter, urls)[0]: 4}, (adapter, where)
        base = [sum(1 for r in m.received if "x-adapter-id" not in r.headers) for m in upstreams]
        assert base == [2, 2]  # one at a time: the least loaded, ties taken in turn


def test_reload_applies_admission_and_breaker_settings_in_place(mock: MockUpstream, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    tight = rollout_policy_yaml().replace(
        "admission: {max_inflight_per_upstream: 64, max_queue: 64",
        "admission: {max_inflight_per_upstream: 1, max_queue: 4",
    )
    assert tight != rollout_policy_yaml()
    path.write_text(tight)

    async def scenario() -> dict[str, Any]:
        app = app_on(path, [mock])
        gw_state = app.state.gateway
        async with asgi(app) as gw:
            post = lambda: gw.post("/v1/completions", json=COMPLETION, headers=AUTH)  # noqa: E731
            mock.hold()
            first = asyncio.create_task(post())
            second = asyncio.create_task(post())
            await asyncio.sleep(0.3)
            out: dict[str, Any] = {"held_before": mock.count}  # one in flight, one queued
            wider = tight.replace(
                "max_inflight_per_upstream: 1, max_queue: 4", "max_inflight_per_upstream: 2, max_queue: 0"
            )
            path.write_text(wider + "breaker: {failure_threshold: 1, open_seconds: 30}\n")
            await gw_state.housekeeping()
            await wait_until(lambda: mock.count >= 2, 10)  # the queued one got the new slot at once
            out["queue_full"] = await post()  # both slots taken, and no queue any more
            mock.release()
            out["done"] = [(await first).status_code, (await second).status_code]
            mock.behavior.fail_status = 503
            out["fail"] = await post()  # one failure now opens the breaker (the default threshold is 5)
            mock.behavior.fail_status = None
            out["open"] = await post()
            return out

    out = run(scenario())
    assert out["held_before"] == 1
    assert_error(out["queue_full"], 503, reason="queue_full")
    assert out["done"] == [200, 200]
    assert out["fail"].status_code == 503
    assert_error(out["open"], 503, reason="circuit_open")


def test_affinity_off_spreads_adapter_requests_like_base_ones(mock: MockUpstream) -> None:
    text = rollout_policy_yaml().replace("queue_timeout_ms: 5000}", "queue_timeout_ms: 5000, affinity: false}")
    assert "affinity: false" in text
    with MockUpstream(adapters=("a1", "a2", "a3")) as other:
        upstreams = [mock, other]

        async def scenario() -> Any:
            async with asgi(build_app(parse_policy(text), [m.url for m in upstreams], MemoryRateLimiter())) as gw:
                for _ in range(4):
                    resp = await gw.post(
                        "/v1/completions",
                        json=COMPLETION,
                        headers={"Authorization": f"Bearer {OTHER_KEY}", "X-Adapter-ID": "a1"},
                    )
                    assert resp.status_code == 200
                return (await gw.get("/admin/policy", headers=ADMIN)).json()["routing"]

        routing = run(scenario())
        assert [m.count for m in upstreams] == [2, 2]  # taken in turn, not all on a1's rendezvous choice
        assert routing["affinity"] == {}
