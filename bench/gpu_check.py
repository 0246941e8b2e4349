"""One prepared check for a single NVIDIA GPU (sized for an H200 and ~8 minutes): run it once, read one table.

    python bench/gpu_check.py [--json PATH] [--budget-s 450] [--skip sanitizer,llama8b] [--work-dir DIR]
    python bench/gpu_check.py --smoke --json PATH     # every code path at tiny sizes on the CPU (~1 minute)

Sections (each in its own subprocess with a timeout, so a crash, a hang or a poisoned CUDA context costs that
section only; a part whose subprocess fails prints `FAILED: reason` in its rows and the rest still run):

1. kernel tests: `python -m pytest -q tests/kernels` without TRITON_INTERPRET (on a GPU host the kernels compile),
   and, when `compute-sanitizer` is on PATH, the same under `compute-sanitizer --tool memcheck ... -x` with the
   caching allocator off (so memcheck sees every allocation's bounds). The sanitizer runs last, on what is left
   of the budget (at most --sanitizer-timeout-s): it is the slowest and least likely to find anything, and it
   must not starve the figures of sections 2-4. Its row stays in section 1.
2. engine vs PEFT: the tiny random model in fp32 on CUDA, a mixed batch (base + 3 PEFT adapters built with PEFT
   itself, tests/lora_fixtures.py), greedy tokens from the engine (after LLMEngine.warm_up, which captures the
   graphs) with cuda_graphs on and off against PEFT + HF greedy decoding of each request alone.
3. kernel throughput: Llama-8B sizes (hidden 4096, a q/k/v group with out columns 4096/1024/1024, rank 16 per
   module), T rows each its own adapter, bf16: Triton SGMV (loragate_kernels/triton/sgmv.py) vs its torch twin
   (loragate_kernels/reference.py) vs gather-bmm (bench/lora_kernels.py `sgmv_gather_bmm`, once per module); CUDA
   events, median of repeats. Target: gather-bmm / SGMV >= 2 at 64 adapters.
4. engine throughput: SmolLM2-135M, then a random-weight Llama-8B-shaped model (written as bf16 safetensors
   into the work dir: the engine loads only directories), 64 requests x 64 new tokens, greedy, ignore_eos,
   decode tok/s with 64 distinct rank-16 adapters (one per request) vs none, cuda_graphs on and off, and the
   peak of torch.cuda.max_memory_allocated. All prompts prefill in one step, so every timed step decodes the
   whole batch; an engine is warmed up (LLMEngine.warm_up, then a short pass of each kind) before it is timed,
   and base and mixed passes alternate. Target: mixed / base >= 0.9.

--smoke runs every part on the CPU at toy sizes: the fp32 subset of the SGMV tests and one paged-attention test;
section 2 with the Triton kernels interpreted and "graphs on" through the engine's graph seam with EagerGraph;
section 3 at hidden 64; section 4 on tiny-random and a toy-shaped random model written like the 8B one. Its
throughput rows are INFO (no targets at toy sizes). The sanitizer is skipped.

A global deadline (--budget-s from the start) skips whatever has not started by then; a part still running is
killed at it. The table (markdown) is printed at the end; --json writes the same figures (also after each
section, so an interrupted run leaves what it had). Exit status 1 when a part failed or a row says FAILED.
A temp work dir is removed at the end, its logs/ kept when something failed; a --work-dir is kept, and a rerun
with it reuses the random model and adapters written there.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import json
import math
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
sys.path.insert(0, str(REPO))

# Parts, in the order they run; their rows are grouped into the four sections (the sanitizer's into section 1).
PARTS = ("host", "tests", "peft", "kernels", "smollm2", "llama8b", "sanitizer")
SECTION_TITLES = {
    "kernel_tests": "1 kernel tests",
    "engine_vs_peft": "2 engine vs PEFT",
    "kernel_throughput": "3 SGMV kernels",
    "engine_throughput": "4 engine throughput",
}
PART_SECTION = {
    "tests": "kernel_tests",
    "sanitizer": "kernel_tests",
    "peft": "engine_vs_peft",
    "kernels": "kernel_throughput",
    "smollm2": "engine_throughput",
    "llama8b": "engine_throughput",
}
# Wall-clock caps per part on a GPU host (each also ends at the global deadline): a hung part costs this much.
CAPS_S = {"host": 60, "tests": 150, "peft": 150, "kernels": 120, "smollm2": 200, "llama8b": 600}

LLAMA8B_SHAPE = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    max_position_embeddings=8192,
    rope_theta=500000.0,
)
SMOKE_LLAMA_SHAPE = dict(  # the same code path at toy size; its vocab is larger than the tokenizer's, as for 8B
    vocab_size=1000,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rope_theta=500000.0,
)
# The smoke run's engine takes the GPU's kernels too (interpreted on CPU tensors, loragate_kernels/triton/jit.py).
TRITON_ON_CPU = {"LORAGATE_LORA_BACKEND": "triton", "LORAGATE_ATTENTION_BACKEND": "triton"}


# ---- sizes per mode ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    device: str
    peft_new_tokens: int
    kernel_hidden: int
    kernel_outs: tuple[int, ...]
    kernel_rank: int
    kernel_tokens: tuple[int, ...]
    kernel_headline: int  # the T whose bmm/SGMV ratio has the target
    kernel_repeats: int
    engine_requests: int
    engine_new_tokens: int
    engine_prompt_len: int
    engine_rank: int
    engine_passes: int
    llama_shape: dict[str, Any] = field(default_factory=dict)


GPU = Sizes(
    device="cuda",
    peft_new_tokens=16,
    kernel_hidden=4096,
    kernel_outs=(4096, 1024, 1024),
    kernel_rank=16,
    kernel_tokens=(1, 16, 64, 256),
    kernel_headline=64,
    kernel_repeats=50,
    engine_requests=64,
    engine_new_tokens=64,
    engine_prompt_len=32,
    engine_rank=16,
    engine_passes=3,
    llama_shape=LLAMA8B_SHAPE,
)
SMOKE = Sizes(
    device="cpu",
    peft_new_tokens=5,
    kernel_hidden=64,
    kernel_outs=(64, 16, 16),
    kernel_rank=16,
    kernel_tokens=(1, 4),
    kernel_headline=4,
    kernel_repeats=3,
    engine_requests=4,
    engine_new_tokens=6,
    engine_prompt_len=8,
    engine_rank=8,
    engine_passes=1,
    llama_shape=SMOKE_LLAMA_SHAPE,
)


def sizes(smoke: bool) -> Sizes:
    return SMOKE if smoke else GPU


# ---- children: each part runs in `python bench/gpu_check.py --child PART`, recording figures as it goes ----


class Recorder:
    """The child's figures, rewritten to its JSON file after every change (a killed child leaves what it had)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class ChildContext:
    smoke: bool
    deadline: float  # time.time() at which the parent kills this child
    work: Path

    @property
    def sizes(self) -> Sizes:
        return sizes(self.smoke)

    def left(self) -> float:
        return self.deadline - time.time()


