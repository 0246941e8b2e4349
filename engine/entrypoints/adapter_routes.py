"""The adapter admin API: /v1/adapters lists (GET), loads (POST) and unloads (DELETE) adapters at run time.

POST loads only from inside the engine's --adapter-dir (`LoadAdapterRequest.resolve_path` enforces it),
and re-registering an id replaces its content under a new version. GET shows where each adapter is
(`state`: disk, host or device; downloading or failed for fetched ones not yet registered, see
engine/entrypoints/fetched_adapters.py), its device loads and evictions and when it was last used.
Errors are JSON like every other route's: 400 for an unusable id, path or adapter, 404 for unloading an id
that is not registered.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine.core.async_engine import AsyncEngine
from engine.core.outputs import AdapterStatus
from engine.entrypoints.fetched_adapters import FetchedAdapters
from engine.entrypoints.protocol import LoadAdapterRequest, parse_body
from engine.entrypoints.responses import adapter_card
from engine.lora.peft_config import AdapterError, validate_adapter_id
from loragate_common.errors import adapter_not_found, bad_request
from loragate_common.http_io import list_body, read_json


class AdapterRoutes:
    """The /v1/adapters handlers; one instance per app, bound to one engine."""

    def __init__(self, engine: AsyncEngine, fetched: FetchedAdapters) -> None:
        self.engine = engine
        self.fetched = fetched
        self.base_model = engine.engine.model_name
        adapter_dir = engine.engine.config.adapter_dir
        self.adapter_dir = Path(adapter_dir) if adapter_dir is not None else None

    def routes(self) -> list[Route]:
        return [
            Route("/v1/adapters", self.adapters, methods=["GET", "POST"]),
            Route("/v1/adapters/{adapter_id:path}", self.unload_adapter, methods=["DELETE"]),
        ]

    async def adapters(self, request: Request) -> Response:
        """GET lists the registered adapters; POST registers one from inside --adapter-dir."""
        if request.method == "GET":
            return JSONResponse(list_body(self.cards()))
        req = parse_body(LoadAdapterRequest, await read_json(request))
        if self.adapter_dir is None:
            raise bad_request(
                "loading adapters at run time needs an adapter directory: start the "
                "engine with --adapter-dir DIR and give paths inside it"
            )
        try:
            spec = await self.engine.load_adapter(req.id, req.resolve_path(self.adapter_dir))
        except ValueError as exc:  # AdapterError is one: unusable directory, files or shapes
            raise bad_request(str(exc)) from None
        registered = AdapterStatus.of(spec, "disk")
        status = next((a for a in self.engine.list_adapters() if (a.adapter_id, a.version) == spec.key), registered)
        return JSONResponse(adapter_card(status, self.base_model))

    def cards(self) -> list[dict[str, Any]]:
        statuses = self.engine.list_adapters()
        counts, _, _ = self.engine.engine.device_adapters.counters.by_adapter([a.adapter_id for a in statuses])
        sources = self.fetched.sources()
        cards = []
        for status in statuses:
            loads, evictions = counts.get(status.adapter_id, (0, 0))
            error = self.engine.engine.adapter_error(status.adapter_id)
            cards.append(
                {
                    **adapter_card(status, self.base_model),
                    "state": "failed" if error is not None else status.residence,
                    "loads": loads,
                    "evictions": evictions,
                    "error": error,
                    **self.fetched.card_fields(status.adapter_id, sources),
                }
            )
        return cards + self.fetched.pending_cards(self.base_model)

    async def unload_adapter(self, request: Request) -> Response:
        adapter_id = request.path_params["adapter_id"]
        try:
            validate_adapter_id(adapter_id)
        except AdapterError as exc:
            raise bad_request(str(exc)) from None
        try:
            await self.engine.unload_adapter(adapter_id)
        except KeyError:
            raise adapter_not_found(adapter_id) from None
        return JSONResponse({"id": adapter_id, "object": "adapter", "deleted": True})
