"""OpenAI's fields beyond plain sampling, end to end on a real `loragate engine` (tiny-random) with the official
`openai` client: tool calls (`required` and named, constrained by the tools' schemas; `auto` refused where the
chat template has no tools), `n` choices (greedy choices equal the single answer, sharing the prompt's KV
blocks), `echo` + `logprobs` with `max_tokens: 0` (HF transformers' log-softmax within 1e-4, base and adapter),
`logit_bias`, and every refusal as a 400 naming its field.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from engine.entrypoints.guided import COMPILE_TIMEOUT_S, ToolChoice, ToolPlan, parse_tools
from engine.entrypoints.tool_calls import ToolCallStream, tool_message
from engine.model.sources import load_tokenizer
from engine.structured import parse_tool_call
from loragate_kernels.backends import Backends, Gemm

from lora_fixtures import load_peft_model, make_peft_adapter
from polling import poll
from processes import start_engine_server

MODEL = "tiny-random"
ADAPTER = "alpha"
PROMPT = (  # more than two KV blocks of 16 tokens
    "The quick brown fox jumps over the lazy dog, and then the quick brown fox sleeps. "
    "A lazy dog dreams of a quick brown fox that never jumps."
)
MESSAGES: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "integer", "maximum": 9}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
WORD_AND_NUMBER = {
    "type": "json_schema",
    "json_schema": {
        "name": "word_and_number",
        "schema": {
            "type": "object",
            "properties": {"word": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "maximum": 999}},
            "required": ["word", "n"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def adapter_root(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    make_peft_adapter(tiny_model_dir, root / ADAPTER, r=8, alpha=16, targets=["q_proj", "v_proj"], seed=1, b_std=0.5)
    return root


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, adapter_root: Path) -> Iterator[str]:
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    proc, base = start_engine_server(log, "--max-model-len", "512", "--adapter-dir", str(adapter_root))
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _metric(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _post(server: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server}{path}", json={"model": MODEL, **body}, timeout=120)


# ---- tool calls ----------------------------------------------------------------------------------------


def _check_call(call: Any, names: set[str]) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["base", "adapter"])
def test_required_tool_choice_calls_one_of_the_tools(client: openai.OpenAI, adapter: str | None) -> None:
    resp = client.chat.completions.create(
        model=adapter or MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None and len(choice.message.tool_calls) == 1
    _check_call(choice.message.tool_calls[0], {"get_weather", "add"})


@pytest.mark.parametrize("name", ["get_weather", "add"])
def test_a_named_tool_choice_calls_that_tool(client: openai.OpenAI, name: str) -> None:
    for seed in range(3):  # sampled, so the arguments vary; the schema holds each time
        resp = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        assert resp.choices[0].finish_reason == "tool_calls"
        calls = resp.choices[0].message.tool_calls or []
        assert [c.function.name for c in calls] == [name]
        _check_call(calls[0], {name})


def test_streamed_tool_call_deltas_accumulate_to_the_whole_answer(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(max_tokens=300, **kwargs).choices[0].message.tool_calls or []
    chunks = list(client.chat.completions.create(stream=True, max_tokens=300, **kwargs))
    deltas = [tc for c in chunks for ch in c.choices for tc in ch.delta.tool_calls or []]
    assert deltas[0].id is not None and deltas[0].function is not None and deltas[0].function.name
    assert all(d.id is None and d.index == 0 for d in deltas[1:])  # only the first carries the id and name
    assert len(deltas) > 2  # the arguments came in fragments, as they were generated
    arguments = "".join(d.function.arguments or "" for d in deltas if d.function is not None)
    assert deltas[0].function.name == whole[0].function.name
    assert json.loads(arguments) == json.loads(whole[0].function.arguments)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


class Add(BaseModel):
    a: int = Field(ge=0, le=99)
    b: int = Field(ge=-9, le=9)


class Weather(BaseModel):
    city: str = Field(max_length=8)
    days: int = Field(ge=1, le=7)


def test_parse_helper_parses_the_tool_arguments(client: openai.OpenAI) -> None:
    tools = [openai.pydantic_function_tool(Add), openai.pydantic_function_tool(Weather)]
    for choice in ("required", {"type": "function", "function": {"name": "Weather"}}):
        completion = client.chat.completions.parse(
            model=MODEL, messages=MESSAGES, tools=tools, tool_choice=choice, temperature=0, max_tokens=300
        )
        calls = completion.choices[0].message.tool_calls or []
        assert len(calls) == 1
        assert isinstance(calls[0].function.parsed_arguments, (Add, Weather))
        if isinstance(choice, dict):
            assert isinstance(calls[0].function.parsed_arguments, Weather)


def test_stream_helper_parses_the_tool_arguments(client: openai.OpenAI) -> None:
    tools = [openai.pydantic_function_tool(Add)]
    with client.chat.completions.stream(
        model=MODEL, messages=MESSAGES, tools=tools, tool_choice="required", temperature=0, max_tokens=300
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert len(done) == 1 and isinstance(done[0].parsed_arguments, Add)
    calls = final.choices[0].message.tool_calls or []
    assert isinstance(calls[0].function.parsed_arguments, Add)
    assert final.choices[0].finish_reason == "tool_calls"


def test_tool_results_go_back_into_the_conversation(client: openai.OpenAI) -> None:
    first = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300
    )
    call = (first.choices[0].message.tool_calls or [])[0]
    messages = [
        *MESSAGES,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=5
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.usage is not None and answer.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_tool_choice_none_ignores_the_tools(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**kwargs).choices[0]
    ignored = client.chat.completions.create(tools=TOOLS, tool_choice="none", **kwargs).choices[0]
    assert ignored.message.tool_calls is None and ignored.finish_reason == plain.finish_reason
    assert ignored.message.content == plain.message.content


def test_auto_needs_a_template_with_tools(server: str) -> None:
    """tiny-random's ChatML template renders no tools: `auto`, also as the default with tools, is a 400."""
    for body in ({"tools": TOOLS, "tool_choice": "auto"}, {"tools": TOOLS}):
        resp = _post(server, "/v1/chat/completions", {"messages": MESSAGES, **body})
        _assert_400(resp, "tool_choice")


