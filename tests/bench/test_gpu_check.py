"""bench/gpu_check.py's smoke run (`--smoke`: every section at toy sizes on the CPU, kernels interpreted), run once
as the GPU host would run the real one: a subprocess with a deadline, then its JSON record and printed table.

Covered: every section and part is in the record and ran (the sanitizer is skipped by design without a GPU); the
engine's greedy tokens equal PEFT's own greedy decoding (tests/lora_fixtures.py) for a batch of base + 3 adapters
whose PEFT outputs differ from the base model's, so the comparison can fail, with graphs on (EagerGraph through the
engine's CUDA-graph seam) and off; the kernel, throughput and memory figures are positive, every request decoded with
its own adapter resident; the table has a row per figure and no FAILED one.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.py"
SECTIONS = ["kernel_tests", "engine_vs_peft", "kernel_throughput", "engine_throughput"]
PARTS = {
    "kernel_tests": ["tests", "sanitizer"],
    "engine_vs_peft": ["peft"],
    "kernel_throughput": ["kernels"],
    "engine_throughput": ["smollm2", "llama8b"],
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], str]:
    """The smoke run's JSON record and stdout (one run for the whole module)."""
    out = tmp_path_factory.mktemp("gpu-check") / "check.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--smoke", "--json", str(out), "--budget-s", "120"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == 0, f"stdout:\n{proc.stdout[-6000:]}\nstderr:\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text()), proc.stdout


def part(record: dict[str, Any], section: str, name: str) -> dict[str, Any]:
    return record["sections"][section]["parts"][name]


def test_every_section_ran(run: tuple[dict[str, Any], str]) -> None:
    record, _ = run
    assert record["smoke"] is True
    assert list(record["sections"]) == SECTIONS
    for section in SECTIONS:
        assert record["sections"][section]["status"] == "ok", record["sections"][section]
        assert sorted(record["sections"][section]["parts"]) == sorted(PARTS[section])
        for name, p in record["sections"][section]["parts"].items():
            expected = "skipped" if name == "sanitizer" else "ok"
            assert p["status"] == expected, (name, p["reason"])
    assert part(record, "kernel_tests", "sanitizer")["reason"] == "smoke run (no GPU)"
    assert record["host"]["torch"] and record["elapsed_s"] < record["budget_s"]


def test_kernel_tests_passed(run: tuple[dict[str, Any], str]) -> None:
    figures = part(run[0], "kernel_tests", "tests")["figures"]
    assert figures["passed"] > 0
    assert figures["failed"] == figures["error"] == 0
    assert figures["rc"] == 0


def test_engine_equals_peft_greedy(run: tuple[dict[str, Any], str]) -> None:
    figures = part(run[0], "engine_vs_peft", "peft")["figures"]
    ref = figures["reference"]
    jobs, peft = ref["jobs"], ref["peft_tokens"]
    assert [j["adapter"] is None for j in jobs] == [False, False, False, True]
    assert len({j["adapter"] for j in jobs}) == 4  # three distinct adapters and the base model in one batch
    assert all(len(tokens) == ref["new_tokens"] > 0 for tokens in peft)
    # The adapters change PEFT's output, so the engine could not match it by ignoring them.
    assert ref["adapters_change_output"] is True
    for j, p, base in zip(jobs, peft, ref["base_tokens"], strict=True):
        assert (p != base) == (j["adapter"] is not None)
    for mode in ("on", "off"):
        run_figures = figures[f"graphs_{mode}"]
        assert run_figures["lora_backend"] == "triton"  # the GPU's kernels, interpreted
        assert run_figures["tokens"] == peft  # the engine's own tokens, compared here too
        assert run_figures["equal"] is True and run_figures["first_mismatch"] is None
        assert "warm_up_error" not in run_figures
    # "on": the runner replays its decode steps from graphs (EagerGraph on a CPU: the GPU's static inputs, padding
    # rows and buckets, the step run again on replay); "off": it has none.
    assert figures["graphs_on"]["graph_captures"] >= 1 and figures["graphs_on"]["graph_kind"] == "EagerGraph"
    assert figures["graphs_off"]["graph_captures"] is None


def test_kernel_figures_are_positive(run: tuple[dict[str, Any], str]) -> None:
    figures = part(run[0], "kernel_throughput", "kernels")["figures"]
    cases = [key for key in figures if key.startswith(("group_T", "single_T"))]
    assert sorted(cases) == ["group_T1", "group_T4", "single_T4"]
    for key in cases:
        case = figures[key]
        for name in ("triton_us", "torch_us", "bmm_us", "bmm_over_triton"):
            assert case[name] > 0, (key, name)
    assert figures["group_T4"]["max_rel_diff"] < 3e-2  # the three ways agreed before they were timed


def test_throughput_figures_are_positive(run: tuple[dict[str, Any], str]) -> None:
    for name in ("smollm2", "llama8b"):
        figures = part(run[0], "engine_throughput", name)["figures"]
        setup = figures["setup"]
        for mode in ("on", "off"):
            f = figures[f"graphs_{mode}"]
            assert f["cuda_graphs"] is (mode == "on")
            for key in ("base_tok_s", "mixed_tok_s", "mixed_over_base", "peak_gib", "base_e2e_tok_s"):
                assert f[key] > 0, (name, mode, key)
            assert f["resident_adapters"] == setup["adapters"]  # every request had its own adapter on the device
            assert f["mixed_decode_steps"] == setup["new_tokens"] - 1  # the whole batch decoded in lockstep
            assert "warm_up_error" not in f


def test_table_lists_every_figure(run: tuple[dict[str, Any], str]) -> None:
    record, stdout = run
    rows = record["table"]
    assert {r["section"][0] for r in rows} == {"1", "2", "3", "4"}
    assert not [r for r in rows if r["verdict"] == "FAILED"]
    table = stdout[stdout.index("| section | item | result | target | verdict |") :]
    for r in rows:
        assert f"| {r['section']} | {r['item']} | {r['result']} |" in table
    assert sum("equal to PEFT" in r["result"] for r in rows) == 2
