"""`tool_choice: auto` on a model whose chat template renders tools: a copy of tiny-random whose
chat_template.jinja lists the tools in a system turn (Hermes-style, as Qwen's and NousResearch's templates do).

A random model does not decide to call a tool, so what is checked end to end is the part the engine owns:
the tools reach the prompt (the same conversation costs more prompt tokens with them), an `auto` answer that
calls nothing is an ordinary message, and `required` still forces a call through the grammar. Parsing the
`<tool_call>` markup a tool-calling model writes is checked in tests/engine/test_structured.py.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from processes import start_engine_server

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Answer with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}{% for message in messages %}{{ '<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
            "required": ["city"],
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    model = tmp_path_factory.mktemp("tools-model") / "tiny-tools"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    proc, base = start_engine_server(model.parent / "engine.log", "--max-model-len", "512", model=str(model))
    yield base
    proc.terminate()
    proc.wait(timeout=60)


def _chat(server: str, **body: Any) -> httpx.Response:
    payload = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, **body}
    return httpx.post(f"{server}/v1/chat/completions", json=payload, timeout=120)


def test_auto_renders_the_tools_and_answers_a_plain_message_when_none_is_called(server: str) -> None:
    without = _chat(server)
    auto = _chat(server, tools=[WEATHER], tool_choice="auto")
    assert without.status_code == 200 and auto.status_code == 200, auto.text
    # The template put the tool's JSON in the prompt: the same conversation, many more prompt tokens.
    grown = auto.json()["usage"]["prompt_tokens"] - without.json()["usage"]["prompt_tokens"]
    assert grown >= len(json.dumps(WEATHER)) // 8, grown
    choice = auto.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and not choice["message"].get("tool_calls")
    assert isinstance(choice["message"]["content"], str)
    # Tools without tool_choice mean auto, as in OpenAI's API: the same answer.
    assert _chat(server, tools=[WEATHER]).json()["choices"][0]["message"] == choice["message"]


def test_required_still_forces_a_call_on_the_same_model(server: str) -> None:
    resp = _chat(server, tools=[WEATHER], tool_choice="required", max_tokens=64)
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
