"""The synchronous engine: owns the scheduler, the runner and detokenization; one `step()` at a time.

Data flow of one step:  Scheduler.schedule -> ModelRunner.execute -> Scheduler.update_from_output ->
detokenize (stop strings) -> RequestOutput deltas. Only the scheduler changes request state.

A request that cannot be computed fails alone (finish reason "error", with a `RequestError`), never the
batch: an adapter whose weights cannot be loaded fails the requests that need it (and that version is
remembered as broken); a row with non-finite logits, or whose output constraint fails or allows no token,
fails its request; and when the forward pass itself raises, the step is run again on halves of the batch until
the request(s) that make it raise are found.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from engine.config import EngineConfig
from engine.core.detokenizer import ByteLevelPieces, IncrementalDetokenizer
from engine.core.memory import KVCacheManager, PagePool
from engine.core.outputs import AdapterStatus, EngineStats, LoadReport, RequestError, RequestOutput, RunnerOutput
from engine.core.preemption import KVSwapper
from engine.core.request import Request, RequestStatus, SamplingParams, TokenLogprob
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.lora.device_tier import LOAD_BUCKETS, DeviceAdapterTier
from engine.lora.dora import DoraNorms
from engine.lora.files import load_weights
from engine.lora.mixes import PartUnusable
from engine.lora.peft_config import AdapterError, AdapterSpec
from engine.lora.registry import AdapterRegistry, HostAdapterCache
from engine.lora.routes import ROUTES
from engine.model.attention import allocate_kv_cache, kv_cache_bytes_per_block
from engine.model.cpu_gemm import step_rounding, warm_up_gemms
from engine.model.decoder import StepInterrupted
from engine.model.generation import load_sampling_defaults
from engine.model.loader import load_model
from engine.model.sources import load_tokenizer, resolve_model
from engine.structured import prepare_tokenizer
from engine.worker.cuda_graphs import CudaGraph, DecodeGraphs, Graph
from engine.worker.runner import ModelRunner
from engine.worker.sampler import Sampler
from engine.worker.threads import ThreadTuner, TransientWorker, make_current, usable_cpus
from loragate_common.adapter_mix import is_mix
from loragate_common.prefix import PromptChunks
from loragate_common.priority import Priority
from loragate_kernels.backends import Backends

logger = logging.getLogger(__name__)

# The held prefixes in the load report are recomputed at most this often (seconds): a report is made after every
# step, and the gateway polls it once a second.
PREFIX_REPORT_S = 1.0


class AdapterUnusable(RuntimeError):
    """The adapter version a request names failed to load before (its files are broken): the request is
    refused at once instead of failing in a step."""


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.threads: ThreadTuner | None = None
        if config.num_threads == "auto":
            self.threads = ThreadTuner(usable_cpus())
        elif isinstance(config.num_threads, int):  # validate(): otherwise None
            torch.set_num_threads(config.num_threads)
        # torch's thread count is per thread: whichever thread steps this engine computes with these.
        self._fixed_threads = torch.get_num_threads()
        self.config = config
        resolved = resolve_model(config.model)
        self.model_name = config.served_model_name or resolved.name
        # read before the weights, so a bad file is refused at once; requests take them at the edge (protocol.py)
        self.sampling_defaults = load_sampling_defaults(config.generation_config, resolved.path)
        logger.info("%s", self.sampling_defaults.summary())
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(resolved.path)
        device = torch.device(config.device)
        make_current(device)
        # every seam's route, decided here once (loragate_kernels/backends.py), logged and shown in GET /load
        self.backends = backends = Backends.resolve(device, config.dtype)
        logger.info("backends: %s", backends.summary())
        self.dtype = dtype = backends.dtype
        self.model = load_model(resolved.path, backends, head_screen=config.head_screen)
        mc = self.model.config
        self.vocab_size = mc.vocab_size
        self.max_model_len = self._max_model_len(config, mc.max_position_embeddings)

        num_blocks = config.num_kv_blocks or (
            (config.pool_mb << 20) // kv_cache_bytes_per_block(mc, config.block_size, dtype)
        )
        if num_blocks < 1:
            raise ValueError(f"--pool-mb {config.pool_mb} holds no KV block of this model")
        self.pool = PagePool(num_blocks)
        kv = KVCacheManager(self.pool, config.block_size, config.enable_prefix_cache)
        eos = set(mc.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = tuple(sorted(eos))
        kv_cache = allocate_kv_cache(mc, num_blocks, config.block_size, dtype, device)
        self.adapters = AdapterRegistry(mc, self.model.base_vocab)
        if config.adapter_dir is not None:
            self.adapters.scan_dir(Path(config.adapter_dir))
        self.host_adapters = HostAdapterCache(config.host_adapter_mb << 20, mc, dtype)
        self.device_adapters = DeviceAdapterTier(
            self.pool,
            kv_cache,
            mc,
            config.max_device_adapters,
            self.host_adapters,
            reclaim=kv.evict_cached,
            mirror=ROUTES[backends.lora].mirror,
            base=DoraNorms(self.model),  # DoRA adapters' row scales come from the base's projections
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                config.max_batch_tokens,
                config.max_num_seqs,
                self.max_model_len,
                config.preemption,
                config.aging_s,
                config.max_adapters_per_step or config.max_device_adapters,
                config.max_prefill_tokens,
                *step_rounding(device),
            ),
            kv,
            self.eos_token_ids,
            self.device_adapters,
            KVSwapper(kv_cache),
        )
        self.runner = ModelRunner(
            self.model,
            kv_cache,
            config.block_size,
            Sampler(self.eos_token_ids, greedy=backends.sampler),
            device,
            self.device_adapters,
            config.max_num_seqs,
            self.max_model_len,
        )
        if device.type == "cuda" and config.cuda_graphs:
            self.enable_graphs(CudaGraph.factory(device))
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        # A byte-level tokenizer's tokens as bytes: detokenizing then calls no tokenizer code (None for others).
        self._byte_pieces = ByteLevelPieces.build(self.tokenizer)
        self.interrupted_steps = 0  # steps a critical arrival ended early (see step())
        self._rerun_due = False  # the next step of lower-class work runs whole
        self._prefetcher = TransientWorker("adapter-prefetch")  # engine/worker/threads.py: why not a pool
        self._prefixes: tuple[str, ...] = ()  # the last KVCacheManager.held_prefixes()
        self._prefixes_at = -float("inf")  # when (time.monotonic()) they were computed
        self.prefixes_stale = False  # a report since then kept them: the cache may have changed
        self.load_report = self._load_report()  # replaced by publish_load()
        logger.info(
            "engine ready: model=%s dtype=%s kv_blocks=%d x %d tokens, max_model_len=%d",
            self.model_name,
            backends.dtype,
            num_blocks,
            config.block_size,
            self.max_model_len,
        )

    @staticmethod
    def _max_model_len(config: EngineConfig, model_max: int) -> int:
        if config.max_model_len is None:
            return model_max
        if config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {model_max}"
            )
        return config.max_model_len

    # ---- requests -----------------------------------------------------------------------------------

    def check_request(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter: AdapterSpec | None = None
    ) -> None:
        """Raise ValueError if this request could never run here."""
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("prompt: must not be empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {self.vocab_size})")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {self.max_model_len} tokens"
            )
        blocks = self.scheduler.kv.blocks_for(n + params.max_tokens)
        if adapter is not None:
            blocks += self.device_adapters.pages_needed(adapter)
        if blocks > self.pool.num_pages:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) needs {blocks} "
                f"pages (KV blocks and adapter weights); the pool holds "
                f"{self.pool.num_pages} (raise --pool-mb)"
            )

    def check_adapter(self, adapter: AdapterSpec) -> None:
        """AdapterUnusable if this adapter version's weights (or a mix's, or one of its parts') already failed to
        load."""
        for spec in (adapter, *(part for part, _ in adapter.parts)):
            reason = self.adapters.broken(spec)
            if reason is not None:
                raise AdapterUnusable(reason)

    def resolve_adapter(self, name: str) -> AdapterSpec:
        """The adapter version a request naming `name` runs with: the registered one, or for a mix
        (`a*0.7+b*0.3`) its derived adapter over its parts' current versions (engine/lora/mixes.py). KeyError
        naming the adapter (or the mix's part) that is not registered; AdapterError for a mix that cannot be served,
        among them one whose summed ranks need more pages than the pool holds."""
        if not is_mix(name):
            return self.adapters.get(name)
        spec = self.adapters.mix(name)
        pages = self.device_adapters.pages_needed(spec)
        if pages > self.pool.num_pages:
            raise AdapterError(
                f"adapter mix {spec.adapter_id!r}: its parts' ranks add up to {spec.max_rank} in places, which "
                f"needs {pages} pages of the pool; it holds {self.pool.num_pages} (mix fewer or smaller adapters, "
                "or raise --pool-mb)"
            )
        return spec

    def verify_adapter(self, spec: AdapterSpec) -> None:
        """Read an adapter's weights as the device tier would (AdapterError if any is not finite in the
        engine's dtype): POST /v1/adapters refuses a broken adapter instead of failing its requests."""
        load_weights(spec, self.model.config, self.dtype)

    def register_cached(self, adapter_id: str, path: Path) -> AdapterSpec:
        """Register an adapter and read its weights straight into the host tier: one read that both checks
        them (AdapterError if any is not finite in the engine's dtype; then it is not registered) and
        serves its first request (a fetched adapter is registered because a request is waiting for it)."""
        spec = self.adapters.register(adapter_id, path)
        try:
            self.host_adapters.prefetch(spec)
        except AdapterError:
            with contextlib.suppress(KeyError):
                self.adapters.unregister(adapter_id)
            raise
        return spec

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, adapter_id: str | None = None
    ) -> AdapterSpec | None:
        """The one check of a request, made where it enters (`add_request`, AsyncEngine.generate): ValueError if it
        could never run here, KeyError for an unknown adapter, AdapterUnusable for an adapter version whose weights
        failed to load. Returns the adapter version it will use (None: the base model)."""
        params.validate()
        adapter = None if adapter_id is None else self.resolve_adapter(adapter_id)  # KeyError: unknown
        self.check_request(prompt_token_ids, params, adapter)
        if adapter is not None:
            self.check_adapter(adapter)
        return adapter

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.STANDARD,
        adapter_id: str | None = None,
        arrival_time: float | None = None,
        prefix_chunks: PromptChunks | None = None,
    ) -> Request:
        """Check a request (`validate_request`) and queue it (`enqueue`): the synchronous entry point."""
        adapter = self.validate_request(prompt_token_ids, params, adapter_id)
        return self.enqueue(request_id, prompt_token_ids, params, priority, adapter, arrival_time, prefix_chunks)

    def enqueue(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority,
        adapter: AdapterSpec | None,
        arrival_time: float | None = None,
        prefix_chunks: PromptChunks | None = None,
    ) -> Request:
        """Queue a request its entry point checked (`validate_request`: nothing is checked again, and the adapter
        version it resolved is the one the request uses). `arrival_time` (time.monotonic()) when it arrived before
        this call (it waited in the async engine's inbox): queue time, aging and arrival order count from then.
        `prefix_chunks`: the gateway's hashes of its prompt (Request.prefix_chunks). ValueError only where the
        request's output constraint cannot start."""
        try:
            request = Request(
                request_id,
                list(prompt_token_ids),
                params,
                priority,
                adapter,
                time.monotonic() if arrival_time is None else arrival_time,
                prefix_chunks=prefix_chunks,
            )
        except Exception as exc:  # its constraint could not be made: this request fails, not the engine thread
            raise ValueError(f"constraint: the request's output constraint could not be started: {exc!r}") from exc
        self.scheduler.add_request(request)
        if adapter is not None:
            self._prefetch(adapter)
        self._detokenizers[request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params, pieces=self._byte_pieces
        )
        return request

    def _prefetch(self, adapter: AdapterSpec) -> None:
        """Read a queued request's adapter into the host tier in the background, so admission only
        copies it into the pool instead of waiting on the disk."""
        if self.device_adapters.is_resident(adapter) or self.host_adapters.contains(adapter):
            return
        future = self._prefetcher.submit(self.host_adapters.prefetch, adapter)
        future.add_done_callback(_log_prefetch_failure)

    def abort_request(self, request_id: str) -> bool:
        """Abort a request and free its blocks; False if it was unknown or already finished."""
        self._detokenizers.pop(request_id, None)
        return self.scheduler.finish_request(request_id, RequestStatus.FINISHED_ABORTED) is not None

    def retire_adapter(self, adapter_id: str) -> None:
        """After a reload or unload: free the device copies of old versions once no request uses them."""
        try:
            current: int | None = self.adapters.get(adapter_id).version
        except KeyError:
            current = None  # unloaded
        self.device_adapters.retire(adapter_id, keep_version=current)
        self.scheduler.kv.invalidate_adapter(adapter_id)
        if current is None:
            self.host_adapters.discard(adapter_id)
        self._retire_mixes(adapter_id)

    def _retire_mixes(self, part_id: str) -> None:
        """The mixes built from an older version of `part_id` (or from it, unloaded) go as an adapter's old versions
        do: device copies once no request uses them, cached prefix blocks, host weights. A mix built from current
        versions only stays. Derived specs the registry no longer keeps are found on the device."""
        keep = self.adapters.retire_mixes(part_id)
        for res in self.device_adapters.resident.values():
            if any(part.adapter_id == part_id for part, _ in res.spec.parts):
                keep.setdefault(res.spec.adapter_id, None)
        for mix_id, version in keep.items():
            self.device_adapters.retire(mix_id, keep_version=version)
            self.scheduler.kv.invalidate_adapter(mix_id)
            self.host_adapters.discard(mix_id, keep_version=version)

    def enable_graphs(self, make_graph: Callable[[], Graph], **options: Any) -> DecodeGraphs:
        """Steps of decodes alone replay graphs (engine/worker/cuda_graphs.py; on CUDA unless --no-cuda-graphs, and
        in tests on a CPU with EagerGraph). One page of the pool is reserved for padding rows' K/V."""
        page = self.pool.allocate_run(1, "cuda-graphs:padding")
        if page is None:
            raise RuntimeError("no page left in the pool for the CUDA graphs' padding rows")
        try:
            return self.runner.enable_graphs(page, make_graph, **options)
        except Exception:
            self.pool.free_run(page, 1)
            raise

    def warm_up(self) -> float:
        """Run the shapes serving meets before the server says ready, so the first burst runs at the steady speed:
        a full prefill chunk, a batch of short prompts prefilled together and decoded at full width, a lone decode,
        and the same with LoRA rows when an adapter is registered (it is loaded into the device tier, as its first
        request would); the grammar engine's tokenizer tables are built too, and the registered adapters are read into
        the host tier while they fit (their first requests then copy them into the pool instead of waiting on the
        disk: ~13 ms a W1 adapter, in the step that admits them). Returns the seconds it took.

        First calls are what it pays for: oneDNN builds a kernel per GEMM shape and row count (on the CPU every row
        count a step can give is run first, engine/model/cpu_gemm.py `warm_up_gemms`), the allocator grows its pools,
        the LoRA stacks and the attention paths meet their shapes. Nothing of it stays: every warm-up request
        finishes, and the prefix cache is emptied."""
        start = time.perf_counter()
        prepare_tokenizer(self.tokenizer)
        registered = self.adapters.list()
        preloaded = self.host_adapters.preload(registered)
        # every GEMM row count a step can give (engine/model/cpu_gemm.py; nothing on CUDA): the decode widths, and
        # the padded prefill steps up to a full prefill chunk beside a full decode batch
        prefill_budget = self.config.max_prefill_tokens or self.config.max_batch_tokens  # the scheduler's
        step_rows = min(self.config.max_batch_tokens, prefill_budget + self.config.max_num_seqs)
        gemms = warm_up_gemms(self.model, step_rows, self.config.max_num_seqs)
        vocab, room = self.model.config.vocab_size, self.max_model_len
        if room < 2:  # no prompt and new token fit
            return 0.0
        new = min(4, room - 1)
        short = min(8, room - new)
        chunk = min(self.config.max_prefill_tokens or self.config.max_batch_tokens, room - new, 512)
        width = min(self.config.max_num_seqs, 32)
        adapter = registered[0].adapter_id if registered else None
        params = SamplingParams(max_tokens=new, min_tokens=new, temperature=0.0, ignore_eos=True)
        for lora in (None, adapter) if adapter is not None else (None,):
            jobs = [(chunk, None)] + [(short, lora if i % 4 == 1 else None) for i in range(width)] + [(short, lora)]
            for i, (length, adapter_id) in enumerate(jobs):
                prompt = [(7 * i + 3 * k) % vocab for k in range(length)]
                name = f"warmup-{i}-{lora is not None}"
                try:
                    self.add_request(name, prompt, params, adapter_id=adapter_id)
                except (AdapterError, AdapterUnusable) as exc:  # its requests will get the error; warm the base
                    logger.warning("warm-up without adapter %s: %s", adapter_id, exc)
                    self.add_request(name, prompt, params)
            while self.has_unfinished_requests():
                self.step()
        self.scheduler.kv.reset_prefix_cache()
        graphs = 0 if self.runner.graphs is None else self.runner.graphs.capture_all()
        seconds = time.perf_counter() - start
        logger.info(
            "warmed up in %.1f s (GEMM row counts %d, prefill chunk %d, decode width %d, LoRA %s, adapters read "
            "into the host tier %d of %d, CUDA graphs captured %d)",
            seconds,
            gemms,
            chunk,
            width,
            adapter,
            preloaded,
            len(registered),
            graphs,
        )
        return seconds

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> EngineStats:
        tier = self.device_adapters
        c = tier.counters
        adapter_pages = self.pool.num_run_pages
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_total=self.pool.num_pages,
            kv_blocks_free=self.pool.num_free,
            kv_pages_used=self.pool.num_used - adapter_pages - self.scheduler.kv.num_evictable_blocks,
            kv_pages_cached=self.scheduler.kv.num_evictable_blocks,
            adapter_pages_used=adapter_pages,
            adapters_registered=len(self.adapters.list()),
            adapters_on_device=len(tier.resident),
            adapter_hits=c.hits,
            adapter_misses=c.misses,
            adapter_loads=c.loads,
            adapter_evictions=c.evictions,
            adapter_load_buckets=tuple(zip(LOAD_BUCKETS, c.load_buckets, strict=True)),
            adapter_load_seconds_sum=c.load_seconds_sum,
            adapter_loads_by_admission=self.scheduler.adapter_loads_by_admission,
            running_by_priority=_count_by_priority(self.scheduler.running),
            waiting_by_priority=_count_by_priority(self.scheduler.waiting),
            preemptions=tuple(self.scheduler.preemption.counts.items()),
            prefix_cache_queries=self.scheduler.kv.prefix_queries,
            prefix_cache_hits=self.scheduler.kv.prefix_hits,
            interrupted_steps=self.interrupted_steps,
        )

    def publish_load(self) -> None:
        """Replace `load_report` with the engine's state now (engine thread only; see LoadReport). The step calls it at
        its end, the async engine after the arrivals and aborts it applies between steps."""
        self.load_report = self._load_report()

    def publish_stale_prefixes(self) -> None:
        """Publish the load again if its held prefixes were kept since they were last computed: an idle engine
        makes no report of its own, and the async engine calls this when it has waited PREFIX_REPORT_S."""
        if self.prefixes_stale:
            self.publish_load()

    def _held_prefixes(self) -> tuple[str, ...]:
        """KVCacheManager.held_prefixes(), recomputed at most once per PREFIX_REPORT_S (the rest of a report is
        O(1) in the cache's size; this is O(recent prompts x their blocks))."""
        now = time.monotonic()
        if now - self._prefixes_at >= PREFIX_REPORT_S:
            self._prefixes, self._prefixes_at = self.scheduler.kv.held_prefixes(), now
            self.prefixes_stale = False
        else:
            self.prefixes_stale = True
        return self._prefixes

    def _load_report(self) -> LoadReport:
        # O(running + adapters waiting + adapters resident): running is at most max_num_seqs, the waiting queue
        # keeps its per-adapter counts as requests come and go; the held prefixes are recomputed once a second.
        s = self.scheduler
        adapter_pages = self.pool.num_run_pages
        cached = s.kv.num_evictable_blocks
        return LoadReport(
            running=len(s.running),
            waiting=len(s.waiting),
            kv_blocks_used=self.pool.num_used - adapter_pages - cached,
            kv_blocks_free=self.pool.num_free,
            adapter_pages=adapter_pages,
            total_pages=self.pool.num_pages,
            device_adapters=self.device_adapters.current_ids(),
            running_by_adapter=tuple(Counter(r.adapter_id for r in s.running).items()),
            waiting_by_adapter=s.waiting.count_by_adapter(),
            prefixes=self._held_prefixes(),
        )

    def adapter_statuses(self) -> list[AdapterStatus]:
        """Every registered adapter and where its weights are (safe to call from another thread)."""
        return [AdapterStatus.of(spec, self._residence(spec)) for spec in self.adapters.list()]

    def adapter_residence(self, adapter_id: str) -> str | None:
        """Where a registered adapter's weights are (device, host or disk), None if it is not registered; for a
        mix's canonical name, its newest derived adapter's ("disk": not built yet), None if none is kept. Safe to
        call from another thread."""
        try:
            return self._residence(self.adapters.get(adapter_id))
        except KeyError:
            mix = self.adapters.derived(adapter_id) if is_mix(adapter_id) else None
            return None if mix is None else self._residence(mix)

    def adapter_error(self, adapter_id: str) -> str | None:
        """Why a registered adapter's weights could not be loaded (None: they could, or it is not registered)."""
        try:
            return self.adapters.broken(self.adapters.get(adapter_id))
        except KeyError:
            return None

    def _residence(self, spec: AdapterSpec) -> str:
        if self.device_adapters.is_resident(spec):
            return "device"
        if self.host_adapters.contains(spec):
            return "host"
        return "disk"

    # ---- the step -----------------------------------------------------------------------------------

    def step(self, interrupt: threading.Event | None = None) -> list[RequestOutput]:
        """Schedule, compute and apply one step (`_step`); the outputs it produced. The load report is published
        before they are returned, so an answer sent on them reports a load without its own request."""
        try:
            return self._step(interrupt)
        finally:
            self.publish_load()

    def _step(self, interrupt: threading.Event | None) -> list[RequestOutput]:
        """Schedule, compute and apply one step; the outputs it produced.

        `interrupt` is set by another thread when a critical request arrives (engine/core/async_engine.py). A step
        that computes no critical prompt then ends between two layers of its forward pass instead of making the
        critical request wait for all of it: nothing is applied (requests keep their state and pages: recomputing
        the same tokens writes the same K/V), and the next step starts the critical request with nothing of lower
        classes beside it (critical requests that were decoding decode in it too), before the interrupted work
        runs again. The first step of lower-class work after an interrupt is not interruptible, so that work
        progresses however often critical requests arrive.
        """
        batch = self.scheduler.schedule()
        outputs = [self._adapter_failure(request, exc) for request, exc in batch.failed] if batch.failed else []
        if batch.is_empty():
            return outputs
        if interrupt is not None and not self._interruptible(batch):
            interrupt = None
        t0 = time.perf_counter()
        wanted = self.threads.threads if self.threads is not None else self._fixed_threads
        if torch.get_num_threads() != wanted:  # stepped by another thread than the one that built it
            torch.set_num_threads(wanted)
        if self.threads is not None:
            self.threads.step_started()
        try:
            result = self._execute(batch, interrupt=interrupt)
        except StepInterrupted:
            self.interrupted_steps += 1
            self._rerun_due = True
            return outputs
        finally:
            if self.threads is not None:
                self.threads.step_done()
        if self._rerun_due and any(r.priority is not Priority.CRITICAL for r in batch.requests):
            self._rerun_due = False
        self.scheduler.preemption.observe_step(batch.total_tokens, time.perf_counter() - t0)
        if result.errors:
            outputs += [self._engine_failure(batch.requests[i], message) for i, message in result.errors.items()]
            batch, result = _without(batch, result, set(result.errors))
        self.scheduler.update_from_output(batch, result)
        return outputs + self._make_outputs(batch, result)

    def _interruptible(self, batch: SchedulerOutput) -> bool:
        """Whether a critical arrival may end this step early: the engine allows it, it is not the first step of
        lower-class work after an interrupt, and it computes no prompt of a request that arrived critical (that
        would delay a critical first token; a critical decode moves to the next step, which computes nothing of lower
        classes)."""
        return self.config.critical_interrupts and not self._rerun_due and not batch.critical_prompt

    def _execute(
        self,
        batch: SchedulerOutput,
        seeds: dict[str, torch.Tensor] | None = None,
        interrupt: threading.Event | None = None,
    ) -> RunnerOutput:
        """`runner.execute(batch)`; if it raises, the same on halves of the batch, down to the single
        requests that make it raise, which fail in `RunnerOutput.errors` while the others get their tokens.

        Any subset of a step is a valid step (a request's rows read and write only its own KV blocks), and
        recomputing a request's rows writes the same K/V again. Seeded draws are rewound before a retry, so
        a seeded request samples as if the failed attempt never happened. An interrupted step (StepInterrupted)
        is no failure: it propagates; the retries on halves are not interruptible.
        """
        if seeds is None:  # the seeded generators' states before any attempt
            seeds = {r.request_id: r.generator.get_state() for r in batch.requests if r.generator is not None}
        try:
            return self.runner.execute(batch, interrupt)
        except StepInterrupted:
            raise
        except Exception as exc:
            if len(batch.requests) == 1:
                logger.exception("request %s failed in the forward pass", batch.requests[0].request_id)
                return RunnerOutput([None], [None], {0: f"the engine failed computing this request: {exc!r}"})
            logger.warning(
                "a step of %d requests failed (%r); retrying it in halves to find the cause", len(batch.requests), exc
            )
        n = len(batch.requests)
        sampled: list[int | None] = [None] * n
        logprobs: list[TokenLogprob | None] = [None] * n
        errors: dict[int, str] = {}
        scored: dict[int, tuple[int, list[TokenLogprob]]] = {}
        for half in (list(range(n // 2)), list(range(n // 2, n))):
            sub = batch.subset(half)
            for request in sub.requests:
                if request.generator is not None:
                    request.generator.set_state(seeds[request.request_id])
            part = self._execute(sub, seeds)
            for j, i in enumerate(half):
                sampled[i], logprobs[i] = part.sampled[j], part.logprobs[j]
                if j in part.errors:
                    errors[i] = part.errors[j]
                if j in part.prompt_logprobs:
                    scored[i] = part.prompt_logprobs[j]
        return RunnerOutput(sampled, logprobs, errors, scored)

    def _adapter_failure(self, request: Request, exc: Exception) -> RequestOutput:
        """A request whose adapter could not be brought onto the device (already finished)."""
        assert request.adapter is not None
        if isinstance(exc, AdapterError):  # its files: every later request of this version would fail too
            # A mix is never remembered as broken (its names are the clients' to make up): the part whose files
            # failed is, and later mixes of it are refused at once (check_adapter).
            broken = exc.part if isinstance(exc, PartUnusable) else request.adapter
            if not broken.parts:
                self.adapters.mark_broken(broken, str(exc))
            message = str(exc)
        else:
            logger.error(
                "loading adapter %s for request %s failed", request.adapter_id, request.request_id, exc_info=exc
            )
            message = f"adapter {request.adapter_id!r} could not be loaded: {exc!r}"
        return self._failed_output(request, RequestError("adapter_error", message))

    def _engine_failure(self, request: Request, message: str) -> RequestOutput:
        self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
        logger.warning("request %s failed: %s", request.request_id, message)
        return self._failed_output(request, RequestError("engine_error", message))

    def _failed_output(self, request: Request, error: RequestError) -> RequestOutput:
        return self._last_output(request, "error", error=error)

    def _last_output(self, request: Request, finish_reason: str, **fields: Any) -> RequestOutput:
        """A finished request's last output that carries no token (a failure, a scored prompt)."""
        self._detokenizers.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason=finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_output_tokens=request.num_output_tokens,
            **fields,
        )

    def _make_outputs(self, batch: SchedulerOutput, result: RunnerOutput) -> list[RequestOutput]:
        outputs = []
        for request, token, logprob in zip(batch.requests, result.sampled, result.logprobs, strict=True):
            if token is None:
                if request.status is RequestStatus.FINISHED_LENGTH:  # it only scored its prompt (max_tokens 0)
                    outputs.append(self._scored_output(request))
                continue
            status = request.status
            if status is RequestStatus.FINISHED_ERROR:  # its output constraint failed (Request.error)
                logger.warning("request %s failed: %s", request.request_id, request.error)
                outputs.append(self._failed_output(request, RequestError("engine_error", request.error or "")))
                continue
            detok = self._detokenizers[request.request_id]
            # A stop token (EOS, a stop id) ends the request without being shown; a token that completes the
            # request's grammar is shown.
            hidden = status is RequestStatus.FINISHED_STOPPED and self._is_stop_token(request, token)
            text, stop_hit = detok.update([] if hidden else [token])
            if stop_hit and not status.finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
                status = request.status
            finished = status is not RequestStatus.RUNNING  # (it was running when scheduled)
            if finished:
                if not stop_hit:
                    text += detok.flush()
                del self._detokenizers[request.request_id]
            num_output_tokens = len(request.output_token_ids)
            output = RequestOutput(  # positional (one per request per step): request_id, new_token_ids, new_text,
                # finished, finish_reason, num_prompt_tokens, num_output_tokens, new_logprobs, queue_time_s
                request.request_id,
                [token],
                text,
                finished,
                ("stop" if stop_hit else status.value) if finished else None,
                len(request.prompt_token_ids),
                num_output_tokens,
                [logprob] if logprob is not None else [],
                request.first_scheduled_time - request.arrival_time
                if num_output_tokens == 1 and request.first_scheduled_time is not None  # (it was scheduled)
                else None,
            )
            if num_output_tokens == 1 and request.prompt_logprobs:  # the first output after the prompt
                output.prompt_logprobs = list(request.prompt_logprobs)
            outputs.append(output)
        return outputs

    def _is_stop_token(self, request: Request, token: int) -> bool:
        """Whether `token`, which ended `request` with "stop", is a stop token (hidden from the text): always,
        unless the request's constraint ended it by completing its grammar with an ordinary token."""
        params = request.sampling_params
        return request.constraint is None or token in self.eos_token_ids or token in params.stop_token_ids

    def _scored_output(self, request: Request) -> RequestOutput:
        """The only output of a request that scored its prompt (max_tokens 0): no token, its prompt logprobs."""
        scheduled = request.first_scheduled_time
        return self._last_output(
            request,
            request.status.value,
            queue_time_s=None if scheduled is None else scheduled - request.arrival_time,
            prompt_logprobs=list(request.prompt_logprobs),
        )


def _without(batch: SchedulerOutput, result: RunnerOutput, dropped: set[int]) -> tuple[SchedulerOutput, RunnerOutput]:
    """The step and its results without the requests at `dropped` (batch indices)."""
    keep = [i for i in range(len(batch.requests)) if i not in dropped]
    scored = {j: result.prompt_logprobs[i] for j, i in enumerate(keep) if i in result.prompt_logprobs}
    return (
        batch.subset(keep),
        RunnerOutput([result.sampled[i] for i in keep], [result.logprobs[i] for i in keep], {}, scored),
    )


def _count_by_priority(requests: Iterable[Request]) -> tuple[tuple[str, int], ...]:
    counts = {p.name.lower(): 0 for p in Priority}
    for request in requests:
        counts[request.priority.name.lower()] += 1
    return tuple(counts.items())


def _log_prefetch_failure(future: Future) -> None:
    # Admission reads the adapter again and reports the error on the request; here it is only logged.
    if future.exception() is not None:
        logger.warning("adapter prefetch failed: %s", future.exception())
