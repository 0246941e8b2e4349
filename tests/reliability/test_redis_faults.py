"""Redis killed and restarted under a gateway, in both `ratelimit.on_redis_error` modes."""

from __future__ import annotations

from pathlib import Path

import httpx

from polling import poll
from redis_server import start_redis
from stack import PROMPT, Stack, auth, metric, policy_yaml

BODY = {"prompt": PROMPT, "max_tokens": 2}


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
        # ...and once it is back and the gateway's Redis breaker has let a probe through (it skips Redis
        # for up to 5 s after failures: gateway/redis_client.py), the shared limit holds again.
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
