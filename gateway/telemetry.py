"""The gateway's Prometheus metrics and OpenTelemetry spans.

`GatewayMetrics` owns a `CollectorRegistry` (never prometheus-client's global default), so several
gateways in one process (tests) do not collide. Counters and histograms are fed per request by the app;
queue depths, in-flight requests, breaker states, Redis errors and the Redis breaker belong to other
components and are read from callbacks at scrape time (`bind`), so there is one owner of each number.

Each request runs in a SERVER span (`request_span`, named "{operation} {model}" after the GenAI semantic
conventions); `inject_headers` puts its context in the upstream request as a W3C `traceparent`, which the
engine continues (engine/entrypoints/tracing.py), so gateway and engine spans share one trace; both
processes build their TracerProvider with loragate_common/tracing.py from the same OTEL_* environment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from loragate_common.adapter_mix import is_mix
from loragate_common.labels import BoundedLabels

_DURATION_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
RATELIMIT_DECISIONS = ("allowed", "rate_limited", "tokens_exhausted", "budget_exhausted", "unavailable")
MAX_ADAPTER_LABELS = 50  # adapters with a label of their own beyond the policy's named ones; the rest: "other"
MAX_MIX_LABELS = 20  # mixes of adapters with a label of their own (their canonical names); the rest: "other"
BREAKER_STATES = {"closed": 0, "half_open": 1, "open": 2}
CATALOG_STATES = ("active", "deprecated")

_GLOB_CHARS = frozenset("*?[]")


class AdapterLabels(BoundedLabels):
    """The gateway's `adapter` label (loragate_common/labels.py): the base models and the adapters and rollouts the
    policy names (tenants' `adapters` entries that are not globs, rollout names and variants) keep their own;
    of the others, the first `max_extra` seen keep theirs, and every later one is counted as "other". Mixes of
    adapters (their canonical names) have a bound of their own, `max_mixes`: clients write new mixes at will,
    and they must not take the labels of the adapters they mix."""

    def __init__(self, max_extra: int = MAX_ADAPTER_LABELS, max_mixes: int = MAX_MIX_LABELS) -> None:
        super().__init__(max_extra)
        self.bases: Callable[[], frozenset[str]] = frozenset
        self.mixes = BoundedLabels(max_mixes)

    def name_from_policy(self, tenants: Iterable[Iterable[str]], rollouts: Iterable[tuple[str, Iterable[str]]]) -> None:
        named = {a for adapters in tenants for a in adapters if not _GLOB_CHARS & set(a)}
        for name, variants in rollouts:
            named.add(name)
            named.update(variants)
        self.named = frozenset(named)

    def __call__(self, adapter: str) -> str:
        if not adapter or adapter in self.bases():  # "": answered before an adapter was known
            return adapter
        if is_mix(adapter):
            return self.mixes.assign(adapter)
        return self.assign(adapter)


_propagator = TraceContextTextMapPropagator()
_tracer = trace.get_tracer("loragate.gateway")  # a proxy: follows whatever provider is set later


class RedisBreakerView(Protocol):
    """What the metrics read of a Redis circuit breaker (gateway/redis_client.py's RedisBreaker)."""

    @property
    def is_open(self) -> bool: ...
    @property
    def skipped(self) -> int: ...


class _Bound:
    """The scrape-time callbacks given to `GatewayMetrics.bind`."""

    def __init__(
        self,
        queue_depths: Callable[[], dict[str, int]],
        inflight: Callable[[], dict[str, int]],
        breaker_states: Callable[[], dict[str, str]],
        redis_errors: Callable[[], int],
        rolled_back: Callable[[], dict[str, bool]],
        spills: Callable[[], int],
        rollout_weights: Callable[[], dict[tuple[str, str], float]],
        overrides: Callable[[], dict[str, Any]],
        redis_breakers: Callable[[], Sequence[RedisBreakerView]],
        ledger: Callable[[], dict[str, int]],
        catalog: Callable[[], dict[str, int]],
        prefix: Callable[[], dict[str, Any]],
    ) -> None:
        self.catalog = catalog
        self.prefix = prefix
        self.ledger = ledger
        self.queue_depths = queue_depths
        self.redis_breakers = redis_breakers
        self.rollout_weights = rollout_weights
        self.overrides = overrides
        self.inflight = inflight
        self.breaker_states = breaker_states
        self.redis_errors = redis_errors
        self.rolled_back = rolled_back
        self.spills = spills


class _StateCollector:
    """Gauges and the Redis error counter, computed from the bound callbacks at each scrape."""

    def __init__(self) -> None:
        self.bound: _Bound | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        bound = self.bound
        if bound is None:
            return
        queue = GaugeMetricFamily(
            "loragate_gateway_queue_depth", "Requests queued for admission, by priority band.", labels=["band"]
        )
        for band, depth in sorted(bound.queue_depths().items()):
            queue.add_metric([band], depth)
        yield queue
        inflight = GaugeMetricFamily(
            "loragate_gateway_inflight", "Requests in flight to each upstream.", labels=["upstream"]
        )
        for upstream, count in sorted(bound.inflight().items()):
            inflight.add_metric([upstream], count)
        yield inflight
        breaker = GaugeMetricFamily(
            "loragate_gateway_breaker_state",
            "Circuit breaker of each upstream: 0 closed, 1 half_open, 2 open.",
            labels=["upstream", "state"],
        )
        for upstream, state in sorted(bound.breaker_states().items()):
            breaker.add_metric([upstream, state], BREAKER_STATES[state])
        yield breaker
        yield CounterMetricFamily(
            "loragate_gateway_redis_errors",
            "Rate limiter calls that failed to reach Redis.",
            value=bound.redis_errors(),
        )
        redis_breakers = bound.redis_breakers()
        yield GaugeMetricFamily(
            "loragate_gateway_redis_breaker_open",
            "1 while the Redis circuit breaker is open (Redis is skipped, or one probe call is testing it).",
            value=int(any(b.is_open for b in redis_breakers)),
        )
        yield CounterMetricFamily(
            "loragate_gateway_redis_skipped",
            "Redis calls answered as unreachable at once, without trying Redis, while its breaker was open.",
            value=sum(b.skipped for b in redis_breakers),
        )
        rolled = GaugeMetricFamily(
            "loragate_gateway_rollout_rolled_back",
            "1 while a rollout serves only its first variant after an automatic rollback.",
            labels=["rollout"],
        )
        for rollout, flag in sorted(bound.rolled_back().items()):
            rolled.add_metric([rollout], int(flag))
        yield rolled
        weights = GaugeMetricFamily(
            "loragate_gateway_rollout_weight",
            "Percent of a rollout's traffic each "
            "variant gets now (a progressive rollout's step, a promotion, a rollback).",
            labels=["rollout", "variant"],
        )
        for (rollout, variant), weight in sorted(bound.rollout_weights().items()):
            weights.add_metric([rollout, variant], weight)
        yield weights
        overrides = bound.overrides()
        drained = GaugeMetricFamily(
            "loragate_gateway_upstream_drained", "1 for an upstream an operator drained.", labels=["upstream"]
        )
        for entry in overrides.get("drained_upstreams", ()):
            drained.add_metric([entry["target"]], 1)
        yield drained
        suspended = GaugeMetricFamily(
            "loragate_gateway_tenant_suspended", "1 for a tenant an operator suspended.", labels=["tenant"]
        )
        for entry in overrides.get("suspended_tenants", ()):
            suspended.add_metric([entry["target"]], 1)
        yield suspended
        yield CounterMetricFamily(
            "loragate_gateway_affinity_spills",
            "Adapter requests sent to another "
            "upstream because their preferred one had spill_inflight requests in flight.",
            value=bound.spills(),
        )
        ledger = bound.ledger()
        yield GaugeMetricFamily(
            "loragate_gateway_usage_pending",
            "Usage records buffered on this replica, not yet in the shared store (it is unreachable, or the "
            "next write is under a second away).",
            value=ledger.get("pending", 0),
        )
        yield CounterMetricFamily(
            "loragate_gateway_usage_dropped",
            "Usage records lost because the buffer was full while the store was unreachable.",
            value=ledger.get("dropped", 0),
        )
        catalog = GaugeMetricFamily(
            "loragate_gateway_catalog_adapters",
            "Adapter versions (ID@N) in the fleet's catalog as this replica sees it, by state (active or deprecated).",
            labels=["state"],
        )
        counts = bound.catalog()
        for state in CATALOG_STATES:
            catalog.add_metric([state], counts.get(state, 0))
        yield catalog
        yield from _prefix_metrics(bound.prefix())


# (metric, help, the prefix of its counts in PrefixIndex.describe()["outcomes"], its outcomes)
ROUTING_OUTCOMES = (
    (
        "loragate_gateway_prefix_routing",
        "Requests routed by prompt prefix: hit (to an engine holding the longest match), miss (no engine held any "
        "of it), overridden (the longest match was past the load bound).",
        "prefix_",
        ("hit", "miss", "overridden"),
    ),
    (
        "loragate_gateway_session_routing",
        "Requests with a session key: hit (to its session's engine), new (the session's first), overridden (its "
        "engine was past the load bound or held less of the prompt than another).",
        "session_",
        ("hit", "new", "overridden"),
    ),
)


def _prefix_metrics(state: dict[str, Any]) -> Iterator[Metric]:
    """Prefix-aware routing and session affinity (gateway/prefix_index.py's `describe()`)."""
    counts = state.get("outcomes", {})
    for name, documentation, prefix, outcomes in ROUTING_OUTCOMES:
        family = CounterMetricFamily(name, documentation, labels=["outcome"])
        for outcome in outcomes:
            family.add_metric([outcome], counts.get(prefix + outcome, 0))
        yield family
    yield GaugeMetricFamily(
        "loragate_gateway_prefix_index_entries",
        "Prompt chunk hashes (and sessions) this replica's prefix index holds.",
        value=state.get("entries", 0),
    )


class GatewayMetrics:
    """The gateway's metrics, in a registry of their own; `render` is the body of GET /metrics."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            "loragate_gateway_requests",
            "Requests answered, by tenant, adapter, HTTP status and X-Loragate-Reason (empty when none).",
            ["tenant", "adapter", "status", "reason"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "loragate_gateway_request_duration_seconds",
            "Arrival to the last byte of the response, by adapter and status class (2xx, 4xx, ...).",
            ["adapter", "status_class"],
            buckets=_DURATION_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "loragate_gateway_time_to_first_token_seconds",
            "Arrival to the first generated token reaching the client.",
            ["adapter"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "loragate_gateway_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            ["adapter"],
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.ratelimit = Counter(
            "loragate_gateway_ratelimit_decisions", "Rate limiter decisions.", ["decision"], registry=self.registry
        )
        for decision in RATELIMIT_DECISIONS:  # every series exists from the start (rate() needs a 0)
            self.ratelimit.labels(decision)
        self.reload_errors = Counter(
            "loragate_gateway_policy_reload_errors",
            "Policy reloads refused (the last good policy stayed active).",
            registry=self.registry,
        )
        self.rollout_requests = Counter(
            "loragate_gateway_rollout_requests",
            "Requests of a rollout that reached a variant, by rollout, variant and result (ok or error).",
            ["rollout", "variant", "result"],
            registry=self.registry,
        )
        self.rollout_ttft = Histogram(
            "loragate_gateway_rollout_time_to_first_token_seconds",
            "Arrival to the "
            "first token (a whole answer: to the answer) of a rollout's successful "
            "requests, by variant.",
            ["rollout", "variant"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        )
        self.rollbacks = Counter(
            "loragate_gateway_rollout_rollbacks",
            "Automatic rollbacks this replica decided, by rollout and the bound broken (error_rate or ttft_p99).",
            ["rollout", "reason"],
            registry=self.registry,
        )
        self.rollout_steps = Counter(
            "loragate_gateway_rollout_steps",
            "Progressive rollout steps this replica took, by rollout and the status reached (progressing or promoted).",
            ["rollout", "status"],
            registry=self.registry,
        )
        self.admin_actions = Counter(
            "loragate_gateway_admin_actions",
            "Operator actions through the admin API, by action and whether it changed anything.",
            ["action", "changed"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "loragate_gateway_prompt_tokens",
            "Prompt tokens of finished requests (the engine's count), by tenant and adapter.",
            ["tenant", "adapter"],
            registry=self.registry,
        )
        self.completion_tokens = Counter(
            "loragate_gateway_completion_tokens",
            "Completion tokens sent to clients, by tenant and adapter.",
            ["tenant", "adapter"],
            registry=self.registry,
        )
        self.mix_parts = Counter(
            "loragate_gateway_mix_part_requests",
            "Requests answered for a mix of adapters, once per part: by tenant, the part's adapter and HTTP status.",
            ["tenant", "adapter", "status"],
            registry=self.registry,
        )
        self.budget_alerts = Counter(
            "loragate_gateway_budget_alerts",
            "Tenants reaching 80% or 100% of a token budget (once per tenant, window and level on a replica).",
            ["tenant", "window", "level"],
            registry=self.registry,
        )
        self.adapter_label = AdapterLabels()
        self._tallies: dict[str, list[int]] = {}  # tenant -> [requests, shed, errors], for the ops page
        self._state = _StateCollector()
        self.registry.register(self._state)

    def observe_request(self, tenant: str, adapter: str, status: int, reason: str | None, duration_s: float) -> None:
        adapter = self.adapter_label(adapter)
        self.requests.labels(tenant, adapter, str(status), reason or "").inc()
        tally = self._tallies.setdefault(tenant, [0, 0, 0])
        tally[0] += 1
        tally[1] += status in (429, 503)
        tally[2] += status >= 500 and status != 503
        self.duration.labels(adapter, f"{status // 100}xx").observe(duration_s)

    def observe_ttft(self, adapter: str, seconds: float) -> None:
        self.ttft.labels(self.adapter_label(adapter)).observe(seconds)

    def observe_tpot(self, adapter: str, seconds: float) -> None:
        self.tpot.labels(self.adapter_label(adapter)).observe(seconds)

    def count_tokens(self, tenant: str, adapter: str, prompt: int, completion: int) -> None:
        adapter = self.adapter_label(adapter)
        self.prompt_tokens.labels(tenant, adapter).inc(prompt)
        self.completion_tokens.labels(tenant, adapter).inc(completion)

    def count_mix_parts(self, tenant: str, parts: Iterable[str], status: int) -> None:
        """One answered request for a mix: each of its parts' adapters (the mix itself is `observe_request`'s)."""
        for part in parts:
            self.mix_parts.labels(tenant, self.adapter_label(part), str(status)).inc()

    def count_budget_alert(self, tenant: str, window: str, level: float) -> None:
        self.budget_alerts.labels(tenant, window, f"{round(level * 100)}%").inc()

    def count_ratelimit(self, decision: str) -> None:
        self.ratelimit.labels(decision).inc()

    def observe_variant(self, rollout: str, variant: str, error: bool, ttft_s: float | None) -> None:
        variant = self.adapter_label(variant)  # named by the policy, unless an override header names another
        self.rollout_requests.labels(rollout, variant, "error" if error else "ok").inc()
        if not error and ttft_s is not None:
            self.rollout_ttft.labels(rollout, variant).observe(ttft_s)

    def count_rollback(self, rollout: str, reason: str) -> None:
        self.rollbacks.labels(rollout, reason).inc()

    def tally(self, tenant: str) -> dict[str, int]:
        """A tenant's answers since start: all, shed (429 or 503) and server errors (other 5xx)."""
        requests, shed, errors = self._tallies.get(tenant, (0, 0, 0))
        return {"requests": requests, "shed": shed, "errors": errors}

    def count_rollout_step(self, rollout: str, status: str) -> None:
        self.rollout_steps.labels(rollout, status).inc()

    def count_admin_action(self, action: str, changed: bool) -> None:
        self.admin_actions.labels(action, str(changed).lower()).inc()

    def count_reload_error(self) -> None:
        self.reload_errors.inc()

    def bind(
        self,
        *,
        queue_depths: Callable[[], dict[str, int]],
        inflight: Callable[[], dict[str, int]],
        breaker_states: Callable[[], dict[str, str]],
        redis_errors: Callable[[], int],
        rolled_back: Callable[[], dict[str, bool]] = dict,
        spills: Callable[[], int] = int,
        rollout_weights: Callable[[], dict[tuple[str, str], float]] = dict,
        overrides: Callable[[], dict[str, Any]] = dict,
        redis_breakers: Callable[[], Sequence[RedisBreakerView]] = list,
        ledger: Callable[[], dict[str, int]] = dict,
        catalog: Callable[[], dict[str, int]] = dict,
        prefix: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        """Read these at each scrape; binding again replaces the callbacks."""
        self._state.bound = _Bound(
            queue_depths,
            inflight,
            breaker_states,
            redis_errors,
            rolled_back,
            spills,
            rollout_weights,
            overrides,
            redis_breakers,
            ledger,
            catalog,
            prefix,
        )

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


@contextmanager
def request_span(operation: str, model: str, *, tenant: str, adapter: str, priority: str) -> Iterator[Span]:
    """The current SERVER span of one gateway request; an exception is recorded, marks it an error and
    is re-raised. Upstream calls made inside it carry its context (`inject_headers`)."""
    attributes = {
        "gen_ai.operation.name": operation,
        "gen_ai.request.model": model,
        "loragate.tenant": tenant,
        "loragate.adapter": adapter,
        "loragate_common.priority": priority,
    }
    with _tracer.start_as_current_span(f"{operation} {model}", kind=SpanKind.SERVER, attributes=attributes) as span:
        yield span


def finish_span(
    span: Span, *, status_code: int, outcome: str, input_tokens: int | None = None, output_tokens: int | None = None
) -> None:
    """What the request came to: status, outcome (e.g. "ok" or an X-Loragate-Reason) and token usage.

    Only a server-side failure (>= 500) marks the span as an error: a 4xx is the client's.
    """
    span.set_attribute("http.response.status_code", status_code)
    span.set_attribute("loragate.outcome", outcome)
    if input_tokens is not None:
        span.set_attribute("gen_ai.usage.input_tokens", input_tokens)
    if output_tokens is not None:
        span.set_attribute("gen_ai.usage.output_tokens", output_tokens)
    if status_code >= 500:
        span.set_attribute("error.type", outcome)
        span.set_status(StatusCode.ERROR, outcome)


def inject_headers(headers: dict[str, str]) -> None:
    """Add the current span's W3C `traceparent` to `headers` (nothing when no span is recording)."""
    _propagator.inject(headers)
