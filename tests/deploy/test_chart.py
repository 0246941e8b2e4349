"""The chart (helm/loragate) with the real helm binary and its loragate engines (`engine.kind` loragate, the
default): `helm lint --strict`, `helm template` with the default values and eight other value sets, every
manifest validated by kubernetes-validate against Kubernetes 1.30 (strict: unknown fields are errors) and the
custom resources checked for their required fields (tests/deploy/chart_checks.py), values.schema.json refusing
bad values, the fetched-adapter cache's bound derived from its emptyDir's sizeLimit (and refused where the
kubelet would evict the pod), and the rendered containers' arguments parsed by the `loragate` CLI's own parser.
The vLLM engines are tests/deploy/test_chart_vllm.py's.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from chart_checks import containers, validate, values_file
from conftest import CHART, NAMESPACE, REPO, find, helm_template, one, render, secret_values

from gateway.discovery import DnsUpstreams
from gateway.engine_kinds import EngineKind
from loragate.cli import build_parser
from loragate_common.adapter_sources import AllowList

VALUE_SETS: dict[str, dict[str, Any]] = {
    "external redis by url": {"redis": {"enabled": False, "url": "redis://redis.shared.svc:6379/2"}},
    "external redis from a secret": {
        "redis": {"enabled": False, "existingSecret": "redis-conn", "existingSecretKey": "url"}
    },
    "autoscaling and observability": {
        "gateway": {"autoscaling": {"enabled": True, "maxReplicas": 6}},
        "engine": {"autoscaling": {"enabled": True, "maxReplicas": 8}, "keda": {"enabled": True}},
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
            "dashboard": {"enabled": True},
        },
    },
    "three GPU engines": {
        "engine": {
            "replicas": 3,
            "gpu": {"enabled": True, "count": 1},
            "runtimeClassName": "nvidia",
            "dtype": "bfloat16",
            "shmSizeLimit": "8Gi",
            "criticalInterrupts": False,
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "affinity": {
                "podAntiAffinity": {
                    "preferredDuringSchedulingIgnoredDuringExecution": [
                        {
                            "weight": 100,
                            "podAffinityTerm": {
                                "topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}},
                            },
                        }
                    ]
                }
            },
            "topologySpreadConstraints": [
                {
                    "maxSkew": 1,
                    "topologyKey": "topology.kubernetes.io/zone",
                    "whenUnsatisfiable": "ScheduleAnyway",
                    "labelSelector": {"matchLabels": {"app.kubernetes.io/component": "engine"}},
                }
            ],
        }
    },
    "existing policy and keys": {
        "policy": {"existingConfigMap": "my-policy"},
        "secrets": {"existingSecret": "my-keys"},
    },
    "network policy and routes": {
        "networkPolicy": {"enabled": True, "allowMetricsFrom": {"kubernetes.io/metadata.name": "monitoring"}},
        "httpRoute": {
            "enabled": True,
            "parentRefs": [{"name": "edge", "namespace": "gateway-system"}],
            "hostnames": ["llm.example.com"],
        },
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "tls": [{"secretName": "llm-tls", "hosts": ["loragate.example.com"]}],
        },
    },
    "adapters fetched from an object store and the Hub": {
        "engine": {
            "adapters": {
                "sources": {"allow": ["hf://my-org/", "s3://adapters/prod/"]},  # the bucket's prefix: once
                "cache": {"sizeLimit": "8Gi"},
                "maxMb": 512,
                "fetchTimeoutSeconds": 120,
                "loadWaitSeconds": 2.5,
            }
        },
        "objectStore": {
            "endpoint": "http://minio.storage.svc:9000",
            "region": "eu-west-1",
            "bucket": "adapters",
            "prefix": "prod",
            "credentialsSecret": "adapter-store",
            "secretAccessKeyKey": "secret-key",
        },
        "huggingface": {"endpoint": "https://hub.example.com", "tokenSecret": "hub-token"},
    },
    "adapters and a model on volumes": {
        "engine": {
            "model": {"pvc": {"claimName": "models", "path": "llama-3.2-1b"}, "servedModelName": "llama-3.2-1b"},
            "adapters": {
                "pvc": {"enabled": True, "create": True, "size": "50Gi", "storageClassName": "efs"},
                "fromImage": {"enabled": False},
            },
        }
    },
}


def test_lint_strict(helm: Path) -> None:
    done = subprocess.run([str(helm), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 chart(s) failed" in done.stdout


def test_default_values_render_valid_manifests(default_manifests: list[dict[str, Any]]) -> None:
    validate(default_manifests)
    kinds = sorted({m["kind"] for m in default_manifests})
    assert kinds == [
        "ConfigMap",
        "Deployment",
        "PersistentVolumeClaim",  # Redis's append-only file: the adapter catalog and the usage ledger
        "Pod",
        "PodDisruptionBudget",
        "Secret",
        "Service",
        "ServiceAccount",
        "StatefulSet",
    ]
    engine = one(default_manifests, "StatefulSet", "-engine")
    headless = one(default_manifests, "Service", "-engine-headless")
    assert headless["spec"]["clusterIP"] == "None" and engine["spec"]["serviceName"] == headless["metadata"]["name"]
    gateway = one(default_manifests, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert gateway["terminationGracePeriodSeconds"] > 30  # above the gateway's 30 s drain
    [policy_volume] = [v for v in gateway["volumes"] if v["name"] == "policy"]
    [policy_mount] = [m for m in gateway["containers"][0]["volumeMounts"] if m["name"] == "policy"]
    assert "configMap" in policy_volume and "subPath" not in policy_mount  # a directory: hot reload works
    for manifest in find(default_manifests, "Deployment") + find(default_manifests, "StatefulSet"):
        pod = manifest["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for container in pod["containers"]:
            context = container["securityContext"]
            assert context["readOnlyRootFilesystem"] and not context["allowPrivilegeEscalation"]
            assert context["capabilities"]["drop"] == ["ALL"]
    probes = containers(default_manifests)["engine"]
    assert "--no-critical-interrupts" not in probes["args"]  # on by default
    assert probes["startupProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert probes["readinessProbe"]["httpGet"]["path"] == "/readyz"
    # No adapters volume, no fetching and no credentials unless asked for: the engine serves the base model.
    assert not find(default_manifests, "PersistentVolumeClaim", "-adapters")
    engine_pod = engine["spec"]["template"]["spec"]
    assert {v["name"] for v in engine_pod["volumes"]} == {"cache", "tmp", "dshm"}
    assert not [a for a in probes["args"] if a in ("--adapter-dir", "--adapter-cache-dir", "--adapter-source-allow")]
    assert {e["name"]: e.get("value") for e in probes["env"]} == {
        "LORAGATE_CACHE": "/var/cache/loragate",
        "HF_HUB_OFFLINE": "1",
    }
    assert not [
        m
        for m in default_manifests
        if "checksum/policy" in (m.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {})
    ]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_value_sets_render_valid_manifests(helm: Path, tmp_path: Path, name: str) -> None:
    manifests = render(helm, "-f", values_file(tmp_path, name, VALUE_SETS[name]))
    validate(manifests)
    kinds = {m["kind"] for m in manifests}
    by_name = containers(manifests)
    gateway_args, gateway_env = by_name["gateway"]["args"], by_name["gateway"].get("env", [])
    if name.startswith("external redis"):
        assert not find(manifests, "Deployment", "-redis") and "--redis" in gateway_args
        [redis_env] = [e for e in gateway_env if e["name"] == "LORAGATE_REDIS_URL"]
        assert ("secretKeyRef" in redis_env.get("valueFrom", {})) == name.endswith("secret")
    elif name == "autoscaling and observability":
        assert {"HorizontalPodAutoscaler", "ScaledObject", "ServiceMonitor"} <= kinds
        assert len(find(manifests, "ServiceMonitor")) == 2 and len(find(manifests, "HorizontalPodAutoscaler")) == 2
        engine_hpa = one(manifests, "HorizontalPodAutoscaler", "-engine")
        assert engine_hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "loragate_engine_requests_waiting"
        assert "replicas" not in one(manifests, "StatefulSet")["spec"]  # the autoscaler owns it
        assert one(manifests, "ConfigMap", "-dashboard")["metadata"]["labels"]["grafana_dashboard"] == "1"
    elif name == "three GPU engines":
        statefulset = one(manifests, "StatefulSet")
        pod = statefulset["spec"]["template"]["spec"]
        assert statefulset["spec"]["replicas"] == 3 and pod["runtimeClassName"] == "nvidia"
        assert by_name["engine"]["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert by_name["engine"]["args"][by_name["engine"]["args"].index("--device") + 1] == "cuda"
        assert "--no-critical-interrupts" in by_name["engine"]["args"]
        assert pod["tolerations"][0]["key"] == "nvidia.com/gpu" and pod["topologySpreadConstraints"]
        [shm] = [v for v in pod["volumes"] if v["name"] == "dshm"]
        assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    elif name == "existing policy and keys":
        assert not find(manifests, "Secret") and not find(manifests, "ConfigMap")
        pod = one(manifests, "Deployment", "-gateway")["spec"]["template"]["spec"]
        assert [v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "policy"] == ["my-policy"]
        assert by_name["gateway"]["envFrom"] == [{"secretRef": {"name": "my-keys"}}]
    elif name == "network policy and routes":
        assert {"NetworkPolicy", "HTTPRoute", "Ingress"} <= kinds
        engine_policy = one(manifests, "NetworkPolicy", "-engine")
        [rule] = engine_policy["spec"]["ingress"]
        assert rule["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "gateway"
    elif name == "adapters fetched from an object store and the Hub":
        _check_fetching(manifests, by_name)
    elif name == "adapters and a model on volumes":
        claim = one(manifests, "PersistentVolumeClaim", "-adapters")
        assert claim["spec"]["resources"]["requests"]["storage"] == "50Gi"
        args = by_name["engine"]["args"]
        assert args[args.index("--model") + 1] == "/models/llama-3.2-1b"
        assert args[args.index("--adapter-dir") + 1] == "/adapters"


def _check_fetching(manifests: list[dict[str, Any]], by_name: dict[str, dict[str, Any]]) -> None:
    """The engine of "adapters fetched from an object store and the Hub": its fetch flags, the cache emptyDir
    they point into, and the store's environment (on the engine only)."""
    assert not find(manifests, "PersistentVolumeClaim", "-adapters")
    engine = by_name["engine"]
    args = engine["args"]
    assert "--adapter-dir" not in args  # no adapters volume: the pod starts empty
    flag = {a: args[args.index(a) + 1] for a in args if a.startswith("--adapter-")}
    assert flag == {
        "--adapter-cache-dir": "/var/cache/adapters",
        "--adapter-cache-mb": str(8 * 1024 - 2 * 512),  # the sizeLimit less room for two downloads
        "--adapter-max-mb": "512",
        "--adapter-fetch-timeout-s": "120",
        "--adapter-load-wait-s": "2.5",
        "--adapter-source-allow": "s3://adapters/prod/",
    }
    at = args.index("--adapter-source-allow")  # objectStore.bucket and .prefix first, then sources.allow
    assert args[at + 1 : at + 3] == ["s3://adapters/prod/", "hf://my-org/"] and args[at + 3].startswith("--")
    pod = one(manifests, "StatefulSet", "-engine")["spec"]["template"]["spec"]
    [cache] = [v for v in pod["volumes"] if v["name"] == "adapter-cache"]
    assert cache["emptyDir"] == {"sizeLimit": "8Gi"}
    [mount] = [m for m in engine["volumeMounts"] if m["name"] == "adapter-cache"]
    assert mount["mountPath"] == flag["--adapter-cache-dir"] and not mount.get("readOnly")
    assert {v["name"] for v in pod["volumes"]} == {"cache", "tmp", "dshm", "adapter-cache"}
    env = {e["name"]: e for e in engine["env"]}
    assert {name: env[name].get("value") for name in env if "value" in env[name]} == {
        "LORAGATE_CACHE": "/var/cache/loragate",
        "HF_HUB_OFFLINE": "0",  # an hf:// source is allowed
        "AWS_ENDPOINT_URL": "http://minio.storage.svc:9000",
        "AWS_REGION": "eu-west-1",
        "AWS_DEFAULT_REGION": "eu-west-1",
        "HF_ENDPOINT": "https://hub.example.com",
    }
    secret_refs = {name: item["valueFrom"]["secretKeyRef"] for name, item in env.items() if "valueFrom" in item}
    assert secret_refs == {
        "AWS_ACCESS_KEY_ID": {"name": "adapter-store", "key": "AWS_ACCESS_KEY_ID"},
        "AWS_SECRET_ACCESS_KEY": {"name": "adapter-store", "key": "secret-key"},
        "HF_TOKEN": {"name": "hub-token", "key": "HF_TOKEN"},
    }
    gateway_env = {e["name"] for e in by_name["gateway"].get("env", [])}
    assert not {n for n in gateway_env if n.startswith(("AWS_", "HF_"))}  # the gateway never fetches


