"""The adapter fleet's whole journey while traffic flows, on real processes: a real S3 API (moto_server), a
Hub-shaped server read through huggingface_hub, two `loragate engine` processes that start with empty
adapter caches, one `loragate gateway`, and `loragate adapters register` (loragate/adapters_cli.py) run as an
operator runs it.

publish v1 to S3 and to the Hub -> each served on its first request -> served through a rollout name ->
publish v2 -> a progressive rollout v1 -> v2 with an SLO gate
-> promoted; then a broken v3 (its source is gone) -> the canary's failures are answered by the stable
variant (gateway/generate.py, fallback_call) and roll the rollout back. No client request fails at any
point, and every answer equals PEFT's greedy decoding of the version that served it.
"""

from __future__ import annotations

import contextlib
import io
import json
import secrets
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.model.sources import load_tokenizer
from loragate.cli import main as loragate_main

from adapter_servers import HubServer, MotoServer, moto_server_fixture
from lora_fixtures import make_peft_adapter, peft_greedy
from policies import ADMIN, ADMIN_KEY, bearer, policy_yaml, tenant_yaml
from polling import poll
from processes import start_engine_server, start_gateway, stop_process

KEY = "journey-key"
PROMPT = "The quick brown fox"
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
GATE = "{max_error_rate: 0.05, max_ttft_p99_ms: 60000, min_requests: 3, window_s: 2}"
BUCKET = "journey"

moto = moto_server_fixture()


def policy(rollout: str) -> str:
    return policy_yaml(tenant_yaml("acme", KEY, '["support*"]'), rollouts=rollout)


def single(variant: str) -> str:
    return f"""  - name: support-live
    sticky_key: header:X-User-ID
    variants: [{{adapter: {variant}, weight: 100}}]"""


def progressive(old: str, new: str) -> str:
    return f"""  - name: support-live
    sticky_key: header:X-User-ID
    variants: [{{adapter: {old}, weight: 1}}, {{adapter: {new}, weight: 1}}]
    steps: [25, 50, 100]
    hold_s: 2
    rollback: {GATE}"""


class Traffic:
    """Two clients sending the rollout's name with fresh user ids until stopped; every answer kept."""

    def __init__(self, gateway: str) -> None:
        self.gateway = gateway
        self.answers: list[tuple[int, str, str]] = []  # status, X-Loragate-Adapter, text (or the error body)
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def __enter__(self) -> Traffic:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=60)

    def _run(self) -> None:
        with httpx.Client(base_url=self.gateway, timeout=120) as client:
            while not self._stop.is_set():
                headers = {**bearer(KEY), "X-Adapter-ID": "support-live", "X-User-ID": uuid.uuid4().hex}
                resp = client.post("/v1/completions", json=BODY, headers=headers)
                text = resp.json()["choices"][0]["text"] if resp.status_code == 200 else resp.text
                self.answers.append((resp.status_code, resp.headers.get("x-loragate-adapter", ""), text))


@pytest.fixture(scope="module")
def versions(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, tuple[Path, str]]:
    """v1 and v2 of `support`, and the text PEFT's greedy decoding gives for each."""
    root = tmp_path_factory.mktemp("journey-adapters")
    tokenizer = load_tokenizer(tiny_model_dir)
    prompt_ids = tokenizer(PROMPT)["input_ids"]
    out = {}
    for name, targets, seed in (("v1", ["q_proj", "v_proj"], 21), ("v2", ["o_proj", "up_proj"], 24)):
        directory = make_peft_adapter(tiny_model_dir, root / name, r=8, alpha=16, targets=targets, seed=seed, b_std=0.5)
        text = tokenizer.decode(peft_greedy(tiny_model_dir, directory, prompt_ids, BODY["max_tokens"]))
        out[name] = (directory, text)
    assert out["v1"][1] != out["v2"][1]
    return out


@pytest.fixture
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


@pytest.fixture
def stack(tmp_path: Path, moto: MotoServer, hub: HubServer) -> Iterator[tuple[str, Path, list[str]]]:
    """Two engines with empty caches behind one gateway; the gateway's URL, its policy file, the engines."""
    procs = []
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**moto.env(), "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}.items():
            mp.setenv(key, value)
        engines = []
        for k in range(2):
            proc, url = start_engine_server(
                tmp_path / f"engine{k}.log",
                "--max-model-len",
                "256",
                "--adapter-cache-dir",
                str(tmp_path / f"cache{k}"),
                "--adapter-source-allow",
                f"s3://{BUCKET}/",
                "hf://org/",
                "--adapter-load-wait-s",
                "30",
            )
            procs.append(proc)
            engines.append(url)
    gateway_proc, gateway = start_gateway(tmp_path, "gateway", policy(single("support")), engines)
    procs.append(gateway_proc)
    try:
        yield gateway, tmp_path / "gateway.yaml", engines
    finally:
        for proc in reversed(procs):
            stop_process(proc)


def register(
    monkeypatch: pytest.MonkeyPatch, moto: MotoServer, gateway: str, source: str, *extra: str, name: str = "support"
) -> str:
    """`loragate adapters register NAME --source SOURCE --json` as an operator runs it; the new ID@N."""
    for key, value in {**moto.env(), "LORAGATE_URL": gateway, "LORAGATE_ADMIN_KEY": ADMIN_KEY}.items():
        monkeypatch.setenv(key, value)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        status = loragate_main(["adapters", "register", name, "--source", source, *extra, "--json"])
    assert status == 0, buffer.getvalue()
    answer: dict[str, Any] = json.loads(buffer.getvalue())
    return str(answer["ref"])


