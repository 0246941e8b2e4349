"""The gateway deploys without torch: `import gateway.app`, the CLI and `loragate policy check` never load the
engine, and `pip install loragate` (no extra) into an empty virtualenv gives a working gateway and CLI whose
`loragate engine` says which extra to install.

Each check runs in a fresh interpreter: this test process has long imported torch for other tests.
"""

from __future__ import annotations

import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "safetensors", "peft", "triton", "engine", "loragate_kernels")
# The engine's settings (engine/config.py, the standard library only): the CLI generates `loragate engine`'s flags
# from them, so every process that builds the parser imports them.
LIGHT = ("engine", "engine.config")
# Prints the heavy packages a snippet left in sys.modules, as the last line.
REPORT = f"import sys; print(sorted({{m.split('.')[0] for m in sys.modules if m not in {LIGHT!r}}} & set({HEAVY!r})))"


def _python(code: str, python: str = sys.executable, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-c", code], capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.mark.parametrize(
    "snippet",
    [
        "import gateway.app",
        "import gateway.serving",
        "import vllm_agent.app",
        "import loragate.cli",
        "from loragate.cli import main; main(['policy', 'check', 'policies/default.yaml'])",
        "from loragate.cli import main; main(['policy', 'schema'])",
    ],
)
def test_the_gateway_and_the_cli_never_import_the_engine(snippet: str) -> None:
    done = _python(f"{snippet}\n{REPORT}")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout


def test_the_gateway_tests_collect_without_torch() -> None:
    code = (
        "import sys, pytest\n"
        "rc = pytest.main(['--collect-only', '-q', '-p', 'no:cacheprovider', 'tests/gateway'])\n"
        "assert rc == 0, rc\n" + REPORT
    )
    done = _python(code)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-500:]


@pytest.mark.parametrize("command", ["engine --model tiny-random", "up"])
def test_engine_commands_without_the_extra_exit_2_naming_it(command: str) -> None:
    # Hide torch the way a missing package looks to the import system.
    code = (
        f"import sys; sys.modules['torch'] = None\nfrom loragate.cli import main; sys.exit(main({command.split()!r}))"
    )
    done = _python(code)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "pip install 'loragate[engine]'" in done.stderr, done.stderr
    assert "torch" in done.stderr


def test_pip_install_without_extras_is_a_working_gateway_and_cli(tmp_path: Path) -> None:
    """A real install from this checkout into an empty virtualenv (packages from PyPI)."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = str(env_dir / "bin" / "python")
    pip = subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(REPO)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert pip.returncode == 0, pip.stdout[-3000:] + pip.stderr[-3000:]
    outside = tmp_path / "elsewhere"  # not the checkout: only the installed package is importable
    outside.mkdir()
    done = _python("import gateway.app, loragate_common.http_server\n" + REPORT, python, outside)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    for name in ("torch", "transformers", "peft"):
        assert _python(f"import {name}", python, outside).returncode != 0, f"{name} was installed"
    page = _python("from gateway.admin import OpsPage; print(len(OpsPage().html))", python, outside)
    assert page.returncode == 0 and int(page.stdout) > 1000, page.stderr  # the ops page ships in the package
    cli = str(env_dir / "bin" / "loragate")
    check = subprocess.run(
        [cli, "policy", "check", str(REPO / "policies" / "default.yaml")],
        capture_output=True,
        text=True,
        cwd=outside,
        timeout=120,
    )
    assert check.returncode == 0 and check.stdout.startswith("ok: "), check.stdout + check.stderr
    engine = subprocess.run(
        [cli, "engine", "--model", "tiny-random"], capture_output=True, text=True, cwd=outside, timeout=120
    )
    assert engine.returncode == 2 and "pip install 'loragate[engine]'" in engine.stderr, engine.stderr
