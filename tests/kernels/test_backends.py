"""The backend object (loragate_kernels/backends.py): docs/backends.md's table says what it does for every row; this
machine's probe agrees with what its flags imply; forcing a route through the environment works, and refuses what
cannot run with a message that says why; and where the C++ ops cannot be built (no compiler, or switched off) every
seam takes its torch route and the engine still matches HF transformers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from loragate_kernels.backends import Backends, Gemm, Kernel, Machine, forced_by_environment

REPO = Path(__file__).resolve().parents[2]
TABLE = REPO / "docs" / "backends.md"
COLUMNS = ["device", "--dtype", "CPU flags", "C++ ops", "dtype", "lora", "attention", "layer", "sampler", "gemm"]
AVX512 = frozenset("avx2 fma avx512f avx512bw avx512vl avx512dq".split())


def table_rows() -> list[dict[str, str]]:
    """docs/backends.md's routes table, one dict per row keyed by its header."""
    lines = TABLE.read_text(encoding="utf-8").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("| device | --dtype |"))
    header = [cell.strip() for cell in lines[start].strip("|").split("|")]
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")), strict=True)))
    return rows


def described(row: dict[str, str]) -> Backends:
    machine = Machine.described(row["device"], frozenset(row["CPU flags"].split()), row["C++ ops"] == "built")
    return Backends.resolve(row["device"], row["--dtype"], machine=machine, forced={})


def shown(backends: Backends) -> dict[str, str]:
    """The object as the table's cells."""
    described = backends.describe()
    return {
        "dtype": described["dtype"],
        **{seam: described[seam] for seam in ("lora", "attention", "layer", "sampler", "gemm")},
        "gemm dtype": described["gemm_dtype"],
    }


@pytest.mark.parametrize("row", table_rows(), ids=lambda row: " ".join(row[c] for c in COLUMNS[:4] if row[c]))
def test_the_docs_table_says_what_the_object_does(row: dict[str, str]) -> None:
    expected = {key: row[key] for key in ("dtype", "lora", "attention", "layer", "sampler", "gemm", "gemm dtype")}
    assert shown(described(row)) == expected


def test_the_table_covers_every_route() -> None:
    objects = [described(row) for row in table_rows()]
    assert {b.gemm for b in objects} == set(Gemm)
    for seam, routes in (("lora", set(Kernel)), ("attention", set(Kernel)), ("layer", {Kernel.CPP, Kernel.TORCH})):
        assert {getattr(b, seam) for b in objects} == routes, seam
    assert {b.dtype for b in objects} == {torch.float32, torch.bfloat16, torch.float16}


def test_this_machine_is_what_its_flags_describe() -> None:
    """The probe (built ops asked which kernels run here, oneDNN asked what it packs) agrees with what the table's
    rows infer from flags alone, so the table is about real machines."""
    probe = Machine.probe("cpu")
    inferred = Machine.described("cpu", probe.cpu_flags, probe.cpu_ops)
    for field in ("panels", "amx", "bf16_dot", "onednn_dtypes"):
        assert getattr(probe, field) == getattr(inferred, field), field
    for dtype in ("auto", "float32", "bfloat16"):
        real = Backends.resolve("cpu", dtype, forced={})
        assert shown(real) == shown(Backends.resolve("cpu", dtype, machine=inferred, forced={}))
        assert real.describe()["cpu_ops"] == ("built" if probe.cpu_ops else f"not built: {probe.cpu_ops_problem}")


CPU_BUILT = Machine.described("cpu", AVX512, cpu_ops=True)
CPU_BARE = Machine.described("cpu", AVX512, cpu_ops=False)
CUDA = Machine.described("cuda", frozenset())


def test_forcing_each_seam() -> None:
    forced = Backends.resolve("cpu", "float32", machine=CPU_BUILT, forced={"lora": "triton", "attention": "torch"})
    assert (forced.lora, forced.attention, forced.layer, forced.gemm) == (
        Kernel.TRITON,
        Kernel.TORCH,
        Kernel.CPP,
        Gemm.PANELS,
    )
    layer = Backends.resolve("cpu", "float32", machine=CPU_BUILT, forced={"layer": "torch", "gemm": "onednn"})
    assert (layer.layer, layer.sampler, layer.gemm) == (Kernel.TORCH, Kernel.TORCH, Gemm.ONEDNN)
    assert Backends.resolve("cpu", "float32", machine=CPU_BUILT, forced={"gemm": "torch"}).gemm is Gemm.TORCH
    # what the environment forced is shown, in the log line and in GET /load
    assert forced.describe()["forced"] == {"attention": "torch", "lora": "triton"}
    assert "forced by the environment" in forced.summary()
    assert "forced" not in Backends.resolve("cpu", "float32", machine=CPU_BUILT, forced={}).describe()


