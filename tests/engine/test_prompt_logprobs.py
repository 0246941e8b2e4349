"""Prompt logprobs through the whole engine against HF transformers' log-softmax of the same model's logits (fp32),
plain and with PEFT adapters: chunked prefill, preemption by recompute mid-prompt and after the prompt, the prefix
cache, and scoring a prompt alone (max_tokens 0)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.request import SamplingParams, TokenLogprob
from engine.core.scheduler import SchedulerOutput

from lora_fixtures import load_peft_model, peft_greedy

# Against HF's fp32 logprobs on the tiny random model, which carries last-bit differences far: the CPU's C++ layer
# ops sum in another order than torch (~1e-4 here; one ulp of noise on a norm moves its logits by ~1.7e-4,
# tests/engine/test_model.py `hf_atol`). A wrong position or adapter is off by more than 1e-2.
TOL = 3e-4
K = 4
# Small steps: a 75-token prompt takes ten prefill chunks.
CHUNKED = dict(max_batch_tokens=16, max_prefill_tokens=8, block_size=4)


@pytest.fixture(scope="module")
def prompts(tiny_model_config) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, tiny_model_config.vocab_size) for _ in range(n)] for n in (1, 2, 9, 40, 75)]


def hf_logprobs(base_dir: Path, adapter_dir: Path | None, prompt: list[int]) -> torch.Tensor:
    """[n, V]: log_softmax of the HF (PEFT) model's fp32 logits at each prompt position."""
    model = load_peft_model(base_dir, adapter_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def assert_matches(
    entries: list[TokenLogprob | None] | None, reference: torch.Tensor, prompt: list[int], k: int
) -> None:
    assert entries is not None and len(entries) == len(prompt) and entries[0] is None
    for p in range(1, len(prompt)):
        entry, row = entries[p], reference[p - 1]  # position p - 1's logits score token p
        assert entry is not None and entry.token_id == prompt[p]
        assert abs(entry.logprob - row[prompt[p]].item()) <= TOL, p
        assert [v for _, v in entry.top] == pytest.approx(row.topk(k).values.tolist(), abs=TOL)
        # The tokens named: each has the logprob stated (HF's top k, unless two tie within the tolerance).
        assert all(abs(row[t].item() - v) <= TOL for t, v in entry.top)


def run(engine: LLMEngine, after_step: Callable[[int], None] | None = None) -> dict[str, list[RequestOutput]]:
    """Step until every request finished; the outputs of each. `after_step(i)` runs after step i."""
    outputs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
        if after_step is not None:
            after_step(steps)
        assert steps < 2000
    engine.scheduler.kv.check_invariants(())
    return outputs


def count_head_rows(engine: LLMEngine) -> list[int]:
    """Make the engine record how many rows each LM-head call gets."""
    rows: list[int] = []
    head = engine.model.compute_logits

    def counting(hidden: torch.Tensor) -> torch.Tensor:
        rows.append(hidden.shape[0])
        return head(hidden)

    engine.model.compute_logits = counting  # type: ignore[method-assign]
    return rows


@pytest.mark.parametrize("config", [{}, CHUNKED], ids=["whole prompts", "chunked"])
def test_base_model_matches_hf(tiny_model_dir, prompts, config) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", **config))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"score{i}", prompt, SamplingParams(max_tokens=0, prompt_logprobs=K))
        engine.add_request(f"gen{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=1))
        engine.add_request(f"plain{i}", prompt, SamplingParams(max_tokens=3, temperature=0.0))
    outputs = run(engine)
    for i, prompt in enumerate(prompts):
        reference = hf_logprobs(tiny_model_dir, None, prompt)
        (scored,) = outputs[f"score{i}"]  # one output: finished once its prompt was computed, no token
        assert scored.finished and scored.finish_reason == "length"
        assert scored.new_token_ids == [] and scored.num_output_tokens == 0 and scored.new_text == ""
        assert_matches(scored.prompt_logprobs, reference, prompt, K)
        gen = outputs[f"gen{i}"]
        assert sum(len(o.new_token_ids) for o in gen) == 3
        assert gen[0].num_output_tokens == 1 and all(o.prompt_logprobs is None for o in gen[1:])
        assert_matches(gen[0].prompt_logprobs, reference, prompt, 1)
        assert all(o.prompt_logprobs is None for o in outputs[f"plain{i}"])


def test_adapters_match_peft(tiny_model_dir, tiny_adapters, prompts) -> None:
    engine = LLMEngine(
        EngineConfig(
            dtype="float32", model="tiny-random", adapter_dir=str(next(iter(tiny_adapters.values())).parent), **CHUNKED
        )
    )
    for name in [None, *tiny_adapters]:  # one mixed batch
        engine.add_request(f"{name}", prompts[4], SamplingParams(max_tokens=0, prompt_logprobs=K), adapter_id=name)
    outputs = run(engine)
    base = hf_logprobs(tiny_model_dir, None, prompts[4])
    for name, adapter_dir in [(None, None), *tiny_adapters.items()]:
        reference = hf_logprobs(tiny_model_dir, adapter_dir, prompts[4])
        if adapter_dir is not None:
            assert (reference - base).abs().max() > 1e-2  # the adapter changes the logprobs
        assert_matches(outputs[f"{name}"][0].prompt_logprobs, reference, prompts[4], K)


@pytest.mark.parametrize("when", ["mid-prompt", "after the prompt"])
def test_preemption_by_recompute_records_each_position_once(tiny_model_dir, tiny_adapters, prompts, when) -> None:
    name, adapter_dir = next(iter(tiny_adapters.items()))
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            model="tiny-random",
            adapter_dir=str(adapter_dir.parent),
            preemption="recompute",
            head_screen=False,  # the head's rows are counted: greedy rows through the whole head too
            **CHUNKED,
        )
    )
    head_rows = count_head_rows(engine)
    prompt, new_tokens = prompts[4], 4
    params = SamplingParams(
        max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=K
    )
    request = engine.add_request("r", prompt, params, adapter_id=name)
    preempted_at: list[int] = []

    def preempt(step: int) -> None:
        due = request.num_computed_tokens >= 24 if when == "mid-prompt" else request.num_output_tokens == 2
        if due and not preempted_at:
            assert request.num_computed_tokens < len(prompt) or when != "mid-prompt"
            engine.scheduler._preempt(request, SchedulerOutput())
            preempted_at.append(step)

    outputs = run(engine, preempt)["r"]
    assert preempted_at and engine.scheduler.preemption.counts["recompute"] == 1
    assert_matches(outputs[0].prompt_logprobs, hf_logprobs(tiny_model_dir, adapter_dir, prompt), prompt, K)
    assert request.output_token_ids == peft_greedy(tiny_model_dir, adapter_dir, prompt, new_tokens)
    # The head saw each prompt position once and each sampled token once, though some were computed twice.
    assert sum(head_rows) == len(prompt) - 1 + new_tokens


