"""Open-loop overload: what a gateway in front of two engines serves when several times more requests arrive than
it can serve, by priority band, and how fast it answers them and refuses the rest.

The stack of the fault suite (tests/reliability/stack.py: two `loragate engine` processes on tiny-random with
PEFT adapters, one `loragate gateway` with 4 in flight per engine and 8 queued, Redis with `--redis`), all on
127.0.0.1. First its capacity: requests per second when kept full (a closed loop at what it admits, 16 at once).
Then `--factor` (3) times that rate for `--seconds` (3) from clients that do not slow down when it does (an open
loop), mixed: 5% critical (acme, an acme adapter or the base model), 35% standard (globex), 60% sheddable
(initech), seeded. Every request is 16 greedy tokens of the same prompt; each 200 is compared with PEFT's own
greedy text for its adapter.

Reported: the capacity; per band, requests sent and the fraction served; refusals by status and reason; answer
latency p50/p99 of the served and the refused; whole answers that never came (hangs, resets) and served texts that
were wrong (both should be 0). These are figures of this machine's speed, so they are measured here rather than
asserted in a test: tests/reliability/test_overload.py checks the admission rules under overload step by step,
whatever the machine's speed.

    python bench/overload.py [--factor 3] [--seconds 3] [--seed 11] [--redis] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests"), str(REPO / "tests" / "reliability")]

from engine.model.sources import resolve_model  # noqa: E402
from loragate_common.stats import percentile  # noqa: E402

# The fault suite's helpers (tests/ is not a package: mypy, run on bench/, does not see them).
from rawhttp import Answer, gather_tally, open_loop, post_json  # type: ignore[import-not-found]  # noqa: E402
from redis_server import start_redis  # type: ignore[import-not-found]  # noqa: E402
from stack import GREEDY, PROMPT, Stack, auth, build_adapters, reference_texts  # type: ignore[import-not-found]  # noqa: E402

ADMITTED = 16  # 2 engines x 4 in flight + 8 queued (stack.policy_yaml's defaults)
BANDS = ("critical", "standard", "sheddable")


def capacity(stack: Stack) -> float:
    """Requests per second the stack serves when kept full (a closed loop at what it admits)."""
    call = lambda: post_json(stack.url, "/v1/completions", {"prompt": PROMPT, **GREEDY}, auth("globex"))  # noqa: E731
    start = time.monotonic()
    tally = asyncio.run(gather_tally([call] * (4 * ADMITTED), concurrency=ADMITTED))
    if tally.by_status() != {200: 4 * ADMITTED} or tally.failures:
        raise SystemExit(f"the stack failed at its own capacity: {tally.by_status()}, {tally.failures[:3]}")
    return len(tally.answers) / (time.monotonic() - start)


def plan(count: int, seed: int) -> list[tuple[str, str, str | None]]:
    """(tenant, priority, adapter) per request: 5% critical (acme), 35% standard, 60% sheddable."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        roll = rng.random()
        if roll < 0.05:
            out.append(("acme", "critical", rng.choice(["acme-a", "acme-b", None])))
        elif roll < 0.4:
            out.append(("globex", "standard", rng.choice(["globex-a", None])))
        else:
            out.append(("initech", "sheddable", rng.choice(["acme-a", "globex-a", None])))
    return out


def overload(stack: Stack, requests: list[tuple[str, str, str | None]], rate: float) -> Any:
    def call(tenant: str, priority: str, adapter: str | None) -> Callable[[], Awaitable[Answer]]:
        headers = {**auth(tenant), "X-Priority": priority, **({"X-Adapter-ID": adapter} if adapter else {})}
        body = {"prompt": PROMPT, **GREEDY}
        return lambda: post_json(stack.url, "/v1/completions", body, headers, tag=(tenant, priority, adapter))

    return asyncio.run(open_loop([call(*r) for r in requests], rate))


def summary(tally: Any, requests: list[tuple[str, str, str | None]], references: dict[str | None, str]) -> dict:
    sent = Counter(priority for _, priority, _ in requests)
    served = Counter(a.tag[1] for a in tally.answers if a.status == 200)
    refusals = Counter(f"{a.status} {a.headers.get('x-loragate-reason')}" for a in tally.answers if a.status != 200)
    wrong = sum(1 for a in tally.answers if a.status == 200 and a.json()["choices"][0]["text"] != references[a.tag[2]])

    def latency(answers: list[Answer]) -> dict[str, float | None]:
        times = [a.elapsed_s for a in answers]
        return {
            "p50_s": round(percentile(times, 0.5), 3) if times else None,
            "p99_s": round(percentile(times, 0.99), 3) if times else None,
        }

    return {
        "sent": len(requests),
        "bands": {
            band: {"sent": sent[band], "served_fraction": round(served[band] / sent[band], 3) if sent[band] else None}
            for band in BANDS
        },
        "refusals": dict(sorted(refusals.items())),
        "served_latency": latency([a for a in tally.answers if a.status == 200]),
        "refused_latency": latency([a for a in tally.answers if a.status != 200]),
        "no_whole_answer": len(tally.failures),
        "wrong_texts": wrong,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--factor", type=float, default=3.0, help="arrival rate as a multiple of the capacity")
    parser.add_argument("--seconds", type=float, default=3.0, help="how long arrivals go on")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--redis", action="store_true", help="share limits through a real redis-server")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="loragate-overload-") as tmp_name:
        tmp = Path(tmp_name)
        base = resolve_model("tiny-random").path
        adapters = build_adapters(base, tmp / "adapters")
        references = reference_texts(base, adapters)
        redis = start_redis(tmp / "redis") if args.redis else None
        (tmp / "stack").mkdir()
        stack = Stack(tmp / "stack", adapters, redis=redis).start()
        try:
            rps = capacity(stack)
            rate = args.factor * rps
            requests = plan(int(rate * args.seconds), args.seed)
            tally = overload(stack, requests, rate)
            stack.wait_idle(timeout_s=120)
        finally:
            stack.stop()
            if redis is not None:
                redis.stop()
    figures = {
        "config": {"factor": args.factor, "seconds": args.seconds, "seed": args.seed, "redis": args.redis},
        "capacity_rps": round(rps, 2),
        "offered_rps": round(rate, 2),
        **summary(tally, requests, references),
    }
    print(json.dumps(figures, indent=2))
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
