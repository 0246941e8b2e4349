"""The `loragate` command line: `engine` serves one model, `gateway` fronts engines, `up` starts a local stack,
`policy` checks policy files offline, `admin` steers a running gateway (loragate/admin_cli.py), `usage` sums
its usage ledger (loragate/usage_cli.py), `adapters` manages its adapter catalog (loragate/adapters_cli.py).

`up` first makes sure the demo adapters exist (trained once into the cache, see engine/lora/demo.py), then
launches each component as a child process (an engine on an internal port, then the gateway in front
of it with policies/default.yaml and a fresh dev API key), waits until each answers /healthz, prints
where to send requests, and stops them all on Ctrl-C or SIGTERM.

`policy check FILE...` runs the gateway's own parser over policy files (so CI can refuse a bad file
before a gateway ever reloads it) and `policy schema` prints their JSON Schema for editors and linters.

Install profiles: `pip install loragate` is the gateway and this CLI (never importing torch: everything
the engine needs is imported inside `engine` and `up`); `pip install 'loragate[engine]'` adds the engine.
Without it, `engine` and `up` exit 2 saying which extra to install.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from loragate import adapters_cli, admin_cli, usage_cli
from loragate.launch import launch as launch_healthy
from loragate.launch import stop as stop_process
from loragate_common.http_server import ConnectionLimits

_LOG_LEVELS = ("debug", "info", "warning", "error")
_STARTUP_TIMEOUT_S = 600.0  # the first smollm2 start converts the GGUF weights (~40 s on 2 cores)
_UP_ENGINE_PORT = 8001  # `up`'s engine listens here, on 127.0.0.1 only: clients go through the gateway
_DEFAULT_POLICY = Path(__file__).resolve().parents[1] / "policies" / "default.yaml"


def _int_at_least(minimum: int, what: str) -> Callable[[str], int]:
    """An argparse type: an integer >= minimum, else a clear usage error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected a {what} integer, got {text!r}")
        return value

    return parse


_positive = _int_at_least(1, "positive")
_non_negative = _int_at_least(0, "non-negative")


def _threads(text: str) -> int | str:
    return "auto" if text == "auto" else _positive(text)


def _directory(text: str) -> str:
    if not Path(text).expanduser().is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing directory")
    return str(Path(text).expanduser().resolve())


