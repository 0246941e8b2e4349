"""The prefix cache keyed by adapter version: memory-level cases with fake compute steps (no model), the
adapter tier reclaiming cached blocks for its runs, and the whole engine on tiny-random against itself
with the cache off."""

from __future__ import annotations

import itertools
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.memory import KVCacheManager, PagePool
from engine.core.request import Request, SamplingParams
from engine.lora.device_tier import DeviceAdapterTier
from engine.lora.peft_config import AdapterKey
from engine.lora.registry import AdapterRegistry, HostAdapterCache
from engine.model.attention import allocate_kv_cache

from lora_fixtures import make_peft_adapter

BS = 4
SYSTEM = list(range(100, 112))  # three full blocks


def spec(adapter_id: str, version: int = 1) -> SimpleNamespace:
    """Stands in for AdapterSpec: the cache reads only its key (id and version)."""
    return SimpleNamespace(adapter_id=adapter_id, version=version, key=AdapterKey(adapter_id, version))


def req(rid: str, tokens: list[int], adapter: SimpleNamespace | None = None) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=8, temperature=0.0), adapter=adapter)


def make_kv(num_pages: int = 64) -> KVCacheManager:
    return KVCacheManager(PagePool(num_pages), BS)


def compute(kv: KVCacheManager, r: Request, n: int | None = None) -> None:
    """One fake step for `r`: room for n more tokens (default: all), computed, full blocks published."""
    n = r.num_tokens - r.num_computed_tokens if n is None else n
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n
    kv.cache_full_blocks(r)


def admit(kv: KVCacheManager, r: Request, live: list[Request]) -> int:
    """Attach its cached prefix, compute the rest of its prompt; returns the tokens found cached."""
    hits = kv.attach_cached_prefix(r)
    compute(kv, r)
    live.append(r)
    kv.check_invariants(live)
    return hits


def finish(kv: KVCacheManager, r: Request, live: list[Request]) -> None:
    kv.free(r)
    live.remove(r)
    kv.check_invariants(live)


# ---- hits and misses -------------------------------------------------------------------------------------


def test_shared_system_prompt_same_adapter_hits() -> None:
    kv, live = make_kv(), []
    first = req("first", SYSTEM + [1, 2, 3], spec("a"))
    assert admit(kv, first, live) == 0
    assert kv.num_cached_blocks == 3  # the partial fourth block is not published
    second = req("second", SYSTEM + [7, 8], spec("a"))
    assert kv.attach_cached_prefix(second) == 12
    assert second.num_computed_tokens == 12
    assert second.block_ids == first.block_ids[:3]
    live.append(second)
    kv.check_invariants(live)  # the three shared blocks have refcount 2
    compute(kv, second)
    assert second.block_ids[3] != first.block_ids[3]  # its own tail block
    assert (kv.prefix_queries, kv.prefix_hits) == (15 + 14, 12)
    kv.check_invariants(live)


def test_last_token_is_never_attached() -> None:
    kv, live = make_kv(), []
    admit(kv, req("a", SYSTEM), live)  # 12 tokens, 3 full blocks
    same = req("same", SYSTEM)
    assert kv.attach_cached_prefix(same) == 8  # the block of the last token is recomputed
    live.append(same)
    compute(kv, same)
    assert same.block_ids[2] != live[0].block_ids[2]
    kv.check_invariants(live)
    # Preempted by recompute after two outputs: the last token is an output, so all 3 prompt blocks hit.
    again = req("again", SYSTEM)
    again.output_token_ids = [5, 6]
    assert kv.attach_cached_prefix(again) == 12
    live.append(again)
    kv.check_invariants(live)
    short = req("short", SYSTEM[:3])  # shorter than a block
    assert admit(kv, short, live) == 0 and kv.num_cached_blocks == 3


