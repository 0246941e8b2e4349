"""The CPU path's GEMMs: every projection and the LM head with its weight laid out once, at load, for the kernel
that multiplies it (`gemm_backend`, loragate_kernels/__init__.py, picks the route):

- "onednn": oneDNN's own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise` per
  call; both in stock CPU torch). `F.linear` hands each call's weight to the BLAS as a plain row-major matrix, and
  at serving shapes (tens of rows against a wide weight) it reaches about two thirds of what the same GEMM reaches
  with the weight packed ahead of time. Measured on a 2-core AVX-512 VM at W1's shapes (M = 32 rows, SmolLM2-135M):
  fp32 ~115 -> ~200 GFLOP/s, the 49,152-wide LM head ~120 -> ~150; bf16 with AMX ~550 -> ~950.
- "cpp" with fp32 weights on a CPU with AVX-512: loragate_kernels/cpu_panels.cpp at every row count, over its panel
  layout of the weight (`panels_usable`; 96 output columns, all of K, k-major). On a 2-core AVX-512 EPYC a step's
  GEMMs at 32 rows ran 51.1 -> 46.3 ms against cpu_gemm.cpp's row-major kernel, and at 512 rows 723 -> 682 ms
  against oneDNN on the row-major weight (docs/performance.md, the ninth session). One copy of the weight serves
  decode and prefill; a tied LM head gets its own panel copy of the embeddings.
- "cpp" with fp32 weights on a CPU with AVX2 and FMA but no AVX-512: weights kept row-major and multiplied by
  loragate_kernels/cpu_gemm.cpp's `skinny_linear` up to SKINNY_ROWS rows (decode steps, which stream every weight
  from memory: the kernel prefetches the next block of the weight while it computes one, where oneDNN's kernels
  stall on the first read; W1's step GEMMs at M = 32 ~90 -> ~130 GFLOP/s on a 2-core AVX2 EPYC, ~180 -> ~210 on a
  2-core AVX-512 Xeon), and by oneDNN over the same tensor above (prefill, where the weight is reused across hundreds
  of rows and oneDNN reaches the same speed without its packed copy). bf16 weights that oneDNN packs keep its packed
  layout on this route where the CPU has neither AMX nor avx512_bf16.
- "cpp" with bf16 weights on a CPU with AMX or avx512_bf16: loragate_kernels/cpu_amx.cpp at every row count, over
  its own tile layout of the weight (`tiles_usable`). On AMX tiles (`amx_usable`) it streams a decode step's weights
  at ~23 GB/s where oneDNN's packed GEMMs read ~16 (a step's 121 GEMMs at 32 rows, 2-core AMX VM: 16.7 -> 11.6 ms);
  at 512 rows it runs ~10% behind oneDNN (56 -> 62 ms for a prompt step's layer GEMMs), kept rather than a second
  copy of every weight for prefill. Without AMX, on the bf16 dot instruction (2-core avx512_bf16 EPYC: 29.4 -> 23.0
  ms at 32 rows, 2-3% ahead at 512). Layers whose dims are not multiples of 32 keep oneDNN's layout.
- "torch": plain nn.Linear (CUDA, or forced).

`prepack_linears(model)` swaps every projection for a `PackedLinear` on a CPU model. oneDNN's packed layout is its
own: the plain weight is dropped (it would double the memory), so a packed model is for serving, not for reading
weights back. A tied LM head gets its own copy of the embedding matrix in its route's layout, and reads the
embeddings themselves on cpu_gemm.cpp's row-major route (`python bench/step_profile.py` shows a step's GEMM time).
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch import nn

from loragate_kernels import cpu_flags, gemm_backend, onednn_available

logger = logging.getLogger(__name__)

# The row count oneDNN picks its weight layout for. Any row count runs against the packed weight; 32 measured
# best (or within noise of it) for decode batches of 8-128 rows and prefill chunks of 512 (fp32 and bf16).
PACK_ROWS_HINT = 32
PACKED_DTYPES = (torch.float32, torch.bfloat16)

# oneDNN builds a kernel for each row count it meets: ~2 ms per GEMM shape in bf16 (~1.4 ms in fp32) on the first
# call with a new count, against ~0.5 ms warm. A served burst meets hundreds of counts (decode widths plus prefill
# chunks of any length), so its first steps ran at ~0.7x of warm. Row counts up to EXACT_ROWS (decode batches) run
# as they are; larger ones are padded up to a multiple of ROW_BUCKET (prefill steps; at most 31 padding rows
# against >= 65 real ones), so a bounded set of counts exists and `warm_up_gemms` can run them all before serving.
EXACT_ROWS = 64
ROW_BUCKET = 32
# On the "cpp" route, fp32 GEMMs of up to this many rows run loragate_kernels/cpu_gemm.cpp (none of them padded:
# EXACT_ROWS). Measured against oneDNN's packed weights over W1's weights (docs/performance.md): on a 2-core AVX2 EPYC
# ahead ~1.4x at 32-64 rows (~1.5x at 8), even at 128 and behind neither at 512; on a 2-core AVX-512 Xeon ahead
# 1.21x / 1.26x / 1.15x / 1.08x at 1 / 8 / 32 / 64 rows. Prefill keeps oneDNN.
SKINNY_ROWS = EXACT_ROWS


def gemm_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at (see EXACT_ROWS)."""
    return rows if rows <= EXACT_ROWS else -(-rows // ROW_BUCKET) * ROW_BUCKET


def step_rounding(device: torch.device) -> tuple[int, int]:
    """(multiple, above): steps of more than `above` tokens are best a multiple of `multiple` tokens on `device` (the
    scheduler trims a prompt chunk to make them so: engine/core/scheduler.py SchedulerConfig), so that `gemm_rows`
    pads nothing; (1, 0) on CUDA, whose GEMMs take any row count."""
    return (ROW_BUCKET, EXACT_ROWS) if device.type == "cpu" else (1, 0)


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def auto_cpu_dtype(flags: frozenset[str] | None = None) -> tuple[torch.dtype, str]:
    """What `--dtype auto` serves on this CPU, and why: bfloat16 where the CPU computes it natively (avx512_bf16
    or AMX: oneDNN's bf16 GEMMs run ~2x fp32 there, and half the bytes stream per step), float32 elsewhere
    (AVX2-only CPUs have no bf16 arithmetic: a bf16 model's GEMMs run in fp32 there, `gemm_dtype`, so fp32 is as
    fast and exact)."""
    flags = cpu_flags() if flags is None else flags
    native = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if native:
        return torch.bfloat16, f"the CPU computes bf16 natively ({', '.join(native)})"
    return torch.float32, "the CPU has no native bf16 (neither avx512_bf16 nor amx_bf16)"


@functools.cache
def onednn_packs(dtype: torch.dtype) -> bool:
    """Whether oneDNN lays out weights of `dtype` on this CPU. Asked of oneDNN itself, with a tiny weight: its bf16
    path needs AVX-512 (bw, vl, dq) or avx_ne_convert, and on an AVX2-only CPU the reorder raises."""
    if dtype not in PACKED_DTYPES or not onednn_available():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_ROWS_HINT)
    except RuntimeError as exc:
        logger.info("oneDNN does not pack %s weights on this CPU (%s)", dtype, exc)
        return False
    return True


