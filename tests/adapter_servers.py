"""Adapter sources on 127.0.0.1 for the fetch tests: a real S3 (moto_server), a Hub-shaped server and an
archive server, the last two with faults injected per path and requests counted per path.

from adapter_servers import HubServer, ArchiveServer, moto_server_fixture, ...
moto = moto_server_fixture()            # module-scoped fixture `moto`: a MotoServer (its env() for AWS_*)
with HubServer() as hub:                # HF_ENDPOINT=hub.url; hub.add_repo("org/name", adapter_dir) -> commit
    hub.fault("/org/name/resolve/*", status=500)   # fnmatch pattern on the request path
    hub.count("/org/name/resolve/*/adapter_model.safetensors")   # GET requests that matched
    hub.count_sent(...)                 # of those, answered to the end (not abandoned by the client)
    hub.reset()                         # no faults, counts back to zero
ArchiveServer().put("/a/x.tgz", adapter_archive(adapter_dir, "tgz"))   # -> its URL

Adapters: the real PEFT ones come from conftest.py's `tiny_adapters` (tests/lora_fixtures.py);
synthetic_adapter() writes a small valid one of a chosen size without torch, copy_adapter() a variant.

The Hub server answers what huggingface_hub's model_info, get_hf_file_metadata and hf_hub_download ask
(read from huggingface_hub 2.4.0): GET /api/models/{repo}[/revision/{rev}] (?blobs=true adds sizes) and
HEAD/GET /{repo}/resolve/{rev}/{filename} with X-Repo-Commit, ETag and Content-Length; a missing repo,
revision or file is 404 with the X-Error-Code the client maps (RepoNotFound, RevisionNotFound,
EntryNotFound), and a private repo without its token is 401, as on the Hub.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import shutil
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import httpx
import pytest

from loragate.launch import stop

from polling import poll
from processes import free_port

MOTO_SERVER = Path(sys.executable).parent / "moto_server"
S = TypeVar("S", bound="FaultyServer")
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")  # written here, not imported: a reference


def sha256sum_digest(directory: Path) -> str:
    """What `sha256sum adapter_config.json adapter_model.safetensors | sha256sum` prints, computed here."""
    lines = "".join(
        f"{hashlib.sha256((directory / name).read_bytes()).hexdigest()}  {name}\n" for name in ADAPTER_FILES
    )
    return hashlib.sha256(lines.encode()).hexdigest()


def copy_adapter(src: Path, dest: Path, *, drop: tuple[str, ...] = (), extra: dict[str, bytes] | None = None) -> Path:
    """A copy of the adapter directory `src` at `dest`, without the files in `drop`, with `extra` files added."""
    shutil.copytree(src, dest)
    for name in drop:
        (dest / name).unlink()
    for name, data in (extra or {}).items():
        (dest / name).write_bytes(data)
    return dest


def synthetic_adapter(directory: Path, payload_bytes: int, seed: int) -> Path:
    """A small adapter directory whose safetensors file is written by the safetensors package (the reference
    writer): one float32 tensor of `payload_bytes` bytes filled with `seed`. Not loadable on a model; for
    the cache and size tests, where only bytes and digests matter."""
    import numpy as np
    from safetensors.numpy import save_file

    directory.mkdir(parents=True)
    config = {"peft_type": "LORA", "r": 1, "lora_alpha": 1, "target_modules": ["q_proj"], "seed": seed}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    save_file({"w": np.full(payload_bytes // 4, seed, dtype=np.float32)}, str(directory / "adapter_model.safetensors"))
    return directory


def archive_bytes(files: dict[str, bytes], kind: str) -> bytes:
    """A .tar, .tar.gz or .zip (kind: "tar", "tgz", "zip") holding `files` {member name: bytes}."""
    buf = io.BytesIO()
    if kind == "zip":
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
            for name, data in files.items():
                zf.writestr(name, data)
    else:
        with tarfile.open(fileobj=buf, mode="w:gz" if kind == "tgz" else "w") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def adapter_archive(directory: Path, kind: str, folder: str | None = None) -> bytes:
    """The two adapter files of `directory` (and its README.md, which fetch must skip) as an archive, at
    the top or inside `folder`."""
    prefix = f"{folder}/" if folder else ""
    names = [*ADAPTER_FILES, *(["README.md"] if (directory / "README.md").exists() else [])]
    return archive_bytes({prefix + name: (directory / name).read_bytes() for name in names}, kind)


# --- HTTP servers with faults -------------------------------------------------------------------------------


@dataclass
class Fault:
    status: int | None = None  # answer this status (and `headers`) instead of the resource
    headers: dict[str, str] = field(default_factory=dict)
    delay_s: float = 0.0  # before the response head
    chunk_delay_s: float = 0.0  # between body chunks of `chunk_bytes`
    chunk_bytes: int = 16 << 10
    truncate_after: int | None = None  # close the connection after this many body bytes (Content-Length full)
    drop: bool = False  # close the connection without answering


@dataclass
class Reply:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def do_GET(self) -> None:
        self.server.owner.handle(self, "GET")

    def do_HEAD(self) -> None:
        self.server.owner.handle(self, "HEAD")

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False  # a handler sleeping in a fault must not hold up stop()
    owner: FaultyServer

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a client that gave up mid-body (a deadline test) is expected


class FaultyServer:
    """An HTTP/1.1 server in a thread on 127.0.0.1: `resource(method, path, query, headers)` answers, unless
    a fault matches the path. Counts requests per (method, path)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._faults: dict[str, Fault] = {}
        self.requests: Counter[tuple[str, str]] = Counter()
        # responses whose last body chunk the server came to write (a client that stopped reading earlier
        # makes the server's writes fail before that)
        self.sent: Counter[tuple[str, str]] = Counter()
        self.auth: list[str | None] = []  # Authorization header of every request, in order
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.owner = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"

    def __enter__(self: S) -> S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    def fault(self, pattern: str, **kwargs: Any) -> None:
        """Apply Fault(**kwargs) to requests whose path matches the fnmatch `pattern` (until reset())."""
        with self._lock:
            self._faults[pattern] = Fault(**kwargs)

    def reset(self) -> None:
        """No faults, and every count back to zero."""
        with self._lock:
            self._faults.clear()
            self.requests.clear()
            self.sent.clear()
            self.auth.clear()

    def count(self, pattern: str, method: str = "GET") -> int:
        """Requests whose path matches the fnmatch `pattern`."""
        with self._lock:
            return _matching(self.requests, pattern, method)

    def count_sent(self, pattern: str, method: str = "GET") -> int:
        """Of those, the responses sent to their end: a client that gave up mid-body is not counted."""
        with self._lock:
            return _matching(self.sent, pattern, method)

    def resource(self, method: str, path: str, query: str, headers: Any) -> Reply:
        raise NotImplementedError

    def handle(self, handler: BaseHTTPRequestHandler, method: str) -> None:
        path, _, query = handler.path.partition("?")
        with self._lock:
            self.requests[(method, path)] += 1
            self.auth.append(handler.headers.get("Authorization"))
            fault = next((f for p, f in self._faults.items() if fnmatch.fnmatchcase(path, p)), Fault())
        time.sleep(fault.delay_s)
        if fault.drop:
            handler.close_connection = True
            return
        if fault.status is not None:
            reply = Reply(fault.status, json.dumps({"error": "injected"}).encode(), dict(fault.headers))
        else:
            reply = self.resource(method, path, query, handler.headers)
        handler.send_response(reply.status)
        for name, value in {"Content-Length": str(len(reply.body)), **reply.headers}.items():
            handler.send_header(name, value)
        handler.end_headers()
        if method == "HEAD":
            return
        body = reply.body if fault.truncate_after is None else reply.body[: fault.truncate_after]
        for start in range(0, len(body), fault.chunk_bytes):
            if start + fault.chunk_bytes >= len(reply.body):
                # Counted before the last chunk goes out, so that a client cannot have read it uncounted.
                with self._lock:
                    self.sent[(method, path)] += 1
            handler.wfile.write(body[start : start + fault.chunk_bytes])
            handler.wfile.flush()
            time.sleep(fault.chunk_delay_s)
        if len(body) < len(reply.body):
            handler.close_connection = True


