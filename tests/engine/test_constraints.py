"""Token constraints (engine/core/request.py TokenConstraint) and logit_bias through the real engine on tiny-random:
outputs obey the masks, unconstrained rows of the same batch are unchanged, a constraint's state survives
preemption by recompute and by swap, a complete grammar ends the request with "stop" (streamed too), and a
biased greedy request follows HF's argmax of the biased logits. Real JSON-schema grammars (engine/structured) too:
base and adapter rows in one batch, prompts prefilled in chunks, preempted mid-prompt and mid-answer by recompute
and by swap, each answer the same as without preemption and valid against its schema (`jsonschema`)."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import jsonschema
import pytest
import torch

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.request import Request, SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.structured import CompiledGrammar, compile_response_format

from lora_fixtures import load_peft_model


def _bit(j: int) -> int:
    """Bit j of an int32 word (bit 31 is the sign bit)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j


class InOrder:
    """Only these token ids, in this order, then finished."""

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.advanced: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        token = self.tokens[len(self.advanced)]
        bitmask[token // 32] = _bit(token % 32)

    def advance(self, token_id: int) -> None:
        assert token_id == self.tokens[len(self.advanced)]
        self.advanced.append(token_id)

    def is_finished(self) -> bool:
        return len(self.advanced) == len(self.tokens)


class EvenOnly:
    """Only even token ids; never finished."""

    def __init__(self) -> None:
        self.advanced: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        bitmask.fill_(0x55555555)  # bits 0, 2, ..., 30 of every word

    def advance(self, token_id: int) -> None:
        assert token_id % 2 == 0
        self.advanced.append(token_id)

    def is_finished(self) -> bool:
        return False


class FreeThenEos:
    """Any `n` tokens but EOS, then the grammar is complete and allows EOS alone (finished once EOS is taken, as
    xgrammar's matchers are)."""

    def __init__(self, n: int, eos: int) -> None:
        self.n, self.eos = n, eos
        self.advanced: list[int] = []

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        if len(self.advanced) < self.n:
            bitmask.fill_(-1)
            bitmask[self.eos // 32] = -1 ^ _bit(self.eos % 32)
        else:
            bitmask[self.eos // 32] = _bit(self.eos % 32)

    def advance(self, token_id: int) -> None:
        self.advanced.append(token_id)

    def is_finished(self) -> bool:
        return bool(self.advanced) and self.advanced[-1] == self.eos


class Nothing:
    """Allows no token at all."""

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        pass

    def advance(self, token_id: int) -> None:
        raise AssertionError("nothing was allowed")

    def is_finished(self) -> bool:
        return False


SEQUENCE = [10, 200, 31, 63, 95, 4, 127]  # ids on bit 31 of their word among them


@pytest.fixture(scope="module")
def prompts(tiny_model_config) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, tiny_model_config.vocab_size) for _ in range(n)] for n in (3, 17, 40)]


def greedy(n: int, **kw: object) -> SamplingParams:
    return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True, **kw)  # type: ignore[arg-type]


def run(engine: LLMEngine, preempt: dict[int, list[Request]] | None = None) -> dict[str, list[RequestOutput]]:
    """Step to completion, collecting each request's outputs; after step i, preempt the requests preempt[i]."""
    outputs: dict[str, list[RequestOutput]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        steps += 1
        for request in (preempt or {}).get(steps, []):
            engine.scheduler._preempt(request, SchedulerOutput())
        assert steps < 2000
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


def test_outputs_obey_constraints_and_unconstrained_greedy_rows_are_unchanged(tiny_adapters, prompts) -> None:
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    alone = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=adapter_dir))
    for i, prompt in enumerate(prompts):
        alone.add_request(f"free{i}", prompt, greedy(12))
        alone.add_request(f"free-lora{i}", prompt, greedy(12), adapter_id="all-r4")
    reference = run(alone)
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=adapter_dir))
    for i, prompt in enumerate(prompts):
        engine.add_request(f"free{i}", prompt, greedy(12))
        engine.add_request(f"free-lora{i}", prompt, greedy(12), adapter_id="all-r4")
        engine.add_request(f"even{i}", prompt, greedy(12, constraint=EvenOnly))
        sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=i, constraint=EvenOnly)
        engine.add_request(f"even-sampled-lora{i}", prompt, sampled, adapter_id="qv-r8")
        in_order = SamplingParams(max_tokens=20, temperature=1.0, constraint=lambda: InOrder(SEQUENCE))
        engine.add_request(f"in-order{i}", prompt, in_order, adapter_id="all-r4" if i % 2 else None)
    outputs = run(engine)
    for i in range(len(prompts)):
        for name in ("free", "free-lora"):
            assert tokens(outputs[f"{name}{i}"]) == tokens(reference[f"{name}{i}"])  # unchanged beside constraints
        for name in ("even", "even-sampled-lora"):
            out = tokens(outputs[f"{name}{i}"])
            assert len(out) == 12 and all(t % 2 == 0 for t in out)
            assert outputs[f"{name}{i}"][-1].finish_reason == "length"
        seq = outputs[f"in-order{i}"]
        assert tokens(seq) == SEQUENCE and seq[-1].finished and seq[-1].finish_reason == "stop"
        # The token that completes the grammar is an ordinary one: it is shown.
        assert "".join(o.new_text for o in seq) == engine.tokenizer.decode(SEQUENCE, skip_special_tokens=True)
    assert tokens(outputs["even0"]) != tokens(reference["free0"])  # the mask changed what greedy picks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_constraint_state_survives_preemption(prompts, mode) -> None:
    def submit(engine: LLMEngine) -> list[Request]:
        eos = engine.eos_token_ids[0]
        then_eos = SamplingParams(max_tokens=16, temperature=0.0, min_tokens=10, constraint=lambda: FreeThenEos(5, eos))
        return [
            engine.add_request("even", prompts[1], greedy(16, constraint=EvenOnly)),
            engine.add_request("in-order", prompts[2], greedy(16, constraint=lambda: InOrder(SEQUENCE))),
            engine.add_request("then-eos", prompts[0], then_eos),
        ]

    calm = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", preemption=mode))
    submit(calm)
    reference = run(calm)
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", preemption=mode))
    even, in_order, then_eos = submit(engine)
    outputs = run(engine, preempt={3: [even, in_order], 5: [then_eos], 7: [even]})
    assert engine.scheduler.preemption.counts[mode] == 4
    for request in (even, in_order, then_eos):
        assert tokens(outputs[request.request_id]) == tokens(reference[request.request_id])
        assert request.constraint is not None
        assert request.constraint.advanced == request.output_token_ids  # type: ignore[attr-defined]
    assert even.output_token_ids and all(t % 2 == 0 for t in even.output_token_ids)
    assert in_order.output_token_ids == SEQUENCE and outputs["in-order"][-1].finish_reason == "stop"
    assert len(then_eos.output_token_ids) == 6 and outputs["then-eos"][-1].finish_reason == "stop"


