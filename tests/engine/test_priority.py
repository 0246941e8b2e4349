"""Priorities, aging, adapter fairness, adapter-aware admission and preemption modes in the scheduler,
with fake runner outputs (no model), plus a long randomized run checking invariants every step."""

from __future__ import annotations

import random
from collections import Counter

import torch
from test_scheduler import fake_run

from engine.core.preemption import KVSwapper
from engine.core.request import Request, RequestStatus, SamplingParams
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from loragate_common.priority import Priority

from fake_adapters import make_spec, make_tier


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(
    num_pages: int = 64,
    block_size: int = 4,
    max_adapters: int = 4,
    max_num_seqs: int = 16,
    max_batch_tokens: int = 64,
    preemption: str = "recompute",
    aging_s: float | None = 10.0,
    max_adapters_per_step: int | None = None,
    max_prefill_tokens: int | None = None,
) -> tuple[Scheduler, Clock, torch.Tensor]:
    kv, tier, cache = make_tier(num_pages, block_size, max_adapters)
    clock = Clock()
    config = SchedulerConfig(
        max_batch_tokens, max_num_seqs, 512, preemption, aging_s, max_adapters_per_step, max_prefill_tokens
    )
    return Scheduler(config, kv, (0,), tier, KVSwapper(cache), clock), clock, cache


def req(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    priority: Priority = Priority.STANDARD,
    arrival: float = 0.0,
    adapter=None,
) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    salt = sum(map(ord, rid))  # distinct prompts, so the prefix cache does not blur the accounting
    return Request(
        rid, [1 + (7 * i + salt) % 50 for i in range(prompt_len)], params, priority, adapter, arrival_time=arrival
    )


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    s.update_from_output(out, fake_run(out))
    return out


def admitted_order(s: Scheduler, limit: int = 10_000) -> list[str]:
    order: list[str] = []
    for _ in range(limit):
        if not s.has_unfinished():
            return order
        for r in step(s).requests:
            if r.request_id not in order:
                order.append(r.request_id)
    raise AssertionError("did not finish")


def test_aging_prevents_starvation() -> None:
    s, clock, _ = make(max_num_seqs=1, aging_s=5.0)
    s.add_request(req("shed", 3, priority=Priority.SHEDDABLE, arrival=0.0))
    started_at = None
    for t in range(40):  # a new critical request arrives every second, each runs ~2 steps
        clock.now = float(t)
        s.add_request(req(f"crit{t}", 3, max_tokens=2, priority=Priority.CRITICAL, arrival=clock.now))
        if any(r.request_id == "shed" for r in step(s).requests):
            started_at = clock.now
            break
    # sheddable -> standard after 5 s, -> critical after 10 s; then it is the oldest critical.
    assert started_at is not None and 10.0 <= started_at <= 12.0


def test_without_aging_sheddable_waits_for_critical_stream() -> None:
    s, clock, _ = make(max_num_seqs=1, aging_s=None)
    s.add_request(req("shed", 3, priority=Priority.SHEDDABLE, arrival=0.0))
    for t in range(30):
        clock.now = float(t)
        s.add_request(req(f"crit{t}", 3, max_tokens=2, priority=Priority.CRITICAL, arrival=clock.now))
        assert all(r.request_id != "shed" for r in step(s).requests)


def test_fairness_across_adapters() -> None:
    s, _, _ = make(max_num_seqs=1)
    hot, cold = make_spec("hot", 4), make_spec("cold", 4)
    for i in range(6):
        s.add_request(req(f"hot{i}", 3, adapter=hot, arrival=float(i)))
    s.add_request(req("cold0", 3, adapter=cold, arrival=10.0))
    s.add_request(req("base0", 3, arrival=11.0))
    order = admitted_order(s)
    assert order[:3] == ["hot0", "cold0", "base0"]  # one of each adapter before hot's second
    assert order[3:] == [f"hot{i}" for i in range(1, 6)]


