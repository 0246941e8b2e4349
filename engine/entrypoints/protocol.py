"""The OpenAI wire format of requests: schemas (pydantic, validated at the edge) and sampling params.

Also the body of POST /v1/adapters (`LoadAdapterRequest`), whose `path` is hostile input: it must
resolve, symlinks included, to a directory inside the engine's --adapter-dir.

Requests are parsed strictly (a string is never coerced to a number) and unknown fields are ignored,
since OpenAI clients send extras. Fields we cannot honour without changing the answer (`suffix`, a `best_of`
other than `n`, the legacy `functions`) are rejected with an error that names them. `response_format`,
`tools` and `tool_choice` are checked by engine/entrypoints/guided.py, which also compiles them into a
grammar. `adapter_mix` follows loragate_common/adapter_mix.py's rules, the same as a mix named in `X-Adapter-ID`
or `model`. `describe()` turns a pydantic ValidationError into one "field: problem" line for the 400 body.

Sampling fields a request leaves unset (absent or null) take the model's defaults from its generation_config.json
(engine/model/generation.py, `--generation-config`), then the built-in ones; a value the request sets always wins.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from engine.core.request import (
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MIN_REPETITION_PENALTY,
    SamplingParams,
)
from engine.entrypoints.chat_messages import ChatMessage, ContentPart, MessageToolCall, ToolCallFunction
from engine.entrypoints.guided import (
    ConstraintFactory,
    FieldError,
    ResponseFormat,
    Tool,
    ToolChoice,
    ToolPlan,
    parse_response_format,
    parse_tool_choice,
    parse_tools,
    plan_tools,
)
from engine.lora.files import resolve_inside
from engine.lora.peft_config import AdapterError, validate_adapter_id
from engine.model.generation import NO_DEFAULTS, SamplingDefaults
from loragate_common.adapter_mix import BODY_FIELD, MixPart, mix_from_body
from loragate_common.errors import ApiError, bad_request, shown

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_N = 16  # choices per request; each is a sequence in the engine
_TEMPERATURE_EPS = 1e-5  # below this sampling is greedy (as in vLLM): logits / ~0 overflow
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_MAX_PATH_CHARS = 4096
M = TypeVar("M", bound=BaseModel)


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


def _parsed(parse: Callable[[object], Any], value: object) -> Any:
    """`parse(value)`, its FieldError as a pydantic error that `describe` writes as "field.sub.path: reason"."""
    try:
        return parse(value)
    except FieldError as exc:
        raise PydanticCustomError("at_path", "{reason}", {"reason": exc.reason, "path": exc.path}) from None


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only to score a prompt (completions, echo + logprobs)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: int | None = Field(default=None, ge=1)
    logit_bias: dict[str, float] | None = None
    response_format: ResponseFormat | None = None
    # a weighted mix of adapters, {"support-v3": 0.7, "legal-tone": 0.3} (loragate_common/adapter_mix.py)
    adapter_mix: tuple[MixPart, ...] | None = None
    # vLLM extras
    top_k: int | None = None  # -1 or 0: no top-k filter, whatever the model's default
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @field_validator("n", mode="before")
    @classmethod
    def _n_given(cls, v: object) -> object:
        return 1 if v is None else v  # null: the default

    @field_validator("logit_bias")
    @classmethod
    def _biases(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise PydanticCustomError(
                    "value_error", "keys must be token ids (digits), not {key}", {"key": shown(key)}
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise PydanticCustomError("value_error", "the bias of token {key} must be in [-100, 100]", {"key": key})
        return v

    @field_validator("response_format", mode="plain")
    @classmethod
    def _response_format(cls, v: object) -> ResponseFormat | None:
        return _parsed(parse_response_format, v)

    @field_validator("adapter_mix", mode="plain")
    @classmethod
    def _adapter_mix(cls, v: object) -> tuple[MixPart, ...] | None:
        if v is None:
            return None
        try:
            return mix_from_body(v)
        except ApiError as exc:  # the shared rules' message, without the field name `describe` puts first
            raise PydanticCustomError(
                "adapter_mix", "{reason}", {"reason": exc.message.removeprefix(f"{BODY_FIELD}: ")}
            ) from None

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise PydanticCustomError("value_error", "must be -1 or 0 (off) or >= 1")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _check_best_of(self) -> None:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(
                f"best_of: must equal n ({self.n}): generating best_of candidates and returning the n most likely "
                "is not supported; ask for n choices instead"
            )

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        constraint: ConstraintFactory | None,
        defaults: SamplingDefaults,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """A field the request leaves unset (absent or null) takes the model's default, else the built-in one."""
        self._check_best_of()
        temperature = _given(self.temperature, defaults.temperature, 1.0)
        top_k = defaults.top_k if self.top_k is None else self.top_k
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < _TEMPERATURE_EPS else temperature,
            top_p=_given(self.top_p, defaults.top_p, 1.0),
            top_k=None if top_k in (-1, 0) else top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=_given(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            # token ids below the vocabulary's size are checked by the engine (LLMEngine.check_request)
            logit_bias=tuple(sorted((int(key), bias) for key, bias in (self.logit_bias or {}).items())),
            prompt_logprobs=prompt_logprobs,
            constraint=constraint,
        )
        params.validate()  # ValueError naming the field (e.g. min_tokens > max_tokens)
        return params


