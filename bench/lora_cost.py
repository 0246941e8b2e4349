"""What LoRA costs a W1 step, measured so that neither a noisy machine nor where an engine's memory happens to lie
favours a side: W1 on identical engines in one process, one per side, their steps interleaved one for one, each
step timed alone, and the sides moved to the next engine every round.

A VM whose speed drifts by 1.5x within minutes (this project's 2-core runners do) makes two W1 runs one after the
other disagree by more than the LoRA cost itself; interleaving single steps puts every side through the same
drift. Two engines built alike in one process also differ, by up to ~3% a step (where their weights and caches
landed): so every engine here has the same configuration (the same registered adapters, pool and device tier), any
engine can run any side, and round k runs side j on engine (j + k) mod n; over n rounds every side has run on every
engine. Within a round, each turn of steps starts one side later, so no side always steps right after the same
other. Each round runs W1 (32 requests x 64 new tokens, greedy) to completion on every side (prefix cache reset, so
every prompt is prefilled), and prints each side's tok/s over its own step time and its ratio to the first side;
the last lines are the medians over rounds. Before the first round every engine runs every side's requests for two
tokens (first calls, adapter loads), so the figures are warm ones.

Sides (`--sides`, comma-separated; default `base,mixed`):
- `base`: no adapter;
- `mixed`: W1's mixed LoRA, request i on W1 adapter i % 8;
- `dora`: 8 DoRA adapters of W1's ranks and modules (request i on DoRA adapter i % 8; `kind_adapter_dirs`);
- `vocab`: 8 adapters of W1's ranks and modules plus a LoRA on the embeddings and on the LM head;
- `mix2`: request i names the 2-part mix of W1 adapters i % 8 and (i + 1) % 8 (docs/adapters.md);
- `sum`: 8 plain adapters whose ranks are those mixes' summed ranks (request i on the one of mix i % 8), so
  `--sides sum,mix2` compares a mix with a single adapter of the same total rank;
- `zipf:N`: N registered adapters (the 8 W1 weight sets under N ids, bench/throughput.py `scale_adapter_dir`),
  request ids drawn with Zipf popularity as bench/throughput.py's adapter-scale pass draws them.
Every engine registers the largest N's ids (at least 8; the first 8 are W1's weight sets, which `mixed` uses) with
a device tier of 64 adapters.

    python bench/lora_cost.py [--dtype float32|bfloat16] [--rounds 4] [--sides base,mixed] [--backend cpp|torch]

`--sides mixed,zipf:512` is the adapter-scale target (512 registered adapters within 10% of 8); `--sides
mixed,dora,vocab` and `--sides sum,mix2` are the adapter formats' (docs/adapters.md: a DoRA step within 1.1x of a
plain one, a mix within 1.05x of one adapter of its summed rank). Rounds in a multiple
of the number of sides put every side on every engine equally often. `--backend` picks the CPU's LoRA path
(LORAGATE_LORA_BACKEND, loragate_kernels/backends.py).

A decode step streams every weight it multiplies from memory, the LoRA op's included: each distinct adapter of the
batch once (`decode_adapter_bytes`). The last lines print those bytes per side, the machine's read bandwidth
(`read_bandwidth`) and, for each side against the side before it, the ratio's ceiling (`ratio_ceiling`): what the
ratio would be if the later side took the earlier one's measured time plus only its extra adapter bytes at that
bandwidth, every decode step. Over 512 ids W1's 32 requests name 25 adapters (rank sum 236) where over 8 they name 8
(rank sum 68), so on a 2-core machine the extra reads alone hold zipf:512 / zipf:8 some way below 1, and how far
moves with the read bandwidth of the minute (docs/performance.md, *LoRA cost and the adapter curve*, has the
figures).
"""

from __future__ import annotations

import argparse
import copy
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.throughput import SCALE_TIER, make_w1_adapters, scale_adapter_dir, w1_prompts, zipf_choices  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.core.llm_engine import LLMEngine  # noqa: E402
from engine.core.request import SamplingParams  # noqa: E402
from engine.model.sources import cache_root, load_tokenizer, resolve_model  # noqa: E402
from loragate_common.adapter_mix import MixPart, is_mix, parse_mix  # noqa: E402


def side_ids(side: str, requests: int) -> list[str | None]:
    """The adapter id of each W1 request on a side (ids as `shared_config`'s adapter directory names them)."""
    if side == "base":
        return [None] * requests
    if side in KIND_PREFIX:
        return [f"{KIND_PREFIX[side]}{i % 8:04d}" for i in range(requests)]
    if side == "mix2":
        return [f"a{i % 8:04d}*0.7+a{(i + 1) % 8:04d}*0.3" for i in range(requests)]
    kind, _, count = side.partition(":")
    if kind != "zipf" or not count.isdigit() or int(count) < 1:
        raise SystemExit(f"unknown side {side!r}: base, mixed or zipf:N")
    return [f"a{k:04d}" for k in zipf_choices(int(count), requests)]