def test_critical_arrival_into_full_pool_starts_within_one_step() -> None:
    for mode in ("recompute", "swap"):
        s, clock, _ = make(num_pages=10, block_size=4, preemption=mode)
        for i in range(5):
            s.add_request(req(f"std{i}", 6, max_tokens=30, arrival=float(i)))
        for _ in range(6):
            step(s)
        assert s.kv.pool.num_free <= 1 and len(s.running) >= 2  # the pool is full
        clock.now = 10.0
        s.add_request(req("crit", 6, max_tokens=3, priority=Priority.CRITICAL, arrival=10.0))
        out = step(s)
        assert "crit" in [r.request_id for r in out.requests], mode
        assert out.preempted and all(r.priority is Priority.STANDARD for r in out.preempted)
        assert s.preemption.counts[mode] > 0


def test_skip_request_whose_adapter_cannot_be_loaded() -> None:
    s, _, _ = make(max_adapters=1, max_num_seqs=8)
    a, b = make_spec("a", 4), make_spec("b", 4)
    s.add_request(req("a0", 3, max_tokens=20, adapter=a, arrival=0.0))
    step(s)  # a0 runs and pins adapter a: the single device slot
    s.add_request(req("b0", 3, adapter=b, arrival=1.0))  # b cannot come in while a is pinned
    s.add_request(req("base", 3, arrival=2.0))
    out = step(s)
    ids = [r.request_id for r in out.requests]
    assert "base" in ids and "b0" not in ids  # skipped, not blocking
    admitted_order(s)  # and b0 runs once a0 is done
    assert s.adapters.counters.evictions >= 1 and not s.has_unfinished()


def test_distinct_adapters_per_step_bound() -> None:
    s, _, _ = make(max_adapters=8, max_adapters_per_step=2)
    specs = [make_spec(f"ad{i}", 2) for i in range(5)]
    for i, spec in enumerate(specs):
        s.add_request(req(f"r{i}", 3, max_tokens=6, adapter=spec, arrival=float(i)))
    while s.has_unfinished():
        out = step(s)
        assert len({r.adapter_id for r in out.requests}) <= 2


def test_swap_keeps_computed_tokens_and_kv_contents() -> None:
    s, _, cache = make(num_pages=16, block_size=4, preemption="swap")
    victim = req("v", 9, max_tokens=8, priority=Priority.SHEDDABLE, arrival=0.0)
    s.add_request(victim)
    step(s)
    blocks = list(victim.block_ids)
    cache[:, blocks] = torch.randn_like(cache[:, blocks])  # what the forward pass would have written
    before = cache[:, blocks].clone()
    computed = victim.num_computed_tokens
    out = SchedulerOutput()
    s._preempt(victim, out)
    assert victim.swapped_kv is not None and victim.num_computed_tokens == computed
    cache.zero_()
    step(s)  # re-admitted: swapped in, then it decodes one token
    assert victim.status is RequestStatus.RUNNING and victim.swapped_kv is None
    restored = cache[:, victim.block_ids[: len(blocks)]]
    assert torch.equal(restored[:, :-1], before[:, :-1])  # full blocks back, bit for bit
    assert victim.num_computed_tokens == computed + 1


def test_auto_mode_picks_by_measured_cost() -> None:
    s, _, _ = make(preemption="auto")
    r = req("x", 8, arrival=0.0)
    s.add_request(r)
    step(s)
    s.preemption.seconds_per_token = 1.0  # recompute looks very expensive
    assert s.preemption.choose(r) == "swap"
    s.preemption.seconds_per_token = 1e-12  # recompute looks free
    assert s.preemption.choose(r) == "recompute"


