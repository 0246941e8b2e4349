"""Sampler against HF transformers' logits processors, the OpenAI penalty formula and torch's log_softmax."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from engine.core.request import Request, SamplingParams
from engine.worker.sampler import (
    FEW_CANDIDATES,
    NO_TOKEN,
    NON_FINITE,
    Sampler,
    argmax,
    argmax_list,
    draw_from_candidates,
    greedy_one_copy,
    sample_inverse_cdf,
)
from engine.worker.token_masks import unpack_bitmask

EOS = 3


def _request(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None, rid: str = "r"
) -> Request:
    req = Request(rid, list(prompt) if prompt is not None else [5, 6, 7], params)
    req.output_token_ids = list(output or [])
    return req


def _hf_reference(raw: torch.Tensor, req: Request) -> torch.Tensor:
    """One row [V] through HF's processors, in the order HF's generate applies them."""
    p = req.sampling_params
    ids = torch.tensor([req.all_token_ids])
    scores = raw[None].clone()
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
    if p.top_k is not None:
        scores = TopKLogitsWarper(p.top_k)(ids, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(ids, scores)
    return scores[0]


_ROW_PARAMS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=20),
    dict(temperature=1.3, top_p=0.9),
    dict(temperature=0.5, top_k=50, top_p=0.8),
    dict(temperature=1.0, top_k=1),
    dict(temperature=0.9, top_p=0.3, repetition_penalty=1.3),
    dict(temperature=1.1, top_k=2000, top_p=0.95, repetition_penalty=0.8),
    dict(temperature=2.0, top_p=0.999),
]


@pytest.mark.parametrize("scale", [0.5, 4.0], ids=["flat", "peaked"])
@pytest.mark.parametrize("vocab", [300, 5000])
def test_filtered_distribution_matches_hf_processors(scale: float, vocab: int) -> None:
    # Flat logits over 5000 tokens give nuclei larger than the sampler's candidate set (its full-sort
    # fallback); peaked ones stay inside it. Rows mix parameters to check per-row batching.
    gen = torch.Generator().manual_seed(int(scale * 10) + vocab)
    raw = torch.randn(len(_ROW_PARAMS), vocab, generator=gen) * scale
    reqs = [
        _request(
            SamplingParams(**kw),
            prompt=torch.randint(vocab, (12,), generator=gen).tolist(),
            output=torch.randint(vocab, (6,), generator=gen).tolist(),
            rid=str(i),
        )
        for i, kw in enumerate(_ROW_PARAMS)
    ]
    processed = Sampler((EOS,), seed=0).process(raw, reqs)
    for i, req in enumerate(reqs):
        expected = _hf_reference(raw[i], req)
        kept = torch.isfinite(processed[i])
        assert torch.equal(kept, torch.isfinite(expected)), (i, int(kept.sum()), int(torch.isfinite(expected).sum()))
        torch.testing.assert_close(processed[i].softmax(-1), expected.softmax(-1), rtol=1e-5, atol=1e-7)
    assert torch.isfinite(processed[4]).sum() == 1  # top_k=1


# Rows of a step as the model cards' defaults and requests give them: top-k alone, top-p alone, both, a top-k past
# the candidates, and rows that keep every token (no filter) or one.
_DRAW_PARAMS = [
    dict(temperature=1.0, top_k=64, top_p=0.95),  # Gemma 3's generation_config
    dict(temperature=0.7, top_k=20, top_p=0.8),  # Qwen2.5's
    dict(temperature=0.2, top_p=0.9),  # SmolLM2's card
    dict(temperature=1.3, top_p=0.99),
    dict(temperature=0.5, top_k=3),
    dict(temperature=1.0, top_k=1500, top_p=0.9),  # a top-k past the candidates
    dict(temperature=0.9),  # every token kept
    dict(temperature=0.8, top_k=1),
]


def _dense_draws(sampler_raw: torch.Tensor, reqs: list[Request], u: torch.Tensor) -> list[int]:
    """The reference draw: `process`'s whole rows (the filters, checked against HF's above), softmax, and the
    inverse CDF over the whole vocabulary at each row's uniform."""
    processed = Sampler((EOS,), seed=0).process(sampler_raw, reqs)
    return sample_inverse_cdf(torch.softmax(processed, dim=-1), u).tolist()


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0], ids=["flat", "peaked", "sharp"])
@pytest.mark.parametrize("vocab", [300, 5000, 70000])
def test_candidate_draws_equal_whole_row_draws(scale: float, vocab: int) -> None:
    """A step draws sampled rows among their top candidates (`draw_from_candidates`) where their kept set lies
    there, the others from their whole row: each row's token equals the whole-row draw at the same uniform, for
    uniforms across [0, 1) including its ends, with ties at the k-th logit (rounded logits) as well."""
    gen = torch.Generator().manual_seed(vocab + int(scale * 10))
    reqs = [_request(SamplingParams(**kw), rid=str(i)) for i, kw in enumerate(_DRAW_PARAMS)]
    rows = len(reqs)
    for rounded in (False, True):
        raw = torch.randn(rows, vocab, generator=gen) * scale
        if rounded:
            raw = raw.mul(2).round().div(2)  # many equal logits: ties at every rank
        for trial in range(6):
            u = torch.rand(rows, generator=gen, dtype=torch.float64)
            if trial == 0:
                u[: rows // 2], u[rows // 2 :] = 0.0, 1.0 - 2**-53
            sampler = Sampler((EOS,), seed=0)
            sampler._uniforms = lambda requests, u=u: u.clone()  # the draws' uniforms, given
            got = sampler(raw, reqs).token_ids
            assert got == _dense_draws(raw, reqs, u), (rounded, trial)


def test_candidate_draws_cover_what_they_can_and_only_that() -> None:
    """Which rows the candidates decide: a top-k row with its k + 1 largest (not when its k-th ties past them), a
    peaked top-p row, a flat one only with enough candidates; never a row that keeps every token."""
    vocab = 5000
    gen = torch.Generator().manual_seed(3)
    peaked, flat = torch.randn(vocab, generator=gen) * 8, torch.randn(vocab, generator=gen) * 0.1
    tied = peaked.clone()
    top = tied.topk(100).indices
    tied[top[3:100]] = tied[top[3]].item()  # the 4th to 100th largest equal: past FEW_CANDIDATES
    x = torch.stack([peaked, tied, peaked, flat, flat, peaked])
    temperature = torch.ones(6)
    top_k = torch.tensor([4, 4, vocab, vocab, vocab, vocab])
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.9, 0.3, 1.0])
    u = torch.full((6,), 0.5, dtype=torch.float64)
    _, covered = draw_from_candidates(x, temperature, top_k, top_p, u, FEW_CANDIDATES)
    assert covered.tolist() == [True, False, True, False, False, False]
    _, covered = draw_from_candidates(x, temperature, top_k, top_p, u, vocab)
    assert covered.tolist() == [True] * 6  # the whole vocabulary: every row's kept set is among them
    assert draw_from_candidates(x.new_full((1, vocab), float("-inf")), temperature[:1], None, top_p[2:3], u[:1], 8)[
        1
    ].tolist() == [False]  # nothing finite: for the whole-row path, which gives NO_TOKEN


