"""`loragate engine`'s flags are EngineConfig's settings, declared once (engine/config.py): every setting the CLI
takes is a flag, the defaults are the config's, parsed flags become the config whole, each flag refuses what its
rule refuses (as `validate` does for configs built in code), and docs/reference.md lists exactly these flags."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from engine.config import EngineConfig, settings
from loragate.cli import build_parser

REPO = Path(__file__).resolve().parents[2]
SERVER_FLAGS = {"--host", "--port", "--header-timeout-s", "--body-timeout-s", "--keep-alive-s", "--max-connections"}
SERVER_FLAGS |= {"--log-level", "--log-probes", "--help", "-h"}


def engine_flags() -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    engine = sub.choices["engine"]  # type: ignore[index]
    return {option for action in engine._actions for option in action.option_strings}


def test_every_setting_is_a_flag_and_nothing_else_is() -> None:
    names = set()
    for f, flag in settings():
        if flag.cli:
            names.add(flag.off or flag.name or "--" + f.name.replace("_", "-"))
    assert engine_flags() - SERVER_FLAGS == names
    assert "--threads" in names and "--no-prefix-cache" in names and "--num-kv-blocks" not in names


def test_parsed_defaults_are_the_configs_defaults() -> None:
    args = build_parser().parse_args(["engine", "--model", "tiny-random"])
    config = EngineConfig.from_flags(args)
    assert config == replace(EngineConfig(), model="tiny-random", num_threads="auto")  # the CLI's one own default
    config.validate()


def test_parsed_flags_become_the_config(tmp_path: Path) -> None:
    argv = ["engine", "--model", "m", "--dtype", "bfloat16", "--block-size", "32", "--no-prefix-cache", "--threads"]
    argv += ["3", "--adapter-dir", str(tmp_path), "--adapter-source-allow", "s3://a/", "hf://b/", "--aging-s", "2.5"]
    argv += ["--adapter-source-allow", "https://c/", "--adapter-cache-dir", str(tmp_path / "cache"), "--no-warmup"]
    config = EngineConfig.from_flags(build_parser().parse_args(argv))
    assert (config.dtype, config.block_size, config.enable_prefix_cache, config.num_threads) == (
        "bfloat16",
        32,
        False,
        3,
    )
    assert config.adapter_dir == str(tmp_path.resolve()) and config.aging_s == 2.5 and config.warmup is False
    assert config.adapter_source_allow == ("s3://a/", "hf://b/", "https://c/")
    config.validate()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--block-size", "0"], "must be an integer >= 1"),
        (["--host-adapter-mb", "-1"], "must be an integer >= 0"),
        (["--pool-mb", "lots"], "invalid literal for int"),
        (["--dtype", "fp8"], "'fp8': must be one of auto, float32, bfloat16, float16"),
        (["--aging-s", "inf"], "must be a number of seconds > 0"),
        (["--adapter-load-wait-s", "-1"], "must be a number of seconds >= 0"),
        (["--threads", "0"], "must be an integer >= 1"),
        (["--adapter-dir", "/nonexistent/dir"], "is not an existing directory"),
        (["--preemption", "never"], "'never': must be one of recompute, swap, auto"),
    ],
)
def test_a_flag_refuses_what_its_rule_refuses(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["engine", "--model", "m", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_validate_applies_the_same_rules_to_configs_built_in_code() -> None:
    for changes, message in (
        ({"block_size": 0}, "block_size must be an integer >= 1, got 0"),
        ({"dtype": "fp8"}, "dtype must be one of auto, float32, bfloat16, float16"),
        ({"aging_s": 0.0}, "aging_s must be a number of seconds > 0"),
        ({"num_threads": "many"}, "num_threads must be an integer >= 1"),
        ({"device": "tpu"}, "device must be cpu or cuda"),
        ({"adapter_source_allow": ("s3://a/",)}, "--adapter-source-allow needs --adapter-cache-dir"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            replace(EngineConfig(), **changes).validate()
    replace(EngineConfig(), aging_s=None, max_prefill_tokens=None, num_threads="auto").validate()  # None: off


def test_the_reference_lists_exactly_the_engine_flags() -> None:
    text = (REPO / "docs" / "reference.md").read_text(encoding="utf-8")
    row = next(line for line in text.splitlines() if line.startswith("| `loragate engine "))
    command = re.split(r"(?<!\\)\|", row)[1]  # the first cell (an escaped \| is no cell border)
    listed = set(re.findall(r"--[a-z][a-z0-9-]*", command))
    connection = {"--header-timeout-s", "--body-timeout-s", "--keep-alive-s", "--max-connections"}  # "the flags below"
    assert listed == engine_flags() - {"--help", "-h"} - connection
