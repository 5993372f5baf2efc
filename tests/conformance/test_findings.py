"""Findings (kvproof.conformance.findings): every verdict carries evidence of what happened, a failure is labelled
with the finding its evidence shows (not its headline), and a run told to ``--accept`` a known finding looks past
each occurrence (the implementation's documented behaviour, followed on the reference), counts it, and fails if it
never occurs."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings

from kvproof.conformance.check import get_suite, replay_vector, run_check
from kvproof.conformance.errors import UsageError
from kvproof.conformance.findings import Evidence, Finding, label, resolve_accepted, unseen
from kvproof.conformance.mutants.swa_allocator import LeakOnFailedAlloc
from kvproof.conformance.plan import ACCEPTED, Impl, plan, run_plan
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.invariants import check_invariants
from kvproof.reference.paged import LEAKED
from kvproof.reference.registry import Component

CONFIG = get_suite(Component.SWA_ALLOCATOR).configs[1]  # P2-W3-F24-S12: the SWA pool runs out first


def _kept_pages(e: Evidence) -> bool:
    d = e.detail
    return (e.op == "alloc_decode" and e.check == "unchanged_on_failure" and not d.get("mapping_entries_changed")
            and bool(d.get("full_pages_taken") or d.get("swa_pages_taken")))


LEAK = Finding("L1", "alloc_decode keeps what each pool with room took (as SGLang 0.5.23, R7)", "test",
               ("swa_allocator", "loc_cache", "decode_prealloc"), _kept_pages, behaviour="non-atomic alloc_decode")


class LeakyDecode(SWATokenToKVPoolAllocator):
    """SGLang 0.5.23's non-atomic ``alloc_decode``, on kvproof's runtime: each pool with room for the new pages takes
    them (from the front of its free list) before the call fails; it declares that as finding L1."""

    findings = (LEAK,)

    def _check_capacity(self, op: str, full_pages: int, swa_pages: int) -> None:
        if op == "alloc_decode":
            pools = (self.full_attn_allocator, self.swa_attn_allocator)
            if any(need > pool.num_free_pages() for pool, need in zip(pools, (full_pages, swa_pages), strict=True)):
                for pool, need in zip(pools, (full_pages, swa_pages), strict=True):
                    if need <= pool.num_free_pages():
                        pool.take_pages(need)
        super()._check_capacity(op, full_pages, swa_pages)


class LeakyDecodeElsewhere(LeakyDecode):
    """Declares L1, but its failed decode also clears the mapping of slot 4: not the documented behaviour."""

    def _check_capacity(self, op: str, full_pages: int, swa_pages: int) -> None:
        try:
            super()._check_capacity(op, full_pages, swa_pages)
        except OutOfMemory:
            if op == "alloc_decode":
                self.full_to_swa_index_mapping[4:8] = 0
            raise


def _run(factory: Any, *, accept: tuple[str, ...] = (), examples: int = 60) -> Any:
    return run_check(Component.SWA_ALLOCATOR, factory, CONFIG, failures_dir=None, isolation="in-process",
                     settings=settings(max_examples=examples, stateful_step_count=30, deadline=None, database=None,
                                       derandomize=True), accept=accept)


def test_a_verdict_carries_the_evidence_of_what_happened() -> None:
    report = _run(LeakyDecode)
    assert not report.passed and report.evidence is not None
    e = Evidence.from_json(report.evidence)
    assert (e.component, e.op, e.check) == ("swa_allocator", "alloc_decode", "unchanged_on_failure")
    assert e.detail["full_pages_taken"] and not e.detail["mapping_entries_changed"]
    assert e.ops[-1] == "alloc_decode" and e.step == len(e.ops)
    assert report.finding == "L1"  # the declared finding, matched by the evidence


def test_the_same_headline_from_another_defect_is_not_the_finding() -> None:
    """An alloc_extend that keeps full pages prints the same headline ("failed with OutOfMemory but changed the
    allocator"): matched by what happened, it is not L1."""
    class Other(LeakOnFailedAlloc):
        findings = (LEAK,)

    report = _run(Other)
    assert report.failure is not None and "failed with OutOfMemory but changed the allocator" in report.failure
    assert report.evidence is not None and report.evidence["op"] == "alloc_extend"
    assert report.finding == "new"


def test_accepting_the_finding_looks_past_every_occurrence_and_counts_them() -> None:
    report = _run(LeakyDecode, accept=("L1",))
    assert report.passed, report.failure
    assert report.accepted["L1"] > 0
    assert report.steps > 1000  # the whole budget, past every occurrence


def test_leaked_pages_are_paired_in_the_order_the_free_lists_handed_them_out() -> None:
    """At P == 1 the free list is soon out of order; the pages a followed failed decode leaked are paired with the
    implementation's in free-list order, not sorted (sorted pairing bound them crosswise and failed this run with
    the finding's own headline: found by a fuzz campaign on SGLang)."""
    config = get_suite(Component.SWA_ALLOCATOR).configs[0]
    assert config.page_size == 1
    report = run_check(Component.SWA_ALLOCATOR, LeakyDecode, config, failures_dir=None, isolation="in-process",
                       settings=settings(max_examples=400, deadline=None, database=None, derandomize=True),
                       accept=("L1",))
    assert report.passed, report.failure
    assert report.accepted["L1"] > 50  # the follower at work many times over (89 under this seed)


def test_an_accepted_finding_does_not_hide_another_behaviour() -> None:
    """The implementation declares L1 but its failed decode also writes the mapping: not followed, still a verdict."""
    report = _run(LeakyDecodeElsewhere, accept=("L1",))
    assert not report.passed and report.finding == "new"
    assert "changed the allocator" in (report.failure or "")


class LeakyDecodeShortFree(LeakyDecode):
    """L1, and a ``free`` that forgets the first slot it is given (a second, new defect)."""

    def free(self, free_index: Any) -> None:
        super().free(free_index[1:])


def test_a_vector_of_a_run_that_accepted_replays_with_the_acceptance() -> None:
    """The machine options of a vector carry ``accept``: a new failure found by a run that looked past L1 replays
    past L1 too, to the same verdict."""
    failing = _run(LeakyDecodeShortFree, accept=("L1",))
    assert not failing.passed and failing.vector is not None and failing.finding == "new"
    assert list(failing.vector["machine_options"]["accept"]) == ["L1"]
    replayed = replay_vector(failing.vector, LeakyDecodeShortFree, isolation="in-process")
    assert replayed.failure is not None and "changed the allocator" not in replayed.failure
    verdict = failing.failure.split("\n")[1].strip() if failing.failure else ""
    assert verdict and verdict in replayed.failure


def test_nothing_is_accepted_unless_asked_and_only_declared_followable_findings() -> None:
    assert not _run(LeakyDecode).passed  # nothing hidden by default
    with pytest.raises(UsageError, match="L2 is not a finding this implementation declares"):
        _run(LeakyDecode, accept=("L2",))
    unfollowable = Finding("L3", "t", "test", ("swa_allocator",), lambda e: True)
    with pytest.raises(UsageError, match="no documented behaviour the suite can follow"):
        resolve_accepted(("L3",), (unfollowable,), "swa_allocator", ("non-atomic alloc_decode",))


def test_an_accepted_finding_that_never_occurs_fails_the_run() -> None:
    """Strict: the runtime itself never leaks, so a plan that accepts L1 for it fails with an outcome saying so."""
    impl = Impl("tests:LeakyDecode", LeakyDecode, (Component.SWA_ALLOCATOR,))
    the_plan = plan((Component.SWA_ALLOCATOR,), (impl,), (CONFIG.label(),), None, {}, accept=("L1",))
    assert the_plan.accepted == ((Component.SWA_ALLOCATOR, "L1"),)
    assert unseen(("L1",), [{"L1": 0}, {}]) == ["L1"] and unseen(("L1",), [{"L1": 2}]) == []
    honest = Impl("runtime", type("Honest", (SWATokenToKVPoolAllocator,), {"findings": (LEAK,)}),
                  (Component.SWA_ALLOCATOR,))
    outcomes, _ = run_plan(plan((Component.SWA_ALLOCATOR,), (honest,), (CONFIG.label(),), None, {},
                                accept=("L1",)), profile="dev", isolation="in-process")
    strict = [o for o in outcomes if o.config == ACCEPTED]
    assert len(strict) == 1 and strict[0].status == "failed" and "never occurred" in strict[0].reason
    with pytest.raises(UsageError, match="no component of this run can look past it"):
        plan((Component.SWA_ALLOCATOR,), (impl,), (), None, {}, accept=("F9",))


def test_labels() -> None:
    e = Evidence("swa_allocator", "alloc_decode", "unchanged_on_failure", 3, ("a", "b", "alloc_decode"),
                 {"full_pages_taken": [2], "mapping_entries_changed": 0})
    assert label(e, (LEAK,)) == "L1"
    assert label(Evidence("swa_allocator", "free", "state", 1, detail={"finding": "S3"}), (LEAK,)) == "S3"
    assert label(Evidence("swa_allocator", "free", "state", 1), (LEAK,)) == "new"
    assert label(None, (LEAK,)) == "-"
    assert Evidence.from_json(e.to_json()) == e


# ---------------------------------------------------------------- the reference side of the followed behaviour


def test_the_reference_leaks_what_upstreams_failed_decode_keeps() -> None:
    """SGLang's F1 reproduction in reference terms: 8 tokens fill the 2-page SWA pool; decoding the 9th fails and
    the full pool's page is gone for good (owned by nobody), the invariants still hold, ``clear`` gives it back."""
    c = PoolConfig(size_full=16, size_swa=8, page_size=4, sliding_window_size=3)
    s, slots = ref.alloc_extend(ref.initial_state(c), [0], [8], [-1], 8, owners=[1])
    with pytest.raises(OutOfMemory):
        ref.alloc_decode(s, [9], [slots[-1]])
    leaked = ref.leak_failed_alloc_decode(s, [9], [slots[-1]])
    assert (ref.full_available_size(leaked), ref.swa_available_size(leaked)) == (4, 0)
    assert leaked.full.owner.count(LEAKED) == 1 and leaked.swa.owner.count(LEAKED) == 0
    check_invariants(leaked)
    released = ref.free(leaked, list(slots))
    check_invariants(released)
    assert ref.full_available_size(released) == 12 and ref.full_available_size(ref.clear(released)) == 16
    with pytest.raises(InvalidOperation, match="no failure to follow"):
        ref.leak_failed_alloc_decode(ref.initial_state(c), [1], [-1])


def test_a_failure_is_labelled_the_moment_it_is_first_seen(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first-seen failure file (what a campaign stopped before shrinking ends reports) names the finding the
    verdict's evidence shows; before, such a failure read as ``new`` whatever it was."""
    from kvproof.conformance import saved

    written: list[str] = []
    real = saved.FailureFile.write

    def record(self: Any, text: str, vector: Any) -> Any:
        written.append(text)
        return real(self, text, vector)

    monkeypatch.setattr(saved.FailureFile, "write", record)
    report = run_check(Component.SWA_ALLOCATOR, LeakyDecode, CONFIG, failures_dir=tmp_path, isolation="in-process",
                       settings=settings(max_examples=60, stateful_step_count=30, deadline=None, database=None,
                                         derandomize=True))
    assert not report.passed and report.finding == "L1"
    assert written[0].startswith(saved.FIRST_SEEN)
    assert "known finding: L1 (matched by the verdict's evidence)" in written[0]
