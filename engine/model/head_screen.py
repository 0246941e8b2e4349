"""Greedy tokens from a wide fp32 LM head without computing every fp32 logit: a bf16 screen, then the exact fp32
logits of the few columns it leaves.

Why: a greedy row's token is the argmax of its logits, and at decode row counts the head is the largest GEMM of a step
whose vocabulary is large: Gemma 3 270M's (262,144 x 640) is more than half of an fp32 decode step of 32 rows. The
bf16 dot instruction does twice the products of an fp32 FMA and reads half the bytes, so a bf16 copy of the head
(loragate_kernels/cpu/screen.cpp) gives every logit in about half the time; the fp32 logits of the columns
it cannot rule out (loragate_kernels/cpu/panels.cpp `panel_columns`) are the same values to the bit as the full fp32
head's, so the token is the one the full head gives (ties: the lowest token id, as `argmax`).

The bound. Row x of the hidden states and column j of the head (w, fp32): z = fp32 logit (panels.cpp's sums, blocks
of at most 64 products), a = the screen's (bf16(w) . bf16(x), K products summed in fp32 one after another). With
u = 2^-8 (bf16 rounds to nearest), g = gamma_K = K 2^-24 / (1 - K 2^-24) (recursive fp32 summation), and
S = sum_k |w_k x_k| <= ||w|| ||x|| (Cauchy-Schwarz):
    |bf16(w) bf16(x) - w x| <= (2u + u^2) |w x|  per product, so the exact sum of the bf16 products is within
        (2u + u^2) S of w . x, and its own absolute sum is at most (1 + u)^2 S;
    |a - exact bf16 sum| <= g (1 + u)^2 S  and  |z - w . x| <= g S;
so |a - z| <= d ||w|| ||x|| with d = 2u + u^2 + g ((1 + u)^2 + 1). `SLACK_MARGIN` covers the rounding of the bound's
own arithmetic (norms taken in float64 and rounded, e = slack * norm in fp32: relative errors near 2^-24, against a
bound that is at least d |a|), and `TINY` the instruction's flushing of subnormal inputs and outputs (at most
2^-126 per product and per step). With e_j = slack * norm_j, every z_j lies in [a_j - e_j, a_j + e_j]; the
largest z is at least L = max(a_j - e_j), so the argmax is among the columns with a_j + e_j >= L. On real logits that
is a handful of columns (docs/performance.md, *The greedy head screen*).

A row falls back to the full fp32 head (its token is None here) where the screen cannot vouch for it: hidden
states that are not finite or so large the fp32 sums could overflow, or more than `CAP` columns left.
"""

from __future__ import annotations

import math

import torch

U = 2.0**-8  # bf16's unit roundoff
SLACK_MARGIN = 1.0 + 2.0**-16
TINY = 2.0**-50  # added to every norm and slack: covers subnormal flushing (2^-126 per product and step)
LARGEST = 2.0**100  # ||w|| ||x|| above this: the row takes the full head (fp32 sums could overflow)
CAP = 1024  # columns a row may leave; beyond, the full head is cheaper than their exact logits


def slack_factor(hidden_size: int) -> float:
    """d of the module docstring for sums of `hidden_size` products."""
    g = hidden_size * 2.0**-24 / (1.0 - hidden_size * 2.0**-24)
    return 2 * U + U * U + g * ((1 + U) ** 2 + 1)


class HeadScreen:
    """The screen of one fp32 head without a bias: a bf16 copy of it in the dot kernel's layout and its rows' norms.
    `panels` is the head's fp32 panel layout (engine/model/cpu_gemm.py PackedLinear on the PANELS route)."""

    def __init__(self, weight: torch.Tensor, panels: torch.Tensor) -> None:
        vocab, hidden = weight.shape
        assert hidden % 2 == 0, "the bf16 layout holds K in pairs (`supports`)"
        plain = weight.detach().float()
        self.vocab = vocab
        self.packed = torch.ops.loragate_cpu.screen_pack(plain)
        # in float64, a block of rows at a time (a whole float64 copy of Gemma 3's head would be 1.3 GB)
        norms = torch.cat([block.double().norm(dim=1) for block in plain.split(8192)])
        self.norms = (norms * SLACK_MARGIN + TINY).float()
        self.largest_norm = float(self.norms.max())
        self.factor = slack_factor(hidden) * SLACK_MARGIN
        self.panels = panels

    @staticmethod
    def supports(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether a head can be screened: fp32, an even hidden size, no bias (the screen's logits have none)."""
        return weight.dtype == torch.float32 and weight.shape[1] % 2 == 0 and bias is None

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.norms.numel() * 4

    def tokens(self, hidden: torch.Tensor, banned: torch.Tensor) -> list[int | None]:
        """Each row's first maximal column of the fp32 logits outside `banned` ([n] int64 token ids), as the full
        head and `argmax` give it; None for a row the screen cannot vouch for (the caller computes its logits)."""
        hidden = hidden.float().contiguous()
        rows = hidden.shape[0]
        if rows == 0:
            return []
        size = hidden.double().norm(dim=1)  # [rows]
        fits = torch.isfinite(size) & (size * self.largest_norm < LARGEST)
        slack = torch.where(fits, size * self.factor + TINY, math.inf).float()
        cols, counts = torch.ops.loragate_cpu.screen_columns(
            hidden.to(torch.bfloat16), self.packed, self.norms, slack, banned, self.vocab, CAP
        )
        exact = torch.ops.loragate_cpu.panel_columns(hidden, self.panels, None, self.vocab, cols)
        best = cols.gather(1, exact.argmax(dim=1, keepdim=True)).squeeze(1)  # cols ascend: ties go to the lowest id
        vouched = (counts > 0) & fits
        return [token if ok else None for token, ok in zip(best.tolist(), vouched.tolist(), strict=True)]