def _port(text: str) -> int:
    value = _positive(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"port must be in 1..65535, got {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


def _add_connection_args(p: argparse.ArgumentParser) -> None:
    """Bounds on client connections (loragate_common/http_server.py), shared by engine and gateway."""
    defaults = ConnectionLimits()
    p.add_argument(
        "--header-timeout-s",
        type=_seconds,
        default=defaults.header_timeout_s,
        help="a connection must send a complete request head within this (else 408, closed)",
    )
    p.add_argument(
        "--body-timeout-s",
        type=_seconds,
        default=defaults.body_timeout_s,
        help="a request's body must arrive within this after its head (else 408, closed)",
    )
    p.add_argument(
        "--keep-alive-s",
        type=_seconds,
        default=defaults.keep_alive_s,
        help="idle keep-alive connections close after this",
    )
    p.add_argument(
        "--max-connections",
        type=_positive,
        default=defaults.max_connections,
        help="client connections open at once; more are answered 503 and closed",
    )


def _connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(args.header_timeout_s, args.body_timeout_s, args.keep_alive_s, args.max_connections)


def _add_engine_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "engine", help="serve one model over the OpenAI API", description="Serve one base model over the OpenAI API."
    )
    p.add_argument(
        "--model", required=True, help="smollm2, tiny-random, or a path to an HF Llama-family safetensors dir"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8001)
    p.add_argument(
        "--adapter-dir",
        type=_directory,
        help="register every PEFT LoRA subdirectory under its folder name; POST "
        "/v1/adapters loads more from inside it at run time",
    )
    p.add_argument(
        "--adapter-cache-dir",
        type=Path,
        help="the disk cache for adapters fetched from --adapter-source-allow sources (object stores, the "
        "Hub, https); created if missing, kept across restarts",
    )
    p.add_argument(
        "--adapter-cache-mb",
        type=_positive,
        default=10240,
        help="size bound of --adapter-cache-dir in MiB (least recently used adapters not in use are evicted)",
    )
    p.add_argument("--adapter-max-mb", type=_positive, default=1024, help="largest adapter the engine fetches, in MiB")
    p.add_argument(
        "--adapter-source-allow",
        nargs="+",
        action="extend",
        default=[],
        metavar="PREFIX",
        help="source prefixes adapters may be fetched from (s3://bucket/prefix/, hf://org/, https://host/path/, "
        "a local directory); a request naming any other source is refused",
    )
    p.add_argument(
        "--adapter-fetch-timeout-s", type=_seconds, default=300.0, help="longest one adapter download may take"
    )
    p.add_argument(
        "--adapter-load-wait-s",
        type=_seconds,
        default=20.0,
        help="how long a request waits for its adapter's download before it gets 503 adapter_loading",
    )
    p.add_argument(
        "--max-device-adapters",
        type=_positive,
        default=8,
        help="adapters resident in device memory at once (least recently used evicted)",
    )
    p.add_argument(
        "--host-adapter-mb", type=_non_negative, default=512, help="host-RAM cache of parsed adapter weights, in MiB"
    )
    p.add_argument(
        "--max-adapters-per-step",
        type=_positive,
        help="distinct adapters computed in one step (default: --max-device-adapters)",
    )
    p.add_argument(
        "--preemption",
        default="auto",
        choices=("recompute", "swap", "auto"),
        help="how a preempted request gives back its KV pages (auto: the cheaper, measured)",
    )
    p.add_argument(
        "--aging-s", type=float, default=10.0, help="seconds of waiting that raise a request by one priority class"
    )
    p.add_argument("--no-prefix-cache", action="store_true", help="do not reuse KV blocks of shared prompt prefixes")
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="listen as soon as the model is loaded (default: first run the shapes serving meets, a few seconds)",
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument(
        "--no-cuda-graphs",
        action="store_true",
        help="CUDA: launch every decode step's kernels one by one instead of replaying captured CUDA graphs",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="auto: bfloat16 on CUDA and on CPUs with avx512_bf16 or AMX, float32 on other CPUs",
    )
    p.add_argument("--max-batch-tokens", type=_positive, default=2048, help="tokens computed per engine step")
    p.add_argument(
        "--max-prefill-tokens",
        type=_positive,
        default=512,
        help="prompt tokens per step for requests below critical: bounds how long a critical request "
        "arriving mid-step waits for that step",
    )
    p.add_argument(
        "--no-critical-interrupts",
        action="store_true",
        help="a critical request arriving mid-step waits for the whole step, instead of ending a step "
        "of lower-class work between two layers (that step then runs again after it starts)",
    )
    p.add_argument("--pool-mb", type=_positive, default=512, help="KV cache pool size in MiB")
    p.add_argument("--block-size", type=_positive, default=16, help="tokens per KV cache block")
    p.add_argument("--max-num-seqs", type=_positive, default=128, help="requests running at once")
    p.add_argument(
        "--max-model-len", type=_positive, help="context length (default: the model's max_position_embeddings)"
    )
    p.add_argument("--served-model-name", help="the name /v1/models reports (default: derived)")
    p.add_argument(
        "--metrics-max-adapters",
        type=_non_negative,
        default=50,
        metavar="N",
        help="adapters with an `adapter` label of their own in the per-adapter metrics (the first N seen); "
        'the rest are counted as "other"',
    )
    p.add_argument(
        "--threads",
        type=_threads,
        default="auto",
        help="torch intra-op threads: N, or auto (default): the CPUs this process may use (affinity "
        "mask and cgroup quota), fewer while other processes take them",
    )
    _add_connection_args(p)
    p.add_argument("--log-level", default="info", choices=_LOG_LEVELS)


def _add_up_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "up", help="start a local stack with one command", description="Start a local serving stack on this machine."
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--model", default="smollm2", help="the engine's --model (default: smollm2)")
    p.add_argument(
        "--adapter-dir", type=_directory, help="serve these adapters instead of the demo ones (trained once, cached)"
    )
    p.add_argument("--log-level", default="info", choices=_LOG_LEVELS)


