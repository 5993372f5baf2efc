"""Hypothesis' strategy constructors the suites draw from inside their rules, each object built once.

A rule draws with ``data.draw(st.integers(1, most))`` and the like, where the bounds depend on the state, so the
strategy is constructed at every draw. Building one costs more than drawing from it (``st.integers`` about 4 us
here: argument checks, Hypothesis' own cache lookup and a lazy wrapper whose inner strategy is built again on first
use), which made strategy construction a tenth of a lockstep step under the breadth driver. The suites import this
module as ``st``; its constructors return the same object for the same arguments (strategies are immutable values,
as Hypothesis' own ``@cacheable`` assumes), so the inner strategy is built once and every later draw, under
Hypothesis' engine or the breadth driver (:func:`kvproof.conformance.generation.sample`), starts from it.

Arguments that cannot be hashed (a list holding unhashable elements) build a fresh strategy, as before. Any other
name is Hypothesis' own (``st.data``, ``st.none``).
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from hypothesis import strategies as _st

__all__ = ["booleans", "integers", "just", "lists", "one_of", "permutations", "sampled_from"]

_SIZE = 4096


@functools.lru_cache(maxsize=_SIZE)
def integers(min_value: int | None = None, max_value: int | None = None) -> _st.SearchStrategy[int]:
    return _st.integers(min_value, max_value)


@functools.lru_cache(maxsize=1)
def booleans() -> _st.SearchStrategy[bool]:
    return _st.booleans()


@functools.lru_cache(maxsize=_SIZE)
def _sampled_from(elements: tuple[Any, ...]) -> _st.SearchStrategy[Any]:
    return _st.sampled_from(elements)


def sampled_from(elements: Sequence[Any]) -> _st.SearchStrategy[Any]:
    """``st.sampled_from(elements)``, one object per tuple of (hashable) elements."""
    key = tuple(elements)
    try:
        return _sampled_from(key)
    except TypeError:  # unhashable elements
        return _st.sampled_from(key)


@functools.lru_cache(maxsize=_SIZE)
def _one_of(branches: tuple[_st.SearchStrategy[Any], ...]) -> _st.SearchStrategy[Any]:
    return _st.one_of(*branches)


def one_of(*branches: _st.SearchStrategy[Any]) -> _st.SearchStrategy[Any]:
    return _one_of(branches)


def just(value: Any) -> _st.SearchStrategy[Any]:
    if isinstance(value, Hashable):
        try:
            return _just(value)
        except TypeError:  # a tuple holding something unhashable
            pass
    return _st.just(value)


@functools.lru_cache(maxsize=_SIZE)
def _just(value: Any) -> _st.SearchStrategy[Any]:
    return _st.just(value)


def lists(elements: _st.SearchStrategy[Any], *, min_size: int = 0, max_size: int | None = None,
          unique: bool = False) -> _st.SearchStrategy[list[Any]]:
    return _lists(elements, min_size, max_size, unique)


@functools.lru_cache(maxsize=_SIZE)
def _lists(elements: _st.SearchStrategy[Any], min_size: int, max_size: int | None,
           unique: bool) -> _st.SearchStrategy[list[Any]]:
    return _st.lists(elements, min_size=min_size, max_size=max_size, unique=unique)


def permutations(values: Iterable[Any]) -> _st.SearchStrategy[list[Any]]:
    key = tuple(values)
    try:
        return _permutations(key)
    except TypeError:
        return _st.permutations(key)


@functools.lru_cache(maxsize=_SIZE)
def _permutations(values: tuple[Any, ...]) -> _st.SearchStrategy[list[Any]]:
    return _st.permutations(values)


def __getattr__(name: str) -> Any:
    """Every other constructor is Hypothesis' own (``data``, ``none``, ...)."""
    return getattr(_st, name)
