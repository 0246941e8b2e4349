"""The grammar compile worker: a child process that compiles JSON schemas with xgrammar.

xgrammar has no limits of its own and a compile cannot be interrupted in a thread, so compiles run in a child
process (`main` below) that is killed when one passes its time bound (a pattern such as `^(a{1,200}){1,200}$`
takes about a second to expand, and a schema may hold any number of them); a fresh child starts at once, in the
background. The parent talks to it over its stdin/stdout in length-prefixed JSON frames:

    {"op": "tokenizer", "key", "info"}  ->  {"ok": true}        (xgrammar's TokenizerInfo, serialized; once per child)
    {"op": "compile", "key", "schema"}  ->  {"ok": true, "grammar": <serialized CompiledGrammar>}
                                         |  {"ok": false, "error", "path": [...] or null, "unsatisfiable": bool}

On a refusal the child also finds where in the schema it comes from: the deepest subschema the engine refuses on
its own. A schema that compiles is refused too (`unsatisfiable`) when its grammar can start a value it can never
finish (dead_ends.py, over automata.py: a `pattern` that matches nothing, or whose matches need what it cannot
write in a string), located the same way: the deepest subschema whose own grammar has the fault, and the keyword
without which it has none. One compile at a time; callers queue on a lock, for at most their own time bound.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import select
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from engine.structured.dead_ends import unsatisfiable

logger = logging.getLogger(__name__)

# Compact JSON with json.dumps' separators and no free whitespace: a small model cannot loop on whitespace, and the
# top-level value ends the grammar at its last byte. strict_mode=False keeps JSON Schema's meaning (additional
# properties are allowed unless the schema says otherwise).
JSON_OPTIONS: dict[str, Any] = {"any_whitespace": False, "separators": (", ", ": "), "strict_mode": False}
STARTUP_TIMEOUT_S = 120.0  # importing xgrammar (and torch) in the child, on a loaded machine
_HEADER = struct.Struct(">I")
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] file.cc:123: " before each message


class CompileTimeout(Exception):
    """The compile passed its time bound (the child was killed)."""


class CompilerBusy(RuntimeError):
    """Other compiles held the worker for longer than this one's time bound: retry later (an HTTP 503)."""


class WorkerCrashed(RuntimeError):
    """The child died while compiling (out of memory, a crash in the library): it is restarted."""


