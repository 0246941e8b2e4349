"""The unified page pool (S-LoRA): fixed-size pages that hold KV blocks and adapter weights alike.

A page is one KV block (`block_size` tokens' K and V for every layer). An adapter takes a run of
consecutive pages, enough for its weights in every layer (engine/lora/device_tier.py), so loading an adapter and
growing a KV cache draw from the same pages. KV blocks are handed out lowest id first and adapter runs
highest first, which keeps the two apart and runs easy to find. The pool only does bookkeeping; the
tensor lives with the runner (`kv_cache[layer, page]`).

KV blocks of full prompt blocks are shared between requests through an exact prefix cache keyed by adapter
version (KVCacheManager); cached blocks no request holds stay allocated until a KV allocation or an adapter
run needs their pages. The cache also tells the gateway which prompt prefixes it holds, by the chunk hashes the
gateway sent with recent prompts (`held_prefixes`, loragate_common/prefix.py).
"""

from __future__ import annotations

import heapq
from collections import Counter, OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field

from engine.core.request import Request
from engine.lora.peft_config import AdapterKey
from loragate_common.prefix import PromptChunks


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


@dataclass(slots=True)
class _Progress:
    """How far a request walked its prompt's block chain: the key of the last block looked at, and the key id
    of every block so far (its first `len(key_ids)` prompt blocks), which `held_prefixes` tests for liveness."""

    parent: BlockKey | None = None
    key_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class _RecentPrompt:
    """A recent prompt's chunk hashes and the key ids of its leading blocks (the request's own list, so it grows
    while the request computes and stays after it is freed)."""

    chunks: PromptChunks
    prompt_tokens: int
    key_ids: list[int]
    max_blocks: int  # the blocks that cover every chunk: liveness past them changes nothing


RECENT_PROMPTS = 1024  # prompts whose chunk hashes held_prefixes looks at, most recently attached first


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
        self._progress: dict[str, _Progress] = {}  # request id -> its walk along its prompt's blocks
        self._next_key_id = 0
        self._live_ids: set[int] = set()  # key ids of the cached entries
        self._recent: OrderedDict[str, _RecentPrompt] = OrderedDict()  # tip hash -> prompt, least recent first
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
        progress = self._start_progress(request)
        for index in range(limit):
            key = self._key(progress.parent, adapter, request, index)
            entry = self._cached.get(key)
            if entry is None:
                break
            self._refs[entry.block] += 1
            self._evictable.pop(entry.block, None)
            request.block_ids.append(entry.block)
            progress.parent = key
            progress.key_ids.append(entry.key_id)
        request.num_computed_tokens = len(request.block_ids) * bs
        self.prefix_queries += request.num_tokens
        self.prefix_hits += request.num_computed_tokens
        return request.num_computed_tokens

    def cache_full_blocks(self, request: Request) -> None:
        """Publish `request`'s newly computed full prompt blocks whose keys are not cached yet."""
        if not self.enable_prefix_cache:
            return
        full = min(request.num_computed_tokens, request.num_prompt_tokens) // self.block_size
        progress = self._progress.get(request.request_id)
        if progress is None:
            progress = self._start_progress(request)
        adapter = _adapter_key(request)
        while (done := len(progress.key_ids)) < full:
            if progress.parent is not None and progress.parent not in self._cached:
                break  # the prefix before this block left the cache: no lookup could reach it now
            key = self._key(progress.parent, adapter, request, done)
            entry = self._cached.get(key)
            if entry is None:  # else another block holds it; ours stays private
                entry = self._publish(key, request.block_ids[done])
            progress.parent = key
            progress.key_ids.append(entry.key_id)

    def _start_progress(self, request: Request) -> _Progress:
        """A request's walk from its first block (at admission; or at its first computed chunk when it skipped
        the lookup: swapped in, or computing prompt logprobs); its prompt becomes the most recent one."""
        progress = self._progress[request.request_id] = _Progress()
        chunks = request.prefix_chunks
        if chunks is not None and chunks.hashes:
            tip = chunks.hashes[-1]
            tokens = -(-len(chunks.hashes) * chunks.chunk * request.num_prompt_tokens // chunks.total)
            recent = _RecentPrompt(chunks, request.num_prompt_tokens, progress.key_ids, self.blocks_for(tokens))
            self._recent.pop(tip, None)
            self._recent[tip] = recent
            if len(self._recent) > RECENT_PROMPTS:
                self._recent.popitem(last=False)
        return progress

    def _publish(self, key: BlockKey, block: int) -> _CacheEntry:
        assert block not in self._key_of and self._refs[block] > 0
        entry = self._cached[key] = _CacheEntry(block, self._next_key_id)
        self._live_ids.add(entry.key_id)
        self._next_key_id += 1
        self._key_of[block] = key
        self.pool.set_owner(block, CACHE_OWNER)
        return entry

    def evict_cached(self) -> bool:
        """Give the least recently used idle cached block's page back to the pool; False if none."""
        if not self._evictable:
            return False
        block, _ = self._evictable.popitem(last=False)
        self._live_ids.discard(self._cached.pop(self._key_of.pop(block)).key_id)
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
            self._live_ids.discard(entry.key_id)
            if self._refs[entry.block] == 0:  # idle; held ones are freed by their last holder
                del self._evictable[entry.block]
                del self._refs[entry.block]
                self.pool.free([entry.block])

    def reset_prefix_cache(self) -> None:
        """Drop every idle cached block."""
        while self.evict_cached():
            pass

    def held_prefixes(self, limit: int = 4096) -> tuple[str, ...]:
        """The chunk hashes of recent prompts (most recent first, each once, at most `limit`) whose text the
        cache still holds: the chunks within each prompt's leading run of cached blocks.

        Set lookups over the blocks that cover each prompt's chunks, up to RECENT_PROMPTS prompts; a prompt's
        blocks count while their key is cached (published, not evicted or invalidated), whoever holds them."""
        held: dict[str, None] = {}  # insertion-ordered set
        live = self._live_ids
        if limit <= 0:
            return ()
        for recent in reversed(self._recent.values()):
            n = 0
            for key_id in recent.key_ids[: recent.max_blocks]:
                if key_id not in live:
                    break
                n += 1
            k = recent.chunks.covered(n * self.block_size, recent.prompt_tokens)
            for chunk_hash in recent.chunks.hashes[:k]:
                held[chunk_hash] = None
                if len(held) >= limit:
                    return tuple(held)
        return tuple(held)

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
        assert self._live_ids == {e.key_id for e in self._cached.values()}
        assert len(self._recent) <= RECENT_PROMPTS
