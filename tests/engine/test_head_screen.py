"""The engine with the greedy head screen (engine/model/head_screen.py) against the same engine computing the whole
fp32 head (`--no-head-screen`), on the real SmolLM2-135M-Instruct weights: greedy rows (plain, and with min_tokens
masking EOS), batches that mix greedy and seeded sampled rows, and a row with logprobs give the same tokens and
logprobs; the screen is built only where the route has it."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from loragate_kernels.backends import Machine

pytestmark = [
    pytest.mark.smollm2,
    pytest.mark.skipif(
        not (Machine.probe("cpu").panels and Machine.probe("cpu").bf16_dot),
        reason="the screen runs on the fp32 panels route with the bf16 dot instruction",
    ),
]

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "List five prime numbers.",
    "Explain what a hash table is.",
    "Translate 'good morning' into German.",
]


@pytest.fixture(scope="module")
def engines(smollm2_dir) -> dict[bool, LLMEngine]:
    return {
        screen: LLMEngine(EngineConfig(dtype="float32", model="smollm2", pool_mb=128, head_screen=screen))
        for screen in (True, False)
    }


def run(engine: LLMEngine, params: list[SamplingParams]) -> dict[str, tuple[list[int], list]]:
    for i, (question, p) in enumerate(zip(QUESTIONS, params, strict=False)):
        engine.add_request(f"r{i}", engine.tokenizer(question)["input_ids"], p)  # ids free again after each run
    out: dict[str, tuple[list[int], list]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            assert o.finish_reason != "error", o
            tokens, logprobs = out.setdefault(o.request_id, ([], []))
            tokens.extend(o.new_token_ids)
            logprobs.extend(o.new_logprobs)
    return out


def test_the_screen_is_built_where_asked(engines: dict[bool, LLMEngine]) -> None:
    screen = engines[True].model.head_screen
    assert screen is not None and screen.vocab == engines[True].vocab_size
    assert engines[False].model.head_screen is None


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(max_tokens=32, temperature=0.0)] * 6,
        [SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, ignore_eos=True)] * 6,
        [SamplingParams(max_tokens=24, temperature=0.0), SamplingParams(max_tokens=6, temperature=0.8, seed=5)] * 3,
        [SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0, logprobs=2)]
        + [SamplingParams(max_tokens=24, temperature=0.0)] * 2,
    ],
    ids=["greedy", "eos-masked", "mixed-sampled", "logprobs"],
)
def test_same_tokens_with_and_without_the_screen(
    engines: dict[bool, LLMEngine], params: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    screen = engines[True].model.head_screen
    assert screen is not None
    screened: list[int] = []
    tokens = screen.tokens
    monkeypatch.setattr(screen, "tokens", lambda hidden, banned: screened.append(len(hidden)) or tokens(hidden, banned))
    with_screen, without = run(engines[True], params), run(engines[False], params)
    assert with_screen == without
    assert screened  # greedy steps took the screen (each batch here has some)
    assert sum(len(tokens) for tokens, _ in with_screen.values()) >= 40
