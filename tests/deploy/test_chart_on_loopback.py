"""The chart's pods, run as local processes: what proves its wiring works without a cluster.

The rendered gateway, engine (tiny-random) and Redis containers are started with their rendered command,
arguments and environment (the Secret's keys included, `$(VAR)` expanded as the kubelet does), after one
mapping: every Service name becomes 127.0.0.1 with a free port, and every volume a local directory (the
policy ConfigMap's file, the adapters, the caches). Each is awaited on its rendered readiness probe; then
one completion with an adapter goes through the gateway with a key read from the rendered Secret. The
Grafana dashboard's metric names are then checked against what the running gateway and engine export.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NAMESPACE, REPO, find, one, render, secret_values
from prometheus_client.parser import text_string_to_metric_families

from polling import poll
from processes import free_port, stop_process
from redis_server import REDIS_SERVER

ADAPTER = "support-v1"


@dataclass
class Pod:
    """One rendered container, mapped onto this machine."""

    container: dict[str, Any]
    port: int  # the local port its container port maps to
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, log: Path) -> None:
        with open(log, "ab") as out:
            self.proc = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=out, stderr=subprocess.STDOUT)

    def ready(self) -> bool:
        assert self.proc is not None and self.proc.poll() is None, f"{self.container['name']} exited"
        probe = self.container["readinessProbe"]
        if "httpGet" in probe:
            try:
                url = f"http://127.0.0.1:{self.port}{probe['httpGet']['path']}"
                return httpx.get(url, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        command = [
            shutil.which(probe["exec"]["command"][0]) or probe["exec"]["command"][0],
            "-p",
            str(self.port),
            *probe["exec"]["command"][1:],
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=10)
        return done.returncode == 0 and "PONG" in done.stdout


def _env(container: dict[str, Any], secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(secrets[source["secretRef"]["name"]])
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = item["value"]
        else:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
    return env


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion of container arguments."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


@pytest.fixture
def pods(helm: Path, tmp_path: Path, tiny_adapters: dict[str, Path]) -> Iterator[dict[str, Pod]]:
    manifests = render(
        helm,
        "--set",
        "engine.model.name=tiny-random",
        "--set",
        "engine.adapters.pvc.enabled=true",
        "--set",
        "engine.adapters.pvc.existingClaim=adapters",
        "--set",
        "metrics.dashboard.enabled=true",
        "--set",
        "engine.poolMb=64",
    )
    secrets = {s["metadata"]["name"]: secret_values(s) for s in find(manifests, "Secret")}
    containers = {
        c["name"]: c
        for m in manifests
        if m["kind"] in ("Deployment", "StatefulSet")
        for c in m["spec"]["template"]["spec"]["containers"]
    }
    ports = {name: free_port() for name in containers}
    services = {}  # "name[.ns.svc.cluster.local]:port" -> 127.0.0.1:local port
    for service in find(manifests, "Service"):
        component = service["spec"]["selector"]["app.kubernetes.io/component"]
        for port in service["spec"]["ports"]:
            name = service["metadata"]["name"]
            for host in (f"{name}.{NAMESPACE}.svc.cluster.local", f"{name}.{NAMESPACE}.svc", name):
                services[f"{host}:{port['port']}"] = f"127.0.0.1:{ports[component]}"
    # The volumes: the policy ConfigMap's file, the adapters PVC, writable caches.
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    (policy_dir / "policy.yaml").write_text(one(manifests, "ConfigMap", "-policy")["data"]["policy.yaml"])
    adapters = tmp_path / "adapters"
    shutil.copytree(tiny_adapters["all-r4"], adapters / ADAPTER)
    paths = {
        "/etc/loragate/policy/policy.yaml": str(policy_dir / "policy.yaml"),
        "/adapters": str(adapters),
        "/var/cache/loragate": str(tmp_path / "cache"),
    }
    out: dict[str, Pod] = {}
    for name, container in containers.items():
        env = _env(container, secrets)
        argv = []
        for arg in container["args"]:
            arg = _expand(arg, env)
            for service, local in services.items():
                arg = arg.replace(service, local)
            arg = paths.get(arg, arg)
            argv.append("127.0.0.1" if arg == "0.0.0.0" else arg)
        at = argv.index("--port") + 1
        assert argv[at] == str(container["ports"][0]["containerPort"]), (name, argv)
        argv[at] = str(ports[name])
        runs = {"loragate": [sys.executable, "-m", "loragate"], "redis-server": [REDIS_SERVER]}
        command = runs[container["command"][0]]
        if name == "redis":
            argv += ["--bind", "127.0.0.1"]
        env = {
            **env,
            **{k: paths.get(v, v) for k, v in env.items()},
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "HOME": str(tmp_path),
        }
        out[name] = Pod(container, ports[name], [*command, *argv], env, tmp_path)
    out["_manifests"] = manifests  # type: ignore[assignment]
    try:
        yield out
    finally:
        for pod in out.values():
            if isinstance(pod, Pod) and pod.proc is not None:
                stop_process(pod.proc)


def test_the_charts_pods_serve_a_completion_with_an_adapter(pods: dict[str, Pod], tmp_path: Path) -> None:
    manifests = pods.pop("_manifests")  # type: ignore[arg-type]
    for name in ("redis", "engine", "gateway"):  # the order the kubelet's probes would settle in
        pods[name].start(tmp_path / f"{name}.log")
        poll(pods[name].ready, 120, interval_s=0.2, what=f"{name} ready on its rendered probe")
    key = secret_values(one(manifests, "Secret"))["LORAGATE_DEV_API_KEY"]
    gateway = f"http://127.0.0.1:{pods['gateway'].port}"
    resp = poll(
        lambda: (
            (
                r := httpx.post(
                    f"{gateway}/v1/completions",
                    timeout=60,
                    json={"prompt": "The quick brown fox", "max_tokens": 4},
                    headers={"Authorization": f"Bearer {key}", "X-Adapter-ID": ADAPTER},
                )
            ).status_code
            == 200
            and r
        ),
        30,
        interval_s=0.5,
        what="a completion through the gateway",
    )
    assert resp.headers["X-Loragate-Adapter"] == ADAPTER and resp.json()["model"] == ADAPTER
    assert int(resp.headers["RateLimit-Limit"]) > 0  # limits shared through the rendered Redis
    admin_key = secret_values(one(manifests, "Secret"))["LORAGATE_ADMIN_KEY"]
    admin = httpx.get(f"{gateway}/admin/policy", timeout=30, headers={"Authorization": f"Bearer {admin_key}"})
    [upstream] = admin.json()["routing"]["upstreams"]
    assert upstream["url"] == f"http://127.0.0.1:{pods['engine'].port}"  # found through --upstream-dns

    # Every series the dashboard plots is one the running gateway and engine export.
    exported: set[str] = set()
    for pod in (pods["gateway"], pods["engine"]):
        text = httpx.get(f"http://127.0.0.1:{pod.port}/metrics", timeout=30).text
        for family in text_string_to_metric_families(text):
            exported.add(family.name)
            exported.update(sample.name for sample in family.samples)
    dashboard = json.loads(one(manifests, "ConfigMap", "-dashboard")["data"]["loragate.json"])
    used = {
        name
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])  # a row panel has none
        for name in re.findall(r"\bloragate_[a-z_]+", target["expr"])
    }
    used |= set(re.findall(r"\bloragate_[a-z_]+", json.dumps(dashboard["templating"])))
    assert len(used) >= 15
    missing = sorted(
        n for n in used if n not in exported and re.sub(r"_(bucket|count|sum|total)$", "", n) not in exported
    )
    assert not missing, missing
