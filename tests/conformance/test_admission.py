"""The prefill-scheduler simulation: ``corrected`` holds on every config; S8 and S9 are found and shrunk."""

from __future__ import annotations

import re

import pytest
from hypothesis import settings

from kvproof.conformance.admission import ADMISSION_CONFIGS, STARVATION_BOUND
from kvproof.conformance.check import get_suite, run_check
from kvproof.conformance.profiles import get_profile
from kvproof.gpu_runtime.admission import AdmissionRuntime
from kvproof.reference.admission import AdmissionConfig, AdmissionPolicy, AdmissionSetup, Node, SwaValue
from kvproof.reference.registry import info, options

from ..devices import DEVICES
from .runtime_runs import group, planned, runtime_run

IDS = [c.label() for c in ADMISSION_CONFIGS]
LONG_TOMBSTONE = next(c for c in ADMISSION_CONFIGS if c.name == "long_tombstone")


def _steps(failure: str) -> list[str]:
    """The numbered operations of a verdict's trace."""
    trace = failure.split("operations so far:")[1].split("\n\n")[0]
    return re.findall(r"^\s+\d+\. (\w+)\(", trace, flags=re.M)


@group("admission")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", ADMISSION_CONFIGS, ids=IDS)
def test_corrected_holds_on_the_runtime(config, device: str) -> None:
    assert all(test.options["policy"] == AdmissionPolicy.CORRECTED.value for test in planned("admission"))
    report = runtime_run("admission", config, device)  # under the registry's default budget, corrected
    assert report.passed, report.failure
    for rule in ("add_one_req", "prepare_for_extend", "evict", "cache_finished_req", "misuse"):
        assert report.rules[rule] > 0, rule
    if config.config.chunk_size is not None:  # chunks are cached and continued
        for rule in ("cache_unfinished_req", "add_chunked_req", "misuse:add_chunked_req:not_chunked"):
            assert report.rules[rule] > 0, rule
    assert report.outcomes.get("InvalidOperation", 0) > 0  # misuse rejected alike


def test_the_configs_cover_tombstones_shorter_equal_and_longer_than_the_window() -> None:
    kinds = set()
    for setup in ADMISSION_CONFIGS:
        w = setup.config.sliding_window
        for n in setup.nodes:
            if n.swa.value == "host":
                kinds.add("<" if n.length < w else "=" if n.length == w else ">>" if n.length >= 4 * w else ">")
    assert {"<", "=", ">>"} <= kinds
    assert any(setup.config.sliding_window % setup.config.page_size for setup in ADMISSION_CONFIGS)
    assert any(setup.config.chunk_size is None for setup in ADMISSION_CONFIGS)
    # a chunk that is no page multiple: a continuation ends inside a page
    assert any(setup.config.chunk_size and setup.config.chunk_size % setup.config.page_size
               for setup in ADMISSION_CONFIGS)


def test_pre_27391_runs_out_after_admission_s8_shrunk() -> None:
    """S8: the pre-#27391 budget admits a request whose load-back does not fit, in 4 steps."""
    report = run_check("admission", AdmissionRuntime, LONG_TOMBSTONE, profile="ci", failures_dir=None,
                       impl_name="runtime", policy="pre_27391")
    failure = report.failure or ""
    print(failure.split("Failing test case")[0])
    assert "A1 violated: add_one_req admitted request 0" in failure, failure
    assert "the pre_27391 budget does not count what load-back allocates: S8" in failure
    assert _steps(failure) == ["arrive", "get_new_batch_prefill", "match_prefix_for_req", "add_one_req"]


def test_upstream_27391_starves_a_request_that_fits_the_empty_pool_s9_shrunk() -> None:
    """S9: a host tombstone longer than the pool in the window: refused in every idle round, 8 steps."""
    report = run_check("admission", AdmissionRuntime, LONG_TOMBSTONE, profile="ci", failures_dir=None,
                       impl_name="runtime", policy="upstream_27391")
    failure = report.failure or ""
    print(failure.split("Failing test case")[0])
    assert f"was refused in {STARVATION_BOUND} idle rounds" in failure, failure
    assert "although it fits the empty pool" in failure
    assert "(S9: the budget charges the window's host tombstones whole" in failure
    assert failure.split("operations so far")[0].rstrip().endswith("policy upstream_27391)")
    assert "24 of them host tombstones" in failure
    round_ = ["get_new_batch_prefill", "match_prefix_for_req", "add_one_req"]
    assert _steps(failure) == ["arrive", *round_, "prepare_for_extend", *round_]


