"""Compute threads (engine/worker/threads.py): the CPUs a process may use (affinity mask and cgroup quota,
v1 and v2, read from fake cgroup trees), the tuner's decisions on scripted CPU and wall clocks, and, on a
two-CPU machine, the tuner shrinking a real engine's team beside a real CPU hog; the helper thread that
ends when idle, and an engine loaded in its own thread (AsyncEngine.load) computing what a synchronous
engine computes."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.worker.threads import ThreadTuner, TransientWorker, make_current, quota_cpus, usable_cpus
from loragate.cli import build_parser

from polling import poll


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_quota_from_cgroup_v2_and_v1_files(tmp_path: Path) -> None:
    v2 = _tree(tmp_path / "v2", {"cpu.max": "max 100000", "pod/cpu.max": "150000 100000"})
    assert quota_cpus(v2, "0::/") is None
    assert quota_cpus(v2, "0::/pod") == 1.5  # its own group's limit
    v1 = _tree(
        tmp_path / "v1",
        {
            "cpu,cpuacct/cpu.cfs_quota_us": "-1",
            "cpu,cpuacct/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/kube/pod/cpu.cfs_quota_us": "250000",
            "cpu,cpuacct/kube/pod/cpu.cfs_period_us": "100000",
            "cpu,cpuacct/kube/cpu.cfs_quota_us": "100000",
            "cpu,cpuacct/kube/cpu.cfs_period_us": "100000",
        },
    )
    assert quota_cpus(v1, "4:cpu,cpuacct:/kube/pod\n3:memory:/kube/pod") == 1.0  # the tighter ancestor
    assert quota_cpus(v1, "4:cpu,cpuacct:/") is None
    assert quota_cpus(tmp_path / "none", "0::/") is None


def test_usable_cpus_is_the_affinity_mask_capped_by_the_quota(tmp_path: Path) -> None:
    mask = len(os.sched_getaffinity(0))
    assert usable_cpus(tmp_path / "none", "0::/") == mask
    half = _tree(tmp_path / "q", {"cpu.max": "50000 100000"})
    assert usable_cpus(half, "0::/") == 1  # never below one
    if mask >= 2:
        assert usable_cpus(_tree(tmp_path / "big", {"cpu.max": f"{mask * 200000} 100000"}), "0::/") == mask


class Clocks:
    """Scripted clocks: each step lasts `wall` seconds and the process gets `cpu` seconds of CPU in it."""

    def __init__(self) -> None:
        self.cpu_s = self.wall_s = 0.0

    def step(self, tuner: ThreadTuner, wall: float, cpu_share: float) -> None:
        tuner.step_started()
        self.wall_s += wall
        self.cpu_s += wall * tuner.threads * cpu_share
        tuner.step_done()


def _tuner(max_threads: int, clocks: Clocks, calls: list[int]) -> ThreadTuner:
    return ThreadTuner(
        max_threads, set_threads=calls.append, cpu_clock=lambda: clocks.cpu_s, wall_clock=lambda: clocks.wall_s
    )


def test_the_tuner_shrinks_the_team_to_the_cpus_it_gets_and_probes_back_later() -> None:
    clocks, calls = Clocks(), []
    tuner = _tuner(2, clocks, calls)
    assert calls == [2]
    for _ in range(5):  # quiet: every thread gets its CPU
        clocks.step(tuner, 0.1, 1.0)
    assert tuner.threads == 2 and tuner.changes == 0
    clocks.step(tuner, 0.5, 0.53)  # a hog took a CPU: two threads got ~1.06 CPUs
    assert tuner.threads == 1 and calls[-1] == 1
    for _ in range(int(ThreadTuner.FIRST_PROBE_S / 0.1) - 1):  # no probe before FIRST_PROBE_S of work
        clocks.step(tuner, 0.1, 1.0)
    assert tuner.threads == 1
    clocks.step(tuner, 0.2, 1.0)  # now it probes one thread more
    assert tuner.threads == 2
    clocks.step(tuner, 0.5, 0.55)  # the hog is still there: back to one, the next probe twice as far
    assert tuner.threads == 1
    for _ in range(int(ThreadTuner.FIRST_PROBE_S / 0.1) + 5):
        clocks.step(tuner, 0.1, 1.0)
    assert tuner.threads == 1  # 15 s more is not yet 30 s
    for _ in range(int(ThreadTuner.FIRST_PROBE_S / 0.1)):
        clocks.step(tuner, 0.1, 1.0)
    assert tuner.threads == 2  # probing
    clocks.step(tuner, 0.1, 0.98)  # the hog left: the probe's thread got its CPU
    assert tuner.threads == 2
    for _ in range(20):
        clocks.step(tuner, 0.1, 1.0)
    assert tuner.threads == 2 and calls == [2, 1, 2, 1, 2]


def test_short_steps_are_judged_together_and_many_cpus_shrink_in_proportion() -> None:
    clocks, calls = Clocks(), []
    tuner = _tuner(8, clocks, calls)
    for _ in range(4):  # 4 x 10 ms is under WINDOW_S: not judged yet
        clocks.step(tuner, 0.01, 0.5)
    assert tuner.threads == 8
    clocks.step(tuner, 0.02, 0.5)  # 60 ms at half the CPU asked for: 8 threads got 4 CPUs
    assert tuner.threads == 4


@pytest.mark.parametrize("value, expected", [("auto", "auto"), ("3", 3)])
def test_threads_flag(value: str, expected: object) -> None:
    assert build_parser().parse_args(["engine", "--model", "tiny-random", "--threads", value]).num_threads == expected
    assert build_parser().parse_args(["engine", "--model", "tiny-random"]).num_threads == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["engine", "--model", "tiny-random", "--threads", "0"])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) != 2, reason="the scenario is one of two CPUs taken")
def test_a_real_engine_beside_a_cpu_hog_computes_with_one_thread() -> None:
    threads = torch.get_num_threads()
    spin = f"import os\nos.sched_setaffinity(0, {{{max(os.sched_getaffinity(0))}}})\nwhile True:\n    pass\n"
    hog = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.3)
        engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", num_threads="auto", max_model_len=1024))
        assert engine.threads is not None and engine.threads.threads == 2
        params = SamplingParams(max_tokens=200, min_tokens=200, temperature=0.0, ignore_eos=True)
        for i in range(16):
            engine.add_request(f"r{i}", list(range(5, 300)), params)
        while engine.has_unfinished_requests() and engine.threads.threads == 2:
            engine.step()
        assert engine.threads.threads == 1 and torch.get_num_threads() == 1
    finally:
        hog.kill()
        hog.wait()
        torch.set_num_threads(threads)


# ---- one thread computes: the transient helper thread, and the engine built in its own thread -----------


def test_transient_worker_runs_in_order_and_its_thread_ends_when_idle() -> None:
    worker = TransientWorker("helper")
    gate = threading.Event()
    seen: list[tuple[int, str]] = []

    def job(i: int) -> int:
        gate.wait(10)
        seen.append((i, threading.current_thread().name))
        return i * i

    futures = [worker.submit(job, i) for i in range(5)]
    assert worker.alive  # one thread while there is work
    gate.set()
    assert [f.result(10) for f in futures] == [0, 1, 4, 9, 16]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4] and {name for _, name in seen} == {"helper"}
    poll(lambda: not worker.alive, timeout_s=10, what="the helper thread's end")
    assert not any(t.name == "helper" for t in threading.enumerate())
    assert worker.submit(torch.get_num_threads).result(10) == 1  # helpers never start an OpenMP pool
    failed = worker.submit(lambda: 1 / 0)  # a new thread for new work; an exception goes to the caller
    with pytest.raises(ZeroDivisionError):
        failed.result(10)
    poll(lambda: not worker.alive, timeout_s=10, what="the second helper thread's end")


def test_an_engine_loaded_in_its_own_thread_serves_what_a_synchronous_one_computes() -> None:
    config = EngineConfig(dtype="float32", model="tiny-random", max_model_len=256, num_threads=2)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [list(range(5, 5 + n)) for n in (3, 9, 17)]
    reference = LLMEngine(config)
    for i, prompt in enumerate(prompts):
        reference.add_request(f"r{i}", prompt, params)
    expected: dict[str, list[int]] = {}
    while reference.has_unfinished_requests():
        for out in reference.step():
            expected.setdefault(out.request_id, []).extend(out.new_token_ids)

    async_engine = AsyncEngine.load(config)
    built_in = async_engine._thread
    assert built_in is not None and built_in is not threading.current_thread() and built_in.name == "loragate-engine"
    assert not async_engine.running  # loaded, waiting for start()

    async def scenario() -> dict[str, list[int]]:
        await async_engine.start()

        async def one(i: int, prompt: list[int]) -> list[int]:
            return [
                t
                for out in [o async for o in async_engine.generate(f"r{i}", prompt, params)]
                for t in out.new_token_ids
            ]

        try:
            got = await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        finally:
            await async_engine.shutdown()
        return {f"r{i}": tokens for i, tokens in enumerate(got)}

    assert asyncio.run(scenario()) == expected
    assert not built_in.is_alive()


def test_whichever_thread_steps_an_engine_computes_with_its_thread_count() -> None:
    main_threads = torch.get_num_threads()
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", max_model_len=128, num_threads=1))
    engine.add_request("r", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0))
    seen: list[int] = []

    def step_elsewhere() -> None:
        torch.set_num_threads(2)  # what another thread (or the new-thread default) may hold
        while engine.has_unfinished_requests():
            engine.step()
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=step_elsewhere)
    thread.start()
    thread.join()
    torch.set_num_threads(main_threads)
    assert seen == [1]


def test_a_failed_load_raises_in_the_caller_and_leaves_no_thread(tmp_path: Path) -> None:
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(Exception, match="not-a-model"):
        AsyncEngine.load(EngineConfig(dtype="float32", model=str(tmp_path / "not-a-model")))
    poll(
        lambda: {t.ident for t in threading.enumerate() if t.name == "loragate-engine"} <= before,
        timeout_s=10,
        what="the engine thread's end",
    )


def test_shutdown_before_start_ends_the_loaded_engine_thread() -> None:
    async_engine = AsyncEngine.load(EngineConfig(dtype="float32", model="tiny-random", max_model_len=128))
    thread = async_engine._thread
    asyncio.run(async_engine.shutdown())
    assert thread is not None and not thread.is_alive()


def test_an_engine_on_a_numbered_gpu_makes_it_current_in_its_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches and graph captures go to the thread's current CUDA device, not the tensors': the engine's
    threads make theirs current (checked through the call torch would make; no GPU here)."""
    calls: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    make_current(torch.device("cuda:1"))
    make_current(torch.device("cpu"))
    make_current(torch.device("cuda"))  # no index: whichever is current stays
    assert calls == [torch.device("cuda:1")]
    with pytest.raises(ValueError, match="has 2 CUDA device"):
        make_current(torch.device("cuda:2"))


def test_a_cuda_device_on_a_machine_without_one_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA device is available"):
        make_current(torch.device("cuda:0"))
