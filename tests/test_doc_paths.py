"""Every repository path and every dotted name the docs and the code's comments cite exists, so neither goes
stale unnoticed.

Where citations are looked for: every Markdown file of the repository (README.md, docs/, helm/, policies/,
...; not the virtualenvs, .git or the benchmark records in bench/results/), and the comments and docstrings of the
Python files under engine/, gateway/, loragate_kernels/, loragate_common/, loragate/, vllm_agent/, bench/, tests/ and
scripts/.

What counts as a citation:

- a path: a token that starts with one of the repository's top-level folders and a slash
  (`gateway/rollout.py`, `tests/engine/`, `helm/loragate/values.yaml`), or is one of its top-level files
  (`Makefile`, `pyproject.toml`, `README.md`), read from the repository root; it must be a file or folder.
  Not checked: patterns and placeholders, that is paths with a `*`, `<...>` or `{...}` in them
  (`docker/*.Dockerfile`, `bench/results/<date>-<host>.json`);
- a Markdown link `[text](target)`: the target, relative to the Markdown file's folder, must exist, and
  an `#anchor` on a Markdown page (or alone, for the page itself) must be one of its headings' anchors
  (web and `mailto:` links are not checked);
- a dotted name: `package.module[.Name[.attribute]]` whose first part is one of the packages engine,
  gateway, loragate_kernels, loragate_common, loragate, vllm_agent (`engine.core.scheduler`,
  `gateway.rollout.Rollouts.route`).
  The longest prefix that is a module of the repository names the module; the rest must be defined in it: a top-level
  name (def, class, assignment, import), then a class's members (its methods, class attributes, dataclass
  fields, `self.x` assignments in its methods, and those of the bases it inherits from). Three rules keep
  other things that look the same out: a name whose last part is a file suffix is a file name
  (`engine.Dockerfile`, `gateway.yaml`); a key path of the chart's values (helm/loragate/values.yaml:
  `engine.model.pvc`, `gateway.dnsIntervalSeconds`) is a chart value; and a two-part name whose second part
  is lower case and no module or top-level name of the package is a variable's attribute (`engine.step` in
  a test is that test's engine), not checked.

Resolution reads the sources (with `ast`) instead of importing them: the gateway's tests run without torch,
and importing loragate_kernels/triton/sgmv.py here would fix its TRITON_INTERPRET choice for the rest of the session.
Names the sources cannot settle (an attribute of something imported from outside the repository, or of a
module-level variable) pass.
"""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent

TOP_DIRS = (
    "engine gateway loragate_kernels loragate_common loragate vllm_agent bench tests docs helm policies docker scripts "
    ".ci"
).split()
TOP_FILES = ("Makefile", "pyproject.toml", "README.md")
PACKAGES = ("engine", "gateway", "loragate_kernels", "loragate_common", "loragate", "vllm_agent")
CODE_DIRS = (
    "engine",
    "gateway",
    "loragate_kernels",
    "loragate_common",
    "loragate",
    "vllm_agent",
    "bench",
    "tests",
    "scripts",
)
# Folders never scanned: tools' and builds' output, and the benchmark records (generated files).
SKIP_DIRS = frozenset({".git", ".venv", ".venv-vllm", "node_modules", "__pycache__", "build", "dist", ".pytest_cache"})
SKIP_DIRS |= frozenset({".mypy_cache", ".ruff_cache", ".hypothesis", ".cache"})
SKIP_PATHS = frozenset({Path("bench/results")})
# A dotted name that is a key path of the chart's values is a chart value, not a Python name.
CHART_VALUES = Path("helm/loragate/values.yaml")
# A dotted name ending in one of these is a file name, not a Python name.
FILE_SUFFIXES = frozenset(
    "py md yaml yml json toml dockerfile html txt log safetensors png cfg ini sh tpl gguf bin pt lock csv".split()
)

_BEFORE = r"(?<![\w./$~-])"  # not the middle of a longer path, URL, variable or word
_PATH = re.compile(
    _BEFORE
    + r"(?:(?:"
    + "|".join(re.escape(d) for d in TOP_DIRS)
    + r")/[\w./*<>{}-]*|(?:"
    + "|".join(re.escape(f) for f in TOP_FILES)
    + r")(?![\w.-]))"
)
_DOTTED = re.compile(_BEFORE + r"(?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+(?![\w-]|\.\w)")
_LINK = re.compile(r"!?\[[^\]\n]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


@dataclass(frozen=True)
class Broken:
    """One citation that does not resolve: where, what, and why."""

    where: str  # repo-relative path
    line: int
    cite: str
    why: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.cite} ({self.why})"


