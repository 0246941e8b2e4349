"""Runs the synchronous LLMEngine in one background thread and streams its outputs to asyncio tasks.

The HTTP event loop never blocks on a forward pass: requests and aborts cross into the engine thread
through a thread-safe inbox, and each step's outputs come back with one `call_soon_threadsafe`.

`AsyncEngine.load(config)` builds the LLMEngine in the engine thread itself, so that the thread that
steps the model is the only one in the process that ever ran torch: loading the model in the main
thread and stepping it in another costs W1 a quarter of its throughput (engine/worker/threads.py says
why). Adapter files are read and checked on a `TransientWorker` for the same reason.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.core.llm_engine import PREFIX_REPORT_S, AdapterUnusable, LLMEngine
from engine.core.outputs import AdapterStatus, RequestError, RequestOutput
from engine.core.request import SamplingParams
from engine.lora.peft_config import AdapterSpec
from engine.worker.threads import TransientWorker, make_current
from loragate_common.prefix import PromptChunks
from loragate_common.priority import Priority

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop failed or was shut down while a request was in flight.

    `reason` is the X-Loragate-Reason of the 503 it becomes: "draining" (shutting down) or
    "engine_failure" (the loop failed outside any one request's computation).
    """

    def __init__(self, message: str, reason: str = "draining") -> None:
        super().__init__(message)
        self.reason = reason


class RequestFailed(RuntimeError):
    """This request failed while the others went on (engine.core.outputs.RequestError): a 500 of `type`."""

    def __init__(self, error: RequestError) -> None:
        super().__init__(error.message)
        self.type = error.type
        self.message = error.message