def adapter_elements(adapter_dir: Path) -> int:
    """How many LoRA weights (every lora_A, lora_B, lora_embedding_A/B and DoRA magnitude) the PEFT adapter in
    `adapter_dir` holds, from its safetensors header (no tensor is read)."""
    from safetensors import safe_open

    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys() if ".lora_" in name)


def decode_adapter_bytes(ids: list[str | None], adapter_dir: Path, element_size: int) -> int:
    """The adapter bytes one decode step of a batch naming `ids` reads: each distinct adapter's weights once (a mix:
    its parts' together, the derived adapter's size), at the engine's `element_size` (the unified pool holds them in
    the model's dtype)."""
    names = [p.ref for i in set(ids) if i is not None for p in (parse_mix(i) if is_mix(i) else [MixPart(i, 1.0)])]
    return sum(adapter_elements(adapter_dir / name) for name in names) * element_size


def read_bandwidth(mib: int = 1024, repeats: int = 5) -> float:
    """Bytes a second this machine reads from memory on the current torch threads: the best of `repeats` sums over
    `mib` MiB of fp32, far more than a VM's share of the last-level cache (a step's weights stream from DRAM)."""
    data = torch.ones(mib * 2**20 // 4)
    data.sum()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def ratio_ceiling(seconds: float, decode_steps: int, extra_bytes: int, bandwidth: float) -> float:
    """The most a side reading `extra_bytes` more adapter weights every decode step can reach against a side measured
    at `seconds` for the same tokens, if those reads cost only their time at `bandwidth` and overlap nothing."""
    return seconds / (seconds + decode_steps * max(0, extra_bytes) / bandwidth)


KIND_PREFIX = {"mixed": "a", "dora": "d", "vocab": "v", "sum": "s"}  # side -> its adapters' id prefix


def kind_adapter_dirs(base_dir: Path, root: Path) -> dict[str, list[Path]]:
    """The 8 adapters of each adapter-format side (`KIND_PREFIX`), built once with PEFT into `root` like W1's: W1's
    ranks (4, 8, 16 by i % 3), all-linear, lora_B N(0, 0.02^2) from seed i; DoRA's magnitudes PEFT's (the base's
    row norms) times 1 + N(0, 0.1^2); the embedding LoRA's A and B N(0, 0.02^2); `sum` i of rank r(i) + r(i + 1)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    def rank(i: int) -> int:
        return [4, 8, 16][i % 3]

    kinds: dict[str, Callable[[int], dict[str, Any]]] = {
        "d": lambda i: dict(r=rank(i), use_dora=True),
        "v": lambda i: dict(r=rank(i), extra=["embed_tokens", "lm_head"]),
        "s": lambda i: dict(r=rank(i) + rank((i + 1) % 8)),
    }
    dirs = {prefix: [root / f"{prefix}-{i}" for i in range(8)] for prefix in kinds}
    missing = [
        (p, i) for p, ds in dirs.items() for i, d in enumerate(ds) if not (d / "adapter_model.safetensors").exists()
    ]
    if not missing:
        return dirs
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    for prefix, i in missing:
        kw = kinds[prefix](i)
        r, extra = kw.pop("r"), kw.pop("extra", [])
        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", *extra]
        config = LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=targets, **kw)
        model = get_peft_model(copy.deepcopy(base), config)
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
                if ".lora_B." in name or ".lora_embedding_" in name:
                    param.copy_(0.02 * torch.randn(param.shape, generator=gen))
                elif "lora_magnitude_vector" in name:
                    param.mul_(1 + 0.1 * torch.randn(param.shape, generator=gen))
        model.save_pretrained(str(dirs[prefix][i]), safe_serialization=True, save_embedding_layers=False)
    return dirs


def shared_config(dtype: str, registered: int) -> EngineConfig:
    """One configuration for every engine, so any can run any side: `registered` adapter ids over the 8 W1 weight
    sets (id k on set k % 8), and the adapter-format sides' 8 each (`kind_adapter_dirs`), hard-linked beside them."""
    root = cache_root() / "bench-adapters"
    base_dir = resolve_model("smollm2").path
    weight_dirs = make_w1_adapters(base_dir, root / "w1")
    scale_dir = scale_adapter_dir(weight_dirs, root, registered)
    for prefix, dirs in kind_adapter_dirs(base_dir, root / "kinds").items():
        for i, source in enumerate(dirs):
            target = scale_dir / f"{prefix}{i:04d}"
            if not target.is_dir():
                target.mkdir()
                for f in source.iterdir():
                    os.link(f, target / f.name)
    return EngineConfig(
        model="smollm2", dtype=dtype, pool_mb=1024, adapter_dir=str(scale_dir), max_device_adapters=SCALE_TIER
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--sides", default="base,mixed")
    ap.add_argument("--backend", default="cpp", choices=["cpp", "torch"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(resolve_model("smollm2").path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(args.requests)]
    os.environ["LORAGATE_LORA_BACKEND"] = args.backend
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    ids = {side: side_ids(side, args.requests) for side in sides}
    registered = max([8] + [int(side.partition(":")[2]) for side in sides if side.startswith("zipf:")])
    config = shared_config(args.dtype, registered)
    engines = [LLMEngine(config) for _ in sides]
    params = SamplingParams(max_tokens=args.new_tokens, min_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    first = sides[0]
    print(
        f"W1 ({args.requests} x {args.new_tokens} tokens), {args.dtype}, {args.threads} threads, LoRA path "
        f"{args.backend}; sides {', '.join(sides)} on {len(engines)} identical engines, moved to the next engine "
        f"every round; steps interleaved one for one; ratios to {first}"
    )
    # warm-up: every engine runs every side's requests for two tokens (first calls of each shape, adapter loads)
    warm = SamplingParams(max_tokens=2, min_tokens=2, temperature=0.0, ignore_eos=True)
    for e, engine in enumerate(engines):
        for side in sides:
            for i, (prompt, adapter) in enumerate(zip(prompts, ids[side], strict=True)):
                engine.add_request(f"warm-{e}-{side}-{i}", prompt, warm, adapter_id=adapter)
            while engine.has_unfinished_requests():
                engine.step()
    rates: dict[str, list[float]] = {side: [] for side in sides}
    for k in range(1, args.rounds + 1):
        on = {side: engines[(j + k) % len(engines)] for j, side in enumerate(sides)}  # round k: side j on j + k
        seconds = dict.fromkeys(sides, 0.0)
        tokens = dict.fromkeys(sides, 0)
        for side, engine in on.items():
            engine.scheduler.kv.reset_prefix_cache()
            for i, (prompt, adapter) in enumerate(zip(prompts, ids[side], strict=True)):
                engine.add_request(f"{k}-{side}-{i}", prompt, params, adapter_id=adapter)
        turn = 0
        while any(engine.has_unfinished_requests() for engine in on.values()):
            # each turn starts one side later, so that no side always steps right after the same other side
            for side in sides[turn % len(sides) :] + sides[: turn % len(sides)]:
                engine = on[side]
                if engine.has_unfinished_requests():
                    start = time.perf_counter()
                    outputs = engine.step()
                    seconds[side] += time.perf_counter() - start
                    tokens[side] += sum(len(o.new_token_ids) for o in outputs)
            turn += 1
        for side in sides:
            rates[side].append(tokens[side] / seconds[side])
        print(
            f"round {k}: "
            + ", ".join(
                f"{side} {rates[side][-1]:.1f} tok/s ({rates[side][-1] / rates[first][-1]:.2f})" for side in sides
            )
        )
    medians = {side: statistics.median(rates[side]) for side in sides}
    ratios = {side: statistics.median(r / b for r, b in zip(rates[side], rates[first], strict=True)) for side in sides}
    print(
        f"median of {args.rounds}: "
        + ", ".join(f"{side} {medians[side]:.1f} tok/s (ratio {ratios[side]:.2f})" for side in sides)
    )
    # what the adapters' reads alone allow: each side against the one before it
    element = torch.empty((), dtype=engines[0].dtype).element_size()
    adapter_dir = Path(str(config.adapter_dir))
    adapter_bytes = {side: decode_adapter_bytes(ids[side], adapter_dir, element) for side in sides}
    bandwidth = read_bandwidth()
    print(
        "adapter bytes a decode step reads: "
        + ", ".join(
            f"{side} {adapter_bytes[side] / 1e6:.1f} MB ({len({i for i in ids[side] if i})} adapters)" for side in sides
        )
        + f"; read bandwidth {bandwidth / 1e9:.1f} GB/s (best sum over 1 GiB, {args.threads} threads)"
    )
    for before, side in itertools.pairwise(sides):
        measured = statistics.median(r / b for r, b in zip(rates[side], rates[before], strict=True))
        seconds = args.requests * args.new_tokens / medians[before]
        extra = adapter_bytes[side] - adapter_bytes[before]
        ceiling = ratio_ceiling(seconds, args.new_tokens - 1, extra, bandwidth)
        print(
            f"{side} / {before}: {measured:.2f} (median of rounds); ceiling {ceiling:.2f} if its "
            f"{extra / 1e6:+.1f} MB a decode step cost only their reads"
        )


if __name__ == "__main__":
    main()