# --- what a text cites ---------------------------------------------------------------------------------


def cited_paths(text: str) -> Iterator[tuple[int, str]]:
    """(offset, path) of every repository path `text` cites, patterns and placeholders left out."""
    for m in _PATH.finditer(text):
        path = m.group(0).rstrip(".")
        if not any(c in path for c in "*<>{}"):
            yield m.start(), path


def cited_names(text: str) -> Iterator[tuple[int, str]]:
    """(offset, name) of every dotted name of one of the packages that `text` cites."""
    for m in _DOTTED.finditer(text):
        name = m.group(0)
        last = name.rsplit(".", 1)[-1]
        if last.lower() in FILE_SUFFIXES:
            continue
        yield m.start(), name


def markdown_links(text: str) -> Iterator[tuple[int, str, str]]:
    """(offset, file, anchor) of every local Markdown link; file is "" for a link within the page."""
    for m in _LINK.finditer(text):
        target = m.group(1)
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http:, https:, mailto:, ...
        file, _, anchor = target.partition("#")
        yield m.start(1), file, anchor


# --- does it exist --------------------------------------------------------------------------------------


def heading_anchors(markdown: str) -> set[str]:
    """The anchors of a Markdown text's headings, as GitHub makes them: lower case, punctuation dropped,
    spaces to hyphens, a repeated heading's anchor suffixed -1, -2, ... Lines in fenced code blocks are not
    headings."""
    anchors, seen, fenced = set(), dict[str, int](), False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        heading = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def _module_file(parts: tuple[str, ...], root: Path) -> Path | None:
    base = root.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _parse(source: str) -> ast.Module:
    with warnings.catch_warnings():  # an invalid escape in someone's string is not this test's business
        warnings.simplefilter("ignore")
        return ast.parse(source)


@cache
def _tree(path: Path) -> ast.Module:
    return _parse(path.read_text(encoding="utf-8"))


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements of a module or class body, looking into if/try/with blocks but not into defs."""
    for node in body:
        yield node
        if isinstance(node, ast.If | ast.With | ast.AsyncWith):
            yield from _top_level(node.body)
            if isinstance(node, ast.If):
                yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _top_level(block)


def _target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Tuple | ast.List):
        for elt in target.elts:
            yield from _target_names(elt)


def _definitions(body: list[ast.stmt]) -> dict[str, ast.AST]:
    """Name -> the statement that defines it, for a module's or class's body."""
    names: dict[str, ast.AST] = {}
    for node in _top_level(body):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                for name in _target_names(target):
                    names[name] = node
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            for name in _target_names(node.target):
                names[name] = node
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                names[(alias.asname or alias.name).split(".")[0]] = node
    return names


def _instance_attributes(cls: ast.ClassDef) -> set[str]:
    """Attributes a class's methods assign on `self`."""
    found = set()
    for node in ast.walk(cls):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            targets = [node.target]
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                found.add(target.attr)
    return found


@dataclass(frozen=True)
class _Found:
    """What a name resolved to: a module, a class, a function, or something whose attributes the sources
    cannot tell (a variable, or a name from outside the repository)."""

    kind: str  # "module", "class", "function" or "opaque"
    module: Path | None = None
    cls: ast.ClassDef | None = None


_OPAQUE = _Found("opaque")


def _lookup_in_module(module: Path, name: str, root: Path) -> _Found | None:
    """`name` defined at the top of `module`, following imports from the repository's own packages."""
    node = _definitions(_tree(module).body).get(name)
    if node is None:
        if module.name == "__init__.py":  # a package's submodule
            sub = _module_file((*module.parent.relative_to(root).parts, name), root)
            if sub is not None:
                return _Found("module", sub)
        return None
    if isinstance(node, ast.ClassDef):
        return _Found("class", module, node)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return _Found("function", module)
    if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        source = _module_file(tuple(node.module.split(".")), root)
        if node.module.split(".")[0] in PACKAGES and source is not None:
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            return _lookup_in_module(source, alias.name, root)
    if isinstance(node, ast.Import):
        alias = next(a for a in node.names if (a.asname or a.name).split(".")[0] == name)
        dotted = alias.name if alias.asname else alias.name.split(".")[0]
        if dotted.split(".")[0] in PACKAGES:
            target = _module_file(tuple(dotted.split(".")), root)
            return _Found("module", target) if target is not None else None
    return _OPAQUE


