"""What the engine hands back to its callers after each step."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.core.request import TokenLogprob

if TYPE_CHECKING:
    from engine.lora.peft_config import AdapterSpec


@dataclass(frozen=True, slots=True)
class RequestError:
    """Why one request failed while others went on: its adapter could not be used, or the engine failed
    computing it (a step that raised, or non-finite logits on its rows)."""

    type: str  # "adapter_error" | "engine_error"
    message: str


@dataclass(slots=True)  # not frozen: one is made per running request per step, and frozen makes __init__ 4x slower
class RequestOutput:
    """The change to one request in one engine step (a delta, never the whole text so far)."""

    request_id: str
    new_token_ids: list[int]  # tokens generated this step (may be empty, e.g. on abort)
    new_text: str  # text safe to show now; text that may be the start of a stop string is held back
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" once finished, else None
    num_prompt_tokens: int
    num_output_tokens: int  # generated so far, including new_token_ids
    new_logprobs: list[TokenLogprob] = field(default_factory=list)  # aligned with new_token_ids
    queue_time_s: float | None = None  # on a request's first output: arrival to first scheduled
    error: RequestError | None = None  # set when finish_reason is "error"
    # With prompt logprobs: the whole list (entry 0 None), once, on the first output after the prompt is computed
    # (the one with the first token; or the only one, finish_reason "length", for max_tokens 0).
    prompt_logprobs: list[TokenLogprob | None] | None = None


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    """One step's samples, aligned with `SchedulerOutput.requests`."""

    sampled: Sequence[int | None]  # None: the request only computed part of its prompt, or failed
    logprobs: Sequence[TokenLogprob | None]  # None: not asked for, or nothing sampled
    errors: dict[int, str] = field(default_factory=dict)  # batch index -> why that request failed
    # batch index -> (p, entries): the prompt logprobs computed this step for prompt positions p, p + 1, ...
    # (entries[j] is position p + j's: its token's logprob given the tokens before it). Only for requests with
    # prompt logprobs; a position already recorded may come again (a recomputed chunk): it is recorded once.
    prompt_logprobs: dict[int, tuple[int, list[TokenLogprob]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class AdapterStatus:
    """What GET /v1/adapters shows for one registered adapter."""

    adapter_id: str
    version: int
    rank: int  # the largest rank over its modules
    target_modules: tuple[str, ...]  # the decoder's projections, then embed_tokens and lm_head
    residence: str  # "device" (in the page pool), "host" (parsed in RAM) or "disk"
    kind: str = "LoRA"  # AdapterSpec.kind: "LoRA" or "DoRA"

    @classmethod
    def of(cls, spec: AdapterSpec, residence: str) -> AdapterStatus:
        modules = spec.modules + spec.vocab_modules
        return cls(spec.adapter_id, spec.version, spec.max_rank, modules, residence, spec.kind)


@dataclass(frozen=True, slots=True)
class EngineStats:
    """A snapshot for metrics and /readyz."""

    num_running: int
    num_waiting: int
    kv_blocks_total: int  # pages in the unified pool
    kv_blocks_free: int
    kv_pages_used: int = 0  # pages holding KV blocks of requests
    kv_pages_cached: int = 0  # pages holding cached prefix blocks no request uses (reclaimable)
    adapter_pages_used: int = 0  # pages holding adapter weights
    adapters_registered: int = 0
    adapters_on_device: int = 0
    adapter_hits: int = 0  # device-tier lookups at admission that found the adapter resident
    adapter_misses: int = 0
    adapter_loads: int = 0  # loads into the page pool
    adapter_evictions: int = 0
    # Load time histogram: cumulative counts per upper bound (seconds), plus sum and count.
    adapter_load_buckets: tuple[tuple[float, int], ...] = ()
    adapter_load_seconds_sum: float = 0.0
    adapter_loads_by_admission: int = 0  # device loads triggered by admitting a waiting request
    running_by_priority: tuple[tuple[str, int], ...] = ()  # (priority name, count)
    waiting_by_priority: tuple[tuple[str, int], ...] = ()
    preemptions: tuple[tuple[str, int], ...] = ()  # (mode, count)
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    interrupted_steps: int = 0  # steps of lower-class work a critical arrival ended early


@dataclass(frozen=True, slots=True)
class LoadReport:
    """The engine's load as the engine thread published it (`LLMEngine.load_report`): after every step and every batch
    of arrivals and aborts it applies. GET /load, the X-Loragate-Load header and the per-adapter gauges read it
    from the event loop without a round trip to the engine thread: the thread replaces the whole (immutable)
    object, so a reader sees one moment's counts, never a structure the thread is changing."""

    running: int
    waiting: int
    kv_blocks_used: int  # pages holding requests' KV blocks
    kv_blocks_free: int  # free pages of the unified pool
    adapter_pages: int  # pages holding adapter weights
    total_pages: int
    device_adapters: tuple[str, ...] = ()  # ids whose current version is resident on the device, sorted
    # (adapter id or None for the base model, requests): only ids with at least one request
    running_by_adapter: tuple[tuple[str | None, int], ...] = ()
    waiting_by_adapter: tuple[tuple[str | None, int], ...] = ()
    # Chunk hashes (X-Loragate-Prefix) of recent prompts whose text the prefix cache holds, most recent first
    # (KVCacheManager.held_prefixes); refreshed at most once per PREFIX_REPORT_S (engine/core/llm_engine.py).
    prefixes: tuple[str, ...] = ()

    @property
    def pool_used(self) -> float:
        """The pool's pages in use, 0..1: requests' KV blocks and adapter weights. Cached prefix blocks no
        request holds are not counted: they are given back whenever pages are needed."""
        return (self.kv_blocks_used + self.adapter_pages) / self.total_pages
