"""kvproof's error taxonomy: who is at fault, in four classes, raised through two functions.

* :class:`OutOfMemory` -- an expected condition: a pool has too few free pages.
  The caller should evict or retract. Nothing changed.
* :class:`InvalidOperation` -- caller misuse: an argument violates a documented
  precondition (double free, reserved slot, misaligned ``last_loc`` ...).
  Nothing changed.
* :class:`InvariantViolation` -- an implementation bug: a state invariant of
  sglang_semantics.md §7 (G1-G5, M1-M5, ...) does not hold.
* :class:`ConfigError` -- a bad configuration: a pool, host pool, scheduler or run
  configuration names an impossible value; the error names the model and the field.

Preconditions are written ``require(condition, op, argument, message)`` (raises
:class:`InvalidOperation`) and postconditions / invariants ``ensure(condition,
invariant, message)`` (raises :class:`InvariantViolation`); every layer uses these two,
never a bare ``assert`` or ``ValueError`` for misuse. ``message`` may be a zero-argument
callable, so hot paths only format it when the check fails.

Every operation of the reference and of the torch runtime signals failure by
raising exactly one of these, never by returning ``None`` (upstream SGLang
returns ``None`` on out-of-memory and asserts on misuse; adapters translate).
``InvalidOperation`` and ``ConfigError`` are also ``ValueError`` and
``InvariantViolation`` an ``AssertionError``, so callers may catch either the kvproof
class or the builtin (the Hypothesis house style, ``InvalidArgument(..., TypeError)``).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["OUTCOME_CLASSES", "ConfigError", "InvalidOperation", "InvariantViolation", "OutOfMemory", "PoolError",
           "ensure", "require"]

Message = str | Callable[[], str]


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


class ConfigError(PoolError, ValueError):
    """A configuration value is impossible: ``model.field`` (``field`` may be ``""`` for a whole-model rule)."""

    def __init__(self, model: str, field: str, message: str) -> None:
        self.model, self.field = model, field
        where = f"{model}.{field}" if field else model
        super().__init__(f"{where}: {message}")


def _text(message: Message) -> str:
    return message() if callable(message) else message


def require(condition: bool, op: str, argument: str, message: Message) -> None:
    """Precondition of ``op`` on ``argument``: :class:`InvalidOperation` (caller misuse) when it fails."""
    if not condition:
        raise InvalidOperation(op, argument, _text(message))


def ensure(condition: bool, invariant: str, message: Message) -> None:
    """Postcondition or state invariant ``invariant`` (an id of §7): :class:`InvariantViolation` when broken."""
    if not condition:
        raise InvariantViolation(invariant, _text(message))


#: The outcome classes the lockstep harness compares step by step.
OUTCOME_CLASSES: tuple[type[PoolError], ...] = (OutOfMemory, InvalidOperation)
