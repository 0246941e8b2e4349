"""`AgentConfig`: the agent's settings, parsed once at the edge (loragate/vllm_agent_cli.py, whose defaults are the
engine's for the flags both take, or tests)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath


@dataclass(frozen=True, slots=True)
class AgentConfig:
    vllm_url: str  # vLLM's OpenAI server, e.g. http://127.0.0.1:8000
    cache_dir: Path  # the disk cache as this process sees it
    # The same cache as vLLM's process sees it (another mount point of one volume); None: `cache_dir`.
    vllm_cache_dir: PurePosixPath | None
    allow: tuple[str, ...]  # source prefixes adapters may be fetched from
    cache_bytes: int
    max_adapter_bytes: int
    fetch_timeout_s: float
    load_wait_s: float  # how long an ensure waits before it answers 503 adapter_loading
    # vLLM's own answers: listing models and health are quick; a load reads the adapter's weights.
    vllm_timeout_s: float = 10.0
    vllm_load_timeout_s: float = 120.0

    @property
    def vllm_dir(self) -> PurePosixPath:
        return self.vllm_cache_dir if self.vllm_cache_dir is not None else PurePosixPath(self.cache_dir.resolve())

    def lora_path(self, sha256: str) -> str:
        """The `lora_path` vLLM loads the cache entry `<cache_dir>/<sha256>` from."""
        return str(self.vllm_dir / sha256)
