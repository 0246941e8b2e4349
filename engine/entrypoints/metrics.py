"""Prometheus metrics of one engine server, kept in the server's own registry.

Each `EngineMetrics` owns a `CollectorRegistry` (never prometheus-client's global default), so several
servers in one process (tests) do not collide. Counters and histograms are fed by the HTTP layer from
the timing of each request's output stream; the gauges, and the adapter tier's counters and load-time
histogram (kept by the engine thread), are read from `LLMEngine.stats()` at scrape time.

The per-adapter series (`loragate_engine_adapter_*{adapter}`) have a bounded `adapter` label
(`AdapterLabels`): token counters are fed by the HTTP layer with the `usage` each request answered; requests
running and waiting are read at scrape time from the load report the engine thread publishes
(`LLMEngine.load_report`), device loads and evictions from the device tier's per-id counters, residence from
the adapter tiers. A weighted mix of adapters counts as one adapter under its canonical name (engine/lora/mixes.py:
the id of its derived adapter, the same for every version of its parts), in every one of these series; its
residence is its newest derived adapter's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from engine.core.outputs import EngineStats, RequestOutput
from loragate_common.adapter_cache import AdapterCache, AdapterCacheCollector
from loragate_common.labels import BoundedLabels

if TYPE_CHECKING:  # the engine (and torch) only for the types: the metrics are built before it is bound
    from engine.core.llm_engine import LLMEngine

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0)
MAX_ADAPTER_LABELS = 50  # the default of --metrics-max-adapters
_TIERS = ("device", "host", "disk")


class AdapterLabels(BoundedLabels):
    """The engine's `adapter` label: the base model is labelled with its served name; the first `max_adapters`
    adapter ids seen (in requests for a registered adapter: ids that 404 never take one) keep their own, and
    every later id is counted as "other" (loragate_common/labels.py). Used from the event loop only (request starts
    and scrapes)."""

    def __init__(self, max_adapters: int = MAX_ADAPTER_LABELS, base: str = "") -> None:
        super().__init__(max_adapters)
        self.base = base  # the served model name, once bound to an engine

    def assign(self, adapter_id: str | None) -> str:
        """The label of a request's adapter (None: the base model), giving the id its own while there is room."""
        return self.base if adapter_id is None else super().assign(adapter_id)

    def __call__(self, adapter_id: str | None) -> str:
        """The label of `adapter_id` as things are (never gives out a label)."""
        return self.base if adapter_id is None else self.label(adapter_id)


class _EngineStatsCollector:
    """Gauges computed from an `EngineStats` snapshot each time /metrics is scraped."""

    def __init__(self) -> None:
        self.stats: Callable[[], EngineStats] | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        stats = self.stats()
        gauges = (
            ("loragate_engine_requests_running", "Requests being computed.", stats.num_running),
            ("loragate_engine_requests_waiting", "Requests queued for admission.", stats.num_waiting),
            ("loragate_engine_kv_blocks_used", "KV cache blocks held by requests.", stats.kv_pages_used),
            ("loragate_engine_kv_blocks_free", "Free pages of the unified pool.", stats.kv_blocks_free),
            (
                "loragate_engine_kv_pages_cached",
                "Pool pages holding reusable prefix-cache blocks "
                "that no request uses (reclaimed when pages are needed).",
                stats.kv_pages_cached,
            ),
            ("loragate_engine_adapter_pages_used", "Pool pages holding adapter weights.", stats.adapter_pages_used),
            ("loragate_engine_adapters_registered", "Adapters registered.", stats.adapters_registered),
            ("loragate_engine_adapters_on_device", "Adapters resident in device memory.", stats.adapters_on_device),
        )
        for name, doc, value in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        counters = (
            ("loragate_engine_adapter_hits", "Admissions that found their adapter on the device.", stats.adapter_hits),
            ("loragate_engine_adapter_misses", "Admissions that had to load their adapter.", stats.adapter_misses),
        )  # evictions: per adapter, in _AdapterCollector
        for name, doc, value in counters:
            yield CounterMetricFamily(name, doc, value=value)
        yield from _scheduler_metrics(stats)
        buckets = [(repr(bound), count) for bound, count in stats.adapter_load_buckets]
        yield HistogramMetricFamily(
            "loragate_engine_adapter_load_seconds",
            "Time to copy an adapter into device memory.",
            buckets=[*buckets, ("+Inf", stats.adapter_loads)],
            sum_value=stats.adapter_load_seconds_sum,
        )


