"""Decode steps replayed from graphs (engine/worker/cuda_graphs.py), checked on a CPU through the seam: EagerGraph
runs the captured function again at each replay, so static inputs, padding to buckets, the scratch page, LoRA
tiles and recapture after a larger adapter are the code a GPU runs. The Triton decode-attention and SGMV kernels
run under the interpreter (what a captured GPU step runs). References: PEFT's greedy output and the same engine
without graphs. What the seam cannot show: that CUDA accepts the capture (bench/gpu_check.py does, on a GPU)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.worker.cuda_graphs import RANK_FLOOR, EagerGraph, batch_buckets

from lora_fixtures import peft_greedy


@pytest.fixture
def triton_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAGATE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("LORAGATE_LORA_BACKEND", "triton")


def _engine(adapter_dir: str | None, graphs: bool, rank_floor: int = 4) -> LLMEngine:
    """rank_floor 4 (not RANK_FLOOR): the tiny adapters' ranks (8 to 32 per group) pass it, and graphs are
    captured again."""
    engine = LLMEngine(
        EngineConfig(dtype="float32", model="tiny-random", adapter_dir=adapter_dir, max_model_len=256, max_num_seqs=16)
    )
    if graphs:
        engine.enable_graphs(EagerGraph, rank_floor=rank_floor)
    return engine


def _generate(engine: LLMEngine, jobs: list[tuple[str | None, list[int], int]]) -> list[list[int]]:
    requests = [
        engine.add_request(
            f"j{i}", prompt, SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0), adapter_id=adapter
        )
        for i, (adapter, prompt, n) in enumerate(jobs)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in requests]


def test_buckets_start_at_one_end_at_the_limit_and_pad_by_half_at_most() -> None:
    for limit in (1, 5, 8, 100, 128, 256):
        sizes = batch_buckets(limit)
        assert sizes[0] == 1 and sizes[-1] == limit and sizes == sorted(set(sizes))
        assert all(b <= 2 * a for a, b in zip(sizes, sizes[1:], strict=False))
        assert all(b <= 1.5 * a for a, b in zip(sizes[3:], sizes[4:], strict=False))


def test_graph_steps_equal_peft_and_the_engine_without_graphs(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], triton_paths: None
) -> None:
    """Seven requests (base and three adapters) of different lengths: decode batches of 7 down to 1 rows, each
    padded to its bucket; padding rows write only the scratch page (else some request's output would change)."""
    rng = random.Random(11)
    names = sorted(tiny_adapters)
    jobs = [([None, *names][i % 4], [rng.randrange(3, 400) for _ in range(3 + 2 * i)], 2 + i) for i in range(7)]
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    eager = _generate(_engine(adapter_dir, graphs=False), jobs)
    engine = _engine(adapter_dir, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None
    replays: list[int] = []
    run = graphs.run
    graphs.run = lambda step, tiles: replays.append(len(step.token_ids)) or run(step, tiles)  # type: ignore[method-assign]
    replayed = _generate(engine, jobs)
    expected = [peft_greedy(tiny_model_dir, None if a is None else tiny_adapters[a], p, n) for a, p, n in jobs]
    assert replayed == eager == expected
    assert sorted(set(replays)) == [1, 2, 3, 4, 5, 6, 7]  # every batch size took the graph path
    assert graphs.captures >= 4  # buckets 1, 2, 4, 8 with LoRA at least


def test_graphs_captured_before_any_adapter_loads_serve_adapters_within_the_rank_floor(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], triton_paths: None
) -> None:
    """With the default floor (64 per module) the graphs warm-up captures, before any adapter is loaded, already
    launch the SGMV kernels and serve every tiny adapter (ranks up to 32 per group) without a new capture."""
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    engine = _engine(adapter_dir, graphs=True, rank_floor=RANK_FLOOR)
    graphs = engine.runner.graphs
    assert graphs is not None
    graphs.capture_all()
    before = graphs.captures
    prompt = [5, 9, 200, 31, 7]
    jobs = [(name, prompt, 3) for name in sorted(tiny_adapters)]
    expected = [peft_greedy(tiny_model_dir, tiny_adapters[name], prompt, 3) for name in sorted(tiny_adapters)]
    assert _generate(engine, jobs) == expected
    assert graphs.captures == before


def test_a_larger_adapter_drops_the_graphs_and_they_are_captured_again(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], triton_paths: None
) -> None:
    """The SGMV grid is sized by the largest rank loaded when a graph is captured: after an adapter with a larger
    rank loads, the graphs are captured again, and its rows get all of their delta."""
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    engine = _engine(adapter_dir, graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None
    prompt = [5, 9, 200, 31, 7]
    for name in ("qv-r8", "mlp-r16-rslora"):  # gate/up: rank 0 at first, then 32
        before = graphs.captures
        assert _generate(engine, [(name, prompt, 4)]) == [peft_greedy(tiny_model_dir, tiny_adapters[name], prompt, 4)]
        assert graphs.captures > before


class _HostReads(TorchDispatchMode):
    """Records the ops that read a tensor's value on the host (.item(), int(), bool(), data-dependent shapes):
    each would wait for the GPU, and none may run inside a captured step."""

    READS = ("aten._local_scalar_dense", "aten.nonzero", "aten.masked_select", "aten.item")

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = str(func.overloadpacket)
        if any(name.startswith(r) for r in self.READS):
            self.seen.append(name)
        return func(*args, **kwargs or {})


def test_a_captured_step_reads_nothing_back_from_the_device(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], triton_paths: None
) -> None:
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    engine = _engine(adapter_dir, graphs=True)
    engine.warm_up()  # loads an adapter and captures every bucket, with and without LoRA
    graphs = engine.runner.graphs
    assert graphs is not None
    assert sorted(graphs._graphs) == sorted((b, lora) for b in graphs.buckets for lora in (False, True))
    captured = [c.graph for c in graphs._graphs.values()]
    assert all(isinstance(g, EagerGraph) for g in captured)
    reads = _HostReads()
    with torch.inference_mode(), reads:  # as the engine thread runs
        for graph in captured:
            graph.replay()
    assert reads.seen == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (bench/gpu_check.py runs this there)")
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_the_engine_on_cuda_equals_peft(tiny_model_dir: Path, tiny_adapters: dict[str, Path], graphs: bool) -> None:
    """On a GPU host: the engine on CUDA in fp32 (compiled kernels, real CUDA graphs captured at warm-up) gives
    PEFT's greedy tokens for base and adapter rows in one batch."""
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    config = EngineConfig(
        dtype="float32",
        model="tiny-random",
        device="cuda",
        cuda_graphs=graphs,
        adapter_dir=adapter_dir,
        max_model_len=256,
        max_num_seqs=16,
    )
    engine = LLMEngine(config)
    engine.warm_up()
    assert (engine.runner.graphs is not None) == graphs
    rng = random.Random(3)
    names = sorted(tiny_adapters)
    jobs = [([None, *names][i % 4], [rng.randrange(3, 400) for _ in range(4 + i)], 5) for i in range(6)]
    expected = [peft_greedy(tiny_model_dir, None if a is None else tiny_adapters[a], p, n) for a, p, n in jobs]
    assert _generate(engine, jobs) == expected


def test_graphs_refuse_the_torch_decode_path_with_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A captured step cannot run the torch decode path (it reads the longest context on the host)."""
    monkeypatch.setenv("LORAGATE_ATTENTION_BACKEND", "torch")
    engine = _engine(None, graphs=False)
    free = engine.pool.num_free
    with pytest.raises(ValueError, match="--no-cuda-graphs"):
        engine.enable_graphs(EagerGraph)
    assert engine.pool.num_free == free and engine.runner.graphs is None  # its scratch page given back
