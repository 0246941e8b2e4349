"""The usage ledger, token counters and budgets (gateway/usage.py, gateway/budgets.py), against real gateway
processes sharing a real Redis, and the mock engine (tests/mock_upstream.py) whose `usage` is the reference:
what the client received is what the ledger must hold, once per request."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest

from gateway.app import build_app
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import MAX_ADAPTER_LABELS, GatewayMetrics
from gateway.usage import MemoryUsageLedger, UsageRecord, aggregate, parse_when

from gateway_testing import asgi, assert_error, run
from mock_upstream import MockUpstream
from policies import ADMIN, ADMIN_KEY, bearer, policy_yaml, tenant_yaml
from polling import poll
from processes import REPO, start_gateway, stop_process
from redis_server import RedisServer, redis_server_fixture

redis_server = redis_server_fixture(scope="function")

ACME, GLOBEX = "acme-key", "globex-key"


def usage_policy(budgets: str | None = None) -> str:
    return policy_yaml(
        tenant_yaml("acme", ACME, '["*"]', budgets=budgets),
        tenant_yaml("globex", GLOBEX, '["*"]'),
        admission="{max_inflight_per_upstream: 32, max_queue: 64, queue_timeout_ms: 5000, affinity: false}",
        breaker="{failure_threshold: 1000, open_seconds: 1, half_open_probes: 1}",
    )


def completion(http: httpx.Client, url: str, key: str, *, stream: bool, adapter: str | None = None) -> dict[str, int]:
    """One request; the usage the client received."""
    body: dict[str, object] = {"prompt": "hello there", "max_tokens": 16, "stream": stream}
    headers = bearer(key) | ({"X-Adapter-ID": adapter} if adapter else {})
    if not stream:
        resp = http.post(f"{url}/v1/completions", json=body, headers=headers)
        assert resp.status_code == 200, resp.text
        return dict(resp.json()["usage"])
    body["stream_options"] = {"include_usage": True}
    usage = None
    with http.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
    assert usage is not None
    return dict(usage)


def cancelled(http: httpx.Client, url: str, key: str, chunks: int) -> int:
    """A stream the client leaves after `chunks` token events; the tokens it received."""
    body = {"prompt": "hello there", "max_tokens": 16, "stream": True}
    got = 0
    with http.stream("POST", f"{url}/v1/completions", json=body, headers=bearer(key)) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                got += 1
                if got == chunks:
                    break
    return got


def usage_rows(url: str, by: str = "tenant", fmt: str = "json") -> str:
    env = {**os.environ, "LORAGATE_URL": url, "LORAGATE_ADMIN_KEY": ADMIN_KEY, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-m", "loragate", "usage", "--since", "1h", "--by", by, "--format", fmt],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return out.stdout


def test_the_ledger_holds_what_clients_received_once_across_replicas_a_restart_and_a_frozen_redis(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    redis = redis_server
    text = usage_policy()
    with MockUpstream() as good, MockUpstream() as flaky, httpx.Client(timeout=60) as http:
        flaky.behavior.fail_status = 502  # every attempt on it fails and is retried on `good`: one request
        upstreams = [good.url, flaky.url]
        gateways = [start_gateway(tmp_path, f"gw{i}", text, upstreams, "--redis", redis.url) for i in (1, 2)]
        try:
            urls = [url for _, url in gateways]
            acme = {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}

            def served(url: str, stream: bool) -> None:
                usage = completion(http, url, ACME, stream=stream)
                acme["requests"] += 1
                acme["prompt_tokens"] += usage["prompt_tokens"]
                acme["completion_tokens"] += usage["completion_tokens"]

            for i in range(12):  # streamed and whole answers, on both replicas; some retried
                served(urls[i % 2], stream=i % 3 == 0)
            assert flaky.count > 0  # some requests met the failing engine first and were retried

            # Streams the client leaves early count what was sent (globex's, counted apart).
            good.behavior.pause_after_chunks = 3
            flaky.behavior.fail_status = None
            flaky.behavior.pause_after_chunks = 3
            sent = [cancelled(http, urls[i % 2], GLOBEX, 3) for i in range(4)]
            good.resume()
            flaky.resume()
            good.behavior.pause_after_chunks = flaky.behavior.pause_after_chunks = None
            flaky.behavior.fail_status = 502

            # A replica restarted (SIGTERM flushes its buffer), then Redis frozen for a while: the records
            # wait in memory and reach the ledger once it answers again.
            stop_process(gateways[1][0])
            gateways[1] = start_gateway(tmp_path, "gw2", text, upstreams, "--redis", redis.url)
            urls = [url for _, url in gateways]
            redis.pause()
            try:
                for i in range(6):
                    served(urls[i % 2], stream=i % 2 == 0)
            finally:
                redis.resume()
            served(urls[0], stream=False)

            expected = [
                {"tenant": "acme", **acme},
                {"tenant": "globex", "requests": 4, "prompt_tokens": None, "completion_tokens": sum(sent)},
            ]

            def ledger(url: str) -> list[dict[str, int]]:
                resp = http.get(f"{url}/admin/usage?since=1h&by=tenant", headers=ADMIN)
                if resp.status_code == 503:  # Redis just thawed: the breaker still skips it for a moment
                    return []
                assert resp.status_code == 200, resp.text
                return list(resp.json())

            def matches(rows: list[dict[str, int]]) -> bool:
                if len(rows) != 2 or rows[0] != expected[0]:
                    return False
                return all(rows[1][k] == v for k, v in expected[1].items() if v is not None)

            # A replica's answer includes its own records still buffered; each sees the other's only once they
            # are in Redis, so both agreeing means every record was written.
            rows = poll(
                lambda: matches(got := ledger(urls[0])) and ledger(urls[1]) == got and got,
                20,
                interval_s=0.2,
                what="every record written",
            )
            assert rows[1]["prompt_tokens"] > 0  # the gateway's estimate for streams cut before their usage

            # `loragate usage` answers the same, in every format.
            assert json.loads(usage_rows(urls[0])) == rows
            parsed = list(csv.DictReader(io.StringIO(usage_rows(urls[0], fmt="csv"))))
            assert [{k: (v if k == "tenant" else int(v)) for k, v in r.items()} for r in parsed] == rows
            table = usage_rows(urls[0], fmt="table").splitlines()
            assert table[0].split() == ["tenant", "requests", "prompt_tokens", "completion_tokens"]
            assert table[1].split() == [
                "acme",
                *(str(acme[k]) for k in ("requests", "prompt_tokens", "completion_tokens")),
            ]
            by_day = json.loads(usage_rows(urls[0], by="tenant,day"))
            assert [r["day"] for r in by_day] == [datetime.now(timezone.utc).strftime("%Y-%m-%d")] * 2
        finally:
            for proc, _ in gateways:
                stop_process(proc)


def test_budgets_refuse_exactly_past_the_limit_across_two_replicas(tmp_path: Path, redis_server: RedisServer) -> None:
    redis = redis_server
    limit = 100
    with MockUpstream() as mock, httpx.Client(timeout=60) as http:
        mock.behavior.tokens = 8
        text = usage_policy(budgets=f"{{tokens_per_day: {limit}}}")
        gateways = [start_gateway(tmp_path, f"gw{i}", text, [mock.url], "--redis", redis.url) for i in (1, 2)]
        try:
            hold = 2 + 10  # the estimate held: ceil(len("hello") / 4) prompt tokens + max_tokens
            used, expected, got = 0, [], []
            for i in range(10):
                resp = http.post(
                    f"{gateways[i % 2][1]}/v1/completions",
                    json={"prompt": "hello", "max_tokens": 10},
                    headers=bearer(ACME),
                )
                got.append(resp.status_code)
                admitted = used + hold <= limit
                expected.append(200 if admitted else 429)
                if resp.status_code == 200:
                    usage = resp.json()["usage"]
                    used += usage["prompt_tokens"] + usage["completion_tokens"]
                else:
                    assert_error(resp, 429, "budget_exhausted", "budget_exhausted")
                    midnight = datetime.now(timezone.utc).replace(hour=0, minute=0, second=0).timestamp() + 86400
                    assert 1 <= int(resp.headers["Retry-After"]) <= midnight - time.time() + 2
            assert got == expected and 429 in got and got.count(200) >= 5
            # Another tenant has no budget; the refused ones held nothing.
            assert (
                http.post(f"{gateways[0][1]}/v1/completions", json={"prompt": "x"}, headers=bearer(GLOBEX)).status_code
                == 200
            )
            alerts = 0.0
            for _, url in gateways:
                for line in http.get(f"{url}/metrics").text.splitlines():
                    if line.startswith('loragate_gateway_budget_alerts_total{level="100%",tenant="acme",window="day"}'):
                        alerts += float(line.split()[-1])
            assert alerts >= 1
        finally:
            for proc, _ in gateways:
                stop_process(proc)


def test_token_counters_equal_the_ledger_and_stay_bounded() -> None:
    policy = parse_policy(usage_policy())
    ledger = MemoryUsageLedger()

    async def scenario(url: str) -> None:
        app = build_app(policy, [url], MemoryRateLimiter(), ledger=ledger)
        async with app.router.lifespan_context(app), asgi(app) as gw:
            for i in range(9):
                body = {"prompt": "hi", "max_tokens": 4, "stream": i % 2 == 0}
                headers = bearer(ACME if i % 3 else GLOBEX) | {"X-Adapter-ID": f"a{1 + i % 2}"}
                resp = await gw.post("/v1/completions", json=body, headers=headers)
                assert resp.status_code == 200
            await app.state.gateway.ledger.flush()
            metrics = (await gw.get("/metrics")).text
        counted: dict[tuple[str, str], list[int]] = {}
        for line in metrics.splitlines():
            for i, name in enumerate(
                ("loragate_gateway_prompt_tokens_total{", "loragate_gateway_completion_tokens_total{")
            ):
                if line.startswith(name):
                    labels = dict(kv.split("=") for kv in line[len(name) : line.index("}")].split(","))
                    key = (labels["tenant"].strip('"'), labels["adapter"].strip('"'))
                    counted.setdefault(key, [0, 0])[i] = int(float(line.split()[-1]))
        rows = aggregate(await ledger.read(0, time.time() + 1), ["tenant", "adapter"])
        assert {(r["tenant"], r["adapter"]): [r["prompt_tokens"], r["completion_tokens"]] for r in rows} == counted
        assert sum(r["requests"] for r in rows) == 9

    with MockUpstream() as mock:
        run(scenario(mock.url))

    # 10,000 adapters: the policy's named ones and the first MAX_ADAPTER_LABELS keep a label, the rest fold.
    metrics = GatewayMetrics()
    metrics.adapter_label.name_from_policy([["named-1", "sql-*"]], [("support", ["support-v1"])])
    for i in range(10_000):
        metrics.count_tokens("acme", f"adapter-{i}", 1, 1)
        metrics.observe_request("acme", f"adapter-{i}", 200, None, 0.01)
    metrics.count_tokens("acme", "named-1", 1, 1)
    body = metrics.render()[0].decode()
    labels = {line.split('adapter="')[1].split('"')[0] for line in body.splitlines() if 'adapter="' in line}
    assert len(labels) == MAX_ADAPTER_LABELS + 2 and {"named-1", "other"} <= labels
    assert 'loragate_gateway_prompt_tokens_total{adapter="other",tenant="acme"} 9950.0' in body


def test_usage_records_group_and_parse() -> None:
    now = datetime(2026, 12, 1, 12, tzinfo=timezone.utc).timestamp()
    records = [
        UsageRecord(
            f"r{i}", now - 86400 * (i % 2), "acme", "sql@2" if i else "sql", "", "", 3, 4, 200, "standard", 1.0, ""
        )
        for i in range(4)
    ]
    rows = aggregate(records + records[:1], ["day", "adapter"])  # a repeated record counts once
    assert rows == [
        {"day": "2026-11-30", "adapter": "sql@2", "requests": 2, "prompt_tokens": 6, "completion_tokens": 8},
        {"day": "2026-12-01", "adapter": "sql", "requests": 1, "prompt_tokens": 3, "completion_tokens": 4},
        {"day": "2026-12-01", "adapter": "sql@2", "requests": 1, "prompt_tokens": 3, "completion_tokens": 4},
    ]
    assert aggregate([], []) == [{"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}]
    with pytest.raises(ValueError, match="unknown grouping key 'colour'"):
        aggregate(records, ["colour"])
    assert parse_when("24h", now) == now - 86400
    assert parse_when("2026-12-01", now) == datetime(2026, 12, 1, tzinfo=timezone.utc).timestamp()
    assert parse_when("2026-12-01T13:00+01:00", now) == now
    with pytest.raises(ValueError, match="ISO 8601"):
        parse_when("yesterday", now)


def test_admin_usage_refuses_bad_queries() -> None:
    policy = parse_policy(usage_policy())

    async def scenario() -> None:
        app = build_app(policy, ["http://127.0.0.1:9"], MemoryRateLimiter())
        async with asgi(app) as gw:
            assert_error(await gw.get("/admin/usage?by=colour", headers=ADMIN), 400)
            assert_error(await gw.get("/admin/usage?since=yesterday", headers=ADMIN), 400)
            assert_error(await gw.get("/admin/usage"), 401)
            resp = await gw.get("/admin/usage?by=", headers=ADMIN)
            assert resp.json() == [{"requests": 0, "prompt_tokens": 0, "completion_tokens": 0}]

    run(scenario())