@functools.cache
def amx_usable() -> bool:
    """Whether bf16 GEMMs can run on loragate_kernels/cpu_amx.cpp here: the CPU has AMX (amx_tile, amx_bf16), the
    C++ ops built with it, and Linux lets this process use the tiles."""
    from loragate_kernels import cpu_ops

    if not {"amx_tile", "amx_bf16"} <= cpu_flags() or not cpu_ops.load():
        return False
    return bool(torch.ops.loragate_cpu.amx_ready())


@functools.cache
def panels_usable() -> bool:
    """Whether fp32 GEMMs can run on loragate_kernels/cpu_panels.cpp here: the CPU has AVX-512 and the C++ ops built
    with it."""
    from loragate_kernels import cpu_ops

    if "avx512f" not in cpu_flags() or not cpu_ops.load():
        return False
    return bool(torch.ops.loragate_cpu.panels_ready())


@functools.cache
def tiles_usable() -> bool:
    """Whether bf16 GEMMs can run on loragate_kernels/cpu_amx.cpp's tile layout here: on AMX tiles (`amx_usable`),
    or on its bf16 dot kernel where the CPU has avx512_bf16 and no AMX (docs/performance.md, the eighth session:
    ahead of oneDNN's packed kernels at decode batches, and one copy of the weight for every row count)."""
    from loragate_kernels import cpu_ops

    if amx_usable():
        return True
    if "avx512_bf16" not in cpu_flags() or not cpu_ops.load():
        return False
    return bool(torch.ops.loragate_cpu.dot_ready())


