"""The base model's shape, parsed from an HF Llama-family directory's config.json (no weights read)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # num_heads % num_kv_heads == 0; query head h reads kv head h // group
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE, else {"rope_type": "linear" | "llama3", ...} without rope_theta.
    rope_scaling: dict[str, Any] | None = field(hash=False)
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json, in that order
    attention_bias: bool = False  # biases on q/k/v/o
    mlp_bias: bool = False  # biases on gate/up/down


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `config.json` (and `generation_config.json` if present) of an HF Llama-family dir."""
    model_dir = Path(model_dir)
    raw = read_json_object(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    generation = read_json_object(gen_path) if gen_path.is_file() else {}
    return parse_model_config(raw, generation)


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from config.json and generation_config.json contents, or say what is wrong."""
    absent = [key for key in _REQUIRED_KEYS if raw.get(key) is None]
    if absent:
        raise ValueError(f"config.json lacks {', '.join(absent)}")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in ("llama", "mistral") or any(a not in _ARCHITECTURES for a in archs):
        raise ValueError(
            f"unsupported architecture (model_type={model_type!r}, architectures={archs}): "
            "loragate serves Llama-family models (llama, mistral without sliding window)"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"unsupported hidden_act {raw['hidden_act']!r}: only silu (SwiGLU)")
    window = raw.get("sliding_window")
    if window is not None and window < raw["max_position_embeddings"]:
        raise ValueError(f"sliding_window={window} attention is not supported")
    num_heads = raw["num_attention_heads"]
    num_kv_heads = raw.get("num_key_value_heads") or num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of {num_kv_heads} kv heads")
    rope_theta, rope_scaling = _parse_rope(raw)
    eos = _token_ids(raw.get("eos_token_id")) + _token_ids(generation.get("eos_token_id"))
    return ModelConfig(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=raw["max_position_embeddings"],
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        bos_token_id=raw.get("bos_token_id", generation.get("bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(eos)),  # dedupe, keep order
        attention_bias=bool(raw.get("attention_bias", False)),
        mlp_bias=bool(raw.get("mlp_bias", False)),
    )


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from `rope_parameters` (transformers 5) or `rope_theta` + `rope_scaling`."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"unsupported rope parameters {params!r} (per-layer-type RoPE)")
    params = dict(params)
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type not in _ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    if rope_type == "default":
        return theta, None
    return theta, {"rope_type": rope_type, **params}


def _token_ids(value: int | list[int] | None) -> list[int]:
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def read_json_object(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data