@pytest.mark.parametrize(
    "first, second",
    [
        (None, spec("a")),
        (spec("a"), None),
        (spec("a"), spec("b")),
        (spec("a", 1), spec("a", 2)),
    ],
    ids=["base-then-adapter", "adapter-then-base", "two-adapters", "two-versions"],
)
def test_no_hit_across_adapters_or_versions(first, second) -> None:
    kv, live = make_kv(), []
    admit(kv, req("x", SYSTEM + [1], first), live)
    assert admit(kv, req("y", SYSTEM + [1], second), live) == 0
    assert kv.num_cached_blocks == 6  # both published their own copies
    assert admit(kv, req("z", SYSTEM + [2], first), live) == 12
    assert admit(kv, req("w", SYSTEM + [2], second), live) == 12


def test_no_hit_after_invalidate_adapter() -> None:
    kv, live = make_kv(16), []
    a_idle = req("a-idle", SYSTEM + [1], spec("a", 1))
    admit(kv, a_idle, live)
    finish(kv, a_idle, live)  # its 3 full blocks stay cached, idle
    a_held = req("a-held", [9] * 8 + [1], spec("a", 2))
    base = req("base", SYSTEM + [1])
    admit(kv, a_held, live)
    admit(kv, base, live)
    held_blocks = list(a_held.block_ids)
    assert kv.num_cached_blocks == 3 + 2 + 3 and kv.pool.num_free == 16 - 3 - 3 - 4
    kv.invalidate_adapter("a")
    kv.check_invariants(live)
    assert kv.num_cached_blocks == 3  # only the base model's
    assert kv.pool.num_free == 16 - 3 - 4  # the idle blocks came back; held ones stay with their request
    assert admit(kv, req("a1", SYSTEM + [2], spec("a", 1)), live) == 0
    assert admit(kv, req("a2", [9] * 8 + [2], spec("a", 2)), live) == 0
    assert admit(kv, req("b", SYSTEM + [2]), live) == 12
    finish(kv, a_held, live)  # no longer cached: its pages go straight back to the pool
    assert not set(held_blocks) & set(kv.pool.owners())


def test_partial_blocks_chunks_and_outputs() -> None:
    kv, live = make_kv(), []
    r = req("r", SYSTEM[:10])  # two full blocks and a partial one
    compute(kv, r, 5)  # a chunk ending inside block 1 publishes only block 0
    live.append(r)
    kv.check_invariants(live)
    assert kv.num_cached_blocks == 1
    assert kv.attach_cached_prefix(probe := req("p1", SYSTEM[:10])) == 4
    kv.free(probe)
    compute(kv, r)
    assert kv.num_cached_blocks == 2
    for token in range(10):  # decoding fills blocks 2 and 3 with outputs, which are never published
        r.output_token_ids.append(token)
        compute(kv, r)
    assert kv.num_cached_blocks == 2 and len(r.block_ids) == 5
    kv.check_invariants(live)
    # A prompt that diverges inside block 1 shares only block 0.
    assert admit(kv, req("diverge", SYSTEM[:6] + [0] * 6), live) == 4


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_three_sharers_free_in_any_order(order: tuple[int, ...]) -> None:
    kv, live = make_kv(32), []
    sharers = [req(f"s{i}", SYSTEM + [i, i, i], spec("a")) for i in range(3)]
    for i, r in enumerate(sharers):
        assert admit(kv, r, live) == (0 if i == 0 else 12)
    shared = sharers[0].block_ids[:3]
    assert all(r.block_ids[:3] == shared for r in sharers)
    private = [b for r in sharers for b in r.block_ids[3:]]
    assert len(set(private)) == 3
    for i in order:
        finish(kv, sharers[i], live)
        assert all(b in kv.pool.owners() for b in shared)  # never freed while one holder is left
    assert kv.pool.num_free == 32 - 3 and kv.num_evictable_blocks == 3
    kv.reset_prefix_cache()
    kv.check_invariants([])
    assert kv.pool.num_free == 32 and kv.num_cached_blocks == 0


# ---- eviction and reclaim --------------------------------------------------------------------------------


