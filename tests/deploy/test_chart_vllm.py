"""The chart's vLLM engines (`engine.kind` vllm or mixed) with the real helm binary: each value set of
tests/deploy/vllm_values.py through `helm lint --strict` and kubernetes-validate (Kubernetes 1.30, strict), the
gateway's `--upstream-dns` values read by gateway/discovery.py's own parser, and what each set renders: vLLM's
arguments, GPUs, probes and volumes, its agent's flags and cache, the LeaderWorkerSet of a multi-node engine, the
NetworkPolicies, ServiceMonitors and PodDisruptionBudgets. tests/deploy/test_chart_vllm_commands.py runs and parses
the rendered commands.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
from chart_checks import component, containers, dns_upstreams, flags, pod_specs, validate, values_file
from conftest import CHART, find, one, render
from vllm_values import ENGINE_HEADLESS, GPUS_PER_POD, HEADLESS, VLLM_SETS

from gateway.engine_kinds import EngineKind

VLLM_SERVER = ["vllm", "serve"]
# `loragate vllm-agent`'s flags (loragate/vllm_agent_cli.py)
AGENT_FLAGS = {
    "--vllm",
    "--host",
    "--port",
    "--adapter-cache-dir",
    "--vllm-cache-dir",
    "--adapter-cache-mb",
    "--adapter-max-mb",
    "--adapter-source-allow",
    "--adapter-fetch-timeout-s",
    "--adapter-load-wait-s",
    "--log-level",
}


def _mount(container: dict[str, Any], volume: str) -> dict[str, Any]:
    [found] = [m for m in container["volumeMounts"] if m["name"] == volume]
    return found


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    [found] = [v for v in pod["volumes"] if v["name"] == name]
    return found


@pytest.mark.parametrize("name", sorted(VLLM_SETS))
def test_vllm_value_sets_lint_and_render_valid_manifests(helm: Path, tmp_path: Path, name: str) -> None:
    path = values_file(tmp_path, name, VLLM_SETS[name])
    lint = subprocess.run(
        [str(helm), "lint", "--strict", "-f", path, str(CHART)], capture_output=True, text=True, timeout=120
    )
    assert lint.returncode == 0 and "0 chart(s) failed" in lint.stdout, lint.stdout + lint.stderr
    manifests = render(helm, "-f", path)
    validate(manifests)
    by_name = containers(manifests)
    mixed = name == "mixed"
    # The loragate engines only where asked for, and vLLM's objects all of one component family.
    assert bool([m for m in manifests if component(m) == "engine"]) == mixed
    assert ("engine" in by_name) == mixed
    _check_service_and_gateway(manifests, by_name, mixed)
    _check_server(manifests, by_name, GPUS_PER_POD[name])
    CHECKS[name](manifests, by_name)


def _check_service_and_gateway(
    manifests: list[dict[str, Any]], by_name: dict[str, dict[str, Any]], mixed: bool
) -> None:
    """The vLLM servers' headless Service, and the gateway's --upstream-dns for each kind that runs."""
    headless = one(manifests, "Service", "-vllm-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["selector"]["app.kubernetes.io/component"] == "vllm"  # servers (leaders) only
    agent = "vllm-agent" in by_name
    assert {p["name"]: p["port"] for p in headless["spec"]["ports"]} == (
        {"http": 8000, "agent": 8002} if agent else {"http": 8000}
    )
    # The gateway: one --upstream-dns per kind, as gateway/discovery.py parses them.
    upstreams = dns_upstreams(by_name)
    assert [u.kind for u in upstreams] == ([EngineKind.LORAGATE, EngineKind.VLLM] if mixed else [EngineKind.VLLM])
    vllm_upstream = upstreams[-1]
    assert (vllm_upstream.name, vllm_upstream.port) == (HEADLESS, 8000)
    assert vllm_upstream.agent_port == (8002 if agent else None)
    if mixed:
        assert (upstreams[0].name, upstreams[0].port, upstreams[0].agent_port) == (ENGINE_HEADLESS, 8001, None)


def _check_server(manifests: list[dict[str, Any]], by_name: dict[str, dict[str, Any]], gpus: int) -> None:
    """What every vLLM server gets: its address, priority scheduling, GPUs, probes, environment and shm."""
    server, agent = by_name["vllm"], "vllm-agent" in by_name
    args = flags(server["args"])
    assert {k: args[k] for k in ("--host", "--port", "--scheduling-policy")} == {
        "--host": "0.0.0.0",
        "--port": "8000",
        "--scheduling-policy": "priority",
    }
    assert "--enable-lora" in args and args["--enable-lora"] is None
    for kind in ("requests", "limits"):
        assert server["resources"][kind]["nvidia.com/gpu"] == gpus
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert server[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert server["startupProbe"]["periodSeconds"] * server["startupProbe"]["failureThreshold"] >= 1800
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert (env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "True") == agent
    assert env["HF_HOME"].startswith(_mount(server, "model-cache")["mountPath"] + "/")
    assert not [n for n in env if n.startswith("AWS_")]  # the object store is the agent's, never vLLM's
    for pod in pod_specs(manifests):
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            assert container["securityContext"]["readOnlyRootFilesystem"] is True
        if any(c["name"].startswith("vllm") and c["name"] != "vllm-agent" for c in pod["containers"]):
            assert _volume(pod, "dshm")["emptyDir"]["medium"] == "Memory"


def _headless_labels(manifests: list[dict[str, Any]]) -> dict[str, str]:
    labels = one(manifests, "Service", "-vllm-headless")["metadata"]["labels"]
    return {
        k: v
        for k, v in labels.items()
        if k in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/component")
    }


def _check_one_gpu(manifests: list[dict[str, Any]], by_name: dict[str, dict[str, Any]]) -> None:
    statefulset = one(manifests, "StatefulSet", "-vllm")
    assert statefulset["spec"]["replicas"] == 2
    assert statefulset["spec"]["serviceName"] == one(manifests, "Service", "-vllm-headless")["metadata"]["name"]
    server, agent = by_name["vllm"], by_name["vllm-agent"]
    assert server["command"] == VLLM_SERVER
    assert server["args"][0] == "meta-llama/Llama-3.1-8B-Instruct"  # `vllm serve MODEL`
    args = flags(server["args"])
    assert {k: args[k] for k in ("--served-model-name", "--dtype", "--max-model-len")} == {
        "--served-model-name": "llama-3.1-8b",
        "--dtype": "bfloat16",
        "--max-model-len": "8192",
    }
    assert (args["--max-loras"], args["--max-lora-rank"], args["--max-cpu-loras"]) == ("8", "64", "32")
    assert args["--tensor-parallel-size"] == "1"
    assert not {"--pipeline-parallel-size", "--distributed-executor-backend"} & set(args)
    assert server["args"][-2:] == ["--gpu-memory-utilization", "0.9"]  # extraArgs, last
    # The agent: the engines' fetch settings, the cache both containers mount, the store's environment.
    assert agent["command"] == ["loragate"] and agent["args"][0] == "vllm-agent"
    agent_args = flags(agent["args"])
    assert set(agent_args) <= AGENT_FLAGS
    assert {k: v for k, v in agent_args.items() if k != "--adapter-source-allow"} == {
        "--vllm": "http://127.0.0.1:8000",
        "--host": "0.0.0.0",
        "--port": "8002",
        "--adapter-cache-dir": "/var/cache/adapters",
        "--adapter-cache-mb": str(20 * 1024 - 2 * 1024),  # the engines' bound: sizeLimit less two downloads
        "--adapter-max-mb": "1024",
        "--adapter-fetch-timeout-s": "300",
        "--adapter-load-wait-s": "20",
        "--log-level": "info",
    }
    at = agent["args"].index("--adapter-source-allow")  # objectStore.bucket and .prefix first, then sources.allow
    assert (
        agent["args"][at + 1 : at + 3] == ["s3://adapters/prod/", "hf://my-org/"]
        and agent["args"][at + 3] == "--log-level"
    )
    pod = one(manifests, "StatefulSet", "-vllm")["spec"]["template"]["spec"]
    assert _volume(pod, "adapter-cache")["emptyDir"] == {"sizeLimit": "20Gi"}
    assert (
        _mount(agent, "adapter-cache")["mountPath"]
        == _mount(server, "adapter-cache")["mountPath"]
        == "/var/cache/adapters"
    )
    assert _mount(server, "adapter-cache")["readOnly"] is True and not _mount(agent, "adapter-cache").get("readOnly")
    assert agent["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "agent"}
    assert {p["name"]: p["containerPort"] for p in agent["ports"]} == {"agent": 8002}
    agent_env = {e["name"]: e for e in agent["env"]}
    assert agent_env["AWS_ENDPOINT_URL"]["value"] == "http://minio.storage.svc:9000"
    assert agent_env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {
        "name": "adapter-store",
        "key": "AWS_ACCESS_KEY_ID",
    }
    hub_token = {"name": "hub-token", "key": "HF_TOKEN"}
    server_env = {e["name"]: e for e in server["env"]}
    assert (
        agent_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        == server_env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]
        == hub_token
    )
    # The gateway reaches vLLM and the agent; metrics scrapers reach both /metrics.
    [from_gateway, from_metrics] = one(manifests, "NetworkPolicy", "-vllm")["spec"]["ingress"]
    assert from_gateway["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    assert {p["port"] for p in from_gateway["ports"]} == {"http", "agent"} == {p["port"] for p in from_metrics["ports"]}
    container_ports = {p["name"] for c in pod["containers"] for p in c.get("ports", [])}
    assert {p["port"] for p in from_gateway["ports"]} <= container_ports  # the policy's named ports exist
    monitor = one(manifests, "ServiceMonitor", "-vllm")
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["http", "agent"]
    assert monitor["spec"]["selector"]["matchLabels"] == _headless_labels(manifests)
    assert not find(manifests, "ServiceMonitor", "-engine")
    budget = one(manifests, "PodDisruptionBudget", "-vllm")
    assert budget["spec"]["maxUnavailable"] == 1
    assert budget["spec"]["selector"]["matchExpressions"][0]["values"] == ["vllm", "vllm-worker"]


def _check_tensor_parallel(manifests: list[dict[str, Any]], by_name: dict[str, dict[str, Any]]) -> None:
    server = by_name["vllm"]
    args = flags(server["args"])
    assert server["args"][0] == "/models/llama-3.1-70b"
    assert (args["--tensor-parallel-size"], args["--max-lora-rank"]) == ("4", "128")
    assert "--pipeline-parallel-size" not in args and "--served-model-name" not in args
    assert "vllm-agent" not in by_name  # no allow-list: nothing to fetch
    pod = one(manifests, "StatefulSet", "-vllm")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia" and pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert _volume(pod, "dshm")["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert _volume(pod, "model-cache")["persistentVolumeClaim"] == {"claimName": "models"}
    assert _mount(server, "model-cache")["mountPath"] == "/models"
    assert {v["name"] for v in pod["volumes"]} == {"dshm", "tmp", "home", "model-cache"}


def _check_multi_node(manifests: list[dict[str, Any]], by_name: dict[str, dict[str, Any]]) -> None:
    assert not find(manifests, "StatefulSet", "-vllm")
    group = one(manifests, "LeaderWorkerSet", "-vllm")
    template = group["spec"]["leaderWorkerTemplate"]
    assert (group["spec"]["replicas"], template["size"]) == (2, 2)
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    assert leader["metadata"]["labels"]["app.kubernetes.io/component"] == "vllm"  # behind the headless Service
    assert worker["metadata"]["labels"]["app.kubernetes.io/component"] == "vllm-worker"  # not
    assert [c["name"] for c in leader["spec"]["containers"]] == ["vllm", "vllm-agent"]  # the agent: leaders only
    [ray_worker] = worker["spec"]["containers"]
    assert ray_worker["name"] == "vllm-worker"
    assert "ray start --address=$(LWS_LEADER_ADDRESS):6379 --block" in ray_worker["command"][-1]
    assert "args" not in ray_worker and "readinessProbe" not in ray_worker
    for container in (by_name["vllm"], ray_worker):
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 2  # TP 2 x PP 2 over 2 pods
    args = flags(by_name["vllm"]["args"])
    assert (args["--tensor-parallel-size"], args["--pipeline-parallel-size"]) == ("2", "2")
    assert args["--distributed-executor-backend"] == "ray"
    # Every pod of a group reads adapters from the agent's path: its group's directory on the shared claim.
    for pod, container in (
        (leader["spec"], by_name["vllm"]),
        (worker["spec"], ray_worker),
        (leader["spec"], by_name["vllm-agent"]),
    ):
        assert _volume(pod, "adapter-cache")["persistentVolumeClaim"] == {"claimName": "adapter-cache"}
        assert _volume(pod, "model-cache")["persistentVolumeClaim"] == {"claimName": "models"}
        mount = _mount(container, "adapter-cache")
        assert mount["mountPath"] == "/var/cache/adapters" and mount["subPathExpr"] == "$(ADAPTER_CACHE_GROUP)"
        assert mount.get("readOnly", False) == (container["name"] != "vllm-agent")
        [group_env] = [e for e in container["env"] if e["name"] == "ADAPTER_CACHE_GROUP"]
        assert (
            group_env["valueFrom"]["fieldRef"]["fieldPath"]
            == "metadata.labels['leaderworkerset.sigs.k8s.io/group-index']"
        )
    # Ray and NCCL between the pods of the vLLM engines, the gateway to the leaders only.
    worker_policy = one(manifests, "NetworkPolicy", "-vllm-worker")
    assert worker_policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm-worker"
    [peers] = worker_policy["spec"]["ingress"]
    assert "ports" not in peers and peers["from"][0]["podSelector"]["matchExpressions"][0]["values"] == [
        "vllm",
        "vllm-worker",
    ]
    leader_rules = one(manifests, "NetworkPolicy", "-vllm")["spec"]["ingress"]
    assert [r["from"][0]["podSelector"].get("matchExpressions") is not None for r in leader_rules] == [False, True]


def _check_mixed(manifests: list[dict[str, Any]], by_name: dict[str, dict[str, Any]]) -> None:
    assert one(manifests, "StatefulSet", "-engine") and one(manifests, "StatefulSet", "-vllm")
    assert one(manifests, "Service", "-engine-headless")
    engine, agent = flags(by_name["engine"]["args"]), flags(by_name["vllm-agent"]["args"])
    shared = ("--adapter-cache-mb", "--adapter-max-mb", "--adapter-source-allow", "--adapter-load-wait-s")
    assert {k: engine[k] for k in shared} == {k: agent[k] for k in shared}  # one set of values for both kinds
    assert agent["--adapter-cache-mb"] == str(8 * 1024 - 2 * 512)
    assert {m["metadata"]["name"] for m in find(manifests, "NetworkPolicy")} >= {
        "rel-loragate-engine",
        "rel-loragate-vllm",
    }
    assert {m["metadata"]["name"] for m in find(manifests, "ServiceMonitor")} == {
        "rel-loragate-gateway",
        "rel-loragate-engine",
        "rel-loragate-vllm",
    }
    assert {m["metadata"]["name"] for m in find(manifests, "PodDisruptionBudget")} == {
        "rel-loragate-gateway",
        "rel-loragate-engine",
        "rel-loragate-vllm",
    }


CHECKS = {
    "vllm on one GPU": _check_one_gpu,
    "vllm tensor parallel 4": _check_tensor_parallel,
    "vllm TP 2 x PP 2 on 2 nodes": _check_multi_node,
    "mixed": _check_mixed,
}
