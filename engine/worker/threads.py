"""How many threads compute a step: as many CPUs as the process may use, fewer while it cannot get them.

torch runs each operator over an OpenMP team that splits the work evenly and waits (spinning) for its
slowest thread. When another process takes one of the CPUs (a neighbour pod, a CPU limit's quota), the
thread that shares that CPU runs at a fraction of the speed and every other thread spins waiting for it,
burning the CPU it does have: on two cores with one taken, a two-thread team ran 0.1x as fast as quiet,
where one thread alone keeps ~0.55x (bench/interference.py).

- `usable_cpus()`: the CPUs this process may run on (its affinity mask) capped by its cgroup's CPU quota
  (cgroup v2 `cpu.max`, v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`), never `os.cpu_count()`.
- `ThreadTuner` (`--threads auto`): after each step it compares the CPU time the process got with what
  its threads asked for (wall time x threads), over at least WINDOW_S of steps. A share well below 1
  means its threads are waiting for CPUs someone else holds: the team shrinks to the CPUs it really
  gets, at once. Now and then (after 15 s of engine work, doubling to 120 s while the answer stays no)
  it tries one thread more for a step and keeps it when that thread got its CPU. A probe is not free
  (a team spinning beside a busy CPU runs several times slower), hence the long and growing intervals.

One thread computes. The OpenMP runtime (libgomp) keeps a pool of worker threads for every thread that
ever ran a parallel torch operator, for as long as that thread lives, and once the pools hold more
threads than there are CPUs it stops spinning between parallel regions: each operator of the engine's
thread then waits for its workers to wake from a futex. Measured here: a small op 87 us instead of 14 us,
W1 25% slower when the model was loaded by another (still living) thread than the one that steps it, and
mixed-LoRA W1 10% slower while the adapter prefetcher's thread lived. So an engine process runs torch in
one long-lived thread (engine/core/async_engine.py loads the model in the engine thread itself), and
helper work that touches torch (reading an adapter's weights) runs on a `TransientWorker`, whose thread
computes with one torch thread (so it never starts a pool: measured, an adapter prefetch thread that did
slowed mixed-LoRA W1 by 5-8% while it read) and ends as soon as its queue is empty. The engine sets its
own thread count at every step, since `torch.set_num_threads` also changes the default that new threads
start with.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, TypeVar

import torch

logger = logging.getLogger(__name__)

_CGROUP = Path("/sys/fs/cgroup")
T = TypeVar("T")


def _quota_in(directory: Path) -> float | None:
    """The CPU quota (in CPUs) one cgroup directory sets, v2 (`cpu.max`) or v1 (`cpu.cfs_quota_us`)."""
    try:
        text = (directory / "cpu.max").read_text().split()  # "max 100000" or "150000 100000"
        return None if text[0] == "max" else int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _cgroup_dirs(root: Path, proc_cgroup: str) -> list[Path]:
    """This process's cgroup directories that may hold a CPU quota, its own and every ancestor's.

    `proc_cgroup` is /proc/self/cgroup: "0::/path" (v2) and "N:cpu,cpuacct:/path" (v1) lines. Inside a
    container the path is "/" and the mount is the container's own cgroup.
    """
    dirs = []
    for line in proc_cgroup.splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            base = root
        elif "cpu" in controllers.split(","):
            base = next((root / name for name in (controllers, "cpu,cpuacct", "cpu") if (root / name).is_dir()), root)
        else:
            continue
        parts = [p for p in path.split("/") if p]
        dirs += [base.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]
    return dirs


def quota_cpus(root: Path = _CGROUP, proc_cgroup: str | None = None) -> float | None:
    """The tightest CPU quota over this process's cgroups, in CPUs; None when none is set."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = "0::/"
    quotas = [q for d in _cgroup_dirs(root, proc_cgroup) if (q := _quota_in(d)) is not None]
    return min(quotas, default=None)


