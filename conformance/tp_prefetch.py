"""Lockstep state machine for the ``tp_prefetch`` component (sglang_semantics.md §6, §7 T1-T5, §9 S10).

Each config is a :class:`~kvproof.reference.tp_prefetch.TPPrefetchGroup`: a tensor-parallel group of 2, 3 or 4
ranks, a page size and window (a window that is not a page multiple, a window longer than short requests at the
root), and the host path every rank starts from (SWA host values and tombstones). The run option ``--variant``
picks the protocol (``upstream_0523``, the default; ``pre_27264``, ``upstream_27264``, ``sum_hits``,
``best_effort_release``); ``--ranks`` says whether ranks may differ in what the protocol assumes they share:
``agree`` (the default: one termination policy, one transfer set, every rank registered), ``mixed`` (each rank
its own: T5's and R5-d's residual risks) or ``host_pressure`` (they agree on those, but under a 0.5.23 protocol each
rank may have fewer Full host pages free when the synced hit is staged: F6; 0.5.23 sizes the host pools alike and
releases through rank-min queues to prevent that).

The machine plays the scheduler of every rank. A check of a prefetch is the five operations of
``kvproof.reference.tp_prefetch`` in order, one rule each: ``sync_prefetch_hit_query`` starts it (a request of
``R`` pages extending the host path, and each rank's own progress: storage hit, pace, whether its IO thread
finished, failed window pages, deadline, policy, transfer set; under ``--ranks mixed`` or ``host_pressure`` with
a 0.5.23 protocol also the Full host pages it has free when the hit is staged), then ``page_transfer``,
``can_terminate_prefetch``, ``reduce_prefetch_ack``, ``handle_prefetch_result``. A check in which no rank may
terminate ends waiting; the next check continues the same request with later progress (the same storage hits:
the hit query is not made again). Under 0.5.23 a synced hit of 0 pages revokes the prefetch (the check ends).
Every operation runs on the reference and on the implementation (for kvproof's runtime: real processes over a real
gloo group), and both must report the same :class:`~kvproof.reference.tp_prefetch.PhaseReport`: the same
collectives (each rank's packed values, the reduced result), the same decisions, the same commits per rank (who
releases a slot compared as "released" for an implementation without ``Capability.SLOT_RELEASE_PATHS``: SGLang's
releases all end in the same drains); a mismatched collective on
either side (ranks that disagree on a collective's presence, op or shape) is a verdict naming the ranks, the
shapes and the time it took to see it.

After every step:

* each rank's host path and host pools (the implementation's snapshot) equal the reference's: the path before
  the check, or after its commit; the prefetch's buffers held until it commits; every host slot free, in the tree
  or held, once (slot conservation);
* on a committed check, the reference itself must keep T1-T4 (``check_tp_prefetch``) and R5-c
  (``check_hit_counts``): under ``pre_27264`` ranks attach different windows (S10), under the #27264-era variants a
  rank releases a window buffer its IO thread still writes (R5-d), ``sum_hits`` reads a count that is not a prefix
  (R5-c). A reference that breaks them is a verdict naming the finding, even though both sides agree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvproof.conformance import strategies as st
from kvproof.conformance.check import Suite
from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.lockstep import Lockstep, check_after_each_step, operation
from kvproof.reference import tp_prefetch as tp
from kvproof.reference.contract import Capability, TPPrefetchUnderTest
from kvproof.reference.errors import InvariantViolation
from kvproof.reference.registry import Component
from kvproof.reference.tp_prefetch import HostNode, Phase, PoolName, TerminationPolicy, TPPrefetchGroup

__all__ = ["SUITE", "TP_CONFIGS", "TPPrefetchMachine"]


def _group(name: str, n: int, p: int, w: int, r: int, *nodes: tuple[int, bool], root: bool = False) -> TPPrefetchGroup:
    return TPPrefetchGroup(name=name, world_size=n, page_size=p, sliding_window=w, max_request_pages=r,
                           anchor_is_root=root, existing=tuple(HostNode(length=k, swa_host=s) for k, s in nodes))


#: Two, three and four ranks; P = 1, 2, 4; a window that is not a page multiple; a path with SWA host values and
#: tombstones a commit can fill (split at the window's start); a window longer than short requests at the root.
TP_CONFIGS: tuple[TPPrefetchGroup, ...] = (
    _group("pair", 2, 2, 4, 8, (4, True), (2, False)),
    _group("trio", 3, 1, 3, 8, (2, False)),
    _group("quad", 4, 4, 6, 6, (8, False), (4, True)),
    _group("root_short", 2, 2, 8, 6, root=True),
)

#: The five operations of one check, in order, each with the phase it runs at.
STEPS: tuple[tuple[str, Phase], ...] = (
    ("page_transfer", Phase.QUERIED),
    ("can_terminate_prefetch", Phase.TRANSFERRED),
    ("reduce_prefetch_ack", Phase.DECIDED),
    ("handle_prefetch_result", Phase.REDUCED),
)
_AT = dict(STEPS)
#: a finished IO thread is the common case: failures shrink toward it (a running one is the unusual draw)
_NOT_FALSE = st.booleans().map(lambda b: not b)


def _finding(err: InvariantViolation, state: tp.PrefetchState) -> str:
    """Which known finding a broken invariant is (sglang_semantics.md §7-§9, docs/sglang-findings.md), or "new"."""
    text, variant = str(err), state.config.variant
    short = any(r.staged is not None and r.synced_hit is not None and r.staged < r.synced_hit for r in state.ranks)
    if variant.protocol_0523 and "[T1]" in text and short:
        return ("F6 (docs/sglang-findings.md: rank-local host pressure: a rank stages fewer Full pages than the synced "
                "hit after the sync, so the ranks expect different lengths)")
    if variant is tp.TPPrefetchVariant.PRE_27264 and any(f"[{t}]" in text for t in ("T1", "T2", "T3")):
        return "S10 (sglang_semantics.md §9: only the completed count is synced, each rank's SWA hits stay local)"
    if "R5-d" in text:
        return "R5-d (#31445 / #31668: a window buffer released while its IO thread still writes it)"
    if "[R5-c]" in text:
        return "R5-c (#31443: hits counted by sum, not by leading run)"
    if "[T5]" in text:
        return "T5 (§7: ranks whose transfer sets or registration differ make different collectives)"
    if "[T1]" in text and "still wait" in text:
        return "T1 (§7: ranks with different termination policies decide differently)"
    return "new"


class TPPrefetchMachine(Lockstep[TPPrefetchGroup, TPPrefetchUnderTest]):
    """Every rank's scheduler on the reference and on the implementation, in lockstep."""

    component = Component.TP_PREFETCH
    snapshot_type = tp.TPPrefetchSnapshot

    @classmethod
    def effective_config(cls, config: TPPrefetchGroup, options: dict[str, Any]) -> TPPrefetchGroup:
        """The run option ``variant``: both sides run that protocol."""
        variant = options.get("variant")
        return config if variant is None else config.with_variant(variant)

    def __init__(self, binding: Any) -> None:
        binding = dataclasses.replace(binding, config=self.effective_config(binding.config, binding.options))
        super().__init__(binding)
        ranks = binding.options.get("ranks", "agree")
        self.mixed = ranks == "mixed"
        #: ranks may have different free host memory at hit time (0.5.23 stages then; before, at the start)
        self.host_pressure = ranks in ("mixed", "host_pressure") and self.config.variant.protocol_0523
        self.n, self.p = self.config.world_size, self.config.page_size
        self.path: tuple[HostNode, ...] = self.config.existing
        self.state: tp.PrefetchState | None = None  # the check in progress (or the one that ended waiting)
        self.pending: tuple[int, tuple[tp.RankProgress, ...]] | None = None  # a waiting request: R and its shape

    def teardown(self) -> None:
        super().teardown()
        impl = getattr(self, "impl", None)
        if impl is not None:
            impl.close()

    # ------------------------------------------------------------ structural coverage

    @classmethod
    def structure(cls, config: TPPrefetchGroup, na: tuple[str, ...] = ()) -> dict[str, int]:
        """Every termination policy; checks that commit, wait (and are continued) and, under 0.5.23's protocol, are
        revoked or discarded; an SWA window attached; an insert that splits a host node; four commits in one
        example (the host path grows under a later check)."""
        protocol_0523 = config.variant.protocol_0523
        return {"policy wait_complete": 1, "policy timeout": 1, "policy best_effort": 1,
                "check committed": 1, "check waiting": 1, "check revoked": int(protocol_0523),
                "sync_prefetch_hit_query continued": 1, "swa window attached": 1,
                "prefetch discarded": int(protocol_0523), "insert split": 1, "commits per example": 4}

    # ------------------------------------------------------------ drawing a check

    def _idle(self) -> bool:
        return self.state is None or self.state.phase in (Phase.COMMITTED, Phase.WAITING, Phase.REVOKED)

    def _window(self, r: int, transfers: tuple[PoolName, ...]) -> int:
        if PoolName.SWA not in transfers:
            return 0
        if self.config.variant.protocol_0523 and r < self.config.sw_pages:
            return r
        return self.config.sw_pages

    def _swa_allowed(self, r: int) -> bool:
        c = self.config
        return r >= c.sw_pages or (c.variant.protocol_0523 and c.anchor_is_root)

    def _transfers(self, data: Any, r: int, label: str) -> tuple[PoolName, ...]:
        """A transfer set (drawn as pool names: a replayed vector holds plain values)."""
        options = [("swa",), ("swa", "mamba"), ("mamba",), ()]
        if not self._swa_allowed(r):
            options = [o for o in options if "swa" not in o]
        return tuple(PoolName(name) for name in data.draw(st.sampled_from(options), label=label))

    def _progress(self, data: Any, rank: int, r: int, policy: TerminationPolicy, transfers: tuple[PoolName, ...],
                  registered: bool) -> tp.RankProgress:
        """Rank ``rank``'s progress for a new request: what its storage answers (and, under host pressure, its free
        host pages at hit time: F6), then its pace."""
        at = f"rank{rank}."
        hit = data.draw(st.one_of(st.just(r), st.integers(0, r)), label=at + "storage_hit")
        free = None
        if self.host_pressure:
            free = data.draw(st.one_of(st.none(), st.integers(1, r)), label=at + "host_free_pages")
        kept = tp.RankProgress(storage_hit=hit, full_pages=0, io_done=False, policy=policy, transfers=transfers,
                               registered=registered, host_free_pages=free)
        return self._pace(data, rank, r, kept)

    def _pace(self, data: Any, rank: int, r: int, kept: tp.RankProgress) -> tp.RankProgress:
        """``kept`` (what a continued check keeps: storage hit, policy, transfers, registration, host capacity) with
        the rank's pace moved on: loaded pages (never fewer), IO finished, deadline (once passed, passed), failed
        fetches. A rank whose IO thread finished has nothing left to move: its progress stays."""
        if kept.io_done:
            return kept
        at, transfers = f"rank{rank}.", kept.transfers
        full = data.draw(st.one_of(st.just(r), st.integers(kept.full_pages, r)), label=at + "full_pages")
        window = self._window(r, transfers)
        missing = data.draw(st.one_of(st.just([]), st.lists(st.integers(0, window - 1), max_size=2, unique=True))
                            if window else st.just([]), label=at + "swa_missing")
        return kept.model_copy(update={
            "full_pages": full, "io_done": data.draw(_NOT_FALSE, label=at + "io_done"),
            "deadline_passed": kept.deadline_passed or data.draw(st.booleans(), label=at + "deadline_passed"),
            "swa_missing": tuple(sorted(missing)),
            "mamba_missing": PoolName.MAMBA in transfers and data.draw(st.booleans(), label=at + "mamba_missing")})

    def _draw_check(self, data: Any) -> tuple[int, tuple[tp.RankProgress, ...]]:
        """A request and every rank's progress: the waiting request again (what its storage answered, its transfer
        sets, policies and registration kept; only the pace moves on), or a new one at least as long as the host
        path."""
        c = self.config
        if self.pending is not None:
            r, shape = self.pending
            return r, tuple(self._pace(data, i, r, p) for i, p in enumerate(shape))
        low = max(1, c.path_pages(self.path))
        r = data.draw(st.one_of(st.just(c.max_request_pages), st.integers(low, c.max_request_pages)),
                      label="request_pages")
        policies = [TerminationPolicy.WAIT_COMPLETE.value, TerminationPolicy.TIMEOUT.value,
                    TerminationPolicy.BEST_EFFORT.value]
        if self.mixed:
            transfers = [self._transfers(data, r, f"rank{i}.transfers") for i in range(self.n)]
            registered = [data.draw(st.sampled_from([True, True, False]), label=f"rank{i}.registered")
                          for i in range(self.n)]
            if not any(registered):
                registered[0] = True
            policy = [TerminationPolicy(data.draw(st.sampled_from(policies), label=f"rank{i}.policy"))
                      for i in range(self.n)]
        else:
            one = self._transfers(data, r, "transfers")
            transfers, registered = [one] * self.n, [True] * self.n
            policy = [TerminationPolicy(data.draw(st.sampled_from(policies), label="policy"))] * self.n
        ranks = tuple(self._progress(data, i, r, policy[i], transfers[i], registered[i]) for i in range(self.n))
        for p in set(policy):
            self.note(f"policy {p.value}")
        return r, ranks

    # ------------------------------------------------------------ one operation on both sides

    def _run(self, op: str) -> None:
        """``op`` (a function of the reference module, a method of the implementation) on both sides; the same
        :class:`PhaseReport` or a verdict saying where they differ."""
        before = self.state
        if before is None:  # the rules' preconditions exclude it
            raise HarnessBug(f"{op} without a check in progress")
        out = self.call(op, "", lambda: getattr(tp, op)(before), getattr(self.impl, op))
        if out is None:  # both raised alike (never expected here: no failure is drawn)
            return
        after, got = out
        want = tp.phase_report(op, before, after)
        self.state = after
        if not isinstance(got, tp.PhaseReport):
            self.fail(f"{op} returned a {type(got).__name__}, not a PhaseReport")
        if Capability.SLOT_RELEASE_PATHS not in self.caps:  # who released a slot is not observable: released or not
            want = want.model_copy(update={"commits": tuple(_released(c) for c in want.commits)})
            got = got.model_copy(update={"commits": tuple(_released(c) for c in got.commits)})
        if got.compared() != want.compared():
            self.fail(f"{op}: {_report_difference(got, want)}", check="result")
        if after.phase is Phase.MISMATCHED:
            self._judge(after, f"; {self.impl_name} saw it too ({got.detail or f'after {got.seconds:.1f} s'})")
        if after.phase in (Phase.COMMITTED, Phase.WAITING, Phase.REVOKED):
            self.note(f"check {after.phase.value}")
        if after.phase is Phase.COMMITTED:
            self.count("commits per example")
            for commit in (r.commit for r in after.ranks if r.commit is not None):
                self.note("swa window attached", int(commit.attached))
                self.note("prefetch discarded", int(commit.discarded))
                self.note("insert split", int(commit.insert_split is not None))
            self._judge(after, "")
            commit = next(r.commit for r in after.ranks if r.proceeds)
            if commit is not None:
                self.path = tp.path_after(commit)
            self.pending = None
        elif after.phase is Phase.REVOKED:
            self.pending = None
        elif after.phase is Phase.WAITING:
            self.pending = (after.config.request_pages, tuple(r.progress for r in after.ranks))

    def _judge(self, state: tp.PrefetchState, seen: str) -> None:
        """The reference's own T1-T5 and R5-c on a finished check: a broken one is a verdict naming the finding."""
        try:
            tp.check_tp_prefetch(state)
            tp.check_hit_counts(state)
        except InvariantViolation as err:
            finding = _finding(err, state)
            self.fail(f"the {state.config.variant.value} protocol breaks {err}{seen}\n  known finding: {finding}",
                      check="collective" if err.invariant == "T5" else "invariant",
                      detail={"invariant": err.invariant, "finding": finding.split(" ", 1)[0],
                              "variant": state.config.variant.value})

    # ------------------------------------------------------------ rules: the five operations of a check

    @operation(when=lambda self: self._idle(), data=st.data())
    def sync_prefetch_hit_query(self, data: Any) -> None:
        """Start a check (the request, every rank's progress) and sync the storage hits."""
        waiting = self.state if self.pending is not None else None
        self.note("sync_prefetch_hit_query continued", int(waiting is not None))
        r, ranks = self._draw_check(data)
        config = self.config.check_config(r, self.path)
        described = ("continued, " if waiting else "") + f"R={r}: " + "; ".join(
            f"rank {i}: {_progress_text(p)}" for i, p in enumerate(ranks))
        out = self.call("initial_state", described, lambda: (tp.initial_state(config, ranks, continues=waiting), None),
                        lambda: self.impl.initial_state(r, ranks))
        if out is None:
            return
        self.state = out[0][0]
        self._run("sync_prefetch_hit_query")

    @operation(when=lambda self: self._at("page_transfer"))
    def page_transfer(self) -> None:
        """Every rank's IO thread against the synced hit."""
        self._run("page_transfer")

    @operation(when=lambda self: self._at("can_terminate_prefetch"))
    def can_terminate_prefetch(self) -> None:
        """The termination vote."""
        self._run("can_terminate_prefetch")

    @operation(when=lambda self: self._at("reduce_prefetch_ack"))
    def reduce_prefetch_ack(self) -> None:
        """The packed MIN of the completed count and the sidecar hits."""
        self._run("reduce_prefetch_ack")

    @operation(when=lambda self: self._at("handle_prefetch_result"))
    def handle_prefetch_result(self) -> None:
        """Every terminating rank inserts, commits and releases."""
        self._run("handle_prefetch_result")

    def _at(self, op: str) -> bool:
        return self.state is not None and self.state.phase is _AT[op]

    # ------------------------------------------------------------ the comparison

    @check_after_each_step
    def agrees_with_reference(self) -> None:
        """Every rank's host path and pools equal the reference's; every host slot accounted for once."""
        self.stats.steps += 1
        if self.state is not None and self.state.phase is Phase.MISMATCHED:  # the group is gone (a verdict)
            self.trace.next_step()
            return
        snap = self.snapshot()
        if len(snap.ranks) != self.n:
            self.fail(f"snapshot() has {len(snap.ranks)} ranks, the group {self.n}")
        for i, rank in enumerate(snap.ranks):
            problem = rank.conservation_problem(self.p)
            if problem:
                self.fail(f"rank {i}: {problem}")
            want_path, held = self._expected(i)
            if rank.nodes != want_path:
                self.fail(f"rank {i}'s host path is {_path_text(rank.nodes)}, the reference's "
                          f"{_path_text(want_path)}")
            if (rank.full_held, rank.swa_held) != held:
                self.fail(f"rank {i} holds {rank.full_held} Full and {rank.swa_held} SWA host pages for the prefetch "
                          f"in progress, the reference {held[0]} and {held[1]}")
        self.trace.next_step()

    def _expected(self, i: int) -> tuple[tuple[HostNode, ...], tuple[int, int]]:
        """Rank ``i``'s path and held buffer pages by the reference, now."""
        state = self.state
        if state is None:
            return self.path, (0, 0)
        rank = state.ranks[i]
        holding = state.phase is not Phase.REVOKED and not (state.phase is Phase.COMMITTED and rank.proceeds)
        held = (rank.staged or 0, rank.window or 0) if holding else (0, 0)
        if state.phase is Phase.COMMITTED and rank.commit is not None:
            return tp.path_after(rank.commit), held
        return tuple(state.config.existing), held


