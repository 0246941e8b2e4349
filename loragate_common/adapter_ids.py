"""Adapter ids and the adapter a request names, one set of rules for the gateway (its catalog, policy and request
path: gateway/adapter_catalog.py, gateway/policy.py, gateway/generate.py) and the engine (what it registers and
serves: engine/lora/peft_config.py, engine/entrypoints/server.py).

  id      `name` or `tenant/name`: each segment [A-Za-z0-9._-]+, not starting with '.', without '..', at most
          128 characters in all
  ref     `ID` or `ID@N`, N a positive integer: version N of ID

`requested_adapter` reads the adapter a request names: `X-Adapter-ID` (once at most), else the body's `model`.
Every id and ref comes from a client or a publisher: these checks are the only way one enters the catalog or an
engine.
"""

from __future__ import annotations

import re
from typing import Any

from loragate_common.errors import bad_request, shown

MAX_ID_CHARS = 128
_SEGMENT_RE = re.compile(r"[A-Za-z0-9._-]+")
_VERSION_RE = re.compile(r"[1-9][0-9]{0,17}")
ID_RULES = (
    "`name` or `tenant/name`, each of letters, digits, '.', '_' and '-', not starting with '.', without '..', "
    f"at most {MAX_ID_CHARS} characters"
)


def id_problem(value: str) -> str | None:
    """Why `value` is not a catalog id (None: it is one)."""
    if not 1 <= len(value) <= MAX_ID_CHARS:
        return f"must be 1 to {MAX_ID_CHARS} characters"
    segments = value.split("/")
    if len(segments) > 2:
        return "at most one '/' (tenant/name)"
    for segment in segments:
        if _SEGMENT_RE.fullmatch(segment) is None or segment.startswith(".") or ".." in segment:
            return f"must be {ID_RULES}"
    return None


def check_id(value: Any, field: str = "id") -> str:
    """`value` if it is a catalog id, else 400 naming `field`."""
    if not isinstance(value, str):
        raise bad_request(f"{field}: must be a string ({ID_RULES})")
    problem = id_problem(value)
    if problem is not None:
        raise bad_request(f"{field}: invalid adapter id {shown(value)}: {problem}")
    return value


def split_ref(text: str) -> tuple[str, int | None] | None:
    """`ID` -> (ID, None), `ID@N` -> (ID, N); None when `text` is neither."""
    name, at, version = text.rpartition("@")
    if not at:
        return (text, None) if id_problem(text) is None else None
    if _VERSION_RE.fullmatch(version) is None or id_problem(name) is not None:
        return None
    return name, int(version)


def base_id(name: str) -> str:
    """The id a name refers to without its version (what tenants' globs are checked against)."""
    ref = split_ref(name)
    return ref[0] if ref is not None else name


def ref_problem(value: str) -> str | None:
    """Why `value` is not `ID` or `ID@N` (None: it is one)."""
    if split_ref(value) is not None:
        return None
    name, at, _ = value.rpartition("@")
    problem = id_problem(name if at else value)
    return problem if problem is not None else "a version is `ID@N` with N a positive integer"


def requested_adapter(header_values: list[str], model: str | None) -> str:
    """The adapter a request names, stripped ("" for none): its `X-Adapter-ID` header (`header_values`, every copy
    the request sent) wins over the body's `model`. 400 when the header is given more than once. Whether the name is
    an adapter, the base model or a rollout is the caller's to say."""
    if len(header_values) > 1:
        raise bad_request("X-Adapter-ID: given more than once; name one adapter")
    return (header_values[0] if header_values else "").strip() or (model or "").strip()


def check_ref(value: str, field: str = "id") -> tuple[str, int | None]:
    """`ID` or `ID@N`, else 400 naming `field`."""
    ref = split_ref(value)
    if ref is not None:
        return ref
    name, at, _ = value.rpartition("@")
    check_id(name if at else value, field)  # raises, unless only the version is wrong
    raise bad_request(f"{field}: {shown(value)}: a version is `ID@N` with N a positive integer")
