"""Multi-LoRA serving through the whole engine, against PEFT (PeftModel on the HF model, one request at a
time): heterogeneous ranks and target sets in one batch, a device tier smaller than the working set,
adapter pages competing with KV pages, reloads and unloads."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from test_step_interrupt import Interrupter

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request, SamplingParams
from engine.lora.routes import Segments, TorchLora
from engine.lora.stacks import MAX_ROWS_PER_ADAPTER, LoraStacks, StackPlan
from engine.model.sources import build_tiny_random
from loragate_kernels.backends import Gemm

from lora_fixtures import make_peft_adapter, peft_greedy

NEW_TOKENS = 12
# name -> LoraConfig arguments: ranks {2, 4, 8, 16, 32}, different targets and alphas, one rslora,
# one with rank_pattern / alpha_pattern.
TINY_ADAPTERS: dict[str, dict] = {
    "r2-qv": dict(r=2, alpha=4, targets=["q_proj", "v_proj"]),
    "r4-all": dict(r=4, alpha=16, targets="all-linear"),
    "r8-rslora": dict(r=8, alpha=8, targets=["o_proj", "down_proj", "gate_proj"], use_rslora=True),
    "r16-kqup": dict(r=16, alpha=32, targets=["k_proj", "up_proj", "q_proj"]),
    "r32-mlp": dict(r=32, alpha=16, targets=["gate_proj", "up_proj", "down_proj"]),
    "r8-patterns": dict(
        r=8, alpha=16, targets="all-linear", rank_pattern={"q_proj": 4, "down_proj": 2}, alpha_pattern={"o_proj": 32}
    ),
}


@pytest.fixture(scope="module")
def tiny_adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for seed, (name, kwargs) in enumerate(TINY_ADAPTERS.items()):
        make_peft_adapter(tiny_model_dir, root / name, seed=seed, b_std=0.3, **kwargs)
    return root


@pytest.fixture(scope="module")
def prompts(tiny_model_dir: Path) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 11, 23)]


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_adapter_dir, prompts) -> dict[tuple[str | None, int], list[int]]:
    """PEFT's greedy tokens for every (adapter or None, prompt index)."""
    out = {}
    for name in [None, *TINY_ADAPTERS]:
        adapter = None if name is None else tiny_adapter_dir / name
        for i, p in enumerate(prompts):
            out[(name, i)] = peft_greedy(tiny_model_dir, adapter, p, NEW_TOKENS)
    return out


def run_all(
    engine: LLMEngine,
    jobs: list[tuple[str | None, int]],
    prompts: list[list[int]],
    step: Callable[[], object] | None = None,
) -> dict[tuple[str | None, int], list[int]]:
    """Submit every (adapter, prompt) at once, step to completion (with `step`, default engine.step), return the
    tokens of each."""
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests: dict[tuple[str | None, int], Request] = {}
    for k, (name, i) in enumerate(jobs):
        requests[(name, i)] = engine.add_request(f"job{k}", prompts[i], params, adapter_id=name)
    steps = 0
    while engine.has_unfinished_requests():
        (step or engine.step)()
        steps += 1
        assert steps < 5000, "no progress"
    assert (
        engine.pool.num_free + engine.device_adapters.num_pages + engine.scheduler.kv.num_evictable_blocks
    ) == engine.pool.num_pages
    return {key: r.output_token_ids for key, r in requests.items()}


ALL_JOBS = [(name, i) for name in [None, *TINY_ADAPTERS] for i in range(3)]


def test_mixed_batch_matches_peft(tiny_adapter_dir, prompts, reference) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir)))
    ours = run_all(engine, ALL_JOBS, prompts)
    for key in ALL_JOBS:
        assert ours[key] == reference[key], f"{key} differs from PEFT"
    # The adapters really change the output (the comparison above is not base vs base).
    assert sum(reference[(name, 0)] != reference[(None, 0)] for name in TINY_ADAPTERS) >= 4
    assert engine.device_adapters.counters.loads == len(TINY_ADAPTERS)


