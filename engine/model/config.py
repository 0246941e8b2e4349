"""The base model's shape, parsed from an HF directory's config.json (no weights read).

One decoder serves several families (engine/model/decoder.py); what differs between them is data here, decided once at
start. transformers' own config class of the family reads config.json first, so every format it accepts (older rope
fields, `sliding_window_pattern`, Qwen2's `use_sliding_window`) arrives here in one form; then every field that would
change the forward pass is either understood or refused, naming the field. Nothing is served half-right.

    family      model_type     what it adds to Llama's decoder
    Llama       llama          (the reference: RMSNorm, SwiGLU, RoPE, GQA)
    Mistral     mistral        a sliding window on every layer when `sliding_window` is set
    Qwen2/2.5   qwen2          biases on q, k and v; sliding layers past `max_window_layers` when enabled
    Qwen3       qwen3          RMSNorm of each q and k head before RoPE
    Gemma 3     gemma3_text    norms as (1 + w) in fp32, GeGLU, embeddings times sqrt(hidden), q/k norms, norms
                               after attention and MLP too, query_pre_attn_scalar, local (sliding) and global layers,
                               each kind with its own RoPE
    Phi-3/4     phi3           q|k|v and gate|up fused in the checkpoint, longrope, partial rotary
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# model_type -> the architectures (config.json "architectures") its checkpoints name.
FAMILIES: dict[str, tuple[str, ...]] = {
    "llama": ("LlamaForCausalLM",),
    "mistral": ("MistralForCausalLM",),
    "qwen2": ("Qwen2ForCausalLM",),
    "qwen3": ("Qwen3ForCausalLM",),
    "gemma3_text": ("Gemma3ForCausalLM",),
    "phi3": ("Phi3ForCausalLM",),
}
# transformers' hidden_act names -> the activation of the gated MLP (engine/model/layer_ops.py)
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}
# RoPE scalings computed (engine/model/decoder.py rope_inv_freq): "dynamic" rescales with the sequence length and "yarn"
# is not implemented; both are refused.
ROPE_TYPES = ("default", "linear", "llama3", "longrope")
FULL, SLIDING = "full_attention", "sliding_attention"
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
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # from config.json and generation_config.json, in that order
    model_type: str  # a FAMILIES key
    # [num_layers] of FULL or SLIDING; a SLIDING layer attends the last `sliding_window` positions only
    layer_types: tuple[str, ...]
    sliding_window: int  # 0 when no layer slides
    # layer type -> transformers' standardized rope parameters of that kind of layer (rope_type, rope_theta,
    # partial_rotary_factor, the scaling's own keys)
    rope_parameters: dict[str, dict[str, Any]] = field(hash=False, compare=False)
    attn_scale: float  # the softmax scale of attention scores
    qkv_bias: bool = False  # biases on q, k and v
    o_bias: bool = False
    mlp_bias: bool = False  # biases on gate, up and down
    activation: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    qk_norm: bool = False  # an RMSNorm over head_dim of each q and k head, before RoPE
    # Gemma's norms: weights stored as w, applied as (1 + w) in fp32; also a norm after attention and after the MLP
    gemma_norms: bool = False
    embed_scale: float = 1.0  # the embeddings are multiplied by it (rounded to the model's dtype, as HF does)
    fused_checkpoint: bool = False  # the checkpoint stores qkv_proj and gate_up_proj (Phi-3)

    def window(self, layer: int) -> int:
        """The attention window of a layer: the positions a query reads back, itself included (0 = all of them)."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else 0


