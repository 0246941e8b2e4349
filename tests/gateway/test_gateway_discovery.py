"""Engines discovered in DNS (`--upstream-dns NAME:PORT`, gateway/discovery.py): replicas that join get
traffic, replicas that leave get none while their requests in flight finish, and adapter affinity moves
only the adapters a joining or leaving replica owns.

The fake engines listen on 127.0.0.1, 127.0.0.2 and 127.0.0.3 (all loopback) on one port, as pods behind
a headless Service do; the resolver is one the test controls. What moves is checked as the property
rendezvous hashing promises: an adapter changes engine only to a joining one or off a leaving one.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator

import httpx
import pytest

from gateway.admission import rendezvous_order
from gateway.app import build_app
from gateway.discovery import DnsUpstreams, parse_target, resolve_addresses
from gateway.engine_kinds import EngineKind, EngineTarget
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics

import policies
from gateway_testing import asgi, assert_error, run
from mock_upstream import MockUpstream
from policies import tenant_yaml
from processes import REPO, start_gateway, stop_process

KEY = "acme-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
ADAPTERS = tuple(f"ad{i}" for i in range(24))
HOSTS = ("127.0.0.1", "127.0.0.2", "127.0.0.3")
POLICY = policies.policy_yaml(
    tenant_yaml("acme", KEY, '["*"]'), admission="{max_inflight_per_upstream: 8, max_queue: 16, queue_timeout_ms: 5000}"
)


def _shared_port() -> int:
    """A port free on every one of HOSTS."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((HOSTS[0], 0))
            port = probe.getsockname()[1]
        try:
            for host in HOSTS[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
            return port
        except OSError:
            continue
    raise AssertionError("no port free on every loopback address")


@pytest.fixture
def engines() -> Iterator[dict[str, MockUpstream]]:
    port = _shared_port()
    mocks = {host: MockUpstream(adapters=ADAPTERS, host=host, port=port).start() for host in HOSTS}
    try:
        yield mocks
    finally:
        for mock in mocks.values():
            mock.stop()


class Resolver:
    """DNS the test controls: the addresses of `answer`, or `error` raised."""

    def __init__(self) -> None:
        self.answer: list[str] = []
        self.error: Exception | None = None

    async def __call__(self, name: str, port: int) -> list[str]:
        assert name == "engines.test"
        if self.error is not None:
            raise self.error
        return list(self.answer)


def _landed(engines: dict[str, MockUpstream]) -> dict[str, str]:
    """adapter -> the host that served its requests (each adapter must land on exactly one)."""
    where: dict[str, set[str]] = {}
    for host, mock in engines.items():
        for received in mock.received:
            where.setdefault(received.headers["x-adapter-id"], set()).add(host)
    assert all(len(hosts) == 1 for hosts in where.values()), where
    return {adapter: hosts.pop() for adapter, hosts in where.items()}


def test_engines_join_and_leave_with_dns_and_affinity_moves_only_what_they_own(
    engines: dict[str, MockUpstream],
) -> None:
    port = next(iter(engines.values())).port
    resolver = Resolver()
    discovery = DnsUpstreams("engines.test", port, resolve=resolver)
    url = {host: f"http://{host}:{port}" for host in HOSTS}

    async def scenario() -> dict[str, object]:
        app = build_app(parse_policy(POLICY), [], MemoryRateLimiter(), metrics=GatewayMetrics(), discovery=discovery)
        gw = app.state.gateway
        out: dict[str, object] = {}
        async with asgi(app) as client:

            async def round_of_requests() -> dict[str, str]:
                for mock in engines.values():
                    mock.reset()
                for adapter in ADAPTERS:
                    resp = await client.post(
                        "/v1/completions",
                        json={"prompt": "hi", "max_tokens": 2},
                        headers={**AUTH, "X-Adapter-ID": adapter},
                    )
                    assert resp.status_code == 200, resp.text
                return _landed(engines)

            out["none"] = await client.post("/v1/completions", json={"prompt": "hi"}, headers=AUTH)
            resolver.answer = [HOSTS[0], HOSTS[1]]
            await gw.fleet.discover()
            out["two"] = await round_of_requests()
            resolver.answer = list(HOSTS)
            await gw.fleet.discover()
            out["three"] = await round_of_requests()

            # A resolver failure keeps the engines; a name with no address (no ready pod) empties them.
            resolver.error = OSError("SERVFAIL")
            await gw.fleet.discover()
            out["kept"] = sorted(u.url for u in gw.fleet.admission.upstreams)
            resolver.error = None

            # Leaving mid-request: the request in flight on 127.0.0.1 finishes; nothing new goes there.
            engines[HOSTS[0]].hold()
            engines[HOSTS[0]].reset()
            first = next(a for a in ADAPTERS if out["three"][a] == HOSTS[0])
            held = asyncio.create_task(
                client.post(
                    "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers={**AUTH, "X-Adapter-ID": first}
                )
            )
            while engines[HOSTS[0]].count == 0:
                await asyncio.sleep(0.01)
            resolver.answer = [HOSTS[1], HOSTS[2]]
            await gw.fleet.discover()
            out["inflight_while_leaving"] = gw.fleet.admission.inflight().get(url[HOSTS[0]])
            out["after_leave"] = await round_of_requests()
            engines[HOSTS[0]].release()
            out["held"] = await held
            out["inflight_after"] = gw.fleet.admission.inflight()
            resolver.answer = []
            await gw.fleet.discover()
            out["empty"] = await client.post("/v1/completions", json={"prompt": "hi"}, headers=AUTH)
        return out

    out = run(scenario())
    assert_error(out["none"], 503, reason="no_upstream")  # before the first resolution: no engine at all
    two, three = out["two"], out["three"]
    urls_two, urls_three = [url[h] for h in HOSTS[:2]], [url[h] for h in HOSTS]
    for adapter in ADAPTERS:  # every adapter lands on its first rendezvous choice (the reference ranking)
        assert url[two[adapter]] == rendezvous_order(adapter, urls_two)[0]
        assert url[three[adapter]] == rendezvous_order(adapter, urls_three)[0]
    moved = {a for a in ADAPTERS if two[a] != three[a]}
    assert moved and all(three[a] == HOSTS[2] for a in moved)  # only to the new engine, never between old ones
    assert Counter(three.values())[HOSTS[2]] == len(moved)
    assert out["kept"] == sorted(urls_three)
    assert out["inflight_while_leaving"] == 1
    assert HOSTS[0] not in out["after_leave"].values()
    assert {a for a in ADAPTERS if three[a] != out["after_leave"][a]} == {a for a in ADAPTERS if three[a] == HOSTS[0]}
    assert out["held"].status_code == 200  # the request in flight on the leaving engine finished
    assert url[HOSTS[0]] not in out["inflight_after"]
    assert_error(out["empty"], 503, reason="no_upstream")


def test_resolving_and_parsing_targets() -> None:
    assert parse_target("loragate-engine-headless.ns.svc.cluster.local:8001") == (
        "loragate-engine-headless.ns.svc.cluster.local",
        8001,
    )
    for bad in ("no-port", "name:", ":8001", "name:99999", "name:http"):
        with pytest.raises(ValueError, match="NAME:PORT"):
            parse_target(bad)
    assert "127.0.0.1" in run(resolve_addresses("localhost", 80))
    assert run(resolve_addresses("no-such-engine.invalid", 80)) == []  # NXDOMAIN: no engine, not an error

    async def v6(name: str, port: int) -> list[str]:
        return ["fd00::7"]

    assert run(DnsUpstreams("x", 8001, resolve=v6).targets()) == [EngineTarget("http://[fd00::7]:8001")]
    vllm = DnsUpstreams.from_target("vllm=vllm-headless:8000,agent=8002")
    vllm.resolve = v6
    assert run(vllm.targets()) == [EngineTarget("http://[fd00::7]:8000", EngineKind.VLLM, "http://[fd00::7]:8002")]
    for bad, problem in (
        ("sglang=x:1", "unknown engine kind"),
        ("x:1,agent=2", "agent=PORT is for vllm"),
        ("vllm=x:1,agent=0", "port number"),
        ("vllm=x:1,agnt=2", "unknown option"),
        ("vllm=x", "NAME:PORT"),
    ):
        with pytest.raises(ValueError, match=problem):
            DnsUpstreams.from_target(bad)


def test_a_gateway_process_serves_the_engines_its_dns_name_resolves_to(tmp_path, mock: MockUpstream) -> None:
    port = mock.url.rsplit(":", 1)[1]
    proc, base = start_gateway(
        tmp_path, "gw", POLICY, [], "--upstream-dns", f"127.0.0.1:{port}", "--dns-interval-s", "0.5"
    )
    try:
        resp = httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=AUTH, timeout=30)
        assert resp.status_code == 200 and mock.count == 1, resp.text
    finally:
        stop_process(proc)
    for args, message in ((["--upstream-dns", "nonsense"], "NAME:PORT"), ([], "--upstream-dns")):
        done = subprocess.run(
            [sys.executable, "-m", "loragate", "gateway", "--policy", str(tmp_path / "gw.yaml"), *args],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
        )
        assert done.returncode == 2 and message in done.stderr, done.stderr
