"""One OpenAI request's `n` choices as engine requests, sharing the prompt's KV blocks.

With n > 1 the engine runs n sequences `{id}-0` ... `{id}-{n-1}` (n == 1: one request `{id}`). The first is
submitted alone; the others only once its first output has come, when its whole prompt has been computed
and its full prompt blocks are in the prefix cache: they attach those blocks (engine/core/memory.py) instead
of computing the prompt n times. Seeded requests use seed + i for choice i, so their draws differ and each
is reproducible. Prompt logprobs (completions' echo) are the same for every choice: only the first computes
them, unless nothing is generated (max_tokens 0), where each choice is that prompt's score.

Outputs come back interleaved as the engine produces them, tagged with their choice's index. A failure of one
choice fails the request; closing (the client left, an error) aborts every choice still running.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator

import anyio

from engine.core.async_engine import AsyncEngine, RequestFailed
from engine.core.outputs import RequestError, RequestOutput
from engine.core.request import SamplingParams
from loragate_common.prefix import PromptChunks
from loragate_common.priority import Priority

_SEED_SPAN = 2**64  # torch.Generator takes seeds in [-2**63, 2**64): past the top, wrap around


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index`'s parameters: seed + index (wrapped into the seed range); prompt logprobs only on the
    first choice when the others generate."""
    if index == 0:
        return params
    seed = params.seed
    if seed is not None:
        seed += index
        seed = seed - _SEED_SPAN if seed >= _SEED_SPAN else seed
    prompt_logprobs = params.prompt_logprobs if params.max_tokens == 0 else None
    return dataclasses.replace(params, seed=seed, prompt_logprobs=prompt_logprobs)


class Choices:
    """The engine requests behind one OpenAI request's n choices."""

    def __init__(
        self,
        engine: AsyncEngine,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        priority: Priority,
        adapter_id: str | None,
        prefix_chunks: PromptChunks | None = None,
    ) -> None:
        """Validate and create the first choice's request (ValueError, KeyError, RequestFailed as
        AsyncEngine.generate raises them); nothing runs before `first()`. Every choice carries `prefix_chunks`
        (they share the prompt)."""
        self._engine = engine
        self._args = (prompt_ids, priority, adapter_id)
        self._prefix_chunks = prefix_chunks
        self._params = params
        self.n = n
        self._ids = [request_id] if n == 1 else [f"{request_id}-{i}" for i in range(n)]
        self._its = [self._generate(0)]
        self._pumps: list[asyncio.Task[None]] = []
        self._queue: asyncio.Queue[tuple[int, RequestOutput | Exception]] = asyncio.Queue()
        self._unfinished = n

    async def first(self) -> RequestOutput:
        """The first choice's first output (its prompt computed); then the other choices are submitted."""
        out = await anext(self._its[0])
        if out.finished:
            self._unfinished -= 1
        self._its.extend(self._generate(i) for i in range(1, self.n))
        return out

    def _generate(self, index: int) -> AsyncIterator[RequestOutput]:
        prompt_ids, priority, adapter_id = self._args
        params = choice_params(self._params, index)
        return self._engine.generate(self._ids[index], prompt_ids, params, priority, adapter_id, self._prefix_chunks)

    async def next(self) -> tuple[int, RequestOutput] | None:
        """The next output after `first()`'s, as (choice index, output), interleaved as the engine produces
        them; None once every choice has finished. Raises the first failure."""
        if not self._unfinished:
            return None
        if self.n == 1:
            index, out = 0, await anext(self._its[0])
        else:
            if not self._pumps:  # the first call: every unfinished choice's outputs go into one queue
                start = 0 if self._unfinished == self.n else 1  # the first choice may have finished already
                self._pumps = [asyncio.create_task(self._pump(i, self._its[i])) for i in range(start, self.n)]
            index, item = await self._queue.get()
            if isinstance(item, Exception):
                raise _for_choice(index, item)
            out = item
        self._unfinished -= out.finished
        return index, out

    async def _pump(self, index: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                self._queue.put_nowait((index, out))
        except Exception as exc:  # RequestFailed, EngineDeadError, ValueError/KeyError from the engine thread
            self._queue.put_nowait((index, exc))

    async def aclose(self) -> None:
        """Abort every choice still running (closing an engine request's iterator aborts it)."""
        with anyio.CancelScope(shield=True):  # runs even while the caller's task is being cancelled
            for pump in self._pumps:
                pump.cancel()
            if self._pumps:
                await asyncio.wait(self._pumps)
            for it in self._its:
                aclose = getattr(it, "aclose", None)
                if aclose is not None:
                    await aclose()


def _for_choice(index: int, exc: Exception) -> Exception:
    """A failed choice's error, its message naming the choice."""
    if isinstance(exc, RequestFailed):
        return RequestFailed(RequestError(exc.type, f"choice {index}: {exc.message}"))
    return exc