def error_text(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= 300 else text[:297] + "..."


def guarded(rec: Recorder, key: str, fn: Callable[[], Any]) -> Any:
    """rec[key] = fn(), or {"error": ...} (traceback to the log) when it raises: one measurement fails alone."""
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row, the rest still runs
        traceback.print_exc()
        value = {"error": error_text(exc)}
    rec.put(key, value)
    return value


def child_host(rec: Recorder, ctx: ChildContext) -> None:
    import torch

    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cpus": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info |= {
            "gpu": props.name,
            "gpu_memory_gib": round(props.total_memory / 2**30, 1),
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        info["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10
        ).stdout.strip()
    rec.put("host", info)


def engine_jobs_tokens(engine: Any, jobs: list[tuple[str | None, list[int]]], new_tokens: int) -> list[list[int]]:
    """Every job added at once and stepped to completion: each one's greedy tokens."""
    from engine.core.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    requests = [
        engine.add_request(f"j{i}", prompt, params, adapter_id=adapter) for i, (adapter, prompt) in enumerate(jobs)
    ]
    errors = []
    while engine.has_unfinished_requests():
        errors += [f"{o.request_id}: {o.error}" for o in engine.step() if o.finish_reason == "error"]
    if errors:
        raise RuntimeError(f"requests failed: {'; '.join(errors)[:200]}")
    return [list(r.output_token_ids) for r in requests]


def serve_warm_up(engine: Any) -> dict[str, Any]:
    """LLMEngine.warm_up, as serving runs it before it listens (AsyncEngine.load): whatever is prepared there
    (CUDA graphs among it, if that is where they are captured) is in place before anything is measured."""
    try:
        return {"warm_up_s": engine.warm_up()}
    except Exception as exc:  # noqa: BLE001 - recorded; the measurement still runs
        traceback.print_exc()
        return {"warm_up_error": error_text(exc)}


def graph_captures(engine: Any) -> int | None:
    """Graphs the engine's runner captured (engine/worker/cuda_graphs.py `DecodeGraphs.captures`), or None when it
    replays none: shows that "graphs on" really ran from graphs."""
    graphs = engine.runner.graphs
    return None if graphs is None else int(graphs.captures)


def free_memory() -> float:
    """Collect dropped engines (they hold reference cycles) and give their device memory back; returns the GiB still
    allocated on the GPU (0 without one)."""
    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated() / 2**30


def child_peft(rec: Recorder, ctx: ChildContext) -> None:
    """Section 2: engine greedy tokens (cuda_graphs on and off) against PEFT's for base + 3 adapters."""
    sys.path.insert(0, str(REPO / "tests"))
    fixtures = importlib.import_module("lora_fixtures")  # tests/lora_fixtures.py: PEFT itself makes the adapters
    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.model.sources import resolve_model

    s = ctx.sizes
    model_dir = resolve_model("tiny-random").path
    root = ctx.work / "peft-adapters"
    shutil.rmtree(root, ignore_errors=True)
    specs = fixtures.TINY_ADAPTER_SPECS
    adapters = {name: fixtures.make_peft_adapter(model_dir, root / name, b_std=0.2, **kw) for name, kw in specs.items()}
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 400) for _ in range(n)] for n in (7, 3, 20, 5)]
    names = sorted(adapters)
    jobs: list[tuple[str | None, list[int]]] = [(names[i] if i < 3 else None, p) for i, p in enumerate(prompts)]
    peft = [fixtures.peft_greedy(model_dir, None if a is None else adapters[a], p, s.peft_new_tokens) for a, p in jobs]
    # Each adapter job's base-model output too: the comparison only means something if the adapters change it.
    plain = [fixtures.peft_greedy(model_dir, None, p, s.peft_new_tokens) for _, p in jobs]
    rec.put(
        "reference",
        {
            "jobs": [{"adapter": a, "prompt_len": len(p)} for a, p in jobs],
            "new_tokens": s.peft_new_tokens,
            "peft_tokens": peft,
            "base_tokens": plain,
            "adapters_change_output": all(e != b for (a, _), e, b in zip(jobs, peft, plain, strict=True) if a),
        },
    )
    for graphs in (True, False):

        def run(graphs: bool = graphs) -> dict[str, Any]:
            config = EngineConfig(
                dtype="float32",
                model="tiny-random",
                adapter_dir=str(root),
                max_model_len=256,
                device=s.device,
                cuda_graphs=graphs,
            )
            engine = LLMEngine(config)
            if graphs and engine.runner.graphs is None and s.device == "cpu":
                # No CUDA: graphs through the engine's seam with EagerGraph (capture runs the step, replay runs it
                # again): the static inputs, padding rows and buckets a GPU's graphs use, on the CPU.
                from engine.worker.cuda_graphs import EagerGraph

                engine.enable_graphs(EagerGraph)
            backend = engine.backends.lora.value
            kind = None if engine.runner.graphs is None else "CUDA graphs" if s.device != "cpu" else "EagerGraph"
            # Interpreted (smoke), the warm-up's 30-odd requests take longer than all the rest: section 4 runs it.
            warm = {} if ctx.smoke else serve_warm_up(engine)
            tokens = engine_jobs_tokens(engine, jobs, s.peft_new_tokens)
            captures = graph_captures(engine)
            del engine
            free_memory()
            mismatch = None
            for i, (got, want) in enumerate(zip(tokens, peft, strict=True)):
                if got != want:
                    pos = next((k for k, (g, w) in enumerate(zip(got, want, strict=False)) if g != w), len(got))
                    mismatch = {"job": i, "adapter": jobs[i][0], "position": pos, "engine": got, "peft": want}
                    break
            return {
                "equal": mismatch is None,
                "first_mismatch": mismatch,
                "lora_backend": backend,
                "tokens": tokens,
                "graph_captures": captures,
                "graph_kind": kind,
                **warm,
            }

        guarded(rec, f"graphs_{'on' if graphs else 'off'}", run)


