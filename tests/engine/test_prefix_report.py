"""Which prompt prefixes the engine reports its prefix cache holds (GET /load's `prefixes`): the gateway's chunk
hashes (X-Loragate-Prefix, loragate_common/prefix.py) of recent prompts, as far as their leading blocks are still
cached.

KVCacheManager-level cases with fake compute steps (no model): what is held follows attaching, computing, eviction,
adapter invalidation and the bounds; then the whole engine on tiny-random over HTTP, the header sent the way the
gateway sends it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from engine.config import EngineConfig
from engine.core import memory
from engine.core.async_engine import AsyncEngine
from engine.core.llm_engine import PREFIX_REPORT_S, LLMEngine
from engine.core.memory import KVCacheManager, PagePool
from engine.core.request import Request, SamplingParams
from engine.entrypoints.server import build_app
from engine.lora.peft_config import AdapterKey
from loragate_common.prefix import HEADER, PromptChunks, prompt_chunks

from polling import poll
from processes import serve_in_thread

BS = 4
CHUNK_CHARS = 32
MAX_CHUNKS = 64
CHARS_PER_TOKEN = 4  # the fake prompts' proportion of text to tokens
SENTENCE = "The quick brown fox jumps over the lazy dog. "


def spec(adapter_id: str, version: int = 1) -> Any:
    """Stands in for AdapterSpec: the cache reads only its key (id and version)."""
    return SimpleNamespace(adapter_id=adapter_id, version=version, key=AdapterKey(adapter_id, version))


def chunks_of(text: str, adapter: str | None = None) -> PromptChunks:
    chunks = prompt_chunks({"prompt": text}, False, adapter, CHUNK_CHARS, MAX_CHUNKS)
    assert chunks is not None and chunks.hashes
    return chunks


def req(rid: str, text: str, first_token: int = 1000, adapter: str | None = None, **params: Any) -> Request:
    """A request for `text` (one token per CHARS_PER_TOKEN characters, ids from `first_token`) carrying its
    chunk hashes; requests with the same `first_token` share leading tokens as their texts share leading text."""
    tokens = list(range(first_token, first_token + len(text) // CHARS_PER_TOKEN))
    return Request(
        rid,
        tokens,
        SamplingParams(max_tokens=8, temperature=0.0, **params),
        adapter=None if adapter is None else spec(adapter),
        prefix_chunks=chunks_of(text, adapter),
    )


def covered_hashes(r: Request, tokens: int) -> tuple[str, ...]:
    """The leading hashes of `r`'s prompt within its first `tokens` tokens."""
    chunks = r.prefix_chunks
    assert chunks is not None
    return chunks.hashes[: chunks.covered(tokens, r.num_prompt_tokens)]


def make_kv(num_pages: int = 256, enable: bool = True) -> KVCacheManager:
    return KVCacheManager(PagePool(num_pages), BS, enable_prefix_cache=enable)


def compute(kv: KVCacheManager, r: Request, n: int | None = None) -> None:
    """One fake step for `r`: room for n more tokens (default: the rest of its prompt), computed, full blocks
    published."""
    n = r.num_tokens - r.num_computed_tokens if n is None else n
    assert kv.allocate_slots(r, n)
    r.num_computed_tokens += n
    kv.cache_full_blocks(r)


def admit(kv: KVCacheManager, r: Request, live: list[Request]) -> None:
    """Attach its cached prefix and compute the rest of its prompt."""
    kv.attach_cached_prefix(r)
    compute(kv, r)
    live.append(r)
    kv.check_invariants(live)


def finish(kv: KVCacheManager, r: Request, live: list[Request]) -> None:
    kv.free(r)
    live.remove(r)
    kv.check_invariants(live)


# ---- KVCacheManager ----------------------------------------------------------------------------------------


def test_held_prefixes_follow_the_cached_blocks() -> None:
    kv, live = make_kv(), list[Request]()
    r = req("r", SENTENCE * 6)  # 270 characters: 8 chunks; 67 tokens: 16 full blocks
    assert r.prefix_chunks is not None and len(r.prefix_chunks.hashes) == 8
    kv.attach_cached_prefix(r)
    live.append(r)
    assert kv.held_prefixes() == ()  # attached, nothing cached yet
    compute(kv, r, 22)  # a first chunk of the prompt: 5 full blocks
    kv.check_invariants(live)
    assert kv.held_prefixes() == covered_hashes(r, 20) and len(kv.held_prefixes()) == 2
    compute(kv, r)
    everything = covered_hashes(r, 64)
    assert kv.held_prefixes() == everything == r.prefix_chunks.hashes
    finish(kv, r, live)
    assert kv.held_prefixes() == everything  # idle cached blocks are still held
    for _ in range(3):  # the tail goes first
        assert kv.evict_cached()
    kv.check_invariants(live)
    assert kv.held_prefixes() == covered_hashes(r, 52) and len(kv.held_prefixes()) == 6
    kv.reset_prefix_cache()
    kv.check_invariants(live)
    assert kv.held_prefixes() == ()


