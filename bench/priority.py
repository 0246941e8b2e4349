"""Priority scheduling under load (in-process and over HTTP) and prefix caching, measured in one run.

The load, both ways: 3x oversubscription, i.e. 48 requests in flight (64 prompt words, 96 new tokens,
greedy, fixed length) on an engine that runs 16 at once (max_num_seqs); every load request that ends is
replaced by a new one (at most --rounds per slot) until the critical requests are done. Once the first 16
decode (so the load's opening prefill burst is over), --critical (8) critical requests (40 words, 8 new tokens) arrive
about 0.4 s apart. TTFT counts from a request's arrival, so it includes the wait for the engine step in
progress. Target: critical TTFT p50 and p99 within 2x of the same requests on an idle engine.

1. In-process: an LLMEngine stepped in this process, the load alternating standard/sheddable; the critical
   requests arrive on a fixed schedule (0.4 s apart); the idle figure comes from a second engine.
2. Over HTTP, end to end: a `loragate engine` process on 127.0.0.1 (same model and threads, `--max-num-seqs
   16 --pool-mb 256 --preemption auto`), the load `X-Priority: sheddable` from 48 closed-loop httpx clients
   (plain responses, so this 2-core client spends little CPU on them; `--stream-load` streams them), the
   critical requests streamed with `X-Priority: critical`, one by one, each after a random 0.2-0.6 s gap
   (so they arrive at random points of the engine's steps). TTFT = request sent -> first SSE chunk that
   carries text. The idle TTFT and the sheddable reference outputs come from a second, fresh engine process
   with the same flags (fresh, so neither phase finds the other's prompts in its prefix cache): the critical
   requests one at a time, then every sheddable request that was sent under load, --ref-batch at a time.
   Greedy and fixed-length (min_tokens = max_tokens, ignore_eos), each sheddable text must be identical
   with and without load: preemption (swap or recompute) must not change greedy outputs. From the engine's
   /metrics: preemptions, requests running/waiting at each probe, the critical requests' queue time, the
   load's time per output token; and GET /healthz's latency (the server's event loop).
3. Shared prefix: 24 requests share a ~300-word system prompt and differ in their last few tokens, sent one
   after another; mean TTFT with the adapter-aware prefix cache vs without it.

Prompts are seeded random draws of words, distinct per request, so no request finds another's prompt in
the prefix cache by accident (parts 1 and 2). Each engine is warmed with one short request before timing.
Everything is bounded: request counts, per-request and per-phase timeouts; all traffic goes to 127.0.0.1.

    python bench/priority.py [--model smollm2|tiny-random] [--threads 2] [--json PATH]
                             [--skip-in-process] [--skip-http] [--skip-prefix]
                             [--max-num-seqs 16] [--max-batch-tokens 2048] [--max-prefill-tokens 512]
                             [--aging-s 10] [--preemption auto] [--critical 8] [--no-critical-interrupts]
                             [--rounds 16] [--ref-batch 8] [--stream-load]

`--json PATH` writes {"config", "in_process", "http", "prefix_cache"}: TTFT figures are
`idle_ttft_p50_s`, `idle_ttft_p99_s`, `loaded_ttft_p50_s`, `loaded_ttft_p99_s`, `ratio_p50`, `ratio_p99`;
both have `preemptions` and `interrupted_steps` (steps a critical arrival ended early);
`http` adds `sheddable_outputs_unchanged`, `sheddable_requests`, `sheddable_mismatches`,
`in_flight_at_probes`, `load_in_flight_min`, `engine_critical_queue_time_{idle,loaded}_s`,
`engine_tpot_loaded_mean_s` and `healthz_*`; `prefix_cache` has `mean_ttft_cache_{on,off}_s` and
`ttft_ratio_on_off`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # as `loragate engine` runs

import httpx  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gateway_overhead import free_port  # noqa: E402
from bench.serving import launch_loragate  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import load_tokenizer, resolve_model  # noqa: E402
from loragate.launch import stop  # noqa: E402
from loragate_common.priority import Priority  # noqa: E402
from loragate_common.stats import percentile as pct  # noqa: E402

WORDS = "the quick brown fox jumps over a lazy dog while serving many adapters at once".split()
POOL_MB = 256
CRIT_WORDS, CRIT_NEW = 40, 8
BG_WORDS, BG_NEW = 64, 96
PROBE_DELAY_S, PROBE_INTERVAL_S = 1.0, 0.4  # first critical arrival after the load is in, then spacing
REQUEST_TIMEOUT_S = 900.0  # one HTTP request (a sheddable one may wait out the whole load)
PHASE_TIMEOUT_S = 1200.0  # one HTTP phase (loaded run, reference run)
Tokenizer = Any  # a transformers tokenizer


@dataclass(frozen=True, slots=True)
class Knobs:
    """The engine settings of both overload parts (over HTTP as `loragate engine` flags)."""

    max_num_seqs: int = 16
    max_batch_tokens: int = 2048
    aging_s: float = 10.0
    preemption: str = "auto"
    max_prefill_tokens: int | None = None  # None: the engine's default
    critical: int = 8  # critical requests sent (the probes)
    critical_interrupts: bool = True  # a critical arrival ends a step of lower-class work early

    def config(self, model: str) -> EngineConfig:
        config = EngineConfig(
            model=model,
            pool_mb=POOL_MB,
            max_num_seqs=self.max_num_seqs,
            max_batch_tokens=self.max_batch_tokens,
            aging_s=self.aging_s,
            preemption=self.preemption,
            critical_interrupts=self.critical_interrupts,
        )
        if self.max_prefill_tokens is None:
            return config
        return dataclasses.replace(config, max_prefill_tokens=self.max_prefill_tokens)

    def flags(self) -> list[str]:
        cap = [] if self.max_prefill_tokens is None else ["--max-prefill-tokens", str(self.max_prefill_tokens)]
        if not self.critical_interrupts:
            cap.append("--no-critical-interrupts")
        return [
            "--pool-mb",
            str(POOL_MB),
            "--max-num-seqs",
            str(self.max_num_seqs),
            "--max-batch-tokens",
            str(self.max_batch_tokens),
            "--aging-s",
            str(self.aging_s),
            "--preemption",
            self.preemption,
            *cap,
        ]


def words(n: int, seed: int | str) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


def crit_prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    return [tok(words(CRIT_WORDS, f"critical-{k}"))["input_ids"] for k in range(n)]


def ttft_figures(idle: list[float], loaded: list[float]) -> dict[str, float]:
    fig = {
        "idle_ttft_p50_s": pct(idle, 0.5),
        "idle_ttft_p99_s": pct(idle, 0.99),
        "loaded_ttft_p50_s": pct(loaded, 0.5),
        "loaded_ttft_p99_s": pct(loaded, 0.99),
    }
    fig["ratio_p50"] = fig["loaded_ttft_p50_s"] / fig["idle_ttft_p50_s"]
    fig["ratio_p99"] = fig["loaded_ttft_p99_s"] / fig["idle_ttft_p99_s"]
    return fig


# ---- in-process ---------------------------------------------------------------------------------------

Arrival = tuple[float, str, list[int], SamplingParams, Priority]


def run_open_loop(
    engine: LLMEngine,
    arrivals: list[Arrival],
    load: Callable[[int], Arrival] | None = None,
    n_load: int = 0,
    max_load: int = 0,
    settle: int = 0,
) -> dict[str, float]:
    """Add `n_load` requests `load(0..n_load-1)` at once and step until `settle` of them have their first token;
    then submit each of `arrivals` at its offset (seconds) from that moment, replacing every load request that
    finishes with the next one (at most `max_load` in all) until all of `arrivals` have finished, and step
    until everything finishes. TTFT per id, from its arrival: it counts the wait for the step in progress.

    As the server's engine thread does (engine/core/async_engine.py), a critical arrival during a step sets the
    event that step may be interrupted by: a thread sets it at each critical arrival's time."""
    pending = sorted(arrivals, key=lambda a: a[0])
    critical_arrived = threading.Event()
    started = threading.Event()  # `start` is set
    done = threading.Event()

    def announce_critical_arrivals() -> None:
        started.wait()
        for offset in sorted(a[0] for a in arrivals if a[4] is Priority.CRITICAL):
            if done.is_set() or start is None or done.wait(max(0.0, start + offset - time.perf_counter())):
                return  # (`started` is set once `start` is, or once `done` is)
            critical_arrived.set()

    announcer = threading.Thread(target=announce_critical_arrivals, daemon=True)
    announcer.start()
    unfinished = {a[1] for a in arrivals}
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    added = 0

    def add(arrival: Arrival, at: float) -> None:
        _, rid, prompt, params, priority = arrival
        engine.add_request(rid, prompt, params, priority)
        arrived[rid] = at

    while load is not None and added < n_load:
        add(load(added), time.perf_counter())
        added += 1
    start: float | None = None
    while pending or engine.has_unfinished_requests():
        if start is None and len(ttft) >= min(settle, n_load):
            start = time.perf_counter()
            started.set()
        critical_arrived.clear()  # before the arrivals are read, as the server's loop clears it
        now = time.perf_counter() - start if start is not None else -math.inf
        while start is not None and pending and pending[0][0] <= now:
            arrival = pending.pop(0)
            add(arrival, start + arrival[0])
        if not engine.has_unfinished_requests():
            time.sleep(min(0.01, max(0.0, pending[0][0] - now)))
            continue
        for out in engine.step(critical_arrived):
            rid = out.request_id
            if out.new_token_ids and rid not in ttft:
                ttft[rid] = time.perf_counter() - arrived[rid]
            if not out.finished:
                continue
            if rid in unfinished:
                unfinished.discard(rid)
            elif load is not None and unfinished and added < max_load:  # a load request: keep the load in flight
                add(load(added), time.perf_counter())
                added += 1
    done.set()
    started.set()
    announcer.join()
    return ttft


