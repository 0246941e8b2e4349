"""The adapter a request names and the rules of ids (loragate_common/adapter_ids.py), one parser for the gateway and
the engine: the header wins over `model`, a repeated header is a 400, and an id the gateway's catalog refuses is an id
the engine refuses too (engine.lora.peft_config.validate_adapter_id reads the same rules)."""

from __future__ import annotations

import pytest

from loragate_common.adapter_ids import ref_problem, requested_adapter, split_ref
from loragate_common.errors import ApiError


def test_the_header_wins_over_the_model_and_blanks_name_nothing() -> None:
    assert requested_adapter([" support "], "legal") == "support"
    assert requested_adapter([], " legal ") == "legal"
    assert requested_adapter([""], "legal") == "legal"  # an empty header names nothing
    assert requested_adapter([], None) == requested_adapter(["  "], "") == ""


def test_a_repeated_header_is_a_400() -> None:
    with pytest.raises(ApiError) as refused:
        requested_adapter(["a", "b"], None)
    assert refused.value.status == 400 and "X-Adapter-ID: given more than once" in refused.value.message


@pytest.mark.parametrize(
    "value",
    ["../x", "a/b/c", "/a", "a/", ".hidden", "a..b", "a b", "é", "a@", "@1", "a@x", "a@0", "a@01", "a@1@2", "x" * 129],
)
def test_refs_that_are_not(value: str) -> None:
    assert split_ref(value) is None and ref_problem(value)


@pytest.mark.parametrize("value", ["a", "acme/support", "support@3", "acme/support@12", "A" * 128, "x.y-z_1"])
def test_refs_that_are(value: str) -> None:
    assert split_ref(value) is not None and ref_problem(value) is None