# ---- tool-call rendering, without a server (`auto` needs a model whose template renders tools) --------------


def _plan(mode: str, parallel: bool = True) -> ToolPlan:
    choice = ToolChoice("named", "add") if mode == "named" else ToolChoice(mode)
    return ToolPlan(parse_tools(TOOLS), choice, parallel)


AUTO_ANSWER = (
    "Let me check."
    '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>\n'
    '<tool_call>{"name": "get_weather", '
    '"arguments": "{\\"city\\": \\"Paris\\", \\"unit\\": \\"celsius\\"}"}</tool_call>'  # arguments as a string
)
AUTO_CALLS = [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Paris", "unit": "celsius"})]


def _calls(tool_calls: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in tool_calls]


@pytest.mark.parametrize("parallel", [True, False])
def test_auto_markup_becomes_tool_calls(parallel: bool) -> None:
    message, finish = tool_message(_plan("auto", parallel), AUTO_ANSWER, "stop")
    assert finish == "tool_calls" and message["content"] == "Let me check."
    assert _calls(message["tool_calls"]) == (AUTO_CALLS if parallel else AUTO_CALLS[:1])
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"])
    stream = ToolCallStream(_plan("auto", parallel))
    assert all(stream.feed(c) == {} for c in AUTO_ANSWER)  # held back: it may be markup
    delta, finish = stream.finish({}, "stop")
    assert finish == "tool_calls" and delta["content"] == "Let me check."
    assert [d["index"] for d in delta["tool_calls"]] == list(range(len(delta["tool_calls"])))
    assert _calls(delta["tool_calls"]) == _calls(message["tool_calls"])
    plain, finish = tool_message(_plan("auto"), "No tools needed.", "stop")
    assert (plain, finish) == ({"role": "assistant", "content": "No tools needed."}, "stop")


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "add", "arguments": {"a": 1, "b": 2}}',
        '{ "name" : "get_weather" , "arguments" : { "city" : "a}}b\\"}" , "unit" : "celsius" } }\n',
        '{"name": "add", "arguments": {}}',
        '{"arguments": {"a": 1, "b": 2}, "name": "add"}',  # another key order: sent whole at the end
    ],
)
def test_a_constrained_call_streams_its_arguments_as_they_come(text: str) -> None:
    name, arguments = parse_tool_call(text)
    stream = ToolCallStream(_plan("required"))
    deltas = [stream.feed(c) for c in text]
    last, finish = stream.finish(deltas.pop(), "stop")
    calls = [call for d in [*deltas, last] for call in d.get("tool_calls", [])]
    assert finish == "tool_calls" and all("content" not in d for d in [*deltas, last])
    assert calls[0]["function"]["name"] == name and calls[0]["id"].startswith("call_")
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == json.loads(arguments)
    cut, finish = ToolCallStream(_plan("required")).finish({}, "length")
    assert (cut, finish) == ({}, "length")


