"""`make bench`: every benchmark side by side in one run, one table, a JSON record and two plots.

Absolute figures differ up to 3x between machines of the same kind (AVX-512 with bf16 on one, only AVX2 on
another), so the only comparisons that hold are those measured in the same run: this runs them all, one
after another (never two at once: each would slow the other), and records the machine beside them.

Each part is its own subprocess writing `--json` into a temporary folder, its output in a log there; a
part that fails (or times out) is reported with the end of its log, and the others still run:

    w1        bench/throughput.py: W1 base and mixed LoRA in-process, HF batched, HF + PEFT batched per
              adapter, and the adapter-scale curve (registered adapters, device tier 64, Zipf popularity)
    vllm      bench/vllm_w1.py under `--vllm-python PATH` (only when given): W1 base and mixed on vLLM-CPU
    compare   bench/w1_compare.py (only with `--vllm-python`): W1 base and mixed, fp32 and bf16, loragate and
              vLLM-CPU on equal terms (vLLM's base row without `enable_lora`), rows interleaved over the rounds
    served    bench/served_vllm_client.py (only with `--vllm-python`): both servers, fp32 then bf16, measured by
              vLLM's own benchmark client, first burst after start and warm
    serving   bench/serving.py: W1 over HTTP and through the gateway, ratios to in-process in the same round
    gateway   bench/gateway_overhead.py: latency the gateway adds over a mock upstream, req/s
    priority  bench/priority.py: critical TTFT under overload vs idle, the shared-prefix cache
    step      bench/step_overhead.py: the engine's step loop, µs per running request per step
    affinity  bench/affinity.py: two engines behind one gateway, adapter affinity off vs on

Then it prints the summary (the W1 table with ratios to HF, the scale curve, the rest), writes
`<out-dir>/<YYYY-MM-DD>-<host>.json` (every part's figures, their status, the machine: CPU model and flags,
cores, torch version; the command) and beside it `-w1.png` (the W1 table as bars) and `-scale.png` (the
adapter-scale curve). `--quick` is a smoke run with small counts, written as `<date>-<host>-quick.*`.

    python bench/report.py [--quick] [--vllm-python PATH] [--skip PART[,PART...]] [--requests N]
                           [--new-tokens N] [--scale-counts 8,64,512,2048] [--rounds N] [--out-dir DIR] [--verbose]
    python bench/report.py --from-json bench/results/<date>-<host>.json   # print and plot a recorded run again
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.metadata
import json
import os
import platform
import re
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PARTS = ("w1", "vllm", "compare", "served", "serving", "gateway", "priority", "step", "affinity")
VLLM_PARTS = ("vllm", "compare", "served")  # the parts that need `--vllm-python`
DTYPES = ("float32", "bfloat16")
FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8")
NA = "n/a"
BUSY_CPUS = 0.15  # other processes' average CPU use during a part above which the summary warns

# The W1 table's columns: (key, heading); each cell is tok/s with its ratio to the HF reference of its row.
W1_COLUMNS = (
    ("loragate", "loragate"),
    ("http", "loragate HTTP"),
    ("gateway", "loragate gateway"),
    ("hf", "HF batched"),
    ("hf_peft", "HF + PEFT"),
    ("vllm", "vLLM-CPU"),
)
W1_ROWS = (("base", "W1 base"), ("mixed", "W1 mixed LoRA"))
W1_REFERENCE = {"base": "hf", "mixed": "hf_peft"}  # what each row's ratios are to


@dataclass
class Sizes:
    """How much each part does: the full run, or `--quick`'s smoke run; flags override either."""

    requests: int = 32
    new_tokens: int = 64
    scale_counts: list[int] = field(default_factory=lambda: [8, 64, 512, 2048])
    rounds: int = 3  # bench/serving.py's interleaved rounds
    gateway_requests: int = 400
    step_args: list[str] = field(default_factory=list)
    affinity_args: list[str] = field(default_factory=list)

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            requests=8,
            new_tokens=8,
            scale_counts=[8, 64],
            rounds=1,
            gateway_requests=40,
            step_args=["--sizes", "1,8", "--steps", "5", "--rounds", "1"],
            affinity_args=["--requests", "16", "--concurrency", "4", "--adapters", "8", "--tier", "4"],
        )


