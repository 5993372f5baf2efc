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
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict

__all__ = ["Owner", "PagedPool", "initial_pool", "release_pages", "take_pages"]

#: Ghost owner label of a page: the id of the request holding it.
Owner = int


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
    return pool.model_copy(update={"free_pages": pool.free_pages[k:], "owner": tuple(owner)}), pages


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
    return pool.model_copy(update={"free_pages": free, "owner": tuple(owner)})
