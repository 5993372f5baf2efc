"""Compare an implementation's snapshot with the reference up to a renaming of pages.

Which free page an allocator hands out is its own choice (sglang_semantics.md §8
item 10: even SGLang's releases differ), so the harness keeps two partial
bijections, reference page -> implementation page, one per pool, over the pages
currently allocated:

* a full page is bound when an allocation returns its slots (:meth:`Renaming.bind_full`);
* an SWA page is bound the first time a live full slot is seen mapped into it;
* a binding is dropped when the reference releases the page, and the partner page
  must then be free in the implementation too.

Under this renaming the observable state must be equal: the number of free pages
per pool, which pages are allocated, the mapping ``M`` on every live slot (0 vs
non-zero, and to the corresponding SWA slot with the same in-page offset), and
the KV rows of live slots (compared in :mod:`kvproof.conformance.swa_allocator`).
With ``Capability.EXACT_PAGE_ORDER`` the renaming must be the identity and the free
lists equal element by element.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvproof.conformance.errors import Verdict
from kvproof.reference import swa_allocator as ref
from kvproof.reference.snapshot import AllocatorSnapshot

__all__ = ["Divergence", "Renaming"]


class Divergence(Verdict):
    """The implementation's observable state differs from the reference's (the machine turns it into a
    :class:`~kvproof.conformance.errors.LockstepFailure` with the trace); ``detail`` says what differs in plain
    values (``code``: one of the comparison's rules, ``pool``: where), the evidence a finding is matched by."""

    def __init__(self, what: str, **detail: object) -> None:
        super().__init__(what)
        self.detail = detail


def _diverge(what: str, code: str, **detail: object) -> None:
    raise Divergence(what, code=code, **detail)


@dataclass
class _PageMap:
    """A partial bijection between reference and implementation pages of one pool."""

    pool: str
    exact: bool
    forward: dict[int, int] = field(default_factory=dict)
    backward: dict[int, int] = field(default_factory=dict)
    changes: int = 0  # bindings made and dropped so far (what Renaming.compare's memo keys on)

    def bind(self, ref_page: int, impl_page: int, why: str) -> None:
        if self.exact and ref_page != impl_page:
            _diverge(f"{why}: {self.pool} page {ref_page} in the reference is page {impl_page} in the "
                     "implementation, but it declares EXACT_PAGE_ORDER", "page_order", pool=self.pool)
        known = self.forward.get(ref_page)
        if known is not None:
            if known != impl_page:
                _diverge(f"{why}: {self.pool} page {ref_page} corresponds to implementation page {known}, "
                         f"but now to {impl_page}", "rebound", pool=self.pool)
            return
        holder = self.backward.get(impl_page)
        if holder is not None:
            _diverge(f"{why}: implementation {self.pool} page {impl_page} is handed out again while it still "
                     f"holds reference page {holder} (aliasing: two owners share one page)", "aliasing", pool=self.pool)
        self.forward[ref_page] = impl_page
        self.backward[impl_page] = ref_page
        self.changes += 1

    def forget(self, still_allocated: set[int]) -> None:
        """Drop the bindings of pages the reference released (no check: see :meth:`Renaming.released`)."""
        for ref_page in [g for g in self.forward if g not in still_allocated]:
            del self.backward[self.forward.pop(ref_page)]
            self.changes += 1

    def prune(self, still_allocated: set[int], impl_free: set[int]) -> None:
        """Forget pages the reference released; their partners must be free in the implementation."""
        for ref_page in [g for g in self.forward if g not in still_allocated]:
            impl_page = self.forward.pop(ref_page)
            del self.backward[impl_page]
            self.changes += 1
            if impl_page not in impl_free:
                _diverge(f"{self.pool} page {ref_page} was released in the reference, but its implementation "
                         f"page {impl_page} is still allocated (leak or missed free)", "not_released", pool=self.pool)


@dataclass
class Renaming:
    """Both page bijections of one lockstep run."""

    page_size: int
    exact: bool
    full: _PageMap = field(init=False)
    swa: _PageMap = field(init=False)
    #: the last comparison that passed: (the parts of the reference state it reads, the snapshot, both maps' changes)
    _passed: tuple[tuple[object, ...], AllocatorSnapshot, tuple[int, int]] | None = field(
        init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.full = _PageMap("full", self.exact)
        self.swa = _PageMap("swa", self.exact)
        self._passed = None

    def reset(self) -> None:
        self.__post_init__()

    def impl_slot(self, ref_slot: int) -> int:
        """The implementation's full slot for a live reference full slot."""
        p = self.page_size
        return self.full.forward[ref_slot // p] * p + ref_slot % p

    def bind_full(self, op: str, ref_slots: Sequence[int], impl_slots: Sequence[int]) -> None:
        """Bind the pages of an allocation's result, slot by slot."""
        p = self.page_size
        if len(ref_slots) != len(impl_slots):
            _diverge(f"{op} returned {len(impl_slots)} slots, the reference {len(ref_slots)}", "result_length")
        for r, i in zip(ref_slots, impl_slots, strict=True):
            if r % p != i % p:
                _diverge(f"{op}: a token at in-page offset {r % p} in the reference got implementation slot {i} "
                         f"(offset {i % p})", "result_offset")
            self.bind_full_page(op, r // p, i // p)

    def bind_full_page(self, why: str, ref_page: int, impl_page: int) -> None:
        if impl_page == 0:
            _diverge(f"{why}: the implementation handed out a slot of the reserved page 0", "reserved_page_handed_out",
                     pool="full")
        self.full.bind(ref_page, impl_page, why)

    def released(self, state: ref.SWAAllocatorState) -> None:
        """Forget the bindings of the pages ``state`` (the reference right after a release, in the middle of a
        step) has free. For a step that releases pages and then allocates again: the reference may hand a page
        it just took back to the next owner, an implementation another one (a binding lasts as long as its
        owner, not a step). Whether the partners were released too is checked at the end of the step, as
        always: the free page counts and the pages still bound must agree then."""
        self.full.forget(_allocated(state.full.owner))
        self.swa.forget(_allocated(state.swa.owner))

    def compare(self, state: ref.SWAAllocatorState, snap: AllocatorSnapshot) -> None:
        """Raise :class:`Divergence` unless ``snap`` equals ``state`` under the renaming.

        The outcome depends on the pools, the fills and the mapping of the reference state (frozen values), the
        snapshot and the bindings alone, and a comparison that passes leaves the bindings such that repeating it
        changes nothing (every page it binds is bound). So when all three are what the last comparison that passed
        saw (the same objects: a step whose operation failed, or that wrote only KV; the snapshot equal; no binding
        made or dropped since), it passes again without being repeated."""
        passed, parts = self._passed, (state.full, state.swa, state.fill, state.full_to_swa_index_mapping)
        if (passed is not None and passed[2] == (self.full.changes, self.swa.changes)
                and all(a is b for a, b in zip(passed[0], parts, strict=True))
                and (passed[1] is snap or passed[1] == snap)):
            return
        self._passed = None
        self._compare_pools(state, snap)
        held_full, held_swa = _held_back(state)
        self.full.prune(_allocated(state.full.owner) | held_full, set(snap.full.free_pages))
        self.swa.prune(_allocated(state.swa.owner) | held_swa, set(snap.swa.free_pages))
        self._compare_mapping(state, snap)
        impl_full_free, impl_swa_free = set(snap.full.free_pages), set(snap.swa.free_pages)
        for pool, pages, free in (("full", self.full, impl_full_free), ("swa", self.swa, impl_swa_free)):
            taken = sorted(set(pages.backward) & free)
            if taken:
                _diverge(f"implementation {pool} pages {taken} hold live data but are in its free list",
                         "live_page_free", pool=pool)
        self._passed = (parts, snap, (self.full.changes, self.swa.changes))

    def _compare_pools(self, state: ref.SWAAllocatorState, snap: AllocatorSnapshot) -> None:
        for name, mine, theirs in (("full", state.full, snap.full), ("swa", state.swa, snap.swa)):
            if (theirs.page_size, theirs.num_pages) != (mine.page_size, mine.num_pages):
                _diverge(f"{name} pool geometry: implementation P={theirs.page_size} pages={theirs.num_pages}, "
                         f"reference P={mine.page_size} pages={mine.num_pages}", "geometry", pool=name)
            if len(theirs.free_pages) != len(mine.free_pages):
                _diverge(f"{name} pool: implementation has {len(theirs.free_pages)} free pages "
                         f"{list(theirs.free_pages)}, reference {len(mine.free_pages)} {list(mine.free_pages)}",
                         "free_count", pool=name, implementation=len(theirs.free_pages), reference=len(mine.free_pages),
                         reserved_page_free=0 in theirs.free_pages)
            if len(set(theirs.free_pages)) != len(theirs.free_pages):
                _diverge(f"{name} pool: implementation free list has a duplicate page {list(theirs.free_pages)}",
                         "duplicate_free", pool=name, reserved_page_free=0 in theirs.free_pages)
            if 0 in theirs.free_pages:
                _diverge(f"{name} pool: implementation free list contains the reserved page 0", "reserved_page_free",
                         pool=name, reserved_page_free=True)
            if self.exact and theirs.free_pages != mine.free_pages:
                _diverge(f"{name} pool order: implementation free list {list(theirs.free_pages)}, reference "
                         f"{list(mine.free_pages)} (EXACT_PAGE_ORDER declared)", "free_order", pool=name)
        if snap.full_to_swa_index_mapping[-1:] != (-1,):
            _diverge("implementation mapping lost its trailing -1 sentinel", "sentinel")

    def _compare_mapping(self, state: ref.SWAAllocatorState, snap: AllocatorSnapshot) -> None:
        p, mine, theirs = self.page_size, state.full_to_swa_index_mapping, snap.full_to_swa_index_mapping
        forward, fill, bound = self.full.forward, state.fill, None
        for g in _allocated(state.full.owner):
            shift = (forward[g] - g) * p  # implementation slot - reference slot, on this page (impl_slot)
            for r in range(g * p, g * p + fill[g]):
                i = r + shift
                m, mi = mine[r], theirs[i]
                if m > 0 and mi > 0 and m % p == mi % p and (m // p, mi // p) == bound:
                    continue  # the slot's SWA page pair is the one bound just before (the common case)
                if m == 0 and mi != 0:
                    _diverge(f"M[{r}] is 0 in the reference (no SWA slot), but the implementation maps its slot "
                             f"{i} to SWA slot {mi} (stale mapping: free_swa would release that page)", "stale_mapping")
                if m > 0 and mi <= 0:
                    _diverge(f"M[{r}] = {m} in the reference, but the implementation maps its slot {i} to {mi}",
                             "unmapped")
                if m > 0:
                    if m % p != mi % p:
                        _diverge(f"M[{r}] = {m} (offset {m % p}); implementation M[{i}] = {mi} (offset {mi % p})",
                                 "mapping_offset")
                    self.swa.bind(m // p, mi // p, f"mapping of full slot {r}")
                    bound = (m // p, mi // p)


def _held_back(state: ref.SWAAllocatorState) -> tuple[set[int], set[int]]:
    """The full and SWA pages an open free group holds back (owned by nobody, in no free list, §1.5a): their
    bindings stay until the group gives them back."""
    group = state.group
    if group is None:
        return set(), set()
    p = state.config.page_size
    full = set(group.full_ids) | ({g for g in group.full_set} if p > 1 else {x // p for x in group.full_set})
    return full, set(group.swa_ids) | set(group.swa_set)


def _allocated(owner: tuple[int | None, ...]) -> set[int]:
    return {g for g, who in enumerate(owner) if who is not None}
