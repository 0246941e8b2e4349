"""`loragate adapters ...`: the fleet's adapter catalog, through a running gateway's /admin/adapters
(gateway/adapter_admin.py).

  loragate adapters register ID --source URI [--revision R | --sha256 D] [--tenant T] [--size N]
  loragate adapters list [--tenant T]           id, version, state, source, the state on each engine (then
                                                each engine's detail: failure reason, last used, loads, evictions)
  loragate adapters show ID[@N]
  loragate adapters deprecate ID[@N] [--undo]
  loragate adapters delete ID[@N]
  loragate adapters digest DIR                  the content digest of a local adapter directory (no gateway)

`--json` prints the API's JSON instead of text. The gateway is `--url` (default $LORAGATE_URL), found as
`loragate admin` finds it. The key: `--api-key`, else the admin key from $LORAGATE_ADMIN_KEY (`--key-env`),
else $LORAGATE_API_KEY, a tenant's own key (a tenant whose policy entry says `publish: true` manages the ids
`<tenant>/<name>`). Prefer the environment: a command line is visible to other users of the machine.

`register` pins every version to a digest. With `--sha256` it registers what it is given (an https archive's
sha256 is required: only the publisher knows it). Without it (s3, hf and local sources) it fetches the adapter
once into a temporary directory, with the operator's own credentials (AWS_*, HF_TOKEN, ...), computes its
content digest and size (loragate_common/adapter_sources.py) and registers those; an hf source is pinned to the
commit its revision resolved to (`hf://org/repo@<commit>`), the revision asked for kept as `revision`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.parse
from dataclasses import replace
from pathlib import Path
from typing import Any

from loragate.admin_cli import AdminCallFailed, add_gateway_args, call, write_stdout
from loragate_common.adapter_kinds import describe
from loragate_common.adapter_sources import ADAPTER_FILES, Source, SourceError, content_digest, fetch, parse_source

PROG = "loragate adapters"
API_KEY_ENV = "LORAGATE_API_KEY"
ARCHIVE_KINDS = ("https", "http")
COMMANDS = ("register", "list", "show", "deprecate", "delete", "digest")


class UsageError(Exception):
    """A command that cannot be run as given (exit status 2)."""


def _common(p: argparse.ArgumentParser, *, top: bool) -> None:
    """--json and --api-key, accepted before the subcommand (`top`) and after it (never overriding)."""
    default: Any = False if top else argparse.SUPPRESS
    p.add_argument("--json", action="store_true", default=default, help="print the API's JSON")
    p.add_argument(
        "--api-key",
        default=None if top else argparse.SUPPRESS,
        help=f"a tenant's API key (prefer ${API_KEY_ENV}: a command line is visible to other users)",
    )
    if not top:
        p.add_argument("--url", default=argparse.SUPPRESS, help="the gateway's base URL (default: $LORAGATE_URL)")
        p.add_argument("--key-env", default=argparse.SUPPRESS, metavar="NAME", help="the admin key's variable")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "adapters",
        help="the fleet's adapter catalog: register, list, show, deprecate, delete",
        description="Manage the adapter catalog of a running gateway (admin key, or a publishing tenant's key, "
        "from the environment).",
    )
    add_gateway_args(p)
    _common(p, top=True)
    actions = p.add_subparsers(dest="adapters_command", required=True, metavar="{" + ",".join(COMMANDS) + "}")
    register = actions.add_parser("register", help="register a new version of an adapter id")
    register.add_argument("id", help="`name` or `tenant/name`")
    register.add_argument(
        "--source", required=True, metavar="URI", help="s3://..., hf://org/repo[@rev], https://..., a path"
    )
    pin = register.add_mutually_exclusive_group()
    pin.add_argument("--revision", metavar="R", help="an hf source's revision (branch, tag or commit)")
    pin.add_argument("--sha256", metavar="D", help="the digest (required for https): skips fetching it here")
    register.add_argument("--tenant", metavar="T", help="the tenant that owns the id (default: its namespace)")
    register.add_argument(
        "--size", type=int, metavar="N", help="bytes of the two adapter files (computed when fetched)"
    )
    register.add_argument("--max-mb", type=int, default=1024, help="largest adapter fetched to compute its digest")
    register.add_argument("--timeout-s", type=float, default=300.0, help="longest the fetch may take")
    listing = actions.add_parser("list", help="every adapter id, its versions and their state on each engine")
    listing.add_argument("--tenant", metavar="T", help="only this tenant's ids")
    show = actions.add_parser("show", help="one id (or ID@N): its versions and their state on each engine")
    show.add_argument("id", metavar="ID[@N]")
    deprecate = actions.add_parser("deprecate", help="deprecate an id or one version (ID@N)")
    deprecate.add_argument("id", metavar="ID[@N]")
    deprecate.add_argument("--undo", action="store_true", help="take the deprecation back")
    delete = actions.add_parser("delete", help="delete an id (every version) or one version (ID@N)")
    delete.add_argument("id", metavar="ID[@N]")
    digest = actions.add_parser("digest", help="print the content digest (and size) of a local adapter directory")
    digest.add_argument("dir", type=Path, metavar="DIR")
    for sub_parser in (register, listing, show, deprecate, delete, digest):
        _common(sub_parser, top=False)


# ---- talking to the gateway ----


def _api(args: argparse.Namespace, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
    """admin_cli.call with the key this command uses: --api-key, the admin key, or $LORAGATE_API_KEY."""
    if args.api_key:
        os.environ[API_KEY_ENV] = args.api_key  # this process's own environment, where call() reads keys
        key_env = API_KEY_ENV
    elif os.environ.get(args.key_env, "").strip():
        key_env = args.key_env
    elif os.environ.get(API_KEY_ENV, "").strip():
        key_env = API_KEY_ENV
    else:
        raise UsageError(f"set {args.key_env} to the gateway's admin key (or {API_KEY_ENV} to a publishing tenant's)")
    gateway = argparse.Namespace(url=args.url, key_env=key_env)
    return call(gateway, method, path, body, PROG)


def _path(ref: str) -> str:
    return "/admin/adapters/" + urllib.parse.quote(ref, safe="")


# ---- register ----


def _registration(args: argparse.Namespace) -> dict[str, Any]:
    """The POST /admin/adapters body: as given with --sha256, else fetched here to pin its digest."""
    try:
        source = parse_source(args.source)
        if args.revision is not None:
            if source.kind != "hf":
                raise UsageError("--revision: only an hf:// source has revisions")
            if source.revision is not None:
                raise UsageError("--revision: the source names a revision already (hf://org/repo@rev)")
            source = parse_source(str(replace(source, revision=args.revision)))
    except SourceError as exc:
        raise UsageError(f"--source: {exc}") from None
    body: dict[str, Any] = {"id": args.id}
    if args.tenant is not None:
        body["tenant"] = args.tenant
    if args.sha256 is not None:
        size = {"size": args.size} if args.size is not None else {}
        return {**body, "source": str(source), "sha256": args.sha256, **size}
    if source.kind in ARCHIVE_KINDS:
        raise UsageError(f"--sha256: required for an {source.kind} source (the archive's sha256, as sha256sum prints)")
    return {**body, **_fetched(args, source)}


def _fetched(args: argparse.Namespace, source: Source) -> dict[str, Any]:
    """Fetch `source` once into a temporary directory: its pinned source, content digest, size, revision."""
    print(f"{PROG}: fetching {source} to compute its digest ...", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="loragate-adapter-") as tmp:
        fetched = fetch(
            source, Path(tmp), sha256=None, size=args.size, max_bytes=args.max_mb << 20, deadline_s=args.timeout_s
        )
    out: dict[str, Any] = {"source": str(source), "sha256": fetched.digest, "size": fetched.size}
    if source.kind == "hf" and fetched.revision is not None:  # pinned to the commit the revision resolved to
        out["source"] = str(replace(source, revision=fetched.revision))
        if source.revision is not None:
            out["revision"] = source.revision
    return out


# ---- output ----


def _engine_name(url: str) -> str:
    return url.split("://", 1)[-1]


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() + "\n" for row in rows)


def _plural(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def engine_detail(card: dict[str, Any]) -> str:
    """A version's state on one engine in words: `device, last used 2026-...Z, 3 loads, 1 eviction`, or
    `failed: <the reason>`."""
    parts = [str(card.get("state", ""))]
    if card.get("error"):
        parts[0] += f": {card['error']}"
    last_used = card.get("last_used")
    if isinstance(last_used, int | float) and not isinstance(last_used, bool):
        parts.append("last used " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(last_used)))
    for key, word in (("loads", "load"), ("evictions", "eviction")):
        if isinstance(card.get(key), int) and not isinstance(card.get(key), bool):
            parts.append(_plural(card[key], word))
    return ", ".join(parts)


def _details(ref: str, engines: dict[str, Any]) -> list[str]:
    """A line per engine that holds, fetches or failed `ref` (those that do not: the table says so)."""
    return [
        f"  {ref} on {_engine_name(url)}: {engine_detail(card)}\n"
        for url, card in engines.items()
        if isinstance(card, dict) and card.get("state") not in (None, "", "not loaded")
    ]


def render_list(answer: dict[str, Any]) -> str:
    """The catalog as a table: a row per version (its kind, e.g. `DoRA r16`, once an engine has read its files), a
    column per engine; then what each version adapts, and for each version an engine holds, fetches or failed to
    fetch, that engine's detail (the reason, last used, loads, evictions)."""
    engines = [e["url"] for e in answer.get("engines", [])]
    rows = [["ID", "VERSION", "STATE", "KIND", "SOURCE", *(_engine_name(u) for u in engines)]]
    details: list[str] = []
    kinds: list[str] = []  # what each version is, once an engine has read its files
    for entry in answer["data"]:
        for v in entry["versions"]:
            states = [str(v.get("engines", {}).get(u, {}).get("state", "")) for u in engines]
            kind = describe(v.get("adapter"), modules=False) or "-"
            rows.append([entry["id"], str(v["version"]), v["state"], kind, v["source"], *states])
            if v.get("adapter"):
                kinds.append(f"  {entry['id']}@{v['version']}: {describe(v['adapter'])}\n")
            details += _details(f"{entry['id']}@{v['version']}", v.get("engines", {}))
    if len(rows) == 1:
        return "no adapters in the catalog\n"
    out = _table(rows) + ("what each is:\n" + "".join(kinds) if kinds else "")
    return out + ("on the engines:\n" + "".join(details) if details else "")


