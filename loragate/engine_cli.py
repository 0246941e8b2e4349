"""`loragate engine`: serve one model over the OpenAI API.

Its flags are EngineConfig's settings (engine/config.py declares each once: name, type, default, help, rule),
generated here, plus the server's own (host, port, client bounds, logging). The parsed flags become the config
whole (`EngineConfig.from_flags`). engine/config.py is torch-free; the engine itself is imported only when the
command runs, and without the `engine` extra the command says which extra to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Any

from engine.config import EngineConfig, Flag, settings
from loragate.args import (
    SubParsers,
    add_connection_args,
    add_logging_args,
    checked,
    connection_limits,
    port,
    setup_logging,
)

# What `pip install 'loragate[engine]'` adds (pyproject.toml); `engine` and `up` need all of them.
ENGINE_MODULES = ("torch", "triton", "transformers", "safetensors", "peft", "gguf", "tokenizers")


def add_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "engine", help="serve one model over the OpenAI API", description="Serve one base model over the OpenAI API."
    )
    for f, flag in settings():
        if flag.cli:
            _add_setting(p, f.name, f.default, flag)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8001)
    add_connection_args(p)
    add_logging_args(p)


def _add_setting(p: argparse.ArgumentParser, name: str, default: Any, flag: Flag) -> None:
    option = flag.name or "--" + name.replace("_", "-")
    if flag.off is not None:  # a boolean on by default: its flag turns it off
        p.add_argument(flag.off, dest=name, action="store_false", help=flag.help)
        return
    metavar = flag.metavar or (None if flag.choices else option.removeprefix("--").replace("-", "_").upper())
    kwargs: dict[str, Any] = {"dest": name, "help": flag.help, "metavar": metavar}
    if flag.many:
        kwargs.update(nargs="+", action="extend", default=[], type=checked(flag.rule.parse))
    else:
        default = flag.cli_default if flag.cli_default is not None else default
        shown = f" (default: {default})" if default is not None and not flag.required else ""
        kwargs.update(
            type=checked(flag.rule.parse, flag.rule.check),
            default=default,
            choices=flag.choices,
            required=flag.required,
            help=flag.help + shown,
        )
    p.add_argument(option, **kwargs)


def missing_engine_modules() -> list[str]:
    """The engine extra's modules that cannot be imported here (found without importing them)."""
    missing = []
    for name in ENGINE_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except (ImportError, ValueError):  # ValueError: a module blocked in sys.modules
            found = False
        if not found:
            missing.append(name)
    return missing


def engine_extra_or_exit(command: str) -> int | None:
    """None when the engine can run here; else print one line and return the exit status (2)."""
    missing = missing_engine_modules()
    if not missing:
        return None
    print(
        f"loragate {command}: error: the engine is not installed (missing {', '.join(missing)}); "
        "install it with: pip install 'loragate[engine]'",
        file=sys.stderr,
    )
    return 2


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (status := engine_extra_or_exit("engine")) is not None:
        return status
    # Prompts are tokenized one at a time: the tokenizers' own thread pool would only compete with the
    # compute threads for the CPUs.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # huggingface_hub (adapters fetched from hf:// sources) sends nothing beyond the requests it is asked for.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from engine.entrypoints.serving import serve

    config = EngineConfig.from_flags(args)
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    setup_logging(args.log_level)
    try:
        serve(
            config,
            args.host,
            args.port,
            log_level=args.log_level,
            limits=connection_limits(args),
            log_probes=args.log_probes,
        )
    except ValueError as exc:  # e.g. a model path that is not a model directory, a forced backend this CPU lacks
        print(f"loragate engine: error: {exc}", file=sys.stderr)
        return 2
    return 0
