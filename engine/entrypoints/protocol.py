"""The OpenAI wire format of requests: schemas (pydantic, validated at the edge) and sampling params.

Also the body of POST /v1/adapters (`LoadAdapterRequest`), whose `path` is hostile input: it must
resolve, symlinks included, to a directory inside the engine's --adapter-dir.

Requests are parsed strictly (a string is never coerced to a number) and unknown fields are ignored,
since OpenAI clients send extras. Fields we cannot honour without changing the answer (echo, best_of,
tools, a JSON response_format, ...) are rejected with an error that names them. `describe()` turns a
pydantic ValidationError into one "field: problem" line for the 400 body.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from engine.core.request import MAX_REPETITION_PENALTY, MAX_TEMPERATURE, MIN_REPETITION_PENALTY, SamplingParams
from engine.lora.files import resolve_inside
from engine.lora.peft_config import AdapterError, validate_adapter_id
from loragate.errors import bad_request

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
_TEMPERATURE_EPS = 1e-5  # below this sampling is greedy (as in vLLM): logits / ~0 overflow
_STRICT = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)
_MAX_PATH_CHARS = 4096
M = TypeVar("M", bound=BaseModel)


def _unsupported(message: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported", message)


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class _GenerationRequest(BaseModel):
    """The fields /v1/completions and /v1/chat/completions share."""

    model_config = _STRICT

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**64 - 1)  # torch.Generator's range
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: int | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    @field_validator("n")
    @classmethod
    def _one_choice(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _unsupported("only n=1 is supported")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _unsupported("best_of > 1 is not supported")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v:
            raise _unsupported("not supported")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k_off(cls, v: int | None) -> int | None:
        if v is not None and v < -1:
            raise PydanticCustomError("value_error", "must be -1 or 0 (off) or >= 1")
        return None if v in (-1, 0) else v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        params = SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < _TEMPERATURE_EPS else temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
        )
        params.validate()  # ValueError naming the field (e.g. min_tokens > max_tokens)
        return params


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
    logprobs: int | None = Field(default=None, ge=0, le=20)
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

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("not supported")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("not supported")
        return v

    def to_sampling_params(self, context_left: int) -> SamplingParams:
        """max_tokens defaults to 16 (OpenAI); `context_left` is unused here (see the chat request)."""
        del context_left
        max_tokens = COMPLETION_DEFAULT_MAX_TOKENS if self.max_tokens is None else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs)


class ContentPart(BaseModel):
    model_config = _STRICT
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = _STRICT
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, str]:
        """The {role, content} dict chat templates expect ("developer" is OpenAI's new "system")."""
        if isinstance(self.content, list):
            text = "".join(part.text for part in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    tool_choice: Any = None

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "text") != "text":
            raise _unsupported('only type "text" is supported')
        return v

    @field_validator("tools", "functions")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise _unsupported("tool calling is not supported")
        return v

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, v: Any) -> Any:
        if v not in (None, "none", "auto"):
            raise _unsupported("tool calling is not supported")
        return v

    def template_messages(self) -> list[dict[str, str]]:
        return [m.for_template() for m in self.messages]

    def to_sampling_params(self, context_left: int) -> SamplingParams:
        """max_tokens defaults to what is left of the context after the prompt (at least 1)."""
        max_tokens = self.max_completion_tokens or self.max_tokens or max(1, context_left)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


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
    return f"{''.join(parts) or 'body'}: {err['msg']}"


_FIELD_NAMES = frozenset().union(
    *(
        m.model_fields
        for m in (CompletionRequest, ChatCompletionRequest, ChatMessage, ContentPart, StreamOptions, LoadAdapterRequest)
    )
)