def test_lru_eviction_order_when_the_pool_is_short() -> None:
    kv, live = make_kv(8), []
    old, new = req("old", [1] * 8 + [0]), req("new", [2] * 8 + [0])
    for r in (old, new):
        admit(kv, r, live)
    new_blocks = new.block_ids[:2]  # the two full, published ones
    finish(kv, old, live)
    finish(kv, new, live)
    assert kv.pool.num_free == 4 and kv.num_evictable_blocks == 4
    # Touch "old" again: attaching and freeing makes its blocks the most recently used.
    touch = req("touch", [1] * 8 + [5])
    assert kv.attach_cached_prefix(touch) == 8
    kv.free(touch)
    # LRU: new's tail, new's head, old's tail, old's head. Nothing changes if even all would not do.
    big = req("big", [3] * 36)
    before = kv.pool.owners()
    assert not kv.allocate_slots(big, 36) and kv.pool.owners() == before
    needs_six = req("six", [3] * 24)
    assert kv.allocate_slots(needs_six, 24)
    live.append(needs_six)
    kv.check_invariants(live)
    assert set(needs_six.block_ids) >= set(new_blocks)
    assert kv.attach_cached_prefix(req("n", [2] * 8 + [0])) == 0
    assert kv.num_evictable_blocks == 2
    assert kv.evict_cached() is True  # old's tail goes before its head
    assert kv.attach_cached_prefix(probe := req("o", [1] * 8 + [0])) == 4
    kv.free(probe)
    assert kv.evict_cached() is True and kv.evict_cached() is False
    kv.check_invariants(live)


def test_check_invariants_catches_a_block_held_without_its_refcount() -> None:
    kv, live = make_kv(), []
    a = req("a", [1, 2, 3, 4, 5])
    admit(kv, a, live)
    b = req("b", [6])
    b.block_ids = [a.block_ids[1]]  # a private block taken without the manager
    with pytest.raises(AssertionError):
        kv.check_invariants([a, b])


def test_adapter_run_reclaims_cached_blocks(tiny_model_config, tiny_adapters) -> None:
    mc = tiny_model_config
    registry = AdapterRegistry(mc)
    specs = [registry.register(name, tiny_adapters[name]) for name in ("qv-r8", "all-r4")]

    def tier_over(pool: PagePool, kv: KVCacheManager | None) -> DeviceAdapterTier:
        cache = allocate_kv_cache(mc, pool.num_pages, BS, torch.float32, torch.device("cpu"))
        return DeviceAdapterTier(
            pool,
            cache,
            mc,
            4,
            HostAdapterCache(1 << 30, mc, torch.float32),
            reclaim=None if kv is None else kv.evict_cached,
        )

    probe = tier_over(PagePool(1), None)
    specs.sort(key=probe.pages_needed, reverse=True)  # evicting the first then frees room for the second
    pages = [probe.pages_needed(s) for s in specs]
    num_pages = pages[0] + pages[1] + 3
    for with_reclaim in (False, True):
        pool = PagePool(num_pages)
        kv = KVCacheManager(pool, BS)
        tier = tier_over(pool, kv if with_reclaim else None)
        assert tier.ensure_resident(specs[0])
        tier.pin(specs[0])
        # Fill every other page with idle cached blocks, scattered in LRU order.
        fillers = [req(f"f{i}", [i + 1] * BS * (1 + i % 3)) for i in range(num_pages)]
        live: list[Request] = []
        for r in fillers:
            if pool.num_free < kv.blocks_for(r.num_prompt_tokens):
                break
            admit(kv, r, live)
        for r in fillers[::2] + fillers[1::2]:
            if r in live:
                finish(kv, r, live)
        assert pool.num_free < pages[1] and kv.num_evictable_blocks > 0
        tier.unpin(specs[0])
        evictable = kv.num_evictable_blocks
        assert tier.ensure_resident(specs[1])
        kv.check_invariants(live)
        if with_reclaim:
            assert tier.is_resident(specs[0]) and tier.counters.evictions == 0  # the cache paid
            assert 0 < evictable - kv.num_evictable_blocks
        else:
            assert not tier.is_resident(specs[0]) and tier.counters.evictions == 1
            assert kv.num_evictable_blocks == evictable


