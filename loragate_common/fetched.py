"""The request side of fetched adapters, one rule for the engine (engine/entrypoints/fetched_adapters.py) and the vLLM
agent (vllm_agent/loader.py): the pinned source a request carries, and the answers when its fetch is slow or fails.

The gateway resolves a catalog adapter to one version and sends it as `X-Adapter-ID: ID@N` with
`X-Adapter-Source`, `X-Adapter-SHA256` and optionally `X-Adapter-Size` (gateway/adapter_catalog.py `Pinned.headers`).
These headers are hostile input like any other: a malformed one is a 400 naming it, a source outside the allow-list a
403 `adapter_source_not_allowed`, a failed fetch a 502 `adapter_fetch_failed`, and a request that waited its bound for
a fetch still going on a 503 `adapter_loading`; the last two carry Retry-After and X-Loragate-Reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from starlette.requests import HTTPConnection

from loragate_common.adapter_sources import SourceError
from loragate_common.errors import ApiError, bad_request, retry_after, unavailable

LOADING_RETRY_AFTER_S = 2.0  # what a request that timed out waiting for a fetch is told
MAX_SOURCE_CHARS = 2048
_SHA256_RE = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True, slots=True)
class Wanted:
    """A request's adapter as the gateway's catalog pins it."""

    source: str
    sha256: str
    size: int | None


def wanted_from_headers(request: HTTPConnection) -> Wanted | None:
    """The pinned source the gateway sent with the request; None without X-Adapter-Source; 400 if malformed."""
    source = request.headers.get("x-adapter-source")
    if source is None:
        return None
    sha256 = (request.headers.get("x-adapter-sha256") or "").strip().lower()
    if not source.strip() or len(source) > MAX_SOURCE_CHARS:
        raise bad_request(f"X-Adapter-Source: must be a source URI of 1 to {MAX_SOURCE_CHARS} characters")
    if _SHA256_RE.fullmatch(sha256) is None:
        raise bad_request("X-Adapter-SHA256: a source needs the content's sha256 (64 hex digits)")
    size_text = request.headers.get("x-adapter-size")
    size = None
    if size_text is not None:
        if not size_text.strip().isdigit():
            raise bad_request("X-Adapter-Size: must be a number of bytes")
        size = int(size_text)
    return Wanted(source.strip(), sha256, size)


def fetch_failed(message: str, retry_after_s: float) -> ApiError:
    return ApiError(
        502,
        "adapter_fetch_failed",
        message,
        {"Retry-After": retry_after(retry_after_s), "X-Loragate-Reason": "adapter_fetch_failed"},
    )


def source_refused(adapter_id: str, error: SourceError) -> ApiError:
    """The answer to a source the disk cache would not fetch from (SourceError, not FetchBackoff): 400 for a
    malformed one, 403 for one outside the allow-list, else 502."""
    if error.reason == "invalid":
        return bad_request(f"X-Adapter-Source: {error}")
    if error.reason == "not_allowed":
        return ApiError(403, "adapter_source_not_allowed", f"adapter {adapter_id!r}: {error}")
    return fetch_failed(f"adapter {adapter_id!r} ({error.reason}): {error}", 1.0)


def still_loading(adapter_id: str, wanted: Wanted) -> ApiError:
    """503 `adapter_loading`: the request waited its bound; the fetch goes on."""
    return unavailable(
        f"adapter {adapter_id!r} is being fetched from {wanted.source}; retry shortly",
        "adapter_loading",
        LOADING_RETRY_AFTER_S,
    )
