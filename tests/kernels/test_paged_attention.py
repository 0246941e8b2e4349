"""The Triton paged-attention decode kernel (loragate_kernels/triton/paged_attention.py) against two references: a
per-sequence float64 oracle written here (gather the context through the block table, repeat kv heads, softmax) and the
engine's torch decode path (engine/model/attention.py `paged_attention` with a decode-only plan).

Without a GPU the kernel runs under Triton's interpreter (tests/conftest.py) on CPU tensors; with one, the same
tests run natively on CUDA tensors. Every case has ragged contexts in one batch (1, bs-1, bs, bs+1, several
blocks, across BLOCK_N tiles, the longest not a multiple of bs), permuted non-contiguous pages, and NaN/+inf/-inf
in every cache slot no sequence owns: the tail of each last block, and the pages its table's padding names
(unowned pages, page 0, other sequences' pages). A kernel that reads a position at or past a context length, or
lets one into the softmax, turns a row into NaN or moves it away from the oracle.

Sliding windows and softmax scales are checked against a third reference: SDPA over each row's whole context with a
boolean mask from transformers' own mask functions (`transformers.masking_utils`), on a cache where everything before
each window is NaN (`outside_window_poisoned`): a kernel that reads a position before a row's window, rather than
skipping it, turns the row into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
import torch.nn.functional as F

from engine.model.attention import AttentionMetadata, paged_attention, plan_attention
from loragate_kernels.backends import Kernel
from loragate_kernels.triton.paged_attention import BLOCK_N, paged_decode_attention

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# Against the float64 oracle and the engine's path, relative to max(1, the largest |output|).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
HEADS = [(4, 4), (4, 2), (8, 2)]  # (num_heads, num_kv_heads): GQA ratios 1, 2, 4
HEAD_IDS = ["mha", "gqa2", "gqa4"]


@dataclass
class DecodeCase:
    q: torch.Tensor  # [D, H, hd]
    k_new: torch.Tensor  # [D, kvh, hd]: the step's keys, for position context_lens[d] - 1
    v_new: torch.Tensor
    cache: torch.Tensor  # [pages, 2, bs, kvh, hd] before the step's K/V are written
    block_tables: torch.Tensor  # [D, W] int64, padded with page ids no sequence may read
    context_lens: torch.Tensor  # [D] int64

    @property
    def block_size(self) -> int:
        return self.cache.shape[2]

    def new_slots(self) -> torch.Tensor:
        """Logical slots (page * bs + offset) of the step's tokens."""
        last = self.context_lens - 1
        pages = self.block_tables.gather(1, (last // self.block_size)[:, None])[:, 0]
        return pages * self.block_size + last % self.block_size

    def cache_after_write(self) -> torch.Tensor:
        """A copy of the cache with the step's K/V written, as the engine does before attention."""
        cache = self.cache.clone()
        last = self.context_lens - 1
        for d in range(len(last)):
            page = self.block_tables[d, last[d] // self.block_size]
            cache[page, 0, last[d] % self.block_size] = self.k_new[d]
            cache[page, 1, last[d] % self.block_size] = self.v_new[d]
        return cache

    def to(self, device: torch.device) -> DecodeCase:
        return DecodeCase(
            *(t.to(device) for t in (self.q, self.k_new, self.v_new, self.cache)),
            *(t.to(device) for t in (self.block_tables, self.context_lens)),
        )


def poison_like(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """fp32 NaN, +inf and -inf in random places."""
    choice = torch.randint(0, 3, shape, generator=generator)
    return torch.tensor([float("nan"), float("inf"), float("-inf")])[choice]


def make_case(
    lens: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
    head_dim: int = 32,
) -> DecodeCase:
    """A decode batch over a poisoned cache: each sequence owns ceil(len / bs) pages taken from a random
    permutation of the pool (page 0 included), and has written positions [0, len - 1); every other slot holds
    NaN/+inf/-inf. Table entries past a sequence's pages name random pages: unowned, page 0, or another
    sequence's."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block_size) for n in lens]
    num_pages = sum(blocks) + 3  # three pages nobody owns
    width = max(blocks) + 2  # padding past every sequence's pages
    cache = poison_like((num_pages, 2, block_size, num_kv_heads, head_dim), g)
    perm = torch.randperm(num_pages, generator=g)
    tables = torch.randint(0, num_pages, (len(lens), width), generator=g)
    cursor = 0
    for d, (n, b) in enumerate(zip(lens, blocks, strict=True)):
        tables[d, :b] = perm[cursor : cursor + b]
        cursor += b
        for p in range(n - 1):  # the context before this step's token
            cache[tables[d, p // block_size], :, p % block_size] = torch.randn(2, num_kv_heads, head_dim, generator=g)
    q = torch.randn(len(lens), num_heads, head_dim, generator=g)
    k_new = torch.randn(len(lens), num_kv_heads, head_dim, generator=g)
    v_new = torch.randn(len(lens), num_kv_heads, head_dim, generator=g)
    return DecodeCase(q.to(dtype), k_new.to(dtype), v_new.to(dtype), cache.to(dtype), tables, torch.tensor(lens))


def oracle(case: DecodeCase) -> torch.Tensor:
    """[D, H, hd] float64, one sequence at a time, from the cache with the step's K/V written."""
    cache = case.cache_after_write().cpu().double()
    tables, lens = case.block_tables.cpu(), case.context_lens.cpu()
    num_seqs, num_heads, head_dim = case.q.shape
    group = num_heads // cache.shape[3]
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=torch.float64)
    for d in range(num_seqs):
        pos = torch.arange(int(lens[d]))
        pages = tables[d, pos // case.block_size]
        keys = cache[pages, 0, pos % case.block_size].repeat_interleave(group, dim=1)  # [n, H, hd]
        values = cache[pages, 1, pos % case.block_size].repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", case.q[d].cpu().double(), keys) * head_dim**-0.5
        out[d] = torch.einsum("hn,nhd->hd", scores.softmax(dim=-1), values)
    return out


def hf_mask(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[Q, K] bool, True where the query at query_pos[i] attends the key at key_pos[j]: transformers' causal mask
    function, and its sliding-window one where window > 0 (key > query - window)."""
    from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

    mask_fn = sliding_window_causal_mask_function(window) if window else causal_mask_function
    return mask_fn(0, 0, query_pos[:, None], key_pos[None, :])


def dense_reference(case: DecodeCase, window: int, scale: float | None) -> torch.Tensor:
    """[D, H, hd] float64: each row's query (position context_len - 1) against its whole context, by SDPA with
    `hf_mask` (scale None: SDPA's default, hd**-0.5), from the cache with the step's K/V written."""
    cache = case.cache_after_write().cpu().double()
    tables, lens = case.block_tables.cpu(), case.context_lens.cpu()
    out = torch.empty(case.q.shape, dtype=torch.float64)
    for d in range(case.q.shape[0]):
        n = int(lens[d])
        pos = torch.arange(n)
        pages = tables[d, pos // case.block_size]
        keys, values = (
            cache[pages, kv, pos % case.block_size].transpose(0, 1)[None] for kv in (0, 1)
        )  # [1, kvh, n, hd]
        query = case.q[d].cpu().double()[None, :, None]  # [1, H, 1, hd]
        mask = hf_mask(torch.tensor([n - 1]), pos, window)  # [1, n]
        out[d] = F.scaled_dot_product_attention(query, keys, values, mask, scale=scale, enable_gqa=True)[0, :, 0]
    return out


def outside_window_poisoned(case: DecodeCase, window: int) -> DecodeCase:
    """The case with what no row's window reaches made NaN: per sequence (its rows share their first page), the
    positions before the earliest window start of its rows; the table entries of the pages wholly before it name an
    extra page of NaN instead. A kernel that reads before a row's window gets NaN."""
    bs = case.block_size
    cache = torch.cat([case.cache, torch.full_like(case.cache[:1], float("nan"))])
    tables = case.block_tables.clone()
    starts: dict[int, int] = {}
    for d, n in enumerate(case.context_lens.tolist()):
        first_page = int(case.block_tables[d, 0])
        starts[first_page] = min(starts.get(first_page, n), max(0, n - window) if window else 0)
    for d in range(tables.shape[0]):
        first = starts[int(case.block_tables[d, 0])]
        tables[d, : first // bs] = cache.shape[0] - 1
        for p in range(first // bs * bs, first):
            cache[case.block_tables[d, p // bs], :, p % bs] = float("nan")
    return replace(case, cache=cache, block_tables=tables)


# (window, scale) pairs: a window of one position, windows shorter than, equal to (bs, 2 bs + 3 at bs 4, BLOCK_N + 1,
# the longest ragged context 3 BLOCK_N + 5) and longer than the contexts, most not a multiple of bs; no window with a
# scale of its own.
WINDOW_SCALES = [(1, None), (5, 0.3), (16, None), (11, 0.11), (BLOCK_N + 1, 0.3), (3 * BLOCK_N + 5, None)]
WINDOW_SCALES += [(1000, 0.2), (0, 0.3)]


def run_engine(
    case: DecodeCase, kernel: Kernel = Kernel.TORCH, window: int | None = None, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, cache after the step) of the engine's path: a decode-only step through plan_attention, on the
    CPU, on the attention route `kernel` (by default the torch decode path, the engine's reference whatever the
    device: its "triton" route is this kernel), with the plan's `window` and `scale`."""
    attn = AttentionMetadata(
        slot_mapping=case.new_slots(),
        num_decode_tokens=case.q.shape[0],
        decode_block_tables=case.block_tables,
        decode_context_lens=case.context_lens,
        prefills=(),
        max_decode_context_len=int(case.context_lens.max()),
    )
    plan = plan_attention(attn, case.block_size, case.cache.shape[3], case.q.dtype, kernel, window, scale)
    cache = case.cache.clone()
    return paged_attention(case.q, case.k_new, case.v_new, cache, plan), cache


def run_kernel(
    case: DecodeCase, out: torch.Tensor | None = None, scale: float | None = None, window: int = 0
) -> torch.Tensor:
    on_device = case.to(DEVICE)
    cache, tables, lens = on_device.cache_after_write(), on_device.block_tables, on_device.context_lens
    result = paged_decode_attention(on_device.q, cache, tables, lens, out=out, scale=scale, window=window)
    assert result.dtype == case.q.dtype and result.shape == case.q.shape
    return result


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual, expected = actual.cpu().double(), expected.cpu().double()
    assert not actual.isnan().any() and not actual.isinf().any(), "a poisoned slot reached the output"
    tol = TOLERANCE[dtype] * max(1.0, expected.abs().max().item())
    torch.testing.assert_close(actual, expected, rtol=0, atol=tol)


def ragged_lens(block_size: int) -> list[int]:
    """Block and tile boundaries on both sides; the longest spans four BLOCK_N tiles, not a multiple of bs."""
    return [1, block_size - 1, block_size, block_size + 1, 2 * block_size + 3, BLOCK_N, BLOCK_N + 1, 3 * BLOCK_N + 5]


@pytest.mark.parametrize("block_size", [4, 8, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_matches_the_oracle_and_the_engine(dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int):
    seed = 100 * DTYPES.index(dtype) + 10 * HEADS.index((num_heads, num_kv_heads)) + block_size
    case = make_case(
        ragged_lens(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    out = run_kernel(case)
    engine_out, engine_cache = run_engine(case)
    # The step's K/V went where the engine writes them (NaN compared equal: the poison is untouched too).
    torch.testing.assert_close(case.cache_after_write(), engine_cache, rtol=0, atol=0, equal_nan=True)
    assert_close(out, oracle(case), dtype)
    assert_close(out, engine_out, dtype)


def test_the_engine_triton_route_runs_this_kernel():
    """The triton attention route sends the engine's decodes here: the same output as its torch path."""
    case = make_case([2, 13, 31], num_heads=8, num_kv_heads=2, block_size=8, dtype=torch.float32, seed=3)
    torch_out, _ = run_engine(case)
    triton_out, triton_cache = run_engine(case, Kernel.TRITON)
    torch.testing.assert_close(triton_cache, case.cache_after_write(), rtol=0, atol=0, equal_nan=True)
    assert_close(triton_out, torch_out, torch.float32)
    assert_close(triton_out, oracle(case), torch.float32)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_window_and_scale_match_the_masked_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, block_size: int
):
    """Every (window, scale) of WINDOW_SCALES over the ragged contexts, with everything before each window poisoned;
    the engine's torch decode path (which gathers the window alone) under the same plan agrees."""
    seed = 300 + 100 * DTYPES.index(dtype) + 10 * HEADS.index((num_heads, num_kv_heads)) + block_size
    case = make_case(
        ragged_lens(block_size),
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        block_size=block_size,
        dtype=dtype,
        seed=seed,
    )
    for window, scale in WINDOW_SCALES:
        expected = dense_reference(case, window, scale)
        poisoned = outside_window_poisoned(case, window)
        assert_close(run_kernel(poisoned, scale=scale, window=window), expected, dtype)
        assert_close(run_engine(poisoned, Kernel.TORCH, window or None, scale)[0], expected, dtype)


def test_a_window_moves_the_output():
    """The reference itself tells windows apart: a window shorter than a context changes that row, and a scale
    changes every row (so the cases above could fail)."""
    case = make_case([3, 40], num_heads=4, num_kv_heads=2, block_size=8, dtype=torch.float32, seed=2)
    full, windowed, scaled = (dense_reference(case, w, s) for w, s in [(0, None), (7, None), (0, 0.5)])
    torch.testing.assert_close(windowed[0], full[0])
    assert (windowed[1] - full[1]).abs().max() > 1e-2
    assert ((scaled - full).abs().amax(dim=(1, 2)) > 1e-2).all()
    assert_close(full, oracle(case), torch.float32)


def test_the_engine_triton_route_passes_the_window_and_scale():
    case = make_case([2, 13, 31], num_heads=8, num_kv_heads=2, block_size=8, dtype=torch.float32, seed=4)
    poisoned = outside_window_poisoned(case, 6)
    out, _ = run_engine(poisoned, Kernel.TRITON, 6, 0.2)
    assert_close(out, dense_reference(case, 6, 0.2), torch.float32)


def test_rejects_a_negative_window():
    case = make_case([3], num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32, seed=0)
    with pytest.raises(AssertionError, match="window"):
        paged_decode_attention(case.q, case.cache, case.block_tables, case.context_lens, window=-1)


@pytest.mark.parametrize("num_seqs", [1, 2, 5, 9])
def test_batch_sizes(num_seqs: int):
    g = torch.Generator().manual_seed(num_seqs)
    lens = torch.randint(1, 2 * BLOCK_N + 8, (num_seqs,), generator=g).tolist()
    case = make_case(lens, num_heads=4, num_kv_heads=2, block_size=8, dtype=torch.float32, seed=num_seqs)
    out = run_kernel(case)
    assert_close(out, oracle(case), torch.float32)
    assert_close(out, run_engine(case)[0], torch.float32)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_head_dims(head_dim: int):
    case = make_case(
        [3, 17, 40], num_heads=4, num_kv_heads=1, block_size=4, dtype=torch.float32, seed=head_dim, head_dim=head_dim
    )
    assert_close(run_kernel(case), oracle(case), torch.float32)


def test_peaked_softmax_rescales_across_tiles():
    """Large scores, the largest in the last tile: the running max moves by far more than exp can absorb."""
    n = 3 * BLOCK_N + 5
    case = make_case([n, 2 * BLOCK_N + 1], num_heads=4, num_kv_heads=2, block_size=8, dtype=torch.float32, seed=5)
    case.q *= 6.0
    late = n - 3  # a key in the last tile, aligned with query head 0: its score is ~100 above the rest
    page = case.block_tables[0, late // 8]
    case.cache[page, 0, late % 8, 0] = case.q[0, 0] * 0.5
    out = run_kernel(case)
    assert_close(out, oracle(case), torch.float32)
    assert_close(out, run_engine(case)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_preempted_row_reads_only_its_own_length(dtype: torch.dtype):
    """Sequence A had 23 tokens and was preempted; its pages went, reordered, to sequence C (6 tokens), whose
    pages still hold A's (finite, large) values past position 6, and whose table's padding still names A's other
    pages. Sequence B decodes beside A in the first step and beside C in the second."""
    bs = 4
    g = torch.Generator().manual_seed(23)
    before = make_case([23, 5], num_heads=4, num_kv_heads=2, block_size=bs, dtype=torch.float32, seed=23)
    stale = before.cache_after_write()
    old_pages = before.block_tables[0, :6].clone()
    for p in range(23):  # A's values, scaled up: any leak dominates the softmax
        stale[old_pages[p // bs], :, p % bs] *= 8.0
    tables = torch.stack([old_pages[[4, 1, 5, 0, 2, 3]], before.block_tables[1, :6].clone()])
    for p in range(5):  # C's own context, over A's values in the first five slots of C's pages
        stale[tables[0, p // bs], :, p % bs] = torch.randn(2, 2, 32, generator=g)
    after = DecodeCase(
        q=torch.randn(2, 4, 32, generator=g).to(dtype),
        k_new=torch.randn(2, 2, 32, generator=g).to(dtype),
        v_new=torch.randn(2, 2, 32, generator=g).to(dtype),
        cache=stale.to(dtype),
        block_tables=tables,
        context_lens=torch.tensor([6, 6]),
    )
    assert_close(run_kernel(before), oracle(before), torch.float32)
    out = run_kernel(after)
    assert_close(out, oracle(after), dtype)
    assert_close(out, run_engine(after)[0], dtype)


def test_out_and_strided_views():
    """q a view into a wider projection output, out a view into a larger buffer: written in place, nothing
    around it touched; int32 block tables and context lengths."""
    case = make_case([1, 9, 30], num_heads=4, num_kv_heads=2, block_size=8, dtype=torch.float16, seed=7)
    wide_q = torch.randn(3, 6, 40, generator=torch.Generator().manual_seed(8)).to(torch.float16).to(DEVICE)
    wide_q[:, 1:5, 4:36] = case.q.to(DEVICE)
    buffer = torch.full((3, 6, 40), 7.0, dtype=torch.float16, device=DEVICE)
    out = buffer[:, 2:6, 8:40]
    on_device = case.to(DEVICE)
    result = paged_decode_attention(
        wide_q[:, 1:5, 4:36],
        on_device.cache_after_write(),
        on_device.block_tables.to(torch.int32),
        on_device.context_lens.to(torch.int32),
        out=out,
    )
    assert result is out
    assert_close(out, oracle(case), torch.float16)
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[:, 2:6, 8:40] = False
    assert (buffer[outside] == 7.0).all()


def test_zero_context_rows_give_zeros():
    """A row with context length 0 (a padding row of a captured batch) gets zeros, its neighbours their result."""
    case = make_case([5, 12], num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32, seed=9)
    expected = oracle(case)
    q = torch.cat([case.q[:1], torch.randn(1, 4, 32), case.q[1:]]).to(DEVICE)
    tables = torch.cat([case.block_tables[:1], torch.zeros_like(case.block_tables[:1]), case.block_tables[1:]])
    lens = torch.tensor([5, 0, 12])
    out = paged_decode_attention(q, case.cache_after_write().to(DEVICE), tables.to(DEVICE), lens.to(DEVICE))
    assert (out[1] == 0).all()
    assert_close(out[[0, 2]], expected, torch.float32)


def test_host_side_never_reads_device_values(monkeypatch: pytest.MonkeyPatch):
    """CUDA-graph safety of the wrapper: no tensor value is read on the host (.item(), int(), .tolist() all go
    through aten._local_scalar_dense), and the launch grid is the same whatever the context lengths."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import loragate_kernels.triton.paged_attention as module

    launches: list[tuple[int, ...]] = []

    class FakeKernel:
        def __getitem__(self, grid: tuple[int, ...]):
            launches.append(grid)
            return lambda *args, **kwargs: None

    class RecordOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(module._paged_decode_kernel, "on", lambda device: FakeKernel())
    for lens, window in (([1, 2, 3], 0), ([40, 7, 200], 0), ([40, 7, 200], 16)):
        case = make_case(lens, num_heads=8, num_kv_heads=2, block_size=8, dtype=torch.float32, seed=1)
        with RecordOps() as recorder:
            paged_decode_attention(case.q, case.cache, case.block_tables, case.context_lens, scale=0.1, window=window)
        assert recorder.ops, "the mode saw no op at all"  # (torch.empty_like for the output, at least)
        assert not [op for op in recorder.ops if "local_scalar_dense" in op or "item" in op], recorder.ops
    assert launches == [(3, 2), (3, 2), (3, 2)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graph_replays_with_new_context_lengths():
    """Captured once, replayed after the tables, lengths and cache change in place: each replay matches the
    oracle for the new step."""

    def make(lens: list[int], seed: int) -> DecodeCase:
        return make_case(lens, num_heads=8, num_kv_heads=2, block_size=16, dtype=torch.bfloat16, seed=seed)

    first, second = make([1, 40, 17], seed=11), make([70, 3, 33], seed=12)
    pages = max(first.cache.shape[0], second.cache.shape[0])
    width = max(first.block_tables.shape[1], second.block_tables.shape[1])
    static_q = first.q.cuda()
    static_cache = torch.zeros((pages, *first.cache.shape[1:]), dtype=torch.bfloat16, device="cuda")
    static_tables = torch.zeros((3, width), dtype=torch.int64, device="cuda")
    static_lens = torch.ones(3, dtype=torch.int64, device="cuda")
    static_out = torch.empty_like(static_q)
    paged_decode_attention(static_q, static_cache, static_tables, static_lens, out=static_out)  # compile
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(static_q, static_cache, static_tables, static_lens, out=static_out)
    for case in (first, second):
        static_q.copy_(case.q)
        static_cache.fill_(float("nan"))
        static_cache[: case.cache.shape[0]].copy_(case.cache_after_write())
        static_tables.zero_()
        static_tables[:, : case.block_tables.shape[1]].copy_(case.block_tables)
        static_lens.copy_(case.context_lens)
        graph.replay()
        assert_close(static_out, oracle(case), torch.bfloat16)


def test_rejects_bad_shapes():
    case = make_case([3], num_heads=4, num_kv_heads=2, block_size=4, dtype=torch.float32, seed=0, head_dim=32)
    with pytest.raises(AssertionError, match="head_dim"):
        paged_decode_attention(case.q[..., :24], case.cache[..., :24], case.block_tables, case.context_lens)
    with pytest.raises(AssertionError, match="block_size"):
        cache = torch.zeros(4, 2, 6, 2, 32)
        paged_decode_attention(case.q, cache, case.block_tables, case.context_lens)
    with pytest.raises(AssertionError, match="query heads"):
        paged_decode_attention(case.q[:, :3], case.cache, case.block_tables, case.context_lens)


def test_every_padding_kind_is_named():
    """The cases above do exercise padding entries naming another sequence's page and unowned pages."""
    case = make_case(ragged_lens(4), num_heads=4, num_kv_heads=4, block_size=4, dtype=torch.float32, seed=4)
    blocks = [-(-int(n) // 4) for n in case.context_lens]
    owner = {int(case.block_tables[d, b]): d for d, n in enumerate(blocks) for b in range(n)}
    kinds = set()
    for d, n in enumerate(blocks):
        for page in case.block_tables[d, n:].tolist():
            kinds.add("unowned" if page not in owner else "own" if owner[page] == d else "other")
    assert {"unowned", "other"} <= kinds, kinds
