"""Iteration-level scheduler: every step, each chosen request gets a number of tokens to compute.

There are no separate prefill and decode phases (vLLM v1's idea). A request needs
`num_tokens - num_computed_tokens` tokens computed: the whole prompt at first, one token per step once it
decodes. The step's token budget (`max_batch_tokens`) is spent on running requests first, so decodes never
stall behind a long prompt; a prompt that does not fit the remaining budget is computed in chunks over
several steps (chunked prefill falls out of this).

Waiting requests are admitted in the order of `WaitingQueue` (priority with aging, fairness across
adapters, arrival). Admission brings a request's adapter onto the device (S-LoRA: its pages come from the
same pool as KV blocks) and attaches any cached KV blocks of its prompt prefix for the same adapter
version. A request whose adapter cannot be brought in this step is skipped, not allowed to block those
behind it; a request whose KV blocks do not fit stops admission, so big requests are not starved.

Preemption (engine/core/preemption.py): when the pool runs dry while running requests grow, or when a waiting
request of the best class waiting outranks running requests by class and finds no room, the running request
of the lowest class, most recently admitted, gives way, by recompute or swap. That waiting request starts in
this step even if aging put other requests ahead of it in the queue: under sustained overload, requests that
aged into the critical class must not hold a critical arrival back (they take the slots that free up).

A step computes at most `max_prefill_tokens` prompt tokens of requests below critical (chunking their prompts
over more steps), which bounds the step in progress that a critical request arriving mid-step waits for. The
step that starts a critical request computes nothing of lower classes, neither prompts nor decodes (they wait
that one step): they would make that step, and so the critical request's first token, longer.

On a CPU a step of more than 64 tokens is trimmed to a multiple of 32 by shortening its last prompt chunk (the CPU's
GEMMs pad other counts up to one: engine/model/cpu_gemm.py `step_rounding`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.memory import KVCacheManager
from engine.core.outputs import RunnerOutput
from engine.core.preemption import KVSwapper, PreemptionPolicy, pick_victim
from engine.core.request import Request, RequestStatus, TokenLogprob
from engine.core.waiting_queue import WaitingQueue
from engine.lora.device_tier import DeviceAdapterTier
from engine.lora.peft_config import AdapterKey, AdapterSpec
from loragate_common.priority import Priority


@dataclass(slots=True)
class SchedulerOutput:
    """The requests computed this step and how many new tokens each gets, in batch order."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Requests finished with an error while being scheduled (their adapter could not be loaded), and why.
    failed: list[tuple[Request, Exception]] = field(default_factory=list)
    # Whether the step computes prompt tokens of a request that arrived critical: a critical arrival does not
    # interrupt it (engine/core/llm_engine.py, step).
    critical_prompt: bool = False

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def is_empty(self) -> bool:
        return not self.requests

    def subset(self, indices: list[int]) -> SchedulerOutput:
        """The step restricted to some of its requests (a valid step: each request's computation reads
        and writes only its own rows and KV blocks)."""
        return SchedulerOutput([self.requests[i] for i in indices], [self.num_tokens[i] for i in indices])


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_tokens: int
    max_num_seqs: int
    max_model_len: int
    preemption: str = "recompute"  # recompute | swap | auto
    aging_s: float | None = 10.0  # a waiting request gains one priority class per aging_s waited
    max_adapters_per_step: int | None = None  # distinct adapters computed in one step
    # Prompt tokens one step computes for requests below critical (None: up to max_batch_tokens). It bounds the
    # step a critical request arriving mid-step waits for; critical prompts may fill max_batch_tokens.
    max_prefill_tokens: int | None = None
    # A step of more than `round_tokens_above` tokens is trimmed to a multiple of `round_tokens` where its last prompt
    # chunk allows (the rest of that prompt goes in the next step): the CPU's GEMMs pad such steps up to that multiple
    # (engine/model/cpu_gemm.py ROW_BUCKET), so padding rows would be computed for nothing. 1: no rounding.
    round_tokens: int = 1
    round_tokens_above: int = 0


@dataclass(slots=True)
class StepBudget:
    """What is left of one step: tokens, and prompt tokens for requests below critical; the lowest class of
    running request the step computes; and whether it computes a critical prompt."""

    tokens: int
    prefill: int
    worst_class: int = int(Priority.SHEDDABLE)
    critical_prompt: bool = False

    def chunk(self, request: Request) -> int:
        """How many tokens `request` computes this step (0: none, its prompt waits for a later step)."""
        n = min(request.num_tokens - request.num_computed_tokens, self.tokens)
        return min(n, self.prefill) if _capped(request, n) else n

    def spend(self, request: Request, n: int) -> None:
        self.tokens -= n
        if request.priority is Priority.CRITICAL:
            self.critical_prompt = self.critical_prompt or request.num_computed_tokens < request.num_prompt_tokens
        elif n > 1:  # _capped(request, n)
            self.prefill -= n

    def critical_only(self) -> None:
        """The step starts a critical request: it computes nothing of lower classes beside it, neither prompts
        nor decodes (they would make that step, and so its first token, longer; they wait one step)."""
        self.prefill = 0
        self.worst_class = int(Priority.CRITICAL)


