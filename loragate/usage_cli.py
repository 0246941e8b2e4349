"""`loragate usage`: the usage ledger of a running gateway (GET /admin/usage, gateway/usage.py), summed.

  loragate usage [--since WHEN] [--until WHEN] [--tenant ID] [--by tenant,adapter,day] [--format table|csv|json]

WHEN is an ISO 8601 date or date-time (UTC unless it says otherwise), a span back from now (`24h`, `7d`) or
epoch seconds; the default is this UTC month up to now. Each row has the `--by` keys plus `requests`,
`prompt_tokens` and `completion_tokens`; `--format json` prints the rows as a JSON list (what GET
/admin/usage answers). The gateway and the admin key are found as `loragate admin` finds them.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
import urllib.parse
from typing import Any

from loragate.admin_cli import AdminCallFailed, add_gateway_args, call, write_stdout

TOTALS = ("requests", "prompt_tokens", "completion_tokens")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "usage",
        help="token usage from a running gateway's ledger, summed by tenant, adapter, day, ...",
        description="Sum the usage ledger of a running gateway (admin key from the environment).",
    )
    add_gateway_args(p)
    p.add_argument("--since", help="from this time (default: the start of this UTC month)")
    p.add_argument("--until", help="up to this time (default: now)")
    p.add_argument("--tenant", help="only this tenant's requests")
    p.add_argument(
        "--by",
        default="tenant",
        help="comma-separated keys to sum by: tenant, adapter, version, rollout, priority, status, day, month "
        "(default: %(default)s; empty: one row of totals)",
    )
    p.add_argument("--format", choices=("table", "csv", "json"), default="table")


def render(rows: list[dict[str, Any]], by: list[str], fmt: str) -> str:
    columns = [*by, *TOTALS]
    if fmt == "json":
        return json.dumps(rows, indent=2) + "\n"
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.DictWriter(out, columns, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        return out.getvalue()
    cells = [columns] + [[str(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    numeric = [c in TOTALS for c in columns]
    lines = [
        "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(line, widths, numeric, strict=True)).rstrip()
        for line in cells
    ]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    by = [key.strip() for key in args.by.split(",") if key.strip()]
    query = {"by": ",".join(by)}
    for name in ("since", "until", "tenant"):
        if getattr(args, name) is not None:
            query[name] = getattr(args, name)
    try:
        rows = call(args, "GET", "/admin/usage?" + urllib.parse.urlencode(query), None, "loragate usage")
    except AdminCallFailed as exc:
        print(exc, file=sys.stderr)
        return exc.status
    write_stdout(render(rows, by, args.format))
    return 0
