"""A request that cannot be computed fails alone: poisoned adapters, a forward pass that raises for one
request, and sampling parameters that leave no token, each in a batch whose other requests must finish
with PEFT's greedy tokens (the reference) as if the poisoned one had never been there.

Before this existed, any exception in `LLMEngine.step` failed every request in flight (AsyncEngine's
fail-all, answered 503), so one bad adapter or request body took down everyone's work.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.core.llm_engine import AdapterUnusable, LLMEngine
from engine.core.outputs import RequestOutput
from engine.core.request import SamplingParams

from lora_fixtures import make_peft_adapter, peft_greedy

NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
WEIGHTS = "adapter_model.safetensors"


def _poison(adapter_dir: Path, value: float) -> None:
    """Overwrite every lora_B of a saved adapter with `value` (NaN, or a huge finite number)."""
    tensors = load_file(str(adapter_dir / WEIGHTS))
    for name, tensor in tensors.items():
        if ".lora_B." in name:
            tensors[name] = torch.full_like(tensor, value)
    save_file(tensors, str(adapter_dir / WEIGHTS), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def adapter_root(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """good (a real PEFT LoRA); nan (NaN weights: the header is fine, the data is not); huge (finite
    weights of 1e30: logits overflow); swapped (good now, replaced on disk once registered)."""
    root = tmp_path_factory.mktemp("isolation-adapters")
    for seed, name in enumerate(("good", "nan", "huge", "swapped")):
        make_peft_adapter(tiny_model_dir, root / name, r=4, alpha=8, targets="all-linear", seed=seed, b_std=0.3)
    _poison(root / "nan", float("nan"))
    _poison(root / "huge", 1e30)
    return root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (6, 13, 21)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path, adapter_root: Path, prompts: list[list[int]]) -> dict:
    """PEFT's greedy tokens for the base model and the good adapter, per prompt."""
    return {
        (name, i): peft_greedy(tiny_model_dir, None if name is None else adapter_root / name, p, NEW_TOKENS)
        for name in (None, "good")
        for i, p in enumerate(prompts)
    }


def run_to_end(
    engine: LLMEngine, jobs: dict[str, tuple[str | None, list[int], SamplingParams]]
) -> dict[str, list[RequestOutput]]:
    """Add every job at once, step until done; each request's outputs in order."""
    for request_id, (adapter, prompt, params) in jobs.items():
        engine.add_request(request_id, prompt, params, adapter_id=adapter)
    outputs: dict[str, list[RequestOutput]] = {request_id: [] for request_id in jobs}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outputs[out.request_id].append(out)
    assert not engine.has_unfinished_requests()
    # Every page went back: failed requests freed their KV blocks, nothing is pinned.
    assert (
        engine.pool.num_free + engine.device_adapters.num_pages + engine.scheduler.kv.num_evictable_blocks
    ) == engine.pool.num_pages
    assert all(res.pins == 0 for res in engine.device_adapters.resident.values())
    return outputs


def tokens(outputs: list[RequestOutput]) -> list[int]:
    assert outputs[-1].finished and outputs[-1].error is None, outputs[-1]
    return [t for out in outputs for t in out.new_token_ids]


def failure(outputs: list[RequestOutput]) -> tuple[str, str]:
    assert len(outputs) == 1 and outputs[0].finished and outputs[0].finish_reason == "error"
    assert outputs[0].error is not None
    return outputs[0].error.type, outputs[0].error.message


def good_jobs(prompts: list[list[int]]) -> dict[str, tuple[str | None, list[int], SamplingParams]]:
    return {f"{name or 'base'}-{i}": (name, p, GREEDY) for name in (None, "good") for i, p in enumerate(prompts)}


def check_good(outputs: dict[str, list[RequestOutput]], reference: dict, prompts: list[list[int]]) -> None:
    for name in (None, "good"):
        for i in range(len(prompts)):
            assert tokens(outputs[f"{name or 'base'}-{i}"]) == reference[(name, i)], (name, i)


