"""The engine with each LoRA route forced (LORAGATE_LORA_BACKEND): the Triton SGMV kernels (for CPU tensors they
run under Triton's interpreter, on a host with or without a GPU) and the CPU's C++ op give the same logits as the
torch path for a mixed-adapter step, and greedy outputs equal to PEFT's for every adapter in one batch. The Triton
run also loads adapters as a GPU engine does (one staged copy per load, the slot tables' mirror in one copy)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from loragate_kernels.backends import Machine

from lora_fixtures import peft_greedy

NEW_TOKENS = 5


def _run(engine: LLMEngine, jobs: list[tuple[str | None, list[int]]]) -> tuple[list[list[int]], torch.Tensor]:
    """Every job at once, to completion: each one's tokens, and the logits of the first sampling step."""
    logits: list[torch.Tensor] = []
    compute = engine.model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        out = compute(hidden)
        logits.append(out.detach().clone())
        return out

    engine.model.compute_logits = recording  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [
        engine.add_request(f"j{i}", prompt, params, adapter_id=adapter) for i, (adapter, prompt) in enumerate(jobs)
    ]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in requests], logits[0]


def test_triton_and_cpp_paths_equal_the_torch_path_and_peft(
    tiny_model_dir: Path, tiny_adapters: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (7, 3, 20, 5)]
    names = sorted(tiny_adapters)  # three adapters: q/v, all seven modules, mlp with rslora
    jobs = [(names[i % 3] if i < 3 else None, p) for i, p in enumerate(prompts)]
    adapter_dir = str(next(iter(tiny_adapters.values())).parent)
    results = {}
    routes = ("torch", "triton", "cpp") if Machine.probe("cpu").cpu_ops else ("torch", "triton")  # cpp: where built
    for backend in routes:
        monkeypatch.setenv("LORAGATE_LORA_BACKEND", backend)
        engine = LLMEngine(
            # the logits are compared: greedy rows through the whole head (no head screen)
            EngineConfig(
                dtype="float32", model="tiny-random", adapter_dir=adapter_dir, max_model_len=256, head_screen=False
            )
        )
        assert engine.backends.lora.value == backend and engine.runner.lora.kernel.value == backend
        assert (engine.device_adapters.mirror is not None) == (backend != "torch")
        # The GPU's way of loading an adapter (one staged table copied into every layer at once), on the CPU.
        engine.device_adapters.stage_copies = backend == "triton"
        results[backend] = _run(engine, jobs)
    torch_tokens, torch_logits = results["torch"]
    scale = torch_logits.abs().max().item()
    expected = [peft_greedy(tiny_model_dir, None if a is None else tiny_adapters[a], p, NEW_TOKENS) for a, p in jobs]
    assert torch_tokens == expected
    for backend in routes[1:]:
        tokens, logits = results[backend]
        torch.testing.assert_close(logits, torch_logits, rtol=0, atol=1e-4 * scale, msg=backend)
        assert tokens == expected, backend
