"""Observable state of an SWA composite allocator, the same shape for every implementation.

The lockstep harness never reads private fields: an implementation reports its
free lists and its ``full_to_swa_index_mapping`` through ``snapshot()``, and the
harness compares snapshots up to a renaming of pages (free-list order and page
choice are the implementation's business unless it declares
``Capability.EXACT_PAGE_ORDER``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["AllocatorSnapshot", "PoolSnapshot"]

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
