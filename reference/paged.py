"""One paged token pool as a frozen value: free-page list plus ghost page owners.

Models ``PagedTokenToKVPoolAllocator`` (P > 1) and ``TokenToKVPoolAllocator``
(P == 1) of SGLang 0.5.23 (sglang_semantics.md §1.2-§1.4):

* page 0 (slots ``0..P-1``) is reserved: it is never free and never owned;
* allocation takes pages from the FRONT of ``free_pages``;
* release order is SGLang 0.5.23's (need_sort=False): at P > 1 the sorted set of
  released pages is PREPENDED (LIFO reuse, ``_release_page_ids(torch.unique(...))``);
  at P == 1 slots are APPENDED in the given order (FIFO, token allocator). The order
  is policy, not contract: the lockstep harness compares it only when an
  implementation declares ``Capability.EXACT_PAGE_ORDER``.
* ``owner`` is ghost state (the real allocator has none): who holds each page, so
  that G3 (owners and free pages partition the pool) can be checked.

:func:`initial_pool` validates; the operations derive new pools from valid ones and
build them with :func:`trusted_pool`, without re-validation (the lockstep harness runs them
thousands of times per second).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict

__all__ = ["LEAKED", "Owner", "PagedPool", "initial_pool", "release_page_ids", "release_pages", "take_pages", "trusted",
           "trusted_pool"]

#: Ghost owner label of a page: the id of the request holding it.
Owner = int
#: The ghost owner of pages an implementation's documented failure took and nobody holds (no live slot, no mapping);
#: only a run that looks past such a finding (``kvproof.conformance.findings``) makes them, following it.
LEAKED: Owner = -1


class PagedPool(BaseModel):
    """Free list and ghost owners of one pool; ``owner[g] is None`` iff page g is not allocated."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    page_size: int
    num_pages: int
    free_pages: tuple[int, ...]
    owner: tuple[Owner | None, ...]  # index = page id, length num_pages + 1

    @property
    def available_size(self) -> int:
        """Free tokens: ``len(free_pages) * P`` (§1.3)."""
        return len(self.free_pages) * self.page_size

    @property
    def size(self) -> int:
        return self.num_pages * self.page_size

    def is_allocated(self, page: int) -> bool:
        return 1 <= page <= self.num_pages and self.owner[page] is not None


_Model = TypeVar("_Model", bound=BaseModel)
# BaseModel's instance slots, set directly (as pydantic's model_construct does, through object.__setattr__)
_set_dict, _set_fields_set, _set_extra, _set_private = (
    BaseModel.__dict__[slot].__set__
    for slot in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__"))


def trusted(cls: type[_Model], values: dict[str, Any], fields_set: set[str]) -> _Model:
    """``cls`` over ``values`` without validation, for values correct by construction.

    The object ``model_construct`` / ``model_copy`` would build (``values`` holds every field,
    in declaration order; ``fields_set`` becomes ``model_fields_set``), without their
    per-call overhead. The reference's operations build every derived value with it.
    """
    model = object.__new__(cls)
    _set_dict(model, values)
    _set_fields_set(model, fields_set)
    _set_extra(model, None)
    _set_private(model, None)
    return model


def trusted_pool(page_size: int, num_pages: int, free_pages: tuple[int, ...],
                 owner: tuple[Owner | None, ...]) -> PagedPool:
    """A pool derived from valid ones (every field set, as ``PagedPool(...)`` would)."""
    return trusted(PagedPool, {"page_size": page_size, "num_pages": num_pages, "free_pages": free_pages,
                               "owner": owner}, {"page_size", "num_pages", "free_pages", "owner"})


def initial_pool(num_pages: int, page_size: int) -> PagedPool:
    """State after ``clear()``: pages ``1..num_pages`` free in ascending order."""
    return PagedPool(
        page_size=page_size,
        num_pages=num_pages,
        free_pages=tuple(range(1, num_pages + 1)),
        owner=(None,) * (num_pages + 1),
    )


def take_pages(pool: PagedPool, owners: Sequence[Owner]) -> tuple[PagedPool, tuple[int, ...]]:
    """Hand the first ``len(owners)`` free pages to ``owners`` (one owner per page, in order).

    The caller has checked capacity (all-or-nothing is the composite's job).
    """
    k = len(owners)
    pages = pool.free_pages[:k]
    owner = list(pool.owner)
    for page, who in zip(pages, owners, strict=True):
        owner[page] = who
    return trusted_pool(pool.page_size, pool.num_pages, pool.free_pages[k:], tuple(owner)), pages


def release_page_ids(pool: PagedPool, pages: Iterable[int]) -> PagedPool:
    """Give ``pages`` back exactly as given, no page twice, no sort (0.5.23 ``free_page_ids``: the kv-row segment
    path): prepended at P > 1, appended at P == 1 (sglang_semantics.md §1.5a)."""
    pages = tuple(pages)
    free = pages + pool.free_pages if pool.page_size > 1 else pool.free_pages + pages
    owner = list(pool.owner)
    for page in pages:
        owner[page] = None
    return trusted_pool(pool.page_size, pool.num_pages, free, tuple(owner))


def release_pages(pool: PagedPool, pages: Iterable[int]) -> PagedPool:
    """Give ``pages`` back in SGLang 0.5.23's order (see module docstring)."""
    pages = tuple(pages)
    if pool.page_size > 1:
        pages = tuple(sorted(set(pages)))
        free = pages + pool.free_pages
    else:
        free = pool.free_pages + pages
    owner = list(pool.owner)
    for page in pages:
        owner[page] = None
    return trusted_pool(pool.page_size, pool.num_pages, free, tuple(owner))
