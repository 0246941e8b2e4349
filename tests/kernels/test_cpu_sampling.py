"""The CPU's greedy pick (loragate_kernels/cpu/sampling.cpp) against torch's argmax and isfinite, and the sampler
through it against the sampler's torch path: ties (the first index wins, also across the ranges the banned columns split
a row into), NaN and infinities anywhere (banned columns included), rows where every column is banned, strided rows,
vocabularies that are not a multiple of the vector width, 1 and 2 threads, bad arguments.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.request import Request, SamplingParams
from engine.worker.sampler import NO_TOKEN, NON_FINITE, Sampler
from loragate_kernels.backends import Kernel
from loragate_kernels.cpu import ops as cpu_ops

from built_ops import require_cpu_ops

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["fp32", "bf16", "fp16"]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    require_cpu_ops()


def expected(logits: torch.Tensor, banned: list[int]) -> list[int]:
    """torch's answer: finiteness over the whole row, then the argmax with the banned columns at -inf."""
    finite = logits.isfinite().all(-1).tolist()
    masked = logits.float().clone()
    if banned:
        masked[:, banned] = float("-inf")
    picks = masked.argmax(-1).tolist()
    everything_banned = len(set(banned)) >= logits.shape[1]
    return [NON_FINITE if not ok else NO_TOKEN if everything_banned else t for t, ok in zip(picks, finite, strict=True)]


def hostile_rows(vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randn(12, vocab + 5, generator=g).mul(3).round().to(dtype)[:, 2 : 2 + vocab]  # ties, strided rows
    raw[1, 3 % vocab] = raw[1, vocab - 1] = raw[1].max() + 1  # a tie at the top, at both ends
    raw[2, :] = float("-inf")
    raw[3, vocab // 2] = float("inf")
    raw[4, vocab - 1] = float("nan")  # in the scalar tail
    raw[5, :] = raw[5, 0]  # a constant row: index 0
    raw[6, 17 % vocab] = float("-inf")  # one -inf: not finite
    return raw


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49, 49152])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_greedy_rows_is_torch_argmax_with_finiteness(dtype: torch.dtype, vocab: int, threads: int) -> None:
    torch.set_num_threads(threads)
    raw = hostile_rows(vocab, dtype, seed=vocab)
    assert raw.stride(0) == vocab + 5
    for banned in ([], [0], [vocab - 1], sorted({vocab // 3, vocab // 2, vocab // 3, 0})):
        got = cpu_ops.greedy_rows_cpu(raw, torch.tensor(banned, dtype=torch.long), NON_FINITE, NO_TOKEN)
        assert got == expected(raw, banned), banned
        assert all(type(t) is int for t in got)


def test_a_tie_across_a_banned_column_keeps_the_first_index() -> None:
    raw = torch.zeros(2, 100)
    raw[0, 10] = raw[0, 60] = 5.0  # the maximum before and after the banned column 40
    raw[1, 40] = 9.0  # the banned column holds the largest value: the next one wins
    raw[1, 90] = 2.0
    banned = torch.tensor([40])
    assert cpu_ops.greedy_rows_cpu(raw, banned, NON_FINITE, NO_TOKEN) == [10, 90]
    raw[1, 40] = float("nan")  # a banned column still counts for finiteness
    assert cpu_ops.greedy_rows_cpu(raw, banned, NON_FINITE, NO_TOKEN) == [10, NON_FINITE]


def test_every_column_banned_is_no_token() -> None:
    raw = torch.randn(3, 4)
    assert cpu_ops.greedy_rows_cpu(raw, torch.tensor([3, 2, 1, 0, 2]), NON_FINITE, NO_TOKEN) == [NO_TOKEN] * 3


def test_bad_arguments_are_refused() -> None:
    raw = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        cpu_ops.greedy_rows_cpu(raw, torch.tensor([8]), NON_FINITE, NO_TOKEN)
    with pytest.raises(RuntimeError, match="outside the vocabulary"):
        cpu_ops.greedy_rows_cpu(raw, torch.tensor([-1]), NON_FINITE, NO_TOKEN)
    with pytest.raises(RuntimeError, match="int64"):
        cpu_ops.greedy_rows_cpu(raw, torch.tensor([1], dtype=torch.int32), NON_FINITE, NO_TOKEN)
    with pytest.raises(RuntimeError, match="contiguous columns"):
        cpu_ops.greedy_rows_cpu(raw.t(), torch.tensor([], dtype=torch.long), NON_FINITE, NO_TOKEN)
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        cpu_ops.greedy_rows_cpu(raw.double(), torch.tensor([], dtype=torch.long), NON_FINITE, NO_TOKEN)


def _request(params: SamplingParams, outputs: int = 0) -> Request:
    r = Request("r", [1, 2, 3], params)
    r.output_token_ids.extend([4] * outputs)
    return r


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "params, outputs",
    [
        (SamplingParams(temperature=0.0), 0),  # plain greedy
        (SamplingParams(temperature=0.0, min_tokens=5), 2),  # EOS masked (W1's rows)
        (SamplingParams(temperature=0.0, min_tokens=5, stop_token_ids=(7,)), 2),  # stop ids too: the torch path
    ],
    ids=["plain", "eos-masked", "stop-ids"],
)
def test_the_sampler_picks_the_same_tokens_on_both_routes(
    dtype: torch.dtype, params: SamplingParams, outputs: int
) -> None:
    eos = (0, 5)
    raw = hostile_rows(300, dtype, seed=3)
    raw[7, 0] = raw[7, 5] = raw[7].max() + 4  # EOS is the argmax: masked below min_tokens
    requests = [_request(params, outputs) for _ in range(raw.shape[0])]
    want = Sampler(eos, greedy=Kernel.TORCH)(raw.clone(), requests).token_ids
    got = Sampler(eos, greedy=Kernel.CPP)(raw.clone(), requests).token_ids
    assert got == want
    assert want[2] == want[3] == want[4] == NON_FINITE
    assert (want[7] in eos) == (outputs >= params.min_tokens)
