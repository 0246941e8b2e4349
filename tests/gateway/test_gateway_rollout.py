"""Rollouts end to end: sticky canary / A-B splits, overrides, automatic rollback (also shared through a real
Redis by two gateway processes), hot reload of the policy file (ConfigMap symlink swaps included), and
adapter affinity across two fake engines (tests/mock_upstream.py, real HTTP servers on 127.0.0.1).

The split is checked against the weights over 20,000 users, and the variant a user gets against what a
second gateway process says; rollback against a fake engine that fails the canary adapter only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.app import build_app
from gateway.fleet_store import RedisFleetStore
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.rollback import Counts
from gateway.rollout import BUCKETS, Rollouts, bucket, pick_variant
from gateway.telemetry import GatewayMetrics

from gateway_testing import (
    COMPLETION,
    KEY,
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
from polling import poll
from processes import start_engine_server, start_gateway, stop_process
from redis_server import redis_url_fixture

redis_url = redis_url_fixture()


@pytest.fixture
def mock() -> Iterator[MockUpstream]:
    with MockUpstream(adapters=("a1", "a2", "a3")) as upstream:
        upstream.behavior.tokens = 2
        yield upstream


def make_app(upstreams: list[MockUpstream], text: str | None = None, **kwargs: Any) -> Any:
    return build_app(
        parse_policy(text or rollout_policy_yaml()),
        [m.url for m in upstreams],
        MemoryRateLimiter(),
        metrics=GatewayMetrics(),
        **kwargs,
    )


# ---- the split ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("weights", [(90, 10), (50, 50), (1, 3)])
def test_split_matches_the_weights_over_20000_users(weights: tuple[int, int]) -> None:
    rollout = parse_policy(rollout_policy_yaml(weights=weights)).rollout("support")
    assert rollout is not None
    counts = Counter(pick_variant(rollout, f"user-{i}").adapter for i in range(20_000))
    share = counts["a2"] / 20_000
    assert abs(share - weights[1] / sum(weights)) <= 0.02, counts


def test_buckets_are_a_blake2b_of_name_and_value_and_weight_zero_gets_none() -> None:
    import hashlib  # the reference: the stable hash the contract names, computed here independently

    digest = hashlib.blake2b(b"support\x00user-7", digest_size=8).digest()
    assert bucket("support", "user-7") == int.from_bytes(digest, "big") % BUCKETS
    rollout = parse_policy(rollout_policy_yaml(weights=(0, 1))).rollout("support")
    assert rollout is not None
    assert {pick_variant(rollout, f"u{i}").adapter for i in range(2000)} == {"a2"}


def test_same_user_same_variant_from_two_gateway_processes(tmp_path: Path, mock: MockUpstream) -> None:
    gateways = [start_gateway(tmp_path, f"gw{i}", rollout_policy_yaml(weights=(50, 50)), [mock.url]) for i in range(2)]
    try:
        seen: list[dict[str, str]] = [{}, {}]
        with httpx.Client(timeout=30) as http:
            for i, (_, url) in enumerate(gateways):
                for user in range(60):
                    resp = http.post(f"{url}/v1/completions", json=COMPLETION, headers=support(f"u{user}"))
                    assert resp.status_code == 200, resp.text
                    seen[i][f"u{user}"] = resp.headers["X-Loragate-Adapter"]
    finally:
        for proc, _ in gateways:
            stop_process(proc)
    assert seen[0] == seen[1]
    assert set(seen[0].values()) == {"a1", "a2"}  # both variants really served
    # the upstream got the adapter the gateway said it served
    assert [r.headers["x-adapter-id"] for r in mock.received[:60]] == [seen[0][f"u{u}"] for u in range(60)]


def test_missing_sticky_header_falls_back_to_the_tenant(mock: MockUpstream) -> None:
    async def scenario() -> tuple[set[str], set[str], set[str]]:
        async with asgi(make_app([mock], rollout_policy_yaml(weights=(50, 50)))) as gw:

            async def served(headers: dict[str, str]) -> str:
                resp = await gw.post("/v1/completions", json=COMPLETION, headers=headers)
                assert resp.status_code == 200, resp.text
                return resp.headers["X-Loragate-Adapter"]

            acme = {await served(support()) for _ in range(10)}
            globex = {await served(support(auth={"Authorization": f"Bearer {OTHER_KEY}"})) for _ in range(10)}
            users = {await served(support(f"user-{i}")) for i in range(40)}
            return acme, globex, users

    acme, globex, users = run(scenario())
    rollout = parse_policy(rollout_policy_yaml(weights=(50, 50))).rollout("support")
    assert rollout is not None
    assert acme == {pick_variant(rollout, "acme").adapter}
    assert globex == {pick_variant(rollout, "globex").adapter}
    assert users == {"a1", "a2"}


def test_sticky_key_tenant_ignores_the_user_header(mock: MockUpstream) -> None:
    text = rollout_policy_yaml(weights=(50, 50), sticky="tenant")

    async def scenario() -> set[str]:
        async with asgi(make_app([mock], text)) as gw:
            return {
                (await gw.post("/v1/completions", json=COMPLETION, headers=support(f"user-{i}"))).headers[
                    "X-Loragate-Adapter"
                ]
                for i in range(30)
            }

    rollout = parse_policy(text).rollout("support")
    assert rollout is not None
    assert run(scenario()) == {pick_variant(rollout, "acme").adapter}


def test_override_forces_a_variant_the_tenant_may_use(mock: MockUpstream) -> None:
    # acme may use the rollout and a1 (not a2); globex may use everything
    async def scenario() -> dict[str, httpx.Response]:
        async with asgi(make_app([mock])) as gw:
            post = lambda headers: gw.post("/v1/completions", json=COMPLETION, headers=headers)  # noqa: E731
            return {
                "globex_a2": await post(support("u1", {"Authorization": f"Bearer {OTHER_KEY}"}, **{"X-Variant": "a2"})),
                "acme_a1": await post(support("u1", **{"X-Variant": "a1"})),
                "acme_a2": await post(support("u1", **{"X-Variant": "a2"})),
                "not_a_variant": await post(support("u1", **{"X-Variant": "a3"})),
                "blank": await post(support("u1", **{"X-Variant": " "})),
            }

    out = run(scenario())
    assert out["globex_a2"].status_code == 200 and out["globex_a2"].headers["X-Loragate-Adapter"] == "a2"
    assert out["acme_a1"].status_code == 200 and out["acme_a1"].headers["X-Loragate-Adapter"] == "a1"
    assert_error(out["acme_a2"], 403, "permission_denied")
    assert "'a2'" in out["acme_a2"].json()["error"]["message"]
    assert_error(out["not_a_variant"], 400)
    assert "X-Variant" in out["not_a_variant"].json()["error"]["message"]
    assert out["blank"].status_code == 200  # an empty override is no override
    assert [r.headers["x-adapter-id"] for r in mock.received] == [
        "a2",
        "a1",
        out["blank"].headers["X-Loragate-Adapter"],
    ]


# ---- rollback ----------------------------------------------------------------------------------------


def test_rollback_after_min_requests_of_canary_failures_only(mock: MockUpstream, tmp_path: Path) -> None:
    path = tmp_path / "policy.yaml"
    text = rollout_policy_yaml(weights=(50, 50))
    path.write_text(text)
    mock.behavior.fail_adapters = frozenset({"a2"})  # the canary is broken, the first variant is fine
    canary = canary_users(text, 12)

    async def scenario() -> dict[str, Any]:
        async with asgi(make_app([mock], text, policy_path=path)) as gw:
            out: dict[str, Any] = {"before": []}
            for user in canary[:9]:  # 9 canary failures, min_requests is 10
                out["before"].append(await gw.post("/v1/completions", json=COMPLETION, headers=support(user)))
            out["policy_before"] = (await gw.get("/admin/policy", headers=ADMIN)).json()
            out["tenth"] = await gw.post("/v1/completions", json=COMPLETION, headers=support(canary[9]))
            out["after"] = [
                await gw.post("/v1/completions", json=COMPLETION, headers=support(u)) for u in canary[10:12]
            ]
            out["override"] = await gw.post(
                "/v1/completions",
                json=COMPLETION,
                headers=support(canary[0], {"Authorization": f"Bearer {OTHER_KEY}"}, **{"X-Variant": "a2"}),
            )
            out["policy"] = (await gw.get("/admin/policy", headers=ADMIN)).json()
            out["metrics"] = (await gw.get("/metrics")).text
            out["reload"] = await gw.post("/admin/reload", headers=ADMIN)
            out["again"] = await gw.post("/v1/completions", json=COMPLETION, headers=support(canary[0]))
            return out

    out = run(scenario())
    # Still routed to the canary (no rollback yet); each of its failures is answered by the first variant.
    assert [r.status_code for r in out["before"]] == [200] * 9
    assert {r.headers["X-Loragate-Adapter"] for r in out["before"]} == {"a1"}
    assert [r.headers["x-adapter-id"] for r in mock.received[:18]] == ["a2", "a1"] * 9
    assert out["policy_before"]["rollouts"][0]["rolled_back"] is None
    assert out["policy_before"]["rollouts"][0]["variants"][1]["window"] == {
        "requests": 9,
        "errors": 9,
        "error_rate": 1.0,
        "ttft_p99_ms": None,
    }
    assert out["tenth"].status_code == 200  # the 10th failure reaches min_requests and trips the rollback
    for resp in out["after"]:  # canary users now get the first variant
        assert resp.status_code == 200 and resp.headers["X-Loragate-Adapter"] == "a1"
    # An explicit, permitted override still reaches the canary, and answers for itself (no fallback).
    assert out["override"].status_code == 500 and out["override"].headers["X-Loragate-Adapter"] == "a2"
    rolled = out["policy"]["rollouts"][0]["rolled_back"]
    assert rolled["variant"] == "a2" and rolled["reason"] == "error_rate" and "10 requests" in rolled["detail"]
    assert 'loragate_gateway_rollout_rollbacks_total{reason="error_rate",rollout="support"} 1.0' in out["metrics"]
    assert 'loragate_gateway_rollout_rolled_back{rollout="support"} 1.0' in out["metrics"]
    assert (
        'loragate_gateway_rollout_requests_total{result="error",rollout="support",variant="a2"} 11.0' in out["metrics"]
    )
    # a1 answered the 10 canary failures it stood in for and the 2 requests after the rollback
    assert 'loragate_gateway_rollout_requests_total{result="ok",rollout="support",variant="a1"} 12.0' in out["metrics"]
    assert out["reload"].status_code == 200
    assert out["reload"].json()["rollouts"][0]["rolled_back"] is None
    # reloaded: the split is back, the canary user gets the canary (and a1 answers for it)
    assert out["again"].status_code == 200 and [r.headers["x-adapter-id"] for r in mock.received[-2:]] == ["a2", "a1"]


def test_first_variant_failures_never_roll_back(mock: MockUpstream) -> None:
    text = rollout_policy_yaml(weights=(50, 50))
    mock.behavior.fail_adapters = frozenset({"a1"})

    async def scenario() -> dict[str, Any]:
        async with asgi(make_app([mock], text)) as gw:
            statuses = [
                (await gw.post("/v1/completions", json=COMPLETION, headers=support(f"user-{i}"))).status_code
                for i in range(60)
            ]
            return {"statuses": statuses, "policy": (await gw.get("/admin/policy", headers=ADMIN)).json()}

    out = run(scenario())
    assert out["statuses"].count(500) >= 10  # the first variant failed plenty ...
    assert out["policy"]["rollouts"][0]["rolled_back"] is None  # ... and there is nothing to roll back to


def test_an_overloaded_engine_does_not_count_against_the_canary(mock: MockUpstream) -> None:
    text = rollout_policy_yaml(weights=(50, 50))
    mock.behavior.fail_status = 503  # every request, both variants: the engine is busy, not broken

    async def scenario() -> dict[str, Any]:
        async with asgi(make_app([mock], text)) as gw:
            for user in canary_users(text, 12):
                assert (await gw.post("/v1/completions", json=COMPLETION, headers=support(user))).status_code == 503
            return (await gw.get("/admin/policy", headers=ADMIN)).json()["rollouts"][0]

    state = run(scenario())
    assert state["rolled_back"] is None
    # the engine's breaker opened after 5 (then circuit_open sheds, which reach no variant)
    assert mock.count == 5 and state["variants"][1]["window"] == {
        "requests": 5,
        "errors": 0,
        "error_rate": 0.0,
        "ttft_p99_ms": None,
    }


def test_ttft_p99_bound_rolls_back_and_windows_slide() -> None:
    policy = parse_policy(
        rollout_policy_yaml(rollback="{max_error_rate: 1, max_ttft_p99_ms: 500, min_requests: 100, window_s: 10}")
    )
    now = [0.0]
    rollouts = Rollouts(policy.rollouts, clock=lambda: now[0])
    for _ in range(99):
        assert rollouts.record("support", "a2", False, 0.9) is None  # slow, but under min_requests
    now[0] = 10.5  # those 99 slide out of the 10 s window
    for _ in range(99):
        assert rollouts.record("support", "a2", False, 0.1) is None
    for _ in range(98):
        assert rollouts.record("support", "a1", False, 5.0) is None  # the first variant is never judged
    assert rollouts.record("support", "a2", False, 0.1) is None  # 100 fast: p99 100 ms
    for _ in range(2):
        rollouts.record("support", "a2", False, 0.8)  # 102 requests, 2 slow: the p99 is a slow one
    assert rollouts.is_rolled_back("support")
    state = rollouts.describe()[0]
    assert state["rolled_back"]["reason"] == "ttft_p99" and state["variants"][1]["window"]["requests"] == 102


def test_counts_p99_test_matches_numpy_nearest_rank() -> None:
    import numpy as np  # the reference: numpy's nearest-rank percentile (method "inverted_cdf")

    rng = np.random.default_rng(0)
    for trial in range(300):
        ttfts = rng.lognormal(-1.0, 1.0, size=int(rng.integers(1, 400)))
        bound = float(rng.choice(ttfts)) if trial % 2 else float(rng.uniform(0.05, 3.0))
        counts = Counts(len(ttfts), 0, len(ttfts), int((ttfts > bound).sum()))
        assert counts.p99_above_bound() == (np.percentile(ttfts, 99, method="inverted_cdf") > bound), trial


def test_two_replicas_pool_their_windows_in_redis(redis_url: str) -> None:
    """min_requests counts the fleet: 5 canary failures on each of two replicas trip a rollback of 10."""
    rollouts = parse_policy(rollout_policy_yaml()).rollouts

    async def scenario() -> dict[str, Any]:
        shares = [RedisFleetStore(redis_url), RedisFleetStore(redis_url)]
        one, two = (Rollouts(rollouts, share) for share in shares)
        try:
            for replica in (one, two):
                for _ in range(5):
                    assert replica.record("support", "a2", True, None) is None  # 5 < min_requests here
            for _ in range(20):
                assert two.record("support", "a1", False, 0.1) is None  # the first variant is fine
            out: dict[str, Any] = {"local": (one.is_rolled_back("support"), two.is_rolled_back("support"))}
            await one.sync()  # pools its 5
            out["after_one"] = one.is_rolled_back("support")  # the pool holds 5 so far: not yet
            await two.sync()  # pools its 5, reads 10: rolls back and publishes
            await one.sync()  # adopts it
            out["both"] = (one.is_rolled_back("support"), two.is_rolled_back("support"))
            out["detail"] = two.describe()[0]
            await one.clear_shared()  # POST /admin/reload on replica one
            fresh = Rollouts(rollouts, shares[0])
            await fresh.sync()
            await two.sync()
            out["cleared"] = (fresh.is_rolled_back("support"), two.is_rolled_back("support"))
            return out
        finally:
            for share in shares:
                await share.aclose()

    out = run(scenario())
    assert out["local"] == (False, False) and out["after_one"] is False
    assert out["both"] == (True, True)
    assert "across the replicas" in out["detail"]["rolled_back"]["detail"]
    assert out["detail"]["variants"][1]["fleet_window"] == {"requests": 10, "errors": 10, "timed": 0, "slow": 0}
    assert out["cleared"] == (False, False)  # the rollback and the pooled counts are gone


def test_rollback_is_shared_through_redis_by_two_gateway_processes(
    tmp_path: Path, redis_url: str, mock: MockUpstream
) -> None:
    text = rollout_policy_yaml(weights=(50, 50))
    mock.behavior.fail_adapters = frozenset({"a2"})
    canary = canary_users(text, 14)
    gateways = [start_gateway(tmp_path, f"gw{i}", text, [mock.url], "--redis", redis_url) for i in range(2)]
    (_, one), (_, two) = gateways
    try:
        with httpx.Client(timeout=30) as http:

            def post(url: str, user: str) -> httpx.Response:
                return http.post(f"{url}/v1/completions", json=COMPLETION, headers=support(user))

            # 5 canary failures on each gateway: neither has min_requests (10) of its own, the fleet has. Each
            # failure is answered by the first variant (gateway/generate.py, fallback_call): no client sees it.
            answers = [post(url, u) for url, u in zip([one, two] * 5, canary[:10], strict=True)]
            assert [(r.status_code, r.headers["X-Loragate-Adapter"]) for r in answers] == [(200, "a1")] * 10
            for url in (one, two):
                state = wait_for_rollback(http, url, rolled_back=True)
                assert state["variant"] == "a2"
            resp = post(two, canary[11])
            assert resp.status_code == 200 and resp.headers["X-Loragate-Adapter"] == "a1"
            assert http.post(f"{one}/admin/reload", headers=ADMIN).status_code == 200  # clears it everywhere
            wait_for_rollback(http, two, rolled_back=False)
            seen = len(mock.received)
            assert post(two, canary[12]).status_code == 200
            tried = [r.headers["x-adapter-id"] for r in mock.received[seen:]]
            assert tried == ["a2", "a1"]  # the canary is back in the split (and still answered by a1)
    finally:
        for proc, _ in gateways:
            stop_process(proc)


def wait_for_rollback(http: httpx.Client, url: str, rolled_back: bool) -> Any:
    """GET /admin/policy until the rollout's `rolled_back` is set (or cleared); returns it."""

    def probe() -> tuple[Any] | None:
        state = http.get(f"{url}/admin/policy", headers=ADMIN).json()["rollouts"][0]["rolled_back"]
        return (state,) if (state is not None) == rolled_back else None

    return poll(probe, timeout_s=10.0)[0]


