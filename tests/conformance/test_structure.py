"""Structural coverage (issue 14): for every component, a ``ci`` run of its default configs against kvproof's runtime
takes each structural dimension its suite declares (batch sizes, requests alive, pools full, restore and remap
cycles, each misuse case, ...) to its maximum on at least one config, and runs every rule declared on each config
outside a misuse case; and the measurement can fail: a suite whose strategies cannot reach a dimension is reported
as below its maximum.

The runs are the plan ``kvproof conform --component <c>`` makes (the registry's default implementation and options),
shared with each component's own conformance test (:mod:`tests.conformance.runtime_runs`).
"""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st

from kvproof.conformance import swa_allocator as swa_suite
from kvproof.conformance.check import Suite, get_suite, run_check, structure_targets, structure_unreached
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.lockstep import operation
from kvproof.conformance.plan import load_impls, plan
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.swa_allocator import SWAAllocatorMachine
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference.contract import Capability
from kvproof.reference.registry import Component, Layer, info

from .runtime_runs import default_run, group, planned

WITH_SUITES = [c.value for c in Component if info(c).has(Layer.SUITE)]
WITH_MISUSE = [c for c in WITH_SUITES if get_suite(c).misuse_cases]


@pytest.mark.parametrize("component", [pytest.param(c, marks=group(c)) for c in WITH_SUITES])
def test_ci_reaches_every_declared_dimension(component: str) -> None:
    reports = []
    for test in planned(component):  # the runs each component's conformance test asserts on (runtime_runs)
        report = default_run(component, test.config)
        assert report.passed, report.failure
        # a rule declared on a config runs there as itself (an implementation that rejects no misuse, as SGLang's,
        # calls it no other way); one with nothing to act on there is declared off it (Operation.on)
        assert report.never_run == (), f"{test.test_id}: rules never executed: {report.never_run}"
        reports.append(report)
    declared = {d for r in reports for d in r.structure_targets}
    assert declared, f"{component} declares no structural dimension"
    # every misuse case the suite declares is a dimension (decode_prealloc and tp_prefetch declare none)
    assert {f"misuse {name}" for name in get_suite(component).misuse_cases} <= declared | {
        f"misuse {n}" for r in reports for n in get_suite(component).misuse_cases if f"misuse:{n}" in r.not_applicable}
    assert len(declared) >= 5, declared
    assert structure_unreached(reports) == {}, structure_unreached(reports)


@pytest.mark.parametrize("component", WITH_MISUSE)
def test_every_misuse_case_declared_on_a_config_is_staged_there(component: str) -> None:
    """A misuse case is a fact about a config: it can be staged there or it cannot (``release_batch:unaligned_start``
    needs a page of P > 1, ``cache_finished_req:prompt_left`` a chunk size). So unlike the other dimensions, which
    may be reached on one config for all, every misuse case a config declares reachable is staged on that config:
    here by the breadth driver (60 examples of up to 50 steps from seed 0, then seeds 1 and 2 for what is still
    missing; a case counts once any of them staged it), which reached every one in a 20-minute campaign but those a
    config cannot stage. A case declared where it cannot be staged is reported below its maximum on every run of
    that config, for ever."""
    budget = settings(get_profile("ci"), max_examples=60, stateful_step_count=50)
    missed = {}
    for test in plan((component,), load_impls(()), (), None, {}).tests:
        below: set[str] | None = None
        for seed in range(3):
            report = run_check(test.component, test.impl.factory, test.config, settings=budget,
                               impl_name=test.impl.spec, failures_dir=None, isolation="in-process", engine="breadth",
                               seed=seed, **test.options)
            assert report.passed, report.failure
            assert any(d.startswith("misuse ") for d in report.structure_targets), test.config.label()
            now = {d for d in report.structure_missed() if d.startswith("misuse ")}
            below = now if below is None else below & now
            if not below:
                break
        if below:
            missed[test.config.label()] = sorted(below)
    assert missed == {}, missed


class NarrowAllocations(SWAAllocatorMachine):
    """The ``swa_allocator`` rules with ``alloc_extend`` narrowed to one request of one token: batches of 2 and 3 and
    a request as long as the SWA pool are out of its reach."""

    @operation(data=st.data())
    def alloc_extend(self, data: object) -> None:
        self._extend("alloc_extend", [(self._new_rid(), 0, 1)])


def test_a_narrow_strategy_is_reported_below_its_maximum(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(swa_suite, "SUITE", Suite(NarrowAllocations, CONFORMANCE_CONFIGS[:1]))
    get_suite.cache_clear()  # the suites are looked up once per process
    try:
        report = run_check(Component.SWA_ALLOCATOR, SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS[0], profile="dev",
                           impl_name="runtime", failures_dir=None)
    finally:
        monkeypatch.undo()
        get_suite.cache_clear()
    missed = report.structure_missed()
    assert missed["alloc_extend batch size"] == (1, 3), missed
    assert structure_unreached([report])["alloc_extend batch size"] == (1, 3)


class AllocOnly(SWATokenToKVPoolAllocator):
    """kvproof's runtime declaring no rule that grows a request (``alloc_extend``, ``alloc_decode``, the tail
    extension): SGLang 0.5.23's allocator at page size 1 has no ``alloc_extend``, and so the same rules."""

    capabilities = SWATokenToKVPoolAllocator.capabilities - {
        Capability.ALLOC_EXTEND, Capability.ALLOC_DECODE, Capability.ALLOC_EXTEND_SWA_TAIL}


def test_a_dimension_only_missing_rules_take_to_its_maximum_is_declared_with_what_the_others_reach() -> None:
    """Without a rule that grows a request, one ``alloc`` (1-4 pages) is the longest a request gets: that is the
    maximum the run is held to, not the SWA pool's 8 pages it can never reach (and is reported below for ever)."""
    suite, config = get_suite("swa_allocator"), CONFORMANCE_CONFIGS[0]  # P1-W3-F12-S8: the SWA pool has 8 pages
    caps = frozenset(AllocOnly.capabilities)
    na = suite.machine.not_applicable(caps, config)
    assert {"alloc_extend", "alloc_decode", "alloc_extend_swa_tail"} <= set(na) and "alloc" not in na
    assert structure_targets(suite, config, caps, na)["full pages of one request"] == 4
    everything = frozenset(SWATokenToKVPoolAllocator.capabilities)
    assert structure_targets(suite, config, everything, ())["full pages of one request"] == 8
    # one growing rule left is enough for the whole pool
    for kept in (Capability.ALLOC_EXTEND, Capability.ALLOC_DECODE):
        some = caps | {kept}
        assert structure_targets(suite, config, some, suite.machine.not_applicable(some, config))[
            "full pages of one request"] == 8, kept
    report = run_check(Component.SWA_ALLOCATOR, AllocOnly, config, profile="ci", impl_name="alloc-only",
                       failures_dir=None)
    assert report.passed, report.failure
    assert report.structure["full pages of one request"] == 4
    assert "full pages of one request" not in report.structure_missed(), report.structure_missed()