def _lookup_in_class(module: Path, cls: ast.ClassDef, name: str, root: Path) -> _Found | None:
    """`name` as a member of `cls`: defined in its body, assigned on `self`, or inherited."""
    node = _definitions(cls.body).get(name)
    if isinstance(node, ast.ClassDef):
        return _Found("class", module, node)
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return _Found("function", module)
    if node is not None or name in _instance_attributes(cls):
        return _OPAQUE
    for base in cls.bases:
        if isinstance(base, ast.Subscript):  # Generic[T], Protocol[T]
            base = base.value
        if isinstance(base, ast.Name) and base.id in ("object", "Protocol", "Generic"):
            continue
        found = _lookup_in_module(module, base.id, root) if isinstance(base, ast.Name) else None
        if found is None or found.kind != "class":
            return _OPAQUE  # a base from outside the repository (`Exception`, `BaseModel`): it may have it
        assert found.module is not None and found.cls is not None
        inherited = _lookup_in_class(found.module, found.cls, name, root)
        if inherited is not None:
            return inherited
    return None


def _key_paths(data: object, prefix: str = "") -> Iterator[str]:
    if isinstance(data, dict):
        for key, value in data.items():
            path = f"{prefix}{key}"
            yield path
            yield from _key_paths(value, path + ".")


@cache
def chart_values(root: Path = ROOT) -> frozenset[str]:
    """Every key path of the chart's values: `engine.model.pvc`, `gateway.dnsIntervalSeconds`, ..."""
    return frozenset(_key_paths(yaml.safe_load((root / CHART_VALUES).read_text(encoding="utf-8"))))


def resolve_name(name: str, root: Path = ROOT) -> str | None:
    """None when the dotted `name` resolves (or is a chart value, or a variable's attribute), else why not."""
    if name in chart_values(root):
        return None
    parts = tuple(name.split("."))
    package = _module_file(parts[:1], root)
    if package is None:
        return "no such package"
    if len(parts) == 2 and parts[1][:1].islower() and _lookup_in_module(package, parts[1], root) is None:
        return None  # `engine.step`: a variable's attribute
    end = next(n for n in range(len(parts), 0, -1) if _module_file(parts[:n], root) is not None)
    current = _Found("module", _module_file(parts[:end], root))
    for i in range(end, len(parts)):
        where = ".".join(parts[:i])
        if current.kind == "opaque":
            return None
        if current.kind == "function":
            return f"{where} is a function"
        if current.kind == "module":
            assert current.module is not None
            found = _lookup_in_module(current.module, parts[i], root)
        else:
            assert current.module is not None and current.cls is not None
            found = _lookup_in_class(current.module, current.cls, parts[i], root)
        if found is None:
            return f"no {parts[i]} in {where}"
        current = found
    return None


# --- where citations are ------------------------------------------------------------------------------


def check_text(
    text: str, where: Path, first_line: int = 1, *, markdown: bool = False, root: Path = ROOT
) -> list[Broken]:
    """The citations in `text` (found in file `where`, starting at `first_line`) that do not resolve."""
    rel = where.relative_to(root).as_posix()
    broken = []

    def at(offset: int) -> int:
        return first_line + text.count("\n", 0, offset)

    for offset, path in cited_paths(text):
        if not (root / path).exists():
            broken.append(Broken(rel, at(offset), path, "no such file or folder"))
    for offset, name in cited_names(text):
        why = resolve_name(name, root)
        if why is not None:
            broken.append(Broken(rel, at(offset), name, why))
    if markdown:
        for offset, file, anchor in markdown_links(text):
            target = where.parent / file
            if file and not target.exists():
                if (at(offset), file) not in {(b.line, b.cite) for b in broken}:  # not reported as a path already
                    broken.append(Broken(rel, at(offset), file, "link to nothing"))
            elif anchor and (not file or target.suffix == ".md"):
                page = target.read_text(encoding="utf-8") if file else text
                if anchor not in heading_anchors(page):
                    broken.append(Broken(rel, at(offset), f"{file}#{anchor}", "no such heading"))
    return broken


