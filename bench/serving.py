"""Serving overhead: W1 (docs/benchmarks.md) in-process and over HTTP in the same run, base and mixed LoRA.

Each round, interleaved: the engine in this process (bench/throughput.py's `bench_engine`); the same
requests to a `loragate engine` process over HTTP, non-streamed and streamed (32 concurrent httpx
clients, prompts sent as token ids so both paths compute exactly the same thing); and the same through a
`loragate gateway` process in front of it. The figure is generated tokens per second from the first
request sent to the last answer received; the ratio is to the in-process figure of the same round.
Only one of the three runs at a time (the servers idle while the in-process engine runs).

    python bench/serving.py [--model smollm2] [--rounds 3] [--requests 32] [--new-tokens 64] [--threads 2]
                            [--json PATH]

`--json PATH` also writes the figures as one JSON object: `config`, `rounds` (each round's tok/s per
workload and path) and `median` (per workload: `in_process_tok_s`, then for each of `http`, `http_stream`,
`gateway`, `gateway_stream` the median tok/s `<path>_tok_s` and the median ratio to in-process `<path>_ratio`).

Targets (issue 14): HTTP >= 0.95x in-process, through the gateway >= 0.93x.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `loragate engine` runs: the same setting both ways

import httpx  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.gateway_overhead import BENCH_TENANT, KEY, free_port  # noqa: E402
from bench.throughput import bench_engine, make_w1_adapters, w1_prompts  # noqa: E402
from engine.model.sources import cache_root, load_tokenizer, resolve_model  # noqa: E402
from loragate.launch import launch, stop  # noqa: E402


def launch_loragate(args: list[str], url: str, log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start `python -m loragate ARGS` (its output into `log`) and wait (at most 600 s) until GET /healthz
    answers; stopped if it does not (loragate.launch.LaunchError, naming the log)."""
    with log.open("wb") as out:
        return launch(
            [sys.executable, "-m", "loragate", *args],
            url,
            timeout_s=600,
            name=f"loragate {args[0]} (log: {log})",
            env=env,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def one(client: httpx.AsyncClient, url: str, body: dict, headers: dict[str, str], stream: bool) -> int:
    """One completion; returns its completion tokens (from `usage`)."""
    if not stream:
        resp = await client.post(f"{url}/v1/completions", json=body, headers=headers)
        resp.raise_for_status()
        return resp.json()["usage"]["completion_tokens"]
    tokens = 0
    async with client.stream(
        "POST",
        f"{url}/v1/completions",
        headers=headers,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
    return tokens


async def over_http(
    url: str, prompts: list[list[int]], adapters: list[str | None], new_tokens: int, stream: bool, auth: dict[str, str]
) -> float:
    """All requests at once over HTTP; returns generated tokens per second."""
    limits = httpx.Limits(max_connections=len(prompts), max_keepalive_connections=len(prompts))
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        await one(client, url, {"prompt": prompts[0], "max_tokens": 2}, auth, False)  # connections warm
        start = time.perf_counter()
        counts = await asyncio.gather(
            *[
                one(
                    client,
                    url,
                    {
                        "prompt": p,
                        "max_tokens": new_tokens,
                        "min_tokens": new_tokens,
                        "ignore_eos": True,
                        "temperature": 0.0,
                    },
                    {**auth, **({"X-Adapter-ID": a} if a else {})},
                    stream,
                )
                for p, a in zip(prompts, adapters, strict=True)
            ]
        )
        elapsed = time.perf_counter() - start
    assert sum(counts) == len(prompts) * new_tokens, counts
    return sum(counts) / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    resolved = resolve_model(args.model)
    tok = load_tokenizer(resolved.path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(args.requests)]
    weight_dirs = make_w1_adapters(resolved.path, cache_root() / "bench-adapters" / "w1")
    names = [d.name for d in weight_dirs]
    workloads: dict[str, list[str | None]] = {
        "base": [None] * len(prompts),
        "mixed": [names[i % len(names)] for i in range(len(prompts))],
    }

    work = Path(tempfile.mkdtemp(prefix="loragate-serving-"))
    engine_url, gateway_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    policy = work / "policy.yaml"
    policy.write_text(
        BENCH_TENANT + "admission: {max_inflight_per_upstream: 64, max_queue: 1024, queue_timeout_ms: 600000}\n"
    )
    procs = []
    try:
        procs.append(
            launch_loragate(
                [
                    "engine",
                    "--model",
                    args.model,
                    "--adapter-dir",
                    str(weight_dirs[0].parent),
                    "--threads",
                    str(args.threads),
                    "--port",
                    engine_url.rsplit(":", 1)[1],
                    "--log-level",
                    "warning",
                ],
                engine_url,
                work / "engine.log",
            )
        )
        procs.append(
            launch_loragate(
                [
                    "gateway",
                    "--policy",
                    str(policy),
                    "--upstream",
                    engine_url,
                    "--port",
                    gateway_url.rsplit(":", 1)[1],
                    "--log-level",
                    "warning",
                ],
                gateway_url,
                work / "gateway.log",
                env={**os.environ, "LORAGATE_BENCH_KEY": KEY},
            )
        )
        print(
            f"W1: {args.requests} requests, {args.new_tokens} new tokens each, {args.model}, {args.threads} "
            f"threads, {args.rounds} interleaved rounds; tok/s (ratio to in-process, same round)"
        )
        figures: dict[tuple[str, str], list[float]] = {}
        rounds: list[dict[str, dict[str, float]]] = []
        for r in range(args.rounds):
            rounds.append({})
            for workload, adapters in workloads.items():
                [(_, inproc)] = bench_engine(
                    args.model, prompts, args.new_tokens, adapters, adapter_dir=str(weight_dirs[0].parent)
                )
                row = {"in-process": inproc}
                for label, url, auth, stream in (
                    ("http", engine_url, {}, False),
                    ("http stream", engine_url, {}, True),
                    ("gateway", gateway_url, {"Authorization": f"Bearer {KEY}"}, False),
                    ("gateway stream", gateway_url, {"Authorization": f"Bearer {KEY}"}, True),
                ):
                    row[label] = asyncio.run(over_http(url, prompts, adapters, args.new_tokens, stream, auth))
                rounds[-1][workload] = row
                for label, value in row.items():
                    figures.setdefault((workload, label), []).append(value / inproc if label != "in-process" else value)
                print(
                    f"round {r + 1} {workload:5s} "
                    + "  ".join(
                        f"{label} {value:6.1f}" + ("" if label == "in-process" else f" ({value / inproc:.2f}x)")
                        for label, value in row.items()
                    ),
                    flush=True,
                )
        print("\nmedian over the rounds (in-process: tok/s; others: ratio to in-process in the same round)")
        for workload in workloads:
            cells = []
            for label in ("in-process", "http", "http stream", "gateway", "gateway stream"):
                values = figures[(workload, label)]
                cells.append(
                    f"{label} {statistics.median(values):.1f}"
                    if label == "in-process"
                    else f"{label} {statistics.median(values):.3f}x"
                )
            print(f"{workload:5s} " + "  ".join(cells))
        print("targets: http >= 0.95x, gateway >= 0.93x")
        if args.json:

            def key(label: str) -> str:
                return label.replace(" ", "_").replace("-", "_")

            median: dict[str, dict[str, float]] = {}
            for workload in workloads:
                med = median[workload] = {"in_process_tok_s": statistics.median(figures[(workload, "in-process")])}
                for label in ("http", "http stream", "gateway", "gateway stream"):
                    med[f"{key(label)}_tok_s"] = statistics.median(r[workload][label] for r in rounds)
                    med[f"{key(label)}_ratio"] = statistics.median(figures[(workload, label)])
            out: dict[str, Any] = {
                "config": {
                    "model": args.model,
                    "requests": args.requests,
                    "new_tokens": args.new_tokens,
                    "threads": args.threads,
                    "rounds": args.rounds,
                },
                "rounds": [
                    {w: {f"{key(label)}_tok_s": v for label, v in row.items()} for w, row in r.items()} for r in rounds
                ],
                "median": median,
            }
            args.json.write_text(json.dumps(out, indent=2))
    finally:
        for proc in procs:
            stop(proc)


if __name__ == "__main__":
    main()
