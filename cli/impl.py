"""Resolve ``--impl module:factory`` into an allocator factory (no sniffing, clear errors)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

__all__ = ["load_factory"]


class ImplSpecError(ValueError):
    """``--impl`` does not name an importable callable."""


def load_factory(spec: str) -> Callable[..., Any]:
    """Import ``module:attr`` and return the callable; ``ImplSpecError`` says what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ImplSpecError(f"--impl must look like 'package.module:factory', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImplSpecError(f"--impl {spec!r}: cannot import {module_name!r}: {err}") from err
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise ImplSpecError(f"--impl {spec!r}: {module_name!r} has no attribute {attr!r}")
        target = getattr(target, part)
    if not callable(target):
        raise ImplSpecError(f"--impl {spec!r}: {attr!r} is not callable")
    return target
