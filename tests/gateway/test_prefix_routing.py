"""Prefix-aware routing and session affinity: the index (gateway/prefix_index.py), admission's use of it
(gateway/admission.py), and two gateway replicas sharing it through a real Redis in front of two engines."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.admission import AdmissionController, EngineLoad, Upstream
from gateway.app import build_app
from gateway.breaker import CircuitBreaker
from gateway.policy import PolicyError, PrefixRouting, parse_policy
from gateway.prefix_index import KEY_PREFIX, REPORT_FRESH_S, PrefixIndex, RedisPrefixStore
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics
from loragate_common.prefix import PromptChunks, prompt_chunks
from loragate_common.priority import Priority

import policies
from fake_clock import FakeClock
from gateway_testing import asgi
from mock_upstream import MockUpstream
from policies import ADMIN, bearer, tenant_yaml
from redis_server import redis_url_fixture, start_redis

redis_url = redis_url_fixture()

STD = Priority.STANDARD
URLS = ("http://a", "http://b", "http://c")
KEY = "acme-secret"
CHAT = True


def system(n: int, chars: int = 2000) -> dict[str, str]:
    """Tenant n's long system prompt."""
    words = " ".join(f"rule{n}-{i} applies to every answer" for i in range(chars // 28))
    return {"role": "system", "content": words[:chars]}


def conversation(n: int, turns: int) -> list[dict[str, str]]:
    """Tenant n's system prompt and `turns` user turns, each answered (the last one is still open)."""
    messages = [system(n)]
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"answer {t} of conversation {n}, " * 8})
        messages.append({"role": "user", "content": f"question {t} of conversation {n}: " + "why? " * 40})
    return messages


def chunks(messages: list[dict[str, str]], adapter: str | None = None, index: PrefixIndex | None = None) -> Any:
    index = index or PrefixIndex(PrefixRouting(), "none")
    return index.chunks({"messages": messages}, CHAT, adapter)


def controller(load_source: str = "engine", cap: int = 8) -> AdmissionController:
    upstreams = [Upstream(url, CircuitBreaker()) for url in URLS]
    return AdmissionController(upstreams, cap, 16, 5.0, spill_inflight=cap, load_source=load_source)


def run(test: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(test(), timeout=30))


def report(ctl: AdmissionController, url: str, running: int) -> None:
    upstream = next(u for u in ctl.upstreams if u.url == url)
    upstream.reported = EngineLoad(running, 0, time.monotonic())


# ---- the index and admission, in one process ----


def test_chunks_are_prefix_stable_and_keyed_by_adapter() -> None:
    one, two = chunks(conversation(0, 1)), chunks(conversation(0, 2))
    assert len(one.hashes) >= 8 and len(two.hashes) > len(one.hashes)
    assert two.hashes[: len(one.hashes)] == one.hashes  # the next turn extends the last one's chain
    under_x, under_y = chunks(conversation(0, 1), "x"), chunks(conversation(0, 1), "y")
    assert not {*one.hashes} & {*under_x.hashes} and not {*under_x.hashes} & {*under_y.hashes}
    assert chunks(conversation(1, 1)).hashes[0] != one.hashes[0]  # another tenant's system prompt
    assert PromptChunks.parse(two.header()) == two
    for bad in (
        "",
        "chunk=0, total=10, hashes=",
        "chunk=4, total=3, hashes=00112233445566ff",
        "x=1",
        two.header()[:-1],
    ):
        assert PromptChunks.parse(bad) is None, bad


def test_prompts_of_token_ids_are_hashed_by_ids() -> None:
    ids = list(range(1000, 1400))
    short, longer = (
        prompt_chunks({"prompt": ids[:300]}, False, None, 256, 128),
        prompt_chunks({"prompt": ids}, False, None, 256, 128),
    )
    assert short is not None and longer is not None
    assert (short.chunk, len(short.hashes), longer.total) == (64, 4, 400)  # 256 characters: 64 ids a chunk
    assert longer.hashes[:4] == short.hashes
    assert prompt_chunks({"prompt": [ids]}, False, None, 256, 128) == longer  # a batch of one
    text = prompt_chunks({"prompt": " ".join(map(str, ids))}, False, None, 256, 128)
    assert text is not None and not set(text.hashes) & set(longer.hashes)
    for prompt in (["a", "b"], [1, True], [2**70], [[1], [2]], None, 5):
        assert prompt_chunks({"prompt": prompt}, False, None, 256, 128) is None, prompt
    assert prompt_chunks({"messages": "x"}, True, None, 256, 128) is None


