"""Adapters fetched on their first request, end to end: a real `loragate engine` process with
--adapter-cache-dir, sources on 127.0.0.1 (a real S3 API from moto_server, a Hub-shaped server read by
huggingface_hub, an archive server), requests carrying the headers the gateway sets
(engine/entrypoints/fetched_adapters.py). Outputs are compared with PEFT's greedy decoding of the same
adapter loaded from a local directory; downloads are counted at the servers.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.model.sources import load_tokenizer

from adapter_servers import (
    ArchiveServer,
    HubServer,
    MotoServer,
    adapter_archive,
    copy_adapter,
    moto_server_fixture,
    sha256sum_digest,
    synthetic_adapter,
)
from lora_fixtures import make_peft_adapter, peft_greedy
from polling import poll
from processes import free_port, start_engine_server

PROMPT = "The quick brown fox"
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
BUCKET = "adapters"
LOAD_WAIT_S = 2.0

moto = moto_server_fixture()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fetched-adapters")
    return {
        name: make_peft_adapter(tiny_model_dir, root / name, r=r, alpha=2 * r, targets=targets, seed=seed, b_std=0.5)
        for name, r, targets, seed in (
            ("alpha", 8, ["q_proj", "v_proj"], 1),
            ("beta", 4, ["o_proj", "down_proj"], 2),
            ("gamma", 4, ["k_proj", "up_proj"], 3),
        )
    }


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


@pytest.fixture(scope="module")
def files() -> Iterator[ArchiveServer]:
    with ArchiveServer() as server:
        yield server


def _engine(tmp: Path, cache: Path, moto: MotoServer, hub: HubServer, files: ArchiveServer, *extra: str) -> Any:
    dead_port = free_port()  # nothing listens here: a source that is down
    allow = [f"s3://{BUCKET}/team/", "hf://org/", f"{files.url}/pub/", f"http://127.0.0.1:{dead_port}/"]
    env = {**moto.env(), "HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0"}
    with pytest.MonkeyPatch.context() as mp:
        for key, value in env.items():
            mp.setenv(key, value)
        proc, base = start_engine_server(
            tmp / "engine.log",
            "--max-model-len",
            "256",
            "--adapter-cache-dir",
            str(cache),
            "--adapter-source-allow",
            *allow,
            "--adapter-load-wait-s",
            str(LOAD_WAIT_S),
            "--adapter-max-mb",
            "1",
            *extra,
        )
    return proc, base, dead_port


@pytest.fixture(scope="module")
def engine(
    tmp_path_factory: pytest.TempPathFactory, moto: MotoServer, hub: HubServer, files: ArchiveServer
) -> Iterator[tuple[str, int]]:
    tmp = tmp_path_factory.mktemp("engine")
    proc, base, dead_port = _engine(tmp, tmp / "cache", moto, hub, files)
    yield base, dead_port
    proc.terminate()
    proc.wait(timeout=60)


def _headers(adapter_id: str, source: str, sha256: str, size: int | None = None) -> dict[str, str]:
    headers = {"X-Adapter-ID": adapter_id, "X-Adapter-Source": source, "X-Adapter-SHA256": sha256}
    if size is not None:
        headers["X-Adapter-Size"] = str(size)
    return headers


def _complete(base: str, headers: dict[str, str], **overrides: Any) -> httpx.Response:
    body = {"prompt": PROMPT, **GREEDY, **overrides}
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)


def _text(resp: httpx.Response) -> str:
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


def _error(resp: httpx.Response, status: int, type_: str, *needles: str) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_, error
    for needle in needles:
        assert needle in error["message"], error["message"]
    return error


def _peft_text(tiny_model_dir: Path, adapter_dir: Path) -> str:
    tokenizer = load_tokenizer(tiny_model_dir)
    ids = peft_greedy(tiny_model_dir, adapter_dir, tokenizer(PROMPT)["input_ids"], GREEDY["max_tokens"])
    return tokenizer.decode(ids)


def _size(directory: Path) -> int:
    return sum((directory / name).stat().st_size for name in ("adapter_config.json", "adapter_model.safetensors"))


def _metric(base: str, name: str) -> float:
    """One sample of the engine's /metrics, read with prometheus-client's own parser."""
    text = httpx.get(f"{base}/metrics", timeout=10).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _cards(base: str) -> list[dict[str, Any]]:
    return httpx.get(f"{base}/v1/adapters", timeout=10).json()["data"]


# ---- served from each kind of source -----------------------------------------------------------------------


def test_each_source_serves_what_peft_computes_from_the_local_directory(
    engine: tuple[str, int],
    adapters: dict[str, Path],
    moto: MotoServer,
    hub: HubServer,
    files: ArchiveServer,
    tiny_model_dir: Path,
) -> None:
    base, _ = engine
    alpha = adapters["alpha"]
    expected = _peft_text(tiny_model_dir, alpha)
    digest = sha256sum_digest(alpha)
    s3 = moto.put_adapter(BUCKET, "team/alpha/v1", alpha)
    hub.add_repo("org/alpha", alpha)
    archive = adapter_archive(alpha, "tgz", folder="alpha")
    url = files.put("/pub/alpha.tar.gz", archive)
    archive_digest = hashlib.sha256(archive).hexdigest()
    for adapter_id, source, sha in (
        ("team/alpha@1", s3, digest),
        ("hub-alpha@1", "hf://org/alpha", digest),
        ("archive-alpha@1", url, archive_digest),
    ):
        assert _text(_complete(base, _headers(adapter_id, source, sha, _size(alpha)))) == expected, source
    cards = {card["id"]: card for card in _cards(base)}
    assert cards["team/alpha@1"]["source"].startswith(f"s3://{BUCKET}/team/alpha/v1")
    assert cards["team/alpha@1"]["sha256"] == digest
    assert cards["team/alpha@1"]["state"] in ("disk", "host", "device")
    assert cards["team/alpha@1"]["last_used"] is not None
    # The same content from two sources is one cache entry; the next request downloads nothing.
    before = hub.count("/org/alpha/resolve/*/adapter_model.safetensors")
    assert _text(_complete(base, _headers("team/alpha@1", s3, digest))) == expected
    assert hub.count("/org/alpha/resolve/*/adapter_model.safetensors") == before


def test_twenty_concurrent_first_requests_share_one_download(
    engine: tuple[str, int], adapters: dict[str, Path], files: ArchiveServer, tiny_model_dir: Path
) -> None:
    base, _ = engine
    beta = adapters["beta"]
    archive = adapter_archive(beta, "zip")
    url = files.put("/pub/beta.zip", archive)
    files.fault("/pub/beta.zip", chunk_delay_s=0.05, chunk_bytes=4096)  # slow enough that all 20 wait on it
    headers = _headers("beta@1", url, hashlib.sha256(archive).hexdigest())
    downloads = _metric(base, "loragate_engine_adapter_downloads_total")

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            body = {"prompt": PROMPT, **GREEDY}
            calls = [client.post(f"{base}/v1/completions", json=body, headers=headers) for _ in range(20)]
            return await asyncio.gather(*calls)

    answers = asyncio.run(burst())
    assert files.count("/pub/beta.zip") == 1
    texts = {_text(resp) for resp in answers if resp.status_code == 200}
    loading = [resp for resp in answers if resp.status_code != 200]
    for resp in loading:  # a download slower than --adapter-load-wait-s: told to come back, never a 404
        _error(resp, 503, "service_unavailable")
        assert resp.headers["X-Loragate-Reason"] == "adapter_loading"
        assert int(resp.headers["Retry-After"]) >= 1
    poll(lambda: _complete(base, headers).status_code == 200, 30, what="beta served")
    assert files.count("/pub/beta.zip") == 1
    assert _metric(base, "loragate_engine_adapter_downloads_total") == downloads + 1
    assert texts <= {_peft_text(tiny_model_dir, beta)}
    assert _text(_complete(base, headers)) == _peft_text(tiny_model_dir, beta)


def test_a_slow_source_answers_adapter_loading_then_serves(
    engine: tuple[str, int], adapters: dict[str, Path], moto: MotoServer, hub: HubServer
) -> None:
    base, _ = engine
    gamma = adapters["gamma"]
    hub.add_repo("org/slow", gamma)
    hub.fault("/org/slow/resolve/*/adapter_model.safetensors", delay_s=LOAD_WAIT_S + 1.5)
    headers = _headers("slow@1", "hf://org/slow", sha256sum_digest(gamma))
    first = _complete(base, headers)
    _error(first, 503, "service_unavailable", "being fetched")
    assert first.headers["X-Loragate-Reason"] == "adapter_loading"
    assert any(card["state"] == "downloading" for card in _cards(base))
    poll(lambda: _complete(base, headers).status_code == 200, 30, what="slow adapter served")
    assert hub.count("/org/slow/resolve/*/adapter_model.safetensors") == 1


# ---- faults ------------------------------------------------------------------------------------------------


def test_source_faults_are_502_with_the_reason_and_not_hammered(
    engine: tuple[str, int], adapters: dict[str, Path], moto: MotoServer, files: ArchiveServer, tmp_path: Path
) -> None:
    base, dead_port = engine
    alpha = adapters["alpha"]
    # Digests no cache entry has (the cache is content-addressed: a cached digest needs no source at all).
    digest = secrets.token_hex(32)
    # 404: nothing at that URL. Asked again at once: the same answer, and no second request to the source.
    missing = f"{files.url}/pub/missing.tar.gz"
    error = _error(_complete(base, _headers("missing@1", missing, digest)), 502, "adapter_fetch_failed")
    assert "404" in error["message"] or "not found" in error["message"].lower()
    again = _complete(base, _headers("missing@1", missing, digest))
    _error(again, 502, "adapter_fetch_failed")
    assert again.headers["X-Loragate-Reason"] == "adapter_fetch_failed"
    assert int(again.headers["Retry-After"]) >= 1
    assert files.count("/pub/missing.tar.gz") == 1
    # Down: nothing listens on the port.
    down = f"http://127.0.0.1:{dead_port}/a.tar.gz"
    _error(_complete(base, _headers("down@1", down, secrets.token_hex(32))), 502, "adapter_fetch_failed")
    # Wrong digest: the content is there but is not what the catalog pinned.
    s3 = moto.put_adapter(BUCKET, "team/alpha/wrong", alpha)
    _error(_complete(base, _headers("wrong@1", s3, "0" * 64)), 502, "adapter_fetch_failed", "digest")
    # Truncated: the connection closes halfway through the archive.
    archive = adapter_archive(alpha, "tar")
    cut = files.put("/pub/cut.tar", archive)
    files.fault("/pub/cut.tar", truncate_after=len(archive) // 2)
    _error(_complete(base, _headers("cut@1", cut, hashlib.sha256(archive).hexdigest())), 502, "adapter_fetch_failed")
    # Oversized: larger than --adapter-max-mb 1.
    big = synthetic_adapter(tmp_path / "big", 2 << 20, seed=5)
    big_source = moto.put_adapter(BUCKET, "team/big", big)
    _error(_complete(base, _headers("big@1", big_source, sha256sum_digest(big))), 502, "adapter_fetch_failed", "large")
    # Pickled weights only: never loaded.
    only_pickle = {"drop": ("adapter_model.safetensors",), "extra": {"adapter_model.bin": b"x"}}
    pickled = copy_adapter(alpha, tmp_path / "pickled", **only_pickle)  # type: ignore[arg-type]
    pickled_source = moto.put_adapter(BUCKET, "team/pickled", pickled)
    pickled_digest = secrets.token_hex(32)
    _error(
        _complete(base, _headers("pickled@1", pickled_source, pickled_digest)), 502, "adapter_fetch_failed", "pickle"
    )
    # None of them registered anything, and the engine still serves.
    registered = {card["id"] for card in _cards(base)}
    assert not {"missing@1", "down@1", "wrong@1", "cut@1", "big@1", "pickled@1"} & registered
    assert _complete(base, {}).status_code == 200


def test_sources_outside_the_allow_list_and_hostile_headers_are_refused(
    engine: tuple[str, int], adapters: dict[str, Path], moto: MotoServer
) -> None:
    base, _ = engine
    digest = sha256sum_digest(adapters["alpha"])
    outside = moto.put_adapter(BUCKET, "team-evil/alpha", adapters["alpha"])  # a prefix of the allowed one
    for source in (outside, f"s3://{BUCKET}/other/", "hf://evil/alpha", "file:///etc", "/etc", "ftp://x/y"):
        resp = _complete(base, _headers("outside@1", source, digest))
        assert resp.status_code in (400, 403), (source, resp.text)
        if resp.status_code == 403:
            _error(resp, 403, "adapter_source_not_allowed")
    assert "outside@1" not in {card["id"] for card in _cards(base)}
    _error(_complete(base, _headers("x@1", f"s3://{BUCKET}/team/alpha/v1", "nothex")), 400, "invalid_request_error")
    _error(
        _complete(base, _headers("x@1", f"s3://{BUCKET}/team/alpha/v1", digest, None) | {"X-Adapter-Size": "-1"}),
        400,
        "invalid_request_error",
    )
    for hostile in ("../x", "a/b/c", "x@y"):
        _error(_complete(base, _headers(hostile, f"s3://{BUCKET}/team/alpha/v1", digest)), 404, "adapter_not_found")


# ---- restarts and the disk bound ---------------------------------------------------------------------------


def test_an_engine_killed_mid_download_restarts_with_its_cache_intact(
    tmp_path: Path,
    adapters: dict[str, Path],
    moto: MotoServer,
    hub: HubServer,
    files: ArchiveServer,
    tiny_model_dir: Path,
) -> None:
    cache = tmp_path / "cache"
    proc, base, _ = _engine(tmp_path, cache, moto, hub, files)
    alpha, beta = adapters["alpha"], adapters["beta"]
    done = moto.put_adapter(BUCKET, "team/restart/alpha", alpha)
    alpha_headers = _headers("kept@1", done, sha256sum_digest(alpha))
    try:
        assert _text(_complete(base, alpha_headers)) == _peft_text(tiny_model_dir, alpha)
        archive = adapter_archive(beta, "tgz")
        url = files.put("/pub/restart-beta.tgz", archive)
        files.fault("/pub/restart-beta.tgz", chunk_delay_s=0.5, chunk_bytes=1024)  # a download of many seconds
        beta_headers = _headers("later@1", url, hashlib.sha256(archive).hexdigest())
        _error(_complete(base, beta_headers), 503, "service_unavailable")
        assert any(p.name.startswith(".tmp") for p in cache.iterdir())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    files.reset()
    proc, base, _ = _engine(tmp_path, cache, moto, hub, files)
    try:
        assert not any(p.name.startswith(".tmp") for p in cache.iterdir())  # the half download is gone
        entry = cache / sha256sum_digest(alpha)
        assert sorted(p.name for p in entry.iterdir() if not p.name.startswith("meta")) == [
            "adapter_config.json",
            "adapter_model.safetensors",
        ]
        assert sha256sum_digest(entry) == sha256sum_digest(alpha)
        # Served from the disk cache: the object store is not asked again (its bucket emptied to prove it).
        s3 = moto.s3()
        for key in ("adapter_config.json", "adapter_model.safetensors"):
            s3.delete_object(Bucket=BUCKET, Key=f"team/restart/alpha/{key}")
        assert _text(_complete(base, alpha_headers)) == _peft_text(tiny_model_dir, alpha)
        assert _text(_complete(base, beta_headers)) == _peft_text(tiny_model_dir, beta)
    finally:
        proc.terminate()
        proc.wait(timeout=60)


class _LongStream:
    """A streamed completion of `max_tokens` tokens read in a thread: `started` once its first token came,
    `ended_at` (time.monotonic()) once its last did. The engine pins its adapter until the stream ends."""

    def __init__(self, base: str, headers: dict[str, str], max_tokens: int) -> None:
        self.started = threading.Event()
        self.ended_at: float | None = None
        self.status: int | None = None
        body = {**GREEDY, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True}
        self._thread = threading.Thread(target=self._read, args=(base, headers, body), daemon=True)
        self._thread.start()

    def _read(self, base: str, headers: dict[str, str], body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers, timeout=120) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        self.started.set()
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def join(self) -> None:
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()


def test_a_full_disk_cache_evicts_the_least_recently_used_adapter_never_one_in_use(
    tmp_path: Path,
    adapters: dict[str, Path],
    moto: MotoServer,
    hub: HubServer,
    files: ArchiveServer,
    tiny_model_dir: Path,
) -> None:
    # Three adapters of ~0.4 MiB each in a 1 MiB cache: the third evicts the least recently used that no
    # request is using. --metrics-max-adapters 1: the per-adapter series stay bounded however many are fetched.
    dirs = {
        name: make_peft_adapter(
            tiny_model_dir, tmp_path / name, r=24, alpha=24, targets="all-linear", seed=10 + i, b_std=0.5
        )
        for i, name in enumerate(("one", "two", "three"))
    }
    size = _size(dirs["one"])
    assert 1 << 20 < 3 * size and 2 * size <= 1 << 20, size
    cache = tmp_path / "cache"
    extra = ("--adapter-cache-mb", "1", "--max-model-len", "1024", "--metrics-max-adapters", "1")
    proc, base, _ = _engine(tmp_path, cache, moto, hub, files, *extra)
    sha = {name: sha256sum_digest(d) for name, d in dirs.items()}
    try:
        headers = {
            name: _headers(f"{name}@1", moto.put_adapter(BUCKET, f"team/lru/{name}", d), sha[name])
            for name, d in dirs.items()
        }
        for name in ("one", "two", "one", "three"):  # "two" is then the least recently used
            assert _complete(base, headers[name]).status_code == 200, name
        registered = {card["id"] for card in _cards(base)}
        assert {"one@1", "three@1"} <= registered and "two@1" not in registered
        assert not (cache / sha["two"]).exists()
        assert _text(_complete(base, headers["two"])) == _peft_text(tiny_model_dir, dirs["two"])  # fetched again
        assert sorted(p.name for p in cache.iterdir()) == sorted([sha["two"], sha["three"]])  # "one" evicted

        # In use: a long stream on "three" pins it (1,000 tokens, as many as the tiny model's 1,024 positions allow:
        # it must outlast fetching and serving "one", which end ~0.8 s before it on a quiet 2-core machine). "two" is
        # used after it, so "three" is the least recently used when "one" needs room; "two" goes instead, and
        # "three"'s stream runs on to its end.
        stream = _LongStream(base, headers["three"], max_tokens=1000)
        assert stream.started.wait(60) and stream.ended_at is None
        assert _complete(base, headers["two"]).status_code == 200
        one = _complete(base, headers["one"])
        one_served_at = time.monotonic()  # before PEFT's reference runs: its seconds are not the engine's
        assert _text(one) == _peft_text(tiny_model_dir, dirs["one"])
        assert sorted(p.name for p in cache.iterdir()) == sorted([sha["one"], sha["three"]])
        stream.join()
        assert stream.status == 200
        assert stream.ended_at is not None and stream.ended_at > one_served_at, "the stream ended too soon"
        assert "three@1" in {card["id"] for card in _cards(base)}
        # Its stream over, "three" is no longer pinned: the least recently used, it makes room for "two".
        assert _complete(base, headers["two"]).status_code == 200
        assert sorted(p.name for p in cache.iterdir()) == sorted([sha["one"], sha["two"]])

        # Prometheus: the disk tier by state only; the per-adapter series name the first adapter seen and
        # count the rest as "other", however many adapters are fetched.
        assert _metric(base, "loragate_engine_adapter_cache_evictions_total") == 4
        assert _metric(base, "loragate_engine_adapter_downloads_total") == 6  # one two three two one two
        assert _metric(base, "loragate_engine_adapter_cache_bytes") == 2 * size
        assert _metric(base, "loragate_engine_adapter_cache_limit_bytes") == 1 << 20
        text = httpx.get(f"{base}/metrics", timeout=10).text
        families = list(text_string_to_metric_families(text))
        states = {s.labels["state"]: s.value for f in families for s in f.samples if f.name.endswith("cache_entries")}
        assert states == {"downloading": 0, "disk": 2, "failed": 0}
        base_model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
        labels = {s.labels["adapter"] for f in families for s in f.samples if "adapter" in s.labels}
        assert labels == {base_model, "one@1", "other"}, labels
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def test_without_a_cache_dir_the_engine_fetches_nothing(tmp_path: Path, adapters: dict[str, Path]) -> None:
    proc, base = start_engine_server(tmp_path / "engine.log", "--max-model-len", "256")
    try:
        headers = _headers("alpha@1", f"s3://{BUCKET}/team/alpha/v1", sha256sum_digest(adapters["alpha"]))
        _error(_complete(base, headers), 403, "adapter_source_not_allowed", "--adapter-cache-dir")
    finally:
        proc.terminate()
        proc.wait(timeout=60)
