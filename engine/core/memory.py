"""The unified page pool (S-LoRA): fixed-size pages that hold KV blocks and adapter weights alike.

A page is one KV block (`block_size` tokens' K and V for every layer). An adapter takes a run of
consecutive pages, enough for its weights in every layer (engine/lora/device_tier.py), so loading an adapter and
growing a KV cache draw from the same pages. KV blocks are handed out lowest id first and adapter runs
highest first, which keeps the two apart and runs easy to find. The pool only does bookkeeping; the
tensor lives with the runner (`kv_cache[layer, page]`).

KV blocks of full prompt blocks are shared between requests through an exact prefix cache keyed by adapter
version (KVCacheManager); cached blocks no request holds stay allocated until a KV allocation or an adapter
run needs their pages.
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.request import Request
from engine.lora.peft_config import AdapterKey


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
        self._runs: dict[int, int] = {}  # first page -> length, of every run handed out
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
        self._runs[start] = n
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
        assert self._runs.pop(start, None) == n, f"no run of {n} pages at {start}"
        self.free(list(range(start, start + n)))
        self.num_run_pages -= n

    def set_owner(self, page: int, owner: str) -> None:
        assert self._used[page], f"page {page} is free"
        self._owner[page] = owner

    def _take(self, page: int, owner: str) -> None:
        self._used[page] = 1
        self._owner[page] = owner
        self._num_free -= 1

    def owners(self) -> dict[int, str]:
        """A copy of page id -> owner, for invariant checks in tests."""
        return dict(self._owner)

    def runs(self) -> dict[int, int]:
        """A copy of first page -> length of every run, for invariant checks in tests."""
        return dict(self._runs)


# A full prompt block's identity: (id of the previous block's key or None, adapter key or None for the base
# model, the block's tokens).
BlockKey = tuple[int | None, AdapterKey | None, tuple[int, ...]]
CACHE_OWNER = "prefix-cache"


@dataclass(slots=True)
class _CacheEntry:
    block: int
    key_id: int  # handed out once per published key, never reused


def _adapter_key(request: Request) -> AdapterKey | None:
    return None if request.adapter is None else request.adapter.key


class KVCacheManager:
    """Grows and frees the KV block lists of requests; shares full prompt blocks through a prefix cache.

    The prefix cache is vLLM's automatic prefix caching made exact: a block's key holds its real tokens,
    its adapter version and the id of the previous block's key. A key id names one key forever (ids are
    never reused), so by induction a key names one whole token prefix under one adapter version, and a
    dict hit is never a collision. Blocks are never shared across adapters or adapter versions.

    Every KV page this manager allocated is in `_refs` and in exactly one state:
      held       refcount (`_refs`) == the number of requests whose block_ids contain it, >= 1;
      evictable  refcount 0, cached, in the LRU `_evictable`; the page stays allocated until reclaimed.
    A page's pool owner is CACHE_OWNER once it was published (it may be shared from then on), else the
    request id of its one holder. Only full blocks are published, so a shared block is never written.
    """

    def __init__(self, pool: PagePool, block_size: int, enable_prefix_cache: bool = True) -> None:
        self.pool = pool
        self.block_size = block_size
        self.enable_prefix_cache = enable_prefix_cache
        self._refs: dict[int, int] = {}
        self._cached: dict[BlockKey, _CacheEntry] = {}
        self._key_of: dict[int, BlockKey] = {}  # cached block -> its key
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently used first
        # request id -> (its prompt blocks already looked at, the key of the last of them)
        self._progress: dict[str, tuple[int, BlockKey | None]] = {}
        self._next_key_id = 0
        self.prefix_queries = 0  # tokens of requests that asked the cache
        self.prefix_hits = 0  # of those, tokens found in it

    @property
    def num_cached_blocks(self) -> int:
        return len(self._key_of)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_new_blocks(self, request: Request, num_new_tokens: int) -> int:
        """Blocks `request` must gain before `num_new_tokens` more tokens can be computed."""
        need = self.blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, need - len(request.block_ids))

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more computed tokens, reclaiming idle cached blocks (LRU first)
        if the pool is short; False (nothing changed) if even that is not enough."""
        n = self.num_new_blocks(request, num_new_tokens)
        if n == 0:  # most decode steps: the last block has room
            return True
        if n > self.pool.num_free + len(self._evictable):
            return False
        while self.pool.num_free < n:
            self.evict_cached()
        blocks = self.pool.allocate(n, request.request_id)
        self._refs.update((block, 1) for block in blocks)
        request.block_ids.extend(blocks)
        return True

    def free(self, request: Request) -> None:
        # Tail first: the LRU then reclaims a prefix's extensions before the prefix itself.
        for block in reversed(request.block_ids):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._key_of:
                self._evictable[block] = None
            else:
                del self._refs[block]
                self.pool.free([block])
        request.block_ids = []
        self._progress.pop(request.request_id, None)

    # ---- prefix cache -----------------------------------------------------------------------------------

    def _key(self, parent: BlockKey | None, adapter: AdapterKey | None, request: Request, index: int) -> BlockKey:
        """Block `index`'s key; `parent` (block index-1's key) must be cached."""
        tokens = tuple(request.prompt_token_ids[index * self.block_size : (index + 1) * self.block_size])
        return (None if parent is None else self._cached[parent].key_id, adapter, tokens)

    def attach_cached_prefix(self, request: Request) -> int:
        """Attach the longest cached run of `request`'s full prompt blocks; returns the tokens it covers.

        The block of the last token is never attached: that token must be computed to give logits.
        """
        assert request.num_computed_tokens == 0 and not request.block_ids
        if not self.enable_prefix_cache:
            return 0
        bs = self.block_size
        limit = min(request.num_prompt_tokens // bs, (request.num_tokens - 1) // bs)
        adapter = _adapter_key(request)
        parent: BlockKey | None = None
        for index in range(limit):
            key = self._key(parent, adapter, request, index)
            entry = self._cached.get(key)
            if entry is None:
                break
            self._refs[entry.block] += 1
            self._evictable.pop(entry.block, None)
            request.block_ids.append(entry.block)
            parent = key
        self._progress[request.request_id] = (len(request.block_ids), parent)
        request.num_computed_tokens = len(request.block_ids) * bs
        self.prefix_queries += request.num_tokens
        self.prefix_hits += request.num_computed_tokens
        return request.num_computed_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Publish `request`'s newly computed full prompt blocks whose keys are not cached yet."""
        if not self.enable_prefix_cache:
            return
        full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        done, parent = self._progress.get(request.request_id, (0, None))
        adapter = _adapter_key(request)
        while done < full:
            if parent is not None and parent not in self._cached:
                break  # the prefix before this block left the cache: no lookup could reach it now
            key = self._key(parent, adapter, request, done)
            if key not in self._cached:  # else another block holds it; ours stays private
                self._publish(key, request.block_ids[done])
            done, parent = done + 1, key
        self._progress[request.request_id] = (done, parent)

    def _publish(self, key: BlockKey, block: int) -> None:
        assert block not in self._key_of and self._refs[block] > 0
        self._cached[key] = _CacheEntry(block, self._next_key_id)
        self._next_key_id += 1
        self._key_of[block] = key
        self.pool.set_owner(block, CACHE_OWNER)

    def evict_cached(self) -> bool:
        """Give the least recently used idle cached block's page back to the pool; False if none."""
        if not self._evictable:
            return False
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._key_of.pop(block)]
        del self._refs[block]
        self.pool.free([block])
        return True

    def invalidate_adapter(self, adapter_id: str) -> None:
        """Forget every cached block of `adapter_id` (any version); idle ones give their pages back now."""
        for key, entry in list(self._cached.items()):
            if key[1] is None or key[1][0] != adapter_id:
                continue
            del self._cached[key]
            del self._key_of[entry.block]
            if self._refs[entry.block] == 0:  # idle; held ones are freed by their last holder
                del self._evictable[entry.block]
                del self._refs[entry.block]
                self.pool.free([entry.block])

    def reset_prefix_cache(self) -> None:
        """Drop every idle cached block."""
        while self.evict_cached():
            pass

    # ---- invariants (tests) -----------------------------------------------------------------------------

    def check_invariants(self, requests: Iterable[Request]) -> None:
        """Assert that pool, refcounts and cache agree, given every request that holds blocks."""
        pool, owners = self.pool, self.pool.owners()
        assert pool.num_free + len(owners) == pool.num_pages
        run_pages = [p for start, n in pool.runs().items() for p in range(start, start + n)]
        assert len(run_pages) == len(set(run_pages)) == pool.num_run_pages
        assert set(run_pages) <= owners.keys()
        assert set(self._refs) == owners.keys() - set(run_pages)  # every other page is a KV block here
        holders: Counter[int] = Counter()
        holder_of: dict[int, Request] = {}
        for r in requests:
            assert len(r.block_ids) == len(set(r.block_ids)), f"{r.request_id} holds a block twice"
            assert 0 <= r.num_computed_tokens <= r.num_tokens
            if r.swapped_kv is None:  # a swapped-out request keeps its tokens on the host, not here
                assert len(r.block_ids) >= self.blocks_for(r.num_computed_tokens)
            else:
                assert not r.block_ids
            holders.update(r.block_ids)
            holder_of.update((b, r) for b in r.block_ids)
        assert holders.keys() <= self._refs.keys(), "a request holds a page that is not a KV block"
        for block, refs in self._refs.items():
            assert refs == holders[block], f"block {block}: refcount {refs}, {holders[block]} holders"
            assert (refs == 0) == (block in self._evictable)
            if block in self._key_of:
                assert owners[block] == CACHE_OWNER
            elif owners[block] != CACHE_OWNER:
                assert refs == 1 and holder_of[block].request_id == owners[block]
        assert self._evictable.keys() <= self._key_of.keys()
        assert len(self._cached) == len(self._key_of)
        assert all(self._key_of.get(e.block) == key for key, e in self._cached.items())
