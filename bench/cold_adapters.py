"""Adapters fetched on first request vs pre-loaded on disk: cold TTFT, downloads, cache hits, throughput.

A real S3 API on 127.0.0.1 (`moto_server`, from moto[server]) holds --adapters published adapters (the W1
weight sets of bench/throughput.py; each adapter's adapter_config.json carries its own `revision`, so every
adapter has its own content digest and its own download). SmolLM2 fp32 engines (one thread each) run
behind one `loragate gateway` whose catalog names every adapter by its s3:// source
(gateway/adapter_catalog.py); the engines start with empty --adapter-cache-dir caches.

1. Cold vs warm TTFT: one engine; for --cold adapters, the first streamed request (the engine fetches it from
   the object store, registers it and computes it) and the second (served from its caches).
2. Zipf: --requests requests over the --adapters adapters (Zipf s=1.1), --concurrency in flight, across two
   engines with adapter affinity, run twice per round, interleaved: `disk` (the baseline: the same adapters
   in each engine's --adapter-dir, no catalog) and `fetched` (empty caches, the catalog). Reported:
   requests/s, p50/p99 TTFT, downloads per engine, cache hit rate (requests that needed no download), and
   fetched/disk throughput (target >= 0.9x).

    python bench/cold_adapters.py [--adapters 100] [--requests 400] [--concurrency 8] [--cold 5]
                                  [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.affinity import metric, zipf_workload  # noqa: E402
from bench.gateway_overhead import BENCH_TENANT, KEY, free_port  # noqa: E402
from bench.load_routing import loragate  # noqa: E402
from loragate.launch import stop, wait_healthy  # noqa: E402
from loragate_common.adapter_sources import ADAPTER_FILES, content_digest  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

ADMIN_KEY = "bench-admin-key"
BUCKET = "loragate-bench"
POLICY = (
    BENCH_TENANT
    + """admin_keys: ["env:LORAGATE_BENCH_ADMIN_KEY"]
