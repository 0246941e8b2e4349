"""The unified page pool (S-LoRA): fixed-size pages that hold KV blocks and adapter weights alike.

A page is one KV block (`block_size` tokens' K and V for every layer). An adapter takes a run of
consecutive pages, enough for its weights in every layer (engine/lora.py), so loading an adapter and
growing a KV cache draw from the same pages. KV blocks are handed out lowest id first and adapter runs
highest first, which keeps the two apart and runs easy to find. The pool only does bookkeeping; the
tensor lives with the runner (`kv_cache[layer, page]`).
"""

from __future__ import annotations

import heapq

from engine.request import Request


class PagePool:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the page pool must hold at least one page")
        self.num_pages = num_pages
        self._used = bytearray(num_pages)  # 1 where a page is owned
        # Candidate free pages, lowest first. Entries go stale when a run takes a page; pops skip them.
        self._heap: list[int] = list(range(num_pages))
        self._num_free = num_pages
        self._owner: dict[int, str] = {}
        self.num_run_pages = 0  # pages held by runs (adapter weights)

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_pages - self._num_free

    def allocate(self, n: int, owner: str) -> list[int]:
        """n single pages (KV blocks), lowest ids first."""
        if n > self._num_free:
            raise MemoryError(f"need {n} pages, {self._num_free} free")
        pages: list[int] = []
        while len(pages) < n:
            page = heapq.heappop(self._heap)
            if not self._used[page]:
                pages.append(page)
                self._take(page, owner)
        return pages

    def allocate_run(self, n: int, owner: str) -> int | None:
        """n consecutive pages (adapter weights), the highest such run; None if there is none."""
        start = self._used.rfind(bytes(n)) if 0 < n <= self._num_free else -1
        if start < 0:
            return None
        for page in range(start, start + n):
            self._take(page, owner)
        self.num_run_pages += n
        return start

    def free(self, pages: list[int]) -> None:
        for page in pages:
            assert self._used[page], f"page {page} freed twice"
            self._used[page] = 0
            del self._owner[page]
            heapq.heappush(self._heap, page)
        self._num_free += len(pages)

    def free_run(self, start: int, n: int) -> None:
        self.free(list(range(start, start + n)))
        self.num_run_pages -= n

    def _take(self, page: int, owner: str) -> None:
        self._used[page] = 1
        self._owner[page] = owner
        self._num_free -= 1

    def owners(self) -> dict[int, str]:
        """A copy of page id -> owner, for invariant checks in tests."""
        return dict(self._owner)


class KVCacheManager:
    """Grows and frees the KV block lists of requests."""

    def __init__(self, pool: PagePool, block_size: int) -> None:
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
