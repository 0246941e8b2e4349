"""Steps of decodes alone, replayed from CUDA graphs captured per batch-size bucket (CUDA only; `--no-cuda-graphs`
turns it off).

A decode step of a small model launches a few hundred kernels (per layer: norms, projections, RoPE, the K/V
write, attention, LoRA shrink and expand per group) and each launch costs the host microseconds; replaying a
graph launches them all at once. What makes a step capturable:

- Its shapes are the bucket's: a step of n decodes runs in the smallest bucket B >= n; rows [n, B) are padding
  (token 0 at position 0, K/V written to a scratch page reserved for them, context length 0, which the decode
  kernel answers with zeros without reading the cache, and no LoRA tile).
- Its inputs live in static buffers the graph reads: token ids, positions, slots, context lengths and LoRA row
  tiles in one int64 buffer, block tables in a [max_batch, max_blocks] one, each written per step from a host
  buffer by one copy (two in all), never reallocated.
- Nothing in it reads a device value on the host: attention is loragate_kernels/triton/paged_attention.py (grid and
  loop bounds from shapes and device memory), LoRA is loragate_kernels/triton/sgmv.py with a fixed tile count (B: at
  most one tile per row; padding tiles name the null slot, whose rank is 0, and return at once).
- What a kernel's launch bakes in stays true: the SGMV grid is sized by a rank bound per module group, the
  larger of RANK_FLOOR per module and the group's largest rank over the adapters loaded so far
  (`PoolWeights.max_rank`, which only grows). Programs past a slot's rank return at once, so the floor costs
  little, and graphs captured before any adapter loads (at warm-up) launch the SGMV kernels too, which compiles
  them then. An adapter past the bound drops every graph; each is captured again on its next use.

Two graphs per bucket at most: with LoRA (when some row has an adapter) and without. A replay is not
interrupted by a critical arrival (engine/core/llm_engine.py); a decode step is short.

A step with a DoRA adapter's rows runs eagerly, over the same static inputs and LoRA tiles: its rows' scales are
gathered by a plan made on the host per step (engine/lora/dora.py), which a captured graph would replay stale.

The seam: a graph is anything with `capture(fn) -> output` and `replay()`. On CUDA it is `CudaGraph`
(torch.cuda.CUDAGraph, one memory pool shared by all captures); `EagerGraph` runs the captured function again
on replay, which lets the tests check everything above on a CPU (tests/engine/test_cuda_graphs.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from engine.lora.device_tier import DeviceAdapterTier
from engine.lora.peft_config import GROUPS
from engine.lora.routes import LoraBatch, TritonLora, TritonPlan
from engine.model.attention import AttentionMetadata
from engine.model.decoder import CausalLM
from loragate_kernels.backends import Kernel

logger = logging.getLogger(__name__)

FIELDS = 7  # token ids, positions, slots, context lengths, tile slots, tile starts, tile ends
RANK_FLOOR = 64  # per module: the SGMV grid of a captured graph covers ranks up to at least this


def batch_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes graphs are captured for: 1, 2, 4, 8, then 12, 16, 24, 32, 48, 64, 96, 128, ... (each 1.5x or
    1.33x the last), and max_num_seqs itself. A step pads to the next one: a third of its rows at most are
    padding, and a decode step's GEMMs cost about the same at B and 1.5 B rows (they read the weights once)."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        last = sizes[-1]
        sizes.append(last * 3 // 2 if last & (last - 1) == 0 else last * 4 // 3)
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


class Graph(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor: ...

    def replay(self) -> None: ...


class CudaGraph:
    """torch.cuda.CUDAGraph behind the seam. The function runs once on a side stream before capture (Triton
    compiles its kernels, cuBLAS picks its algorithms: neither may happen during capture)."""

    def __init__(self, device: torch.device, pool: Any) -> None:
        self.device, self.pool = device, pool
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()

    @staticmethod
    def factory(device: torch.device) -> Callable[[], Graph]:
        pool = torch.cuda.graph_pool_handle()  # one pool: the buckets' graphs never run at the same time
        return lambda: CudaGraph(device, pool)


class EagerGraph:
    """A CPU stand-in: capture runs the function and keeps its output tensor; replay runs it again into that
    tensor. Everything around it (static inputs, padding, buckets, recapture) is what runs on a GPU."""

    def __init__(self) -> None:
        self.fn: Callable[[], torch.Tensor] | None = None
        self.out: torch.Tensor | None = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        self.fn, self.out = fn, fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None
        self.out.copy_(self.fn())


@dataclass(slots=True)
class GraphStep:
    """A step of decodes that all sample, in batch order: what a graph replay needs, as host lists."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    context_lens: list[int]
    rows: list[int]  # persistent-batch rows (their block tables)
    sample_idx: list[int]
    sample_rows: None = None  # every row samples, in order
    prompt_chunks: None = None