def python_texts(source: str) -> Iterator[tuple[int, str]]:
    """(first line, raw text) of every comment and every string statement (docstrings) in a Python source."""
    starts = {
        (node.value.lineno, node.value.col_offset)
        for node in ast.walk(_parse(source))
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING and tok.start in starts):
            yield tok.start[0], tok.string


def _files(root: Path, top: Path, suffix: str) -> Iterator[Path]:
    for folder, dirs, files in os.walk(top):
        here = Path(folder)
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS and not d.endswith(".egg-info") and (here / d).relative_to(root) not in SKIP_PATHS
        )
        yield from (here / f for f in sorted(files) if f.endswith(suffix))


def scan(root: Path = ROOT) -> list[Broken]:
    """Every broken citation in the repository's Markdown files and Python comments and docstrings."""
    broken = []
    for md in _files(root, root, ".md"):
        broken += check_text(md.read_text(encoding="utf-8"), md, markdown=True, root=root)
    for top in CODE_DIRS:
        for py in _files(root, root / top, ".py"):
            for line, text in python_texts(py.read_text(encoding="utf-8")):
                broken += check_text(text, py, line, root=root)
    return broken


# --- the tests ----------------------------------------------------------------------------------------


def test_every_cited_path_and_name_exists() -> None:
    broken = scan()
    assert not broken, f"{len(broken)} citations resolve to nothing:\n" + "\n".join(map(str, broken))


FAKE_DOC = """\
# A fake page
Real: `gateway/rollout.py`, `tests/engine/`, helm/loragate, [layout](architecture.md#layout), `.ci/run`,
`engine.core.scheduler.Scheduler.schedule`, engine.core.request.Request, `Makefile`, `gateway.policy.Policy`.
Not citations: `docker/*.Dockerfile`, `bench/results/<date>-<host>.json`, `engine.Dockerfile`, `gateway.yaml`,
engine.step(), engine.step, `engine.model.pvc`, [web](https://example.com/a.md), [top](#a-fake-page).
Broken: `gateway/nope.py`, [nope](docs/nope/), [a link](nope.md#a), `engine.core.nope`, [x](#nope),
gateway.rollout.Rollouts.nope, `loragate_kernels.reference.lora_sgmv_group.x`, [y](architecture.md#nope), engine/gw.
"""

FAKE_SOURCE = '''\
"""Module docstring citing gateway/nope_doc.py."""

TEXT = "gateway/not_a_citation.py"  # a comment citing engine.core.nope_comment


def f() -> None:
    """A function's docstring: engine/core/scheduler.py exists."""
'''


def test_checker_reports_every_broken_citation_and_only_those() -> None:
    where = ROOT / "docs" / "fake.md"
    broken = sorted((b.line, b.cite) for b in check_text(FAKE_DOC, where, markdown=True))
    assert broken == [
        (6, "#nope"),
        (6, "docs/nope/"),
        (6, "engine.core.nope"),
        (6, "gateway/nope.py"),
        (6, "nope.md"),
        (7, "architecture.md#nope"),
        (7, "engine/gw"),
        (7, "gateway.rollout.Rollouts.nope"),
        (7, "loragate_kernels.reference.lora_sgmv_group.x"),
    ]
    report = "\n".join(str(b) for b in check_text(FAKE_DOC, where, 10, markdown=True))
    assert "docs/fake.md:15: gateway/nope.py (no such file or folder)" in report


def test_heading_anchors_are_githubs() -> None:
    page = "# The `make bench` run\n```bash\n# not a heading\n```\n## Rollouts (canary and A/B)\n" * 2
    assert heading_anchors(page) == {
        "the-make-bench-run",
        "the-make-bench-run-1",
        "rollouts-canary-and-ab",
        "rollouts-canary-and-ab-1",
    }


def test_python_comments_and_docstrings_are_read_and_code_strings_are_not() -> None:
    texts = list(python_texts(FAKE_SOURCE))
    assert [line for line, _ in texts] == [1, 3, 7]
    where = ROOT / "tests" / "fake.py"
    broken = [str(b) for line, text in texts for b in check_text(text, where, line)]
    assert broken == [
        "tests/fake.py:1: gateway/nope_doc.py (no such file or folder)",
        "tests/fake.py:3: engine.core.nope_comment (no nope_comment in engine.core)",
    ]
