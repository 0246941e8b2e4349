"""Fetching adapters (loragate_common/adapter_sources.py) from a real S3 API (moto_server), a Hub-shaped server and
an archive server on 127.0.0.1, with faults injected at the servers.

References: the source files themselves (fetched bytes must be identical), hashlib and the real `sha256sum`
for the digests, huggingface_hub's own hf_hub_download for the Hub server's shape, the safetensors package
for a valid header, and the servers' request counts for what was downloaded.
"""

from __future__ import annotations

import hashlib
import io
import os
import shutil
import stat
import subprocess
import tarfile
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from loragate_common.adapter_sources import AllowList, Fetched, SourceError, check_adapter_files, fetch, parse_source

from adapter_servers import (
    ADAPTER_FILES,
    ArchiveServer,
    HubServer,
    MotoServer,
    adapter_archive,
    archive_bytes,
    copy_adapter,
    moto_server_fixture,
    sha256sum_digest,
    synthetic_adapter,
)
from processes import free_port

MB = 1 << 20
moto = moto_server_fixture()


@pytest.fixture(scope="module")
def adapter(tiny_adapters: dict[str, Path]) -> Path:
    """A real PEFT LoRA for the tiny model, as PEFT saved it (with its README.md, which fetch must skip)."""
    return tiny_adapters["qv-r8"]


@pytest.fixture
def aws(moto: MotoServer, monkeypatch: pytest.MonkeyPatch) -> MotoServer:
    for name, value in moto.env().items():
        monkeypatch.setenv(name, value)
    return moto


@pytest.fixture(scope="module")
def hub_server() -> Iterator[HubServer]:
    with HubServer() as server:
        yield server


@pytest.fixture
def hub(hub_server: HubServer, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubServer]:
    monkeypatch.setenv("HF_ENDPOINT", hub_server.url)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    hub_server.reset()
    yield hub_server


@pytest.fixture(scope="module")
def archive_server() -> Iterator[ArchiveServer]:
    with ArchiveServer() as server:
        yield server


@pytest.fixture
def archives(archive_server: ArchiveServer) -> ArchiveServer:
    archive_server.reset()
    return archive_server


def fetch_into(
    dest: Path,
    uri: str,
    *,
    sha256: str | None = None,
    size: int | None = None,
    max_bytes: int = 16 * MB,
    deadline_s: float = 10.0,
) -> Fetched:
    dest.mkdir()
    return fetch(parse_source(uri), dest, sha256=sha256, size=size, max_bytes=max_bytes, deadline_s=deadline_s)


def fetch_error(dest: Path, uri: str, **kwargs: Any) -> SourceError:
    """The SourceError fetching `uri` raises; `dest` must be left empty."""
    with pytest.raises(SourceError) as info:
        fetch_into(dest, uri, **kwargs)
    assert list(dest.iterdir()) == []
    return info.value


def assert_same_adapter(dest: Path, source: Path, fetched: Fetched) -> None:
    assert sorted(os.listdir(dest)) == sorted(ADAPTER_FILES)
    for name in ADAPTER_FILES:
        assert (dest / name).read_bytes() == (source / name).read_bytes()
    assert fetched.digest == sha256sum_digest(source)
    assert fetched.size == sum((source / name).stat().st_size for name in ADAPTER_FILES)


# --- parsing and the allow-list -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("uri", "kind", "normalised"),
    [
        ("S3://bkt/team/qv/", "s3", "s3://bkt/team/qv"),
        ("s3://my.bucket-1", "s3", "s3://my.bucket-1"),
        ("hf://Org/Repo_1.x", "hf", "hf://Org/Repo_1.x"),
        ("hf://org/repo@refs/pr/1", "hf", "hf://org/repo@refs/pr/1"),
        ("HTTPS://Host.Example:443/a/b.tar.gz", "https", "https://host.example/a/b.tar.gz"),
        (
            "https://host.example/a/b.zip?X-Amz-Signature=ab%2Fcd",
            "https",
            "https://host.example/a/b.zip?X-Amz-Signature=ab%2Fcd",
        ),
        ("http://127.0.0.1:8080/x.tgz", "http", "http://127.0.0.1:8080/x.tgz"),
        ("http://[::1]:80/x.tar", "http", "http://[::1]/x.tar"),
        ("/srv/adapters/qv/", "local", "/srv/adapters/qv"),
        ("file:///srv/my%20adapters/qv", "local", "/srv/my adapters/qv"),
    ],
)
def test_sources_are_normalised(uri: str, kind: str, normalised: str) -> None:
    source = parse_source(uri)
    assert (source.kind, str(source)) == (kind, normalised)
    assert str(parse_source(str(source))) == normalised  # a fixed point


