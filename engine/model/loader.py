"""Read an HF model directory's weights (*.safetensors) into our own model (every family engine/model/config.py
serves).

Only the safetensors library touches the weights (never pickle). HF key names are mapped onto our
modules at load time; q/k/v and gate/up are fused here into one projection each. The model's shape comes
from engine/model/config.py.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig, load_model_config, read_json_object
from engine.model.decoder import CausalLM
from loragate_kernels.backends import Backends

logger = logging.getLogger(__name__)

# Our projection -> the HF projections concatenated (along the output dim) into it, in order; a checkpoint with
# `fused_checkpoint` (Phi-3) stores our fused projections as they are.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# Our norm -> the checkpoint's, per layer (engine/model/decoder.py DecoderLayer): Llama's names, and Gemma 3's, whose
# post_attention_layernorm norms the attention's output and whose pre_feedforward_layernorm is Llama's
# post_attention_layernorm.
_NORMS = {"input_layernorm": "input_layernorm", "post_attention_layernorm": "post_attention_layernorm"}
_GEMMA_NORMS = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "pre_feedforward_layernorm",
    "attn_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}
_QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def load_model(model_dir: Path, backends: Backends, prepack: bool = True, head_screen: bool = True) -> CausalLM:
    """Our CausalLM with the directory's safetensors weights on `backends.device` in `backends.dtype`, in eval
    mode; its GEMMs' weights laid out for the GEMM route of `backends` unless `prepack` is False, with the LM head's
    greedy screen where `head_screen` and the route allow it (CausalLM.prepack)."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    tensors = _read_safetensors(model_dir)
    _check_hf_tensors(config, tensors)
    state = {name: _cast(config, name, t, backends) for name, t in _fuse(config, tensors).items()}
    with torch.device("meta"):  # no random init of parameters that are overwritten anyway
        model = CausalLM(config, backends)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)  # serving only: no autograd graph even outside inference_mode
    parameters = sum(p.numel() for p in model.parameters())
    packed = model.prepack(head_screen) if prepack else 0
    logger.info(
        "loaded %s: %d layers, %.1fM parameters, %d GEMMs laid out for the %s route",
        model_dir.name,
        config.num_layers,
        parameters / 1e6,
        packed,
        backends.gemm.value,
    )
    if model.head_screen is not None:
        logger.info(
            "greedy head screen: a bf16 copy of the LM head, %.0f MB (engine/model/head_screen.py; --no-head-screen "
            "drops it)",
            model.head_screen.nbytes / 2**20,
        )
    return model.eval()


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        return sorted({model_dir / name for name in read_json_object(index)["weight_map"].values()})
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
    if c.fused_checkpoint:
        projections = [
            ("self_attn.qkv_proj", q_size + 2 * kv_size, c.hidden_size, c.qkv_bias),
            ("mlp.gate_up_proj", 2 * c.intermediate_size, c.hidden_size, c.mlp_bias),
        ]
    else:
        projections = [
            ("self_attn.q_proj", q_size, c.hidden_size, c.qkv_bias),
            ("self_attn.k_proj", kv_size, c.hidden_size, c.qkv_bias),
            ("self_attn.v_proj", kv_size, c.hidden_size, c.qkv_bias),
            ("mlp.gate_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
            ("mlp.up_proj", c.intermediate_size, c.hidden_size, c.mlp_bias),
        ]
    projections += [
        ("self_attn.o_proj", c.hidden_size, q_size, c.o_bias),
        ("mlp.down_proj", c.hidden_size, c.intermediate_size, c.mlp_bias),
    ]
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        for norm in _layer_norms(c).values():
            shapes[p + norm + ".weight"] = (c.hidden_size,)
        if c.qk_norm:
            for norm in _QK_NORMS:
                shapes[p + norm + ".weight"] = (c.head_dim,)
        for proj, out_dim, in_dim, bias in projections:
            shapes[p + proj + ".weight"] = (out_dim, in_dim)
            if bias:
                shapes[p + proj + ".bias"] = (out_dim,)
    return shapes


def _layer_norms(config: ModelConfig) -> dict[str, str]:
    return _GEMMA_NORMS if config.gemma_norms else _NORMS


def _cast(config: ModelConfig, name: str, tensor: torch.Tensor, backends: Backends) -> torch.Tensor:
    """A state tensor on the device in the model's dtype; Gemma's norm weights as (1 + w) in fp32, the values HF's
    Gemma3RMSNorm multiplies by (rounding 1 + w to bf16 would lose most of w)."""
    if config.gemma_norms and name.rsplit(".", 2)[-2].endswith("norm"):
        return (1.0 + tensor.to(device=backends.device, dtype=torch.float32)).contiguous()
    return tensor.to(device=backends.device, dtype=backends.dtype)


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
        raise ValueError(
            f"checkpoint does not match config.json: missing {_some(missing)}, unexpected {_some(unexpected)}"
        )
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
    fused = {target: (target,) for target in _FUSED} if config.fused_checkpoint else _FUSED
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm, hf_norm in _layer_norms(config).items():
            state[f"{ours}{norm}.weight"] = tensors[f"{hf}{hf_norm}.weight"]
        if config.qk_norm:
            for norm in _QK_NORMS:
                state[f"{ours}{norm}.weight"] = tensors[f"{hf}{norm}.weight"]
        for (target, sources), suffix in itertools.product(fused.items(), ("weight", "bias")):
            names = [f"{hf}{source}.{suffix}" for source in sources]
            if all(name in tensors for name in names):  # biases exist only if the config says so
                parts = [tensors[name] for name in names]
                state[f"{ours}{target}.{suffix}"] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return state