@pytest.mark.parametrize(
    "params",
    [
        dict(temperature=0.8, top_p=0.5, presence_penalty=1.0, repetition_penalty=1.5, logprobs=3, min_tokens=5),
        dict(temperature=0.0, min_tokens=5, stop_token_ids=(7, 7, 9)),  # the masked greedy path, a repeated id
        dict(temperature=0.0, min_tokens=5),  # ... masking EOS alone
    ],
    ids=["full path", "greedy below min_tokens", "greedy below min_tokens, EOS alone"],
)
def test_does_not_modify_its_input(params: dict) -> None:
    raw = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    raw[:, EOS] = 50.0  # masked, and would win otherwise
    before = raw.clone()
    reqs = [_request(SamplingParams(**params), output=[1, 2, EOS]) for _ in range(3)]
    out = Sampler((EOS,), seed=0)(raw, reqs)
    assert torch.equal(raw, before)
    assert EOS not in out.token_ids


def test_a_batch_with_nothing_to_adjust_is_read_in_place_and_left_as_it_was() -> None:
    """Without a constraint, bias, min_tokens or penalty the logits are not copied: the draws and logprobs read
    them, and neither `process` nor a step writes into them."""
    raw = torch.randn(4, 3000, generator=torch.Generator().manual_seed(5)) * 3
    before = raw.clone()
    reqs = [_request(SamplingParams(temperature=0.9, top_k=5, top_p=0.9, logprobs=2)) for _ in range(4)]
    out = Sampler((EOS,), seed=0)(raw, reqs)
    processed = Sampler((EOS,), seed=0).process(raw, reqs)
    assert torch.equal(raw, before)
    for i, token in enumerate(out.token_ids):
        assert token in raw[i].topk(5).indices.tolist() and torch.isfinite(processed[i, token])
        assert out.logprobs[i] is not None and out.logprobs[i].token_id == token


