"""The fleet's adapter catalog in one gateway (gateway/adapter_catalog.py, gateway/adapter_admin.py): the
/admin/adapters API and its validation, versions, deprecation and deletion; what a request naming a catalog
adapter sends to the engine (`ID@N` and the source headers, never a client's); tenants publishing in their
own namespace within their quotas; engines' adapter_loading / adapter_fetch_failed passed through; the
per-engine state; metrics and the model list. Fake engines (tests/gateway/gateway_testing.py's CatalogEngine)
on real ports; the gateway in process. Sharing through Redis and the CLI: test_adapter_catalog_fleet.py.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
import yaml

from gateway.app import build_app
from gateway.policy import PolicyError, parse_policy
from gateway.policy_schema import policy_json_schema
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics

import policies
from gateway_testing import AdapterReply, CatalogEngine, asgi, assert_error, run
from mock_upstream import BASE_MODEL
from policies import ADMIN, ADMIN_KEY, bearer, tenant_yaml
from processes import free_port

ACME, GLOBEX, INITECH = "acme-secret", "globex-secret", "initech-secret"
COMPLETION = {"prompt": "hello", "max_tokens": 4}
SHA_A, SHA_B, SHA_C = "a" * 64, "b" * 64, "c" * 64
SOURCE = "s3://models/adapters/support"
PUBLISH = (
    "\n    publish: true\n    publish_quota: {max_adapters: 3, max_bytes: 1000}"
    '\n    publish_sources: ["s3://models/adapters/"]'
)


def catalog_yaml(breaker: str = "{failure_threshold: 1, open_seconds: 60}") -> str:
    rollout = """  - name: helpdesk
    variants: [{adapter: a1, weight: 0}, {adapter: "support@2", weight: 100}]"""
    return policies.policy_yaml(
        tenant_yaml("acme", ACME, '["support", "a1", "helpdesk"]') + PUBLISH,
        tenant_yaml("globex", GLOBEX, '["*"]'),
        tenant_yaml("initech", INITECH, "[]"),
        rollouts=rollout,
        breaker=breaker,
    )


@pytest.fixture
def engine() -> Iterator[CatalogEngine]:
    with CatalogEngine() as upstream:
        yield upstream


@pytest.fixture
def engine_b() -> Iterator[CatalogEngine]:
    with CatalogEngine() as upstream:
        yield upstream


def make_app(urls: list[str], text: str | None = None) -> Any:
    return build_app(parse_policy(text or catalog_yaml()), urls, MemoryRateLimiter(), metrics=GatewayMetrics())


async def register(
    gw: httpx.AsyncClient, adapter_id: str, sha256: str, source: str = SOURCE, auth: dict[str, str] = ADMIN, **more: Any
) -> httpx.Response:
    return await gw.post(
        "/admin/adapters", json={"id": adapter_id, "source": source, "sha256": sha256, **more}, headers=auth
    )


def generate(gw: httpx.AsyncClient, adapter: str, key: str = ACME, **headers: str) -> Any:
    return gw.post("/v1/completions", json=COMPLETION, headers={**bearer(key), "X-Adapter-ID": adapter, **headers})


# ---- the API: ids, validation, versions ----------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", ["../x", "a/b/c", "x@y", "x@1", "", "a" * 200, ".hidden", "a/..", "a b", "a/", 7])
def test_hostile_ids_are_refused_naming_the_field(engine: CatalogEngine, bad_id: Any) -> None:
    async def scenario() -> tuple[httpx.Response, dict[str, Any]]:
        async with asgi(make_app([engine.url])) as gw:
            return await register(gw, bad_id, SHA_A), (await gw.get("/admin/adapters", headers=ADMIN)).json()

    resp, listed = run(scenario())
    assert_error(resp, 400, "invalid_request_error")
    assert resp.json()["error"]["message"].startswith("id: ")
    assert listed["data"] == []


@pytest.mark.parametrize(
    ("path", "field"),
    [("x@y", "id"), ("support@0", "id"), ("a/b/c", "id"), ("%2E%2E%2Fx", "id"), ("support@01", "id")],
)
def test_hostile_refs_in_the_path_are_refused(engine: CatalogEngine, path: str, field: str) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([engine.url])) as gw:
            return [
                await gw.get(f"/admin/adapters/{path}", headers=ADMIN),
                await gw.delete(f"/admin/adapters/{path}", headers=ADMIN),
                await gw.post(f"/admin/adapters/{path}/deprecate", headers=ADMIN),
            ]

    for resp in run(scenario()):
        assert_error(resp, 400, "invalid_request_error")
        assert resp.json()["error"]["message"].startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"source": "ftp://host/x"}, "source"),
        ({"source": "s3://bucket/../etc"}, "source"),
        ({"source": 12}, "source"),
        ({"source": "https://models.example.com/a.tar.gz", "sha256": None}, "sha256"),
        ({"source": "http://127.0.0.1:9/a.tgz", "sha256": None}, "sha256"),
        ({"sha256": None}, "sha256"),  # every source is pinned: the engine needs the digest
        ({"sha256": "abc"}, "sha256"),
        ({"sha256": "g" * 64}, "sha256"),
        ({"size": -1}, "size"),
        ({"size": True}, "size"),
        ({"revision": "x" * 300}, "revision"),
        ({"tenant": "nobody"}, "tenant"),
        ({"colour": "red"}, "colour"),
    ],
)
def test_bad_registrations_name_the_field(engine: CatalogEngine, body: dict[str, Any], field: str) -> None:
    async def scenario() -> httpx.Response:
        async with asgi(make_app([engine.url])) as gw:
            data = {"id": "support", "source": SOURCE, "sha256": SHA_A, **body}
            return await gw.post(
                "/admin/adapters", json={k: v for k, v in data.items() if v is not None}, headers=ADMIN
            )

    resp = run(scenario())
    assert_error(resp, 400, "invalid_request_error")
    assert resp.json()["error"]["message"].startswith(f"{field}: "), resp.json()


def test_versions_are_numbered_once_and_registration_is_idempotent(engine: CatalogEngine) -> None:
    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with asgi(make_app([engine.url])) as gw:
            out["first"] = await register(gw, "support", SHA_A, size=1234, revision="main")
            out["again"] = await register(gw, "support", SHA_A.upper(), size=1234)  # the same digest, any case
            out["second"] = await register(gw, "support", SHA_B)
            out["back"] = await register(gw, "support", SHA_A)  # older content again: a new version
            out["delete_3"] = await gw.delete("/admin/adapters/support@3", headers=ADMIN)
            out["after_delete"] = await register(gw, "support", SHA_C)
            out["delete_all"] = await gw.delete("/admin/adapters/support", headers=ADMIN)
            out["gone"] = await gw.get("/admin/adapters/support", headers=ADMIN)
            out["reborn"] = await register(gw, "support", SHA_C)
            out["show"] = (await gw.get("/admin/adapters/support", headers=ADMIN)).json()
            out["unknown"] = await gw.delete("/admin/adapters/support@2", headers=ADMIN)
            out["no_id"] = await gw.post("/admin/adapters/nothing/deprecate", headers=ADMIN)
            out["log"] = (await gw.get("/admin/policy", headers=ADMIN)).json()["actions"]
        return out

    out = run(scenario())
    assert out["first"].status_code == 201 and out["first"].json()["ref"] == "support@1"
    v1 = out["first"].json()["adapter"]["versions"][0]
    assert (v1["source"], v1["sha256"], v1["size"], v1["revision"]) == (SOURCE, SHA_A, 1234, "main")
    assert v1["published_by"] == "admin:" + hashlib.sha256(ADMIN_KEY.encode()).hexdigest()[:12]
    published = datetime.strptime(v1["published_at"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=timezone.utc)
    assert abs(published.timestamp() - time.time()) < 120  # when: UTC, to the second
    assert out["again"].status_code == 200 and out["again"].json()["changed"] is False
    assert out["again"].json()["ref"] == "support@1"
    assert out["second"].json()["ref"] == "support@2" and out["back"].json()["ref"] == "support@3"
    assert out["delete_3"].status_code == 200
    assert out["after_delete"].json()["ref"] == "support@4"  # 3 is never given again
    assert_error(out["gone"], 404, "not_found")
    assert out["reborn"].json()["ref"] == "support@5"  # nor are a deleted id's numbers
    assert [v["version"] for v in out["show"]["versions"]] == [5]
    assert_error(out["unknown"], 404, "not_found")
    assert_error(out["no_id"], 404, "not_found")
    assert [a["action"] for a in out["log"]][:3] == ["adapter.register", "adapter.delete", "adapter.register"]


def test_admin_routes_need_a_key(engine: CatalogEngine) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([engine.url])) as gw:
            return [
                await gw.get("/admin/adapters"),
                await register(gw, "support", SHA_A, auth=bearer("not-a-key")),
                await register(gw, "support", SHA_A, auth=bearer(GLOBEX)),  # a tenant that may not publish
            ]

    nobody, wrong, globex = run(scenario())
    assert_error(nobody, 401, "authentication_error")
    assert_error(wrong, 401, "authentication_error")
    assert_error(globex, 403, "permission_denied")


# ---- the request path -----------------------------------------------------------------------------------------


def test_a_catalog_adapter_goes_upstream_as_its_version_with_the_catalog_source(engine: CatalogEngine) -> None:
    forged = {"X-Adapter-Source": "s3://evil/weights", "X-Adapter-SHA256": "f" * 64, "X-Adapter-Size": "1"}

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with asgi(make_app([engine.url])) as gw:
            await register(gw, "support", SHA_A, size=1234)
            await register(gw, "support", SHA_B)
            out["current"] = await generate(gw, "support", **forged)
            out["pinned"] = await gw.post(
                "/v1/completions", json={**COMPLETION, "model": "support@1"}, headers=bearer(ACME)
            )
            out["base"] = await gw.post("/v1/completions", json=COMPLETION, headers={**bearer(ACME), **forged})
            out["engine_adapter"] = await generate(gw, "a1", **forged)
            out["no_version"] = await generate(gw, "support@9")
            out["not_allowed"] = await generate(gw, "support@1", key=INITECH)
            await gw.post("/admin/adapters/support@2/deprecate", headers=ADMIN)
            out["after_deprecation"] = await generate(gw, "support")
            out["deprecated_pinned"] = await generate(gw, "support@2")
            await gw.post("/admin/adapters/support/deprecate", headers=ADMIN)
            out["id_deprecated"] = await generate(gw, "support")
            await gw.delete("/admin/adapters/support", headers=ADMIN)
            out["deleted"] = await generate(gw, "support")
        return out

    out = run(scenario())
    current, pinned, base, engine_adapter = engine.received[:4]
    assert out["current"].status_code == 200 and out["current"].headers["X-Loragate-Adapter"] == "support@2"
    assert "deprecation" not in out["current"].headers
    # No engine lists "support": a catalog adapter is fetched by the engine, never a 404.
    assert current.headers["x-adapter-id"] == "support@2" and current.body["model"] == "support@2"
    assert (current.headers["x-adapter-source"], current.headers["x-adapter-sha256"]) == (SOURCE, SHA_B)
    assert "x-adapter-size" not in current.headers  # v2 declared none; the client's forged one never passes
    assert pinned.headers["x-adapter-id"] == "support@1" and pinned.body["model"] == "support@1"
    assert (pinned.headers["x-adapter-sha256"], pinned.headers["x-adapter-size"]) == (SHA_A, "1234")
    for plain in (base, engine_adapter):  # a client's source headers never reach an engine
        assert not {"x-adapter-source", "x-adapter-sha256", "x-adapter-size"} & set(plain.headers)
    assert engine_adapter.headers["x-adapter-id"] == "a1"
    assert_error(out["no_version"], 404, "adapter_not_found")
    assert "versions: 1, 2" in out["no_version"].json()["error"]["message"]
    assert_error(out["not_allowed"], 403, "permission_denied")
    assert engine.received[4].headers["x-adapter-id"] == "support@1"  # 2 deprecated: `support` is 1
    assert out["after_deprecation"].headers["X-Loragate-Adapter"] == "support@1"
    assert "deprecation" not in out["after_deprecation"].headers
    assert out["deprecated_pinned"].headers["Deprecation"] == "true"
    assert out["id_deprecated"].headers["Deprecation"] == "true"
    assert out["id_deprecated"].headers["X-Loragate-Adapter"] == "support@1"
    assert_error(out["deleted"], 404, "adapter_not_found")  # no longer in the catalog, and no engine has it
    assert engine.count == 7


def test_a_rollout_variant_names_a_catalog_version(engine: CatalogEngine) -> None:
    async def scenario() -> tuple[httpx.Response, dict[str, Any]]:
        async with asgi(make_app([engine.url])) as gw:
            await register(gw, "support", SHA_A)
            await register(gw, "support", SHA_B)
            await register(gw, "support", SHA_C)  # the newest: the variant still gets 2
            resp = await generate(gw, "helpdesk", **{"X-User-ID": "u1"})
            return resp, (await gw.get("/admin/policy", headers=ADMIN)).json()

    resp, state = run(scenario())
    assert resp.status_code == 200 and resp.headers["X-Loragate-Adapter"] == "support@2"
    (received,) = engine.received
    assert received.headers["x-adapter-id"] == "support@2" and received.headers["x-adapter-sha256"] == SHA_B
    (rollout,) = state["rollouts"]
    windows = {v["adapter"]: v["window"]["requests"] for v in rollout["variants"]}
    assert windows == {"a1": 0, "support@2": 1}  # judged under the name the rollout gives it


def test_a_reload_accepts_variants_that_name_catalog_versions(engine: CatalogEngine, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(catalog_yaml())
    app = build_app(parse_policy(path.read_text()), [engine.url], MemoryRateLimiter(), policy_path=path)

    async def scenario() -> tuple[httpx.Response, httpx.Response, httpx.Response]:
        async with asgi(app) as gw:
            refused = await gw.post("/admin/reload", headers=ADMIN)  # support@2 is in no engine nor the catalog
            await register(gw, "support", SHA_A)
            await register(gw, "support", SHA_B)
            accepted = await gw.post("/admin/reload", headers=ADMIN)
            path.write_text(catalog_yaml().replace("support@2", "support@3"))
            unknown_version = await gw.post("/admin/reload", headers=ADMIN)
            return refused, accepted, unknown_version

    refused, accepted, unknown_version = run(scenario())
    assert_error(refused, 400, "invalid_policy")
    assert "rollouts[0].variants[1].adapter" in refused.json()["error"]["message"]
    assert accepted.status_code == 200
    assert_error(unknown_version, 400, "invalid_policy")


@pytest.mark.parametrize(("status", "reason"), [(503, "adapter_loading"), (502, "adapter_fetch_failed")])
@pytest.mark.parametrize("stream", [False, True])
def test_adapter_download_answers_pass_through_without_retry_or_breaker(
    engine: CatalogEngine, engine_b: CatalogEngine, status: int, reason: str, stream: bool
) -> None:
    for upstream in (engine, engine_b):
        upstream.reply = AdapterReply(status, reason, retry_after="7")
    app = make_app([engine.url, engine_b.url])  # breaker failure_threshold 1: one counted failure opens it

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with asgi(app) as gw:
            await register(gw, "support", SHA_A)
            body = {**COMPLETION, "stream": stream}
            out["answers"] = [
                await gw.post("/v1/completions", json=body, headers={**bearer(ACME), "X-Adapter-ID": "support"})
                for _ in range(3)
            ]
            out["breakers"] = [u.breaker.state for u in app.state.gateway.fleet.admission.upstreams]
            out["metrics"] = (await gw.get("/metrics")).text
            out["tried"] = engine.count + engine_b.count
            for upstream in (engine, engine_b):  # the same status without the reason: an unwell engine
                upstream.reply = AdapterReply(status, None)
            out["plain"] = await generate(gw, "support")
            out["plain_breakers"] = [u.breaker.state for u in app.state.gateway.fleet.admission.upstreams]
        return out

    out = run(scenario())
    for resp in out["answers"]:
        assert_error(resp, status, reason, reason)
        assert resp.headers["Retry-After"] == "7"
        assert resp.json()["error"]["message"] == f"engine says {reason}"  # the engine's body, as it was
        assert resp.headers["X-Loragate-Adapter"] == "support@1"
    assert out["tried"] == 3  # one engine each: not retried elsewhere
    assert out["breakers"] == ["closed", "closed"]
    assert f'reason="{reason}"' in out["metrics"]
    assert out["plain"].status_code == status
    assert engine.count + engine_b.count == 5  # the plain failure was retried on the other engine
    assert out["plain_breakers"] == ["open", "open"]


# ---- per-engine state -----------------------------------------------------------------------------------------


def test_each_versions_state_on_each_engine(engine: CatalogEngine, engine_b: CatalogEngine) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    engine.cards = [
        {
            "id": "support@1",
            "state": "device",
            "loads": 3,
            "evictions": 1,
            "last_used": 1.7e9,
            "error": None,
            "sha256": SHA_A,
        },
        {"id": "support@2", "state": "failed", "error": "digest_mismatch: expected ...", "loads": 0, "evictions": 0},
        {"id": "a1", "residence": "host"},
    ]
    engine_b.cards = [{"id": "support@2", "state": "downloading"}]

    async def scenario() -> dict[str, Any]:
        async with asgi(make_app([engine.url, engine_b.url, dead])) as gw:
            await register(gw, "support", SHA_A)
            await register(gw, "support", SHA_B)
            await register(gw, "acme/bot", SHA_C, size=10, auth=bearer(ACME))
            engine_b.cards = None  # now an engine without the route
            return {
                "list": (await gw.get("/admin/adapters", headers=ADMIN)).json(),
                "show": (await gw.get("/admin/adapters/support@2", headers=ADMIN)).json(),
                "tenant": (await gw.get("/admin/adapters", headers=bearer(ACME))).json(),
                "acme_only": (await gw.get("/admin/adapters?tenant=acme", headers=ADMIN)).json(),
            }

    out = run(scenario())
    assert [e["id"] for e in out["list"]["data"]] == ["acme/bot", "support"]
    v1, v2 = out["list"]["data"][1]["versions"]
    assert v1["engines"][engine.url] == {
        "state": "device",
        "error": None,
        "last_used": 1.7e9,
        "loads": 3,
        "evictions": 1,
        "sha256": SHA_A,
        "adapter": None,  # the card does not say what it is (an engine's says kind, rank and target_modules)
    }
    assert v1["adapter"] is None
    assert v1["engines"][engine_b.url] == {"state": "unknown", "error": "GET /v1/adapters failed: HTTPStatusError"}
    assert v1["engines"][dead]["state"] == "unknown"
    assert v2["engines"][engine.url]["state"] == "failed" and "digest_mismatch" in v2["engines"][engine.url]["error"]
    assert out["list"]["engines"] == [
        {"url": engine.url, "reachable": True, "error": None},
        {"url": engine_b.url, "reachable": False, "error": "GET /v1/adapters failed: HTTPStatusError"},
        {"url": dead, "reachable": False, "error": "GET /v1/adapters failed: ConnectError"},
    ]
    assert [v["version"] for v in out["show"]["versions"]] == [2]
    assert out["show"]["versions"][0]["engines"][engine.url]["state"] == "failed"
    (bot,) = out["tenant"]["data"]  # a tenant sees its namespace, and the engines by position only
    assert bot["id"] == "acme/bot" and bot["versions"][0]["engines"]["engine-0"] == {"state": "not loaded"}
    assert [e["url"] for e in out["tenant"]["engines"]] == ["engine-0", "engine-1", "engine-2"]
    assert [e["id"] for e in out["acme_only"]["data"]] == ["acme/bot"]


# ---- tenants publishing ---------------------------------------------------------------------------------------


def test_a_tenant_publishes_in_its_own_namespace_within_its_quota(engine: CatalogEngine) -> None:
    acme = bearer(ACME)

    async def scenario() -> dict[str, Any]:
        out: dict[str, Any] = {}
        async with asgi(make_app([engine.url])) as gw:
            out["own"] = await register(gw, "acme/bot", SHA_A, auth=acme, size=400)
            out["other_ns"] = await register(gw, "globex/bot", SHA_A, auth=acme, size=1)
            out["no_ns"] = await register(gw, "bot", SHA_A, auth=acme, size=1)
            out["for_other"] = await register(gw, "acme/x", SHA_A, auth=acme, size=1, tenant="globex")
            out["no_size"] = await register(gw, "acme/bot", SHA_B, auth=acme)
            out["foreign_source"] = await register(gw, "acme/bot", SHA_B, "s3://models/globex/bot", acme, size=4)
            out["v2"] = await register(gw, "acme/bot", SHA_B, auth=acme, size=400)
            out["over_bytes"] = await register(gw, "acme/faq", SHA_A, auth=acme, size=300)
            out["v3"] = await register(gw, "acme/faq", SHA_A, auth=acme, size=100)
            out["over_count"] = await register(gw, "acme/faq", SHA_B, auth=acme, size=1)
            out["admin_in_ns"] = await register(gw, "acme/ops", SHA_C, size=1)  # an admin is not held to it
            out["delete_v1"] = await gw.delete("/admin/adapters/acme%2Fbot@1", headers=acme)
            out["after_delete"] = await register(gw, "acme/faq", SHA_B, auth=acme, size=1)
            await register(gw, "support", SHA_A)
            out["deprecate_other"] = await gw.post("/admin/adapters/support/deprecate", headers=acme)
            out["delete_other"] = await gw.delete("/admin/adapters/support", headers=acme)
            out["show_other"] = await gw.get("/admin/adapters/support", headers=acme)
            out["deprecate_own"] = await gw.post("/admin/adapters/acme/faq@2/deprecate", headers=acme)
            out["list_other"] = await gw.get("/admin/adapters?tenant=globex", headers=acme)
            out["uses_own"] = await generate(gw, "acme/faq")
            out["globex_by_glob"] = await generate(gw, "acme/faq", key=GLOBEX)
            out["initech"] = await generate(gw, "acme/faq", key=INITECH)
            await gw.post("/admin/tenants/acme/suspend", headers=ADMIN)
            out["suspended"] = await register(gw, "acme/new", SHA_C, auth=acme, size=1)
        return out

    out = run(scenario())
    own = out["own"].json()
    assert out["own"].status_code == 201 and own["adapter"]["tenant"] == "acme"
    assert own["adapter"]["versions"][0]["published_by"] == "acme"
    assert own["adapter"]["versions"][0]["published_at"].endswith("Z")
    for key in ("other_ns", "no_ns", "for_other"):
        assert_error(out[key], 403, "permission_denied")
    assert_error(out["no_size"], 400, "invalid_request_error")
    assert out["no_size"].json()["error"]["message"].startswith("size: ")
    assert_error(out["foreign_source"], 403, "permission_denied")  # outside its publish_sources
    assert "publish_sources" in out["foreign_source"].json()["error"]["message"]
    assert out["v2"].status_code == 201
    assert_error(out["over_bytes"], 403, "quota_exceeded")  # 800 + 300 > max_bytes 1000
    assert "max_bytes" in out["over_bytes"].json()["error"]["message"]
    assert out["v3"].status_code == 201
    assert_error(out["over_count"], 403, "quota_exceeded")  # a 4th version > max_adapters 3
    assert "max_adapters" in out["over_count"].json()["error"]["message"]
    assert out["admin_in_ns"].status_code == 201
    assert out["delete_v1"].status_code == 200
    assert_error(out["after_delete"], 403, "quota_exceeded")  # the admin's acme/ops counts too: still 3
    for key in ("deprecate_other", "delete_other", "show_other", "list_other"):
        assert_error(out[key], 403, "permission_denied")
    assert out["deprecate_own"].status_code == 404  # acme/faq has version 1 only
    assert out["uses_own"].status_code == 200 and out["uses_own"].headers["X-Loragate-Adapter"] == "acme/faq@1"
    assert out["globex_by_glob"].status_code == 200
    assert_error(out["initech"], 403, "permission_denied")
    assert_error(out["suspended"], 403, "tenant_suspended")


def test_models_list_the_catalog_adapters_a_tenant_may_use(engine: CatalogEngine) -> None:
    engine.adapters = ("a1", "a2", "support@1")  # an engine lists a fetched version under ID@N

    async def scenario() -> dict[str, list[str]]:
        async with asgi(make_app([engine.url])) as gw:
            await register(gw, "support", SHA_A)
            await register(gw, "acme/bot", SHA_A, auth=bearer(ACME), size=1)
            await register(gw, "unlisted", SHA_A)
            return {
                key: [m["id"] for m in (await gw.get("/v1/models", headers=bearer(key))).json()["data"]]
                for key in (ACME, INITECH)
            }

    out = run(scenario())
    assert out[ACME] == [BASE_MODEL, "a1", "acme/bot", "support", "helpdesk"]
    assert out[INITECH] == [BASE_MODEL]


def test_metrics_count_catalog_versions_by_state(engine: CatalogEngine) -> None:
    async def scenario() -> str:
        async with asgi(make_app([engine.url])) as gw:
            for sha in (SHA_A, SHA_B, SHA_C):
                await register(gw, "support", sha)
            await register(gw, "other", SHA_A)
            await gw.post("/admin/adapters/support@1/deprecate", headers=ADMIN)
            await gw.post("/admin/adapters/other/deprecate", headers=ADMIN)
            return (await gw.get("/metrics")).text

    text = run(scenario())
    assert 'loragate_gateway_catalog_adapters{state="active"} 2.0' in text
    assert 'loragate_gateway_catalog_adapters{state="deprecated"} 2.0' in text
    assert 'action="adapter.deprecate"' in text and 'action="adapter.register"' in text


# ---- the policy -----------------------------------------------------------------------------------------------


def test_publish_settings_and_catalog_variants_in_the_policy() -> None:
    policy = parse_policy(catalog_yaml())
    acme, globex = policy.tenant("acme"), policy.tenant("globex")
    assert acme is not None and globex is not None
    assert acme.publish and (acme.publish_quota.max_adapters, acme.publish_quota.max_bytes) == (3, 1000)
    assert not globex.publish and globex.publish_quota.max_bytes == 10 << 30
    assert acme.allows("acme/anything") and acme.allows("support") and not acme.allows("globex/x")
    assert not policy.tenant("initech").allows("initech/x")  # type: ignore[union-attr]  # no publish: no namespace

    no_sources = policies.policy_yaml(tenant_yaml("acme", ACME, "[]") + "\n    publish: true")
    with pytest.raises(PolicyError, match=r"tenants\[0\]\.publish_sources: a tenant that publishes needs"):
        parse_policy(no_sources)
    bad_prefix = policies.policy_yaml(
        tenant_yaml("acme", ACME, "[]") + '\n    publish: true\n    publish_sources: ["s3://../x"]'
    )
    with pytest.raises(PolicyError, match=r"tenants\[0\]\.publish_sources\[0\]"):
        parse_policy(bad_prefix)
    bad_tenant = policies.policy_yaml(tenant_yaml("a/b", ACME, "[]") + "\n    publish: true")
    with pytest.raises(PolicyError, match=r"tenants\[0\]\.publish"):
        parse_policy(bad_tenant)

    schema = jsonschema.Draft202012Validator(policy_json_schema())
    for adapter, ok in [("acme/x@2", True), ("x@3", True), ("a/b/c", False), ("../x", False), ("a/ b", False)]:
        rollout = f"  - name: r\n    variants: [{{adapter: {json.dumps(adapter)}, weight: 1}}]"
        text = policies.policy_yaml(tenant_yaml("acme", ACME, "[]"), rollouts=rollout)
        doc = yaml.safe_load(text)
        assert schema.is_valid(doc) is ok, adapter
        if ok:
            parse_policy(text)
        else:
            with pytest.raises(PolicyError, match=r"rollouts\[0\]\.variants\[0\]\.adapter"):
                parse_policy(text)
