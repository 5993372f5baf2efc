"""Show the harm, not only the first divergence (issue 15 item 3).

A lockstep run stops at the first step where the implementation and the reference disagree: a failed
``alloc_decode`` that kept a page, a free that put the reserved page into circulation. A maintainer asks what that
costs. :func:`continue_for_harm` replays the (shrunk) failure vector to its divergence, then keeps driving the
*implementation alone* -- the reference no longer agrees, so it cannot judge -- under a **ghost ownership model**: which
request holds which page, taken from what each call handed out and never from the implementation's own bookkeeping.
The walk makes only calls the contract allows a caller (extend, decode, window eviction, free; sglang_semantics.md
§1.5-§1.6, §2.7) and after each one looks for a consequence (:data:`HARMS`, most severe first):

* ``cross-request KV read``: a request reads KV another request wrote (every position the walk owns is written
  with a tag naming the write, and read back after every step);
* ``two owners``: one page held by two live requests;
* ``freed while owned``: a page in a free list while a live request holds it;
* ``duplicate in a free list``;
* ``reserved page handed out``: page 0 (SGLang's padding page, §1.5) held by a request, or a fresh position left
  without its SWA slot;
* ``raised``: a legal call raised something other than out-of-memory (an assertion);
* ``capacity lost``: once every request is freed, pages are neither free nor held, and a request that fits the
  empty pool is refused.

Ownership at the divergence is the harness's request table as the implementation named it (the last state both
sides agreed on, plus what the diverging call had handed out where it was bound). The first try releases
everything at once; each of the other ``tries - 1`` walks is seeded (``seed``, try): the same vector and seed give
the same continuation. The most severe harm wins, then the shortest walk. A component whose machine has no
:meth:`~kvproof.conformance.lockstep.Lockstep.ghost` says so, and why (``Lockstep.ghost_missing``), rather than
pretending to look.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvproof.conformance.errors import LockstepFailure, UsageError
from kvproof.conformance.isolation import DEFAULT_MEMORY_LIMIT_MB, Crash, fork_problem, run_isolated
from kvproof.conformance.lockstep import deadline_scope
from kvproof.conformance.vector import replay

__all__ = ["HARMS", "Ghost", "Harm", "HarmReport", "continue_for_harm", "severity"]

#: The consequences a walk looks for, most severe first (:func:`severity`).
HARMS = ("cross-request KV read", "two owners", "freed while owned", "duplicate in a free list",
         "reserved page handed out", "raised", "capacity lost")


def severity(kind: str) -> int:
    """The rank of a harm kind in :data:`HARMS` (0: the most severe)."""
    return HARMS.index(kind)


@dataclass(frozen=True)
class Harm:
    """One consequence: its kind (one of :data:`HARMS`) and what exactly happened."""

    kind: str
    text: str

    def __post_init__(self) -> None:
        if self.kind not in HARMS:
            raise UsageError(f"harm kind {self.kind!r}: choose one of {list(HARMS)}")


class Ghost(Protocol):
    """A component's implementation-alone driver, built by a machine at its divergence (``Lockstep.ghost``)."""

    def owners(self) -> str:
        """Who holds what now, in one or a few lines."""

    def harm(self) -> Harm | None:
        """The most severe consequence visible now (``None``: none)."""

    def step(self, rng: random.Random) -> tuple[str, Harm | None] | None:
        """One legal call chosen with ``rng``: its line and a harm it raised (``None``: no call is possible)."""

    def settle(self) -> tuple[list[str], Harm | None]:
        """The end of a walk: release everything legally, then look at what is left (lines, a harm or ``None``)."""


@dataclass(frozen=True)
class HarmReport:
    """What a continuation found: the divergence it went on from, the walk, the harm (``None``: none found)."""

    component: str
    config: str
    diverged_after: int  # vector steps done when the divergence was seen
    divergence: str  # the verdict's first line ("" when the vector did not fail)
    owners: str  # ghost ownership at the divergence
    walk: tuple[str, ...]  # the calls of the continuation, one line each
    harm: Harm | None
    tries: int
    seed: int
    note: str = ""  # why there is no continuation (the vector passes, no ghost model, the process crashed)
    tried: tuple[str, ...] = field(default=())  # the kind found by each try ("none" where none was)

    def text(self) -> str:
        """The continuation as printed under the shrunk trace."""
        head = (f"harm continuation ({self.component} {self.config}; the implementation alone after vector step "
                f"{self.diverged_after}, ownership from what each call handed out; seed {self.seed}, "
                f"{self.tries} tries)")
        if self.note:
            return f"{head}:\n  {self.note}"
        lines = [f"{head}:", "  owners at the divergence:"]
        lines += [f"    {line}" for line in self.owners.splitlines()]
        lines += [f"  +{i} {line}" for i, line in enumerate(self.walk, 1)]
        if self.harm is None:
            lines.append(f"  no harm found in {self.tries} walks (the divergence stays a contract difference here)")
        else:
            lines.append(f"  HARM ({self.harm.kind}): {self.harm.text}")
            found = sorted({k for k in self.tried if k != "none"}, key=severity)
            lines.append(f"  walks that found a harm: {sum(k != 'none' for k in self.tried)} of {len(self.tried)}"
                         + (f" ({', '.join(found)})" if found else ""))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"diverged_after": self.diverged_after, "divergence": self.divergence, "owners": self.owners,
                "walk": list(self.walk), "harm": None if self.harm is None else {"kind": self.harm.kind,
                                                                                "text": self.harm.text},
                "tries": self.tries, "seed": self.seed, "note": self.note, "tried": list(self.tried)}


