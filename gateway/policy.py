"""The gateway policy: tenants, API keys, limits, rollouts, admission and breaker settings.

A policy file (YAML, `version: 1`, the format in docs/reference.md) is parsed once, at the edge, into the frozen
pydantic models below; nothing deeper in the gateway reads raw dicts. Every problem in a file raises
`PolicyError`, whose message names the offending key (`tenants[0].limits.burst: ...`), so a reload can
be refused with a message the operator can act on.
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictBool,
    ValidationError,
    model_validator,
)

from loragate_common.adapter_ids import id_problem
from loragate_common.adapter_sources import AllowList, SourceError
from loragate_common.priority import Priority

__all__ = [
    "Admission",
    "Breaker",
    "Defaults",
    "Limits",
    "Policy",
    "PrefixRouting",
    "PublishQuota",
    "PolicyError",
    "RateLimitPolicy",
    "Rollback",
    "Rollout",
    "Tenant",
    "Variant",
    "load_policy",
    "parse_policy",
    "read_policy",
]

_HASH_RE = re.compile(r"sha256:[0-9a-f]{64}")
_ENV_RE = re.compile(r"env:[A-Za-z_][A-Za-z0-9_]*")
_HEADER_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")  # an RFC 9110 token


class PolicyError(ValueError):
    """A policy file that cannot be used; the message names the key at fault."""


def _key_ref(value: str) -> str:
    # The value is never echoed: a raw key pasted here by mistake must not end up in logs.
    if not (_HASH_RE.fullmatch(value) or _ENV_RE.fullmatch(value)):
        raise ValueError("must be 'sha256:<64 lowercase hex digits>' or 'env:<ENV_VAR_NAME>'")
    return value


def _sticky_key(value: str) -> str:
    if value != "tenant" and not (value.startswith("header:") and _HEADER_RE.fullmatch(value[7:])):
        raise ValueError("must be 'tenant' or 'header:<Header-Name>'")
    return value


def _session_key(value: str) -> str:
    if value not in ("none", "body:user") and not (value.startswith("header:") and _HEADER_RE.fullmatch(value[7:])):
        raise ValueError("must be 'header:<Header-Name>', 'body:user' or 'none'")
    return value


def _header_name(value: str) -> str:
    if not _HEADER_RE.fullmatch(value):
        raise ValueError("must be an HTTP header name")
    return value


KeyRef = Annotated[str, AfterValidator(_key_ref)]
PriorityName = Literal["critical", "standard", "sheddable"]
# Numbers are strict: `burst: "20"` or `burst: true` in YAML is a mistake, not something to coerce.
PosInt = Annotated[int, Field(strict=True, ge=1)]
NonNegInt = Annotated[int, Field(strict=True, ge=0)]
PosFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
NonEmptyStr = Annotated[str, Field(min_length=1)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(_Model):
    requests_per_second: PosFloat
    burst: PosInt
    tokens_per_minute: PosInt


class Budgets(_Model):
    """Tokens (prompt + completion) a tenant may use per UTC day and per UTC month; None: no bound."""

    tokens_per_day: PosInt | None = None
    tokens_per_month: PosInt | None = None


class Defaults(_Model):
    priority: PriorityName = "standard"
    limits: Limits = Limits(requests_per_second=10, burst=20, tokens_per_minute=60000)


def _source_prefix(value: str) -> str:
    try:
        AllowList([value])
    except SourceError as exc:
        raise ValueError(str(exc)) from None
    return value


class PublishQuota(_Model):
    """What a publishing tenant may keep in the adapter catalog: versions of its ids, and their declared bytes."""

    max_adapters: PosInt = 100
    max_bytes: PosInt = 10 << 30


class Tenant(_Model):
    id: NonEmptyStr
    api_keys: tuple[KeyRef, ...]
    adapters: tuple[NonEmptyStr, ...] = ()  # globs over adapter ids and rollout names
    max_priority: PriorityName = "critical"
    limits: Limits | None = None  # None: the policy's defaults
    budgets: Budgets = Budgets()  # none by default
    # May register, deprecate and delete catalog adapters `<id>/<name>` with its own API key (and always use them).
    publish: StrictBool = False
    publish_quota: PublishQuota = PublishQuota()
    # The source prefixes its registrations must lie under (loragate_common/adapter_sources.py AllowList), e.g. its own
    # bucket prefix: a tenant cannot point an adapter at another tenant's files. Required when it publishes.
    publish_sources: tuple[Annotated[str, AfterValidator(_source_prefix)], ...] = ()

    def allows(self, adapter_id: str) -> bool:
        """Whether this tenant may use an adapter id or rollout name (case-sensitive globs; a publishing
        tenant's own namespace `<id>/...` too)."""
        if self.publish and adapter_id.startswith(f"{self.id}/"):
            return True
        return any(fnmatch.fnmatchcase(adapter_id, glob) for glob in self.adapters)

    @property
    def priority_cap(self) -> Priority:
        return Priority.parse(self.max_priority)

    def cap(self, priority: Priority) -> Priority:
        """The priority a request asking for `priority` gets. CRITICAL is 0, so the cap is a max()."""
        return max(priority, self.priority_cap)


_GLOB_CHARS = frozenset("*?[]")


def _adapter_id(value: str) -> str:
    """One adapter: an id, `namespace/name` (a catalog id), either with `@N` (a catalog version)."""
    if _GLOB_CHARS & set(value):
        raise ValueError("must name one adapter id, not a pattern (no * ? [ ])")
    segments = value.split("/")
    if len(segments) > 2 or any(s != s.strip() or s in ("", ".", "..") for s in segments):
        raise ValueError("must be an adapter id (no surrounding spaces; at most one '/', as in tenant/name)")
    return value


class Variant(_Model):
    adapter: Annotated[str, Field(min_length=1), AfterValidator(_adapter_id)]
    weight: Annotated[float, Field(strict=True, ge=0, allow_inf_nan=False)]


class Rollback(_Model):
    max_error_rate: Annotated[float, Field(strict=True, ge=0, le=1)]
    max_ttft_p99_ms: PosFloat
    min_requests: PosInt
    window_s: PosFloat


def _check_variants(variants: tuple[Variant, ...]) -> tuple[Variant, ...]:
    if sum(v.weight for v in variants) <= 0:
        raise ValueError("weights must sum to more than 0")
    seen = [v.adapter for v in variants]
    dup = next((a for i, a in enumerate(seen) if a in seen[:i]), None)
    if dup is not None:
        raise ValueError(f"adapter {dup!r} is listed twice")
    return variants


def _check_steps(steps: tuple[float, ...]) -> tuple[float, ...]:
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise ValueError("steps must increase")
    if steps[-1] != 100:
        raise ValueError("the last step must be 100 (the new variant takes all traffic: promoted)")
    return steps


class Rollout(_Model):
    name: NonEmptyStr
    sticky_key: Annotated[str, AfterValidator(_sticky_key)] = "header:X-User-ID"
    variants: Annotated[tuple[Variant, ...], Field(min_length=1), AfterValidator(_check_variants)]
    override_header: Annotated[str, AfterValidator(_header_name)] | None = None
    rollback: Rollback | None = None
    # A progressive rollout: the second variant's weight goes through `steps` (percent), each held for
    # `hold_s` while the rollback bounds hold, then the next; at 100 the rollout is promoted.
    steps: (
        Annotated[
            tuple[Annotated[float, Field(strict=True, gt=0, le=100, allow_inf_nan=False)], ...],
            Field(min_length=1),
            AfterValidator(_check_steps),
        ]
        | None
    ) = None
    hold_s: PosFloat | None = None

    @property
    def progressive(self) -> bool:
        return self.steps is not None


class PrefixRouting(_Model):
    """Prefix-aware routing (gateway/prefix_index.py): a request goes to the engine that holds the longest
    run of its prompt's leading chunks, within the bounded-load rule."""

    enabled: StrictBool = True
    chunk_chars: Annotated[int, Field(strict=True, ge=16, le=65536)] = 256  # text per chunk hash
    max_chunks: Annotated[int, Field(strict=True, ge=1, le=512)] = 128  # a prompt's leading chunks hashed
    index_entries: Annotated[int, Field(strict=True, ge=1, le=10_000_000)] = 65536  # this replica's LRU bound
    ttl_s: Annotated[int, Field(strict=True, ge=1, le=86400)] = 600  # how long a shared entry lives in Redis


class Admission(_Model):
    max_inflight_per_upstream: PosInt = 32
    max_queue: NonNegInt = 256  # 0: no queue, shed when every upstream is full
    queue_timeout_ms: PosInt = 10000
    # Adapter affinity: an adapter's requests go to its preferred upstream until this many are in flight
    # there, then spill to the next choice. None: three quarters of max_inflight_per_upstream.
    spill_inflight: PosInt | None = None
    affinity: StrictBool = True  # False: adapter requests go to the least loaded upstream, like base ones
    # What an upstream's load is: "engine" what it reports (every replica's requests there), "local" this
    # replica's requests in flight only. With "engine", affinity also yields past balance_factor x the mean.
    load_source: Literal["engine", "local"] = "engine"
    balance_factor: Annotated[float, Field(strict=False, ge=1.0, le=10.0, allow_inf_nan=False)] = 1.2
    prefix: PrefixRouting = PrefixRouting()
    # A session's requests go where its last one went (bounded by load like everything else): the value of
    # this header, or of the body's `user` field; "none": no session affinity.
    session_key: Annotated[str, AfterValidator(_session_key)] = "header:X-Session-ID"

    @property
    def spill_at(self) -> int:
        if self.spill_inflight is not None:
            return min(self.spill_inflight, self.max_inflight_per_upstream)
        return max(1, self.max_inflight_per_upstream * 3 // 4)

    @property
    def queue_timeout_s(self) -> float:
        return self.queue_timeout_ms / 1000


class Breaker(_Model):
    failure_threshold: PosInt = 5
    open_seconds: PosFloat = 10.0
    half_open_probes: PosInt = 1


class RateLimitPolicy(_Model):
    on_redis_error: Literal["open", "closed"] = "open"


class Policy(_Model):
    version: Literal[1]
    defaults: Defaults = Defaults()
    admin_keys: tuple[KeyRef, ...] = ()
    tenants: tuple[Tenant, ...] = ()
    rollouts: tuple[Rollout, ...] = ()
    admission: Admission = Admission()
    breaker: Breaker = Breaker()
    ratelimit: RateLimitPolicy = RateLimitPolicy()

    _tenants: dict[str, Tenant] = PrivateAttr(default_factory=dict)
    _rollouts: dict[str, Rollout] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_unique(self) -> Policy:
        # Messages carry their own path: a model validator's error has no location of its own.
        _first_duplicate(self.tenants, lambda t: t.id, "tenants", "id", "tenant id")
        _first_duplicate(self.rollouts, lambda r: r.name, "rollouts", "name", "rollout name")
        for i, rollout in enumerate(self.rollouts):
            _check_progressive(rollout, f"rollouts[{i}]")
        owner: dict[str, str] = {}
        for i, tenant in enumerate(self.tenants):
            if tenant.publish and ("/" in tenant.id or id_problem(tenant.id) is not None):
                raise ValueError(
                    f"tenants[{i}].publish: the tenant id {tenant.id!r} names its adapters' namespace "
                    "(`<id>/<name>`), so it must be letters, digits, '.', '_' and '-', not starting with '.'"
                )
            if tenant.publish and not tenant.publish_sources:
                raise ValueError(
                    f"tenants[{i}].publish_sources: a tenant that publishes needs the source prefixes it may "
                    "publish from (e.g. [s3://bucket/<tenant>/]), so it cannot name another tenant's files"
                )
            for j, ref in enumerate(tenant.api_keys):
                if ref.startswith("sha256:") and owner.setdefault(ref, tenant.id) != tenant.id:
                    where = f"tenants[{i}].api_keys[{j}]"
                    raise ValueError(f"{where}: key already belongs to tenant {owner[ref]!r}")
        return self

    def model_post_init(self, context: Any, /) -> None:
        self._tenants = {t.id: t for t in self.tenants}
        self._rollouts = {r.name: r for r in self.rollouts}

    def tenant(self, tenant_id: str) -> Tenant | None:
        return self._tenants.get(tenant_id)

    def rollout(self, name: str) -> Rollout | None:
        return self._rollouts.get(name)

    def limits_for(self, tenant: Tenant) -> Limits:
        return tenant.limits if tenant.limits is not None else self.defaults.limits

    @property
    def default_priority(self) -> Priority:
        return Priority.parse(self.defaults.priority)


def _check_progressive(rollout: Rollout, where: str) -> None:
    """The rules that tie `steps` to the rest of a rollout (the steps themselves are checked on their own)."""
    if rollout.steps is None:
        if rollout.hold_s is not None:
            raise ValueError(f"{where}.hold_s: only a rollout with steps holds them")
        return
    if len(rollout.variants) != 2:
        raise ValueError(
            f"{where}.variants: a rollout with steps has exactly two variants: the current one "
            "first, the new one second"
        )
    if rollout.rollback is None:
        raise ValueError(f"{where}.rollback: a rollout with steps needs rollback bounds (its gate between steps)")
    if rollout.hold_s is None:
        raise ValueError(f"{where}.hold_s: a rollout with steps needs a hold time per step")
    if rollout.hold_s < rollout.rollback.window_s:
        raise ValueError(
            f"{where}.hold_s: must be at least rollback.window_s ({rollout.rollback.window_s:g} s), "
            "so each step is judged on a whole window of its own traffic"
        )


def _first_duplicate(items: tuple[Any, ...], key: Any, where: str, field: str, what: str) -> None:
    seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first = seen.setdefault(key(item), i)
        if first != i:
            raise ValueError(f"{where}[{i}].{field}: duplicate {what} {key(item)!r} (first at {where}[{first}])")


class _UniqueKeyLoader(yaml.SafeLoader):
    """safe_load that refuses a mapping naming the same key twice (YAML would keep the last silently)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise PolicyError(f"duplicate key {key!r} at line {mark.line + 1}, column {mark.column + 1}")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def parse_policy(text: str) -> Policy:
    """Parse and validate policy YAML; raises PolicyError naming the offending key."""
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise PolicyError(f"invalid YAML{where}: {e.problem or e.context}") from None
    except yaml.YAMLError as e:
        raise PolicyError(f"invalid YAML: {e}") from None
    if not isinstance(data, dict):
        got = "an empty document" if data is None else f"a {type(data).__name__}"
        raise PolicyError(f"the policy must be a mapping at the top level, got {got}")
    try:
        return Policy.model_validate(data)
    except ValidationError as e:
        raise PolicyError("; ".join(_describe(err) for err in e.errors())) from None


def read_policy(path: Path) -> tuple[Policy, str]:
    """Read and parse a policy file: the policy and the sha256 of the file's bytes (the version the gateway
    logs and GET /admin/policy shows). Errors are prefixed with the file's path."""
    try:
        raw = Path(path).read_bytes()
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PolicyError(f"{path}: cannot read policy file: {e}") from None
    try:
        return parse_policy(text), hashlib.sha256(raw).hexdigest()
    except PolicyError as e:
        raise PolicyError(f"{path}: {e}") from None


def load_policy(path: Path) -> Policy:
    """Read and parse a policy file; errors are prefixed with the file's path."""
    return read_policy(path)[0]


# pydantic speaks Python; a policy author wrote YAML.
_PLAIN_MESSAGES = {"tuple_type": "Input should be a list", "model_type": "Input should be a mapping"}


def _describe(err: Any) -> str:
    """One pydantic error as `key.path[0].leaf: message`, without echoing the input value."""
    loc = err["loc"]
    if err["type"] == "extra_forbidden":
        allowed = ", ".join(_model_at(loc[:-1]).model_fields)
        message = f"unknown key (expected one of: {allowed})"
    elif err["type"] == "value_error":
        message = str(err["ctx"]["error"])
    elif err["type"] in _PLAIN_MESSAGES:
        message = _PLAIN_MESSAGES[err["type"]]
    else:
        message = err["msg"].replace("Tuple should", "List should")
    path = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc).lstrip(".")
    return f"{path}: {message}" if path else message


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel]:
    """The model class whose fields live at `loc` (list indexes skipped)."""
    model: type[BaseModel] = Policy
    for part in loc:
        if isinstance(part, int):
            continue
        model = _inner_model(model.model_fields[part].annotation)
    return model


def _inner_model(annotation: Any) -> type[BaseModel]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        try:
            return _inner_model(arg)
        except LookupError:
            continue
    raise LookupError(annotation)
