"""The pure functions of bench/report.py (`make bench`'s summary, record and plots); nothing is run or measured.

Covered: cpu_info and flags_text (the machine line), dig / num / times (formatting helpers), w1_cells and
w1_ratios, table, scale_rows, serving_lines, gateway_table, priority_table, step_table, compare_table and
served_table (the vLLM comparisons, and the commands of their parts), summary (on the recorded
bench/results/2026-12-01-vm.json and on records with parts missing or failed), plot (PNG files, matplotlib Agg),
parse_parts, result_stem and command_line. Expected figures are read from the JSON record and formatted here.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
RECORD = REPO / "bench" / "results" / "2026-12-01-vm.json"

# bench/ is not a package and holds modules named like common ones (priority, serving): load report.py by path
# rather than putting bench/ on sys.path. Registered before exec: dataclasses looks its module up there.
_spec = importlib.util.spec_from_file_location("bench_report", REPO / "bench" / "report.py")
report = importlib.util.module_from_spec(_spec)
sys.modules["bench_report"] = report
_spec.loader.exec_module(report)

ROWS = {"base": "W1 base", "mixed": "W1 mixed LoRA"}
COLUMNS = ["loragate", "http", "gateway", "hf", "hf_peft", "vllm"]  # the W1 table's order
REFERENCE = {"base": "hf", "mixed": "hf_peft"}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def record() -> dict[str, Any]:
    return json.loads(RECORD.read_text())


def fig(record: dict[str, Any], part: str) -> Any:
    return record["parts"][part]["figures"]


def expected_cells(record: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """The W1 table's tok/s, read from the parts' figures by hand."""
    w1, median, vllm = fig(record, "w1"), fig(record, "serving")["median"], fig(record, "vllm")
    return {
        row: {
            "loragate": w1[row]["loragate_tok_s"],
            "http": median[row]["http_tok_s"],
            "gateway": median[row]["gateway_tok_s"],
            "hf": w1["base"]["hf_tok_s"] if row == "base" else None,
            "hf_peft": w1["mixed"]["hf_peft_tok_s"] if row == "mixed" else None,
            "vllm": vllm[f"{row}_tok_s"],
        }
        for row in ROWS
    }


def split_cells(line: str) -> list[str]:
    """A table line's cells (cells hold single spaces at most; columns are two or more apart)."""
    return re.split(r"\s{2,}", line.strip())


def w1_block(summary: str) -> str:
    """The summary's W1 heading and table (up to the first blank line after it)."""
    return summary.split("\nW1: ", 1)[1].split("\n\n", 1)[0]


def line_starting(text: str, prefix: str) -> str:
    [line] = [ln for ln in text.splitlines() if ln.startswith(prefix)]
    return line


# -- machine -----------------------------------------------------------------------------------------------


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu avx512_bf16 sse avx2 avx512fp16 avx512f amx_tile
bugs\t\t: spectre_v1

