"""One generation request and its sampling parameters.

A `Request` is the single object that carries a sequence through the engine: its prompt and output
tokens, how many of them already have K/V in the cache (`num_computed_tokens`), its KV blocks, priority,
sampling parameters and status. The scheduler decides, the runner computes, and only
`Scheduler.update_from_output` changes a request's tokens or status.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from loragate_common.prefix import PromptChunks
from loragate_common.priority import Priority

if TYPE_CHECKING:
    from engine.lora.peft_config import AdapterSpec


# Bounds that keep every sampling step finite in float32 (logits of a few hundred at most): a temperature
# of 1e39 is inf in float32 and a repetition penalty of 1e-39 divides logits into inf, and either turns a
# row into NaN probabilities. NaN compares false, so the checks below also refuse it.
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound: -100 bans a token in practice, +100 makes it the only choice
MAX_LOGPROBS = 20  # top alternatives per token, for sampled and prompt tokens alike


class TokenConstraint(Protocol):
    """Which tokens one request may produce next; one object per request, advanced on each accepted token.

    The engine calls `fill_bitmask` for the request's row each time it samples for it, `advance` once for each
    token it appends to the request's output (never again for the same token: preemption keeps the output and
    the state), and ends the request ("stop") as soon as `is_finished`."""

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        """bitmask: int32 CPU tensor [ceil(vocab / 32)] (one row, zeros on entry); bit j of word i set = token
        32*i + j allowed (the llguidance / xgrammar layout)."""

    def advance(self, token_id: int) -> None:
        """The token sampled for the request (always one `fill_bitmask` allowed)."""

    def is_finished(self) -> bool:
        """The grammar is complete: the request finishes with "stop"."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Per-request sampling parameters (OpenAI's plus the vLLM extras). Validated at the edge."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # in (0, 1]
    top_k: int | None = None  # None: no top-k filter
    seed: int | None = None  # None: not reproducible
    stop: tuple[str, ...] = ()  # cut before the first occurrence; never returned
    stop_token_ids: tuple[int, ...] = ()  # finish after emitting one of these (not returned as text)
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids are suppressed before this many outputs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # HF/vLLM style, applied over prompt and output tokens
    logprobs: int | None = None  # None: off; k >= 0: the sampled token's logprob plus the top k
    skip_special_tokens: bool = True
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    # None: off; k >= 0: each prompt token's logprob (the first has none) plus the top k, from the raw logits
    prompt_logprobs: int | None = None
    # Makes the request's TokenConstraint (one per request: it holds the grammar's state); None: unconstrained.
    constraint: Callable[[], TokenConstraint] | None = field(default=None, compare=False)
    # Derived: greedy, no logprobs, no penalties, no bias, no constraint: the token is the argmax of the raw logits,
    # with EOS and the stop ids masked below min_tokens (the sampler's fast paths test this per row every step).
    plain_greedy: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "plain_greedy",
            (
                self.temperature == 0.0
                and self.logprobs is None
                and self.repetition_penalty == 1.0
                and self.presence_penalty == 0.0
                and self.frequency_penalty == 0.0
                and not self.logit_bias
                and self.constraint is None
            ),
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        """Raise ValueError naming the field if a value is out of range."""
        if self.max_tokens < 0 or (self.max_tokens == 0 and self.prompt_logprobs is None):
            raise ValueError("max_tokens must be at least 1 (0 only to score the prompt, with prompt logprobs)")
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(f"temperature must be in [0, {MAX_TEMPERATURE:g}]")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError("top_k must be >= 1 (or -1/null to disable)")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must be between 0 and max_tokens")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError("presence_penalty must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("frequency_penalty must be in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}]")
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        self._validate_logit_bias()

    def _validate_logit_bias(self) -> None:
        """Token ids non-negative and given once, biases finite in [-100, 100] (the engine checks ids < vocab)."""
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if token_id < 0:
                raise ValueError(f"logit_bias: token id {token_id} must be >= 0")
            if token_id in seen:
                raise ValueError(f"logit_bias: token id {token_id} is given twice")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise ValueError(f"logit_bias: the bias of token {token_id} must be in [-100, 100]")
            seen.add(token_id)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context length reached
    FINISHED_ABORTED = "abort"  # the client went away or the request was cancelled
    FINISHED_ERROR = "error"  # this request could not be computed (its adapter, or a failing step)

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.RUNNING and self is not RequestStatus.WAITING


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The sampled token's log-probability and the top alternatives, from the raw model logits."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token_id, logprob), best first


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: Priority = Priority.STANDARD
    # The adapter version this request runs with, fixed when it arrives (a reload does not change it).
    adapter: AdapterSpec | None = None
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    # Tokens whose K/V are in the cache. Invariant: 0 <= num_computed_tokens <= num_tokens.
    num_computed_tokens: int = 0
    # KV cache blocks in order; block i holds positions [i*block_size, (i+1)*block_size).
    block_ids: list[int] = field(default_factory=list)
    # Per-request RNG so a seeded request samples the same tokens whatever else is in the batch.
    generator: torch.Generator | None = None
    # Host copy of the KV blocks of a request preempted by swapping; restored on re-admission.
    swapped_kv: torch.Tensor | None = None
    first_scheduled_time: float | None = None  # when it first got tokens computed (queue time)
    # The class it runs at, for preemption: its own, or the one aging lifted it to by its admission.
    run_class: int = -1
    # Which tokens it may produce next (made from sampling_params.constraint); advanced by the scheduler on each
    # token it appends, so preemption (which keeps the output) keeps its state.
    constraint: TokenConstraint | None = None
    # With sampling_params.prompt_logprobs: entry p is prompt token p's logprob given the tokens before it (entry 0,
    # with nothing before it, is None), filled as the prompt is computed; each position is recorded once. Empty
    # for requests that did not ask.
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    error: str | None = None  # why the scheduler finished it with FINISHED_ERROR (its constraint failed)
    # The gateway's chunk hashes of its prompt (X-Loragate-Prefix), a routing hint only: the prefix cache reports
    # which of them it still holds (KVCacheManager.held_prefixes). None: not sent, or malformed.
    prefix_chunks: PromptChunks | None = None

    def __post_init__(self) -> None:
        params = self.sampling_params
        if self.run_class < 0:
            self.run_class = int(self.priority)
        if params.seed is not None and not params.greedy:
            self.generator = torch.Generator().manual_seed(params.seed)
        if self.constraint is None and params.constraint is not None:
            self.constraint = params.constraint()
        if params.prompt_logprobs is not None and not self.prompt_logprobs:
            self.prompt_logprobs.append(None)

    @property
    def adapter_id(self) -> str | None:
        return None if self.adapter is None else self.adapter.adapter_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + outputs, without copying the whole sequence."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt logprobs and some prompt positions are not recorded yet: it must compute them
        itself (no cached prefix blocks)."""
        return 0 < len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished
