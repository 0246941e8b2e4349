"""Iteration-level scheduler: every step, each chosen request gets a number of tokens to compute.

There are no separate prefill and decode phases (vLLM v1's idea). A request needs
`num_tokens - num_computed_tokens` tokens computed: the whole prompt at first, one token per step once it
decodes. The step's token budget (`max_batch_tokens`) is spent on running requests first, so decodes never
stall behind a long prompt; a prompt that does not fit the remaining budget is computed in chunks over
several steps (chunked prefill falls out of this).

When the KV pool runs dry, the most recently admitted running request of the lowest priority is preempted:
its blocks are freed and it goes back to the front of the waiting queue to be recomputed later.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engine.lora import DeviceAdapterTier
from engine.memory import KVCacheManager
from engine.outputs import RunnerOutput
from engine.request import Request, RequestStatus


@dataclass(slots=True)
class SchedulerOutput:
    """The requests computed this step and how many new tokens each gets, in batch order."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    def is_empty(self) -> bool:
        return not self.requests


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_batch_tokens: int
    max_num_seqs: int
    max_model_len: int


def _queue_key(request: Request) -> tuple[int, float]:
    return (int(request.priority), request.arrival_time)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager,
                 eos_token_ids: tuple[int, ...], adapters: DeviceAdapterTier | None = None) -> None:
        self.config = config
        self.kv = kv
        self.adapters = adapters
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: list[Request] = []  # sorted by (priority, arrival)
        self.running: list[Request] = []  # in admission order
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        keys = [_queue_key(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(keys, _queue_key(request)), request)

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
        request.status = status
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- scheduling --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_batch_tokens
        budget = self._schedule_running(out, budget)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            while not self.kv.allocate_slots(request, n):
                if self.adapters is not None and self.adapters.evict_idle():
                    continue  # idle adapter pages become KV pages
                victim = self._pick_victim()
                budget += self._preempt(victim, out)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                out.requests.append(request)
                out.num_tokens.append(n)
                budget -= n
                i = self.running.index(request) + 1  # victims before i shifted the list
            # else `request` itself was preempted and running[i] is now the next one.
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if request.adapter is not None and not self.adapters.ensure_resident(request.adapter):
                break  # its adapter cannot be brought onto the device until running requests finish
            if not self.kv.allocate_slots(request, n):
                break
            self.waiting.pop(0)
            request.status = RequestStatus.RUNNING
            if request.adapter is not None:
                self.adapters.pin(request.adapter)
            self.running.append(request)
            out.requests.append(request)
            out.num_tokens.append(n)
            budget -= n

    def _pick_victim(self) -> Request:
        """The lowest-priority running request, the most recently admitted among equals."""
        return max(reversed(self.running), key=lambda r: int(r.priority))

    def _preempt(self, request: Request, out: SchedulerOutput) -> int:
        """Free `request`'s blocks and requeue it for recompute; returns budget it gives back."""
        self.running.remove(request)
        self._unpin(request)
        self.kv.free(request)
        self.num_preemptions += 1
        request.num_computed_tokens = 0  # recompute: prompt and outputs so far are prefilled again
        out.preempted.append(request)
        self._enqueue(request)
        if request not in out.requests:
            return 0
        idx = out.requests.index(request)  # already given tokens earlier in this step
        del out.requests[idx]
        return out.num_tokens.pop(idx)

    def _unpin(self, request: Request) -> None:
        if request.adapter is not None:
            self.adapters.unpin(request.adapter)

    # ---- applying results --------------------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput, result: RunnerOutput) -> list[Request]:
        """Apply one step: advance computed tokens, append sampled tokens, finish by token rules.

        Returns the requests that finished this step (their blocks are already freed).
        """
        finished: list[Request] = []
        for request, n, token, logprob in zip(out.requests, out.num_tokens, result.sampled,
                                               result.logprobs):
            request.num_computed_tokens += n
            if token is None:
                continue
            request.output_token_ids.append(token)
            if logprob is not None:
                request.output_logprobs.append(logprob)
            status = self._check_stop(request, token)
            if status is not None:
                self.finish_request(request.request_id, status)
                finished.append(request)
        return finished

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
