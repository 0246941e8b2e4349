"""What the engine and the gateway share, torch-free: JSON errors (`errors`), strict bodies and SSE framing
(`http_io`), the hardened uvicorn server (`http_server`), `X-Priority` classes (`priority`), metric label bounds
(`labels`), percentiles (`stats`), the OpenTelemetry setup (`tracing`), adapter sources (`adapter_sources`), the disk
cache of fetched adapters (`adapter_cache`) and the adapter headers a request carries (`fetched`)."""
