"""The vLLM agent (vllm_agent/) end to end: the real app under uvicorn on 127.0.0.1 in front of a fake vLLM that
answers as vLLM 0.32 does (tests/vllm_agent/vllm_testing.py), fetching from the repository's loopback adapter servers
(tests/adapter_servers.py: an archive server, a Hub-shaped server read by huggingface_hub, a real S3 API from
moto_server). The files vLLM is pointed at are compared byte for byte with the published adapter (a PEFT one from
tests/lora_fixtures.py); downloads are counted at the sources, loads and unloads at vLLM.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from adapter_servers import (
    ADAPTER_FILES,
    ArchiveServer,
    HubServer,
    adapter_archive,
    moto_server_fixture,
    sha256sum_digest,
    synthetic_adapter,
)
from polling import poll
from processes import free_port
from vllm_testing import MockVllm, agent, agent_config, assert_error, cards, ensure, ensure_headers

KB = 1 << 10

moto = moto_server_fixture()


def publish(archives: ArchiveServer, directory: Path, name: str) -> tuple[str, str]:
    """Serve `directory` as /pub/NAME.tgz; (its URL, the archive's sha256: what the catalog pins for https)."""
    data = adapter_archive(directory, "tgz")
    return archives.put(f"/pub/{name}.tgz", data), hashlib.sha256(data).hexdigest()


def allowed(archives: ArchiveServer) -> list[str]:
    return [archives.url + "/pub/"]


def metric(base: str, name: str, **labels: str) -> float | None:
    """A sample of the agent's GET /metrics; None when it has none."""
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    return None


def files_of(directory: Path) -> dict[str, bytes]:
    return {name: (directory / name).read_bytes() for name in ADAPTER_FILES}


@pytest.mark.parametrize("kind", ["archive", "hub", "s3"])
def test_a_first_ensure_fetches_then_loads_the_published_files(
    kind: str,
    tiny_adapters: dict[str, Path],
    vllm: MockVllm,
    archives: ArchiveServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    request: pytest.FixtureRequest,
) -> None:
    adapter = tiny_adapters["qv-r8"]
    with HubServer() as hub:
        if kind == "archive":
            source, sha = publish(archives, adapter, "qv")
            allow = allowed(archives)
        elif kind == "hub":
            monkeypatch.setenv("HF_ENDPOINT", hub.url)
            hub.add_repo("org/qv", adapter)
            source, sha, allow = "hf://org/qv", sha256sum_digest(adapter), ["hf://org/"]
        else:
            s3 = request.getfixturevalue("moto")
            for key, value in s3.env().items():
                monkeypatch.setenv(key, value)
            source, sha = s3.put_adapter("adapters", "team/qv", adapter), sha256sum_digest(adapter)
            allow = ["s3://adapters/team/"]
        with agent(agent_config(tmp_path / "cache", vllm.url, allow)) as base:
            resp = ensure(base, "qv@1", source, sha)
            assert resp.status_code == 200, resp.text
            card = resp.json()
            assert (card["id"], card["sha256"], card["state"]) == ("qv@1", sha, "loaded")
            assert card["download_s"] > 0 and card["load_s"] > 0
            [load] = vllm.loads
            assert (load.name, load.path, load.status) == ("qv@1", str((tmp_path / "cache").resolve() / sha), 200)
            assert vllm.load_files["qv@1"] == files_of(adapter)  # what vLLM found at lora_path
            assert sorted(os.listdir(load.path)) == sorted([*ADAPTER_FILES, "meta.json"])
            listed = cards(base)
            assert listed["qv@1"]["state"] == "loaded" and listed["qv@1"]["source"] == source

            assert ensure(base, "qv@1", source, sha).json() == card  # served from what the agent knows
            assert len(vllm.loads) == 1
            assert metric(base, "loragate_vllm_agent_downloads_total") == 1
            assert metric(base, "loragate_vllm_agent_loads_total") == 1


def test_twenty_concurrent_ensures_make_one_download_and_one_load(
    vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    adapter = synthetic_adapter(tmp_path / "a", 64 * KB, seed=1)
    source, sha = publish(archives, adapter, "a")
    archives.fault("/pub/a.tgz", delay_s=0.3)  # every ensure arrives while the download runs
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:

        async def burst() -> list[httpx.Response]:
            async with httpx.AsyncClient(base_url=base, timeout=30) as client:
                headers = ensure_headers("a@1", source, sha)
                return await asyncio.gather(*(client.post("/v1/adapters/ensure", headers=headers) for _ in range(20)))

        answers = asyncio.run(burst())
        assert [r.status_code for r in answers] == [200] * 20
        assert len({json.dumps(r.json(), sort_keys=True) for r in answers}) == 1
        assert archives.count("/pub/a.tgz") == 1
        assert [(load.name, load.status) for load in vllm.loads] == [("a@1", 200)]
        assert metric(base, "loragate_vllm_agent_loads_total") == 1
        assert metric(base, "loragate_vllm_agent_downloads_total") == 1
        assert metric(base, "loragate_vllm_agent_cache_bytes") == sum(len(b) for b in files_of(adapter).values())


def test_after_a_restart_the_ids_vllm_lists_are_loaded_without_loading_them_again(
    vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=2), "a")
    config = agent_config(tmp_path / "cache", vllm.url, allowed(archives))
    with agent(config) as base:
        assert ensure(base, "a@1", source, sha).status_code == 200
    with agent(config) as base:  # the same cache and the same vLLM: learnt from vLLM's list at start
        card = cards(base)["a@1"]
        assert (card["state"], card["download_s"], card["load_s"]) == ("loaded", None, None)
        resp = ensure(base, "a@1", source, sha)
        assert resp.json() == {"id": "a@1", "sha256": sha, "state": "loaded", "download_s": None, "load_s": None}
    assert len(vllm.loads) == 1 and archives.count("/pub/a.tgz") == 1


def test_an_id_vllm_lost_while_the_agent_ran_is_loaded_again(
    vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    """vLLM restarted between two probes (its runtime adapters gone): the gateway asks again, and the agent looks at
    vLLM's list rather than answering from memory."""
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=12), "a")
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        assert ensure(base, "a@1", source, sha).status_code == 200
        vllm.loaded.clear()
        resp = ensure(base, "a@1", source, sha)
        assert resp.status_code == 200, resp.text
        assert [load.name for load in vllm.loads] == ["a@1", "a@1"] and "a@1" in vllm.loaded
        assert archives.count("/pub/a.tgz") == 1  # its files were still on disk


