"""Policy parsing/validation (gateway/policy.py) and API key auth (gateway/auth.py). Pure CPU, no network."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.auth import Authenticator, hash_key
from gateway.policy import Limits, Policy, PolicyError, load_policy, parse_policy
from loragate_common.priority import Priority

REPO = Path(__file__).resolve().parents[2]

# Digests from coreutils `printf %s KEY | sha256sum`, not from the code under test.
ACME_KEY = "sk-acme-0123456789"
ACME_HASH = "sha256:70f3edfe9a5539de9541a82c314eabee1dca123ef29487888d219b17b4572dcd"
ADMIN_KEY = "sk-admin-0123456789"
ADMIN_HASH = "sha256:d638dd660e3e43a5ed5f468652c34c7311f3f2a0fe94d77b9434f27a5873870a"

# The example policy of docs/reference.md, with real digests, plus a second tenant that has a low priority cap.
CONTRACT_POLICY = f"""
version: 1
defaults:
  priority: standard                      # used when a request names none
  limits: {{requests_per_second: 10, burst: 20, tokens_per_minute: 60000}}
admin_keys: ["{ADMIN_HASH}"]
tenants:
  - id: acme
    api_keys: ["{ACME_HASH}", "env:ACME_API_KEY"]   # hashed, or read from the environment
    adapters: ["support", "sql-*"]        # adapter ids or rollout names this tenant may use (globs)
    max_priority: critical                # a higher X-Priority is capped to this
    limits: {{requests_per_second: 5, burst: 10, tokens_per_minute: 20000}}
  - id: batch
    api_keys: ["env:BATCH_API_KEY"]
    max_priority: sheddable
rollouts:
  - name: support                         # what clients send as X-Adapter-ID (or model)
    sticky_key: header:X-User-ID          # or `tenant`; the same key always gets the same variant
    variants:
      - {{adapter: support-v1, weight: 90}}
      - {{adapter: support-v2, weight: 10}}
    override_header: X-Variant            # a request may force a variant by naming its adapter
    rollback: {{max_error_rate: 0.05, max_ttft_p99_ms: 2000, min_requests: 100, window_s: 60}}
admission:
  max_inflight_per_upstream: 32
  max_queue: 256
  queue_timeout_ms: 10000
