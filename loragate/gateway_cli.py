"""`loragate gateway`: tenant auth, rate limits, admission and routing in front of engines (gateway/)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loragate.args import (
    SubParsers,
    add_connection_args,
    add_logging_args,
    connection_limits,
    port,
    positive,
    seconds,
    setup_logging,
)


def add_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve the gateway in front of engine replicas",
        description="Tenant auth, rate limits, admission and routing in front of engines.",
    )
    p.add_argument("--policy", required=True, type=Path, help="the policy YAML file (format: docs/reference.md)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="[KIND=]URL[,agent=PORT]",
        help="an engine's base URL, e.g. http://127.0.0.1:8001 (repeat for more replicas); KIND is loragate "
        "(the default) or vllm, e.g. vllm=http://127.0.0.1:8000,agent=8002 (a vLLM server and its "
        "`loragate vllm-agent` on port 8002 of the same host)",
    )
    p.add_argument(
        "--upstream-dns",
        action="append",
        default=[],
        metavar="[KIND=]NAME:PORT[,agent=PORT]",
        help="also serve from every address NAME resolves to (e.g. a Kubernetes headless Service), "
        "as http://ADDRESS:PORT, re-resolved every --dns-interval-s (repeat for more names, e.g. one per kind)",
    )
    p.add_argument("--dns-interval-s", type=seconds, default=5.0, help="how often --upstream-dns is resolved again")
    p.add_argument(
        "--redis",
        metavar="URL",
        help="share rate limits, budgets, the usage ledger, rollouts and operator overrides across gateway "
        "replicas through this Redis (default: in-process)",
    )
    p.add_argument(
        "--usage-retention",
        type=positive,
        default=1_000_000,
        metavar="N",
        help="usage records the shared ledger keeps, about (oldest trimmed first; export them before)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--max-body-mb", type=positive, default=1, help="largest request body, in MiB")
    p.add_argument(
        "--clear-overrides",
        action="store_true",
        help="lift every operator override (suspended tenants, drained upstreams) at start, for "
        "every replica sharing --redis",
    )
    add_connection_args(p)
    add_logging_args(p)


def run(args: argparse.Namespace) -> int:
    from gateway.policy import PolicyError, load_policy
    from gateway.serving import serve

    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(f"loragate gateway: error: {exc}", file=sys.stderr)
        return 2
    from gateway.discovery import DnsUpstreams
    from gateway.engine_kinds import parse_upstream

    try:
        for text in args.upstream:
            parse_upstream(text)
        discovery = [DnsUpstreams.from_target(text, interval_s=args.dns_interval_s) for text in args.upstream_dns]
    except ValueError as exc:
        print(f"loragate gateway: error: {exc}", file=sys.stderr)
        return 2
    if not args.upstream and not discovery:
        print(
            "loragate gateway: error: name the engines with --upstream URL or --upstream-dns NAME:PORT", file=sys.stderr
        )
        return 2
    setup_logging(args.log_level)
    try:
        serve(
            args.policy,
            args.upstream,
            args.redis,
            args.host,
            args.port,
            policy=policy,
            max_body_bytes=args.max_body_mb << 20,
            log_level=args.log_level,
            limits=connection_limits(args),
            log_probes=args.log_probes,
            discovery=discovery,
            clear_overrides=args.clear_overrides,
            usage_retention=args.usage_retention,
        )
    except PolicyError as exc:  # e.g. two tenants sharing a key through env: references
        print(f"loragate gateway: error: {exc}", file=sys.stderr)
        return 2
    return 0
