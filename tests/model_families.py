"""Small random models of every family the engine serves, built from transformers' own config and model classes (the
references the engine is compared with), with the tiny-random model's tokenizer.

Each family's config turns on what distinguishes it (engine/model/config.py): Qwen2's q/k/v biases, Qwen3's q/k norms,
Gemma 3's local layers with a short window between global ones, Phi-3's longrope with partial rotary, Mistral's
sliding window. Windows are shorter than the tests' sequences, so a kernel that ignores them is caught.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from engine.model.sources import resolve_model

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
# family -> (transformers config class name, model class name, config fields over _COMMON)
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen2-sliding": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=6, max_window_layers=2, tie_word_embeddings=False),
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, tie_word_embeddings=True)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=32,
            num_hidden_layers=5,
            sliding_window=5,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]
            + ["full_attention"],
            query_pre_attn_scalar=24,
            # untied: tied to these std-0.5 embeddings scaled by sqrt(hidden), the head mostly repeats the last token
            tie_word_embeddings=False,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
            },
        ),
    ),
    "gemma3-tied": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(head_dim=32, sliding_window=3)),  # as Gemma 3 ships
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            max_position_embeddings=512,
            original_max_position_embeddings=64,  # positions past 64 take the long factors
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [1.5 + 0.5 * i for i in range(6)],
            },
            partial_rotary_factor=0.75,
        ),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7)),
}


def build_family(family: str, path: Path, seed: int = 0, **overrides: Any) -> Path:
    """Save a small random `family` model (transformers' classes) with the tiny tokenizer into `path`."""
    import transformers

    config_class, model_class, fields = FAMILIES[family]
    tiny = resolve_model("tiny-random").path
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny)
    config = getattr(transformers, config_class)(**{**_COMMON, "vocab_size": len(tokenizer), **fields, **overrides})
    model = getattr(transformers, model_class)(config)
    _fill(model, seed)
    path = Path(path)
    model.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny / name).is_file():
            shutil.copy(tiny / name, path / name)
    return path


def _fill(model: torch.nn.Module, seed: int) -> None:
    """Every parameter from one seeded generator, in name order: weights N(0, 0.5^2) so greedy decoding has
    well-separated logits, norms 1 + N(0, 0.1^2) (Gemma's, stored as w, are N(0, 0.1^2) around 0: applied as 1 + w),
    biases N(0, 0.1^2)."""
    gemma = type(model).__name__.startswith("Gemma")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(0.1 * noise + (0.0 if gemma else 1.0))
            elif name.endswith(".bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(0.5 * noise)