def test_an_id_vllm_already_lists_is_not_loaded(vllm: MockVllm, archives: ArchiveServer, tmp_path: Path) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=3), "a")
    vllm.loaded["a@1"] = "/models/loras/a"  # e.g. vLLM's own --lora-modules
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        resp = ensure(base, "a@1", source, sha)
        assert resp.status_code == 200, resp.text
        assert resp.json()["load_s"] is None and resp.json()["download_s"] > 0
        assert vllm.loads == [] and archives.count("/pub/a.tgz") == 1


def test_already_loaded_counts_as_loaded(vllm: MockVllm, archives: ArchiveServer, tmp_path: Path) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=4), "a")
    vllm.loaded["a@1"] = "/models/loras/a"
    vllm.hidden.add("a@1")  # loaded, but not in GET /v1/models: the load meets vLLM's 400
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        resp = ensure(base, "a@1", source, sha)
        assert resp.status_code == 200, resp.text
        assert resp.json()["state"] == "loaded" and resp.json()["load_s"] is None
        assert [(load.name, load.status) for load in vllm.loads] == [("a@1", 400)]
        assert cards(base)["a@1"]["state"] == "loaded"
        assert metric(base, "loragate_vllm_agent_loads_total") == 0


def test_vllm_refusing_the_adapter_is_a_502_with_its_message(
    vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=5), "a")
    # vLLM looks for the cache where nothing is: it answers 404 "No adapter found for PATH".
    config = agent_config(tmp_path / "cache", vllm.url, allowed(archives), vllm_cache_dir="/nonexistent/cache")
    with agent(config) as base:
        for attempt in (1, 2):
            resp = ensure(base, "a@1", source, sha)
            message = assert_error(resp, 502, "adapter_fetch_failed", reason="adapter_fetch_failed")
            assert f"Loading lora a@1 failed: No adapter found for /nonexistent/cache/{sha}" in message
            assert resp.headers["Retry-After"] == "60"
            assert [load.status for load in vllm.loads] == [404] * attempt  # asked again: vLLM may be fixed
        card = cards(base)["a@1"]
        assert card["state"] == "failed" and "No adapter found" in card["error"]
        assert httpx.get(f"{base}/healthz").status_code == 200
        assert metric(base, "loragate_vllm_agent_failures_total", reason="vllm_refused") == 2
        assert archives.count("/pub/a.tgz") == 1  # the download is kept


