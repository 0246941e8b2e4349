"""The engine's HTTP API end to end: a real `loragate engine` process serving tiny-random, driven by
the official `openai` client (the reference for the wire format) and by raw httpx for what a client
cannot send.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from engine.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, describe
from engine.model.sources import load_tokenizer

from polling import poll
from processes import start_engine_server

MODEL = "tiny-random"
MAX_MODEL_LEN = 1024  # tiny-random's whole context: long requests take ~1 s, time to disconnect
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY: dict[str, Any] = {"model": MODEL, "temperature": 0, "max_tokens": 12}


def _start_server(log_path: Path, *extra: str, warmup: bool = False) -> tuple[subprocess.Popen[bytes], str]:
    return start_engine_server(log_path, "--max-model-len", str(MAX_MODEL_LEN), *extra, model=MODEL, warmup=warmup)


@pytest.fixture(scope="module")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engine") / "engine.log"


@pytest.fixture(scope="module")
def server(server_log: Path, tiny_model_dir: Path) -> Iterator[str]:
    proc, base = _start_server(server_log, warmup=True)  # as `loragate engine` starts by default
    yield base
    proc.terminate()
    proc.wait(timeout=60)


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(tiny_model_dir)


def _chat_prompt_len(tokenizer: Any) -> int:
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"])


def _metrics(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{base}/metrics").text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _metric(base: str, name: str, **labels: str) -> float:
    return _metrics(base).get((name, tuple(sorted(labels.items()))), 0.0)


# ---- the OpenAI surface, through the official client -----------------------------------------------


def test_completion_stream_matches_non_stream(client: openai.OpenAI, tokenizer: Any) -> None:
    args = {**GREEDY, "prompt": PROMPT, "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**args)
    chunks = list(client.completions.create(**args, stream=True))
    assert full.object == "text_completion" and full.id.startswith("cmpl-")
    assert full.model == MODEL
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.prompt_tokens == len(tokenizer(PROMPT)["input_ids"])
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    assert len([c for c in chunks if c.choices[0].text]) > 1  # streamed as generated, not at once
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_chat_stream_matches_non_stream(client: openai.OpenAI, tokenizer: Any) -> None:
    args = {**GREEDY, "messages": CHAT, "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert full.object == "chat.completion" and full.id.startswith("chatcmpl-")
    assert full.choices[0].message.role == "assistant"
    assert full.choices[0].finish_reason == "length"
    assert full.usage.prompt_tokens == _chat_prompt_len(tokenizer)
    assert full.usage.completion_tokens == 12
    assert chunks[0].choices[0].delta.role == "assistant"
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(c.choices[0].delta.content or "" for c in text_chunks) == full.choices[0].message.content
    assert text_chunks[-1].choices[0].finish_reason == "length"
    assert usage_chunk.choices == []
    assert usage_chunk.usage.model_dump(include={"prompt_tokens", "completion_tokens"}) == {
        "prompt_tokens": full.usage.prompt_tokens,
        "completion_tokens": 12,
    }


def test_chat_default_max_tokens_fills_the_context(client: openai.OpenAI, tokenizer: Any) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == MAX_MODEL_LEN - _chat_prompt_len(tokenizer)
    assert out.choices[0].finish_reason == "length"


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.completions.create(**GREEDY, prompt=PROMPT, logprobs=3)
    lp = out.choices[0].logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        # The sampled token and the top 3, keyed by text (distinct ids may share one, e.g. "\ufffd").
        assert logprob <= 0 and 1 <= len(top) <= 4 and top[token] == logprob
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely token


def test_chat_logprobs_shape(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(**GREEDY, messages=CHAT, logprobs=True, top_logprobs=2)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    args = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "seed": 1234}
    first = client.completions.create(**args).choices[0].text
    assert client.completions.create(**args).choices[0].text == first
    streamed = client.completions.create(**args, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == first


def test_stop_string_cuts_the_output(client: openai.OpenAI) -> None:
    args = {**GREEDY, "prompt": PROMPT, "max_tokens": 24, "extra_body": {"ignore_eos": True}}
    unstopped = client.completions.create(**args).choices[0].text
    candidates = [
        unstopped[i : i + 2]
        for i in range(2, len(unstopped) - 2)
        if unstopped[i : i + 2].isascii() and unstopped[i : i + 2].isprintable()
    ]
    assert candidates, f"no usable stop string in {unstopped!r}"
    stop = candidates[len(candidates) // 2]
    stopped = client.completions.create(**args, stop=[stop])
    assert stopped.choices[0].text == unstopped.split(stop)[0]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**args, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == unstopped.split(stop)[0]


def test_models_lists_the_base_model(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_unknown_adapter_is_404(client: openai.OpenAI, server: str) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="no-such-adapter", prompt=PROMPT, max_tokens=2)
    assert info.value.body["type"] == "adapter_not_found"
    resp = httpx.post(
        f"{server}/v1/chat/completions",
        headers={"X-Adapter-ID": "no-such-adapter"},
        json={"model": MODEL, "messages": CHAT, "max_tokens": 2},
    )
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "adapter_not_found"
    assert "no-such-adapter" in resp.json()["error"]["message"]


# ---- health, readiness, metrics --------------------------------------------------------------------


def test_health_and_readiness(server: str, server_log: Path) -> None:
    assert httpx.get(f"{server}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{server}/readyz")
    assert ready.status_code == 200
    log = server_log.read_text()  # the engine warmed up before it listened
    assert log.index("warmed up in") < log.index("serving ")


def test_metrics_move_after_a_request(client: openai.OpenAI, server: str, tokenizer: Any) -> None:
    resp = httpx.get(f"{server}/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    names = {s.name for f in text_string_to_metric_families(resp.text) for s in f.samples}
    for name in (
        "loragate_engine_requests_total",
        "loragate_engine_prompt_tokens_total",
        "loragate_engine_generation_tokens_total",
        "loragate_engine_time_to_first_token_seconds_count",
        "loragate_engine_time_per_output_token_seconds_count",
        "loragate_engine_e2e_request_latency_seconds_count",
        "loragate_engine_requests_running",
        "loragate_engine_requests_waiting",
        "loragate_engine_kv_blocks_used",
        "loragate_engine_kv_blocks_free",
    ):
        assert name in names, name
    before = _metrics(server)
    client.completions.create(**{**GREEDY, "max_tokens": 5}, prompt=PROMPT, extra_body={"ignore_eos": True})
    after = _metrics(server)

    def delta(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("loragate_engine_requests_total", status="length") == 1
    assert delta("loragate_engine_generation_tokens_total") == 5
    assert delta("loragate_engine_prompt_tokens_total") == len(tokenizer(PROMPT)["input_ids"])
    assert delta("loragate_engine_time_to_first_token_seconds_count") == 1
    assert delta("loragate_engine_time_per_output_token_seconds_count") == 1
    assert after[("loragate_engine_kv_blocks_used", ())] == 0
    assert after[("loragate_engine_kv_blocks_free", ())] > 0


# ---- bad input: 400 naming the field, never a 500 ----------------------------------------------------

_BAD_COMPLETIONS: list[tuple[Any, str]] = [
    (b"{not json", "body"),
    (b"[1, 2]", "body"),
    (b"", "body"),
    ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ({"prompt": PROMPT, "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": PROMPT, "temperature": -1}, "temperature"),
    ({"prompt": PROMPT, "top_p": 0}, "top_p"),
    ({"prompt": PROMPT, "top_p": 1.5}, "top_p"),
    ({"prompt": PROMPT, "n": 0}, "n"),
    ({"prompt": PROMPT, "top_k": -5}, "top_k"),
    ({"prompt": PROMPT, "stop": ["ok", 3]}, "stop"),
    ({"prompt": PROMPT, "seed": 2**80}, "seed"),
    ({"prompt": PROMPT, "echo": "yes"}, "echo"),
    ({"prompt": PROMPT, "best_of": 3}, "best_of"),
    ({"prompt": PROMPT, "logit_bias": {"5": 1000}}, "logit_bias"),
    ({"prompt": PROMPT, "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ({"prompt": [PROMPT, PROMPT]}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": 7}, "prompt"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": [5] * (MAX_MODEL_LEN + 10)}, "prompt"),  # longer than the context
    ({"prompt": [5] * 1000, "max_tokens": 100}, "prompt"),  # prompt + max_tokens > context
    ({"prompt": [10**9]}, "prompt"),  # not a token id of this vocabulary
    # Values that used to reach the sampler and fail the whole step (IndexError): refused up front.
    ({"prompt": PROMPT, "max_tokens": 7, "repetition_penalty": 1e-39}, "repetition_penalty"),
    ({"prompt": PROMPT, "max_tokens": 7, "min_tokens": 1, "temperature": 1e39}, "temperature"),
    # JSON Python parses but no encoder writes back (NaN, Infinity, 1e999, lone surrogates).
    (b'{"prompt": "hello", "temperature": NaN}', "temperature"),
    (b'{"prompt": "hello", "top_p": Infinity}', "top_p"),
    (b'{"prompt": "hello", "frequency_penalty": 1e999}', "frequency_penalty"),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', "prompt"),
    (b'{"prompt": "hello", "user": "\\udc00"}', "user"),
    (b'{"prompt": "hello", "stop": ["ok", "\\udfff"]}', "stop[1]"),
]

_BAD_CHATS: list[tuple[Any, str]] = [
    (b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content"),
    (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udc00"}]}]}',
        "messages[0].content[0].text",
    ),
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
        "messages[0].content[0].type",
    ),
    ({"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ({"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": CHAT, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    ({"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f g"}}]}, "tools[0].function.name"),
    ({"messages": CHAT, "response_format": {"type": "xml"}}, "response_format.type"),
    ({"messages": CHAT, "temperature": "hot"}, "temperature"),
    ({"messages": CHAT, "stream_options": {"include_usage": "yes"}, "stream": True}, "stream_options.include_usage"),
]


def _post(server: str, path: str, body: Any, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server}{path}", content=content, headers={"Content-Type": "application/json", **headers}, timeout=60
    )


def _assert_error(resp: httpx.Response, status: int, type_: str, field: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert error["type"] == type_
    if field is not None:
        assert error["message"].startswith(field), error["message"]


@pytest.mark.parametrize(("body", "field"), _BAD_COMPLETIONS)
def test_bad_completion_request_is_400(server: str, body: Any, field: str) -> None:
    _assert_error(_post(server, "/v1/completions", body), 400, "invalid_request_error", field)


@pytest.mark.parametrize(("body", "field"), _BAD_CHATS)
def test_bad_chat_request_is_400(server: str, body: Any, field: str) -> None:
    _assert_error(_post(server, "/v1/chat/completions", body), 400, "invalid_request_error", field)


def test_a_repeated_adapter_header_is_400(server: str) -> None:
    resp = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 2},
        headers=[("X-Adapter-ID", MODEL), ("X-Adapter-ID", "other")],
        timeout=60,
    )
    _assert_error(resp, 400, "invalid_request_error", "X-Adapter-ID")


def test_bad_priority_is_400(server: str) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2}
    resp = _post(server, "/v1/completions", body, **{"X-Priority": "urgent"})
    _assert_error(resp, 400, "invalid_request_error", "X-Priority")
    ok = _post(server, "/v1/completions", body, **{"X-Priority": "critical"})
    assert ok.status_code == 200


def test_critical_requests_interrupt_sheddable_steps(server: str, client: openai.OpenAI) -> None:
    """Critical requests sent while sheddable ones decode end those steps early (engine/core/llm_engine.py, step):
    the counter moves, and every request gets the text it gets on an idle engine."""
    long = {**GREEDY, "prompt": PROMPT, "max_tokens": 900, "extra_body": {"ignore_eos": True}}
    short = {**GREEDY, "prompt": "Once upon a time", "max_tokens": 4}
    alone_long = client.completions.create(**long).choices[0].text
    alone_short = client.completions.create(**short).choices[0].text
    before = _metric(server, "loragate_engine_interrupted_steps_total")
    with ThreadPoolExecutor(3) as pool:
        load = [
            pool.submit(client.completions.create, **long, extra_headers={"X-Priority": "sheddable"}) for _ in range(3)
        ]
        poll(lambda: _metric(server, "loragate_engine_requests_running") == 3, what="3 sheddable requests running")
        texts = []
        for _ in range(20):  # one arriving mid-step is enough; nearly every one does
            texts.append(client.completions.create(**short, extra_headers={"X-Priority": "critical"}).choices[0].text)
            if _metric(server, "loragate_engine_interrupted_steps_total") > before:
                break
        assert not any(f.done() for f in load), "the sheddable requests finished before a critical one came"
        assert [f.result().choices[0].text for f in load] == [alone_long] * 3
    assert _metric(server, "loragate_engine_interrupted_steps_total") > before
    assert texts == [alone_short] * len(texts)


def test_unknown_route_and_method_are_json(server: str) -> None:
    _assert_error(httpx.get(f"{server}/v1/nothing-here"), 404, "not_found")
    resp = httpx.get(f"{server}/v1/completions")
    _assert_error(resp, 405, "method_not_allowed")
    assert resp.headers["allow"] == "POST"


def test_oversized_body_is_413(server: str) -> None:
    body = b'{"prompt": "' + b"a" * (8 << 20) + b'"}'
    _assert_error(_post(server, "/v1/completions", body), 413, "request_too_large", "body")


def test_errors_are_counted(server: str) -> None:
    before = _metric(server, "loragate_engine_requests_total", status="4xx")
    _post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 0})
    assert _metric(server, "loragate_engine_requests_total", status="4xx") == before + 1


# ---- clients that go away ----------------------------------------------------------------------------


def _long_request(stream: bool) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [5, 6], "max_tokens": MAX_MODEL_LEN - 2, "ignore_eos": True, "stream": stream}


def test_disconnect_mid_stream_aborts_the_request(server: str) -> None:
    aborted = _metric(server, "loragate_engine_requests_total", status="abort")
    with httpx.stream("POST", f"{server}/v1/completions", json=_long_request(True)) as resp:
        lines = resp.iter_lines()
        assert next(lines).startswith("data: ")
        assert _metric(server, "loragate_engine_kv_blocks_used") > 0
    poll(lambda: _metric(server, "loragate_engine_requests_total", status="abort") == aborted + 1)
    poll(lambda: _metric(server, "loragate_engine_kv_blocks_used") == 0)


def test_disconnect_while_waiting_for_json_aborts_the_request(server: str) -> None:
    aborted = _metric(server, "loragate_engine_requests_total", status="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", json=_long_request(False), timeout=0.3)
    poll(lambda: _metric(server, "loragate_engine_requests_total", status="abort") == aborted + 1)
    poll(lambda: _metric(server, "loragate_engine_kv_blocks_used") == 0)


# ---- draining ---------------------------------------------------------------------------------------


def test_sigterm_drains_then_exits(tmp_path: Path) -> None:
    proc, base = _start_server(tmp_path / "engine.log")
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=_long_request(True), timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith("data: ")
            proc.send_signal(signal.SIGTERM)
            # Still listening while the stream runs, but refusing new work.
            for refused in (
                httpx.get(f"{base}/readyz"),
                _post(base, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2}),
            ):
                _assert_error(refused, 503, "service_unavailable")
                assert refused.headers["x-loragate-reason"] == "draining"
                assert refused.headers["retry-after"].isdigit()
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        last = json.loads(rest[-2].removeprefix("data: "))
        assert last["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_draining_engine_refuses_new_work(tiny_model_dir: Path) -> None:
    from engine.config import EngineConfig
    from engine.core.async_engine import AsyncEngine
    from engine.core.llm_engine import LLMEngine
    from engine.entrypoints.server import build_app

    engine = AsyncEngine(LLMEngine(EngineConfig(dtype="float32", model=MODEL, max_model_len=MAX_MODEL_LEN)))
    app = build_app(engine)

    async def scenario() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://engine") as http:
            stopped = await http.get("/readyz")  # no lifespan here: the engine loop is not running
            await engine.start()
            ready = await http.get("/readyz")
            app.state.api.draining = True
            draining = await http.get("/readyz")
            refused = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2})
            await engine.shutdown()
            return [stopped, ready, draining, refused]

    stopped, ready, draining, refused = asyncio.run(scenario())
    assert ready.status_code == 200
    _assert_error(stopped, 503, "service_unavailable")
    assert stopped.headers["x-loragate-reason"] == "engine_failure"  # not draining: the loop is down
    for resp in (draining, refused):
        _assert_error(resp, 503, "service_unavailable")
        assert resp.headers["retry-after"].isdigit()
        assert resp.headers["x-loragate-reason"] == "draining"


# ---- protocol models, no server --------------------------------------------------------------------


def test_protocol_defaults_and_field_names() -> None:
    req = CompletionRequest.model_validate({"prompt": [[1, 2, 3]], "top_k": -1, "stop": "\n"})
    params = req.to_sampling_params(context_left=100)
    assert req.prompt == [1, 2, 3]
    assert (params.max_tokens, params.top_k, params.stop) == (16, None, ("\n",))
    assert params.temperature == 1.0
    chat = ChatCompletionRequest.model_validate(
        {"messages": CHAT, "max_tokens": 5, "max_completion_tokens": 7, "temperature": 0}
    )
    assert chat.to_sampling_params(context_left=100).max_tokens == 7
    default = ChatCompletionRequest.model_validate({"messages": CHAT}).to_sampling_params(40)
    assert default.max_tokens == 40  # what is left of the context
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text"}]}]})
    assert describe(info.value) == "messages[0].content[0].text: Field required"
