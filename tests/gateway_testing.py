"""Helpers shared by the gateway's HTTP tests: in-process (ASGI) and real-server clients, assertions, processes."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import uvicorn
from engine_server import start_loragate
from starlette.applications import Starlette


@contextlib.asynccontextmanager
async def asgi(app: Starlette) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                 timeout=30) as client:
        yield client


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def assert_error(resp: httpx.Response, status: int, type_: str | None = None, reason: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    if type_ is not None:
        assert error["type"] == type_
    if reason is not None:
        assert resp.headers["X-Loragate-Reason"] == reason
        assert int(resp.headers["Retry-After"]) >= 1


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@contextlib.contextmanager
def serve_app(app: Starlette) -> Iterator[str]:
    """Run `app` under uvicorn in a thread on a free 127.0.0.1 port; yields its base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http="h11"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "gateway did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()


def start_gateway(tmp_path: Path, name: str, policy: str, upstreams: list[str],
                  *extra: str) -> tuple[subprocess.Popen[bytes], str]:
    policy_path = tmp_path / f"{name}.yaml"
    policy_path.write_text(policy)
    args = ["gateway", "--policy", str(policy_path), "--log-level", "warning", *extra]
    for upstream in upstreams:
        args += ["--upstream", upstream]
    return start_loragate(tmp_path / f"{name}.log", *args, timeout_s=30)


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)


def poll(probe: Any, timeout_s: float = 15.0) -> Any:
    """The first truthy answer of `probe()`, polled until timeout_s (then the test fails)."""
    end = time.monotonic() + timeout_s
    while not (answer := probe()):
        assert time.monotonic() < end, "condition not reached in time"
        time.sleep(0.1)
    return answer