def _scheduler_metrics(stats: EngineStats) -> Iterator[Metric]:
    """Priority classes, preemptions and the prefix cache, from the same snapshot."""
    for name, doc, pairs in (
        (
            "loragate_engine_requests_running_by_priority",
            "Requests being computed, by priority.",
            stats.running_by_priority,
        ),
        ("loragate_engine_requests_waiting_by_priority", "Requests queued, by priority.", stats.waiting_by_priority),
    ):
        family = GaugeMetricFamily(name, doc, labels=["priority"])
        for priority, count in pairs:
            family.add_metric([priority], count)
        yield family
    preemptions = CounterMetricFamily(
        "loragate_engine_preemptions", "Running requests preempted, by mode (recompute or swap).", labels=["mode"]
    )
    for mode, count in stats.preemptions:
        preemptions.add_metric([mode], count)
    yield preemptions
    yield CounterMetricFamily(
        "loragate_engine_prefix_cache_queried_tokens",
        "Prompt tokens looked up in the prefix cache.",
        value=stats.prefix_cache_queries,
    )
    yield CounterMetricFamily(
        "loragate_engine_prefix_cache_hit_tokens",
        "Prompt tokens found in the prefix cache (hit rate = hit / queried).",
        value=stats.prefix_cache_hits,
    )
    yield CounterMetricFamily(
        "loragate_engine_adapter_loads_by_admission",
        "Device loads of an adapter caused by admitting a waiting request.",
        value=stats.adapter_loads_by_admission,
    )
    yield CounterMetricFamily(
        "loragate_engine_interrupted_steps",
        "Steps of lower-class work ended between two "
        "layers because a critical request arrived (they run again after it starts).",
        value=stats.interrupted_steps,
    )


