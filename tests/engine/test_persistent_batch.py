"""The persistent batch (engine/worker/input_batch.py): rows kept across steps must always equal what the requests'
own lists say, through block growth, preemption (blocks freed and allocated anew), departures and row reuse; and
penalised decoding through it must match HF transformers (repetition penalty) and the OpenAI formula over HF's
logits (presence / frequency), also while requests are preempted and recomputed or swapped."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.worker.input_batch import InputBatch
from engine.worker.runner import DecodeBuffers, HostStaging

NEW_TOKENS = 16
CONFIGS = [  # max_batch_tokens, block_size, num_kv_blocks, preemption
    (2048, 16, None, "recompute"),
    (7, 4, None, "recompute"),  # chunked prefill beside decodes
    (64, 4, 40, "recompute"),  # a tight pool: preempted and recomputed
    (64, 4, 40, "swap"),  # ... or swapped out and back in
]


def _running(
    request_id: str, prompt: list[int], outputs: list[int], blocks: list[int], params: SamplingParams | None = None
) -> Request:
    r = Request(request_id, prompt, params or SamplingParams(temperature=0.0), output_token_ids=list(outputs))
    r.block_ids = list(blocks)
    r.status = RequestStatus.RUNNING
    return r


def _check(batch: InputBatch, requests: list[Request], rows: list[int], vocab: int) -> None:
    width = max(len(r.block_ids) for r in requests)
    tables = batch.decode_tables(rows, width)
    for r, table in zip(requests, tables.tolist(), strict=True):
        assert table[: len(r.block_ids)] == r.block_ids
    penalised = [i for i, r in enumerate(requests) if r.sampling_params.frequency_penalty != 0.0]
    if penalised:
        counts = batch.output_counts([rows[i] for i in penalised])
        seen = batch.seen([rows[i] for i in penalised])
        for j, i in enumerate(penalised):
            expected = torch.zeros(vocab)
            for token, n in Counter(requests[i].output_token_ids).items():
                expected[token] = n
            assert torch.equal(counts[j], expected)
            assert seen[j].nonzero().squeeze(1).tolist() == sorted(set(requests[i].all_token_ids))


def test_rows_follow_the_requests_through_growth_preemption_and_reuse() -> None:
    vocab = 50
    rng = random.Random(3)
    batch = InputBatch(max_rows=4, max_blocks=32, vocab=vocab, device=torch.device("cpu"))
    penalised = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    requests = [
        _running(
            f"r{i}", [rng.randrange(vocab) for _ in range(5)], [], [rng.randrange(100)], penalised if i % 2 else None
        )
        for i in range(4)
    ]
    next_id = 4
    for step in range(60):
        active = [r for r in requests if r.status is RequestStatus.RUNNING]
        rows = batch.sync(active)
        assert len(set(rows)) == len(rows) == len(batch)
        _check(batch, active, rows, vocab)
        for r in active:  # the step's effects, as the scheduler applies them
            r.output_token_ids.append(rng.randrange(vocab))
            if rng.random() < 0.3:
                r.block_ids.append(rng.randrange(100))
        victim = rng.choice(active)
        if step % 7 == 3:  # preempted and admitted again before the next step: new blocks, same outputs
            victim.block_ids = [rng.randrange(100) for _ in range(rng.randrange(1, 4))]
        elif step % 7 == 5:  # finished: its row goes to a newcomer
            victim.status = RequestStatus.FINISHED_LENGTH
            requests.append(
                _running(
                    f"r{next_id}",
                    [rng.randrange(vocab) for _ in range(3)],
                    [rng.randrange(vocab)],
                    [rng.randrange(100)],
                    penalised,
                )
            )
            next_id += 1
    assert next_id > 8  # rows were reused many times


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(hf_model) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, hf_model.config.vocab_size) for _ in range(n)] for n in (2, 9, 16, 30, 47, 70)]


def run_engine(
    config: tuple[int, int, int | None, str], prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], int]:
    max_batch_tokens, block_size, num_kv_blocks, preemption = config
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
    requests = [engine.add_request(f"p{i}", p, params) for i, p in enumerate(prompts)]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        assert steps < 10_000
    return [r.output_token_ids for r in requests], sum(engine.scheduler.preemption.counts.values())


@pytest.mark.parametrize("config", [CONFIGS[0], CONFIGS[2]])
def test_repetition_penalty_matches_hf_generate(hf_model, prompts, config) -> None:
    params = SamplingParams(
        max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=1.6
    )
    ours, preempted = run_engine(config, prompts, params)
    assert (preempted > 0) == (config[2] is not None)
    generation = GenerationConfig(
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        repetition_penalty=1.6,
        eos_token_id=None,
        pad_token_id=0,
    )
    plain = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    unpenalised, _ = run_engine(CONFIGS[0], prompts[:2], plain)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                generation_config=generation,
            )
        assert ours[i] == out[0, len(prompt) :].tolist(), f"prompt {i} diverged"
    assert ours[:2] != unpenalised  # the penalty changed the outputs


def openai_penalised_greedy(model, prompt: list[int], n: int, presence: float, frequency: float) -> list[int]:
    """HF's logits, then OpenAI's formula: logit[t] -= presence * (count[t] > 0) + frequency * count[t]."""
    ids = list(prompt)
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1].float()
        logits[2] = float("-inf")  # EOS masked, as ignore_eos + min_tokens do
        logits[0] = float("-inf")  # the tiny model's second end token
        for token, count in Counter(out).items():
            logits[token] -= presence * (count > 0) + frequency * count
        token = int(logits.argmax())
        out.append(token)
        ids.append(token)
    return out


@pytest.mark.parametrize("config", [CONFIGS[1], CONFIGS[3]])
def test_presence_and_frequency_penalties_match_the_openai_formula(hf_model, prompts, config) -> None:
    params = SamplingParams(
        max_tokens=NEW_TOKENS,
        min_tokens=NEW_TOKENS,
        temperature=0.0,
        ignore_eos=True,
        presence_penalty=0.8,
        frequency_penalty=0.6,
    )
    ours, _ = run_engine(config, prompts, params)
    for i, prompt in enumerate(prompts):
        assert ours[i] == openai_penalised_greedy(hf_model, prompt, NEW_TOKENS, 0.8, 0.6), f"prompt {i} diverged"


def test_host_staging_copies_each_step_and_grows() -> None:
    staging = HostStaging(torch.device("cpu"), size=8)
    rng = random.Random(5)
    lists = [[rng.randrange(1000) for _ in range(rng.randrange(0, 20))] for _ in range(8)]  # 0..19: grows past 8
    tensors = [staging.stage(values) for values in lists]  # one per step; the buffer is reused
    assert [t.tolist() for t in tensors] == lists  # no step's tensor was overwritten by a later one
    assert all(t.dtype == torch.long for t in tensors)


def test_decode_buffers_are_written_in_place_per_batch_size() -> None:
    """Steady decoding reuses one buffer per batch size: the same four views, holding the latest step's values;
    another size has its own buffer, so writing one never changes the other's."""
    buffers = DecodeBuffers()
    first = buffers.write(list(range(8)), 2)
    assert [t.tolist() for t in first] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(t.dtype == torch.long for t in first)
    three = buffers.write(list(range(100, 112)), 3)
    again = buffers.write(list(range(10, 18)), 2)
    assert all(a is b for a, b in zip(first, again, strict=True))  # the same views, written again
    assert [t.tolist() for t in again] == [[10, 11], [12, 13], [14, 15], [16, 17]]
    assert [t.tolist() for t in three] == [[100, 101, 102], [103, 104, 105], [106, 107, 108], [109, 110, 111]]
