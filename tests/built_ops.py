"""Whether the CPU's C++ ops are here, for the tests of the ops themselves.

Where they are off on purpose (LORAGATE_CPU_OPS=0: CI runs a selection of the suite so, as a machine without a
compiler would) or cannot be built on a machine that does not require them, those tests skip and the torch routes'
tests run; with LORAGATE_REQUIRE_TOOLS=1 (CI) a build that fails is a failure, never a skip.
"""

from __future__ import annotations

import os

import pytest


def require_cpu_ops() -> None:
    from loragate_kernels.cpu import build

    if build.load():
        return
    reason = f"the CPU ops are not built here: {build.unavailable_reason()}"
    if os.environ.get("LORAGATE_CPU_OPS", "1").strip() == "0" or os.environ.get("LORAGATE_REQUIRE_TOOLS") != "1":
        pytest.skip(reason)
    pytest.fail(reason)