def test_vllm_cache_dir_is_where_vllm_finds_the_cache(vllm: MockVllm, archives: ArchiveServer, tmp_path: Path) -> None:
    adapter = synthetic_adapter(tmp_path / "a", 8 * KB, seed=6)
    source, sha = publish(archives, adapter, "a")
    (tmp_path / "cache").mkdir()
    (tmp_path / "vllm-mount").symlink_to(tmp_path / "cache")  # one volume, mounted elsewhere in vLLM's container
    config = agent_config(tmp_path / "cache", vllm.url, allowed(archives), vllm_cache_dir=str(tmp_path / "vllm-mount"))
    with agent(config) as base:
        assert ensure(base, "a@1", source, sha).status_code == 200
    [load] = vllm.loads
    assert load.path == f"{tmp_path}/vllm-mount/{sha}" and vllm.load_files["a@1"] == files_of(adapter)


def test_without_runtime_updating_the_502_says_how_to_start_vllm(
    vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=7), "a")
    vllm.runtime_updating = False
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        message = assert_error(
            ensure(base, "a@1", source, sha), 502, "adapter_fetch_failed", reason="adapter_fetch_failed"
        )
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in message
        assert metric(base, "loragate_vllm_agent_failures_total", reason="runtime_updating_off") == 1


def test_a_slow_download_answers_adapter_loading_then_loaded(
    vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=8), "a")
    archives.fault("/pub/a.tgz", delay_s=1.5)
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives), load_wait_s=0.3)) as base:
        first = ensure(base, "a@1", source, sha)
        assert_error(first, 503, "service_unavailable", reason="adapter_loading")
        assert first.headers["Retry-After"] == "2"
        assert cards(base)["a@1"]["state"] == "downloading"

        def loaded() -> httpx.Response | None:
            resp = ensure(base, "a@1", source, sha)
            return resp if resp.status_code == 200 else None

        assert poll(loaded, 20, interval_s=0.2, what="ensure 200").json()["state"] == "loaded"
        assert archives.count("/pub/a.tgz") == 1 and len(vllm.loads) == 1


def test_a_wrong_digest_is_a_502_and_backs_off(vllm: MockVllm, archives: ArchiveServer, tmp_path: Path) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=9), "a")
    wrong = hashlib.sha256(b"another archive").hexdigest()
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        resp = ensure(base, "a@1", source, wrong)
        message = assert_error(resp, 502, "adapter_fetch_failed", reason="adapter_fetch_failed")
        assert "digest_mismatch" in message and sha in message
        assert int(resp.headers["Retry-After"]) >= 1
        again = ensure(base, "a@1", source, wrong)  # within the backoff: refused without a download
        assert "not tried again" in assert_error(again, 502, "adapter_fetch_failed", reason="adapter_fetch_failed")
        assert archives.count("/pub/a.tgz") == 1 and vllm.loads == []
        card = cards(base)["a@1"]
        assert card["state"] == "failed" and sha in card["error"] and card["sha256"] == wrong
        assert metric(base, "loragate_vllm_agent_failures_total", reason="digest_mismatch") == 2


def test_a_source_outside_the_allow_list_is_403_and_never_fetched(
    vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    data = adapter_archive(synthetic_adapter(tmp_path / "a", 8 * KB, seed=10), "tgz")
    sha = hashlib.sha256(data).hexdigest()
    outside = [archives.put("/other/a.tgz", data), archives.put("/pub-evil/a.tgz", data)]
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        for source in outside:
            message = assert_error(ensure(base, "a@1", source, sha), 403, "adapter_source_not_allowed")
            assert "not under an allowed prefix" in message
        assert sum(archives.requests.values()) == 0 and vllm.loads == [] and cards(base) == {}


GOOD_SHA = "ab" * 32


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ({"X-Adapter-ID": "../x"}, "X-Adapter-ID"),
        ({"X-Adapter-ID": "a@0"}, "X-Adapter-ID"),
        ({"X-Adapter-ID": "a@1@2"}, "X-Adapter-ID"),
        ({"X-Adapter-ID": "x" * 3000}, "X-Adapter-ID"),
        ({"X-Adapter-ID": None}, "X-Adapter-ID"),
        ({"X-Adapter-Source": "http://127.0.0.1/pub/" + "a" * 3000}, "X-Adapter-Source"),
        ({"X-Adapter-Source": None}, "X-Adapter-Source"),
        ({"X-Adapter-Source": "SOURCE/../../etc/a.tgz"}, "X-Adapter-Source"),
        ({"X-Adapter-SHA256": "zz" * 32}, "X-Adapter-SHA256"),
        ({"X-Adapter-SHA256": "ab" * 31}, "X-Adapter-SHA256"),
        ({"X-Adapter-Size": "-1"}, "X-Adapter-Size"),
        ({"X-Adapter-Size": "12 MB"}, "X-Adapter-Size"),
    ],
)
def test_malformed_headers_are_400_naming_the_header(
    headers: dict[str, str | None], named: str, vllm: MockVllm, archives: ArchiveServer, tmp_path: Path
) -> None:
    source = f"{archives.url}/pub/a.tgz"
    sent: dict[str, Any] = {**ensure_headers("a@1", source, GOOD_SHA), **headers}
    sent = {k: v.replace("SOURCE", f"{archives.url}/pub") for k, v in sent.items() if v is not None}
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        resp = httpx.post(f"{base}/v1/adapters/ensure", headers=sent, timeout=10)
        message = assert_error(resp, 400, "invalid_request_error")
        assert message.startswith(named) and len(message) < 400  # a hostile value is never echoed whole
        assert sum(archives.requests.values()) == 0 and vllm.loads == []