def render_show(entry: dict[str, Any]) -> str:
    head = f"{entry['id']}  tenant: {entry['tenant'] or '-'}  current: {entry['current']}"
    lines = [head + ("  (deprecated)" if entry["deprecated"] else "") + "\n"]
    rows = [["VERSION", "STATE", "SIZE", "SHA256", "PUBLISHED", "BY", "SOURCE"]]
    on_engines = []
    for v in entry["versions"]:
        size = "" if v["size"] is None else str(v["size"])
        rows.append(
            [str(v["version"]), v["state"], size, v["sha256"][:12], v["published_at"], v["published_by"], v["source"]]
        )
        for url, card in v.get("engines", {}).items():
            on_engines.append(f"  @{v['version']} on {_engine_name(url)}: {engine_detail(card)}\n")
    return "".join(lines) + _table(rows) + ("engines:\n" + "".join(on_engines) if on_engines else "")


def _done(answer: dict[str, Any]) -> str:
    action, target = answer["action"], answer.get("ref") or answer.get("target")
    if not answer["changed"]:
        return f"{target}: already so (nothing changed)\n"
    verb = {"register": "registered", "delete": "deleted"}.get(action)
    if verb is None:
        verb = "deprecated" if answer.get("deprecated", True) else "no longer deprecated"
    return f"{verb} {target}\n"


