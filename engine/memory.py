"""The KV block pool: fixed-size blocks handed to requests as their sequences grow.

A block holds `block_size` tokens' K and V for every layer. The pool only does bookkeeping (which block
ids are free, who owns each); the tensor itself lives with the runner (`kv_cache[:, :, block_id]`).
"""

from __future__ import annotations

from collections import deque

from engine.request import Request


class OutOfBlocks(Exception):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("the KV pool must hold at least one block")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # Invariant: every block id is either in _free or in _owner, never both.
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int, owner: str) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._owner[b] = owner
        return blocks

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            assert b in self._owner, f"block {b} freed twice"
            del self._owner[b]
            self._free.append(b)

    def owners(self) -> dict[int, str]:
        """A copy of block id -> owner, for invariant checks in tests."""
        return dict(self._owner)


class KVCacheManager:
    """Grows and frees the block lists of requests."""

    def __init__(self, pool: BlockPool, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` must gain before `num_new_tokens` more tokens can be computed."""
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, need - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (nothing changed) if the pool is short."""
        n = self.num_new_blocks(request, num_new_tokens)
        if n > self.pool.num_free:
            return False
        if n:
            request.block_ids.extend(self.pool.allocate(n, request.request_id))
        return True

    def free(self, request: Request) -> None:
        self.pool.free(request.block_ids)
        request.block_ids = []