@pytest.mark.parametrize(
    "uri",
    [
        "",
        "x" * 3000,
        "s3://bkt/a\x00b",
        "s3://bkt/a\nb",
        "https://host/a\x7f.tgz",
        "s3://bkt/..",
        "s3://bkt/a/../b",
        "s3://bkt/a/./b",
        "s3://bkt//a",
        "s3://ab/a",  # bucket names have 3 to 63 characters
        "s3://Bucket/a",
        "s3://bkt_1/a",
        "s3://a..b/a",
        "s3://192.168.1.1/a",
        "s3://-bkt/a",
        "s3://bkt/a%2Fb",
        "s3://bkt/a b",
        "hf://org/",
        "hf:///repo",
        "hf://org//repo",
        "hf://org",
        "hf://org/repo/extra",
        "hf://org/repo@",
        "hf://org/repo@../main",
        "hf://org/re..po",
        "hf://-org/repo",
        "https://host/a/%2e%2e/x.tgz",
        "https://host/a/%2E./x.tgz",
        "https://host/a%2fb/x.tgz",
        "https://host/a%5cb/x.tgz",
        "https://host/%252e%252e/x.tgz",
        "https://host/a%00/x.tgz",
        "https://host/../x.tgz",
        "https://user:pw@host/x.tgz",
        "https://host@evil.example/x.tgz",
        "https://host\\@evil.example/x.tgz",
        "https://host:99999/x.tgz",
        "https://host:0/x.tgz",
        "https://ho_st/x.tgz",
        "https:///x.tgz",
        "https://host/x.tgz#frag",
        "https://host/adapter.exe",
        "https://host/",
        "https://hoßt/x.tgz",
        "ftp://host/x.tgz",
        "relative/adapter",
        "/srv/../etc",
        "/srv//etc",
        "/srv/./x",
        "file://otherhost/srv/x",
        "file:///srv/%2e%2e/etc",
        "file:///srv/a%2fb",
    ],
)
def test_hostile_uris_are_invalid(uri: str) -> None:
    with pytest.raises(SourceError) as info:
        parse_source(uri)
    assert info.value.reason == "invalid"