def test_mlp_adapters_match_peft_where_the_activation_fuses(tmp_path: Path) -> None:
    """A model whose gate and up fill whole 96-column panels: on cpu/panels.cpp's route its base rows take the GEMM
    with the activation fused (engine/model/cpu_gemm.py PackedLinear.silu_mul), and steps with adapters on the MLP
    keep their deltas on gate and up (which the fused op has no room for: the MLP runs the two ops apart there)."""
    model_dir = build_tiny_random(tmp_path / "model", seed=5, intermediate_size=192)
    specs = {"mlp": TINY_ADAPTERS["r32-mlp"], "gate-up": dict(r=8, alpha=16, targets=["gate_proj", "up_proj"])}
    for seed, (name, kwargs) in enumerate(specs.items()):
        make_peft_adapter(model_dir, tmp_path / "adapters" / name, seed=seed, b_std=0.3, **kwargs)
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(model_dir), adapter_dir=str(tmp_path / "adapters")))
    prompts = [[random.Random(i).randrange(3, 250) for _ in range(9 + 5 * i)] for i in range(2)]
    jobs = [(name, i) for name in [None, *specs] for i in range(2)]
    ours = run_all(engine, jobs, prompts)
    want = {
        (name, i): peft_greedy(model_dir, name and tmp_path / "adapters" / name, prompts[i], NEW_TOKENS)
        for name, i in jobs
    }
    assert ours == want
    assert all(want[(name, 0)] != want[(None, 0)] for name in specs)  # the MLP deltas change the output
    mlp = engine.model.layers[0].mlp
    fused = mlp.gate_up_proj.silu_mul(torch.zeros(1, mlp.gate_up_proj.in_features))
    assert (fused is not None) == (engine.backends.gemm is Gemm.PANELS)


@pytest.fixture
def torch_lora_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU's torch route (where the C++ op cannot be built), which stacks decoding steps' adapters."""
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", "torch")


@pytest.mark.usefixtures("torch_lora_path")
def test_stacked_decode_lora_matches_peft_and_the_per_segment_path(tiny_adapter_dir, prompts, reference) -> None:
    """The CPU's torch path stacks a decoding step's adapters for batched matmuls (engine/lora/stacks.py): uneven
    request counts per adapter (padded stacks) and base rows among them still give PEFT's tokens, and every layer's and
    group's deltas equal the per-segment path's (loragate_kernels/reference.py lora_sgmv_group) on the same pool."""
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir)))
    jobs = [(name, i) for k, name in enumerate(TINY_ADAPTERS) for i in range(k % 3 + 1)] + [(None, 1)]
    ours = run_all(engine, jobs, prompts)
    assert all(ours[key] == reference[key] for key in jobs), "differs from PEFT"
    assert isinstance(engine.runner.lora, TorchLora) and engine.runner.lora.stacks.builds >= 1
    _check_stacked_deltas(engine)


@pytest.mark.usefixtures("torch_lora_path")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_deltas_equal_per_segment_deltas(tiny_adapter_dir, prompts, dtype) -> None:
    engine = LLMEngine(EngineConfig(dtype=dtype, model="tiny-random", adapter_dir=str(tiny_adapter_dir)))
    run_all(engine, [(name, 0) for name in TINY_ADAPTERS], prompts)
    _check_stacked_deltas(engine)


def _check_stacked_deltas(engine: LLMEngine) -> None:
    tier, route = engine.device_adapters, engine.runner.lora
    assert isinstance(route, TorchLora)
    stacks = route.stacks
    slots = sorted(res.slot for res in tier.resident.values())
    assert len(slots) == len(TINY_ADAPTERS)
    # 1-3 rows per adapter, a base segment among them, and one adapter in two segments
    starts, seg_slots = [0], []
    for k, slot in enumerate([*slots[:3], tier.null_slot, *slots[3:], slots[0]]):
        seg_slots.append(slot)
        starts.append(starts[-1] + k % 3 + 1)
    plan = stacks.plan(starts, seg_slots, tier.null_slot)
    assert plan is not None and plan.mask is not None  # padded: the adapters' row counts differ
    _compare_with_per_segment(route, starts, seg_slots, plan, base_rows=list(range(starts[3], starts[4])))
    # requests finish: a step of 4 of those 6 adapters reuses their stack (no copy), its extra adapters padding
    builds = stacks.builds
    fewer = [0, 2, 3, 5, 6]
    subset = stacks.plan(fewer, slots[1:5], tier.null_slot)
    assert subset is not None and subset.stack is plan.stack and stacks.builds == builds
    _compare_with_per_segment(route, fewer, slots[1:5], subset, base_rows=[])
    # a stack past its byte bound is not built: the per-segment path serves the step
    assert LoraStacks(tier.weights, max_bytes=0).plan(starts, seg_slots, tier.null_slot) is None
    long_segment = [0, MAX_ROWS_PER_ADAPTER + 1]  # a prefill chunk: per segment
    assert stacks.plan(long_segment, slots[:1], tier.null_slot) is None


def _compare_with_per_segment(
    route: TorchLora, starts: list[int], seg_slots: list[int], plan: StackPlan, base_rows: list[int]
) -> None:
    """Every layer's and group's deltas through `plan` equal the per-segment path's on random x and y."""
    dtype = route.weights.layer_pools[0].dtype
    gen = torch.Generator().manual_seed(0)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    cols, ins = route.weights.out_cols, route.weights.in_features
    for layer in range(len(route.weights.layer_pools)):
        for group in cols:
            x = torch.randn(starts[-1], ins[group], generator=gen).to(dtype)
            y0 = torch.randn(starts[-1], cols[group][-1], generator=gen).to(dtype)
            stacked, looped = y0.clone(), y0.clone()
            route.apply(plan, layer, group, stacked, x)
            route.apply(Segments(starts, seg_slots), layer, group, looped, x)
            torch.testing.assert_close(stacked, looped, atol=tol, rtol=tol)
            assert torch.equal(stacked[base_rows], y0[base_rows])  # rows without an adapter are untouched


