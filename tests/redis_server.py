"""A real, throwaway redis-server on 127.0.0.1 for tests (no persistence, its own temp dir).

from redis_server import redis_server_fixture, redis_url_fixture, start_redis
redis_url = redis_url_fixture()                          # module-scoped fixture `redis_url` (a URL)
redis_server = redis_server_fixture(scope="function")    # fixture `redis_server`: a RedisServer to stop/start,
                                                         # or pause/resume (SIGSTOP/SIGCONT: a stalled Redis)
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from polling import poll
from processes import free_port

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"


def ping(port: int, timeout_s: float = 0.5) -> bool:
    """True when a Redis on 127.0.0.1:port answers PING (raw RESP, no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.dir / "redis.log"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start (or restart, on the same port) and wait until it answers PING."""
        assert self.proc is None, "already running"
        argv = [
            REDIS_SERVER,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.dir),
            "--logfile",
            str(self.log_path),
            "--daemonize",
            "no",
        ]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        proc = self.proc
        try:
            poll(lambda: ping(self.port) or proc.poll() is not None, timeout_s, interval_s=0.02)
            assert proc.poll() is None, f"exited with status {proc.returncode}"
        except AssertionError as exc:
            self.stop()
            log = self.log_path.read_text() if self.log_path.exists() else ""
            raise RuntimeError(f"redis-server did not come up on port {self.port} ({exc}):\n{log[-2000:]}") from None

    def pause(self) -> None:
        """Freeze it (SIGSTOP): connections are still accepted by the kernel, nothing is answered."""
        assert self.proc is not None, "not running"
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Undo `pause` (SIGCONT); what was sent meanwhile is then answered."""
        assert self.proc is not None, "not running"
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop it and wait until the port no longer answers (a paused one is resumed first)."""
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGCONT)  # a stopped process would hold SIGTERM until continued
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        self.proc = None


def start_redis(directory: Path | None = None) -> RedisServer:
    """A running server on a free port; stop() it when done (tries a few ports against bind races)."""
    directory = directory or Path(tempfile.mkdtemp(prefix="loragate-redis-"))
    directory.mkdir(parents=True, exist_ok=True)
    for attempt in range(3):
        server = RedisServer(free_port(), directory)
        try:
            server.start()
            return server
        except RuntimeError:
            if attempt == 2:
                raise
    raise AssertionError("unreachable")


def _require_binary() -> None:
    if shutil.which(REDIS_SERVER) is None:
        pytest.skip("needs redis-server (apt-get install redis-server)")


def redis_server_fixture(scope: Any = "module", name: str = "redis_server") -> Callable[..., Iterator[RedisServer]]:
    """A fixture called `name` (assign it to a module-level variable) yielding a fresh RedisServer, stopped
    afterwards."""

    @pytest.fixture(scope=scope, name=name)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
        _require_binary()
        server = start_redis(tmp_path_factory.mktemp("redis"))
        try:
            yield server
        finally:
            server.stop()

    return fixture


def redis_url_fixture(scope: Any = "module", name: str = "redis_url") -> Callable[..., Iterator[str]]:
    """A fixture called `name` (assign it to a module-level variable) yielding the URL of a fresh
    redis-server."""

    @pytest.fixture(scope=scope, name=name)
    def fixture(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
        _require_binary()
        server = start_redis(tmp_path_factory.mktemp("redis"))
        try:
            yield server.url
        finally:
            server.stop()

    return fixture