def gemm_dtype(dtype: torch.dtype) -> torch.dtype | None:
    """The dtype a `dtype` model's packed GEMMs compute in on this CPU (None: not packed, plain F.linear).

    bf16 where oneDNN packs it; where it cannot (AVX2-only CPUs), fp32 over the bf16 weights upcast once at load:
    the upcast is exact, and a bf16 GEMM multiplies and sums in fp32 anyway, so the outputs (rounded to bf16 once)
    differ from a native bf16 GEMM's only in summation order. It costs fp32's weight memory and runs at fp32's
    speed, ~5x F.linear's bf16 on such a CPU (W1 base: 49 -> 252 tok/s, docs/performance.md)."""
    if onednn_packs(dtype):
        return dtype
    if dtype == torch.bfloat16 and onednn_packs(torch.float32):
        return torch.float32
    return None


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias with the weight laid out once for this CPU's GEMMs; x [T, in] -> [T, out] in x's
    dtype. The weight is kept in `compute_dtype` (default: its own; see `gemm_dtype`), inputs are cast to it and
    outputs back. On the "cpp" route (`cpp`): fp32 weights take loragate_kernels/cpu_panels.cpp's panel layout where
    `panels_usable` (`self.panels`, every row count), else stay row-major for loragate_kernels/cpu_gemm.cpp up to
    SKINNY_ROWS rows and oneDNN above (`self.skinny`); bf16 ones take loragate_kernels/cpu_amx.cpp's tile layout
    where `tiles_usable` and both dims are multiples of 32 (`self.tiles`). Everything else: oneDNN's packed layout
    for every row count."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype | None = None,
        cpp: bool = False,
    ):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        compute_dtype = compute_dtype or weight.dtype
        self.panels = cpp and compute_dtype == torch.float32 and panels_usable()
        self.skinny = cpp and compute_dtype == torch.float32 and not self.panels
        # a [gate; up] weight whose halves fill whole panels can take its activation on the tiles (`silu_mul`)
        self.silu_fusable = self.panels and self.out_features % (2 * PANEL_COLUMNS) == 0
        self.tiles = (
            cpp
            and compute_dtype == torch.bfloat16
            and self.out_features % 32 == 0
            and self.in_features % 32 == 0
            and tiles_usable()
        )
        plain = weight.detach().to(compute_dtype)
        # the row-major weight itself (no copy when it is already fp32 and contiguous), or a packed copy
        if self.panels:
            self.weight = torch.ops.loragate_cpu.panel_pack_weight(plain)
        elif self.skinny:
            self.weight = plain.contiguous()
        elif self.tiles:
            self.weight = torch.ops.loragate_cpu.amx_pack_weight(plain)
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(plain, PACK_ROWS_HINT)
        self.bias = None if bias is None else bias.detach().to(compute_dtype).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight.dtype:
            return self._linear(x.to(self.weight.dtype)).to(x.dtype)
        return self._linear(x)

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2:
            return self._linear(x.reshape(-1, x.shape[-1])).reshape(*x.shape[:-1], self.out_features)
        rows = x.shape[0]
        if self.panels:
            return torch.ops.loragate_cpu.panel_linear(x, self.weight, self.bias, self.out_features)
        if self.tiles:
            return torch.ops.loragate_cpu.amx_linear(x, self.weight, self.bias)
        if self.skinny and rows <= SKINNY_ROWS:
            return torch.ops.loragate_cpu.skinny_linear(x, self.weight, self.bias)
        if not onednn_available():  # the "cpp" route forced on a torch without oneDNN
            return F.linear(x, self.weight, self.bias)
        padded = gemm_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        wide = x.new_empty(padded, x.shape[1])  # zeroing only the padding rows: the whole fill cost 2% of a step
        wide[:rows] = x
        wide[rows:] = 0
        return torch.ops.mkldnn._linear_pointwise(wide, self.weight, self.bias, "none", [], "")[:rows]

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this layer's output, a [gate; up] projection (x [T, in] -> [T, out / 2]), equal to
        loragate_kernels/cpu_layer.cpp's `silu_mul` on it to the bit, in one op where its route has one
        (loragate_kernels/cpu_panels.cpp `panel_linear_silu`: the [T, out] product never reaches memory; on a 2-core
        AVX-512 EPYC, SmolLM2's gate_up GEMM and activation at 512 rows 8.9 -> 8.4 ms alone, and in a served burst's
        profile, `python bench/served_steps.py --profile`, a prompt step's GEMMs and activations 515 -> 514 ms, a
        decode step's 45.8 -> 44.6 ms); None elsewhere, and the caller applies the activation itself."""
        if self.silu_fusable and x.dim() == 2 and x.dtype == self.weight.dtype:
            return torch.ops.loragate_cpu.panel_linear_silu(x, self.weight, self.bias, self.out_features)
        return None

    def fused_lora(
        self, x: torch.Tensor, segments: torch.Tensor, pool: torch.Tensor, block: torch.Tensor, out_cols: list[int]
    ) -> torch.Tensor | None:
        """This layer with a LoRA group's deltas added (loragate_kernels/cpu_ops.py `lora_sgmv_group_cpu`'s
        arguments) in one op where its route has one (loragate_kernels/cpu_panels.cpp `panel_linear_lora`,
        cpu_gemm.cpp `skinny_linear_lora`, cpu_amx.cpp `amx_linear_lora`: a step's 120 LoRA calls cost no dispatch of
        their own); None elsewhere, and the caller adds the deltas itself."""
        if x.dim() != 2 or x.dtype != self.weight.dtype:
            return None
        if self.panels:
            return torch.ops.loragate_cpu.panel_linear_lora(
                x, self.weight, self.bias, self.out_features, segments, pool, block, out_cols
            )
        if self.tiles:
            return torch.ops.loragate_cpu.amx_linear_lora(x, self.weight, self.bias, segments, pool, block, out_cols)
        if self.skinny and x.shape[0] <= SKINNY_ROWS:
            return torch.ops.loragate_cpu.skinny_linear_lora(x, self.weight, self.bias, segments, pool, block, out_cols)
        return None

    def extra_repr(self) -> str:
        routes = {"cpu_panels.cpp": self.panels, "cpu_gemm.cpp": self.skinny, "cpu_amx.cpp": self.tiles}
        route = next((name for name, taken in routes.items() if taken), "oneDNN")
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bias={self.bias is not None}, {route}"


PANEL_COLUMNS = 96  # output columns a panel of loragate_kernels/cpu_panels.cpp holds


class PanelEmbedding(nn.Module):
    """An embedding table read from a tied LM head's panel layout ([ceil(V / 96), hidden, 96]: row v of the matrix
    is column v % 96 of panel v // 96), so a tied fp32 model keeps one copy of the matrix (SmolLM2-135M: 113 MB)
    instead of a row-major one beside the head's. A step gathers only its own tokens' rows."""

    def __init__(self, panels: torch.Tensor) -> None:
        super().__init__()
        self.panels = panels  # the head's tensor, not a parameter of this module: the head owns it

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.panels[input_ids // PANEL_COLUMNS, :, input_ids % PANEL_COLUMNS]


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> PackedLinear | None:
    """`weight` (and `bias`) laid out for this CPU's GEMMs on the route `gemm_backend` picks, in `gemm_dtype`; None
    where they stay plain F.linear (CUDA tensors, the "torch" route, a dtype no route computes)."""
    if weight.device.type != "cpu":
        return None
    compute = gemm_dtype(weight.dtype)
    backend = gemm_backend(weight.device)
    if compute is None or backend == "torch":
        return None
    return PackedLinear(weight, bias, compute, cpp=backend == "cpp")


def prepack_linears(model: nn.Module) -> int:
    """Replace `model`'s nn.Linear projections with PackedLinear (`packed_linear`; a tied LM head is
    LlamaForCausalLM.prepack's). Returns how many GEMMs were laid out."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = packed_linear(child.weight, child.bias)
                if packed is None:
                    return count
                setattr(parent, name, packed)
                count += 1
    return count


def gemm_route(model: nn.Module) -> str:
    """What `model`'s GEMMs run on, for the log: the route and the dtype they compute in."""
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    if not packed:
        return "plain F.linear"
    dtype = str(packed[0].weight.dtype).removeprefix("torch.")
    if any(m.panels for m in packed):
        return f"loragate_kernels/cpu_panels.cpp's panel layout (AVX-512) at every row count, in {dtype}"
    if any(m.tiles for m in packed):
        kernel = "AMX tiles" if amx_usable() else "the bf16 dot instruction"
        return f"loragate_kernels/cpu_amx.cpp's tile layout ({kernel}) at every row count, in {dtype}"
    if any(m.skinny for m in packed):
        return f"loragate_kernels/cpu_gemm.cpp up to {SKINNY_ROWS} rows, oneDNN above, in {dtype}"
    return f"oneDNN-prepacked weights, in {dtype}"


def warm_up_gemms(model: nn.Module, max_rows: int, max_head_rows: int) -> int:
    """Run every PackedLinear shape of `model` once at every row count a step can give it (1..EXACT_ROWS, then the
    ROW_BUCKET multiples up to `max_rows`; the LM head, `lm_head`, up to `max_head_rows` sampled rows), so oneDNN
    has built each kernel before the first request. Layers share shapes: each distinct one runs once per count.
    Returns how many GEMMs ran."""
    shapes: dict[tuple[int, int, bool], PackedLinear] = {}
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        # the tile and panel layouts build no kernels per row count
        if isinstance(module, PackedLinear) and module is not head and not (module.tiles or module.panels):
            shapes.setdefault((module.in_features, module.out_features, module.bias is None), module)
    counts = sorted({gemm_rows(n) for n in range(1, max(1, max_rows) + 1)})
    calls = [(m, n) for m in shapes.values() for n in counts]
    if isinstance(head, PackedLinear) and not (head.tiles or head.panels):
        calls += [(head, n) for n in sorted({gemm_rows(n) for n in range(1, max(1, max_head_rows) + 1)})]
    with torch.inference_mode():
        for module, n in calls:
            module(torch.zeros(n, module.in_features, dtype=module.weight.dtype))
    return len(calls)