def test_prefix_cache_gives_no_blocks_to_a_request_that_scores_its_prompt(tiny_model_dir, prompts) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", block_size=4))
    kv = engine.scheduler.kv
    prompt = prompts[3]
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    run(engine)
    hits = kv.prefix_hits
    engine.add_request("scored", prompt, SamplingParams(max_tokens=0, prompt_logprobs=K))
    scored = run(engine)["scored"][0]
    assert kv.prefix_hits == hits  # every prompt position was computed: cached blocks have no logits
    assert_matches(scored.prompt_logprobs, hf_logprobs(tiny_model_dir, None, prompt), prompt, K)
    engine.add_request("again", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    run(engine)
    assert kv.prefix_hits == hits + 36  # a request without prompt logprobs still gets the cached blocks


def test_requests_that_do_not_ask_send_only_their_sampled_rows_through_the_head(prompts) -> None:
    # greedy rows through the whole head (engine/model/head_screen.py would take their tokens without it)
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", head_screen=False, **CHUNKED))
    head_rows = count_head_rows(engine)
    for i, prompt in enumerate(prompts):
        engine.add_request(
            f"p{i}", prompt, SamplingParams(max_tokens=5, min_tokens=5, temperature=0.0, ignore_eos=True)
        )
    run(engine)
    assert sum(head_rows) == 5 * len(prompts)