@dataclass(slots=True)
class _Captured:
    graph: Graph
    hidden: torch.Tensor  # [B, hidden]: the replay's output, always this tensor


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        block_table: np.ndarray,
        max_num_seqs: int,
        scratch_page: int,
        adapters: DeviceAdapterTier | None,
        make_graph: Callable[[], Graph],
        rank_floor: int = RANK_FLOOR,
    ) -> None:
        """`block_table`: the persistent batch's host table [max_rows, max_blocks] (engine/worker/input_batch.py);
        `scratch_page`: a page of the pool reserved for padding rows' K/V."""
        device = kv_cache.device
        backends = model.backends
        if backends.attention is not Kernel.TRITON or (adapters is not None and backends.lora is not Kernel.TRITON):
            raise ValueError(
                "CUDA graphs need the Triton decode attention and LoRA kernels (LORAGATE_ATTENTION_BACKEND and "
                "LORAGATE_LORA_BACKEND unset or triton, loragate_kernels/backends.py); pass --no-cuda-graphs to use "
                "others"
            )
        self.model, self.kv_cache, self.adapters, self.make_graph = model, kv_cache, adapters, make_graph
        self.block_table = block_table
        self.buckets = batch_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.scratch_slot = scratch_page * block_size
        self.rank_floor = rank_floor
        cuda = device.type == "cuda"
        width = self.max_batch
        # Static inputs, FIELDS sections of max_batch each; a bucket's graph reads the first B of each.
        self._host = torch.zeros(FIELDS * width, dtype=torch.long, pin_memory=cuda)
        self._host_tables = torch.zeros(block_table.shape[1] * width, dtype=torch.long, pin_memory=cuda)
        self._inputs = torch.zeros(FIELDS * width, dtype=torch.long, device=device)
        self._tables = torch.zeros(width, block_table.shape[1], dtype=torch.long, device=device)
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[tuple[int, bool], _Captured] = {}
        self._rank_key: tuple[int, ...] = self._ranks()
        self.captures = 0  # graphs captured so far (recaptures included)
        self.eager_steps = 0  # steps run eagerly (DoRA rows)
        # the route of those steps: one, so its stack of DoRA scales is kept between them
        self._eager_lora = None if adapters is None else TritonLora(adapters.weights)

    def fits(self, num_rows: int) -> bool:
        return num_rows <= self.max_batch

    def bucket(self, num_rows: int) -> int:
        return next(b for b in self.buckets if b >= num_rows)

    def run(self, step: GraphStep, tiles: tuple[list[int], list[int], list[int]] | None) -> torch.Tensor:
        """The final hidden states [n, hidden] of the step's n rows. `tiles`: the step's LoRA row tiles
        (loragate_kernels/triton/sgmv.py `segment_tiles`), None when no row has an adapter."""
        n = len(step.token_ids)
        size = self.bucket(n)
        if tiles is not None and self.adapters is not None and not self.adapters.tables.dora_slots.isdisjoint(tiles[0]):
            return self._eager(size, step, tiles)[:n]
        ranks = self._ranks()
        if ranks != self._rank_key:  # an adapter of a larger rank: the captured SGMV grids are too small
            self._graphs.clear()
            self._rank_key = ranks
        key = (size, tiles is not None)
        captured = self._graphs.get(key)
        if captured is None:
            captured = self._capture(size, tiles is not None)
        self._stage(size, step, tiles)
        captured.graph.replay()
        return captured.hidden[:n]

    def capture_all(self) -> int:
        """Capture every bucket now (the engine's warm-up), largest first so the smaller reuse its memory; with
        LoRA too when the engine has an adapter tier. Returns how many were captured."""
        before = self.captures
        for size in reversed(self.buckets):
            for with_lora in (False, True) if self.adapters is not None else (False,):
                if (size, with_lora) not in self._graphs:
                    self._capture(size, with_lora)
        return self.captures - before

    # ---- internals --------------------------------------------------------------------------------------

    def _ranks(self) -> tuple[int, ...]:
        """Each group's rank bound (the captured SGMV grids')."""
        if self.adapters is None:
            return ()
        loaded = self.adapters.weights.max_rank
        return tuple(max(loaded[g], self.rank_floor * len(names)) for g, names in GROUPS.items())

    def _view(self, field: int, size: int) -> torch.Tensor:
        return self._inputs[field * self.max_batch : field * self.max_batch + size]

    def _capture(self, size: int, with_lora: bool) -> _Captured:
        self._stage(size, None, None)  # padding rows only: capturing touches no request's cache
        ids, positions, slots, lens = (self._view(f, size) for f in range(4))
        attn = AttentionMetadata(slots, size, self._tables[:size], lens, (), 0)
        lora = None
        if with_lora:
            from loragate_kernels.triton.sgmv import SgmvPlan

            assert self.adapters is not None
            tiles = SgmvPlan(self._view(4, size), self._view(5, size), self._view(6, size), size)
            bounds = dict(zip(GROUPS, self._rank_key, strict=True))
            lora = LoraBatch(TritonLora(self.adapters.weights), TritonPlan(tiles, bounds))

        def forward() -> torch.Tensor:
            return self.model(ids, positions, self.kv_cache, attn, lora)

        graph = self.make_graph()
        captured = self._graphs[(size, with_lora)] = _Captured(graph, graph.capture(forward))
        self.captures += 1
        return captured

    def _eager(self, size: int, step: GraphStep, tiles: tuple[list[int], list[int], list[int]]) -> torch.Tensor:
        """The step's forward pass run as it comes (not captured), on the static inputs staged as for a replay."""
        from loragate_kernels.triton.sgmv import BLOCK_M, SgmvPlan

        assert self._eager_lora is not None
        self._stage(size, step, tiles)
        ids, positions, slots, lens = (self._view(f, size) for f in range(4))
        attn = AttentionMetadata(slots, size, self._tables[:size], lens, (), 0)
        plan = TritonPlan(SgmvPlan(self._view(4, size), self._view(5, size), self._view(6, size), size))
        dora = self._eager_lora.dora.plan((k, lo, min(lo + BLOCK_M, end)) for k, lo, end in zip(*tiles, strict=True))
        self.eager_steps += 1
        return self.model(ids, positions, self.kv_cache, attn, LoraBatch(self._eager_lora, plan, dora))

    def _stage(self, size: int, step: GraphStep | None, tiles: tuple[list[int], list[int], list[int]] | None) -> None:
        """Write a step's inputs (padding to `size` rows) into the static buffers: one copy for the integers,
        one for the block tables' first columns that any row reads."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copies read the host buffers
        host = self._host.numpy().reshape(FIELDS, self.max_batch)
        n = 0 if step is None else len(step.token_ids)
        null = 0 if self.adapters is None else self.adapters.null_slot
        host[:, :size] = 0
        host[2, :size] = self.scratch_slot
        host[4, :size] = null
        width = 1
        if step is not None:
            host[0, :n] = step.token_ids
            host[1, :n] = step.positions
            host[2, :n] = step.slots
            host[3, :n] = step.context_lens
            block_size = self.kv_cache.shape[3]
            width = -(-max(step.context_lens) // block_size)
        if tiles is not None:
            k = len(tiles[0])
            host[4, :k], host[5, :k], host[6, :k] = tiles
        tables = self._host_tables.numpy()[: size * width].reshape(size, width)
        tables[:] = self.scratch_slot // self.kv_cache.shape[3]
        if step is not None:
            tables[:n] = self.block_table[step.rows, :width]
        cuda = self._inputs.is_cuda
        self._inputs.copy_(self._host, non_blocking=cuda)
        self._tables[:size, :width].copy_(self._host_tables[: size * width].view(size, width), non_blocking=cuda)
        if cuda:
            self._copied = torch.cuda.Event()
            self._copied.record(torch.cuda.current_stream(self._inputs.device))
