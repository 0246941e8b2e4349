"""Property: whatever a completion or chat body holds (wrong types, extreme numbers, NaN and Infinity,
lone surrogates, unknown fields, odd headers), the engine and the gateway answer it without a 5xx.

Hypothesis draws the bodies; a bounded number of examples runs in `make test` (more under LORAGATE_SOAK).
Generation is kept short (max_tokens is always drawn, mostly small), so each example costs milliseconds.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stack import SCALE, Stack, auth

# Characters worth trying: letters, digits, spaces, controls and lone surrogates (which "\\ud800" escapes
# decode to) - not whole Unicode, which would mostly draw letters.
TEXT = st.text(st.characters(categories=["Lu", "Ll", "Nd", "Zs", "Cc", "Cs", "So"]), max_size=24)
NUMBERS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 1, 2**63, 1e39, 1e-39, -0.0]),
)
SCALARS = st.one_of(st.none(), st.booleans(), NUMBERS, TEXT)
ANY = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)
SMALL = st.one_of(st.integers(-3, 6), st.sampled_from([0, 2**31, 10**12, -(2**63)]), NUMBERS, SCALARS)
FLOATY = st.one_of(st.floats(-5, 5), NUMBERS, SCALARS)

SAMPLING = {
    "temperature": FLOATY,
    "top_p": FLOATY,
    "top_k": SMALL,
    "min_tokens": SMALL,
    "seed": SMALL,
    "presence_penalty": FLOATY,
    "frequency_penalty": FLOATY,
    "repetition_penalty": FLOATY,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=3), ANY),
    "stop_token_ids": st.one_of(st.lists(st.integers(-5, 60000), max_size=4), ANY),
    "stream": st.one_of(st.booleans(), ANY),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), ANY)}), ANY),
    "ignore_eos": st.one_of(st.booleans(), ANY),
    "n": SMALL,
    "user": ANY,
    "model": st.one_of(TEXT, ANY),
    "logit_bias": ANY,
    "skip_special_tokens": ANY,
    "best_of": SMALL,
}


def body(required: dict[str, st.SearchStrategy], optional: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A body with the required fields, any of the optional ones, and a few unknown fields."""
    known = st.fixed_dictionaries(required, optional=optional)
    return st.tuples(known, st.dictionaries(TEXT, ANY, max_size=2)).map(lambda kv: {**kv[1], **kv[0]})


COMPLETION = body(
    {"max_tokens": SMALL, "prompt": st.one_of(TEXT, st.lists(st.integers(-5, 60000), max_size=8), ANY)},
    {**SAMPLING, "logprobs": SMALL, "echo": ANY, "suffix": ANY},
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {
            "role": st.one_of(st.sampled_from(["user", "system", "assistant", "developer"]), TEXT),
            "content": st.one_of(
                TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2), ANY
            ),
        }
    ),
    ANY,
)
CHAT = st.one_of(
    *(
        body(
            {limit: SMALL, "messages": st.one_of(st.lists(MESSAGE, min_size=1, max_size=3), ANY)},
            {**SAMPLING, "logprobs": ANY, "top_logprobs": SMALL, "tools": ANY, "response_format": ANY},
        )
        for limit in ("max_tokens", "max_completion_tokens")
    )
)
HEADERS = st.dictionaries(
    st.sampled_from(["X-Adapter-ID", "X-Priority", "X-User-ID", "X-Variant"]),
    st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=12),
    max_size=3,
)
SETTINGS = settings(
    max_examples=40 * SCALE,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def _send(url: str, path: str, body: Any, headers: dict[str, str]) -> httpx.Response:
    # json.dumps writes NaN/Infinity and escapes lone surrogates: exactly what a careless client sends.
    return httpx.post(
        f"{url}{path}",
        content=json.dumps(body).encode(),
        timeout=60,
        headers={"Content-Type": "application/json", **headers},
    )


def _check(resp: httpx.Response, body: Any) -> None:
    assert resp.status_code < 500, (resp.status_code, resp.text, body)
    if resp.status_code >= 400:
        assert resp.json()["error"]["message"], resp.text
    elif resp.headers["content-type"].startswith("text/event-stream"):
        assert resp.text.rstrip().endswith("data: [DONE]")


@pytest.mark.parametrize("path, bodies", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_fuzzed_bodies_never_get_a_5xx(stack: Stack, path: str, bodies: st.SearchStrategy) -> None:
    engine = stack.engines[0].url

    @SETTINGS
    @given(body=bodies, headers=HEADERS)
    def property_holds(body: dict[str, Any], headers: dict[str, str]) -> None:
        _check(_send(engine, path, body, headers), body)
        _check(_send(stack.url, path, body, {**headers, **auth("initech")}), body)

    property_holds()
    stack.wait_idle()
