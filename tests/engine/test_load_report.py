"""The engine's load report and per-adapter metrics end to end: real `loragate engine` processes on tiny-random
with PEFT adapters (tests/lora_fixtures.py), over HTTP.

- GET /load and the `X-Loragate-Load` header of every generation answer (whole, streamed, errors), which the
  gateway parses (gateway.admission.EngineLoad; the gateway is torch-free, importing it here is fine);
- `loragate_engine_adapter_*{adapter}`: token counters equal to the `usage` the clients were sent, requests
  running and waiting, device loads and evictions per adapter, residence, and the bounded `adapter` label
  (`--metrics-max-adapters`: the first N adapters seen keep their own, the rest count as "other").
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.admission import EngineLoad

from lora_fixtures import make_peft_adapter
from polling import poll
from processes import start_engine_server

MODEL = "tiny-random"  # also the base model's `adapter` label: its served name
MAX_MODEL_LEN = 1024  # tiny-random's whole context: a request of all of it decodes for about a second
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
ADAPTERS = ("a1", "a2", "a3", "a4")
HEADER = re.compile(r"running=(\d+), waiting=(\d+), pool=(\d\.\d\d)")
LOAD_FIELDS = {
    "running",
    "waiting",
    "kv_blocks_used",
    "kv_blocks_free",
    "pool_used",
    "device_adapters",
    "max_num_seqs",
    "max_device_adapters",
    "backends",
    "sampling_defaults",
    "prefixes",
}

Metrics = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Four adapters (copies of one PEFT LoRA: what they compute does not matter here)."""
    root = tmp_path_factory.mktemp("adapters")
    first = make_peft_adapter(tiny_model_dir, root / ADAPTERS[0], r=4, alpha=8, targets=["q_proj", "v_proj"], seed=1)
    for name in ADAPTERS[1:]:
        shutil.copytree(first, root / name)
    return root


@contextlib.contextmanager
def _engine(log: Path, adapter_root: Path, *extra: str) -> Iterator[str]:
    proc, base = start_engine_server(
        log, "--max-model-len", str(MAX_MODEL_LEN), "--adapter-dir", str(adapter_root), *extra, model=MODEL
    )
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine") / "engine.log"


@pytest.fixture(scope="module")
def server(server_log: Path, adapter_root: Path) -> Iterator[str]:
    """One request computed at a time: a second one waits, so a test can hold one running and one waiting."""
    with _engine(server_log, adapter_root, "--max-num-seqs", "1") as base:
        yield base


