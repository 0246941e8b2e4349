"""Redis faults under a gateway: how soon service resumes once Redis answers again, and what a frozen Redis
costs compared with a dead one.

A real redis-server (its own temp dir, no persistence), a mock engine (tests/mock_upstream.py, its own process) and one
`loragate gateway --redis` process in front of it, all on 127.0.0.1. For each `ratelimit.on_redis_error`
mode, a steady stream of completions (`--rate` a second, each sent on time whatever the others do) runs
while Redis is killed then started again on its port, and while it is frozen (SIGSTOP) then thawed
(SIGCONT), `--hold` seconds each. Reported per fault and mode, medians of `--runs`:

- recovery: from Redis answering this script's PING again to the end of the first request sent after
  that and served with Redis's word: a 200 failing closed; failing open (everything is 200), a 200 whose
  RateLimit-Remaining came from Redis (below the limit: admitted without Redis, it is the full limit);
- after: the requests sent after Redis answered that were still served without it (503
  `ratelimit_unavailable` failing closed, admitted unlimited failing open).

Then throughput, failing open: 8 closed-loop clients for `--fault-s` seconds with Redis killed, then with
it frozen; the ratio frozen/killed per run, and its median.

    python bench/redis_recovery.py [--runs 3] [--rate 100] [--hold 3] [--fault-s 5] [--json PATH]
        [--redis-client FILE]

`--redis-client FILE` runs the gateway with FILE as its gateway/redis_client.py, to measure another
version of the breaker against this one, e.g. the last committed one:
`git show HEAD:gateway/redis_client.py > /tmp/redis_client_head.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gateway_overhead import start_mock  # noqa: E402
from loragate.launch import stop, wait_healthy  # noqa: E402

KEY = "bench-key"
LIMIT = 1000  # requests_per_second and burst: never binding at the rates used here
POLICY = """version: 1
tenants:
  - id: bench
    api_keys: ["env:LORAGATE_BENCH_KEY"]
    adapters: ["*"]
    limits: {{requests_per_second: {limit}, burst: {limit}, tokens_per_minute: 1000000000}}
admission: {{max_inflight_per_upstream: 64, max_queue: 1024, queue_timeout_ms: 30000}}
ratelimit: {{on_redis_error: {mode}}}
"""
# `loragate gateway` with FILE loaded as gateway/redis_client.py (a version without `stop_probes` gets a
# no-op one: gateway/app.py calls it at shutdown).
WITH_REDIS_CLIENT = """
import importlib.util, sys
import gateway
spec = importlib.util.spec_from_file_location("gateway.redis_client", {path!r})
module = importlib.util.module_from_spec(spec)
sys.modules["gateway.redis_client"] = module
spec.loader.exec_module(module)
gateway.redis_client = module
if not hasattr(module, "stop_probes"):
    async def stop_probes(breakers):
        pass
    module.stop_probes = stop_probes
from loragate.cli import main
raise SystemExit(main())
"""
BODY = {"model": "mock-base", "prompt": "The quick brown fox", "max_tokens": 4}
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENTS = 8  # closed-loop clients of the throughput runs


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def ping(port: int) -> bool:
    """True when the Redis on 127.0.0.1:port answers PING (raw RESP)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A throwaway redis-server on 127.0.0.1 (as tests/redis_server.py runs them): killed and started again
    on its port, frozen (SIGSTOP) and thawed."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start it (again, on the same port); returns once it answers PING."""
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        argv = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        argv += ["--dir", str(self.dir), "--logfile", str(self.dir / "redis.log"), "--daemonize", "no"]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not come up on port {self.port}: see {self.dir / 'redis.log'}")
            time.sleep(0.005)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Kill it (SIGTERM; a frozen one is thawed first) and wait until it is gone."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGCONT)
        stop(self.proc, grace_s=5)
        self.proc = None


