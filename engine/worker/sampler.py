"""Turn one step's logits into one next token per request (vLLM / OpenAI sampling conventions).

Per row, in order: logprobs are taken from the raw logits; then the request's logit_bias is added and its
constraint masks the tokens its grammar does not allow (engine/worker/token_masks.py); min_tokens masks EOS
(unless the row has a constraint: its grammar allows EOS only when complete) and the stop token ids; then the
repetition penalty (HF: over prompt + output tokens), then presence / frequency penalties (OpenAI: over output
tokens); greedy rows take the argmax, the others are divided by the temperature, filtered by top-k then top-p
and drawn from the softmax.

Penalties read token tables (`TokenTables`: per row, how often each token occurs in the output and which
tokens were seen at all) instead of the requests' token lists: the engine keeps them up to date across steps
in its persistent batch (engine/worker/input_batch.py); without one they are built from the lists.

A seeded request draws its own uniform from `request.generator`, so it samples the same tokens whatever
else shares the batch; every other row draws from the sampler's shared generator. The draw itself is an
inverse-CDF lookup batched over rows, so the per-row Python loop only produces one float per row. A sampled row
whose top-k / top-p set lies among its largest logits is drawn there (`draw_from_candidates`: the same token as over
its whole row, without a pass per [rows, vocab] tensor), the others over their whole row;
`python bench/sampling.py` measures both.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.request import Request, SamplingParams, TokenLogprob
from engine.worker.token_masks import apply_logit_bias, constrained_copy
from loragate_kernels.backends import Kernel
from loragate_kernels.cpu.ops import greedy_rows_cpu

_NEG_INF = float("-inf")
# Top-p looks for the nucleus among this many most likely tokens before falling back to a full sort.
_CANDIDATES = 1024
# A sampled row is drawn among its FEW_CANDIDATES largest logits (or its top-k and one more), then among
# _CANDIDATES, before its whole row (`Sampler._draw`): a top-k of 1,024 costs ~5x one of 64 (32 rows, SmolLM2's
# 49,152-token vocabulary: 7.1 against 1.5 ms), and a peaked row's nucleus is usually a few tokens.
FEW_CANDIDATES = 64
# Passes over whole rows run on blocks of rows of at most this many bytes: glibc maps a block above its mmap
# threshold (32 MiB at most) fresh from the kernel each time, and faulting 32 MiB in cost ~10 ms (32 rows of Gemma
# 3's 262,144-token vocabulary: exp(x / T - top).sum() took 37 ms at once, ~9 in blocks).
_BLOCK_BYTES = 8 << 20
NO_TOKEN = -1  # the token id of a row that has none to sample
NON_FINITE = -2  # the token id of a row whose logits are not all finite (it is not sampled)


@dataclass(frozen=True, slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[TokenLogprob | None]  # per row; None where the request asked for none


class TokenTables(Protocol):
    """Per-row token statistics for penalties; `index` picks rows of the batch being sampled."""

    def output_counts(self, index: list[int]) -> torch.Tensor: ...  # [R, V] float32: occurrences in the output

    def seen(self, index: list[int]) -> torch.Tensor: ...  # [R, V] bool: in the prompt or the output


class ListTables:
    """TokenTables built from the requests' token lists (for a batch with no persistent state)."""

    def __init__(self, requests: Sequence[Request], vocab: int, device: torch.device) -> None:
        self.requests, self.vocab, self.device = requests, vocab, device

    def output_counts(self, index: list[int]) -> torch.Tensor:
        counts = torch.zeros(len(index), self.vocab, device=self.device)
        for j, i in enumerate(index):
            ids = self.requests[i].output_token_ids
            if ids:
                counts[j].index_put_(
                    (torch.tensor(ids, device=self.device),), torch.ones(len(ids), device=self.device), accumulate=True
                )
        return counts

    def seen(self, index: list[int]) -> torch.Tensor:
        seen = torch.zeros(len(index), self.vocab, dtype=torch.bool, device=self.device)
        for j, i in enumerate(index):
            seen[j, torch.tensor(self.requests[i].all_token_ids, dtype=torch.int64, device=self.device)] = True
        return seen


