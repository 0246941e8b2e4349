"""Scheduler and block-pool behaviour with fake runner outputs (no model): cheap edge cases."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from engine.core.memory import KVCacheManager, PagePool
from engine.core.outputs import RunnerOutput
from engine.core.request import Request, RequestStatus, SamplingParams, TokenLogprob
from engine.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.worker.prompt_logprobs import plan_chunk
from loragate_common.priority import Priority

EOS = 0


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    max_batch_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 256,
) -> Scheduler:
    kv = KVCacheManager(PagePool(num_blocks), block_size, enable_prefix_cache=False)
    return Scheduler(SchedulerConfig(max_batch_tokens, max_num_seqs, max_model_len, aging_s=None), kv, (EOS,))


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int = 4,
    priority: Priority = Priority.STANDARD,
    arrival: float = 0.0,
    **params: object,
) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, **params)
    return Request(rid, list(range(1, prompt_len + 1)), sp, priority, arrival_time=arrival)


def fake_token(request: Request) -> int:
    """A deterministic 'model': the next token depends only on the sequence so far."""
    return 1 + (sum(request.all_token_ids) * 31 + request.num_tokens) % 97


def fake_run(batch: SchedulerOutput) -> RunnerOutput:
    sampled = [
        fake_token(r) if r.num_computed_tokens + n == r.num_tokens else None
        for r, n in zip(batch.requests, batch.num_tokens, strict=True)
    ]
    return RunnerOutput(sampled, [None] * len(sampled))


def check_invariants(s: Scheduler) -> None:
    pool = s.kv.pool
    owners = pool.owners()
    assert pool.num_free + len(owners) == pool.num_pages  # pages conserved
    held = [b for r in s.requests.values() for b in r.block_ids]
    assert len(held) == len(set(held))  # no block owned twice
    assert sorted(held) == sorted(owners)
    for r in s.requests.values():
        assert owners.keys() >= set(r.block_ids)
        assert all(owners[b] == r.request_id for b in r.block_ids)
        assert 0 <= r.num_computed_tokens <= r.num_tokens
        assert len(r.block_ids) >= s.kv.blocks_for(r.num_computed_tokens)
    assert len(s.running) <= s.config.max_num_seqs


def run_to_completion(s: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    steps = []
    while s.has_unfinished():
        batch = s.schedule()
        assert not batch.is_empty(), "scheduler stalled with unfinished requests"
        assert batch.total_tokens <= s.config.max_batch_tokens
        s.update_from_output(batch, fake_run(batch))
        check_invariants(s)
        steps.append(batch)
        assert len(steps) < max_steps
    return steps


def test_priority_then_arrival_order() -> None:
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("late-critical", 3, priority=Priority.CRITICAL, arrival=3.0))
    s.add_request(make_request("early-standard", 3, arrival=1.0))
    s.add_request(make_request("sheddable", 3, priority=Priority.SHEDDABLE, arrival=0.0))
    s.add_request(make_request("mid-standard", 3, arrival=2.0))
    order = []
    for batch in run_to_completion(s):
        for r in batch.requests:
            if r.request_id not in order:
                order.append(r.request_id)
    assert order == ["late-critical", "early-standard", "mid-standard", "sheddable"]


def test_decodes_go_first_and_long_prompt_is_chunked() -> None:
    s = make_scheduler(max_batch_tokens=8)
    s.add_request(make_request("short", 2, max_tokens=20))
    first = s.schedule()
    s.update_from_output(first, fake_run(first))
    s.add_request(make_request("long", 30, max_tokens=2))
    chunks = []
    while "long" in s.requests and s.requests["long"].num_computed_tokens < 30:
        batch = s.schedule()
        ids = [r.request_id for r in batch.requests]
        assert ids[0] == "short" and batch.num_tokens[0] == 1  # the decode is never stalled
        chunks.append(batch.num_tokens[ids.index("long")])
        s.update_from_output(batch, fake_run(batch))
    assert chunks == [7, 7, 7, 7, 2]
    assert s.requests["long"].num_output_tokens == 1  # sampled exactly once, after the last chunk


def test_steps_are_rounded_by_trimming_their_last_prompt_chunk() -> None:
    """With round_tokens (the CPU's GEMM row bucket), a step of more than round_tokens_above tokens computes a multiple
    of round_tokens where a prompt chunk can give the excess up; the rest of that prompt comes next step, and every
    request ends with the tokens the unrounded scheduler gives it."""
    results = {}
    for multiple in (1, 8):
        kv = KVCacheManager(PagePool(256), 4, enable_prefix_cache=False)
        config = SchedulerConfig(40, 16, 256, aging_s=None, round_tokens=multiple, round_tokens_above=12)
        s = Scheduler(config, kv, (EOS,))
        rng = random.Random(7)
        requests = [make_request(f"r{i}", rng.randint(2, 30), max_tokens=rng.randint(1, 12)) for i in range(24)]
        for request in requests[:6]:
            s.add_request(request)
        steps = []
        while s.has_unfinished():
            batch = s.schedule()
            total = batch.total_tokens
            has_chunk = any(n > total % 8 and n > 1 for n in batch.num_tokens)
            if multiple > 1 and total > 12 and has_chunk:
                assert total % multiple == 0, batch.num_tokens
            s.update_from_output(batch, fake_run(batch))
            check_invariants(s)
            steps.append(total)
            if len(steps) % 3 == 0 and len(s.requests) < 24 and len(steps) // 3 + 5 < len(requests):
                s.add_request(requests[len(steps) // 3 + 5])
            assert len(steps) < 1000
        results[multiple] = ({r.request_id: r.output_token_ids for r in requests}, steps)
    assert results[8][0] == results[1][0]
    rounded = [t for t in results[8][1] if t > 12]
    assert sum(t % 8 == 0 for t in rounded) > sum(t % 8 == 0 for t in results[1][1] if t > 12)


def test_stop_conditions() -> None:
    s = make_scheduler()
    r = make_request("a", 3, max_tokens=5)
    s.add_request(r)
    run_to_completion(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 5
    # A stop token id ends it as soon as it is sampled (after min_tokens).
    s = make_scheduler()
    probe = make_request("p", 3, max_tokens=1)
    s.add_request(probe)
    run_to_completion(s)
    first = probe.output_token_ids[0]
    s = make_scheduler()
    r = make_request("b", 3, max_tokens=5, stop_token_ids=(first,))
    s.add_request(r)
    run_to_completion(s)
    assert r.status is RequestStatus.FINISHED_STOPPED and r.output_token_ids == [first]
    s = make_scheduler()
    r = make_request("c", 3, max_tokens=5, min_tokens=2, stop_token_ids=(first,))
    s.add_request(r)
    run_to_completion(s)
    assert r.num_output_tokens >= 2
    # The context length caps output too.
    s = make_scheduler(max_model_len=6)
    r = make_request("d", 4, max_tokens=50)
    s.add_request(r)
    run_to_completion(s)
    assert r.status is RequestStatus.FINISHED_LENGTH and r.num_tokens == 6


def test_preemption_by_recompute_keeps_outputs() -> None:
    reference = make_scheduler(num_blocks=256)
    tight = make_scheduler(num_blocks=12)  # 48 token slots for 6 requests of up to 18 tokens
    for s in (reference, tight):
        for i in range(6):
            s.add_request(make_request(f"r{i}", 6 + i, max_tokens=8, arrival=float(i)))
    ref_requests = dict(reference.requests)
    tight_requests = dict(tight.requests)
    run_to_completion(reference)
    steps = run_to_completion(tight)
    assert sum(len(b.preempted) for b in steps) > 0, "the pool was meant to run out"
    for rid, r in ref_requests.items():
        assert tight_requests[rid].output_token_ids == r.output_token_ids
    assert tight.kv.pool.num_free == tight.kv.pool.num_pages


def test_victim_is_lowest_priority_most_recent() -> None:
    s = make_scheduler(num_blocks=6, block_size=4)
    s.add_request(make_request("crit", 4, max_tokens=12, priority=Priority.CRITICAL, arrival=0))
    s.add_request(make_request("shed-old", 4, max_tokens=12, priority=Priority.SHEDDABLE, arrival=1))
    s.add_request(make_request("shed-new", 4, max_tokens=12, priority=Priority.SHEDDABLE, arrival=2))
    preempted = []
    for batch in run_to_completion(s):
        preempted += [r.request_id for r in batch.preempted]
    assert preempted and preempted[0] == "shed-new"
    assert "crit" not in preempted


def test_max_num_seqs_bounds_running() -> None:
    s = make_scheduler(max_num_seqs=3)
    for i in range(10):
        s.add_request(make_request(f"r{i}", 3, max_tokens=3))
    for batch in run_to_completion(s):
        assert len(batch.requests) <= 3


def test_duplicate_id_rejected_and_abort_frees_blocks() -> None:
    s = make_scheduler()
    s.add_request(make_request("x", 9))
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("x", 3))
    batch = s.schedule()
    s.update_from_output(batch, fake_run(batch))
    assert s.kv.pool.num_used > 0
    s.finish_request("x", RequestStatus.FINISHED_ABORTED)
    assert s.kv.pool.num_used == 0 and not s.has_unfinished()
    assert s.finish_request("x", RequestStatus.FINISHED_ABORTED) is None


def test_randomized_invariants_with_aborts() -> None:
    rng = random.Random(1234)
    s = make_scheduler(num_blocks=40, block_size=4, max_batch_tokens=24, max_num_seqs=8)
    submitted = finished = aborted = 0
    for step in range(3000):
        if rng.random() < 0.4 and submitted < 1000:
            s.add_request(
                make_request(
                    f"q{submitted}",
                    rng.randint(1, 30),
                    rng.randint(1, 20),
                    Priority(rng.randint(0, 2)),
                    arrival=float(step),
                )
            )
            submitted += 1
        if s.requests and rng.random() < 0.05:
            rid = rng.choice(sorted(s.requests))
            assert s.finish_request(rid, RequestStatus.FINISHED_ABORTED) is not None
            aborted += 1
        if s.has_unfinished():
            batch = s.schedule()
            assert not batch.is_empty()
            finished += len(s.update_from_output(batch, fake_run(batch)))
        check_invariants(s)
    run_to_completion(s)
    assert s.kv.pool.num_free == s.kv.pool.num_pages
    assert submitted > 500 and aborted > 10


def test_page_pool_runs_and_single_pages_share_pages() -> None:
    pool = PagePool(16)
    kv = pool.allocate(5, "req")
    assert kv == [0, 1, 2, 3, 4]  # KV blocks from the low end
    run = pool.allocate_run(6, "adapter")
    assert run == 10  # runs from the high end
    assert pool.num_free == 5 and pool.num_run_pages == 6
    assert pool.allocate_run(6, "too-big") is None  # 5 free pages left
    assert pool.allocate(5, "req2") == [5, 6, 7, 8, 9]
    with pytest.raises(MemoryError):
        pool.allocate(1, "none-left")
    pool.free([2, 3, 4])
    assert pool.allocate_run(3, "fits") == 2
    pool.free_run(10, 6)
    pool.free_run(2, 3)
    pool.free([0, 1, 5, 6, 7, 8, 9])
    assert pool.num_free == 16 and not pool.owners() and pool.num_run_pages == 0
    assert sorted(pool.allocate(16, "all")) == list(range(16))  # stale heap entries were skipped


def fake_run_scoring(batch: SchedulerOutput) -> RunnerOutput:
    """fake_run, plus prompt logprobs as the runner plans them (engine/worker/prompt_logprobs.py), each entry's
    logprob minus its position (so a misplaced entry shows), and no token for a request that only scores its
    prompt (max_tokens 0)."""
    sampled: list[int | None] = []
    scored: dict[int, tuple[int, list[TokenLogprob]]] = {}
    for i, (r, n) in enumerate(zip(batch.requests, batch.num_tokens, strict=True)):
        end = r.num_computed_tokens + n
        samples = end == r.num_tokens and (r.output_token_ids or r.sampling_params.max_tokens)
        sampled.append(fake_token(r) if samples else None)
        chunk = plan_chunk(r, i, 0, r.num_computed_tokens, end) if r.prompt_logprobs else None
        if chunk is not None:
            entries = [
                TokenLogprob(r.prompt_token_ids[q + 1], -float(q + 1), ()) for q in range(chunk.start, chunk.end)
            ]
            scored[i] = (chunk.start + 1, entries)
            SCORED_POSITIONS.update((r.request_id, q + 1) for q in range(chunk.start, chunk.end))
    return RunnerOutput(sampled, [None] * len(sampled), {}, scored)


SCORED_POSITIONS: Counter[tuple[str, int]] = Counter()  # (request id, prompt position) -> times scored


def expected_prompt_logprobs(r: Request) -> list[TokenLogprob | None]:
    return [None] + [TokenLogprob(t, -float(p), ()) for p, t in enumerate(r.prompt_token_ids) if p > 0]


def step_scoring(s: Scheduler) -> SchedulerOutput:
    batch = s.schedule()
    s.update_from_output(batch, fake_run_scoring(batch))
    s.kv.check_invariants(s.requests.values())
    return batch


@pytest.mark.parametrize("when", ["mid-prompt", "after the prompt"])
def test_prompt_logprobs_are_recorded_once_through_chunks_and_recompute(when: str) -> None:
    SCORED_POSITIONS.clear()
    s = make_scheduler(max_batch_tokens=8)
    r = make_request("r", 30, max_tokens=3, prompt_logprobs=2)
    s.add_request(r)
    step_scoring(s)
    if when == "after the prompt":
        while r.num_output_tokens == 0:
            step_scoring(s)
    assert r.prompt_logprobs == expected_prompt_logprobs(r)[: min(r.num_computed_tokens + 1, 30)]
    s._preempt(r, SchedulerOutput())  # recompute: the prompt (and output) is computed again from position 0
    assert r.num_computed_tokens == 0 and r.status is RequestStatus.WAITING
    while s.has_unfinished():
        step_scoring(s)
    assert r.prompt_logprobs == expected_prompt_logprobs(r)
    assert r.num_output_tokens == 3
    # Each position was scored once: the chunks computed again score only positions not recorded yet.
    assert all(SCORED_POSITIONS[("r", p)] == 1 for p in range(1, 30))


def test_scoring_a_prompt_finishes_once_it_is_computed_without_a_token() -> None:
    s = make_scheduler(max_batch_tokens=8)
    scored = make_request("scored", 30, max_tokens=0, prompt_logprobs=0)
    one = make_request("one-token", 1, max_tokens=0, prompt_logprobs=0)
    s.add_request(scored)
    s.add_request(one)
    finished: list[Request] = []
    steps = 0
    while s.has_unfinished():
        batch = s.schedule()
        finished += s.update_from_output(batch, fake_run_scoring(batch))
        steps += 1
    assert finished == [scored, one]
    assert scored.status is RequestStatus.FINISHED_LENGTH and scored.output_token_ids == []
    assert scored.prompt_logprobs == expected_prompt_logprobs(scored) and one.prompt_logprobs == [None]
    assert steps == 4 and s.kv.pool.num_free == s.kv.pool.num_pages  # 31 prompt tokens, 8 a step


def test_a_request_with_prompt_logprobs_computes_its_whole_prompt_despite_the_prefix_cache() -> None:
    kv = KVCacheManager(PagePool(64), 4, enable_prefix_cache=True)
    s = Scheduler(SchedulerConfig(64, 16, 256, aging_s=None), kv, (EOS,))
    first = make_request("first", 21, max_tokens=2)
    s.add_request(first)
    while s.has_unfinished():
        step_scoring(s)
    scored = make_request("scored", 21, max_tokens=2, prompt_logprobs=1)
    s.add_request(scored)
    batch = step_scoring(s)
    assert batch.num_tokens == [21] and kv.prefix_hits == 0  # no cached block: every position gives its logits
    while s.has_unfinished():
        step_scoring(s)
    assert scored.prompt_logprobs == expected_prompt_logprobs(scored)
    again = make_request("again", 21, max_tokens=2)  # the same prompt without prompt logprobs: cached blocks
    s.add_request(again)
    assert step_scoring(s).num_tokens == [1] and kv.prefix_hits == 20


class RecordingConstraint:
    """A TokenConstraint that allows everything, records what it was advanced with, and is finished after
    `length` tokens (never, for None); `fail_at` makes advance raise at that many tokens."""

    def __init__(self, length: int | None = None, fail_at: int | None = None) -> None:
        self.length, self.fail_at = length, fail_at
        self.advanced: list[int] = []

    def fill_bitmask(self, bitmask: object) -> None:
        raise AssertionError("the scheduler never fills masks")

    def advance(self, token_id: int) -> None:
        if self.fail_at is not None and len(self.advanced) == self.fail_at:
            raise RuntimeError("grammar broke")
        self.advanced.append(token_id)

    def is_finished(self) -> bool:
        return self.length is not None and len(self.advanced) >= self.length


def test_constraints_advance_once_per_token_through_preemption_and_finish_the_request() -> None:
    reference = make_scheduler(num_blocks=256)
    tight = make_scheduler(num_blocks=12)
    for s in (reference, tight):
        for i in range(6):
            # r1 and r4's grammars complete after 3 tokens, before min_tokens; r5's constraint breaks on its 2nd token.
            length = 3 if i in (1, 4) else None
            s.add_request(
                make_request(
                    f"r{i}",
                    6 + i,
                    max_tokens=8,
                    arrival=float(i),
                    min_tokens=5,
                    constraint=lambda length=length, i=i: RecordingConstraint(length, 1 if i == 5 else None),
                )
            )
    ref_requests, tight_requests = dict(reference.requests), dict(tight.requests)
    run_to_completion(reference)
    steps = run_to_completion(tight)
    assert sum(len(b.preempted) for b in steps) > 0, "the pool was meant to run out"
    for rid, r in tight_requests.items():
        assert r.output_token_ids == ref_requests[rid].output_token_ids
        assert isinstance(r.constraint, RecordingConstraint)
        if rid == "r5":
            assert r.status is RequestStatus.FINISHED_ERROR and r.error is not None and "grammar broke" in r.error
            assert r.constraint.advanced == r.output_token_ids[:1]
            continue
        assert r.constraint.advanced == r.output_token_ids  # once per token, never again after a recompute
        if rid in ("r1", "r4"):
            assert r.status is RequestStatus.FINISHED_STOPPED and r.num_output_tokens == 3
        else:
            assert r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 8
