"""Which kernel computes each seam of a step, decided once, when the engine starts.

`Backends.resolve(device, dtype)` looks at the machine (`Machine.probe`: the device's kind; on a CPU its feature
flags, whether the C++ ops built, which of their GEMM kernels this CPU runs, which dtypes oneDNN packs) and at what
the environment forces, and names one route for every seam:

    seam       routes                                     asked by
    dtype      float32 | bfloat16 | float16               the weights and the KV cache (`auto` is resolved here)
    lora       cpp | torch | triton                       engine/lora/routes.py (one class per route)
    attention  cpp | torch | triton                       engine/model/attention.py (decodes, short prompt chunks)
    layer      cpp | torch                                engine/model/layer_ops.py (norms, RoPE + K/V write, SiLU)
    sampler    cpp | torch                                engine/worker/sampler.py (greedy rows)
    gemm       panels | skinny | amx | dot | onednn | torch   engine/model/cpu_gemm.py (projections, the LM head)

The engine logs the object once at start and shows it in GET /load; the model, the runner and the sampler ask it,
never the environment. docs/engine.md's backend table gives the routes per machine, and
tests/kernels/test_backends.py builds the object for every row of that table.

Forcing a route (the tests run every route on a CPU this way; an operator can step around a kernel):
LORAGATE_LORA_BACKEND and LORAGATE_ATTENTION_BACKEND (torch|triton|cpp: "triton" on CPU tensors runs under Triton's
interpreter), LORAGATE_LAYER_BACKEND (torch|cpp; the sampler follows it) and LORAGATE_GEMM_BACKEND
(torch|onednn|cpp: "cpp" takes whichever C++ GEMM this CPU runs). This module reads them; nothing else does.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch

from loragate_kernels.cpu import build as cpu_build

logger = logging.getLogger(__name__)


class Kernel(str, Enum):
    """Who computes a seam: the CPU's C++ ops, plain torch ops (the twins), or Triton (CUDA; interpreted on CPUs)."""

    CPP = "cpp"
    TORCH = "torch"
    TRITON = "triton"


class Gemm(str, Enum):
    """How the projections and the LM head multiply (engine/model/cpu_gemm.py says why each exists)."""

    PANELS = "panels"  # fp32: loragate_kernels/cpu/panels.cpp over a panel layout, every row count (AVX-512)
    SKINNY = "skinny"  # fp32: loragate_kernels/cpu/gemm.cpp up to 64 rows, oneDNN above, row-major weight (AVX2)
    AMX = "amx"  # bf16: loragate_kernels/cpu/amx.cpp's tile layout on AMX tiles
    DOT = "dot"  # bf16: loragate_kernels/cpu/amx.cpp's tile layout on the bf16 dot instruction (avx512_bf16)
    ONEDNN = "onednn"  # oneDNN-prepacked weights
    TORCH = "torch"  # plain F.linear (CUDA; dtypes no CPU route computes)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# The environment variable that forces each seam, and the values it takes.
FORCING = {
    "lora": ("LORAGATE_LORA_BACKEND", ("torch", "triton", "cpp")),
    "attention": ("LORAGATE_ATTENTION_BACKEND", ("torch", "triton", "cpp")),
    "layer": ("LORAGATE_LAYER_BACKEND", ("torch", "cpp")),
    "gemm": ("LORAGATE_GEMM_BACKEND", ("torch", "onednn", "cpp")),
}


@dataclass(frozen=True, slots=True)
class Machine:
    """What the routes are chosen from. `probe` reads this machine; `described` says what a machine with the given CPU
    flags would report (the rows of docs/engine.md's backend table)."""

    device_type: str  # "cpu" or "cuda"
    cpu_flags: frozenset[str] = frozenset()
    cpu_ops: bool = False  # the C++ ops built and are registered (torch.ops.loragate_cpu)
    cpu_ops_problem: str | None = None  # why they did not (None where they did, and on CUDA)
    panels: bool = False  # loragate_kernels/cpu/panels.cpp runs here
    amx: bool = False  # loragate_kernels/cpu/amx.cpp runs on AMX tiles here (the CPU has them, Linux grants them)
    bf16_dot: bool = False  # loragate_kernels/cpu/amx.cpp runs on the bf16 dot instruction here
    onednn_dtypes: frozenset[torch.dtype] = frozenset()  # the weight dtypes oneDNN packs here (empty: no oneDNN)

    @staticmethod
    def probe(device: torch.device | str) -> Machine:
        """This machine, as seen from `device` (on a CPU this builds the C++ ops, once per process)."""
        return _probe(torch.device(device).type)

    @staticmethod
    def described(device_type: str, flags: frozenset[str], cpu_ops: bool = True) -> Machine:
        """What `probe` reports on a machine whose CPU has `flags`, where the C++ ops build (`cpu_ops`) and torch has
        oneDNN. oneDNN packs bf16 weights where the CPU has AVX-512 (bw, vl, dq) or avx_ne_convert."""
        if device_type != "cpu":
            return Machine(device_type)
        packs_bf16 = {"avx512bw", "avx512vl", "avx512dq"} <= flags or "avx_ne_convert" in flags
        return Machine(
            "cpu",
            flags,
            cpu_ops,
            None if cpu_ops else "described without them",
            panels=cpu_ops and "avx512f" in flags,
            amx=cpu_ops and {"amx_tile", "amx_bf16"} <= flags,
            bf16_dot=cpu_ops and "avx512_bf16" in flags,
            onednn_dtypes=frozenset({torch.float32, torch.bfloat16} if packs_bf16 else {torch.float32}),
        )