def test_warm_up_runs_base_and_lora_shapes_and_leaves_nothing_behind(tiny_adapter_dir, prompts, reference) -> None:
    """LLMEngine.warm_up (what AsyncEngine.load runs before the server listens): it steps prefill and decode batches
    with and without LoRA rows, then holds no request, no cached prefix and no pinned page; the registered adapters
    wait in the host tier; outputs after it are PEFT's."""
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir)))
    assert engine.warm_up() > 0
    tier = engine.device_adapters
    assert not engine.has_unfinished_requests() and engine.scheduler.kv.num_evictable_blocks == 0
    assert tier.counters.loads == 1
    registered = engine.adapters.list()
    assert len(registered) > 1 and all(engine.host_adapters.contains(spec) for spec in registered)
    assert engine.host_adapters.misses == 0  # read before any request asked
    assert all(res.pins == 0 for res in tier.resident.values())
    assert engine.pool.num_free + tier.num_pages == engine.pool.num_pages
    ours = run_all(engine, ALL_JOBS, prompts)
    assert all(ours[key] == reference[key] for key in ALL_JOBS)
    # a context too short for its usual prompts: shorter ones, never a refused warm-up request (a failed start)
    small = LLMEngine(
        EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir), max_model_len=6)
    )
    assert small.warm_up() > 0 and not small.has_unfinished_requests()


def test_interrupted_steps_of_a_mixed_batch_match_peft(tiny_adapter_dir, prompts, reference) -> None:
    """Steps ended between two layers (a critical arrival, tests/engine/test_step_interrupt.py) and run again:
    the LoRA segments of the partial pass wrote K/V that the rerun writes again, alike."""
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            model="tiny-random",
            adapter_dir=str(tiny_adapter_dir),
            max_device_adapters=3,
            max_batch_tokens=16,
        )
    )
    driver = Interrupter(engine, layer=2, when=lambda i: i % 2 == 0)
    ours = run_all(engine, ALL_JOBS, prompts, step=driver.step)
    assert ours == {key: reference[key] for key in ALL_JOBS}
    assert engine.interrupted_steps > 0 and engine.device_adapters.counters.evictions > 0


def test_device_tier_smaller_than_working_set(tiny_adapter_dir, prompts, reference) -> None:
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            model="tiny-random",
            adapter_dir=str(tiny_adapter_dir),
            max_device_adapters=2,
            max_batch_tokens=16,
        )
    )
    ours = run_all(engine, ALL_JOBS, prompts)
    assert ours == {key: reference[key] for key in ALL_JOBS}
    assert engine.device_adapters.counters.evictions > 0
    assert len(engine.device_adapters.resident) <= 2


def test_adapter_pages_compete_with_kv_pages(tiny_adapter_dir, prompts, reference) -> None:
    probe = LLMEngine(
        EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir), block_size=4)
    )
    largest = max(probe.device_adapters.pages_needed(s) for s in probe.adapters.list())
    # Room for the largest adapter plus a few requests' KV blocks: loads evict idle adapters and
    # running requests get preempted, and nothing deadlocks.
    engine = LLMEngine(
        EngineConfig(
            dtype="float32",
            model="tiny-random",
            adapter_dir=str(tiny_adapter_dir),
            block_size=4,
            num_kv_blocks=largest + 12,
        )
    )
    ours = run_all(engine, ALL_JOBS, prompts)
    assert ours == {key: reference[key] for key in ALL_JOBS}
    assert engine.device_adapters.counters.evictions > 0