def part_commands(part: str, sizes: Sizes, out: Path, work: Path, vllm_python: str | None) -> list[list[str]]:
    """The command lines of one part, run in order; the last writes the part's JSON to `out`."""
    py = sys.executable
    w1 = ["--requests", str(sizes.requests), "--new-tokens", str(sizes.new_tokens)]
    if part == "w1":
        return [
            [
                py,
                str(BENCH / "throughput.py"),
                *w1,
                "--scale-counts",
                ",".join(map(str, sizes.scale_counts)),
                "--json",
                str(out),
            ]
        ]
    if part == "vllm":
        assert vllm_python
        spec = work / "vllm-w1-spec.json"
        rows = [work / "vllm-w1-base.json", work / "vllm-w1-mixed.json"]
        return [
            [py, str(BENCH / "vllm_w1.py"), "--prepare", str(spec), *w1],
            *(
                [vllm_python, str(BENCH / "vllm_w1.py"), "--spec", str(spec), "--row", row, "--dtype", "float32"]
                + ["--threads", "2", "--json", str(path)]
                for row, path in zip(("base", "mixed"), rows, strict=True)
            ),
            [py, str(BENCH / "vllm_w1.py"), "--merge", *map(str, rows), "--json", str(out)],
        ]
    if part == "compare":
        assert vllm_python
        return [
            [py, str(BENCH / "w1_compare.py"), "--vllm-python", vllm_python, "--rounds", str(sizes.rounds)]
            + ["--dtypes", ",".join(DTYPES), "--json", str(out)]
        ]
    if part == "served":
        assert vllm_python
        return [
            [py, str(BENCH / "served_vllm_client.py"), "--vllm-python", vllm_python, "--dtype", ",".join(DTYPES)]
            + ["--prompts", str(2 * sizes.requests), "--concurrency", str(sizes.requests), "--json", str(out)]
        ]
    if part == "serving":
        return [[py, str(BENCH / "serving.py"), *w1, "--rounds", str(sizes.rounds), "--json", str(out)]]
    if part == "gateway":
        return [[py, str(BENCH / "gateway_overhead.py"), "--requests", str(sizes.gateway_requests), "--json", str(out)]]
    if part == "priority":
        return [[py, str(BENCH / "priority.py"), "--json", str(out)]]
    if part == "step":
        return [[py, str(BENCH / "step_overhead.py"), *sizes.step_args, "--json", str(out)]]
    if part == "affinity":
        return [[py, str(BENCH / "affinity.py"), *sizes.affinity_args, "--json", str(out)]]
    raise ValueError(part)


def cpu_busy_s() -> float | None:
    """CPU-seconds the whole machine has spent busy since boot (/proc/stat), None where unreadable."""
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def other_cpus_now(seconds: float = 2.0) -> float | None:
    """How many CPUs other processes keep busy right now (this one sleeps meanwhile)."""
    before = cpu_busy_s()
    time.sleep(seconds)
    after = cpu_busy_s()
    return None if before is None or after is None else (after - before) / seconds