def test_randomized_invariants_10k_steps() -> None:
    rng = random.Random(2024)
    s, clock, _ = make(
        num_pages=48, block_size=4, max_adapters=3, max_num_seqs=6, max_batch_tokens=24, preemption="auto", aging_s=3.0
    )
    versions = {f"ad{i}": 1 for i in range(5)}
    specs = {name: make_spec(name, rng.choice([1, 2, 4])) for name in versions}
    submitted, ended = 0, set()
    for n in range(10_000):
        clock.now = n * 0.01
        if rng.random() < 0.3:
            adapter = specs[rng.choice(sorted(specs))] if rng.random() < 0.7 else None
            s.add_request(
                req(
                    f"q{submitted}",
                    rng.randint(1, 20),
                    rng.randint(1, 10),
                    Priority(rng.randint(0, 2)),
                    clock.now,
                    adapter,
                )
            )
            submitted += 1
        if s.requests and rng.random() < 0.03:
            rid = rng.choice(sorted(s.requests))
            s.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            ended.add(rid)
        if rng.random() < 0.01:  # reload an adapter: new requests get the new version
            name = rng.choice(sorted(specs))
            versions[name] += 1
            specs[name] = make_spec(name, rng.choice([1, 2, 4]), versions[name])
            s.adapters.retire(name, keep_version=versions[name])
            s.kv.invalidate_adapter(name)
        if s.has_unfinished():
            out = s.schedule()
            ended |= {r.request_id for r in s.update_from_output(out, fake_run(out))}
        _check(s)
    while s.has_unfinished():
        out = s.schedule()
        ended |= {r.request_id for r in s.update_from_output(out, fake_run(out))}
        _check(s)
    assert ended == {f"q{i}" for i in range(submitted)}  # every request finished or was aborted
    assert s.num_preemptions > 0 and s.adapters.counters.evictions > 0
    assert s.kv.pool.num_free + s.kv.num_evictable_blocks + s.adapters.num_pages == s.kv.pool.num_pages


def _check(s: Scheduler) -> None:
    s.kv.check_invariants(s.requests.values())
    pool = s.kv.pool
    adapter_pages = sum(res.num_pages for res in s.adapters.resident.values())
    assert pool.num_run_pages == adapter_pages
    for res in s.adapters.resident.values():
        users = [
            r
            for r in s.running
            if r.adapter is not None
            and (r.adapter.adapter_id, r.adapter.version) == (res.spec.adapter_id, res.spec.version)
        ]
        assert res.pins == len(users)
    assert len(s.running) <= s.config.max_num_seqs
    # What the engine's load report and per-adapter metrics read: kept as requests come and go, never recounted.
    assert dict(s.waiting.count_by_adapter()) == Counter(r.adapter_id for r in s.waiting)
    c = s.adapters.counters
    assert (sum(c.loads_by_adapter.values()), sum(c.evictions_by_adapter.values())) == (c.loads, c.evictions)
    for r in s.running:  # a running request's adapter is on the device: pinned, never evicted
        assert r.swapped_kv is None
        assert r.adapter is None or s.adapters.is_resident(r.adapter)


def test_aged_requests_reorder_the_queue_but_never_preempt() -> None:
    s, clock, _ = make(num_pages=64, max_num_seqs=2, aging_s=1.0)
    for i in range(6):  # two run, four wait and age past every class
        s.add_request(req(f"shed{i}", 3, max_tokens=12, priority=Priority.SHEDDABLE, arrival=0.0))
    for t in range(20):
        clock.now = float(t)
        step(s)
    assert s.num_preemptions == 0  # aged sheddable work does not trade places with running sheddable work


def test_a_step_that_starts_a_critical_request_computes_nothing_of_lower_classes() -> None:
    s, clock, _ = make(max_num_seqs=8, max_batch_tokens=256)
    s.add_request(req("run", 3, max_tokens=20, priority=Priority.SHEDDABLE))
    step(s)
    clock.now = 1.0
    for i in range(4):
        s.add_request(req(f"shed{i}", 10, priority=Priority.SHEDDABLE, arrival=1.0))
    s.add_request(req("crit", 10, priority=Priority.CRITICAL, arrival=1.0))
    ids = [r.request_id for r in step(s).requests]
    assert ids == ["crit"]  # the running sheddable decode and the waiting prompts wait one step
    ids = [r.request_id for r in step(s).requests]
    assert ids == ["run", "crit", "shed0", "shed1", "shed2", "shed3"]


