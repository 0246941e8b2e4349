"""DoRA adapters (PEFT's use_dora) served in the mixed batch, against PEFT's own DoRA forward (PeftModel on the HF
model, one request at a time): greedy tokens and the sampled steps' top logprobs, with DoRA adapters of ranks 4 to 32,
a plain LoRA and base rows in one batch, through every LoRA route (the C++ op, the torch twins stacked and per segment,
the Triton kernels under their interpreter, and the CUDA-graph path's eager fallback); Qwen2's q/k/v biases and
Phi-3's fused projections; a device tier smaller than the working set; hostile magnitudes. The magnitudes are PEFT's
(the base's row norms) times 1 + N(0, 0.1^2) (tests/lora_fixtures.py), so a missing rescale changes the output."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from model_families import build_family
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request, SamplingParams
from engine.lora.peft_config import AdapterError
from engine.lora.routes import TorchLora
from loragate_kernels.backends import Machine
from loragate_kernels.cpu.ops import dora_scale_group_cpu
from loragate_kernels.reference import dora_scale_group

from lora_fixtures import load_peft_model, make_peft_adapter, peft_greedy

NEW_TOKENS = 5
TOP = 5  # logprobs compared per sampled token
DORA: dict[str, dict] = {
    "d4-all": dict(r=4, alpha=8, targets="all-linear"),
    "d16-attn-down": dict(r=16, alpha=16, targets=["q_proj", "k_proj", "v_proj", "down_proj"], use_rslora=True),
    "d32-mlp": dict(r=32, alpha=32, targets=["gate_proj", "up_proj"], rank_pattern={"up_proj": 8}),
}
PLAIN: dict[str, dict] = {"p8-all": dict(r=8, alpha=16, targets="all-linear")}


@pytest.fixture(scope="module", autouse=True)
def peft_dora_caching() -> Iterator[None]:
    """PEFT's own cache of DoRA's weight norms in eval mode (the same values, computed once per module instead of at
    every forward: PEFT's DoRA on SmolLM2 is otherwise ~6 s a token here)."""
    import peft.tuners.lora.dora as peft_dora

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(peft_dora, "ENABLE_DORA_CACHING", True)
        yield


def _make(base: Path, root: Path, specs: dict[str, dict], dora: bool, seed: int = 0, b_std: float = 0.3) -> None:
    for i, (name, kwargs) in enumerate(specs.items()):
        make_peft_adapter(base, root / name, seed=seed + i, b_std=b_std, use_dora=dora, **kwargs)


@pytest.fixture(scope="module")
def adapter_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dora")
    _make(tiny_model_dir, root, DORA, dora=True)
    _make(tiny_model_dir, root, PLAIN, dora=False, seed=len(DORA))
    return root


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    """A short prompt (decodes: the stacked torch path, DoRA rows gathered), one past the stacked path's 16 rows per
    adapter, and one past DoRA's 64-row gather span (scaled per segment)."""
    rng = random.Random(7)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in (5, 23, 70)]


def _jobs(names: list[str | None], count: int) -> list[tuple[str | None, int]]:
    return [(name, i) for name in names for i in range(count)]


ALL = [None, *DORA, *PLAIN]


def peft_logprobs(base: Path, adapter: Path | None, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """PEFT's log-softmax for each of `tokens` given the prompt and the tokens before it: [len(tokens), vocab]."""
    model = load_peft_model(base, adapter)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1 : -1].float(), dim=-1)


@pytest.fixture(scope="module")
def reference(tiny_model_dir, adapter_dir, prompts) -> dict[tuple[str | None, int], tuple[list[int], torch.Tensor]]:
    """PEFT's greedy tokens and their steps' log-softmax for every (adapter or None, prompt)."""
    out = {}
    for name, i in _jobs(ALL, len(prompts)):
        adapter = None if name is None else adapter_dir / name
        tokens = peft_greedy(tiny_model_dir, adapter, prompts[i], NEW_TOKENS)
        out[(name, i)] = tokens, peft_logprobs(tiny_model_dir, adapter, prompts[i], tokens)
    return out