breaker: {{failure_threshold: 5, open_seconds: 10, half_open_probes: 1}}
"""


@pytest.fixture(scope="module")
def policy() -> Policy:
    return parse_policy(CONTRACT_POLICY)


def test_contract_example_parses(policy: Policy) -> None:
    acme = policy.tenant("acme")
    assert acme is not None and acme.api_keys == (ACME_HASH, "env:ACME_API_KEY")
    assert policy.limits_for(acme) == Limits(requests_per_second=5, burst=10, tokens_per_minute=20000)
    assert policy.admin_keys == (ADMIN_HASH,)
    support = policy.rollout("support")
    assert support is not None
    assert [(v.adapter, v.weight) for v in support.variants] == [("support-v1", 90), ("support-v2", 10)]
    assert support.sticky_key == "header:X-User-ID" and support.override_header == "X-Variant"
    assert support.rollback is not None and support.rollback.max_ttft_p99_ms == 2000
    assert policy.admission.queue_timeout_s == 10.0 and policy.breaker.failure_threshold == 5
    assert policy.tenant("nobody") is None and policy.rollout("nothing") is None


def test_defaults_applied(policy: Policy) -> None:
    minimal = parse_policy("version: 1\ntenants: [{id: t, api_keys: []}]")
    tenant = minimal.tenant("t")
    assert tenant is not None and tenant.adapters == () and tenant.priority_cap is Priority.CRITICAL
    assert minimal.limits_for(tenant) == Limits(requests_per_second=10, burst=20, tokens_per_minute=60000)
    assert minimal.default_priority is Priority.STANDARD
    assert (minimal.admission.max_inflight_per_upstream, minimal.admission.max_queue) == (32, 256)
    assert minimal.admission.queue_timeout_ms == 10000
    breaker = minimal.breaker
    assert (breaker.failure_threshold, breaker.open_seconds, breaker.half_open_probes) == (5, 10, 1)
    assert minimal.ratelimit.on_redis_error == "open"
    batch = policy.tenant("batch")
    assert batch is not None and policy.limits_for(batch) == policy.defaults.limits  # no limits of its own
    rollout = parse_policy(V + "rollouts: [{name: r, variants: [{adapter: a, weight: 1}]}]").rollout("r")
    assert rollout is not None and rollout.sticky_key == "header:X-User-ID" and rollout.rollback is None


def test_policy_is_frozen(policy: Policy) -> None:
    with pytest.raises(ValidationError):
        policy.breaker.failure_threshold = 1  # type: ignore[misc]


TENANT = "tenants: [{id: acme, api_keys: []}]"
V = "version: 1\n"
LIMITS = "requests_per_second: 1, tokens_per_minute: 1"
VARIANT = "{adapter: a, weight: 1}"


@pytest.mark.parametrize(
    "text, expected",
    [
        (V + "tenants:\n  - id: [acme\n", "invalid YAML at line 4, column 1"),
        (V + "version: 1\n", "duplicate key 'version' at line 2"),
        ("- version: 1\n", "must be a mapping at the top level, got a list"),
        ("", "must be a mapping at the top level, got an empty document"),
        ("defaults: {}\n", "version: Field required"),
        ("version: 2\n", "version: Input should be 1"),
        (V + "colour: red\n", "colour: unknown key (expected one of: version, defaults,"),
        (V + "tenants: [{id: a, api_keys: [], colour: red}]", "tenants[0].colour: unknown key"),
        (
            V + f"defaults: {{limits: {{{LIMITS}, burst: 1, rpm: 3}}}}",
            "defaults.limits.rpm: unknown key (expected one of: requests_per_second, burst, tokens_per_minute)",
        ),
        (
            V + "rollouts: [{name: r, variants: [{adapter: a, weight: 0}, {adapter: b, weight: 0}]}]",
            "rollouts[0].variants: weights must sum to more than 0",
        ),
        (V + "rollouts: [{name: r, variants: []}]", "rollouts[0].variants: List should have at least 1"),
        (
            V + "rollouts: [{name: r, variants: [{adapter: a, weight: -1}, {adapter: b, weight: 2}]}]",
            "rollouts[0].variants[0].weight: Input should be greater than or equal to 0",
        ),
        (
            V + f"rollouts: [{{name: r, variants: [{VARIANT}, {VARIANT}]}}]",
            "rollouts[0].variants: adapter 'a' is listed twice",
        ),
        (
            V + f"rollouts: [{{name: r, sticky_key: cookie, variants: [{VARIANT}]}}]",
            "rollouts[0].sticky_key: must be 'tenant' or 'header:<Header-Name>'",
        ),
        (
            V + f"rollouts: [{{name: r, variants: [{VARIANT}]}}, {{name: r, variants: [{VARIANT}]}}]",
            "rollouts[1].name: duplicate rollout name 'r' (first at rollouts[0])",
        ),
        (
            V + "tenants: [{id: a, api_keys: [sk-plain-secret]}]",
            "tenants[0].api_keys[0]: must be 'sha256:<64 lowercase hex digits>' or 'env:<ENV_VAR_NAME>'",
        ),
        (V + f"tenants: [{{id: a, api_keys: [sha256:{ACME_HASH[7:].upper()}]}}]", "tenants[0].api_keys[0]: must be"),
        (V + f"tenants: [{{id: a, api_keys: ['{ACME_HASH[:-1]}']}}]", "tenants[0].api_keys[0]: must be"),
        (V + "tenants: [{id: a, api_keys: ['env:1BAD']}]", "tenants[0].api_keys[0]: must be"),
        (V + "admin_keys: ['env:BAD-NAME']", "admin_keys[0]: must be"),
        (V + "tenants: [{id: a, api_keys: 'env:A'}]", "tenants[0].api_keys: Input should be a list"),
        (
            V + f"tenants: [{{id: a, api_keys: [], limits: {{{LIMITS}, burst: 0}}}}]",
            "tenants[0].limits.burst: Input should be greater than or equal to 1",
        ),
        (
            V + f"defaults: {{limits: {{{LIMITS}, burst: '20'}}}}",
            "defaults.limits.burst: Input should be a valid integer",
        ),
        (
            V + "defaults: {limits: {requests_per_second: 0, burst: 1, tokens_per_minute: 1}}",
            "defaults.limits.requests_per_second: Input should be greater than 0",
        ),
        (
            V + "tenants: [{id: acme, api_keys: []}, {id: acme, api_keys: []}]",
            "tenants[1].id: duplicate tenant id 'acme' (first at tenants[0])",
        ),
        (
            V + f"tenants: [{{id: a, api_keys: ['{ACME_HASH}']}}, {{id: b, api_keys: ['{ACME_HASH}']}}]",
            "tenants[1].api_keys[0]: key already belongs to tenant 'a'",
        ),
        (
            V + "tenants: [{id: a, api_keys: [], max_priority: urgent}]",
            "tenants[0].max_priority: Input should be 'critical', 'standard' or 'sheddable'",
        ),
        (V + "admission: {max_queue: -1}", "admission.max_queue: Input should be greater than or equal to 0"),
        (V + "ratelimit: {on_redis_error: maybe}", "ratelimit.on_redis_error: Input should be 'open' or 'closed'"),
    ],
)
def test_rejection_names_the_key(text: str, expected: str) -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy(text)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_rejection_never_echoes_a_pasted_key() -> None:
    with pytest.raises(PolicyError) as info:
        parse_policy("version: 1\ntenants: [{id: a, api_keys: [sk-live-VERYSECRET]}]")
    assert "VERYSECRET" not in str(info.value)


def test_default_policy_file_parses() -> None:
    default = load_policy(REPO / "policies" / "default.yaml")
    dev = default.tenant("dev")
    assert dev is not None and dev.api_keys == ("env:LORAGATE_DEV_API_KEY",)
    assert dev.allows("any-adapter") and dev.priority_cap is Priority.CRITICAL
    assert default.limits_for(dev) == Limits(requests_per_second=20, burst=40, tokens_per_minute=200000)
    assert default.defaults.limits == Limits(requests_per_second=10, burst=20, tokens_per_minute=60000)
    assert default.admin_keys == ("env:LORAGATE_ADMIN_KEY",) and default.default_priority is Priority.STANDARD
    admission = default.admission
    assert admission.max_inflight_per_upstream == 32 and admission.max_queue == 256
    assert admission.queue_timeout_ms == 30000
    assert default.breaker.model_dump() == {"failure_threshold": 5, "open_seconds": 10, "half_open_probes": 1}
    keys = {"LORAGATE_DEV_API_KEY": "dev-key", "LORAGATE_ADMIN_KEY": "admin-key"}
    auth = Authenticator(default, environ=keys)
    assert auth.tenant_for("Bearer dev-key") is dev and auth.is_admin("Bearer admin-key")


def test_load_policy_errors_name_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nbreaker: {open_seconds: 0}\n")
    message = r"bad\.yaml: breaker\.open_seconds: Input should be greater than 0$"
    with pytest.raises(PolicyError, match=message):
        load_policy(bad)
    with pytest.raises(PolicyError, match="cannot read policy file"):
        load_policy(tmp_path / "missing.yaml")


def test_hash_key_is_sha256() -> None:
    assert hash_key(ACME_KEY) == ACME_HASH
    fips_180_2 = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"  # its "abc" vector
    assert hash_key("abc") == "sha256:" + fips_180_2


ENVIRON = {"ACME_API_KEY": "sk-acme-from-env", "BATCH_API_KEY": "sk-batch-from-env"}


@pytest.mark.parametrize(
    "header, tenant_id",
    [
        (f"Bearer {ACME_KEY}", "acme"),
        (f"bearer {ACME_KEY}", "acme"),
        (f"BEARER   {ACME_KEY} ", "acme"),
        ("Bearer sk-acme-from-env", "acme"),
        ("Bearer sk-batch-from-env", "batch"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer ", None),
        (ACME_KEY, None),  # no scheme
        (f"Basic {ACME_KEY}", None),
        (f"Token {ACME_KEY}", None),
        (f"Bearer {ACME_KEY}x", None),
        ("Bearer sk-shared-by-no-one", None),
        (f"Bearer {ACME_HASH}", None),  # the stored digest is not a key
        (f"Bearer {ADMIN_KEY}", None),  # admin keys do not identify a tenant
    ],
)
def test_tenant_for(policy: Policy, header: str | None, tenant_id: str | None) -> None:
    tenant = Authenticator(policy, environ=ENVIRON).tenant_for(header)
    assert (tenant.id if tenant else None) == tenant_id


def test_unset_env_key_never_matches_and_warns_once(policy: Policy, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="gateway.auth"):
        auth = Authenticator(policy, environ={"BATCH_API_KEY": ""})
        for header in ["Bearer ", "Bearer sk-acme-from-env", "Bearer None"]:
            assert auth.tenant_for(header) is None
    warnings = [r.getMessage() for r in caplog.records]
    assert sum("ACME_API_KEY" in m for m in warnings) == 1
    assert sum("BATCH_API_KEY" in m for m in warnings) == 1
    assert auth.tenant_for(f"Bearer {ACME_KEY}") is not None  # the hashed key still works


def test_env_keys_are_read_once(policy: Policy) -> None:
    environ = dict(ENVIRON)
    auth = Authenticator(policy, environ=environ)
    environ["ACME_API_KEY"] = "sk-rotated"
    assert auth.tenant_for("Bearer sk-acme-from-env") is not None
    assert auth.tenant_for("Bearer sk-rotated") is None


def test_env_keys_shared_by_two_tenants_are_refused(policy: Policy) -> None:
    with pytest.raises(PolicyError, match="'acme' and 'batch' share an API key"):
        Authenticator(policy, environ={"ACME_API_KEY": "same", "BATCH_API_KEY": "same"})


def test_admin_keys() -> None:
    admin_policy = parse_policy(V + f"admin_keys: ['{ADMIN_HASH}', 'env:OPS_KEY', 'env:UNSET_KEY']\n{TENANT}")
    auth = Authenticator(admin_policy, environ={"OPS_KEY": "sk-ops"})
    assert auth.is_admin(f"Bearer {ADMIN_KEY}") and auth.is_admin(f"bearer {ADMIN_KEY}")
    assert auth.is_admin("Bearer sk-ops")
    wrong = [None, "", f"Basic {ADMIN_KEY}", f"Bearer {ADMIN_KEY}!", "Bearer sk-nobody", f"Bearer {ACME_KEY}"]
    for header in wrong:
        assert not auth.is_admin(header), header
    assert not Authenticator(parse_policy("version: 1"), environ={}).is_admin(f"Bearer {ADMIN_KEY}")


@pytest.mark.parametrize(
    "adapter, allowed",
    [
        ("support", True),
        ("sql-users", True),
        ("sql-", True),
        ("sql", False),
        ("support-v2", False),
        ("SQL-users", False),
        ("xsql-users", False),
        ("", False),
    ],
)
def test_adapter_globs(policy: Policy, adapter: str, allowed: bool) -> None:
    acme = policy.tenant("acme")
    assert acme is not None and acme.allows(adapter) is allowed


def test_no_adapter_globs_allows_no_adapter(policy: Policy) -> None:
    batch = policy.tenant("batch")
    assert batch is not None and not batch.allows("support") and not batch.allows("*")


@pytest.mark.parametrize(
    "cap, asked, got",
    [
        ("critical", Priority.CRITICAL, Priority.CRITICAL),
        ("critical", Priority.SHEDDABLE, Priority.SHEDDABLE),
        ("standard", Priority.CRITICAL, Priority.STANDARD),
        ("standard", Priority.SHEDDABLE, Priority.SHEDDABLE),
        ("sheddable", Priority.CRITICAL, Priority.SHEDDABLE),
        ("sheddable", Priority.STANDARD, Priority.SHEDDABLE),
    ],
)
def test_priority_cap(cap: str, asked: Priority, got: Priority) -> None:
    tenant = parse_policy(f"version: 1\ntenants: [{{id: t, api_keys: [], max_priority: {cap}}}]").tenant("t")
    assert tenant is not None and tenant.priority_cap is Priority.parse(cap)
    assert tenant.cap(asked) is got


def test_default_priority_follows_the_policy() -> None:
    assert parse_policy("version: 1\ndefaults: {priority: sheddable}").default_priority is Priority.SHEDDABLE