def test_longest_match_wins_over_adapter_affinity_and_load() -> None:
    async def scenario() -> None:
        ctl, index = controller(), PrefixIndex(PrefixRouting(), "none")
        await index.record("http://c", chunks(conversation(0, 1)[:1]), None)  # the system prompt only
        await index.record("http://b", chunks(conversation(0, 2)), None)  # the whole last turn
        hints = await index.lookup(chunks(conversation(0, 3)), None)
        assert hints.match("http://b") == len(chunks(conversation(0, 2)).hashes)
        assert 0 < hints.match("http://c") < hints.match("http://b") and hints.match("http://a") == 0
        report(ctl, "http://b", 1)  # b is busier than a and c, still within the bound
        for affinity in (None, "adapter-0", "adapter-1", "adapter-2"):
            slot = await ctl.acquire(STD, "t", affinity=affinity, hints=hints)
            assert slot.upstream.url == "http://b", affinity
            slot.release()
        assert ctl.spills == 0  # going where the prefix is is not a spill

    run(scenario)


def test_the_load_bound_overrides_the_longest_match() -> None:
    async def scenario() -> None:
        ctl, index = controller(), PrefixIndex(PrefixRouting(), "none")
        await index.record("http://c", chunks(conversation(0, 1)[:1]), None)
        await index.record("http://b", chunks(conversation(0, 2)), None)
        asked = chunks(conversation(0, 3))
        hints = await index.lookup(asked, None)
        report(ctl, "http://b", 10)  # bound: max(2, ceil(1.2 * 11 / 3)) = 5 < 11
        slot = await ctl.acquire(STD, "t", hints=hints)
        assert slot.upstream.url == "http://c"  # the next longest match within the bound
        index.count(hints, slot.upstream.url, asked, None)
        slot.release()
        report(ctl, "http://c", 10)
        slot = await ctl.acquire(STD, "t", hints=hints)
        assert slot.upstream.url == "http://a"  # both holders are past it: load routing
        slot.release()
        report(ctl, "http://b", 0)
        slot = await ctl.acquire(STD, "t", hints=hints)
        assert slot.upstream.url == "http://b"
        index.count(hints, slot.upstream.url, asked, None)
        other = chunks(conversation(5, 1))
        index.count(await index.lookup(other, None), "http://a", other, None)
        assert index.describe()["outcomes"] == {"prefix_hit": 1, "prefix_miss": 1, "prefix_overridden": 1}

    run(scenario)


def test_local_loads_bound_the_match_by_spill_inflight() -> None:
    async def scenario() -> None:
        upstreams = [Upstream(url, CircuitBreaker()) for url in URLS]
        ctl = AdmissionController(upstreams, 8, 16, 5.0, spill_inflight=2, load_source="local")
        index = PrefixIndex(PrefixRouting(), "none")
        await index.record("http://b", chunks(conversation(0, 1)), None)
        hints = await index.lookup(chunks(conversation(0, 2)), None)
        slots = [await ctl.acquire(STD, "t", hints=hints) for _ in range(3)]
        assert [s.upstream.url for s in slots[:2]] == ["http://b", "http://b"]
        assert slots[2].upstream.url != "http://b"  # two in flight there: spill_inflight reached

    run(scenario)


def test_the_same_text_under_two_adapters_is_two_prefixes() -> None:
    async def scenario() -> None:
        index = PrefixIndex(PrefixRouting(), "none")
        messages = conversation(0, 2)
        await index.record("http://b", chunks(messages, "support@2"), None)
        assert (await index.lookup(chunks(messages, "support@2"), None)).best > 0
        assert (await index.lookup(chunks(messages, "support@3"), None)).matches == {}
        assert (await index.lookup(chunks(messages, "legal"), None)).matches == {}
        assert (await index.lookup(chunks(messages, None), None)).matches == {}

    run(scenario)


