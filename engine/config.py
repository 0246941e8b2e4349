"""Engine configuration, parsed once at the edge (CLI or tests) and never changed afterwards.

Every field is one engine setting, declared once here: its type and default, and (in its `Flag`) its command-line
name, help, choices and the rule its value follows. `loragate engine`'s flags are generated from these fields
(loragate/engine_cli.py), `from_flags` builds a config from the parsed flags, and `validate` checks the same rules
for configs built in code. This module imports nothing but the standard library: the CLI builds its parser from it
without the engine's dependencies.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

DTYPE_NAMES = ("auto", "float32", "bfloat16", "float16")
_GENERATION_CONFIG_WORDS = ("auto", "none")


@dataclass(frozen=True, slots=True)
class Rule:
    """How a setting's value is read from text (`parse`) and what makes it valid (`check`: the problem, or None)."""

    parse: Callable[[str], Any]
    check: Callable[[Any], str | None]


def _int(minimum: int) -> Rule:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        return None if ok else f"must be an integer >= {minimum}"

    return Rule(int, check)


def _seconds(minimum_exclusive: bool) -> Rule:
    def check(value: Any) -> str | None:
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = number and (value > 0 if minimum_exclusive else value >= 0)
        return None if ok else f"must be a number of seconds {'>' if minimum_exclusive else '>='} 0"

    return Rule(float, check)


def _choice(*choices: str) -> Rule:
    return Rule(str, lambda value: None if value in choices else f"must be one of {', '.join(choices)}")


def _threads_check(value: Any) -> str | None:
    return _POSITIVE.check(value) if value != "auto" else None


def _generation_config(text: str) -> str:
    return text if text in _GENERATION_CONFIG_WORDS else existing_directory(text)


def _generation_config_check(value: Any) -> str | None:
    ok = value in _GENERATION_CONFIG_WORDS or (isinstance(value, str) and Path(value).is_dir())
    return None if ok else "must be auto, none or an existing directory"


def existing_directory(text: str) -> str:
    path = Path(text).expanduser()
    if not path.is_dir():
        raise ValueError(f"{text!r} is not an existing directory")
    return str(path.resolve())


_POSITIVE = _int(1)
_NON_NEGATIVE = _int(0)
_SECONDS = _seconds(minimum_exclusive=True)
_TEXT = Rule(str, lambda value: None if isinstance(value, str) and value else "must be a non-empty string")
_THREADS = Rule(lambda text: text if text == "auto" else int(text), _threads_check)
_DIRECTORY = Rule(existing_directory, lambda value: None if isinstance(value, str) else "must be a directory path")
_SWITCH = Rule(bool, lambda value: None if isinstance(value, bool) else "must be true or false")  # flags: `off`
_GENERATION_CONFIG = Rule(_generation_config, _generation_config_check)
_PREFIXES = Rule(str, lambda value: None if isinstance(value, tuple) else "must be a tuple of source prefixes")


@dataclass(frozen=True, slots=True)
class Flag:
    """A setting's command-line form. `name`: the flag (default `--field-name`); `off`: for a boolean that is on by
    default, the flag that turns it off; `many`: the flag takes one or more values, and may repeat; `cli_default`:
    the CLI's default where it differs from the field's (which suits configs built in code)."""

    help: str
    rule: Rule = _TEXT
    name: str | None = None
    off: str | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    many: bool = False
    required: bool = False
    cli_default: Any = None
    cli: bool = True


