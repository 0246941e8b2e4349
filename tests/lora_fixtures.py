"""Real PEFT LoRA adapters for tests, and PEFT's own greedy decoding as the reference engines compare to.

Adapters are built with peft.get_peft_model on the HF model and saved with save_pretrained, so every file
detail (key names, config fields, rank_pattern, use_rslora) is PEFT's, not ours.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel

_BASE_MODELS: dict[Path, PreTrainedModel] = {}  # resolved base dir -> pristine fp32 HF model


# The tiny model's three test adapters (tests/conftest.py `tiny_adapters`, bench/gpu_check.py): q/v only, all seven
# modules, the MLP with rsLoRA; each changes greedy output from the first tokens on with lora_B std 0.2.
TINY_ADAPTER_SPECS: dict[str, dict[str, Any]] = {
    "qv-r8": dict(r=8, alpha=16, targets=["q_proj", "v_proj"], seed=8),
    "all-r4": dict(r=4, alpha=8, targets="all-linear", seed=4),
    "mlp-r16-rslora": dict(r=16, alpha=8, targets=["gate_proj", "up_proj", "down_proj"], use_rslora=True, seed=16),
}


def hf_base_model(base_dir: Path) -> PreTrainedModel:
    """A fresh copy of the HF model at `base_dir` (loaded once per process; PEFT mutates what it wraps)."""
    key = Path(base_dir).resolve()
    if key not in _BASE_MODELS:
        model = AutoModelForCausalLM.from_pretrained(str(key), dtype=torch.float32)
        _BASE_MODELS[key] = model.eval()
    return copy.deepcopy(_BASE_MODELS[key])


def make_peft_adapter(
    base_dir: Path,
    out_dir: Path,
    *,
    r: int,
    alpha: float,
    targets: list[str] | str,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int,
    b_std: float = 0.02,
    magnitude_std: float = 0.1,
    **lora_kwargs: Any,
) -> Path:
    """Save a PEFT LoRA on the model at `base_dir` to `out_dir`; every lora_B (and an embedding's lora_embedding_A,
    which PEFT initialises to zeros) is N(0, b_std^2) from `seed`.

    lora_A keeps PEFT's initialisation, drawn under torch.manual_seed(seed). `lora_kwargs` go to
    LoraConfig unchanged (e.g. exclude_modules, layers_to_transform; use_dora=True for DoRA, whose magnitudes PEFT
    initialises to the base's row norms: they are multiplied by 1 + N(0, magnitude_std^2) too, so that the row
    scales differ from 1 however small B is).
    """
    config = LoraConfig(
        r=r,
        lora_alpha=alpha,
        target_modules=targets,
        use_rslora=use_rslora,
        lora_dropout=0.0,
        rank_pattern=rank_pattern or {},
        alpha_pattern=alpha_pattern or {},
        task_type="CAUSAL_LM",
        **lora_kwargs,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        peft_model = get_peft_model(hf_base_model(base_dir), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(peft_model.named_parameters(), key=lambda item: item[0]):
            if ".lora_B." in name or ".lora_embedding_A." in name:  # PEFT starts an embedding's A at zero
                param.copy_(b_std * torch.randn(param.shape, generator=gen))
            elif ".lora_magnitude_vector." in name:
                param.mul_(1 + magnitude_std * torch.randn(param.shape, generator=gen))
    out_dir = Path(out_dir)
    peft_model.save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def load_peft_model(base_dir: Path, adapter_dir: Path | None) -> torch.nn.Module:
    """The HF model at `base_dir` with the saved adapter loaded by PEFT itself (or plain, for None)."""
    model = hf_base_model(base_dir)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    return model.eval()


def peft_greedy(base_dir: Path, adapter_dir: Path | None, prompt_ids: list[int], n: int) -> list[int]:
    """PEFT + HF greedy decoding of exactly `n` tokens (EOS disabled) for one prompt: the reference."""
    model = load_peft_model(base_dir, adapter_dir)
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()
