"""Prefix-aware routing: prefix-cache hit rate, TTFT and balance of multi-turn chats on two engines.

Two `loragate engine` processes (SmolLM2, one thread each, a --pool-mb KV pool each) sit behind two `loragate
gateway` replicas that share one real redis-server (no persistence, its own temp dir), both gateways in front of
both engines, all on 127.0.0.1. The stream: --tenants tenants (one policy tenant, bench/gateway_overhead.py's,
whose limits never bind; the "tenants" are told apart by their system prompts), each with its own deterministic
English-ish system prompt of about --system-tokens tokens (counted with SmolLM2's tokenizer), --adapter-tenants of
them served through a W1 adapter each (`X-Adapter-ID`, ids over bench/throughput.py's weight sets). --conversations
conversations, one per tenant first and the rest drawn Zipf (s=1.1) over the tenants, in a seeded random order; each
is --turns turns on /v1/chat/completions, every turn sending the whole conversation so far (system prompt, the
earlier user messages and the engine's real answers, the new user message; user messages distinct per
conversation), greedy, exactly --new-tokens tokens an answer, streamed (TTFT: to the first chunk with content),
with `X-Session-ID: <conversation id>`. --concurrency workers per gateway each take the next conversation and run
its turns in order; turn t of conversation c goes through gateway (c + t) % 2, so a conversation crosses the
replicas and only the index they share in Redis keeps it together.

Configurations, each run with fresh engines, gateways and Redis, interleaved over --rounds (the order rotates
each round; both engines keep their ports within a round, since rendezvous hashing ranks engines by URL):

- `load` (the baseline): load-only routing, `admission.prefix: {enabled: false}`, `session_key: none`;
- `prefix`: prefix-aware routing, `prefix: {enabled: true, chunk_chars: 256, max_chunks: 128,
  index_entries: 65536, ttl_s: 600}`, `session_key: header:X-Session-ID`;
- `single`: the same stream against ONE engine behind the two gateways: the hit rate one engine alone gets.

Reported per run and as medians over the rounds: the engines' prefix-cache hit rate (hit tokens / queried tokens
summed over the engines, deltas of their /metrics counters over the run), TTFT p50 and p99, requests/s and
tokens/s (prompt + generated tokens, from the engines' counters), wall time, and the busier engine's share of the
computed work (prompt tokens computed, i.e. queried - hit, plus generated tokens); per run also the entries of the
shared prefix index left in Redis (`loragate:prefix:*` keys; 0 where prefix routing is off). Then the ratios
against the targets (the issue): prefix hit rate / single hit rate >= 0.9, prefix TTFT p50 / load TTFT p50 <= 0.6,
the busier engine at most 60% of the work under prefix.

    python bench/prefix_routing.py [--rounds 3] [--tenants 16] [--conversations 48] [--turns 4] [--concurrency 4]
                                   [--new-tokens 16] [--system-tokens 1000] [--adapter-tenants 6] [--pool-mb 2048]
                                   [--configs load,prefix,single] [--json PATH]

The pool: SmolLM2's KV takes 30 layers x 2 x 3 KV heads x 64 x 4 bytes = 45 KiB a token in fp32 (22.5 KiB in bf16,
what `--dtype auto` picks on CPUs with avx512_bf16); the default stream's distinct prompt tokens (16 system
prompts of ~1,000 tokens plus 48 conversations' turns) are ~30k, 1.3 GiB in fp32, so 2048 MiB an engine holds the
whole stream (with the adapters' pages) even in fp32: no configuration's hit rate is bounded by evictions. The
header line prints the stream's estimate; a run whose engines hold fewer tokens (measured from their /metrics at
the start) says so.

`--json PATH` also writes the figures as one JSON object: `config`, `workload`, `runs` (per configuration, one
entry per round), `median` and `ratios`. As for the other benches, a run worth keeping is added to
bench/results/history.json by hand (date, machine, command, figures, note).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.affinity import metric  # noqa: E402
from bench.gateway_overhead import BENCH_TENANT, KEY, free_port  # noqa: E402
from bench.load_routing import loragate, start_gateways  # noqa: E402
from bench.redis_recovery import RedisServer  # noqa: E402
from bench.throughput import make_w1_adapters, scale_adapter_dir, zipf_choices  # noqa: E402
from engine.model.sources import cache_root, load_tokenizer, resolve_model  # noqa: E402
from loragate.launch import stop, wait_healthy  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

ADMISSION = """admission: {{max_inflight_per_upstream: 16, max_queue: 1024, queue_timeout_ms: 600000,
             load_source: engine, prefix: {prefix}, session_key: {session}}}