def test_an_evicted_entry_is_unloaded_from_vllm(vllm: MockVllm, archives: ArchiveServer, tmp_path: Path) -> None:
    adapters = {name: synthetic_adapter(tmp_path / name, 256 * KB, seed=i) for i, name in enumerate("abc")}
    published = {name: publish(archives, directory, name) for name, directory in adapters.items()}
    size = sum(len(b) for b in files_of(adapters["a"]).values())
    config = agent_config(tmp_path / "cache", vllm.url, allowed(archives), cache_bytes=2 * size + size // 2)
    with agent(config) as base:

        def ensure_ok(name: str) -> None:
            resp = ensure(base, f"{name}@1", *published[name])
            assert resp.status_code == 200, resp.text

        ensure_ok("a")
        ensure_ok("b")
        ensure_ok("a")  # a is now more recently used than b
        ensure_ok("c")  # room for two: b goes
        poll(lambda: vllm.unloads == ["b@1"], 10, what="b@1 unloaded")
        assert set(vllm.loaded) == {"a@1", "c@1"} and set(cards(base)) == {"a@1", "c@1"}
        assert metric(base, "loragate_vllm_agent_unloads_total") == 1
        assert metric(base, "loragate_vllm_agent_cache_evictions_total") == 1

        ensure_ok("b")  # fetched and loaded again; a, now the least recently used, goes
        poll(lambda: vllm.unloads == ["b@1", "a@1"], 10, what="a@1 unloaded")
        assert archives.count("/pub/b.tgz") == 2 and [load.status for load in vllm.loads_of("b@1")] == [200, 200]
        assert set(vllm.loaded) == {"b@1", "c@1"} and set(cards(base)) == {"b@1", "c@1"}


def test_vllm_down_is_503_upstream_unavailable_until_it_answers(archives: ArchiveServer, tmp_path: Path) -> None:
    source, sha = publish(archives, synthetic_adapter(tmp_path / "a", 8 * KB, seed=11), "a")
    port = free_port()  # nothing listens here yet
    with agent(agent_config(tmp_path / "cache", f"http://127.0.0.1:{port}", allowed(archives))) as base:
        resp = ensure(base, "a@1", source, sha)
        assert_error(resp, 503, "service_unavailable", reason="upstream_unavailable")
        assert resp.headers["Retry-After"] == "2"
        assert_error(httpx.get(f"{base}/readyz"), 503, "service_unavailable", reason="upstream_unavailable")
        assert cards(base)["a@1"]["state"] == "disk"  # fetched: only vLLM's load is missing
        assert metric(base, "loragate_vllm_agent_failures_total", reason="vllm_unavailable") == 1
        with MockVllm().serving(port=port) as late:
            assert ensure(base, "a@1", source, sha).status_code == 200
            assert httpx.get(f"{base}/readyz").status_code == 200
            assert [(load.name, load.status) for load in late.loads] == [("a@1", 200)]
        assert archives.count("/pub/a.tgz") == 1


def test_readyz_follows_vllms_health(vllm: MockVllm, archives: ArchiveServer, tmp_path: Path) -> None:
    with agent(agent_config(tmp_path / "cache", vllm.url, allowed(archives))) as base:
        assert httpx.get(f"{base}/readyz").json() == {"status": "ready"}
        vllm.healthy = False
        assert_error(httpx.get(f"{base}/readyz"), 503, "service_unavailable", reason="upstream_unavailable")
        assert httpx.get(f"{base}/healthz").status_code == 200
        vllm.healthy = True
        assert httpx.get(f"{base}/readyz").status_code == 200