def _is_plain_greedy(request: Request) -> bool:
    """True when the row's token is just the argmax of its raw logits."""
    p = request.sampling_params
    return p.plain_greedy and len(request.output_token_ids) >= p.min_tokens


def _mask_eos_alone(requests: Sequence[Request]) -> bool:
    """True when every row is below its min_tokens with no stop ids: min_tokens masks EOS alone (W1's rows)."""
    return all(
        r.num_output_tokens < r.sampling_params.min_tokens and not r.sampling_params.stop_token_ids for r in requests
    )


class Sampler:
    def __init__(
        self, eos_token_ids: tuple[int, ...], *, greedy: Kernel = Kernel.TORCH, seed: int | None = None
    ) -> None:
        """`greedy`: the sampler seam's route (loragate_kernels/backends.py `Backends.sampler`): CPP picks greedy rows
        on loragate_kernels/cpu/sampling.cpp, TORCH with torch ops (the twin)."""
        self.eos_token_ids = tuple(eos_token_ids)
        self.greedy_cpp = greedy is Kernel.CPP
        self._eos_index: dict[tuple[int, torch.device], torch.Tensor] = {}
        # Shared by every row without its own generator. Unseeded: a fresh random seed per sampler, so
        # unseeded requests do not repeat the same draws after each restart.
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, requests: Sequence[Request], tables: TokenTables | None = None
    ) -> SamplerOutput:
        """Sample one token per row. logits: [B, V], row i belongs to requests[i]; `tables` (row i of the batch
        is index i) give the penalties their token statistics (default: built from the token lists).

        A row whose logits are not all finite (a broken adapter, an overflow) is not sampled: its token is
        NON_FINITE. A row left with no finite logit after masking (its constraint, or min_tokens and
        stop_token_ids, masking everything) has no token to give: NO_TOKEN. The caller fails those requests
        instead of inventing a token. Rows with a logit_bias or a constraint take the full path.
        """
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (logits.shape, len(requests))
        plain = all(map(_is_plain_greedy, requests))
        if plain and logits.device.type != "cpu":  # one wait for the device, not two
            return SamplerOutput(greedy_one_copy(logits), [None] * len(requests))
        greedy = all(r.sampling_params.plain_greedy for r in requests)
        if greedy:
            picked = self._greedy_cpp(logits, requests)
            if picked is not None:
                return SamplerOutput(picked, [None] * len(requests))
        ok = finite_rows(logits)  # [B]
        if plain:
            # Hot path: one batched argmax, no copies.
            return SamplerOutput(_unless_finite(ok, argmax_list(logits)), [None] * len(requests))
        if greedy:
            # Greedy rows that only need EOS and stop ids masked (min_tokens): the same, after one masked write.
            return SamplerOutput(self._greedy_masked(logits, requests, ok), [None] * len(requests))
        if all(ok):
            return self._sample(logits, requests, tables)
        token_ids: list[int] = [NON_FINITE] * len(requests)
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        good = [i for i, row_ok in enumerate(ok) if row_ok]
        if good:
            part = self._sample(
                logits[good], [requests[i] for i in good], None if tables is None else RowTables(tables, good)
            )
            for j, i in enumerate(good):
                token_ids[i], logprobs[i] = part.token_ids[j], part.logprobs[j]
        return SamplerOutput(token_ids, logprobs)

    def _sample(self, logits: torch.Tensor, requests: Sequence[Request], tables: TokenTables | None) -> SamplerOutput:
        """The full path (penalties, temperature, top-k/top-p, logprobs) for rows whose logits are finite."""
        raw = logits.float()
        adjusted = self._adjust(raw, requests, tables)  # [B, V]
        token_ids = self._draw(adjusted, requests).clamp_(0, adjusted.shape[1] - 1)  # [B]
        # Every token masked: the draw's token is -inf too (a drawn token has a probability > 0 if any has).
        empty = ~torch.isfinite(adjusted.gather(1, token_ids[:, None]).squeeze(1))  # [B]
        if bool(empty.any()):
            token_ids = token_ids.masked_fill(empty, NO_TOKEN)
        logprobs = _logprobs(raw, token_ids.clamp(min=0), requests)
        return SamplerOutput(token_ids.tolist(), logprobs)

    def process(
        self, logits: torch.Tensor, requests: Sequence[Request], tables: TokenTables | None = None
    ) -> torch.Tensor:
        """The logits each row is drawn from; does not modify its input.

        Shapes: logits [B, V] -> [B, V] float32. Greedy rows are masked and penalised but not scaled or
        filtered (their token is the argmax); sampled rows are also divided by the temperature and have
        -inf outside their top-k / top-p set, so softmax(row) is the row's sampling distribution. A step does not
        build this whole: it draws sampled rows from their top candidates (`draw_from_candidates`).
        """
        out = self._adjust(logits, requests, tables)
        if out is logits:
            out = out.clone()
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if rows:
            index = torch.tensor(rows, device=out.device)
            out[index] = _filtered(out[index], [requests[i].sampling_params for i in rows])
        return out

    def _adjust(self, logits: torch.Tensor, requests: Sequence[Request], tables: TokenTables | None) -> torch.Tensor:
        """A float32 copy of `logits` [B, V] with every row's constraint, logit_bias, min_tokens mask and penalties
        applied: a greedy row's final logits, a sampled row's before its temperature and top-k / top-p. Where none
        applies to any row, float32 `logits` itself (a copy is 32 MiB at 32 rows of Gemma 3's vocabulary)."""
        if not any(map(_adjusts, requests)):
            return logits.float()
        out = constrained_copy(logits.float(), requests)  # [B, V]
        apply_logit_bias(out, requests)
        self._mask_below_min_tokens(out, requests)
        if tables is None:
            tables = ListTables(requests, out.shape[1], out.device)
        _apply_repetition_penalty(out, requests, tables)
        _apply_presence_frequency_penalties(out, requests, tables)
        return out

    def _banned(self, requests: Sequence[Request], vocab: int) -> tuple[list[int], list[int]]:
        """(rows, token ids) masked by min_tokens: EOS and the stop token ids of rows below their min_tokens. A row
        with a constraint keeps EOS: its grammar allows EOS only once complete, and then nothing else may follow."""
        rows: list[int] = []
        cols: list[int] = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if r.num_output_tokens < p.min_tokens:
                stops = p.stop_token_ids if r.constraint is not None else self.eos_token_ids + p.stop_token_ids
                banned = [t for t in stops if 0 <= t < vocab]
                rows += [i] * len(banned)
                cols += banned
        return rows, cols

    def _mask_below_min_tokens(self, logits: torch.Tensor, requests: Sequence[Request]) -> None:
        """EOS and the stop token ids get -inf in rows that have not reached min_tokens (one write for all)."""
        rows, cols = self._banned(requests, logits.shape[1])
        if rows:
            logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = _NEG_INF

    def _greedy_cpp(self, logits: torch.Tensor, requests: Sequence[Request]) -> list[int] | None:
        """Greedy rows' tokens in one pass of loragate_kernels/cpu/sampling.cpp (argmax, finiteness and the EOS mask of
        min_tokens together), where the CPU's C++ ops run and every row is plain or masks EOS alone (W1's rows);
        None otherwise. The same tokens as the torch path below (`finite_rows`, `argmax_list`, `_greedy_masked`)."""
        if not self.greedy_cpp or logits.device.type != "cpu":
            return None
        banned = self.argmax_bans(requests, logits.shape[1], logits.device)
        if banned is None:
            return None
        return greedy_rows_cpu(logits, banned, NON_FINITE, NO_TOKEN)

    def argmax_bans(self, requests: Sequence[Request], vocab: int, device: torch.device) -> torch.Tensor | None:
        """[n] int64 token ids, the same for every row, when each row's token is the first maximal raw logit outside
        them (plain greedy rows: none; greedy rows whose min_tokens masks EOS alone: the EOS ids); None otherwise."""
        if not all(r.sampling_params.plain_greedy for r in requests):
            return None
        if all(map(_is_plain_greedy, requests)):
            return torch.empty(0, dtype=torch.long, device=device)
        if _mask_eos_alone(requests):
            return self._eos_columns(vocab, device)
        return None

    def _greedy_masked(self, logits: torch.Tensor, requests: Sequence[Request], finite: list[bool]) -> list[int]:
        """Argmax per row after the min_tokens mask; NON_FINITE for a row whose logits are not all finite, NO_TOKEN
        for a row whose every token is masked. The mask is written into `logits` and the entries put back after:
        a copy of the whole batch would cost a third of the argmax (32 rows of a 49,152-token vocabulary)."""
        vocab = logits.shape[1]
        eos_only = _mask_eos_alone(requests)  # one column index for all rows
        if eos_only:
            index: tuple[torch.Tensor | slice, torch.Tensor] = (slice(None), self._eos_columns(vocab, logits.device))
        else:
            rows, cols = self._banned(requests, vocab)
            index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
        kept = logits[index]  # the masked entries, put back afterwards: no copy of the whole batch
        logits[index] = _NEG_INF
        try:
            token_ids = _unless_finite(finite, argmax_list(logits))
        finally:
            logits[index] = kept
        if eos_only:
            if index[1].numel() >= vocab:  # every token is an EOS
                token_ids = [t if t == NON_FINITE else NO_TOKEN for t in token_ids]
        elif len(set(cols)) >= vocab:  # a row may have lost every token
            for i in set(rows):
                if token_ids[i] != NON_FINITE and len({c for r, c in zip(rows, cols, strict=True) if r == i}) >= vocab:
                    token_ids[i] = NO_TOKEN
        return token_ids

    def _eos_columns(self, vocab: int, device: torch.device) -> torch.Tensor:
        """The EOS ids within the vocabulary, as an index tensor (made once per vocabulary size and device)."""
        key = (vocab, device)
        if key not in self._eos_index:
            self._eos_index[key] = torch.tensor(
                [t for t in self.eos_token_ids if 0 <= t < vocab], dtype=torch.long, device=device
            )
        return self._eos_index[key]

    def _draw(self, adjusted: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """adjusted: [B, V] from `_adjust`. Returns [B] int64 token ids: a greedy row's argmax, a sampled row's draw
        from softmax(`process`'s row), by the inverse CDF at the row's uniform (`sample_inverse_cdf`). Rows whose
        kept set lies among their top candidates are drawn there (`draw_from_candidates`), the others from their
        whole filtered row."""
        rows = [i for i, r in enumerate(requests) if not r.sampling_params.greedy]
        if len(rows) < len(requests):
            token_ids = argmax(adjusted)  # [B]; the answer for greedy rows
        else:
            token_ids = torch.zeros(len(requests), dtype=torch.int64, device=adjusted.device)
        if not rows:
            return token_ids
        index = torch.tensor(rows, device=adjusted.device)
        x = adjusted if len(rows) == len(requests) else adjusted[index]  # [S, V]
        params = [requests[i].sampling_params for i in rows]
        u = self._uniforms([requests[i] for i in rows]).to(adjusted.device)  # [S]
        vocab = x.shape[1]
        temperature, top_k, top_p = _filter_tensors(params, vocab, x.device)
        drawn = torch.zeros(len(rows), dtype=torch.int64, device=x.device)
        # the rows not drawn yet; rows without top-k or top-p keep every token: no candidates can hold them
        filtering = [(p.top_k or vocab) < vocab or p.top_p < 1.0 for p in params]
        rest = torch.tensor([i for i, f in enumerate(filtering) if f], dtype=torch.int64, device=x.device)  # [R]
        every_k = max((p.top_k or vocab for p in params), default=vocab)  # below vocab where every row has a top-k
        first = every_k + 1 if every_k < _CANDIDATES else FEW_CANDIDATES
        for num in sorted({min(vocab, first), min(vocab, _CANDIDATES)}) if rest.numel() else []:
            sub = x if len(rest) == len(rows) else x[rest]
            got, covered = draw_from_candidates(
                sub,
                temperature[rest],
                None if top_k is None else top_k[rest],
                None if top_p is None else top_p[rest],
                u[rest],
                num,
            )
            drawn[rest[covered]] = got[covered]
            rest = rest[~covered]
            if rest.numel() == 0:
                break
        # kept sets reaching past the candidates, and rows without filters: from the whole filtered row, in blocks
        # of rows (the CDF is float64: twice the logits' bytes)
        dense = sorted(set(rest.tolist()) | {i for i, f in enumerate(filtering) if not f})
        step = max(1, _BLOCK_BYTES // (8 * vocab))
        for lo in range(0, len(dense), step):
            block = dense[lo : lo + step]
            filtered = _filtered(x[block], [params[i] for i in block])
            drawn[block] = sample_inverse_cdf(torch.softmax(filtered, dim=-1), u[block])
        token_ids[index] = drawn
        return token_ids

    def _uniforms(self, requests: Sequence[Request]) -> torch.Tensor:
        """One U[0, 1) float64 per row: from the row's own generator if seeded, else the shared one."""
        u = torch.empty(len(requests), dtype=torch.float64)
        shared = [i for i, r in enumerate(requests) if r.generator is None]
        if shared:
            u[shared] = torch.rand(len(shared), generator=self._generator, dtype=torch.float64)
        for i, r in enumerate(requests):
            if r.generator is not None:
                u[i] = torch.rand((), generator=r.generator, dtype=torch.float64)
        return u


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] int64: the first index of each row's maximum, as `argmax(dim=-1)`, which it is (both return
    the first maximal index). `max(dim).indices` is vectorised on CPU where argmax is not: about 3x faster for
    a 49,152-token vocabulary (SmolLM2's), 2.2 -> 0.7 ms for 32 rows, measured with torch 2.13 on one thread; float32
    on the CPU goes through NumPy's argmax, faster still (`argmax_list`)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=1))
    return logits.max(dim=-1).indices


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """[B, V] -> per row, whether all its logits are finite. A row's sum is finite exactly when all its logits
    are (they are far below overflow). Checked in Python: at a few rows, every tensor op costs more than the
    check itself."""
    return list(map(math.isfinite, logits.sum(dim=-1).tolist()))


def argmax_list(logits: torch.Tensor) -> list[int]:
    """[B, V] -> each row's first maximal index, as a list. Float32 logits on the CPU are reduced by NumPy's
    argmax on a view of their memory: it is vectorised and called without the dispatcher, 32 rows x 49,152
    (SmolLM2's vocabulary) in 0.23 ms where `max(dim)` takes 0.73 (torch 2.13, NumPy 2.4, one thread). (NumPy's
    row sum is no faster than torch's inside the step loop, so `finite_rows` stays with torch.)"""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(axis=1).tolist()
    return argmax(logits).tolist()


def greedy_one_copy(logits: torch.Tensor) -> list[int]:
    """[B, V] -> each row's first maximal index, NON_FINITE where its logits are not all finite: computed on the
    logits' device and copied to the host at once (on a GPU each copy waits for the step to finish, and this is
    the step's only wait)."""
    packed = torch.stack((argmax(logits), torch.isfinite(logits.sum(dim=-1)).long()))  # [2, B]
    token_ids, finite = packed.tolist()
    return _unless_finite([bool(f) for f in finite], token_ids)


def _unless_finite(finite: list[bool], token_ids: list[int]) -> list[int]:
    """The token ids, NON_FINITE where the row's logits were not all finite."""
    return token_ids if all(finite) else [t if ok else NON_FINITE for t, ok in zip(token_ids, finite, strict=True)]


class RowTables:
    """`tables` seen through a list of its rows: index i here is row `rows[i]` there (a subset of a batch, or the
    persistent batch's rows of the requests being sampled, engine/worker/input_batch.py)."""

    def __init__(self, tables: TokenTables, rows: list[int]) -> None:
        self.tables, self.rows = tables, rows

    def output_counts(self, index: list[int]) -> torch.Tensor:
        return self.tables.output_counts([self.rows[i] for i in index])

    def seen(self, index: list[int]) -> torch.Tensor:
        return self.tables.seen([self.rows[i] for i in index])


def _adjusts(request: Request) -> bool:
    """Whether `Sampler._adjust` changes the request's row: a constraint, a logit_bias, min_tokens still masking,
    or a penalty."""
    p = request.sampling_params
    return bool(
        request.constraint is not None
        or p.logit_bias
        or request.num_output_tokens < p.min_tokens
        or p.repetition_penalty != 1.0
        or (request.output_token_ids and (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0))
    )


def _filter_tensors(
    params: Sequence[SamplingParams], vocab: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Sampled rows' temperature [S] float32, top-k [S] int64 in [1, vocab] (vocab: none; None where no row has
    one) and top-p [S] float32 (None where no row has one below 1)."""
    temperature = torch.tensor([p.temperature for p in params], device=device)
    top_k = top_p = None
    if any(p.top_k is not None for p in params):
        top_k = torch.tensor([min(p.top_k or vocab, vocab) for p in params], device=device)
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device)
    return temperature, top_k, top_p


def _filtered(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Sampled rows [S, V] divided by their temperature, with -inf outside their top-k / top-p set."""
    temperature, top_k, top_p = _filter_tensors(params, x.shape[1], x.device)
    return apply_top_k_top_p(x / temperature[:, None], top_k, top_p)


def draw_from_candidates(
    x: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    u: torch.Tensor,
    num: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled rows drawn among their largest logits, where their top-k / top-p set lies within them.

    A step of 32 rows over Gemma 3's 262,144-token vocabulary at its model card's top-k 64 and top-p 0.95 took
    ~240 ms on two cores the dense way (`_filtered`, a softmax over the row and a CDF over the whole vocabulary,
    each a new [S, V] tensor), more than the step's forward pass; most rows keep a few dozen tokens. Here each row's
    `num` largest logits are found in one pass, the filters run on them alone, and the draw is over the kept ones in
    token-id order: the same inverse CDF at the same uniform as `sample_inverse_cdf` over `process`'s row (whose
    other entries have probability 0), the weights left unnormalised (the CDF's last entry is the total). A row
    with top-p and no top-k reads its whole row once more, for the total its nucleus takes its mass from.

    Semantics, per row: covered = (the row's top logit is finite) and (no candidate the filters keep has the last
    candidate's value, or the candidates are the whole vocabulary: `_reaches_last`); if covered, token = the draw
    described above, equal to
    `sample_inverse_cdf(softmax(process's row), u)` up to the rounding of the weights' sum. Rows not covered are
    for the caller to draw from their whole row.
    Shapes: x [S, V] float32 (`_adjust`'s rows), temperature [S] > 0, top_k [S] int64 in [1, V] (V: none) or None,
    top_p [S] or None, u [S] float64 in [0, 1), 1 <= num <= V (a top-k row needs k + 1 to be covered: a tie with
    its k-th logit reaching past the candidates shows there). Returns (token ids [S] int64, covered [S] bool).
    """
    vocab = x.shape[1]
    has_k = None if top_k is None else top_k < vocab  # [S]
    values, ids = _by_value_then_id(*x.topk(num, dim=-1))  # [S, num]
    scaled = values / temperature[:, None]  # as `_filtered`: x / T is monotone in x, so these are its top `num`
    top = scaled[:, :1]  # [S, 1]
    keep = torch.isfinite(scaled)  # [S, num]
    exps = torch.exp(scaled - top)  # [S, num]: unnormalised probabilities
    covered = torch.isfinite(top.squeeze(1))  # [S]
    if top_k is not None and has_k is not None:
        kth = scaled.gather(1, (top_k.clamp(max=num) - 1)[:, None])  # [S, 1]
        keep &= ~has_k[:, None] | (scaled >= kth)
        if num < vocab:  # a top-k set reaching the last candidate (k past them, or ties) may reach past it
            covered &= ~has_k | ~keep[:, -1]
    if top_p is not None:
        # the mass of the kept set: among the candidates where a top-k keeps it there, else over the whole row
        total = torch.where(keep, exps, 0.0).sum(dim=-1)  # [S]
        whole = torch.arange(len(x), device=x.device) if has_k is None else (~has_k).nonzero().squeeze(1)
        step = max(1, _BLOCK_BYTES // (4 * vocab))
        for lo in range(0, whole.numel(), step):
            block = whole[lo : lo + step]
            scaled_rows = x.index_select(0, block).div_(temperature[block, None]).sub_(top[block])  # a copy, in place
            # e^x below e^-87 is subnormal or 0, and computing it took ~10x as long a value (a peaked row at a low
            # temperature is mostly such values); the term that is 1 keeps them from changing the sum's bits
            total[block] = scaled_rows.clamp_(min=-87.0).exp_().sum(dim=-1)
        probs = (exps / total[:, None]).double().masked_fill(~keep, 0.0)  # [S, num]
        keep &= _in_nucleus(probs, top_p)
    if num < vocab:  # a kept set reaching the last candidate's value may reach past it
        covered &= ~_reaches_last(keep, scaled)
    weights = torch.where(keep, exps, 0.0)  # [S, num]
    by_id, order = ids.sort(dim=-1)  # the CDF runs in token-id order, as over the whole row
    token_ids = by_id.gather(1, sample_inverse_cdf(weights.gather(1, order), u).clamp(max=num - 1)[:, None])
    return token_ids.squeeze(1), covered


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Set to -inf every logit outside the row's top-k, then outside its top-p nucleus.

    Semantics (per row, HF TopKLogitsWarper then TopPLogitsWarper):
        keep = logits >= logits.topk(k).values[-1]                   # ties with the k-th are kept
        probs = softmax(logits masked to keep), sorted descending
        keep only tokens whose probability mass above them is < p    # smallest set with mass >= p
    Shapes: logits [B, V] float; top_k [B] int64 in [1, V] (V: no filter) or None;
    top_p [B] float in (0, 1] or None. Returns a new [B, V] tensor.
    """
    if top_k is None and top_p is None:
        return logits
    kth = _kth_largest(logits, top_k)  # [B, 1]
    if top_p is None:
        return logits.masked_fill(logits < kth, _NEG_INF)
    # A full sort of the vocabulary is slow on CPU, and the nucleus is usually small: look for it among
    # the top candidates first; rows whose nucleus (or top-k set) reaches past them are sorted in full.
    masked = logits if top_k is None else logits.masked_fill(logits < kth, _NEG_INF)  # [B, V]
    num = min(logits.shape[1], _CANDIDATES)
    values, ids = _by_value_then_id(*masked.topk(num, dim=-1))  # [B, num]
    top = values[:, :1]  # [B, 1]
    total = torch.exp(masked - top).sum(dim=-1, keepdim=True)  # [B, 1]
    probs = (torch.exp(values - top) / total).double()  # [B, num]
    keep = (values > _NEG_INF) & _in_nucleus(probs, top_p)
    out = torch.full_like(logits, _NEG_INF).scatter_(1, ids, values.masked_fill(~keep, _NEG_INF))
    if num < logits.shape[1]:
        # A row whose kept set reaches its last candidate's value may reach past the candidates: sorted in full.
        rows = _reaches_last(keep, values).nonzero().squeeze(1)  # [U]
        if rows.numel() > 0:
            out[rows] = _top_p_sorted(masked[rows], top_p[rows])
    return out


def _kth_largest(logits: torch.Tensor, top_k: torch.Tensor | None) -> torch.Tensor:
    """[B, 1]: each row's k-th largest logit, or -inf where the row has no top-k (k == V or None)."""
    vocab = logits.shape[1]
    if top_k is None or bool((top_k >= vocab).all()):
        return torch.full((logits.shape[0], 1), _NEG_INF, device=logits.device, dtype=logits.dtype)
    max_k = int(top_k[top_k < vocab].max())
    values = logits.topk(max_k, dim=-1).values  # [B, max_k]
    kth = values.gather(1, (top_k.clamp(max=max_k) - 1)[:, None])  # [B, 1]
    return kth.masked_fill((top_k >= vocab)[:, None], _NEG_INF)


def _top_p_sorted(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Top-p by a full sort, as HF's TopPLogitsWarper: the tokens whose ascending cumulative mass is at most 1 - p
    are dropped. logits [R, V], top_p [R] -> [R, V]. Equal logits sort by token id, the lower nearer the top, as in
    `_by_value_then_id`."""
    vocab = logits.shape[1]
    sorted_logits, flipped = logits.flip(-1).sort(dim=-1, stable=True)  # ascending; ties: higher ids first
    order = vocab - 1 - flipped
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [R, V]
    drop = cum <= (1.0 - top_p)[:, None]
    drop[:, -1] = False  # always keep the most probable token
    return torch.empty_like(logits).scatter_(1, order, sorted_logits.masked_fill(drop, _NEG_INF))


def _reaches_last(keep: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """[R] bool: whether a row keeps a candidate whose value equals its last candidate's. Such a row's kept set may
    reach past its candidates: tokens of that value outside them, and which tied tokens `topk` took in is its own
    choice. keep, values [R, n] in `_by_value_then_id`'s order."""
    return (keep & (values == values[:, -1:])).any(dim=-1)


def _in_nucleus(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """[R, n] bool: whether each of a row's tokens, most probable first (`probs` float64 in that order), has less
    than the row's top-p of mass above it; the first always, and every one where top-p is 1 (the sum's rounding
    may reach 1 before the row's last token)."""
    keep = (probs.cumsum(dim=-1) - probs < top_p.double()[:, None]) | (top_p >= 1.0)[:, None]
    keep[:, 0] = True
    return keep


def _by_value_then_id(values: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`topk`'s output [R, n] reordered by value (descending), equal values by token id: top-p's cut falls among
    tied tokens the same way on every path (topk orders ties as it likes, and one vocabulary row of bf16 logits
    holds many ties)."""
    by_id, order = ids.sort(dim=-1)
    values, order = values.gather(1, order).sort(dim=-1, descending=True, stable=True)
    return values, by_id.gather(1, order)


def sample_inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Draw one index per row: the first j with cdf[j] > u * cdf[-1].

    Shapes: probs [S, V] (rows need not be normalised), u [S] float64 in [0, 1). Returns [S] int64.
    Never returns an index of zero probability: the found j has cdf[j-1] <= target < cdf[j]. The target
    is kept below the total, which u * total could round up to.
    """
    cdf = probs.double().cumsum(dim=-1)  # [S, V]
    total = cdf[:, -1]  # [S]
    target = torch.minimum(u.double() * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # [S]


def _apply_repetition_penalty(logits: torch.Tensor, requests: Sequence[Request], tables: TokenTables) -> None:
    """HF semantics, in place: for tokens seen in prompt or output, logit > 0 -> logit / p, else * p."""
    rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
    if not rows:
        return
    index = torch.tensor(rows, device=logits.device)
    penalty = torch.tensor([requests[i].sampling_params.repetition_penalty for i in rows], device=logits.device)[
        :, None
    ]  # [R, 1]
    x = logits.index_select(0, index)  # [R, V]
    penalised = torch.where(x > 0, x / penalty, x * penalty)
    logits[index] = torch.where(tables.seen(rows), penalised, x)


def _apply_presence_frequency_penalties(logits: torch.Tensor, requests: Sequence[Request], tables: TokenTables) -> None:
    """OpenAI semantics, in place, over output tokens: logit -= presence * (n > 0) + frequency * n."""
    rows = [
        i
        for i, r in enumerate(requests)
        if r.output_token_ids
        and (r.sampling_params.presence_penalty != 0.0 or r.sampling_params.frequency_penalty != 0.0)
    ]
    if not rows:
        return
    counts = tables.output_counts(rows)  # [R, V]
    params = [requests[i].sampling_params for i in rows]
    presence = torch.tensor([p.presence_penalty for p in params], device=logits.device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=logits.device)[:, None]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits.index_select(0, index) - (presence * (counts > 0) + frequency * counts)


def _logprobs(raw: torch.Tensor, token_ids: torch.Tensor, requests: Sequence[Request]) -> list[TokenLogprob | None]:
    """From the raw logits [B, V]: each asking row's sampled-token logprob and its top-k, best first."""
    result: list[TokenLogprob | None] = [None] * len(requests)
    asked = [r.sampling_params.logprobs for r in requests]  # top-k wanted per row, None: no logprobs
    rows = [i for i, k in enumerate(asked) if k is not None]
    ks = [k for k in asked if k is not None]
    if not rows:
        return result
    index = torch.tensor(rows, device=raw.device)
    logprobs = torch.log_softmax(raw[index], dim=-1)  # [R, V]
    chosen_ids = token_ids[index]  # [R]
    chosen = logprobs.gather(1, chosen_ids[:, None]).squeeze(1).tolist()
    top_value_t, top_id_t = logprobs.topk(max(ks), dim=-1)  # [R, max_k], sorted best first
    top_values, top_ids = top_value_t.tolist(), top_id_t.tolist()
    for j, (i, k) in enumerate(zip(rows, ks, strict=True)):
        top = tuple(zip(top_ids[j][:k], top_values[j][:k], strict=True))
        result[i] = TokenLogprob(token_id=int(chosen_ids[j]), logprob=chosen[j], top=top)
    return result