# ---- through a real engine ------------------------------------------------------------------------------


def test_canary_through_a_real_engine_serves_what_it_names(
    tmp_path: Path, tiny_model_dir: Path, tiny_adapters: dict[str, Path]
) -> None:
    """The official client through the gateway to a real engine: every answer is PEFT's greedy output of
    the variant X-Loragate-Adapter names, and each user keeps their variant."""
    text = rollout_policy_yaml(
        weights=(50, 50), variants=("qv-r8", "all-r4"), rollback=None, acme_adapters='["support"]'
    )
    rollout = parse_policy(text).rollout("support")
    assert rollout is not None
    users = [f"user-{i}" for i in range(8)]
    assigned = {u: pick_variant(rollout, u).adapter for u in users}
    assert set(assigned.values()) == {"qv-r8", "all-r4"}  # both variants among these users
    adapter_root = tiny_adapters["qv-r8"].parent
    engine, engine_url = start_engine_server(tmp_path / "engine.log", "--adapter-dir", str(adapter_root))
    gateway, url = start_gateway(tmp_path, "gw", text, [engine_url])
    prompt = "The quick brown fox"
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        answers = {}
        for user in users + users[:2]:  # the first two twice: sticky
            raw = client.completions.with_raw_response.create(
                model="support",
                prompt=prompt,
                temperature=0,
                max_tokens=6,
                extra_body={"ignore_eos": True},
                extra_headers={"X-User-ID": user},
            )
            answers.setdefault(user, []).append((raw.headers["X-Loragate-Adapter"], raw.parse().choices[0].text))
    finally:
        stop_process(gateway)
        stop_process(engine)
    from engine.model.sources import load_tokenizer  # the reference needs torch: only this test loads it

    from lora_fixtures import peft_greedy

    tokenizer = load_tokenizer(tiny_model_dir)
    ids = tokenizer(prompt)["input_ids"]
    expected = {
        name: tokenizer.decode(peft_greedy(tiny_model_dir, tiny_adapters[name], ids, 6)) for name in ("qv-r8", "all-r4")
    }
    assert expected["qv-r8"] != expected["all-r4"]
    for user, seen in answers.items():
        assert {adapter for adapter, _ in seen} == {assigned[user]}, user
        assert {answer for _, answer in seen} == {expected[assigned[user]]}, user
