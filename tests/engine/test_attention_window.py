"""Sliding windows and softmax scales through engine/model/attention.py `plan_attention` and `paged_attention`, on each
attention route this machine has (torch always; the C++ kernel, with prompt rows on it or on SDPA, where the CPU ops
build; the Triton kernel under its interpreter): steps that mix decodes, chunks after cached context and several fresh
prompts (batched and padded, batched as a view, alone), each sequence's rows against SDPA over its whole context with
a mask from transformers' own mask functions (`transformers.masking_utils`).

Cache slots no sequence owns hold NaN/inf, and so does every position before the earliest window of a sequence's
queries: a route that masks those positions rather than skipping them turns rows into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from engine.model import attention
from engine.model.attention import AttentionMetadata, AttentionPlan, PrefillSeq, paged_attention, plan_attention
from loragate_kernels.backends import Kernel

from built_ops import require_cpu_ops

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 32  # GQA 4
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # relative to max(1, the largest |output|)


@dataclass(frozen=True)
class Work:
    decodes: tuple[int, ...]  # context lengths of sequences computing their last token
    prefills: tuple[tuple[int, int], ...]  # (context_len, query_len); query_len == context_len: a fresh prompt


STEPS = {
    # chunks after 31 and 55 cached tokens around four fresh prompts of 12, 30, 5 and 29 tokens (batched, padded)
    "mixed": Work((1, 7, 16, 33, 70), ((40, 9), (12, 12), (30, 30), (5, 5), (29, 29), (75, 20))),
    # three fresh prompts of one length in consecutive rows (batched as a view), then a chunk
    "view": Work((9,), ((16, 16), (16, 16), (16, 16), (50, 3))),
    # a fresh prompt alone beside a chunk (not batched), no decodes
    "alone": Work((), ((45, 45), (20, 7))),
    "decodes": Work((3, 60, 18, 1), ()),
}
# (window, scale): none; one position; windows shorter than, equal to (4 = bs 4, 75 = the longest context) and longer
# than the contexts, most not a multiple of the block size; a scale of its own with no window.
WINDOW_SCALES = [(None, None), (1, 0.3), (4, None), (13, 0.2), (33, None), (75, 0.25), (1000, None), (None, 0.15)]


@dataclass
class Step:
    q: torch.Tensor  # [T, H, hd]
    k: torch.Tensor  # [T, kvh, hd]: the step's keys
    v: torch.Tensor
    cache: torch.Tensor  # [pages, 2, bs, kvh, hd] before the step's K/V are written
    attn: AttentionMetadata
    # per sequence: (its rows of the step, its keys and values at positions [0, context_len))
    seqs: list[tuple[slice, torch.Tensor, torch.Tensor]]
    tables: list[torch.Tensor]  # per sequence: its pages

    def poisoned(self, window: int | None) -> torch.Tensor:
        """The cache with every position before the earliest window of each sequence's queries NaN."""
        cache = self.cache.clone()
        if window is None:
            return cache
        bs = cache.shape[2]
        for (rows, keys, _), table in zip(self.seqs, self.tables, strict=True):
            first_query = keys.shape[0] - (rows.stop - rows.start)
            for p in range(max(0, first_query - window + 1)):
                cache[table[p // bs], :, p % bs] = float("nan")
        return cache


def make_step(work: Work, block_size: int, dtype: torch.dtype, seed: int) -> Step:
    g = torch.Generator().manual_seed(seed)
    lens = [(n, 1) for n in work.decodes] + list(work.prefills)
    blocks = [-(-n // block_size) for n, _ in lens]
    num_pages = sum(blocks) + 3  # three pages nobody owns
    choice = torch.randint(0, 3, (num_pages, 2, block_size, NUM_KV_HEADS, HEAD_DIM), generator=g)
    cache = torch.tensor([float("nan"), float("inf"), float("-inf")])[choice].to(dtype)
    perm = torch.randperm(num_pages, generator=g)
    padded = torch.randint(0, num_pages, (len(lens), max(blocks) + 2), generator=g)  # padding names any page
    q, k, v, slots, seqs, tables = [], [], [], [], [], []
    cursor = row = 0
    for i, ((n, queries), b) in enumerate(zip(lens, blocks, strict=True)):
        table = perm[cursor : cursor + b]
        cursor += b
        padded[i, :b] = table
        keys, values = (torch.randn(n, NUM_KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
        for p in range(n - queries):  # the cached context
            cache[table[p // block_size], 0, p % block_size] = keys[p]
            cache[table[p // block_size], 1, p % block_size] = values[p]
        pos = torch.arange(n - queries, n)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        q.append(torch.randn(queries, NUM_HEADS, HEAD_DIM, generator=g).to(dtype))
        k.append(keys[n - queries :])
        v.append(values[n - queries :])
        seqs.append((slice(row, row + queries), keys, values))
        tables.append(table)
        row += queries
    decodes = len(work.decodes)
    prefills = tuple(
        PrefillSeq(seqs[i][0].start, queries, n, tables[i]) for i, (n, queries) in enumerate(lens) if i >= decodes
    )
    attn = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=decodes,
        decode_block_tables=padded[:decodes],
        decode_context_lens=torch.tensor(work.decodes, dtype=torch.int64),
        prefills=prefills,
        max_decode_context_len=max(work.decodes, default=0),
    )
    return Step(torch.cat(q), torch.cat(k), torch.cat(v), cache, attn, seqs, tables)


def hf_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[Q, K] bool, True where a query attends a key: transformers' causal mask function, or its sliding-window one."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    mask_fn = causal_mask_function if window is None else sliding_window_causal_mask_function(window)
    return mask_fn(0, 0, query_pos[:, None], key_pos[None, :])


def reference(step: Step, window: int | None, scale: float | None) -> torch.Tensor:
    """[T, H, hd] float64: each sequence's queries against its whole context, SDPA with `hf_mask`."""
    out = torch.empty(step.q.shape, dtype=torch.float64)
    for rows, keys, values in step.seqs:
        n, queries = keys.shape[0], rows.stop - rows.start
        mask = hf_mask(torch.arange(n - queries, n), torch.arange(n), window)  # [Q, n]
        q = step.q[rows].double().transpose(0, 1)[None]  # [1, H, Q, hd]
        k, v = (t.double().transpose(0, 1)[None] for t in (keys, values))  # [1, kvh, n, hd]
        out[rows] = F.scaled_dot_product_attention(q, k, v, mask, scale=scale, enable_gqa=True)[0].transpose(0, 1)
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual = actual.double()
    assert not actual.isnan().any() and not actual.isinf().any(), "a poisoned slot reached the output"
    tol = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol)


def run(step: Step, kernel: Kernel, window: int | None, scale: float | None, **kw: object) -> torch.Tensor:
    plan = plan_attention(step.attn, step.cache.shape[2], NUM_KV_HEADS, step.q.dtype, kernel, window, scale, **kw)
    return paged_attention(step.q, step.k, step.v, step.poisoned(window), plan)


# "cpp": every row of a step on the C++ kernel (contexts <= PAGED_PREFILL_MAX_CONTEXT); "cpp-sdpa": the limit lowered to
# 8, so prompt chunks go through SDPA beside the kernel's decodes, except under windows of <= 8 (a row reads its window)
ROUTES = {"torch": Kernel.TORCH, "cpp": Kernel.CPP, "cpp-sdpa": Kernel.CPP, "triton": Kernel.TRITON}


@pytest.mark.parametrize("step_name", list(STEPS))
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(
    ("route", "dtype"),
    [(r, torch.float32) for r in ROUTES] + [("torch", torch.bfloat16), ("cpp", torch.bfloat16)],
    ids=[*ROUTES, "torch-bf16", "cpp-bf16"],
)
def test_every_route_matches_the_masked_reference(
    route: str, dtype: torch.dtype, block_size: int, step_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = ROUTES[route]
    if kernel is Kernel.CPP:
        require_cpu_ops()
    if route == "cpp-sdpa":
        monkeypatch.setattr(attention, "PAGED_PREFILL_MAX_CONTEXT", 8)
    work = STEPS[step_name]
    step = make_step(work, block_size, dtype, seed=block_size + 10 * list(STEPS).index(step_name))
    for window, scale in WINDOW_SCALES:
        out = run(step, kernel, window, scale)
        assert_close(out, reference(step, window, scale), dtype)
    if kernel is Kernel.CPP and work.prefills:  # the route each plan took
        plan = plan_attention(step.attn, block_size, NUM_KV_HEADS, dtype, kernel, 4)
        assert plan.paged_rows == step.q.shape[0]
        plan = plan_attention(step.attn, block_size, NUM_KV_HEADS, dtype, kernel)
        assert plan.paged_rows == (step.q.shape[0] if route == "cpp" else len(work.decodes))


def test_without_a_window_in_reach_the_plan_is_the_plain_one() -> None:
    """No window, or one longer than every context: the same gathers as a plan without one, no masks (SDPA's causal
    flag and lower-right causal attention as before), the window kept for the kernels."""
    step = make_step(STEPS["mixed"], 4, torch.float32, seed=1)
    plain = plan_attention(step.attn, 4, NUM_KV_HEADS, torch.float32, Kernel.TORCH)
    assert plain.window == 0 and plain.scale is None
    far = plan_attention(step.attn, 4, NUM_KV_HEADS, torch.float32, Kernel.TORCH, 75, 0.5)
    assert far.window == 75 and far.scale == 0.5
    for plan in (plain, far):
        assert plan.max_decode_ctx == 70 and plan.decode_bias is not None and plan.decode_bias.shape[-1] == 70
        assert plan.fresh is not None and plan.fresh.mask is None and plan.fresh.members == (1, 2, 3, 4)
        assert all(seq.mask is None for seq in plan.prefills)
    assert plain.decode_k_rows is not None and far.decode_k_rows is not None
    assert torch.equal(plain.decode_k_rows, far.decode_k_rows)
    assert torch.equal(plain.decode_bias, far.decode_bias)  # type: ignore[arg-type]


def test_a_window_is_skipped_not_masked() -> None:
    """Under a window of 13 the torch routes read what the windows reach: decodes gather 13 positions, a chunk of 9
    after 31 cached tokens the 21 from its first query's window on; fresh prompts past 13 tokens get the window's mask
    (one tensor, the batch's and each prompt's top-left part)."""
    step = make_step(STEPS["mixed"], 4, torch.float32, seed=1)
    plan = plan_attention(step.attn, 4, NUM_KV_HEADS, torch.float32, Kernel.TORCH, 13)
    assert plan.window == 13 and plan.max_decode_ctx == 13
    assert plan.decode_k_rows is not None and plan.decode_k_rows.numel() == 5 * NUM_KV_HEADS * 13
    chunk = plan.prefills[0]
    assert chunk.context_k is not None and chunk.context_k.numel() == 21
    assert chunk.mask is not None and chunk.mask.shape == (9, 21)
    assert plan.fresh is not None and plan.fresh.mask is not None and plan.fresh.mask.shape == (30, 30)
    short, long = plan.prefills[3], plan.prefills[2]  # fresh prompts of 5 and 30 tokens
    assert short.mask is None and long.mask is not None and long.mask.shape == (30, 30)


@pytest.mark.parametrize("kernel", [Kernel.TORCH, Kernel.CPP], ids=["torch", "cpp"])
def test_a_shared_plan_lends_its_window_independent_parts(kernel: Kernel) -> None:
    """A step planned for global layers, then for windowed ones with `shared`: the K/V rows (and the C++ route's
    per-row tables, and the chunks neither window cuts into) are the global plan's, and the output is the unshared
    plan's."""
    if kernel is Kernel.CPP:
        require_cpu_ops()
    step = make_step(STEPS["mixed"], 4, torch.float32, seed=2)
    base = plan_attention(step.attn, 4, NUM_KV_HEADS, torch.float32, kernel)
    for window in (13, 1000):
        local = plan_attention(step.attn, 4, NUM_KV_HEADS, torch.float32, kernel, window, 0.2, shared=base)
        alone = plan_attention(step.attn, 4, NUM_KV_HEADS, torch.float32, kernel, window, 0.2)
        assert local.k_rows is base.k_rows and local.v_rows is base.v_rows
        if kernel is Kernel.CPP:
            assert local.decode_block_tables is base.decode_block_tables
        else:
            uncut = [i for i, seq in enumerate(step.attn.prefills) if seq.context_len <= window]
            assert all(local.prefills[i] is base.prefills[i] for i in uncut) and len(uncut) == (
                2 if window == 13 else 6
            )
        cache = step.poisoned(window)
        out = paged_attention(step.q, step.k, step.v, cache.clone(), local)
        torch.testing.assert_close(out, paged_attention(step.q, step.k, step.v, cache.clone(), alone), rtol=0, atol=0)
        assert_close(out, reference(step, window, 0.2), torch.float32)


@pytest.mark.parametrize("kernel", [Kernel.TRITON, Kernel.CPP], ids=["triton", "cpp"])
def test_the_kernels_window_whatever_the_planned_lengths(kernel: Kernel) -> None:
    """A captured CUDA graph replays a plan made for its capture's lengths (engine/worker/cuda_graphs.py plans with a
    longest context of 0): the kernels still window the lengths they read from the device."""
    if kernel is Kernel.CPP:
        require_cpu_ops()
    step = make_step(STEPS["decodes"], 8, torch.float32, seed=3)
    attn = step.attn
    tables, lens = attn.decode_block_tables, attn.decode_context_lens
    captured = AttentionMetadata(attn.slot_mapping, attn.num_decode_tokens, tables, lens, (), 0)
    plan: AttentionPlan = plan_attention(captured, 8, NUM_KV_HEADS, torch.float32, kernel, 5, 0.2)
    assert plan.window == 5
    out = paged_attention(step.q, step.k, step.v, step.poisoned(5), plan)
    assert_close(out, reference(step, 5, 0.2), torch.float32)


@pytest.mark.parametrize("window", [0, -3])
def test_a_window_must_hold_a_position(window: int) -> None:
    step = make_step(STEPS["decodes"], 4, torch.float32, seed=4)
    with pytest.raises(ValueError, match="at least one position"):
        plan_attention(step.attn, 4, NUM_KV_HEADS, torch.float32, Kernel.TORCH, window)
