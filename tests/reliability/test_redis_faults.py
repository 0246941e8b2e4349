"""Redis killed and restarted under a gateway, in both `ratelimit.on_redis_error` modes; and how soon a
gateway serves with its shared limits again once Redis answers, killed or frozen, with no request meanwhile
(its Redis breaker probes Redis in the background: gateway/redis_client.py)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

import policies
from mock_upstream import MockUpstream
from polling import poll
from processes import start_gateway, stop_process
from redis_server import ping, start_redis
from stack import PROMPT, Stack, auth, metric, policy_yaml

BODY = {"prompt": PROMPT, "max_tokens": 2}
LOAD_KEY, LIMITED_KEY = "load-secret", "limited-secret"
LIMITED = "{requests_per_second: 0.01, burst: 3, tokens_per_minute: 100000000}"  # 3 requests, then one per 100 s
RECOVERY_S = 0.5  # the bound: from Redis answering the test's PING to the gateway's breaker closed


def _post(stack: Stack) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/completions", json=BODY, headers=auth("acme"), timeout=60)


def _poll_status(stack: Stack, status: int, timeout_s: float = 20.0) -> httpx.Response:
    return poll(
        lambda: (resp := _post(stack)).status_code == status and resp,
        timeout_s,
        interval_s=0.1,
        what=f"an answer {status}",
    )


def test_redis_down_and_back_in_both_fail_modes(tmp_path: Path, suite_adapters: Path) -> None:

    redis = start_redis(tmp_path / "redis")
    limited = "{requests_per_second: 0.01, burst: 3, tokens_per_minute: 100000000}"  # 3 requests, then one per 100 s
    stack = Stack(
        tmp_path,
        suite_adapters,
        num_engines=1,
        redis=redis,
        policy=policy_yaml(on_redis_error="closed", acme_limits=limited),
    ).start()
    try:
        # Shared limits work: the burst, then 429.
        assert [_post(stack).status_code for _ in range(4)] == [200, 200, 200, 429]

        # Fail closed: while Redis is down every request is 503 ratelimit_unavailable, and not ready.
        redis.stop()
        down = _poll_status(stack, 503)
        assert down.headers["x-loragate-reason"] == "ratelimit_unavailable"
        assert int(down.headers["retry-after"]) >= 1
        assert httpx.get(f"{stack.url}/readyz", timeout=30).status_code == 503
        redis.start()  # an empty Redis on the same port: the burst is fresh
        _poll_status(stack, 200)
        assert httpx.get(f"{stack.url}/readyz", timeout=30).status_code == 200

        # Fail open (a reload switches the mode in place): requests pass while Redis is down...
        assert stack.reload(policy_yaml(on_redis_error="open", acme_limits=limited)).status_code == 200
        redis.stop()
        assert all(_post(stack).status_code == 200 for _ in range(6))  # more than the burst: not limited
        assert httpx.get(f"{stack.url}/readyz", timeout=30).status_code == 200
        # ...and once it is back and the gateway's Redis breaker has closed (its background PING finds
        # Redis back: gateway/redis_client.py), the shared limit holds again.
        redis.start()
        poll(
            lambda: metric(stack.url, "loragate_gateway_redis_breaker_open") == 0,
            15,
            interval_s=0.1,
            what="the Redis breaker closed",
        )
        statuses = [_post(stack).status_code for _ in range(4)]
        assert statuses == [200, 200, 200, 429], statuses
    finally:
        stack.stop()
        redis.stop()


def _breaker_open(client: httpx.Client) -> bool:
    """The gateway's `loragate_gateway_redis_breaker_open` (reading /metrics sends nothing to Redis)."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("loragate_gateway_redis_breaker_open "):
            return float(line.split()[1]) == 1
    raise AssertionError("no loragate_gateway_redis_breaker_open in /metrics")


def _closed_after(client: httpx.Client, answered: float) -> float:
    """Seconds from `answered` until the gateway's breaker is seen closed."""
    poll(lambda: not _breaker_open(client), 10, interval_s=0.005, what="the Redis breaker closed")
    return time.monotonic() - answered


@pytest.mark.parametrize("mode", ["open", "closed"])
def test_without_requests_the_gateway_finds_redis_back_within_half_a_second(tmp_path: Path, mode: str) -> None:
    """Killed then restarted, and frozen (SIGSTOP) then thawed: no request while Redis is out (only the
    gateway's own once-a-second housekeeping calls it, and the breaker skips those), yet its breaker closes
    within RECOVERY_S of Redis answering again, and the next requests are decided by Redis."""
    redis = start_redis(tmp_path / "redis")
    policy = policies.policy_yaml(
        policies.tenant_yaml("load", LOAD_KEY, '["*"]'),
        policies.tenant_yaml("limited", LIMITED_KEY, '["*"]', limits=LIMITED),
        extra=f"ratelimit: {{on_redis_error: {mode}}}",
    )
    try:
        with MockUpstream() as engine:
            proc, url = start_gateway(tmp_path, "gateway", policy, [engine.url], "--redis", redis.url)
            try:
                with httpx.Client(base_url=url, timeout=30) as client:

                    def post(key: str) -> int:
                        return client.post("/v1/completions", json=BODY, headers=policies.bearer(key)).status_code

                    assert post(LOAD_KEY) == 200
                    recovered: dict[str, float] = {}

                    redis.stop()
                    poll(lambda: _breaker_open(client), 10, interval_s=0.05, what="the Redis breaker open")
                    time.sleep(1.5)  # out a while longer: the breaker's own interval grows past RECOVERY_S
                    redis.start()  # returns once Redis answers the test's PING
                    recovered["killed"] = _closed_after(client, time.monotonic())
                    # A fresh Redis on the same port: the limited tenant's burst, then 429.
                    assert [post(LIMITED_KEY) for _ in range(4)] == [200, 200, 200, 429]

                    redis.pause()
                    try:
                        poll(lambda: _breaker_open(client), 10, interval_s=0.05, what="the Redis breaker open")
                        time.sleep(1.5)
                    finally:
                        redis.resume()
                    poll(lambda: ping(redis.port), 5, interval_s=0.001, what="Redis answering")
                    recovered["frozen"] = _closed_after(client, time.monotonic())
                    # Redis kept its state: the limited tenant is still out of requests (with the breaker open
                    # it would be admitted failing open, refused with 503 failing closed).
                    assert post(LIMITED_KEY) == 429
                    assert post(LOAD_KEY) == 200
                    assert all(seconds < RECOVERY_S for seconds in recovered.values()), recovered
            finally:
                stop_process(proc)
    finally:
        redis.stop()