def usable_cpus(cgroup_root: Path = _CGROUP, proc_cgroup: str | None = None) -> int:
    """CPUs this process may really use: its affinity mask, capped by its cgroup quota (rounded down,
    at least 1: a team larger than the quota is throttled at the end of every period)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quota = quota_cpus(cgroup_root, proc_cgroup)
    if quota is not None:
        cpus = min(cpus, max(1, math.floor(quota)))
    return max(1, cpus)


def process_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class ThreadTuner:
    """Adapts torch's intra-op threads between 1 and `max_threads` to the CPUs the process gets.

    Call `step_started()` and `step_done()` around every engine step (the engine thread).
    `set_threads` is `torch.set_num_threads` (injectable for tests), and so are the clocks.
    """

    LOW_SHARE = 0.8  # below this, the team waits for CPUs it does not get
    WINDOW_S = 0.05  # judge shares over at least this much step time (one long step is enough)
    FIRST_PROBE_S, MAX_PROBE_S = 15.0, 120.0

    def __init__(
        self,
        max_threads: int,
        set_threads: Callable[[int], None] = torch.set_num_threads,
        cpu_clock: Callable[[], float] = process_cpu_seconds,
        wall_clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self._set = set_threads
        self._cpu, self._wall = cpu_clock, wall_clock
        self._set(self.threads)
        self._started: tuple[float, float] | None = None  # (cpu, wall) when the current step began
        self._cpu_s = self._wall_s = 0.0  # summed over the steps of the current window
        self._probing_from: int | None = None  # the thread count to return to if a probe fails
        self._busy_s = 0.0  # engine work since the last probe decision
        self._probe_every_s = self.FIRST_PROBE_S
        self.changes = 0

    def step_started(self) -> None:
        self._started = (self._cpu(), self._wall())

    def step_done(self) -> None:
        """Count the step since `step_started` (only steps: idle time between them is not measured)."""
        if self._started is None:
            return
        cpu0, wall0 = self._started
        self._started = None
        self._cpu_s += self._cpu() - cpu0
        self._wall_s += self._wall() - wall0
        if self._wall_s < self.WINDOW_S:
            return
        cpu, wall = self._cpu_s, self._wall_s
        self._cpu_s = self._wall_s = 0.0
        self._busy_s += wall
        self._judge(cpu / (wall * self.threads))

    def _judge(self, share: float) -> None:
        if self._probing_from is not None:  # a probe with one thread more: did that thread get its CPU?
            back, self._probing_from = self._probing_from, None
            if share < self.LOW_SHARE:
                self._apply(back, f"probe of {self.threads} threads got {share:.2f} of its CPU time")
                self._probe_every_s = min(self.MAX_PROBE_S, self._probe_every_s * 2)
            else:
                self._probe_every_s = self.FIRST_PROBE_S
                logger.info("compute threads: %d (the CPUs are free again)", self.threads)
            self._busy_s = 0.0
            return
        if self.threads > 1 and share < self.LOW_SHARE:
            self._apply(
                max(1, math.floor(self.threads * share + 0.25)),
                f"{self.threads} threads got {share:.2f} of the CPU time they asked for",
            )
            self._busy_s = 0.0
            return
        if self.threads < self.max_threads and self._busy_s >= self._probe_every_s:
            self._probing_from = self.threads
            self._apply(self.threads + 1, "probing whether one more CPU is free")

    def _apply(self, threads: int, why: str) -> None:
        if threads == self.threads:
            return
        logger.info("compute threads: %d -> %d (%s)", self.threads, threads, why)
        self.threads = threads
        self._set(threads)
        self.changes += 1


class TransientWorker:
    """Runs submitted calls one at a time, in order, on a thread that exists only while there is work.

    Like a one-thread ThreadPoolExecutor whose thread ends when its queue is empty (and a new one starts
    with the next call), so no idle thread keeps an OpenMP pool alive beside the engine's (see above).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._queue: deque[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]]] = deque()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[..., T], *args: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            self._queue.append((future, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name=self.name, daemon=True)
                self._thread.start()
        return future

    @property
    def alive(self) -> bool:
        with self._lock:
            return self._thread is not None

    def _work(self) -> None:
        torch.set_num_threads(1)  # run torch inline: no OpenMP pool beside the engine's
        while True:
            with self._lock:
                if not self._queue:
                    self._thread = None  # a submit from now on starts a new thread
                    return
                future, fn, args = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # handed to whoever waits on the future
                future.set_exception(exc)


def make_current(device: torch.device) -> None:
    """Make `device` the calling thread's current CUDA device (nothing to do off CUDA).

    The current device is per thread, and torch ops follow their tensors while Triton launches, CUDA graph
    captures and new streams follow the current device: an engine on `cuda:1` whose thread kept GPU 0 would run
    kernels there with GPU 1's pointers. Called by the thread that builds the engine and by the one that steps
    it (engine/core/async_engine.py)."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count()  # 0 without a GPU or with a CPU build of torch
    if count == 0:
        raise ValueError(f"--device {device}: no CUDA device is available (torch {torch.__version__})")
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {device}: this machine has {count} CUDA device(s), cuda:0 to cuda:{count - 1}")
    if device.index is not None:
        torch.cuda.set_device(device)
