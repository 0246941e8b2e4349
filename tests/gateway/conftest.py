"""Fixtures of the gateway tests: fake engines on real ports (tests/mock_upstream.py). Nothing imported
here (or by any gateway test at import time) pulls in torch: the gateway deploys without it, and its
tests start in well under a second."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from mock_upstream import MockUpstream


@pytest.fixture
def mock() -> Iterator[MockUpstream]:
    with MockUpstream() as upstream:
        yield upstream


@pytest.fixture
def mock_b() -> Iterator[MockUpstream]:
    with MockUpstream() as upstream:
        yield upstream
