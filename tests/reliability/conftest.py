"""Fixtures of the fault suite: the adapters, PEFT's reference texts, and one shared stack for the
scenarios that leave it as they found it (those that kill processes build their own)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from redis_server import RedisServer, start_redis
from stack import Stack, build_adapters, reference_texts


@pytest.fixture(scope="session")
def suite_adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_adapters(tiny_model_dir, tmp_path_factory.mktemp("suite-adapters"))


@pytest.fixture(scope="session")
def references(tiny_model_dir: Path, suite_adapters: Path) -> dict[str | None, str]:
    return reference_texts(tiny_model_dir, suite_adapters)


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("suite-redis"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory, suite_adapters: Path, shared_redis: RedisServer) -> Iterator[Stack]:
    """Two engines and a gateway sharing limits through Redis; every scenario must leave it idle."""
    shared = Stack(tmp_path_factory.mktemp("shared-stack"), suite_adapters, redis=shared_redis).start()
    yield shared
    shared.stop()
