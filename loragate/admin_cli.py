"""`loragate admin ...`: the operator actions of a running gateway's admin API (gateway/admin.py), from a shell.

  loragate admin status                               the state: rollouts, upstreams, queues, tenants, overrides
  loragate admin rollout NAME pause|resume|promote|rollback|reset
  loragate admin upstream drain|undrain|reset-breaker URL
  loragate admin tenant ID suspend [--reason TEXT] | resume
  loragate admin overrides clear
  loragate admin reload

The gateway is `--url` (default $LORAGATE_URL, else http://127.0.0.1:8000); the admin key is read from the
environment variable `--key-env` names (default LORAGATE_ADMIN_KEY), never from the command line, where
other users could read it in the process list. The answer's JSON goes to stdout; an error's message goes
to stderr with exit status 1 (2 for a usage error, such as no key). `X-Loragate-Actor` carries the login
name, so the gateway's action log says who it was as well as which key.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

ROLLOUT_ACTIONS = ("pause", "resume", "promote", "rollback", "reset")
UPSTREAM_ACTIONS = ("drain", "undrain", "reset-breaker")
DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 30.0


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "admin",
        help="operator actions on a running gateway (admin key from the environment)",
        description="Steer a running gateway through its admin API: rollouts, upstreams, "
        "tenants. The admin key is read from the environment (--key-env).",
    )
    add_gateway_args(p)
    actions = p.add_subparsers(
        dest="admin_command", required=True, metavar="{status,rollout,upstream,tenant,overrides,reload}"
    )
    actions.add_parser("status", help="print GET /admin/policy")
    rollout = actions.add_parser("rollout", help="pause, resume, promote, roll back or reset a rollout")
    rollout.add_argument("name")
    rollout.add_argument("action", choices=ROLLOUT_ACTIONS)
    upstream = actions.add_parser("upstream", help="drain or undrain an engine, or reset its breaker")
    upstream.add_argument("action", choices=UPSTREAM_ACTIONS)
    upstream.add_argument("upstream_url", metavar="URL", help="the upstream's URL, as GET /admin/policy lists it")
    tenant = actions.add_parser("tenant", help="suspend or resume a tenant")
    tenant.add_argument("id")
    tenant.add_argument("action", choices=("suspend", "resume"))
    tenant.add_argument("--reason", help="why (shown to the tenant in its 403 answers)")
    overrides = actions.add_parser("overrides", help="lift every suspension and drain")
    overrides.add_argument("action", choices=("clear",))
    actions.add_parser("reload", help="reload the policy file (starts rollouts afresh, lifts overrides)")


def add_gateway_args(p: argparse.ArgumentParser) -> None:
    """--url and --key-env: how every admin command finds the gateway and its admin key."""
    p.add_argument(
        "--url",
        default=os.environ.get("LORAGATE_URL", DEFAULT_URL),
        help="the gateway's base URL (default: $LORAGATE_URL, else %(default)s)",
    )
    p.add_argument(
        "--key-env",
        default="LORAGATE_ADMIN_KEY",
        metavar="NAME",
        help="the environment variable holding the admin key (default: %(default)s)",
    )


class AdminCallFailed(Exception):
    """The call did not get an answer: the message for stderr, and the exit status."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def call(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None, prog: str) -> Any:
    """The admin API's JSON answer to `method path` on the gateway `args.url`, with the key `args.key_env`
    names; AdminCallFailed (status 2 without a key, 1 for an error answer or no gateway)."""
    key = os.environ.get(args.key_env, "").strip()
    if not key:
        raise AdminCallFailed(f"{prog}: error: set {args.key_env} to the gateway's admin key", 2)
    headers = {"Authorization": f"Bearer {key}", "Accept": "application/json"}
    try:
        headers["X-Loragate-Actor"] = getpass.getuser()
    except (KeyError, OSError):  # no login name (a container with an unnamed uid): the key's fingerprint only
        pass
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    request = urllib.request.Request(args.url.rstrip("/") + path, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        try:
            message = json.load(exc)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = exc.reason
        raise AdminCallFailed(f"{prog}: {method} {path}: {exc.code} {message}", 1) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise AdminCallFailed(f"{prog}: cannot reach the gateway at {args.url}: {exc}", 1) from None


def write_stdout(text: str) -> None:
    """Print `text`; a reader that went away (`... | head`) is not an error."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _request(args: argparse.Namespace) -> tuple[str, str, dict[str, Any] | None]:
    """(method, path, JSON body) for the parsed command."""
    command = args.admin_command
    if command == "status":
        return "GET", "/admin/policy", None
    if command == "rollout":
        return "POST", f"/admin/rollouts/{urllib.parse.quote(args.name, safe='')}/{args.action}", None
    if command == "upstream":
        return "POST", f"/admin/upstreams/{args.action}", {"url": args.upstream_url}
    if command == "tenant":
        body = {"reason": args.reason} if args.action == "suspend" and args.reason else None
        return "POST", f"/admin/tenants/{urllib.parse.quote(args.id, safe='')}/{args.action}", body
    if command == "overrides":
        return "POST", "/admin/overrides/clear", None
    return "POST", "/admin/reload", None


def run(args: argparse.Namespace) -> int:
    method, path, body = _request(args)
    try:
        answer = call(args, method, path, body, "loragate admin")
    except AdminCallFailed as exc:
        print(exc, file=sys.stderr)
        return exc.status
    write_stdout(json.dumps(answer, indent=2) + "\n")
    return 0