admission: {max_inflight_per_upstream: 16, max_queue: 4096, queue_timeout_ms: 600000}
"""
)
MOTO_SERVER = Path(sys.executable).parent / "moto_server"


def published_adapters(scale_dir: Path, root: Path) -> dict[str, Path]:
    """A copy of each adapter of `scale_dir` whose config names its own revision: distinct digests."""
    out = {}
    for src in sorted(scale_dir.iterdir()):
        dest = root / src.name
        dest.mkdir(parents=True)
        config = json.loads((src / "adapter_config.json").read_text())
        config["revision"] = f"bench-{src.name}"
        (dest / "adapter_config.json").write_text(json.dumps(config))
        shutil.copyfile(src / "adapter_model.safetensors", dest / "adapter_model.safetensors")
        out[src.name] = dest
    return out


def start_moto(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(f"http://127.0.0.1:{port}/moto-api/", timeout=1)
            return proc
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError("moto_server did not start")


def upload(adapters: dict[str, Path], env: dict[str, str]) -> None:
    import boto3

    s3 = boto3.client(
        "s3",
        endpoint_url=env["AWS_ENDPOINT_URL"],
        region_name=env["AWS_DEFAULT_REGION"],
        aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
    )
    s3.create_bucket(Bucket=BUCKET)
    for name, directory in adapters.items():
        for file in ADAPTER_FILES:
            s3.put_object(Bucket=BUCKET, Key=f"adapters/{name}/{file}", Body=(directory / file).read_bytes())


class Stack:
    """Engines (fetching into empty caches, or serving --adapter-dir) behind one gateway."""

    def __init__(self, engines: int, adapter_dir: Path | None, env: dict[str, str], logs: Path) -> None:
        logs.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[bytes]] = []
        self.engines: list[str] = []
        for k in range(engines):
            port = free_port()
            argv = ["engine", "--model", "smollm2", "--threads", "1", "--port", str(port), "--log-level", "warning"]
            argv += ["--max-device-adapters", "8"]
            if adapter_dir is not None:
                argv += ["--adapter-dir", str(adapter_dir)]
            else:
                cache = Path(tempfile.mkdtemp(dir=logs, prefix=f"cache{k}-"))
                argv += ["--adapter-cache-dir", str(cache), "--adapter-source-allow", f"s3://{BUCKET}/adapters/"]
                argv += ["--adapter-load-wait-s", "120"]
            self.procs.append(loragate(argv, logs / f"engine{k}.log", env))
            self.engines.append(f"http://127.0.0.1:{port}")
        (logs / "policy.yaml").write_text(POLICY)
        port = free_port()
        argv = ["gateway", "--policy", str(logs / "policy.yaml"), "--port", str(port), "--log-level", "warning"]
        for url in self.engines:
            argv += ["--upstream", url]
        self.procs.append(loragate(argv, logs / "gateway.log", env))
        self.gateway = f"http://127.0.0.1:{port}"
        for url, proc in zip([*self.engines, self.gateway], self.procs, strict=True):
            wait_healthy(url, proc, timeout_s=300)

    def register(self, adapters: dict[str, Path]) -> None:
        headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
        for name, directory in adapters.items():
            body = {
                "id": name,
                "source": f"s3://{BUCKET}/adapters/{name}/",
                "sha256": content_digest(directory),
                "size": sum((directory / f).stat().st_size for f in ADAPTER_FILES),
            }
            resp = httpx.post(f"{self.gateway}/admin/adapters", json=body, headers=headers, timeout=30)
            assert resp.status_code in (200, 201), resp.text

    def downloads(self) -> list[float]:
        return [
            metric(httpx.get(f"{u}/metrics", timeout=10).text, "loragate_engine_adapter_downloads_total")
            for u in self.engines
        ]

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc, grace_s=60)


async def ttft(client: httpx.AsyncClient, adapter: str, prompt: str, new_tokens: int) -> float:
    """Seconds from sending a streamed request to its first token."""
    body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/completions", json=body, headers={"X-Adapter-ID": adapter}) as resp:
        assert resp.status_code == 200, (await resp.aread()).decode()
        first = None
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    assert first is not None
    return first


async def drive(url: str, stream: list[str], prompts: list[str], concurrency: int, new_tokens: int) -> list[float]:
    todo = list(enumerate(stream))
    out: list[float] = []
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) as client:

        async def worker() -> None:
            while todo:
                i, adapter = todo.pop(0)
                out.append(await ttft(client, adapter, prompts[i % len(prompts)], new_tokens))

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


def cold_vs_warm(
    adapters: dict[str, Path], prompts: list[str], count: int, env: dict[str, str], logs: Path
) -> dict[str, Any]:
    stack = Stack(1, None, env, logs)
    try:
        stack.register(adapters)
        names = sorted(adapters)[:count]

        async def run() -> tuple[list[float], list[float]]:
            async with httpx.AsyncClient(
                base_url=stack.gateway, headers={"Authorization": f"Bearer {KEY}"}, timeout=600
            ) as c:
                cold, warm = [], []
                for name in names:
                    cold.append(await ttft(c, name, prompts[0], 8))
                    warm.append(await ttft(c, name, prompts[0], 8))
                return cold, warm

        cold, warm = asyncio.run(run())
    finally:
        stack.close()
    return {"cold_s": cold, "warm_s": warm, "cold_p50": percentile(cold, 0.5), "warm_p50": percentile(warm, 0.5)}


def zipf_run(
    mode: str,
    adapters: dict[str, Path],
    disk_dir: Path,
    stream: list[str],
    prompts: list[str],
    args: argparse.Namespace,
    env: dict[str, str],
    logs: Path,
) -> dict[str, float]:
    stack = Stack(2, disk_dir if mode == "disk" else None, env, logs)
    try:
        if mode == "fetched":
            stack.register(adapters)
        t0 = time.perf_counter()
        ttfts = asyncio.run(drive(stack.gateway, stream, prompts, args.concurrency, args.new_tokens))
        wall = time.perf_counter() - t0
        downloads = stack.downloads()
    finally:
        stack.close()
    return {
        "rps": len(ttfts) / wall,
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "downloads_engine0": downloads[0],
        "downloads_engine1": downloads[1],
        "hit_rate": 1 - sum(downloads) / len(stream),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapters", type=int, default=100)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--cold", type=int, default=5, help="adapters whose cold and warm TTFT are measured")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the Zipf run (disk, fetched, ...)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not MOTO_SERVER.exists():
        sys.exit("bench/cold_adapters.py needs moto[server] (the dev extra): pip install 'moto[server]'")
    scale_dir, stream, prompts = zipf_workload(args.adapters, args.requests)
    logs = Path(tempfile.mkdtemp(prefix="cold-adapters-"))
    adapters = published_adapters(scale_dir, logs / "published")
    disk_dir = logs / "published"
    moto_port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "LORAGATE_BENCH_KEY": KEY,
        "LORAGATE_BENCH_ADMIN_KEY": ADMIN_KEY,
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    moto = start_moto(moto_port)
    try:
        upload(adapters, env)
        size = sum((next(iter(adapters.values())) / f).stat().st_size for f in ADAPTER_FILES)
        print(
            f"{len(adapters)} adapters of {size / 2**20:.1f} MiB in a local S3 (moto_server); SmolLM2 fp32 engines, "
            f"1 thread each; {args.requests} requests (Zipf s=1.1 over {len(set(stream))} distinct adapters), "
            f"{args.concurrency} in flight, {args.new_tokens} tokens each, streamed",
            flush=True,
        )
        cold = cold_vs_warm(adapters, prompts, args.cold, env, logs / "cold")
        print(
            f"cold adapter TTFT p50 {cold['cold_p50']:.2f} s (fetched from S3, registered, computed) vs warm "
            f"{cold['warm_p50']:.2f} s ({args.cold} adapters)",
            flush=True,
        )
        runs: dict[str, list[dict[str, float]]] = {"disk": [], "fetched": []}
        for k in range(args.rounds):
            for mode in ("disk", "fetched"):
                r = zipf_run(mode, adapters, disk_dir, stream, prompts, args, env, logs / f"{mode}{k}")
                runs[mode].append(r)
                print(
                    f"{mode:8} {r['rps']:5.2f} req/s  TTFT p50 {r['ttft_p50']:.2f} s p99 {r['ttft_p99']:.2f} s  "
                    f"downloads {r['downloads_engine0']:.0f} + {r['downloads_engine1']:.0f}  "
                    f"cache hit rate {100 * r['hit_rate']:.1f}%",
                    flush=True,
                )
        median = {m: {key: percentile([r[key] for r in rs], 0.5) for key in rs[0]} for m, rs in runs.items()}
        ratio = median["fetched"]["rps"] / median["disk"]["rps"]
        print(f"fetched/disk throughput (medians of {args.rounds}): {ratio:.2f}x (target >= 0.9x)")
        if args.json:
            result = {"config": vars(args) | {"json": str(args.json)}, "cold": cold, "runs": runs, "median": median}
            args.json.write_text(json.dumps(result | {"ratio_fetched_disk": ratio}, indent=2))
    finally:
        moto.terminate()
        moto.wait(timeout=10)
        shutil.rmtree(logs, ignore_errors=True)


if __name__ == "__main__":
    main()