def _setting(default: Any, flag: Flag) -> Any:
    return field(default=default, metadata={"flag": flag})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = _setting(
        "smollm2",
        Flag("smollm2, tiny-random, or a path to a Hugging Face Llama-family directory (safetensors)", required=True),
    )
    device: str = _setting("cpu", Flag("cpu or cuda[:N]"))
    dtype: str = _setting(
        "auto",
        Flag(
            "auto: bfloat16 on CUDA and on CPUs with avx512_bf16 or AMX, float32 on other CPUs "
            "(loragate_kernels/backends.py)",
            _choice(*DTYPE_NAMES),
            choices=DTYPE_NAMES,
        ),
    )
    block_size: int = _setting(16, Flag("tokens per KV cache block", _POSITIVE))
    pool_mb: int = _setting(512, Flag("memory budget of the KV block pool (and adapter pages), in MiB", _POSITIVE))
    num_kv_blocks: int | None = _setting(
        None, Flag("KV blocks in the pool, overriding --pool-mb (tests, tuning)", _POSITIVE, cli=False)
    )
    max_batch_tokens: int = _setting(2048, Flag("tokens computed per engine step (chunked prefill budget)", _POSITIVE))
    max_prefill_tokens: int | None = _setting(
        512,
        Flag(
            "prompt tokens per step for requests below critical: bounds how long a critical request arriving "
            "mid-step waits for that step (engine/core/scheduler.py)",
            _POSITIVE,
        ),
    )
    critical_interrupts: bool = _setting(
        True,
        Flag(
            "a critical request arriving mid-step waits for the whole step, instead of ending a step of "
            "lower-class work between two layers (that step then runs again after it starts)",
            _SWITCH,
            off="--no-critical-interrupts",
        ),
    )
    max_num_seqs: int = _setting(128, Flag("requests running at once", _POSITIVE))
    max_model_len: int | None = _setting(
        None, Flag("context length (default: the model's max_position_embeddings)", _POSITIVE)
    )
    served_model_name: str | None = _setting(None, Flag("the name /v1/models reports (default: derived from --model)"))
    generation_config: str = _setting(
        "auto",
        Flag(
            "sampling defaults for requests that leave temperature, top_p, top_k, repetition_penalty or max_tokens "
            "unset: auto: from the model directory's generation_config.json (if any), as vLLM does; none: the "
            "built-in ones (temperature 1); or a directory holding a generation_config.json "
            "(engine/model/generation.py)",
            _GENERATION_CONFIG,
            metavar="auto|none|DIR",
        ),
    )
    num_threads: int | str | None = _setting(
        None,
        Flag(
            "torch intra-op threads: N, or auto: the CPUs this process may use (affinity mask and cgroup quota), "
            "fewer while other processes take them (engine/worker/threads.py); configs built in code leave torch's "
            "setting untouched by default",
            _THREADS,
            name="--threads",
            cli_default="auto",
        ),
    )
    adapter_dir: str | None = _setting(
        None,
        Flag(
            "register every PEFT LoRA subdirectory under its folder name; POST /v1/adapters loads more from inside "
            "it at run time",
            _DIRECTORY,
        ),
    )
    max_device_adapters: int = _setting(
        8, Flag("adapters resident in device memory at once (least recently used evicted)", _POSITIVE)
    )
    host_adapter_mb: int = _setting(512, Flag("host-RAM cache of parsed adapter weights, in MiB", _NON_NEGATIVE))
    max_adapters_per_step: int | None = _setting(
        None, Flag("distinct adapters computed in one step (default: --max-device-adapters)", _POSITIVE)
    )
    preemption: str = _setting(
        "auto",
        Flag(
            "how a preempted request gives back its KV pages (auto: the cheaper, measured)",
            _choice("recompute", "swap", "auto"),
            choices=("recompute", "swap", "auto"),
        ),
    )
    aging_s: float | None = _setting(
        10.0, Flag("seconds of waiting that raise a request by one priority class", _SECONDS)
    )
    enable_prefix_cache: bool = _setting(
        True,
        Flag(
            "do not reuse KV blocks of shared prompt prefixes (reuse is keyed by adapter version)",
            _SWITCH,
            off="--no-prefix-cache",
        ),
    )
    head_screen: bool = _setting(
        True,
        Flag(
            "fp32 on a CPU with the bf16 dot instruction: greedy rows compute the whole fp32 LM head, instead of a "
            "bf16 screen of it and the exact fp32 logits of the few tokens it leaves (the same tokens; the screen "
            "keeps a bf16 copy of the head, half the fp32 head's memory: engine/model/head_screen.py)",
            _SWITCH,
            off="--no-head-screen",
        ),
    )
    metrics_max_adapters: int = _setting(
        50,
        Flag(
            "adapters with an `adapter` label of their own in the per-adapter metrics (the first N seen); the rest "
            'are counted as "other"',
            _NON_NEGATIVE,
            metavar="N",
        ),
    )
    # Adapters fetched from object stores, the Hub or https (loragate_common/adapter_cache.py).
    adapter_cache_dir: str | None = _setting(
        None,
        Flag(
            "the disk cache for adapters fetched from --adapter-source-allow sources (object stores, the Hub, "
            "https); created if missing, kept across restarts (default: fetching is off)"
        ),
    )
    adapter_cache_mb: int = _setting(
        10240,
        Flag(
            "size bound of --adapter-cache-dir in MiB (least recently used adapters not in use are evicted)",
            _POSITIVE,
        ),
    )
    adapter_max_mb: int = _setting(1024, Flag("largest adapter the engine fetches, in MiB", _POSITIVE))
    adapter_source_allow: tuple[str, ...] = _setting(
        (),
        Flag(
            "source prefixes adapters may be fetched from (s3://bucket/prefix/, hf://org/, https://host/path/, a "
            "local directory); a request naming any other source is refused",
            _PREFIXES,
            metavar="PREFIX",
            many=True,
        ),
    )
    adapter_fetch_timeout_s: float = _setting(300.0, Flag("longest one adapter download may take", _SECONDS))
    adapter_load_wait_s: float = _setting(
        20.0,
        Flag(
            "how long a request waits for its adapter's download before it gets 503 adapter_loading",
            _seconds(minimum_exclusive=False),
        ),
    )
    warmup: bool = _setting(
        True,
        Flag(
            "listen as soon as the model is loaded (default: first run the shapes serving meets, a few seconds: "
            "LLMEngine.warm_up)",
            _SWITCH,
            off="--no-warmup",
        ),
    )
    cuda_graphs: bool = _setting(
        True,
        Flag(
            "CUDA: launch every decode step's kernels one by one instead of replaying captured CUDA graphs "
            "(engine/worker/cuda_graphs.py)",
            _SWITCH,
            off="--no-cuda-graphs",
        ),
    )

    @classmethod
    def from_flags(cls, parsed: object) -> EngineConfig:
        """The config from parsed command-line flags: an object with one attribute per CLI setting."""
        values: dict[str, Any] = {}
        for f, flag in settings():
            if flag.cli:
                value = getattr(parsed, f.name)
                values[f.name] = tuple(value) if flag.many else value
        return cls(**values)

    def validate(self) -> None:
        """ValueError naming the first setting whose value breaks its rule, or two settings that do not go together."""
        for f, flag in settings():
            value = getattr(self, f.name)
            if value is None and "None" in str(f.type):
                continue
            problem = flag.rule.check(value)
            if problem is not None:
                raise ValueError(f"{f.name} {problem}, got {value!r}")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be cpu or cuda, got {self.device!r}")
        if self.adapter_source_allow and self.adapter_cache_dir is None:
            raise ValueError("--adapter-source-allow needs --adapter-cache-dir (where fetched adapters are kept)")


def settings() -> Iterator[tuple[Any, Flag]]:
    """Every setting of EngineConfig with its Flag, in declaration order."""
    for f in fields(EngineConfig):
        yield f, f.metadata["flag"]