def _matching(counts: Counter[tuple[str, str]], pattern: str, method: str) -> int:
    return sum(n for (m, path), n in counts.items() if m == method and fnmatch.fnmatchcase(path, pattern))


class ArchiveServer(FaultyServer):
    """Plain files by path: put("/a/adapter.tar.gz", data) serves it at url + "/a/adapter.tar.gz"."""

    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        super().__init__()

    def put(self, path: str, data: bytes) -> str:
        self.files[path] = data
        return self.url + path

    def resource(self, method: str, path: str, query: str, headers: Any) -> Reply:
        data = self.files.get(path)
        if data is None:
            return Reply(404, b"not found")
        return Reply(200, data, {"Content-Type": "application/octet-stream"})


@dataclass
class _Repo:
    branches: dict[str, str]  # branch or tag -> commit
    commits: dict[str, dict[str, bytes]]  # commit -> {filename: bytes}
    token: str | None = None  # private: only this Bearer token sees it


class HubServer(FaultyServer):
    """Model repos served the way the Hugging Face Hub serves them to huggingface_hub."""

    def __init__(self) -> None:
        self.repos: dict[str, _Repo] = {}
        super().__init__()

    def add_repo(self, repo_id: str, directory: Path, revision: str = "main", token: str | None = None) -> str:
        """Commit the files of `directory` to `repo_id` at branch `revision`; returns the commit id."""
        files = {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}
        commit = hashlib.sha1(repr((repo_id, revision, sorted(files.items()))).encode()).hexdigest()
        repo = self.repos.setdefault(repo_id, _Repo({}, {}, token))
        repo.branches[revision] = commit
        repo.commits[commit] = files
        return commit

    def resource(self, method: str, path: str, query: str, headers: Any) -> Reply:
        parts = [unquote(p) for p in path.strip("/").split("/")]
        if parts[:2] == ["api", "models"]:
            repo_id, revision = "/".join(parts[2:4]), "main"
            if parts[4:5] == ["revision"]:
                revision = "/".join(parts[5:])
            return self._lookup(repo_id, revision, None, headers, info="blobs=true" in query)
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._lookup("/".join(parts[:2]), parts[3], "/".join(parts[4:]), headers)
        return Reply(404, b"not found")

    def _lookup(self, repo_id: str, revision: str, filename: str | None, headers: Any, info: bool = False) -> Reply:
        repo = self.repos.get(repo_id)
        if repo is None or (repo.token is not None and headers.get("Authorization") != f"Bearer {repo.token}"):
            return _hub_error(401 if repo is not None else 404, "RepoNotFound")
        commit = repo.branches.get(revision, revision if revision in repo.commits else None)
        if commit is None:
            return _hub_error(404, "RevisionNotFound")
        files = repo.commits[commit]
        if filename is None:
            siblings = [
                {"rfilename": name, **({"size": len(data)} if info else {})} for name, data in sorted(files.items())
            ]
            body = {"id": repo_id, "modelId": repo_id, "sha": commit, "private": repo.token is not None}
            return Reply(200, json.dumps({**body, "siblings": siblings}).encode(), {"Content-Type": "application/json"})
        if filename not in files:
            return _hub_error(404, "EntryNotFound")
        data = files[filename]
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        return Reply(200, data, {"X-Repo-Commit": commit, "ETag": etag, "Content-Type": "application/octet-stream"})


