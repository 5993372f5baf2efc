"""State invariants of the SWA composite allocator (sglang_semantics.md §7: G1-G3, M1, M2, M5).

:func:`check_invariants` raises :class:`InvariantViolation` naming the first broken
invariant, with the values that break it. The reference calls nothing here on its
own: the lockstep harness checks the reference after every step (so a bug in the
reference cannot hide), and the tests check it on hand-built broken states.

"Live" slots are the full slots handed out and not released (ghost ``fill``). The
mapping is only constrained on live slots: released pages may keep stale entries by
design (``restore_state``, §2.11 R3), and allocations overwrite what they hand out.
G4 (atomic allocation), G5 (whole-page release), M3 (``free_swa``) and M4 (tail
shape) are transition properties: the Z3 models prove them and the lockstep harness
compares every transition against an implementation.

This runs after every lockstep step, so all rules are first decided at once
(``_all_hold``: counts, min / max and set sizes over whole tuples, and one pass over the
allocated pages); only a state that fails that test is checked rule by rule, in the
order above, which names the first broken rule. The fast test is sufficient, never
necessary: it returns ``True`` only for states every rule accepts.
"""

from __future__ import annotations

from kvproof.reference.errors import ensure
from kvproof.reference.paged import LEAKED, PagedPool
from kvproof.reference.swa_allocator import SWAAllocatorState, _live_mapping_holds, check_live_mapping

__all__ = ["check_invariants", "check_pool"]


def check_pool(pool: PagedPool, name: str) -> None:
    """G1-G3 for one pool: free pages are real, unique pages; free iff unowned."""
    if _pool_holds(pool):
        return
    free, n = pool.free_pages, pool.num_pages  # messages are built only for a broken rule: this runs every step
    free_set = set(free)
    # G1: free pages are 1..num_pages, page 0 never, no duplicates
    ensure(all(1 <= g <= n for g in free), "G1", lambda: f"{name} free list has pages outside 1..{n}: {free}")
    ensure(len(free_set) == len(free), "G1", lambda: f"{name} free list has a duplicate page: {free}")
    # G2: available never exceeds the pool (the only runtime over-free check upstream)
    ensure(pool.available_size <= pool.size, "G2",
           lambda: f"{name} available {pool.available_size} > size {pool.size}")
    # G3: owners and free pages partition 1..num_pages
    owned = {g for g, who in enumerate(pool.owner) if who is not None and g}
    ensure(owned.isdisjoint(free_set), "G3", lambda: f"{name} pages both free and owned: {sorted(owned & free_set)}")
    ensure(len(owned) + len(free) == n, "G3",
           lambda: f"{name} leaks pages: {sorted(set(range(1, n + 1)) - owned - free_set)}")
    ensure(pool.owner[0] is None, "G1", lambda: f"{name} reserved page 0 has an owner")


def _pool_holds(pool: PagedPool) -> bool:
    """All of :func:`check_pool` at once: distinct free pages in 1..n, unowned, and every other page 1..n owned."""
    free, n, owner = pool.free_pages, pool.num_pages, pool.owner
    k = len(free)
    # the Nones are page 0 and the free pages (so len(free) * P <= n * P)
    return (len(owner) == n + 1 > 0 and owner[0] is None and pool.page_size >= 0 and owner.count(None) == k + 1
            and (not free or (min(free) >= 1 and max(free) <= n and len(set(free)) == k
                              and [owner[g] for g in free].count(None) == k)))


def check_invariants(state: SWAAllocatorState) -> None:
    """Raise :class:`InvariantViolation` if any of G1-G3, M1, M2, M5 fails."""
    if _all_hold(state):
        return
    check_pool(state.full, "full")
    check_pool(state.swa, "swa")
    _check_fill_and_mapping(state)
    check_live_mapping(state)


def _all_hold(state: SWAAllocatorState) -> bool:
    """Every rule of :func:`check_invariants` at once (``True`` only if they all hold)."""
    cfg, full, fill = state.config, state.full, state.fill
    n = cfg.num_pages_full
    return (_pool_holds(full) and _pool_holds(state.swa) and _mapping_holds(state) and n == full.num_pages
            # ghost fill: 1..P live slots on each allocated page (_live_mapping_holds checks it), none on a free or a
            # leaked one
            and _live_mapping_holds(state)
            and fill[1:n + 1].count(0) == len(full.free_pages) + full.owner[1:].count(LEAKED))


def _check_fill_and_mapping(state: SWAAllocatorState) -> None:
    """The ghost ``fill`` (G3) and M1, rule by rule."""
    cfg, p, mapping = state.config, state.config.page_size, state.full_to_swa_index_mapping
    owner, fill = state.full.owner, state.fill
    # ghost fill: a free page has no live slot, an allocated one 1..P, a leaked one none
    bad_fill = [g for g in range(1, cfg.num_pages_full + 1)
                if not ((1 <= fill[g] <= p) if owner[g] not in (None, LEAKED) else fill[g] == 0)]
    ensure(not bad_fill, "G3", lambda: ", ".join(f"page {g} has fill {fill[g]}" for g in bad_fill))
    # M1: sentinel, reserved page unmapped, values are 0 or real SWA slots
    ensure(len(mapping) == cfg.mapping_len and mapping[-1] == -1, "M1", "mapping lost its -1 sentinel")
    ensure(not any(mapping[:p]), "M1", lambda: f"reserved page 0 is mapped: {mapping[:p]}")
    top = (cfg.num_pages_swa + 1) * p
    bad = [(f, m) for f, m in enumerate(mapping[:-1]) if m and not p <= m < top]
    ensure(not bad, "M1", lambda: f"mapping entries outside {{0}} or [{p}, {top}): {bad[:4]}")


def _mapping_holds(state: SWAAllocatorState) -> bool:
    """M1 at once: the sentinel, page 0 unmapped, every other entry 0 or in P..top-1."""
    cfg, p, mapping = state.config, state.config.page_size, state.full_to_swa_index_mapping
    if not (len(mapping) == cfg.mapping_len and mapping[-1] == -1 and not any(mapping[:p])):
        return False
    values = set(mapping[:-1])
    values.discard(0)
    return not values or (min(values) >= p and max(values) < (cfg.num_pages_swa + 1) * p)
