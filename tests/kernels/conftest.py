"""Shared by the kernel tests: one torch thread."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """The tensors here are tiny: with a second intra-op thread the matmuls only wait on each other (10x slower
    when the cores are shared), and the results do not depend on the thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