def _add_gateway_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "gateway",
        help="serve the gateway in front of engine replicas",
        description="Tenant auth, rate limits, admission and routing in front of engines.",
    )
    p.add_argument("--policy", required=True, type=Path, help="the policy YAML file (format: docs/reference.md)")
    p.add_argument(
        "--upstream",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL, e.g. http://127.0.0.1:8001 (repeat for more replicas)",
    )
    p.add_argument(
        "--upstream-dns",
        metavar="NAME:PORT",
        help="also serve from every address NAME resolves to (e.g. a Kubernetes headless Service), "
        "as http://ADDRESS:PORT, re-resolved every --dns-interval-s",
    )
    p.add_argument("--dns-interval-s", type=_seconds, default=5.0, help="how often --upstream-dns is resolved again")
    p.add_argument(
        "--redis",
        metavar="URL",
        help="share rate limits, budgets, the usage ledger, rollouts and operator overrides across gateway "
        "replicas through this Redis (default: in-process)",
    )
    p.add_argument(
        "--usage-retention",
        type=_positive,
        default=1_000_000,
        metavar="N",
        help="usage records the shared ledger keeps, about (oldest trimmed first; export them before)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--max-body-mb", type=_positive, default=1, help="largest request body, in MiB")
    p.add_argument(
        "--clear-overrides",
        action="store_true",
        help="lift every operator override (suspended tenants, drained upstreams) at start, for "
        "every replica sharing --redis",
    )
    _add_connection_args(p)
    p.add_argument("--log-level", default="info", choices=_LOG_LEVELS)


def _add_policy_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "policy",
        help="check policy files, print their JSON Schema",
        description="Work with gateway policy files (docs/reference.md) offline.",
    )
    actions = p.add_subparsers(dest="policy_command", required=True, metavar="{check,schema}")
    check = actions.add_parser(
        "check",
        help="validate policy files the way the gateway loads them",
        description="Validate policy files with the gateway's own parser; exit 1 if any is invalid.",
    )
    check.add_argument("files", nargs="+", type=Path, metavar="FILE", help="a policy YAML file")
    actions.add_parser(
        "schema",
        help="print the policy file's JSON Schema (Draft 2020-12)",
        description="Print the policy file's JSON Schema (Draft 2020-12) to stdout.",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loragate", description="Multi-LoRA LLM serving.")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{engine,up,gateway,policy,admin,usage,adapters}"
    )
    _add_engine_parser(sub)
    _add_up_parser(sub)
    _add_gateway_parser(sub)
    _add_policy_parser(sub)
    admin_cli.add_parser(sub)
    usage_cli.add_parser(sub)
    adapters_cli.add_parser(sub)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


# What `pip install 'loragate[engine]'` adds (pyproject.toml); `engine` and `up` need all of them.
ENGINE_MODULES = ("torch", "triton", "transformers", "safetensors", "peft", "gguf", "tokenizers")


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


def _engine_extra_or_exit(command: str) -> int | None:
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


def run_engine(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    if (status := _engine_extra_or_exit("engine")) is not None:
        return status
    # Prompts are tokenized one at a time: the tokenizers' own thread pool would only compete with the
    # compute threads for the CPUs.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # huggingface_hub (adapters fetched from hf:// sources) sends nothing beyond the requests it is asked for.
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from engine.config import EngineConfig
    from engine.entrypoints.serving import serve

    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        block_size=args.block_size,
        pool_mb=args.pool_mb,
        max_batch_tokens=args.max_batch_tokens,
        max_prefill_tokens=args.max_prefill_tokens,
        critical_interrupts=not args.no_critical_interrupts,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        served_model_name=args.served_model_name,
        num_threads=args.threads,
        adapter_dir=args.adapter_dir,
        max_device_adapters=args.max_device_adapters,
        host_adapter_mb=args.host_adapter_mb,
        max_adapters_per_step=args.max_adapters_per_step,
        preemption=args.preemption,
        aging_s=args.aging_s,
        enable_prefix_cache=not args.no_prefix_cache,
        warmup=not args.no_warmup,
        cuda_graphs=not args.no_cuda_graphs,
        metrics_max_adapters=args.metrics_max_adapters,
        adapter_cache_dir=str(args.adapter_cache_dir) if args.adapter_cache_dir is not None else None,
        adapter_cache_mb=args.adapter_cache_mb,
        adapter_max_mb=args.adapter_max_mb,
        adapter_source_allow=tuple(args.adapter_source_allow),
        adapter_fetch_timeout_s=args.adapter_fetch_timeout_s,
        adapter_load_wait_s=args.adapter_load_wait_s,
    )
    try:
        config.validate()
    except ValueError as exc:
        parser.error(str(exc))
    _setup_logging(args.log_level)
    try:
        serve(config, args.host, args.port, log_level=args.log_level, limits=_connection_limits(args))
    except ValueError as exc:  # e.g. a model path that is not a model directory
        print(f"loragate engine: error: {exc}", file=sys.stderr)
        return 2
    return 0


