"""Observable state of an SWA composite allocator, the same shape for every implementation.

The lockstep harness never reads private fields: an implementation reports its
free lists and its ``full_to_swa_index_mapping`` through ``snapshot()``, and the
harness compares snapshots up to a renaming of pages (free-list order and page
choice are the implementation's business unless it declares
``Capability.EXACT_PAGE_ORDER``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from kvproof.reference.paged import trusted

__all__ = ["AllocatorSnapshot", "PoolSnapshot", "allocator_snapshot", "pool_snapshot"]

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class PoolSnapshot(BaseModel):
    """One pool: page size, number of usable pages, free pages in hand-out order."""

    model_config = _FROZEN

    page_size: int
    num_pages: int
    free_pages: tuple[int, ...]

    @property
    def available_size(self) -> int:
        return len(self.free_pages) * self.page_size


class AllocatorSnapshot(BaseModel):
    """Both pools and the full-to-SWA mapping (with its trailing -1 sentinel)."""

    model_config = _FROZEN

    full: PoolSnapshot
    swa: PoolSnapshot
    full_to_swa_index_mapping: tuple[int, ...]


def pool_snapshot(page_size: int, num_pages: int, free_pages: tuple[int, ...]) -> PoolSnapshot:
    """A :class:`PoolSnapshot` of values an implementation knows to be right (Python ints, a tuple of them), built
    without validation (``model_construct``'s object at a fraction of its price: the harness asks for a snapshot
    after every step)."""
    return trusted(PoolSnapshot, {"page_size": page_size, "num_pages": num_pages, "free_pages": free_pages},
                   {"page_size", "num_pages", "free_pages"})


def allocator_snapshot(full: PoolSnapshot, swa: PoolSnapshot, mapping: tuple[int, ...]) -> AllocatorSnapshot:
    """An :class:`AllocatorSnapshot` of trusted parts, without validation (see :func:`pool_snapshot`)."""
    return trusted(AllocatorSnapshot, {"full": full, "swa": swa, "full_to_swa_index_mapping": mapping},
                   {"full", "swa", "full_to_swa_index_mapping"})