def test_the_index_bounds_its_memory() -> None:
    async def scenario() -> None:
        index = PrefixIndex(PrefixRouting(index_entries=64), "none")
        first = chunks(conversation(0, 1))
        await index.record("http://a", first, None)
        for n in range(1, 40):
            await index.record("http://a", chunks(conversation(n, 1)), None)
        assert index.describe()["entries"] == 64
        assert (await index.lookup(first, None)).matches == {}  # the oldest went first
        assert (await index.lookup(chunks(conversation(39, 1)), None)).best == len(first.hashes)
        index.configure(PrefixRouting(index_entries=8), "none")
        assert index.describe()["entries"] == 8
        index.report("http://a", [f"{i:016x}" for i in range(100)])
        assert index.describe()["reported"] == {"http://a": 8}

    run(scenario)


def test_engine_reports_override_what_was_sent_there() -> None:
    async def scenario() -> None:
        clock = FakeClock()
        index = PrefixIndex(PrefixRouting(), "none", clock=clock)
        sent = chunks(conversation(0, 1))
        await index.record("http://b", sent, None)
        assert (await index.lookup(sent, None)).matches == {"http://b": len(sent.hashes)}
        clock.advance(1)
        index.report("http://b", [])  # recorded one second before the report: maybe still queued there
        assert (await index.lookup(sent, None)).match("http://b") == len(sent.hashes)
        clock.advance(30)
        index.report("http://b", [])  # b restarted (or evicted it): its report has none of it
        index.report("http://c", sent.hashes[:3])  # c holds the first three chunks (another request's)
        assert (await index.lookup(sent, None)).matches == {"http://c": 3}
        index.report("http://b", sent.hashes[:5])
        assert (await index.lookup(sent, None)).matches == {"http://b": 5, "http://c": 3}
        clock.advance(REPORT_FRESH_S + 1)  # stale reports: the records count again, unreported engines fall out
        assert (await index.lookup(sent, None)).matches == {"http://b": len(sent.hashes)}

    run(scenario)


def test_sessions_stick_within_the_load_bound() -> None:
    async def scenario() -> None:
        ctl, index = controller(), PrefixIndex(PrefixRouting(), "header:X-Session-ID")
        short = {"messages": [{"role": "user", "content": "hi"}]}  # no full chunk: the session alone steers
        assert index.chunks(short, CHAT, None).hashes == ()
        session = index.session("acme", {"X-Session-ID": "s-1"}, short)
        assert session is not None and session != index.session("globex", {"X-Session-ID": "s-1"}, short)
        assert index.session("acme", {}, short) is None
        first = await ctl.acquire(STD, "t", hints=await index.lookup(None, session))
        index.count(await index.lookup(None, session), first.upstream.url, None, session)
        await index.record(first.upstream.url, None, session)
        report(ctl, first.upstream.url, 1)  # busier than the others, within the bound
        hints = await index.lookup(None, session)
        assert hints.session == first.upstream.url
        again = await ctl.acquire(STD, "t", hints=hints)
        assert again.upstream is first.upstream
        index.count(hints, again.upstream.url, None, session)
        report(ctl, first.upstream.url, 9)  # past the bound: it moves
        moved = await ctl.acquire(STD, "t", hints=hints)
        assert moved.upstream is not first.upstream
        index.count(hints, moved.upstream.url, None, session)
        assert index.describe()["outcomes"] == {"session_hit": 1, "session_new": 1, "session_overridden": 1}
        by_user = PrefixIndex(PrefixRouting(), "body:user")
        assert by_user.session("acme", {"X-Session-ID": "s-1"}, {**short, "user": "u-7"}) is not None
        assert by_user.session("acme", {"X-Session-ID": "s-1"}, short) is None

    run(scenario)


