"""The agent's Prometheus metrics, in its own `CollectorRegistry` (several agents in one process, as in the tests, do
not collide). vLLM loads, unloads and failures are counted as they happen; the disk cache's series are read from it
at scrape time, without a per-adapter label (GET /v1/adapters lists each one).

  loragate_vllm_agent_loads_total                   adapters loaded into vLLM
  loragate_vllm_agent_unloads_total                 adapters unloaded from vLLM (files left the cache, or replaced)
  loragate_vllm_agent_failures_total{reason}        failed ensures and unloads: the cache's reason (not_allowed,
                                                    unreachable, digest_mismatch, too_large, ...), vllm_refused,
                                                    runtime_updating_off, vllm_unavailable, unload_failed
  loragate_vllm_agent_downloads_total               downloads verified and stored
  loragate_vllm_agent_download_failures_total       downloads that failed
  loragate_vllm_agent_cache_evictions_total         entries evicted from the disk cache
  loragate_vllm_agent_cache_bytes                   bytes of adapters on disk
  loragate_vllm_agent_cache_limit_bytes             the cache's bound (--adapter-cache-mb)
  loragate_vllm_agent_cache_entries{state}          entries downloading, on disk, failed
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from loragate_common.adapter_cache import AdapterCache, AdapterCacheCollector


class AgentMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.loads = Counter("loragate_vllm_agent_loads", "Adapters loaded into vLLM.", registry=self.registry)
        self.unloads = Counter(
            "loragate_vllm_agent_unloads",
            "Adapters unloaded from vLLM (their files left the cache, or the id was replaced).",
            registry=self.registry,
        )
        self.failures = Counter(
            "loragate_vllm_agent_failures", "Failed ensures and unloads, by reason.", ["reason"], registry=self.registry
        )
        self._cache = AdapterCacheCollector("loragate_vllm_agent")
        self.registry.register(self._cache)

    def bind_cache(self, cache: AdapterCache) -> None:
        self._cache.cache = cache

    def failed(self, reason: str) -> None:
        self.failures.labels(reason=reason).inc()

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
