"""kvproof's error taxonomy: who is at fault, in three classes.

* :class:`OutOfMemory` -- an expected condition: a pool has too few free pages.
  The caller should evict or retract. Nothing changed.
* :class:`InvalidOperation` -- caller misuse: an argument violates a documented
  precondition (double free, reserved slot, misaligned ``last_loc`` ...).
  Nothing changed.
* :class:`InvariantViolation` -- an implementation bug: a state invariant of
  sglang_semantics.md §7 (G1-G5, M1-M5) does not hold.

Every operation of the reference and of the torch runtime signals failure by
raising exactly one of these, never by returning ``None`` (upstream SGLang
returns ``None`` on out-of-memory and asserts on misuse; adapters translate).
``InvalidOperation`` is also a ``ValueError`` and ``InvariantViolation`` an
``AssertionError``, so callers may catch either the kvproof class or the builtin.
"""

from __future__ import annotations

__all__ = ["PoolError", "OutOfMemory", "InvalidOperation", "InvariantViolation", "OUTCOME_CLASSES"]


class PoolError(Exception):
    """Root of the taxonomy; never raised directly."""


class OutOfMemory(PoolError):
    """A pool has fewer free pages than the operation needs; state unchanged."""

    def __init__(self, op: str, pool: str, pages_needed: int, pages_free: int, *, request: int | None = None) -> None:
        self.op, self.pool, self.request = op, pool, request
        self.pages_needed, self.pages_free = pages_needed, pages_free
        who = "" if request is None else f" for request {request}"
        super().__init__(f"{op}: {pool} pool needs {pages_needed} page(s){who}, {pages_free} free")


class InvalidOperation(PoolError, ValueError):
    """Caller misuse: ``argument`` violates a precondition; state unchanged."""

    def __init__(self, op: str, argument: str, message: str) -> None:
        self.op, self.argument = op, argument
        super().__init__(f"{op}: {argument}: {message}")


class InvariantViolation(PoolError, AssertionError):
    """An implementation bug: ``invariant`` (an id from §7, e.g. ``M2``) is broken."""

    def __init__(self, invariant: str, message: str) -> None:
        self.invariant = invariant
        super().__init__(f"[{invariant}] {message}")


#: The outcome classes the lockstep harness compares step by step.
OUTCOME_CLASSES: tuple[type[PoolError], ...] = (OutOfMemory, InvalidOperation)