# ---- n choices -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["base", "adapter"])
def test_n_greedy_choices_equal_the_single_answer(server: str, client: openai.OpenAI, adapter: str | None) -> None:
    model = adapter or MODEL
    # A prompt no earlier request had: only the first choice's blocks can be in the prefix cache for the others.
    kwargs: dict[str, Any] = dict(model=model, prompt=f"{PROMPT} ({model})", temperature=0, max_tokens=10)
    hits = _metric(server, "loragate_engine_prefix_cache_hit_tokens_total")
    four = client.completions.create(n=4, **kwargs)
    hits = _metric(server, "loragate_engine_prefix_cache_hit_tokens_total") - hits
    one = client.completions.create(**kwargs)
    assert [c.index for c in four.choices] == [0, 1, 2, 3]
    assert [c.text for c in four.choices] == [one.choices[0].text] * 4
    assert four.usage is not None and one.usage is not None
    assert four.usage.completion_tokens == 4 * one.usage.completion_tokens
    assert four.usage.prompt_tokens == one.usage.prompt_tokens
    # The three later choices attached the first one's full prompt blocks (16 tokens each) instead of computing
    # them: submitted together, none would have found any (blocks are cached once computed).
    full_block_tokens = one.usage.prompt_tokens // 16 * 16
    assert full_block_tokens >= 32
    assert hits == 3 * full_block_tokens

    chat = client.chat.completions.create(model=model, messages=MESSAGES, n=4, temperature=0, max_tokens=10)
    single = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0, max_tokens=10)
    assert [c.message.content for c in chat.choices] == [single.choices[0].message.content] * 4


def test_n_streamed_choices_interleave_with_their_index(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, temperature=1.0, seed=11, max_tokens=12)
    whole = client.completions.create(n=3, **kwargs)
    texts = ["", "", ""]
    finishes: list[str | None] = [None, None, None]
    for chunk in client.completions.create(n=3, stream=True, **kwargs):
        for c in chunk.choices:
            texts[c.index] += c.text
            finishes[c.index] = c.finish_reason or finishes[c.index]
    assert texts == [c.text for c in whole.choices]  # seeded: seed + i for choice i, reproducible
    assert finishes == [c.finish_reason for c in whole.choices]
    assert len(set(texts)) == 3  # different seeds drew different texts


