"""``PagedTokenToKVPoolAllocator`` over torch tensors, any page size P >= 1 (sglang_semantics.md §1.2-§1.4).

One pool of ``num_pages = size // P`` pages; slot ``g * P + o`` is offset ``o`` of page ``g``.
P == 1 is SGLang's ``TokenToKVPoolAllocator`` (a page is a slot).

State, all on ``device``:

* the free list, ``free_pages`` (int64 page ids in hand-out order; page 0 is reserved and
  never free, §1.4). It is the window ``[head, tail)`` of a preallocated buffer, so that
  taking pages and releasing them cost O(pages moved), not O(pool) as SGLang's
  ``torch.cat`` does;
* ``fill``: int64 per page, how many slots of the page are live (handed out and not
  released). Live slots are always a prefix of the page, so ``fill == 0`` iff the page is
  free (or page 0). One extra zero entry (page ``num_pages + 1``) absorbs clamped
  out-of-range slots. SGLang has no such field; it makes double frees and
  never-handed-out slots detectable with one vectorised comparison.

Order policy of SGLang 0.5.23 (``need_sort=False``): allocation takes pages from the
front (``head`` moves up); at P > 1 a release PREPENDS the sorted set of released pages
(written just below ``head``: LIFO reuse, ``_release_page_ids(torch.unique(...))``); at
P == 1 it APPENDS the slots in the given order (written at ``tail``: FIFO). Argument
checks with op names are the caller's job (the SWA composite); :meth:`check_live`
serves them, since this class owns ``fill``.

The allocation paths read the pages they take as a view of the buffer
(``take_pages(copy=False)``), used before any release can write there; at P == 1, where
the slots are the pages, the slots handed to the caller are a copy. Wholly new pages
get their ``fill`` from host counts (:meth:`~PagedTokenToKVPoolAllocator.mark_pages`),
other slots by a scatter-max.

Backups hold the buffer and the window (O(1)) plus a copy of ``fill``. Only releases
write into the buffer, and they write outside every window taken since (below the
head or past the tail, or into a fresh buffer), so a restore is exact as long as no
release happened since the backup; a ``generation`` counter rejects any other restore.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kvproof.gpu_runtime._geometry import (
    Plan,
    SinglePlan,
    count_new_pages,
    decode_plan,
    extend_plan,
    page_offsets,
    page_slots,
)
from kvproof.reference.errors import ConfigError, OutOfMemory, ensure, require

__all__ = ["PagedBackup", "PagedTokenToKVPoolAllocator", "as_index", "default_device", "resolve_device"]

Tensor = torch.Tensor
_I64 = torch.int64


class PagedBackup(NamedTuple):
    """What ``backup_state`` captures: the free-list window and a copy of ``fill``."""

    buffer: Tensor
    head: int
    tail: int
    fill: Tensor
    generation: int


def default_device() -> torch.device:
    """``cuda`` when a GPU is present, else ``cpu``."""
    return resolve_device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The construction-time device, with an explicit CUDA index (tensors report ``cuda:0``, not ``cuda``)."""
    if device is None:
        return default_device()
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def as_index(x: Tensor | object, device: torch.device) -> Tensor:
    """A 1-D int64 tensor on ``device`` (the argument itself when it already is one)."""
    if isinstance(x, Tensor) and x.dtype == _I64 and x.dim() == 1 and x.device == device:
        return x
    return torch.as_tensor(x, dtype=_I64, device=device).reshape(-1)


def _check_geometry(size: int, page_size: int) -> None:
    """A pool is a whole number of pages: ``page_size >= 1``, ``size >= 0`` a multiple of it (else ``ConfigError``)."""
    model = "PagedTokenToKVPoolAllocator"
    if page_size < 1:
        raise ConfigError(model, "page_size", f"must be >= 1, got {page_size}")
    if size < 0 or size % page_size:
        raise ConfigError(model, "size", f"must be a non-negative multiple of page_size ({page_size}), got {size}")


