"""Read an HF Llama-family directory's weights (*.safetensors) into our own model.

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
from engine.model.llama import LlamaForCausalLM
from loragate_kernels.backends import Backends

logger = logging.getLogger(__name__)

# Our projection -> the HF projections concatenated (along the output dim) into it, in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def load_model(model_dir: Path, backends: Backends, prepack: bool = True) -> LlamaForCausalLM:
    """Our LlamaForCausalLM with the directory's safetensors weights on `backends.device` in `backends.dtype`, in eval
    mode; its GEMMs' weights laid out for the GEMM route of `backends` unless `prepack` is False
    (LlamaForCausalLM.prepack)."""
    model_dir = Path(model_dir)
    config = load_model_config(model_dir)
    tensors = _read_safetensors(model_dir)
    _check_hf_tensors(config, tensors)
    state = {name: t.to(device=backends.device, dtype=backends.dtype) for name, t in _fuse(config, tensors).items()}
    with torch.device("meta"):  # no random init of parameters that are overwritten anyway
        model = LlamaForCausalLM(config, backends)
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)  # serving only: no autograd graph even outside inference_mode
    parameters = sum(p.numel() for p in model.parameters())
    packed = model.prepack() if prepack else 0
    logger.info(
        "loaded %s: %d layers, %.1fM parameters, %d GEMMs laid out for the %s route",
        model_dir.name,
        config.num_layers,
        parameters / 1e6,
        packed,
        backends.gemm.value,
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
    for i in range(config.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"{ours}{norm}.weight"] = tensors[f"{hf}{norm}.weight"]
        for (target, sources), suffix in itertools.product(_FUSED.items(), ("weight", "bias")):
            names = [f"{hf}{source}.{suffix}" for source in sources]
            if all(name in tensors for name in names):  # biases exist only if the config says so
                parts = [tensors[name] for name in names]
                state[f"{ours}{target}.{suffix}"] = torch.cat(parts) if len(parts) > 1 else parts[0]
    return state
