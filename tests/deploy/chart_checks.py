"""Checks shared by the chart's tests: every rendered manifest validated by kubernetes-validate against Kubernetes
1.30 (strict: unknown fields are errors), the custom resources checked for what their CRDs require, and the
rendered containers by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from gateway.discovery import DnsUpstreams

K8S_VERSION = "1.30"
CRDS = {"ServiceMonitor", "ScaledObject", "HTTPRoute", "LeaderWorkerSet"}


def values_file(tmp_path: Path, name: str, values: dict[str, Any]) -> str:
    path = tmp_path / f"{name.replace(' ', '-')}.yaml"
    path.write_text(yaml.safe_dump(values))
    return str(path)


def validate(manifests: list[dict[str, Any]]) -> None:
    """Every built-in resource against Kubernetes' own schemas; custom resources for what their CRDs
    require."""
    for manifest in manifests:
        if manifest["kind"] in CRDS:
            check_custom(manifest)
            continue
        kubernetes_validate.validate(manifest, K8S_VERSION, strict=True)


def check_custom(manifest: dict[str, Any]) -> None:
    spec = manifest["spec"]
    kind = manifest["kind"]
    if kind == "ServiceMonitor":
        assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
        assert spec["selector"]["matchLabels"] and all(e["path"] == "/metrics" for e in spec["endpoints"])
        ports = [endpoint["port"] for endpoint in spec["endpoints"]]
        vllm = spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == "vllm"
        assert ports == ["http"] or (vllm and ports == ["http", "agent"])  # a vLLM server's agent has its own
    elif kind == "ScaledObject":
        assert manifest["apiVersion"] == "keda.sh/v1alpha1"
        assert spec["scaleTargetRef"]["name"] and spec["scaleTargetRef"]["kind"] == "StatefulSet"
        [trigger] = spec["triggers"]
        assert trigger["type"] == "prometheus"
        assert {"serverAddress", "query", "threshold"} <= set(trigger["metadata"])
        assert "loragate_engine_requests_waiting" in trigger["metadata"]["query"]
    elif kind == "HTTPRoute":
        assert manifest["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert spec["parentRefs"] and all(ref["name"] for ref in spec["parentRefs"])
        for rule in spec["rules"]:
            for ref in rule["backendRefs"]:
                assert ref["name"] and isinstance(ref["port"], int)
    elif kind == "LeaderWorkerSet":
        _check_leader_worker_set(manifest)


def _check_leader_worker_set(manifest: dict[str, Any]) -> None:
    """What leaderworkerset.x-k8s.io/v1's CRD requires (a workerTemplate; size, restartPolicy and startupPolicy
    within their enums), and both pod templates against Kubernetes' PodTemplate schema."""
    assert manifest["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = manifest["spec"]
    template = spec["leaderWorkerTemplate"]
    assert isinstance(spec.get("replicas", 1), int) and spec.get("replicas", 1) >= 0
    assert spec.get("startupPolicy", "LeaderCreated") in ("LeaderCreated", "LeaderReady")
    assert isinstance(template["size"], int) and template["size"] >= 1
    assert template.get("restartPolicy", "RecreateGroupOnPodRestart") in ("RecreateGroupOnPodRestart", "None")
    assert set(template) <= {"leaderTemplate", "workerTemplate", "size", "restartPolicy", "subGroupPolicy"}
    for role in ("leaderTemplate", "workerTemplate"):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": role.lower()}}
        kubernetes_validate.validate({**pod_template, "template": template[role]}, K8S_VERSION, strict=True)


def pod_specs(manifests: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every pod spec the workloads render: Deployments', StatefulSets' and both of a LeaderWorkerSet's."""
    specs = []
    for manifest in manifests:
        if manifest["kind"] in ("Deployment", "StatefulSet"):
            specs.append(manifest["spec"]["template"]["spec"])
        elif manifest["kind"] == "LeaderWorkerSet":
            template = manifest["spec"]["leaderWorkerTemplate"]
            specs += [template["leaderTemplate"]["spec"], template["workerTemplate"]["spec"]]
    return specs


def containers(manifests: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {container["name"]: container for pod in pod_specs(manifests) for container in pod["containers"]}


def flags(args: list[str]) -> dict[str, str | None]:
    """`--flag value` and bare `--flag` arguments as {flag: value or None} (a flag given twice: the last)."""
    out: dict[str, str | None] = {}
    for at, arg in enumerate(args):
        if arg.startswith("--"):
            following = args[at + 1] if at + 1 < len(args) else None
            out[arg] = None if following is None or following.startswith("--") else following
    return out


def component(manifest: dict[str, Any]) -> str | None:
    return manifest["metadata"].get("labels", {}).get("app.kubernetes.io/component")


def dns_upstreams(by_name: dict[str, dict[str, Any]]) -> list[DnsUpstreams]:
    """The gateway container's `--upstream-dns` values, as gateway/discovery.py reads them."""
    args = by_name["gateway"]["args"]
    return [DnsUpstreams.from_target(args[at + 1]) for at, arg in enumerate(args) if arg == "--upstream-dns"]