def _capped(request: Request, n: int) -> bool:
    """Whether a chunk of `n` tokens is a prompt chunk under the prefill cap (a decode is one token; classes are
    the ones requests arrived with: aging orders the queue, it grants no critical privileges)."""
    return n > 1 and request.priority is not Priority.CRITICAL


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        eos_token_ids: tuple[int, ...],
        adapters: DeviceAdapterTier | None = None,
        swapper: KVSwapper | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = frozenset(eos_token_ids)
        self.adapters = adapters
        self.preemption = PreemptionPolicy(config.preemption, swapper)
        self.swapper = swapper
        self.clock = clock
        self.waiting = WaitingQueue(config.aging_s)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.adapter_loads_by_admission = 0

    # ---- queue management -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self.waiting.add(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, ...) and free its blocks. Unknown ids are ignored."""
        assert status.finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._unpin(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.kv.free(request)
        request.swapped_kv = None
        request.status = status
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- scheduling --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        prefill_cap = self.config.max_prefill_tokens or self.config.max_batch_tokens
        budget = StepBudget(self.config.max_batch_tokens, prefill_cap)
        order, contender = self._admission_order()
        if contender is not None:
            self._make_room_for(contender, out)
            if contender.priority is Priority.CRITICAL:
                budget.critical_only()
        made_room = len(out.preempted)
        self._schedule_running(out, budget)
        admitted_from = len(out.requests)
        if len(out.preempted) == made_room:  # no running request ran out of pages: admit more
            if made_room:  # the victims went back into the queue: order it again
                order, _ = self._admission_order()
            if order:
                self._schedule_waiting(out, budget, order)
        if budget.worst_class < Priority.SHEDDABLE and not any(
            r.priority is Priority.CRITICAL for r in out.requests[admitted_from:]
        ):
            # The critical request could not start after all (its pages): the lower classes go on this step.
            budget.worst_class, budget.prefill = int(Priority.SHEDDABLE), prefill_cap
            self._schedule_running(out, budget)
        out.critical_prompt = budget.critical_prompt
        self._round(out)
        return out

    def _round(self, out: SchedulerOutput) -> None:
        """Trim the step's last prompt chunk (of more tokens than it must lose, not a critical request's: its first
        token would come a step later) so the step computes a multiple of `round_tokens` (SchedulerConfig); the
        pages the chunk was given stay with its request for the next chunk."""
        multiple, total = self.config.round_tokens, out.total_tokens
        excess = total % multiple
        if multiple <= 1 or total <= self.config.round_tokens_above or excess == 0:
            return
        for i in reversed(range(len(out.requests))):
            if (
                out.num_tokens[i] > excess and out.requests[i].priority is not Priority.CRITICAL
            ):  # (a prompt chunk: > 1)
                out.num_tokens[i] -= excess
                return

    def _admission_order(self) -> tuple[list[Request], Request | None]:
        """The waiting requests in the order they may start this step, and the contender: the first request of
        the best class waiting, when it outranks a running request (by its own class: aging orders the queue
        but never preempts). The contender starts first, by preemption if need be, whatever aging put ahead of
        it; aging decides who takes the sequence slots that free up by themselves."""
        best = self.waiting.best_class()
        if best is None:
            return [], None
        outranks = any(r.run_class > best for r in self.running)
        if len(self.running) >= self.config.max_num_seqs and not outranks:
            return [], None  # nothing could start: no need to order the queue
        order = self.waiting.ordered(self.clock())
        if not outranks:
            return order, None
        contender = next(r for r in order if int(r.priority) == best)
        order.remove(contender)
        return [contender, *order], contender

    def _make_room_for(self, contender: Request, out: SchedulerOutput) -> None:
        """Preempt running requests `contender` outranks until it fits (it then starts now). Running requests
        rank by the class they were admitted at: one that aged into a class is not preempted for a request of
        that class (under a stream of critical requests it would never finish)."""
        prio = int(contender.priority)
        while not self._fits(contender):
            lower = [r for r in self.running if r.run_class > prio]
            if not lower:
                return
            self._preempt(pick_victim(lower), out)

    def _fits(self, request: Request) -> bool:
        """Whether `request` could be admitted now: a sequence slot, its first chunk's pages, its adapter."""
        if len(self.running) >= self.config.max_num_seqs:
            return False
        free = self.kv.pool.num_free + self.kv.num_evictable_blocks
        chunk = min(
            request.num_tokens - request.num_computed_tokens, max(1, self.config.max_batch_tokens - len(self.running))
        )
        need = self.kv.blocks_for(request.num_computed_tokens + chunk) - len(request.block_ids)
        if request.adapter is not None:
            tier = self._tier()
            if not tier.is_resident(request.adapter):
                if tier.idle_count() == 0 and tier.full():
                    return False
                need += tier.pages_needed(request.adapter)
                free += tier.idle_pages()
        return need <= free

    def _schedule_running(self, out: SchedulerOutput, budget: StepBudget) -> None:
        """Give running requests their tokens, in admission order (those already in `out` keep theirs)."""
        scheduled = set(out.requests) if out.requests else ()
        i = 0
        while i < len(self.running) and budget.tokens > 0:
            request = self.running[i]
            n = budget.chunk(request) if request.run_class <= budget.worst_class and request not in scheduled else 0
            if n == 0:  # a prompt chunk over the prefill cap, or a lower class than a critical start: next step
                i += 1
                continue
            preempted = False
            while not self.kv.allocate_slots(request, n):
                if self.adapters is not None and self.adapters.evict_idle():
                    continue  # idle adapter pages become KV pages
                victim = pick_victim(self.running)
                budget.tokens += self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                out.requests.append(request)
                out.num_tokens.append(n)
                budget.spend(request, n)
                i = self.running.index(request) + 1 if preempted else i + 1  # victims before i shifted the list
            # else `request` itself was preempted and running[i] is now the next one.

    def _schedule_waiting(self, out: SchedulerOutput, budget: StepBudget, order: list[Request]) -> None:
        step_adapters = {r.adapter.key for r in out.requests if r.adapter is not None}
        broken: dict[AdapterKey, Exception] = {}  # adapters whose load failed this step
        bound = self.config.max_adapters_per_step
        now = self.clock()
        for request in order:
            if budget.tokens <= 0 or len(self.running) >= self.config.max_num_seqs:
                return
            if int(request.priority) > budget.worst_class:
                continue  # the step starts a critical request: nothing of a lower class beside it
            if budget.prefill <= 0 and _capped(request, request.num_tokens - request.num_computed_tokens):
                continue  # the step's prefill cap is spent; a critical request behind may still start
            if request.adapter is not None and request.adapter.key not in step_adapters:
                if bound is not None and len(step_adapters) >= bound:
                    continue  # no more distinct adapters this step; later requests may share one
                try:
                    brought = broken.get(request.adapter.key) is None and self._bring_adapter(request.adapter)
                except Exception as exc:  # its files became unusable: its requests fail, alone
                    broken[request.adapter.key] = exc
                    brought = False
                if request.adapter.key in broken:
                    self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
                    out.failed.append((request, broken[request.adapter.key]))
                    continue
                if not brought:
                    continue  # cannot be brought in now: skip, do not block the requests behind
            n = self._admit_chunk(request, budget)
            if n is None:
                return  # the pool is short: stop here so large requests are not starved
            request.run_class = self.waiting.effective_priority(request, now)
            self.waiting.admit(request)
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            if request.adapter is not None:
                self._tier().pin(request.adapter)
                step_adapters.add(request.adapter.key)
            self.running.append(request)
            out.requests.append(request)
            out.num_tokens.append(n)
            budget.spend(request, n)
            if request.priority is Priority.CRITICAL:
                budget.critical_only()

    def _bring_adapter(self, adapter: AdapterSpec) -> bool:
        tier = self._tier()
        loads = tier.counters.loads
        ok = tier.ensure_resident(adapter)
        self.adapter_loads_by_admission += tier.counters.loads - loads
        return ok

    def _admit_chunk(self, request: Request, budget: StepBudget) -> int | None:
        """Give a waiting request its blocks (cached prefix, swapped-in copy, new ones) for its next
        chunk; the chunk's token count, or None (nothing held) if the pool is short."""
        counters = (self.kv.prefix_queries, self.kv.prefix_hits)
        if request.swapped_kv is None and request.num_computed_tokens == 0 and not request.needs_prompt_logprobs:
            # (A request still recording prompt logprobs computes its whole prompt: cached blocks give no logits.)
            self.kv.attach_cached_prefix(request)
        n = budget.chunk(request)  # >= 1: the prefill cap was checked before the prefix made the prompt shorter
        if not self.kv.allocate_slots(request, n):
            self.kv.free(request)  # the attached prefix goes back to the cache
            if request.swapped_kv is None:
                request.num_computed_tokens = 0
            # The lookup is repeated at the next admission attempt: count it once.
            self.kv.prefix_queries, self.kv.prefix_hits = counters
            return None
        if request.swapped_kv is not None:
            self._swapper().swap_in(request.swapped_kv, request.block_ids[: request.swapped_kv.shape[1]])
            request.swapped_kv = None
        return n

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Take `request` off the running list by swap or recompute; returns budget it gives back."""
        self.running.remove(request)
        self._unpin(request)
        if self.preemption.choose(request) == "swap":
            blocks = request.block_ids[: self.kv.blocks_for(request.num_computed_tokens)]
            request.swapped_kv = self._swapper().swap_out(blocks)  # num_computed_tokens is kept
        else:
            request.num_computed_tokens = 0  # prompt and outputs so far are prefilled again
        self.kv.free(request)
        self.num_preemptions += 1
        out.preempted.append(request)
        request.status = RequestStatus.WAITING
        self.waiting.add(request)
        if request not in out.requests:
            return 0
        idx = out.requests.index(request)  # already given tokens earlier in this step
        del out.requests[idx]
        return out.num_tokens.pop(idx)

    def _unpin(self, request: Request) -> None:
        if request.adapter is not None:
            self._tier().unpin(request.adapter)

    def _tier(self) -> DeviceAdapterTier:
        """The device adapter tier: a request names an adapter only on an engine that has one."""
        if self.adapters is None:
            raise RuntimeError("a request names an adapter, but the engine has no device adapter tier")
        return self.adapters

    def _swapper(self) -> KVSwapper:
        """The KV swapper: requests are swapped (out, and back in) only under a preemption mode that has one."""
        if self.swapper is None:
            raise RuntimeError("a request is swapped, but the engine has no KV swapper")
        return self.swapper

    # ---- applying results --------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply one step: record prompt logprobs, advance computed tokens, append sampled tokens (advancing the
        request's constraint by each: the only place it advances), finish by token rules (a request scoring its
        prompt, max_tokens 0, once the prompt is computed).

        Returns the requests that finished this step (their blocks are already freed).
        """
        finished: list[Request] = []
        for index, (start, entries) in result.prompt_logprobs.items():
            _record_prompt_logprobs(out.requests[index], start, entries)
        for request, n, token, logprob in zip(
            out.requests, out.num_tokens, result.sampled, result.logprobs, strict=True
        ):
            in_prompt = request.num_computed_tokens < len(request.prompt_token_ids)
            request.num_computed_tokens += n
            if in_prompt:  # prompt blocks may have filled up
                self.kv.cache_full_blocks(request)
            if token is None:
                if (
                    in_prompt
                    and request.sampling_params.max_tokens == 0
                    and request.num_computed_tokens == request.num_tokens
                ):
                    # Scoring a prompt: it ends once the prompt is computed (its logprobs recorded), with no token.
                    self.finish_request(request.request_id, RequestStatus.FINISHED_LENGTH)
                    finished.append(request)
                continue
            request.output_token_ids.append(token)
            if logprob is not None:
                request.output_logprobs.append(logprob)
            status = None
            if request.constraint is not None:  # the token is accepted: the grammar moves on
                status = _advance_constraint(request, token, token in self.eos_token_ids)
            if status is None:
                status = self._check_stop(request, token)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if num_output >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if len(request.prompt_token_ids) + num_output >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _record_prompt_logprobs(request: Request, start: int, entries: list[TokenLogprob]) -> None:
    """Append the entries of prompt positions start, start + 1, ... that `request` has not recorded yet (a chunk
    computed again after a preemption by recompute records nothing twice)."""
    recorded = len(request.prompt_logprobs)
    assert start <= recorded, f"{request.request_id}: prompt logprobs from position {start}, {recorded} recorded"
    request.prompt_logprobs.extend(entries[recorded - start :])


def _advance_constraint(request: Request, token: int, is_eos: bool) -> RequestStatus | None:
    """Advance the request's constraint by its new token (the only place it advances: once per token appended to
    the output, which preemption keeps). FINISHED_STOPPED when its grammar is complete, whatever min_tokens says:
    a constraint allows EOS only once the grammar is complete, and nothing may follow then. FINISHED_ERROR (with
    `request.error`) if the constraint fails: the request fails alone."""
    constraint = request.constraint
    assert constraint is not None
    try:
        constraint.advance(token)
        done = is_eos or constraint.is_finished()
    except Exception as exc:  # a grammar library's failure is this request's, not the engine's
        request.error = f"the request's output constraint failed on token {token}: {exc!r}"
        return RequestStatus.FINISHED_ERROR
    return RequestStatus.FINISHED_STOPPED if done else None
