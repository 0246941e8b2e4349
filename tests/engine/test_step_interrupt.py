"""A critical arrival ends a step of lower-class work between two layers (`LLMEngine.step(interrupt)`): the step
runs again later, and every request's tokens are what they would have been uninterrupted (HF `generate` on
tiny-random is the reference), whatever the step was doing: prefilling in chunks, decoding, preempting."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from test_engine import NEW_TOKENS, engine_outputs, greedy_params, hf_greedy
from transformers import AutoModelForCausalLM

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.request import Request, SamplingParams
from loragate_common.priority import Priority


@dataclass
class Step:
    requests: list[Request]
    prompts: list[Request]  # those of `requests` computing prompt tokens
    interrupted: bool = False


class Interrupter:
    """Steps an engine as its server thread does (the event cleared before each step) and sets the event while
    the model is about to compute layer `layer` of the steps `when(i)` picks (i counts steps): the check before
    the next layer ends the pass after the first layers wrote this step's K/V, as a critical arrival mid-step
    does. Records, per step, the requests scheduled, those of them computing prompt tokens, and whether the step
    was interrupted."""

    def __init__(self, engine: LLMEngine, layer: int = 1, when: Callable[[int], bool] = lambda i: True) -> None:
        assert 0 < layer < len(engine.model.layers) - 1, "layers before it, and after it one that checks"
        self.engine = engine
        self.event = threading.Event()
        self.when = when
        self.steps: list[Step] = []
        engine.model.layers[layer].register_forward_pre_hook(self._hook)
        schedule = engine.scheduler.schedule

        def recording_schedule():
            out = schedule()
            prompts = [r for r in out.requests if r.num_computed_tokens < r.num_prompt_tokens]
            self.steps.append(Step(list(out.requests), prompts))
            return out

        engine.scheduler.schedule = recording_schedule

    def _hook(self, module, args) -> None:
        if self.when(len(self.steps) - 1):
            self.event.set()

    def step(self) -> list[RequestOutput]:
        self.event.clear()
        before = self.engine.interrupted_steps
        outputs = self.engine.step(self.event)
        self.steps[-1].interrupted = self.engine.interrupted_steps > before
        return outputs

    @property
    def interrupted(self) -> int:
        return sum(step.interrupted for step in self.steps)


@pytest.fixture(scope="module")
def cases(tiny_model_dir) -> tuple[list[list[int]], list[list[int]]]:
    """Prompts of 2 to 70 tokens and HF's greedy tokens for each."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    rng = random.Random(11)
    prompts = [[rng.randrange(3, model.config.vocab_size) for _ in range(n)] for n in (2, 9, 17, 40, 70)]
    return prompts, [hf_greedy(model, p, NEW_TOKENS) for p in prompts]


SHEDDABLE = dict.fromkeys(range(5), Priority.SHEDDABLE)  # every prompt of `cases`


@pytest.mark.parametrize(
    "config",
    [
        dict(),  # every prompt in one step, then decodes
        dict(max_batch_tokens=7, block_size=4),  # prompts in chunks beside the decodes
        dict(max_batch_tokens=64, block_size=4, num_kv_blocks=40, preemption="recompute"),  # a tight pool
        dict(max_batch_tokens=64, block_size=4, num_kv_blocks=40, preemption="swap"),
    ],
    ids=["whole-prompts", "chunked", "recompute", "swap"],
)
@pytest.mark.parametrize("layer", [1, 2])
def test_interrupted_steps_leave_outputs_equal_to_hf(cases, config, layer) -> None:
    prompts, expected = cases
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", **config))
    driver = Interrupter(engine, layer, when=lambda i: i % 3 == 1)
    ours = engine_outputs(engine, prompts, join_after={3: 4, 4: 9}, priorities=SHEDDABLE, step=driver.step)
    assert ours == expected
    assert driver.interrupted > 0 and engine.interrupted_steps == driver.interrupted
    assert engine.stats().interrupted_steps == driver.interrupted
    preempted = engine.scheduler.preemption.counts
    assert (sum(preempted.values()) > 0) == ("num_kv_blocks" in config), preempted  # the tight pools preempt


