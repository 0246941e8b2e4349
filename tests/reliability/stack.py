"""The fault suite's stack: real `loragate engine` (tiny-random) and `loragate gateway` processes and a real
Redis on 127.0.0.1, the policy they run, and what the tests read back (metrics, admin state).

Tenants (API key = "<id>-key"):  acme may use acme-* (and the rollout acme-support), up to critical;
globex may use globex-*; initech may use everything, at sheddable at most and at 50 requests per second.
Adapters on every engine: acme-a, acme-b, globex-a (real PEFT LoRAs that change the output), acme-bad
(NaN weights: the header is fine, the data is not) and broken (not a safetensors file: skipped at start).

`LORAGATE_SOAK=N` multiplies the counts and durations of the scenarios (`make soak` sets it).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import load_file, save_file

from gateway.auth import hash_key

from lora_fixtures import make_peft_adapter, peft_greedy
from polling import poll
from processes import free_port, start_engine_server, start_gateway, stop_process
from redis_server import RedisServer

SCALE = max(1, int(os.environ.get("LORAGATE_SOAK", "1")))
ADMIN_KEY = "admin-secret"
TENANTS = ("acme", "globex", "initech")
PROMPT = "The quick brown fox"
NEW_TOKENS = 16
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS, "ignore_eos": True}
GOOD_ADAPTERS = ("acme-a", "acme-b", "globex-a")
MAX_MODEL_LEN = 1024
# Every X-Loragate-Reason a 429 or 503 may carry.
REASONS = frozenset(
    {
        "rate_limited",
        "tokens_exhausted",
        "budget_exhausted",
        "queue_full",
        "queue_timeout",
        "circuit_open",
        "no_upstream",
        "draining",
        "ratelimit_unavailable",
        "upstream_unavailable",
        "adapter_loading",
        "adapter_fetch_failed",
    }
)


def key(tenant: str) -> str:
    return f"{tenant}-key"


def auth(tenant: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key(tenant)}"}


ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


UNLIMITED = "{requests_per_second: 1000, burst: 1000, tokens_per_minute: 100000000}"


def policy_yaml(
    *,
    on_redis_error: str = "open",
    max_inflight: int = 4,
    max_queue: int = 8,
    queue_timeout_ms: int = 20000,
    acme_limits: str = UNLIMITED,
    open_seconds: float = 2,
) -> str:
    return f"""
version: 1
admin_keys: ["{hash_key(ADMIN_KEY)}"]
defaults:
  limits: {{requests_per_second: 1000, burst: 1000, tokens_per_minute: 100000000}}
tenants:
  - id: acme
    api_keys: ["{hash_key(key("acme"))}"]
    adapters: ["acme-*"]
    max_priority: critical
    limits: {acme_limits}
  - id: globex
    api_keys: ["{hash_key(key("globex"))}"]
    adapters: ["globex-*"]
  - id: initech
    api_keys: ["{hash_key(key("initech"))}"]
    adapters: ["*"]
    max_priority: sheddable
    limits: {{requests_per_second: 50, burst: 50, tokens_per_minute: 100000000}}
rollouts:
  - name: acme-support
    sticky_key: header:X-User-ID
    variants: [{{adapter: acme-a, weight: 50}}, {{adapter: acme-b, weight: 50}}]
    override_header: X-Variant
ratelimit: {{on_redis_error: {on_redis_error}}}
admission: {{max_inflight_per_upstream: {max_inflight}, max_queue: {max_queue}, queue_timeout_ms: {queue_timeout_ms}}}
breaker: {{failure_threshold: 2, open_seconds: {open_seconds}, half_open_probes: 1}}
"""


def build_adapters(base_dir: Path, root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for seed, name in enumerate(GOOD_ADAPTERS):
        make_peft_adapter(base_dir, root / name, r=4, alpha=8, targets="all-linear", seed=seed + 1, b_std=0.3)
    shutil.copytree(root / "acme-a", root / "acme-bad")
    weights = root / "acme-bad" / "adapter_model.safetensors"
    tensors = {
        k: torch.full_like(v, float("nan")) if ".lora_B." in k else v for k, v in load_file(str(weights)).items()
    }
    save_file(tensors, str(weights), metadata={"format": "pt"})
    shutil.copytree(root / "acme-a", root / "broken")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"\x00not safetensors" * 64)
    return root


def reference_texts(base_dir: Path, adapter_root: Path) -> dict[str | None, str]:
    """PEFT's greedy text of PROMPT for the base model and each good adapter (the tokens decoded)."""
    from engine.model.sources import load_tokenizer

    tokenizer = load_tokenizer(base_dir)
    ids = tokenizer(PROMPT)["input_ids"]
    return {
        name: tokenizer.decode(peft_greedy(base_dir, None if name is None else adapter_root / name, ids, NEW_TOKENS))
        for name in (None, *GOOD_ADAPTERS)
    }


def metrics(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def metric(url: str, name: str, **labels: str) -> float:
    return metrics(url).get((name, tuple(sorted(labels.items()))), 0.0)


@dataclass
class Engine:
    log: Path
    port: int
    args: tuple[str, ...]
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc, _ = start_engine_server(self.log, *self.args, port=self.port)

    def kill(self) -> None:
        """SIGKILL: no drain, connections cut mid-answer."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)
            self.proc = None


@dataclass
class Stack:
    """Engines, one gateway in front of them, and optionally a Redis they share limits through."""

    tmp: Path
    adapter_dir: Path
    num_engines: int = 2
    redis: RedisServer | None = None
    policy: str = field(default_factory=policy_yaml)
    gateway_args: tuple[str, ...] = ()
    engines: list[Engine] = field(default_factory=list)
    gateway_proc: subprocess.Popen[bytes] | None = None
    url: str = ""

    @property
    def policy_path(self) -> Path:
        return self.tmp / "gateway.yaml"

    def start(self) -> Stack:
        engine_args = (
            "--adapter-dir",
            str(self.adapter_dir),
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--max-device-adapters",
            "4",
        )
        for i in range(self.num_engines):
            engine = Engine(self.tmp / f"engine{i}.log", free_port(), engine_args)
            engine.start()
            self.engines.append(engine)
        args = list(self.gateway_args)
        if self.redis is not None:
            args += ["--redis", self.redis.url]
        self.gateway_proc, self.url = start_gateway(
            self.tmp, "gateway", self.policy, [e.url for e in self.engines], *args
        )
        return self

    def stop(self) -> None:
        if self.gateway_proc is not None:
            stop_process(self.gateway_proc)
        for engine in self.engines:
            engine.stop()

    def admin_policy(self) -> dict[str, Any]:
        resp = httpx.get(f"{self.url}/admin/policy", headers=ADMIN, timeout=30)
        resp.raise_for_status()
        return resp.json()

    def breakers(self) -> dict[str, str]:
        return {u["url"]: u["breaker"] for u in self.admin_policy()["routing"]["upstreams"]}

    def reload(self, policy: str) -> httpx.Response:
        self.policy_path.write_text(policy)
        return httpx.post(f"{self.url}/admin/reload", headers=ADMIN, timeout=30)

    def wait_idle(self, timeout_s: float = 30.0) -> None:
        """Until no engine holds a running or waiting request, and their KV blocks are free again."""
        gauges = (
            "loragate_engine_requests_running",
            "loragate_engine_requests_waiting",
            "loragate_engine_kv_blocks_used",
        )

        def busy() -> list[tuple[str, str]]:
            return [(e.url, name) for e in self.engines if e.proc is not None for name in gauges if metric(e.url, name)]

        poll(lambda: not busy(), timeout_s, interval_s=0.1, what="engines idle")
