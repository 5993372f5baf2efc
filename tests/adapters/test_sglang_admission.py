"""SGLang 0.5.23's real prefill adder behind ``admission``: importable without SGLang, and, where SGLang is installed
(``.venv-sglang``: ``make sglang``), the real ``PrefillAdder`` / ``SWAPrefillBudget`` / ``SWATokenToKVPoolAllocator``
driven in lockstep with the reference's ``upstream_0523`` policy on every admission config, the budget functions
compared with the reference's on their own (the decision arithmetic, without the scheduler around it), and one test
per documented finding (docs/sglang-findings.md, "admission: SGLang's prefill adder").

Tests that need SGLang are skipped with one reason, naming the install command, when it is not importable.
"""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproof.conformance.adapters import sglang_admission as adapter
from kvproof.conformance.adapters import sglang_findings
from kvproof.conformance.adapters.sglang import import_sglang_modules
from kvproof.conformance.admission import ADMISSION_CONFIGS
from kvproof.conformance.check import run_check
from kvproof.reference import admission as ad
from kvproof.reference.contract import AdmissionSystemUnderTest
from kvproof.reference.errors import ConfigError

SKIP_REASON = f"SGLang is not installed here; install it with: {adapter.INSTALL_HINT}"
needs_sglang = pytest.mark.skipif(not adapter.sglang_available(), reason=SKIP_REASON)
Policy = ad.AdmissionPolicy
BY_NAME = {setup.name: setup for setup in ADMISSION_CONFIGS}
#: what a ``ci`` lockstep run of each config ends with: a pass, or the documented finding it stops at
EXPECTED = {"shared": None, "page_edge": None, "unaligned_chunk": None, "long_tombstone": "F4", "no_chunk": "F4",
            "host_prefix": "F5"}


# ---------------------------------------------------------------- without SGLang (any venv)