def child_kernels(rec: Recorder, ctx: ChildContext) -> None:
    """Section 3: Triton SGMV vs the torch twin vs gather-bmm, a q/k/v group, every row its own adapter."""
    import torch

    from bench.lora_kernels import kernel_timer, make_case, sgmv_gather_bmm
    from loragate_kernels.reference import lora_sgmv, lora_sgmv_group
    from loragate_kernels.triton.sgmv import GroupTables, column_tiles, lora_sgmv_group_triton, plan_segments

    s = ctx.sizes
    dev = torch.device(s.device)
    dtype = torch.bfloat16
    timed = kernel_timer(dev, s.kernel_repeats)
    d_in, outs, r = s.kernel_hidden, list(s.kernel_outs), s.kernel_rank
    cols = [0]
    for out in outs:
        cols.append(cols[-1] + out)
    big_r = r * len(outs)
    rec.put(
        "config",
        {"hidden": d_in, "outs": outs, "rank": r, "dtype": "bfloat16", "device": str(dev), "repeats": s.kernel_repeats},
    )

    def group_case(t: int) -> dict[str, Any]:
        # bench/lora_kernels.py `make_case` with rank 3r and out width sum(outs) / 3 lays out, per slot, the stacked
        # A [3r, d_in] the group's one shrink reads, then a B region of sum(outs) * r elements: module m's B
        # (stored transposed, [r, out_m]) sits at cols[m] * r in it. x, the pool and its unaligned offsets are all
        # make_case's.
        assert (cols[-1] * r) % big_r == 0
        _, x, starts, slots, pool, a_off, b_region, _ = make_case(
            d_in, cols[-1] * r // big_r, [big_r] * t, [1] * t, dtype
        )
        x, pool = x.to(dev), pool.to(dev)
        b_off = [[b + cols[m] * r for b in b_region] for m in range(len(outs))]
        ranks = [[r] * t for _ in outs]
        tables = GroupTables(
            torch.tensor(a_off, dtype=torch.int64, device=dev),
            torch.tensor(ranks, dtype=torch.int32, device=dev),
            torch.tensor(b_off, dtype=torch.int64, device=dev),
            torch.tensor([[m * r] * t for m in range(len(outs))], dtype=torch.int32, device=dev),
            torch.tensor([big_r] * t, dtype=torch.int32, device=dev),
        )
        plan = plan_segments(starts, slots, dev)
        out_cols = torch.tensor(cols, dtype=torch.int32, device=dev)
        tiles = column_tiles(cols, dev)
        ys = {k: torch.zeros(t, cols[-1], dtype=dtype, device=dev) for k in ("triton", "torch", "bmm")}
        # Module m alone: its A is rows [m r, (m + 1) r) of the stacked A; gather-bmm runs once per module.
        per_module = [
            (ys["bmm"][:, cols[m] : cols[m + 1]], [a + m * r * d_in for a in a_off], b_off[m]) for m in range(len(outs))
        ]

        def gather_bmm() -> None:
            for y_m, a_m, b_m in per_module:
                sgmv_gather_bmm(y_m, x, starts, slots, pool, a_m, b_m, [r] * t)

        calls: dict[str, Callable[[], None]] = {
            "triton": lambda: lora_sgmv_group_triton(ys["triton"], x, plan, pool, tables, out_cols, tiles, big_r),
            "torch": lambda: lora_sgmv_group(ys["torch"], x, starts, slots, pool, a_off, ranks, b_off, cols),
            "bmm": gather_bmm,
        }
        for call in calls.values():  # y starts at zero: each way must give the same deltas
            call()
        ref = ys["torch"].float()
        scale = max(ref.abs().max().item(), 1e-6)
        diffs = {k: (ys[k].float() - ref).abs().max().item() / scale for k in ("triton", "bmm")}
        if max(diffs.values()) > 3e-2:
            raise AssertionError(f"deltas differ from the torch twin: relative max |diff| {diffs}")
        us = {k: timed(call) for k, call in calls.items()}
        if dev.type == "cuda":
            torch.cuda.synchronize()
        return {
            "tokens": t,
            "adapters": t,
            "triton_us": us["triton"],
            "torch_us": us["torch"],
            "bmm_us": us["bmm"],
            "bmm_over_triton": us["bmm"] / us["triton"],
            "max_rel_diff": max(diffs.values()),
        }

    def single_case(t: int) -> dict[str, Any]:
        """One module d_in x d_in (bench/lora_kernels.py's GPU table): the same kernels without the grouping."""
        y, x, starts, slots, pool, a_off, b_off, ranks = make_case(d_in, d_in, [r] * t, [1] * t, dtype)
        y, x, pool = y.to(dev), x.to(dev), pool.to(dev)
        tables = GroupTables(
            torch.tensor(a_off, dtype=torch.int64, device=dev),
            torch.tensor([ranks], dtype=torch.int32, device=dev),
            torch.tensor([b_off], dtype=torch.int64, device=dev),
            torch.zeros(1, t, dtype=torch.int32, device=dev),
            torch.tensor(ranks, dtype=torch.int32, device=dev),
        )
        plan = plan_segments(starts, slots, dev)
        out_cols = torch.tensor([0, d_in], dtype=torch.int32, device=dev)
        tiles = column_tiles([0, d_in], dev)
        us = {
            "triton": timed(lambda: lora_sgmv_group_triton(y, x, plan, pool, tables, out_cols, tiles, r)),
            "torch": timed(lambda: lora_sgmv(y, x, starts, slots, pool, a_off, b_off, ranks)),
            "bmm": timed(lambda: sgmv_gather_bmm(y, x, starts, slots, pool, a_off, b_off, ranks)),
        }
        return {
            "tokens": t,
            "triton_us": us["triton"],
            "torch_us": us["torch"],
            "bmm_us": us["bmm"],
            "bmm_over_triton": us["bmm"] / us["triton"],
        }

    for t in s.kernel_tokens:
        guarded(rec, f"group_T{t}", partial(group_case, t))
    guarded(rec, f"single_T{s.kernel_headline}", lambda: single_case(s.kernel_headline))


