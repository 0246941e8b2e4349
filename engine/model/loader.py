"""Read an HF Llama-family directory (config.json + *.safetensors) into our own model.

Only the safetensors library touches the weights (never pickle). HF key names are mapped onto our
modules at load time; q/k/v and gate/up are fused here into one projection each.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
_ROPE_TYPES = ("default", "linear", "llama3")
_REQUIRED_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "max_position_embeddings")
# Our projection -> the HF projections concatenated (along the output dim) into it, in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


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
    raw = _read_json(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    generation = _read_json(gen_path) if gen_path.is_file() else {}
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


def _read_json(path: Path) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    """Our LlamaForCausalLM with the directory's safetensors weights, in eval mode."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    tensors = _read_safetensors(model_dir)
    _check_hf_tensors(config, tensors)
    state = {name: t.to(device=device, dtype=dtype) for name, t in _fuse(config, tensors).items()}
    with torch.device("meta"):  # no random init of parameters that are overwritten anyway
        model = LlamaForCausalLM(config, device=torch.device(device))
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)  # serving only: no autograd graph even outside inference_mode
    logger.info("loaded %s: %d layers, %.1fM parameters", model_dir.name, config.num_layers,
                sum(p.numel() for p in model.parameters()) / 1e6)
    return model.eval()


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model_dir / name for name in _read_json(index)["weight_map"].values()})
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model directory {model_dir} has no *.safetensors weights")
    return files


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """HF name -> tensor (CPU) over all shards."""
    tensors: dict[str, torch.Tensor] = {}
    for path in _weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if name in tensors:
                    raise ValueError(f"tensor {name} appears in more than one shard ({path.name})")
                tensors[name] = f.get_tensor(name)
    return tensors


def _expected_hf_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the config implies, with its shape."""
    c = config
    q_size, kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (c.hidden_size,)
        shapes[p + "post_attention_layernorm.weight"] = (c.hidden_size,)
        for proj, out_dim, in_dim, bias in (
            ("self_attn.q_proj", q_size, c.hidden_size, c.attention_bias),
            ("self_attn.k_proj", kv_size, c.hidden_size, c.attention_bias),
            ("self_attn.v_proj", kv_size, c.hidden_size, c.attention_bias),
            ("self_attn.o_proj", c.hidden_size, q_size, c.attention_bias),
            ("mlp.gate_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
            ("mlp.up_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
            ("mlp.down_proj", c.hidden_size, c.intermediate_size, c.mlp_bias),
        ):
            shapes[p + proj + ".weight"] = (out_dim, in_dim)
            if bias:
                shapes[p + proj + ".bias"] = (out_dim,)
    return shapes


def _check_hf_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> None:
    """Raise ValueError on a missing, unexpected or mis-shaped tensor (drops ignorable extras)."""
    expected = _expected_hf_shapes(config)
    for name in list(tensors):
        tied_head = config.tie_word_embeddings and name == "lm_head.weight"
        if tied_head or name.endswith("rotary_emb.inv_freq"):
            del tensors[name]  # tied / recomputed: the stored copy is not used
    missing = sorted(expected.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(f"checkpoint does not match config.json: missing {_some(missing)}, "
                         f"unexpected {_some(unexpected)}")
    for name, shape in expected.items():
        actual = tuple(tensors[name].shape)
        if actual != shape:
            raise ValueError(f"{name} has shape {actual}, config.json implies {shape}")


def _some(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "") or "none"


def _fuse(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map checked HF tensors onto our state dict names, concatenating q|k|v and gate|up along dim 0."""
    state = {
        "embed_tokens.weight": tensors["model.embed_tokens.weight"],
        "norm.weight": tensors["model.norm.weight"],
    }
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = tensors["lm_head.weight"]
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{ours}{norm}.weight"] = tensors[f"{hf}{norm}.weight"]
        for (target, sources), suffix in itertools.product(_FUSED.items(), ("weight", "bias")):
            parts = [tensors.get(f"{hf}{source}.{suffix}") for source in sources]
            if all(part is not None for part in parts):  # biases exist only if the config says so
                state[f"{ours}{target}.{suffix}"] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return state