def run_gateway(args: argparse.Namespace) -> int:
    from gateway.policy import PolicyError, load_policy
    from gateway.serving import serve

    try:
        policy = load_policy(args.policy)
    except PolicyError as exc:
        print(f"loragate gateway: error: {exc}", file=sys.stderr)
        return 2
    for url in args.upstream:
        if not url.startswith(("http://", "https://")):
            print(f"loragate gateway: error: --upstream {url!r}: expected an http(s):// URL", file=sys.stderr)
            return 2
    discovery = None
    if args.upstream_dns is not None:
        from gateway.discovery import DnsUpstreams

        try:
            discovery = DnsUpstreams.from_target(args.upstream_dns, interval_s=args.dns_interval_s)
        except ValueError as exc:
            print(f"loragate gateway: error: {exc}", file=sys.stderr)
            return 2
    elif not args.upstream:
        print(
            "loragate gateway: error: name the engines with --upstream URL or --upstream-dns NAME:PORT", file=sys.stderr
        )
        return 2
    _setup_logging(args.log_level)
    try:
        serve(
            args.policy,
            args.upstream,
            args.redis,
            args.host,
            args.port,
            policy=policy,
            max_body_bytes=args.max_body_mb << 20,
            log_level=args.log_level,
            limits=_connection_limits(args),
            discovery=discovery,
            clear_overrides=args.clear_overrides,
            usage_retention=args.usage_retention,
        )
    except PolicyError as exc:  # e.g. two tenants sharing a key through env: references
        print(f"loragate gateway: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _check_policy_file(path: Path) -> str:
    """One file's `ok:` line; raises PolicyError naming the file and the key at fault."""
    from gateway.policy import read_policy

    policy, digest = read_policy(path)
    return (
        f"ok: {path} ({_plural(len(policy.tenants), 'tenant')}, "
        f"{_plural(len(policy.rollouts), 'rollout')}, sha256 {digest[:12]})"
    )


def run_policy(args: argparse.Namespace) -> int:
    if args.policy_command == "schema":
        from gateway.policy_schema import render_policy_json_schema

        sys.stdout.write(render_policy_json_schema())
        return 0
    from gateway.policy import PolicyError

    failed = False
    for path in args.files:  # every file, so one run reports every problem
        try:
            print(_check_policy_file(path), flush=True)
        except PolicyError as exc:
            print(f"loragate policy check: error: {exc}", file=sys.stderr, flush=True)
            failed = True
    return 1 if failed else 0


@dataclass
class Component:
    """One child process of `loragate up`."""

    name: str
    argv: list[str]
    url: str  # its base URL; ready when GET {url}/healthz answers 200
    process: subprocess.Popen[bytes] | None = None
    env: dict[str, str] | None = None  # None: inherit ours


def launch(components: Sequence[Component], timeout_s: float = _STARTUP_TIMEOUT_S) -> None:
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
    _setup_logging(args.log_level)
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
    engine_argv = [
        sys.executable,
        "-m",
        "loragate",
        "engine",
        "--model",
        args.model,
        "--host",
        "127.0.0.1",
        "--port",
        str(_UP_ENGINE_PORT),
        "--log-level",
        args.log_level,
    ]
    if adapter_dir is not None:
        engine_argv += ["--adapter-dir", str(adapter_dir)]
    gateway_argv = [
        sys.executable,
        "-m",
        "loragate",
        "gateway",
        "--policy",
        str(_DEFAULT_POLICY),
        "--upstream",
        engine_url,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--log-level",
        args.log_level,
    ]
    env = {**os.environ, "LORAGATE_DEV_API_KEY": dev_key, "LORAGATE_ADMIN_KEY": admin_key}
    return [Component("engine", engine_argv, engine_url), Component("gateway", gateway_argv, url, env=env)]


def run_up(args: argparse.Namespace) -> int:
    if (status := _engine_extra_or_exit("up")) is not None:
        return status
    url = f"http://{args.host}:{args.port}"
    engine_url = f"http://127.0.0.1:{_UP_ENGINE_PORT}"
    if args.port == _UP_ENGINE_PORT:
        print(f"loragate up: error: port {_UP_ENGINE_PORT} is the engine's; choose another --port", file=sys.stderr)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "engine":
        return run_engine(args, parser)
    if args.command == "gateway":
        return run_gateway(args)
    if args.command == "policy":
        return run_policy(args)
    if args.command == "admin":
        return admin_cli.run(args)
    if args.command == "usage":
        return usage_cli.run(args)
    if args.command == "adapters":
        return adapters_cli.run(args)
    return run_up(args)