class _AdapterCollector:
    """The per-adapter gauges and device-tier counters, computed at scrape time: O(adapters with a label of their
    own + adapters with requests), however many are registered."""

    def __init__(self, labels: AdapterLabels) -> None:
        self.labels = labels
        self.engine: LLMEngine | None = None

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        engine = self.engine
        if engine is None:
            return
        labels = self.labels
        own = list(labels.own)
        report = engine.load_report  # one object the engine thread replaces whole: a consistent moment
        for name, doc, pairs in (
            (
                "loragate_engine_adapter_requests_running",
                "Requests being computed, by adapter.",
                report.running_by_adapter,
            ),
            ("loragate_engine_adapter_requests_waiting", "Requests queued, by adapter.", report.waiting_by_adapter),
        ):
            counts = dict.fromkeys([labels.base, *own, labels.OTHER], 0)
            for adapter_id, n in pairs:
                counts[labels(adapter_id)] += n
            family = GaugeMetricFamily(name, doc, labels=["adapter"])
            for label, n in counts.items():
                family.add_metric([label], n)
            yield family
        resident = GaugeMetricFamily(
            "loragate_engine_adapter_resident",
            "1 for the tier a registered adapter's weights are in now (device, host or disk), 0 for the others; "
            "adapters with a label of their own only.",
            labels=["adapter", "tier"],
        )
        for adapter_id in own:
            where = engine.adapter_residence(adapter_id)
            if where is not None:  # else unregistered: it is in no tier
                for tier in _TIERS:
                    resident.add_metric([adapter_id, tier], float(tier == where))
        yield resident
        # Adapters without a label of their own: all minus the labelled ones, read at one moment. An id counted
        # there never gets a label later (labels are given when first seen), so "other" only grows.
        by_id, loads, evictions = engine.device_adapters.counters.by_adapter(own)
        for name, doc, total, i in (
            ("loragate_engine_adapter_loads", "Device loads of an adapter's weights, by adapter.", loads, 0),
            ("loragate_engine_adapter_evictions", "Adapters evicted from the device, by adapter.", evictions, 1),
        ):
            counter = CounterMetricFamily(name, doc, labels=["adapter"])
            for adapter_id in own:
                counter.add_metric([adapter_id], by_id[adapter_id][i])
            counter.add_metric([labels.OTHER], total - sum(c[i] for c in by_id.values()))
            yield counter


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None, max_adapters: int = MAX_ADAPTER_LABELS) -> None:
        """`max_adapters`: adapters with a label of their own in the per-adapter series (AdapterLabels)."""
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "loragate_engine_requests",
            "Requests by outcome: a finish reason (stop, length, abort) or an HTTP error class (4xx, 5xx).",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter("loragate_engine_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("loragate_engine_generation_tokens", "Tokens generated.", registry=r)
        self.ttft = Histogram(
            "loragate_engine_time_to_first_token_seconds",
            "From arrival to the first generated token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "loragate_engine_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "loragate_engine_e2e_request_latency_seconds",
            "From arrival to the last output.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "loragate_engine_queue_time_seconds",
            "From arrival to first being scheduled, by priority.",
            ["priority"],
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.adapters = AdapterLabels(max_adapters)
        self.adapter_prompt_tokens = Counter(
            "loragate_engine_adapter_prompt_tokens",
            "Prompt tokens of finished requests, by adapter.",
            ["adapter"],
            registry=r,
        )
        self.adapter_generation_tokens = Counter(
            "loragate_engine_adapter_generation_tokens", "Tokens generated, by adapter.", ["adapter"], registry=r
        )
        self._stats_collector = _EngineStatsCollector()
        r.register(self._stats_collector)
        self._adapter_collector = _AdapterCollector(self.adapters)
        r.register(self._adapter_collector)
        self._disk_cache_collector = AdapterCacheCollector("loragate_engine_adapter")
        r.register(self._disk_cache_collector)

    def bind_stats(self, stats: Callable[[], EngineStats]) -> None:
        """Read the running/waiting/KV gauges from `stats` (normally `LLMEngine.stats`)."""
        self._stats_collector.stats = stats

    def bind_engine(self, engine: LLMEngine) -> None:
        """Read the gauges of `engine` (`bind_stats`) and its per-adapter ones; the base model is labelled with
        its served name."""
        self.bind_stats(engine.stats)
        self.adapters.base = engine.model_name
        self._adapter_collector.engine = engine

    def bind_store(self, store: AdapterCache | None) -> None:
        """Export the disk cache of fetched adapters (none without --adapter-cache-dir)."""
        self._disk_cache_collector.cache = store

    def start_request(self, priority: str = "standard") -> RequestTracker:
        """A request's tracker; name its adapter (`RequestTracker.adapter`) once the engine accepted it."""
        return RequestTracker(self, priority)

    def count_error(self, status_code: int) -> None:
        self.requests.labels(status=f"{status_code // 100}xx").inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class RequestTracker:
    """Times one request's output stream and records it once, when it ends."""

    def __init__(self, metrics: EngineMetrics, priority: str) -> None:
        self._metrics = metrics
        self._priority = priority
        self._arrival = time.monotonic()
        self._first_token: float | None = None
        self._last: RequestOutput | None = None
        self._last_time = self._arrival
        self._done = False
        self.adapter = metrics.adapters.base  # its `adapter` label, set by the server once the engine accepted it

    def on_output(self, out: RequestOutput) -> None:
        if out.queue_time_s is not None:
            self._metrics.queue_time.labels(priority=self._priority).observe(out.queue_time_s)
        if self._first_token is None and out.new_token_ids:
            self._first_token = time.monotonic()
            self._metrics.ttft.observe(self._first_token - self._arrival)
        self._last = out
        self._last_time = time.monotonic()

    def finish(self, status: str | None = None) -> None:
        """Record the request; `status` defaults to the last output's finish reason (else abort)."""
        if self._done:
            return
        self._done = True
        last = self._last
        if status is None:
            status = last.finish_reason if last is not None and last.finish_reason else "abort"
        m = self._metrics
        m.requests.labels(status=status).inc()
        if last is None:
            m.e2e.observe(time.monotonic() - self._arrival)
            return
        m.e2e.observe(self._last_time - self._arrival)
        m.prompt_tokens.inc(last.num_prompt_tokens)
        m.generation_tokens.inc(last.num_output_tokens)
        # The same numbers as the `usage` the client was sent (engine/entrypoints/responses.py usage()).
        m.adapter_prompt_tokens.labels(adapter=self.adapter).inc(last.num_prompt_tokens)
        m.adapter_generation_tokens.labels(adapter=self.adapter).inc(last.num_output_tokens)
        if self._first_token is not None and last.num_output_tokens > 1:
            m.tpot.observe((self._last_time - self._first_token) / (last.num_output_tokens - 1))