def test_prefill_cap_chunks_lower_class_prompts_but_not_critical_ones() -> None:
    s, clock, _ = make(num_pages=128, max_num_seqs=8, max_batch_tokens=256, max_prefill_tokens=10)
    s.add_request(req("run", 3, max_tokens=30, priority=Priority.SHEDDABLE))
    step(s)
    for i in range(3):
        s.add_request(req(f"shed{i}", 20, priority=Priority.SHEDDABLE))
    s.add_request(req("std", 25, priority=Priority.STANDARD))
    steps = [step(s) for _ in range(4)]
    for out in steps:
        assert out.requests[0].request_id == "run" and out.num_tokens[0] == 1  # the decode goes on beside
        assert sum(n for n in out.num_tokens if n > 1) <= 10
    assert [(r.request_id, n) for r, n in zip(steps[0].requests, steps[0].num_tokens, strict=True)] == [
        ("run", 1),
        ("std", 10),
    ]
    assert [(r.request_id, n) for r, n in zip(steps[2].requests, steps[2].num_tokens, strict=True)] == [
        ("run", 1),
        ("std", 5),
        ("shed0", 5),
    ]  # the standard prompt's last chunk, then the queue's next
    assert [(r.request_id, n) for r, n in zip(steps[3].requests, steps[3].num_tokens, strict=True)] == [
        ("run", 1),
        ("std", 1),
        ("shed0", 10),
    ]
    clock.now = 1.0
    s.add_request(req("crit", 40, priority=Priority.CRITICAL, arrival=1.0))
    out = step(s)  # the critical prompt whole, alone: lower classes' decodes and prompt chunks wait this step
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_tokens, strict=True)] == [("crit", 40)]
    out = step(s)
    assert [(r.request_id, n) for r, n in zip(out.requests, out.num_tokens, strict=True)] == [
        ("run", 1),
        ("std", 1),
        ("shed0", 5),
        ("crit", 1),
        ("shed1", 5),
    ]


def test_randomized_invariants_with_a_prefill_cap() -> None:
    rng = random.Random(7)
    s, clock, _ = make(
        num_pages=48,
        block_size=4,
        max_num_seqs=6,
        max_batch_tokens=24,
        preemption="auto",
        aging_s=3.0,
        max_prefill_tokens=5,
    )
    submitted, ended = 0, set()
    for n in range(3000):
        clock.now = n * 0.01
        if rng.random() < 0.3:
            s.add_request(
                req(f"q{submitted}", rng.randint(1, 30), rng.randint(1, 10), Priority(rng.randint(0, 2)), clock.now)
            )
            submitted += 1
        if s.has_unfinished():
            out = s.schedule()
            capped = [
                k
                for r, k in zip(out.requests, out.num_tokens, strict=True)
                if k > 1 and r.priority is not Priority.CRITICAL
            ]
            assert sum(capped) <= 5
            ended |= {r.request_id for r in s.update_from_output(out, fake_run(out))}
        _check(s)
    while s.has_unfinished():
        out = s.schedule()
        ended |= {r.request_id for r in s.update_from_output(out, fake_run(out))}
    assert ended == {f"q{i}" for i in range(submitted)}  # nothing starves under the cap


def test_a_critical_arrival_starts_at_once_behind_requests_aged_into_critical() -> None:
    s, clock, _ = make(num_pages=64, max_num_seqs=2, aging_s=1.0)
    for i in range(6):  # two run, four wait
        s.add_request(req(f"shed{i}", 3, max_tokens=30, priority=Priority.SHEDDABLE, arrival=0.0))
    step(s)
    clock.now = 5.0  # the waiting four have aged into the critical class
    s.add_request(req("crit", 3, priority=Priority.CRITICAL, arrival=5.0))
    out = step(s)
    assert "crit" in [r.request_id for r in out.requests] and [r.request_id for r in out.preempted] == ["shed1"]

    def aged_running() -> list:
        return [r for r in s.running if r.priority is Priority.SHEDDABLE and r.run_class == int(Priority.CRITICAL)]

    for _ in range(40):  # once the critical request is done, an aged request takes its slot, at critical class
        step(s)
        if aged_running():
            break
    aged = aged_running()
    assert aged
    clock.now = 6.0
    s.add_request(req("crit2", 3, priority=Priority.CRITICAL, arrival=6.0))
    out = step(s)  # it preempts a request running at sheddable class, never one that aged into critical
    assert all(r.run_class == int(Priority.SHEDDABLE) for r in out.preempted)
    assert aged[0] in s.running
