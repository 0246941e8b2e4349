"""Adapter affinity: device loads and throughput across two engine replicas, affinity on vs off.

Two `loragate engine` processes (SmolLM2 fp32, one thread each, a device tier of --tier adapters each,
--adapters ids over the W1 weight sets of bench/throughput.py) sit behind one `loragate gateway`. The same
Zipf-distributed stream of adapter requests (bounded: --requests, --concurrency in flight, 8 new tokens
each, all on 127.0.0.1) goes through the gateway twice, with fresh engines each time:

- affinity off (`admission.affinity: false`, the baseline, run first): every request to the least
  loaded replica;
- affinity on (the default): each adapter's requests go to its rendezvous-hashed replica until
  `spill_inflight` (--spill-inflight, default 12 of 16 as in the policy default) are in flight there.

Reported per run: adapter device loads (misses) and evictions summed over both engines (from their
/metrics), wall time, requests/s and latency p50; then the ratios affinity on / off.

    python bench/affinity.py [--requests 160] [--concurrency 8] [--adapters 16] [--tier 8] [--spill-inflight 12]
                             [--json PATH]

`--json PATH` also writes the figures as one JSON object: `config`, `off` and `on` (each run's `loads`,
`evictions`, `wall`, `rps`, `p50`, `share`) and `ratio_on_off` (`loads`, `evictions`, `throughput`).
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

from bench.gateway_overhead import BENCH_TENANT, KEY, free_port  # noqa: E402
from bench.throughput import make_w1_adapters, scale_adapter_dir, w1_prompts, zipf_choices  # noqa: E402
from engine.model.sources import cache_root, resolve_model  # noqa: E402
from loragate.launch import stop, wait_healthy  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

ADMISSION = """admission: {{max_inflight_per_upstream: 16, max_queue: 1024, queue_timeout_ms: 600000,
             affinity: {affinity}, spill_inflight: {spill}}}
"""


def metric(text: str, name: str) -> float:
    """The sum of a metric's samples over their labels (evictions are counted per adapter)."""
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.MULTILINE))


def engine_counts(urls: list[str]) -> tuple[float, float, list[float]]:
    """(adapter device loads, evictions) summed over the engines, and each engine's generated tokens."""
    loads = evictions = 0.0
    tokens = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        loads += metric(text, "loragate_engine_adapter_misses_total")
        evictions += metric(text, "loragate_engine_adapter_evictions_total")
        tokens.append(metric(text, "loragate_engine_generation_tokens_total"))
    return loads, evictions, tokens


