"""Sampling defaults from the model's generation_config.json (engine/model/generation.py, `--generation-config`).

End to end: two in-process engines on copies of tiny-random, one whose generation_config.json carries sampling
values (`auto`, the default) and one started with `none`, served over HTTP and driven by the official `openai`
client. A request that leaves a field unset samples with the file's value, and a seeded sampled answer of one
engine equals the other's where the request spells out what the other engine's defaults are; a value the request
sets always wins. Also: bad values refused at start naming the file and the key, the start-up log line, the flag,
and the defaults the smollm2 build writes.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from engine.config import EngineConfig
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import LLMEngine
from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest
from engine.entrypoints.server import build_app
from engine.model.generation import GENERATION_CONFIG, load_sampling_defaults, write_sampling_defaults
from engine.model.sources import SMOLLM2_SAMPLING
from loragate.cli import build_parser

from processes import REPO, serve_in_thread

NAME = "tiny"
PROMPT = "The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# top_k 1 makes every unset request greedy: its answer is the argmax path whatever the temperature.
FILE_VALUES = {"temperature": 0.7, "top_p": 0.9, "top_k": 1, "min_p": 0.05, "do_sample": True}
ANSWER: dict[str, Any] = {"max_tokens": 16, "extra_body": {"ignore_eos": True}}
SEEDS = (1, 2, 3)


def model_dir(root: Path, tiny_model_dir: Path, values: dict[str, Any]) -> Path:
    """A copy of tiny-random whose generation_config.json also holds `values` (its eos/bos ids kept)."""
    path = root / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / GENERATION_CONFIG).read_text())
    (path / GENERATION_CONFIG).write_text(json.dumps({**config, **values}))
    return path


def engine_config(model: Path, **changes: Any) -> EngineConfig:
    config = EngineConfig(model=str(model), dtype="float32", pool_mb=16, max_model_len=256, served_model_name=NAME)
    return replace(config, num_threads=1, warmup=False, **changes)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def start(config: EngineConfig) -> tuple[LLMEngine, list[str]]:
    """The engine, and what it logged while starting."""
    handler = Lines()
    logger = logging.getLogger("engine.core.llm_engine")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        return LLMEngine(config), handler.lines
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture(scope="module")
def with_defaults(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> tuple[Path, LLMEngine, list[str]]:
    path = model_dir(tmp_path_factory.mktemp("defaults"), tiny_model_dir, FILE_VALUES)
    return (path, *start(engine_config(path)))


@pytest.fixture(scope="module")
def without_defaults(with_defaults: tuple[Path, LLMEngine, list[str]]) -> tuple[LLMEngine, list[str]]:
    return start(engine_config(with_defaults[0], generation_config="none"))


def serve(engine: LLMEngine) -> Iterator[tuple[openai.OpenAI, str]]:
    with serve_in_thread(build_app(AsyncEngine(engine))) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60), base


@pytest.fixture(scope="module")
def auto(with_defaults: tuple[Path, LLMEngine, list[str]]) -> Iterator[tuple[openai.OpenAI, str]]:
    yield from serve(with_defaults[1])


@pytest.fixture(scope="module")
def off(without_defaults: tuple[LLMEngine, list[str]]) -> Iterator[tuple[openai.OpenAI, str]]:
    yield from serve(without_defaults[0])


def complete(client: openai.OpenAI, **fields: Any) -> str:
    extra_body = {**ANSWER["extra_body"], **fields.pop("extra_body", {})}
    resp = client.completions.create(model=NAME, prompt=PROMPT, **{**ANSWER, **fields, "extra_body": extra_body})
    return resp.choices[0].text


def chat(client: openai.OpenAI, stream: bool, **fields: Any) -> str:
    extra_body = {**ANSWER["extra_body"], **fields.pop("extra_body", {})}
    args: dict[str, Any] = {"model": NAME, "messages": CHAT, **ANSWER, **fields, "extra_body": extra_body}
    if not stream:
        return client.chat.completions.create(**args).choices[0].message.content or ""
    chunks = client.chat.completions.create(**args, stream=True)
    return "".join(chunk.choices[0].delta.content or "" for chunk in chunks)


# ---- served ---------------------------------------------------------------------------------------------------


def test_unset_fields_take_the_files_values(auto: tuple[openai.OpenAI, str]) -> None:
    client = auto[0]
    greedy = complete(client, temperature=0)
    for seed in SEEDS:  # top_k 1 from the file: the seed cannot matter
        assert complete(client, seed=seed) == greedy
    greedy_chat = chat(client, stream=False, temperature=0)
    assert chat(client, stream=False, seed=1) == greedy_chat
    assert chat(client, stream=True, seed=2) == greedy_chat


def test_explicit_values_win(auto: tuple[openai.OpenAI, str], off: tuple[openai.OpenAI, str]) -> None:
    on, none = auto[0], off[0]
    greedy = complete(on, temperature=0)
    sampled = {seed: complete(none, seed=seed) for seed in SEEDS}  # the built-in defaults: temperature 1
    assert any(text != greedy for text in sampled.values())  # so the checks below can fail
    for seed in SEEDS:
        # every default spelled out as the built-in one: the answer of the engine without defaults
        assert complete(on, seed=seed, temperature=1.0, top_p=1.0, extra_body={"top_k": -1}) == sampled[seed]
        # top_k off, explicitly: the file's temperature and top_p still apply
        explicit = complete(none, seed=seed, temperature=0.7, top_p=0.9)
        assert complete(on, seed=seed, extra_body={"top_k": 0}) == explicit
        # null is unset: the file's value
        assert complete(on, seed=seed, temperature=None, extra_body={"top_k": None}) == greedy
    assert chat(on, stream=True, seed=1, temperature=1.0, top_p=1.0, extra_body={"top_k": -1}) == chat(
        none, stream=False, seed=1
    )


def test_the_off_flag_restores_the_built_in_defaults(
    auto: tuple[openai.OpenAI, str], off: tuple[openai.OpenAI, str]
) -> None:
    greedy = complete(off[0], temperature=0)
    answers = [complete(off[0], seed=seed) for seed in SEEDS]
    assert answers == [complete(off[0], seed=seed, temperature=1.0) for seed in SEEDS]
    assert any(text != greedy for text in answers)  # top_k 1 from the file would have made them all greedy


def test_load_shows_the_defaults_in_force(auto: tuple[openai.OpenAI, str], off: tuple[openai.OpenAI, str]) -> None:
    assert httpx.get(f"{auto[1]}/load").json()["sampling_defaults"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 1}
    assert httpx.get(f"{off[1]}/load").json()["sampling_defaults"] == {}


def test_the_start_up_log_names_the_defaults(
    with_defaults: tuple[Path, LLMEngine, list[str]], without_defaults: tuple[LLMEngine, list[str]]
) -> None:
    path, _, lines = with_defaults
    expected = (
        f"sampling defaults from {path / GENERATION_CONFIG}: temperature=0.7 top_p=0.9 top_k=1 "
        "(not supported, ignored: min_p=0.05)"
    )
    assert [line for line in lines if line.startswith("sampling defaults")] == [expected]
    assert "sampling defaults: none (--generation-config none)" in without_defaults[1]


# ---- bad files, the flag ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("values", "problem"),
    [
        ({"temperature": -0.5}, "temperature must be a number in [0, 100], got -0.5"),
        ({"temperature": "0.7"}, "temperature must be a number in [0, 100], got '0.7'"),
        ({"temperature": True}, "temperature must be a number in [0, 100], got True"),
        ({"top_p": 0}, "top_p must be a number in (0, 1], got 0"),
        ({"top_p": 1.5}, "top_p must be a number in (0, 1], got 1.5"),
        ({"top_k": 2.5}, "top_k must be an integer >= -1, got 2.5"),
        ({"top_k": -2}, "top_k must be an integer >= -1, got -2"),
        ({"repetition_penalty": 0}, "repetition_penalty must be a number in [0.01, 100], got 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1, got 0"),
    ],
)
def test_a_bad_value_is_refused_naming_the_file_and_the_key(
    tmp_path: Path, tiny_model_dir: Path, values: dict[str, Any], problem: str
) -> None:
    path = model_dir(tmp_path, tiny_model_dir, {"top_p": 0.9, **values})
    with pytest.raises(ValueError) as info:
        load_sampling_defaults("auto", path)
    assert str(info.value).startswith(f"{path / GENERATION_CONFIG}: {problem}")
    assert "--generation-config none" in str(info.value)
    assert load_sampling_defaults("none", path).values() == {}  # the way out


def test_nan_and_broken_json_are_refused(tmp_path: Path) -> None:
    (tmp_path / GENERATION_CONFIG).write_text('{"temperature": NaN}')
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_sampling_defaults("auto", tmp_path)
    (tmp_path / GENERATION_CONFIG).write_text('{"temperature": 0.5')
    with pytest.raises(ValueError, match="generation_config.json: not valid JSON"):
        load_sampling_defaults("auto", tmp_path)


def test_the_engine_refuses_a_bad_file_at_start(tmp_path: Path, tiny_model_dir: Path) -> None:
    path = model_dir(tmp_path, tiny_model_dir, {"temperature": 500})
    with pytest.raises(ValueError, match=r"generation_config\.json: temperature must be a number in \[0, 100\]"):
        LLMEngine(engine_config(path))
    argv = [sys.executable, "-m", "loragate", "engine", "--model", str(path), "--threads", "1"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert f"{path / GENERATION_CONFIG}: temperature must be a number in [0, 100], got 500" in done.stderr


def test_the_flag(tmp_path: Path, tiny_model_dir: Path) -> None:
    def parsed(*argv: str) -> EngineConfig:
        return EngineConfig.from_flags(build_parser().parse_args(["engine", "--model", "m", *argv]))

    assert parsed().generation_config == "auto"
    assert parsed("--generation-config", "none").generation_config == "none"
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    assert parsed("--generation-config", str(folder)).generation_config == str(folder.resolve())
    with pytest.raises(SystemExit):
        parsed("--generation-config", "vllm")  # neither a word it knows nor a directory
    with pytest.raises(ValueError, match="generation_config must be auto, none or an existing directory"):
        replace(EngineConfig(), generation_config=str(tmp_path / "missing")).validate()
    # a directory: its file, not the model's; it must hold one
    write_sampling_defaults(folder, {"temperature": 0.3})
    assert load_sampling_defaults(str(folder), tiny_model_dir).values() == {"temperature": 0.3}
    with pytest.raises(ValueError, match=f"--generation-config {tmp_path}: {tmp_path} has no generation_config.json"):
        load_sampling_defaults(str(tmp_path), tiny_model_dir)


def test_tiny_random_has_no_sampling_defaults(tiny_model_dir: Path) -> None:
    defaults = load_sampling_defaults("auto", tiny_model_dir)
    assert defaults.values() == {}
    assert defaults.summary() == f"sampling defaults: none ({tiny_model_dir / GENERATION_CONFIG})"


# ---- requests ---------------------------------------------------------------------------------------------------


def test_each_field_takes_its_default_unless_the_request_sets_it(tmp_path: Path) -> None:
    file_values = {"temperature": 0.2, "top_p": 0.9, "top_k": 40, "repetition_penalty": 1.1, "max_new_tokens": 8}
    write_sampling_defaults(tmp_path, file_values)
    defaults = load_sampling_defaults("auto", tmp_path)

    def params(body: dict[str, Any], context_left: int = 100) -> tuple[Any, ...]:
        p = CompletionRequest.model_validate({"prompt": "hi", **body}).to_sampling_params(context_left, None, defaults)
        return (p.temperature, p.top_p, p.top_k, p.repetition_penalty, p.max_tokens)

    assert params({}) == (0.2, 0.9, 40, 1.1, 8)
    assert params({"temperature": 1.0, "top_p": 0.5, "top_k": 3, "repetition_penalty": 1.0, "max_tokens": 30}) == (
        1.0,
        0.5,
        3,
        1.0,
        30,
    )
    assert params({"temperature": 0, "top_k": -1}) == (0.0, 0.9, None, 1.1, 8)
    assert params({"temperature": None, "top_p": None, "top_k": None, "max_tokens": None}) == (0.2, 0.9, 40, 1.1, 8)
    chat_req = ChatCompletionRequest.model_validate({"messages": CHAT})
    assert chat_req.to_sampling_params(5, None, defaults).max_tokens == 5  # the context left, if less
    assert chat_req.to_sampling_params(100, None, defaults).max_tokens == 8  # else max_new_tokens
    big = replace(defaults, max_tokens=1000)
    assert CompletionRequest.model_validate({"prompt": "hi"}).to_sampling_params(100, None, big).max_tokens == 16


# ---- the demo model ---------------------------------------------------------------------------------------------


def test_the_smollm2_build_writes_its_cards_sampling(tmp_path: Path) -> None:
    """What _convert_smollm2 writes after saving the model: the card's values, beside the ids HF saved."""
    assert SMOLLM2_SAMPLING == {"temperature": 0.2, "top_p": 0.9}  # HuggingFaceTB/SmolLM2-135M-Instruct's card
    saved = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "transformers_version": "5.0.0"}
    (tmp_path / GENERATION_CONFIG).write_text(json.dumps(saved))
    write_sampling_defaults(tmp_path, SMOLLM2_SAMPLING)
    assert json.loads((tmp_path / GENERATION_CONFIG).read_text()) == {**saved, "temperature": 0.2, "top_p": 0.9}
    defaults = load_sampling_defaults("auto", tmp_path)
    assert defaults.summary() == f"sampling defaults from {tmp_path / GENERATION_CONFIG}: temperature=0.2 top_p=0.9"


@pytest.mark.smollm2
def test_the_built_smollm2_directory_carries_them(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / GENERATION_CONFIG).read_text())
    assert (config["temperature"], config["top_p"]) == (0.2, 0.9)
    assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    assert "do_sample" not in config  # see SMOLLM2_SAMPLING