def test_fast_path_greedy_is_argmax_and_returns_python_ints() -> None:
    raw = torch.randn(16, 1000, generator=torch.Generator().manual_seed(1))
    out = Sampler((EOS,))(raw, [_request(SamplingParams(temperature=0.0)) for _ in range(16)])
    assert out.token_ids == raw.argmax(-1).tolist()
    assert all(type(t) is int for t in out.token_ids)
    assert out.logprobs == [None] * 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_is_torch_argmax_with_ties_and_specials(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    raw = torch.randn(12, 49152, generator=gen).mul(3).round().to(dtype)  # rounded: many ties for the maximum
    raw[1, 100] = raw[1, 40000] = raw[1].max() + 1  # a tie at the top, far apart
    raw[2, :] = float("-inf")
    raw[3, 7] = float("inf")
    raw[4, 9000] = float("nan")
    raw[5, :] = raw[5, 0]  # a constant row
    assert argmax(raw).tolist() == raw.argmax(dim=-1).tolist()
    assert argmax(raw)[1] == 100
    # The sampler's list form (NumPy's argmax for float32 on the CPU), also on a strided view.
    assert argmax_list(raw) == raw.argmax(dim=-1).tolist()
    assert argmax_list(raw[::2, 1::3]) == raw[::2, 1::3].argmax(dim=-1).tolist()
    assert all(type(t) is int for t in argmax_list(raw))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_greedy_path_matches_the_cpu_one_in_one_copy(dtype: torch.dtype) -> None:
    """On a GPU plain-greedy rows go through `greedy_one_copy` (argmax and finiteness copied together); it runs on
    any device, so it is checked here against the CPU path's two steps."""
    raw = torch.randn(6, 3000, generator=torch.Generator().manual_seed(4)).mul(3).round().to(dtype)
    raw[1, 17], raw[3, 0], raw[4, 2999] = float("nan"), float("inf"), float("-inf")
    finite = raw.isfinite().all(-1).tolist()
    expected = [t if ok else NON_FINITE for t, ok in zip(raw.float().argmax(-1).tolist(), finite, strict=True)]
    assert greedy_one_copy(raw) == expected
    assert expected[1] == expected[3] == expected[4] == NON_FINITE and expected[0] >= 0


_PATHS = {  # every row of the batch takes this path of the sampler
    "plain greedy": dict(temperature=0.0),
    "greedy below min_tokens": dict(temperature=0.0, min_tokens=5),
    "full": dict(temperature=0.8, top_p=0.9, repetition_penalty=1.2, frequency_penalty=0.3, logprobs=2, seed=11),
}


@pytest.mark.parametrize("path", _PATHS)
def test_rows_with_non_finite_logits_are_not_sampled_and_do_not_change_the_others(path: str) -> None:
    raw = torch.randn(5, 300, generator=torch.Generator().manual_seed(3))
    bad = raw.clone()
    bad[1, 17], bad[3, 0], bad[4, 299] = float("nan"), float("inf"), float("-inf")
    params = SamplingParams(**_PATHS[path])
    out = Sampler((EOS,), seed=0)(bad, [_request(params, output=[1, 2]) for _ in range(5)])
    assert [out.token_ids[i] for i in (1, 3, 4)] == [NON_FINITE] * 3
    assert [out.logprobs[i] for i in (1, 3, 4)] == [None] * 3
    alone = Sampler((EOS,), seed=0)(raw[[0, 2]], [_request(params, output=[1, 2]) for _ in range(2)])
    assert [out.token_ids[0], out.token_ids[2]] == alone.token_ids
    assert [out.logprobs[0], out.logprobs[2]] == alone.logprobs


def test_greedy_with_penalties_is_argmax_of_penalised_logits() -> None:
    raw = torch.zeros(2, 10)
    raw[:, 4], raw[:, 8] = 2.0, 1.9  # token 4 wins unless penalised
    reqs = [
        _request(SamplingParams(temperature=0.0, repetition_penalty=1.2), prompt=[4]),
        _request(SamplingParams(temperature=0.0, frequency_penalty=0.2), output=[4]),
    ]
    out = Sampler((EOS,))(raw, reqs)
    assert out.token_ids == [8, 8]
    assert all(type(t) is int for t in out.token_ids)


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    vocab = 50
    raw = torch.randn(2, vocab, generator=torch.Generator().manual_seed(2))
    prompt, output = [1, 2, 9, 9], [9, 9, 9, 4, 7, 4]
    reqs = [
        _request(
            SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.3), prompt=prompt, output=output
        ),
        _request(
            SamplingParams(temperature=0.0, presence_penalty=-0.5, frequency_penalty=1.5), prompt=prompt, output=output
        ),
    ]
    processed = Sampler((EOS,)).process(raw, reqs)
    counts = Counter(output)
    for row, (presence, frequency) in enumerate([(0.7, 0.3), (-0.5, 1.5)]):
        expected = raw[row].clone()
        for token in range(vocab):  # prompt-only tokens (1, 2) are not penalised
            n = counts[token]
            expected[token] -= presence * (n > 0) + frequency * n
        torch.testing.assert_close(processed[row], expected, rtol=0, atol=1e-6)
        assert torch.equal(processed[row, [1, 2]], raw[row, [1, 2]])


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_tokens_masks_eos_and_stop_token_ids(ignore_eos: bool) -> None:
    raw = torch.zeros(4, 20)
    raw[:, EOS], raw[:, 11], raw[:, 12] = 30.0, 29.0, 28.0  # EOS, then the stop token id, then 12
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(11,), ignore_eos=ignore_eos),
        SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=(11,), ignore_eos=ignore_eos, seed=1),
    ]
    below = [_request(p, output=[5, 6]) for p in params]  # 2 < min_tokens
    reached = [_request(p, output=[5, 6, 7]) for p in params]
    sampler = Sampler((EOS,), seed=0)
    processed = sampler.process(raw, below + reached)
    assert torch.isinf(processed[:2, [EOS, 11]]).all() and torch.isfinite(processed[2:]).all()
    assert sampler(raw, below + reached).token_ids == [12, 12, EOS, EOS]


