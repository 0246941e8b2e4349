"""The model's sampling defaults: the values of its `generation_config.json` that requests which leave them unset
take, as vLLM's `--generation-config auto` does. Read once, at start (`load_sampling_defaults`); applied to each
request where its sampling parameters are made (engine/entrypoints/protocol.py); a value the request sets wins.

The keys read are those vLLM applies that loragate's SamplingParams can honour: `temperature`, `top_p`, `top_k`,
`repetition_penalty`, and `max_new_tokens`, which lowers the max_tokens of requests that name none. vLLM's
`min_p` has no counterpart here: it is named in the start-up log as ignored. Every other key is ignored, as vLLM
ignores it; `do_sample` too: a file that sets a temperature samples with it, whatever `do_sample` says.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from engine.core.request import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_REPETITION_PENALTY

GENERATION_CONFIG = "generation_config.json"
_IGNORED = ("min_p",)  # keys vLLM applies that loragate cannot


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Defaults for a request's unset sampling fields (None: the built-in default). Named like the request fields:
    `max_tokens` is the file's `max_new_tokens`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # the file's 0 or -1 (no top-k filter) is None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    origin: str = "none"  # where they come from, for the start-up log
    ignored: tuple[tuple[str, Any], ...] = ()  # (key, value) of the file's keys vLLM applies that loragate cannot

    def values(self) -> dict[str, float | int]:
        """The defaults in force, by request field name (GET /load shows them)."""
        return {f.name: v for f in fields(self) if f.name in _RULES and (v := getattr(self, f.name)) is not None}

    def max_tokens_within(self, default: int) -> int:
        """The max_tokens of a request that names none: `default`, lowered to the file's max_new_tokens."""
        return default if self.max_tokens is None else min(default, self.max_tokens)

    def summary(self) -> str:
        """The start-up log's line."""
        values = self.values()
        if not values:
            text = f"sampling defaults: none ({self.origin})"
        else:
            text = f"sampling defaults from {self.origin}: " + " ".join(f"{k}={v}" for k, v in values.items())
        if self.ignored:
            text += " (not supported, ignored: " + " ".join(f"{k}={v!r}" for k, v in self.ignored) + ")"
        return text


NO_DEFAULTS = SamplingDefaults()


def _number(low: float, high: float, low_open: bool = False) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        number = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        ok = number and (low < value if low_open else low <= value) and value <= high
        return None if ok else f"must be a number in {'(' if low_open else '['}{low:g}, {high:g}]"

    return check


def _integer(minimum: int) -> Callable[[Any], str | None]:
    def check(value: Any) -> str | None:
        ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
        return None if ok else f"must be an integer >= {minimum}"

    return check


# request field -> (the file's key, what makes its value valid): the bounds requests are held to (protocol.py)
_RULES: dict[str, tuple[str, Callable[[Any], str | None]]] = {
    "temperature": ("temperature", _number(0, MAX_TEMPERATURE)),
    "top_p": ("top_p", _number(0, 1, low_open=True)),
    "top_k": ("top_k", _integer(-1)),
    "repetition_penalty": ("repetition_penalty", _number(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY)),
    "max_tokens": ("max_new_tokens", _integer(1)),
}


def load_sampling_defaults(setting: str, model_dir: Path) -> SamplingDefaults:
    """The defaults `--generation-config` asks for: `auto` those of `model_dir`'s generation_config.json (none
    without one), `none` none, a directory those of its generation_config.json (which must exist).

    A value out of range or of the wrong type is refused (ValueError naming the file and the key) rather than
    skipped with a warning: a default reaches every request, so a skipped one would silently change every answer
    from what the file's author meant, and vLLM does not skip one either (the requests it is applied to fail its
    checks). Refused at start, it cannot go unnoticed: the operator fixes the file, or starts with
    `--generation-config none`.
    """
    if setting == "none":
        return SamplingDefaults(origin="--generation-config none")
    folder = model_dir if setting == "auto" else Path(setting)
    path = folder / GENERATION_CONFIG
    if not path.is_file():
        if setting != "auto":
            raise ValueError(f"--generation-config {setting}: {folder} has no {GENERATION_CONFIG}")
        return SamplingDefaults(origin=f"no {GENERATION_CONFIG} in {folder}")
    data = _read_object(path)
    values: dict[str, Any] = {}
    for name, (key, check) in _RULES.items():
        value = data.get(key)
        if value is None:  # absent, or null: the built-in default
            continue
        problem = check(value)
        if problem is not None:
            raise ValueError(
                f"{path}: {key} {problem}, got {value!r} (fix the file, or start with --generation-config none)"
            )
        values[name] = value
    if values.get("top_k") in (-1, 0):  # HF and vLLM: no top-k filter
        del values["top_k"]
    ignored = tuple((key, data[key]) for key in _IGNORED if data.get(key) is not None)
    return SamplingDefaults(**values, origin=str(path), ignored=ignored)


def write_sampling_defaults(model_dir: Path, values: Mapping[str, float | int]) -> None:
    """Merge `values` (the file's keys, e.g. {"temperature": 0.2}) into `model_dir`'s generation_config.json,
    created if missing; its other keys (bos/eos token ids, ...) are kept."""
    path = model_dir / GENERATION_CONFIG
    data = _read_object(path) if path.is_file() else {}
    data.update(values)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _read_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: must hold a JSON object")
    return data