# ---- section 4: random-weight models and adapters, decode throughput ------------------------------------------


def write_random_model(out: Path, shape: dict[str, Any], device: str, shard_gb: float = 4.0) -> Path:
    """An HF Llama directory with random bf16 weights of `shape` (config.json, *.safetensors shards) and the tiny
    random model's tokenizer (the engine only needs one to detokenize; ids past it decode to nothing). Weights
    are N(0, 0.02^2), norms 1: finite logits in bf16. Reused when a complete copy of the same shape is there."""
    import torch
    from safetensors.torch import save_file

    from engine.model.sources import resolve_model

    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "bfloat16",
        **shape,
    }
    marker = out / ".complete"
    if marker.is_file() and json.loads((out / "config.json").read_text()) == config:
        return out
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    tokenizer_dir = resolve_model("tiny-random").path
    for f in tokenizer_dir.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    c = config
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    hidden, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    shapes += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    gen = torch.Generator(device=device).manual_seed(0)
    shard: dict[str, torch.Tensor] = {}
    nbytes, index = 0, 0

    def flush() -> None:
        nonlocal shard, nbytes, index
        if shard:
            index += 1
            save_file(shard, str(out / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
        shard, nbytes = {}, 0

    for name, dims in shapes:
        if len(dims) == 1:
            tensor = torch.ones(dims, dtype=torch.bfloat16)
        else:
            tensor = torch.empty(dims, dtype=torch.bfloat16, device=device).normal_(0.0, 0.02, generator=gen).cpu()
        shard[name] = tensor
        nbytes += tensor.numel() * 2
        if nbytes >= shard_gb * 2**30:
            flush()
    flush()
    (out / "config.json").write_text(json.dumps(config, indent=1))
    marker.touch()
    return out


def write_random_adapters(model_dir: Path, root: Path, count: int, rank: int, device: str) -> list[str]:
    """`count` PEFT-format LoRA dirs (adapter_config.json + adapter_model.safetensors, bf16, PEFT's key names) of
    rank `rank` on q/k/v/o/gate/up/down of every layer, each with its own random weights; their ids, sorted.
    Reused when a complete set of the same count and rank for the same model is there (a rerun's --work-dir)."""
    import torch
    from safetensors.torch import save_file

    from engine.lora.peft_config import MODULES, module_features, module_name
    from engine.model.config import load_model_config

    mc = load_model_config(model_dir)
    ids = [f"rand-{k:03d}" for k in range(count)]
    stamp = json.dumps({"count": count, "rank": rank, "model": (model_dir / "config.json").read_text()})
    marker = root / ".complete"
    if marker.is_file() and marker.read_text() == stamp:
        return ids
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    gen = torch.Generator(device=device).manual_seed(1)
    for adapter_id in ids:
        out = root / adapter_id
        out.mkdir()
        tensors = {}
        for layer in range(mc.num_layers):
            for module in MODULES:
                d_in, d_out = module_features(mc, module)
                key = f"base_model.model.{module_name(layer, module)}"
                a = torch.empty(rank, d_in, device=device).normal_(0.0, d_in**-0.5, generator=gen)
                b = torch.empty(d_out, rank, device=device).normal_(0.0, 0.02, generator=gen)
                tensors[f"{key}.lora_A.weight"] = a.to(torch.bfloat16).cpu()
                tensors[f"{key}.lora_B.weight"] = b.to(torch.bfloat16).cpu()
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        config = {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": list(MODULES),
            "base_model_name_or_path": str(model_dir),
        }
        (out / "adapter_config.json").write_text(json.dumps(config, indent=1))
    marker.write_text(stamp)
    return ids


def adapter_bytes(model_dir: Path, rank: int) -> int:
    """Bytes of one rank-`rank` adapter on every module and layer, in bf16 (what the device tier holds)."""
    from engine.lora.peft_config import MODULES, module_features
    from engine.model.config import load_model_config

    mc = load_model_config(model_dir)
    return 2 * rank * mc.num_layers * sum(sum(module_features(mc, m)) for m in MODULES)


def kv_bytes_per_token(model_dir: Path) -> int:
    from engine.model.config import load_model_config

    mc = load_model_config(model_dir)
    return 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 2  # K and V, bf16


@dataclass
class DecodePass:
    decode_tok_s: float
    e2e_tok_s: float
    decode_steps: int
    prefill_steps: int


def decode_pass(
    engine: Any, tag: str, prompts: list[list[int]], adapters: list[str | None], new_tokens: int
) -> DecodePass:
    """All requests at once; decode tok/s counts only the steps after every request has its first token (so
    every timed step decodes the whole batch), e2e tok/s the whole pass."""
    from engine.core.request import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, min_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    requests = [
        engine.add_request(f"{tag}-{i}", p, params, adapter_id=a)
        for i, (p, a) in enumerate(zip(prompts, adapters, strict=True))
    ]
    errors: list[str] = []

    def step() -> None:
        errors.extend(f"{o.request_id}: {o.error}" for o in engine.step() if o.finish_reason == "error")
        if errors:
            raise RuntimeError(f"requests failed: {'; '.join(errors)[:200]}")

    prefill_steps = decode_steps = 0
    while engine.has_unfinished_requests() and any(not r.output_token_ids for r in requests):
        step()
        prefill_steps += 1
    t0, first = time.perf_counter(), sum(len(r.output_token_ids) for r in requests)
    while engine.has_unfinished_requests():
        step()
        decode_steps += 1
    end = time.perf_counter()
    total = sum(len(r.output_token_ids) for r in requests)
    if total != len(requests) * new_tokens:
        raise RuntimeError(f"{total} tokens generated, expected {len(requests) * new_tokens}")
    return DecodePass((total - first) / max(end - t0, 1e-9), total / (end - start), decode_steps, prefill_steps)


def peak_gib(device: str) -> tuple[float, str]:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30, "torch.cuda.max_memory_allocated"
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "process max RSS (CPU run)"


def engine_throughput(model_spec: str, adapter_root: Path, ids: list[str], graphs: bool, ctx: ChildContext) -> dict:
    """One engine (cuda_graphs on or off): warm-up, then `passes` timed passes of base and of mixed LoRA."""
    import torch

    from engine.config import EngineConfig
    from engine.core.llm_engine import LLMEngine
    from engine.model.sources import resolve_model

    s = ctx.sizes
    model_dir = resolve_model(model_spec).path
    n, new, plen = s.engine_requests, s.engine_new_tokens, s.engine_prompt_len
    tokens = n * (plen + new)
    pool = len(ids) * adapter_bytes(model_dir, s.engine_rank) * 1.3 + 2 * tokens * kv_bytes_per_token(model_dir)
    config = EngineConfig(
        model=model_spec,
        device=s.device,
        dtype="bfloat16",
        adapter_dir=str(adapter_root),
        max_device_adapters=len(ids),
        host_adapter_mb=int(len(ids) * adapter_bytes(model_dir, s.engine_rank) * 2.5 / 2**20) + 64,
        pool_mb=int(pool / 2**20) + 64,
        max_num_seqs=n,
        max_batch_tokens=n * plen,  # every prompt prefilled in one step: all requests then decode in lockstep
        max_prefill_tokens=None,
        max_model_len=min(2 * (plen + new) + 16, 4096),
        enable_prefix_cache=False,
        cuda_graphs=graphs,
    )
    baseline = free_memory()  # what an earlier engine of this process left allocated (0 when all was freed)
    if s.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t0
    vocab = min(engine.vocab_size, len(engine.tokenizer))
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(3, vocab) for _ in range(plen)] for _ in range(n)]

    mixed = [ids[i % len(ids)] for i in range(n)]
    base: list[str | None] = [None] * n
    t0 = time.perf_counter()
    warm = serve_warm_up(engine)
    for tag, adapters in (("warm-base", base), ("warm-mixed", mixed)):  # adapters load, graphs are captured
        decode_pass(engine, tag, prompts(), list(adapters), min(new, 4))
    warm_s = time.perf_counter() - t0
    runs: dict[str, list[DecodePass]] = {"base": [], "mixed": []}
    for k in range(s.engine_passes):
        for name, adapters in (("base", base), ("mixed", mixed)):  # interleaved: drift hits both alike
            runs[name].append(decode_pass(engine, f"{name}-{k}", prompts(), list(adapters), new))
    peak, peak_kind = peak_gib(s.device)
    backend = engine.backends.lora.value
    resident = len(engine.device_adapters.current_ids())
    captures = graph_captures(engine)
    del engine
    free_memory()
    result: dict[str, Any] = {
        "cuda_graphs": graphs,
        "lora_backend": backend,
        "load_s": load_s,
        "warmup_s": warm_s,
        **warm,
        "resident_adapters": resident,
        "graph_captures": captures,
        "pool_mb": config.pool_mb,
        "peak_gib": peak,
        "baseline_gib": baseline,
        "peak_kind": peak_kind,
    }
    for name, passes in runs.items():
        result[f"{name}_tok_s"] = statistics.median(p.decode_tok_s for p in passes)
        result[f"{name}_e2e_tok_s"] = statistics.median(p.e2e_tok_s for p in passes)
        result[f"{name}_decode_steps"] = passes[0].decode_steps
        result[f"{name}_passes_tok_s"] = [p.decode_tok_s for p in passes]
    result["mixed_over_base"] = result["mixed_tok_s"] / result["base_tok_s"]
    return result


