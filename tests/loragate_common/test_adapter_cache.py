"""The disk cache of fetched adapters (loragate_common/adapter_cache.py) against real archive and Hub-shaped
servers on 127.0.0.1: single-flight downloads (counted at the server), failure backoff, the allow-list
checked before anything is fetched, a download killed mid-way (a real process, SIGKILL), and LRU eviction
that never touches a pinned entry. The files on disk are compared with the sources; digests with hashlib.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from loragate_common.adapter_cache import TMP_PREFIX, AdapterCache, FetchBackoff
from loragate_common.adapter_sources import AllowList, SourceError

from adapter_servers import (
    ADAPTER_FILES,
    ArchiveServer,
    FaultyServer,
    HubServer,
    adapter_archive,
    sha256sum_digest,
    synthetic_adapter,
)
from polling import poll

REPO = Path(__file__).resolve().parents[2]
KB = 1 << 10


@pytest.fixture
def archives() -> Iterator[ArchiveServer]:
    with ArchiveServer() as server:
        yield server


def publish(server: ArchiveServer, directory: Path, name: str, kind: str = "tgz") -> tuple[str, str]:
    """Serve `directory` as /adapters/NAME.KIND; (its URL, the archive's sha256)."""
    data = adapter_archive(directory, kind)
    return server.put(f"/adapters/{name}.{kind}", data), hashlib.sha256(data).hexdigest()


def make_store(
    root: Path,
    server: FaultyServer,
    evicted: list[str] | None = None,
    *,
    max_bytes: int = 1 << 30,
    max_adapter_bytes: int = 1 << 30,
    backoff_s: float = 1.0,
    max_backoff_s: float = 60.0,
    allow: list[str] | None = None,
) -> AdapterCache:
    """A store allowed to fetch from `server`'s /adapters/ (or `allow`); evicted sha256s go to `evicted`."""
    return AdapterCache(
        root,
        max_bytes=max_bytes,
        max_adapter_bytes=max_adapter_bytes,
        allow=AllowList(allow if allow is not None else [server.url + "/adapters/"]),
        fetch_timeout_s=10.0,
        on_evict=(evicted if evicted is not None else []).append,
        backoff_s=backoff_s,
        max_backoff_s=max_backoff_s,
    )


def assert_entry(path: Path, source: Path) -> None:
    assert sorted(os.listdir(path)) == sorted([*ADAPTER_FILES, "meta.json"])
    for name in ADAPTER_FILES:
        assert (path / name).read_bytes() == (source / name).read_bytes()


def test_twenty_concurrent_ensures_share_one_download(archives: ArchiveServer, tmp_path: Path) -> None:
    adapter = synthetic_adapter(tmp_path / "a", 64 * KB, seed=1)
    url, sha = publish(archives, adapter, "a")
    archives.fault("/adapters/a.tgz", delay_s=0.3)  # every caller arrives while the download runs
    store = make_store(tmp_path / "cache", archives)

    async def scenario() -> list[Path]:
        return await asyncio.gather(*(store.ensure(url, sha, None) for _ in range(20)))

    paths = asyncio.run(scenario())
    assert archives.count("/adapters/a.tgz") == 1
    assert set(paths) == {tmp_path / "cache" / sha}
    assert_entry(paths[0], adapter)
    meta = json.loads((paths[0] / "meta.json").read_text())
    assert (meta["source"], meta["sha256"]) == (url, sha)
    assert meta["size"] == sum((adapter / name).stat().st_size for name in ADAPTER_FILES)
    [status] = store.status()
    assert (status["sha256"], status["state"], status["downloads"], status["error"]) == (sha, "disk", 1, None)
    assert isinstance(status["download_s"], float) and status["download_s"] > 0
    assert store.status_of(sha) == store.status()[0] and store.status_of("0" * 64) is None
    assert store.entry(sha) == paths[0]
    assert asyncio.run(store.ensure(url, sha, None)) == paths[0]
    assert archives.count("/adapters/a.tgz") == 1  # served from disk afterwards
    assert not [p for p in (tmp_path / "cache").iterdir() if p.name.startswith(TMP_PREFIX)]


def test_concurrent_ensures_of_a_hub_adapter_download_each_file_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    adapter = synthetic_adapter(tmp_path / "a", 64 * KB, seed=8)
    sha = sha256sum_digest(adapter)  # hf sources are pinned by the content digest
    with HubServer() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        commit = hub.add_repo("org/a", adapter)
        hub.fault("/org/a/resolve/*", delay_s=0.2)
        store = make_store(tmp_path / "cache", hub, allow=["hf://org/"])

        async def scenario() -> list[Path]:
            return await asyncio.gather(*(store.ensure("hf://org/a", sha, None) for _ in range(20)))

        paths = asyncio.run(scenario())
        assert set(paths) == {tmp_path / "cache" / sha}
        assert_entry(paths[0], adapter)
        assert hub.count("/api/models/org/a") == 1
        for name in ADAPTER_FILES:
            assert hub.count(f"/org/a/resolve/{commit}/{name}") == 1
        assert json.loads((paths[0] / "meta.json").read_text())["revision"] == commit


def test_the_allow_list_is_checked_before_anything(archives: ArchiveServer, tmp_path: Path) -> None:
    adapter = synthetic_adapter(tmp_path / "a", KB, seed=2)
    data = adapter_archive(adapter, "tgz")
    sha = hashlib.sha256(data).hexdigest()
    outside = [
        archives.put("/adapters-evil/a.tgz", data),  # the allowed prefix is /adapters/: a segment boundary
        archives.put("/other/a.tgz", data),
        archives.url.replace("127.0.0.1", "localhost") + "/adapters/a.tgz",
    ]
    store = make_store(tmp_path / "cache", archives)
    for url in outside:
        with pytest.raises(SourceError) as info:
            asyncio.run(store.ensure(url, sha, None))
        assert info.value.reason == "not_allowed"
        assert not isinstance(info.value, FetchBackoff)
    with pytest.raises(SourceError) as info:
        asyncio.run(store.ensure(archives.url + "/adapters/../other/a.tgz", sha, None))
    assert info.value.reason == "invalid"
    assert sum(archives.requests.values()) == 0
    assert store.status() == []


def test_a_failure_backs_off_then_is_retried(archives: ArchiveServer, tmp_path: Path) -> None:
    adapter = synthetic_adapter(tmp_path / "a", KB, seed=3)
    url, sha = publish(archives, adapter, "a")
    archives.fault("/adapters/a.tgz", status=500)
    store = make_store(tmp_path / "cache", archives, backoff_s=0.5, max_backoff_s=10.0)

    with pytest.raises(FetchBackoff) as info:
        asyncio.run(store.ensure(url, sha, None))
    assert (info.value.reason, info.value.retry_after_s) == ("unreachable", 0.5)
    assert "HTTP 500" in str(info.value)
    # Within the backoff: refused at once, nothing fetched.
    with pytest.raises(FetchBackoff) as info:
        asyncio.run(store.ensure(url, sha, None))
    assert info.value.reason == "unreachable" and 0 < info.value.retry_after_s <= 0.5
    assert archives.count("/adapters/a.tgz") == 1
    [status] = store.status()
    assert (status["state"], status["reason"]) == ("failed", "unreachable")

    # The second failure in a row doubles the backoff.
    time.sleep(0.55)
    with pytest.raises(FetchBackoff) as info:
        asyncio.run(store.ensure(url, sha, None))
    assert info.value.retry_after_s == 1.0
    assert archives.count("/adapters/a.tgz") == 2

    archives.reset()
    time.sleep(1.05)
    assert_entry(asyncio.run(store.ensure(url, sha, None)), adapter)
    assert archives.count("/adapters/a.tgz") == 1
    assert store.status()[0]["state"] == "disk"


def test_wrong_content_is_never_cached(archives: ArchiveServer, tmp_path: Path) -> None:
    adapter = synthetic_adapter(tmp_path / "a", KB, seed=4)
    url, sha = publish(archives, adapter, "a")
    wrong = hashlib.sha256(b"another archive").hexdigest()
    store = make_store(tmp_path / "cache", archives)
    with pytest.raises(FetchBackoff) as info:
        asyncio.run(store.ensure(url, wrong, None))
    assert info.value.reason == "digest_mismatch"
    assert sha in str(info.value)
    assert os.listdir(tmp_path / "cache") == []
    assert store.entry(wrong) is None


def test_adapter_larger_than_its_cap(archives: ArchiveServer, tmp_path: Path) -> None:
    adapter = synthetic_adapter(tmp_path / "a", 64 * KB, seed=5)
    url, sha = publish(archives, adapter, "a")
    store = make_store(tmp_path / "cache", archives, max_adapter_bytes=32 * KB)
    with pytest.raises(FetchBackoff) as info:
        asyncio.run(store.ensure(url, sha, None))
    assert info.value.reason == "too_large"
    assert os.listdir(tmp_path / "cache") == []


# A process that fetches one adapter into a cache; the test kills it mid-download.
FETCH_SCRIPT = """
import asyncio, sys
from pathlib import Path
from loragate_common.adapter_cache import AdapterCache
from loragate_common.adapter_sources import AllowList
root, url, sha, allow = sys.argv[1:5]
store = AdapterCache(Path(root), 1 << 30, 1 << 30, AllowList([allow]), 60.0, print)
asyncio.run(store.ensure(url, sha, None))
"""


def test_a_download_killed_midway_leaves_nothing_behind(archives: ArchiveServer, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    done = synthetic_adapter(tmp_path / "done", 8 * KB, seed=6)
    done_url, done_sha = publish(archives, done, "done")
    assert_entry(asyncio.run(make_store(root, archives).ensure(done_url, done_sha, None)), done)

    slow = synthetic_adapter(tmp_path / "slow", 256 * KB, seed=7)
    slow_url, slow_sha = publish(archives, slow, "slow", "tar")  # uncompressed: 256 KiB on the wire
    archives.fault("/adapters/slow.tar", chunk_bytes=4 * KB, chunk_delay_s=0.2)
    argv = [sys.executable, "-c", FETCH_SCRIPT, str(root), slow_url, slow_sha, archives.url + "/adapters/"]
    proc = subprocess.Popen(argv, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    try:
        parts = poll(lambda: [p for p in root.glob(f"{TMP_PREFIX}*/*") if p.stat().st_size > 0], 20, what="bytes")
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == -9
    assert parts and (root / slow_sha).exists() is False

    evicted: list[str] = []
    store = make_store(root, archives, evicted)
    assert sorted(p.name for p in root.iterdir()) == [done_sha]
    assert_entry(root / done_sha, done)
    assert store.entry(done_sha) == root / done_sha
    assert [(s["sha256"], s["state"], s["source"]) for s in store.status()] == [(done_sha, "disk", done_url)]
    assert store.status()[0]["download_s"] is None  # on disk before this process's cache started
    assert evicted == []


def test_lru_eviction_spares_pinned_entries(archives: ArchiveServer, tmp_path: Path) -> None:
    sources = {name: synthetic_adapter(tmp_path / name, 16 * KB, seed=seed) for seed, name in enumerate("abcde")}
    urls = {name: publish(archives, directory, name) for name, directory in sources.items()}
    size = sum((sources["a"] / name).stat().st_size for name in ADAPTER_FILES)
    evicted: list[str] = []
    store = make_store(tmp_path / "cache", archives, evicted, max_bytes=2 * size + size // 2, backoff_s=0.1)

    def ensure(name: str) -> Path:
        url, sha = urls[name]
        return asyncio.run(store.ensure(url, sha, None))

    sha = {name: urls[name][1] for name in urls}
    ensure("a")
    ensure("b")
    assert store.entry(sha["a"]) is not None  # a is now more recently used than b
    ensure("c")
    assert evicted == [sha["b"]]  # the least recently used
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([sha["a"], sha["c"]])

    store.pin(sha["a"])  # a is least recently used now, but in use
    ensure("d")
    assert evicted == [sha["b"], sha["c"]]
    assert store.entry(sha["a"]) is not None and store.total_bytes() == 2 * size

    store.pin(sha["d"])
    with pytest.raises(FetchBackoff) as info:  # both entries in use: nothing may go
        ensure("e")
    assert info.value.reason == "too_large" and "in use" in str(info.value)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([sha["a"], sha["d"]])
    assert evicted == [sha["b"], sha["c"]]

    store.unpin(sha["d"])
    time.sleep(0.15)  # the failed fetch's backoff
    assert_entry(ensure("e"), sources["e"])
    assert evicted == [sha["b"], sha["c"], sha["d"]]
    assert store.entry(sha["a"]) is not None
    with pytest.raises(ValueError):
        store.unpin(sha["d"])


def test_a_kept_cache_larger_than_its_new_bound_is_trimmed(archives: ArchiveServer, tmp_path: Path) -> None:
    root = tmp_path / "cache"
    first = make_store(root, archives)
    shas: list[str] = []
    for name in ("a", "b", "c"):
        url, sha = publish(archives, synthetic_adapter(tmp_path / name, 8 * KB, seed=ord(name)), name)
        asyncio.run(first.ensure(url, sha, None))
        os.utime(root / sha, (time.time() - 100 + len(shas), time.time() - 100 + len(shas)))  # a oldest
        shas.append(sha)
    size = first.total_bytes() // 3
    evicted: list[str] = []
    make_store(root, archives, evicted, max_bytes=2 * size)
    assert evicted == [shas[0]]
    assert sorted(p.name for p in root.iterdir()) == sorted(shas[1:])


def test_an_entry_says_what_the_adapter_is(archives: ArchiveServer, tmp_path: Path) -> None:
    """The fetcher reads a PEFT adapter's kind, rank and modules from its files (torch-free), keeps them in meta.json
    and shows them in its status, after a restart too: what PEFT's own config and model say."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base = LlamaForCausalLM(
        LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    )
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "embed_tokens"], use_dora=True)
    peft_model = get_peft_model(base, config)
    peft_model.save_pretrained(str(tmp_path / "dora"), save_embedding_layers=False)
    adapted = sorted({name.split(".")[-1] for name, module in peft_model.named_modules() if hasattr(module, "r")})
    url, sha = publish(archives, tmp_path / "dora", "dora")
    store = make_store(tmp_path / "cache", archives)
    path = asyncio.run(store.ensure(url, sha, None))
    expected = {"kind": "DoRA", "rank": 4, "target_modules": adapted}
    assert store.status_of(sha)["adapter"] == expected  # type: ignore[index]
    assert json.loads((path / "meta.json").read_text())["adapter"] == expected
    assert make_store(tmp_path / "cache", archives).status_of(sha)["adapter"] == expected  # type: ignore[index]
