"""Weighted mixes of adapters through the gateway (gateway/generate.py `resolve_mix`, the forms of
loragate_common/adapter_mix.py): what the engine receives for each form (a fake engine on a real port,
tests/mock_upstream.py, records it), the tenant's allow-list per part, rollouts split per part as if named alone
(against `pick_variant` and what a request naming the rollout alone gets), catalog parts pinned with their
sources, the 400s naming the problem, the ledger, the metrics (read back with prometheus_client's own parser)
and vLLM engines, which are never sent a mix. The official openai client sends the body form once.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette

from gateway.app import build_app
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.rollout import pick_variant
from gateway.telemetry import MAX_MIX_LABELS, GatewayMetrics
from gateway.usage import MemoryUsageLedger, UsageRecord
from loragate_common.adapter_mix import MAX_PARTS, MixPart, mix_name

import policies
from gateway_testing import asgi, assert_error, run
from mock_upstream import BASE_MODEL, MockUpstream
from policies import ADMIN, bearer, tenant_yaml

ACME, GLOBEX = "acme-secret", "globex-secret"
ROLLOUT = """  - name: support
    sticky_key: header:X-User-ID
    variants: [{adapter: a1, weight: 50}, {adapter: a2, weight: 50}]
    override_header: X-Variant"""
POLICY = policies.policy_yaml(
    tenant_yaml("acme", ACME, '["a1", "a2", "a3", "support", "cat*", "zz-*"]'),
    tenant_yaml("globex", GLOBEX, '["a1"]'),
    rollouts=ROLLOUT,
    admission="{max_inflight_per_upstream: 64, max_queue: 64, queue_timeout_ms: 5000}",
)
SHA_A, SHA_B = "a" * 64, "b" * 64


@pytest.fixture
def mock() -> Iterator[MockUpstream]:
    with MockUpstream(adapters=("a1", "a2", "a3")) as upstream:
        upstream.behavior.tokens = 2
        yield upstream


def make_app(urls: list[str], ledger: MemoryUsageLedger | None = None) -> Starlette:
    return build_app(
        parse_policy(POLICY), urls, MemoryRateLimiter(), metrics=GatewayMetrics(), ledger=ledger or MemoryUsageLedger()
    )


def canonical(*parts: tuple[str, float]) -> str:
    """The name the contract says the engine gets: adapter_mix.mix_name of the parts as resolved."""
    return mix_name([MixPart(ref, weight) for ref, weight in parts])


async def complete(
    gw: httpx.AsyncClient, adapter: str | None = None, key: str = ACME, path: str = "/v1/completions", **more: Any
) -> httpx.Response:
    """One request: `adapter` in X-Adapter-ID; `more` are body fields, or headers when given as `headers`."""
    headers = {**bearer(key), **more.pop("headers", {})}
    if adapter is not None:
        headers["X-Adapter-ID"] = adapter
    if path.endswith("chat/completions"):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, **more}
    else:
        body = {"prompt": "hello", "max_tokens": 4, **more}
    return await gw.post(path, json=body, headers=headers)


def metric_samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one metric family (by its name without _total), keyed by their sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    out[tuple(sorted(sample.labels.items()))] = sample.value
    return out


# ---- the forms ----------------------------------------------------------------------------------------------


def test_every_form_and_order_reaches_the_engine_as_one_canonical_name(mock: MockUpstream) -> None:
    expected = canonical(("a1", 0.7), ("a3", 0.3))
    assert expected.index("a1") < expected.index("a3")  # parts by ref, whatever order the client wrote

    async def scenario() -> list[httpx.Response]:
        app = make_app([mock.url])
        async with asgi(app) as gw:
            answers = [
                await complete(gw, "a1*0.7+a3*0.3"),
                await complete(gw, " a3*0.3 + a1*0.7 "),
                await complete(gw, "a3*3e-1+a1*0.70"),  # the same numbers written otherwise
                await complete(gw, model="a3*0.3+a1*0.7"),
                await complete(gw, model=BASE_MODEL, adapter_mix={"a3": 0.3, "a1": 0.7}),
                await complete(gw, adapter_mix={"a1": 0.7, "a3": 0.3}),
                await complete(gw, "a3*0.3+a1*0.7", path="/v1/chat/completions", stream=True),
            ]
            client = openai.AsyncOpenAI(
                base_url="http://gw/v1",
                api_key=ACME,
                max_retries=0,
                http_client=httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw"),
            )
            raw = await client.completions.with_raw_response.create(
                model=BASE_MODEL, prompt="hello", max_tokens=2, extra_body={"adapter_mix": {"a3": 0.3, "a1": 0.7}}
            )
            assert raw.headers["X-Loragate-Adapter"] == expected
            assert raw.parse().choices[0].text == "t0 t1 "
            return answers

    answers = run(scenario())
    for resp in answers:
        assert resp.status_code == 200, resp.text
        assert resp.headers["X-Loragate-Adapter"] == expected
    assert len(mock.received) == len(answers) + 1
    for received in mock.received:
        assert received.headers["x-adapter-id"] == expected
        assert received.body["model"] == expected
        assert "adapter_mix" not in received.body  # the header carries the mix, however the client wrote it
        assert not {"x-adapter-part-sources", "x-adapter-source"} & set(received.headers)


def test_the_same_mix_is_placed_as_one_adapter(mock: MockUpstream) -> None:
    """Affinity keys a mix by its canonical name: every order of it lands on the same engine."""
    with MockUpstream(adapters=("a1", "a2", "a3")) as other:

        async def scenario() -> None:
            async with asgi(make_app([mock.url, other.url])) as gw:
                for text in ["a1*0.5+a2*-0.25", "a2*-0.25+a1*0.5"] * 4:
                    assert (await complete(gw, text)).status_code == 200

        run(scenario())
        counts = sorted([mock.count, other.count])
        assert counts == [0, 8]
        received = mock.received or other.received
        assert {r.headers["x-adapter-id"] for r in received} == {canonical(("a1", 0.5), ("a2", -0.25))}


# ---- parts resolved as alone ----------------------------------------------------------------------------------


def test_a_rollout_part_gets_the_variant_it_would_get_alone(mock: MockUpstream) -> None:
    rollout = parse_policy(POLICY).rollout("support")
    assert rollout is not None
    users = [f"user-{i}" for i in range(24)]
    variant = {u: pick_variant(rollout, u).adapter for u in users}
    assert set(variant.values()) == {"a1", "a2"}

    async def scenario() -> tuple[dict[str, str], str]:
        async with asgi(make_app([mock.url])) as gw:
            alone = {}
            for user in users:
                resp = await complete(gw, "support", headers={"X-User-ID": user})
                alone[user] = resp.headers["X-Loragate-Adapter"]
                for _ in range(2):  # sticky: the same user, the same variant
                    resp = await complete(gw, "a3*0.4+support*0.6", headers={"X-User-ID": user})
                    assert resp.status_code == 200, resp.text
            resp = await complete(gw, "a3*0.4+support*0.6", headers={"X-User-ID": users[0], "X-Variant": "a2"})
            return alone, (await gw.get("/metrics")).text

    alone, metrics = run(scenario())
    assert alone == variant
    mixes = [r.headers["x-adapter-id"] for r in mock.received if "*" in r.headers["x-adapter-id"]]
    assert mixes[:-1] == [canonical((variant[u], 0.6), ("a3", 0.4)) for u in users for _ in range(2)]
    assert mixes[-1] == canonical(("a2", 0.6), ("a3", 0.4))  # the rollout's override header, for its part
    # the rollout's metrics count each mix once for the variant its part got, as a request naming it alone
    samples = metric_samples(metrics, "loragate_gateway_rollout_requests")
    for name in ("a1", "a2"):
        served = sum(3 for u in users if variant[u] == name) + (name == "a2")
        assert samples[(("result", "ok"), ("rollout", "support"), ("variant", name))] == served


def test_a_failed_canary_part_is_answered_by_the_stable_variant(mock: MockUpstream) -> None:
    rollout = parse_policy(POLICY).rollout("support")
    assert rollout is not None
    user = next(f"user-{i}" for i in range(100) if pick_variant(rollout, f"user-{i}").adapter == "a2")
    canary, stable = canonical(("a2", 0.5), ("a3", 0.5)), canonical(("a1", 0.5), ("a3", 0.5))
    mock.behavior.fail_adapters = frozenset({canary})

    async def scenario() -> tuple[httpx.Response, str]:
        async with asgi(make_app([mock.url])) as gw:
            resp = await complete(gw, "support*0.5+a3*0.5", headers={"X-User-ID": user})
            return resp, (await gw.get("/metrics")).text

    resp, metrics = run(scenario())
    assert resp.status_code == 200, resp.text
    assert resp.headers["X-Loragate-Adapter"] == stable
    assert [r.headers["x-adapter-id"] for r in mock.received] == [canary, stable]
    samples = metric_samples(metrics, "loragate_gateway_rollout_requests")
    assert samples[(("result", "error"), ("rollout", "support"), ("variant", "a2"))] == 1
    assert samples[(("result", "ok"), ("rollout", "support"), ("variant", "a1"))] == 1


def test_catalog_parts_are_pinned_and_their_sources_sent(mock: MockUpstream) -> None:
    async def register(gw: httpx.AsyncClient, adapter_id: str, sha256: str, size: int | None) -> str:
        body: dict[str, Any] = {"id": adapter_id, "source": f"s3://models/{adapter_id}/{sha256[0]}", "sha256": sha256}
        if size is not None:
            body["size"] = size
        resp = await gw.post("/admin/adapters", json=body, headers=ADMIN)
        assert resp.status_code == 201, resp.text
        return str(resp.json()["ref"])

    async def scenario() -> tuple[list[httpx.Response], dict[str, Any]]:
        async with asgi(make_app([mock.url])) as gw:
            assert await register(gw, "cat", SHA_A, 1000) == "cat@1"
            assert await register(gw, "cat", SHA_B, None) == "cat@2"
            assert await register(gw, "cat-two", SHA_A, 7) == "cat-two@1"
            answers = [
                await complete(gw, "cat*0.5+a1*0.5"),
                await complete(gw, "cat@1*0.5+a1*0.5"),
                await complete(gw, adapter_mix={"cat-two": -1.5, "cat@1": 2}),
            ]
            resp = await gw.post("/admin/adapters/cat@1/deprecate", headers=ADMIN)
            assert resp.status_code == 200, resp.text
            answers.append(await complete(gw, "cat@1*0.5+a1*0.5"))
            catalog = (await gw.get("/admin/adapters", headers=ADMIN)).json()
            return answers, {e["id"]: e for e in catalog["data"]}

    answers, catalog = run(scenario())

    def source(ref: str) -> dict[str, Any]:
        """The version's source as the catalog's own API shows it."""
        adapter_id, _, number = ref.partition("@")
        version = next(v for v in catalog[adapter_id]["versions"] if v["version"] == int(number))
        return {"ref": ref, "source": version["source"], "sha256": version["sha256"], "size": version["size"]}

    expected = [
        (canonical(("a1", 0.5), ("cat@2", 0.5)), [source("cat@2")]),
        (canonical(("a1", 0.5), ("cat@1", 0.5)), [source("cat@1")]),
        (canonical(("cat-two@1", -1.5), ("cat@1", 2.0)), [source("cat-two@1"), source("cat@1")]),
        (canonical(("a1", 0.5), ("cat@1", 0.5)), [source("cat@1")]),
    ]
    assert [a.status_code for a in answers] == [200] * 4, [a.text for a in answers]
    assert source("cat@2")["size"] is None and source("cat@1")["size"] == 1000
    for received, resp, (name, sources) in zip(mock.received, answers, expected, strict=True):
        assert received.headers["x-adapter-id"] == name == resp.headers["X-Loragate-Adapter"]
        assert json.loads(received.headers["x-adapter-part-sources"]) == sorted(sources, key=lambda s: s["ref"])
        assert "x-adapter-source" not in received.headers and "x-adapter-sha256" not in received.headers
    assert [resp.headers.get("Deprecation") for resp in answers] == [None, None, None, "true"]


# ---- refusals -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("adapter", "body", "named"),
    [
        ("a1*0.5+a2*0.5", {}, "'a2'"),
        (None, {"adapter_mix": {"a1": 0.5, "a3": 0.5}}, "'a3'"),
        ("support*0.5+a1*0.5", {}, "'support'"),  # a rollout the tenant may not use: checked by its name
    ],
)
def test_a_part_the_tenant_may_not_use_is_403_naming_it(
    mock: MockUpstream, adapter: str | None, body: dict[str, Any], named: str
) -> None:
    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock.url])) as gw:
            return await complete(gw, adapter, key=GLOBEX, **body)

    resp = run(scenario())
    assert_error(resp, 403, "permission_denied")
    assert named in resp.json()["error"]["message"]
    assert mock.received == []


NINE = "+".join(f"a{i}*1" for i in range(MAX_PARTS + 1))


@pytest.mark.parametrize(
    ("adapter", "body", "headers", "field", "problem"),
    [
        ("a1*nan+a2*0.5", {}, {}, "X-Adapter-ID", "'nan' of 'a1' is not a finite number"),
        ("a1*0.5+a2*inf", {}, {}, "X-Adapter-ID", "'inf' of 'a2' is not a finite number"),
        (None, {"model": "a1*1e999"}, {}, "model", "the weight of 'a1' is not a finite number"),
        ("a1*0", {}, {}, "X-Adapter-ID", "must be non-zero"),
        (NINE, {}, {}, "X-Adapter-ID", f"at most {MAX_PARTS} parts, not {MAX_PARTS + 1}"),
        ("a1*0.5++a2*0.5", {}, {}, "X-Adapter-ID", "'' is not ADAPTER*WEIGHT"),
        ("a1*0.5+*0.5", {}, {}, "X-Adapter-ID", "'*0.5' is not ADAPTER*WEIGHT"),
        ("a1*0.5+a1*0.25", {}, {}, "X-Adapter-ID", "'a1' is named twice"),
        ("a1*0.5+../x*0.5", {}, {}, "X-Adapter-ID", "invalid adapter id '../x'"),
        (f"{BASE_MODEL}*0.5+a1*0.5", {}, {}, "X-Adapter-ID", f"the base model {BASE_MODEL!r} cannot be a part"),
        ("support*0.5+a1*0.5", {}, {"X-Variant": "a1"}, "X-Adapter-ID", "'support' and 'a1' are both served by 'a1'"),
        ("a1*0.5+a2*0.5", {"adapter_mix": {"a1": 1}}, {}, "adapter_mix", "also names 'a1*0.5+a2*0.5' in X-Adapter-ID"),
        ("a1", {"adapter_mix": {"a2": 1}}, {}, "adapter_mix", "also names 'a1' in X-Adapter-ID"),
        (None, {"model": "a1*1", "adapter_mix": {"a2": 1}}, {}, "adapter_mix", "also names 'a1*1' in model"),
        (None, {"model": "a1", "adapter_mix": {"a2": 1}}, {}, "adapter_mix", "also names 'a1' in model"),
        (None, {"adapter_mix": {}}, {}, "adapter_mix", "a mix names at least one adapter"),
        (None, {"adapter_mix": {"a1": "0.5"}}, {}, "adapter_mix", "the weight of 'a1' must be a number"),
        (None, {"adapter_mix": [["a1", 0.5]]}, {}, "adapter_mix", "must be an object of adapter -> weight"),
        (None, {"adapter_mix": {f"a{i}": 1 for i in range(9)}}, {}, "adapter_mix", f"at most {MAX_PARTS} parts"),
    ],
)
def test_malformed_mixes_are_400_naming_the_problem(
    mock: MockUpstream, adapter: str | None, body: dict[str, Any], headers: dict[str, str], field: str, problem: str
) -> None:
    async def scenario() -> httpx.Response:
        async with asgi(make_app([mock.url])) as gw:
            return await complete(gw, adapter, headers=headers, **body)

    resp = run(scenario())
    assert_error(resp, 400, "invalid_request_error")
    message = resp.json()["error"]["message"]
    assert message.startswith(f"{field}: ") and problem in message, message
    assert mock.received == []


def test_an_unknown_part_is_404_naming_it(mock: MockUpstream) -> None:
    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app([mock.url])) as gw:
            return [
                await complete(gw, "a1*0.5+zz-unknown*0.5"),
                await complete(gw, adapter_mix={"a1": 0.5, "zz-unknown": 0.5}),
                await complete(gw, "zz-unknown"),  # the same answer as for that adapter alone
            ]

    for resp in run(scenario()):
        assert_error(resp, 404, "adapter_not_found")
        assert "'zz-unknown'" in resp.json()["error"]["message"]
    assert mock.received == []


# ---- what is recorded -----------------------------------------------------------------------------------------


def test_usage_ledger_and_metrics_name_the_mix_and_its_parts(mock: MockUpstream) -> None:
    ledger = MemoryUsageLedger()
    rollout = parse_policy(POLICY).rollout("support")
    assert rollout is not None
    user = "user-1"
    variant = pick_variant(rollout, user).adapter
    plain = canonical(("a1", 0.7), ("a3", 0.3))
    routed = canonical((variant, 0.5), ("a3", -0.5))

    async def scenario() -> tuple[list[dict[str, int]], list[dict[str, Any]], str]:
        async with asgi(make_app([mock.url], ledger)) as gw:
            usages = [
                (await complete(gw, "a3*0.3+a1*0.7")).json()["usage"],
                (await complete(gw, adapter_mix={"a1": 0.7, "a3": 0.3}, max_tokens=6)).json()["usage"],
                (await complete(gw, "support*0.5+a3*-0.5", headers={"X-User-ID": user})).json()["usage"],
            ]
            await ledger.flush()
            rows = (await gw.get("/admin/usage?by=adapter,version,rollout", headers=ADMIN)).json()
            return usages, rows, (await gw.get("/metrics")).text

    usages, rows, metrics = run(scenario())
    records = list(ledger.records)
    assert [(r.adapter, r.version) for r in records] == [(plain, ""), (plain, ""), (routed, "")]
    assert [(r.prompt_tokens, r.completion_tokens) for r in records] == [
        (u["prompt_tokens"], u["completion_tokens"]) for u in usages
    ]
    assert records[0].parts == ({"adapter": "a1", "weight": 0.7}, {"adapter": "a3", "weight": 0.3})
    assert records[2].rollout == "support"
    assert sorted(records[2].parts, key=lambda p: p["adapter"]) == sorted(
        [{"adapter": variant, "weight": 0.5, "rollout": "support"}, {"adapter": "a3", "weight": -0.5}],
        key=lambda p: p["adapter"],
    )
    for record in records:  # as a Redis Stream entry holds it: every field a string, read back whole
        fields = record.to_fields()
        assert all(isinstance(v, str) for v in fields.values())
        assert UsageRecord.from_fields(fields) == record
    assert {(r["adapter"], r["rollout"]): r["requests"] for r in rows} == {(plain, ""): 2, (routed, "support"): 1}

    requests = metric_samples(metrics, "loragate_gateway_requests")
    assert requests[(("adapter", plain), ("reason", ""), ("status", "200"), ("tenant", "acme"))] == 2
    assert requests[(("adapter", routed), ("reason", ""), ("status", "200"), ("tenant", "acme"))] == 1
    parts = metric_samples(metrics, "loragate_gateway_mix_part_requests")
    assert parts == {
        (("adapter", "a1"), ("status", "200"), ("tenant", "acme")): 2 + (variant == "a1"),
        (("adapter", "a3"), ("status", "200"), ("tenant", "acme")): 3,
        **({(("adapter", "a2"), ("status", "200"), ("tenant", "acme")): 1} if variant == "a2" else {}),
    }
    tokens = metric_samples(metrics, "loragate_gateway_completion_tokens")
    assert tokens[(("adapter", plain), ("tenant", "acme"))] == sum(u["completion_tokens"] for u in usages[:2])


def test_mix_labels_are_bounded_apart_from_the_adapters() -> None:
    """Clients write new mixes at will: past MAX_MIX_LABELS they count as "other", and never take the labels the
    adapters they mix would get."""
    metrics = GatewayMetrics()
    for i in range(MAX_MIX_LABELS + 30):
        metrics.observe_request("acme", canonical(("a1", 1.0 + i), ("a2", 0.5)), 200, None, 0.01)
    metrics.observe_request("acme", "fresh-adapter", 200, None, 0.01)
    samples = metric_samples(metrics.render()[0].decode(), "loragate_gateway_requests")
    labels = {dict(key)["adapter"]: value for key, value in samples.items()}
    assert len(labels) == MAX_MIX_LABELS + 2 and labels["other"] == 30 and labels["fresh-adapter"] == 1


# ---- vLLM engines -----------------------------------------------------------------------------------------------


def test_a_mix_never_goes_to_a_vllm_engine(mock: MockUpstream) -> None:
    with MockUpstream(adapters=("a1", "a2", "a3")) as vllm_engine:

        async def scenario() -> tuple[list[httpx.Response], httpx.Response, httpx.Response]:
            async with asgi(make_app([mock.url, f"vllm={vllm_engine.url}"])) as gw:
                mixed = [await complete(gw, f"a1*{w}+a2*0.5") for w in (0.25, 0.5, 0.75, 1, 1.25, 1.5)]
            async with asgi(make_app([f"vllm={vllm_engine.url}"])) as gw:
                alone = await complete(gw, "a1")
                refused = await complete(gw, adapter_mix={"a1": 0.5, "a2": 0.5})
            return mixed, alone, refused

        mixed, alone, refused = run(scenario())
        assert [r.status_code for r in mixed] == [200] * 6
        assert mock.count == 6
        assert alone.status_code == 200  # the vLLM engine serves, but for single adapters only
        assert [r.headers["x-adapter-id"] for r in vllm_engine.received] == ["a1"]
        assert_error(refused, 503, "service_unavailable", reason="no_upstream")
        assert "vLLM" in refused.json()["error"]["message"]
        assert "mix" in refused.json()["error"]["message"]


def test_the_ledger_reads_records_written_before_mixes() -> None:
    """A stream entry without `parts` (written before mixes existed) reads back as a record without parts."""
    record = UsageRecord("r1", time.time(), "acme", "a1", "", "", 3, 4, 200, "standard", 1.0, "")
    fields = record.to_fields()
    assert "parts" not in fields
    assert UsageRecord.from_fields(fields) == record
    assert UsageRecord.from_fields({**fields, "parts": "{not json"}) is None