def run_jobs(
    engine: LLMEngine, jobs: list[tuple[str | None, int]], prompts: list[list[int]]
) -> dict[tuple[str | None, int], Request]:
    """Every job at once (greedy, with the sampled tokens' top logprobs), stepped to completion."""
    params = SamplingParams(
        max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP
    )
    requests = {
        job: engine.add_request(f"j{k}-{job}", prompts[job[1]], params, adapter_id=job[0]) for k, job in enumerate(jobs)
    }
    while engine.has_unfinished_requests():
        engine.step()
    return requests


def assert_matches(requests: dict, reference: dict, atol: float = 1e-3) -> None:
    """Tokens equal PEFT's, and every top logprob within `atol` of PEFT's: fp32 sums in another order than PEFT's,
    through layers of std-0.5 weights whose logits reach ~20, differ by up to a few 1e-4 (dropping DoRA's rescale
    moves them by more than 1e-2: `test_dora_changes_the_output`)."""
    for key, request in requests.items():
        tokens, logprobs = reference[key]
        assert request.output_token_ids == tokens, f"{key}: tokens differ from PEFT"
        assert len(request.output_logprobs) == len(tokens)
        for step, entry in enumerate(request.output_logprobs):
            for token, value in entry.top:
                assert abs(value - logprobs[step, token].item()) < atol, f"{key} step {step}: logprob differs"


def _engine(adapter_dir: Path, **overrides) -> LLMEngine:
    return LLMEngine(
        EngineConfig(dtype="float32", model="tiny-random", adapter_dir=str(adapter_dir), max_model_len=256, **overrides)
    )


ROUTES = ["cpp", "torch"] if Machine.probe("cpu").cpu_ops else ["torch"]


@pytest.mark.parametrize("route", ROUTES)
def test_mixed_batch_equals_peft(adapter_dir, prompts, reference, route, monkeypatch) -> None:
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", route)
    engine = _engine(adapter_dir)
    assert engine.runner.lora is not None and engine.runner.lora.kernel.value == route
    jobs = _jobs(ALL, len(prompts))
    assert_matches(run_jobs(engine, jobs, prompts), reference)
    # GET /v1/adapters' cards say which are DoRA, as their PEFT configs do
    kinds = {status.adapter_id: status.kind for status in engine.adapter_statuses()}
    for name, kind in kinds.items():
        use_dora = json.loads((adapter_dir / name / "adapter_config.json").read_text()).get("use_dora")
        assert kind == ("DoRA" if use_dora else "LoRA")
    assert set(kinds.values()) == {"DoRA", "LoRA"}
    if route == "torch":  # the stacked decode path ran, and DoRA's torch scaler
        assert isinstance(engine.runner.lora, TorchLora) and engine.runner.lora.stacks.builds >= 1
        assert engine.runner.lora.dora.builds >= 1


def test_triton_route_equals_peft(adapter_dir, prompts, reference, monkeypatch) -> None:
    """The Triton SGMV kernels under their interpreter (slow: the short prompt only), loading as a GPU engine does."""
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", "triton")
    engine = _engine(adapter_dir)
    engine.device_adapters.stage_copies = True
    jobs = _jobs(ALL, 1)
    assert_matches(run_jobs(engine, jobs, prompts), reference)


def test_dora_changes_the_output(tiny_model_dir, adapter_dir, prompts, reference, tmp_path) -> None:
    """The same adapter read as a plain LoRA (its magnitudes dropped) differs from PEFT's DoRA in every step's
    logprobs: the comparisons above would catch rows left unscaled."""
    plain = tmp_path / "plain"
    shutil.copytree(adapter_dir / "d4-all", plain)
    config = json.loads((plain / "adapter_config.json").read_text())
    (plain / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False}))
    weights = load_file(plain / "adapter_model.safetensors")
    save_file({k: v for k, v in weights.items() if "magnitude" not in k}, plain / "adapter_model.safetensors")
    tokens, dora = reference[("d4-all", 0)]
    lora = peft_logprobs(tiny_model_dir, plain, prompts[0], tokens)
    assert ((lora - dora).abs().amax(dim=-1) > 1e-2).all()


