"""Gateway overhead: the same requests sent straight to a mock upstream and through one gateway process.

The mock (tests/mock_upstream.py, in its own process) answers 4-token completions at once; the gateway
(`loragate gateway`, its own process) enforces a policy whose limits never bind; the client (this process)
sends non-streamed completions at concurrency 1 and 10 and reports latency p50/p99 and the latency the
gateway adds, then what routing through a canary rollout (split, windows, rollback check) adds on top of
a plain base-model request, then the most requests/s one gateway process holds at concurrency 32.
Everything is on 127.0.0.1, bounded in count and time.

    python bench/gateway_overhead.py [--requests 400] [--json PATH]

`--json PATH` also writes the figures (milliseconds, requests/s) as one JSON object: `concurrency` (per c:
direct and gateway p50/p99 and what the gateway added), `rollout` and `throughput_c32_rps`.

Reference (docs/benchmarks.md, same machine kind): LiteLLM added 32 ms p50 at c=1 and ~300 ms at c=10, ~30 req/s.
Targets: <= 1 ms p50 added at c=1, <= 5 ms at c=10.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from loragate.launch import stop, wait_healthy  # noqa: E402
from loragate_common.stats import percentile as pct  # noqa: E402

KEY = "bench-key"
# One tenant (its key read from LORAGATE_BENCH_KEY) whose limits never bind; bench/affinity.py shares it.
BENCH_TENANT = """version: 1
tenants:
  - id: bench
    api_keys: ["env:LORAGATE_BENCH_KEY"]
    adapters: ["*"]
    limits: {requests_per_second: 1000000, burst: 1000000, tokens_per_minute: 1000000000}
"""
POLICY = (
    BENCH_TENANT
    + """rollouts:
  - name: canary
    variants: [{adapter: a1, weight: 90}, {adapter: a2, weight: 10}]
    override_header: X-Variant
    rollback: {max_error_rate: 0.05, max_ttft_p99_ms: 2000, min_requests: 100, window_s: 60}
admission: {max_inflight_per_upstream: 64, max_queue: 1024, queue_timeout_ms: 30000}
"""
)
MOCK = """
import sys, time
sys.path.insert(0, {tests!r})
from mock_upstream import MockUpstream
mock = MockUpstream().start()
mock.behavior.tokens = 4
mock.behavior.token_interval_s = 0.0
print(mock.url, flush=True)
while True:
    time.sleep(3600)
"""
BODY = {"model": "mock-base", "prompt": "The quick brown fox", "max_tokens": 4}


def start_mock(env: dict[str, str]) -> tuple[subprocess.Popen[bytes], str]:
    """tests/mock_upstream.py in a process of its own (4 tokens an answer, at once); the process and its URL."""
    mock = subprocess.Popen(
        [sys.executable, "-c", MOCK.format(tests=str(REPO / "tests"))], stdout=subprocess.PIPE, env=env
    )
    if mock.stdout is None:  # never: stdout=PIPE
        raise RuntimeError("the mock upstream's stdout is not a pipe")
    return mock, mock.stdout.readline().decode().strip()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def latencies(url: str, concurrency: int, total: int, headers: dict[str, str]) -> list[float]:
    """Send `total` completions with `concurrency` in flight; each one's latency in seconds."""
    out: list[float] = []
    remaining = total
    async with httpx.AsyncClient(
        base_url=url, headers=headers, timeout=30, limits=httpx.Limits(max_connections=concurrency)
    ) as client:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=BODY)
                out.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    figures: dict[str, Any] = {"requests": args.requests, "concurrency": []}
    env = {**os.environ, "LORAGATE_BENCH_KEY": KEY, "PYTHONPATH": str(REPO)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        mock, mock_url = start_mock(env)
        procs.append(mock)
        policy = Path(tempfile.mkdtemp()) / "policy.yaml"
        policy.write_text(POLICY)
        port = free_port()
        gateway = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loragate",
                "gateway",
                "--policy",
                str(policy),
                "--upstream",
                mock_url,
                "--port",
                str(port),
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=REPO,
        )
        procs.append(gateway)
        gateway_url = f"http://127.0.0.1:{port}"
        wait_healthy(mock_url, mock, timeout_s=60, name="the mock upstream")
        wait_healthy(gateway_url, gateway, timeout_s=60, name="the gateway")
        auth = {"Authorization": f"Bearer {KEY}"}
        asyncio.run(latencies(gateway_url, 4, 40, auth))  # warm both paths up
        asyncio.run(latencies(mock_url, 4, 40, {}))
        for c in (1, 10):
            direct = asyncio.run(latencies(mock_url, c, args.requests, {}))
            through = asyncio.run(latencies(gateway_url, c, args.requests, auth))
            print(
                f"c={c:2d}  direct p50 {1e3 * pct(direct, 0.5):6.2f} ms p99 {1e3 * pct(direct, 0.99):6.2f} ms"
                f"   gateway p50 {1e3 * pct(through, 0.5):6.2f} ms p99 {1e3 * pct(through, 0.99):6.2f} ms"
                f"   added p50 {1e3 * (pct(through, 0.5) - pct(direct, 0.5)):6.2f} ms"
                f" p99 {1e3 * (pct(through, 0.99) - pct(direct, 0.99)):6.2f} ms"
            )
            figures["concurrency"].append(
                {
                    "c": c,
                    "direct_p50_ms": 1e3 * pct(direct, 0.5),
                    "direct_p99_ms": 1e3 * pct(direct, 0.99),
                    "gateway_p50_ms": 1e3 * pct(through, 0.5),
                    "gateway_p99_ms": 1e3 * pct(through, 0.99),
                    "added_p50_ms": 1e3 * (pct(through, 0.5) - pct(direct, 0.5)),
                    "added_p99_ms": 1e3 * (pct(through, 0.99) - pct(direct, 0.99)),
                }
            )
        rollout = {**auth, "X-Adapter-ID": "canary", "X-User-ID": "user-42"}
        base = asyncio.run(latencies(gateway_url, 1, args.requests, auth))
        split = asyncio.run(latencies(gateway_url, 1, args.requests, rollout))
        print(
            f"c= 1  base p50 {1e3 * pct(base, 0.5):6.2f} ms   canary rollout p50 {1e3 * pct(split, 0.5):6.2f} ms"
            f"   rollout routing added p50 {1e3 * (pct(split, 0.5) - pct(base, 0.5)):6.2f} ms"
        )
        figures["rollout"] = {
            "base_p50_ms": 1e3 * pct(base, 0.5),
            "canary_p50_ms": 1e3 * pct(split, 0.5),
            "added_p50_ms": 1e3 * (pct(split, 0.5) - pct(base, 0.5)),
        }
        t0 = time.perf_counter()
        done = asyncio.run(latencies(gateway_url, 32, 4 * args.requests, auth))
        rps = len(done) / (time.perf_counter() - t0)
        print(f"throughput through one gateway process at c=32: {rps:.0f} req/s")
        figures["throughput_c32_rps"] = rps
        print("targets: added p50 <= 1 ms at c=1, <= 5 ms at c=10; LiteLLM: 32 ms / ~300 ms, ~30 req/s")
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
    finally:
        for p in procs:
            stop(p)


if __name__ == "__main__":
    main()