def test_a_prompt_found_cached_counts_and_shared_hashes_come_once() -> None:
    kv, live = make_kv(), list[Request]()
    turn1 = req("turn1", SENTENCE * 4)
    admit(kv, turn1, live)
    finish(kv, turn1, live)
    turn2 = req("turn2", SENTENCE * 6)  # the same conversation one turn on: turn 1's text and tokens first
    assert kv.attach_cached_prefix(turn2) == 44  # turn 1's 11 full blocks
    live.append(turn2)
    kv.check_invariants(live)
    assert kv.held_prefixes() == covered_hashes(turn2, 44)  # most recent first; turn 1's hashes are its prefix
    compute(kv, turn2)
    kv.check_invariants(live)
    assert kv.held_prefixes() == covered_hashes(turn2, 64)
    again = req("again", SENTENCE * 6)  # the same prompt (another choice of it): one entry
    admit(kv, again, live)
    assert kv.held_prefixes() == covered_hashes(turn2, 64)


def test_requests_that_skip_the_lookup_are_reported() -> None:
    kv, live = make_kv(), list[Request]()
    r = req("logprobs", SENTENCE * 4, prompt_logprobs=0)  # computes its own prompt (no attach)
    compute(kv, r)
    live.append(r)
    kv.check_invariants(live)
    assert kv.held_prefixes() == covered_hashes(r, 44) != ()


def test_invalidate_adapter_drops_its_prefixes() -> None:
    kv, live = make_kv(), list[Request]()
    base = req("base", SENTENCE * 4)
    tuned = req("tuned", SENTENCE * 4, adapter="a")
    for r in (base, tuned):
        admit(kv, r, live)
    finish(kv, base, live)
    assert tuned.prefix_chunks is not None and base.prefix_chunks is not None
    assert kv.held_prefixes() == tuned.prefix_chunks.hashes + base.prefix_chunks.hashes
    kv.invalidate_adapter("a")  # held by a running request: its blocks stay with it, out of the cache
    kv.check_invariants(live)
    assert kv.held_prefixes() == base.prefix_chunks.hashes
    finish(kv, tuned, live)
    assert kv.held_prefixes() == base.prefix_chunks.hashes


def test_recent_prompts_and_limit_bound_the_report(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "RECENT_PROMPTS", 2)
    kv, live = make_kv(), list[Request]()
    prompts = [req(f"r{i}", f"prompt {i}: " + SENTENCE * 2, first_token=1000 * (i + 1)) for i in range(3)]
    for r in prompts:
        admit(kv, r, live)
    kv.check_invariants(live)
    newest, middle = (r.prefix_chunks.hashes for r in prompts[:0:-1] if r.prefix_chunks is not None)
    assert kv.held_prefixes() == newest + middle  # the oldest prompt left the recent ones
    assert kv.held_prefixes(limit=3) == newest[:3]
    assert kv.held_prefixes(limit=len(newest) + 1) == newest + middle[:1]
    assert kv.held_prefixes(limit=0) == ()


def test_requests_without_hashes_and_a_disabled_cache_report_nothing() -> None:
    kv, live = make_kv(), list[Request]()
    plain = Request("plain", list(range(40)), SamplingParams(max_tokens=4))
    empty = req("empty", SENTENCE * 4)
    empty.prefix_chunks = PromptChunks((), CHUNK_CHARS, 10)
    for r in (plain, empty):
        admit(kv, r, live)
    assert kv.num_cached_blocks > 0 and kv.held_prefixes() == ()
    off, live = make_kv(enable=False), list[Request]()
    admit(off, req("r", SENTENCE * 4), live)
    assert off.held_prefixes() == ()


# ---- the engine over HTTP ----------------------------------------------------------------------------------

PROMPT = SENTENCE * 12  # 540 characters: 16 chunks; about 120 tokens on tiny-random


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path) -> Iterator[str]:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", max_model_len=256))
    with serve_in_thread(build_app(AsyncEngine(engine))) as url:
        yield url


