"""API key authentication: `Authorization: Bearer <key>` -> the tenant it belongs to.

Keys are never stored in the clear: the policy holds `sha256:<hex>` digests, or `env:NAME` references
that are read from the environment once, when the Authenticator is built, and hashed on the spot. A
presented key is hashed and compared in constant time against every stored digest, with no early exit,
so the response time says nothing about which tenant (or how many) a key came close to.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
from collections.abc import Mapping

from gateway.policy import Policy, PolicyError, Tenant

__all__ = ["Authenticator", "hash_key"]

logger = logging.getLogger(__name__)


def hash_key(key: str) -> str:
    """The policy-file form of an API key: `sha256:<64 lowercase hex digits>`."""
    return "sha256:" + hashlib.sha256(key.encode("utf-8")).hexdigest()


class Authenticator:
    """Maps an Authorization header to a tenant (or admin) for one policy. Build a new one on reload."""

    def __init__(self, policy: Policy, environ: Mapping[str, str] = os.environ) -> None:
        self._tenant_keys: list[tuple[bytes, Tenant]] = []
        owner: dict[bytes, str] = {}
        for tenant in policy.tenants:
            for digest in _resolve(tenant.api_keys, environ, f"tenant {tenant.id!r}"):
                if owner.setdefault(digest, tenant.id) != tenant.id:
                    # Only reachable through env: keys (the policy rejects shared sha256 entries).
                    raise PolicyError(f"tenants {owner[digest]!r} and {tenant.id!r} share an API key")
                self._tenant_keys.append((digest, tenant))
        self._admin_keys = _resolve(policy.admin_keys, environ, "admin_keys")

    def tenant_for(self, authorization: str | None) -> Tenant | None:
        """The tenant whose key is presented, or None for a missing, malformed or unknown key."""
        digest = _presented_digest(authorization)
        if digest is None:
            return None
        found: Tenant | None = None
        for stored, tenant in self._tenant_keys:
            # compare_digest runs first, for every stored key, whether or not one already matched.
            if hmac.compare_digest(stored, digest) and found is None:
                found = tenant
        return found

    def is_admin(self, authorization: str | None) -> bool:
        digest = _presented_digest(authorization)
        if digest is None:
            return False
        matched = False
        for stored in self._admin_keys:
            matched |= hmac.compare_digest(stored, digest)
        return matched


def _presented_digest(authorization: str | None) -> bytes | None:
    """sha256 of the key in `Bearer <key>` (scheme case-insensitive, RFC 9110); None if absent or bad."""
    if authorization is None:
        return None
    scheme, _, key = authorization.strip().partition(" ")
    key = key.strip()
    if scheme.lower() != "bearer" or not key:
        return None
    return hashlib.sha256(key.encode("utf-8")).digest()


def _resolve(refs: tuple[str, ...], environ: Mapping[str, str], owner: str) -> list[bytes]:
    """Digests for the policy's key references; an unset env var is warned about and skipped."""
    digests: list[bytes] = []
    for ref in refs:
        kind, _, value = ref.partition(":")
        if kind == "sha256":
            digests.append(bytes.fromhex(value))
            continue
        key = environ.get(value)
        if not key:
            logger.warning("%s: environment variable %s is not set; that key will never match", owner, value)
            continue
        digests.append(hashlib.sha256(key.encode("utf-8")).digest())
    return digests
