"""Gateway policy files for tests: one builder of the YAML the gateway reads (the format of
docs/reference.md), so every test writes policies the same way."""

from __future__ import annotations

from pathlib import Path

from gateway.auth import hash_key

ADMIN_KEY = "admin-secret"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
UNLIMITED = "{requests_per_second: 1000, burst: 1000, tokens_per_minute: 100000000}"


def bearer(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


def tenant_yaml(
    tenant_id: str,
    api_keys: list[str] | str,
    adapters: str,
    *,
    max_priority: str | None = None,
    limits: str | None = UNLIMITED,
    extra_keys: str = "",
    budgets: str | None = None,
) -> str:
    """One entry of `tenants:`; `api_keys` are plain keys (hashed here), `adapters` a YAML list."""
    keys = [api_keys] if isinstance(api_keys, str) else api_keys
    hashed = ", ".join('"' + hash_key(k) + '"' for k in keys)
    lines = [f"  - id: {tenant_id}", f"    api_keys: [{hashed}{extra_keys}]", f"    adapters: {adapters}"]
    if max_priority is not None:
        lines.append(f"    max_priority: {max_priority}")
    if limits is not None:
        lines.append(f"    limits: {limits}")
    if budgets is not None:
        lines.append(f"    budgets: {budgets}")
    return "\n".join(lines)


def policy_yaml(
    *tenants: str,
    rollouts: str = "",
    admission: str | None = None,
    breaker: str | None = None,
    extra: str = "",
    admin_key: str = ADMIN_KEY,
) -> str:
    """A whole policy file: the admin key, the tenants (tenant_yaml), then the optional sections as YAML."""
    parts = ["version: 1", f'admin_keys: ["{hash_key(admin_key)}"]', "tenants:", *tenants]
    if rollouts:
        parts += ["rollouts:", rollouts.strip("\n")]
    if admission is not None:
        parts.append(f"admission: {admission}")
    if breaker is not None:
        parts.append(f"breaker: {breaker}")
    if extra:
        parts.append(extra.strip("\n"))
    return "\n".join(parts) + "\n"


def write_policy(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