# ---- randomized ------------------------------------------------------------------------------------------


def test_randomized_operations_keep_invariants_and_contents() -> None:
    """~2000 random operations; every op checks the invariants, and every attach checks that the KV
    contents it reuses (tracked per page as (adapter key, tokens written so far)) are exactly its own."""
    rng = random.Random(2024)
    pool = PagePool(48)
    kv = KVCacheManager(pool, BS)
    versions = {"a": 1, "b": 1}
    systems = [[rng.randrange(1, 50) for _ in range(rng.choice([4, 9, 13]))] for _ in range(3)]
    contents: dict[int, tuple] = {}  # page -> (adapter key, the tokens whose K/V it holds, from 0)
    live: list[Request] = []
    runs: list[tuple[int, int]] = []
    hits = attaches = 0

    def key_of(r: Request) -> tuple | None:
        return None if r.adapter is None else (r.adapter.adapter_id, r.adapter.version)

    def step(r: Request, n: int) -> bool:
        if not kv.allocate_slots(r, n):
            return False
        owners = pool.owners()
        start, end = r.num_computed_tokens, r.num_computed_tokens + n
        for index in range(start // BS, kv.blocks_for(end)):
            block = r.block_ids[index]
            assert owners[block] == r.request_id, "writing into a block that may be shared"
            contents[block] = (key_of(r), tuple(r.all_token_ids[: min(end, (index + 1) * BS)]))
        r.num_computed_tokens = end
        kv.cache_full_blocks(r)
        return True

    for op in range(2000):
        choice = rng.random()
        if choice < 0.25 and len(live) < 12:
            name = rng.choice([None, "a", "b"])
            adapter = None if name is None else spec(name, versions[name])
            prompt = rng.choice(systems) + [rng.randrange(1, 50) for _ in range(rng.randrange(0, 9))]
            r = req(f"r{op}", prompt, adapter)
            if rng.random() < 0.2:
                r.output_token_ids = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 6))]
            found = kv.attach_cached_prefix(r)
            attaches += 1
            hits += found > 0
            assert found % BS == 0 and found < r.num_tokens
            for index, block in enumerate(r.block_ids):
                assert contents[block] == (key_of(r), tuple(prompt[: (index + 1) * BS]))
            live.append(r)
            if not step(r, rng.randint(1, r.num_tokens - r.num_computed_tokens)):
                kv.free(r)
                live.remove(r)
        elif choice < 0.6 and live:
            r = rng.choice(live)
            if r.num_computed_tokens == r.num_tokens:
                r.output_token_ids.append(rng.randrange(1, 50))
            step(r, rng.randint(1, r.num_tokens - r.num_computed_tokens))
        elif choice < 0.75 and live:
            r = rng.choice(live)
            kv.free(r)
            live.remove(r)
        elif choice < 0.82:
            kv.evict_cached()
        elif choice < 0.85:
            name = rng.choice(["a", "b"])
            kv.invalidate_adapter(name)
            if rng.random() < 0.7:
                versions[name] += 1  # a reload; otherwise the same version may be cached again
        elif choice < 0.95:
            n = rng.randint(1, 6)
            start = pool.allocate_run(n, "adapter:x")
            while start is None and kv.evict_cached():
                start = pool.allocate_run(n, "adapter:x")
            if start is not None:
                runs.append((start, n))
        elif runs:
            pool.free_run(*runs.pop(rng.randrange(len(runs))))
        kv.check_invariants(live)
    assert hits > 50 and attaches > 200
    for r in list(live):
        kv.free(r)
    for run in runs:
        pool.free_run(*run)
    kv.reset_prefix_cache()
    kv.check_invariants([])
    assert pool.num_free == pool.num_pages and kv.num_cached_blocks == 0