@pytest.mark.parametrize(
    ("machine", "forced", "message"),
    [
        (CPU_BUILT, {"lora": "cuda"}, "LORAGATE_LORA_BACKEND must be one of torch, triton, cpp, not 'cuda'"),
        (CPU_BUILT, {"layer": "triton"}, "LORAGATE_LAYER_BACKEND must be one of torch, cpp"),
        (CPU_BUILT, {"gemm": "mkl"}, "LORAGATE_GEMM_BACKEND must be one of torch, onednn, cpp"),
        (CPU_BARE, {"attention": "cpp"}, "LORAGATE_ATTENTION_BACKEND=cpp, but the CPU ops cannot be built"),
        (CPU_BARE, {"gemm": "cpp"}, "LORAGATE_GEMM_BACKEND=cpp, but the CPU ops cannot be built"),
        (CUDA, {"lora": "cpp"}, "compute on CPU tensors, and the device is cuda"),
        (CUDA, {"gemm": "onednn"}, "lays weights out for a CPU"),
        (Machine("cpu", AVX512, True), {"gemm": "onednn"}, "this torch has no oneDNN"),
        (CPU_BUILT, {"kv": "cpp"}, "no seam named kv"),
    ],
)
def test_a_route_that_cannot_run_is_refused_saying_why(machine: Machine, forced: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Backends.resolve(machine.device_type, "float32", machine=machine, forced=forced)


def test_an_unknown_dtype_is_refused() -> None:
    with pytest.raises(ValueError, match="dtype must be auto, float32, bfloat16, float16, got 'fp8'"):
        Backends.resolve("cpu", "fp8", machine=CPU_BUILT, forced={})


def test_the_environment_is_read_here(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in ("LORAGATE_LORA_BACKEND", "LORAGATE_ATTENTION_BACKEND", "LORAGATE_GEMM_BACKEND"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("LORAGATE_LAYER_BACKEND", " Torch ")
    assert forced_by_environment() == {"layer": "torch"}
    assert Backends.resolve("cpu", "float32", machine=CPU_BUILT).layer is Kernel.TORCH
    assert forced_by_environment({"LORAGATE_GEMM_BACKEND": "onednn", "LORAGATE_CPU_OPS": "0"}) == {"gemm": "onednn"}


# A fresh interpreter on a machine whose C++ ops cannot be built (a compiler that fails, an empty build directory:
# nothing to reuse), or that switched them off: the routes it takes, and a tiny engine's greedy tokens against HF's.
FALLBACK = """
import json, torch
from transformers import AutoModelForCausalLM
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import SamplingParams
from engine.model.sources import resolve_model
from loragate_kernels.backends import Backends
from loragate_kernels.cpu import build

engine = LLMEngine(EngineConfig(model="tiny-random", dtype="float32", warmup=False))
prompt = [5, 17, 250, 3, 99, 42, 7]
engine.add_request("r", prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
ours = []
while engine.has_unfinished_requests():
    ours += [t for out in engine.step() for t in out.new_token_ids]
hf = AutoModelForCausalLM.from_pretrained(resolve_model("tiny-random").path, dtype=torch.float32)
want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
print(json.dumps({"built": build.load(), "reason": build.unavailable_reason(), "backends": engine.backends.describe(),
                  "ours": ours, "hf": want}))
"""


@pytest.mark.parametrize(
    "env",
    [{"CXX": "/bin/false"}, {"LORAGATE_CPU_OPS": "0"}],
    ids=["no-compiler", "switched-off"],
)
def test_without_the_cpu_ops_every_seam_takes_its_torch_route(env: dict[str, str], tmp_path: Path) -> None:
    env = {**os.environ, **env, "LORAGATE_TORCH_EXTENSIONS": str(tmp_path / "ext"), "TOKENIZERS_PARALLELISM": "false"}
    for seam in ("LORA", "ATTENTION", "LAYER", "GEMM"):
        env.pop(f"LORAGATE_{seam}_BACKEND", None)
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(FALLBACK)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["built"] is False and result["reason"]
    backends = result["backends"]
    assert {seam: backends[seam] for seam in ("lora", "attention", "layer", "sampler")} == dict.fromkeys(
        ("lora", "attention", "layer", "sampler"), "torch"
    )
    assert backends["gemm"] == "onednn" and backends["cpu_ops"].startswith("not built: ")
    assert result["ours"] == result["hf"] and len(result["ours"]) == 8