#: who releases a slot, as an implementation without ``Capability.SLOT_RELEASE_PATHS`` reports it
_RELEASED = {tp.SlotOwner.RELEASE_QUEUE: tp.SlotOwner.FREED, tp.SlotOwner.IO_THREAD: tp.SlotOwner.FREED}


def _released(commit: tp.RankCommit) -> tp.RankCommit:
    """``commit`` with every released slot ``FREED``, whoever releases it (the tree's and the held ones stay)."""
    return commit.model_copy(update={k: tuple(_RELEASED.get(o, o) for o in getattr(commit, k))
                                     for k in ("full_slots", "swa_slots")})


def _progress_text(p: tp.RankProgress) -> str:
    if not p.registered:
        return "not registered"
    parts = [f"hit {p.storage_hit}", f"loaded {p.full_pages}", "io done" if p.io_done else "io running",
             p.policy.value, "+".join(t.value for t in p.transfers) or "no sidecar"]
    if p.deadline_passed:
        parts.append("deadline passed")
    if p.swa_missing:
        parts.append(f"swa missing {list(p.swa_missing)}")
    if p.mamba_missing:
        parts.append("mamba missing")
    if p.host_free_pages is not None:
        parts.append(f"{p.host_free_pages} host pages free")
    return ", ".join(parts)