def child_engine(which: str, rec: Recorder, ctx: ChildContext) -> None:
    """Section 4 for one model: adapters (and for llama8b the model) written to the work dir, then graphs on/off."""
    from engine.model.sources import resolve_model

    s = ctx.sizes
    t0 = time.perf_counter()
    if which == "smollm2":
        spec = "tiny-random" if ctx.smoke else "smollm2"
        model_dir = resolve_model(spec).path
    else:
        model_dir = write_random_model(ctx.work / "llama8b-random", s.llama_shape, s.device)
        spec = str(model_dir)
    model_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    n_adapters = s.engine_requests
    ids = write_random_adapters(model_dir, ctx.work / f"adapters-{which}", n_adapters, s.engine_rank, s.device)
    rec.put(
        "setup",
        {
            "model": spec if which == "smollm2" else "random Llama-8B shape",
            "shape": s.llama_shape if which == "llama8b" else None,
            "model_s": model_s,
            "adapters": n_adapters,
            "rank": s.engine_rank,
            "adapters_s": time.perf_counter() - t0,
            "requests": s.engine_requests,
            "new_tokens": s.engine_new_tokens,
            "prompt_len": s.engine_prompt_len,
            "passes": s.engine_passes,
        },
    )
    first_s = None
    for graphs in (True, False):
        key = f"graphs_{'on' if graphs else 'off'}"
        if first_s is not None and ctx.left() < first_s:
            rec.put(key, {"skipped": f"budget: the first run took {first_s:.0f} s, {ctx.left():.0f} s left"})
            continue
        t0 = time.perf_counter()
        guarded(rec, key, partial(engine_throughput, spec, ctx.work / f"adapters-{which}", ids, graphs, ctx))
        first_s = first_s or time.perf_counter() - t0


def run_child(part: str, out: Path, ctx: ChildContext) -> int:
    rec = Recorder(out)
    rec.put("started", time.time())
    try:
        if part == "host":
            child_host(rec, ctx)
        elif part == "peft":
            child_peft(rec, ctx)
        elif part == "kernels":
            child_kernels(rec, ctx)
        elif part in ("smollm2", "llama8b"):
            child_engine(part, rec, ctx)
        else:
            raise ValueError(f"unknown part {part!r}")
    except Exception as exc:  # noqa: BLE001 - reported in the part's row
        traceback.print_exc()
        rec.put("error", error_text(exc))
        return 1
    rec.put("done", True)
    return 0


# ---- the parent: runs the parts, each with a timeout inside the global deadline, and prints the table -------


