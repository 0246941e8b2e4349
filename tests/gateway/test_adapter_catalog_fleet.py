"""The adapter catalog shared by gateway replicas through a real Redis, driven by the real CLI
(`loragate adapters`, loragate/adapters_cli.py, run through loragate.cli.main): what one replica registers the
other serves within about a second; replicas registering at once never hand out one version twice; a Redis
outage keeps the last snapshot serving; `register` pins local and hf sources to the digest it computes
(checked against coreutils' sha256sum) and an hf revision to its commit; a tenant publishes with its own key.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from gateway.app import build_app
from gateway.catalog_store import CATALOG_KEY, RedisCatalogStore
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics
from loragate.cli import main

import policies
from adapter_servers import HubServer, synthetic_adapter
from gateway_testing import CatalogEngine, asgi, assert_error, run
from policies import ADMIN, ADMIN_KEY, bearer, tenant_yaml
from polling import poll
from processes import serve_in_thread, start_gateway, stop_process
from redis_server import RedisServer, redis_server_fixture

redis_server = redis_server_fixture()

ACME = "acme-secret"
COMPLETION = {"prompt": "hello", "max_tokens": 4}
ARCHIVE = "https://models.example.com/support.tar.gz"


def fleet_yaml() -> str:
    publishing = '\n    publish: true\n    publish_sources: ["https://models.example.com/"]'
    return policies.policy_yaml(tenant_yaml("acme", ACME, '["support", "hf-bot"]') + publishing)


@pytest.fixture
def engine() -> Iterator[CatalogEngine]:
    with CatalogEngine() as upstream:
        yield upstream


@pytest.fixture
def fresh_redis(redis_server: RedisServer) -> str:
    """The module's Redis, without a catalog left by an earlier test."""
    with redis.Redis.from_url(redis_server.url) as client:
        client.delete(CATALOG_KEY)
    return redis_server.url


def sha256sum_digest(directory: Path) -> str:
    """`sha256sum adapter_config.json adapter_model.safetensors | sha256sum`, by coreutils (the reference)."""
    listing = subprocess.run(
        ["sha256sum", "adapter_config.json", "adapter_model.safetensors"],
        cwd=directory,
        capture_output=True,
        check=True,
    ).stdout
    return subprocess.run(["sha256sum"], input=listing, capture_output=True, check=True).stdout.split()[0].decode()


