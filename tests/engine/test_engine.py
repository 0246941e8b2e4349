"""The whole engine (our model, scheduler, runner, sampler) against HF transformers on tiny-random."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.request import Request, SamplingParams
from loragate_common.priority import Priority

PROMPT_LENGTHS = (1, 3, 7, 16, 17, 33, 50, 90)
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(hf_model) -> list[list[int]]:
    rng = random.Random(7)
    vocab = hf_model.config.vocab_size
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENGTHS]


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """HF `generate`, greedy, EOS disabled so every prompt yields exactly n tokens."""
    config = GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt) :].tolist()


def greedy_params(n: int = NEW_TOKENS) -> SamplingParams:
    """Exactly n greedy tokens with EOS masked, as HF's min_new_tokens does in `hf_greedy`."""
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)


def engine_outputs(
    engine: LLMEngine,
    prompts: list[list[int]],
    join_after: dict[int, int] | None = None,
    priorities: dict[int, Priority] | None = None,
    step: Callable[[], object] | None = None,
) -> list[list[int]]:
    """Greedy outputs per prompt; prompt i joins the running batch at step join_after.get(i, 0), with priority
    priorities.get(i) (default standard); `step` steps the engine (default engine.step)."""
    join_after, priorities = join_after or {}, priorities or {}
    pending = dict(enumerate(prompts))
    added: dict[int, Request] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():
        for i in [i for i in pending if join_after.get(i, 0) <= steps]:
            added[i] = engine.add_request(
                f"p{i}", pending.pop(i), greedy_params(), priorities.get(i, Priority.STANDARD)
            )
        (step or engine.step)()
        steps += 1
        assert steps < 10_000
    assert engine.pool.num_free + engine.scheduler.kv.num_evictable_blocks == engine.pool.num_pages
    return [added[i].output_token_ids for i in range(len(prompts))]


@pytest.fixture(scope="module")
def hf_outputs(hf_model, prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NEW_TOKENS) for p in prompts]


@pytest.mark.parametrize(
    "max_batch_tokens,block_size,num_kv_blocks,preemption",
    [
        (2048, 16, None, "recompute"),  # every prompt prefilled in one step, then batched decodes
        (7, 4, None, "recompute"),  # chunked prefill: long prompts take many steps beside running decodes
        (64, 4, 40, "recompute"),  # a tight pool: requests are preempted and recomputed
        (64, 4, 40, "swap"),  # ... or preempted by swapping their KV blocks out and back in
    ],
)
def test_greedy_matches_hf_generate(
    prompts, hf_outputs, max_batch_tokens, block_size, num_kv_blocks, preemption
) -> None:
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            model="tiny-random",
            max_batch_tokens=max_batch_tokens,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            preemption=preemption,
        )
    )
    ours = engine_outputs(engine, prompts)
    for i, (a, b) in enumerate(zip(ours, hf_outputs, strict=True)):
        assert a == b, f"prompt {i} (length {len(prompts[i])}) diverged"
    counts = engine.scheduler.preemption.counts
    assert (counts[preemption] > 0) == (num_kv_blocks is not None)
    assert sum(counts.values()) == counts[preemption]


def test_prefill_cap_chunks_prompts_and_leaves_outputs_unchanged(prompts, hf_outputs) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", max_prefill_tokens=6))
    prompt_tokens_per_step = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        prompt_tokens_per_step.append(sum(n for n in out.num_tokens if n > 1))
        return out

    engine.scheduler.schedule = recording_schedule
    assert engine_outputs(engine, prompts) == hf_outputs
    assert max(prompt_tokens_per_step) == 6  # every step within the cap, and the cap was reached
    assert sum(prompt_tokens_per_step) >= sum(len(p) for p in prompts) - len(prompts)


def test_staggered_arrivals_match_hf(prompts, hf_outputs) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", max_batch_tokens=32, block_size=8))
    ours = engine_outputs(engine, prompts, join_after={i: 3 * i for i in range(len(prompts))})
    assert ours == hf_outputs


