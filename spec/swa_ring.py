"""The per-request SWA ring of SGLang 0.5.23's ``SWATokenToKVPoolAllocator``: a transition system and its obligations.

Semantics: sglang_semantics.md §1.5 (the composite allocator, whose paged SWA side the ring replaces), written up in
docs/sglang-findings.md "The per-request SWA ring" (invariants SR1-SR3) after 0.5.23's ``allocator/swa.py``
(``_swa_req_ring``), ``base_swa_memory_pool.py`` (``swa_req_ring_size``) and ``deepseek_v4_memory_pool.py`` (the only
pool that sets it).

In ring mode every request slot of ``ReqToTokenPool`` owns a ring of ``C = ceil(ring / P) * P`` SWA tokens addressed
by the slot, so the allocator's paged SWA pool and its mapping are never used:

* SR1: ``available_size`` is the full pool's alone (the ring never limits token growth);
* SR2: ``swa_available_size`` is free request slots x ``C``: only ``alloc_req_slots`` / ``free_req_slots``
  (``ReqToTokenPool.alloc_rows`` / ``free_rows``) change it, and it stays within ``[0, slots x C]``;
* SR3: no operation takes or gives back a paged SWA page or writes the mapping; frees never credit SWA capacity.

The model counts, symbolically (any page size, ring, pool and slot count): free full pages ``F`` of ``NF``, free paged
SWA pages ``S`` of ``NS``, free request slots ``R`` of ``NR``, mapped entries ``mapped``. One transition per reference
operation the ring changes or reads (``alloc*`` take ``k`` full pages, the full-side releases give ``k`` back,
``free_swa`` / ``free_swa_segment`` are no-ops, ``clear`` leaves the request slots), named like the reference's.

Obligations (``swa_allocator.<op or ring>.<claim>``), each with a broken twin Z3 refutes:

* ``ring.cost_rounds_to_pages``: ``C`` is a whole number of pages covering the ring, less than a page more (twin: the
  floored cost misses ring tokens);
* ``ring.initiation`` / ``ring.consecution``: SR3 and the bounds hold initially and after every op (twins: the free
  slots taken from the paged ``size_swa``, which the ring bypasses; ``alloc.ring_takes_paged_swa``: 0.5.23's
  ``alloc``, which has no ring branch, takes paged SWA pages and maps them: finding F8);
* ``alloc_extend.ring_fits_iff_full``: an extend of ``k`` pages succeeds iff ``k * P <= available_size()`` (SR1; twin:
  ``available_size`` as ``min(full, swa)``, the paged formula);
* ``alloc_extend_swa_tail.ring_needs_full_only``: the tail allocation is refused only for want of full pages (twin:
  ``new_pages_available`` without its ring branch also needs the paged SWA pool);
* ``free.ring_never_credits_swa`` / ``free_swa.ring_releases_nothing``: releases leave ``swa_available_size`` and the
  paged pool alone (SR3; twins: ``_free_swa_pages`` without its ring return, ``free_swa`` releasing as if paged);
* ``alloc_req_slots.ring_capacity`` / ``free_req_slots.ring_capacity``: SR2's conservation ``swa_available_size +
  held x C == NR x C`` and bounds (twins: no free-slot check, and 0.5.23's unchecked ``free_rows`` of a slot nobody
  holds, which over-credits the ring capacity).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Obligation, as_int
from kvproof.spec._ts import Check, Clause, Step, TransitionSystem

__all__ = ["ALLOCATIONS", "FAMILY", "FULL_RELEASES", "NOOPS", "OBLIGATIONS", "OPS", "SYSTEM", "Action", "State",
           "available_size", "ring_cost", "swa_available_size", "system"]

FAMILY = "swa_ring"
ALLOCATIONS = ("alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail")
FULL_RELEASES = ("free", "free_full", "free_segment", "free_full_segment")
NOOPS = ("free_swa", "free_swa_segment")


@dataclass(frozen=True)
class State:
    """Counts of one ring-mode allocator; the configuration (``P``, ``ring``, ``NF``, ``NS``, ``NR``) is the same
    symbol in every state."""

    P: z3.ArithRef
    ring: z3.ArithRef
    NF: z3.ArithRef
    NS: z3.ArithRef
    NR: z3.ArithRef
    F: z3.ArithRef
    S: z3.ArithRef
    R: z3.ArithRef
    mapped: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> State:
        return State(z3.Int("P"), z3.Int("ring"), z3.Int("NF"), z3.Int("NS"), z3.Int("NR"), z3.Int(f"F@{tag}"),
                     z3.Int(f"S@{tag}"), z3.Int(f"R@{tag}"), z3.Int(f"mapped@{tag}"))


@dataclass(frozen=True)
class Action:
    """``k``: full pages an allocation takes or a release gives back; ``n``: request slots taken or given back."""

    k: z3.ArithRef
    n: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> Action:
        return Action(z3.Int(f"k@{tag}"), z3.Int(f"n@{tag}"))


def ring_cost(s: State) -> z3.ArithRef:
    """``ceil(ring / P) * P`` (0.5.23: ``(ring_size + page_size - 1) // page_size * page_size``)."""
    return ((s.ring + s.P - 1) / s.P) * s.P


def available_size(s: State) -> z3.ArithRef:
    """SR1: the full pool's free tokens."""
    return s.F * s.P


def swa_available_size(s: State) -> z3.ArithRef:
    """SR2: free request slots x ring cost."""
    return s.R * ring_cost(s)


def _config(s: State) -> list[z3.BoolRef]:
    return [s.P >= 1, s.ring >= 1, s.NF >= 0, s.NS >= 0, s.NR >= 1]


def init(s: State) -> z3.BoolRef:
    return z3.And(*_config(s), s.F == s.NF, s.S == s.NS, s.R == s.NR, s.mapped == 0)


def _init_from_paged_size(s: State) -> z3.BoolRef:
    """A twin's construction: as many ring slots as the paged SWA pool has pages (``size_swa`` not bypassed)."""
    return z3.And(*_config(s), s.F == s.NF, s.S == s.NS, s.R == s.NS, s.mapped == 0)


def invariant(s: State) -> Sequence[Clause]:
    return (("config: P, ring, slots >= 1", z3.And(*_config(s))),
            ("0 <= F <= NF", z3.And(s.F >= 0, s.F <= s.NF)),
            ("SR3: the paged SWA pool is untouched (S == NS)", s.S == s.NS),
            ("SR3: the mapping is unwritten (mapped == 0)", s.mapped == 0),
            ("0 <= R <= NR", z3.And(s.R >= 0, s.R <= s.NR)))


def _frame(s: State, t: State, *written: str) -> list[z3.BoolRef]:
    return _ts.unchanged_except(s, t, *written)


def _allocate(s: State, a: Action, t: State) -> z3.BoolRef:
    """Full pages only; the capacity check is the full pool's (SR1, SR3)."""
    return z3.And(a.k >= 0, a.k <= s.F, s.F - a.k == t.F, *_frame(s, t, "F"))


def _release_full(s: State, a: Action, t: State) -> z3.BoolRef:
    """The full side only (the ring has no paged SWA peer to release)."""
    return z3.And(a.k >= 0, a.k <= s.NF - s.F, s.F + a.k == t.F, *_frame(s, t, "F"))


def _noop(s: State, a: Action, t: State) -> z3.BoolRef:
    return z3.And(*_frame(s, t))


def _clear(s: State, a: Action, t: State) -> z3.BoolRef:
    """Both pools and the mapping back to initial; the request slots are ReqToTokenPool's, left alone."""
    return z3.And(t.F == s.NF, t.S == s.NS, t.mapped == 0, *_frame(s, t, "F", "S", "mapped"))


def _alloc_req_slots(s: State, a: Action, t: State) -> z3.BoolRef:
    return z3.And(a.n >= 0, a.n <= s.R, s.R - a.n == t.R, *_frame(s, t, "R"))


def _free_req_slots(s: State, a: Action, t: State) -> z3.BoolRef:
    """Only held slots go back (kvproof checks; upstream's ``free_rows`` does not: the twin)."""
    return z3.And(a.n >= 0, a.n <= s.NR - s.R, s.R + a.n == t.R, *_frame(s, t, "R"))


def _upstream_alloc(s: State, a: Action, t: State) -> z3.BoolRef:
    """0.5.23's ``alloc`` (no ring branch): ``k`` full and ``k`` paged SWA pages, ``k * P`` mapping entries."""
    return z3.And(a.k >= 0, a.k <= s.F, a.k <= s.S, s.F - a.k == t.F, s.S - a.k == t.S,
                  t.mapped == s.mapped + a.k * s.P, *_frame(s, t, "F", "S", "mapped"))


def _cells(m: z3.ModelRef, s: State) -> tuple[str, ...]:
    p, ring = as_int(m, s.P), as_int(m, s.ring)
    cost = -(-ring // p) * p if p >= 1 else 0
    return (f"P={p} ring={ring} C={cost}", f"{as_int(m, s.F)}/{as_int(m, s.NF)}", f"{as_int(m, s.S)}/{as_int(m, s.NS)}",
            f"{as_int(m, s.R)}/{as_int(m, s.NR)}", str(as_int(m, s.mapped)),
            f"{as_int(m, s.F) * p} / {as_int(m, s.R) * cost}")


def _describe(m: z3.ModelRef, step: Step[State, Action]) -> str:
    op, a = step.op_name(m), step.action
    if op in ("alloc_req_slots", "free_req_slots"):
        return f"{op}({as_int(m, a.n)} slot(s))"
    if op in NOOPS or op == "clear":
        return f"{op}()"
    return f"{op}({as_int(m, a.k)} page(s))"


def system(**replaced: _ts.Relation[State, Action]) -> TransitionSystem[State, Action]:
    """The ring's transition system (``replaced``: a twin's broken relations)."""
    transitions: dict[str, _ts.Relation[State, Action]] = {
        **dict.fromkeys(ALLOCATIONS, _allocate), **dict.fromkeys(FULL_RELEASES, _release_full),
        **dict.fromkeys(NOOPS, _noop), "clear": _clear, "alloc_req_slots": _alloc_req_slots,
        "free_req_slots": _free_req_slots}
    return TransitionSystem(
        component="swa_allocator", state=State.fresh, action=Action.fresh, init=init,
        transitions={**transitions, **replaced}, invariant=invariant,
        columns=("config", "full free pages", "paged SWA free pages", "free request slots", "mapped entries",
                 "available_size / swa_available_size"),
        cells=_cells, describe=_describe)


SYSTEM = system()
OPS = SYSTEM.ops


# ---- obligations --------------------------------------------------------------------------------------------


def _ob(suffix: str, statement: str, check: Check, twin_of: str | None = None) -> Obligation:
    return _ts.obligation(SYSTEM, suffix, statement, check, family=FAMILY, twin_of=twin_of)


def _cost_check(cost: z3.ArithRef | None = None) -> Check:
    s = State.fresh("0")
    c = ring_cost(s) if cost is None else cost

    def build() -> list[z3.BoolRef]:
        return [s.P >= 1, s.ring >= 1, z3.Not(z3.And(c % s.P == 0, s.ring <= c, c < s.ring + s.P))]

    def render(m: z3.ModelRef) -> str:
        return (f"P = {as_int(m, s.P)}, ring = {as_int(m, s.ring)}: cost {as_int(m, c)} is not a whole number of "
                "pages in [ring, ring + P)")

    return Check(build, render)


def _paged_min(s: State) -> z3.ArithRef:
    """The paged path's ``available_size``: ``min(full, swa)``."""
    full, swa = available_size(s), swa_available_size(s)
    return z3.If(full <= swa, full, swa)


def _fits_iff(avail: Callable[[State], z3.ArithRef] = available_size) -> Check:
    """An ``alloc_extend`` of ``k`` pages is possible iff ``k * P <= available_size()`` (enabledness)."""
    step = Step.fresh(SYSTEM)
    s, a, t = step.pre, step.action, step.post
    size = avail(s)

    def build() -> list[z3.BoolRef]:
        enabled = z3.Exists([t.F], _allocate(s, a, State(s.P, s.ring, s.NF, s.NS, s.NR, t.F, s.S, s.R, s.mapped)))
        return [SYSTEM.holds(s), a.k >= 0, z3.Not(enabled == (a.k * s.P <= size))]

    def render(m: z3.ModelRef) -> str:
        k, p = as_int(m, a.k), as_int(m, s.P)
        return (f"alloc_extend of {k} page(s) ({k * p} tokens) with {as_int(m, s.F)} full pages free, "
                f"{as_int(m, s.R)} request slots free: available_size() = {as_int(m, size)} says "
                f"{'no' if k * p > as_int(m, size) else 'yes'}, the allocation "
                f"{'succeeds' if k <= as_int(m, s.F) else 'fails'}")

    return Check(build, render)


def _swa_unchanged(step: Step[State, Action]) -> z3.BoolRef:
    s, t = step.pre, step.post
    return z3.And(swa_available_size(t) == swa_available_size(s), t.S == s.S, t.mapped == s.mapped)


def _noop_claim(step: Step[State, Action]) -> z3.BoolRef:
    s, t = step.pre, step.post
    return z3.And(t.F == s.F, t.S == s.S, t.R == s.R, t.mapped == s.mapped)


def _capacity(step: Step[State, Action]) -> z3.BoolRef:
    """SR2 after the step: conservation and bounds of the ring capacity."""
    t = step.post
    held = t.NR - t.R
    c = ring_cost(t)
    return z3.And(swa_available_size(t) + held * c == t.NR * c, swa_available_size(t) >= 0,
                  swa_available_size(t) <= t.NR * c)


def _credits_paged(s: State, a: Action, t: State) -> z3.BoolRef:
    """``free`` with ``_free_swa_pages``' crediting and no ring return: ``k`` pages back into the paged SWA pool."""
    return z3.And(a.k >= 0, a.k <= s.NF - s.F, s.F + a.k == t.F, s.S + a.k == t.S, *_frame(s, t, "F", "S"))


def _free_swa_paged(s: State, a: Action, t: State) -> z3.BoolRef:
    """``free_swa`` as on the paged path: the SWA peers of ``k`` pages go back."""
    return z3.And(a.k >= 1, s.S + a.k == t.S, *_frame(s, t, "S"))


def _tail_gated(s: State, a: Action, t: State) -> z3.BoolRef:
    """The tail allocation through ``new_pages_available`` without its ring branch: the paged SWA pool must hold the
    tail's pages too (here: as many as the full side's)."""
    return z3.And(a.k >= 0, a.k <= s.F, a.k <= s.S, s.F - a.k == t.F, *_frame(s, t, "F"))


def _alloc_unchecked(s: State, a: Action, t: State) -> z3.BoolRef:
    """``alloc_req_slots`` without the free-slot check."""
    return z3.And(a.n >= 0, s.R - a.n == t.R, *_frame(s, t, "R"))


def _free_unchecked(s: State, a: Action, t: State) -> z3.BoolRef:
    """0.5.23's ``free_rows``: appends whatever it is given (a slot nobody holds comes back twice)."""
    return z3.And(a.n >= 0, s.R + a.n == t.R, *_frame(s, t, "R"))


def _tail_fits(system_: TransitionSystem[State, Action]) -> Check:
    """``alloc_extend_swa_tail`` of ``k`` full pages is refused only when the full pool is short."""
    step = Step.fresh(system_)
    s, a, t = step.pre, step.action, step.post
    relation = system_.transitions["alloc_extend_swa_tail"]

    def build() -> list[z3.BoolRef]:
        enabled = z3.Exists([t.F, t.S, t.R, t.mapped], relation(s, a, t))
        return [system_.holds(s), a.k >= 0, a.k <= s.F, z3.Not(enabled)]

    def render(m: z3.ModelRef) -> str:
        return (f"alloc_extend_swa_tail of {as_int(m, a.k)} page(s) refused with {as_int(m, s.F)} full pages free "
                f"(paged SWA pool: {as_int(m, s.S)} free pages, unused by the ring)")

    return Check(build, render)


_RELEASES = (*FULL_RELEASES, *NOOPS)
_CONSECUTION = _ts.consecution(SYSTEM)

OBLIGATIONS: tuple[Obligation, ...] = (
    _ob("ring.cost_rounds_to_pages", "the ring cost ceil(ring/P)*P is a multiple of P in [ring, ring + P)",
        _cost_check()),
    _ob("ring.cost_rounds_to_pages.floored", "broken twin: the floored cost floor(ring/P)*P covers the ring",
        _cost_check(z3.Int("ring") / z3.Int("P") * z3.Int("P")), twin_of="ring.cost_rounds_to_pages"),
    _ob("ring.initiation", "SR3 and the bounds hold for a fresh ring allocator", _ts.initiation(SYSTEM)),
    _ob("ring.initiation.paged_size_swa", "broken twin: the ring's free slots taken from the paged size_swa (in "
        "pages), which 0.5.23's ring bypasses", _ts.initiation(dataclasses.replace(SYSTEM, init=_init_from_paged_size)),
        twin_of="ring.initiation"),
    _ob("ring.consecution", "every ring op keeps SR3 (paged SWA pool and mapping untouched) and the bounds",
        _CONSECUTION),
    _ob("alloc.ring_takes_paged_swa", "broken twin (finding F8): 0.5.23's alloc without a ring branch keeps SR3",
        _ts.consecution(system(alloc=_upstream_alloc), ["alloc"]), twin_of="ring.consecution"),
    _ob("alloc_extend.ring_fits_iff_full", "SR1: an extend of k pages succeeds iff k * P <= available_size() = "
        "full free tokens", _fits_iff()),
    _ob("alloc_extend.ring_fits_iff_full.min", "broken twin: available_size() = min(full, swa) in ring mode",
        _fits_iff(_paged_min),
        twin_of="alloc_extend.ring_fits_iff_full"),
    _ob("alloc_extend_swa_tail.ring_needs_full_only", "SR1: the tail allocation is refused only for want of full "
        "pages", _tail_fits(SYSTEM)),
    _ob("alloc_extend_swa_tail.ring_needs_full_only.paged_gate", "broken twin: new_pages_available without its ring "
        "branch (the paged SWA pool gates too)", _tail_fits(system(alloc_extend_swa_tail=_tail_gated)),
        twin_of="alloc_extend_swa_tail.ring_needs_full_only"),
    _ob("free.ring_never_credits_swa", "SR3: no release changes swa_available_size, the paged pool or the mapping",
        _ts.safety(SYSTEM, _swa_unchanged, lambda m, step: "a release changed the SWA side", _RELEASES)),
    _ob("free.ring_never_credits_swa.credits_paged", "broken twin: free credits the paged SWA pool "
        "(_free_swa_pages without its ring return)",
        _ts.safety(system(free=_credits_paged), _swa_unchanged,
                   lambda m, step: "free gave paged SWA pages back: the paged pool's available_size() is "
                                   "over-credited", ["free"]), twin_of="free.ring_never_credits_swa"),
    _ob("free_swa.ring_releases_nothing", "free_swa / free_swa_segment change nothing on a ring",
        _ts.safety(SYSTEM, _noop_claim, lambda m, step: "free_swa changed the allocator", NOOPS)),
    _ob("free_swa.ring_releases_nothing.paged", "broken twin: free_swa releases SWA peers as on the paged path",
        _ts.safety(system(free_swa=_free_swa_paged), _noop_claim,
                   lambda m, step: "free_swa released paged SWA pages the ring never took", ["free_swa"]),
        twin_of="free_swa.ring_releases_nothing"),
    _ob("alloc_req_slots.ring_capacity", "SR2: after alloc_req_slots, swa_available_size + held slots x C == "
        "slots x C and 0 <= swa_available_size <= slots x C",
        _ts.safety(SYSTEM, _capacity, lambda m, step: "SR2 broken", ["alloc_req_slots"])),
    _ob("alloc_req_slots.ring_capacity.unchecked", "broken twin: alloc_req_slots without the free-slot check",
        _ts.safety(system(alloc_req_slots=_alloc_unchecked), _capacity,
                   lambda m, step: "more slots taken than free: swa_available_size() < 0", ["alloc_req_slots"]),
        twin_of="alloc_req_slots.ring_capacity"),
    _ob("free_req_slots.ring_capacity", "SR2: after free_req_slots (held slots only) the ring capacity stays within "
        "slots x C", _ts.safety(SYSTEM, _capacity, lambda m, step: "SR2 broken", ["free_req_slots"])),
    _ob("free_req_slots.ring_capacity.unchecked", "broken twin: 0.5.23's free_rows appends a slot nobody holds",
        _ts.safety(system(free_req_slots=_free_unchecked), _capacity,
                   lambda m, step: "a slot came back twice: swa_available_size() exceeds slots x C",
                   ["free_req_slots"]), twin_of="free_req_slots.ring_capacity"),
)