@pytest.mark.parametrize(
    ("prefixes", "uri", "allowed"),
    [
        (["s3://bkt/team/"], "s3://bkt/team/qv", True),
        (["s3://bkt/team/"], "s3://bkt/team", True),
        (["s3://bkt/team/"], "s3://bkt/team-evil/qv", False),
        (["s3://bkt/team"], "s3://bkt/team/qv", True),
        (["s3://bkt/team"], "s3://bkt/team-evil/qv", False),
        (["s3://bkt/team"], "s3://bkt/teamqv", False),
        (["s3://bkt/team"], "s3://bkt/other/team/qv", False),
        (["s3://bkt"], "s3://bkt/qv", True),
        (["s3://bkt"], "s3://bkt-evil/qv", False),
        (["s3://bkt/team/"], "s3://BKT2/team/qv".lower(), False),
        (["hf://org/"], "hf://org/repo", True),
        (["hf://org/"], "hf://org/repo@v2", True),
        (["hf://org"], "hf://org-evil/repo", False),
        (["hf://org"], "hf://orgx/repo", False),
        (["hf://org/repo@v1"], "hf://org/repo@v1", True),
        (["hf://org/repo@v1"], "hf://org/repo@v2", False),
        (["hf://org/repo@v1"], "hf://org/repo", False),
        (["hf://org/repo@main"], "hf://org/repo", True),
        (["https://host.example/adapters/"], "https://host.example/adapters/x.tgz", True),
        (["https://host.example/adapters/"], "https://HOST.example:443/adapters/x.tgz", True),
        (["https://host.example/adapters/"], "https://host.example/adapters/x.tgz?sig=1", True),
        (["https://host.example/adapters/"], "https://host.example/adapters-evil/x.tgz", False),
        (["https://host.example/adapters/"], "https://host.example.evil.example/adapters/x.tgz", False),
        (["https://host.example/adapters/"], "https://host.example:8443/adapters/x.tgz", False),
        (["https://host.example/adapters/"], "http://host.example/adapters/x.tgz", False),
        (["https://host.example/adapters/"], "s3://host.example/adapters/x.tgz", False),
        ([], "s3://bkt/team/qv", False),
        (["s3://bkt/a/", "hf://org/"], "hf://org/repo", True),
    ],
)
def test_allow_list_matches_whole_segments(prefixes: list[str], uri: str, allowed: bool) -> None:
    allow = AllowList(prefixes)
    source = parse_source(uri)
    assert allow.allows(source) is allowed
    if not allowed:
        with pytest.raises(SourceError) as info:
            allow.check(source)
        assert info.value.reason == "not_allowed"


def test_allow_list_compares_local_paths_after_resolving_links(tmp_path: Path) -> None:
    allowed, outside = tmp_path / "allowed", tmp_path / "allowed-evil"
    (allowed / "qv").mkdir(parents=True)
    (outside / "qv").mkdir(parents=True)
    (allowed / "escape").symlink_to(outside)  # inside by name, outside in fact
    (tmp_path / "door").symlink_to(allowed)  # outside by name, inside in fact
    allow = AllowList([str(allowed)])
    assert allow.allows(parse_source(str(allowed / "qv")))
    assert allow.allows(parse_source(f"file://{allowed}/qv"))
    assert not allow.allows(parse_source(str(outside / "qv")))
    assert not allow.allows(parse_source(str(allowed / "escape" / "qv")))
    assert allow.allows(parse_source(str(tmp_path / "door" / "qv")))


def test_an_invalid_allowed_prefix_is_refused() -> None:
    with pytest.raises(SourceError) as info:
        AllowList(["s3://bkt/../x"])
    assert info.value.reason == "invalid"


# --- s3 --------------------------------------------------------------------------------------------------------


def test_s3_fetch_is_byte_identical_and_digest_is_sha256sums_sha256(
    aws: MotoServer, adapter: Path, tmp_path: Path
) -> None:
    uri = aws.put_adapter("adapters", "team/qv-r8", adapter)
    expected = sha256sum_digest(adapter)
    fetched = fetch_into(tmp_path / "out", uri, sha256=expected, size=None)
    assert_same_adapter(tmp_path / "out", adapter, fetched)
    assert fetched.archive_digest is None and fetched.revision is None
    if shutil.which("sha256sum"):  # the coreutils tool itself, where installed
        shell = "sha256sum adapter_config.json adapter_model.safetensors | sha256sum"
        out = subprocess.run(shell, shell=True, cwd=adapter, capture_output=True, text=True, check=True).stdout
        assert out.split()[0] == fetched.digest


def test_s3_lists_only_directly_under_the_prefix(aws: MotoServer, adapter: Path, tmp_path: Path) -> None:
    aws.put_adapter("adapters", "nested/deeper/qv", adapter)
    aws.put_adapter("adapters", "prefixes/qv-r8x", adapter)
    assert fetch_error(tmp_path / "a", "s3://adapters/nested").reason == "not_found"
    assert fetch_error(tmp_path / "b", "s3://adapters/prefixes/qv-r8").reason == "not_found"  # not qv-r8x/
    assert fetch_error(tmp_path / "c", "s3://no-such-bucket/qv").reason == "not_found"