def _path_text(path: tuple[HostNode, ...]) -> str:
    return "[" + ", ".join(f"{n.length}{'+swa' if n.swa_host else ''}" for n in path) + "]"


def _report_difference(got: tp.PhaseReport, want: tp.PhaseReport) -> str:
    """The first difference between two reports, in words (the ranks, the values)."""
    if (got.mismatch is None) != (want.mismatch is None) or (
            got.mismatch is not None and want.mismatch is not None
            and got.mismatch.groups() != want.mismatch.groups()):
        seen = f" ({got.detail})" if got.detail else f" (after {got.seconds:.1f} s)"
        mine = "none" if want.mismatch is None else want.mismatch.describe()
        theirs = "none" + seen if got.mismatch is None else got.mismatch.describe() + seen
        return f"mismatched collective: implementation {theirs}; reference {mine}"
    if got.phase != want.phase:
        return f"phase {got.phase.value}, the reference {want.phase.value}"
    if len(got.collectives) != len(want.collectives):
        return (f"{len(got.collectives)} collective(s) {[c.name for c in got.collectives]}, the reference "
                f"{len(want.collectives)} {[c.name for c in want.collectives]}")
    for g, w in zip(got.collectives, want.collectives, strict=True):
        if g != w:
            for rank, (gp, wp) in enumerate(zip(g.packed, w.packed, strict=False)):
                if gp != wp:
                    return (f"collective {w.name}: rank {rank} passed {_packed_text(gp)}, the reference "
                            f"{_packed_text(wp)}")
            return f"collective {w.name}: result {list(g.result)}, the reference {list(w.result)}"
    if got.proceeds != want.proceeds:
        return f"ranks terminating now {list(got.proceeds)}, the reference {list(want.proceeds)}"
    for rank, (gc, wc) in enumerate(zip(got.commits, want.commits, strict=False)):
        if gc != wc:
            fields = [k for k in type(wc).model_fields if getattr(gc, k) != getattr(wc, k)]
            return f"rank {rank}'s commit differs in {', '.join(fields)}: {gc!r}; the reference {wc!r}"
    return f"{got.compared()!r}; the reference {want.compared()!r}"


def _packed_text(p: tp.Packed | None) -> str:
    if p is None:
        return "no call"
    return f"{p.op.value.upper()} {dict(zip(p.layout, p.values, strict=True))}"


def _variant(value: str) -> dict[str, Any]:
    return {"variant": tp.TPPrefetchVariant(value).value}


def _ranks(value: str) -> dict[str, Any]:
    return {"ranks": value}


SUITE = Suite(TPPrefetchMachine, TP_CONFIGS, apply={"variant": _variant, "ranks": _ranks})
