"""The CPU's C++ paged decode attention (loragate_kernels/cpu/attention.cpp) against the float64 oracle and the engine's
torch decode path, on tests/kernels/test_paged_attention.py's cases: ragged contexts (1, bs-1, bs, bs+1, several
blocks), permuted non-contiguous pages, and NaN/+inf/-inf in every cache slot no sequence owns (a read at or past a
context length turns a row into NaN). Also: the engine sends its decodes to the op by default on a CPU, rows of length 0
give zeros, and tables naming pages outside the cache are refused before anything is read. Sliding windows and scales
(decode rows and prompt rows, every loop of the op) against SDPA with transformers' mask, with everything before each
window NaN (test_paged_attention.py `outside_window_poisoned`).
"""

from __future__ import annotations

import pytest
import torch
from test_paged_attention import (
    DTYPE_IDS,
    DTYPES,
    HEAD_IDS,
    HEADS,
    WINDOW_SCALES,
    DecodeCase,
    assert_close,
    dense_reference,
    make_case,
    oracle,
    outside_window_poisoned,
    ragged_lens,
    run_engine,
)

from loragate_kernels.backends import Kernel
from loragate_kernels.cpu.ops import paged_decode_attention_cpu

from built_ops import require_cpu_ops


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_cpu_ops()