def test_scalers_equal_the_twin_and_leave_other_rows(adapter_dir, prompts) -> None:
    """DoraScaler (gathered rows, and segment by segment) and the C++ op against loragate_kernels/reference.py's
    per-segment oracle on the pool the tier wrote, with and without a bias; rows of plain and base segments keep their
    values bit for bit."""
    engine = _engine(adapter_dir)
    run_jobs(engine, [(name, 0) for name in ALL if name is not None], prompts)
    tier, route = engine.device_adapters, engine.runner.lora
    assert route is not None
    slot = {res.spec.adapter_id: res.slot for res in tier.resident.values()}
    order = ["d4-all", None, "p8-all", "d32-mlp", "d16-attn-down", "d4-all"]
    for rows in (3, 20):  # spans of 18 and 120 rows: gathered, then per segment
        seg_slots = [tier.null_slot if name is None else slot[name] for name in order]
        starts = [rows * i for i in range(len(order) + 1)]
        plan = route.dora.plan_segments(starts, seg_slots)
        assert plan is not None and (plan.index is None) == (rows == 20)
        plain_rows = [r for i, name in enumerate(order) if name in (None, "p8-all") for r in range(*starts[i : i + 2])]
        gen = torch.Generator().manual_seed(rows)
        for layer, pool in enumerate(tier.weights.layer_pools):
            for group, cols in tier.weights.out_cols.items():
                y = torch.randn(starts[-1], cols[-1], generator=gen)
                bias = torch.randn(cols[-1], generator=gen) if layer % 2 else None
                ours, cpp, twin = y.clone(), y.clone(), y.clone()
                plan.apply(layer, group, ours, bias)
                dora_scale_group(twin, starts, seg_slots, pool, tier.tables.g_offsets[layer][group], bias)
                torch.testing.assert_close(ours, twin, rtol=1e-6, atol=1e-6)
                assert torch.equal(ours[plain_rows], y[plain_rows])
                if tier.mirror is not None:
                    segments = torch.tensor(starts + seg_slots)
                    dora_scale_group_cpu(cpp, segments, pool, tier.mirror.g_offsets[layer][group], bias)
                    torch.testing.assert_close(cpp, twin, rtol=1e-6, atol=1e-6)
                    assert torch.equal(cpp[plain_rows], y[plain_rows])


@pytest.mark.skipif(not Machine.probe("cpu").cpu_ops, reason="the C++ ops are not built on this machine")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpp_op_equals_the_twin_in_each_dtype(dtype: torch.dtype) -> None:
    """The C++ op on a synthetic pool: rows of a wider tensor (a row stride past the width), slots without scales,
    an empty segment, a bias of another dtype; and its argument checks."""
    gen = torch.Generator().manual_seed(1)
    pool = (1 + 0.3 * torch.randn(400, generator=gen)).to(dtype)
    offsets = torch.tensor([7, -1, 200, -1])  # slots 0 and 2 have scales
    starts, slots = [0, 3, 3, 9, 10, 14], [0, 1, 2, 3, 2]
    wide = torch.randn(14, 90, generator=gen).to(dtype)
    bias = torch.randn(60, generator=gen)
    for b in (None, bias):
        ours, twin = wide.clone(), wide.clone()
        dora_scale_group_cpu(ours[:, :60], torch.tensor(starts + slots), pool, offsets, b)
        dora_scale_group(twin[:, :60], starts, slots, pool, offsets, b)
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(ours, twin, rtol=tol, atol=tol)
        assert torch.equal(ours[:, 60:], wide[:, 60:]) and torch.equal(ours[9], wide[9])
    with pytest.raises(RuntimeError, match="overrun the pool"):
        dora_scale_group_cpu(wide[:, :60], torch.tensor(starts + slots), pool, torch.tensor([390, -1, 0, -1]))
    with pytest.raises(RuntimeError, match="names slot 4"):
        dora_scale_group_cpu(wide[:, :60], torch.tensor([0, 2, 4]), pool, offsets)