def children_cpu_s() -> float:
    """CPU-seconds of this process's children that have ended and been waited for (with their own such)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def adopt_orphans() -> bool:
    """Become the subreaper of this process's descendants (Linux): a process whose parent ends first (vLLM's
    server leaves its engine process so when stopped) is handed to this process instead of init, and
    `reap_children` waits for it, so its CPU time joins `children_cpu_s` as its part's own rather than counting
    as another process's. False where the kernel refuses or is not Linux."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def own_children() -> list[int]:
    """The pids of this process's living children (adopted orphans included), from /proc."""
    pids: list[int] = []
    for task in Path(f"/proc/{os.getpid()}/task").glob("*"):
        try:
            pids += [int(pid) for pid in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return pids


def reap_children(grace_s: float = 10.0) -> None:
    """Wait for every child this process still has (a part's adopted orphans: runs between parts, when no part's
    own process is left), SIGKILLing those still running after `grace_s`, so that none runs into the next part
    and their CPU time is counted (`children_cpu_s`)."""
    deadline, killed = time.monotonic() + grace_s, False
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid:
            continue
        if time.monotonic() > deadline:
            children = own_children()
            if killed or not children:
                return  # (what /proc does not show, or will not die, is left; its time counts as another's)
            for child in children:
                try:
                    os.kill(child, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            deadline, killed = time.monotonic() + grace_s, True
        time.sleep(0.05)


def kill_group(pgid: int) -> None:
    """SIGKILL what is left of a part's process group (the part's own session, see `run_part`)."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stop(proc: subprocess.Popen[bytes], grace_s: float = 30) -> None:
    """SIGINT to the part's process group (the bench scripts stop their servers in `finally`), then
    SIGKILL to the group if the part has not ended within `grace_s`."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=grace_s)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    kill_group(proc.pid)
    proc.wait()


def run_part(
    part: str, commands: list[list[str]], out: Path, log: Path, timeout_s: float, verbose: bool, reap: bool = False
) -> dict[str, Any]:
    """Run one part's commands: {"status": "ok" | "failed", "seconds", "other_cpus", "figures" | "error"}.

    `other_cpus` is how many CPUs other processes kept busy on average meanwhile (the machine's busy time
    less this part's own: its processes', the orphans they left included once `adopt_orphans` has run), so a
    figure measured beside someone else's work can be told from a real one."""
    start, busy0, own0 = time.monotonic(), cpu_busy_s(), children_cpu_s()
    result: dict[str, Any] = {}
    with log.open("wb") as sink:
        for argv in commands:
            sink.write(f"$ {shlex.join(argv)}\n".encode())
            sink.flush()
            # Its own session: a Ctrl-C here reaches it through `stop`, which also ends whatever servers it
            # started, and nothing it leaves behind runs on into the next part.
            proc = subprocess.Popen(
                argv,
                cwd=REPO,
                stdout=None if verbose else sink,
                stderr=None if verbose else subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                stop(proc)
                result.update(status="failed", error=f"timed out after {timeout_s:.0f} s: {shlex.join(argv)}")
                break
            except KeyboardInterrupt:
                stop(proc)
                raise
            finally:
                kill_group(proc.pid)
            if proc.returncode != 0:
                result.update(status="failed", error=f"exit {proc.returncode}: {shlex.join(argv)}")
                break
    if reap:  # this process adopts orphans (`adopt_orphans`): collect those the part left
        reap_children()
    wall, busy1 = time.monotonic() - start, cpu_busy_s()
    result["seconds"] = round(wall, 1)
    if busy0 is not None and busy1 is not None and wall > 0:
        result["other_cpus"] = round(max(0.0, (busy1 - busy0) - (children_cpu_s() - own0)) / wall, 2)
    if "status" not in result:
        try:
            result.update(status="ok", figures=json.loads(out.read_text()))
        except (OSError, ValueError) as exc:
            result.update(status="failed", error=f"no JSON figures ({exc})")
    if result["status"] != "ok":
        result["log"] = str(log)
        if not verbose:
            result["log_tail"] = log.read_text(errors="replace").splitlines()[-15:]
    return result


# -- machine -----------------------------------------------------------------------------------------------


def cpu_info(cpuinfo: str) -> dict[str, Any]:
    """CPU model and the flags of interest from /proc/cpuinfo's text (the first processor's)."""
    model = re.search(r"^model name[ \t]*:[ \t]*(.*)$", cpuinfo, re.MULTILINE)  # a field may be empty
    flags = re.search(r"^flags[ \t]*:[ \t]*(.*)$", cpuinfo, re.MULTILINE)
    present = set(flags.group(1).split()) if flags else set()
    name = model.group(1).strip() if model else ""
    return {"cpu_model": name or platform.processor() or NA, "flags": [f for f in FLAGS if f in present]}


def machine_info() -> dict[str, Any]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = NA
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        **cpu_info(text),
        "cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch": torch_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "git_commit": git("rev-parse", "--short", "HEAD") or NA,
        "git_changed_files": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def git(*args: str) -> str:
    """A read-only git query's output, empty where git or the repository is missing."""
    try:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def flags_text(flags: Sequence[str]) -> str:
    """avx2, avx512f, avx512_bf16 as they are; the three AMX flags as one `amx` (with what it has)."""
    amx = [f.removeprefix("amx_") for f in flags if f.startswith("amx_")]
    return " ".join([f for f in flags if not f.startswith("amx_")] + ([f"amx({','.join(amx)})"] if amx else []))


# -- the summary (pure functions of the recorded parts) --------------------------------------------------------


def dig(tree: Any, *keys: Any) -> Any:
    """tree[k1][k2]...; None where any level is missing or of the wrong shape."""
    for key in keys:
        try:
            tree = tree[key]
        except (KeyError, IndexError, TypeError):
            return None
    return tree


def figures(parts: dict[str, Any], part: str) -> Any:
    return dig(parts, part, "figures")


def is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def num(value: Any, fmt: str = ".1f", suffix: str = "", scale: float = 1.0) -> str:
    """`value * scale` formatted, or n/a when it is not a number."""
    return f"{value * scale:{fmt}}{suffix}" if is_num(value) else NA


def times(value: Any) -> str:
    return num(value, ".2f", "x")


def w1_cells(parts: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """tok/s per W1 row and column, None where not measured."""
    w1, serving, vllm = figures(parts, "w1"), figures(parts, "serving"), figures(parts, "vllm")
    cells = {
        row: {
            "loragate": dig(w1, row, "loragate_tok_s"),
            "http": dig(serving, "median", row, "http_tok_s"),
            "gateway": dig(serving, "median", row, "gateway_tok_s"),
            "hf": dig(w1, "base", "hf_tok_s") if row == "base" else None,
            "hf_peft": dig(w1, "mixed", "hf_peft_tok_s") if row == "mixed" else None,
            "vllm": dig(vllm, f"{row}_tok_s"),
        }
        for row, _ in W1_ROWS
    }
    return {row: {col: (v if is_num(v) else None) for col, v in values.items()} for row, values in cells.items()}


def w1_ratios(cells: dict[str, dict[str, float | None]]) -> dict[str, dict[str, float | None]]:
    """Each cell over its row's HF reference (base: HF batched, mixed: HF + PEFT), None where either is missing."""
    out: dict[str, dict[str, float | None]] = {}
    for row, values in cells.items():
        ref = values.get(W1_REFERENCE[row])
        out[row] = {col: (v / ref if v is not None and ref else None) for col, v in values.items()}
    return out


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned text: the first column left, the others right."""
    widths = [max(len(str(r[i])) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        return "  ".join(
            str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *map(line, rows)])


def w1_table(parts: dict[str, Any]) -> str:
    cells = w1_cells(parts)
    if all(v is None for row in cells.values() for v in row.values()):
        return "(not measured)"
    ratios = w1_ratios(cells)
    columns = [c for c in W1_COLUMNS if c[0] != "vllm" or "vllm" in parts]
    rows = [
        [
            label,
            *(
                num(cells[row][col]) + (f" ({ratios[row][col]:.2f}x)" if ratios[row][col] is not None else "")
                for col, _ in columns
            ),
        ]
        for row, label in W1_ROWS
    ]
    return table(["tok/s (x HF, same run)", *(h for _, h in columns)], rows)


def serving_lines(parts: dict[str, Any]) -> str | None:
    median = dig(figures(parts, "serving"), "median")
    if not isinstance(median, dict):
        return None
    lines = []
    for row, label in W1_ROWS:
        m = median.get(row)
        if not isinstance(m, dict):
            m = {}
        lines.append(
            f"{label:<14} HTTP {times(m.get('http_ratio'))} (streamed {times(m.get('http_stream_ratio'))}), "
            f"gateway {times(m.get('gateway_ratio'))} (streamed {times(m.get('gateway_stream_ratio'))})"
        )
    return "\n".join(lines)


def compare_table(parts: dict[str, Any]) -> str | None:
    """bench/w1_compare.py's medians: loragate and vLLM-CPU per dtype and row, their ratio, loragate's LoRA/base."""
    med = dig(figures(parts, "compare"), "medians")
    if not isinstance(med, dict):
        return None
    rows = []
    for dtype in DTYPES:
        for row in ("base", "mixed"):
            ours, theirs = med.get(f"loragate {dtype} {row}"), med.get(f"vllm {dtype} {row}")
            ratio = ours / theirs if is_num(ours) and is_num(theirs) and theirs else None
            base = med.get(f"loragate {dtype} base")
            lora = ours / base if row == "mixed" and is_num(ours) and is_num(base) and base else None
            rows.append([f"{dtype} {row}", num(ours), num(theirs), times(ratio), times(lora) if lora else ""])
    return table(["W1 tok/s, median", "loragate", "vLLM-CPU", "loragate / vLLM", "LoRA / base"], rows)


def served_table(parts: dict[str, Any]) -> str | None:
    """bench/served_vllm_client.py's figures: warm output tok/s per system and dtype, the ratio, first / warm."""
    got = figures(parts, "served")
    if not isinstance(got, dict) or not any(isinstance(got.get(d), dict) for d in DTYPES):
        return None
    rows = []
    for dtype in DTYPES:
        runs = got.get(dtype)
        if not isinstance(runs, dict):
            continue
        warm = {s: dig(runs, s, "warm", "output_throughput") for s in ("loragate", "vllm")}
        first = {s: dig(runs, s, "first", "output_throughput") for s in ("loragate", "vllm")}
        ratio = warm["loragate"] / warm["vllm"] if is_num(warm["loragate"]) and is_num(warm["vllm"]) else None
        fw = {s: first[s] / warm[s] if is_num(first[s]) and is_num(warm[s]) and warm[s] else None for s in warm}
        ttft = {s: dig(runs, s, "warm", "mean_ttft_ms") for s in warm}
        tpot = {s: dig(runs, s, "warm", "mean_tpot_ms") for s in warm}
        rows.append(
            [
                dtype,
                num(warm["loragate"]),
                num(warm["vllm"]),
                times(ratio),
                f"{num(ttft['loragate'], '.0f')} / {num(ttft['vllm'], '.0f')}",
                f"{num(tpot['loragate'])} / {num(tpot['vllm'])}",
                f"{times(fw['loragate'])} / {times(fw['vllm'])}",
            ]
        )
    headers = ["served, warm", "loragate tok/s", "vLLM tok/s", "loragate / vLLM", "TTFT ms", "TPOT ms", "first / warm"]
    return table(headers, rows)


def scale_rows(parts: dict[str, Any]) -> list[dict[str, Any]]:
    """The scale curve with each count's warm and cold tok/s as a ratio to the smallest count's."""
    curve = [e for e in dig(figures(parts, "w1"), "scale") or [] if isinstance(e, dict)]
    curve.sort(key=lambda e: e.get("adapters", 0))
    first = curve[0] if curve else {}
    out = []
    for e in curve:
        ratio = {
            k: (e[k] / first[k] if is_num(e.get(k)) and is_num(first.get(k)) and first[k] else None)
            for k in ("cold_tok_s", "warm_tok_s")
        }
        out.append({**e, "cold_ratio": ratio["cold_tok_s"], "warm_ratio": ratio["warm_tok_s"]})
    return out


def scale_table(parts: dict[str, Any]) -> str | None:
    rows = scale_rows(parts)
    if not rows:
        return None
    base = rows[0].get("adapters")
    return table(
        ["registered adapters", "distinct in batch", "cold tok/s", "warm tok/s", f"warm / {base}", f"cold / {base}"],
        [
            [
                str(r.get("adapters")),
                str(r.get("distinct_in_batch", NA)),
                num(r.get("cold_tok_s")),
                num(r.get("warm_tok_s")),
                times(r["warm_ratio"]),
                times(r["cold_ratio"]),
            ]
            for r in rows
        ],
    )


def gateway_table(parts: dict[str, Any]) -> str | None:
    g = figures(parts, "gateway")
    if not isinstance(g, dict):
        return None
    rows = [
        [
            f"c={e.get('c')}",
            num(e.get("direct_p50_ms"), ".2f"),
            num(e.get("gateway_p50_ms"), ".2f"),
            num(e.get("added_p50_ms"), ".2f"),
            num(e.get("added_p99_ms"), ".2f"),
        ]
        for e in g.get("concurrency", [])
        if isinstance(e, dict)
    ]
    return (
        table(["concurrency", "direct p50 ms", "gateway p50 ms", "added p50 ms", "added p99 ms"], rows)
        + f"\ncanary rollout routing added p50 {num(dig(g, 'rollout', 'added_p50_ms'), '.2f')} ms; "
        f"{num(g.get('throughput_c32_rps'), '.0f')} req/s through one gateway process at c=32"
    )


def priority_table(parts: dict[str, Any]) -> str | None:
    p = figures(parts, "priority")
    if not isinstance(p, dict):
        return None
    keys = (
        ("idle_ttft_p50_s", "idle p50 ms"),
        ("loaded_ttft_p50_s", "loaded p50 ms"),
        ("loaded_ttft_p99_s", "loaded p99 ms"),
    )
    rows = []
    for path in ("http", "in_process"):
        if not isinstance(p.get(path), dict):
            continue
        e = p[path]
        unchanged = e.get("sheddable_outputs_unchanged")
        rows.append(
            [
                path.replace("_", "-"),
                *(num(e.get(k), scale=1e3) for k, _ in keys),
                times(e.get("ratio_p50")),
                times(e.get("ratio_p99")),
                NA if unchanged is None else ("yes" if unchanged else "NO"),
            ]
        )
    text = (
        table(["critical TTFT", *(h for _, h in keys), "ratio p50", "ratio p99", "sheddable outputs unchanged"], rows)
        if rows
        else "critical TTFT: n/a"
    )
    prefix = p.get("prefix_cache")
    if isinstance(prefix, dict) and prefix:
        if "mean_ttft_cache_on_s" in prefix or "mean_ttft_cache_off_s" in prefix:
            text += (
                f"\nshared ~300-word prefix, mean TTFT: {num(prefix.get('mean_ttft_cache_on_s'), scale=1e3)} ms "
                f"with the prefix cache, {num(prefix.get('mean_ttft_cache_off_s'), scale=1e3)} ms without "
                f"({times(prefix.get('ttft_ratio_on_off'))})"
            )
        else:  # a shape this report does not know: its numbers as they are
            text += "\nshared prefix: " + ", ".join(f"{k} {num(v, '.3g')}" for k, v in prefix.items() if is_num(v))
    return text


def step_table(parts: dict[str, Any]) -> str | None:
    entries = [e for e in figures(parts, "step") or [] if isinstance(e, dict)]
    if not entries:
        return None
    sizes = sorted({e["running"] for e in entries if isinstance(e.get("running"), int)})
    workloads = list(dict.fromkeys(e.get("workload") for e in entries))
    total = {(e.get("workload"), e.get("running")): e.get("total") for e in entries}
    return table(
        ["µs/request/step", *(f"{n} running" for n in sizes)],
        [[str(w), *(num(total.get((w, n))) for n in sizes)] for w in workloads],
    )


def affinity_line(parts: dict[str, Any]) -> str | None:
    a = figures(parts, "affinity")
    if not isinstance(a, dict):
        return None
    r = a.get("ratio_on_off", {})
    return (
        f"adapter affinity on / off (bench/affinity.py): device loads {times(r.get('loads'))}, evictions "
        f"{times(r.get('evictions'))}, throughput {times(r.get('throughput'))} (engine 1 did "
        f"{num(dig(a, 'on', 'share'), '.0f', '%', 100)} of the work with affinity on)"
    )


def summary(record: dict[str, Any]) -> str:
    """The whole printed report, from the JSON record alone."""
    parts, m, cfg = record["parts"], record["machine"], record["config"]
    out = [
        f"loragate benchmarks {record['date']} on {record['host']}: {m['cpu_model']} "
        f"[{flags_text(m['flags']) or 'no avx2'}], {m['usable_cpus']} usable CPUs, torch {m['torch']}"
        + (" (QUICK smoke run: small counts, not comparable)" if cfg.get("quick") else ""),
        f"command: {record['command']}",
        "",
        f"W1: SmolLM2-135M fp32, {cfg['requests']} requests x {cfg['new_tokens']} new tokens, greedy, all at "
        "once, 2 threads; ratios to HF batched (base) and HF + PEFT batched per adapter (mixed), same run",
        w1_table(parts),
    ]
    sections: list[tuple[str, Callable[[dict[str, Any]], str | None]]] = [
        (
            "W1 on equal terms (bench/w1_compare.py: vLLM's base row without enable_lora, same dtype and threads)",
            compare_table,
        ),
        (
            "served, vLLM's own benchmark client (bench/served_vllm_client.py: random 128-token prompts, 64 new; "
            "TTFT and TPOT means, loragate / vLLM)",
            served_table,
        ),
        ("over HTTP / in-process, same round (bench/serving.py, median of the rounds)", serving_lines),
        (f"adapter scale: device tier 64, Zipf popularity, {cfg['requests']} requests", scale_table),
        ("gateway overhead (bench/gateway_overhead.py: mock upstream, 4-token completions)", gateway_table),
        ("priority (bench/priority.py): critical TTFT under overload vs an idle engine", priority_table),
        ("step overhead (bench/step_overhead.py: tiny-random, 1 thread), total", step_table),
        ("", affinity_line),
    ]
    for title, render in sections:
        text = render(parts)
        if text:
            out += ([f"\n{title}"] if title else []) + [text]
    status = [f"{name} {p['status']} ({p.get('seconds', 0):.0f} s)" for name, p in parts.items()]
    out += ["", "parts: " + ", ".join(status)]
    busy = {name: p["other_cpus"] for name, p in parts.items() if (p.get("other_cpus") or 0) >= BUSY_CPUS}
    if busy:
        out.append(
            "NOT QUIET: other processes kept CPUs busy during "
            + ", ".join(f"{name} ({cpus:.2f} CPUs on average)" for name, cpus in busy.items())
            + ": those figures are slowed by them, run again on a quiet machine"
        )
    for name, p in parts.items():
        if p["status"] == "failed":
            out += [
                f"{name} FAILED: {p.get('error')}" + (f" (log: {p['log']})" if p.get("log") else ""),
                *("  | " + line for line in p.get("log_tail", [])),
            ]
    return "\n".join(out)


# -- plots ----------------------------------------------------------------------------------------------------


def plot(record: dict[str, Any], stem: Path) -> list[Path]:
    """`<stem>-w1.png` (W1 tok/s per system, base and mixed) and `<stem>-scale.png` (the scale curve)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts, written = record["parts"], []
    cells = w1_cells(parts)
    columns = [(c, h) for c, h in W1_COLUMNS if any(cells[row][c] is not None for row, _ in W1_ROWS)]
    title = f"{record['machine']['cpu_model']}, {record['date']}"
    if columns:
        fig, ax = plt.subplots(figsize=(7.5, 3.6), dpi=100)
        width = 0.8 / len(columns)
        for k, (col, heading) in enumerate(columns):
            xs = [i + (k - (len(columns) - 1) / 2) * width for i in range(len(W1_ROWS))]
            ys = [cells[row][col] or 0.0 for row, _ in W1_ROWS]
            bars = ax.bar(xs, ys, width, label=heading)
            ax.bar_label(bars, labels=[(f"{y:.0f}" if y >= 10 else f"{y:.1f}") if y else "" for y in ys], fontsize=7)
        ax.set_xticks(range(len(W1_ROWS)), [label for _, label in W1_ROWS])
        ax.set_ylim(0, 1.3 * max(v or 0.0 for row in cells.values() for v in row.values()))  # room for the legend
        ax.set_ylabel("generated tok/s")
        ax.set_title(
            f"W1 ({record['config']['requests']} requests x {record['config']['new_tokens']} tokens), {title}",
            fontsize=9,
        )
        ax.legend(fontsize=7, ncols=3)
        fig.tight_layout()
        fig.savefig(path := stem.with_name(stem.name + "-w1.png"))
        plt.close(fig)
        written.append(path)
    rows = [r for r in scale_rows(parts) if isinstance(r.get("adapters"), int)]
    if rows:
        fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
        for key, label in (("warm_tok_s", "warm (adapters loaded once)"), ("cold_tok_s", "cold (first pass)")):
            points = [(r["adapters"], r[key]) for r in rows if is_num(r.get(key))]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        mixed = cells["mixed"]["loragate"]
        if mixed:
            ax.axhline(mixed, color="grey", linestyle=":", label="W1 mixed LoRA (8, uniform)")
        ax.set_xscale("log", base=2)
        ax.set_xticks([r["adapters"] for r in rows], [str(r["adapters"]) for r in rows])
        ax.set_ylim(bottom=0)
        ax.set_xlabel("registered adapters (device tier 64, Zipf popularity)")
        ax.set_ylabel("generated tok/s")
        ax.set_title(f"adapter scale, {title}", fontsize=9)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path := stem.with_name(stem.name + "-scale.png"))
        plt.close(fig)
        written.append(path)
    return written


# -- main -----------------------------------------------------------------------------------------------------


def parse_parts(values: list[str]) -> set[str]:
    names = {v.strip() for value in values for v in value.split(",") if v.strip()}
    unknown = names - set(PARTS)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown part(s) {sorted(unknown)}; parts: {', '.join(PARTS)}")
    return names


def result_stem(out_dir: Path, date: str, host: str, quick: bool) -> Path:
    """`<out_dir>/<date>-<host>[-quick]`, the host name reduced to safe file-name characters."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", host).strip("-") or "host"
    return out_dir / f"{date}-{safe}{'-quick' if quick else ''}"


def command_line(argv: list[str], under_make: bool) -> str:
    """How this run was asked for: `make bench [BENCH_ARGS='...']` under make, else the script's command."""
    if under_make:
        return "make bench" + (f" BENCH_ARGS={shlex.quote(shlex.join(argv))}" if argv else "")
    return shlex.join(["python", "bench/report.py", *argv])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run with small counts (not comparable)")
    ap.add_argument("--vllm-python", help="an interpreter with vllm-cpu installed: adds the vLLM-CPU column")
    ap.add_argument("--skip", action="append", default=[], help=f"parts to skip, comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--requests", type=int, help="W1 requests (default 32; --quick 8)")
    ap.add_argument("--new-tokens", type=int, help="W1 new tokens per request (default 64; --quick 8)")
    ap.add_argument("--scale-counts", help="registered-adapter counts of the scale curve (default 8,64,512,2048)")
    ap.add_argument("--rounds", type=int, help="bench/serving.py rounds (default 3; --quick 1)")
    ap.add_argument("--out-dir", type=Path, default=BENCH / "results")
    ap.add_argument("--part-timeout-s", type=float, default=3600)
    ap.add_argument("--verbose", action="store_true", help="show each part's own output instead of logging it")
    ap.add_argument(
        "--from-json",
        type=Path,
        metavar="RECORD",
        help="run nothing: print the summary of a recorded run and redraw its plots beside it",
    )
    args = ap.parse_args()
    if args.from_json:
        recorded = json.loads(args.from_json.read_text())
        stem = args.from_json.with_suffix("")
        written = plot(recorded, stem)
        print(summary(recorded) + "\n\nwrote " + ", ".join(map(str, written)))
        return
    try:
        skip = parse_parts(args.skip)
    except argparse.ArgumentTypeError as exc:
        ap.error(str(exc))
    sizes = Sizes.quick() if args.quick else Sizes()
    if args.requests:
        sizes.requests = args.requests
    if args.new_tokens:
        sizes.new_tokens = args.new_tokens
    if args.scale_counts:
        sizes.scale_counts = [int(c) for c in args.scale_counts.split(",") if c]
    if args.rounds:
        sizes.rounds = args.rounds
    if not args.vllm_python:
        skip.update(VLLM_PARTS)
    elif not Path(args.vllm_python).exists():
        ap.error(f"--vllm-python {args.vllm_python}: no such file")

    now = datetime.datetime.now()
    host = socket.gethostname()
    record: dict[str, Any] = {
        "date": now.strftime("%Y-%m-%d"),
        "started": now.isoformat(timespec="seconds"),
        "host": host,
        "command": command_line(sys.argv[1:], under_make="MAKELEVEL" in os.environ),
        "machine": machine_info(),
        "config": {
            "quick": args.quick,
            "requests": sizes.requests,
            "new_tokens": sizes.new_tokens,
            "scale_counts": sizes.scale_counts,
            "device_tier": 64,
            "serving_rounds": sizes.rounds,
            "vllm_python": args.vllm_python,
        },
        "parts": {},
    }
    work = Path(tempfile.mkdtemp(prefix="loragate-bench-"))
    adopting = adopt_orphans()  # a part's orphaned processes count as its own CPU time, not another's
    print(f"running {', '.join(p for p in PARTS if p not in skip)} one after another; logs in {work}", flush=True)
    busy = other_cpus_now()
    if busy is not None and busy >= BUSY_CPUS:
        print(f"warning: other processes keep {busy:.2f} CPUs busy now; the figures will be slowed by them", flush=True)
    for part in PARTS:
        if part in skip:
            continue
        out = work / f"{part}.json"
        commands = part_commands(part, sizes, out, work, args.vllm_python)
        print(f"[{part}] {shlex.join(commands[-1])}", flush=True)
        try:
            result = run_part(
                part, commands, out, work / f"{part}.log", args.part_timeout_s, args.verbose, reap=adopting
            )
        except KeyboardInterrupt:  # subprocess.run has killed the part's process: keep what the others measured
            record["parts"][part] = {
                "status": "failed",
                "error": "interrupted (Ctrl-C)",
                "seconds": 0.0,
                "log": str(work / f"{part}.log"),
            }
            print(f"[{part}] interrupted: writing what the parts before it measured", flush=True)
            break
        record["parts"][part] = result
        print(
            f"[{part}] {result['status']} in {result['seconds']:.0f} s"
            + (f": {result['error']}" if result["status"] != "ok" else "")
            + (
                f" (other processes kept {result['other_cpus']:.2f} CPUs busy meanwhile)"
                if (result.get("other_cpus") or 0) >= BUSY_CPUS
                else ""
            ),
            flush=True,
        )
    record["finished"] = datetime.datetime.now().isoformat(timespec="seconds")

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = result_stem(args.out_dir, record["date"], host, args.quick)
    json_path = stem.with_name(stem.name + ".json")
    record["plots"] = []
    try:
        record["plots"] = [p.name for p in plot(record, stem)]
    except ImportError as exc:
        print(f"no plots: {exc} (matplotlib is in the `bench` extra: pip install -e '.[bench]')")
    json_path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print("\n" + summary(record))
    print(f"\nwrote {json_path}" + "".join(f", {json_path.with_name(p)}" for p in record["plots"]))
    if any(p["status"] != "ok" for p in record["parts"].values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