def test_importing_the_admission_adapter_does_not_import_sglang() -> None:
    code = ("import sys, kvproof.conformance.adapters.sglang_admission; "
            "assert 'sglang' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("policy", [p for p in Policy if p is not Policy.UPSTREAM_0523])
def test_only_the_upstream_0523_budget(policy: Policy) -> None:
    with pytest.raises(ConfigError, match="run with --budget upstream_0523"):
        adapter.SGLangAdmission(ADMISSION_CONFIGS[0].with_policy(policy))


def test_every_config_has_an_expected_outcome() -> None:
    assert set(EXPECTED) == set(BY_NAME)


def test_classify_names_f4_and_f5_by_the_reason_not_the_headline() -> None:
    """Both are liveness verdicts with the same headline; the evidence's reason and policy tell them apart."""
    from kvproof.conformance.findings import Evidence

    def starved(reason: str, policy: str = "upstream_0523") -> Evidence:
        return Evidence("admission", "add_one_req", "liveness", 8, detail={"reason": reason, "policy": policy})

    assert sglang_findings.classify(starved("tombstones_charged_whole")).id == "F4"
    assert sglang_findings.classify(starved("selection_pin")).id == "F5"
    # the same reasons under another policy are not SGLang 0.5.23's, and a plain divergence is new
    assert sglang_findings.classify(starved("tombstones_charged_whole", "upstream_27391")) is None
    assert sglang_findings.classify(Evidence("admission", "add_one_req", "state", 8)) is None


# ---------------------------------------------------------------- with SGLang


@pytest.fixture(scope="module")
def sched() -> adapter.SGLangSchedulerModules:
    return adapter.load_sglang_scheduler()


@needs_sglang
def test_the_adapter_drives_the_real_classes(sched: adapter.SGLangSchedulerModules) -> None:
    impl = adapter.SGLangAdmission(BY_NAME["shared"].with_policy(Policy.UPSTREAM_0523))
    assert isinstance(impl, AdmissionSystemUnderTest)
    assert type(impl.allocator) is sched.SWATokenToKVPoolAllocator
    assert impl.allocator.size_swa == 10 * 2 and impl.free_count() == 10 - 2 - 2  # nodes 0 and 2 hold 4 pages
    rid = impl.arrive(13, 2, 2)
    impl.get_new_batch_prefill()
    assert type(impl.adder) is sched.PrefillAdder
    assert type(impl.adder.memory_budget).__name__ == "SWAPrefillBudget"
    impl.match_prefix_for_req(rid)  # SGLang's own Req.init_next_round_input adopts the stand-in's match
    req = impl.requests[rid].req
    assert type(req) is sched.Req and (req.prefix_len, req.host_hit_length, req.swa_host_hit_length) == (10, 0, 0)
    assert impl.add_one_req(rid) in set(ad.AddReqResult)
    impl.prepare_for_extend()
    ad.check_admission_snapshot(impl.snapshot())


@needs_sglang
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_lockstep_with_the_reference_ends_as_documented(sched: adapter.SGLangSchedulerModules, name: str) -> None:
    """Every step of a ``ci`` run agrees with ``upstream_0523``; the runs that fail stop at the documented finding
    (a property both sides break alike), never at a divergence."""
    report = run_check("admission", adapter.SGLangAdmission, BY_NAME[name], profile="ci", failures_dir=None,
                       policy="upstream_0523", isolation="in-process")
    assert report.steps > 0
    if EXPECTED[name] is None:
        assert report.passed, report.failure
        assert report.calls.get("add_one_req", 0) > 0 and report.calls.get("prepare_for_extend", 0) > 0
        if name == "unaligned_chunk":  # chunks continued through SGLang's own add_chunked_req
            assert report.calls.get("add_chunked_req", 0) > 0 and report.calls.get("cache_unfinished_req", 0) > 0
    else:
        finding = sglang_findings.classify(report.evidence)
        assert finding is not None and finding.id == EXPECTED[name] == report.finding, report.failure


@needs_sglang
@pytest.mark.parametrize("name", ["long_tombstone", "host_prefix", "no_chunk"])
def test_looking_past_f4_and_f5_runs_the_whole_budget(sched: adapter.SGLangSchedulerModules, name: str) -> None:
    """``--accept F4 --accept F5``: each starved request is set aside on both sides (both refused it alike) and the
    run serves the requests behind it, to its whole ``ci`` budget; each occurrence is counted."""
    report = run_check("admission", adapter.SGLangAdmission, BY_NAME[name], profile="ci", failures_dir=None,
                       policy="upstream_0523", isolation="in-process", accept=("F4", "F5"))
    assert report.passed, report.failure
    assert report.accepted[EXPECTED[name]] > 0 and report.steps > 1000, (report.accepted, report.steps)


@needs_sglang
def test_f4_a_window_tombstone_longer_than_the_pool_is_refused_in_every_round(sched: Any) -> None:
    seen = sglang_findings.reproduce_window_tombstone_starves()
    assert seen["remaining_swa"] == seen["size_swa"] == 16  # an empty, idle pool
    assert seen["verdicts"] == [(False, None)] * 3, "SGLang now admits the request: update F4"
    assert seen["with_window_capped_host_hit"] == (True, 8)  # what a window-capped host hit would admit


@needs_sglang
def test_f5_the_selection_pin_refuses_in_every_round_what_fits(sched: Any) -> None:
    seen = sglang_findings.reproduce_selection_pin_starves()
    assert seen["pinned"] == [("NO_TOKEN", 16, False)] * 3, "SGLang now admits the request: update F5"
    assert seen["unpinned"][2], seen  # without the pin of the device match the same request is admitted


# ---- the decision arithmetic on its own: the reference's functions against SWAPrefillBudget's ---------------


class _Tree:
    """What ``SWAPrefillBudget`` reads of a tree: its window and what is evictable."""

    def __init__(self, window: int, swa_evictable: int) -> None:
        self.sliding_window_size, self._swa = window, swa_evictable

    def supports_mamba(self) -> bool:
        return False

    def full_evictable_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return self._swa


@st.composite
def budget_cases(draw: st.DrawFn) -> dict[str, Any]:
    p = draw(st.sampled_from((1, 2, 4, 16)))
    pages = draw(st.integers(1, 12))
    return {"p": p, "w": draw(st.integers(1, 40)), "pages": pages, "free": draw(st.integers(0, pages)),
            "evictable": draw(st.integers(0, 4 * pages * p)), "offset": draw(st.integers(0, 3 * pages * p)),
            "e": draw(st.integers(1, 6 * pages * p)), "m": draw(st.integers(0, 40)),
            "h": draw(st.sampled_from((0, 0, p, 3 * p, pages * p, 5 * pages * p))),
            "chunk": draw(st.one_of(st.none(), st.integers(1, 4 * pages * p)))}


def _budget(case: dict[str, Any]) -> Any:
    a = sglang_findings._sglang_allocator(size=1 << 12, size_swa=case["pages"] * case["p"], page_size=case["p"])
    taken = case["pages"] - case["free"]
    if taken:
        a.swa_attn_allocator.alloc(taken * case["p"])
    budget = a.create_prefill_budget(_Tree(case["w"], case["evictable"]))
    budget.swa_offset = case["offset"]
    return budget


@needs_sglang
@settings(max_examples=300, deadline=None, derandomize=True)
@given(case=budget_cases())
def test_estimate_check_and_reserve_agree_with_swaprefillbudget(sched: Any, case: dict[str, Any]) -> None:
    """``estimate_swa_kv_tokens``, ``check_prefill`` (with the never-fits chunk cap) and ``reserve`` of the real
    ``SWAPrefillBudget`` over the real allocator equal the reference's, on any numbers."""
    (prefill_budget,) = import_sglang_modules("sglang.srt.mem_cache.prefill_budget")
    p, w, e, m, h, chunk = case["p"], case["w"], case["e"], case["m"], case["h"], case["chunk"]
    assert ad.estimate_swa_kv_tokens(e, m, window=w, page_size=p, allocation_limit=chunk, host_hit_length=h) == \
        prefill_budget.estimate_swa_kv_tokens(e, m, sliding_window_size=w, page_size=p, allocation_limit=chunk,
                                              host_hit_length=h)
    budget = _budget(case)
    remaining = int(budget.remaining_swa)
    assert remaining == (case["free"] * p + case["evictable"]) - case["offset"]
    config = ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=case["pages"], chunk_size=None,
                                policy=Policy.UPSTREAM_0523)
    theirs = budget.check_prefill(extend_input_len=e, total_tokens=1, max_new_tokens=m, input_tokens=e,
                                  swa_host_hit_length=h, chunk_limit=chunk)
    assert ad.check_prefill(config, e, m, h, remaining, chunk) == theirs
    adder = ad.PrefillAdder(rem_swa_token_offset=case["offset"], rem_chunk_tokens=chunk)
    ours = ad.update_prefill_budget(adder, config, e, m).rem_swa_token_offset
    budget.reserve(-(-e // p) * p, m, chunk_limit=chunk)
    assert ours == budget.swa_offset


@needs_sglang
def test_can_allocate_prefill_admits_at_equality_where_check_prefill_does_not(sched: Any) -> None:
    """upstream_0523_vllm_fuzz.md §1.2: ``can_allocate_prefill`` (the continuation and ignore-EOS paths) tests
    ``needed <= remaining_swa``, ``check_prefill`` ``needed < remaining_swa``. Recorded, not a defect: ``needed``
    already carries the page of allocation overhead. A release that aligns the two makes this fail."""
    case = {"p": 2, "w": 4, "pages": 8, "free": 8, "evictable": 0, "offset": 4, "e": 2, "m": 0, "h": 0, "chunk": 8}
    budget = _budget(case)
    needed = ad.estimate_swa_kv_tokens(2, 0, window=4, page_size=2, allocation_limit=8)  # 0 + 2 + 2
    budget.swa_offset = 16 - needed  # remaining_swa == needed
    assert int(budget.remaining_swa) == needed == 4
    assert budget.check_prefill(extend_input_len=2, total_tokens=1, max_new_tokens=0, input_tokens=2,
                                swa_host_hit_length=0, chunk_limit=8) == (False, None)
    assert budget.can_allocate_prefill(paged_input=2, extend_input_len=2, max_new_tokens=0, chunk_limit=8)