def reload(gateway: str, policy_file: Path, text: str) -> None:
    policy_file.write_text(text)
    resp = httpx.post(f"{gateway}/admin/reload", headers=ADMIN, timeout=30)
    assert resp.status_code == 200, resp.text


def rollout_state(gateway: str) -> dict[str, Any]:
    described = httpx.get(f"{gateway}/admin/policy", headers=ADMIN, timeout=10).json()
    return next(r for r in described["rollouts"] if r["name"] == "support-live")


def test_publish_roll_out_promote_then_roll_back_a_broken_version_without_a_failed_request(
    stack: tuple[str, Path, list[str]],
    versions: dict[str, tuple[Path, str]],
    moto: MotoServer,
    hub: HubServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gateway, policy_file, engines = stack
    (v1_dir, v1_text), (v2_dir, v2_text) = versions["v1"], versions["v2"]
    assert register(monkeypatch, moto, gateway, moto.put_adapter(BUCKET, "support/v1", v1_dir)) == "support@1"
    # An adapter published to the Hub (`huggingface-cli upload org/support ...`): registered by name and pinned to
    # its commit, fetched on its first request through huggingface_hub, served with PEFT's output. Its bytes are
    # v2's, which no engine holds yet: an engine's disk cache is keyed by digest, so v1's bytes from S3 could
    # already be there and need no download from the Hub.
    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    commit = hub.add_repo("org/support", v2_dir)
    assert register(monkeypatch, moto, gateway, "hf://org/support", name="support-hub") == "support-hub@1"
    for adapter, text in (("support", v1_text), ("support-hub", v2_text)):  # first requests: no engine holds them
        headers = {**bearer(KEY), "X-Adapter-ID": adapter}
        resp = httpx.post(f"{gateway}/v1/completions", json=BODY, headers=headers, timeout=120)
        assert resp.status_code == 200, resp.text
        assert (resp.headers["X-Loragate-Adapter"], resp.json()["choices"][0]["text"]) == (f"{adapter}@1", text)
    shown = httpx.get(f"{gateway}/admin/adapters/support-hub", headers=ADMIN, timeout=10).json()
    assert shown["versions"][0]["source"] == f"hf://org/support@{commit}"
    assert hub.count("/org/support/resolve/*/adapter_model.safetensors") == 2  # the CLI's digest, one engine
    reload(gateway, policy_file, policy(single("support@1")))
    with Traffic(gateway) as traffic:
        poll(lambda: len(traffic.answers) >= 5, 120, what="first answers through the rollout name")
        # Publish v2 and roll it out progressively while the traffic flows.
        assert register(monkeypatch, moto, gateway, moto.put_adapter(BUCKET, "support/v2", v2_dir)) == "support@2"
        reload(gateway, policy_file, policy(progressive("support@1", "support@2")))
        poll(lambda: rollout_state(gateway)["control"]["status"] == "promoted", 180, what="v2 promoted")
        promoted_at = len(traffic.answers)
        poll(lambda: len(traffic.answers) >= promoted_at + 6, 60, what="answers after the promotion")
    answers = traffic.answers
    assert [a for a in answers if a[0] != 200] == []  # not one failed request
    assert {text for _, served, text in answers if served == "support@1"} == {v1_text}
    assert {text for _, served, text in answers if served == "support@2"} == {v2_text}
    assert {served for _, served, _ in answers[promoted_at + 2 :]} == {"support@2"}
    assert rollout_state(gateway)["rolled_back"] is None

    # A broken v3: registered with a digest, but its source is gone. The canary fails at the engine (502
    # adapter_fetch_failed); the stable variant answers each of those requests, and the gate rolls back.
    missing = f"s3://{BUCKET}/support/v3-deleted/"
    assert register(monkeypatch, moto, gateway, missing, "--sha256", secrets.token_hex(32)) == "support@3"
    reload(gateway, policy_file, policy(progressive("support@2", "support@3")))
    with Traffic(gateway) as traffic:
        poll(lambda: rollout_state(gateway)["rolled_back"] is not None, 180, what="v3 rolled back")
        rolled_back_at = len(traffic.answers)
        poll(lambda: len(traffic.answers) >= rolled_back_at + 6, 60, what="answers after the rollback")
    answers = traffic.answers
    assert [a for a in answers if a[0] != 200] == []
    assert {(served, text) for _, served, text in answers} == {("support@2", v2_text)}
    state = rollout_state(gateway)
    assert state["rolled_back"]["reason"] == "error_rate", state
    canary = next(v for v in state["variants"] if v["adapter"] == "support@3")
    assert canary["window"]["errors"] >= 1

    # Where each version is, as the operator sees it: v3 failed on the engine that tried it, with the reason.
    shown = httpx.get(f"{gateway}/admin/adapters/support", headers=ADMIN, timeout=10).json()
    by_version = {v["version"]: v["engines"] for v in shown["versions"]}
    failed = [e for e in by_version[3].values() if e["state"] == "failed"]
    assert failed and "no adapter_config.json" in failed[0]["error"], by_version
    assert any(e["state"] in ("disk", "host", "device") for e in by_version[2].values())
    # Deleting a version unloads it from the engines at once.
    assert any("support@1" in {c["id"] for c in _cards(url)} for url in engines)
    assert httpx.delete(f"{gateway}/admin/adapters/support@1", headers=ADMIN, timeout=10).status_code == 200
    assert all("support@1" not in {c["id"] for c in _cards(url)} for url in engines)


def _cards(engine: str) -> list[dict[str, Any]]:
    return httpx.get(f"{engine}/v1/adapters", timeout=10).json()["data"]
