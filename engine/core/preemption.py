"""Preemption: which running request gives way, and how (recompute or swap).

- recompute: free the request's KV blocks; it prefills its prompt and outputs so far again later.
- swap: copy its KV blocks to host memory, free them, and copy them back into new blocks when it is
  admitted again; no token is computed twice.
- auto: pick per preemption by the measured cost of each: swapping moves the blocks' bytes twice (out and
  back) at the copy speed seen so far; recomputing costs its computed tokens at the prefill speed seen so
  far. Both speeds are exponential moving averages fed by real swaps and engine steps.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from engine.core.request import Request

MODES = ("recompute", "swap", "auto")
_EMA = 0.2  # weight of the newest measurement


def pick_victim(running: Sequence[Request]) -> Request:
    """The running request of the lowest class it runs at; the most recently admitted among equals."""
    return max(reversed(running), key=lambda r: r.run_class)


class KVSwapper:
    """Copies whole KV blocks (all layers) between the page pool and host memory."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache  # [num_layers, num_pages, 2, block_size, kvh, hd]
        self.bytes_per_block = kv_cache[:, 0].numel() * kv_cache.element_size()
        self.seconds_per_byte = self._calibrate()

    def _calibrate(self) -> float:
        t0 = time.perf_counter()
        self.kv_cache[:, :1].to("cpu", copy=True)
        return max(time.perf_counter() - t0, 1e-9) / self.bytes_per_block

    def swap_out(self, blocks: list[int]) -> torch.Tensor:
        """A host copy [num_layers, len(blocks), 2, block_size, kvh, hd] of these blocks."""
        t0 = time.perf_counter()
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv_cache.device)
        host = self.kv_cache.index_select(1, index).to("cpu")
        self._observe(time.perf_counter() - t0, len(blocks))
        return host

    def swap_in(self, host: torch.Tensor, blocks: list[int]) -> None:
        """Write a swapped-out copy back into (new) blocks, in order."""
        assert host.shape[1] == len(blocks)
        t0 = time.perf_counter()
        index = torch.tensor(blocks, dtype=torch.long, device=self.kv_cache.device)
        self.kv_cache.index_copy_(1, index, host.to(self.kv_cache.device))
        self._observe(time.perf_counter() - t0, len(blocks))

    def _observe(self, seconds: float, num_blocks: int) -> None:
        if num_blocks:
            measured = seconds / (num_blocks * self.bytes_per_block)
            self.seconds_per_byte += _EMA * (measured - self.seconds_per_byte)

    def cost(self, num_blocks: int) -> float:
        """Estimated seconds to swap this many blocks out and back in."""
        return 2 * num_blocks * self.bytes_per_block * self.seconds_per_byte


class PreemptionPolicy:
    def __init__(self, mode: str, swapper: KVSwapper | None) -> None:
        if mode not in MODES:
            raise ValueError(f"preemption must be one of {', '.join(MODES)}, got {mode!r}")
        if mode != "recompute" and swapper is None:
            raise ValueError(f"preemption {mode!r} needs a KV swapper")
        self.mode = mode
        self.swapper = swapper
        self.seconds_per_token = 1e-3  # prefill cost, refined by observe_step()
        self.counts = {"recompute": 0, "swap": 0}

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """Feed one engine step's size and time (only prefill-sized steps say much about prefill)."""
        if num_tokens >= 16:
            measured = seconds / num_tokens
            self.seconds_per_token += _EMA * (measured - self.seconds_per_token)

    def choose(self, request: Request) -> str:
        """recompute or swap, for preempting `request` now."""
        if self.mode != "auto":
            mode = self.mode
        elif not request.block_ids or request.num_computed_tokens == 0:
            mode = "recompute"  # nothing worth keeping
        else:
            if self.swapper is None:  # never: __init__ refuses "auto" without one
                raise RuntimeError("preemption 'auto' needs a KV swapper")
            swap = self.swapper.cost(len(request.block_ids))
            recompute = request.num_computed_tokens * self.seconds_per_token
            mode = "swap" if swap < recompute else "recompute"
        self.counts[mode] += 1
        return mode