def warm(engine: LLMEngine, tok: Tokenizer) -> None:
    run_open_loop(
        engine,
        [
            (
                0.0,
                "warmup",
                tok(words(CRIT_WORDS, "warm-up"))["input_ids"],
                SamplingParams(max_tokens=2, temperature=0.0),
                Priority.STANDARD,
            )
        ],
    )


def in_process(model: str, knobs: Knobs, rounds: int) -> dict[str, Any]:
    config = knobs.config(model)
    max_num_seqs = knobs.max_num_seqs
    engine = LLMEngine(config)
    tok = engine.tokenizer
    warm(engine, tok)
    background = SamplingParams(max_tokens=BG_NEW, min_tokens=BG_NEW, temperature=0.0, ignore_eos=True)
    critical = SamplingParams(max_tokens=CRIT_NEW, min_tokens=CRIT_NEW, temperature=0.0, ignore_eos=True)
    crit = crit_prompts(tok, knobs.critical)
    n_bg = 3 * max_num_seqs

    def load(i: int) -> Arrival:
        return (
            0.0,
            f"bg{i}",
            tok(words(BG_WORDS, f"load-{i}"))["input_ids"],
            background,
            Priority.STANDARD if i % 2 else Priority.SHEDDABLE,
        )

    arrivals = [
        (PROBE_DELAY_S + PROBE_INTERVAL_S * k, f"crit{k}", p, critical, Priority.CRITICAL) for k, p in enumerate(crit)
    ]
    loaded = run_open_loop(engine, arrivals, load, n_load=n_bg, max_load=n_bg * rounds, settle=max_num_seqs)
    preemptions = dict(engine.scheduler.preemption.counts)
    interrupted = engine.interrupted_steps
    del engine
    idle_engine = LLMEngine(config)
    warm(idle_engine, tok)
    idle: dict[str, float] = {}
    for k, prompt in enumerate(crit):
        idle.update(run_open_loop(idle_engine, [(0.0, f"crit{k}", prompt, critical, Priority.CRITICAL)]))
    others = [v for k, v in loaded.items() if k.startswith("bg")]
    return {
        **ttft_figures([idle[f"crit{k}"] for k in range(len(crit))], [loaded[f"crit{k}"] for k in range(len(crit))]),
        "background_requests": len(others),
        "background_concurrency": n_bg,
        "background_ttft_p50_s": pct(others, 0.5),
        "background_ttft_p99_s": pct(others, 0.99),
        "preemptions": preemptions,
        "interrupted_steps": interrupted,
    }