def test_s3_refuses_pickled_weights(aws: MotoServer, adapter: Path, tmp_path: Path) -> None:
    pickled = copy_adapter(
        adapter, tmp_path / "pickled", drop=("adapter_model.safetensors",), extra={"adapter_model.bin": b"\x80\x04."}
    )
    uri = aws.put_adapter("adapters", "pickled", pickled)
    error = fetch_error(tmp_path / "out", uri)
    assert error.reason == "pickle"
    assert "safetensors" in str(error)


def test_s3_wrong_digest_and_size(aws: MotoServer, adapter: Path, tmp_path: Path) -> None:
    uri = aws.put_adapter("adapters", "digest/qv", adapter)
    wrong = hashlib.sha256(b"something else").hexdigest()
    error = fetch_error(tmp_path / "a", uri, sha256=wrong)
    assert error.reason == "digest_mismatch"
    assert wrong in str(error) and sha256sum_digest(adapter) in str(error)
    size = sum((adapter / name).stat().st_size for name in ADAPTER_FILES)
    assert fetch_error(tmp_path / "b", uri, size=size + 1).reason == "size_mismatch"
    assert fetch_error(tmp_path / "c", uri, size=size + 1, max_bytes=size).reason == "too_large"


def test_s3_oversized_adapter_is_refused_before_download(aws: MotoServer, tmp_path: Path) -> None:
    big = synthetic_adapter(tmp_path / "big", 2 * MB, seed=1)
    uri = aws.put_adapter("adapters", "big", big)
    error = fetch_error(tmp_path / "out", uri, max_bytes=MB)
    assert error.reason == "too_large"


def test_s3_down(moto: MotoServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in moto.env().items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert fetch_error(tmp_path / "out", "s3://adapters/team/qv-r8").reason == "unreachable"


# --- hf -------------------------------------------------------------------------------------------------------


def test_hub_server_is_what_huggingface_hub_expects(hub: HubServer, adapter: Path, tmp_path: Path) -> None:
    """The reference client against the fake Hub: hf_hub_download (HEAD for metadata, then GET) reads the
    same bytes, so the Hub-shaped server is shaped the way huggingface_hub needs."""
    from huggingface_hub import hf_hub_download

    hub.add_repo("shape/qv", adapter)
    for name in ADAPTER_FILES:
        path = hf_hub_download("shape/qv", name, endpoint=hub.url, cache_dir=tmp_path / "hf-cache")
        assert Path(path).read_bytes() == (adapter / name).read_bytes()


def test_hf_fetch_resolves_the_revision_to_a_commit(
    hub: HubServer, adapter: Path, tiny_adapters: dict[str, Path], tmp_path: Path
) -> None:
    main = hub.add_repo("org/qv", adapter)
    v2 = hub.add_repo("org/qv", tiny_adapters["all-r4"], revision="v2")
    fetched = fetch_into(tmp_path / "main", "hf://org/qv", sha256=sha256sum_digest(adapter))
    assert_same_adapter(tmp_path / "main", adapter, fetched)
    assert fetched.revision == main
    fetched = fetch_into(tmp_path / "v2", "hf://org/qv@v2")
    assert_same_adapter(tmp_path / "v2", tiny_adapters["all-r4"], fetched)
    assert fetched.revision == v2
    # The files are downloaded at the resolved commit, once each; README.md is not downloaded.
    assert hub.count(f"/org/qv/resolve/{v2}/adapter_model.safetensors") == 1
    assert hub.count("/org/qv/resolve/*/README.md") == 0


def test_hf_not_found(hub: HubServer, adapter: Path, tmp_path: Path) -> None:
    hub.add_repo("org/config-only", copy_adapter(adapter, tmp_path / "c", drop=("adapter_model.safetensors",)))
    hub.add_repo("org/present", adapter)
    assert fetch_error(tmp_path / "a", "hf://org/missing").reason == "not_found"
    assert fetch_error(tmp_path / "b", "hf://org/config-only").reason == "not_found"
    assert fetch_error(tmp_path / "d", "hf://org/present@no-such-branch").reason == "not_found"


def test_hf_private_repo_needs_hf_token(
    hub: HubServer, adapter: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hub.add_repo("org/private", adapter, token="hf_secret")
    assert fetch_error(tmp_path / "a", "hf://org/private").reason == "not_found"
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    assert_same_adapter(tmp_path / "b", adapter, fetch_into(tmp_path / "b", "hf://org/private"))
    assert hub.auth[-1] == "Bearer hf_secret"


def test_hf_refuses_pickles_and_checks_sizes_before_downloading(hub: HubServer, adapter: Path, tmp_path: Path) -> None:
    pickled = copy_adapter(
        adapter, tmp_path / "p", drop=("adapter_model.safetensors",), extra={"adapter_model.bin": b"\x80\x04."}
    )
    hub.add_repo("org/pickled", pickled)
    assert fetch_error(tmp_path / "a", "hf://org/pickled").reason == "pickle"
    hub.add_repo("org/big", synthetic_adapter(tmp_path / "big", 2 * MB, seed=2))
    assert fetch_error(tmp_path / "b", "hf://org/big", max_bytes=MB).reason == "too_large"
    assert hub.count("/org/big/resolve/*") == 0


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (dict(status=500), "unreachable"),
        (dict(status=404, headers={"X-Error-Code": "EntryNotFound"}), "not_found"),
        (dict(truncate_after=1000), "unreachable"),
        (dict(drop=True), "unreachable"),
        (dict(delay_s=3.0), "timeout"),
        (dict(chunk_bytes=1024, chunk_delay_s=0.1), "timeout"),
    ],
)
def test_hf_download_faults(hub: HubServer, adapter: Path, tmp_path: Path, fault: dict[str, Any], reason: str) -> None:
    hub.add_repo("org/faulty", adapter)
    hub.fault("/org/faulty/resolve/*/adapter_model.safetensors", **fault)
    assert fetch_error(tmp_path / "out", "hf://org/faulty", deadline_s=1.0).reason == reason
    if reason == "timeout":  # abandoned at its deadline, not read to the end first
        assert hub.count_sent("/org/faulty/resolve/*/adapter_model.safetensors") == 0


