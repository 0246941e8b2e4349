"""The JSON Schema of a policy file, for editors, CI linters and `loragate policy schema`.

The schema is derived from the pydantic models in gateway/policy.py, so it cannot drift from what the
gateway accepts. pydantic cannot see the checks that live in AfterValidators (key references, sticky keys,
header names, variant adapter ids, weights that sum to more than 0), so the cheap ones are added back
here as `pattern` and `contains` keywords. What a schema cannot say (unique tenant ids and rollout names, a
key hash shared by two tenants, an adapter listed twice in one rollout) is left to `loragate policy
check`, which runs the real parser: the schema is a helpful first line, never the authority.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from gateway.policy import Policy

__all__ = ["DRAFT", "policy_json_schema", "render_policy_json_schema"]

DRAFT = "https://json-schema.org/draft/2020-12/schema"
TITLE = "loragate gateway policy file (version 1)"

# The same languages as gateway/policy.py's regexes, anchored, in ECMA-262 syntax (which JSON Schema uses).
_KEY_REF = r"^(sha256:[0-9a-f]{64}|env:[A-Za-z_][A-Za-z0-9_]*)$"
_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"  # an RFC 9110 token: what an HTTP header name may be
_STICKY_KEY = rf"^(tenant|header:{_TOKEN})$"
_HEADER_NAME = rf"^{_TOKEN}$"
_SESSION_KEY = rf"^(none|body:user|header:{_TOKEN})$"
# One adapter id: one segment or two joined by '/' (a catalog id, `tenant/name`), each without glob characters,
# not '.' or '..', without leading or trailing whitespace; `@N` (a catalog version) is part of the last.
_SEGMENT = r"(?!\.\.?(?:/|$))[^\s*?\[\]/](?:[^*?\[\]/]*[^\s*?\[\]/])?"
_ADAPTER_ID = rf"^{_SEGMENT}(?:/{_SEGMENT})?$"


def policy_json_schema() -> dict[str, Any]:
    """The policy file's JSON Schema (Draft 2020-12) as a fresh dict."""
    schema = copy.deepcopy(Policy.model_json_schema())
    defs = schema["$defs"]
    _string_items(schema["properties"]["admin_keys"])["pattern"] = _KEY_REF
    _string_items(defs["Tenant"]["properties"]["api_keys"])["pattern"] = _KEY_REF
    rollout = defs["Rollout"]["properties"]
    _string_branch(rollout["sticky_key"])["pattern"] = _STICKY_KEY
    _string_branch(rollout["override_header"])["pattern"] = _HEADER_NAME
    # Weights are each >= 0, so "they sum to more than 0" is "at least one is more than 0".
    rollout["variants"]["contains"] = {"properties": {"weight": {"exclusiveMinimum": 0}}, "required": ["weight"]}
    _string_branch(defs["Variant"]["properties"]["adapter"])["pattern"] = _ADAPTER_ID
    _string_branch(defs["Admission"]["properties"]["session_key"])["pattern"] = _SESSION_KEY
    schema["title"] = TITLE
    schema["description"] = (
        "Tenants, API keys, limits, rollouts, admission and breaker settings for the "
        "loragate gateway. `loragate policy check FILE` runs the full validation."
    )
    return {"$schema": DRAFT, **schema}


def render_policy_json_schema() -> str:
    """The schema as `loragate policy schema` prints it (and policies/schema.json stores it)."""
    return json.dumps(policy_json_schema(), indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _string_items(array_schema: dict[str, Any]) -> dict[str, Any]:
    """The item schema of an array-of-strings property."""
    items: dict[str, Any] = array_schema["items"]
    if items.get("type") != "string":
        raise LookupError(f"expected an array of strings, got items {items!r}")
    return items


def _string_branch(prop: dict[str, Any]) -> dict[str, Any]:
    """The string schema of a property that is a string or `anyOf` [string, null]."""
    if prop.get("type") == "string":
        return prop
    branch: dict[str, Any]
    for branch in prop.get("anyOf", ()):
        if branch.get("type") == "string":
            return branch
    raise LookupError(f"expected a string property, got {prop!r}")