def test_n_streamed_chat_choices_work_with_the_stream_helper(client: openai.OpenAI) -> None:
    # JSON answers: they end ("stop"), which the helper needs (it refuses a "length" answer).
    kwargs: dict[str, Any] = dict(
        model=MODEL, messages=MESSAGES, n=3, temperature=1.0, seed=5, max_tokens=300, response_format=WORD_AND_NUMBER
    )
    whole = client.chat.completions.create(**kwargs)
    with client.chat.completions.stream(**kwargs) as stream:
        final = stream.get_final_completion()
    assert [c.index for c in final.choices] == [0, 1, 2]
    assert [c.message.content for c in final.choices] == [c.message.content for c in whole.choices]
    assert all(isinstance(json.loads(c.message.content or ""), dict) for c in final.choices)
    assert len({c.message.content for c in final.choices}) == 3  # seed + i: three different draws


def test_n_tool_calls(client: openai.OpenAI) -> None:
    resp = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        n=2,
        temperature=1.0,
        seed=1,
        max_tokens=300,
    )
    assert len(resp.choices) == 2
    for choice in resp.choices:
        assert choice.finish_reason == "tool_calls"
        _check_call((choice.message.tool_calls or [])[0], {"get_weather", "add"})


def _load(server: str) -> dict[str, Any]:
    return httpx.get(f"{server}/load").json()  # type: ignore[no-any-return]


def _idle(server: str) -> bool:
    load = _load(server)
    return load["running"] == load["waiting"] == load["kv_blocks_used"] == 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_leaves_aborts_every_choice(server: str, stream: bool) -> None:
    body = {"model": MODEL, "prompt": [5, 6], "max_tokens": 500, "ignore_eos": True, "n": 4, "stream": stream}
    poll(lambda: _idle(server))
    tokens = "loragate_engine_generation_tokens_total"
    before = _metric(server, tokens)
    if stream:
        with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            poll(lambda: _load(server)["running"] == 4)  # all four choices run (the later three reuse the prompt)
    else:  # a raw connection, closed once all four choices run (a client timeout raced the engine's speed)
        url = urlsplit(server)
        data = json.dumps(body).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n"
        with socket.create_connection((url.hostname, url.port)) as conn:
            conn.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)
            poll(lambda: _load(server)["running"] == 4)
    # At once, and short of the four choices' 2,000 tokens: every choice stopped when the client left.
    poll(lambda: _idle(server), timeout_s=1.5)
    poll(lambda: _metric(server, tokens) > before)  # the request's metrics are recorded as its handler ends
    assert _metric(server, tokens) - before < 4 * 500


# ---- echo, prompt logprobs, max_tokens 0 -----------------------------------------------------------------


def _hf_prompt_logprobs(
    tiny_model_dir: Path, adapter_dir: Path | None, ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """From HF (and PEFT) in fp32: [len(ids) - 1] logprob of token i given the tokens before it, and the whole
    log-softmax [len(ids), vocab]."""
    model = load_peft_model(tiny_model_dir, adapter_dir)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])], logprobs


@pytest.mark.parametrize("adapter", [None, ADAPTER], ids=["base", "adapter"])
def test_echo_scores_the_prompt_like_hf(
    client: openai.OpenAI, tokenizer: Any, tiny_model_dir: Path, adapter_root: Path, adapter: str | None
) -> None:
    ids = tokenizer.encode(PROMPT)
    resp = client.completions.create(model=adapter or MODEL, prompt=PROMPT, echo=True, logprobs=3, max_tokens=0)
    choice = resp.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert resp.usage is not None and (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (len(ids), 0)
    lp = choice.logprobs
    assert lp is not None and lp.tokens == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing before the first token
    expected, full = _hf_prompt_logprobs(tiny_model_dir, adapter_root / ADAPTER if adapter else None, ids)
    # fp32 to 1e-4 plus 1e-5 relative: logprobs reach -20 here, and the CPU's LoRA op sums in another order than
    # PEFT's matmuls (the torch path's products are PEFT's own and match exactly). The server's GEMMs on the C++
    # routes (loragate_kernels/cpu/, the default on CPUs with AVX2) sum in another order than HF's BLAS too,
    # and this random tiny model amplifies the last bit (up to ~1.7e-4 in its logits: tests/engine/test_model.py
    # `hf_atol`); a wrong op moves them by ~1.
    atol = 1e-4 if Backends.resolve("cpu", "float32").gemm in (Gemm.ONEDNN, Gemm.TORCH) else 5e-4
    assert torch.allclose(torch.tensor(lp.token_logprobs[1:]), expected, atol=atol, rtol=1e-5)
    for i, top in enumerate(lp.top_logprobs[1:]):  # the best alternative at each position is HF's best
        assert abs(max(top.values()) - full[i].max().item()) < atol


def test_echo_with_completion_puts_the_prompt_first(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    plain = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, logprobs=1, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    lp, plain_lp = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert lp is not None and plain_lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.tokens[len(ids) :] == plain_lp.tokens and lp.token_logprobs[len(ids) :] == plain_lp.token_logprobs
    assert lp.text_offset is not None and lp.text_offset[len(ids)] == len("".join(lp.tokens[: len(ids)]))
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4, echo=True, stream=True
        )
    )
    assert streamed == echoed.choices[0].text