processor\t: 1
model name\t: Some Other CPU
flags\t\t: fpu avx2 amx_int8
"""


def test_cpu_info_reads_first_processor_model_and_flags() -> None:
    info = report.cpu_info(CPUINFO)
    assert info["cpu_model"] == "Intel(R) Xeon(R) Platinum 8480+"
    # Only the flags of interest, in FLAGS order; not processor 1's.
    assert info["flags"] == ["avx2", "avx512f", "avx512_bf16", "amx_tile"]
    assert report.cpu_info("flags\t\t: fpu avx512fp16 avx2\n")["flags"] == ["avx2"]  # whole words: no avx512f


def test_cpu_info_without_model_or_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    assert report.cpu_info("flags\t\t: fpu sse avx\n")["flags"] == []  # avx alone is not avx2
    monkeypatch.setattr(report.platform, "processor", lambda: "")
    assert report.cpu_info("") == {"cpu_model": "n/a", "flags": []}
    monkeypatch.setattr(report.platform, "processor", lambda: "x86_64")
    assert report.cpu_info("processor\t: 0\n")["cpu_model"] == "x86_64"


def test_cpu_info_empty_fields_do_not_take_the_next_line() -> None:
    info = report.cpu_info("processor\t: 0\nmodel name\t:\nstepping\t: 4\nflags\t\t:\nbugs\t\t: avx2\n")
    assert info["cpu_model"] != "stepping\t: 4"
    assert info["flags"] == []


def test_flags_text() -> None:
    every = ["avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile", "amx_int8"]
    assert report.flags_text(every) == "avx2 avx512f avx512_bf16 amx(bf16,tile,int8)"
    assert report.flags_text(["avx2"]) == "avx2"
    assert report.flags_text(["amx_tile"]) == "amx(tile)"
    assert report.flags_text([]) == ""


# -- helpers ---------------------------------------------------------------------------------------------------


def test_dig() -> None:
    tree = {"a": [{"b": 1}, {"b": 0}], "s": "text"}
    assert report.dig(tree, "a", 0, "b") == 1
    assert report.dig(tree, "a", 1, "b") == 0  # a falsy value is returned, not None
    assert report.dig(tree) is tree
    assert report.dig(tree, "missing", "b") is None  # KeyError
    assert report.dig(tree, "a", 5) is None  # IndexError
    assert report.dig(tree, "a", "b") is None  # list indexed by a string: TypeError
    assert report.dig(None, "a") is None


def test_num_and_times() -> None:
    assert report.num(3.14159) == "3.1"
    assert report.num(2, ".2f", " ms") == "2.00 ms"
    assert report.num(0.0123, scale=1e3) == "12.3"
    assert report.num(0) == "0.0"
    for not_a_number in (None, True, "5", [1.0]):
        assert report.num(not_a_number) == "n/a"
    assert report.times(1.5) == "1.50x"
    assert report.times(None) == "n/a"


def test_table_aligns_first_column_left_and_the_others_right() -> None:
    text = report.table(["name", "n"], [["a", "1"], ["longer", "123"]])
    assert text == "name      n\n------  ---\na         1\nlonger  123"
    wide = report.table(["x", "tok/s", "ratio"], [["W1 base", "316.0", "1.09x"], ["b", "n/a", "12.00x"]])
    lines = wide.splitlines()
    assert len({len(line) for line in lines}) == 1  # every line as wide as the widest cell of each column
    assert [len(c) for c in lines[1].split("  ")] == [len("W1 base"), len("tok/s"), len("12.00x")]


# -- W1 ------------------------------------------------------------------------------------------------------


def test_w1_cells_on_the_record(record: dict[str, Any]) -> None:
    assert report.w1_cells(record["parts"]) == expected_cells(record)


def test_w1_cells_missing_or_not_numbers() -> None:
    parts = {
        "w1": {"figures": {"base": {"loragate_tok_s": "fast", "hf_tok_s": True}, "mixed": {"loragate_tok_s": 7.5}}}
    }
    cells = report.w1_cells(parts)
    assert cells["mixed"]["loragate"] == 7.5
    assert all(v is None for col, v in cells["mixed"].items() if col != "loragate")
    assert all(v is None for v in cells["base"].values())
    assert all(v is None for row in report.w1_cells({}).values() for v in row.values())


def test_w1_ratios_are_the_quotients_of_the_cells(record: dict[str, Any]) -> None:
    cells = expected_cells(record)
    ratios = report.w1_ratios(cells)
    for row, values in cells.items():
        ref = values[REFERENCE[row]]
        for col, v in values.items():
            assert ratios[row][col] == (None if v is None else pytest.approx(v / ref))
    assert ratios["base"]["hf"] == 1.0 and ratios["mixed"]["hf_peft"] == 1.0


def test_w1_ratios_missing_reference_gives_none() -> None:
    cells = {
        "base": {"loragate": 10.0, "hf": None, "vllm": 4.0},
        "mixed": {"loragate": 5.0, "hf_peft": 2.0, "vllm": None},
    }
    ratios = report.w1_ratios(cells)
    assert ratios["base"] == {"loragate": None, "hf": None, "vllm": None}
    assert ratios["mixed"] == {"loragate": 2.5, "hf_peft": 1.0, "vllm": None}
    zero = report.w1_ratios({"base": {"loragate": 10.0, "hf": 0.0}, "mixed": {"hf_peft": None}})
    assert zero["base"] == {"loragate": None, "hf": None}  # no ZeroDivisionError


# -- the other parts' sections -----------------------------------------------------------------------------------


def test_scale_rows_sorted_with_ratios_to_the_smallest_count() -> None:
    curve = [
        {"adapters": 64, "cold_tok_s": 50.0, "warm_tok_s": 60.0, "distinct_in_batch": 19},
        "junk",
        {"adapters": 8, "cold_tok_s": 100.0, "warm_tok_s": 120.0},
        {"adapters": 512, "cold_tok_s": None, "warm_tok_s": 30.0},
    ]
    rows = report.scale_rows({"w1": {"figures": {"scale": curve}}})
    assert [r["adapters"] for r in rows] == [8, 64, 512]
    assert [r["cold_ratio"] for r in rows] == [1.0, 50 / 100, None]
    assert [r["warm_ratio"] for r in rows] == [1.0, 60 / 120, 30 / 120]
    assert rows[1]["distinct_in_batch"] == 19  # the entry's own keys are kept
    zero_first = report.scale_rows(
        {"w1": {"figures": {"scale": [{"adapters": 8, "cold_tok_s": 0.0}, {"adapters": 64, "cold_tok_s": 5.0}]}}}
    )
    assert [r["cold_ratio"] for r in zero_first] == [None, None]
    assert report.scale_rows({}) == []


def test_scale_rows_on_the_record(record: dict[str, Any]) -> None:
    curve = fig(record, "w1")["scale"]
    first = min(curve, key=lambda e: e["adapters"])
    rows = report.scale_rows(record["parts"])
    assert len(rows) == len(curve)
    for r in rows:
        assert r["warm_ratio"] == pytest.approx(r["warm_tok_s"] / first["warm_tok_s"])
        assert r["cold_ratio"] == pytest.approx(r["cold_tok_s"] / first["cold_tok_s"])


def test_serving_lines(record: dict[str, Any]) -> None:
    text = report.serving_lines(record["parts"])
    median = fig(record, "serving")["median"]
    for row, label in ROWS.items():
        m = median[row]
        line = line_starting(text, label)
        assert f"HTTP {m['http_ratio']:.2f}x (streamed {m['http_stream_ratio']:.2f}x)" in line
        assert f"gateway {m['gateway_ratio']:.2f}x (streamed {m['gateway_stream_ratio']:.2f}x)" in line
    only_base = report.serving_lines({"serving": {"figures": {"median": {"base": {"http_ratio": 1.5}}}}})
    assert "HTTP 1.50x" in line_starting(only_base, "W1 base")
    assert line_starting(only_base, "W1 mixed LoRA").endswith("HTTP n/a (streamed n/a), gateway n/a (streamed n/a)")
    assert report.serving_lines({}) is None
    assert report.serving_lines({"serving": {"status": "failed"}}) is None


def test_gateway_table(record: dict[str, Any]) -> None:
    g = fig(record, "gateway")
    lines = report.gateway_table(record["parts"]).splitlines()
    assert len(lines) == 2 + len(g["concurrency"]) + 1
    for line, e in zip(lines[2:], g["concurrency"], strict=False):  # (and the rollout line after them)
        assert line.split() == [
            f"c={e['c']}",
            *(f"{e[k]:.2f}" for k in ("direct_p50_ms", "gateway_p50_ms", "added_p50_ms", "added_p99_ms")),
        ]
    assert f"added p50 {g['rollout']['added_p50_ms']:.2f} ms" in lines[-1]
    assert f"{g['throughput_c32_rps']:.0f} req/s" in lines[-1]
    assert report.gateway_table({}) is None
    empty = report.gateway_table({"gateway": {"figures": {}}})
    assert "added p50 n/a ms; n/a req/s" in empty


def test_priority_table(record: dict[str, Any]) -> None:
    p = fig(record, "priority")
    text = report.priority_table(record["parts"])
    for path in ("http", "in_process"):
        e = p[path]
        unchanged = e.get("sheddable_outputs_unchanged")
        assert split_cells(line_starting(text, path.replace("_", "-"))) == [
            path.replace("_", "-"),
            *(f"{1e3 * e[k]:.1f}" for k in ("idle_ttft_p50_s", "loaded_ttft_p50_s", "loaded_ttft_p99_s")),
            f"{e['ratio_p50']:.2f}x",
            f"{e['ratio_p99']:.2f}x",
            "n/a" if unchanged is None else ("yes" if unchanged else "NO"),
        ]
    prefix = p["prefix_cache"]
    assert (
        f"{1e3 * prefix['mean_ttft_cache_on_s']:.1f} ms with the prefix cache, "
        f"{1e3 * prefix['mean_ttft_cache_off_s']:.1f} ms without ({prefix['ttft_ratio_on_off']:.2f}x)"
    ) in text


def test_priority_table_other_shapes() -> None:
    text = report.priority_table(
        {
            "priority": {
                "figures": {
                    "in_process": {"sheddable_outputs_unchanged": False},
                    "prefix_cache": {"hits": 12, "rate": 0.51234, "name": "x"},
                }
            }
        }
    )
    assert split_cells(line_starting(text, "in-process"))[-1] == "NO"
    assert "http" not in text.split("\n", 2)[2]  # no row for the path not measured
    assert text.endswith("\nshared prefix: hits 12, rate 0.512")
    assert report.priority_table({"priority": {"figures": {}}}) == "critical TTFT: n/a"
    assert report.priority_table({}) is None


def test_step_table() -> None:
    entries = [
        {"workload": "greedy", "running": 8, "total": 5.0},
        {"workload": "lora", "running": 8, "total": 3.5},
        {"workload": "greedy", "running": 1, "total": 10.0},
        {"workload": "odd", "running": "32"},
        "junk",
    ]
    lines = report.step_table({"step": {"figures": entries}}).splitlines()
    assert split_cells(lines[0]) == ["µs/request/step", "1 running", "8 running"]  # sizes sorted, ints only
    assert [split_cells(line) for line in lines[2:]] == [
        ["greedy", "10.0", "5.0"],
        ["lora", "n/a", "3.5"],
        ["odd", "n/a", "n/a"],
    ]
    assert report.step_table({}) is None
    assert report.step_table({"step": {"figures": []}}) is None


# -- summary ----------------------------------------------------------------------------------------------------


def test_summary_of_the_record(record: dict[str, Any]) -> None:
    text = report.summary(record)
    m = record["machine"]
    first = text.splitlines()[0]
    assert m["cpu_model"] in first and f"{m['usable_cpus']} usable CPUs" in first and m["torch"] in first
    assert "QUICK" not in first
    assert f"command: {record['command']}" in text
    cells = expected_cells(record)
    for row, label in ROWS.items():
        ref = cells[row][REFERENCE[row]]
        assert split_cells(line_starting(w1_block(text), label)) == [
            label,
            *("n/a" if cells[row][c] is None else f"{cells[row][c]:.1f} ({cells[row][c] / ref:.2f}x)" for c in COLUMNS),
        ]
    for title in (
        "over HTTP / in-process",
        "adapter scale",
        "gateway overhead",
        "priority (bench/priority.py)",
        "step overhead",
        "adapter affinity on / off",
    ):
        assert title in text
    statuses = ", ".join(f"{name} {p['status']} ({p['seconds']:.0f} s)" for name, p in record["parts"].items())
    assert f"parts: {statuses}" in text
    assert "NOT QUIET" not in text and "FAILED" not in text


def test_summary_with_parts_missing_or_failed(record: dict[str, Any]) -> None:
    w1 = copy.deepcopy(record["parts"]["w1"])
    del w1["figures"]["scale"]
    record["config"]["quick"] = True
    record["parts"] = {
        "w1": w1,
        "gateway": {
            "status": "failed",
            "error": "exit 1: python bench/gateway_overhead.py",
            "seconds": 3.2,
            "other_cpus": 0.5,
            "log": "/tmp/g.log",
            "log_tail": ["Traceback (most recent call last):", "ValueError: boom"],
        },
    }
    text = report.summary(record)
    assert "QUICK smoke run" in text.splitlines()[0]
    for title in (
        "over HTTP / in-process",
        "adapter scale",
        "gateway overhead",
        "priority (",
        "step overhead",
        "adapter affinity",
    ):
        assert title not in text
    assert "vLLM-CPU" not in text and "loragate HTTP" in w1_block(text)  # the vllm part was not run: no column
    base = w1["figures"]["base"]
    assert split_cells(line_starting(w1_block(text), "W1 base")) == [
        "W1 base",
        f"{base['loragate_tok_s']:.1f} ({base['loragate_tok_s'] / base['hf_tok_s']:.2f}x)",
        "n/a",
        "n/a",
        f"{base['hf_tok_s']:.1f} (1.00x)",
        "n/a",
    ]
    assert f"parts: w1 ok ({w1['seconds']:.0f} s), gateway failed (3 s)" in text
    assert "gateway FAILED: exit 1: python bench/gateway_overhead.py (log: /tmp/g.log)" in text
    assert "\n  | ValueError: boom" in text
    not_quiet = line_starting(text, "NOT QUIET")
    assert "gateway (0.50 CPUs on average)" in not_quiet and "w1" not in not_quiet


def test_summary_with_no_parts(record: dict[str, Any]) -> None:
    record["parts"] = {}
    text = report.summary(record)
    assert "(not measured)" in text
    assert text.endswith("parts: ")


# -- plots ----------------------------------------------------------------------------------------------------


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE) and data[12:16] == b"IHDR" and data.endswith(b"IEND\xaeB`\x82")


def test_plot_writes_both_pngs(record: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    stem = tmp_path / "2026-12-01-vm"
    written = report.plot(record, stem)
    assert written == [tmp_path / "2026-12-01-vm-w1.png", tmp_path / "2026-12-01-vm-scale.png"]
    assert sorted(tmp_path.iterdir()) == sorted(written)
    for path in written:
        assert_png(path)


def test_plot_skips_what_was_not_measured(record: dict[str, Any], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    del record["parts"]["w1"]["figures"]["scale"]
    assert report.plot(record, tmp_path / "a") == [tmp_path / "a-w1.png"]
    assert_png(tmp_path / "a-w1.png")
    record["parts"] = {}
    assert report.plot(record, tmp_path / "b") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-w1.png"]


# -- command line ---------------------------------------------------------------------------------------------


def test_parse_parts() -> None:
    assert report.parse_parts(["w1, vllm", "step,", " "]) == {"w1", "vllm", "step"}
    assert report.parse_parts([]) == set()
    with pytest.raises(argparse.ArgumentTypeError, match="bogus"):
        report.parse_parts(["w1,bogus"])


def test_result_stem() -> None:
    out = Path("out")
    assert report.result_stem(out, "2026-12-01", "vm", False) == out / "2026-12-01-vm"
    assert report.result_stem(out, "2026-12-01", "my host/x.lan", True) == out / "2026-12-01-my-host-x.lan-quick"
    assert report.result_stem(out, "2026-12-01", "-a-", False) == out / "2026-12-01-a"
    assert report.result_stem(out, "2026-12-01", "!!!", False) == out / "2026-12-01-host"


def test_command_line() -> None:
    argv = ["--quick", "--out-dir", "my dir", "--skip", "vllm,step"]
    made = shlex.split(report.command_line(argv, under_make=True))
    assert made[:2] == ["make", "bench"] and len(made) == 3
    name, _, value = made[2].partition("=")
    assert name == "BENCH_ARGS" and shlex.split(value) == argv  # the shell gives make the arguments back
    assert report.command_line([], under_make=True) == "make bench"
    assert shlex.split(report.command_line(argv, under_make=False)) == ["python", "bench/report.py", *argv]


# -- the vLLM comparisons (bench/w1_compare.py, bench/served_vllm_client.py) -----------------------------------

COMPARE = {
    "medians": {
        f"{system} {dtype} {row}": value
        for (system, dtype, row), value in {
            ("loragate", "float32", "base"): 523.1,
            ("loragate", "float32", "mixed"): 437.5,
            ("vllm", "float32", "base"): 391.4,
            ("vllm", "float32", "mixed"): 111.2,
            ("loragate", "bfloat16", "base"): 1411.0,
            ("loragate", "bfloat16", "mixed"): 1020.0,
            ("vllm", "bfloat16", "base"): 817.4,
            ("vllm", "bfloat16", "mixed"): 138.3,
        }.items()
    },
    "threads": 2,
}


def burst(tok_s: float, ttft: float, tpot: float) -> dict[str, float]:
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot}


SERVED = {
    "float32": {
        "loragate": {"first": burst(300.0, 1300, 86.0), "warm": burst(290.0, 1385, 88.5)},
        "vllm": {"first": burst(235.2, 2322, 100.7), "warm": burst(250.0, 2149, 96.1)},
    },
    "bfloat16": {
        "loragate": {"first": burst(762.0, 400, 34.0), "warm": burst(762.0, 458, 34.6)},
        "vllm": {"first": burst(600.0, 522, 45.6), "warm": burst(610.0, 466, 44.9)},
    },
}


def ok(figures: Any) -> dict[str, Any]:
    return {"status": "ok", "seconds": 1.0, "figures": figures}


def test_compare_table() -> None:
    lines = report.compare_table({"compare": ok(COMPARE)}).splitlines()
    assert split_cells(lines[0]) == ["W1 tok/s, median", "loragate", "vLLM-CPU", "loragate / vLLM", "LoRA / base"]
    med = COMPARE["medians"]
    for line, (dtype, row) in zip(
        lines[2:], [(d, r) for d in ("float32", "bfloat16") for r in ("base", "mixed")], strict=True
    ):
        ours, theirs = med[f"loragate {dtype} {row}"], med[f"vllm {dtype} {row}"]
        want = [f"{dtype} {row}", f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}x"]
        if row == "mixed":
            want.append(f"{ours / med[f'loragate {dtype} base']:.2f}x")
        assert split_cells(line) == want
    assert report.compare_table({}) is None
    assert report.compare_table({"compare": {"status": "failed"}}) is None


def test_served_table() -> None:
    lines = report.served_table({"served": ok(SERVED)}).splitlines()
    assert len(lines) == 4
    for line, dtype in zip(lines[2:], ("float32", "bfloat16"), strict=True):
        ours, theirs = SERVED[dtype]["loragate"], SERVED[dtype]["vllm"]
        warm_ours, warm_theirs = ours["warm"]["output_throughput"], theirs["warm"]["output_throughput"]
        first_warm = [r["first"]["output_throughput"] / r["warm"]["output_throughput"] for r in (ours, theirs)]
        assert split_cells(line) == [
            dtype,
            f"{warm_ours:.1f}",
            f"{warm_theirs:.1f}",
            f"{warm_ours / warm_theirs:.2f}x",
            f"{ours['warm']['mean_ttft_ms']:.0f} / {theirs['warm']['mean_ttft_ms']:.0f}",
            f"{ours['warm']['mean_tpot_ms']:.1f} / {theirs['warm']['mean_tpot_ms']:.1f}",
            f"{first_warm[0]:.2f}x / {first_warm[1]:.2f}x",
        ]
    only_fp32 = report.served_table({"served": ok({"float32": SERVED["float32"]})}).splitlines()
    assert len(only_fp32) == 3 and only_fp32[2].startswith("float32")
    assert report.served_table({"served": ok({"float16": {}})}) is None
    assert report.served_table({}) is None


def test_the_vllm_parts_run_both_dtypes_against_the_given_interpreter(tmp_path: Path) -> None:
    out, vllm = tmp_path / "out.json", "/venv/bin/python"
    [compare] = report.part_commands("compare", report.Sizes(), out, tmp_path, vllm)
    assert Path(compare[1]).name == "w1_compare.py"
    assert compare[compare.index("--vllm-python") + 1] == vllm
    assert compare[compare.index("--dtypes") + 1] == "float32,bfloat16"
    assert compare[compare.index("--json") + 1] == str(out)
    [served] = report.part_commands("served", report.Sizes.quick(), out, tmp_path, vllm)
    assert Path(served[1]).name == "served_vllm_client.py"
    assert served[served.index("--dtype") + 1] == "float32,bfloat16"
    assert served[served.index("--concurrency") + 1] == str(report.Sizes.quick().requests)
    assert served[served.index("--json") + 1] == str(out)
    assert set(report.VLLM_PARTS) == {"vllm", "compare", "served"} <= set(report.PARTS)


def test_summary_shows_the_vllm_comparisons(record: dict[str, Any]) -> None:
    record["parts"]["compare"] = ok(COMPARE)
    record["parts"]["served"] = ok(SERVED)
    text = report.summary(record)
    assert "W1 on equal terms (bench/w1_compare.py" in text
    assert line_starting(text, "bfloat16 base").split()[-1] == f"{1411.0 / 817.4:.2f}x"
    served = text.split("served, vLLM's own benchmark client", 1)[1].split("\n\n", 1)[0].splitlines()
    assert split_cells(served[3])[:4] == ["float32", "290.0", "250.0", f"{290.0 / 250.0:.2f}x"]


# -- a part's own CPU time --------------------------------------------------------------------------------

# A part as vLLM's server behaves when stopped: its process starts a child that starts a grandchild (burning
# ~1.5 CPU-seconds) and ends at once, leaving the grandchild an orphan; the part's process waits for the
# grandchild's marker, then writes its JSON.
ORPHAN_PART = """
import json, subprocess, sys, time
from pathlib import Path
out, marker = Path(sys.argv[1]), Path(sys.argv[2])
burn = "import time, pathlib, sys\\nwhile time.process_time() < 1.5: pass\\npathlib.Path(sys.argv[1]).touch()"
spawn = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}, {str(marker)!r}])"
subprocess.run([sys.executable, "-c", spawn], check=True)
deadline = time.monotonic() + 60
while not marker.exists() and time.monotonic() < deadline:
    time.sleep(0.05)