class PagedTokenToKVPoolAllocator:
    """Free-page list plus per-page live-slot counts for one pool (``name`` is ``full`` or ``swa``)."""

    def __init__(self, size: int, page_size: int, device: torch.device | str | None = None, name: str = "pool") -> None:
        _check_geometry(size, page_size)
        self.size, self.page_size, self.name = size, page_size, name
        self.num_pages = size // page_size
        self.device = resolve_device(device)
        self.end_slot = (self.num_pages + 1) * page_size  # real slots live in [P, end_slot)
        self._offsets = page_offsets(page_size, self.device)
        self.generation = 0  # bumped by every release and clear: a backup older than that is stale
        self.clear()

    # ------------------------------------------------------------ free list window

    @property
    def free_pages(self) -> Tensor:
        """Free pages in hand-out order (a view: read it, do not write it)."""
        return self._buf[self._head:self._tail]

    @free_pages.setter
    def free_pages(self, pages: Tensor) -> None:
        """Replace the free list (tests and mutants); lands in a fresh buffer with room to grow."""
        n, room = pages.numel(), max(self.num_pages, 1)
        self._buf = torch.empty(n + 2 * room, dtype=_I64, device=self.device)
        self._head, self._tail = room, room + n  # room below (prepends) and above (appends)
        self._buf[self._head:self._tail] = pages.to(self.device)

    def num_free_pages(self) -> int:
        return self._tail - self._head

    def available_size(self) -> int:
        """Free tokens: ``len(free_pages) * P`` (§1.3)."""
        return (self._tail - self._head) * self.page_size

    # ------------------------------------------------------------ state

    def clear(self) -> None:
        """All pages ``1..num_pages`` free in ascending order, nothing live."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=_I64, device=self.device)
        self.fill = torch.zeros(self.num_pages + 2, dtype=_I64, device=self.device)
        self.generation += 1

    def backup_state(self) -> PagedBackup:
        return PagedBackup(self._buf, self._head, self._tail, self.fill.clone(), self.generation)

    def restore_state(self, state: PagedBackup) -> None:
        """Put the free list and fills back (only allocations may have happened since the backup).

        A page free NOW stays unallocated even where the backup had it live, as the
        reference's ``_roll_back`` keeps current owners; with only allocations since
        the backup that never happens.
        """
        # a release since the backup may have written inside the backed-up window
        require(state.generation == self.generation, "restore_state", "state", "pages were released since backup_state")
        self._buf, self._head, self._tail = state.buffer, state.head, state.tail
        self.fill.copy_(torch.where(self.fill > 0, state.fill, 0))  # in place: the tensor object stays
        self.generation += 1  # the pages given back may be overwritten: older backups are stale

    # ------------------------------------------------------------ allocation

    def take_pages(self, k: int, *, copy: bool = True) -> Tensor:
        """Remove and return the first ``k`` free pages (the caller checked capacity).

        ``copy=False`` returns a view of the buffer instead, for a caller that is done
        with it before the next release (which may write there).
        """
        if k > self._tail - self._head:
            raise OutOfMemory("take_pages", self.name, k, self._tail - self._head)
        pages = self._buf[self._head:self._head + k]
        self._head += k
        return pages.clone() if copy else pages

    def page_slots(self, pages: Tensor) -> Tensor:
        """All slots of ``pages``, page by page."""
        return page_slots(pages, self.page_size)

    def mark_live(self, slots: Tensor) -> None:
        """Raise ``fill`` to cover newly handed-out ``slots`` (they extend a page's live prefix)."""
        p = self.page_size
        if p == 1:
            self.fill.index_fill_(0, slots, 1)
        else:
            self.fill.scatter_reduce_(0, torch.div(slots, p, rounding_mode="floor"), slots.remainder(p).add_(1),
                                      reduce="amax")

    def mark_pages(self, pages: Tensor, used: int) -> None:
        """:meth:`mark_live` for the first ``used`` slots of new ``pages``, page by page (fills known on the host)."""
        p, k = self.page_size, pages.numel()
        touched = min(-(-used // p), k)
        if not touched:
            return
        if touched < k:  # pages taken beyond the slots handed out stay free-looking (only a broken plan does that)
            pages = pages[:touched]
        self.fill.index_fill_(0, pages, p)
        last = used - (touched - 1) * p
        if last < p:  # the last page is partly handed out
            self.fill.index_fill_(0, pages[touched - 1:], last)

    def alloc_planned(self, plan: Plan, last_loc: Tensor) -> Tensor:
        """Take ``plan.num_new_pages`` pages and hand out the plan's slots (continuing ``last_loc``)."""
        return self.alloc_planned_pages(plan, last_loc)[0]

    def alloc_planned_pages(self, plan: Plan, last_loc: Tensor, *, keep: bool = True) -> tuple[Tensor, Tensor]:
        """:meth:`alloc_planned`, also returning the pages it took: ``(slots, pages)``.

        ``pages`` is a view of the free-list buffer (use it before the next release). At
        P == 1 the slots may be the pages themselves, so they are a copy unless the caller
        is done with them before the next release too (``keep=False``).
        """
        pages = self.take_pages(plan.num_new_pages, copy=keep and self.page_size == 1)
        out = plan.slots(pages, last_loc)
        if isinstance(plan, SinglePlan) and plan.n1 == 0:  # new pages only: their fills are known on the host
            self.mark_pages(pages, plan.rest)
        else:
            self.mark_live(out)
        return out, pages

    def alloc(self, need_size: int) -> Tensor:
        """Bulk, page-aligned allocation: whole pages from the front, slots in page order."""
        return self.alloc_pages(need_size)[0]

    def alloc_pages(self, need_size: int, *, keep: bool = True) -> tuple[Tensor, Tensor]:
        """:meth:`alloc`, also returning the pages it took: ``(slots, pages)`` (``pages`` and ``keep`` as in
        :meth:`alloc_planned_pages`)."""
        pages = self.take_pages(need_size // self.page_size, copy=keep and self.page_size == 1)
        out = self.page_slots(pages)
        self.mark_pages(pages, out.numel())
        return out, pages

    def alloc_extend(self, prefix_lens: Tensor, prefix_lens_cpu: Tensor, seq_lens: Tensor, seq_lens_cpu: Tensor,
                     last_loc: Tensor, extend_num_tokens: int, num_new_pages: int | None = None) -> Tensor:
        """SGLang-shaped paged extend (§1.3); arguments are trusted (validated by the caller)."""
        k = count_new_pages(prefix_lens_cpu, seq_lens_cpu, self.page_size) if num_new_pages is None else num_new_pages
        plan = extend_plan(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, extend_num_tokens, k, self.page_size)
        return self.alloc_planned(plan, last_loc)

    def alloc_decode(self, seq_lens: Tensor, seq_lens_cpu: Tensor, last_loc: Tensor) -> Tensor:
        """SGLang-shaped decode: one slot per request (§1.3)."""
        return self.alloc_planned(decode_plan(seq_lens, seq_lens_cpu, self.page_size), last_loc)

    # ------------------------------------------------------------ release

    def release_pages(self, pages: Tensor) -> None:
        """Give ``pages`` back in SGLang 0.5.23's order; they are no longer live.

        ``pages`` is the sorted set at P > 1 (prepended) and the slots in the given order
        at P == 1 (appended), as :meth:`free` computes them.
        """
        m = pages.numel()
        if m == 0:
            return
        self.fill.index_fill_(0, pages, 0)
        self.generation += 1
        if self.page_size > 1 and m <= self._head:  # LIFO: just below the head
            self._buf[self._head - m:self._head].copy_(pages)
            self._head -= m
        elif self.page_size == 1 and self._tail + m <= self._buf.numel():  # FIFO: at the tail
            self._buf[self._tail:self._tail + m].copy_(pages)
            self._tail += m
        else:  # out of room (after many appends, or an over-full list): move to a fresh buffer
            both = (pages, self.free_pages) if self.page_size > 1 else (self.free_pages, pages)
            self.free_pages = torch.cat(both)

    def free(self, free_index: Tensor) -> None:
        """Release every page touched by ``free_index`` as a whole page (G5)."""
        self.release_pages(torch.unique(free_index // self.page_size) if self.page_size > 1 else free_index)

    def live_slots_of(self, pages: Tensor) -> tuple[Tensor, Tensor]:
        """All slots of ``pages`` and whether each is live (offset < fill): ``(slots, live)``."""
        fill = self.fill.index_select(0, pages)
        if self.page_size == 1:
            return pages, fill > 0
        return self.page_slots(pages), (self._offsets < fill.unsqueeze(1)).view(-1)

    # ------------------------------------------------------------ validation helpers

    def live_mask(self, slots: Tensor) -> Tensor:
        """True where a slot (1-D) is handed out and not released (in range, not page 0, offset < fill)."""
        # slots below 0 clamp into page 0, slots past the pool into page num_pages + 1: both never live
        safe, p = slots.clamp(0, self.end_slot), self.page_size
        if p == 1:
            return self.fill.index_select(0, safe) > 0
        return safe.remainder(p) < self.fill.index_select(0, torch.div(safe, p, rounding_mode="floor"))

    def all_live(self, slots: Tensor) -> bool:
        """Whether every slot (1-D) is live: :meth:`live_mask` reduced, one sync."""
        safe, p = slots.clamp(0, self.end_slot), self.page_size
        if p == 1:
            return int(self.fill.index_select(0, safe).min()) > 0
        spare = self.fill.index_select(0, torch.div(safe, p, rounding_mode="floor")) - safe.remainder(p)
        return int(spare.min()) > 0  # offset < fill everywhere

    def check_live(self, op: str, argument: str, slots: Tensor, *, duplicates_ok: bool,
                   freed_means: str = "is not allocated") -> Tensor | None:
        """Raise ``InvalidOperation(op, argument)`` unless every slot is live (and, unless allowed, distinct).

        Returns the sorted distinct slots when it computed them (``duplicates_ok=False``).
        """
        n = slots.numel()
        if n == 0:
            return slots if not duplicates_ok else None
        require(self.all_live(slots), op, argument, lambda: self._explain_dead(slots, freed_means))
        if duplicates_ok:
            return None
        if n == 1:
            return slots
        distinct: Tensor = torch.unique(slots)
        require(distinct.numel() == n, op, argument, lambda: _explain_repeat(slots))
        return distinct

    def _explain_dead(self, slots: Tensor, freed_means: str) -> str:
        """Message for the first slot that is not live (slow path, errors only)."""
        f, p = int(slots[~self.live_mask(slots)][0]), self.page_size
        if not 0 <= f < self.end_slot:
            return f"slot {f} is outside the {self.name} pool [0, {self.end_slot})"
        if f < p:
            return f"slot {f} lies in the reserved page 0"
        fill = int(self.fill[f // p])
        if fill == 0:
            return f"slot {f} is in page {f // p}, which {freed_means}"
        return f"slot {f} was never handed out (page {f // p} has {fill} live slots)"

    def check_invariants(self) -> None:
        """G1-G3 for this pool: free pages are distinct real pages, free iff fill == 0, fill <= P."""
        free, fill, n = self.free_pages, self.fill, self.num_pages
        ensure(bool(((free >= 1) & (free <= n)).all()), "G1", f"{self.name} free list has pages outside 1..{n}")
        ensure(torch.unique(free).numel() == free.numel(), "G1", f"{self.name} free list has a duplicate page")
        ensure(self.available_size() <= self.size, "G2",
               f"{self.name} available {self.available_size()} > size {self.size}")
        ensure(int(fill[0]) == 0 and int(fill[-1]) == 0, "G1", f"{self.name} reserved page 0 has live slots")
        ensure(not bool(fill[free].any()), "G3", f"{self.name} pages both free and live")
        owned = torch.ones(n + 2, dtype=torch.bool, device=self.device)
        owned[0] = owned[-1] = False
        owned[free] = False
        ok = ((fill >= 1) & (fill <= self.page_size)) | ~owned
        ensure(bool(ok.all()), "G3", f"{self.name} pages neither free nor live (leak) or over-full")


def _explain_repeat(slots: Tensor) -> str:
    """Message naming the first slot (in argument order) that repeats an earlier one (slow path, errors only)."""
    seen: set[int] = set()
    for f in slots.tolist():
        if f in seen:
            return f"slot {f} appears twice"
        seen.add(f)
    return "a slot appears twice"
