"""The gateway and the OpenAI fields of structured outputs, tools, n and prompt scoring: it checks `n`, reserves
the prompt + n x max_tokens against the tenant's token limit (the prompt only for a prompt scored with
max_tokens 0), and forwards every field to the engine unchanged (a fake engine, tests/mock_upstream.py)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from starlette.applications import Starlette

from gateway.app import build_app
from gateway.policy import parse_policy
from gateway.ratelimit import MemoryRateLimiter
from gateway.telemetry import GatewayMetrics

import policies
from gateway_testing import asgi, assert_error, run
from mock_upstream import MockUpstream
from policies import tenant_yaml

KEY = "acme-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


def make_app(mock: MockUpstream, tokens_per_minute: int = 1_000_000) -> Starlette:
    limits = f"{{requests_per_second: 100, burst: 100, tokens_per_minute: {tokens_per_minute}}}"
    policy = parse_policy(policies.policy_yaml(tenant_yaml("acme", KEY, '["*"]', limits=limits)))
    return build_app(policy, [mock.url], MemoryRateLimiter(), metrics=GatewayMetrics())


def post_all(mock: MockUpstream, tokens_per_minute: int, *requests: tuple[str, dict[str, Any]]) -> list[httpx.Response]:
    """Each (path, body) in turn through one gateway app."""

    async def scenario() -> list[httpx.Response]:
        async with asgi(make_app(mock, tokens_per_minute)) as gw:
            return [await gw.post(path, json=body, headers=AUTH) for path, body in requests]

    return run(scenario())  # type: ignore[no-any-return]


def test_n_choices_reserve_n_times_max_tokens(mock: MockUpstream) -> None:
    # "hello" is estimated at 2 tokens; each request is refunded down to what the mock says it used (5 + 8).
    body = {"prompt": "hello", "max_tokens": 200}
    one, four, five = post_all(
        mock,
        1000,
        ("/v1/completions", {**body, "n": 1}),
        ("/v1/completions", {**body, "n": 4}),  # 2 + 4 x 200 fits in 1000
        ("/v1/completions", {**body, "n": 5}),  # 2 + 5 x 200 never fits: refused before the engine
    )
    assert one.status_code == four.status_code == 200
    assert_error(five, 429, "rate_limit_exceeded", "tokens_exhausted")
    assert five.headers["Retry-After"] == "60"
    assert mock.count == 2


def test_chat_n_choices_reserve_n_times_max_completion_tokens(mock: MockUpstream) -> None:
    messages = [{"role": "user", "content": "hi"}]
    ok, refused = post_all(
        mock,
        500,
        ("/v1/chat/completions", {"messages": messages, "n": 2, "max_completion_tokens": 200}),
        ("/v1/chat/completions", {"messages": messages, "n": 3, "max_completion_tokens": 200}),
    )
    assert ok.status_code == 200
    assert_error(refused, 429, "rate_limit_exceeded", "tokens_exhausted")
    assert mock.count == 1


def test_a_scored_prompt_reserves_the_prompt_only(mock: MockUpstream) -> None:
    scored = {"prompt": "hello", "echo": True, "logprobs": 1, "max_tokens": 0}
    ok, default_max = post_all(
        mock,
        10,
        ("/v1/completions", scored),  # 2 tokens
        ("/v1/completions", {"prompt": "hello"}),  # 2 + 256 (the default reservation)
    )
    assert ok.status_code == 200
    assert_error(default_max, 429, "rate_limit_exceeded", "tokens_exhausted")


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
        ("/v1/completions", {"prompt": "x", "n": True}, "n"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),  # not scoring: nothing to do
        ("/v1/completions", {"prompt": "x", "max_tokens": 0, "echo": True}, "max_tokens"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ],
)
def test_bad_n_or_max_tokens_is_400_at_the_gateway(
    mock: MockUpstream, path: str, body: dict[str, Any], field: str
) -> None:
    (resp,) = post_all(mock, 1_000_000, (path, body))
    assert_error(resp, 400, "invalid_request_error")
    assert resp.json()["error"]["message"].startswith(field)
    assert mock.count == 0


def test_every_field_reaches_the_engine_unchanged(mock: MockUpstream) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    tools = [{"type": "function", "function": {"name": "add", "parameters": schema}}]
    chat = {
        "messages": [{"role": "user", "content": "x"}],
        "n": 3,
        "logit_bias": {"5": -100, "7": 2.5},
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}},
        "tools": tools,
        "tool_choice": {"type": "function", "function": {"name": "add"}},
        "parallel_tool_calls": False,
        "seed": 7,
    }
    completion = {
        "prompt": "hello",
        "echo": True,
        "logprobs": 2,
        "max_tokens": 0,
        "n": 2,
        "best_of": 2,
        "response_format": {"type": "json_object"},
        "logit_bias": {"9": 100},
    }
    responses = post_all(mock, 1_000_000, ("/v1/chat/completions", chat), ("/v1/completions", completion))
    assert [r.status_code for r in responses] == [200, 200]
    assert [r.body for r in mock.received] == [chat, completion]
