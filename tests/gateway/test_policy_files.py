"""The shipped policy files, their JSON Schema, and `loragate policy check | schema`.

Every file in policies/ must load in the gateway AND validate against the schema; jsonschema (not our
parser) is the reference that says the schema rejects what it should. The CLI runs as a subprocess, the
way CI would call it.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from gateway.policy import PolicyError, load_policy, parse_policy
from gateway.policy_schema import policy_json_schema, render_policy_json_schema

REPO = Path(__file__).resolve().parents[2]
POLICIES = REPO / "policies"
SCHEMA_FILE = POLICIES / "schema.json"
POLICY_FILES = sorted([*POLICIES.glob("*.yaml"), *(POLICIES / "examples").glob("*.yaml")])
REGENERATE = "regenerate it with: python -m loragate policy schema > policies/schema.json"


def loragate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "loragate", *map(str, args)], cwd=REPO, capture_output=True, text=True, timeout=120
    )


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def test_the_examples_exist() -> None:
    names = {p.relative_to(POLICIES).as_posix() for p in POLICY_FILES}
    assert {
        "default.yaml",
        "examples/multi-tenant.yaml",
        "examples/canary.yaml",
        "examples/ab-by-tenant.yaml",
        "examples/progressive.yaml",
    } <= names


@pytest.mark.parametrize("path", POLICY_FILES, ids=lambda p: p.relative_to(POLICIES).as_posix())
def test_policy_file_loads_and_matches_the_schema(path: Path, validator: jsonschema.Draft202012Validator) -> None:
    load_policy(path)
    errors = [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(yaml.safe_load(path.read_text(encoding="utf-8")))
    ]
    assert errors == []


def test_multi_tenant_example_hash_is_of_the_key_its_comment_names() -> None:
    policy = load_policy(POLICIES / "examples" / "multi-tenant.yaml")
    digest = "sha256:" + hashlib.sha256(b"example-key-acme").hexdigest()
    assert digest in policy.tenant("acme").api_keys  # type: ignore[union-attr]


def test_canary_example_is_the_documented_rollout() -> None:
    rollout = load_policy(POLICIES / "examples" / "canary.yaml").rollout("support")
    assert rollout is not None and rollout.rollback is not None
    assert [(v.adapter, v.weight) for v in rollout.variants] == [("support-v1", 90), ("support-v2", 10)]
    assert (rollout.sticky_key, rollout.override_header) == ("header:X-User-ID", "X-Variant")
    assert rollout.rollback.model_dump() == {
        "max_error_rate": 0.05,
        "max_ttft_p99_ms": 2000,
        "min_requests": 100,
        "window_s": 60,
    }


def test_progressive_example_steps_to_100_with_a_gate() -> None:
    rollout = load_policy(POLICIES / "examples" / "progressive.yaml").rollout("support")
    assert rollout is not None and rollout.rollback is not None and rollout.hold_s is not None
    assert rollout.steps == (5, 25, 50, 100) and rollout.hold_s >= rollout.rollback.window_s


def test_ab_example_splits_by_tenant_half_and_half() -> None:
    policy = load_policy(POLICIES / "examples" / "ab-by-tenant.yaml")
    (rollout,) = policy.rollouts
    assert rollout.sticky_key == "tenant"
    assert [v.weight for v in rollout.variants] == [50, 50]
    assert len(policy.tenants) >= 3


# --- the schema, judged by jsonschema ---------------------------------------------------------------

VALID: dict[str, Any] = {
    "version": 1,
    "admin_keys": ["env:ADMIN_KEY"],
    "tenants": [{"id": "acme", "api_keys": ["sha256:" + "ab" * 32, "env:ACME_KEY"], "adapters": ["sql-*"]}],
    "rollouts": [
        {
            "name": "support",
            "sticky_key": "header:X-User-ID",
            "override_header": "X-Variant",
            "variants": [{"adapter": "support-v1", "weight": 90}, {"adapter": "support-v2", "weight": 10}],
        }
    ],
    "admission": {"max_inflight_per_upstream": 8, "spill_inflight": 6},
}


def _with(path: str, value: Any) -> dict[str, Any]:
    """A deep copy of VALID with the value at a dotted path (list indexes as digits) replaced."""
    doc = json.loads(json.dumps(VALID))
    *parents, leaf = path.split(".")
    node: Any = doc
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[int(leaf) if leaf.isdigit() else leaf] = value
    return doc


def test_schema_accepts_a_valid_policy(validator: jsonschema.Draft202012Validator) -> None:
    assert list(validator.iter_errors(VALID)) == []
    parse_policy(json.dumps(VALID))


@pytest.mark.parametrize(
    ("path", "value"),
    [
        ("tenants.0.colour", "red"),  # an unknown key
        ("colour", "red"),  # an unknown top-level key
        ("rollouts.0.variants.0.weight", "90"),  # a weight given as a string
        ("version", 2),
        ("tenants.0.api_keys.0", "sk-a-raw-key-pasted-by-mistake"),
        ("admin_keys.0", "sha256:ABC"),
        ("rollouts.0.sticky_key", "cookie:session"),
        ("rollouts.0.override_header", "X Variant"),
        ("rollouts.0.variants.0.adapter", "support-*"),
        ("rollouts.0.variants", [{"adapter": "a", "weight": 0}, {"adapter": "b", "weight": 0}]),
        ("tenants.0.max_priority", "urgent"),
        ("admission.spill_inflight", 0),
    ],
)
def test_schema_rejects(validator: jsonschema.Draft202012Validator, path: str, value: Any) -> None:
    doc = _with(path, value)
    assert not validator.is_valid(doc)
    with pytest.raises(PolicyError):  # and the gateway's parser agrees
        parse_policy(json.dumps(doc))  # JSON is YAML


def test_committed_schema_is_current() -> None:
    assert SCHEMA_FILE.read_text(encoding="utf-8") == render_policy_json_schema(), (
        f"policies/schema.json is stale; {REGENERATE}"
    )


def test_schema_is_draft_2020_12_without_an_id() -> None:
    schema = policy_json_schema()
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["title"] and "$id" not in schema


# --- the CLI -----------------------------------------------------------------------------------------


def test_policy_schema_prints_the_committed_schema() -> None:
    result = loragate("policy", "schema")
    assert result.returncode == 0, result.stderr
    assert result.stdout == SCHEMA_FILE.read_text(encoding="utf-8"), f"policies/schema.json is stale; {REGENERATE}"


def test_policy_check_good_files() -> None:
    canary = Path("policies/examples/canary.yaml")
    result = loragate("policy", "check", canary, "policies/default.yaml")
    assert result.returncode == 0, result.stderr
    digest = hashlib.sha256((REPO / canary).read_bytes()).hexdigest()[:12]
    lines = result.stdout.splitlines()
    assert lines[0] == f"ok: {canary} (2 tenants, 1 rollout, sha256 {digest})"
    assert lines[1].startswith("ok: policies/default.yaml (1 tenant, 0 rollouts, sha256 ")
    assert result.stderr == ""


BROKEN = {
    "bad-yaml.yaml": ("version: 1\ntenants: [\n", "line"),
    "unknown-key.yaml": (
        "version: 1\ntenants:\n  - id: a\n    api_keys: []\n    colour: red\n",
        "tenants[0].colour: unknown key",
    ),
    "zero-weights.yaml": (
        "version: 1\nrollouts:\n  - name: r\n    variants:\n"
        "      - {adapter: a, weight: 0}\n      - {adapter: b, weight: 0}\n",
        "rollouts[0].variants: weights must sum to more than 0",
    ),
    "pattern-variant.yaml": (
        "version: 1\nrollouts:\n  - name: support\n    variants:\n      - {adapter: support-*, weight: 1}\n",
        "rollouts[0].variants[0].adapter: must name one adapter id",
    ),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_policy_check_broken_file(tmp_path: Path, name: str) -> None:
    text, expected = BROKEN[name]
    path = tmp_path / name
    path.write_text(text)
    result = loragate("policy", "check", path)
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr.startswith(f"loragate policy check: error: {path}: ")
    assert expected in result.stderr


def test_policy_check_reports_every_file_and_fails_if_any_does(tmp_path: Path) -> None:
    bad = tmp_path / "unknown-key.yaml"
    bad.write_text(BROKEN["unknown-key.yaml"][0])
    missing = tmp_path / "missing.yaml"
    result = loragate("policy", "check", bad, "policies/default.yaml", missing)
    assert result.returncode == 1
    assert result.stdout.startswith("ok: policies/default.yaml ")
    errors = result.stderr.splitlines()
    assert len(errors) == 2
    assert errors[0].startswith(f"loragate policy check: error: {bad}: tenants[0].colour")
    assert errors[1].startswith(f"loragate policy check: error: {missing}: cannot read policy file")


def test_policy_needs_a_subcommand() -> None:
    result = loragate("policy")
    assert result.returncode == 2
    assert "{check,schema}" in result.stderr
