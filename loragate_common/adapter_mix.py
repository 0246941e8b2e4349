"""Weighted mixes of adapters: how a request names one, one set of rules for the gateway and the engine.

  header  `X-Adapter-ID: support-v3*0.7+legal-tone*0.3` (also accepted in the body's `model`): PART ('+' PART)*,
          PART = REF '*' WEIGHT, REF an adapter ref (`ID` or `ID@N`, loragate_common/adapter_ids.py)
  body    `"adapter_mix": {"support-v3": 0.7, "legal-tone": 0.3}`

A weight is a finite decimal number, non-zero, at most MAX_WEIGHT in size; a mix has 1 to MAX_PARTS parts, each ref
named once. The parts' order carries no meaning: `mix_name` writes a mix in one canonical form (parts sorted by
ref), the key its derived adapter is cached under.

A mix of plain LoRAs is served exactly as one adapter whose ranks are its parts' side by side (each A stacked, each
B times its part's weight and scale): PEFT's `add_weighted_adapter(..., combination_type="cat")`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from loragate_common.adapter_ids import ref_problem
from loragate_common.errors import bad_request, shown

MAX_PARTS = 8
MAX_WEIGHT = 100.0
BODY_FIELD = "adapter_mix"
# Set by the gateway only: JSON, a list of {"ref": "ID@N", "source", "sha256", "size": int | null}, a catalog part each
PART_SOURCES_HEADER = "X-Adapter-Part-Sources"
_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_PART_SPLIT_RE = re.compile(r"(?<![eE])\+")  # a '+' in an exponent (1e+2) does not end a part


@dataclass(frozen=True, slots=True)
class MixPart:
    ref: str  # `ID` or `ID@N`
    weight: float


def is_mix(name: str) -> bool:
    """Whether a requested name is written as a mix (an adapter ref never holds '*')."""
    return "*" in name


def _weight(field: str, ref: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"{field}: the weight of {shown(ref)} must be a number")
    weight = float(value)
    if not math.isfinite(weight):
        raise bad_request(f"{field}: the weight of {shown(ref)} is not a finite number")
    if weight == 0.0 or abs(weight) > MAX_WEIGHT:
        raise bad_request(f"{field}: the weight of {shown(ref)} must be non-zero and at most {MAX_WEIGHT:g} in size")
    return weight


def _parts(field: str, pairs: list[tuple[str, float]]) -> tuple[MixPart, ...]:
    if not pairs:
        raise bad_request(f"{field}: a mix names at least one adapter")
    if len(pairs) > MAX_PARTS:
        raise bad_request(f"{field}: a mix has at most {MAX_PARTS} parts, not {len(pairs)}")
    seen: set[str] = set()
    for ref, _ in pairs:
        problem = ref_problem(ref)
        if problem is not None:
            raise bad_request(f"{field}: invalid adapter id {shown(ref)} in the mix: {problem}")
        if ref in seen:
            raise bad_request(f"{field}: {shown(ref)} is named twice in the mix")
        seen.add(ref)
    return tuple(MixPart(ref, weight) for ref, weight in pairs)


def parse_mix(text: str, field: str = "X-Adapter-ID") -> tuple[MixPart, ...]:
    """The parts of `support-v3*0.7+legal-tone*0.3`, else 400 naming `field` and the problem."""
    pairs = []
    for piece in _PART_SPLIT_RE.split(text.strip()):
        ref, star, number = piece.strip().rpartition("*")
        if not star or not ref.strip():
            raise bad_request(f"{field}: {shown(piece)} is not ADAPTER*WEIGHT (e.g. support-v3*0.7+legal-tone*0.3)")
        number = number.strip()
        if _NUMBER_RE.fullmatch(number) is None:
            raise bad_request(f"{field}: the weight {shown(number)} of {shown(ref.strip())} is not a finite number")
        pairs.append((ref.strip(), _weight(field, ref.strip(), float(number))))
    return _parts(field, pairs)


def mix_from_body(value: Any, field: str = BODY_FIELD) -> tuple[MixPart, ...]:
    """The parts of the body's `{"support-v3": 0.7, "legal-tone": 0.3}`, else 400 naming `field`."""
    if not isinstance(value, dict):
        raise bad_request(f'{field}: must be an object of adapter -> weight, e.g. {{"support-v3": 0.7}}')
    return _parts(field, [(str(ref), _weight(field, str(ref), w)) for ref, w in value.items()])


def mix_name(parts: tuple[MixPart, ...] | list[MixPart]) -> str:
    """The canonical text of a mix: parts sorted by ref, each weight as Python's shortest repr of the float."""
    return "+".join(f"{p.ref}*{p.weight!r}" for p in sorted(parts, key=lambda p: p.ref))