@pytest.mark.parametrize(
    "size_limit, max_mb, cache_mb, expected",
    [
        ("20Gi", None, None, 20 * 1024 - 2 * 1024),  # the defaults
        ("30G", 256, None, 30 * 10**9 // 2**20 - 2 * 256),  # a decimal quantity
        ("1Ti", None, None, 2**20 - 2 * 1024),
        ("6144Mi", 1024, 5000, 5000),  # set explicitly
    ],
)
def test_the_adapter_cache_bound_follows_its_size_limit(
    helm: Path, size_limit: str, max_mb: int | None, cache_mb: int | None, expected: int
) -> None:
    values = [
        "--set",
        "engine.adapters.sources.allow={s3://a/}",
        "--set",
        f"engine.adapters.cache.sizeLimit={size_limit}",
    ]
    values += ["--set", f"engine.adapters.maxMb={max_mb}"] if max_mb is not None else []
    values += ["--set", f"engine.adapters.cache.mb={cache_mb}"] if cache_mb is not None else []
    args = containers(render(helm, *values))["engine"]["args"]
    assert args[args.index("--adapter-cache-mb") + 1] == str(expected)


@pytest.mark.parametrize(
    "values, complaint",
    [
        (["--set", "engine.adapters.cache.sizeLimit=2Gi"], "cannot hold an adapter of engine.adapters.maxMb"),
        (["--set", "engine.adapters.cache.mb=20480"], "must be below engine.adapters.cache.sizeLimit"),
        (["--set", "engine.adapters.maxMb=4096", "--set", "engine.adapters.cache.mb=2048"], "cannot hold"),
    ],
)
def test_the_chart_refuses_an_adapter_cache_the_kubelet_would_evict(
    helm: Path, values: list[str], complaint: str
) -> None:
    done = helm_template(helm, "--set", "engine.adapters.sources.allow={s3://a/}", *values)
    assert done.returncode != 0 and complaint in done.stderr, done.stderr


@pytest.mark.parametrize(
    "values, complaint",
    [
        (["--set", "gateway.replicas=two"], "gateway.replicas"),
        (["--set", "engine.device=tpu"], "engine.device"),
        (["--set", "engine.criticalInterrupts=sometimes"], "engine.criticalInterrupts"),
        (["--set", "colour=red"], "colour"),
        (["--set", "gateway.terminationGracePeriodSeconds=10"], "gateway.terminationGracePeriodSeconds"),
        (["--set", "redis.url=http://not-redis"], "redis.url"),
        (["--set-json", 'engine.gpu={"enabled": true, "count": 0}'], "engine.gpu.count"),
        (["--set", "engine.adapters.sources.allow={ftp://mirror/lora/}"], "engine.adapters.sources.allow.0"),
        (["--set", "engine.adapters.cache.sizeLimit=1.5Gi"], "engine.adapters.cache.sizeLimit"),
        (["--set", "engine.adapters.loadWaitSeconds=0"], "engine.adapters.loadWaitSeconds"),
        (["--set", "objectStore.endpoint=minio:9000"], "objectStore.endpoint"),
        (["--set", "objectStore.credentialsSecret=My_Keys"], "objectStore.credentialsSecret"),
        (["--set", "objectStore.bucket=My_Bucket"], "objectStore.bucket"),
        (["--set", "objectStore.prefix=team/../other"], "objectStore.prefix"),
        (["--set", "objectStore.prefix=/team"], "objectStore.prefix"),
        (["--set", "huggingface.token=hf_abc"], "Additional property token is not allowed"),
    ],
)
def test_the_values_schema_refuses_bad_values(helm: Path, values: list[str], complaint: str) -> None:
    done = helm_template(helm, *values)
    assert done.returncode != 0
    assert "values don't meet the specifications of the schema" in done.stderr and complaint in done.stderr, done.stderr


@pytest.mark.parametrize("name", ["default", *sorted(VALUE_SETS)])
def test_rendered_commands_parse_with_the_cli_and_the_policy_checks(helm: Path, tmp_path: Path, name: str) -> None:
    values = [] if name == "default" else ["-f", values_file(tmp_path, name, VALUE_SETS[name])]
    manifests = render(helm, *values)
    parser = build_parser()
    pod_dirs = {"/adapters": tmp_path}  # directories the CLI checks exist: the pod's volume, here a local one
    for container in containers(manifests).values():
        if container["command"] != ["loragate"]:
            continue
        argv = [str(pod_dirs.get(arg, arg)) for arg in container["args"]]
        args = parser.parse_args(argv)  # exits (a failure) on an argument the CLI does not know
        assert args.command == container["name"]
        if args.command == "engine":  # the allow-list, whole, as the engine reads it
            values = VALUE_SETS.get(name, {})
            store = values.get("objectStore", {})
            bucket = [f"s3://{store['bucket']}/{store['prefix']}/"] if store.get("bucket") else []
            allow = values.get("engine", {}).get("adapters", {}).get("sources", {}).get("allow", [])
            assert args.adapter_source_allow == bucket + [a for a in allow if a not in bucket]
            AllowList(args.adapter_source_allow)  # each one a prefix the engine accepts
        if args.command == "gateway":  # the loragate engines' Service only, as gateway/discovery.py reads it
            [target] = [DnsUpstreams.from_target(text) for text in args.upstream_dns]
            assert (target.kind, target.port, target.agent_port) == (EngineKind.LORAGATE, 8001, None)
            assert target.name == f"rel-loragate-engine-headless.{NAMESPACE}.svc.cluster.local"
            assert args.host == "0.0.0.0"
    for config in find(manifests, "ConfigMap", "-policy"):
        policy = tmp_path / "policy.yaml"
        policy.write_text(config["data"]["policy.yaml"])
        done = subprocess.run(
            [sys.executable, "-m", "loragate", "policy", "check", str(policy)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0 and done.stdout.startswith("ok: "), done.stderr


def test_generated_keys_fill_every_env_key_the_policy_reads(default_manifests: list[dict[str, Any]]) -> None:
    keys = secret_values(one(default_manifests, "Secret"))
    policy = yaml.safe_load(one(default_manifests, "ConfigMap", "-policy")["data"]["policy.yaml"])
    referenced = {
        key.removeprefix("env:") for tenant in policy["tenants"] for key in tenant["api_keys"] if key.startswith("env:")
    } | {k.removeprefix("env:") for k in policy["admin_keys"]}
    assert referenced <= set(keys) and all(len(keys[name]) >= 32 for name in referenced)


def test_the_rendered_policy_equals_the_default_policy_file(default_manifests: list[dict[str, Any]]) -> None:
    """The chart's default policy and policies/default.yaml (what `loragate up` runs) say the same."""
    rendered = yaml.safe_load(one(default_manifests, "ConfigMap", "-policy")["data"]["policy.yaml"])
    assert rendered == yaml.safe_load((REPO / "policies" / "default.yaml").read_text())


def test_the_charts_redis_keeps_the_catalog_on_a_volume_unless_told_not_to(helm: Path) -> None:
    """The adapter catalog and the usage ledger live in Redis: by default it appends every write to a file on a
    PersistentVolumeClaim; without persistence it runs on an emptyDir with no file, as before."""
    persisted = render(helm)
    redis = one(persisted, "Deployment", "-redis")
    container = redis["spec"]["template"]["spec"]["containers"][0]
    args = container["args"]
    assert args[args.index("--appendonly") + 1] == "yes" and "--appendfsync" in args
    claim = one(persisted, "PersistentVolumeClaim", "-redis-data")
    [volume] = redis["spec"]["template"]["spec"]["volumes"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and redis["spec"]["strategy"]["type"] == "Recreate"
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/data"}

    ephemeral = render(helm, "--set", "redis.persistence.enabled=false")
    redis = one(ephemeral, "Deployment", "-redis")
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--appendonly") + 1] == "no"
    assert redis["spec"]["template"]["spec"]["volumes"][0]["emptyDir"] == {}
    assert not find(ephemeral, "PersistentVolumeClaim", "-redis-data")

    existing = render(helm, "--set", "redis.persistence.existingClaim=shared-redis")
    redis = one(existing, "Deployment", "-redis")
    assert redis["spec"]["template"]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "shared-redis"
    assert not find(existing, "PersistentVolumeClaim", "-redis-data")