# ---- prefix cache -------------------------------------------------------------------------------------


def shared_prefix(model: str) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for enabled in (False, True):
        engine = LLMEngine(EngineConfig(model=model, pool_mb=POOL_MB, enable_prefix_cache=enabled))
        tok = engine.tokenizer
        system = words(300, 7)
        params = SamplingParams(max_tokens=1, temperature=0.0)
        ttfts: list[float] = []
        for k in range(24):
            prompt = tok(f"{system} question {k}: {words(6, k)}")["input_ids"]
            ttfts += run_open_loop(engine, [(0.0, f"q{k}", prompt, params, Priority.STANDARD)]).values()
        key = "on" if enabled else "off"
        results[f"mean_ttft_cache_{key}_s"] = statistics.mean(ttfts[1:])  # the first request fills the cache
        results[f"hit_tokens_cache_{key}"] = engine.scheduler.kv.prefix_hits
        results[f"queried_tokens_cache_{key}"] = engine.scheduler.kv.prefix_queries
    results["ttft_ratio_on_off"] = results["mean_ttft_cache_on_s"] / results["mean_ttft_cache_off_s"]
    return results


# ---- over HTTP ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Streamed:
    ttft_s: float  # request sent -> first chunk with text (first chunk at all if none has text)
    text: str
    completion_tokens: int