def test_policy_keys_are_checked() -> None:
    def text(admission: str) -> str:
        return policies.policy_yaml(tenant_yaml("acme", KEY, '["*"]'), admission=admission)

    policy = parse_policy(text("{prefix: {chunk_chars: 512, index_entries: 1000}, session_key: body:user}"))
    assert policy.admission.prefix.chunk_chars == 512 and policy.admission.session_key == "body:user"
    assert parse_policy(text("{}")).admission.prefix.enabled  # on by default
    for bad, key in (
        ("{prefix: {chunk_chars: 4}}", "admission.prefix.chunk_chars"),
        ("{prefix: {index_entries: 0}}", "admission.prefix.index_entries"),
        ("{prefix: {enabled: 'yes'}}", "admission.prefix.enabled"),
        ("{prefix: {size: 3}}", "admission.prefix.size"),
        ("{session_key: 'cookie:x'}", "admission.session_key"),
    ):
        with pytest.raises(PolicyError, match=key.replace(".", r"\.")):
            parse_policy(text(bad))


# ---- two gateway replicas, one Redis, two engines ----


def test_shared_records_are_written_once_per_refresh(redis_url: str) -> None:
    async def scenario() -> None:
        clock = FakeClock(5000.0)
        store = RedisPrefixStore(redis_url)
        index = PrefixIndex(PrefixRouting(ttl_s=100), "header:X-Session-ID", store, clock=clock)
        sent, session = chunks(conversation(7, 1)), "s" + "7" * 16
        keys = [*sent.hashes, session]

        async def stamps(url: str) -> list[float | None]:
            return [where.get(url) for where in await store.get(keys)]

        await index.record("http://a", sent, session, await index.lookup(sent, session))
        assert await stamps("http://a") == [5000.0] * len(keys)
        assert 0 < await store._redis.ttl(KEY_PREFIX + keys[0]) <= 100
        clock.advance(20)  # younger than a quarter of ttl_s: not written again
        await index.record("http://a", sent, session, await index.lookup(sent, session))
        assert await stamps("http://a") == [5000.0] * len(keys)
        await index.record("http://b", sent, session, await index.lookup(sent, session))  # another engine: written
        assert await stamps("http://b") == [5020.0] * len(keys)
        clock.advance(10)  # 30 s: rewritten, its expiry pushed back
        await index.record("http://a", sent, session, await index.lookup(sent, session))
        assert await stamps("http://a") == [5030.0] * len(keys)
        await index.record("http://c", sent, session)  # without what a lookup found: written
        assert await stamps("http://c") == [5030.0] * len(keys)
        await store.aclose()

    run(scenario)


def fleet_yaml(prefix: str = "{}") -> str:
    return policies.policy_yaml(
        tenant_yaml("acme", KEY, '["*"]'),
        admission=f"{{max_inflight_per_upstream: 8, max_queue: 16, queue_timeout_ms: 5000, prefix: {prefix}}}",
    )


def replica(engines: list[MockUpstream], redis: str, text: str | None = None) -> tuple[Any, RedisPrefixStore]:
    store = RedisPrefixStore(redis)
    app = build_app(
        parse_policy(text or fleet_yaml()),
        [m.url for m in engines],
        MemoryRateLimiter(),
        metrics=GatewayMetrics(),
        prefix_store=store,
    )
    return app, store


def served_by(engines: list[MockUpstream]) -> dict[str, set[int]]:
    """Conversation number -> the engines (by index) that served its turns."""
    out: dict[str, set[int]] = {}
    for k, engine in enumerate(engines):
        for received in engine.received:
            out.setdefault(received.body["messages"][0]["content"][:12], set()).add(k)
    return out


