"""Compiled grammars and the per-request token constraint, on xgrammar.

Why xgrammar (bench/structured_masks.py; figures in docs): on CPU it fills a bitmask row and advances for the least
per decoding step of the three engines measured (llguidance, xgrammar, outlines-core), compiles a schema in a few
milliseconds (outlines-core takes seconds), and its matcher fits a paged, preemptive batch: its state moves only when
the engine accepts a token, so recompute or swap preemption and chunked prefill leave it alone, and a per-request
matcher is a ~1 µs fork of the compiled template. What it would not enforce is refused first (`schema.py`) or taken
out of its vocabulary (`vocabulary.py`).

Compiles run in a child process (`worker.py`) that is killed past the time bound, and are cached by digest in a
bounded LRU; a compile still running is shared, so a schema sent again waits for the one compile.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch
import xgrammar

from engine.structured.keywords import engine_schema
from engine.structured.schema import SchemaError, format_path
from engine.structured.vocabulary import Vocabulary, vocabulary
from engine.structured.worker import CompileTimeout, CompileWorker, WorkerCrashed, WorkerRefusal

logger = logging.getLogger(__name__)

CACHE_SIZE = 256
worker = CompileWorker()


class CompileTimeoutError(SchemaError):
    """A schema whose compile passed its time bound: refused (a 400 like any SchemaError), and never compiled
    again in parts to locate the fault (each part could take as long)."""


class GrammarConstraint:
    """One request's matcher (engine/core/request.py `TokenConstraint`): fills its bitmask row, advances on the
    token the engine accepted, and says when the grammar is complete."""

    __slots__ = ("_matcher", "_vocab", "_follow", "_scratch", "_failed")

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab: Vocabulary) -> None:
        self._matcher = matcher
        self._vocab = vocab
        self._follow: torch.Tensor | None = None  # the last token ended on a UTF-8 lead byte: what may follow it
        self._scratch: torch.Tensor | None = None  # a row for is_finished, made at the end of a walk only
        self._failed = False

    def fill_bitmask(self, bitmask: torch.Tensor) -> None:
        """Write the allowed tokens into `bitmask` (int32 CPU [ceil(vocab / 32)], contiguous) in place: bit j of word
        i set = token 32*i + j allowed. Words past the tokenizer's vocabulary (a padded LM head) are cleared."""
        words = self._vocab.words
        if bitmask.dtype != torch.int32 or bitmask.dim() != 1 or bitmask.numel() < words or not bitmask.is_contiguous():
            # (xgrammar itself refuses a row off the CPU)
            raise ValueError(f"the bitmask must be a contiguous int32 row of at least {words} words")
        row = bitmask if bitmask.numel() == words else bitmask[:words]
        self._matcher.fill_next_token_bitmask(row)
        if self._follow is not None:
            row.bitwise_and_(self._follow)
        if row is not bitmask:
            bitmask[words:].zero_()

    def advance(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            logger.warning("token %d refused by the grammar; ending the request", token_id)
            self._failed = True
        self._follow = self._vocab.follow.get(token_id)

    def is_finished(self) -> bool:
        """The grammar admits nothing but EOS (its value is complete and cannot go on), or EOS was taken."""
        matcher = self._matcher
        if self._failed or matcher.is_terminated():
            return True
        if not matcher.is_completed():
            return False
        if self._scratch is None:
            self._scratch = torch.empty(self._vocab.words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(self._scratch)
        eos = self._vocab.eos
        self._scratch[eos // 32] ^= _bit(eos % 32)
        return not bool(self._scratch.any())

    def is_accepting(self) -> bool:
        """EOS is allowed now: what was generated is a complete value (more may still follow)."""
        return self._matcher.is_completed()


def _bit(j: int) -> int:
    """The int32 value with only bit j set (bit 31 is the sign bit)."""
    return -(1 << 31) if j == 31 else 1 << j


class CompiledGrammar:
    """A compiled grammar for one tokenizer; `constraint()` makes a fresh matcher per request (a fork of a template
    matcher, ~1 µs). Thread-safe."""

    def __init__(self, kind: str, digest: str, compiled: xgrammar.CompiledGrammar, vocab: Vocabulary) -> None:
        self.kind = kind  # "json_object", "json_schema" or "tool_call"
        self.digest = digest
        self._template = xgrammar.GrammarMatcher(compiled)
        self._vocab = vocab
        self._lock = threading.Lock()

    def constraint(self) -> GrammarConstraint:
        with self._lock:
            matcher = self._template.fork()
        return GrammarConstraint(matcher, self._vocab)

    def __repr__(self) -> str:
        return f"CompiledGrammar({self.kind}, {self.digest[:12]})"


def prepare_tokenizer(tokenizer: Any) -> None:
    """Build (once per tokenizer object) what the grammar engine needs from `tokenizer`, and start the compile
    worker with it. Compiling does both on first use; call this at startup so the first structured request does
    not wait for them (~1 s, and a few seconds for the worker to import xgrammar)."""
    vocab = vocabulary(tokenizer)
    worker.warm(vocab.key, vocab.info_json)


class _Cache:
    """Bounded LRU of compile futures by digest: done (a grammar or a SchemaError) or still running."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[str, Future[CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    def get_or_start(self, digest: str, build: Callable[[], CompiledGrammar]) -> Future[CompiledGrammar]:
        with self._lock:
            future = self._entries.get(digest)
            if future is not None:
                self._entries.move_to_end(digest)
                return future
            future = Future()
            self._entries[digest] = future
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)
        threading.Thread(target=self._run, args=(digest, future, build), name="grammar-compile", daemon=True).start()
        return future

    def _run(self, digest: str, future: Future[CompiledGrammar], build: Callable[[], CompiledGrammar]) -> None:
        try:
            future.set_result(build())
        except SchemaError as exc:  # the schema's fault (a timeout too): kept, so a repeat is refused at once
            future.set_exception(exc)
        except Exception as exc:  # busy, or the worker failed to start: not the schema's fault, not kept
            with self._lock:
                if self._entries.get(digest) is future:
                    del self._entries[digest]
            future.set_exception(exc)

    def __len__(self) -> int:
        return len(self._entries)


cache = _Cache(CACHE_SIZE)


def compile_grammar(
    kind: str,
    schema: Any,
    tokenizer: Any,
    *,
    path: str,
    timeout_s: float,
    check: Callable[[], None] | None = None,
    salt: str = "",
) -> CompiledGrammar:
    """The compiled grammar for a JSON `schema`, from the cache or compiled now. `check` (the schema checks) runs
    first; an engine refusal without a location of its own gets `path`. The compile itself is bounded by
    `timeout_s` (SchemaError past it); waiting for the worker behind other compiles by `timeout_s` too (CompilerBusy,
    an HTTP 503). The digest covers the tokenizer, `kind`, `path`, `salt` (what else the check's error paths depend
    on) and the schema's JSON, keys in their order (it is the order properties are generated in)."""
    vocab = vocabulary(tokenizer)  # outside the time bound: once per tokenizer, not the schema's cost
    try:
        canonical = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise SchemaError(path, f"not a JSON value: {exc}") from None
    digest = hashlib.sha256(f"{vocab.key}\n{kind}\n{path}\n{salt}\n{canonical}".encode()).hexdigest()

    def build() -> CompiledGrammar:
        if check is not None:
            check()
        return _build(kind, digest, engine_schema(schema), vocab, path, timeout_s)

    try:
        return cache.get_or_start(digest, build).result()
    except SchemaError as exc:
        raise type(exc)(exc.path, exc.message) from None  # a fresh error: the cached one is shared


def _build(kind: str, digest: str, schema: Any, vocab: Vocabulary, path: str, timeout_s: float) -> CompiledGrammar:
    try:
        serialized = worker.compile(vocab.key, vocab.info_json, json.dumps(schema), timeout_s=timeout_s)
    except CompileTimeout:
        logger.warning("grammar compile for %s passed %.1f s: refused", path, timeout_s)
        raise CompileTimeoutError(
            path, f"the schema took longer than {timeout_s:g} s to compile; simplify it"
        ) from None
    except WorkerRefusal as exc:
        where = path if exc.path is None else format_path(path, tuple(exc.path))
        if exc.unsatisfiable:  # it compiled, but could start a value it can never finish (automata.py)
            raise SchemaError(where, exc.message) from None
        raise SchemaError(where, f"the grammar engine cannot enforce this: {exc.message}") from None
    except WorkerCrashed as exc:  # the child died on this schema (memory, a crash): refused; it restarts
        raise SchemaError(path, f"the grammar engine failed on this schema ({exc})") from None
    compiled = xgrammar.CompiledGrammar.deserialize_json(serialized, vocab.info)
    grammar = CompiledGrammar(kind, digest, compiled, vocab)
    mask = torch.zeros(vocab.words, dtype=torch.int32)
    grammar.constraint().fill_bitmask(mask)
    if not bool(mask.any()):
        raise SchemaError(path, "the schema cannot be satisfied: no JSON value fits it")
    return grammar
