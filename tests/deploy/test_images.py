"""The images (docker/*.Dockerfile), checked without a Docker daemon: dockerfilelint (npm) finds nothing,
every COPY source exists in the build context and is not excluded by .dockerignore, the final stage runs
as a non-root user with no build tools, the gateway image installs loragate without the engine extra, and
each image's default command parses with the `loragate` CLI's own parser.
"""

from __future__ import annotations

import fnmatch
import json
import shlex
import subprocess
from pathlib import Path

import pytest
from conftest import REPO

from loragate.cli import build_parser

DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))


def _instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    text = path.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _stages(path: Path) -> list[list[tuple[str, str]]]:
    stages: list[list[tuple[str, str]]] = []
    for instruction in _instructions(path):
        if instruction[0] == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


def _target(path: Path, name: str) -> list[tuple[str, str]]:
    """The instructions of the stage named `name` (`docker build --target name`)."""
    for stage in _stages(path):
        if stage[0][1].partition(" AS ")[2].strip() == name:
            return stage
    raise AssertionError(f"{path.name} has no stage {name!r}")


def _ignored(source: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip()]
    return any(fnmatch.fnmatch(source, p) or source.startswith(p.rstrip("/") + "/") or source == p for p in patterns)


def test_there_is_a_gateway_and_an_engine_image() -> None:
    assert [p.name for p in DOCKERFILES] == ["engine.Dockerfile", "gateway.Dockerfile"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfilelint_finds_nothing(dockerfilelint: Path, dockerfile: Path) -> None:
    done = subprocess.run(
        [str(dockerfilelint), "-o", "json", str(dockerfile)], capture_output=True, text=True, timeout=120
    )
    report = json.loads(done.stdout)
    issues = [issue for f in report["files"] for issue in f["issues"]]
    assert done.returncode == 0 and not issues, issues


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_every_copy_source_exists_in_the_build_context(dockerfile: Path) -> None:
    copies = [args for word, args in _instructions(dockerfile) if word == "COPY"]
    assert copies
    for args in copies:
        parts = [p for p in shlex.split(args) if not p.startswith("--")]
        if any(a.startswith("--from=") for a in shlex.split(args)):
            continue  # from another stage, not the context
        for source in parts[:-1]:
            assert (REPO / source).exists(), f"{dockerfile.name}: COPY {source}: not in the build context"
            assert not _ignored(source), f"{dockerfile.name}: COPY {source}: excluded by .dockerignore"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_and_the_final_stage_is_lean_and_non_root(dockerfile: Path) -> None:
    stages = _stages(dockerfile)
    assert len(stages) >= 2
    final = stages[-1]
    users = [args for word, args in final if word == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    runs = " ".join(args for word, args in final if word == "RUN")
    for tool in ("gcc", "build-essential", "apt-get install", "make "):
        assert tool not in runs, f"{dockerfile.name}: the final stage installs {tool!r}"
    assert any(word == "COPY" and "--from=build" in args for word, args in final)


def test_the_engine_cuda_target_has_a_c_compiler_for_triton_and_runs_as_before() -> None:
    """Triton builds a C launcher for each kernel signature on its first launch: the CUDA image needs a compiler
    (the CPU image, the default target, has none: test above). Still non-root, and its command asks for CUDA."""
    cuda = _target(REPO / "docker" / "engine.Dockerfile", "cuda")
    runs = " ".join(args for word, args in cuda if word == "RUN")
    assert "apt-get install" in runs and " gcc" in runs and "libc6-dev" in runs
    users = [args for word, args in cuda if word == "USER"]
    assert users[-1].split(":")[0] not in ("root", "0")
    cmd = [json.loads(args) for word, args in cuda if word == "CMD"][-1]
    assert build_parser().parse_args(cmd).device == "cuda"


def test_the_gateway_image_has_no_engine_extra() -> None:
    instructions = " ".join(args for _, args in _instructions(REPO / "docker" / "gateway.Dockerfile"))
    assert "[engine]" not in instructions and "torch" not in instructions
    assert ".[engine]" in (REPO / "docker" / "engine.Dockerfile").read_text()


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_the_default_command_parses_with_the_cli(dockerfile: Path) -> None:
    final = _stages(dockerfile)[-1]
    entrypoint = [json.loads(args) for word, args in final if word == "ENTRYPOINT"][-1]
    cmd = [json.loads(args) for word, args in final if word == "CMD"][-1]
    assert entrypoint == ["loragate"]
    args = build_parser().parse_args(cmd)
    assert args.host == "0.0.0.0"