def test_interrupts_leave_seeded_sampling_penalties_and_cached_prefixes_unchanged(cases) -> None:
    """Sampled requests with their own seed and penalties, some sharing a cached prompt prefix: the same tokens
    with steps interrupted as without (the sampler never runs in an interrupted step; penalty counts are synced
    once per token; attached prefix blocks are only read)."""
    prompts, _ = cases
    shared = prompts[4][:32]  # two full blocks of 16, cached after the first request computes them
    jobs = [
        (
            shared + p[:5],
            SamplingParams(
                max_tokens=20,
                temperature=0.9,
                top_p=0.9,
                seed=100 + i,
                repetition_penalty=1.3,
                frequency_penalty=0.4,
                presence_penalty=0.2,
                ignore_eos=True,
            ),
        )
        for i, p in enumerate(prompts)
    ]

    def run(interrupt: bool) -> tuple[list[list[int]], int]:
        engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", max_batch_tokens=24))
        driver = Interrupter(engine, layer=1, when=(lambda i: i % 2 == 0) if interrupt else (lambda i: False))
        requests = []
        for i, (prompt, params) in enumerate(jobs):
            requests.append(engine.add_request(f"s{i}", prompt, params, Priority.SHEDDABLE))
            for _ in range(3):  # each joins a running batch
                driver.step()
        while engine.has_unfinished_requests():
            driver.step()
        assert engine.scheduler.kv.prefix_hits > 0
        return [r.output_token_ids for r in requests], engine.interrupted_steps

    plain, none = run(False)
    interrupted, some = run(True)
    assert none == 0 and some > 0
    assert interrupted == plain


def test_critical_prompts_are_never_interrupted_and_lower_classes_always_progress(cases) -> None:
    """The event set in every step, as under a stream of critical arrivals: steps computing a critical prompt run
    whole, steps where critical requests only decode may not; an interrupted step is always followed by one
    that runs whole."""
    prompts, expected = cases
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", max_batch_tokens=16, block_size=4))
    driver = Interrupter(engine, layer=2)
    priorities = {**SHEDDABLE, 3: Priority.CRITICAL, 4: Priority.STANDARD}
    ours = engine_outputs(engine, prompts, join_after={3: 5, 4: 7}, priorities=priorities, step=driver.step)
    assert ours == expected
    steps = [step for step in driver.steps if step.requests]
    assert driver.interrupted > 0
    critical = [step for step in steps if any(r.priority is Priority.CRITICAL for r in step.requests)]
    assert any(step.interrupted for step in critical), "a step of critical decodes and lower-class work"
    for step in critical:
        if any(r.priority is Priority.CRITICAL for r in step.prompts):
            assert not step.interrupted
    for first, second in zip(steps, steps[1:], strict=False):
        assert not (first.interrupted and second.interrupted), "lower-class work made no progress"


def test_interrupts_can_be_turned_off(cases) -> None:
    prompts, expected = cases
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", critical_interrupts=False))
    driver = Interrupter(engine)
    ours = engine_outputs(engine, prompts, priorities=SHEDDABLE, step=driver.step)
    assert ours == expected
    assert driver.interrupted == 0 and engine.interrupted_steps == 0


def test_a_critical_arrival_interrupts_the_step_in_progress_of_the_async_engine(cases) -> None:
    """Through AsyncEngine, as the server runs it: a critical request put in the inbox while the engine thread is
    inside a step of sheddable decodes ends that step; the critical request and the sheddable ones all get the
    tokens they would have got alone."""
    prompts, expected = cases
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", model="tiny-random")))
    armed, inside = threading.Event(), threading.Event()

    def hold_step(module, args) -> None:  # on the engine thread, before layer 1
        if armed.is_set():
            armed.clear()
            inside.set()
            engine._critical_arrived.wait(timeout=30)  # the critical request is in the inbox

    engine.engine.model.layers[1].register_forward_pre_hook(hold_step)

    async def collect(rid: str, prompt: list[int], priority: Priority, first: asyncio.Event | None = None) -> list[int]:
        tokens: list[int] = []
        async for out in engine.generate(rid, prompt, greedy_params(), priority):
            tokens += out.new_token_ids
            if first is not None and len(tokens) >= 2:
                first.set()
        return tokens

    async def scenario() -> tuple[list[list[int]], list[int]]:
        await engine.start()
        try:
            decoding = [asyncio.Event() for _ in range(3)]
            load = [
                asyncio.create_task(collect(f"s{i}", prompts[i], Priority.SHEDDABLE, decoding[i])) for i in range(3)
            ]
            for event in decoding:
                await asyncio.wait_for(event.wait(), 30)
            armed.set()
            assert await asyncio.to_thread(inside.wait, 30), "the engine did not step"
            critical = await asyncio.wait_for(collect("c", prompts[3], Priority.CRITICAL), 60)
            return await asyncio.wait_for(asyncio.gather(*load), 60), critical
        finally:
            await engine.shutdown()

    sheddable, critical = asyncio.run(scenario())
    assert engine.engine.interrupted_steps == 1
    assert critical == expected[3]
    assert sheddable == expected[:3]