def test_hf_hub_down(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{free_port()}")
    assert fetch_error(tmp_path / "out", "hf://org/qv").reason == "unreachable"


# --- https/http archives ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tar", "tgz", "zip"])
@pytest.mark.parametrize("folder", [None, "qv-r8"])
def test_archive_fetch(archives: ArchiveServer, adapter: Path, tmp_path: Path, kind: str, folder: str | None) -> None:
    data = adapter_archive(adapter, kind, folder)
    suffix = {"tar": "tar", "tgz": "tar.gz", "zip": "zip"}[kind]
    url = archives.put(f"/a/{kind}-{folder}.{suffix}", data)
    fetched = fetch_into(tmp_path / "out", url, sha256=hashlib.sha256(data).hexdigest())
    assert_same_adapter(tmp_path / "out", adapter, fetched)
    assert fetched.archive_digest == hashlib.sha256(data).hexdigest()


def test_archive_with_wrong_digest_is_not_extracted(archives: ArchiveServer, adapter: Path, tmp_path: Path) -> None:
    data = adapter_archive(adapter, "tgz")
    url = archives.put("/a/digest.tgz", data)
    error = fetch_error(tmp_path / "out", url, sha256="0" * 64)
    assert error.reason == "digest_mismatch"
    assert hashlib.sha256(data).hexdigest() in str(error)


def test_redirects_are_not_followed(archives: ArchiveServer, adapter: Path, tmp_path: Path) -> None:
    archives.put("/a/target.tgz", adapter_archive(adapter, "tgz"))
    url = archives.put("/a/moved.tgz", b"")
    archives.fault("/a/moved.tgz", status=302, headers={"Location": "/a/target.tgz"})
    assert fetch_error(tmp_path / "out", url).reason == "invalid"
    assert archives.count("/a/target.tgz") == 0


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (dict(status=404), "not_found"),
        (dict(status=403), "not_found"),
        (dict(status=503), "unreachable"),
        (dict(drop=True), "unreachable"),
        (dict(truncate_after=2000), "unreachable"),
        (dict(delay_s=3.0), "timeout"),
        (dict(chunk_bytes=1024, chunk_delay_s=0.1), "timeout"),  # every chunk in time, the whole too slow
    ],
)
def test_archive_download_faults(
    archives: ArchiveServer, adapter: Path, tmp_path: Path, fault: dict[str, Any], reason: str
) -> None:
    url = archives.put("/a/faulty.tgz", adapter_archive(adapter, "tgz"))
    archives.fault("/a/faulty.tgz", **fault)
    assert fetch_error(tmp_path / "out", url, deadline_s=1.0).reason == reason
    if reason == "timeout":  # abandoned at its deadline, not read to the end first
        assert archives.count_sent("/a/faulty.tgz") == 0


