"""Stand-in ``triton.compiler``."""

from triton.compiler import compiler

__all__ = ["CompiledKernel", "compiler"]


class CompiledKernel:
    """``triton.compiler.CompiledKernel`` (a type torch imports)."""