def start_engine(adapter_dir: Path, tier: int, port: int, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """One SmolLM2 engine on one thread, with a device tier of `tier` adapters, serving `adapter_dir`."""
    argv = ["engine", "--model", "smollm2", "--threads", "1", "--adapter-dir", str(adapter_dir)]
    argv += ["--max-device-adapters", str(tier), "--port", str(port), "--log-level", "warning"]
    return subprocess.Popen(
        [sys.executable, "-m", "loragate", *argv], env=env, cwd=REPO, stdout=log.open("wb"), stderr=subprocess.STDOUT
    )


def zipf_workload(adapters: int, requests: int) -> tuple[Path, list[str], list[str]]:
    """`adapters` ids over the W1 weight sets (cached), a Zipf stream of `requests` of them, and the prompts."""
    root = cache_root() / "bench-adapters"
    weight_dirs = make_w1_adapters(resolve_model("smollm2").path, root / "w1")
    adapter_dir = scale_adapter_dir(weight_dirs, root, adapters)
    ids = sorted(p.name for p in adapter_dir.iterdir())
    return adapter_dir, [ids[k] for k in zipf_choices(len(ids), requests, seed=1)], w1_prompts(16)


async def drive(url: str, adapters: list[str], prompts: list[str], concurrency: int) -> list[float]:
    """Send request i for adapters[i] with `concurrency` in flight; each one's latency in seconds."""
    out: list[float] = []
    todo = list(enumerate(adapters))
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:

        async def worker() -> None:
            while todo:
                i, adapter = todo.pop(0)
                body = {"prompt": prompts[i % len(prompts)], "max_tokens": 8, "temperature": 0}
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=body, headers={"X-Adapter-ID": adapter})
                out.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def run_once(
    affinity: bool,
    adapter_dir: Path,
    adapters: list[str],
    prompts: list[str],
    concurrency: int,
    tier: int,
    spill: int,
    env: dict[str, str],
) -> dict[str, float]:
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp())
    try:
        engines = []
        for k in range(2):
            port = free_port()
            procs.append(start_engine(adapter_dir, tier, port, logs / f"engine{k}.log", env))
            engines.append(f"http://127.0.0.1:{port}")
        policy = logs / "policy.yaml"
        policy.write_text(BENCH_TENANT + ADMISSION.format(affinity="true" if affinity else "false", spill=spill))
        port = free_port()
        argv = [
            sys.executable,
            "-m",
            "loragate",
            "gateway",
            "--policy",
            str(policy),
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        for url in engines:
            argv += ["--upstream", url]
        procs.append(subprocess.Popen(argv, env=env, cwd=REPO))
        gateway = f"http://127.0.0.1:{port}"
        for url, proc in zip([*engines, gateway], procs, strict=True):
            wait_healthy(url, proc, timeout_s=300)
        loads0, evictions0, tokens0 = engine_counts(engines)
        t0 = time.perf_counter()
        latencies = asyncio.run(drive(gateway, adapters, prompts, concurrency))
        wall = time.perf_counter() - t0
        loads, evictions, tokens = engine_counts(engines)
        shares = [b - a for a, b in zip(tokens0, tokens, strict=True)]
        return {
            "loads": loads - loads0,
            "evictions": evictions - evictions0,
            "wall": wall,
            "rps": len(latencies) / wall,
            "p50": percentile(latencies, 0.5),
            "share": shares[0] / max(sum(shares), 1),
        }
    finally:
        for p in reversed(procs):
            stop(p, grace_s=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=160)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--adapters", type=int, default=16)
    ap.add_argument("--tier", type=int, default=8, help="each engine's --max-device-adapters")
    ap.add_argument("--spill-inflight", type=int, default=12, help="admission.spill_inflight (of 16)")
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    adapter_dir, adapters, prompts = zipf_workload(args.adapters, args.requests)
    env = {**os.environ, "LORAGATE_BENCH_KEY": KEY, "PYTHONPATH": str(REPO)}
    print(
        f"{args.requests} requests over {len(set(adapters))} distinct adapters (Zipf), {args.concurrency} in "
        f"flight, 2 engines x (1 thread, device tier {args.tier}), one gateway, spill_inflight {args.spill_inflight}"
    )
    results = {}
    for affinity in (False, True):  # the baseline first
        r = results[affinity] = run_once(
            affinity, adapter_dir, adapters, prompts, args.concurrency, args.tier, args.spill_inflight, env
        )
        print(
            f"affinity {'on ' if affinity else 'off'}  adapter loads {r['loads']:5.0f}  evictions "
            f"{r['evictions']:5.0f}  wall {r['wall']:6.1f} s  {r['rps']:5.2f} req/s  p50 {r['p50']:.2f} s  "
            f"engine 1 generated {100 * r['share']:.0f}% of the tokens"
        )
    on, off = results[True], results[False]
    ratio = {
        "loads": on["loads"] / max(off["loads"], 1),
        "evictions": on["evictions"] / max(off["evictions"], 1),
        "throughput": on["rps"] / off["rps"],
    }
    print(
        f"on/off: loads {ratio['loads']:.2f}x  evictions {ratio['evictions']:.2f}x  "
        f"throughput {ratio['throughput']:.2f}x"
    )
    if args.json:
        config = {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "adapters": args.adapters,
            "distinct": len(set(adapters)),
            "tier": args.tier,
            "spill_inflight": args.spill_inflight,
        }
        args.json.write_text(json.dumps({"config": config, "off": off, "on": on, "ratio_on_off": ratio}, indent=2))


if __name__ == "__main__":
    main()
