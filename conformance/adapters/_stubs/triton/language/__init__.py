"""Stand-in ``triton.language``: the annotation types kernels and torch read at import."""

from __future__ import annotations

from typing import Any

from triton.language import core, extra, math

__all__ = ["constexpr", "core", "dtype", "extra", "math", "tensor"]


class constexpr:
    """``tl.constexpr``: an annotation, sometimes called on a value at module level."""

    def __init__(self, value: Any = None) -> None:
        self.value = value


class dtype:
    """``tl.dtype`` (torch's dynamo registers it as a constant type)."""


class tensor:
    """``tl.tensor`` (an annotation in torch's inductor helpers)."""