def test_archive_source_down(tmp_path: Path) -> None:
    assert fetch_error(tmp_path / "out", f"http://127.0.0.1:{free_port()}/a.tgz").reason == "unreachable"


def test_oversized_archive_is_refused(archives: ArchiveServer, tmp_path: Path) -> None:
    big = synthetic_adapter(tmp_path / "big", 2 * MB, seed=3)
    url = archives.put("/a/big.tar", adapter_archive(big, "tar"))
    assert fetch_error(tmp_path / "out", url, max_bytes=MB).reason == "too_large"


def _tar(*members: tuple[tarfile.TarInfo, bytes | None]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            info.size = len(data) if data is not None else 0
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname = kind, linkname
    return info


def _zip_symlink(adapter: Path) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("adapter_config.json", (adapter / "adapter_config.json").read_bytes())
        link = zipfile.ZipInfo("adapter_model.safetensors")
        link.external_attr = (stat.S_IFLNK | 0o777) << 16
        zf.writestr(link, "/etc/passwd")
    return buf.getvalue()


def _hostile_archives(adapter: Path) -> dict[str, tuple[str, bytes]]:
    config = (adapter / "adapter_config.json").read_bytes()
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    good = [(_member("adapter_config.json"), config), (_member("adapter_model.safetensors"), weights)]
    return {
        "dotdot": ("tgz", _tar(*good, (_member("../escaped"), b"x"))),
        "dotdot-inside": ("tgz", _tar(*good, (_member("qv/../../escaped"), b"x"))),
        "absolute": ("tgz", _tar(*good, (_member("/tmp/escaped"), b"x"))),
        "symlink": ("tgz", _tar(good[0], (_member("adapter_model.safetensors", tarfile.SYMTYPE, "/etc/passwd"), None))),
        "hardlink": ("tgz", _tar(*good, (_member("extra", tarfile.LNKTYPE, "/etc/passwd"), None))),
        "device": ("tgz", _tar(*good, (_member("dev", tarfile.CHRTYPE), None))),
        "fifo": ("tgz", _tar(*good, (_member("fifo", tarfile.FIFOTYPE), None))),
        "duplicate": ("tgz", _tar(*good, (_member("./adapter_model.safetensors"), b"replaced"))),
        "two-folders": (
            "tgz",
            _tar((_member("a/adapter_config.json"), config), (_member("b/adapter_model.safetensors"), weights)),
        ),
        "zip-dotdot": (
            "zip",
            archive_bytes({"adapter_config.json": config, "adapter_model.safetensors": weights, "../x": b"x"}, "zip"),
        ),
        "zip-absolute": (
            "zip",
            archive_bytes({"/adapter_config.json": config, "adapter_model.safetensors": weights}, "zip"),
        ),
        "zip-backslash": ("zip", archive_bytes({"..\\x": b"x", "adapter_config.json": config}, "zip")),
        "zip-symlink": ("zip", _zip_symlink(adapter)),
        "no-adapter": ("tgz", _tar((_member("README.md"), b"hello"))),
        "not-an-archive": ("tgz", b"this is not gzip"),
    }


@pytest.mark.parametrize(
    "case",
    [
        "dotdot",
        "dotdot-inside",
        "absolute",
        "symlink",
        "hardlink",
        "device",
        "fifo",
        "duplicate",
        "two-folders",
        "zip-dotdot",
        "zip-absolute",
        "zip-backslash",
        "zip-symlink",
        "no-adapter",
        "not-an-archive",
    ],
)
def test_hostile_archive_members_are_refused(archives: ArchiveServer, adapter: Path, tmp_path: Path, case: str) -> None:
    kind, data = _hostile_archives(adapter)[case]
    url = archives.put(f"/hostile/{case}.{'zip' if kind == 'zip' else 'tgz'}", data)
    work = tmp_path / "work"
    work.mkdir()
    assert fetch_error(work / "out", url).reason == "bad_archive"
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["out", "work"]  # nothing landed anywhere
    assert not Path("/tmp/escaped").exists()


@pytest.mark.parametrize("kind", ["zip", "tgz"])
def test_archive_bomb_is_cut_at_max_bytes(archives: ArchiveServer, adapter: Path, tmp_path: Path, kind: str) -> None:
    """64 MiB of zeros compress to a few dozen KiB: the archive is small, its content is not."""
    bomb = archive_bytes(
        {
            "adapter_config.json": (adapter / "adapter_config.json").read_bytes(),
            "adapter_model.safetensors": bytes(64 * MB),
        },
        kind,
    )
    assert len(bomb) < MB
    url = archives.put(f"/bomb/bomb.{'zip' if kind == 'zip' else 'tgz'}", bomb)
    assert fetch_error(tmp_path / "out", url, max_bytes=4 * MB).reason == "too_large"


def test_archive_with_pickled_weights_only(archives: ArchiveServer, adapter: Path, tmp_path: Path) -> None:
    data = archive_bytes(
        {
            "qv/adapter_config.json": (adapter / "adapter_config.json").read_bytes(),
            "qv/adapter_model.bin": b"\x80\x04.",
        },
        "zip",
    )
    url = archives.put("/a/pickled.zip", data)
    assert fetch_error(tmp_path / "out", url).reason == "pickle"


# --- local directories and the file checks ----------------------------------------------------------------------


def test_local_fetch(adapter: Path, tmp_path: Path) -> None:
    assert_same_adapter(tmp_path / "a", adapter, fetch_into(tmp_path / "a", str(adapter)))
    assert_same_adapter(tmp_path / "b", adapter, fetch_into(tmp_path / "b", f"file://{adapter}"))
    assert fetch_error(tmp_path / "c", str(tmp_path / "missing")).reason == "not_found"
    pickled = copy_adapter(
        adapter, tmp_path / "p", drop=("adapter_model.safetensors",), extra={"adapter_model.pt": b"x"}
    )
    assert fetch_error(tmp_path / "d", str(pickled)).reason == "pickle"


def test_local_oversized_is_cut_at_max_bytes(tmp_path: Path) -> None:
    big = synthetic_adapter(tmp_path / "big", 2 * MB, seed=4)
    assert fetch_error(tmp_path / "out", str(big), max_bytes=MB).reason == "too_large"


def test_check_adapter_files(adapter: Path, tmp_path: Path) -> None:
    check_adapter_files(adapter)  # PEFT's own files
    check_adapter_files(synthetic_adapter(tmp_path / "synthetic", 1024, seed=5))  # the safetensors package's
    weights = (adapter / "adapter_model.safetensors").read_bytes()
    broken = {
        "garbage": weights[:0] + b"\xff" * 64,
        "truncated": weights[: len(weights) // 2],  # the header's offsets run past the end
        "huge-header": (1 << 62).to_bytes(8, "little") + weights[8:],
        "header-not-json": (4).to_bytes(8, "little") + b"{{{{" + weights[8:],
    }
    for name, data in broken.items():
        directory = copy_adapter(adapter, tmp_path / name, extra={"adapter_model.safetensors": data})
        with pytest.raises(SourceError) as info:
            check_adapter_files(directory)
        assert info.value.reason == "bad_adapter", name
    not_object = copy_adapter(adapter, tmp_path / "config-list", extra={"adapter_config.json": b"[1, 2]"})
    assert fetch_error(tmp_path / "out", str(not_object)).reason == "bad_adapter"