"""
PREFIX_ON = "{enabled: true, chunk_chars: 256, max_chunks: 128, index_entries: 65536, ttl_s: 600}"
# configuration -> (admission.prefix, admission.session_key, engines)
CONFIGS: dict[str, tuple[str, str, int]] = {
    "load": ("{enabled: false}", "none", 2),
    "prefix": (PREFIX_ON, "header:X-Session-ID", 2),
    "single": ("{enabled: false}", "none", 1),
}
COUNTERS = {
    "queried": "loragate_engine_prefix_cache_queried_tokens_total",
    "hit": "loragate_engine_prefix_cache_hit_tokens_total",
    "prompt": "loragate_engine_prompt_tokens_total",
    "generated": "loragate_engine_generation_tokens_total",
}
REDIS_PREFIX_KEYS = "loragate:prefix:*"  # the shared prefix index's entries (gateway/prefix_index.py KEY_PREFIX)
BLOCK_SIZE = 16  # `loragate engine --block-size`'s default, which the engines here run with
TEMPLATE_TOKENS = 5  # a chat message's own tokens in SmolLM2's template (<|im_start|>role\n ... <|im_end|>\n)

# The words of the seeded English-ish text: "<subject> <verb> <object> <tail>" clauses.
SUBJECTS = (
    "the customer|our support team|every order|the warehouse|a new account|the billing system|each invoice|"
    "the delivery driver|a premium member|the store manager|the mobile app|a returned item|the loyalty program|"
    "the regional office|every shipment|the night shift|a gift card|the supplier"
).split("|")
VERBS = (
    "should receive|may request|will review|must confirm|can update|needs to check|is allowed to keep|has to report|"
    "might cancel|should never share|is expected to track|will gladly replace"
).split("|")
OBJECTS = (
    "a full refund|the shipping address|the monthly statement|a replacement part|the order history|a written apology|"
    "the warranty terms|a discount code|the tracking number|the payment details|a signed receipt|the delivery window|"
    "the product manual|a loyalty bonus|the return label"
).split("|")
TAILS = (
    "within two business days|before the end of the month|unless a manager objects|after the payment clears|"
    "as soon as the parcel arrives|when the weather is bad|only during opening hours|for orders above fifty dollars|"
    "if the item was damaged|in the customer's own language|without any extra charge|on the first request"
).split("|")
ADJECTIVES = ("Northern", "Bright", "Silver", "Quiet", "Golden", "Rapid", "Coastal", "Green", "Urban", "Honest")
NOUNS = ("Harbor", "Orchard", "Bakery", "Outfitters", "Pharmacy", "Garage", "Books", "Travel", "Furniture", "Telecom")


@dataclass(frozen=True)
class Conversation:
    index: int
    tenant: int
    system: str
    users: tuple[str, ...]
    adapter: str | None  # X-Adapter-ID, or None: the base model

    @property
    def session(self) -> str:
        return f"conv-{self.index:04d}"


def clause(rng: random.Random) -> str:
    return f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)} {rng.choice(TAILS)}"


def count_tokens(tokenizer: Any, text: str) -> int:
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def system_prompt(tenant: int, tokens: int, tokenizer: Any) -> str:
    """Tenant `tenant`'s system prompt: seeded house rules, at least `tokens` tokens, distinct from its first words."""
    rng = random.Random(1000 + tenant)
    company = f"{rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} {tenant:02d}"
    parts = [f"You are the assistant of {company}. Answer briefly and follow these house rules."]
    count = count_tokens(tokenizer, parts[0])
    rule = 0
    while count < tokens:
        rule += 1
        text = clause(rng)
        parts.append(f"Rule {rule}: {text[0].upper()}{text[1:]}.")
        count += count_tokens(tokenizer, " " + parts[-1])
    return " ".join(parts)


def adapter_tenants(tenants: int, count: int) -> list[int]:
    """`count` tenants spread evenly over the popularity ranks (tenant 0 the most popular)."""
    return sorted({min(tenants - 1, int((i + 0.5) * tenants / count)) for i in range(count)}) if count else []


def build_stream(args: argparse.Namespace, systems: list[str], adapter_ids: list[str]) -> list[Conversation]:
    """The conversations in the order they start: one per tenant (while there are enough), the rest Zipf."""
    adapter_of = dict(zip(adapter_tenants(args.tenants, args.adapter_tenants), adapter_ids, strict=True))
    first = min(args.tenants, args.conversations)
    tenants = list(range(first)) + zipf_choices(args.tenants, args.conversations - first, seed=args.seed)
    random.Random(args.seed).shuffle(tenants)
    stream = []
    for c, tenant in enumerate(tenants):
        rng = random.Random(f"conversation-{c}")
        users = tuple(
            f"Conversation {c}, question {t + 1}: can you tell me whether {clause(rng)}, and whether {clause(rng)}?"
            for t in range(args.turns)
        )
        stream.append(Conversation(c, tenant, systems[tenant], users, adapter_of.get(tenant)))
    return stream


