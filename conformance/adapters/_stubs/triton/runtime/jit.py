"""Stand-in ``triton.runtime.jit``: the types torch imports."""

from triton import StubKernel as JITFunction


class KernelInterface:
    """``triton.runtime.jit.KernelInterface``."""


__all__ = ["JITFunction", "KernelInterface"]