# ---- the whole engine ------------------------------------------------------------------------------------

NEW_TOKENS = 6
_ids = itertools.count()


@pytest.fixture(scope="module")
def two_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("prefix-adapters")
    make_peft_adapter(tiny_model_dir, root / "a", r=4, alpha=8, targets="all-linear", seed=1, b_std=0.3)
    make_peft_adapter(tiny_model_dir, root / "b", r=8, alpha=16, targets=["q_proj", "v_proj"], seed=2, b_std=0.3)
    return root


@pytest.fixture(scope="module")
def system_prompt() -> list[int]:
    rng = random.Random(11)
    return [rng.randrange(3, 250) for _ in range(37)]


def make_engine(adapter_dir: Path, enable: bool = True) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            dtype="float32", model="tiny-random", adapter_dir=str(adapter_dir), block_size=8, enable_prefix_cache=enable
        )
    )


def run(engine: LLMEngine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Submit the jobs together and step to completion, checking the cache invariants every step."""
    params = SamplingParams(max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(f"j{next(_ids)}", prompt, params, adapter_id=adapter) for prompt, adapter in jobs]
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.scheduler.kv.check_invariants(engine.scheduler.requests.values())
        steps += 1
        assert steps < 1000
    return [r.output_token_ids for r in requests]


def test_engine_outputs_same_with_and_without_cache(two_adapters, system_prompt) -> None:
    first = [(system_prompt + [5, 6, 7], name) for name in (None, "a", "b")]
    rest = [
        (system_prompt + suffix, name) for suffix in ([9], [10, 11, 12, 13, 14], [15] * 12) for name in (None, "a", "b")
    ]
    outputs = {}
    for enable in (False, True):
        engine = make_engine(two_adapters, enable)
        outputs[enable] = run(engine, first) + run(engine, rest)
        kv = engine.scheduler.kv
        if enable:
            # Every request of the second wave found the system prompt's 4 full blocks of 8 tokens.
            assert kv.prefix_hits == len(rest) * 32
        else:
            assert kv.prefix_hits == 0 and kv.num_cached_blocks == 0
            assert engine.pool.num_free == engine.pool.num_pages - engine.device_adapters.num_pages
    assert outputs[True] == outputs[False]
    # Not vacuous: the three adapters give three different continuations of the same prompt.
    assert len({tuple(o) for o in outputs[True][:3]}) == 3


def test_engine_hits_only_for_the_same_adapter(two_adapters, system_prompt) -> None:
    engine = make_engine(two_adapters)
    kv = engine.scheduler.kv
    prompt = system_prompt + [1, 2]
    run(engine, [(prompt, "a")])
    assert kv.prefix_hits == 0 and kv.num_cached_blocks == 4
    for other in ("b", None):
        run(engine, [(prompt, other)])
        assert kv.prefix_hits == 0
    assert kv.num_cached_blocks == 12
    for name in ("a", "b", None):
        hits = kv.prefix_hits
        run(engine, [(prompt, name)])
        assert kv.prefix_hits == hits + 32


def test_engine_reregistered_adapter_does_not_reuse_old_blocks(two_adapters, system_prompt) -> None:
    engine = make_engine(two_adapters)
    kv = engine.scheduler.kv
    prompt = system_prompt + [3]
    before = run(engine, [(prompt, "a"), (prompt, None)])
    assert kv.num_cached_blocks == 8
    spec = engine.adapters.register("a", two_adapters / "a")  # same files, new version
    engine.retire_adapter("a")
    assert spec.version == 2
    assert kv.num_cached_blocks == 4  # the old version's blocks are gone, the base model's stay
    hits = kv.prefix_hits
    after = run(engine, [(prompt, "a")])
    assert kv.prefix_hits == hits  # recomputed, not reused
    assert after == before[:1]  # same weights, same tokens
    run(engine, [(prompt, None)])
    assert kv.prefix_hits == hits + 32
