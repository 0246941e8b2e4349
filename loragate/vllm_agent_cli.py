"""`loragate vllm-agent`: the sidecar beside a vLLM OpenAI server that fetches catalog adapters into a disk cache and
loads them into vLLM (vllm_agent/). The flags it shares with `loragate engine` take the engine's defaults and rules
(engine/config.py); torch-free, like the gateway it ships with."""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import fields
from pathlib import Path, PurePosixPath
from typing import Any

from engine.config import EngineConfig, Flag
from loragate.args import (
    SubParsers,
    add_connection_args,
    add_logging_args,
    checked,
    connection_limits,
    port,
    setup_logging,
)
from loragate_common.adapter_sources import AllowList, SourceError

_ENGINE = {f.name: (f.default, f.metadata["flag"]) for f in fields(EngineConfig)}


def add_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "vllm-agent",
        help="fetch catalog adapters and load them into a vLLM server, beside it",
        description="A sidecar beside a vLLM OpenAI server (started with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True): "
        "fetches catalog adapters into a disk cache it shares with vLLM and loads them into vLLM as ID@N.",
    )
    p.add_argument("--vllm", default="http://127.0.0.1:8000", metavar="URL", help="vLLM's OpenAI server")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8002)
    p.add_argument(
        "--adapter-cache-dir",
        required=True,
        type=Path,
        metavar="DIR",
        help="the disk cache for fetched adapters, on a volume vLLM reads too; created if missing, kept across "
        "restarts",
    )
    p.add_argument(
        "--vllm-cache-dir",
        metavar="DIR",
        help="the same cache as vLLM's process sees it (an absolute path; default: --adapter-cache-dir): vLLM loads "
        "the entry <adapter-cache-dir>/<sha256> from <vllm-cache-dir>/<sha256>",
    )
    _add_engine_setting(p, "adapter_cache_mb", "size bound of --adapter-cache-dir in MiB (least recently used go)")
    _add_engine_setting(p, "adapter_max_mb", "largest adapter the agent fetches, in MiB")
    p.add_argument(
        "--adapter-source-allow",
        required=True,
        nargs="+",
        action="extend",
        type=checked(str, _prefix_problem),
        metavar="PREFIX",
        help="source prefixes adapters may be fetched from (s3://bucket/prefix/, hf://org/, https://host/path/, a "
        "local directory); an ensure naming any other source is refused",
    )
    _add_engine_setting(p, "adapter_fetch_timeout_s", "longest one adapter download may take")
    _add_engine_setting(
        p,
        "adapter_load_wait_s",
        "how long an ensure waits for its adapter's download and load before it gets 503 adapter_loading",
    )
    add_connection_args(p)
    add_logging_args(p)


def _add_engine_setting(p: argparse.ArgumentParser, name: str, help_: str) -> None:
    """A flag `loragate engine` has too: its default and rule are the engine's."""
    default, flag = _ENGINE[name]
    assert isinstance(flag, Flag)
    option = "--" + name.replace("_", "-")
    p.add_argument(
        option,
        dest=name,
        type=checked(flag.rule.parse, flag.rule.check),
        default=default,
        metavar=option.removeprefix("--").replace("-", "_").upper(),
        help=f"{help_} (default: {default})",
    )


def _prefix_problem(value: Any) -> str | None:
    try:
        AllowList([value])
    except SourceError as exc:
        return str(exc)
    return None


def run(args: argparse.Namespace) -> int:
    from vllm_agent.app import serve
    from vllm_agent.config import AgentConfig

    def refuse(message: str) -> int:
        print(f"loragate vllm-agent: error: {message}", file=sys.stderr)
        return 2

    if not args.vllm.startswith(("http://", "https://")):
        return refuse(f"--vllm {args.vllm!r}: expected an http(s):// URL")
    vllm_dir = None
    if args.vllm_cache_dir is not None:
        if not os.path.isabs(args.vllm_cache_dir):
            return refuse(f"--vllm-cache-dir {args.vllm_cache_dir!r}: expected an absolute path (as vLLM sees it)")
        vllm_dir = PurePosixPath(args.vllm_cache_dir)
    cache_dir = args.adapter_cache_dir.expanduser().resolve()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return refuse(f"--adapter-cache-dir {str(args.adapter_cache_dir)!r}: {exc.strerror or exc}")
    config = AgentConfig(
        vllm_url=args.vllm,
        cache_dir=cache_dir,
        vllm_cache_dir=vllm_dir,
        allow=tuple(args.adapter_source_allow),
        cache_bytes=args.adapter_cache_mb << 20,
        max_adapter_bytes=args.adapter_max_mb << 20,
        fetch_timeout_s=args.adapter_fetch_timeout_s,
        load_wait_s=args.adapter_load_wait_s,
    )
    # huggingface_hub (adapters fetched from hf:// sources) sends nothing beyond the requests it is asked for.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    setup_logging(args.log_level)
    serve(
        config,
        args.host,
        args.port,
        log_level=args.log_level,
        limits=connection_limits(args),
        log_probes=args.log_probes,
    )
    return 0