def test_a_complete_grammar_ends_a_stream_with_stop_even_below_min_tokens(prompts) -> None:
    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", model="tiny-random")))
    eos = engine.engine.eos_token_ids[0]

    async def collect(request_id: str, params: SamplingParams) -> list[RequestOutput]:
        return [out async for out in engine.generate(request_id, prompts[1], params)]

    async def scenario() -> tuple[list[RequestOutput], list[RequestOutput]]:
        await engine.start()
        try:
            return await asyncio.gather(
                collect(
                    "in-order", SamplingParams(max_tokens=30, temperature=0.8, constraint=lambda: InOrder(SEQUENCE))
                ),
                collect(
                    "then-eos", SamplingParams(max_tokens=30, min_tokens=20, constraint=lambda: FreeThenEos(4, eos))
                ),
            )
        finally:
            await engine.shutdown()

    in_order, then_eos = asyncio.run(scenario())
    assert tokens(in_order) == SEQUENCE and in_order[-1].finished and in_order[-1].finish_reason == "stop"
    assert all(not o.finished for o in in_order[:-1]) and len(in_order) == len(SEQUENCE)
    # min_tokens (20) did not mask EOS into "no token": the grammar was complete, EOS ended it, and is not shown.
    out = tokens(then_eos)
    assert len(out) == 5 and out[-1] == eos and then_eos[-1].finish_reason == "stop" and then_eos[-1].error is None
    tokenizer = engine.engine.tokenizer
    assert "".join(o.new_text for o in then_eos) == tokenizer.decode(out[:4], skip_special_tokens=True)


def test_a_constraint_that_allows_nothing_fails_its_own_request(prompts) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))
    engine.add_request("stuck", prompts[0], SamplingParams(max_tokens=4, constraint=Nothing))
    engine.add_request("fine", prompts[0], greedy(4, constraint=EvenOnly))
    outputs = run(engine)
    (stuck,) = outputs["stuck"]
    assert stuck.finish_reason == "error" and stuck.error is not None and "constraint" in stuck.error.message
    assert len(tokens(outputs["fine"])) == 4


class BreaksOnSecondToken(EvenOnly):
    def advance(self, token_id: int) -> None:
        if self.advanced:
            raise RuntimeError("matcher rejected the token")
        super().advance(token_id)


def test_a_failing_constraint_fails_its_own_request_and_the_engine_goes_on(prompts) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))

    def unusable() -> EvenOnly:
        raise RuntimeError("no matcher")

    with pytest.raises(ValueError, match="constraint"):
        engine.add_request("unusable", prompts[0], greedy(4, constraint=unusable))
    assert not engine.has_unfinished_requests()
    engine.add_request("breaks", prompts[0], greedy(4, constraint=BreaksOnSecondToken))
    engine.add_request("fine", prompts[1], greedy(4, constraint=EvenOnly))
    outputs = run(engine)
    broke = outputs["breaks"]
    assert len(broke) == 2 and broke[-1].finish_reason == "error" and broke[-1].error is not None
    assert broke[-1].error.type == "engine_error" and "matcher rejected the token" in broke[-1].error.message
    assert len(tokens(outputs["fine"])) == 4 and outputs["fine"][-1].finish_reason == "length"