def test_poisoned_adapters_fail_alone(adapter_root: Path, prompts: list[list[int]], reference: dict) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(adapter_root)))
    jobs = {
        **good_jobs(prompts),
        "nan-0": ("nan", prompts[0], GREEDY),
        "nan-1": ("nan", prompts[1], GREEDY),
        "huge-0": ("huge", prompts[2], GREEDY),
    }
    outputs = run_to_end(engine, jobs)
    check_good(outputs, reference, prompts)
    for request_id in ("nan-0", "nan-1"):
        kind, message = failure(outputs[request_id])
        assert kind == "adapter_error" and "'nan'" in message and "non-finite" in message
    kind, message = failure(outputs["huge-0"])
    assert kind == "engine_error" and "non-finite logits" in message

    # The NaN adapter's version is remembered as broken: its next request is refused before it runs.
    with pytest.raises(AdapterUnusable, match="non-finite"):
        engine.add_request("nan-again", prompts[0], GREEDY, adapter_id="nan")
    assert "non-finite" in engine.adapters.broken(engine.adapters.get("nan"))
    # Registering it again (a new version) clears that: its files are read afresh.
    engine.adapters.register("nan", adapter_root / "nan")
    assert engine.adapters.broken(engine.adapters.get("nan")) is None


def test_weights_replaced_on_disk_fail_alone(
    adapter_root: Path, prompts: list[list[int]], reference: dict, tmp_path: Path, tiny_model_dir: Path
) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(adapter_root)))
    swapped = adapter_root / "swapped" / WEIGHTS
    original = swapped.read_bytes()
    try:
        make_peft_adapter(tiny_model_dir, tmp_path / "other", r=4, alpha=8, targets="all-linear", seed=99)
        swapped.write_bytes((tmp_path / "other" / WEIGHTS).read_bytes() + b" ")  # another size: a new stamp
        outputs = run_to_end(engine, {**good_jobs(prompts), "swapped-0": ("swapped", prompts[0], GREEDY)})
    finally:
        swapped.write_bytes(original)
    check_good(outputs, reference, prompts)
    kind, message = failure(outputs["swapped-0"])
    assert kind == "adapter_error" and "changed on disk" in message


def test_a_forward_pass_that_raises_for_one_request_fails_only_that_request(
    adapter_root: Path, prompts: list[list[int]], reference: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fault injection: the model raises whenever a step holds the poison token, wherever it is."""
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(adapter_root)))
    poison = 251
    forward = engine.runner.model.forward
    calls = {"n": 0}

    def faulty(input_ids: torch.Tensor, *args, **kwargs):
        calls["n"] += 1
        if bool((input_ids == poison).any()):
            raise RuntimeError("injected fault")
        return forward(input_ids, *args, **kwargs)

    monkeypatch.setattr(engine.runner.model, "forward", faulty)
    seeded = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, seed=1234, ignore_eos=True)
    jobs = {**good_jobs(prompts), "poisoned": ("good", [5, 6, poison, 7], GREEDY), "seeded": (None, prompts[1], seeded)}
    outputs = run_to_end(engine, jobs)
    check_good(outputs, reference, prompts)
    kind, message = failure(outputs["poisoned"])
    assert kind == "engine_error" and "injected fault" in message
    assert calls["n"] > NEW_TOKENS + 2  # the failing step was retried on halves of the batch

    # The seeded request drew as if the failed attempts never happened: the same tokens alone.
    alone = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))
    again = run_to_end(alone, {"seeded": (None, prompts[1], seeded)})
    assert tokens(outputs["seeded"]) == tokens(again["seeded"])


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_sampling_that_leaves_no_token_fails_alone(
    prompts: list[list[int]], reference: dict, temperature: float
) -> None:
    """min_tokens masks EOS and stop_token_ids until it is reached: naming every token id leaves none."""
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random"))
    every_id = tuple(range(engine.vocab_size))
    no_token = SamplingParams(max_tokens=4, min_tokens=2, temperature=temperature, stop_token_ids=every_id)
    jobs = {f"base-{i}": (None, p, GREEDY) for i, p in enumerate(prompts)}
    outputs = run_to_end(engine, {**jobs, "no-token": (None, prompts[0], no_token)})
    for i in range(len(prompts)):
        assert tokens(outputs[f"base-{i}"]) == reference[(None, i)]
    kind, message = failure(outputs["no-token"])
    assert kind == "engine_error" and "no token" in message


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", 1e39),
        ("temperature", float("inf")),
        ("temperature", float("nan")),
        ("temperature", 101.0),
        ("repetition_penalty", 1e-39),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", float("nan")),
        ("repetition_penalty", 1e39),
    ],
)
def test_sampling_params_outside_a_finite_range_are_refused(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value}).validate()
