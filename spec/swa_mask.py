"""Mask symmetry of ``get_cpu_copy`` / ``load_cpu_copy`` (sglang_semantics.md §2.8, §9 S4).

A request's ``n`` positions are offloaded and later reloaded into new slots.
``old[j]`` says position ``j`` had an SWA slot at copy time (``M[idx_old[j]] > 0``),
``new[j]`` that it has one at load time. Rows are modelled by the position they
were saved from, destination slots by the position they belong to (``t = M[idx_new]``
is injective on mapped positions), so the claims are about positions only.

* copy: saved rows ``S = [j for j if old[j]]`` (``s[swa_mask]``, in order);
* load: ``row_mask = new[old]`` (``new_mask[old_mask]``), filtered rows
  ``S[row_mask]``, destinations ``t[old][row_mask]``.

Checked for **all** masks of every length ``n`` in 1..8 (bounded: ``n`` is symbolic
in ``[1, 8]``, mask bits past ``n`` are false). Boolean-mask selection is encoded
quantifier-free with prefix counts (``rank``) as If-sums.

Broken twins: the legacy path (``row_mask = new_mask``, destinations ``t[new_mask]``,
ignoring ``old_mask``) and a load that drops ``row_mask`` (all saved rows into
``t[new_mask]``).

Obligations are named ``swa_allocator.load_cpu_copy.<claim>[.<twin>]`` (the copy's mask is
``get_cpu_copy``'s, the claims are about what the load writes).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec._solver import Expect, Obligation, as_bool, as_int, fmt_bools

__all__ = ["MAX_LEN", "OBLIGATIONS", "Load", "MaskCase", "compress", "copy", "load_cpu_copy", "rank"]

COMPONENT = "swa_allocator"
FAMILY = "swa_mask"
NAME = f"{COMPONENT}.load_cpu_copy"
MAX_LEN = 8  # every mask length n in 1..MAX_LEN is covered
TWIN_LEN = 6  # broken twins look for counterexamples of at most this length


@dataclass(frozen=True)
class MaskCase:
    """Length ``n`` and the copy-time / load-time SWA masks over positions ``0..MAX_LEN-1``."""

    n: z3.ArithRef
    old: tuple[z3.BoolRef, ...]
    new: tuple[z3.BoolRef, ...]

    @staticmethod
    def fresh() -> MaskCase:
        return MaskCase(
            z3.Int("n"),
            tuple(z3.Bool(f"old_{j}") for j in range(MAX_LEN)),
            tuple(z3.Bool(f"new_{j}") for j in range(MAX_LEN)),
        )

    def hypotheses(self) -> list[z3.BoolRef]:
        """``1 <= n <= MAX_LEN``; positions ``>= n`` do not exist (both masks false)."""
        absent = [z3.Implies(j >= self.n, z3.And(z3.Not(self.old[j]), z3.Not(self.new[j]))) for j in range(MAX_LEN)]
        return [self.n >= 1, self.n <= MAX_LEN, *absent]


@dataclass(frozen=True)
class Load:
    """What ``load_cpu_copy`` writes: filtered row ``m`` (by source position) to ``dest[m]``.

    ``raises`` models torch's IndexError when a Boolean row mask does not match the
    number of saved rows. Nothing is written (and nothing raises) when the copy
    saved no SWA rows (``swa`` is None) or there are no destinations (§2.8 steps 2
    and 4).
    """

    rows: tuple[z3.ArithRef, ...]
    num_rows: z3.ArithRef
    dest: tuple[z3.ArithRef, ...]
    num_dest: z3.ArithRef
    raises: z3.BoolRef

    @staticmethod
    def of(rows: tuple[z3.ArithRef, ...], num_rows: z3.ArithRef, dest: tuple[z3.ArithRef, ...],
           num_dest: z3.ArithRef, num_saved: z3.ArithRef, raises: z3.BoolRef | bool = False) -> Load:
        """Apply the early returns: no saved rows or no destinations means no write, no error."""
        nothing = z3.Or(num_saved == 0, num_dest == 0)
        written, targets = z3.If(nothing, 0, num_rows), z3.If(nothing, 0, num_dest)
        return Load(rows, written, dest, targets, z3.And(z3.Not(nothing), raises))


def _bit(b: z3.BoolRef) -> z3.ArithRef:
    return z3.If(b, 1, 0)


def rank(mask: Sequence[z3.BoolRef], j: int) -> z3.ArithRef:
    """Number of true entries of ``mask`` before index ``j`` (prefix count)."""
    return z3.Sum([_bit(mask[i]) for i in range(j)]) if j else z3.IntVal(0)


def compress(mask: Sequence[z3.BoolRef], values: Sequence[z3.ArithRef]) -> tuple[tuple[z3.ArithRef, ...], z3.ArithRef]:
    """``values[mask]`` as torch computes it: the selected values in order, and their count.

    Entry ``k`` is the value at the unique ``j`` with ``mask[j]`` and ``rank(mask, j) == k``
    (0 past the count).
    """
    selected = tuple(
        z3.Sum([z3.If(z3.And(mask[j], rank(mask, j) == k), values[j], 0) for j in range(len(mask))])
        for k in range(len(mask))
    )
    return selected, rank(mask, len(mask))


def compress_bools(mask: Sequence[z3.BoolRef], values: Sequence[z3.BoolRef]) -> tuple[z3.BoolRef, ...]:
    """``values[mask]`` for a Boolean ``values`` (false past the count)."""
    selected, _ = compress(mask, [_bit(v) for v in values])
    return tuple(x == 1 for x in selected)


def _positions() -> tuple[z3.ArithRef, ...]:
    return tuple(z3.IntVal(j) for j in range(MAX_LEN))


def copy(case: MaskCase) -> tuple[tuple[z3.ArithRef, ...], z3.ArithRef]:
    """``get_cpu_copy``: rows saved for ``old``-mapped positions, in position order."""
    return compress(case.old, _positions())


def load_cpu_copy(case: MaskCase) -> Load:
    """The #24857 load: ``row_mask = new_mask[old_mask]``, destinations ``t[old_mask][row_mask]``."""
    saved, num_saved = copy(case)
    row_mask = compress_bools(case.old, case.new)
    rows, num_rows = compress(row_mask, saved)
    t_old, _ = compress(case.old, _positions())
    dest, num_dest = compress(row_mask, t_old)
    return Load.of(rows, num_rows, dest, num_dest, num_saved)


