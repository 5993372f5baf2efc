"""Index memory: index tensors as views of storages at byte addresses (sglang_semantics.md §3.3, §3.6).

The loc-translation cache is keyed by an address (``x.data_ptr()`` or the storage's
base address) and a length, so the model of an index tensor must carry both: a
*storage* is ``numel`` int64 elements at byte address ``base``; a *view* is a window
``[offset, offset + numel)`` of one storage. Freeing a storage lets a later storage
take the same address with other contents -- what the CUDA caching allocator does,
and what makes a pointer-keyed cache stale (R2-a). Pure functions over a frozen
:class:`IndexMemory`; bad input raises ``InvalidOperation`` and changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict

from kvproof.reference.errors import require

__all__ = [
    "ELEMENT_BYTES",
    "IndexMemory",
    "IndexView",
    "Storage",
    "data_ptr",
    "free_storage",
    "make_view",
    "new_storage",
    "storage_ptr",
    "view_contents",
    "write_index",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

#: Index tensors are int64: one element is 8 bytes.
ELEMENT_BYTES = 8


class Storage(BaseModel):
    """One allocation of index memory: ``len(contents)`` int64 elements at byte address ``base``."""

    model_config = _FROZEN

    base: int
    contents: tuple[int, ...]
    alive: bool = True


class IndexView(BaseModel):
    """A tensor: ``numel`` elements of storage ``storage`` starting at element ``offset``."""

    model_config = _FROZEN

    storage: int
    offset: int
    numel: int


class IndexMemory(BaseModel):
    """Every storage ever allocated (freed ones kept, so their ids stay stable)."""

    model_config = _FROZEN

    storages: tuple[Storage, ...] = ()


def _live(memory: IndexMemory, op: str, sid: int) -> Storage:
    require(0 <= sid < len(memory.storages), op, "storage", f"no storage {sid}")
    storage = memory.storages[sid]
    require(storage.alive, op, "storage", f"storage {sid} was freed")
    return storage


def _replace(memory: IndexMemory, sid: int, storage: Storage) -> IndexMemory:
    storages = list(memory.storages)
    storages[sid] = storage
    return IndexMemory(storages=tuple(storages))


def new_storage(memory: IndexMemory, base: int, contents: Sequence[int]) -> tuple[IndexMemory, int]:
    """Allocate ``contents`` at ``base``; a freed storage's address may be reused, a live one's not."""
    op, n = "new_storage", len(contents)
    require(n >= 1, op, "contents", "a storage holds at least one element")
    require(base >= 0 and base % ELEMENT_BYTES == 0, op, "base", f"{base} is not an aligned address")
    end = base + n * ELEMENT_BYTES
    for sid, s in enumerate(memory.storages):
        clash = s.alive and base < s.base + len(s.contents) * ELEMENT_BYTES and s.base < end
        # two live storages never overlap (an allocator may reuse only freed addresses)
        require(not clash, op, "base", f"[{base}, {end}) overlaps live storage {sid} at {s.base}")
    storages = (*memory.storages, Storage(base=base, contents=tuple(int(x) for x in contents)))
    return IndexMemory(storages=storages), len(storages) - 1


def free_storage(memory: IndexMemory, storage: int) -> IndexMemory:
    """Free a storage; its address may be handed to a later ``new_storage``."""
    s = _live(memory, "free_storage", storage)
    return _replace(memory, storage, s.model_copy(update={"alive": False}))


def write_index(memory: IndexMemory, storage: int, offset: int, values: Sequence[int]) -> IndexMemory:
    """Rewrite elements in place (a scheduler buffer reused for the next batch)."""
    op = "write_index"
    s = _live(memory, op, storage)
    require(offset >= 0 and offset + len(values) <= len(s.contents), op, "offset",
            f"[{offset}, {offset + len(values)}) is outside storage {storage} of {len(s.contents)} elements")
    contents = s.contents[:offset] + tuple(int(v) for v in values) + s.contents[offset + len(values):]
    return _replace(memory, storage, s.model_copy(update={"contents": contents}))


def make_view(memory: IndexMemory, storage: int, offset: int, numel: int) -> IndexView:
    """``storage[offset:offset + numel]`` as a view (same storage, its own address)."""
    op = "make_view"
    s = _live(memory, op, storage)
    require(numel >= 1 and offset >= 0 and offset + numel <= len(s.contents), op, "numel",
            f"view [{offset}, {offset + numel}) does not fit storage {storage} of {len(s.contents)} elements")
    return IndexView(storage=storage, offset=offset, numel=numel)


def view_contents(memory: IndexMemory, view: IndexView) -> tuple[int, ...]:
    s = memory.storages[view.storage]
    return s.contents[view.offset:view.offset + view.numel]


def data_ptr(memory: IndexMemory, view: IndexView) -> int:
    """``x.data_ptr()``: the address of the view's first element."""
    return memory.storages[view.storage].base + view.offset * ELEMENT_BYTES


def storage_ptr(memory: IndexMemory, view: IndexView) -> int:
    """``x.untyped_storage().data_ptr()``: the address of the view's storage."""
    return memory.storages[view.storage].base
