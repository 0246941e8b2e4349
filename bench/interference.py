"""Throughput when the CPU is shared: W1 quiet vs beside a CPU hog, and under a CFS quota.

    python bench/interference.py [--rounds 3] [--new-tokens 64] [--skip-quota]

Each measurement runs the engine in a fresh process (thread pools are per process) on workload W1
(docs/benchmarks.md), base model and 8 mixed LoRA adapters, with two thread settings:
  fixed   `--threads N` with N = the CPUs this process may use: what the engine did before `auto`;
  auto    `--threads auto` (the default): the same N, fewer while the process cannot get them
          (engine/worker/threads.py).
Conditions, interleaved round by round:
  quiet   nothing else runs;
  hog     a separate process spins on the last CPU for the whole run (started and stopped here);
  quota   the engine's process in a cgroup whose CPU quota is one CPU less than it sees (cgroup v1 or v2,
          when this machine lets us create one; said when not).
Prints each figure, the median over rounds, and the ratios hog/quiet and quota/quiet per setting.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def child(workload: str, threads: str, new_tokens: int) -> None:
    """One measurement, in this process: prints {"tok_s", "threads"} as JSON."""
    from bench.throughput import bench_engine, make_w1_adapters, w1_prompts
    from engine.model.sources import cache_root, load_tokenizer, resolve_model

    resolved = resolve_model("smollm2")
    tok = load_tokenizer(resolved.path)
    prompts = [tok(t)["input_ids"] for t in w1_prompts(32)]
    adapters: list[str | None] | None = None
    adapter_dir: str | None = None  # (EngineConfig's default)
    if workload == "mixed":
        dirs = make_w1_adapters(resolved.path, cache_root() / "bench-adapters" / "w1")
        adapters = [dirs[i % 8].name for i in range(len(prompts))]
        adapter_dir = str(dirs[0].parent)
    num_threads = "auto" if threads == "auto" else int(threads)
    [(secs, tok_s)] = bench_engine(
        "smollm2", prompts, new_tokens, adapters, num_threads=num_threads, adapter_dir=adapter_dir
    )
    print(json.dumps({"tok_s": tok_s, "secs": secs}))


@contextmanager
def hog(cpu: int):
    """A process spinning on `cpu` until the block ends."""
    code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(0.5)
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def make_quota_cgroup(cpus: float) -> tuple[Path, str] | None:
    """A cgroup limited to `cpus` CPUs: (its directory, the file a pid is written to), or None."""
    period = 100_000
    candidates = [
        (Path("/sys/fs/cgroup/cpu"), "cpu.cfs_quota_us", "tasks"),  # v1
        (Path("/sys/fs/cgroup"), "cpu.max", "cgroup.procs"),
    ]  # v2
    for root, quota_file, procs in candidates:
        if not (root / quota_file).exists() and not (root / "cgroup.subtree_control").exists():
            continue
        group = root / f"loragate-bench-{os.getpid()}"
        try:
            group.mkdir(exist_ok=True)
            if quota_file == "cpu.max":
                (group / "cpu.max").write_text(f"{int(cpus * period)} {period}")
            else:
                (group / "cpu.cfs_period_us").write_text(str(period))
                (group / "cpu.cfs_quota_us").write_text(str(int(cpus * period)))
            return group, procs
        except OSError:
            try:
                group.rmdir()
            except OSError:
                pass
    return None


def measure(workload: str, threads: str, new_tokens: int, cgroup: tuple[Path, str] | None = None) -> float:
    argv = [sys.executable, __file__, "--child", workload, "--threads", threads, "--new-tokens", str(new_tokens)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
    if cgroup is not None:
        group, procs = cgroup
        (group / procs).write_text(str(proc.pid))  # while it is still importing torch
    out, _ = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"measurement {workload}/{threads} failed ({proc.returncode})")
    return json.loads(out.strip().splitlines()[-1])["tok_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--skip-quota", action="store_true")
    ap.add_argument("--child", choices=("base", "mixed"))
    ap.add_argument("--threads", default="auto")
    args = ap.parse_args()
    if args.child:
        child(args.child, args.threads, args.new_tokens)
        return
    from engine.worker.threads import usable_cpus

    cpus = usable_cpus()
    settings = {"fixed": str(cpus), "auto": "auto"}
    cgroup = None if args.skip_quota else make_quota_cgroup(max(1.0, cpus - 1.0))
    conditions = ["quiet", "hog"] + (["quota"] if cgroup is not None else [])
    print(
        f"W1, {cpus} usable CPUs, {args.new_tokens} new tokens, {args.rounds} interleaved rounds; "
        f"hog on CPU {sorted(os.sched_getaffinity(0))[-1]}"
        + (
            f"; quota {max(1.0, cpus - 1.0):g} CPU in {cgroup[0]}"
            if cgroup
            else "; quota: skipped"
            if args.skip_quota
            else "; quota: this machine does not let us create a cgroup"
        )
    )
    figures: dict[tuple[str, str, str], list[float]] = {}
    try:
        for r in range(args.rounds):
            for workload in ("base", "mixed"):
                for condition in conditions:
                    for name, threads in settings.items():
                        if condition == "hog":
                            with hog(sorted(os.sched_getaffinity(0))[-1]):
                                tok_s = measure(workload, threads, args.new_tokens)
                        else:
                            tok_s = measure(
                                workload, threads, args.new_tokens, cgroup if condition == "quota" else None
                            )
                        figures.setdefault((workload, condition, name), []).append(tok_s)
                        print(f"round {r + 1} {workload:5} {condition:5} {name:5} {tok_s:7.1f} tok/s", flush=True)
    finally:
        if cgroup is not None:
            cgroup[0].rmdir()
    print("\nmedian tok/s, and the ratio to quiet with the same setting")
    for workload in ("base", "mixed"):
        for name in settings:
            quiet = statistics.median(figures[(workload, "quiet", name)])
            cells = [f"quiet {quiet:6.1f}"]
            for condition in conditions[1:]:
                value = statistics.median(figures[(workload, condition, name)])
                cells.append(f"{condition} {value:6.1f} ({value / quiet:.2f}x)")
            print(f"{workload:5} {name:5} " + "  ".join(cells))


if __name__ == "__main__":
    main()