def answering_at(port: int) -> float:
    """Polls Redis with PING until it answers; when it did (monotonic)."""
    while not ping(port):
        time.sleep(0.001)
    return time.monotonic()


def restart(redis: RedisServer) -> float:
    """Start a killed Redis again on its port; when it first answered a PING."""
    with ThreadPoolExecutor(1) as pool:
        answered = pool.submit(answering_at, redis.port)
        redis.start()
        return answered.result()


def thaw(redis: RedisServer) -> float:
    redis.resume()
    return answering_at(redis.port)


def breaker_open(url: str) -> bool:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("loragate_gateway_redis_breaker_open "):
            return float(line.split()[1]) == 1
    raise RuntimeError("no loragate_gateway_redis_breaker_open in /metrics")


def wait_closed(url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while breaker_open(url):
        if time.monotonic() > deadline:
            raise RuntimeError(f"the gateway's Redis breaker still open after {timeout_s:g} s")
        time.sleep(0.05)


async def fault_run(url: str, redis: RedisServer, fault: str, mode: str, rate: float, hold_s: float) -> dict[str, Any]:
    """One fault under a steady stream: (sent, done, status, RateLimit-Remaining) per request, and when
    Redis answered again; reduced to the recovery and the requests served without Redis after it."""
    samples: list[tuple[float, float, int, int]] = []
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=256)) as client:

        async def one() -> None:
            sent = time.monotonic()
            try:
                answer = await client.post("/v1/completions", json=BODY, headers=AUTH)
            except httpx.HTTPError:
                samples.append((sent, time.monotonic(), 0, -1))
                return
            remaining = int(answer.headers.get("ratelimit-remaining", "-1"))
            samples.append((sent, time.monotonic(), answer.status_code, remaining))

        async def drive() -> None:
            pending: set[asyncio.Task[None]] = set()
            due = loop.time()
            while not stopping.is_set():
                task = asyncio.create_task(one())
                pending.add(task)
                task.add_done_callback(pending.discard)
                due += 1 / rate
                await asyncio.sleep(max(0.0, due - loop.time()))
            await asyncio.gather(*pending)

        driver = asyncio.create_task(drive())
        await asyncio.sleep(1.0)
        await asyncio.to_thread(redis.stop if fault == "killed" else redis.pause)
        await asyncio.sleep(hold_s)
        answered = await asyncio.to_thread(restart if fault == "killed" else thaw, redis)
        await asyncio.sleep(3.0)
        stopping.set()
        await driver

    after = sorted(s for s in samples if s[0] >= answered)

    def with_redis(sample: tuple[float, float, int, int]) -> bool:
        status, remaining = sample[2], sample[3]
        return status == 200 and (mode == "closed" or 0 <= remaining < LIMIT)

    served = [s for s in after if with_redis(s)]
    return {
        "recovery_s": (served[0][1] - answered) if served else None,
        "without_redis_after": sum(1 for s in after if not with_redis(s)),
        "sent_after": len(after),
        "errors": sum(1 for s in samples if s[2] not in (200, 503)),
    }


