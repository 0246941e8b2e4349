"""`loragate up`: a local stack with one command.

It first makes sure the demo adapters exist (trained once into the cache, see engine/lora/demo.py), then launches each
component as a child process (an engine on an internal port, then the gateway in front of it with
policies/default.yaml and a fresh dev API key), waits until each answers /healthz, prints where to send requests, and
stops them all on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from engine.config import existing_directory
from loragate.args import SubParsers, add_logging_args, checked, port, setup_logging
from loragate.engine_cli import engine_extra_or_exit
from loragate.launch import launch as launch_healthy
from loragate.launch import stop as stop_process

STARTUP_TIMEOUT_S = 600.0  # the first smollm2 start converts the GGUF weights (~40 s on 2 cores)
ENGINE_PORT = 8001  # `up`'s engine listens here, on 127.0.0.1 only: clients go through the gateway
DEFAULT_POLICY = Path(__file__).resolve().parents[1] / "policies" / "default.yaml"


def add_parser(sub: SubParsers[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up", help="start a local stack with one command", description="Start a local serving stack on this machine."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port, default=8000)
    p.add_argument("--model", default="smollm2", help="the engine's --model (default: smollm2)")
    p.add_argument(
        "--adapter-dir",
        type=checked(existing_directory),
        help="serve these adapters instead of the demo ones (trained once, cached)",
    )
    add_logging_args(p)


@dataclass
class Component:
    """One child process of `loragate up`."""

    name: str
    argv: list[str]
    url: str  # its base URL; ready when GET {url}/healthz answers 200
    process: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None  # None: inherit ours


def launch(components: Sequence[Component], timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Start each component in order and wait until it is healthy (LaunchError if it dies or times out)."""
    for comp in components:
        comp.process = launch_healthy(comp.argv, comp.url, timeout_s=timeout_s, name=comp.name, env=comp.env)


def stop(components: Sequence[Component], grace_s: float = 40.0) -> None:
    """SIGTERM every running component (last started first), then wait; SIGKILL stragglers."""
    running = [c.process for c in reversed(components) if c.process and c.process.poll() is None]
    for proc in running:
        proc.terminate()
    for proc in running:
        stop_process(proc, grace_s)


def _wait_any_exit(components: Sequence[Component]) -> None:
    while all(c.process is not None and c.process.poll() is None for c in components):
        time.sleep(0.5)


def _up_adapter_dir(args: argparse.Namespace) -> Path | None:
    """--adapter-dir, else the demo adapters for the model (trained on first use), else None."""
    if args.adapter_dir is not None:
        return Path(args.adapter_dir)
    from engine.lora.demo import DEMO_MODELS, demo_adapter_dir

    if args.model not in DEMO_MODELS:
        print(
            f"loragate up: no demo adapters for --model {args.model}; serving the base model only "
            "(pass --adapter-dir to serve adapters)",
            flush=True,
        )
        return None
    print("loragate up: preparing the demo adapters (trained once, then cached) ...", flush=True)
    setup_logging(args.log_level)
    return demo_adapter_dir(args.model)


def _served_adapters(url: str) -> list[str]:
    """The adapter ids the engine at `url` actually registered (broken directories are skipped)."""
    try:
        with urllib.request.urlopen(f"{url}/v1/adapters", timeout=10) as resp:
            return [card["id"] for card in json.load(resp)["data"]]
    except (urllib.error.URLError, OSError, ValueError, KeyError, TypeError):
        return []


def _banner(
    url: str, adapter_ids: list[str], dev_key: str = "<your API key>", admin_key: str = "<the admin key>"
) -> str:
    from engine.lora.demo import DEMOS

    about = {demo.adapter_id: demo.description for demo in DEMOS}
    lines = [
        f"\nloragate is up: OpenAI API at {url}/v1 (the gateway; the engine behind it is internal)",
        f"dev API key (new every run): {dev_key}",
        f"  export KEY={dev_key}",
    ]
    if adapter_ids:
        lines.append("adapters (choose one with the X-Adapter-ID header, or as the body's model):")
        lines += [f"  {a:<12} {about.get(a, '')}".rstrip() for a in adapter_ids]
    example = next(
        (d.adapter_id for d in DEMOS if d.adapter_id in adapter_ids), adapter_ids[0] if adapter_ids else None
    )
    header = f"-H 'X-Adapter-ID: {example}' " if example is not None else ""
    lines += [
        f'  curl {url}/v1/chat/completions -H "Authorization: Bearer $KEY" \\',
        f"    -H 'Content-Type: application/json' {header}\\",
        '    -d \'{"messages": [{"role": "user", "content": "Tell me about the moon."}], "max_tokens": 48}\'',
        f'  curl {url}/v1/models -H "Authorization: Bearer $KEY"     # what this key may use',
        f"ops page: {url}/admin/ui   admin key (new every run): {admin_key}",
        f"  LORAGATE_ADMIN_KEY={admin_key} loragate admin --url {url} status",
        "Ctrl-C stops it.",
    ]
    return "\n".join(lines)


def _up_components(
    args: argparse.Namespace, adapter_dir: Path | None, engine_url: str, url: str, dev_key: str, admin_key: str
) -> list[Component]:
    logging = ["--log-level", args.log_level] + (["--log-probes"] if args.log_probes else [])
    loragate = [sys.executable, "-m", "loragate"]
    engine_argv = [*loragate, "engine", "--model", args.model, "--host", "127.0.0.1", "--port", str(ENGINE_PORT)]
    if adapter_dir is not None:
        engine_argv += ["--adapter-dir", str(adapter_dir)]
    gateway_argv = [*loragate, "gateway", "--policy", str(DEFAULT_POLICY), "--upstream", engine_url]
    gateway_argv += ["--host", args.host, "--port", str(args.port)]
    env = {**os.environ, "LORAGATE_DEV_API_KEY": dev_key, "LORAGATE_ADMIN_KEY": admin_key}
    return [
        Component("engine", engine_argv + logging, engine_url),
        Component("gateway", gateway_argv + logging, url, env=env),
    ]


def run(args: argparse.Namespace) -> int:
    if (status := engine_extra_or_exit("up")) is not None:
        return status
    url = f"http://{args.host}:{args.port}"
    engine_url = f"http://127.0.0.1:{ENGINE_PORT}"
    if args.port == ENGINE_PORT:
        print(f"loragate up: error: port {ENGINE_PORT} is the engine's; choose another --port", file=sys.stderr)
        return 2
    components: list[Component] = []

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)  # from here on, a SIGTERM unwinds through the finally
    try:
        try:
            adapter_dir = _up_adapter_dir(args)
        except (ValueError, OSError) as exc:
            raise RuntimeError(f"cannot prepare the demo adapters: {exc}") from None
        dev_key, admin_key = secrets.token_urlsafe(24), secrets.token_urlsafe(32)
        components += _up_components(args, adapter_dir, engine_url, url, dev_key, admin_key)
        print(
            f"loragate up: starting the engine ({args.model}) on {engine_url} and the gateway on {url} ...", flush=True
        )
        launch(components)
        print(_banner(url, _served_adapters(engine_url), dev_key, admin_key), flush=True)
        _wait_any_exit(components)
        print("loragate up: a component exited; stopping the rest", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    except RuntimeError as exc:
        print(f"loragate up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop(components)
