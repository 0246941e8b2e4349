"""The `loragate` command line: `engine` serves one model (loragate/engine_cli.py), `gateway` fronts engines
(loragate/gateway_cli.py), `up` starts a local stack (loragate/up_cli.py), `policy` checks policy files offline
(loragate/policy_cli.py), `admin` steers a running gateway (loragate/admin_cli.py), `usage` sums its usage ledger
(loragate/usage_cli.py), `adapters` manages its adapter catalog (loragate/adapters_cli.py), `vllm-agent` fetches
catalog adapters and loads them into a vLLM server beside it (loragate/vllm_agent_cli.py).

Install profiles: `pip install loragate` is the gateway and this CLI (never importing torch: the engine's flags come
from the torch-free engine/config.py, and everything else the engine needs is imported inside `engine` and `up`);
`pip install 'loragate[engine]'` adds the engine. Without it, `engine` and `up` exit 2 saying which extra to install.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from loragate import adapters_cli, admin_cli, engine_cli, gateway_cli, policy_cli, up_cli, usage_cli, vllm_agent_cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loragate", description="Multi-LoRA LLM serving.")
    sub = parser.add_subparsers(
        dest="command", required=True, metavar="{engine,up,gateway,policy,admin,usage,adapters,vllm-agent}"
    )
    engine_cli.add_parser(sub)
    up_cli.add_parser(sub)
    gateway_cli.add_parser(sub)
    policy_cli.add_parser(sub)
    admin_cli.add_parser(sub)
    usage_cli.add_parser(sub)
    adapters_cli.add_parser(sub)
    vllm_agent_cli.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "engine":
        return engine_cli.run(args, parser)
    commands = {
        "gateway": gateway_cli.run,
        "policy": policy_cli.run,
        "admin": admin_cli.run,
        "usage": usage_cli.run,
        "adapters": adapters_cli.run,
        "up": up_cli.run,
        "vllm-agent": vllm_agent_cli.run,
    }
    return commands[args.command](args)
