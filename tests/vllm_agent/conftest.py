"""Fixtures of the vLLM agent's tests: a fake vLLM server (tests/vllm_agent/vllm_testing.py) and an archive server on
127.0.0.1 (tests/adapter_servers.py). Nothing imported here pulls in torch: the agent deploys without it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from adapter_servers import ArchiveServer
from vllm_testing import MockVllm


@pytest.fixture
def vllm() -> Iterator[MockVllm]:
    with MockVllm().serving() as server:
        yield server


@pytest.fixture
def archives() -> Iterator[ArchiveServer]:
    with ArchiveServer() as server:
        yield server
