"""The repository describes itself as it is: docs/architecture.md's layout lists every module of the five packages,
and no file keeps a diary of the spans of work that made it (numbered or dated, "this one", "later ones the same
day"): the project speaks of itself only, and measured history lives in bench/results/."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "gateway", "loragate_kernels", "loragate_common", "loragate", "vllm_agent")
MODULE_SUFFIXES = (".py", ".cpp", ".h", ".html")

ORDINALS = "first second third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth".split()
# A session as a span of someone's work: an ordinal one, this/that/the last/... one. Technical sessions (pytest's
# scope="session", a process session, sessionStorage, X-Session-ID) are not preceded by these words.
DIARY = re.compile(
    r"\b(?:(?:" + "|".join(ORDINALS) + r"|\d+(?:st|nd|rd|th)|this|that|last|previous|earlier|later|next|new|"
    r"same|each|every|one|another)\s+sessions?\b|sessions?\s+(?:ago|before|earlier|later)\b)",
    re.IGNORECASE,
)


def tracked_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [ROOT / name for name in listed if (ROOT / name).is_file()]


def test_the_layout_lists_every_module() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    layout = text[text.index("## Layout") :]
    modules = [
        path.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*"))
        if path.suffix in MODULE_SUFFIXES and path.name != "__init__.py" and "__pycache__" not in path.parts
    ]
    assert len(modules) > 100  # the walk found the packages
    assert [module for module in modules if f"`{module}`" not in layout] == []


def diary_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if DIARY.search(line)]


def test_no_file_speaks_of_sessions() -> None:
    found = {}
    for path in tracked_files():
        if path.suffix == ".png":
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        lines = diary_lines(text)
        if lines:
            found[path.relative_to(ROOT).as_posix()] = lines[:3]
    assert found == {}


# The check's own cases, with the word put in at run time (this file is tracked too).
@pytest.mark.parametrize(
    ("line", "diary"),
    [
        ("### 2026-12-05, a twelfth {s}: the MLP's activation", True),
        ("docs/performance.md, the ninth {s}): 51.1 -> 46.3 ms", True),
        ("Later {s}s the same day, on the same engine code", True),
        ("measured at this {s}'s start", True),
        ("the 3rd {s}'s figures", True),
        ('@pytest.fixture(scope="{s}")', False),
        ("proc = subprocess.Popen(cmd, start_new_{s}=True)", False),
        ("{s}Storage.getItem(KEY)", False),
        ("a sticky key such as X-Session-ID", False),
        ("for the rest of the {s}", False),
    ],
)
def test_the_diary_check_tells_the_two_apart(line: str, diary: bool) -> None:
    assert bool(diary_lines(line.format(s="session"))) == diary