def test_echo_of_token_ids_and_n(client: openai.OpenAI, tokenizer: Any) -> None:
    ids = tokenizer.encode(PROMPT)
    resp = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=2, n=2, temperature=0)
    texts = [c.text for c in resp.choices]
    assert texts[0] == texts[1] and texts[0].startswith(tokenizer.decode(ids))
    for c in resp.choices:  # every choice echoes the prompt's scores, computed once
        assert c.logprobs is not None and c.logprobs.token_logprobs is not None
        assert c.logprobs.token_logprobs[: len(ids)] == resp.choices[0].logprobs.token_logprobs[: len(ids)]  # type: ignore[union-attr]
        assert c.logprobs.token_logprobs[0] is None and len(c.logprobs.token_logprobs) == len(ids) + 2


# ---- logit_bias ----------------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, tokenizer: Any) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=0)
    plain = client.completions.create(**kwargs).choices[0]
    forced_id = tokenizer.encode(" fox")[0]
    forced = client.completions.create(logit_bias={str(forced_id): 100}, **kwargs).choices[0]
    assert forced.text == tokenizer.decode([forced_id] * 6)
    assert plain.logprobs is not None and plain.logprobs.tokens is not None
    first = plain.logprobs.tokens[0]  # the greedy first token's text: ban every token with that text
    same_text = [i for i in range(len(tokenizer)) if tokenizer.decode([i]) == first]
    banned = client.completions.create(logit_bias={str(i): -100 for i in same_text}, **kwargs).choices[0]
    assert banned.logprobs is not None and banned.logprobs.tokens is not None
    assert banned.logprobs.tokens[0] != plain.logprobs.tokens[0]
    chat = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=3, logit_bias={str(forced_id): 100}
    )
    assert chat.choices[0].message.content == tokenizer.decode([forced_id] * 3)


# ---- refusals: a 400 naming the field ----------------------------------------------------------------------


def _assert_400(resp: httpx.Response, field: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(field), error["message"]


BAD_MINIMUM = {"type": "object", "properties": {"x": {"type": "integer", "minimum": "a"}}}


def _schema_format(schema: Any) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


_BAD_COMPLETIONS: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"n": "2"}, "n"),
    ({"best_of": 3}, "best_of"),
    ({"best_of": 2, "n": 3}, "best_of"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"logit_bias": {"99999": 1}}, "logit_bias"),  # not in the vocabulary
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 0, "echo": True}, "max_tokens"),  # echo alone: nothing to score
    ({"max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"suffix": "x"}, "suffix"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": _schema_format({"type": "integer", "minimum": "ten"})}, "response_format.json_schema.schema"),
]

