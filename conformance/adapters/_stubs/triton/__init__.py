"""kvproof's import-time stand-in for ``triton`` (see ../README.md); no kernel can run."""

from __future__ import annotations

from typing import Any

from triton import language

__all__ = ["Config", "jit", "language"]
__version__ = "0.0.0+kvproof.stub"


class StubKernel:
    """What ``@triton.jit`` returns: the Python function, unlaunchable."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "kernel")
        self.__doc__ = getattr(fn, "__doc__", None)

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError(f"Triton kernel {self.__name__!r} launched, but triton is kvproof's CPU stub")
        return launch

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"Triton kernel {self.__name__!r} called, but triton is kvproof's CPU stub")


def jit(fn: Any = None, **options: Any) -> Any:
    """``@triton.jit`` and ``@triton.jit(...)``."""
    if fn is None:
        return StubKernel
    return StubKernel(fn)


class Config:
    """``triton.Config`` (autotune configs built at import time)."""

    def __init__(self, kwargs: dict[str, Any] | None = None, num_warps: int = 4, num_stages: int = 2,
                 **extra: Any) -> None:
        self.kwargs, self.num_warps, self.num_stages, self.extra = dict(kwargs or {}), num_warps, num_stages, extra
