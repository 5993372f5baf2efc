"""Stand-in ``triton.runtime``."""

from triton.runtime import autotuner, cache, jit

__all__ = ["autotuner", "cache", "jit"]
