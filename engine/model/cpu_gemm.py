"""The CPU path's GEMMs: every projection and the LM head with its weight laid out once, at load, for the kernel
that multiplies it. loragate_kernels/backends.py picks the route (`Backends.gemm`) and the dtype it computes in;
`PackedLinear` holds one layer on it:

- PANELS (fp32, AVX-512): loragate_kernels/cpu/panels.cpp at every row count, over a panel layout of the weight (96
  output columns, all of K, k-major). One copy of the weight serves decode and prefill; a tied LM head gets its own
  panel copy of the embeddings, which the embedding lookup then reads too (`PanelEmbedding`).
- SKINNY (fp32, AVX2 and FMA): weights kept row-major, multiplied by loragate_kernels/cpu/gemm.cpp's `skinny_linear`
  up to SKINNY_ROWS rows (decode steps stream every weight from memory: the kernel asks for the next block of the
  weight while it computes one, where oneDNN's kernels stall on the first read) and by oneDNN over the same tensor
  above (prefill reuses the weight across hundreds of rows, and oneDNN reaches the same speed without a packed copy).
- AMX and DOT (bf16): loragate_kernels/cpu/amx.cpp at every row count, over its own tile layout of the weight, on AMX
  tiles or on the bf16 dot instruction: it streams a decode step's weights faster than oneDNN's packed GEMMs, and
  one copy of the weight serves every row count. Layers whose dims are not multiples of 32 keep oneDNN's layout.
- ONEDNN: oneDNN's own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, then `_linear_pointwise` per
  call; both in stock CPU torch). F.linear hands each call's weight to the BLAS as a plain row-major matrix, and at
  serving shapes (tens of rows against a wide weight) it reaches about two thirds of the packed GEMM's rate.
- TORCH: plain nn.Linear (CUDA, fp16, or forced).

docs/performance.md gives each route's measured rate; `python bench/step_profile.py` shows a step's GEMM time.
`prepack_linears(model, backends)` swaps every projection for a `PackedLinear`. The packed layouts are their own: the
plain weight is dropped (it would double the memory), so a packed model is for serving, not for reading weights back.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from loragate_kernels.backends import Backends, Gemm

logger = logging.getLogger(__name__)

# The row count oneDNN picks its weight layout for. Any row count runs against the packed weight; 32 measured
# best (or within noise of it) for decode batches of 8-128 rows and prefill chunks of 512 (fp32 and bf16).
PACK_ROWS_HINT = 32

# oneDNN builds a kernel for each row count it meets, on the first call with that count (several times a warm
# call's cost). A served burst meets hundreds of counts (decode widths plus prefill chunks of any length), so its
# first steps would run well below warm speed. Row counts up to EXACT_ROWS (decode batches) run as they are; larger
# ones are padded up to a multiple of ROW_BUCKET (prefill steps; at most 31 padding rows against >= 65 real ones), so
# a bounded set of counts exists and `warm_up_gemms` can run them all before serving.
EXACT_ROWS = 64
ROW_BUCKET = 32
# On the SKINNY route, fp32 GEMMs of up to this many rows run loragate_kernels/cpu/gemm.cpp (none of them padded:
# EXACT_ROWS); up to here it runs ahead of oneDNN's packed weights, and prefill keeps oneDNN (docs/performance.md).
SKINNY_ROWS = EXACT_ROWS


def gemm_rows(rows: int) -> int:
    """The row count a GEMM of `rows` rows runs at (see EXACT_ROWS)."""
    return rows if rows <= EXACT_ROWS else -(-rows // ROW_BUCKET) * ROW_BUCKET


def step_rounding(device: torch.device) -> tuple[int, int]:
    """(multiple, above): steps of more than `above` tokens are best a multiple of `multiple` tokens on `device` (the
    scheduler trims a prompt chunk to make them so: engine/core/scheduler.py SchedulerConfig), so that `gemm_rows`
    pads nothing; (1, 0) on CUDA, whose GEMMs take any row count."""
    return (ROW_BUCKET, EXACT_ROWS) if device.type == "cpu" else (1, 0)


class PackedLinear(nn.Module):
    """y = x @ weight.T + bias with the weight laid out once for its GEMM route; x [T, in] -> [T, out] in x's dtype.
    The weight is kept in `compute_dtype` (loragate_kernels/backends.py `Backends.gemm_dtype`), inputs are cast to it
    and outputs back. `route` is the model's (PANELS, SKINNY, AMX, DOT or ONEDNN); a layer whose dims the tile layout
    cannot take (not multiples of 32) keeps oneDNN's packed layout instead of AMX's or DOT's."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, route: Gemm, compute_dtype: torch.dtype):
        super().__init__()
        assert route is not Gemm.TORCH, "plain F.linear layers stay nn.Linear"
        self.out_features, self.in_features = weight.shape
        self.panels = route is Gemm.PANELS
        self.skinny = route is Gemm.SKINNY
        self.tiles = route in (Gemm.AMX, Gemm.DOT) and self.out_features % 32 == 0 and self.in_features % 32 == 0
        # a [gate; up] weight whose halves fill whole panels can take its activation on the tiles (`silu_mul`)
        self.silu_fusable = self.panels and self.out_features % (2 * PANEL_COLUMNS) == 0
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
        padded = gemm_rows(rows)
        if padded == rows:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        wide = x.new_empty(padded, x.shape[1])  # zeroing only the padding rows: the whole fill cost 2% of a step
        wide[:rows] = x
        wide[rows:] = 0
        return torch.ops.mkldnn._linear_pointwise(wide, self.weight, self.bias, "none", [], "")[:rows]

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this layer's output, a [gate; up] projection (x [T, in] -> [T, out / 2]), equal to
        loragate_kernels/cpu/layer.cpp's `silu_mul` on it to the bit, in one op where its route has one
        (loragate_kernels/cpu/panels.cpp `panel_linear_silu`: the [T, out] product never reaches memory); None
        elsewhere, and the caller applies the activation itself."""
        if self.silu_fusable and x.dim() == 2 and x.dtype == self.weight.dtype:
            return torch.ops.loragate_cpu.panel_linear_silu(x, self.weight, self.bias, self.out_features)
        return None

    def fused_lora(
        self, x: torch.Tensor, segments: torch.Tensor, pool: torch.Tensor, block: torch.Tensor, out_cols: list[int]
    ) -> torch.Tensor | None:
        """This layer with a LoRA group's deltas added (loragate_kernels/cpu/ops.py `lora_sgmv_group_cpu`'s
        arguments) in one op where its route has one (loragate_kernels/cpu/panels.cpp `panel_linear_lora`,
        cpu/gemm.cpp `skinny_linear_lora`, cpu/amx.cpp `amx_linear_lora`: a step's 120 LoRA calls cost no dispatch of
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
        routes = {"cpu/panels.cpp": self.panels, "cpu/gemm.cpp": self.skinny, "cpu/amx.cpp": self.tiles}
        route = next((name for name, taken in routes.items() if taken), "oneDNN")
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bias={self.bias is not None}, {route}"


PANEL_COLUMNS = 96  # output columns a panel of loragate_kernels/cpu/panels.cpp holds


class PanelEmbedding(nn.Module):
    """An embedding table read from a tied LM head's panel layout ([ceil(V / 96), hidden, 96]: row v of the matrix
    is column v % 96 of panel v // 96), so a tied fp32 model keeps one copy of the matrix (SmolLM2-135M: 113 MB)
    instead of a row-major one beside the head's. A step gathers only its own tokens' rows."""

    def __init__(self, panels: torch.Tensor) -> None:
        super().__init__()
        self.panels = panels  # the head's tensor, not a parameter of this module: the head owns it

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.panels[input_ids // PANEL_COLUMNS, :, input_ids % PANEL_COLUMNS]


def packed_linear(weight: torch.Tensor, bias: torch.Tensor | None, backends: Backends) -> PackedLinear | None:
    """`weight` (and `bias`) laid out for the GEMM route of `backends`; None where they stay plain F.linear."""
    if backends.gemm is Gemm.TORCH:
        return None
    return PackedLinear(weight, bias, backends.gemm, backends.gemm_dtype)


def prepack_linears(model: nn.Module, backends: Backends) -> int:
    """Replace `model`'s nn.Linear projections with PackedLinear (`packed_linear`; a tied LM head is
    CausalLM.prepack's). Returns how many GEMMs were laid out."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear:
                packed = packed_linear(child.weight, child.bias, backends)
                if packed is None:
                    return count
                setattr(parent, name, packed)
                count += 1
    return count


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
