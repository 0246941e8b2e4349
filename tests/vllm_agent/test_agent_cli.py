"""`loragate vllm-agent` (loragate/vllm_agent_cli.py): the flags it shares with `loragate engine` take the engine's
defaults and rules (engine/config.py), a bad value exits 2 naming its flag, and the command serves: a real process
answers /healthz and loads an adapter into a fake vLLM (tests/vllm_agent/vllm_testing.py)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import httpx
import pytest

from engine.config import EngineConfig
from loragate.cli import build_parser, main

from adapter_servers import ArchiveServer, adapter_archive, synthetic_adapter
from processes import start_loragate, stop_process
from vllm_testing import MockVllm, ensure

REQUIRED = ["vllm-agent", "--adapter-cache-dir", "/tmp/agent-cache", "--adapter-source-allow", "s3://adapters/team/"]


def test_the_defaults_are_the_engines() -> None:
    args = build_parser().parse_args(REQUIRED)
    engine = EngineConfig()
    assert (args.vllm, args.host, args.port, args.vllm_cache_dir) == ("http://127.0.0.1:8000", "127.0.0.1", 8002, None)
    assert (args.adapter_cache_mb, args.adapter_max_mb) == (engine.adapter_cache_mb, engine.adapter_max_mb)
    assert args.adapter_fetch_timeout_s == engine.adapter_fetch_timeout_s
    assert args.adapter_load_wait_s == engine.adapter_load_wait_s
    assert (args.log_level, args.max_connections) == ("info", 1024)


def test_flags_are_parsed() -> None:
    argv = [*REQUIRED, "hf://org/", "--adapter-source-allow", "https://files.example/pub/", "--vllm-cache-dir", "/v"]
    argv += ["--adapter-cache-mb", "64", "--adapter-max-mb", "8", "--adapter-load-wait-s", "0", "--port", "9000"]
    args = build_parser().parse_args(argv)
    assert args.adapter_source_allow == ["s3://adapters/team/", "hf://org/", "https://files.example/pub/"]
    assert (args.vllm_cache_dir, args.adapter_cache_mb, args.adapter_max_mb) == ("/v", 64, 8)
    assert (args.adapter_load_wait_s, args.port) == (0.0, 9000)


@pytest.mark.parametrize(
    ("argv", "flag", "message"),
    [
        (["--adapter-cache-mb", "0"], "--adapter-cache-mb", "must be an integer >= 1"),
        (["--adapter-max-mb", "lots"], "--adapter-max-mb", "invalid literal for int"),
        (["--adapter-fetch-timeout-s", "inf"], "--adapter-fetch-timeout-s", "must be a number of seconds > 0"),
        (["--adapter-load-wait-s", "-1"], "--adapter-load-wait-s", "must be a number of seconds >= 0"),
        (["--port", "70000"], "--port", "a port is in 1..65535"),
        (["--adapter-source-allow", "s3://adapters/../x/"], "--adapter-source-allow", "invalid adapter source"),
        (["--adapter-source-allow", "ftp://host/x/"], "--adapter-source-allow", "invalid adapter source"),
    ],
)
def test_a_bad_value_exits_2_naming_its_flag(
    argv: list[str], flag: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args([*REQUIRED, *argv])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert exit_.value.code == 2
    assert last.startswith(f"loragate vllm-agent: error: argument {flag}") and message in last, last


@pytest.mark.parametrize("missing", ["--adapter-cache-dir", "--adapter-source-allow"])
def test_a_required_flag_left_out_exits_2_naming_it(missing: str, capsys: pytest.CaptureFixture[str]) -> None:
    at = REQUIRED.index(missing)
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(REQUIRED[:at] + REQUIRED[at + 2 :])
    assert exit_.value.code == 2 and missing in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize(
    ("argv", "flag"),
    [(["--vllm", "ftp://127.0.0.1:8000"], "--vllm"), (["--vllm-cache-dir", "relative/cache"], "--vllm-cache-dir")],
)
def test_a_value_refused_at_start_exits_2_with_one_line(
    argv: list[str], flag: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    at = REQUIRED.index("--adapter-cache-dir") + 1
    required = [*REQUIRED[:at], str(tmp_path / "cache"), *REQUIRED[at + 1 :]]
    assert main([*required, *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"loragate vllm-agent: error: {flag} "), err


def test_the_command_serves(tmp_path: Path) -> None:
    data = adapter_archive(synthetic_adapter(tmp_path / "a", 4096, seed=1), "tgz")
    with ArchiveServer() as archives, MockVllm().serving() as vllm:
        source, sha = archives.put("/pub/a.tgz", data), hashlib.sha256(data).hexdigest()
        args = ["vllm-agent", "--vllm", vllm.url, "--adapter-cache-dir", str(tmp_path / "cache")]
        args += ["--adapter-source-allow", archives.url + "/pub/", "--adapter-cache-mb", "16"]
        proc, base = start_loragate(tmp_path / "agent.log", *args, timeout_s=30)
        try:
            resp = ensure(base, "a@1", source, sha)
            assert resp.status_code == 200, resp.text
            assert httpx.get(f"{base}/readyz").status_code == 200
        finally:
            stop_process(proc)
        assert [(load.name, load.path) for load in vllm.loads] == [("a@1", str((tmp_path / "cache").resolve() / sha))]