def _metrics(base: str) -> Metrics:
    text = httpx.get(f"{base}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _by_adapter(metrics: Metrics, name: str) -> dict[str, float]:
    """{adapter label: value} of one per-adapter series (no other label)."""
    return {dict(labels)["adapter"]: v for (n, labels), v in metrics.items() if n == name and len(labels) == 1}


def _load(base: str) -> dict[str, Any]:
    resp = httpx.get(f"{base}/load")
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert set(body) == LOAD_FIELDS
    return body


def _idle(base: str) -> dict[str, Any]:
    """/load once nothing runs or waits (a test before may have left an abort in flight)."""
    return poll(lambda: (body := _load(base))["running"] == body["waiting"] == 0 and body, what="idle engine")


def _post(base: str, path: str, body: dict[str, Any], adapter: str | None = None) -> httpx.Response:
    headers = {"X-Adapter-ID": adapter} if adapter is not None else {}
    return httpx.post(f"{base}{path}", json={"model": MODEL, **body}, headers=headers, timeout=60)


def _stream_usage(resp: httpx.Response) -> dict[str, int]:
    """The usage chunk of a stream read whole (stream_options.include_usage)."""
    events = [line.removeprefix("data: ") for line in resp.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def _request(base: str, kind: str, adapter: str | None, max_tokens: int) -> tuple[httpx.Response, dict[str, int]]:
    """One generation of `kind` (completion | chat | completion-stream | chat-stream); the answer and its usage."""
    path = "/v1/chat/completions" if kind.startswith("chat") else "/v1/completions"
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    body |= {"messages": CHAT} if kind.startswith("chat") else {"prompt": PROMPT}
    if kind.endswith("stream"):
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    resp = _post(base, path, body, adapter)
    assert resp.status_code == 200, resp.text
    return resp, _stream_usage(resp) if kind.endswith("stream") else resp.json()["usage"]


def _parsed(header: str | None) -> EngineLoad:
    assert header is not None and HEADER.fullmatch(header), header
    load = EngineLoad.parse(header, time.monotonic())  # what the gateway makes of it
    assert load is not None
    return load


# ---- GET /load ----------------------------------------------------------------------------------------


def test_load_when_idle_and_with_adapters_on_the_device(server: str) -> None:
    idle = _idle(server)
    assert (idle["kv_blocks_used"], idle["max_num_seqs"], idle["max_device_adapters"]) == (0, 1, 8)
    assert idle["kv_blocks_free"] > 0 and 0 <= idle["pool_used"] < 1
    for adapter in ("a2", "a1"):
        _request(server, "completion", adapter, 2)
    after = _idle(server)
    assert {"a1", "a2"} <= set(after["device_adapters"])
    assert after["device_adapters"] == sorted(after["device_adapters"])
    assert after["pool_used"] > 0  # the adapters' pages
    assert after["prefixes"] == []  # no request sent X-Loragate-Prefix: no hashes to report
    resp, _ = _request(server, "completion", None, 2)
    header = resp.headers.get("x-loragate-load")
    _parsed(header)
    assert abs(float(header.rpartition("pool=")[2]) - after["pool_used"]) <= 0.01


def test_load_names_the_backends_and_the_log_leaves_out_probes(server: str, server_log: Path) -> None:
    """GET /load shows the routes the engine chose at start (loragate_kernels/backends.py), the same the engine logged
    once; the access log lists generation requests but not /load, /readyz, /healthz or /metrics (--log-probes)."""
    from loragate_kernels.backends import Backends

    backends = _idle(server)["backends"]
    assert backends == Backends.resolve("cpu", "float32").describe()  # the test process sees the same machine
    for path in ("/load", "/readyz", "/healthz", "/metrics"):
        assert httpx.get(f"{server}{path}").status_code == 200
    _request(server, "completion", None, 1)
    log = server_log.read_text()
    assert log.count("backends: device=cpu dtype=float32") == 1
    assert re.search(r'"POST /v1/completions HTTP/1.1" 200', log)
    assert not re.search(r'"GET /(load|readyz|healthz|metrics) HTTP', log), log[-2000:]


def test_load_counts_running_and_waiting(server: str) -> None:
    _idle(server)
    long = {"prompt": [5, 6], "max_tokens": MAX_MODEL_LEN - 2, "ignore_eos": True, "stream": True, "model": MODEL}
    started: list[str | None] = []

    def second() -> None:  # waits behind the first (one sequence at a time), then starts once it is gone
        headers = {"X-Adapter-ID": "a1"}
        with httpx.stream("POST", f"{server}/v1/completions", json=long, headers=headers, timeout=60) as resp:
            started.append(resp.headers.get("x-loragate-load"))
            lines = resp.iter_lines()  # (kept: a line iterator closed early closes the connection)
            assert next(lines).startswith("data: ")

    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", f"{server}/v1/completions", json=long, timeout=60) as first:
            lines = first.iter_lines()
            assert next(lines).startswith("data: ")
            load = _parsed(first.headers.get("x-loragate-load"))
            assert (load.running, load.waiting) == (1, 0)
            waiter = pool.submit(second)

            def held() -> bool:
                load, metrics = _load(server), _metrics(server)
                running = _by_adapter(metrics, "loragate_engine_adapter_requests_running")
                waiting = _by_adapter(metrics, "loragate_engine_adapter_requests_waiting")
                return (load["running"], load["waiting"], running[MODEL], waiting.get("a1")) == (1, 1, 1, 1)

            poll(held, what="one request running (base) and one waiting (a1)")
            assert _load(server)["kv_blocks_used"] > 0
        waiter.result(timeout=60)  # the first left (aborted): the second ran
    load = _parsed(started[0])
    assert (load.running, load.waiting) == (1, 0)  # at its start: itself, nobody waiting
    _idle(server)


# ---- X-Loragate-Load --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat", "completion-stream", "chat-stream"])
def test_every_answer_carries_the_load(server: str, kind: str) -> None:
    _idle(server)
    resp, _ = _request(server, kind, "a1", 100)  # a stream's request still runs when its answer starts
    load = _parsed(resp.headers.get("x-loragate-load"))
    # A whole answer is sent once its request finished; a stream starts while its request runs.
    assert (load.running, load.waiting) == ((1, 0) if kind.endswith("stream") else (0, 0))


@pytest.mark.parametrize(
    ("body", "adapter", "status"),
    [({"prompt": PROMPT, "max_tokens": 0}, None, 400), ({"prompt": PROMPT, "max_tokens": 2}, "nope", 404)],
)
def test_error_answers_carry_the_load(server: str, body: dict[str, Any], adapter: str | None, status: int) -> None:
    _idle(server)
    resp = _post(server, "/v1/completions", body, adapter)
    assert resp.status_code == status
    load = _parsed(resp.headers.get("x-loragate-load"))
    assert (load.running, load.waiting) == (0, 0)
    # An unknown adapter takes no label of its own (else anyone could use them all up).
    assert "nope" not in _by_adapter(_metrics(server), "loragate_engine_adapter_requests_running")


# ---- per-adapter metrics ----------------------------------------------------------------------------


def _usage_delta(before: Metrics, after: Metrics, series: str) -> dict[str, float]:
    """{adapter label: increase} of one per-adapter series, for the labels that moved."""
    old, new = _by_adapter(before, series), _by_adapter(after, series)
    return {label: value - old.get(label, 0.0) for label, value in new.items() if value != old.get(label, 0.0)}


def test_token_counters_equal_the_usage_sent(server: str) -> None:
    _idle(server)
    before = _metrics(server)
    prompt: Counter[str] = Counter()
    completion: Counter[str] = Counter()
    plan = [
        ("completion", None, 3),
        ("chat-stream", None, 4),
        ("completion", "a1", 5),
        ("completion-stream", "a1", 2),
        ("chat", "a2", 6),
        ("completion-stream", "a2", 3),
    ]
    for kind, adapter, max_tokens in plan:
        _, usage = _request(server, kind, adapter, max_tokens)
        label = adapter or MODEL
        prompt[label] += usage["prompt_tokens"]
        completion[label] += usage["completion_tokens"]
    after = _metrics(server)
    assert _usage_delta(before, after, "loragate_engine_adapter_prompt_tokens_total") == prompt
    assert _usage_delta(before, after, "loragate_engine_adapter_generation_tokens_total") == completion
    assert sum(completion.values()) == sum(n for _, _, n in plan)  # ignore_eos: every max_tokens generated


def test_labels_are_bounded_and_device_loads_counted(
    tmp_path_factory: pytest.TempPathFactory, adapter_root: Path
) -> None:
    """One adapter on the device at a time, two with a label of their own: a1 and a2 (seen first) keep theirs,
    a3 and a4 count as "other", whose counters are the sums of theirs."""
    log = tmp_path_factory.mktemp("engine-bounded") / "engine.log"
    with _engine(log, adapter_root, "--max-device-adapters", "1", "--metrics-max-adapters", "2") as base:
        prompt: Counter[str] = Counter()
        completion: Counter[str] = Counter()
        for i, adapter in enumerate(["a1", "a2", "a1", "a2", "a3", None, "a4", "a3"]):
            _, usage = _request(base, "completion" if i % 2 else "chat-stream", adapter, 2 + i)
            label = MODEL if adapter is None else adapter if adapter in ("a1", "a2") else "other"
            prompt[label] += usage["prompt_tokens"]
            completion[label] += usage["completion_tokens"]
        metrics = _metrics(base)
        labels = {MODEL, "a1", "a2", "other"}
        assert _by_adapter(metrics, "loragate_engine_adapter_prompt_tokens_total") == prompt
        assert _by_adapter(metrics, "loragate_engine_adapter_generation_tokens_total") == completion
        assert set(prompt) == labels
        for gauge in ("requests_running", "requests_waiting"):
            assert _by_adapter(metrics, f"loragate_engine_adapter_{gauge}") == dict.fromkeys(labels, 0)
        # Every switch evicts the one resident adapter and loads the next: a1 a2 a1 a2 a3 a4 a3.
        loads = _by_adapter(metrics, "loragate_engine_adapter_loads_total")
        assert loads == {"a1": 2, "a2": 2, "other": 3}  # a3 twice, a4 once
        assert sum(loads.values()) == metrics[("loragate_engine_adapter_load_seconds_count", ())]
        assert _by_adapter(metrics, "loragate_engine_adapter_evictions_total") == {"a1": 2, "a2": 2, "other": 2}
        resident = {
            (dict(pairs)["adapter"], dict(pairs)["tier"]): value
            for (name, pairs), value in metrics.items()
            if name == "loragate_engine_adapter_resident"
        }
        # Only the labelled adapters; both were evicted to the host tier (a3 is on the device).
        assert resident == {
            (a, tier): float(tier == "host") for a in ("a1", "a2") for tier in ("device", "host", "disk")
        }
        assert _load(base)["device_adapters"] == ["a3"]
