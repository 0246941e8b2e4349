"""Routing on the engines' reported load vs on each gateway's own counts: two gateways, two engines.

Two `loragate engine` processes (SmolLM2 fp32, one thread each, a device tier of --tier adapters each,
--adapters ids over the W1 weight sets of bench/throughput.py) sit behind two `loragate gateway` replicas,
both in front of both engines, as in a Kubernetes deployment. The same Zipf-distributed stream of adapter
requests (bounded: --requests, --concurrency in flight per gateway, --new-tokens each, streamed, all on
127.0.0.1) is split between the two gateways, twice, with fresh engines and gateways each time:

- `load_source: local` (the baseline, run first): each gateway knows only its own requests in flight, so
  adapter affinity sends each adapter to its preferred engine until `spill_inflight` of *this* gateway's
  requests are there, however many the other gateway has sent;
- `load_source: engine` (the default): the gateways route on what the engines report (their running and
  waiting requests, from every gateway), with the bounded-load rule (`balance_factor`).

Reported per run: the share of generated tokens the busier engine did, adapter device loads (misses) and
evictions summed over both engines, wall time, requests/s, and the p50 / p99 time to first token; then
engine / local ratios. Targets (the issue): the busier engine at most 60% of the work, device loads at
most 1.2x the baseline's.

    python bench/load_routing.py [--requests 160] [--concurrency 6] [--adapters 16] [--tier 8] [--new-tokens 16]
                                 [--rounds 1] [--per-adapter] [--json PATH]

`--per-adapter` also prints, after each run, every adapter's generated tokens and device loads on each engine
(where the loads came from: an adapter placed on an engine whose device it does not fit, or a hot one copied).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.affinity import engine_counts, start_engine, zipf_workload  # noqa: E402
from bench.gateway_overhead import BENCH_TENANT, KEY, free_port  # noqa: E402
from loragate.launch import stop, wait_healthy  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

ADMISSION = """admission: {{max_inflight_per_upstream: 16, max_queue: 1024, queue_timeout_ms: 600000,
             spill_inflight: 12, load_source: {source}}}