@pytest.mark.parametrize("with_sampled_row", [False, True])  # all greedy: the masked-argmax path; else the full one
def test_greedy_min_tokens_rows_take_the_masked_argmax_or_no_token(with_sampled_row: bool) -> None:
    vocab = 6
    raw = torch.randn(3, vocab, generator=torch.Generator().manual_seed(5))
    raw[:, EOS] = 50.0
    every_token = tuple(t for t in range(vocab) if t != EOS)
    reqs = [
        _request(SamplingParams(temperature=0.0, min_tokens=2), output=[1]),  # below: EOS masked
        _request(SamplingParams(temperature=0.0, min_tokens=2), output=[1, 1]),  # reached: EOS wins
        _request(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=every_token), output=[1]),
    ]
    if with_sampled_row:
        reqs.append(_request(SamplingParams(temperature=1.0, seed=3), output=[1]))
        raw = torch.cat([raw, torch.randn(1, vocab)])
    out = Sampler((EOS,), seed=0)(raw, reqs).token_ids
    masked = raw[0].clone()
    masked[EOS] = float("-inf")
    assert out[:3] == [int(masked.argmax()), EOS, NO_TOKEN]


def test_rows_that_all_mask_eos_alone_take_the_argmax_without_it() -> None:
    eos = (EOS, 0, 10_000)  # an id past the vocabulary is ignored
    raw = torch.randn(4, 50, generator=torch.Generator().manual_seed(6))
    raw[:, EOS], raw[1, 0] = 50.0, 60.0  # both EOS ids would win
    out = Sampler(eos)(raw, [_request(SamplingParams(temperature=0.0, min_tokens=3), output=[1]) for _ in range(4)])
    masked = raw.clone()
    masked[:, [EOS, 0]] = float("-inf")
    assert out.token_ids == masked.argmax(dim=-1).tolist()
    tiny = torch.randn(2, 2)  # every token is an EOS: nothing to give
    out = Sampler((0, 1))(tiny, [_request(SamplingParams(temperature=0.0, min_tokens=3)) for _ in range(2)])
    assert out.token_ids == [NO_TOKEN, NO_TOKEN]