def prefixes(base: str) -> list[str]:
    body = httpx.get(f"{base}/load", timeout=10).json()
    assert isinstance(body["prefixes"], list)
    return body["prefixes"]


def post(base: str, path: str, body: dict[str, Any], headers: list[tuple[str, str]]) -> dict[str, Any]:
    resp = httpx.post(f"{base}{path}", json={**body, "max_tokens": 4}, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    return resp.json()


def expected(chunks: PromptChunks, prompt_tokens: int, block_size: int = 16) -> list[str]:
    """The leading hashes within the prompt's full blocks (all of them computed and cached)."""
    full = prompt_tokens // block_size * block_size
    return list(chunks.hashes[: chunks.covered(full, prompt_tokens)])


def wait_reported(base: str, chunks: PromptChunks, want: list[str]) -> None:
    """Poll /load until its hashes of this prompt are `want`, in order (the report refreshes once a second)."""
    mine = set(chunks.hashes)

    def probe() -> bool:
        return [h for h in prefixes(base) if h in mine] == want

    poll(probe, timeout_s=3 * PREFIX_REPORT_S + 1, interval_s=0.1, what="the prompt's hashes on /load")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_load_reports_the_prompt_hashes_the_engine_holds(base: str, path: str) -> None:
    chat = path.endswith("chat/completions")
    body: dict[str, Any] = {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    chunks = prompt_chunks(body, chat, None, CHUNK_CHARS, MAX_CHUNKS)
    assert chunks is not None and len(chunks.hashes) >= 16
    answer = post(base, path, body, [(HEADER, chunks.header())])
    want = expected(chunks, answer["usage"]["prompt_tokens"])
    assert len(want) >= 12
    wait_reported(base, chunks, want)


def test_every_choice_carries_the_hashes(base: str) -> None:
    text = "Two choices share this prompt and its blocks. " * 5
    chunks = prompt_chunks({"prompt": text}, False, None, CHUNK_CHARS, MAX_CHUNKS)
    assert chunks is not None
    answer = post(base, "/v1/completions", {"prompt": text, "n": 2}, [(HEADER, chunks.header())])
    assert len(answer["choices"]) == 2
    wait_reported(base, chunks, expected(chunks, answer["usage"]["prompt_tokens"]))


def test_a_malformed_or_repeated_header_is_ignored(base: str) -> None:
    text = "Another prompt entirely, told at length. " * 5
    chunks = prompt_chunks({"prompt": text}, False, None, CHUNK_CHARS, MAX_CHUNKS)
    assert chunks is not None
    bad = f"chunk={chunks.chunk}, total=1, hashes={','.join(chunks.hashes)}"  # more chunks than text
    assert PromptChunks.parse(bad) is None
    post(base, "/v1/completions", {"prompt": text}, [(HEADER, bad)])
    post(base, "/v1/completions", {"prompt": text}, [(HEADER, chunks.header()), (HEADER, chunks.header())])
    # A request with a good header after them: once its hashes are reported, the report came after theirs.
    marker_text = "A marker prompt, sent last. " * 6
    marker = prompt_chunks({"prompt": marker_text}, False, None, CHUNK_CHARS, MAX_CHUNKS)
    assert marker is not None
    answer = post(base, "/v1/completions", {"prompt": marker_text}, [(HEADER, marker.header())])
    want = expected(marker, answer["usage"]["prompt_tokens"])
    assert want
    wait_reported(base, marker, want)
    assert not set(chunks.hashes) & set(prefixes(base))


def test_the_held_prefixes_are_recomputed_at_most_once_a_second(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = LLMEngine(EngineConfig(dtype="float32", model="tiny-random", max_model_len=256, warmup=False))
    kv, calls = engine.scheduler.kv, []
    held = kv.held_prefixes

    def counted(limit: int = 4096) -> tuple[str, ...]:
        calls.append(limit)
        return held(limit)

    monkeypatch.setattr(kv, "held_prefixes", counted)
    time.sleep(PREFIX_REPORT_S)  # the report the constructor made is due again
    for _ in range(50):  # a report after every step
        engine.publish_load()
    assert len(calls) == 1 and engine.prefixes_stale
    engine.publish_stale_prefixes()  # too soon: kept
    assert len(calls) == 1
    time.sleep(PREFIX_REPORT_S)
    engine.publish_stale_prefixes()  # what an idle engine's thread does once a second
    assert len(calls) == 2 and not engine.prefixes_stale
    engine.publish_stale_prefixes()
    assert len(calls) == 2