def test_block_accounting_after_random_requests_and_aborts() -> None:
    engine = LLMEngine(
        EngineConfig(
            dtype="float32", model="tiny-random", block_size=4, num_kv_blocks=96, max_batch_tokens=64, max_num_seqs=32
        )
    )
    rng = random.Random(99)
    vocab = engine.vocab_size
    submitted = aborted = 0
    live: list[str] = []
    while submitted < 1000 or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 6)):
            if submitted == 1000:
                break
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
            params = SamplingParams(
                max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(100)
            )
            engine.add_request(f"r{submitted}", prompt, params)
            live.append(f"r{submitted}")
            submitted += 1
        if live and rng.random() < 0.3:
            if engine.abort_request(live.pop(rng.randrange(len(live)))):
                aborted += 1
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        engine.scheduler.kv.check_invariants(engine.scheduler.requests.values())
    assert aborted > 50
    kv = engine.scheduler.kv
    assert engine.pool.num_free + kv.num_evictable_blocks == engine.pool.num_pages
    kv.reset_prefix_cache()
    assert engine.pool.num_free == engine.pool.num_pages
    assert not engine.scheduler.requests and not engine._detokenizers


def collect_text(
    engine: LLMEngine, request_id: str, prompt: list[int], params: SamplingParams, others: int = 0
) -> tuple[str, list[int], str]:
    """Run one request (optionally beside `others` random requests); return text, tokens, reason."""
    engine.add_request(request_id, prompt, params)
    for k in range(others):
        engine.add_request(
            f"{request_id}-other{k}", prompt[k:] + [k + 5], SamplingParams(max_tokens=5 + k, temperature=1.0)
        )
    text, tokens, reason = "", [], None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == request_id:
                text += out.new_text
                tokens += out.new_token_ids
                reason = out.finish_reason if out.finished else reason
    return text, tokens, reason


def test_seed_reproducible_whatever_the_batch(prompts) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))
    params = SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=1234)
    alone = collect_text(engine, "a", prompts[4], params)
    batched = collect_text(engine, "b", prompts[4], params, others=5)
    other_seed = collect_text(
        engine, "c", prompts[4], SamplingParams(max_tokens=20, temperature=0.9, top_p=0.95, seed=4321)
    )
    assert alone[1] == batched[1]
    assert alone[1] != other_seed[1]


def test_stop_string_cuts_output(prompts) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))
    full, full_tokens, reason = collect_text(engine, "full", prompts[5], greedy_params(40))
    assert reason == "length" and full == engine.tokenizer.decode(full_tokens, skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert len(stop) == 3
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=(stop,))
    cut, _, reason = collect_text(engine, "cut", prompts[5], params)
    assert reason == "stop"
    assert cut == full.split(stop)[0]
    assert stop not in cut


def test_request_that_can_never_fit_is_rejected() -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", model="tiny-random", block_size=4, num_kv_blocks=8, max_model_len=128)
    )
    with pytest.raises(ValueError, match="context length"):
        engine.add_request("long", [5] * 120, SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="KV blocks"):
        engine.add_request("big", [5] * 30, SamplingParams(max_tokens=16))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", [], SamplingParams(max_tokens=16))
    assert not engine.has_unfinished_requests()


def test_queue_time_counts_from_the_arrival_the_caller_gives(prompts) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))
    arrived = time.monotonic() - 5.0  # it waited 5 s before reaching the engine (an inbox, a step in progress)
    request = engine.add_request("late", prompts[0], greedy_params(2), arrival_time=arrived)
    assert request.arrival_time == arrived
    first = next(o for o in engine.step() if o.request_id == "late")
    assert first.queue_time_s is not None and first.queue_time_s >= 5.0


def test_async_engine_stamps_arrival_when_it_accepts_a_request(prompts) -> None:
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", model="tiny-random")))

    async def scenario() -> list[RequestOutput]:
        await engine.start()
        try:
            stream = engine.generate("r", prompts[0], greedy_params(2))
            await asyncio.sleep(0.3)  # accepted, not yet handed to the engine thread
            return [out async for out in stream]
        finally:
            await engine.shutdown()

    outputs = asyncio.run(scenario())
    assert outputs[0].queue_time_s is not None and outputs[0].queue_time_s >= 0.3
    assert "".join(o.new_text for o in outputs) and outputs[-1].finished