_BAD_CHATS: list[tuple[dict[str, Any], str]] = [
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ({"response_format": "json"}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    (
        {"response_format": _schema_format(BAD_MINIMUM)},
        "response_format.json_schema.schema.properties.x.minimum",
    ),
    ({"response_format": _schema_format({"not": {"type": "string"}})}, "response_format.json_schema.schema"),
    (
        {"response_format": _schema_format({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3})},
        "response_format.json_schema.schema.maxLength",
    ),
    (
        {"response_format": _schema_format({"type": "string", "pattern": "(?=a)b"})},
        "response_format.json_schema.schema",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "required"},
        "tools[0].function.name",
    ),
    ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools[0].type"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools[2].function.name"),
    ({"tools": "get_weather", "tool_choice": "required"}, "tools"),
    (
        {
            "tools": [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
            "tool_choice": "required",
        },
        "tools[1].function.parameters",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_MINIMUM}}],
            "tool_choice": "required",
        },
        "tools[0].function.parameters.properties.x.minimum",
    ),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"best_of": 2}, "best_of"),
]


@pytest.mark.parametrize(("body", "field"), _BAD_COMPLETIONS)
def test_bad_completion_fields_are_400(server: str, body: dict[str, Any], field: str) -> None:
    _assert_400(_post(server, "/v1/completions", {"prompt": PROMPT, **body}), field)


@pytest.mark.parametrize(("body", "field"), _BAD_CHATS)
def test_bad_chat_fields_are_400(server: str, body: dict[str, Any], field: str) -> None:
    _assert_400(_post(server, "/v1/chat/completions", {"messages": MESSAGES, **body}), field)


# ---- a schema that compiles for too long: a 400 at the bound, and the engine serves on meanwhile ---------------


def _pathological(properties: int) -> dict[str, Any]:
    """One nested counted repetition per property: xgrammar expands each for 0.5 to 2 s (2-core CPU, xgrammar 0.2.9)
    and has no limit of its own, so this compiles for about `properties` seconds."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    pattern = {f"p{c}": {"type": "string", "pattern": f"^({c}{{1,200}}){{1,200}}$"} for c in letters[:properties]}
    return {"type": "object", "properties": pattern, "required": list(pattern), "additionalProperties": False}


SLOW = _pathological(40)  # ~40 s: eight times the bound
SMALL = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"response_format": _schema_format(SLOW)}, "response_format.json_schema.schema"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "slow", "parameters": SLOW}}],
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
    ],
    ids=["response_format", "tools"],
)
def test_a_schema_slower_than_the_bound_is_a_400_while_others_are_served(
    server: str, client: openai.OpenAI, body: dict[str, Any], field: str
) -> None:
    def small(schema: dict[str, Any]) -> Any:
        response_format: Any = _schema_format(schema)
        answer = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, response_format=response_format, temperature=0, max_tokens=50
        )
        return json.loads(answer.choices[0].message.content or "")

    small(SMALL)  # the compile worker is up (its start is not a schema's time)
    with ThreadPoolExecutor(max_workers=1) as pool:
        start = time.monotonic()
        refused = pool.submit(_post, server, "/v1/chat/completions", {"messages": MESSAGES, **body})
        time.sleep(0.5)  # the compile is under way
        served = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, max_tokens=4)
        served_after = time.monotonic() - start
        resp = refused.result()
        refused_after = time.monotonic() - start
    assert served.choices[0].text and served_after < COMPILE_TIMEOUT_S  # answered while the schema compiled
    _assert_400(resp, field)
    assert f"longer than {COMPILE_TIMEOUT_S:g} s" in resp.json()["error"]["message"]
    assert COMPILE_TIMEOUT_S <= refused_after < COMPILE_TIMEOUT_S + 3
    # The same schema again is refused at once (kept by its digest); the restarted worker compiles the next one.
    start = time.monotonic()
    _assert_400(_post(server, "/v1/chat/completions", {"messages": MESSAGES, **body}), field)
    assert time.monotonic() - start < 1.0
    fresh = {**SMALL, "properties": {field: {"type": "boolean"}}, "required": [field]}
    jsonschema.validate(small(fresh), fresh)