def distinct_tokens(stream: list[Conversation], tokenizer: Any, new_tokens: int) -> int:
    """About how many distinct prompt tokens the stream sends (what one engine caches to miss nothing)."""
    systems = {(c.system, c.adapter) for c in stream}  # an adapter's KV is its own
    total = sum(count_tokens(tokenizer, s) + TEMPLATE_TOKENS for s, _ in systems)
    for c in stream:
        total += sum(count_tokens(tokenizer, u) + new_tokens + 2 * TEMPLATE_TOKENS for u in c.users)
    return total


async def chat_turn(
    client: httpx.AsyncClient, conv: Conversation, messages: list[dict[str, str]], tokens: int
) -> tuple[str, float]:
    """One streamed turn: the answer's text and the time to its first content chunk (seconds)."""
    body = {"messages": messages, "max_tokens": tokens, "min_tokens": tokens, "temperature": 0, "stream": True}
    headers = {"X-Session-ID": conv.session}
    if conv.adapter is not None:
        headers["X-Adapter-ID"] = conv.adapter
    parts: list[str] = []
    first: float | None = None
    t0 = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{conv.session}: HTTP {r.status_code}: {(await r.aread()).decode()[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                raise RuntimeError(f"{conv.session}: error in the stream: {chunk['error']}")
            for choice in chunk.get("choices", []):
                text = (choice.get("delta") or {}).get("content") or ""
                if text:
                    if first is None:
                        first = time.perf_counter() - t0
                    parts.append(text)
    return "".join(parts), first if first is not None else time.perf_counter() - t0


async def drive(gateways: list[str], stream: list[Conversation], concurrency: int, tokens: int) -> list[float]:
    """Run every conversation, `concurrency` workers per gateway, turn t of conversation c through gateway
    (c + t) % len(gateways); every turn's TTFT in seconds."""
    ttfts: list[float] = []
    todo = list(stream)
    clients = [
        httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {KEY}"}, timeout=600) for url in gateways
    ]

    async def worker() -> None:
        while todo:
            conv = todo.pop(0)
            messages = [{"role": "system", "content": conv.system}]
            for t, user in enumerate(conv.users):
                messages.append({"role": "user", "content": user})
                answer, ttft = await chat_turn(clients[(conv.index + t) % len(clients)], conv, messages, tokens)
                messages.append({"role": "assistant", "content": answer})
                ttfts.append(ttft)

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency * len(gateways))))
    finally:
        for c in clients:
            await c.aclose()
    return ttfts


def engine_counters(urls: list[str]) -> list[dict[str, float]]:
    """Each engine's token counters (COUNTERS' keys) from its /metrics; a missing one is an error, not 0."""
    out = []
    for url in urls:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        missing = [name for name in COUNTERS.values() if not re.search(rf"^{name}[ {{]", text, re.MULTILINE)]
        if missing:
            raise RuntimeError(f"{url}/metrics has no {', '.join(missing)}")
        out.append({key: metric(text, name) for key, name in COUNTERS.items()})
    return out


def redis_keys(url: str, pattern: str) -> int:
    """How many keys of the Redis at `url` match `pattern`."""
    client = redis.Redis.from_url(url, socket_timeout=10)
    try:
        return sum(1 for _ in client.scan_iter(match=pattern, count=1000))
    finally:
        client.close()


