"""The engine's step overhead: µs per running request per step on the tiny random model, where the forward
pass costs little and what is left is the step loop itself (scheduling, building inputs, sampling,
applying results, making outputs).

For 1, 8, 32 and 128 running requests (all decoding: their prompts are computed before timing starts),
four workloads, each timed over `--steps` steps on one thread:
- greedy:    plain greedy decoding, the engine's hot path;
- min_tokens: greedy with min_tokens = max_tokens, as workload W1 runs (EOS is masked every step);
- penalties: sampled (temperature 0.8, top-p 0.9) with repetition, presence and frequency penalties;
- lora:      greedy, request i served by adapter i % 8 (the 8 W1 adapters built on the tiny model);
- queued:    greedy with three times as many requests waiting (max_num_seqs caps the running ones), so
             the waiting queue is ordered every step.
Printed per phase, median of `--rounds` rounds: schedule, execute (building the step's inputs, sampling: the
runner's work besides the model), forward (the model itself, which is not step overhead), update (applying the
sampled tokens), outputs (detokenizing, making the outputs); `overhead` is the total without the forward pass.
`total` and `overhead` come from a first pass of `--steps` steps that times only the forward pass; the phases from
a second pass that times each phase too (its timers add ~1 µs a phase per step, which `overhead` leaves out).

    python bench/step_overhead.py [--sizes 1,8,32,128] [--steps 40] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import make_w1_adapters  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import cache_root, resolve_model  # noqa: E402

PHASES = ("schedule", "execute", "forward", "update", "outputs")
WORKLOADS = ("greedy", "min_tokens", "penalties", "lora", "queued")


class PhaseTimer:
    """Times an engine's forward pass (the runner's model) and, once `time_phases` is called, its phase methods too
    (instance attributes shadow the class's), summing their time."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.on = False
        timed = _TimedModel(engine.runner.model, self)
        engine.runner.model = timed  # type: ignore[assignment]  # a proxy of the model (it times its passes)

    def time_phases(self) -> None:
        engine = self.engine
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(engine, "_execute", "execute")
        self._wrap(engine.scheduler, "update_from_output", "update")
        self._wrap(engine, "_make_outputs", "outputs")

    def _wrap(self, owner: Any, name: str, phase: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds[phase] += time.perf_counter() - start

        setattr(owner, name, timed)


class _TimedModel:
    """The runner's model, its forward pass and logits timed as "forward" (and taken out of "execute")."""

    def __init__(self, model: Any, timer: PhaseTimer) -> None:
        self._model, self._timer = model, timer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def _timed(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self._timer.on:
            return fn(*args)
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            spent = time.perf_counter() - start
            self._timer.seconds["forward"] += spent
            self._timer.seconds["execute"] -= spent  # (only read in the pass that times "execute")

    def __call__(self, *args: Any) -> Any:
        return self._timed(self._model, *args)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._timed(self._model.compute_logits, hidden)


def measure(model: str, workload: str, running: int, steps: int, adapters: Path | None) -> dict[str, float]:
    """µs per running request per step: per phase, in total and without the forward pass."""
    waiting = 3 * running if workload == "queued" else 0
    engine = LLMEngine(
        EngineConfig(
            model=model,
            num_threads=1,
            pool_mb=256,
            max_num_seqs=running,
            max_batch_tokens=max(2048, 16 * (running + waiting)),
            adapter_dir=str(adapters) if workload == "lora" else None,
            max_device_adapters=8,
            aging_s=None,
        )
    )
    warmup = 16  # steps before timing, at most; prompts go 512 tokens a step (--max-prefill-tokens)
    if workload == "penalties":
        params = SamplingParams(
            max_tokens=2 * steps + warmup + 8,
            min_tokens=2 * steps + warmup + 8,
            temperature=0.8,
            top_p=0.9,
            seed=None,
            repetition_penalty=1.1,
            presence_penalty=0.5,
            frequency_penalty=0.2,
            ignore_eos=True,
        )
    else:
        n = 2 * steps + warmup + 8
        params = SamplingParams(
            max_tokens=n, min_tokens=n if workload == "min_tokens" else 0, temperature=0.0, ignore_eos=True
        )
    names = sorted(p.name for p in adapters.iterdir()) if workload == "lora" and adapters else []
    for i in range(running + waiting):
        prompt = [(7 * i + j) % 200 + 10 for j in range(16)]
        engine.add_request(f"r{i}", prompt, params, adapter_id=names[i % len(names)] if names else None)
    for _ in range(warmup):  # until every running request has its prompt computed and decodes
        engine.step()
        running_ones = engine.scheduler.running
        if len(running_ones) == running and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running_ones):
            break
    engine.step()
    assert len(engine.scheduler.running) == running, (len(engine.scheduler.running), running)
    gc.collect()  # the engines of earlier configurations are garbage: collect them before, not while, timing
    timer = PhaseTimer(engine)
    timer.on = True
    scale = 1e6 / (steps * running)
    with torch.inference_mode():  # as the server's engine thread steps (engine/core/async_engine.py)
        start = time.perf_counter()
        for _ in range(steps):  # pass 1: the total, and the forward pass in it
            engine.step()
        total = time.perf_counter() - start
        overhead = total - timer.seconds["forward"]
        timer.seconds = dict.fromkeys(PHASES, 0.0)
        timer.time_phases()
        for _ in range(steps):  # pass 2: each phase
            engine.step()
    return {
        **{phase: s * scale for phase, s in timer.seconds.items()},
        "total": total * scale,
        "overhead": overhead * scale,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-random")
    parser.add_argument("--sizes", default="1,8,32,128")
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, help="write the medians here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes {args.sizes!r}: comma-separated positive integers")
    workloads = args.workloads.split(",")
    if min(sizes) < 1 or args.steps < 1 or args.rounds < 1:
        parser.error("--sizes, --steps and --rounds must be positive")
    if unknown := sorted(set(workloads) - set(WORKLOADS)):
        parser.error(f"unknown workload(s) {unknown}; workloads: {', '.join(WORKLOADS)}")
    adapters = None
    if "lora" in workloads:
        root = cache_root() / "bench-adapters" / "tiny-random"
        make_w1_adapters(resolve_model(args.model).path, root)
        adapters = root
    samples: dict[tuple[str, int], list[dict[str, float]]] = {}
    for _ in range(args.rounds):  # rounds interleave the configurations, so drift hits all alike
        for workload in workloads:
            for n in sizes:
                samples.setdefault((workload, n), []).append(measure(args.model, workload, n, args.steps, adapters))
    print(
        f"µs per running request per step, {args.model}, 1 thread, median of {args.rounds} rounds x {args.steps} steps"
    )
    print(f"{'workload':<10} {'running':>7} " + " ".join(f"{p:>9}" for p in PHASES) + f" {'total':>9} {'overhead':>9}")
    results = []
    for (workload, n), runs in samples.items():
        med = {k: statistics.median(r[k] for r in runs) for k in (*PHASES, "total", "overhead")}
        results.append({"workload": workload, "running": n, **{k: round(v, 2) for k, v in med.items()}})
        figures = " ".join(f"{med[p]:>9.1f}" for p in (*PHASES, "total", "overhead"))
        print(f"{workload:<10} {n:>7} {figures}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