def test_pages_proportional_to_rank(tiny_adapter_dir) -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir), block_size=1)
    )
    tier = engine.device_adapters
    for spec in engine.adapters.list():
        # Reference: the element counts of the adapter file's own tensors, largest layer, whole pages.
        per_layer: dict[str, int] = {}
        with safe_open(str(tiny_adapter_dir / spec.adapter_id / "adapter_model.safetensors"), "pt") as f:
            for key in f.keys():
                layer = key.split(".layers.")[1].split(".")[0]
                per_layer[layer] = (
                    per_layer.get(layer, 0) + f.get_slice(key).get_shape()[0] * f.get_slice(key).get_shape()[1]
                )
        expected = -(-max(per_layer.values()) // tier.page_elems)
        assert tier.pages_needed(spec) == expected, spec.adapter_id
    specs = {s.adapter_id: s for s in engine.adapters.list()}
    assert tier.pages_needed(specs["r2-qv"]) * 8 < tier.pages_needed(specs["r32-mlp"])


def test_reload_bumps_version_and_running_requests_keep_theirs(
    tiny_model_dir, tiny_adapter_dir, prompts, reference, tmp_path
) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir)))
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    old = engine.add_request("old", prompts[1], params, adapter_id="r4-all")
    engine.step()
    engine.step()
    # Reload the id with different weights while "old" runs.
    other = make_peft_adapter(tiny_model_dir, tmp_path / "v2", seed=77, b_std=0.3, **TINY_ADAPTERS["r4-all"])
    spec = engine.adapters.register("r4-all", other)
    engine.retire_adapter("r4-all")
    assert spec.version == 2
    new = engine.add_request("new", prompts[1], params, adapter_id="r4-all")
    while engine.has_unfinished_requests():
        engine.step()
    assert old.output_token_ids == reference[("r4-all", 1)]
    assert new.output_token_ids == peft_greedy(tiny_model_dir, other, prompts[1], NEW_TOKENS)
    assert new.output_token_ids != old.output_token_ids
    assert not any(key[1] == 1 for key in engine.device_adapters.resident)  # v1 freed when unpinned
    # Unload: unknown afterwards, and its pages come back.
    engine.adapters.unregister("r4-all")
    engine.retire_adapter("r4-all")
    with pytest.raises(KeyError):
        engine.add_request("gone", prompts[0], params, adapter_id="r4-all")
    assert engine.device_adapters.num_pages == 0
    assert engine.pool.num_free + engine.scheduler.kv.num_evictable_blocks == engine.pool.num_pages


@pytest.mark.smollm2
def test_smollm2_adapters_match_peft(smollm2_dir: Path, tmp_path: Path) -> None:
    specs = {
        "s4": dict(r=4, alpha=8, targets="all-linear"),
        "s8-rslora": dict(r=8, alpha=16, targets=["q_proj", "v_proj", "down_proj"], use_rslora=True),
        "s16": dict(r=16, alpha=32, targets=["k_proj", "o_proj", "gate_proj", "up_proj"]),
    }
    for seed, (name, kwargs) in enumerate(specs.items()):
        make_peft_adapter(smollm2_dir, tmp_path / name, seed=seed, b_std=0.02, **kwargs)
    engine = LLMEngine(EngineConfig(dtype="float32", model="smollm2", adapter_dir=str(tmp_path), pool_mb=192))
    prompt = engine.tokenizer("The quick brown fox jumps over")["input_ids"]
    n = 6
    jobs = [None, *specs]
    params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    reqs = {name: engine.add_request(f"j-{name}", prompt, params, adapter_id=name) for name in jobs}
    while engine.has_unfinished_requests():
        engine.step()
    for name in jobs:
        expected = peft_greedy(smollm2_dir, None if name is None else tmp_path / name, prompt, n)
        assert reqs[name].output_token_ids == expected, name


def test_queued_requests_adapters_are_prefetched_into_host_tier(tiny_adapter_dir, prompts) -> None:
    engine = LLMEngine(
        EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(tiny_adapter_dir), max_num_seqs=1)
    )
    params = SamplingParams(max_tokens=4, temperature=0.0)
    engine.add_request("first", prompts[0], params)
    engine.step()  # "first" holds the only sequence slot: the next request waits
    waiting = engine.add_request("queued", prompts[1], params, adapter_id="r16-kqup")
    engine._prefetcher.submit(lambda: None).result()  # the prefetch queued before this has finished
    assert engine.host_adapters.contains(waiting.adapter)
    assert not engine.device_adapters.is_resident(waiting.adapter)  # host tier only, not yet device
    assert waiting.status.value == "waiting"
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.host_adapters.hits >= 1  # admission found it in the host tier