@functools.cache
def _probe(device_type: str) -> Machine:
    if device_type != "cpu":
        return Machine(device_type)
    flags = cpu_build.cpu_flags()
    built = cpu_build.load()
    ops = torch.ops.loragate_cpu if built else None
    return Machine(
        "cpu",
        flags,
        built,
        cpu_build.unavailable_reason(),
        panels=ops is not None and "avx512f" in flags and bool(ops.panels_ready()),
        amx=ops is not None and {"amx_tile", "amx_bf16"} <= flags and bool(ops.amx_ready()),
        bf16_dot=ops is not None and "avx512_bf16" in flags and bool(ops.dot_ready()),
        onednn_dtypes=frozenset(d for d in (torch.float32, torch.bfloat16) if _onednn_packs(d)),
    )


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN lays out weights of `dtype` on this CPU, asked of oneDNN itself with a tiny weight (on an
    AVX2-only CPU its bf16 reorder raises)."""
    if not onednn_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 32)
    except RuntimeError as exc:
        logger.info("oneDNN does not pack %s weights on this CPU (%s)", dtype, exc)
        return False
    return True


def forced_by_environment(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The routes the environment forces, by seam (values checked by `Backends.resolve`)."""
    env = os.environ if env is None else env
    forced = {}
    for seam, (variable, _) in FORCING.items():
        value = env.get(variable, "").strip().lower()
        if value:
            forced[seam] = value
    return forced


def _dtype(device_type: str, requested: str | torch.dtype, machine: Machine) -> tuple[torch.dtype, str]:
    """The dtype served, and why: "auto" is bfloat16 on CUDA and on CPUs that compute bf16 natively (avx512_bf16 or
    AMX: bf16 GEMMs run ~2x fp32 there, and half the bytes stream per step), float32 on other CPUs (no bf16
    arithmetic: a bf16 model's GEMMs would run in fp32 anyway, so fp32 is as fast and exact)."""
    if isinstance(requested, torch.dtype):
        return requested, "given"
    if requested != "auto":
        if requested not in DTYPES:
            raise ValueError(f"dtype must be auto, {', '.join(DTYPES)}, got {requested!r}")
        return DTYPES[requested], "--dtype"
    if device_type != "cpu":
        return torch.bfloat16, "auto on CUDA"
    native = [f for f in NATIVE_BF16_FLAGS if f in machine.cpu_flags]
    if native:
        return torch.bfloat16, f"auto: the CPU computes bf16 natively ({', '.join(native)})"
    return torch.float32, "auto: the CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)"


def _kernel(seam: str, forced: Mapping[str, str], machine: Machine, gpu: Kernel) -> Kernel:
    """The route of a kernel seam: the forced one, else `gpu` on CUDA; on a CPU the C++ ops where they built."""
    value = forced.get(seam)
    if value is None:
        if machine.device_type != "cpu":
            return gpu
        return Kernel.CPP if machine.cpu_ops else Kernel.TORCH
    variable, choices = FORCING[seam]
    if value not in choices:
        raise ValueError(f"{variable} must be one of {', '.join(choices)}, not {value!r}")
    if value == "cpp" and machine.device_type != "cpu":
        raise ValueError(f"{variable}=cpp: the C++ ops compute on CPU tensors, and the device is {machine.device_type}")
    if value == "cpp" and not machine.cpu_ops:
        raise ValueError(f"{variable}=cpp, but the CPU ops cannot be built: {machine.cpu_ops_problem}")
    return Kernel(value)