def _hub_error(status: int, code: str) -> Reply:
    return Reply(status, json.dumps({"error": code}).encode(), {"X-Error-Code": code, "X-Error-Message": code})


# --- moto_server: a real S3 API --------------------------------------------------------------------------


@dataclass
class MotoServer:
    port: int
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self) -> dict[str, str]:
        """The AWS environment a boto3 client needs to reach this server (and nothing else)."""
        return {
            "AWS_ENDPOINT_URL": self.url,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": "/nonexistent",
            "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        }

    def start(self, timeout_s: float = 20.0) -> None:
        argv = [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        proc = self.proc
        poll(lambda: self._answers() or proc.poll() is not None, timeout_s, interval_s=0.05, what="moto_server up")
        assert proc.poll() is None, f"moto_server exited with status {proc.returncode}"

    def _answers(self) -> bool:
        try:
            return httpx.get(self.url + "/moto-api/", timeout=1.0).status_code < 500
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace_s=5)
            self.proc = None

    def s3(self) -> Any:
        import boto3

        env = self.env()
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"],
            region_name=env["AWS_DEFAULT_REGION"],
        )

    def put_adapter(self, bucket: str, prefix: str, directory: Path) -> str:
        """Upload every file of `directory` under s3://bucket/prefix/ (the bucket made if needed); the URI."""
        s3 = self.s3()
        if bucket not in {b["Name"] for b in s3.list_buckets()["Buckets"]}:
            s3.create_bucket(Bucket=bucket)
        for path in sorted(directory.iterdir()):
            s3.put_object(Bucket=bucket, Key=f"{prefix}/{path.name}", Body=path.read_bytes())
        return f"s3://{bucket}/{prefix}"


def moto_server_fixture(scope: Any = "module", name: str = "moto") -> Callable[..., Iterator[MotoServer]]:
    """A fixture called `name` (assign it to a module-level variable) yielding a running MotoServer."""

    @pytest.fixture(scope=scope, name=name)
    def fixture() -> Iterator[MotoServer]:
        if not MOTO_SERVER.exists():
            pytest.skip("needs moto[server] (pip install 'moto[server]')")
        server = MotoServer(free_port())
        server.start()
        try:
            yield server
        finally:
            server.stop()

    return fixture