# 32, 64, 128: the AVX-512 loop's sizes (where the CPU has AVX-512); 24: the portable loop
@pytest.mark.parametrize("head_dim", [24, 32, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_op_matches_the_oracle_and_the_torch_path(
    dtype: torch.dtype,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    head_dim: int,
) -> None:
    seed = 1000 * DTYPES.index(dtype) + 100 * HEADS.index((num_heads, num_kv_heads)) + block_size + head_dim
    case = make_case(
        ragged_lens(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        head_dim=head_dim,
    )
    out = paged_decode_attention_cpu(case.q, case.cache_after_write(), case.block_tables, case.context_lens)
    assert out.dtype == dtype and out.shape == case.q.shape
    assert_close(out, oracle(case), dtype)
    torch_out, _ = run_engine(case)
    cpp_out, cpp_cache = run_engine(case, Kernel.CPP)  # through plan_attention and paged_attention, as a step runs it
    torch.testing.assert_close(cpp_cache, case.cache_after_write(), rtol=0, atol=0, equal_nan=True)
    assert_close(cpp_out, torch_out, dtype)
    assert_close(cpp_out, oracle(case), dtype)


@pytest.mark.parametrize("head_dim", [24, 32, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_window_and_scale_match_the_masked_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    """Every (window, scale) of WINDOW_SCALES over the ragged contexts, everything before each window poisoned; the
    C++ route through plan_attention and paged_attention too."""
    seed = 5000 + 1000 * DTYPES.index(dtype) + 100 * HEADS.index((num_heads, num_kv_heads)) + block_size + head_dim
    case = make_case(
        ragged_lens(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        head_dim=head_dim,
    )
    for window, scale in WINDOW_SCALES:
        expected = dense_reference(case, window, scale)
        poisoned = outside_window_poisoned(case, window)
        cache, tables, lens = poisoned.cache_after_write(), poisoned.block_tables, poisoned.context_lens
        out = paged_decode_attention_cpu(poisoned.q, cache, tables, lens, scale=scale, window=window)
        assert_close(out, expected, dtype)
        assert_close(run_engine(poisoned, Kernel.CPP, window or None, scale)[0], expected, dtype)


def prompt_rows(case: DecodeCase, chunks: list[tuple[int, int, int]]) -> DecodeCase:
    """Rows as engine/model/attention.py `_paged_rows` lays out a step: for (sequence d, first, count), the prompt
    tokens of sequence d at positions first .. first + count - 1, each a row with context position + 1 over d's table
    (so each row writes its own position, as the step's K/V are written before attention)."""
    picks = [d for d, first, count in chunks for _ in range(count)]
    lens = torch.tensor([position + 1 for _, first, count in chunks for position in range(first, first + count)])
    g = torch.Generator().manual_seed(len(picks))
    num_heads, head_dim = case.q.shape[1:]
    num_kv_heads = case.cache.shape[3]

    def fresh(heads: int) -> torch.Tensor:
        return torch.randn(len(picks), heads, head_dim, generator=g).to(case.q.dtype)

    return DecodeCase(
        fresh(num_heads),
        fresh(num_kv_heads),
        fresh(num_kv_heads),
        case.cache,
        case.block_tables[picks].contiguous(),
        lens,
    )


# 37 rows of one prompt (blocks of 16, 16 and 5) after two decode rows; 3 rows (too few for a block); 16 rows from
# position 16 (one block, a page boundary at its start); 21 rows from position 100; then sequence 4's rows at positions
# 0-5 and sequence 5's at 6-11, whose context lengths run on from 4's but over other pages.
CHUNKS = [(0, 40, 1), (1, 8, 1), (2, 0, 37), (3, 5, 3), (1, 16, 16), (0, 100, 21), (4, 0, 6), (5, 6, 6)]


@pytest.mark.parametrize("head_dim", [24, 32, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prompt_rows_match_the_oracle(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    seed = 7 + 1000 * DTYPES.index(dtype) + 100 * HEADS.index((num_heads, num_kv_heads)) + block_size + head_dim
    seqs = make_case(
        [121, 33, 37, 8, 6, 12],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        head_dim=head_dim,
    )
    case = prompt_rows(seqs, CHUNKS)
    cache, tables, lens = case.cache_after_write(), case.block_tables, case.context_lens
    out = paged_decode_attention_cpu(case.q, cache, tables, lens)
    assert_close(out, oracle(case), dtype)
    rows = [slice(i, i + 1) for i in range(len(lens))]  # each row alone: never part of a block
    one_by_one = torch.cat([paged_decode_attention_cpu(case.q[r], cache, tables[r], lens[r]) for r in rows])
    assert_close(out, one_by_one, dtype)


@pytest.mark.parametrize("head_dim", [24, 32, 64, 128])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prompt_rows_with_a_window_match_the_masked_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int, head_dim: int
) -> None:
    """CHUNKS' rows (fp32: blocks of up to 16 rows, one a lane) under windows shorter than a block's rows (1, 3, 5),
    around it (16, 17) and longer (37, 200), before which every sequence's cache is NaN; each row alone (never part of
    a block) agrees."""
    seed = 9 + 1000 * DTYPES.index(dtype) + 100 * HEADS.index((num_heads, num_kv_heads)) + block_size + head_dim
    seqs = make_case(
        [121, 33, 37, 8, 6, 12],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
        head_dim=head_dim,
    )
    case = prompt_rows(seqs, CHUNKS)
    for window, scale in [(1, None), (3, 0.2), (5, None), (16, 0.3), (17, None), (37, 0.1), (200, None)]:
        expected = dense_reference(case, window, scale)
        poisoned = outside_window_poisoned(case, window)
        cache, tables, lens = poisoned.cache_after_write(), poisoned.block_tables, poisoned.context_lens
        out = paged_decode_attention_cpu(poisoned.q, cache, tables, lens, scale=scale, window=window)
        assert_close(out, expected, dtype)
        rows = [slice(i, i + 1) for i in range(len(lens))]
        alone = [
            paged_decode_attention_cpu(poisoned.q[r], cache, tables[r], lens[r], scale=scale, window=window)
            for r in rows
        ]
        assert_close(torch.cat(alone), expected, dtype)


def test_prompt_rows_deep_in_a_long_context() -> None:
    """50 rows at positions 650-699 of a 700-token sequence (engine/model/attention.py PAGED_PREFILL_MAX_CONTEXT lets
    contexts this long through), beside a decode row."""
    seqs = make_case([700, 30], num_heads=9, num_kv_heads=3, block_size=16, dtype=torch.float32, seed=11, head_dim=64)
    case = prompt_rows(seqs, [(1, 29, 1), (0, 650, 50)])
    out = paged_decode_attention_cpu(case.q, case.cache_after_write(), case.block_tables, case.context_lens)
    assert_close(out, oracle(case), torch.float32)


def test_peaked_scores_and_strided_q() -> None:
    """Scores ~100 apart (the softmax must subtract its max), and q a view into a wider projection output."""
    case = make_case([37, 2], num_heads=4, num_kv_heads=2, block_size=8, dtype=torch.float32, seed=5)
    case.q *= 6.0
    page = case.block_tables[0, 30 // 8]
    case.cache[page, 0, 30 % 8, 0] = case.q[0, 0] * 0.5
    wide = torch.randn(2, 6, 40)
    wide[:, 1:5, 4:36] = case.q
    out = paged_decode_attention_cpu(wide[:, 1:5, 4:36], case.cache_after_write(), case.block_tables, case.context_lens)
    assert_close(out, oracle(case), torch.float32)


def test_zero_context_rows_give_zeros() -> None:
    case = make_case([5, 12], num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32, seed=9)
    q = torch.cat([case.q[:1], torch.randn(1, 4, 32), case.q[1:]])
    tables = torch.cat([case.block_tables[:1], torch.zeros_like(case.block_tables[:1]), case.block_tables[1:]])
    out = paged_decode_attention_cpu(q, case.cache_after_write(), tables, torch.tensor([5, 0, 12]))
    assert (out[1] == 0).all()
    assert_close(out[[0, 2]], oracle(case), torch.float32)


def test_tables_outside_the_cache_are_refused() -> None:
    case = make_case([5, 12], num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32, seed=9)
    cache, tables, lens = case.cache_after_write(), case.block_tables.clone(), case.context_lens
    bad = tables.clone()
    bad[1, 2] = cache.shape[0]  # a page past the cache, inside row 1's length
    with pytest.raises(RuntimeError, match="is not a page"):
        paged_decode_attention_cpu(case.q, cache, bad, lens)
    bad[1, 2] = -1
    with pytest.raises(RuntimeError, match="is not a page"):
        paged_decode_attention_cpu(case.q, cache, bad, lens)
    with pytest.raises(RuntimeError, match="does not fit"):
        paged_decode_attention_cpu(case.q, cache, tables, torch.tensor([5, tables.shape[1] * 4 + 1]))
    with pytest.raises(RuntimeError, match="int64"):
        paged_decode_attention_cpu(case.q, cache, tables.int(), lens)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_decode_attention_cpu(case.q.double(), cache, tables, lens)
    # padding entries past a row's length are never read, whatever they hold
    padded = tables.clone()
    padded[0, 2:] = 10**9
    assert_close(paged_decode_attention_cpu(case.q, cache, padded, lens), oracle(case), torch.float32)
    # nor are those of pages wholly before a row's window (row 1: context 12 over pages of 4)
    before = tables.clone()
    before[1, 0] = 10**9
    with pytest.raises(RuntimeError, match="is not a page"):
        paged_decode_attention_cpu(case.q, cache, before, lens, window=9)  # positions 3-11: from page 0
    expected = dense_reference(case, 8, None)
    assert_close(paged_decode_attention_cpu(case.q, cache, before, lens, window=8), expected, torch.float32)  # 4-11
    with pytest.raises(RuntimeError, match="window"):
        paged_decode_attention_cpu(case.q, cache, tables, lens, window=-1)