def test_logprobs_come_from_raw_logits_with_sorted_top() -> None:
    raw = torch.randn(4, 200, generator=torch.Generator().manual_seed(3)) * 3
    reqs = [
        _request(SamplingParams(temperature=0.7, top_p=0.5, repetition_penalty=1.5, logprobs=5, seed=4), output=[1, 2]),
        _request(SamplingParams(temperature=0.0, logprobs=0)),
        _request(SamplingParams(temperature=1.0)),
        _request(SamplingParams(temperature=0.0, frequency_penalty=2.0, logprobs=20), output=[7]),
    ]
    out = Sampler((EOS,), seed=0)(raw, reqs)
    reference = torch.log_softmax(raw, dim=-1)
    assert out.logprobs[2] is None
    for row, k in [(0, 5), (1, 0), (3, 20)]:
        lp = out.logprobs[row]
        assert lp is not None and lp.token_id == out.token_ids[row]
        assert lp.logprob == pytest.approx(reference[row, out.token_ids[row]].item(), abs=1e-6)
        values, ids = reference[row].topk(k)
        assert [t for t, _ in lp.top] == ids.tolist()
        assert [v for _, v in lp.top] == pytest.approx(values.tolist(), abs=1e-6)
        assert all(a[1] >= b[1] for a, b in zip(lp.top, lp.top[1:], strict=False))
        assert all(type(t) is int and type(v) is float for t, v in lp.top)


def _draw_steps(sampler: Sampler, batch: list[Request], steps: int, row: int) -> list[int]:
    """Sample `steps` tokens for every request in `batch`; return those of `batch[row]`."""
    gen = torch.Generator().manual_seed(5)
    tokens = []
    for _ in range(steps):
        raw = torch.randn(len(batch), 500, generator=gen)
        raw[row] = torch.linspace(-1.0, 1.0, 500)  # the watched request's logits do not depend on the batch
        out = sampler(raw, batch)
        tokens.append(out.token_ids[row])
        for req, token in zip(batch, out.token_ids, strict=True):
            req.output_token_ids.append(token)
    return tokens