def test_two_replicas_share_the_index_through_redis(redis_url: str, mock: MockUpstream, mock_b: MockUpstream) -> None:
    engines = [mock, mock_b]

    async def scenario() -> dict[str, Any]:
        (app1, store1), (app2, store2) = replica(engines, redis_url), replica(engines, redis_url)
        out: dict[str, Any] = {}
        async with asgi(app1) as one, asgi(app2) as two:
            # Each conversation's turns alternate between the replicas; without the shared index the
            # second replica's load routing would send them anywhere.
            for turn in range(1, 4):
                for n in random.Random(turn).sample(range(8), 8):
                    gw = (one, two)[(n + turn) % 2]
                    body = {"messages": conversation(n, turn), "max_tokens": 4}
                    resp = await gw.post("/v1/chat/completions", json=body, headers=bearer(KEY))
                    assert resp.status_code == 200, resp.text
            out["policy"] = (await two.get("/admin/policy", headers=ADMIN)).json()["routing"]["prefix"]
            out["metrics"] = (await one.get("/metrics")).text
        for store in (store1, store2):
            await store.aclose()
        return out

    out = run_get(scenario)
    by_conversation = served_by(engines)
    assert len(by_conversation) == 8
    assert all(len(where) == 1 for where in by_conversation.values()), by_conversation  # each on one engine
    spread = Counter(next(iter(w)) for w in by_conversation.values())
    assert set(spread) == {0, 1}, spread  # and the conversations spread over both
    outcomes = out["policy"]["outcomes"]
    assert outcomes["prefix_hit"] >= 8 and out["policy"]["shared"] is True
    assert 'loragate_gateway_prefix_routing_total{outcome="hit"}' in out["metrics"]
    # The engine got the chunks of what it computes, as the index hashed them.
    received = mock.received[-1] if mock.received else mock_b.received[-1]
    sent = PromptChunks.parse(received.headers["x-loragate-prefix"])
    assert sent == prompt_chunks({"messages": received.body["messages"]}, True, None, 256, 128)


def test_routes_to_what_an_engine_reports_holding(mock: MockUpstream, mock_b: MockUpstream) -> None:
    messages = conversation(3, 2)
    held = chunks(messages)
    for engine in (mock, mock_b):
        engine.behavior.load = (0, 0, ())
    mock_b.behavior.prefixes = held.hashes[:4]  # it computed another request with this system prompt

    async def scenario() -> dict[str, Any]:
        app = build_app(parse_policy(fleet_yaml()), [mock.url, mock_b.url], MemoryRateLimiter())
        async with asgi(app) as gw:
            await app.state.gateway.fleet.poll_loads()
            for _ in range(3):
                resp = await gw.post("/v1/chat/completions", json={"messages": messages}, headers=bearer(KEY))
                assert resp.status_code == 200
            return (await gw.get("/admin/policy", headers=ADMIN)).json()["routing"]["prefix"]

    state = run_get(scenario)
    assert (mock.count, mock_b.count) == (0, 3)
    assert state["reported"] == {mock.url: 0, mock_b.url: 4}


def test_prefix_routing_off_sends_no_chunks(mock: MockUpstream, mock_b: MockUpstream) -> None:
    async def scenario() -> None:
        app = build_app(parse_policy(fleet_yaml("{enabled: false}")), [mock.url, mock_b.url], MemoryRateLimiter())
        async with asgi(app) as gw:
            resp = await gw.post("/v1/chat/completions", json={"messages": conversation(0, 1)}, headers=bearer(KEY))
            assert resp.status_code == 200
        assert all("x-loragate-prefix" not in r.headers for r in [*mock.received, *mock_b.received])

    run(scenario)


def test_redis_loss_falls_back_to_this_replicas_records(mock: MockUpstream, mock_b: MockUpstream) -> None:
    engines = [mock, mock_b]
    server = start_redis()
    url = server.url
    server.stop()  # Redis is gone before the first request

    async def scenario() -> dict[str, Any]:
        app, store = replica(engines, url)
        async with asgi(app) as gw:
            statuses = []
            for turn in range(1, 4):
                for n in range(4):
                    body = {"messages": conversation(n, turn), "max_tokens": 4}
                    statuses.append((await gw.post("/v1/chat/completions", json=body, headers=bearer(KEY))).status_code)
            state = (await gw.get("/admin/policy", headers=ADMIN)).json()["routing"]["prefix"]
        await store.aclose()
        return {"statuses": statuses, "state": state}

    out = run_get(scenario)
    assert out["statuses"] == [200] * 12
    assert out["state"]["redis_errors"] > 0
    assert all(len(where) == 1 for where in served_by(engines).values())  # this replica's own records route


def run_get(scenario: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
    return asyncio.run(asyncio.wait_for(scenario(), timeout=60))
