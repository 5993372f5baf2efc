"""What a verdict is: evidence of what happened, the findings an implementation declares, and the known ones a run
may look past (habits 6-8).

Every verdict a lockstep machine raises (:meth:`kvproof.conformance.lockstep.Lockstep.fail`) carries
:class:`Evidence`: the operation that diverged, which check saw it (:data:`CHECKS`), the step, the operations so
far and the check's own values (for a failed call that changed the state: what changed, per pool). A finding is
matched against that evidence, never against the verdict's wording: two upstream defects can print the same
headline, and a message that is reworded must not change what a failure is.

An implementation declares the findings kvproof has classified for it (its ``findings`` attribute: a tuple of
:class:`Finding`; the SGLang adapters declare those of ``docs/sglang-findings.md``). Each report labels a failure
with the declared finding its evidence matches, or ``new``.

**Looking past a known finding.** A finding whose implementation behaviour is documented names it
(``behaviour``); a suite that can follow that behaviour on the reference declares a method for it with
:func:`follows`. A run given ``accept=("F1",)`` (``--accept F1``) then does not stop at an occurrence: the
machine checks that the implementation did exactly the documented thing (anything else is still a verdict),
makes the reference do the same, and goes on exploring. Nothing is hidden by default (a run accepts nothing unless
told), every occurrence is counted (``CheckReport.accepted``; the reports print them), and an accepted finding
that never occurs in a run fails it (:func:`unseen`), as a strict xfail does: the implementation changed, or the
run cannot reach it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvproof.conformance.errors import UsageError

__all__ = ["CHECKS", "Evidence", "Finding", "declared_findings", "follows", "label", "resolve_accepted", "unseen"]

#: The checks a verdict can come from (``Evidence.check``).
CHECKS = (
    "outcome",  # the two sides ended an operation differently (success vs an error class, or another error class)
    "unchanged_on_failure",  # both failed alike, but the implementation's state changed (G4)
    "result",  # an operation's result differs (indices, a decision, a return value)
    "state",  # the per-step comparison of the observable state
    "kv",  # KV rows read back differ
    "custody",  # the implementation wrote into a tensor the caller owns
    "invariant",  # an invariant of the model or of the implementation is broken
    "liveness",  # a request that fits is refused forever
    "collective",  # ranks disagree on a collective (tp_prefetch)
    "crash",  # the implementation raised something that is no verdict of the contract
    "hang",  # a call did not return within the per-operation deadline
    "other",
)

_FOLLOWS = "__kvproof_follows__"


@dataclass(frozen=True)
class Evidence:
    """What a verdict saw: the operation, the check, the step, the operations so far, the check's values."""

    component: str
    op: str
    check: str
    step: int
    ops: tuple[str, ...] = ()
    detail: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"component": self.component, "op": self.op, "check": self.check, "step": self.step,
                "ops": list(self.ops), "detail": dict(self.detail)}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Evidence:
        return cls(str(doc["component"]), str(doc["op"]), str(doc["check"]), int(doc["step"]),
                   tuple(doc.get("ops", ())), dict(doc.get("detail", {})))


@dataclass(frozen=True)
class Finding:
    """A classified divergence of one implementation: its id, title and kind, how to recognise it from the evidence,
    and (``behaviour``) the documented implementation behaviour a suite can follow to look past it."""

    id: str
    title: str
    kind: str  # "sglang-bug", "model-gap", ...
    components: tuple[str, ...]  # the suites that can show it
    matches: Callable[[Evidence], bool]
    behaviour: str | None = None

    def __call__(self, evidence: Evidence) -> bool:
        return evidence.component in self.components and bool(self.matches(evidence))


def declared_findings(implementation: Any) -> tuple[Finding, ...]:
    """The findings an implementation (or its factory) declares: its ``findings`` attribute, or none."""
    found = getattr(implementation, "findings", ())
    return tuple(f for f in found if isinstance(f, Finding))


def label(evidence: Evidence | None, findings: Iterable[Finding]) -> str:
    """The id of the declared finding the evidence shows; else the scenario the suite itself recognised (its
    ``detail["finding"]``: a reference variant's known failure, such as S10); else ``new`` (``-`` without evidence:
    the implementation's process died)."""
    if evidence is None:
        return "-"
    declared = next((f.id for f in findings if f(evidence)), None)
    if declared is not None:
        return declared
    own = evidence.detail.get("finding")
    return str(own) if own else "new"


def resolve_accepted(ids: Iterable[str], findings: Iterable[Finding], component: str,
                     followed: Iterable[str]) -> tuple[Finding, ...]:
    """The findings a run of ``component`` looks past: each id must be a finding the implementation declares for the
    component, with a behaviour the suite follows (``followed``); anything else is a :class:`UsageError` naming
    the choices."""
    mine = {f.id: f for f in findings if component in f.components}
    can = sorted(i for i, f in mine.items() if f.behaviour in set(followed))
    out = []
    for wanted in dict.fromkeys(ids):
        finding = mine.get(wanted)
        if finding is None or finding.id not in can:
            why = "is not a finding this implementation declares for" if finding is None else \
                "has no documented behaviour the suite can follow for"
            raise UsageError(f"--accept {wanted}: {wanted} {why} {component}; choose from {can or 'none'}")
        out.append(finding)
    return tuple(out)


def unseen(accepted: Iterable[str], counts: Iterable[Mapping[str, int]]) -> list[str]:
    """The accepted findings none of a run's reports saw (each such finding fails the run: strict)."""
    total: dict[str, int] = {}
    for c in counts:
        for k, v in c.items():
            total[k] = total.get(k, 0) + v
    return [a for a in dict.fromkeys(accepted) if not total.get(a)]


def follows(behaviour: str) -> Callable[[Callable[..., bool]], Callable[..., bool]]:
    """Declare a machine method that follows a documented implementation behaviour on the reference: called with the
    evidence of an occurrence and the snapshots before and after (a failed call's), it returns ``True`` when the
    implementation did exactly that behaviour and the reference now did the same (the run goes on), ``False``
    otherwise (the verdict stands)."""
    def decorate(function: Callable[..., bool]) -> Callable[..., bool]:
        setattr(function, _FOLLOWS, behaviour)
        return function

    return decorate


def followed_by(cls: type) -> dict[str, str]:
    """The behaviours a machine class follows: behaviour -> method name."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        for name, member in vars(klass).items():
            behaviour = getattr(member, _FOLLOWS, None)
            if behaviour is not None:
                out[behaviour] = name
    return out