async def served_in(url: str, seconds: float) -> int:
    """200s that CLIENTS closed-loop clients get within `seconds`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    served = 0
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=httpx.Limits(max_connections=CLIENTS)) as client:

        async def worker() -> None:
            nonlocal served
            while loop.time() < deadline:
                answer = await client.post("/v1/completions", json=BODY, headers=AUTH)
                served += answer.status_code == 200 and loop.time() <= deadline

        await asyncio.gather(*(worker() for _ in range(CLIENTS)))
    return served


def start_gateway(
    mode: str, mock_url: str, redis: RedisServer, env: dict[str, str], workdir: Path, redis_client: Path | None
) -> tuple[subprocess.Popen[bytes], str]:
    policy = workdir / f"policy-{mode}.yaml"
    policy.write_text(POLICY.format(limit=LIMIT, mode=mode))
    port = free_port()
    head = [sys.executable, "-c", WITH_REDIS_CLIENT.format(path=str(redis_client))] if redis_client else None
    argv = [*(head or [sys.executable, "-m", "loragate"]), "gateway", "--policy", str(policy)]
    argv += ["--upstream", mock_url, "--redis", redis.url, "--port", str(port), "--log-level", "error"]
    proc = subprocess.Popen(argv, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout_s=60, name="the gateway")
    return proc, url


def median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rate", type=float, default=100.0, help="requests a second of the steady stream")
    ap.add_argument("--hold", type=float, default=3.0, help="seconds Redis stays out in the recovery runs")
    ap.add_argument("--fault-s", type=float, default=5.0, help="seconds of each throughput run")
    ap.add_argument("--redis-client", type=Path, help="run the gateway with this file as gateway/redis_client.py")
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    env = {**os.environ, "LORAGATE_BENCH_KEY": KEY, "PYTHONPATH": str(REPO)}
    workdir = Path(tempfile.mkdtemp(prefix="loragate-redis-recovery-"))
    figures: dict[str, Any] = {
        "redis_client": str(args.redis_client) if args.redis_client else "gateway/redis_client.py",
        "runs": args.runs,
        "rate": args.rate,
        "hold_s": args.hold,
        "recovery": {},
    }
    redis = RedisServer(workdir / "redis")
    redis.start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        mock, mock_url = start_mock(env)
        procs.append(mock)
        wait_healthy(mock_url, mock, timeout_s=60, name="the mock upstream")
        print(f"gateway/redis_client.py: {figures['redis_client']}; {args.runs} runs, {args.rate:g} requests/s")
        for mode in ("open", "closed"):
            gateway, url = start_gateway(mode, mock_url, redis, env, workdir, args.redis_client)
            try:
                asyncio.run(served_in(url, 1.0))  # warm: connections, the script cache
                for fault in ("killed", "frozen"):
                    runs = []
                    for _ in range(args.runs):
                        wait_closed(url)
                        runs.append(asyncio.run(fault_run(url, redis, fault, mode, args.rate, args.hold)))
                    recovery = median([r["recovery_s"] for r in runs])
                    without = median([r["without_redis_after"] for r in runs])
                    figures["recovery"][f"{mode}/{fault}"] = {
                        "recovery_s_median": recovery,
                        "without_redis_after_median": without,
                        "runs": runs,
                    }
                    shown = "never" if recovery is None else f"{1e3 * recovery:7.0f} ms"
                    refused = "503" if mode == "closed" else "unlimited"
                    print(
                        f"on_redis_error: {mode:6s} {fault:6s}: first request served with Redis {shown} after it"
                        f" answered; {without:g} {refused} after it (medians; each run: "
                        + ", ".join(
                            f"{'-' if r['recovery_s'] is None else round(1e3 * r['recovery_s'])} ms"
                            f"/{r['without_redis_after']}"
                            for r in runs
                        )
                        + ")"
                    )
                if mode == "open":
                    pairs = []
                    for _ in range(args.runs):
                        wait_closed(url)
                        redis.stop()
                        killed = asyncio.run(served_in(url, args.fault_s))
                        redis.start()
                        wait_closed(url)
                        redis.pause()
                        try:
                            frozen = asyncio.run(served_in(url, args.fault_s))
                        finally:
                            redis.resume()
                        pairs.append((killed, frozen))
                    ratios = [frozen / killed for killed, frozen in pairs]
                    figures["throughput"] = {"pairs": pairs, "ratio_median": statistics.median(ratios)}
                    print(
                        f"throughput failing open, {CLIENTS} clients, {args.fault_s:g} s: (killed, frozen) {pairs};"
                        f" frozen/killed median {statistics.median(ratios):.2f}"
                    )
                wait_closed(url)  # what the gateway kept locally reaches Redis before it stops
            finally:
                stop(gateway)
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
    finally:
        for p in procs:
            stop(p)
        redis.stop()


if __name__ == "__main__":
    main()
