"""Triton kernels that run where their tensors are: compiled for CUDA tensors, interpreted for CPU ones.

`triton.jit` decides once, at decoration, from TRITON_INTERPRET: a kernel decorated without it cannot run on
CPU tensors, and one decorated with it never reaches the GPU. `device_jit` keeps both forms of a kernel and
`DeviceKernel.on(device)` picks by the tensors' device, so the same test (CPU tensors, the interpreter) passes
on a GPU host, and an engine on `cuda:1` runs compiled code whatever the environment says.

Launches on CUDA go through `cuda_device(device)`: Triton launches on the *current* CUDA device, not the
tensors' own, so an engine on `cuda:1` whose thread had not made it current would run kernels on GPU 0 with
GPU 1's pointers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch


class DeviceKernel:
    """One Triton kernel in both forms, each made on first use."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self._compiled: Any = None
        self._interpreted: Any = None

    def on(self, device: torch.device) -> Any:
        """The kernel to launch for tensors on `device` (`kernel.on(x.device)[grid](...)`)."""
        if device.type == "cuda":
            if self._compiled is None:
                from triton.runtime.jit import JITFunction

                self._compiled = JITFunction(self.fn)
            return self._compiled
        if self._interpreted is None:
            self._interpreted = _Interpreted(self.fn)
        return self._interpreted


class _Interpreted:
    """A kernel under Triton's interpreter, launched as `kernel[grid](...)`, whatever TRITON_INTERPRET says.

    Triton's own library functions (`tl.zeros`, `tl.max`, `tl.sum`, ...) are @triton.jit functions, made
    interpretable only when TRITON_INTERPRET=1 was set as triton was imported; without it the interpreter
    cannot call them. For the launch, they are swapped for interpreted twins and put back after, as the
    interpreter itself swaps `triton.language`'s builtins during a launch (neither is safe beside a compiling
    launch in another thread; only tests run CPU kernels in a process that also compiles).
    """

    def __init__(self, fn: Callable[..., Any]) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        self.kernel = InterpretedFunction(fn)

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            with _interpretable_library():
                self.kernel[grid](*args, **kwargs)

        return launch


@contextlib.contextmanager
def _interpretable_library() -> Iterator[None]:
    import triton.experimental.gluon  # noqa: F401  (imported lazily by a launch, it checks for the originals)
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    swapped: list[tuple[object, str, object]] = []
    for module in (tl, tl.standard, tl.math):
        for name, value in list(vars(module).items()):
            if isinstance(value, JITFunction):
                swapped.append((module, name, value))
                setattr(module, name, InterpretedFunction(value.fn))
    try:
        yield
    finally:
        for module, name, value in swapped:
            setattr(module, name, value)


def device_jit(fn: Callable[..., Any]) -> DeviceKernel:
    """Decorator: `@device_jit` in place of `@triton.jit` (no options: none of ours needs them)."""
    return DeviceKernel(fn)


def interpreted(device: torch.device) -> bool:
    """Whether kernels for tensors on `device` run under Triton's interpreter (anything but CUDA)."""
    return device.type != "cuda"


@contextlib.contextmanager
def cuda_device(device: torch.device) -> Iterator[None]:
    """Make `device` the current CUDA device for the launches inside (nothing to do off CUDA)."""
    if device.type != "cuda":
        yield
        return
    with torch.cuda.device(device):
        yield