# ---- the commands ----


def digest(directory: Path) -> dict[str, Any]:
    size = sum((directory / name).stat().st_size for name in ADAPTER_FILES)
    return {"path": str(directory), "sha256": content_digest(directory), "size": size}


def _run(args: argparse.Namespace) -> tuple[Any, str]:
    """The command's JSON answer and its text form."""
    command = args.adapters_command
    if command == "digest":
        found = digest(args.dir)
        return found, f"{found['sha256']}  {found['size']} bytes\n"
    if command == "register":
        answer = _api(args, "POST", "/admin/adapters", _registration(args))
        return answer, _done(answer)
    if command == "list":
        query = "?" + urllib.parse.urlencode({"tenant": args.tenant}) if args.tenant is not None else ""
        answer = _api(args, "GET", "/admin/adapters" + query)
        return answer, render_list(answer)
    if command == "show":
        answer = _api(args, "GET", _path(args.id))
        return answer, render_show(answer)
    if command == "deprecate":
        answer = _api(args, "POST", _path(args.id) + "/deprecate", {"deprecated": not args.undo})
        return answer, _done(answer)
    answer = _api(args, "DELETE", _path(args.id))
    return answer, _done(answer)


def run(args: argparse.Namespace) -> int:
    try:
        answer, text = _run(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except AdminCallFailed as exc:
        print(exc, file=sys.stderr)
        return exc.status
    except (SourceError, OSError) as exc:
        print(f"{PROG}: {args.adapters_command}: {exc}", file=sys.stderr)
        return 1
    write_stdout(json.dumps(answer, indent=2) + "\n" if args.json else text)
    return 0