class WorkerRefusal(Exception):
    """xgrammar refused the schema, or (`unsatisfiable`) its grammar could start a value it can never finish:
    `path` (a list of keys and indices into it) is where, when found."""

    def __init__(self, message: str, path: list[str | int] | None, unsatisfiable: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.path = path
        self.unsatisfiable = unsatisfiable


class CompileWorker:
    """The parent's handle on the child process (started on first use, restarted after a kill or a crash)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._sent: set[str] = set()  # tokenizer keys the current child holds
        self._lock = threading.Lock()
        atexit.register(self.close)

    def compile(self, key: str, info_json: Callable[[], str], schema_json: str, *, timeout_s: float) -> str:
        """The serialized CompiledGrammar for `schema_json` with tokenizer `key`. Raises CompileTimeout past
        `timeout_s` of compiling, WorkerRefusal, CompilerBusy if the worker stays busy for `timeout_s`, WorkerCrashed
        if the child dies compiling, or RuntimeError if it cannot be started."""
        if not self._lock.acquire(timeout=timeout_s):
            raise CompilerBusy(f"the grammar compiler stayed busy for {timeout_s:g} s")
        try:
            self._prepare(key, info_json)
            try:
                reply = self._request({"op": "compile", "key": key, "schema": schema_json}, timeout_s)
            except CompileTimeout:
                self._restart()
                raise
            except RuntimeError as exc:
                self._restart()
                raise WorkerCrashed(str(exc)) from None
        finally:
            self._lock.release()
        if not reply["ok"]:
            raise WorkerRefusal(reply["error"], reply.get("path"), bool(reply.get("unsatisfiable")))
        return str(reply["grammar"])

    def warm(self, key: str, info_json: Callable[[], str]) -> None:
        """Start the child and give it the tokenizer now, so the first compile does not wait for it."""
        with self._lock:
            self._prepare(key, info_json)

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc is not None:
            for stream in (proc.stdin, proc.stdout):
                if stream is not None:
                    stream.close()

    def _prepare(self, key: str, info_json: Callable[[], str]) -> None:
        """Start the child if needed and give it the tokenizer (not a schema's cost: outside its time bound)."""
        if self._proc is None or self._proc.poll() is not None:
            self._spawn()
        try:
            if not self._ready:
                self._read(time.monotonic() + STARTUP_TIMEOUT_S)
                self._ready = True
            if key not in self._sent:
                self._request({"op": "tokenizer", "key": key, "info": info_json()}, STARTUP_TIMEOUT_S)
                self._sent.add(key)
        except (CompileTimeout, RuntimeError) as exc:
            self.close()
            raise RuntimeError(f"the grammar compile worker did not start: {exc!r}") from None

    def _spawn(self) -> None:
        self.close()
        root = str(Path(__file__).resolve().parents[2])  # the directory holding the `engine` package
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self._proc = subprocess.Popen(
            [sys.executable, "-c", "from engine.structured.worker import main; main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            bufsize=0,
        )
        self._ready = False
        self._sent.clear()

    def _restart(self) -> None:
        logger.warning("restarting the grammar compile worker")
        self._spawn()  # kills the old child; the new one starts importing now, before anyone needs it

    def _request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        deadline = time.monotonic() + timeout_s
        try:
            _write(proc.stdin, message)
        except OSError as exc:
            raise RuntimeError(f"the grammar compile worker is gone: {exc}") from None
        return self._read(deadline)

    def _read(self, deadline: float) -> dict[str, Any]:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        header = _read_exact(fd, _HEADER.size, deadline)
        return json.loads(_read_exact(fd, _HEADER.unpack(header)[0], deadline))


def _read_exact(fd: int, size: int, deadline: float) -> bytes:
    chunks, left = [], size
    while left:
        wait = deadline - time.monotonic()
        if wait <= 0 or not select.select([fd], [], [], wait)[0]:
            raise CompileTimeout()
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            raise RuntimeError("the grammar compile worker exited")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _write(stream: IO[bytes], message: dict[str, Any]) -> None:
    data = json.dumps(message).encode()
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


# The child.


def _serve(inp: IO[bytes], out: IO[bytes]) -> None:
    import xgrammar

    compilers: dict[str, Any] = {}
    _write(out, {"ok": True})  # ready
    while header := inp.read(_HEADER.size):
        message = json.loads(inp.read(_HEADER.unpack(header)[0]))
        if message["op"] == "tokenizer":
            info = xgrammar.TokenizerInfo.deserialize_json(message["info"])
            compilers[message["key"]] = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            _write(out, {"ok": True})
            continue
        reply: dict[str, Any]
        try:
            compiled = compilers[message["key"]].compile_json_schema(message["schema"], **JSON_OPTIONS)
            fault = unsatisfiable(compiled, message["schema"], xgrammar, JSON_OPTIONS)
            if fault is not None:
                reply = {"ok": False, "error": fault[1], "path": fault[0], "unsatisfiable": True}
            else:
                reply = {"ok": True, "grammar": compiled.serialize_json()}
        except Exception as exc:
            path, error = _locate(json.loads(message["schema"]), xgrammar)
            reply = {"ok": False, "error": error or _clean(exc), "path": path}
        _write(out, reply)


def _locate(schema: Any, xgrammar: Any) -> tuple[list[str | int] | None, str | None]:
    """The deepest subschema xgrammar refuses on its own (the root's `$defs` beside it, so references resolve)."""
    from engine.structured.keywords import subschemas

    shared = {k: schema[k] for k in ("$defs", "definitions") if isinstance(schema, dict) and k in schema}
    for path, node in sorted(subschemas(schema), key=lambda item: len(item[0]), reverse=True):
        if path[-2:-1] in (("$defs",), ("definitions",)):
            continue  # a definition is checked where it is used
        error = _refusal({**shared, **node}, xgrammar)
        if error is None:
            continue
        # The keyword at fault: the one whose removal lets the rest compile ("type" last: without it, the engine
        # drops every typed keyword).
        for key in sorted(node, key=lambda k: k == "type"):
            if (
                key not in shared
                and _refusal({**shared, **{k: v for k, v in node.items() if k != key}}, xgrammar) is None
            ):
                return [*path, key], error
        return list(path), error
    return None, None


def _refusal(schema: dict[str, Any], xgrammar: Any) -> str | None:
    try:
        xgrammar.Grammar.from_json_schema(json.dumps(schema), **JSON_OPTIONS)
    except Exception as exc:
        return _clean(exc)
    return None


def _clean(exc: BaseException) -> str:
    lines = [_LOG_PREFIX.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line)[:400]


def main() -> None:
    out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints from libraries go to stderr, never into the frames
    _serve(sys.stdin.buffer, out)