def test_seeded_request_draws_the_same_tokens_alone_or_in_any_batch() -> None:
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=400, seed=42)
    alone = _draw_steps(Sampler((EOS,)), [_request(params)], 25, 0)
    for position in (1, 3):
        others = [_request(SamplingParams(temperature=1.0, seed=7 + i)) for i in range(2)]
        others += [_request(SamplingParams(temperature=0.0)), _request(SamplingParams(temperature=0.5))]
        batch = others[:position] + [_request(params)] + others[position:]
        assert _draw_steps(Sampler((EOS,)), batch, 25, position) == alone
    other_seed = _draw_steps(
        Sampler((EOS,)), [_request(SamplingParams(temperature=0.9, top_p=0.95, top_k=400, seed=43))], 25, 0
    )
    assert other_seed != alone
    assert len(set(alone)) > 10  # it really samples


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    def run(seed: int) -> list[int]:
        return _draw_steps(Sampler((EOS,), seed=seed), [_request(SamplingParams()) for _ in range(3)], 10, 1)

    assert run(0) == run(0)
    assert run(0) != run(1)


def _chi_square(counts: Counter[int], expected: list[float], draws: int) -> float:
    return sum((counts[t] - draws * p) ** 2 / (draws * p) for t, p in enumerate(expected) if p > 0)


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_fit_the_distribution(seeded: bool) -> None:
    probs = [0.5, 0.2, 0.15, 0.1, 0.05]
    draws = 4000
    raw = torch.tensor(probs).log()[None].expand(draws, -1)
    cases = [  # (params, the distribution it must draw from, computed by hand)
        (dict(temperature=1.0), probs),
        (dict(temperature=0.5), [p * p / sum(q * q for q in probs) for p in probs]),
        (dict(temperature=1.0, top_p=0.8), [0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85, 0.0, 0.0]),
        (dict(temperature=1.0, top_k=2), [0.5 / 0.7, 0.2 / 0.7, 0.0, 0.0, 0.0]),
    ]
    for kw, expected in cases:
        reqs = [_request(SamplingParams(**kw, seed=i if seeded else None)) for i in range(draws)]
        counts = Counter(Sampler((EOS,), seed=11)(raw, reqs).token_ids)
        assert all(counts[t] == 0 for t, p in enumerate(expected) if p == 0), (kw, counts)
        dof = sum(p > 0 for p in expected) - 1
        # chi-square with <= 4 degrees of freedom: P(stat > 35) < 1e-6, so this never flakes, while a
        # 2-point shift in one probability gives a statistic in the hundreds.
        assert _chi_square(counts, expected, draws) < 35, (kw, counts, dof)
        assert math.isclose(sum(counts.values()), draws)


