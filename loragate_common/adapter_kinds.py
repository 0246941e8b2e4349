"""What an adapter is, said the same way by the engine's cards, the disk cache of fetched adapters, the vLLM agent,
the gateway's catalog, `loragate adapters` and the ops page: its kind, its largest rank and the modules it adapts.

  kind     "LoRA", "DoRA" (PEFT's `use_dora`: a magnitude vector per module, docs/adapters.md) or "mix" (a weighted
           mix of adapters a request names: loragate_common/adapter_mix.py; only engines show those)
  modules  the module names its tensors adapt, e.g. q_proj, v_proj, embed_tokens, lm_head

Torch-free: `summarize_dir` reads adapter_config.json and the safetensors header only (the fetcher calls it on
files it has already checked: loragate_common/adapter_sources.py `check_adapter_files`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

_MODULE_RE = re.compile(r"\.(\w+)\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)(?:\.|$)")
_MAX_HEADER_BYTES = 100 << 20


def adapter_kind(config: Mapping[str, Any]) -> str:
    return "DoRA" if config.get("use_dora") else "LoRA"


def summarize(config: Mapping[str, Any], tensor_names: Iterable[str]) -> dict[str, Any]:
    """{"kind", "rank", "target_modules"} of a PEFT adapter from its config and its tensors' names."""
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    valid = [r for r in ranks if isinstance(r, int) and not isinstance(r, bool) and r > 0]
    modules = {m[1] for name in tensor_names if (m := _MODULE_RE.search(name)) is not None}
    return {"kind": adapter_kind(config), "rank": max(valid, default=None), "target_modules": sorted(modules)}


def summarize_dir(directory: Path) -> dict[str, Any] | None:
    """`summarize` of the adapter files in `directory`; None when they cannot be read as an adapter."""
    try:
        config = json.loads((directory / "adapter_config.json").read_bytes())
        with open(directory / "adapter_model.safetensors", "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            if not 0 < length <= _MAX_HEADER_BYTES:
                return None
            header = json.loads(f.read(length))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict) or not isinstance(header, dict):
        return None
    return summarize(config, (name for name in header if name != "__metadata__"))


def describe(summary: Mapping[str, Any] | None, modules: bool = True) -> str:
    """`DoRA r16: q_proj, v_proj, embed_tokens`, or `DoRA r16` without `modules` ("" when nothing is known)."""
    if not summary or not summary.get("kind"):
        return ""
    rank = summary.get("rank")
    names = summary.get("target_modules") or []
    head = f"{summary['kind']} r{rank}" if isinstance(rank, int) else str(summary["kind"])
    return f"{head}: {', '.join(map(str, names))}" if modules and names else head