def load_legacy(case: MaskCase) -> Load:
    """Broken: the legacy branch, ``row_mask = new_mask`` and destinations ``t[new_mask]``.

    ``_filter_swa_cpu_copy`` returns the rows unchanged for an all-true mask, and
    otherwise indexes the saved rows with the ``n``-entry mask (IndexError unless
    every position was saved).
    """
    saved, num_saved = copy(case)
    all_new = z3.And([z3.Implies(j < case.n, case.new[j]) for j in range(MAX_LEN)])
    filtered, num_filtered = compress(case.new, saved)
    rows = tuple(z3.If(all_new, kept, picked) for kept, picked in zip(saved, filtered, strict=True))
    dest, num_dest = compress(case.new, _positions())
    raises = z3.And(z3.Not(all_new), case.n != num_saved)
    return Load.of(rows, z3.If(all_new, num_saved, num_filtered), dest, num_dest, num_saved, raises)


def load_without_row_mask(case: MaskCase) -> Load:
    """Broken: every saved row is loaded into ``t[new_mask]``."""
    saved, num_saved = copy(case)
    dest, num_dest = compress(case.new, _positions())
    return Load.of(saved, num_saved, dest, num_dest, num_saved)


# ---- properties -----------------------------------------------------------------------


def row_count_matches(case: MaskCase, load: Load) -> z3.BoolRef:
    """No IndexError, and as many filtered rows as destinations (the load never mis-sizes)."""
    return z3.And(z3.Not(load.raises), load.num_rows == load.num_dest)


def survives_iff_mapped_both(case: MaskCase, load: Load) -> z3.BoolRef:
    """Row ``m`` goes to destination ``m`` of its own position; receivers are ``old & new``."""
    in_place = [z3.Implies(m < load.num_rows, load.rows[m] == load.dest[m]) for m in range(MAX_LEN)]
    receives = [
        z3.Or([z3.And(m < load.num_dest, load.dest[m] == j) for m in range(MAX_LEN)])
        == z3.And(case.old[j], case.new[j])
        for j in range(MAX_LEN)
    ]
    return z3.And(row_count_matches(case, load), *in_place, *receives)