class Cli:
    """`loragate adapters ...` through loragate.cli.main, with the environment a user would have set."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
        self.monkeypatch = monkeypatch
        self.capsys = capsys

    def __call__(self, *args: str, key: str | None = ADMIN_KEY, api_key: str | None = None) -> tuple[int, str, str]:
        for name, value in (("LORAGATE_ADMIN_KEY", key), ("LORAGATE_API_KEY", api_key)):
            if value is None:
                self.monkeypatch.delenv(name, raising=False)
            else:
                self.monkeypatch.setenv(name, value)
        self.capsys.readouterr()
        status = main(["adapters", *args])
        out = self.capsys.readouterr()
        return status, out.out, out.err

    def json(self, *args: str, **kwargs: Any) -> Any:
        status, out, err = self(*args, "--json", **kwargs)
        assert status == 0, err
        return json.loads(out)


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(monkeypatch, capsys)


def served_as(gateway: str, engine: CatalogEngine, adapter: str, expected: str) -> bool:
    """Send one request for `adapter` to `gateway`: did the engine get it as `expected`?"""
    resp = httpx.post(
        f"{gateway}/v1/completions", json=COMPLETION, headers={**bearer(ACME), "X-Adapter-ID": adapter}, timeout=10
    )
    return resp.status_code == 200 and engine.received[-1].headers["x-adapter-id"] == expected


def test_the_cli_against_two_replicas_sharing_redis(
    tmp_path: Path, fresh_redis: str, engine: CatalogEngine, cli: Cli
) -> None:
    adapter = synthetic_adapter(tmp_path / "support", payload_bytes=4096, seed=1)
    digest = sha256sum_digest(adapter)
    size = sum((adapter / name).stat().st_size for name in ("adapter_config.json", "adapter_model.safetensors"))
    engine.cards = [
        {
            "id": "support@1",
            "state": "device",
            "loads": 1,
            "evictions": 0,
            "last_used": 1.7e9,
            "kind": "DoRA",
            "rank": 8,
            "target_modules": ["q_proj", "v_proj", "embed_tokens"],
        }
    ]
    one, url_one = start_gateway(tmp_path, "one", fleet_yaml(), [engine.url], "--redis", fresh_redis)
    try:
        two, url_two = start_gateway(tmp_path, "two", fleet_yaml(), [engine.url], "--redis", fresh_redis)
    except BaseException:
        stop_process(one)
        raise
    try:
        assert cli.json("digest", str(adapter)) == {"path": str(adapter), "sha256": digest, "size": size}

        # A local source: fetched once by the CLI to pin its digest and size, then served by the other replica.
        first = cli.json("register", "support", "--source", str(adapter), "--url", url_one)
        assert first["ref"] == "support@1" and first["changed"] is True
        pinned = first["adapter"]["versions"][0]
        assert (pinned["source"], pinned["sha256"], pinned["size"]) == (str(adapter), digest, size)
        poll(lambda: served_as(url_two, engine, "support", "support@1"), 10, 0.1, "replica two serving support@1")
        received = engine.received[-1].headers
        assert (received["x-adapter-source"], received["x-adapter-sha256"]) == (str(adapter), digest)
        assert received["x-adapter-size"] == str(size)

        status, _, err = cli("register", "support", "--source", ARCHIVE, "--url", url_one)
        assert status == 2 and "--sha256" in err  # an archive's digest only its publisher knows
        status, out, err = cli("register", "support", "--source", ARCHIVE, "--sha256", "ab" * 32, "--url", url_one)
        assert status == 0 and out == "registered support@2\n", err

        poll(lambda: len(cli.json("list", "--url", url_two)["data"][0]["versions"]) == 2, 10, 0.1, "two sees v2")
        status, table, _ = cli("list", "--url", url_two)
        host = engine.url.split("://")[1]
        assert status == 0 and table.splitlines()[0].split() == ["ID", "VERSION", "STATE", "KIND", "SOURCE", host]
        # The kind as the engine that read the files says it; "-" before any engine has.
        assert table.splitlines()[1].split() == ["support", "1", "active", "DoRA", "r8", str(adapter), "device"]
        assert table.splitlines()[2].split() == ["support", "2", "active", "-", ARCHIVE, "not", "loaded"]
        # Then what each version adapts, and each engine's detail of the versions it holds or failed: the reason,
        # last used, loads, evictions.
        assert table.splitlines()[3:] == [
            "what each is:",
            "  support@1: DoRA r8: q_proj, v_proj, embed_tokens",
            "on the engines:",
            f"  support@1 on {host}: device, last used 2023-11-14T22:13:20Z, 1 load, 0 evictions",
        ]
        engine.cards.append({"id": "support@2", "state": "failed", "error": "digest_mismatch: expected ab..."})
        status, table, _ = cli("list", "--url", url_two)
        assert table.splitlines()[2].split()[-1] == "failed"
        assert table.splitlines()[-1] == f"  support@2 on {host}: failed: digest_mismatch: expected ab..."
        shown = cli.json("show", "support@2", "--url", url_two)
        assert [v["version"] for v in shown["versions"]] == [2]
        # Who published each version, and when.
        published = datetime.strptime(shown["versions"][0]["published_at"], "%Y-%m-%dT%H:%M:%SZ")
        assert abs(published.replace(tzinfo=timezone.utc).timestamp() - time.time()) < 120
        assert shown["versions"][0]["published_by"].startswith("admin:")
        status, text, _ = cli("show", "support@2", "--url", url_two)
        lines = text.splitlines()
        assert status == 0 and lines[0].split()[:5] == ["support", "tenant:", "-", "current:", "2"]
        assert lines[1].split() == ["VERSION", "STATE", "SIZE", "SHA256", "PUBLISHED", "BY", "SOURCE"]
        assert lines[2].split() == [
            "2",
            "active",
            "ab" * 6,
            shown["versions"][0]["published_at"],
            shown["versions"][0]["published_by"],
            ARCHIVE,
        ]
        assert lines[3:] == ["engines:", f"  @2 on {host}: failed: digest_mismatch: expected ab..."]

        status, out, _ = cli("deprecate", "support@2", "--url", url_two)
        assert status == 0 and out == "deprecated support@2\n"
        poll(lambda: served_as(url_one, engine, "support", "support@1"), 10, 0.1, "`support` back to version 1")
        status, out, _ = cli("deprecate", "support@2", "--undo", "--url", url_one)
        assert out == "no longer deprecated support@2\n"
        status, out, _ = cli("delete", "support@1", "--url", url_one)
        assert status == 0 and out == "deleted support@1\n"
        listed = cli.json("list", "--url", url_one)
        assert [(e["id"], [v["version"] for v in e["versions"]]) for e in listed["data"]] == [("support", [2])]

        # A tenant publishes with its own key, in its own namespace only.
        pinned_archive = ("--source", ARCHIVE, "--sha256", "cd" * 32, "--size", "5", "--url", url_two)
        status, out, err = cli("register", "acme/bot", *pinned_archive, key=None, api_key=ACME)
        assert status == 0 and out == "registered acme/bot@1\n", err
        status, _, err = cli("register", "globex/bot", *pinned_archive, key=None, api_key=ACME)
        assert status == 1 and "403" in err
        status, _, err = cli("register", "acme/x", *pinned_archive, "--tenant", "globex", key=None, api_key=ACME)
        assert status == 1 and "403" in err and "for itself only" in err
        # An admin registers for a tenant with --tenant: the id is then that tenant's (its namespace, or none).
        faq = cli.json("register", "faq", *pinned_archive, "--tenant", "acme")
        assert (faq["ref"], faq["adapter"]["tenant"]) == ("faq@1", "acme")
        status, _, err = cli("register", "globex/faq", *pinned_archive, "--tenant", "acme")
        assert status == 1 and "400" in err and "namespace" in err
        acme_only = cli.json("list", "--tenant", "acme", "--url", url_two)
        assert sorted(e["id"] for e in acme_only["data"]) == ["acme/bot", "faq"]
        bot = cli.json("show", "acme/bot", "--url", url_two)
        assert (bot["tenant"], bot["versions"][0]["published_by"]) == ("acme", "acme")
        status, _, err = cli("list", "--url", url_two, key=None)
        assert status == 2 and "LORAGATE_ADMIN_KEY" in err
        status, _, err = cli("show", "nothing", "--url", url_two)
        assert status == 1 and "404" in err
    finally:
        stop_process(one)
        stop_process(two)


def test_register_pins_an_hf_revision_to_its_commit(tmp_path: Path, engine: CatalogEngine, cli: Cli) -> None:
    adapter = synthetic_adapter(tmp_path / "bot", payload_bytes=1024, seed=2)
    app = build_app(parse_policy(fleet_yaml()), [engine.url], MemoryRateLimiter(), metrics=GatewayMetrics())
    with HubServer() as hub, serve_in_thread(app) as url:
        commit = hub.add_repo("org/bot", adapter, revision="v1")
        cli.monkeypatch.setenv("HF_ENDPOINT", hub.url)
        answer = cli.json("register", "hf-bot", "--source", "hf://org/bot", "--revision", "v1", "--url", url)
        status, _, err = cli("register", "hf-bot", "--source", "hf://org/bot@v1", "--revision", "v1", "--url", url)
    version = answer["adapter"]["versions"][0]
    assert version["source"] == f"hf://org/bot@{commit}" and version["revision"] == "v1"
    assert version["sha256"] == sha256sum_digest(adapter)
    assert status == 2 and "--revision" in err


def test_the_console_script_prints_a_digest(tmp_path: Path) -> None:
    adapter = synthetic_adapter(tmp_path / "a", payload_bytes=256, seed=3)
    done = subprocess.run(
        [sys.executable, "-m", "loragate", "adapters", "digest", str(adapter)],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[0] == sha256sum_digest(adapter)


# ---- two replicas in this process: concurrent registration, an outage ---------------------------------------


def make_replica(url: str, engine: CatalogEngine) -> Any:
    policy = parse_policy(fleet_yaml())
    store = RedisCatalogStore(url)
    return build_app(policy, [engine.url], MemoryRateLimiter(), metrics=GatewayMetrics(), catalog_store=store)


async def register(gw: httpx.AsyncClient, sha256: str) -> httpx.Response:
    body = {"id": "support", "source": ARCHIVE, "sha256": sha256}
    return await gw.post("/admin/adapters", json=body, headers=ADMIN)


def test_replicas_registering_at_once_get_distinct_versions(fresh_redis: str, engine: CatalogEngine) -> None:
    shas = [hashlib.sha256(str(i).encode()).hexdigest() for i in range(12)]

    async def scenario() -> dict[str, Any]:
        apps = [make_replica(fresh_redis, engine) for _ in range(2)]
        async with asgi(apps[0]) as one, asgi(apps[1]) as two:
            answers = await asyncio.gather(*(register((one, two)[i % 2], sha) for i, sha in enumerate(shas)))
            for app in apps:
                await app.state.gateway.housekeeping()  # the once-a-second refresh
            after = await two.post(
                "/v1/completions", json=COMPLETION, headers={**bearer(ACME), "X-Adapter-ID": "support"}
            )
            shown = (await one.get("/admin/adapters/support", headers=ADMIN)).json()
        for app in apps:
            await app.state.gateway.adapters.aclose()
        return {"answers": answers, "after": after, "shown": shown}

    out = run(scenario())
    refs = {resp.json()["ref"]: sha for resp, sha in zip(out["answers"], shas, strict=True)}
    assert all(resp.status_code == 201 for resp in out["answers"])
    assert sorted(refs, key=lambda r: int(r.split("@")[1])) == [f"support@{n}" for n in range(1, 13)]
    assert {v["ref"]: v["sha256"] for v in out["shown"]["versions"]} == refs
    # After its refresh, replica two serves the newest version, whichever replica registered it.
    assert out["after"].status_code == 200
    assert engine.received[-1].headers["x-adapter-id"] == "support@12"
    assert engine.received[-1].headers["x-adapter-sha256"] == refs["support@12"]


def test_a_redis_outage_keeps_the_last_snapshot_serving(
    fresh_redis: str, redis_server: RedisServer, engine: CatalogEngine
) -> None:
    async def scenario() -> dict[str, Any]:
        apps = [make_replica(fresh_redis, engine) for _ in range(2)]
        out: dict[str, Any] = {}
        async with asgi(apps[0]) as one, asgi(apps[1]) as two:
            out["registered"] = await register(one, "ab" * 32)
            await apps[1].state.gateway.housekeeping()
            redis_server.stop()
            try:
                await apps[1].state.gateway.housekeeping()  # the refresh fails: the snapshot stays
                out["served"] = await two.post(
                    "/v1/completions", json=COMPLETION, headers={**bearer(ACME), "X-Adapter-ID": "support"}
                )
                out["refused"] = await register(one, "cd" * 32)
            finally:
                redis_server.start()
        for app in apps:
            await app.state.gateway.adapters.aclose()
        return out

    out = run(scenario())
    assert out["registered"].status_code == 201
    assert out["served"].status_code == 200 and engine.received[-1].headers["x-adapter-id"] == "support@1"
    assert_error(out["refused"], 503, "service_unavailable", "redis_unavailable")