async def stream(
    client: httpx.AsyncClient, url: str, prompt: list[int], new_tokens: int, priority: str, streamed: bool = True
) -> Streamed:
    """One greedy completion of exactly `new_tokens` tokens, streamed (or not: then TTFT is the latency)."""
    body = {
        "prompt": prompt,
        "max_tokens": new_tokens,
        "min_tokens": new_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    if not streamed:
        resp = await client.post(
            f"{url}/v1/completions", json={**body, "stream": False}, headers={"X-Priority": priority}
        )
        if resp.status_code != 200:
            raise RuntimeError(f"{priority} request: HTTP {resp.status_code} {resp.text[:300]!r}")
        answer = resp.json()
        return Streamed(time.perf_counter() - t0, answer["choices"][0]["text"], answer["usage"]["completion_tokens"])
    ttft = first = math.nan
    parts: list[str] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers={"X-Priority": priority}) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{priority} request: HTTP {resp.status_code} {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{priority} request failed mid-stream: {chunk['error']}")
            if math.isnan(first):
                first = time.perf_counter() - t0
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices") or ():
                if choice.get("text"):
                    if math.isnan(ttft):
                        ttft = time.perf_counter() - t0
                    parts.append(choice["text"])
    return Streamed(first if math.isnan(ttft) else ttft, "".join(parts), tokens)


async def scrape(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    """The engine's /metrics as {'name{labels}': value}."""
    out: dict[str, float] = {}
    for line in (await client.get(f"{url}/metrics")).text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def by_priority(metrics: dict[str, float], family: str) -> dict[str, int]:
    return {p.name.lower(): int(metrics.get(f'{family}{{priority="{p.name.lower()}"}}', 0)) for p in Priority}


def in_flight(metrics: dict[str, float]) -> tuple[int, int]:
    """(running, waiting) requests in the engine, all priorities."""
    return (
        sum(by_priority(metrics, "loragate_engine_requests_running_by_priority").values()),
        sum(by_priority(metrics, "loragate_engine_requests_waiting_by_priority").values()),
    )


def critical_queue_time(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean arrival -> first scheduled of the critical requests between two scrapes (engine-side)."""
    name = 'loragate_engine_queue_time_seconds_{}{{priority="critical"}}'
    count = after.get(name.format("count"), 0) - before.get(name.format("count"), 0)
    return (after.get(name.format("sum"), 0) - before.get(name.format("sum"), 0)) / count if count else math.nan


def mean_tpot(before: dict[str, float], after: dict[str, float]) -> float:
    """Mean time per output token of the requests that finished between two scrapes: the decode step time."""
    name = "loragate_engine_time_per_output_token_seconds_{}"
    count = after.get(name.format("count"), 0) - before.get(name.format("count"), 0)
    return (after.get(name.format("sum"), 0) - before.get(name.format("sum"), 0)) / count if count else math.nan


def preemptions(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    return {
        mode: int(
            after.get(f'loragate_engine_preemptions_total{{mode="{mode}"}}', 0)
            - before.get(f'loragate_engine_preemptions_total{{mode="{mode}"}}', 0)
        )
        for mode in ("recompute", "swap")
    }


def client(connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=REQUEST_TIMEOUT_S,
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
    )


async def warm_http(http: httpx.AsyncClient, url: str, tok: Tokenizer) -> None:
    await stream(http, url, tok(words(CRIT_WORDS, "warm-up"))["input_ids"], 2, "standard")


async def healthz_latency(http: httpx.AsyncClient, url: str) -> float:
    """Round trip of GET /healthz: how long the engine's event loop takes to answer a trivial request."""
    t0 = time.perf_counter()
    (await http.get(f"{url}/healthz")).raise_for_status()
    return time.perf_counter() - t0


async def loaded_phase(
    url: str, tok: Tokenizer, crit: list[list[int]], shed: list[list[list[int]]], settle: int, stream_load: bool
) -> dict[str, Any]:
    """The sheddable load (one closed-loop client per entry of `shed`) with the critical probes in it, sent once
    every load request is in the engine and `settle` of them have their first token."""
    async with client(len(shed)) as shed_client, client(2) as probe_client:
        await warm_http(probe_client, url, tok)
        await asyncio.gather(*(warm_http(shed_client, url, tok) for _ in range(4)))  # open some connections
        before = await scrape(probe_client, url)
        done = asyncio.Event()
        outputs: dict[tuple[int, int], Streamed] = {}

        async def worker(w: int) -> None:
            for r, prompt in enumerate(shed[w]):
                if r and done.is_set():
                    return
                outputs[(w, r)] = await stream(shed_client, url, prompt, BG_NEW, "sheddable", stream_load)

        tasks = [asyncio.create_task(worker(w)) for w in range(len(shed))]
        try:
            first_tokens = "loragate_engine_time_to_first_token_seconds_count"
            deadline = time.monotonic() + PHASE_TIMEOUT_S / 2
            while time.monotonic() < deadline:  # every sheddable request is in the engine, the first wave decodes
                now = await scrape(probe_client, url)
                if (
                    sum(in_flight(now)) >= len(shed)
                    and now.get(first_tokens, 0) - before.get(first_tokens, 0) >= settle
                ):
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(PROBE_DELAY_S)
            probes: list[Streamed] = []
            samples: list[tuple[int, int]] = []
            healthz: list[float] = []
            gaps = random.Random(0)
            for prompt in crit:
                # One by one, each after a random gap: a probe sent right when the previous one ended would
                # arrive at the same point of every engine step (just after one began) and always wait a whole step.
                await asyncio.sleep(gaps.uniform(0.5, 1.5) * PROBE_INTERVAL_S)
                samples.append(in_flight(await scrape(probe_client, url)))
                healthz.append(await healthz_latency(probe_client, url))
                probes.append(await stream(probe_client, url, prompt, CRIT_NEW, "critical"))
            mid = await scrape(probe_client, url)
            done.set()
            await asyncio.gather(*tasks)
        finally:
            done.set()
            for task in tasks:
                task.cancel()
        after = await scrape(probe_client, url)
    return {
        "probes": probes,
        "outputs": outputs,
        "in_flight_at_probes": samples,
        "healthz_s": healthz,
        "critical_queue_time_s": critical_queue_time(before, mid),
        "preemptions": preemptions(before, after),
        "tpot_s": mean_tpot(before, after),
        "interrupted_steps": int(
            after.get("loragate_engine_interrupted_steps_total", 0)
            - before.get("loragate_engine_interrupted_steps_total", 0)
        ),
    }


async def idle_phase(
    url: str,
    tok: Tokenizer,
    crit: list[list[int]],
    shed: dict[tuple[int, int], list[int]],
    ref_batch: int,
    stream_load: bool,
) -> dict[str, Any]:
    """Critical requests one at a time, then the sheddable requests `ref_batch` at a time, on an idle engine."""
    async with client(ref_batch) as http:
        await warm_http(http, url, tok)
        before = await scrape(http, url)
        probes, healthz = [], []
        for prompt in crit:
            healthz.append(await healthz_latency(http, url))
            probes.append(await stream(http, url, prompt, CRIT_NEW, "critical"))
            await asyncio.sleep(0.05)
        mid = await scrape(http, url)
        keys = sorted(shed)
        reference: dict[tuple[int, int], Streamed] = {}
        for i in range(0, len(keys), ref_batch):
            batch = keys[i : i + ref_batch]
            outs = await asyncio.gather(*(stream(http, url, shed[k], BG_NEW, "sheddable", stream_load) for k in batch))
            reference.update(zip(batch, outs, strict=True))
    return {
        "probes": probes,
        "reference": reference,
        "healthz_s": healthz,
        "critical_queue_time_s": critical_queue_time(before, mid),
    }


def first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def over_http(model: str, threads: int, knobs: Knobs, rounds: int, ref_batch: int, stream_load: bool) -> dict[str, Any]:
    max_num_seqs = knobs.max_num_seqs
    tok = load_tokenizer(resolve_model(model).path)
    crit = crit_prompts(tok, knobs.critical)
    n_shed = 3 * max_num_seqs
    shed = [[tok(words(BG_WORDS, f"load-{w}-{r}"))["input_ids"] for r in range(rounds)] for w in range(n_shed)]
    work = Path(tempfile.mkdtemp(prefix="loragate-priority-"))

    def serve(label: str) -> tuple[str, subprocess.Popen[bytes]]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = launch_loragate(
            [
                "engine",
                "--model",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--threads",
                str(threads),
                *knobs.flags(),
                "--keep-alive-s",
                "600",
                "--log-level",
                "warning",
            ],
            url,
            work / f"engine-{label}.log",
        )
        return url, proc

    def run(label: str, phase: Callable[[str], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        url, proc = serve(label)
        try:
            return asyncio.run(asyncio.wait_for(phase(url), PHASE_TIMEOUT_S))
        finally:
            stop(proc)

    loaded = run("loaded", lambda url: loaded_phase(url, tok, crit, shed, max_num_seqs, stream_load))
    sent = {key: shed[key[0]][key[1]] for key in loaded["outputs"]}
    idle = run("idle", lambda url: idle_phase(url, tok, crit, sent, ref_batch, stream_load))
    mismatches = []
    for key in sorted(sent):
        got, want = loaded["outputs"][key], idle["reference"][key]
        if got.text != want.text or got.completion_tokens != BG_NEW or want.completion_tokens != BG_NEW:
            at = first_difference(got.text, want.text)
            mismatches.append(
                {
                    "request": f"w{key[0]}r{key[1]}",
                    "first_difference_at_char": at,
                    "loaded": got.text[max(0, at - 20) : at + 40],
                    "idle": want.text[max(0, at - 20) : at + 40],
                    "tokens": [got.completion_tokens, want.completion_tokens],
                }
            )
    samples = loaded["in_flight_at_probes"]
    return {
        **ttft_figures([p.ttft_s for p in idle["probes"]], [p.ttft_s for p in loaded["probes"]]),
        "idle_ttft_s": [p.ttft_s for p in idle["probes"]],
        "loaded_ttft_s": [p.ttft_s for p in loaded["probes"]],
        "sheddable_outputs_unchanged": not mismatches,
        "sheddable_requests": len(sent),
        "sheddable_concurrency": n_shed,
        "sheddable_streamed": stream_load,
        "sheddable_mismatches": mismatches,
        "healthz_idle_p50_s": pct(idle["healthz_s"], 0.5),
        "healthz_loaded_p50_s": pct(loaded["healthz_s"], 0.5),
        "healthz_loaded_max_s": max(loaded["healthz_s"]),
        "preemptions": loaded["preemptions"],
        "interrupted_steps": loaded["interrupted_steps"],
        "in_flight_at_probes": [{"running": r, "waiting": w} for r, w in samples],
        "load_in_flight_min": min(r + w for r, w in samples),
        "engine_critical_queue_time_idle_s": idle["critical_queue_time_s"],
        "engine_critical_queue_time_loaded_s": loaded["critical_queue_time_s"],
        "engine_tpot_loaded_mean_s": loaded["tpot_s"],
        "logs": str(work),
    }


# ---- report -------------------------------------------------------------------------------------------


def print_ttft_table(parts: dict[str, dict[str, Any]]) -> None:
    print(
        f"{'critical TTFT':14s} {'idle p50':>9s} {'idle p99':>9s} {'loaded p50':>11s} {'loaded p99':>11s} "
        f"{'ratio p50':>10s} {'ratio p99':>10s}   (target <= 2x)"
    )
    for name, f in parts.items():
        print(
            f"{name:14s} {1e3 * f['idle_ttft_p50_s']:6.1f} ms {1e3 * f['idle_ttft_p99_s']:6.1f} ms "
            f"{1e3 * f['loaded_ttft_p50_s']:8.1f} ms {1e3 * f['loaded_ttft_p99_s']:8.1f} ms "
            f"{f['ratio_p50']:9.2f}x {f['ratio_p99']:9.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=16, help="requests the engine runs at once (load: 3x)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048, help="the engine's step token budget")
    ap.add_argument(
        "--max-prefill-tokens",
        type=int,
        help="the engine's prompt tokens per step below critical (default: the engine's)",
    )
    ap.add_argument("--aging-s", type=float, default=10.0, help="the engine's --aging-s (1e9: no aging)")
    ap.add_argument("--critical", type=int, default=8, help="critical requests sent, one after another")
    ap.add_argument("--preemption", default="auto", choices=("recompute", "swap", "auto"))
    ap.add_argument(
        "--no-critical-interrupts",
        action="store_true",
        help="the engine's --no-critical-interrupts: critical arrivals wait for the step in progress",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=16,
        help="most load requests per closed-loop client (each "
        "load request that ends is replaced until the critical ones are done)",
    )
    ap.add_argument("--ref-batch", type=int, default=8, help="HTTP: sheddable reference requests at once")
    ap.add_argument(
        "--stream-load",
        action="store_true",
        help="HTTP: stream the sheddable requests too "
        "(default: plain responses, so this 2-core client spends little CPU on them)",
    )
    ap.add_argument("--json", type=Path, help="write every figure to this file as JSON")
    ap.add_argument("--skip-in-process", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    args = ap.parse_args()
    for name in (
        "threads",
        "max_num_seqs",
        "max_batch_tokens",
        "max_prefill_tokens",
        "aging_s",
        "critical",
        "rounds",
        "ref_batch",
    ):
        if getattr(args, name) is not None and getattr(args, name) <= 0:
            ap.error(f"--{name.replace('_', '-')} must be positive")
    try:
        resolve_model(args.model)
    except ValueError as exc:
        ap.error(str(exc))
    torch.set_num_threads(args.threads)
    knobs = Knobs(
        args.max_num_seqs,
        args.max_batch_tokens,
        args.aging_s,
        args.preemption,
        args.max_prefill_tokens,
        args.critical,
        not args.no_critical_interrupts,
    )
    result: dict[str, Any] = {
        "config": {
            "model": args.model,
            "threads": args.threads,
            "max_num_seqs": args.max_num_seqs,
            "max_batch_tokens": args.max_batch_tokens,
            "max_prefill_tokens": args.max_prefill_tokens,
            "critical_interrupts": not args.no_critical_interrupts,
            "aging_s": args.aging_s,
            "preemption": args.preemption,
            "load_requests_in_flight": 3 * args.max_num_seqs,
            "critical_requests": args.critical,
            "probe_interval_s": PROBE_INTERVAL_S,
        }
    }
    print(
        f"{args.model}, {args.threads} threads, max_num_seqs {args.max_num_seqs} "
        f"(load: {3 * args.max_num_seqs} requests of {BG_WORDS} words + {BG_NEW} new tokens), "
        f"{args.critical} critical requests ({CRIT_WORDS} words + {CRIT_NEW} new tokens) {PROBE_INTERVAL_S} s apart, "
        f"--max-prefill-tokens {args.max_prefill_tokens or 'default'}, critical interrupts "
        f"{'off' if args.no_critical_interrupts else 'on'}",
        flush=True,
    )
    if not args.skip_in_process:
        result["in_process"] = in_process(args.model, knobs, args.rounds)
        print(f"in-process done: preemptions {result['in_process']['preemptions']}", flush=True)
    if not args.skip_http:
        result["http"] = over_http(args.model, args.threads, knobs, args.rounds, args.ref_batch, args.stream_load)
        print("http done", flush=True)
    if not args.skip_prefix:
        result["prefix_cache"] = shared_prefix(args.model)

    print()
    print_ttft_table(
        {name: result[key] for name, key in (("in-process", "in_process"), ("over HTTP", "http")) if key in result}
    )
    if "in_process" in result:
        f = result["in_process"]
        print(
            f"in-process: {f['background_requests']} standard/sheddable requests ({f['background_concurrency']} "
            f"in flight), their TTFT p50 "
            f"{f['background_ttft_p50_s']:.2f} s p99 {f['background_ttft_p99_s']:.2f} s; "
            f"preemptions {f['preemptions']}, steps interrupted by critical arrivals {f['interrupted_steps']}"
        )
    if "http" in result:
        f = result["http"]
        identical = f["sheddable_requests"] - len(f["sheddable_mismatches"])
        print(
            f"over HTTP: {f['sheddable_requests']} sheddable requests ({f['sheddable_concurrency']} in flight, "
            f"at least {f['load_in_flight_min']} in the engine at each probe), outputs unchanged: "
            f"{'yes' if f['sheddable_outputs_unchanged'] else 'NO'} ({identical}/{f['sheddable_requests']} "
            f"identical to an idle engine's); preemptions {f['preemptions']}, steps interrupted by critical "
            f"arrivals {f['interrupted_steps']}"
        )
        print(
            "  critical TTFT per probe (ms): "
            + " ".join(f"{1e3 * t:.0f}" for t in f["loaded_ttft_s"])
            + "; requests waiting in the engine just before: "
            + " ".join(str(s["waiting"]) for s in f["in_flight_at_probes"])
        )
        print(
            f"  engine /metrics: critical queue time idle {1e3 * f['engine_critical_queue_time_idle_s']:.1f} ms, "
            f"loaded {1e3 * f['engine_critical_queue_time_loaded_s']:.1f} ms; load time per output token "
            f"{1e3 * f['engine_tpot_loaded_mean_s']:.0f} ms; GET /healthz p50 idle "
            f"{1e3 * f['healthz_idle_p50_s']:.1f} ms, loaded {1e3 * f['healthz_loaded_p50_s']:.1f} ms"
        )
        for m in f["sheddable_mismatches"][:3]:
            print(
                f"  mismatch {m['request']} at char {m['first_difference_at_char']} (tokens {m['tokens']}): "
                f"loaded {m['loaded']!r} idle {m['idle']!r}"
            )
    if "prefix_cache" in result:
        f = result["prefix_cache"]
        print(
            f"shared prefix: mean TTFT cache off {1e3 * f['mean_ttft_cache_off_s']:.1f} ms, on "
            f"{1e3 * f['mean_ttft_cache_on_s']:.1f} ms ({f['ttft_ratio_on_off']:.2f}x; hit tokens "
            f"{f['hit_tokens_cache_on']}/{f['queried_tokens_cache_on']})"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
