"""End to end on the real SmolLM2-135M-Instruct weights (converted once from the packaged GGUF)."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams

pytestmark = pytest.mark.smollm2


@pytest.fixture(scope="module")
def engine(smollm2_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", model="smollm2", pool_mb=128))


def chat_ids(engine: LLMEngine, question: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_capital_of_france_is_paris(engine: LLMEngine) -> None:
    engine.add_request(
        "paris", chat_ids(engine, "What is the capital of France?"), SamplingParams(max_tokens=24, temperature=0.0)
    )
    engine.add_request("other", chat_ids(engine, "Name a colour."), SamplingParams(max_tokens=8, temperature=0.0))
    text, reason = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == "paris":
                text += out.new_text
                reason = out.finish_reason
    assert "Paris" in text, text
    assert reason == "stop"  # the model ends its answer with EOS (<|im_end|>)
    assert engine.pool.num_free + engine.scheduler.kv.num_evictable_blocks == engine.pool.num_pages
