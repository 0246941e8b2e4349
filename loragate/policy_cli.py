"""`loragate policy`: `check FILE...` runs the gateway's own parser over policy files (so CI can refuse a bad file
before a gateway ever reloads it); `schema` prints their JSON Schema for editors and linters."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loragate.args import SubParsers


def add_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "policy",
        help="check policy files, print their JSON Schema",
        description="Work with gateway policy files (docs/reference.md) offline.",
    )
    actions = p.add_subparsers(dest="policy_command", required=True, metavar="{check,schema}")
    check = actions.add_parser(
        "check",
        help="validate policy files the way the gateway loads them",
        description="Validate policy files with the gateway's own parser; exit 1 if any is invalid.",
    )
    check.add_argument("files", nargs="+", type=Path, metavar="FILE", help="a policy YAML file")
    actions.add_parser(
        "schema",
        help="print the policy file's JSON Schema (Draft 2020-12)",
        description="Print the policy file's JSON Schema (Draft 2020-12) to stdout.",
    )


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _check_policy_file(path: Path) -> str:
    """One file's `ok:` line; raises PolicyError naming the file and the key at fault."""
    from gateway.policy import read_policy

    policy, digest = read_policy(path)
    return (
        f"ok: {path} ({_plural(len(policy.tenants), 'tenant')}, "
        f"{_plural(len(policy.rollouts), 'rollout')}, sha256 {digest[:12]})"
    )


def run(args: argparse.Namespace) -> int:
    if args.policy_command == "schema":
        from gateway.policy_schema import render_policy_json_schema

        sys.stdout.write(render_policy_json_schema())
        return 0
    from gateway.policy import PolicyError

    failed = False
    for path in args.files:  # every file, so one run reports every problem
        try:
            print(_check_policy_file(path), flush=True)
        except PolicyError as exc:
            print(f"loragate policy check: error: {exc}", file=sys.stderr, flush=True)
            failed = True
    return 1 if failed else 0