def _bitmask_of(allowed: set[int], vocab: int) -> torch.Tensor:
    """The int32 bitmask row [ceil(vocab / 32)] allowing `allowed`, written bit by bit (bit 31 is the sign bit)."""
    words = [0] * -(-vocab // 32)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)


class _Allowed:
    """A TokenConstraint allowing a fixed set of tokens (never finished)."""

    def __init__(self, allowed: set[int], vocab: int) -> None:
        self.row = _bitmask_of(allowed, vocab)

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        bitmask.copy_(self.row)

    def advance(self, token_id: int) -> None:
        pass

    def is_finished(self) -> bool:
        return False


@pytest.mark.parametrize("vocab", [31, 32, 100, 4097])
def test_unpack_bitmask_reads_each_token_bit(vocab: int) -> None:
    rng = torch.Generator().manual_seed(vocab)
    sets = [set(torch.randperm(vocab, generator=rng)[: vocab // 3].tolist()), {vocab - 1, 0}, set(range(31, vocab, 32))]
    bitmask = torch.stack([_bitmask_of(s, vocab) for s in sets])
    unpacked = unpack_bitmask(bitmask, vocab)
    assert unpacked.shape == (3, vocab) and unpacked.dtype == torch.bool
    for row, allowed in zip(unpacked, sets, strict=True):
        assert set(row.nonzero().squeeze(1).tolist()) == allowed


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_rows_sample_allowed_tokens_and_leave_the_others_alone(temperature: float) -> None:
    vocab = 200
    raw = torch.randn(5, vocab, generator=torch.Generator().manual_seed(8))
    allowed = {3 + 7 * i for i in range(20)}  # EOS among them
    reqs = [
        _request(SamplingParams(temperature=0.0)),
        _request(SamplingParams(temperature=temperature, seed=1, constraint=lambda: _Allowed(allowed, vocab))),
        _request(SamplingParams(temperature=0.0, logprobs=2)),
        _request(SamplingParams(temperature=temperature, seed=2, constraint=lambda: _Allowed(set(), vocab))),
        _request(SamplingParams(temperature=0.0, min_tokens=4, constraint=lambda: _Allowed({EOS}, vocab))),
    ]
    assert not any(r.sampling_params.plain_greedy for r in reqs[1::2])
    before = raw.clone()
    out = Sampler((EOS,), seed=0)(raw, reqs)
    assert torch.equal(raw, before)
    assert out.token_ids[0] == int(raw[0].argmax()) and out.token_ids[2] == int(raw[2].argmax())
    assert out.token_ids[1] in allowed
    if temperature == 0.0:
        assert out.token_ids[1] == max(allowed, key=lambda t: raw[1, t].item())
    assert out.token_ids[3] == NO_TOKEN  # the mask leaves nothing
    # Below min_tokens, a constraint that allows only EOS (its grammar is complete) still gets EOS: min_tokens masks
    # EOS only in rows without a constraint.
    assert out.token_ids[4] == EOS
    assert out.logprobs[2] is not None and out.logprobs[2].token_id == out.token_ids[2]


def test_logit_bias_is_added_before_penalties_and_temperature() -> None:
    vocab = 300
    raw = torch.randn(4, vocab, generator=torch.Generator().manual_seed(9))
    bias = ((5, 100.0), (17, -100.0), (int(raw[1].argmax()), -3.5), (299, 0.25))
    params = [
        SamplingParams(temperature=0.0, logit_bias=bias),
        SamplingParams(temperature=0.7, top_k=40, repetition_penalty=1.3, logit_bias=bias),
        SamplingParams(temperature=0.0),  # no bias: untouched in the same batch
        SamplingParams(temperature=0.0, logit_bias=((int(raw[3].argmax()), -100.0),)),
    ]
    reqs = [_request(p, prompt=[5, 6, 7], output=[17, 299]) for p in params]
    biased = raw.clone()
    for row in (0, 1):
        for token_id, value in bias:
            biased[row, token_id] += value
    biased[3, int(raw[3].argmax())] -= 100.0
    processed = Sampler((EOS,), seed=0).process(raw, reqs)
    assert torch.equal(processed[0], biased[0]) and torch.equal(processed[2], raw[2])
    expected = _hf_reference(biased[1], reqs[1])  # HF's processors on the biased logits
    assert torch.equal(torch.isfinite(processed[1]), torch.isfinite(expected))
    torch.testing.assert_close(processed[1].softmax(-1), expected.softmax(-1), rtol=1e-5, atol=1e-7)
    out = Sampler((EOS,), seed=0)(raw, reqs)
    assert out.token_ids[0] == 5 and out.token_ids[2] == int(raw[2].argmax())
    assert out.token_ids[3] == int(biased[3].argmax()) != int(raw[3].argmax())


@pytest.mark.parametrize(
    "params,message",
    [
        (dict(logit_bias=((5, 100.5),)), "logit_bias"),
        (dict(logit_bias=((5, float("nan")),)), "logit_bias"),
        (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
        (dict(logit_bias=((5, 1.0), (5, 2.0))), "logit_bias"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=0, prompt_logprobs=21), "prompt_logprobs"),
        (dict(prompt_logprobs=-1), "prompt_logprobs"),
    ],
)
def test_new_fields_are_validated_naming_the_field(params: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params).validate()


def test_scoring_a_prompt_is_valid_and_a_bias_leaves_the_plain_greedy_path() -> None:
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
    SamplingParams(logit_bias=((5, -100.0), (6, 100.0)), prompt_logprobs=20).validate()
    assert SamplingParams(temperature=0.0, prompt_logprobs=3).plain_greedy  # prompt logprobs do not sample
    assert not SamplingParams(temperature=0.0, logit_bias=((5, 1.0),)).plain_greedy
