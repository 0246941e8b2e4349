"""Engine configuration, parsed once at the edge (CLI or tests) and never changed afterwards."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"  # smollm2 | tiny-random | a path to an HF Llama-family dir (safetensors)
    device: str = "cpu"
    # auto: bfloat16 on CUDA and on CPUs with native bf16 (avx512_bf16 or AMX), float32 on other CPUs
    # (engine/model/cpu_gemm.py auto_cpu_dtype)
    dtype: str = "auto"
    block_size: int = 16  # tokens per KV cache block
    pool_mb: int = 512  # memory budget of the KV block pool
    num_kv_blocks: int | None = None  # overrides the count derived from pool_mb (tests, tuning)
    max_batch_tokens: int = 2048  # tokens computed per engine step (chunked prefill budget)
    # prompt tokens per step for requests below critical (None: max_batch_tokens); bounds how long a critical
    # request arriving mid-step waits for that step (engine/core/scheduler.py)
    max_prefill_tokens: int | None = 512
    # a critical arrival ends a step of lower-class work between two layers (it runs again after the critical
    # request starts), instead of waiting for all of it (engine/core/llm_engine.py, step)
    critical_interrupts: bool = True
    max_num_seqs: int = 128  # requests running at once
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    served_model_name: str | None = None  # None: derived from `model`
    # torch intra-op threads: a number (fixed), "auto" (the CPUs the process may use, fewer while it cannot
    # get them: engine/worker/threads.py; what `loragate engine` runs) or None (torch's setting untouched)
    num_threads: int | str | None = None
    adapter_dir: str | None = None  # every PEFT LoRA subdirectory is registered under its folder name
    max_device_adapters: int = 8  # adapters resident in the page pool at once
    host_adapter_mb: int = 512  # host-RAM LRU of parsed adapter weights
    max_adapters_per_step: int | None = None  # distinct adapters in one step (None: the device tier)
    preemption: str = "auto"  # recompute | swap | auto (by the measured cost of each)
    aging_s: float | None = 10.0  # a waiting request gains one priority class per aging_s waited
    enable_prefix_cache: bool = True  # reuse KV blocks of prompt prefixes (same adapter version only)
    # adapters with an `adapter` label of their own in the per-adapter metrics (the first seen); the rest: "other"
    metrics_max_adapters: int = 50
    # Adapters fetched from object stores, the Hub or https (engine/lora/adapter_store.py): the bounded disk
    # cache they land in (None: fetching is off), its size bound, one adapter's size cap, the source prefixes
    # the engine may fetch from (nothing else, whatever a request says), how long one download may take, and
    # how long a request waits for one before it gets 503 adapter_loading.
    adapter_cache_dir: str | None = None
    adapter_cache_mb: int = 10240
    adapter_max_mb: int = 1024
    adapter_source_allow: tuple[str, ...] = ()
    adapter_fetch_timeout_s: float = 300.0
    adapter_load_wait_s: float = 20.0
    # run the shapes serving meets before the server listens (LLMEngine.warm_up; AsyncEngine.load does it)
    warmup: bool = True
    # CUDA only: steps of decodes alone replay CUDA graphs captured per batch-size bucket
    # (engine/worker/cuda_graphs.py); off: every step launches its kernels one by one
    cuda_graphs: bool = True

    def validate(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.pool_mb < 1:
            raise ValueError("pool_mb must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.max_batch_tokens < 1:
            raise ValueError("max_batch_tokens must be >= 1")
        if self.max_prefill_tokens is not None and self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_device_adapters < 1:
            raise ValueError("max_device_adapters must be >= 1")
        if self.host_adapter_mb < 0:
            raise ValueError("host_adapter_mb must be >= 0")
        if self.metrics_max_adapters < 0:
            raise ValueError("metrics_max_adapters must be >= 0")
        if self.max_adapters_per_step is not None and self.max_adapters_per_step < 1:
            raise ValueError("max_adapters_per_step must be >= 1")
        if self.preemption not in ("recompute", "swap", "auto"):
            raise ValueError(f"preemption must be recompute, swap or auto, got {self.preemption!r}")
        if self.aging_s is not None and self.aging_s <= 0:
            raise ValueError("aging_s must be > 0")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if (
            self.num_threads is not None
            and self.num_threads != "auto"
            and (not isinstance(self.num_threads, int) or self.num_threads < 1)
        ):
            raise ValueError(f"num_threads must be a positive integer or 'auto', got {self.num_threads!r}")
        if self.adapter_cache_mb < 1 or self.adapter_max_mb < 1:
            raise ValueError("adapter_cache_mb and adapter_max_mb must be >= 1")
        if self.adapter_fetch_timeout_s <= 0 or self.adapter_load_wait_s < 0:
            raise ValueError("adapter_fetch_timeout_s must be > 0 and adapter_load_wait_s >= 0")
        if self.adapter_source_allow and self.adapter_cache_dir is None:
            raise ValueError("--adapter-source-allow needs --adapter-cache-dir (where fetched adapters are kept)")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