def load_model_config(model_dir: Path) -> ModelConfig:
    """Parse `config.json` (and `generation_config.json` if present) of an HF model directory."""
    model_dir = Path(model_dir)
    raw = read_json_object(model_dir / "config.json")
    gen_path = model_dir / "generation_config.json"
    generation = read_json_object(gen_path) if gen_path.is_file() else {}
    return parse_model_config(raw, generation)


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from config.json and generation_config.json contents, or say what is wrong (ValueError
    naming the field)."""
    absent = [key for key in _REQUIRED_KEYS if raw.get(key) is None]
    if absent:
        raise ValueError(f"config.json lacks {', '.join(absent)}")
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type not in FAMILIES or any(a not in FAMILIES[model_type] for a in archs):
        served = ", ".join(f"{arch[0]} ({name})" for name, arch in FAMILIES.items())
        raise ValueError(
            f"unsupported architecture (model_type={model_type!r}, architectures={archs}): loragate serves {served}"
        )
    hf = _hf_config(model_type, raw)
    _refuse_unsupported(model_type, hf)
    num_heads = hf.num_attention_heads
    num_kv_heads = getattr(hf, "num_key_value_heads", None) or num_heads
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_attention_heads={num_heads} is not a multiple of {num_kv_heads} kv heads")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
    act_name = getattr(hf, "hidden_activation", None) or getattr(hf, "hidden_act", "silu")
    if act_name not in _ACTIVATIONS:
        raise ValueError(f"hidden_act={act_name!r} is not supported: {', '.join(_ACTIVATIONS)}")
    layer_types, window = _layer_types(model_type, hf)
    rope = _rope_parameters(hf, layer_types, head_dim)
    attention_bias = bool(getattr(hf, "attention_bias", False))
    gemma = model_type == "gemma3_text"
    eos = _token_ids(raw.get("eos_token_id")) + _token_ids(generation.get("eos_token_id"))
    return ModelConfig(
        vocab_size=hf.vocab_size,
        hidden_size=hf.hidden_size,
        intermediate_size=hf.intermediate_size,
        num_layers=hf.num_hidden_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        max_position_embeddings=hf.max_position_embeddings,
        # read from the file: transformers' config classes default it per family (Gemma: tied)
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", hf.tie_word_embeddings)),
        bos_token_id=raw.get("bos_token_id", generation.get("bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(eos)),  # dedupe, keep order
        model_type=model_type,
        layer_types=layer_types,
        sliding_window=window,
        rope_parameters=rope,
        qkv_bias=attention_bias or model_type == "qwen2",  # Qwen2 always has them, and never on o_proj
        o_bias=attention_bias and model_type != "qwen2",
        mlp_bias=bool(getattr(hf, "mlp_bias", False)),
        activation=_ACTIVATIONS[act_name],
        qk_norm=model_type in ("qwen3", "gemma3_text"),
        gemma_norms=gemma,
        embed_scale=hf.hidden_size**0.5 if gemma else 1.0,
        attn_scale=hf.query_pre_attn_scalar**-0.5 if gemma else head_dim**-0.5,
        fused_checkpoint=model_type == "phi3",
    )


def _hf_config(model_type: str, raw: dict[str, Any]) -> Any:
    """transformers' config object of the family for `raw`: it puts older formats into today's fields."""
    from transformers import AutoConfig

    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version", "auto_map")}
    # transformers warns about configs it finds odd; what matters to serving is checked below
    level = logging.getLogger("transformers").level
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        return AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError, KeyError, AttributeError) as exc:
        raise ValueError(f"config.json is not a valid {model_type} config: {exc}") from None
    finally:
        logging.getLogger("transformers").setLevel(level)


def _refuse_unsupported(model_type: str, hf: Any) -> None:
    """ValueError naming the first config field that would change the forward pass in a way loragate does not
    compute."""
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(hf, name, None) is not None:
            raise ValueError(f"{name}={getattr(hf, name)} is not supported (logit soft-capping)")
    if getattr(hf, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention=true is not supported (a decoder attends causally)")
    if getattr(hf, "layer_types", None) and len(hf.layer_types) != hf.num_hidden_layers:
        raise ValueError(f"layer_types has {len(hf.layer_types)} entries for {hf.num_hidden_layers} layers")


def _layer_types(model_type: str, hf: Any) -> tuple[tuple[str, ...], int]:
    """([num_layers] of FULL / SLIDING, the window) as the family's HF attention reads them."""
    window = getattr(hf, "sliding_window", None)
    types = getattr(hf, "layer_types", None)
    if model_type in ("mistral", "phi3"):  # HF slides every layer when the field is set
        types = [SLIDING if window is not None else FULL] * hf.num_hidden_layers
    elif not types:  # transformers before `layer_types` read the families' older fields
        n, pattern = hf.num_hidden_layers, getattr(hf, "sliding_window_pattern", None)
        if model_type == "gemma3_text" and pattern:  # every pattern-th layer global
            types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        elif getattr(hf, "use_sliding_window", False):  # Qwen2/3: the layers from max_window_layers on slide
            first = getattr(hf, "max_window_layers", n)
            types = [SLIDING if i >= first else FULL for i in range(n)]
        else:
            types = [FULL] * n
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported: {FULL}, {SLIDING}")
    if SLIDING not in types:
        return tuple(types), 0
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        raise ValueError(f"sliding_window={window!r}: sliding layers need a positive window")
    if window >= hf.max_position_embeddings:  # every position is inside the window: plain causal attention
        return (FULL,) * hf.num_hidden_layers, 0
    return tuple(types), window


def _rope_parameters(hf: Any, layer_types: tuple[str, ...], head_dim: int) -> dict[str, dict[str, Any]]:
    """Layer type -> transformers' standardized rope parameters (one set for every type when the config has one)."""
    params = getattr(hf, "rope_parameters", None)
    if not params:  # transformers before 5: rope_theta and rope_scaling, and Gemma 3's base for its local layers
        full = {"rope_theta": getattr(hf, "rope_theta", 10000.0), **(getattr(hf, "rope_scaling", None) or {})}
        local = getattr(hf, "rope_local_base_freq", None)
        params = {FULL: full, SLIDING: {"rope_type": "default", "rope_theta": local}} if local else full
    per_type = params if set(params) <= {FULL, SLIDING} and params else dict.fromkeys(set(layer_types), params)
    out: dict[str, dict[str, Any]] = {}
    for kind in set(layer_types):
        rope = dict(per_type.get(kind) or per_type.get(FULL) or {})
        rope_type = rope.get("rope_type") or rope.pop("type", None) or "default"
        rope.pop("type", None)
        if rope_type not in ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported: {', '.join(ROPE_TYPES)}")
        rope["rope_type"] = rope_type
        rope.setdefault("rope_theta", getattr(hf, "rope_theta", 10000.0))
        factor = rope.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)) or 1.0
        rotary = int(head_dim * factor)
        if not 0 < rotary <= head_dim or rotary % 2:
            raise ValueError(
                f"partial_rotary_factor={factor} leaves {rotary} of {head_dim} dims rotated: need an even count"
            )
        rope["partial_rotary_factor"] = factor
        if not math.isfinite(float(rope["rope_theta"])) or float(rope["rope_theta"]) <= 0:
            raise ValueError(f"rope_theta={rope['rope_theta']!r} must be a positive number")
        out[kind] = rope
    return out


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