def test_logit_bias_greedy_follows_hf_argmax_of_the_biased_logits(tiny_model_dir, prompts) -> None:
    model = load_peft_model(tiny_model_dir, None)
    prompt = prompts[1]

    def hf_biased_greedy(bias: dict[int, float], n: int) -> list[int]:
        ids = list(prompt)
        for _ in range(n):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].float()
            for token_id, value in bias.items():
                logits[token_id] += value
            ids.append(int(logits.argmax()))
        return ids[len(prompt) :]

    plain = hf_biased_greedy({}, 6)
    bias = {7: 2.5, plain[0]: -100.0, plain[1]: -100.0}
    expected = hf_biased_greedy(bias, 6)
    assert expected != plain
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))
    engine.add_request("biased", prompt, greedy(6, logit_bias=tuple(bias.items())))
    engine.add_request("plain", prompt, greedy(6))
    outputs = run(engine)
    assert tokens(outputs["biased"]) == expected and tokens(outputs["plain"]) == plain
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request("too-far", prompt, greedy(2, logit_bias=((engine.vocab_size, 1.0),)))


# ---- real grammars: chunked prefill and preemption -------------------------------------------------------


def _closed(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required, "additionalProperties": False}


GRAMMAR_SCHEMAS: list[dict[str, Any]] = [
    _closed(
        {
            "name": {"type": "string", "minLength": 1, "maxLength": 5},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "role": {"enum": ["admin", "user", "guest"]},
        },
        ["name", "age", "role"],
    ),
    _closed({"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3}}, ["tags"]),
    _closed({"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}, "ok": {"type": "boolean"}}, ["code"]),
    _closed({"outer": _closed({"x": {"type": "number", "minimum": -1, "maximum": 1}}, ["x"])}, ["outer"]),
]
CHUNKED = dict(max_batch_tokens=32, max_prefill_tokens=12, block_size=4)  # a 40-token prompt: four chunks
ROW_ADAPTERS = [None, "all-r4", "qv-r8", None]  # base and adapter rows in one batch


def _submit_json(engine: LLMEngine, grammars: list[CompiledGrammar], prompts: list[list[int]]) -> list[Request]:
    requests = []
    for i, (grammar, adapter) in enumerate(zip(grammars, ROW_ADAPTERS, strict=True)):
        params = SamplingParams(max_tokens=200, temperature=0.0, constraint=grammar.constraint)
        requests.append(engine.add_request(f"json{i}", prompts[1 + i % 2], params, adapter_id=adapter))
    engine.add_request("free", prompts[2], greedy(12), adapter_id="all-r4")  # unconstrained, beside them
    return requests


def _chunked_config(tiny_adapters: dict[str, Any], mode: str) -> EngineConfig:
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    return EngineConfig(dtype="float32", model="tiny-random", adapter_dir=adapter_dir, preemption=mode, **CHUNKED)


@pytest.fixture(scope="module")
def json_reference(tiny_adapters, prompts) -> tuple[list[CompiledGrammar], dict[str, list[RequestOutput]]]:
    """The grammars of GRAMMAR_SCHEMAS and their requests' outputs on a chunked engine that preempts nothing."""
    calm = LLMEngine(_chunked_config(tiny_adapters, "recompute"))
    grammars = [
        compile_response_format({"type": "json_schema", "json_schema": {"name": "s", "schema": s}}, calm.tokenizer)
        for s in GRAMMAR_SCHEMAS
    ]
    _submit_json(calm, grammars, prompts)
    return grammars, run(calm)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_schema_grammars_survive_chunked_prefill_and_preemption(tiny_adapters, prompts, json_reference, mode) -> None:
    grammars, reference = json_reference
    engine = LLMEngine(_chunked_config(tiny_adapters, mode))
    requests = _submit_json(engine, grammars, prompts)
    # Each grammar request is preempted while its prompt is half prefilled, after its 2nd token and after its 6th.
    done: set[tuple[str, str]] = set()
    outputs: dict[str, list[RequestOutput]] = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs.setdefault(out.request_id, []).append(out)
        for request in requests:
            if request not in engine.scheduler.running:
                continue
            computed, prompt_len = request.num_computed_tokens, request.num_prompt_tokens
            for when, due in (
                ("mid-prompt", 0 < computed < prompt_len),
                ("2 tokens", request.num_output_tokens >= 2),
                ("6 tokens", request.num_output_tokens >= 6),
            ):
                if due and (request.request_id, when) not in done:
                    done.add((request.request_id, when))
                    engine.scheduler._preempt(request, SchedulerOutput())
                    break
    assert not engine.has_unfinished_requests()
    assert len(done) == 3 * len(requests)  # every preemption above happened
    assert engine.scheduler.preemption.counts[mode] == 3 * len(requests)
    assert tokens(outputs["free"]) == tokens(reference["free"])
    for request, schema in zip(requests, GRAMMAR_SCHEMAS, strict=True):
        rid = request.request_id
        assert tokens(outputs[rid]) == tokens(reference[rid]), rid  # the grammar resumed where it was
        assert outputs[rid][-1].finish_reason == "stop", rid
        jsonschema.validate(json.loads("".join(o.new_text for o in outputs[rid])), schema)