def kv_capacity(url: str) -> int:
    """Tokens of KV the engine's pool holds now (free and reclaimable cached pages)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    blocks = metric(text, "loragate_engine_kv_blocks_free") + metric(text, "loragate_engine_kv_pages_cached")
    return int(blocks) * BLOCK_SIZE


def start_engine(
    port: int, pool_mb: int, adapter_dir: Path | None, log: Path, env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """One SmolLM2 engine on one thread with a `pool_mb` pool, serving the adapters of `adapter_dir` if any."""
    argv = ["engine", "--model", "smollm2", "--threads", "1", "--pool-mb", str(pool_mb), "--port", str(port)]
    argv += ["--log-level", "warning"]
    if adapter_dir is not None:
        argv += ["--adapter-dir", str(adapter_dir)]
    return loragate(argv, log, env)


def run_once(
    config: str,
    args: argparse.Namespace,
    stream: list[Conversation],
    adapter_dir: Path | None,
    engine_ports: list[int],
    env: dict[str, str],
) -> dict[str, Any]:
    """One configuration on fresh engines, gateways and Redis: its figures."""
    prefix, session, engine_count = CONFIGS[config]
    procs: list[subprocess.Popen[bytes]] = []
    logs = Path(tempfile.mkdtemp(prefix=f"prefix-routing-{config}-"))
    redis_server = RedisServer(logs / "redis")
    try:
        redis_server.start()
        engines = []
        for k, port in enumerate(engine_ports[:engine_count]):
            procs.append(start_engine(port, args.pool_mb, adapter_dir, logs / f"engine{k}.log", env))
            engines.append(f"http://127.0.0.1:{port}")
        policy = logs / "policy.yaml"
        policy.write_text(BENCH_TENANT + ADMISSION.format(prefix=prefix, session=session))
        gateway_procs, gateways = start_gateways(policy, engines, logs, env, redis_server.url)
        procs += gateway_procs
        for url, proc in zip([*engines, *gateways], procs, strict=True):
            wait_healthy(url, proc, timeout_s=300)
        time.sleep(2)  # the gateways poll the engines' GET /load every second: both known before the first turn
        capacity = [kv_capacity(url) for url in engines]
        before = engine_counters(engines)
        t0 = time.perf_counter()
        ttfts = asyncio.run(drive(gateways, stream, args.concurrency, args.new_tokens))
        wall = time.perf_counter() - t0
        after = engine_counters(engines)
        index_entries = redis_keys(redis_server.url, REDIS_PREFIX_KEYS)
    except BaseException:
        print(f"{config}: failed; logs in {logs}", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            stop(p, grace_s=60)
        redis_server.stop()
    delta = [{key: b[key] - a[key] for key in COUNTERS} for a, b in zip(before, after, strict=True)]
    total = {key: sum(d[key] for d in delta) for key in COUNTERS}
    work = [d["queried"] - d["hit"] + d["generated"] for d in delta]
    return {
        "hit_rate": total["hit"] / max(total["queried"], 1),
        "ttft_p50": percentile(ttfts, 0.5),
        "ttft_p99": percentile(ttfts, 0.99),
        "rps": len(ttfts) / wall,
        "tok_s": (total["prompt"] + total["generated"]) / wall,
        "wall": wall,
        "busier_share": max(work) / max(sum(work), 1),
        "queried_tokens": total["queried"],
        "hit_tokens": total["hit"],
        "generated_tokens": total["generated"],
        "work_per_engine": work,
        "kv_capacity_tokens": capacity,
        "redis_prefix_entries": index_entries,
    }


def print_row(name: str, r: dict[str, Any]) -> None:
    entries = r.get("redis_prefix_entries")
    print(
        f"{name:14} {100 * r['hit_rate']:8.1f}% {1e3 * r['ttft_p50']:9.0f} {1e3 * r['ttft_p99']:9.0f} "
        f"{r['rps']:7.2f} {r['tok_s']:8.0f} {r['wall']:7.1f} {100 * r['busier_share']:8.0f}%"
        + ("" if entries is None else f" {entries:>9}"),
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds (the order rotates each round)")
    ap.add_argument("--tenants", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=48, help="in all, across the tenants")
    ap.add_argument("--turns", type=int, default=4, help="turns per conversation")
    ap.add_argument("--concurrency", type=int, default=4, help="conversations in progress per gateway")
    ap.add_argument("--new-tokens", type=int, default=16, help="tokens of each answer (max_tokens = min_tokens)")
    ap.add_argument("--system-tokens", type=int, default=1000, help="tokens of each tenant's system prompt")
    ap.add_argument("--adapter-tenants", type=int, default=6, help="tenants served through an adapter each")
    ap.add_argument("--pool-mb", type=int, default=2048, help="each engine's --pool-mb")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--configs", default="load,prefix,single", help="of: " + ", ".join(CONFIGS))
    ap.add_argument("--json", type=Path, help="also write the figures here as one JSON object")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs):
        ap.error(f"--configs: a comma-separated list of {', '.join(CONFIGS)}")
    if not 0 <= args.adapter_tenants <= args.tenants:
        ap.error("--adapter-tenants: 0 to --tenants")

    model_dir = resolve_model("smollm2").path
    tokenizer = load_tokenizer(model_dir)
    adapter_dir: Path | None = None
    adapter_ids: list[str] = []
    if args.adapter_tenants:
        root = cache_root() / "bench-adapters"
        adapter_dir = scale_adapter_dir(make_w1_adapters(model_dir, root / "w1"), root, args.adapter_tenants)
        adapter_ids = sorted(p.name for p in adapter_dir.iterdir())[: args.adapter_tenants]
    systems = [system_prompt(k, args.system_tokens, tokenizer) for k in range(args.tenants)]
    stream = build_stream(args, systems, adapter_ids)
    per_tenant = [sum(c.tenant == k for c in stream) for k in range(args.tenants)]
    distinct = distinct_tokens(stream, tokenizer, args.new_tokens)
    workload = {
        "conversations_per_tenant": per_tenant,
        "adapter_tenants": adapter_tenants(args.tenants, args.adapter_tenants),
        "system_prompt_tokens": [count_tokens(tokenizer, s) for s in systems],
        "turns": len(stream) * args.turns,
        "distinct_prompt_tokens": distinct,
    }
    env = {**os.environ, "LORAGATE_BENCH_KEY": KEY, "PYTHONPATH": str(REPO)}
    print(
        f"{len(stream)} conversations x {args.turns} turns over {sum(n > 0 for n in per_tenant)} tenants "
        f"(conversations per tenant {per_tenant}; through an adapter: tenants {workload['adapter_tenants']}), system "
        f"prompts ~{args.system_tokens} tokens, {args.new_tokens} new tokens a turn, 2 gateways x {args.concurrency} "
        f"conversations at once, engines of 1 thread and a {args.pool_mb} MiB pool; the stream's distinct prompt "
        f"tokens ~{distinct}",
        flush=True,
    )
    print(
        f"{'config (round)':14} {'hit rate':>9} {'TTFT p50':>9} {'p99 (ms)':>9} {'req/s':>7} {'tok/s':>8} "
        f"{'wall s':>7} {'busier':>9} {'index':>9}"
    )
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for r in range(args.rounds):
        engine_ports = [free_port(), free_port()]  # the same engine URLs for every configuration of a round
        for config in configs[r % len(configs) :] + configs[: r % len(configs)]:
            result = run_once(config, args, stream, adapter_dir, engine_ports, env)
            runs[config].append(result)
            print_row(f"{config} ({r + 1})", result)
            if min(result["kv_capacity_tokens"]) < distinct:
                print(
                    f"  note: an engine's pool holds {min(result['kv_capacity_tokens'])} tokens, fewer than the "
                    f"stream's ~{distinct}: raise --pool-mb"
                )
    keys = [k for k, v in runs[configs[0]][0].items() if isinstance(v, float)]
    median = {c: {k: percentile([run[k] for run in rs], 0.5) for k in keys} for c, rs in runs.items()}
    print(f"medians of {args.rounds} round(s):")
    for config in configs:
        print_row(config, median[config])
    ratios: dict[str, float] = {}
    lines = []
    if "prefix" in median and "single" in median:
        ratios["hit_rate_prefix_over_single"] = median["prefix"]["hit_rate"] / max(median["single"]["hit_rate"], 1e-9)
        lines.append(f"hit rate prefix/single {ratios['hit_rate_prefix_over_single']:.2f} (target >= 0.9)")
    if "prefix" in median and "load" in median:
        ratios["ttft_p50_prefix_over_load"] = median["prefix"]["ttft_p50"] / median["load"]["ttft_p50"]
        ratios["ttft_p99_prefix_over_load"] = median["prefix"]["ttft_p99"] / median["load"]["ttft_p99"]
        ratios["throughput_prefix_over_load"] = median["prefix"]["tok_s"] / median["load"]["tok_s"]
        lines.append(f"TTFT p50 prefix/load {ratios['ttft_p50_prefix_over_load']:.2f} (target <= 0.6)")
        lines.append(f"p99 {ratios['ttft_p99_prefix_over_load']:.2f}")
        lines.append(f"throughput {ratios['throughput_prefix_over_load']:.2f}x")
    if "prefix" in median:
        ratios["busier_share_prefix"] = median["prefix"]["busier_share"]
        lines.append(f"busier engine under prefix {100 * ratios['busier_share_prefix']:.0f}% (target <= 60%)")
    if lines:
        print("; ".join(lines))
    print(
        "busier: the busier engine's share of the computed tokens (prompt tokens not found cached + generated); "
        f"index: keys {REDIS_PREFIX_KEYS} in the shared Redis at the end of the run"
    )
    if args.json:
        config_json = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        figures = {"config": config_json, "workload": workload, "runs": runs, "median": median, "ratios": ratios}
        args.json.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