def continue_for_harm(vector: dict[str, Any], factory: Callable[[Any], Any], *, impl_name: str,
                      op_timeout: float | None = 60.0, tries: int = 32, steps: int = 40, seed: int = 0,
                      isolation: str = "process", memory_limit_mb: int = DEFAULT_MEMORY_LIMIT_MB) -> HarmReport:
    """Replay ``vector`` on ``factory``'s implementation to its divergence, then walk the implementation alone for up
    to ``steps`` calls, ``tries`` times, looking for a consequence (see the module). ``isolation="process"`` runs it
    in a supervised child: an implementation that kills the process is a harm of its own kind (``raised``)."""
    if tries < 1 or steps < 0:
        raise UsageError(f"harm continuation: tries must be >= 1 and steps >= 0, got tries={tries}, steps={steps}")
    component, label = str(vector["component"]), str(vector["config"].get("label", "?"))
    if isolation == "process" and not fork_problem():
        outcome = run_isolated(lambda: continue_for_harm(vector, factory, impl_name=impl_name,
                                                         op_timeout=op_timeout, tries=tries, steps=steps,
                                                         seed=seed, isolation="in-process"),
                               op_timeout=op_timeout, memory_limit_mb=memory_limit_mb)
        if not isinstance(outcome, Crash):
            return outcome
        return HarmReport(component, label, 0, "", "", (), Harm("raised", f"the implementation's process ended "
                                                                         f"during the continuation: "
                                                                         f"{outcome.message}"),
                          tries, seed)
    best: tuple[tuple[int, int], list[str], Harm] | None = None
    tried: list[str] = []
    owners, divergence, after = "", "", 0
    limit = steps
    for t in range(tries):
        ghost, divergence, after, note = _at_divergence(vector, factory, impl_name, op_timeout)
        if ghost is None:
            return HarmReport(component, label, after, divergence, "", (), None, tries, seed, note)
        owners = owners or ghost.owners()
        # the first try releases everything at once (the shortest road to what the divergence itself cost); the
        # others walk first
        walk, harm = _walk(ghost, random.Random(f"kvproof-harm:{seed}:{t}"), 0 if t == 0 else limit)
        tried.append(harm.kind if harm else "none")
        if harm is not None:
            rank = (severity(harm.kind), len(walk))
            if best is None or rank < best[0]:
                best = (rank, walk, harm)
                if harm.kind != "capacity lost":  # later walks need not be longer than this one
                    limit = min(limit, len(walk))
    if best is None:
        return HarmReport(component, label, after, divergence, owners, (), None, tries, seed, tried=tuple(tried))
    return HarmReport(component, label, after, divergence, owners, tuple(best[1]), best[2], tries, seed,
                      tried=tuple(tried))


def _at_divergence(vector: dict[str, Any], factory: Callable[[Any], Any], impl_name: str,
                   op_timeout: float | None) -> tuple[Ghost | None, str, int, str]:
    """A fresh machine replayed to ``vector``'s divergence and its ghost: (ghost or ``None``, the verdict's first
    line, the steps done, why there is no ghost)."""
    from kvproof.conformance.check import replay_machine

    with deadline_scope():
        try:
            machine = replay_machine(vector, factory, impl_name=impl_name, op_timeout=op_timeout)
        except LockstepFailure as err:
            return None, str(err).splitlines()[0], 0, "the implementation could not be built: nothing to continue"
        result = replay(vector, machine)
    if result.passed:
        return None, "", result.steps, "the vector does not fail on this implementation: nothing to continue"
    first = (result.failure or "").splitlines()[0]
    ghost = machine.ghost()
    if ghost is None:
        return None, first, result.steps, (f"no continuation for component {vector['component']}: "
                                           f"{type(machine).ghost_missing}")
    return ghost, first, result.steps, ""


def _walk(ghost: Ghost, rng: random.Random, limit: int) -> tuple[list[str], Harm | None]:
    """Up to ``limit`` legal calls, stopping at the first harm; then settle (release everything, look again)."""
    harm = ghost.harm()
    if harm is not None:  # already at the divergence
        return [], harm
    walk: list[str] = []
    for _ in range(limit):
        done = ghost.step(rng)
        if done is None:
            break
        line, harm = done
        walk.append(line)
        harm = harm or ghost.harm()
        if harm is not None:
            return walk, harm
    lines, harm = ghost.settle()
    return walk + lines, harm
