"""The chart's pods, run as local processes: what proves its wiring works without a cluster.

The rendered gateway, engine (tiny-random) and Redis containers are started with their rendered command,
arguments and environment (the Secret's keys included, `$(VAR)` expanded as the kubelet does), after one
mapping: every Service name becomes 127.0.0.1 with a free port, and every volume a local directory (the
policy ConfigMap's file, the adapters, the caches). Each is awaited on its rendered readiness probe; then
one completion with an adapter goes through the gateway with a key read from the rendered Secret. The
Grafana dashboard's metric names are then checked against what the running gateway and engine export.

A second rendering has no adapters volume at all: the engine starts empty, with `objectStore.endpoint` on a
real S3-compatible server on loopback (moto_server), `objectStore.bucket` and `.prefix` its allow-list, and
the store's keys from an existing Secret; an
adapter uploaded there and registered in the gateway's catalog is then fetched and served on first use
(its first request, with a 10 ms load wait, is usually answered 503 adapter_loading and retried as its
Retry-After says).
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import NAMESPACE, REPO, find, one, render, secret_values
from prometheus_client.parser import text_string_to_metric_families

from adapter_servers import ADAPTER_FILES, MotoServer, moto_server_fixture
from polling import poll
from processes import free_port, stop_process
from redis_server import REDIS_SERVER

ADAPTER = "support-v1"
BUCKET, PREFIX = "adapters", "tenants/acme/support"
CATALOG_ID = "support-s3"
STORE_KEYS = {"AWS_ACCESS_KEY_ID": "loopback-key-id", "AWS_SECRET_ACCESS_KEY": "loopback-secret"}

moto = moto_server_fixture(scope="function")


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


def _local_pods(
    manifests: list[dict[str, Any]], tmp_path: Path, secrets: dict[str, dict[str, str]], paths: dict[str, str]
) -> dict[str, Pod]:
    """The rendered containers as local processes (not started): Service names -> 127.0.0.1 and free ports,
    `paths` (container path -> local path) and every emptyDir mount -> a fresh local directory."""
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
    empty_dirs = _empty_dirs(manifests, tmp_path / "volumes")
    out: dict[str, Pod] = {}
    for name, container in containers.items():
        env = _env(container, secrets)
        local_paths = {**empty_dirs[name], **paths}
        argv = []
        for arg in container["args"]:
            arg = _expand(arg, env)
            for service, local in services.items():
                arg = arg.replace(service, local)
            arg = local_paths.get(arg, arg)
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
            **{k: local_paths.get(v, v) for k, v in env.items()},
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(REPO),
            "HOME": str(tmp_path),
        }
        out[name] = Pod(container, ports[name], [*command, *argv], env, tmp_path)
    return out


def _empty_dirs(manifests: list[dict[str, Any]], root: Path) -> dict[str, dict[str, str]]:
    """{container: {mount path: ROOT/workload/volume}} for every emptyDir a rendered container mounts (the
    directories are created: a pod's emptyDir exists, empty, when its containers start)."""
    out: dict[str, dict[str, str]] = {}
    for manifest in manifests:
        if manifest["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = manifest["spec"]["template"]["spec"]
        empty = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
        for container in pod["containers"]:
            mounts = out.setdefault(container["name"], {})
            for mount in container.get("volumeMounts", []):
                if mount["name"] in empty:
                    local = root / manifest["metadata"]["name"] / mount["name"]
                    local.mkdir(parents=True, exist_ok=True)
                    mounts[mount["mountPath"]] = str(local)
    return out


def _start(pods: dict[str, Pod], tmp_path: Path) -> None:
    for name in ("redis", "engine", "gateway"):  # the order the kubelet's probes would settle in
        pods[name].start(tmp_path / f"{name}.log")
        poll(pods[name].ready, 120, interval_s=0.2, what=f"{name} ready on its rendered probe")


def _stop(pods: dict[str, Pod]) -> None:
    for pod in pods.values():
        if pod.proc is not None:
            stop_process(pod.proc)


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
    # The volumes: the policy ConfigMap's file, the adapters PVC (the emptyDirs: _local_pods).
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    (policy_dir / "policy.yaml").write_text(one(manifests, "ConfigMap", "-policy")["data"]["policy.yaml"])
    adapters = tmp_path / "adapters"
    shutil.copytree(tiny_adapters["all-r4"], adapters / ADAPTER)
    paths = {"/etc/loragate/policy/policy.yaml": str(policy_dir / "policy.yaml"), "/adapters": str(adapters)}
    out = _local_pods(manifests, tmp_path, secrets, paths)
    out["_manifests"] = manifests  # type: ignore[assignment]
    try:
        yield out
    finally:
        _stop({k: v for k, v in out.items() if isinstance(v, Pod)})


def test_the_charts_pods_serve_a_completion_with_an_adapter(pods: dict[str, Pod], tmp_path: Path) -> None:
    manifests = pods.pop("_manifests")  # type: ignore[arg-type]
    _start(pods, tmp_path)
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


@pytest.fixture
def fetching_pods(helm: Path, tmp_path: Path, moto: MotoServer) -> Iterator[tuple[dict[str, Pod], list[Any]]]:
    """The chart with adapters fetched from the S3 API of `moto` and no adapters volume (not started)."""
    manifests = render(
        helm,
        "--set",
        "engine.model.name=tiny-random",
        "--set",
        "engine.poolMb=64",
        "--set",
        f"objectStore.bucket={BUCKET}",  # s3://adapters/tenants/ is then the engines' allow-list
        "--set",
        "objectStore.prefix=tenants",
        "--set",
        "engine.adapters.cache.sizeLimit=1Gi",
        "--set",
        "engine.adapters.maxMb=64",
        "--set-json",
        "engine.adapters.loadWaitSeconds=0.01",  # the first request likely gets 503 adapter_loading
        "--set",
        f"objectStore.endpoint={moto.url}",
        "--set",
        "objectStore.region=us-east-1",
        "--set",
        "objectStore.credentialsSecret=adapter-store",
    )
    secrets = {s["metadata"]["name"]: secret_values(s) for s in find(manifests, "Secret")}
    secrets["adapter-store"] = STORE_KEYS  # the cluster's own Secret, which the chart only names
    policy_dir = tmp_path / "policy"
    policy_dir.mkdir()
    (policy_dir / "policy.yaml").write_text(one(manifests, "ConfigMap", "-policy")["data"]["policy.yaml"])
    out = _local_pods(
        manifests, tmp_path, secrets, {"/etc/loragate/policy/policy.yaml": str(policy_dir / "policy.yaml")}
    )
    try:
        yield out, manifests
    finally:
        _stop(out)


def _content_digest(directory: Path) -> str:
    """sha256 of what `sha256sum adapter_config.json adapter_model.safetensors` prints (the real binary)."""
    listing = subprocess.run(["sha256sum", *ADAPTER_FILES], cwd=directory, capture_output=True, check=True).stdout
    return hashlib.sha256(listing).hexdigest()


def _complete(gateway: str, key: str, adapter: str | None, timeout_s: float = 90) -> httpx.Response:
    """One greedy completion (with `adapter`: retried while the engine answers 503 adapter_loading, after
    its Retry-After, for at most `timeout_s`)."""
    headers = {"Authorization": f"Bearer {key}", **({"X-Adapter-ID": adapter} if adapter else {})}
    body = {"prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0}
    deadline = time.monotonic() + timeout_s
    while True:
        resp = httpx.post(f"{gateway}/v1/completions", timeout=60, json=body, headers=headers)
        if resp.status_code != 503 or resp.headers.get("X-Loragate-Reason") != "adapter_loading":
            return resp
        assert time.monotonic() < deadline, f"still adapter_loading after {timeout_s:g} s: {resp.text}"
        time.sleep(min(float(resp.headers["Retry-After"]), 5.0))


def test_an_empty_engine_fetches_a_catalog_adapter_from_the_object_store(
    fetching_pods: tuple[dict[str, Pod], list[Any]], moto: MotoServer, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    pods, manifests = fetching_pods
    engine_pod = one(manifests, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    assert "adapters" not in {v["name"] for v in engine_pod["volumes"]}
    assert "--adapter-dir" not in pods["engine"].argv
    argv = pods["engine"].argv
    assert argv[argv.index("--adapter-source-allow") + 1] == f"s3://{BUCKET}/tenants/"
    assert pods["engine"].env["AWS_ENDPOINT_URL"] == moto.url
    assert pods["engine"].env["AWS_ACCESS_KEY_ID"] == STORE_KEYS["AWS_ACCESS_KEY_ID"]  # through secretKeyRef
    adapter = tiny_adapters["all-r4"]
    digest = _content_digest(adapter)
    # Every file PEFT saved (README.md too), uploaded with other keys than the engine's (moto takes any).
    source = moto.put_adapter(BUCKET, PREFIX, adapter) + "/"
    _start(pods, tmp_path)
    engine = f"http://127.0.0.1:{pods['engine'].port}"
    assert httpx.get(f"{engine}/v1/adapters", timeout=30).json()["data"] == []  # the pod starts empty

    keys = secret_values(one(manifests, "Secret"))
    gateway = f"http://127.0.0.1:{pods['gateway'].port}"
    registered = httpx.post(
        f"{gateway}/admin/adapters",
        timeout=30,
        json={"id": CATALOG_ID, "source": source, "sha256": digest},
        headers={"Authorization": f"Bearer {keys['LORAGATE_ADMIN_KEY']}"},
    )
    assert registered.status_code in (200, 201), registered.text
    resp = _complete(gateway, keys["LORAGATE_DEV_API_KEY"], CATALOG_ID)
    assert resp.status_code == 200, (resp.status_code, resp.headers.get("X-Loragate-Reason"), resp.text)
    assert resp.headers["X-Loragate-Adapter"].split("@")[0] == CATALOG_ID
    base = _complete(gateway, keys["LORAGATE_DEV_API_KEY"], None)
    assert base.status_code == 200, base.text
    # The fetched weights are applied: this adapter changes greedy output from the first tokens on.
    assert resp.json()["choices"][0]["text"] != base.json()["choices"][0]["text"]

    cards = httpx.get(f"{engine}/v1/adapters", timeout=30).json()["data"]
    [card] = [c for c in cards if c["id"].split("@")[0] == CATALOG_ID]
    assert card["id"] == f"{CATALOG_ID}@1"  # the catalog's first version
    assert card["source"].rstrip("/") == source.rstrip("/") and card["sha256"] == digest
    assert card["state"] in ("host", "device")
    # ... from the rendered cache emptyDir (here a local directory), under its content digest.
    cached = Path(argv[argv.index("--adapter-cache-dir") + 1]) / digest
    for name in ADAPTER_FILES:
        assert (cached / name).read_bytes() == (adapter / name).read_bytes()
