"""How a request names a weighted mix of adapters (loragate_common/adapter_mix.py), one parser for the gateway and the
engine: the header form and the body form give the same parts, the canonical name does not depend on their order, and
every malformed mix is a 400 that names its problem."""

from __future__ import annotations

import math

import pytest

from loragate_common.adapter_mix import MAX_PARTS, MixPart, is_mix, mix_from_body, mix_name, parse_mix
from loragate_common.errors import ApiError


def test_header_and_body_forms_name_the_same_mix_in_one_canonical_form() -> None:
    header = parse_mix(" support-v3*0.7 + acme/legal-tone@2*.3 ")
    body = mix_from_body({"acme/legal-tone@2": 0.3, "support-v3": 0.7})
    assert header == (MixPart("support-v3", 0.7), MixPart("acme/legal-tone@2", 0.3))
    assert mix_name(header) == mix_name(body) == "acme/legal-tone@2*0.3+support-v3*0.7"
    assert parse_mix(mix_name(header)) == tuple(sorted(header, key=lambda p: p.ref))  # the name parses back
    assert parse_mix("a*1e+1+b*-2E-1") == (MixPart("a", 10.0), MixPart("b", -0.2))  # exponents, negative weights
    assert is_mix("a*1") and not is_mix("support-v3@2")


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("a*nan", "not a finite number"),
        ("a*inf+b*1", "not a finite number"),
        ("a*1e999", "not a finite number"),
        ("a*0x10", "not a finite number"),
        ("a*1_0", "not a finite number"),
        ("a*0", "non-zero"),
        ("a*101", "at most 100"),
        ("a", "is not ADAPTER*WEIGHT"),
        ("a*0.5+", "is not ADAPTER*WEIGHT"),
        ("*1", "is not ADAPTER*WEIGHT"),
        ("a*0.5+a*0.5", "named twice"),
        ("../x*1", "invalid adapter id"),
        ("a@0*1", "invalid adapter id"),
        ("+".join(f"p{i}*1" for i in range(MAX_PARTS + 1)), f"at most {MAX_PARTS} parts"),
    ],
)
def test_malformed_mixes_are_400s_naming_the_problem(text: str, problem: str) -> None:
    with pytest.raises(ApiError) as refused:
        parse_mix(text)
    assert refused.value.status == 400 and problem in refused.value.message
    assert refused.value.message.startswith("X-Adapter-ID: ")


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ([["a", 1]], "must be an object"),
        ({}, "at least one adapter"),
        ({"a": "0.5"}, "must be a number"),
        ({"a": True}, "must be a number"),
        ({"a": math.nan}, "not a finite number"),
        ({"a": -math.inf}, "not a finite number"),
        ({"a b": 1}, "invalid adapter id"),
        ({f"p{i}": 1 for i in range(MAX_PARTS + 1)}, f"at most {MAX_PARTS} parts"),
    ],
)
def test_malformed_body_mixes_are_400s_naming_the_field(value: object, problem: str) -> None:
    with pytest.raises(ApiError) as refused:
        mix_from_body(value)
    assert refused.value.status == 400 and problem in refused.value.message
    assert refused.value.message.startswith("adapter_mix: ")