# ---- rendering --------------------------------------------------------------------------


def _explain(old: list[bool], new: list[bool], rows: list[int], dest: list[int], raises: bool) -> str:
    if raises:
        return f"load raises IndexError: row_mask has {len(old)} entries for {sum(old)} saved row(s)"
    counts = f"{len(rows)} filtered row(s) {rows} for {len(dest)} destination(s) {dest}"
    for row, slot in zip(rows, dest, strict=False):  # unequal lengths are what _explain reports
        if row != slot:
            mismatch = f" ({counts})" if len(rows) != len(dest) else ""
            return f"row from position {row} lands on position {slot}{mismatch}"
    if len(rows) != len(dest):
        return counts
    both = [j for j in range(len(old)) if old[j] and new[j]]
    return f"positions {dest} receive rows, expected old & new = {both}"


def _render(make_load: Callable[[MaskCase], Load]) -> Callable[[z3.ModelRef], str]:
    def render(model: z3.ModelRef) -> str:
        case = MaskCase.fresh()
        load = make_load(case)
        n = as_int(model, case.n)
        old = [as_bool(model, b) for b in case.old[:n]]
        new = [as_bool(model, b) for b in case.new[:n]]
        rows = [as_int(model, x) for x in load.rows[: as_int(model, load.num_rows)]]
        dest = [as_int(model, x) for x in load.dest[: as_int(model, load.num_dest)]]
        explained = _explain(old, new, rows, dest, as_bool(model, load.raises))
        return f"old={fmt_bools(old)} new={fmt_bools(new)}: {explained}"

    return render


Property = Callable[[MaskCase, Load], z3.BoolRef]


def _mask_obligation(
    name: str,
    statement: str,
    prop: Property,
    *,
    make_load: Callable[[MaskCase], Load] = load_cpu_copy,
    expect: Expect = "proved",
    twin_of: str | None = None,
) -> Obligation:
    """hypotheses(n, old, new) and not prop(load).

    Broken twins search ``n <= 6`` only (the length of scenario S4): any
    counterexample refutes them, and shorter masks read better.
    """

    def build() -> list[z3.BoolRef]:
        case = MaskCase.fresh()
        short = [case.n <= TWIN_LEN] if expect == "counterexample" else []
        return [*case.hypotheses(), *short, z3.Not(prop(case, make_load(case)))]

    return Obligation(
        name=f"{NAME}.{name}",
        component=COMPONENT,
        family=FAMILY,
        statement=statement,
        expect=expect,
        build=build,
        render=_render(make_load),
        twin_of=twin_of,
    )


OBLIGATIONS: tuple[Obligation, ...] = (
    _mask_obligation(
        "row_count_matches",
        "for all old/new masks of length n in 1..8 (bounded): load_cpu_copy filters exactly as many "
        "saved rows as it has destinations",
        row_count_matches,
    ),
    _mask_obligation(
        "row_count_matches.legacy_row_mask",
        "the legacy row_mask = new_mask over a masked copy raises or filters the wrong number of rows",
        row_count_matches, make_load=load_legacy, expect="counterexample",
        twin_of=f"{NAME}.row_count_matches",
    ),
    _mask_obligation(
        "survives_iff_mapped_both",
        "for all old/new masks of length n in 1..8 (bounded): the m-th filtered row is written to the "
        "m-th destination, which is the slot of the row's own position, and the positions that receive "
        "a row are exactly {j : old[j] and new[j]}",
        survives_iff_mapped_both,
    ),
    _mask_obligation(
        "survives_iff_mapped_both.legacy_row_mask",
        "the legacy path (row_mask = new_mask, destinations t[new_mask]) misplaces rows of a masked copy",
        survives_iff_mapped_both, make_load=load_legacy, expect="counterexample",
        twin_of=f"{NAME}.survives_iff_mapped_both",
    ),
    _mask_obligation(
        "survives_iff_mapped_both.no_row_mask",
        "loading all saved rows into t[new_mask] (no row_mask) puts rows on wrong slots",
        survives_iff_mapped_both, make_load=load_without_row_mask, expect="counterexample",
        twin_of=f"{NAME}.survives_iff_mapped_both",
    ),
)