def _given(value: float | None, default: float | None, builtin: float) -> float:
    return value if value is not None else default if default is not None else builtin


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _single_prompt(value: object) -> str | list[int] | None:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(_is_token_id(t) for t in value):
        return list(value)
    return None


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int]
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool | None = False
    suffix: str | None = None

    @field_validator("prompt", mode="plain")
    @classmethod
    def _one_prompt(cls, v: object) -> str | list[int]:
        prompt = _single_prompt(v)
        if prompt is None and isinstance(v, list) and len(v) == 1:
            prompt = _single_prompt(v[0])
        if prompt is None and isinstance(v, list) and len(v) > 1:
            if all(_single_prompt(p) is not None for p in v):
                raise _unsupported("batched prompts are not supported")
        if prompt is None:
            raise PydanticCustomError(
                "prompt_type", "must be a string, a list of token ids, or a list holding one of those"
            )
        if prompt == "":
            raise PydanticCustomError("value_error", "must not be empty")
        return prompt

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("not supported")
        return v

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: each prompt token's logprob is part of the answer."""
        return bool(self.echo) and self.logprobs is not None

    def to_sampling_params(
        self,
        context_left: int,
        constraint: ConstraintFactory | None = None,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        """max_tokens defaults to 16 (OpenAI; lowered to the model's max_new_tokens); 0 scores the prompt (echo +
        logprobs) without generating. `context_left` is unused here (see the chat request)."""
        del context_left
        max_tokens = self.max_tokens
        if max_tokens is None:
            max_tokens = defaults.max_tokens_within(COMPLETION_DEFAULT_MAX_TOKENS)
        if max_tokens == 0 and not self.scores_prompt:
            raise ValueError("max_tokens: 0 is only allowed with echo and logprobs (to score the prompt)")
        prompt_logprobs = self.logprobs if self.scores_prompt else None
        return self._sampling_params(max_tokens, self.logprobs, constraint, defaults, prompt_logprobs)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None

    @field_validator("tools", mode="plain")
    @classmethod
    def _tools(cls, v: object) -> tuple[Tool, ...]:
        return _parsed(parse_tools, v)

    @field_validator("tool_choice", mode="plain")
    @classmethod
    def _tool_choice(cls, v: object) -> ToolChoice | None:
        return _parsed(parse_tool_choice, v)

    @field_validator("functions")
    @classmethod
    def _no_functions(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise _unsupported("the legacy functions field is not supported; use tools")
        return v

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]

    def tool_plan(self) -> ToolPlan | None:
        """The tools this request uses (None: none), or ValueError naming the field."""
        parallel = self.parallel_tool_calls is not False
        return plan_tools(self.tools, self.tool_choice, parallel, self.response_format)

    def to_sampling_params(
        self,
        context_left: int,
        constraint: ConstraintFactory | None = None,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        """max_tokens defaults to what is left of the context after the prompt (at least 1; lowered to the model's
        max_new_tokens)."""
        if self.max_tokens == 0:
            raise ValueError("max_tokens: must be at least 1")
        max_tokens = self.max_completion_tokens or self.max_tokens or defaults.max_tokens_within(max(1, context_left))
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, constraint, defaults)


class LoadAdapterRequest(BaseModel):
    """POST /v1/adapters: register the PEFT LoRA directory `path` under `id` (again: a new version).

    `path` is relative to the engine's --adapter-dir (an absolute path must lie inside it too); without
    it, the subdirectory named like the id.
    """

    model_config = _STRICT
    id: str
    path: str | None = Field(default=None, min_length=1, max_length=_MAX_PATH_CHARS)

    @field_validator("id")
    @classmethod
    def _valid_id(cls, v: str) -> str:
        try:
            return validate_adapter_id(v)
        except AdapterError as exc:
            raise PydanticCustomError("adapter_id", str(exc)) from None

    def resolve_path(self, adapter_dir: Path) -> Path:
        """The real path (symlinks resolved) of the adapter directory, or AdapterError naming `path`."""
        return resolve_inside(adapter_dir, self.path if self.path is not None else self.id)


def parse_body(model: type[M], data: dict[str, Any]) -> M:
    """`data` validated as `model`, or a 400 naming the offending field."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise bad_request(describe(exc)) from None


def describe(exc: ValidationError) -> str:
    """One "field.path: problem" line for the most specific error (union branches are elided)."""
    errors = exc.errors(include_url=False)
    err = max(errors, key=lambda e: len(e["loc"]))  # max() keeps the first of equals
    parts: list[str] = []
    for item in err["loc"]:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif item in _FIELD_NAMES:
            parts.append(f".{item}" if parts else item)
    if err["type"] == "at_path":  # a FieldError inside the field (guided.py): its path continues the field's
        parts.append(err["ctx"]["path"])
    return f"{''.join(parts) or 'body'}: {err['msg']}"


_FIELD_NAMES = frozenset().union(
    *(
        m.model_fields
        for m in (
            CompletionRequest,
            ChatCompletionRequest,
            ChatMessage,
            ContentPart,
            MessageToolCall,
            ToolCallFunction,
            StreamOptions,
            LoadAdapterRequest,
        )
    )
)
