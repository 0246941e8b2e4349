"""Helpers of the vLLM agent's tests: a fake vLLM server (`MockVllm`), the agent app served on a free port, and the
ensure request as the gateway sends it.

MockVllm answers what vLLM 0.32's OpenAI server answers the agent, as measured on a real one (vllm_agent/vllm.py
lists them): POST /v1/load_lora_adapter loads when `lora_path` is a directory holding adapter_config.json (the files
it finds there are kept in `load_files`), answers 400 "has already been loaded" for a name it has and 404 "No adapter
found" for a path without an adapter; without runtime updating (`runtime_updating = False`) the routes are missing
(404 {"detail": "Not Found"}). GET /v1/models lists the base and each loaded LoRA with its root; GET /health is 200
while `healthy`. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from vllm_agent.app import build_app
from vllm_agent.config import AgentConfig

from adapter_servers import ADAPTER_FILES
from processes import serve_in_thread

BASE = "smollm2"


def _vllm_error(status: int, type_: str, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": status}}, status)


@dataclass
class Load:
    name: str
    path: str
    status: int  # what the mock answered


@dataclass
class MockVllm:
    runtime_updating: bool = True
    healthy: bool = True
    hidden: set[str] = field(default_factory=set)  # loaded, but left out of GET /v1/models
    loaded: dict[str, str] = field(default_factory=dict)  # name -> lora_path
    loads: list[Load] = field(default_factory=list)  # every load request
    load_files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # name -> files at lora_path when loaded
    unloads: list[str] = field(default_factory=list)  # every unload request's name
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @contextlib.contextmanager
    def serving(self, port: int = 0) -> Iterator[MockVllm]:
        with serve_in_thread(self.app(), log_level="critical", lifespan="off", port=port) as url:
            self.url = url
            yield self

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/v1/load_lora_adapter", self._load, methods=["POST"]),
                Route("/v1/unload_lora_adapter", self._unload, methods=["POST"]),
                Route("/health", self._health, methods=["GET"]),
            ]
        )

    def loads_of(self, name: str) -> list[Load]:
        with self._lock:
            return [load for load in self.loads if load.name == name]

    async def _models(self, request: Request) -> Response:
        with self._lock:
            loras = [(name, path) for name, path in self.loaded.items() if name not in self.hidden]
        cards = [{"id": BASE, "object": "model", "owned_by": "vllm", "root": f"/models/{BASE}", "parent": None}]
        cards += [{"id": n, "object": "model", "owned_by": "vllm", "root": p, "parent": BASE} for n, p in loras]
        return JSONResponse({"object": "list", "data": cards})

    async def _load(self, request: Request) -> Response:
        if not self.runtime_updating:
            return JSONResponse({"detail": "Not Found"}, 404)
        body = await request.json()
        name, path = body["lora_name"], body["lora_path"]
        with self._lock:
            if name in self.loaded:
                status, answer = (
                    400,
                    _vllm_error(
                        400,
                        "InvalidUserInput",
                        f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
                        "set 'load_inplace' to True.",
                    ),
                )
            elif not os.path.isfile(os.path.join(path, "adapter_config.json")):
                status = 404
                answer = _vllm_error(404, "NotFoundError", f"Loading lora {name} failed: No adapter found for {path}")
            else:
                status = 200
                answer = PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")
                self.loaded[name] = path
                self.load_files[name] = {f: (Path(path) / f).read_bytes() for f in ADAPTER_FILES}
            self.loads.append(Load(name, path, status))
        return answer

    async def _unload(self, request: Request) -> Response:
        if not self.runtime_updating:
            return JSONResponse({"detail": "Not Found"}, 404)
        name = (await request.json())["lora_name"]
        with self._lock:
            self.unloads.append(name)
            if self.loaded.pop(name, None) is None:
                return _vllm_error(404, "NotFoundError", f"The lora adapter '{name}' cannot be found.")
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200 if self.healthy else 503)


def agent_config(cache_dir: Path, vllm_url: str, allow: list[str], **changes: Any) -> AgentConfig:
    """The CLI's defaults, but a short wait: the tests' sources answer in milliseconds unless told to be slow."""
    values: dict[str, Any] = dict(
        vllm_url=vllm_url,
        cache_dir=cache_dir,
        vllm_cache_dir=None,
        allow=tuple(allow),
        cache_bytes=1 << 30,
        max_adapter_bytes=1 << 30,
        fetch_timeout_s=30.0,
        load_wait_s=10.0,
    )
    values.update(changes)
    if isinstance(values["vllm_cache_dir"], str):
        values["vllm_cache_dir"] = PurePosixPath(values["vllm_cache_dir"])
    return AgentConfig(**values)


@contextlib.contextmanager
def agent(config: AgentConfig) -> Iterator[str]:
    """The agent app under uvicorn on a free 127.0.0.1 port (its lifespan runs); yields its base URL."""
    with serve_in_thread(build_app(config), log_level="critical", lifespan="on") as url:
        yield url


def ensure_headers(ref: str, source: str, sha256: str, size: int | None = None) -> dict[str, str]:
    headers = {"X-Adapter-ID": ref, "X-Adapter-Source": source, "X-Adapter-SHA256": sha256}
    if size is not None:
        headers["X-Adapter-Size"] = str(size)
    return headers


def ensure(base: str, ref: str, source: str, sha256: str, size: int | None = None) -> httpx.Response:
    return httpx.post(f"{base}/v1/adapters/ensure", headers=ensure_headers(ref, source, sha256, size), timeout=60)


def assert_error(resp: httpx.Response, status: int, type_: str, *, reason: str | None = None) -> str:
    """The error's message, once its status, type and X-Loragate-Reason are as expected."""
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["type"] == type_, error
    assert resp.headers.get("X-Loragate-Reason") == reason
    return str(error["message"])


def cards(base: str) -> dict[str | None, dict[str, Any]]:
    """GET /v1/adapters' cards by id."""
    resp = httpx.get(f"{base}/v1/adapters", timeout=10)
    assert resp.status_code == 200 and resp.json()["object"] == "list"
    return {card["id"]: card for card in resp.json()["data"]}