"""


async def drive(
    gateways: list[str], adapters: list[str], prompts: list[str], concurrency: int, tokens: int
) -> list[float]:
    """Request i for adapters[i] through gateways[i % 2], `concurrency` in flight per gateway, streamed;
    each request's time to first token in seconds."""
    ttfts: list[float] = []
    headers = {"Authorization": f"Bearer {KEY}"}
    queues = [[(i, a) for i, a in enumerate(adapters) if i % len(gateways) == g] for g in range(len(gateways))]

    async def worker(client: httpx.AsyncClient, todo: list[tuple[int, str]]) -> None:
        while todo:
            i, adapter = todo.pop(0)
            body = {"prompt": prompts[i % len(prompts)], "max_tokens": tokens, "min_tokens": tokens, "stream": True}
            t0 = time.perf_counter()
            first = None
            async with client.stream("POST", "/v1/completions", json=body, headers={"X-Adapter-ID": adapter}) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: {"):
                        first = time.perf_counter() - t0
            ttfts.append(first if first is not None else time.perf_counter() - t0)

    clients = [httpx.AsyncClient(base_url=url, headers=headers, timeout=600) for url in gateways]
    try:
        await asyncio.gather(*(worker(c, q) for c, q in zip(clients, queues, strict=True) for _ in range(concurrency)))
    finally:
        for c in clients:
            await c.aclose()
    return ttfts


def per_adapter(urls: list[str], name: str) -> dict[str, list[float]]:
    """A per-adapter counter (`loragate_engine_adapter_<name>_total{adapter}`) on each engine, by adapter."""
    out: dict[str, list[float]] = {}
    for k, url in enumerate(urls):
        text = httpx.get(f"{url}/metrics", timeout=10).text
        pattern = rf'^loragate_engine_adapter_{name}_total{{adapter="([^"]*)"}} ([0-9.e+-]+)$'
        for adapter, value in re.findall(pattern, text, re.MULTILINE):
            out.setdefault(adapter, [0.0] * len(urls))[k] += float(value)
    return out


def loragate(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "loragate", *args], env=env, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def start_gateways(
    policy: Path, engines: list[str], logs: Path, env: dict[str, str], redis_url: str | None = None, count: int = 2
) -> tuple[list[subprocess.Popen[bytes]], list[str]]:
    """`count` gateway replicas in front of every engine (sharing `redis_url`'s Redis if given): processes, urls."""
    procs, urls = [], []
    for k in range(count):
        port = free_port()
        argv = ["gateway", "--policy", str(policy), "--port", str(port), "--log-level", "warning"]
        argv += ["--redis", redis_url] if redis_url is not None else []
        for url in engines:
            argv += ["--upstream", url]
        procs.append(loragate(argv, logs / f"gateway{k}.log", env))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def run_once(
    source: str,
    args: argparse.Namespace,
    adapter_dir: Path,
    adapters: list[str],
    prompts: list[str],
    env: dict[str, str],
    engine_ports: list[int],
) -> dict[str, float]:
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp())
    try:
        engines = []
        for k, port in enumerate(engine_ports):
            procs.append(start_engine(adapter_dir, args.tier, port, logs / f"engine{k}.log", env))
            engines.append(f"http://127.0.0.1:{port}")
        policy = logs / "policy.yaml"
        policy.write_text(BENCH_TENANT + ADMISSION.format(source=source))
        gateway_procs, gateways = start_gateways(policy, engines, logs, env)
        procs += gateway_procs
        for url, proc in zip([*engines, *gateways], procs, strict=True):
            wait_healthy(url, proc, timeout_s=300)
        loads0, evictions0, tokens0 = engine_counts(engines)
        t0 = time.perf_counter()
        ttfts = asyncio.run(drive(gateways, adapters, prompts, args.concurrency, args.new_tokens))
        wall = time.perf_counter() - t0
        loads, evictions, tokens = engine_counts(engines)
        work = [b - a for a, b in zip(tokens0, tokens, strict=True)]
        if args.per_adapter:
            by_adapter = per_adapter(engines, "loads")
            requests = per_adapter(engines, "generation_tokens")
            for adapter in sorted(requests, key=lambda a: -sum(requests[a])):
                print(
                    f"  {adapter:24} tokens {' / '.join(f'{t:5.0f}' for t in requests[adapter])}  device loads "
                    f"{' / '.join(f'{n:2.0f}' for n in by_adapter.get(adapter, [0.0] * len(engines)))}"
                )
        return {
            "busier_share": max(work) / max(sum(work), 1),
            "loads": loads - loads0,
            "evictions": evictions - evictions0,
            "wall": wall,
            "rps": len(ttfts) / wall,
            "ttft_p50": percentile(ttfts, 0.5),
            "ttft_p99": percentile(ttfts, 0.99),
        }
    finally:
        for p in reversed(procs):
            stop(p, grace_s=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=6, help="requests in flight per gateway")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--tier", type=int, default=8, help="each engine's --max-device-adapters")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (local, engine, local, ...)")
    ap.add_argument("--per-adapter", action="store_true", help="print each adapter's tokens and loads per engine")
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    adapter_dir, adapters, prompts = zipf_workload(args.adapters, args.requests)
    env = {**os.environ, "LORAGATE_BENCH_KEY": KEY, "PYTHONPATH": str(REPO)}
    print(
        f"{args.requests} requests over {len(set(adapters))} distinct adapters (Zipf s=1.1), 2 gateways x "
        f"{args.concurrency} in flight, 2 engines x (1 thread, device tier {args.tier}), {args.new_tokens} tokens each"
    )
    runs: dict[str, list[dict[str, float]]] = {"local": [], "engine": []}
    for _ in range(args.rounds):
        # Both runs of a round use the same engine URLs: rendezvous hashing ranks engines by URL, so the
        # same ports give both the same preferred engine for every adapter.
        engine_ports = [free_port(), free_port()]
        for source in ("local", "engine"):  # the baseline first in each round
            r = run_once(source, args, adapter_dir, adapters, prompts, env, engine_ports)
            runs[source].append(r)
            print(
                f"load_source {source:6}  busier engine {100 * r['busier_share']:3.0f}% of the tokens  adapter loads "
                f"{r['loads']:4.0f}  evictions {r['evictions']:4.0f}  {r['rps']:5.2f} req/s  TTFT p50 "
                f"{r['ttft_p50']:.2f} s  p99 {r['ttft_p99']:.2f} s",
                flush=True,
            )
    median = {s: {k: percentile([r[k] for r in rs], 0.5) for k in rs[0]} for s, rs in runs.items()}
    local, eng = median["local"], median["engine"]
    ratio = {
        "loads": eng["loads"] / max(local["loads"], 1),
        "throughput": eng["rps"] / local["rps"],
        "ttft_p99": eng["ttft_p99"] / local["ttft_p99"],
    }
    print(
        f"engine/local (medians of {args.rounds}): busier engine {100 * local['busier_share']:.0f}% -> "
        f"{100 * eng['busier_share']:.0f}% (target <= 60%), device loads {ratio['loads']:.2f}x (target <= 1.2x), "
        f"throughput {ratio['throughput']:.2f}x, TTFT p99 {ratio['ttft_p99']:.2f}x"
    )
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "config": vars(args) | {"json": str(args.json)},
                    "runs": runs,
                    "median": median,
                    "ratio_engine_local": ratio,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
