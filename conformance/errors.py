"""The harness's two kinds of error, never mixed (habit 6).

* :class:`Verdict` -- a finding about the implementation under test: it diverged from the
  reference (:class:`LockstepFailure`, raised inside a run), or a checked run did not pass
  (:class:`ConformanceFailure`, raised by ``kvproof.conformance.check.check``). A run turns
  verdicts into reports; they are the product, not crashes.
* :class:`HarnessError` -- kvproof itself, or what it was given, is at fault:
  :class:`UsageError` for bad input to the harness (an ``--impl`` that names nothing, an
  unknown config label or profile, a malformed selection file or vector) and
  :class:`HarnessBug` when the harness generated a call its own reference rejects.

Errors about pools and configurations (``OutOfMemory``, ``InvalidOperation``,
``InvariantViolation``, ``ConfigError``) are the reference's taxonomy,
``kvproof.reference.errors``; an unknown component name is a ``ConfigError``
(``kvproof.reference.registry.UnknownComponent``).
"""

from __future__ import annotations

__all__ = [
    "ConformanceFailure",
    "HarnessBug",
    "HarnessError",
    "ImplSpecError",
    "LockstepFailure",
    "RunInterrupted",
    "UsageError",
    "VectorError",
    "Verdict",
]


class Verdict(Exception):
    """Root of the findings about an implementation; the message is the full explanation."""


class LockstepFailure(Verdict):
    """The implementation diverged; the message has the op, the step, the values and a replay hint, and
    ``evidence`` (a :class:`kvproof.conformance.findings.Evidence`, when the machine raised it) what happened."""

    def __init__(self, message: str, evidence: object = None) -> None:
        super().__init__(message)
        self.evidence = evidence

    def __reduce__(self) -> tuple[type, tuple[str, object]]:  # picklable with its evidence (isolated runs)
        return type(self), (str(self), self.evidence)


class ConformanceFailure(Verdict):
    """A checked run did not pass (``check`` / ``check_<component>``); the message is the run's verdict."""


class HarnessError(Exception):
    """Root of the errors that are kvproof's or its inputs' fault, not the implementation's."""


class UsageError(HarnessError, ValueError):
    """Bad input to the harness: the message names the argument and the choices."""


class ImplSpecError(UsageError):
    """``--impl`` / ``$KVPROOF_IMPL`` does not name an importable callable."""


class VectorError(UsageError):
    """A vector that cannot be replayed here: malformed, another suite, or a step whose rule does not apply."""


class HarnessBug(HarnessError):
    """The harness generated a call the reference rejects, or a suite is declared inconsistently: a kvproof bug."""


class RunInterrupted(KeyboardInterrupt):
    """Ctrl-C during a run: still a ``KeyboardInterrupt``, carrying what the run had found (``report``)."""

    def __init__(self, report: object) -> None:
        super().__init__("interrupted")
        self.report = report  # a kvproof.conformance.check.CheckReport: the first-seen failure, if any