def test_tier_smaller_than_the_working_set(adapter_dir, prompts, reference) -> None:
    """Two slots for four adapters: DoRA adapters are evicted and brought back (their scales computed again), and
    every request still equals PEFT."""
    engine = _engine(adapter_dir, max_device_adapters=2, max_batch_tokens=32)
    for i in range(2):  # the second round brings back the adapters the first one's last evicted
        assert_matches(run_jobs(engine, [(name, i) for name in ALL], prompts), reference)
    counters = engine.device_adapters.counters
    assert counters.evictions > 0 and max(counters.loads_by_adapter[name] for name in DORA) >= 2


@pytest.mark.parametrize("family", ["qwen2", "phi3"])
def test_biased_and_fused_projections_equal_peft(family: str, tmp_path: Path) -> None:
    """Qwen2's q/k/v biases (the rescale keeps the bias out of g: g ⊙ (W x + s B A x) + bias) and Phi-3's fused
    qkv_proj and gate_up_proj (one magnitude over the fused rows, split between the modules it covers)."""
    base = build_family(family, tmp_path / "model", seed=3)
    targets = ["q_proj", "k_proj", "v_proj", "down_proj"] if family == "qwen2" else ["qkv_proj", "gate_up_proj"]
    specs = {"dora": dict(r=8, alpha=16, targets=targets), "dora-o": dict(r=4, alpha=8, targets=["o_proj"])}
    _make(base, tmp_path / "adapters", specs, dora=True)
    _make(base, tmp_path / "adapters", {"plain": dict(r=8, alpha=16, targets=targets)}, dora=False, seed=5)
    engine = LLMEngine(EngineConfig(dtype="float32", model=str(base), adapter_dir=str(tmp_path / "adapters")))
    prompts = [[random.Random(i).randrange(3, 250) for _ in range(6 + 9 * i)] for i in range(2)]
    jobs = _jobs([None, "dora", "dora-o", "plain"], 2)
    reference = {}
    for name, i in jobs:
        adapter = None if name is None else tmp_path / "adapters" / name
        tokens = peft_greedy(base, adapter, prompts[i], NEW_TOKENS)
        reference[(name, i)] = tokens, peft_logprobs(base, adapter, prompts[i], tokens)
    assert_matches(run_jobs(engine, jobs, prompts), reference)


def test_graph_steps_with_dora_rows_run_eagerly_and_equal_peft(adapter_dir, prompts, reference, monkeypatch) -> None:
    """Decode steps on the CUDA-graph path (its CPU seam, engine/worker/cuda_graphs.py): those with DoRA rows run
    eagerly over the staged inputs, the others replay; all equal PEFT."""
    from engine.worker.cuda_graphs import EagerGraph

    monkeypatch.setenv("LORAGATE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", "triton")
    engine = _engine(adapter_dir, max_num_seqs=4)
    graphs = engine.enable_graphs(EagerGraph, rank_floor=4)
    assert_matches(run_jobs(engine, [("d16-attn-down", 0), ("p8-all", 0), (None, 0)], prompts), reference)
    assert graphs.eager_steps == NEW_TOKENS - 1 and graphs.captures == 0  # every decode step had a DoRA row
    assert_matches(run_jobs(engine, [("p8-all", 0)], prompts), reference)  # none: replayed
    assert graphs.eager_steps == NEW_TOKENS - 1 and graphs.captures >= 1


# ---- hostile files ---------------------------------------------------------------------------------------------


def _broken(adapter_dir: Path, tmp_path: Path, name: str, edit) -> Path:
    """A copy of adapter `d4-all` under `name` whose tensors `edit` changed."""
    target = tmp_path / name
    shutil.copytree(adapter_dir / "d4-all", target)
    tensors = load_file(target / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, target / "adapter_model.safetensors")
    return target


Q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"


def _nan(tensors: dict) -> None:
    tensors[Q0] = tensors[Q0].clone()
    tensors[Q0][3] = float("nan")