def _gemm(forced: Mapping[str, str], machine: Machine, dtype: torch.dtype) -> tuple[Gemm, torch.dtype]:
    """The GEMM route and the dtype it computes in.

    On a CPU, weights are laid out once at load for the kernel that multiplies them: fp32 on cpu/panels.cpp where the
    CPU has AVX-512, else cpu/gemm.cpp for decode-sized steps (AVX2 and FMA); bf16 on cpu/amx.cpp's tiles (AMX, or
    the bf16 dot instruction); oneDNN's packed layout where none of those runs. A bf16 model on a CPU where oneDNN
    cannot pack bf16 (AVX2 only) computes in fp32 over its weights upcast once: the upcast is exact, a bf16 GEMM sums
    in fp32 anyway, and it runs ~5x faster than F.linear's emulated bf16 there. fp16 is not packed: plain F.linear.
    """
    value = forced.get("gemm")
    if value is not None:
        variable, choices = FORCING["gemm"]
        if value not in choices:
            raise ValueError(f"{variable} must be one of {', '.join(choices)}, not {value!r}")
        if value != "torch" and machine.device_type != "cpu":
            raise ValueError(f"{variable}={value} lays weights out for a CPU, and the device is {machine.device_type}")
        if value == "onednn" and not machine.onednn_dtypes:
            raise ValueError(f"{variable}=onednn, but this torch has no oneDNN")
        if value == "cpp" and not machine.cpu_ops:
            raise ValueError(f"{variable}=cpp, but the CPU ops cannot be built: {machine.cpu_ops_problem}")
        kind = value
    elif machine.device_type != "cpu":
        kind = "torch"
    elif {"avx2", "fma"} <= machine.cpu_flags and machine.cpu_ops:
        kind = "cpp"
    else:
        kind = "onednn" if machine.onednn_dtypes else "torch"
    if kind == "torch":
        return Gemm.TORCH, dtype
    if dtype in machine.onednn_dtypes:
        compute = dtype
    elif dtype == torch.bfloat16 and torch.float32 in machine.onednn_dtypes:
        compute = torch.float32
    else:  # a dtype no CPU route computes
        return Gemm.TORCH, dtype
    if kind == "onednn":
        return Gemm.ONEDNN, compute
    if compute == torch.float32:
        return (Gemm.PANELS if machine.panels else Gemm.SKINNY), compute
    if machine.amx:
        return Gemm.AMX, compute
    return (Gemm.DOT if machine.bf16_dot else Gemm.ONEDNN), compute


@dataclass(frozen=True, slots=True)
class Backends:
    """The route of every seam on one device at one dtype (see the module docstring)."""

    device: torch.device
    dtype: torch.dtype
    lora: Kernel
    attention: Kernel
    layer: Kernel  # CPP or TORCH
    sampler: Kernel  # CPP or TORCH: the greedy pick
    gemm: Gemm
    gemm_dtype: torch.dtype  # what the GEMMs compute in (fp32 for a bf16 model where bf16 is not packed)
    machine: Machine
    dtype_reason: str = ""
    forced: tuple[tuple[str, str], ...] = ()  # (seam, route) the environment forced

    @classmethod
    def resolve(
        cls,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | str = "auto",
        *,
        machine: Machine | None = None,
        forced: Mapping[str, str] | None = None,
    ) -> Backends:
        """The routes for `device` and `dtype` ("auto" or a name in DTYPES, or a torch dtype); `machine` defaults to
        this one (`Machine.probe`), `forced` to the environment's (`forced_by_environment`). ValueError on a forced
        route that is not one, or that this machine cannot run."""
        device = torch.device(device)
        machine = Machine.probe(device) if machine is None else machine
        forced = forced_by_environment() if forced is None else forced
        unknown = set(forced) - set(FORCING)
        if unknown:
            raise ValueError(f"no seam named {', '.join(sorted(unknown))} (seams: {', '.join(FORCING)})")
        resolved, why = _dtype(device.type, dtype, machine)
        layer = _kernel("layer", forced, machine, gpu=Kernel.TORCH)
        gemm, gemm_dtype = _gemm(forced, machine, resolved)
        return cls(
            device,
            resolved,
            _kernel("lora", forced, machine, gpu=Kernel.TRITON),
            _kernel("attention", forced, machine, gpu=Kernel.TRITON),
            layer,
            layer,  # the greedy pick is one of the layer ops' build, and follows them
            gemm,
            gemm_dtype,
            machine,
            why,
            tuple(sorted(forced.items())),
        )

    @property
    def head_screen(self) -> bool:
        """Whether greedy rows can take their token from a bf16 screen of the fp32 LM head
        (engine/model/head_screen.py): the fp32 panels route, on a CPU with the bf16 dot instruction."""
        return self.gemm is Gemm.PANELS and self.machine.bf16_dot

    def describe(self) -> dict[str, Any]:
        """What GET /load and the start log show."""
        machine = self.machine
        shown: dict[str, Any] = {
            "device": str(self.device),
            "dtype": _name(self.dtype),
            "lora": self.lora.value,
            "attention": self.attention.value,
            "layer": self.layer.value,
            "sampler": self.sampler.value,
            "gemm": self.gemm.value,
            "gemm_dtype": _name(self.gemm_dtype),
        }
        if machine.device_type == "cpu":
            shown["cpu_ops"] = "built" if machine.cpu_ops else f"not built: {machine.cpu_ops_problem}"
        if self.forced:
            shown["forced"] = dict(self.forced)
        return shown

    def summary(self) -> str:
        """One line for the start log."""
        shown = self.describe()
        forced = shown.pop("forced", None)
        text = " ".join(f"{key}={value}" for key, value in shown.items())
        text += f" (dtype {self.dtype_reason})" if self.dtype_reason else ""
        return text + (f"; forced by the environment: {forced}" if forced else "")


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