out.write_text(json.dumps({"ok": True}))
"""

# Runs the part twice in a fresh interpreter (becoming a subreaper lasts for the process): first as run_part did
# before orphans were adopted, then after `adopt_orphans`; prints how much CPU time each run counted as its own.
ORPHAN_DRIVER = """
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("bench_report", sys.argv[1])
report = importlib.util.module_from_spec(spec)
sys.modules["bench_report"] = report
spec.loader.exec_module(report)
tmp, script = Path(sys.argv[2]), sys.argv[3]
own = {}
for name in ("not adopting", "adopting"):
    reap = name == "adopting" and report.adopt_orphans()
    out, marker = tmp / f"{name}.json", tmp / f"{name}.marker"
    before = report.children_cpu_s()
    result = report.run_part(
        "orphan", [[sys.executable, script, str(out), str(marker)]], out, tmp / f"{name}.log", 120, False, reap=reap
    )
    assert result["status"] == "ok", result
    own[name] = report.children_cpu_s() - before
print(json.dumps(own))
"""


def test_run_part_counts_the_orphans_a_part_leaves_as_its_own(tmp_path: Path) -> None:
    import subprocess

    script = tmp_path / "part.py"
    script.write_text(ORPHAN_PART)
    driver = subprocess.run(
        [sys.executable, "-c", ORPHAN_DRIVER, str(REPO / "bench" / "report.py"), str(tmp_path), str(script)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert driver.returncode == 0, driver.stderr
    own = json.loads(driver.stdout.strip().splitlines()[-1])
    # before: the orphan's ~1.5 CPU-seconds were nobody's (init reaped it), so they counted as another process's
    assert own["not adopting"] < 1.2
    # now: the part's process, its child and the orphan, reaped by run_part
    assert own["adopting"] >= 1.45
