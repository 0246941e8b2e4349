"""Grammar engines for structured outputs, measured on CPU: llguidance, xgrammar and outlines-core, and `engine`
(engine/structured's GrammarConstraint: xgrammar as the engine runs it, through its vocabulary filter).

For each library and each JSON schema below, with the model's real tokenizer (SmolLM2-135M: 49,152 tokens, or
the tiny random model's 512):
- setup:    building the library's view of the tokenizer (once per model);
- compile:  schema -> grammar ready to make matchers (its library cache off), plus the first mask;
- matcher:  a fresh per-request matcher from the compiled grammar (new, and a copy of a started one);
- step:     per token of a JSON document that fits the schema: fill one bitmask row + advance by the token
            (median and mean µs; `fill` and `advance` apart too);
- batch32:  32 matchers walking the same document, one step = fill 32 rows (sequentially, and with the
            library's parallel batch call where it has one) + advance 32.
Every document token is checked against the mask the library filled (outside the timed part), so a library that
refuses the document is reported, not timed on a shorter walk. Single process; the machine should be quiet.

    python bench/structured_masks.py [--model smollm2|tiny-random] [--libs llguidance,xgrammar,outlines,engine]
                                     [--cases person,order,...] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.model.sources import load_tokenizer, resolve_model  # noqa: E402

BATCH = 32
ITEM_SEP, KEY_SEP = ", ", ": "  # the separators every library is given (json.dumps' defaults)

# (name, schema, a document that fits it, properties in schema order)
CASES: list[tuple[str, dict[str, Any], Any]] = [
    (
        "person",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "age": {"type": "integer", "minimum": 0, "maximum": 150},
                "member": {"type": "boolean"},
            },
            "required": ["name", "age", "member"],
            "additionalProperties": False,
        },
        {"name": "Ada Lovelace", "age": 36, "member": True},
    ),
    (
        "order",
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer"},
                "status": {"enum": ["pending", "paid", "shipped"]},
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 5,
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                            "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                            "price": {"type": "number", "minimum": 0},
                        },
                        "required": ["sku", "qty", "price"],
                        "additionalProperties": False,
                    },
                },
                "note": {"type": "string"},
            },
            "required": ["id", "status", "items"],
            "additionalProperties": False,
        },
        {
            "id": 1042,
            "status": "paid",
            "items": [
                {"sku": "ABC-0001", "qty": 2, "price": 9.5},
                {"sku": "XYZ-1234", "qty": 1, "price": 120.25},
                {"sku": "QRS-9000", "qty": 12, "price": 0.99},
            ],
            "note": "Leave the parcel at the door, please.",
        },
    ),
    (
        "union",
        {
            "type": "object",
            "properties": {
                "shapes": {
                    "type": "array",
                    "maxItems": 4,
                    "items": {
                        "anyOf": [
                            {
                                "type": "object",
                                "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                                "required": ["kind", "r"],
                                "additionalProperties": False,
                            },
                            {
                                "type": "object",
                                "properties": {
                                    "kind": {"const": "rect"},
                                    "w": {"type": "number"},
                                    "h": {"type": "number"},
                                },
                                "required": ["kind", "w", "h"],
                                "additionalProperties": False,
                            },
                        ]
                    },
                },
                "label": {"type": ["string", "null"]},
            },
            "required": ["shapes", "label"],
            "additionalProperties": False,
        },
        {"shapes": [{"kind": "circle", "r": 2.5}, {"kind": "rect", "w": 3, "h": 4}], "label": None},
    ),
    (
        "strings",
        {
            "type": "object",
            "properties": {
                "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                "title": {"type": "string", "minLength": 5, "maxLength": 80},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
                "summary": {"type": "string", "maxLength": 300},
            },
            "required": ["date", "title", "tags", "summary"],
            "additionalProperties": False,
        },
        {
            "date": "2026-12-01",
            "title": "Structured outputs on CPU",
            "tags": ["grammar", "json", "serving"],
            "summary": "Three grammar engines are measured with one tokenizer: the cost to compile a schema "
            "and the cost of each decoding step, where a bitmask row is filled and the matcher advanced.",
        },
    ),
    (
        "json_object",
        {"type": "object"},
        {"city": "Paris", "population": 2102650, "landmarks": ["Louvre", "Eiffel Tower"], "capital": True},
    ),
]


class Library:
    """One grammar engine behind a common face: compile a schema, make matchers, fill rows, advance."""

    name = ""
    has_par = False

    def setup(self, tokenizer: Any) -> None: ...
    def compile(self, schema: dict[str, Any]) -> Any: ...
    def matcher(self, grammar: Any) -> Any: ...
    def copy(self, matcher: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None: ...
    def advance(self, matcher: Any, token: int) -> None: ...
    def fill_par(self, matchers: list[Any], bitmask: torch.Tensor) -> None: ...


class LLGuidance(Library):
    name = "llguidance"
    has_par = True

    def setup(self, tokenizer: Any) -> None:
        import llguidance
        import llguidance.hf

        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.executor = llguidance.LLExecutor(num_threads=2)

    def compile(self, schema: dict[str, Any]) -> Any:
        options = {"whitespace_flexible": False, "item_separator": ITEM_SEP, "key_separator": KEY_SEP}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)  # type: ignore[arg-type]
        matcher = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def matcher(self, grammar: Any) -> Any:
        return self.llg.LLMatcher(self.tok, grammar, log_level=0)

    def copy(self, matcher: Any) -> Any:
        return matcher.deep_copy()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), bitmask.shape[1] * 4)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()

    def fill_par(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        pairs = [(m, i) for i, m in enumerate(matchers)]
        self.executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])


class XGrammar(Library):
    name = "xgrammar"
    has_par = True

    def setup(self, tokenizer: Any) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self.batch = xgrammar.BatchGrammarMatcher(max_threads=2)

    def compile(self, schema: dict[str, Any]) -> Any:
        return self.compiler.compile_json_schema(
            schema, any_whitespace=False, separators=(ITEM_SEP, KEY_SEP), strict_mode=False
        )

    def matcher(self, grammar: Any) -> Any:
        return self.xgr.GrammarMatcher(grammar)

    def copy(self, matcher: Any) -> Any:
        return matcher.fork()

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)

    def fill_par(self, matchers: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(matchers, bitmask)


class OutlinesCore(Library):
    name = "outlines"

    def setup(self, tokenizer: Any) -> None:
        import outlines_core

        self.oc = outlines_core
        self.vocabulary = outlines_core.Vocabulary(tokenizer.eos_token_id, _byte_vocabulary(tokenizer))

    def compile(self, schema: dict[str, Any]) -> Any:
        # outlines-core has no separator option: its regex puts an optional whitespace run around ',' and ':'.
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(schema), whitespace_pattern=" ?")
        return self.oc.Index(regex, self.vocabulary)

    def matcher(self, grammar: Any) -> Any:
        return self.oc.Guide(grammar)

    def copy(self, matcher: Any) -> Any:
        raise NotImplementedError  # a Guide has no copy; its state is an int (get_state), a new Guide is cheap

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.write_mask_into(bitmask[row].data_ptr(), bitmask.shape[1], 4)

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token, return_tokens=False)


class Engine(Library):
    """What the engine runs: engine/structured's GrammarConstraint (xgrammar behind its vocabulary filter and UTF-8
    guard), compiled through the worker process and the digest cache (cleared per compile, so it is timed)."""

    name = "engine"

    def setup(self, tokenizer: Any) -> None:
        from engine.structured import grammars, prepare_tokenizer

        self.grammars = grammars
        self.tokenizer = tokenizer
        prepare_tokenizer(tokenizer)

    def compile(self, schema: dict[str, Any]) -> Any:
        from engine.structured import compile_response_format

        spec = {"type": "json_schema", "json_schema": {"name": "bench", "schema": schema}}
        self.grammars.cache.size = 0  # every compile a miss: the figure is the compile, not the cache
        try:
            return compile_response_format(spec, self.tokenizer)
        finally:
            self.grammars.cache.size = self.grammars.CACHE_SIZE

    def matcher(self, grammar: Any) -> Any:
        return grammar.constraint()

    def copy(self, matcher: Any) -> Any:
        raise NotImplementedError  # constraints are made from the compiled grammar (`matcher`, a fork)

    def fill(self, matcher: Any, bitmask: torch.Tensor, row: int) -> None:
        matcher.fill_bitmask(bitmask[row])

    def advance(self, matcher: Any, token: int) -> None:
        matcher.advance(token)


def _byte_vocabulary(tokenizer: Any) -> dict[bytes, list[int]]:
    """Token bytes -> ids for a byte-level BPE tokenizer (GPT-2's byte-to-unicode map undone); special tokens out."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    byte_of = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            byte_of[chr(256 + extra)] = b
            extra += 1
    special = set(tokenizer.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id in special or token_id >= len(tokenizer):
            continue
        if all(ch in byte_of for ch in piece):
            out.setdefault(bytes(byte_of[ch] for ch in piece), []).append(token_id)
    return out


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def _allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def measure_case(lib: Library, schema: dict[str, Any], tokens: list[int], words: int) -> dict[str, Any]:
    grammar, compile_s = _timed(lambda: lib.compile(schema))
    bitmask = torch.zeros((BATCH, words), dtype=torch.int32)
    matcher, new_s = _timed(lambda: lib.matcher(grammar))
    _, first_s = _timed(lambda: lib.fill(matcher, bitmask, 0))
    copy_us = None
    if lib.name in ("llguidance", "xgrammar"):
        copy_us = min(_timed(lambda: lib.copy(matcher))[1] for _ in range(20)) * 1e6
    # One walk over the document: per step, fill + advance timed apart; every token checked against its mask.
    matcher = lib.matcher(grammar)
    fills, advances = [], []
    for pos, token in enumerate(tokens):
        t0 = time.perf_counter_ns()
        lib.fill(matcher, bitmask, 0)
        t1 = time.perf_counter_ns()
        if not _allowed(bitmask, 0, token):
            return {"error": f"refuses document token {pos} ({token})"}
        t2 = time.perf_counter_ns()
        lib.advance(matcher, token)
        t3 = time.perf_counter_ns()
        fills.append((t1 - t0) / 1e3)
        advances.append((t3 - t2) / 1e3)
    steps = [f + a for f, a in zip(fills, advances, strict=True)]
    result = {
        "tokens": len(tokens),
        "compile_ms": round((compile_s + first_s) * 1e3, 2),
        "new_matcher_us": round(new_s * 1e6, 1),
        "copy_matcher_us": None if copy_us is None else round(copy_us, 1),
        "step_median_us": round(statistics.median(steps), 1),
        "step_mean_us": round(statistics.fmean(steps), 1),
        "fill_mean_us": round(statistics.fmean(fills), 1),
        "advance_mean_us": round(statistics.fmean(advances), 1),
        "step_max_us": round(max(steps), 1),
    }
    result["batch32_seq_us"] = round(_batch_step_us(lib, grammar, tokens, bitmask, par=False), 1)
    if lib.has_par:
        result["batch32_par_us"] = round(_batch_step_us(lib, grammar, tokens, bitmask, par=True), 1)
    return result


def _batch_step_us(lib: Library, grammar: Any, tokens: list[int], bitmask: torch.Tensor, *, par: bool) -> float:
    """Mean µs per step for BATCH matchers walking the document together (fill every row, advance every matcher)."""
    matchers = [lib.matcher(grammar) for _ in range(BATCH)]
    start = time.perf_counter()
    for token in tokens:
        if par:
            lib.fill_par(matchers, bitmask)
        else:
            for row, m in enumerate(matchers):
                lib.fill(m, bitmask, row)
        for m in matchers:
            lib.advance(m, token)
    return (time.perf_counter() - start) / len(tokens) * 1e6


LIBRARIES: dict[str, Callable[[], Library]] = {
    "llguidance": LLGuidance,
    "xgrammar": XGrammar,
    "outlines": OutlinesCore,
    "engine": Engine,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--libs", default="llguidance,xgrammar,outlines,engine")
    parser.add_argument("--cases", default=",".join(case for case, _, _ in CASES))
    parser.add_argument("--rounds", type=int, default=3, help="walks per case; the fastest round is kept")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(resolve_model(args.model).path)
    words = (len(tokenizer) + 31) // 32
    print(f"model {args.model}: vocab {len(tokenizer)}, bitmask row {words} int32 words", flush=True)
    results: list[dict[str, Any]] = []
    for lib_name in args.libs.split(","):
        lib = LIBRARIES[lib_name]()
        _, setup_s = _timed(lambda lib=lib: lib.setup(tokenizer))  # type: ignore[misc]
        print(f"\n{lib_name}: tokenizer setup {setup_s * 1e3:.0f} ms", flush=True)
        for case, schema, document in CASES:
            if case not in args.cases.split(","):
                continue
            tokens = tokenizer.encode(json.dumps(document, separators=(ITEM_SEP, KEY_SEP)), add_special_tokens=False)
            rounds = []
            for _ in range(args.rounds):
                try:
                    rounds.append(measure_case(lib, schema, tokens, words))
                except Exception as exc:  # a library that cannot compile the case is reported, not fatal
                    rounds.append({"error": f"{type(exc).__name__}: {str(exc)[:200]}"})
            ok = [r for r in rounds if "error" not in r]
            best = min(ok, key=lambda r: r["step_mean_us"]) if ok else rounds[0]
            if ok:  # compile time: the fastest round too (the first pays for warming caches)
                best = {**best, "compile_ms": min(r["compile_ms"] for r in ok)}
            row = {"library": lib_name, "case": case, "setup_ms": round(setup_s * 1e3, 1), **best}
            results.append(row)
            print(f"  {case:12s} " + "  ".join(f"{k}={v}" for k, v in best.items()), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"model": args.model, "results": results}, indent=2))


if __name__ == "__main__":
    main()