@dataclass
class PartResult:
    status: str  # ok | failed | timeout | skipped
    reason: str | None = None
    elapsed_s: float = 0.0
    figures: dict[str, Any] = field(default_factory=dict)


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """End the process group this script started for `proc` (its session: the child and what it spawned)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=30)


def run_process(cmd: list[str], timeout: float, log: Path, env: dict[str, str]) -> tuple[int | None, float]:
    """(exit code or None on timeout, seconds): output to `log`, killed with its whole group at `timeout`."""
    start = time.monotonic()
    with open(log, "wb") as f:
        f.write(f"$ {' '.join(cmd)}\n".encode())
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc: int | None = proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            kill_group(proc)
            rc = None
        except BaseException:
            kill_group(proc)
            raise
    return rc, time.monotonic() - start


def last_line(log: Path) -> str:
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else "(no output)"


class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smoke: bool = args.smoke
        self.start = time.monotonic()
        self.deadline = self.start + args.budget_s
        self.made_work = args.work_dir is None
        self.work = Path(args.work_dir or tempfile.mkdtemp(prefix="loragate-gpu-check-")).resolve()
        self.logs = self.work / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.skip = {p.strip() for p in args.skip.split(",") if p.strip()}
        self.results: dict[str, PartResult] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(extra)
        return env

    def cap(self, part: str) -> float:
        return min(CAPS_S.get(part, 600), self.left())

    def progress(self, part: str, result: PartResult) -> None:
        t = time.monotonic() - self.start
        reason = f": {result.reason}" if result.reason else ""
        print(f"[{t:6.1f} s] {part:<9} {result.status} ({result.elapsed_s:.1f} s){reason}", flush=True)

    def skipped(self, part: str) -> PartResult | None:
        if part in self.skip:
            return PartResult("skipped", "--skip")
        if self.left() < 1:
            return PartResult("skipped", f"budget: --budget-s {self.args.budget_s:g} used up")
        return None

    def child(self, part: str, **env: str) -> PartResult:
        early = self.skipped(part)
        if early is not None:
            return early
        out, log = self.logs / f"{part}.json", self.logs / f"{part}.log"
        out.unlink(missing_ok=True)  # a reused --work-dir: never read an earlier run's figures
        timeout = self.cap(part)
        cmd = [sys.executable, str(SCRIPT), "--child", part, "--out", str(out), "--work-dir", str(self.work)]
        cmd += ["--deadline", f"{time.time() + timeout:.3f}"] + (["--smoke"] if self.smoke else [])
        rc, elapsed = run_process(cmd, timeout, log, self.env(**env))
        figures: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            figures = json.loads(out.read_text())
        figures.pop("started", None)
        error = figures.pop("error", None)
        done = figures.pop("done", False)
        if rc is None:
            return PartResult("timeout", f"killed after {elapsed:.0f} s (cap or budget)", elapsed, figures)
        if rc != 0 or not done:
            why = error or f"exit code {rc}: {last_line(log)}"
            return PartResult("failed", why, elapsed, figures)
        return PartResult("ok", None, elapsed, figures)

    def pytest_part(self, part: str) -> PartResult:
        """Section 1: the kernel tests natively (part "tests"), or under compute-sanitizer memcheck ("sanitizer")."""
        if part == "sanitizer" and self.smoke:
            return PartResult("skipped", "smoke run (no GPU)")
        early = self.skipped(part)
        if early is not None:
            return early
        target = ["tests/kernels"]
        if self.smoke:  # a few of each kernel's tests, interpreted
            target = [
                "tests/kernels/test_sgmv_triton.py",
                "-k",
                "fp32",
                "tests/kernels/test_paged_attention.py::test_matches_the_oracle_and_the_engine[fp32-gqa2-8]",
            ]
        pytest = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *target]
        env = self.env()
        if part == "sanitizer":
            tool = shutil.which("compute-sanitizer") or next(
                (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.access(p, os.X_OK)), None
            )
            if tool is None:
                return PartResult("skipped", "compute-sanitizer not on PATH")
            cmd = [tool, "--tool", "memcheck", *pytest, "-x"]
            env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"  # memcheck sees each allocation's own bounds
            timeout = min(self.args.sanitizer_timeout_s, self.left())
            if timeout < 20:
                return PartResult("skipped", f"budget: {self.left():.0f} s left")
        else:
            cmd, timeout = pytest, self.cap(part)
        log = self.logs / f"{part}.log"
        rc, elapsed = run_process(cmd, timeout, log, env)
        text = log.read_text(errors="replace")
        figures: dict[str, Any] = {"command": " ".join(cmd[cmd.index("-m") - 1 :] if part == "tests" else cmd)}
        counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0, "deselected": 0}
        summary = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b", ln)]
        if summary:
            for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected)", summary[-1]):
                counts[what.rstrip("s") if what.startswith("error") else what] += int(n)
        figures |= counts
        figures["rc"] = rc
        if part == "sanitizer":
            found = re.findall(r"ERROR SUMMARY: (\d+) errors?", text)
            figures["sanitizer_errors"] = int(found[-1]) if found else None
            figures["sanitizer_summary"] = f"ERROR SUMMARY: {found[-1]} errors" if found else None
        if rc is None:
            return PartResult("timeout", f"killed after {elapsed:.0f} s", elapsed, figures)
        if rc != 0 and counts["failed"] + counts["error"] == 0 and not figures.get("sanitizer_errors"):
            return PartResult("failed", f"exit code {rc}: {last_line(log)}", elapsed, figures)
        return PartResult("ok", None, elapsed, figures)

    def run(self) -> dict[str, Any]:
        order: list[tuple[str, Callable[[], PartResult]]] = [
            ("host", lambda: self.child("host")),
            ("tests", lambda: self.pytest_part("tests")),
            # In the smoke run the engine takes the Triton path too (interpreted on CPU tensors): the code a GPU runs.
            ("peft", lambda: self.child("peft", **(TRITON_ON_CPU if self.smoke else {}))),
            ("kernels", lambda: self.child("kernels")),
            ("smollm2", lambda: self.child("smollm2")),
            ("llama8b", lambda: self.child("llama8b")),
            ("sanitizer", lambda: self.pytest_part("sanitizer")),
        ]
        record: dict[str, Any] = {}
        for part, fn in order:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001 - the runner's own bug in one part must not end the run
                result = PartResult("failed", f"gpu_check: {error_text(exc)}")
            self.results[part] = result
            self.progress(part, result)
            record = self.record()
            if self.args.json:
                write_json(Path(self.args.json), record)
        return record

    def record(self) -> dict[str, Any]:
        host = self.results.get("host")
        sections: dict[str, Any] = {}
        for name in SECTION_TITLES:
            parts = {p: r for p, r in self.results.items() if PART_SECTION.get(p) == name}
            # ok | partial (some part skipped) | skipped | failed (a part failed or timed out) | pending
            statuses = {r.status for p, r in parts.items() if p != "sanitizer" or r.status != "skipped"}
            if not parts:
                status = "pending"
            elif statuses & {"failed", "timeout"}:
                status = "failed"
            elif statuses <= {"skipped"}:
                status = "skipped" if statuses else "ok"
            else:
                status = "partial" if "skipped" in statuses else "ok"
            sections[name] = {
                "status": status,
                "parts": {
                    p: {
                        "status": r.status,
                        "reason": r.reason,
                        "elapsed_s": round(r.elapsed_s, 2),
                        "figures": r.figures,
                    }
                    for p, r in parts.items()
                },
            }
        record: dict[str, Any] = {
            "smoke": self.smoke,
            "budget_s": self.args.budget_s,
            "elapsed_s": round(time.monotonic() - self.start, 1),
            "host": host.figures.get("host", {}) if host else {},
            "sections": sections,
        }
        record["table"] = table_rows(record)
        return record

    def cleanup(self, record: dict[str, Any]) -> str | None:
        """Remove the big files (the random 8B model, adapters); the whole work dir if it was ours and all went
        well. Returns the directory left behind, if any."""
        failed = has_failures(record)
        if self.args.keep_work_dir or not self.made_work:
            return str(self.work)
        if not failed:
            shutil.rmtree(self.work, ignore_errors=True)
            return None
        for p in self.work.iterdir():
            if p != self.logs:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        return str(self.work)


def has_failures(record: dict[str, Any]) -> bool:
    """A part failed or timed out, or a row says FAILED (e.g. tokens not equal to PEFT's)."""
    return any(sec["status"] == "failed" for sec in record["sections"].values()) or any(
        r["verdict"] == "FAILED" for r in record["table"]
    )


def write_json(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(record, indent=1, default=str) + "\n")
    os.replace(tmp, path)


# ---- the table ---------------------------------------------------------------------------------------------


def fmt(x: float | None, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:,.{digits}f}"


def table_rows(record: dict[str, Any]) -> list[dict[str, str]]:
    """One dict per table row: section, item, result, target, verdict (PASS, MISS, FAILED, SKIPPED, INFO)."""
    smoke = record["smoke"]
    rows: list[dict[str, str]] = []

    def row(section: str, item: str, result: str, target: str = "", verdict: str = "INFO") -> None:
        rows.append(
            {"section": SECTION_TITLES[section], "item": item, "result": result, "target": target, "verdict": verdict}
        )

    def perf(ok: bool) -> str:
        return "INFO" if smoke else "PASS" if ok else "MISS"

    def bad(section: str, item: str, part: dict[str, Any] | None) -> bool:
        """A row for a part that did not run or failed; True when nothing else is to be shown for it."""
        if part is None:
            row(section, item, "not run", verdict="SKIPPED")
            return True
        if part["status"] == "skipped":
            row(section, item, f"SKIPPED: {part['reason']}", verdict="SKIPPED")
            return True
        if part["status"] in ("failed", "timeout"):
            row(section, item, f"FAILED: {part['reason']}", verdict="FAILED")
        return False

    def sub_failed(section: str, item: str, fig: Any) -> bool:
        if fig is None:
            row(section, item, "FAILED: not reached (part ended before it)", verdict="FAILED")
            return True
        if "error" in fig:
            row(section, item, f"FAILED: {fig['error']}", verdict="FAILED")
            return True
        if "skipped" in fig:
            row(section, item, f"SKIPPED: {fig['skipped']}", verdict="SKIPPED")
            return True
        return False

    secs = record["sections"]
    # 1
    parts = secs["kernel_tests"]["parts"]
    tests = parts.get("tests")
    if not bad("kernel_tests", "pytest tests/kernels", tests) and tests is not None and tests["status"] == "ok":
        f = tests["figures"]
        ok = f["failed"] == 0 and f["error"] == 0 and f["passed"] > 0 and f["rc"] == 0
        result = f"{f['passed']} passed, {f['failed']} failed, {f['error']} errors ({tests['elapsed_s']:.0f} s)"
        row(
            "kernel_tests",
            f"pytest {'fp32 subset' if smoke else 'tests/kernels'}",
            result,
            "all pass",
            "PASS" if ok else "FAILED",
        )
    san = parts.get("sanitizer")
    if not bad("kernel_tests", "compute-sanitizer memcheck", san) and san is not None:
        f = san["figures"]
        errors = f.get("sanitizer_errors")
        done = san["status"] == "ok" and errors is not None
        result = f"{errors} memcheck errors; {f['passed']} passed, {f['failed']} failed ({san['elapsed_s']:.0f} s)"
        row(
            "kernel_tests",
            "compute-sanitizer memcheck",
            result if done else f"{san['status']}: {san['reason']}; {result}",
            "0 errors",
            "PASS" if done and errors == 0 and f["failed"] == 0 else "FAILED",
        )
    # 2
    peft = secs["engine_vs_peft"]["parts"].get("peft")
    if not bad("engine_vs_peft", "greedy tokens", peft) and peft is not None:
        f = peft["figures"]
        ref = f.get("reference")
        if not sub_failed("engine_vs_peft", "PEFT reference", ref):
            assert ref is not None
            if not ref["adapters_change_output"]:
                row("engine_vs_peft", "PEFT reference", "an adapter leaves PEFT's output unchanged", "", "FAILED")
            what = f"tiny-random fp32 on {'cpu' if smoke else 'cuda'}, base + 3 adapters, {ref['new_tokens']} tokens"
            for mode in ("on", "off"):
                fig = f.get(f"graphs_{mode}")
                item = f"cuda_graphs {mode}"
                if sub_failed("engine_vs_peft", item, fig):
                    continue
                if fig["equal"]:
                    result = f"equal to PEFT ({what}; {fig['lora_backend']} LoRA{engine_notes(fig)})"
                else:
                    m = fig["first_mismatch"]
                    result = (
                        f"NOT equal: job {m['job']} ({m['adapter'] or 'base'}) at token {m['position']}: "
                        f"engine {m['engine']} vs PEFT {m['peft']}"
                    )
                row("engine_vs_peft", item, result, "equal", "PASS" if fig["equal"] else "FAILED")
    # 3
    kern = secs["kernel_throughput"]["parts"].get("kernels")
    if not bad("kernel_throughput", "SGMV vs torch vs gather-bmm", kern) and kern is not None:
        f = kern["figures"]
        cfg = f.get("config", {})
        headline = SMOKE.kernel_headline if smoke else GPU.kernel_headline
        for key in sorted((k for k in f if k.startswith("group_T")), key=lambda k: int(k[7:])):
            t = int(key[7:])
            item = f"qkv group {cfg.get('hidden')}->{'/'.join(map(str, cfg.get('outs', [])))}, T={t} adapters"
            fig = f[key]
            if sub_failed("kernel_throughput", item, fig):
                continue
            ratio = fig["bmm_over_triton"]
            result = (
                f"SGMV {fmt(fig['triton_us'])} µs, torch {fmt(fig['torch_us'])} µs, "
                f"gather-bmm {fmt(fig['bmm_us'])} µs; bmm/SGMV {ratio:.3g}x"
            )
            head = t == headline
            row(
                "kernel_throughput", item, result, "bmm/SGMV >= 2" if head else "", perf(ratio >= 2) if head else "INFO"
            )
        for key in (k for k in f if k.startswith("single_T")):
            fig = f[key]
            item = f"one module {cfg.get('hidden')}x{cfg.get('hidden')}, T={key[8:]} adapters"
            if not sub_failed("kernel_throughput", item, fig):
                result = (
                    f"SGMV {fmt(fig['triton_us'])} µs, torch {fmt(fig['torch_us'])} µs, "
                    f"gather-bmm {fmt(fig['bmm_us'])} µs; bmm/SGMV {fig['bmm_over_triton']:.3g}x"
                )
                row("kernel_throughput", item, result)
    # 4
    for part in ("smollm2", "llama8b"):
        p = secs["engine_throughput"]["parts"].get(part)
        label = {"smollm2": "SmolLM2-135M", "llama8b": "Llama-8B shape (random)"}[part]
        if smoke:
            label += " (smoke: tiny-random)" if part == "smollm2" else " (smoke: toy shape)"
        if bad("engine_throughput", label, p) or p is None:
            continue
        f = p["figures"]
        setup = f.get("setup")
        if sub_failed("engine_throughput", f"{label} setup", setup):
            continue
        assert setup is not None
        load = f"{setup['requests']} req x {setup['new_tokens']} tok, {setup['adapters']} adapters r{setup['rank']}"
        for mode in ("on", "off"):
            fig = f.get(f"graphs_{mode}")
            item = f"{label}, graphs {mode}"
            if sub_failed("engine_throughput", item, fig):
                continue
            ratio = fig["mixed_over_base"]
            peak = "peak" if fig["peak_kind"].startswith("torch.cuda") else "peak RSS"
            if fig["resident_adapters"] < setup["adapters"]:
                load += f"; only {fig['resident_adapters']} adapters resident"
            if fig["mixed_decode_steps"] != setup["new_tokens"] - 1:
                load += f"; NOT in lockstep: {fig['mixed_decode_steps']} mixed decode steps"
            if fig.get("baseline_gib", 0) > 0.05:
                load += f"; {fig['baseline_gib']:.2f} GiB of it left by the engine before"
            result = (
                f"base {fmt(fig['base_tok_s'], 0)} tok/s, mixed {fmt(fig['mixed_tok_s'], 0)} tok/s, "
                f"mixed/base {ratio:.2f}; {peak} {fmt(fig['peak_gib'], 2)} GiB ({load}{engine_notes(fig)})"
            )
            row("engine_throughput", item, result, "mixed/base >= 0.9", perf(ratio >= 0.9))
        on, off = f.get("graphs_on") or {}, f.get("graphs_off") or {}
        if "base_tok_s" in on and "base_tok_s" in off:
            result = (
                f"base {on['base_tok_s'] / off['base_tok_s']:.2f}x, mixed {on['mixed_tok_s'] / off['mixed_tok_s']:.2f}x"
            )
            row("engine_throughput", f"{label}, graphs on / off", result)
    return rows


def engine_notes(fig: dict[str, Any]) -> str:
    """What a row adds about the engine run: graphs captured (when the runner counts them), a failed warm-up."""
    notes = ""
    if fig.get("graph_captures") is not None:
        notes += f"; {fig['graph_captures']} {fig.get('graph_kind') or 'CUDA graphs'} captured"
    if fig.get("warm_up_error"):
        notes += f"; warm_up FAILED: {fig['warm_up_error']}"
    return notes


def markdown(record: dict[str, Any]) -> str:
    host = record.get("host") or {}
    where = host.get("gpu") or f"CPU only ({host.get('cpus', '?')} cores)"
    head = (
        f"loragate GPU check{' (SMOKE: toy sizes on CPU)' if record['smoke'] else ''}: {where}, torch "
        f"{host.get('torch', '?')}, triton {host.get('triton', '?')}, commit {host.get('commit', '?')}; "
        f"{record['elapsed_s']:.0f} s of a {record['budget_s']:g} s budget"
    )
    cols = ["section", "item", "result", "target", "verdict"]
    lines = [head, "", "| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    for r in record["table"]:
        lines.append("| " + " | ".join(r[c].replace("|", "/") for c in cols) + " |")
    return "\n".join(lines)


# ---- entry point -------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", help="write every figure to this JSON file (also after each section)")
    parser.add_argument("--budget-s", type=float, default=450.0, help="global deadline from the start (s)")
    parser.add_argument("--smoke", action="store_true", help="toy sizes on the CPU: the code paths, no GPU")
    parser.add_argument("--skip", default="", help=f"comma-separated parts to skip: {', '.join(PARTS[1:])}")
    parser.add_argument("--sanitizer-timeout-s", type=float, default=180.0)
    parser.add_argument("--work-dir", help="where models, adapters and logs go (default: a temp dir, removed)")
    parser.add_argument("--keep-work-dir", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        ctx = ChildContext(args.smoke, args.deadline or time.time() + 600, Path(args.work_dir))
        if args.smoke:
            import torch

            torch.set_num_threads(1)  # toy sizes: a second thread only waits at barriers (and the host is shared)
        return run_child(args.child, Path(args.out), ctx)
    runner = Runner(args)
    try:
        record = runner.run()
    except KeyboardInterrupt:
        print("interrupted: the table holds what finished", flush=True)
        record = runner.record()
    left = runner.cleanup(record)
    if args.json:
        write_json(Path(args.json), record)
    print()
    print(markdown(record))
    if args.json:
        print(f"\nJSON: {args.json}")
    if left:
        print(f"work dir (logs in logs/): {left}")
    return 1 if has_failures(record) else 0


if __name__ == "__main__":
    sys.exit(main())