def test_hostile_magnitudes_are_refused_naming_them_beside_a_running_batch(
    adapter_dir, prompts, reference, tmp_path
) -> None:
    """Registration reads the header: a magnitude of the wrong length, a missing one, one on a plain adapter, a
    use_dora that is not a boolean are refused naming the tensor or key. A NaN magnitude is found reading the
    weights: POST /v1/adapters' check (`verify_adapter`) refuses it, and a request naming it (registered unchecked)
    fails alone. The batch running meanwhile still equals PEFT."""
    engine = _engine(adapter_dir)
    params = SamplingParams(
        max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP
    )
    jobs = _jobs(["d16-attn-down", "d4-all", None], 2)
    running = {
        job: engine.add_request(f"r{k}", prompts[job[1]], params, adapter_id=job[0]) for k, job in enumerate(jobs)
    }
    engine.step()
    short = _broken(adapter_dir, tmp_path, "short", lambda t: t.__setitem__(Q0, t[Q0][:-1].clone()))
    missing = _broken(adapter_dir, tmp_path, "missing", lambda t: t.pop(Q0))
    plain = tmp_path / "plain-with-magnitude"
    shutil.copytree(adapter_dir / "p8-all", plain)
    tensors = load_file(plain / "adapter_model.safetensors")
    save_file({**tensors, Q0: torch.ones(64)}, plain / "adapter_model.safetensors")
    flag = _broken(adapter_dir, tmp_path, "flag", lambda t: None)
    config = json.loads((flag / "adapter_config.json").read_text())
    (flag / "adapter_config.json").write_text(json.dumps({**config, "use_dora": "yes"}))
    refusals = {
        short: (Q0, "shape [63]", "expected [64]"),
        missing: (Q0, "lacks"),
        plain: (Q0, "use_dora"),
        flag: ("use_dora='yes'",),
    }
    for path, needles in refusals.items():
        with pytest.raises(AdapterError) as caught:
            engine.adapters.register(path.name, path, verify=engine.verify_adapter)
        assert all(needle in str(caught.value) for needle in needles), str(caught.value)
        engine.step()
    nan = _broken(adapter_dir, tmp_path, "nan", _nan)
    with pytest.raises(AdapterError, match=f"{Q0} has non-finite values"):
        engine.adapters.register("nan", nan, verify=engine.verify_adapter)
    engine.adapters.register("nan", nan)  # the header alone is fine: its first request reads the weights
    failing = engine.add_request("nan", prompts[0], params, adapter_id="nan")
    errors = []
    while engine.has_unfinished_requests():
        errors += [out.error for out in engine.step() if out.error is not None]
    assert failing.output_token_ids == [] and len(errors) == 1 and Q0 in str(errors[0])
    assert_matches(running, reference)


@pytest.mark.smollm2
def test_smollm2_dora_equals_peft(smollm2_dir: Path, tmp_path: Path) -> None:
    specs = {
        "d4": dict(r=4, alpha=8, targets="all-linear"),
        "d16": dict(r=16, alpha=32, targets=["k_proj", "o_proj", "gate_proj", "up_proj"]),
    }
    _make(smollm2_dir, tmp_path, specs, dora=True, b_std=0.02)
    _make(smollm2_dir, tmp_path, {"p8": dict(r=8, alpha=16, targets=["q_proj", "v_proj"])}, False, seed=9, b_std=0.02)
    engine = LLMEngine(EngineConfig(dtype="float32", model="smollm2", adapter_dir=str(tmp_path), pool_mb=192))
    prompt = engine.tokenizer("The quick brown fox jumps over")["input_ids"]
    names = [None, *specs, "p8"]
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = {name: engine.add_request(f"s-{name}", prompt, params, adapter_id=name) for name in names}
    while engine.has_unfinished_requests():
        engine.step()
    expected = {
        name: peft_greedy(smollm2_dir, None if name is None else tmp_path / name, prompt, NEW_TOKENS) for name in names
    }
    assert {name: r.output_token_ids for name, r in requests.items()} == expected
    assert expected["d4"] != expected[None]
