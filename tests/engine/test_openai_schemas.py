"""Structured outputs end to end: a real `loragate engine` on tiny-random, driven by the official `openai` client.

Every answer to a `response_format` JSON schema must validate against it (`jsonschema`), across 60+ schemas
(nested objects, arrays, enums, required and optional properties, bounded numbers, string patterns, `$ref`s),
on the base model and with a PEFT adapter, streamed and not, and on an engine whose KV pool is so small that
requests are preempted while their grammars are half way. The client's `parse` helpers with a Pydantic model
parse what the engine answers. The model is random: only the grammar makes its output JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from lora_fixtures import make_peft_adapter
from processes import start_engine_server

MODEL = "tiny-random"
ADAPTER = "alpha"
MESSAGES: list[Any] = [{"role": "user", "content": "Describe a user as JSON."}]
MAX_TOKENS = 400  # far more than any schema below needs: an answer cut short fails the test

# ---- the schemas ---------------------------------------------------------------------------------------

# Leaf schemas; strings are bounded (a random model rarely closes an unbounded string) and so are arrays.
LEAVES: dict[str, dict[str, Any]] = {
    "int": {"type": "integer", "minimum": 0, "maximum": 100},
    "negative_int": {"type": "integer", "minimum": -50, "maximum": -1},
    "exclusive_int": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
    "bool": {"type": "boolean"},
    "null": {"type": "null"},
    "enum": {"enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": [1, "two", None, True]},
    "const": {"const": "fixed"},
    "short_string": {"type": "string", "maxLength": 6},
    "bounded_string": {"type": "string", "minLength": 2, "maxLength": 5},
    "code_pattern": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    "date_pattern": {"type": "string", "pattern": "^20[0-9]{2}-(0[1-9]|1[0-2])-[0-2][0-9]$"},
    "nullable_int": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    "int_or_word": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5}, {"enum": ["none", "many"]}]},
    "small_ints": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 2},
}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


def _schemas() -> dict[str, dict[str, Any]]:
    """Four shapes around every leaf (alone, beside an optional neighbour, nested, in an array), then a few more."""
    names = list(LEAVES)
    schemas: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(names):
        leaf, neighbour = LEAVES[name], LEAVES[names[(i + 1) % len(names)]]
        schemas[f"{name}"] = _object({"value": leaf})
        schemas[f"{name}+optional"] = _object({"value": leaf, "extra": neighbour}, required=["value"])
        schemas[f"{name}/nested"] = _object({"outer": _object({"inner": leaf, "flag": LEAVES["bool"]})})
        schemas[f"{name}[]"] = _object({"items": {"type": "array", "items": leaf, "minItems": 1, "maxItems": 2}})
    person = _object(
        {"name": LEAVES["bounded_string"], "age": LEAVES["int"], "email": LEAVES["short_string"]}, ["name", "age"]
    )
    schemas["person"] = person
    schemas["people"] = _object({"people": {"type": "array", "items": person, "maxItems": 2}})
    schemas["ref"] = {
        "$defs": {"point": _object({"x": LEAVES["int"], "y": LEAVES["negative_int"]})},
        **_object({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
    }
    schemas["deep"] = _object({"a": _object({"b": _object({"c": _object({"d": LEAVES["enum"]})})})})
    schemas["one_of_shapes"] = _object(
        {"shape": {"oneOf": [_object({"circle": LEAVES["int"]}), _object({"square": LEAVES["tags"]})]}}
    )
    schemas["top_level_array"] = {"type": "array", "items": LEAVES["enum"], "minItems": 1, "maxItems": 3}
    schemas["top_level_enum"] = LEAVES["mixed_enum"]
    schemas["tuple"] = _object(
        {"pair": {"type": "array", "prefixItems": [LEAVES["int"], LEAVES["enum"]], "items": False, "minItems": 2}}
    )
    schemas["all_optional"] = _object({"maybe": LEAVES["int"], "perhaps": LEAVES["bool"]}, required=[])
    return schemas


SCHEMAS = _schemas()
assert len(SCHEMAS) >= 50


def _response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": _wire_name(name), "schema": schema, "strict": True}}


def _wire_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name)


# ---- servers -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(tiny_model_dir, root / ADAPTER, r=8, alpha=16, targets=["q_proj", "v_proj"], seed=1, b_std=0.5)
    return root


def _serve(log: Path, adapter_root: Path, *extra: str) -> Iterator[str]:
    proc, base = start_engine_server(log, "--max-model-len", "512", "--adapter-dir", str(adapter_root), *extra)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapter_root: Path) -> Iterator[str]:
    yield from _serve(tmp_path_factory.mktemp("engine") / "engine.log", adapter_root)


@pytest.fixture(scope="module")
def small_pool_server(tmp_path_factory: pytest.TempPathFactory, adapter_root: Path) -> Iterator[str]:
    """1 MiB of pool: 64 blocks of 16 tokens (tiny-random's KV is 16 KiB a block), 1024 tokens for everyone."""
    log = tmp_path_factory.mktemp("engine-small") / "engine.log"
    yield from _serve(log, adapter_root, "--pool-mb", "1", "--preemption", "recompute")


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return _client(server)


# ---- helpers -------------------------------------------------------------------------------------------


def _ask(client: openai.OpenAI, name: str, *, adapter: str | None, stream: bool, **extra: Any) -> tuple[str, str]:
    """(content, finish_reason) of one schema's answer (greedy unless `extra` says otherwise)."""
    kwargs: dict[str, Any] = {
        "model": adapter or MODEL,
        "messages": MESSAGES,
        "response_format": _response_format(name, SCHEMAS[name]),
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        **extra,
    }
    if not stream:
        resp = client.chat.completions.create(**kwargs)
        return resp.choices[0].message.content or "", resp.choices[0].finish_reason
    content, finish = "", ""
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return content, finish


def _failures(names: list[str], ask: Callable[[str], tuple[str, str]]) -> dict[str, str]:
    """Ask every schema at once (the engine batches them); {schema: why its answer is wrong}."""
    with ThreadPoolExecutor(max_workers=8) as pool:
        answers = dict(zip(names, pool.map(ask, names), strict=True))
    failures = {}
    for name, (content, finish) in answers.items():
        try:
            assert finish == "stop", f"finish_reason {finish!r}"
            jsonschema.validate(json.loads(content), SCHEMAS[name])
        except (AssertionError, ValueError, jsonschema.ValidationError) as exc:
            failures[name] = f"{str(exc)[:200]} in {content[:200]!r}"
    return failures


def _preemptions(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "loragate_engine_preemptions_total"
    )


# ---- tests ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["base", "adapter"])
def test_every_answer_validates_against_its_schema(client: openai.OpenAI, adapter: str | None, stream: bool) -> None:
    assert _failures(list(SCHEMAS), lambda name: _ask(client, name, adapter=adapter, stream=stream)) == {}


def test_base_and_adapter_rows_in_one_batch_follow_their_own_schemas(client: openai.OpenAI) -> None:
    """Half the schemas on the base model, half with the adapter, all at once (mixed batches)."""
    names = list(SCHEMAS)

    def ask(name: str) -> tuple[str, str]:
        return _ask(client, name, adapter=ADAPTER if names.index(name) % 2 else None, stream=bool(len(name) % 2))

    assert _failures(names, ask) == {}


def test_schemas_hold_across_preemption(small_pool_server: str) -> None:
    """Long unconstrained requests fill the pool while the schema requests run: the engine preempts (sheddable
    first), and every preempted grammar resumes where it was."""
    client = _client(small_pool_server)
    before = _preemptions(small_pool_server)
    filler = dict(model=MODEL, prompt="The quick brown fox", max_tokens=300, temperature=0)

    def fill(i: int) -> None:
        client.completions.create(**filler, extra_body={"ignore_eos": True})

    def ask(name: str) -> tuple[str, str]:
        i = list(SCHEMAS).index(name)
        return _ask(
            client,
            name,
            adapter=ADAPTER if i % 2 else None,
            stream=bool(i % 3 == 0),
            extra_headers={"X-Priority": "sheddable"},
        )

    with ThreadPoolExecutor(max_workers=6) as pool:
        fillers = [pool.submit(fill, i) for i in range(6)]
        failures = _failures(list(SCHEMAS), ask)
        for f in fillers:
            f.result()
    assert failures == {}
    assert _preemptions(small_pool_server) > before


def test_json_object_gives_an_object(client: openai.OpenAI) -> None:
    for stream in (False, True):
        kwargs: dict[str, Any] = dict(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_object"},
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        if stream:
            content = "".join(
                c.choices[0].delta.content or ""
                for c in client.chat.completions.create(stream=True, **kwargs)
                if c.choices
            )
        else:
            content = client.chat.completions.create(**kwargs).choices[0].message.content or ""
        assert isinstance(json.loads(content), dict), content


def test_completions_take_a_response_format_too(server: str) -> None:
    for name in ("person", "ref", "code_pattern[]", "top_level_array"):
        body = {
            "model": MODEL,
            "prompt": "JSON:",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "response_format": _response_format(name, SCHEMAS[name]),
        }
        resp = httpx.post(f"{server}/v1/completions", json=body, timeout=120)
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["finish_reason"] == "stop"
        jsonschema.validate(json.loads(choice["text"]), SCHEMAS[name])


def test_a_seeded_sampled_answer_validates_too(client: openai.OpenAI) -> None:
    names = ["person", "people", "deep", "one_of_shapes", "date_pattern/nested"]
    failures = _failures(names, lambda n: _ask(client, n, adapter=None, stream=False, temperature=1.0, seed=3))
    assert failures == {}


# ---- the client's parse helpers with Pydantic models ------------------------------------------------------


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class User(BaseModel):
    name: str = Field(min_length=1, max_length=6)
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["x", "y"]] = Field(max_length=2)
    address: Address


@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["base", "adapter"])
def test_parse_helper_returns_the_pydantic_model(client: openai.OpenAI, adapter: str | None) -> None:
    completion = client.chat.completions.parse(
        model=adapter or MODEL, messages=MESSAGES, response_format=User, temperature=0, max_tokens=MAX_TOKENS
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, User), message.content
    assert User.model_validate_json(message.content or "") == message.parsed


def test_stream_helper_parses_the_pydantic_model(client: openai.OpenAI) -> None:
    with client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, response_format=User, temperature=0, max_tokens=MAX_TOKENS
    ) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, User)
    whole = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, response_format=User, temperature=0, max_tokens=MAX_TOKENS
    )
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed


def test_an_unconstrained_answer_is_not_json(client: openai.OpenAI) -> None:
    """The control: without the grammar tiny-random's answer is not valid JSON, so the tests above test it."""
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=40)
    with pytest.raises(ValueError):
        json.loads(resp.choices[0].message.content or "")
