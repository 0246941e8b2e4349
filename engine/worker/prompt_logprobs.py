"""Prompt logprobs: for a request that asks (`SamplingParams.prompt_logprobs = k`), each prompt token's
log-probability given the tokens before it, plus the top k, from the raw logits in fp32.

The logits at prompt position q score the token at q + 1, so a chunk computing positions [start, end) of a
prompt of n tokens scores tokens start + 1 .. min(end, n - 1); position n - 1's logits give the first output
token instead (the sampler's). Only the chunk rows of requests that ask go through the LM head here, and only
positions they have not recorded yet (a chunk computed again after a preemption by recompute is not scored
twice); every other row costs nothing. The head runs on at most `PIECE_ROWS` rows at a time, bounding the
[rows, vocab] logits a long prompt chunk would otherwise materialise at once. Every row's logits get its own request's
LM-head LoRA where its adapter has one (`HeadLora`), as the sampled rows' do.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from engine.core.request import Request, TokenLogprob

PIECE_ROWS = 128  # rows through the LM head at once: 128 x 49,152 fp32 logits (SmolLM2) is 24 MiB
# (logits [P, vocab], their hidden states [P, hidden], each row's request by batch index): adds each row's LM-head
# LoRA to its logits in place (engine/lora/vocab_lora.py VocabStep.head, through the runner's slots)
HeadLora = Callable[[torch.Tensor, torch.Tensor, list[int]], None]


class PromptChunk(NamedTuple):
    """Prompt positions [start, end) of the request at `batch_index` (the runner's batch order), whose hidden
    states are the step's rows row, row + 1, ...: their logits score prompt tokens start + 1 .. end."""

    batch_index: int
    row: int
    start: int
    end: int


def plan_chunk(request: Request, index: int, row: int, start: int, end: int) -> PromptChunk | None:
    """The positions of [start, end) (computed at rows row, row + 1, ...) whose logits score a prompt token the
    request has not recorded yet; None if there are none."""
    first = max(start, len(request.prompt_logprobs) - 1)  # entry p comes from position p - 1
    last = min(end, len(request.prompt_token_ids) - 1)
    return PromptChunk(index, row + first - start, first, last) if first < last else None


def score_prompt_chunks(
    hidden: torch.Tensor,
    lm_head: Callable[[torch.Tensor], torch.Tensor],
    requests: Sequence[Request],
    chunks: Sequence[PromptChunk],
    head_lora: HeadLora | None = None,
) -> tuple[dict[int, tuple[int, list[TokenLogprob]]], list[int]]:
    """The chunks' prompt logprobs, and the requests (by index) whose logits were not finite (not recorded).

    Semantics, per chunk c of request r (k = r.sampling_params.prompt_logprobs):
        logits = lm_head(hidden[c.row : c.row + c.end - c.start])  # plus r's LM-head LoRA (`head_lora`), if any
        logprobs = log_softmax(logits.float(), -1)  # [P, V]
        entry for prompt token q + 1 (q in [c.start, c.end)): its logprob, and logprobs[q].topk(k)
    Shapes: hidden [T, hidden] (the step's final-normed states). Returns {c.batch_index: (c.start + 1, entries)}.
    """
    rows: list[int] = []
    targets: list[int] = []
    owners: list[int] = []  # each row's request, by batch index
    for c in chunks:
        rows.extend(range(c.row, c.row + c.end - c.start))
        targets.extend(requests[c.batch_index].prompt_token_ids[c.start + 1 : c.end + 1])
        owners.extend([c.batch_index] * (c.end - c.start))
    max_k = max(requests[c.batch_index].sampling_params.prompt_logprobs or 0 for c in chunks)
    chosen: list[float] = []
    top_values: list[list[float]] = []
    top_ids: list[list[int]] = []
    device = hidden.device
    for lo in range(0, len(rows), PIECE_ROWS):
        index = torch.tensor(rows[lo : lo + PIECE_ROWS], device=device)
        piece = hidden.index_select(0, index)
        logits = lm_head(piece)
        if head_lora is not None:
            head_lora(logits, piece, owners[lo : lo + PIECE_ROWS])
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [P, V]
        target = torch.tensor(targets[lo : lo + PIECE_ROWS], device=device)
        chosen += logprobs.gather(1, target[:, None]).squeeze(1).tolist()
        if max_k:
            values, ids = logprobs.topk(max_k, dim=-1)  # [P, max_k], best first
            top_values += values.tolist()
            top_ids += ids.tolist()
    scored: dict[int, tuple[int, list[TokenLogprob]]] = {}
    failed: list[int] = []
    at = 0
    for c in chunks:
        n = c.end - c.start
        k = requests[c.batch_index].sampling_params.prompt_logprobs or 0
        row_values = chosen[at : at + n]
        if not all(map(math.isfinite, row_values)):
            failed.append(c.batch_index)
        else:
            scored[c.batch_index] = (
                c.start + 1,
                [
                    TokenLogprob(
                        targets[at + j],
                        row_values[j],
                        tuple(zip(top_ids[at + j][:k], top_values[at + j][:k], strict=True)) if k else (),
                    )
                    for j in range(n)
                ],
            )
        at += n
    return scored, failed