def test_upstream_0523_starves_too_and_corrected_does_not_on_the_same_config() -> None:
    report = run_check("admission", AdmissionRuntime, LONG_TOMBSTONE, profile="dev", failures_dir=None,
                       policy="upstream_0523")
    assert "(S9: the budget charges the window's host tombstones whole" in (report.failure or "")
    assert run_check("admission", AdmissionRuntime, LONG_TOMBSTONE, profile="dev", failures_dir=None,
                     policy="corrected").passed


#: A window of 3 pages, an 8-token host tombstone (4 pages), 8 pages: pre_27391 admits a long prompt (budget
#: max(8, 6) + 2 = 10 < 16), its load-back takes 4 pages and its first chunk the other 4.
DEADLOCK = AdmissionSetup(name="deadlock", config=AdmissionConfig(page_size=2, sliding_window=6, swa_pages=8,
                                                                  chunk_size=8),
                          nodes=(Node(parent=-1, length=8, full_on_device=True, swa=SwaValue.HOST),))


def test_a_continuation_deferred_with_nothing_else_holding_swa_is_a_deadlock() -> None:
    """pre_27391 over-admits: after the first chunk (8 own tokens, 1 page freed out of the window) the request holds 3
    pages and locks 4: rem_swa_tokens 2, available_chunk_tokens min(8, 2 - 2) = 0 in every round, nothing else to
    finish. corrected refuses that admission and passes.

    pre_27391 has a second bug on this config (two requests alive: the second's chunk does not fit after its
    load-back, A1 / S8's shape), which the derandomized ``ci`` run meets first; the deadlock is searched for with the
    same budget from seed 0 (the same seed, the same examples)."""
    first = run_check("admission", AdmissionRuntime, DEADLOCK, profile="ci", failures_dir=None, policy="pre_27391",
                      shrink_with="vector")  # which bug comes first, not how short: the faster shrinker
    assert "A1 violated: 'Prefill out of memory'" in (first.failure or ""), first.failure
    report = run_check("admission", AdmissionRuntime, DEADLOCK, failures_dir=None, policy="pre_27391", seed=0,
                       settings=settings(get_profile("ci"), derandomize=False))
    failure = report.failure or ""
    print(failure.split("Failing test case")[0])
    assert f"was deferred in {STARVATION_BOUND} rounds in which nothing else held SWA" in failure, failure
    assert "(deadlock, policy pre_27391)" in failure and "holding 3 SWA pages" in failure
    continuation = ["get_new_batch_prefill", "add_chunked_req"]
    assert _steps(failure) == ["arrive", "get_new_batch_prefill", "match_prefix_for_req", "add_one_req",
                               "prepare_for_extend", "cache_unfinished_req", *continuation, "prepare_for_extend",
                               *continuation]
    assert run_check("admission", AdmissionRuntime, DEADLOCK, profile="ci", failures_dir=None,
                     policy="corrected").passed


def test_the_budget_option_is_declared_once_and_maps_to_both_sides() -> None:
    """``--budget`` of admission comes from the registry; decode_prealloc's ``--policy`` values never reach it."""
    (option,) = info("admission").options
    assert option.name == "budget" and set(option.choices) == {p.value for p in AdmissionPolicy}
    assert {o.name for o in options()} == {"policy", "budget", "variant", "ranks"}
    suite = get_suite("admission")
    assert suite.options({"budget": "upstream_27391"}) == {"policy": "upstream_27391"}
    assert suite.options({"policy": "upstream"}) == {"policy": "corrected"}  # decode_prealloc's option: not ours
    assert LONG_TOMBSTONE.with_policy("upstream_27391").config.policy is AdmissionPolicy.UPSTREAM_27391
    from kvproof.conformance.errors import UsageError

    with pytest.raises(UsageError, match="choose one of"):
        suite.options({"budget": "upstream"})