@dataclass(frozen=True, slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: Priority
    adapter: AdapterSpec | None  # the version generate() resolved and checked
    arrival_time: float  # time.monotonic() when generate() accepted it: queue time includes the inbox wait
    prefix_chunks: PromptChunks | None = None  # the gateway's hashes of its prompt (Request.prefix_chunks)


@dataclass(frozen=True, slots=True)
class _Abort:
    request_id: str


@dataclass(frozen=True, slots=True)
class _RetireAdapter:
    adapter_id: str


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _RetireAdapter | None] = queue.SimpleQueue()
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = threading.Event()
        self._go = threading.Event()  # start() gave the loop: a thread made by load() may run
        # Set when a critical request is put in the inbox: the step in progress may end early (LLMEngine.step).
        self._critical_arrived = threading.Event()
        self._adapter_io = TransientWorker("adapter-load")

    @classmethod
    def load(cls, config: EngineConfig) -> AsyncEngine:
        """Start the engine thread and build the LLMEngine in it (blocks until the model is loaded and warmed up,
        LLMEngine.warm_up; the constructor's exception is raised here). The thread then waits for `start()`."""
        built: list[AsyncEngine | BaseException] = []
        ready = threading.Event()

        def main() -> None:
            try:
                engine = LLMEngine(config)
                if config.warmup:  # before the server listens: /readyz answers once the first burst runs warm
                    engine.warm_up()
                async_engine = cls(engine)
            except BaseException as exc:
                built.append(exc)
                ready.set()
                return
            async_engine._thread = threading.current_thread()
            built.append(async_engine)
            ready.set()
            async_engine._go.wait()
            if not async_engine._stopping.is_set():
                async_engine._run()

        threading.Thread(target=main, name="loragate-engine", daemon=True).start()
        ready.wait()
        if isinstance(built[0], BaseException):
            raise built[0]
        return built[0]

    @property
    def running(self) -> bool:
        return (
            self._thread is not None and self._thread.is_alive() and self._go.is_set() and not self._stopping.is_set()
        )

    async def start(self) -> None:
        if self._go.is_set():
            return
        self._loop = asyncio.get_running_loop()
        if self._thread is None:  # built by the caller: step it in a thread of our own
            self._thread = threading.Thread(target=self._run, name="loragate-engine", daemon=True)
            self._thread.start()
        self._go.set()

    async def shutdown(self) -> None:
        if self._thread is None:
            return
        self._stopping.set()
        self._go.set()  # a thread waiting for start() ends at once
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        for stream in self._streams.values():
            stream.put_nowait(EngineDeadError("the engine is shutting down"))

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: Priority = Priority.STANDARD,
        adapter_id: str | None = None,
        prefix_chunks: PromptChunks | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Validate now (LLMEngine.validate_request, the request's one check: ValueError, KeyError for an unknown
        adapter, RequestFailed for one whose weights failed to load), then stream the request's outputs; one that
        fails in the engine raises RequestFailed from the iterator. The engine thread queues it as checked here.
        `prefix_chunks`: the gateway's hashes of its prompt, kept with its cached blocks (Request.prefix_chunks).

        Closing the iterator early (client gone, task cancelled) aborts the request and frees its blocks.
        """
        try:
            adapter = self.engine.validate_request(prompt_token_ids, params, adapter_id)
        except AdapterUnusable as exc:
            raise RequestFailed(RequestError("adapter_error", str(exc))) from None
        if request_id in self._streams:
            raise ValueError(f"duplicate request id {request_id!r}")
        add = _Add(request_id, list(prompt_token_ids), params, priority, adapter, time.monotonic(), prefix_chunks)
        return self._stream(add)

    # ---- adapters -------------------------------------------------------------------------------------

    async def load_adapter(self, adapter_id: str, path: Path) -> AdapterSpec:
        """Register (or re-register, bumping the version) an adapter; AdapterError if it is unusable.

        Its weights are read and checked (finite in the engine's dtype) in a worker thread, so a broken
        adapter is refused here rather than failing its first requests; requests already running keep the
        version they started with.
        """
        spec = await asyncio.wrap_future(
            self._adapter_io.submit(self.engine.adapters.register, adapter_id, path, self.engine.verify_adapter)
        )
        self._inbox.put(_RetireAdapter(adapter_id))
        return spec

    async def register_cached(self, adapter_id: str, path: Path) -> AdapterSpec:
        """`load_adapter` for an adapter a request waits for: its weights, read once, are checked and kept in
        the host tier (LLMEngine.register_cached) rather than read to be checked and then again to be used."""
        spec = await asyncio.wrap_future(self._adapter_io.submit(self.engine.register_cached, adapter_id, path))
        self._inbox.put(_RetireAdapter(adapter_id))
        return spec

    async def unload_adapter(self, adapter_id: str) -> None:
        """Unregister an adapter (KeyError if unknown); its pages are freed once no request uses it."""
        self.forget_adapter(adapter_id)

    def forget_adapter(self, adapter_id: str) -> None:
        """`unload_adapter` from any thread (KeyError if unknown)."""
        self.engine.adapters.unregister(adapter_id)
        self._inbox.put(_RetireAdapter(adapter_id))

    def list_adapters(self) -> list[AdapterStatus]:
        return self.engine.adapter_statuses()

    async def _stream(self, add: _Add) -> AsyncIterator[RequestOutput]:
        if not self.running:
            raise EngineDeadError(
                "the engine is not running", "draining" if self._stopping.is_set() else "engine_failure"
            )
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[add.request_id] = stream
        self._inbox.put(add)
        if add.priority is Priority.CRITICAL:
            self._critical_arrived.set()
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error is not None:
                    raise RequestFailed(item.error)
                yield item
        finally:
            self._streams.pop(add.request_id, None)
            if not finished:
                self._inbox.put(_Abort(add.request_id))

    # ---- the engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        make_current(self.engine.runner.device)  # this thread steps the engine (it may not be the one that built it)
        with torch.inference_mode():  # once for the thread's life, not per step (see ModelRunner.execute)
            self._step_until_stopped()

    def _step_until_stopped(self) -> None:
        engine = self.engine
        while not self._stopping.is_set():
            block = not engine.has_unfinished_requests()
            # Cleared before the inbox is read: a critical request put there later interrupts the coming step;
            # one read now is in that step's schedule (a stale flag interrupts at most one step).
            self._critical_arrived.clear()
            if not self._drain_inbox(block):
                break
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step(self._critical_arrived)
            except Exception as exc:  # outside any one request (a request's own failure is an output)
                logger.exception("engine step failed; aborting all requests in flight")
                self._fail_all(exc)
                engine.publish_load()
                continue
            if outputs:
                self._event_loop().call_soon_threadsafe(self._dispatch, outputs)

    def _drain_inbox(self, block: bool) -> bool:
        """Apply queued adds/aborts; wait for one if `block` (up to PREFIX_REPORT_S). False when asked to stop.

        What it applied is in the load report at once: arrivals count as waiting during the coming step (which may
        be long), and aborts that leave the engine idle are not reported as running until the next request. A wait
        that ends with nothing to apply brings the report's held prefixes up to date (LLMEngine.publish_stale_prefixes):
        an idle engine reports what its last steps cached.
        """
        applied = False
        while True:
            try:
                item = self._inbox.get(block=block, timeout=PREFIX_REPORT_S if block else None)
            except queue.Empty:
                if applied:
                    self.engine.publish_load()
                elif block:
                    self.engine.publish_stale_prefixes()
                return True
            block = False
            applied = True
            if item is None:
                return False
            if isinstance(item, _Abort):
                self.engine.abort_request(item.request_id)
                continue
            if isinstance(item, _RetireAdapter):
                self.engine.retire_adapter(item.adapter_id)
                continue
            try:
                self.engine.enqueue(
                    item.request_id,
                    item.prompt_token_ids,
                    item.params,
                    item.priority,
                    item.adapter,
                    item.arrival_time,
                    item.prefix_chunks,
                )
            except ValueError as exc:  # its output constraint could not start
                self._event_loop().call_soon_threadsafe(self._fail, item.request_id, exc)

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self.engine.scheduler.requests):
            self.engine.abort_request(request_id)
            self._event_loop().call_soon_threadsafe(
                self._fail, request_id, EngineDeadError(f"engine step failed: {exc}", "engine_failure")
            )

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop of `start()`, which the engine thread hands its results to (it runs only after start)."""
        if self._loop is None:
            raise RuntimeError("the engine thread runs before start() gave it the event loop")
        return self._loop

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail(self, request_id: str, exc: BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.put_nowait(exc)
