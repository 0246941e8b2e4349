"""The vLLM value sets the chart's tests render (tests/deploy/test_chart_vllm.py and test_chart_vllm_commands.py):
one GPU, tensor parallel 4, tensor 2 x pipeline 2 over two nodes (a LeaderWorkerSet), and both engine kinds at once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from chart_checks import values_file
from conftest import NAMESPACE, render

HEADLESS = f"rel-loragate-vllm-headless.{NAMESPACE}.svc.cluster.local"
ENGINE_HEADLESS = f"rel-loragate-engine-headless.{NAMESPACE}.svc.cluster.local"

VLLM_SETS: dict[str, dict[str, Any]] = {
    "vllm on one GPU": {
        "engine": {"kind": "vllm", "adapters": {"sources": {"allow": ["hf://my-org/"]}}},
        "vllm": {
            "model": "meta-llama/Llama-3.1-8B-Instruct",
            "servedModelName": "llama-3.1-8b",
            "replicas": 2,
            "dtype": "bfloat16",
            "maxModelLen": 8192,
            "extraArgs": ["--gpu-memory-utilization", "0.9"],
        },
        "objectStore": {
            "endpoint": "http://minio.storage.svc:9000",
            "bucket": "adapters",
            "prefix": "prod",
            "credentialsSecret": "adapter-store",
        },
        "huggingface": {"tokenSecret": "hub-token"},
        "networkPolicy": {"enabled": True, "allowMetricsFrom": {"kubernetes.io/metadata.name": "monitoring"}},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "vllm tensor parallel 4": {
        "engine": {"kind": "vllm"},  # no allow-list: no agent
        "vllm": {
            "model": "/models/llama-3.1-70b",
            "tensorParallelSize": 4,
            "maxLoraRank": 128,
            "runtimeClassName": "nvidia",
            "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
            "shmSizeLimit": "32Gi",
            "modelCache": {"existingClaim": "models"},
        },
    },
    "vllm TP 2 x PP 2 on 2 nodes": {
        "engine": {"kind": "vllm", "adapters": {"sources": {"allow": ["s3://adapters/prod/"]}}},
        "vllm": {
            "model": "meta-llama/Llama-3.1-405B-Instruct",
            "replicas": 2,
            "tensorParallelSize": 2,
            "pipelineParallelSize": 2,
            "nodes": 2,
            "modelCache": {"existingClaim": "models"},
            "agent": {"cacheClaim": "adapter-cache"},
        },
        "networkPolicy": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
    "mixed": {
        "engine": {
            "kind": "mixed",
            "adapters": {"sources": {"allow": ["s3://adapters/prod/"]}, "cache": {"sizeLimit": "8Gi"}, "maxMb": 512},
        },
        "vllm": {"model": "Qwen/Qwen2.5-7B-Instruct"},
        "networkPolicy": {"enabled": True},
        "metrics": {"serviceMonitor": {"enabled": True}},
    },
}
GPUS_PER_POD = {"vllm on one GPU": 1, "vllm tensor parallel 4": 4, "vllm TP 2 x PP 2 on 2 nodes": 2, "mixed": 1}


def render_set(helm: Path, tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return render(helm, "-f", values_file(tmp_path, name, VLLM_SETS[name]))
