"""The ``tp_prefetch`` lockstep suite against real rank processes: ``upstream_0523`` holds on every config at world
sizes 2-4; S10 (``pre_27264``) and T5 (ranks that differ) are found and shrunk; the mutants are killed for the right
reason, and the arithmetic ones have Z3 twins; no rank process outlives the run."""

from __future__ import annotations

import functools
import re
import time

import pytest
from hypothesis import Phase, settings

from kvproof import spec
from kvproof.conformance.check import MutantVerdict, kill_mutants, mutants_of, run_check
from kvproof.conformance.mutants.tp_prefetch import MUTANTS
from kvproof.conformance.profiles import get_profile
from kvproof.conformance.tp_prefetch import TP_CONFIGS
from kvproof.gpu_runtime.tp_prefetch import TPPrefetchRuntime
from kvproof.reference.registry import info, options

from .runtime_runs import default_run, group, planned

pytestmark = group("tp_prefetch")  # rank processes ("ranks"): one worker at a time on the 2-core machine

IDS = [c.label() for c in TP_CONFIGS]
PAIR, TRIO = TP_CONFIGS[0], TP_CONFIGS[1]


def _steps(failure: str) -> list[str]:
    trace = failure.split("operations so far:")[1].split("\n\n")[0]
    return re.findall(r"^\s+\d+\. (\w+)\(", trace, flags=re.M)


@pytest.fixture(autouse=True)
def _nothing_left(no_rank_left: None) -> None:
    """Runs are isolated in a child process: its rank processes end with it (checked after every test)."""


def test_the_registry_declares_the_options() -> None:
    names = {o.name: o for o in info("tp_prefetch").options}
    assert names["variant"].default == "upstream_0523" and names["ranks"].default == "agree"
    assert {o.name for o in options()} >= {"variant", "ranks"}


def test_the_configs_cover_world_sizes_and_window_shapes() -> None:
    assert {c.world_size for c in TP_CONFIGS} == {2, 3, 4}
    assert any(c.sliding_window % c.page_size for c in TP_CONFIGS)  # a window that is no page multiple
    assert any(n.swa_host for c in TP_CONFIGS for n in c.existing)  # an SWA host value on the path
    assert any(not n.swa_host for c in TP_CONFIGS for n in c.existing)  # a tombstone a commit can fill
    assert any(c.anchor_is_root and c.sw_pages > 1 for c in TP_CONFIGS)  # short requests at the root (#34798)


@pytest.mark.parametrize("config", TP_CONFIGS, ids=IDS)
def test_upstream_0523_holds_on_the_runtime(config) -> None:
    assert all(test.options == {"variant": "upstream_0523", "ranks": "agree"} for test in planned("tp_prefetch"))
    report = default_run("tp_prefetch", config)  # shared with test_structure: both in group("tp_prefetch")
    assert report.passed, report.failure
    for rule in ("sync_prefetch_hit_query", "page_transfer", "can_terminate_prefetch", "reduce_prefetch_ack",
                 "handle_prefetch_result"):
        assert report.rules[rule] > 0, rule
    assert report.calls["initial_state"] > report.calls["handle_prefetch_result"]  # some checks end waiting


def test_pre_27264_attaches_different_windows_s10_shrunk() -> None:
    """S10: only the completed count is synced, so a rank whose window arrived attaches it while another drops it;
    found on real ranks and shrunk to one check."""
    report = run_check("tp_prefetch", TPPrefetchRuntime, PAIR, profile="ci", impl_name="runtime", failures_dir=None,
                       variant="pre_27264")
    failure = report.failure or ""
    assert "the pre_27264 protocol breaks [T1]" in failure, failure
    assert "known finding: S10" in failure
    assert _steps(failure) == ["initial_state", "page_transfer", "can_terminate_prefetch", "reduce_prefetch_ack",
                               "handle_prefetch_result"]


def test_ranks_with_different_transfer_sets_mismatch_t5_within_the_bound() -> None:
    """``--ranks mixed``: ranks with and without a trailing-pages transfer pack hit queries of different lengths; the
    verdict names each rank's shape and how the real group failed, and comes in bounded time."""
    # no shrinking: the mismatch is the example's first operation, and every attempt to shrink it aborts the real
    # group and starts a new one (seconds each)
    start = time.monotonic()
    report = run_check("tp_prefetch", TPPrefetchRuntime, TRIO, impl_name="runtime", failures_dir=None,
                       settings=settings(get_profile("dev"), phases=(Phase.explicit, Phase.reuse, Phase.generate)),
                       ranks="mixed")
    seconds = time.monotonic() - start
    failure = report.failure or ""
    assert "breaks [T5] mismatched collective sync_prefetch_hit_query" in failure, failure
    assert re.search(r"rank \d: all_reduce\(MIN\) of 4 value\(s\) \[hit, kv, mamba, swa\]", failure)
    assert "saw it too (seen after" in failure and "known finding: T5" in failure
    assert seconds < 600


def test_host_pressure_breaks_t1_under_upstream_0523_f6_shrunk() -> None:
    """F6 (docs/sglang-findings.md): ranks that agree on everything but their free host memory at hit time stage
    different lengths after the sync; the completed MIN then matches one rank's expectation and not the other's, so
    one rank inserts while the other discards. Found on real ranks and shrunk to one check."""
    report = run_check("tp_prefetch", TPPrefetchRuntime, PAIR, profile="ci", impl_name="runtime", failures_dir=None,
                       ranks="host_pressure")
    failure = report.failure or ""
    assert "the upstream_0523 protocol breaks [T1]" in failure, failure
    assert "known finding: F6" in failure and "host pages free" in failure
    assert _steps(failure) == ["initial_state", "page_transfer", "can_terminate_prefetch", "reduce_prefetch_ack",
                               "handle_prefetch_result"]


# ---------------------------------------------------------------- mutants

#: What the kill's evidence line must say, per mutant.
EVIDENCE: dict[str, str] = {
    "min_as_max": r"collective \w+: rank \d passed MAX",
    "local_ack_value": r"^handle_prefetch_result: rank \d's commit differs",
    "swa_hits_not_written_back": r"^handle_prefetch_result: rank \d's commit differs",
    "attach_partial_window": r"^handle_prefetch_result: rank \d's commit differs in (nodes, )?attached",
    "release_attached_slot": r"^rank \d: swa host pool: \d+ free \+ \d+ in the tree \+ \d+ held != capacity",
    "split_one_page_late": r"^handle_prefetch_result: rank \d's commit differs in nodes, swa_split",
    "last_rank_skips_ack": r"^reduce_prefetch_ack: mismatched collective: implementation mismatched collective "
                           r"reduce_prefetch_ack: rank 0: all_reduce\(MIN\) of 1 value\(s\) \[completed\]; rank 1: no "
                           r"call",
    "hits_by_sum": r"collective reduce_prefetch_ack: rank \d passed MIN \{'kv': \d+, 'mamba': \d+, 'swa': \d+\}",
}
#: The Z3 twin that catches the same arithmetic mistake.
Z3_TWINS: dict[str, str] = {
    "min_as_max": "tp_prefetch.handle_prefetch_result.full_slots_conserved.max_reduce",
    "local_ack_value": "tp_prefetch.handle_prefetch_result.same_tree_0523.no_pool_sync",
    "swa_hits_not_written_back": "tp_prefetch.handle_prefetch_result.same_tree_0523.no_pool_sync",
    "attach_partial_window": "tp_prefetch.commit_prefetch.whole_window_0523.partial_window",
    "hits_by_sum": "tp_prefetch.count_pool_hits.synced_prefix_fetched.sum",
}


def test_registered_under_tp_prefetch() -> None:
    assert mutants_of("tp_prefetch") is MUTANTS
    assert len(MUTANTS) >= 6
    assert set(EVIDENCE) == set(MUTANTS)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_documents_its_bug(name: str) -> None:
    doc = MUTANTS[name].__doc__ or ""
    assert re.search(r"§\d+", doc), f"{name}: the docstring names no section"
    assert "Differs:" in doc, f"{name}: the docstring gives no differing case"
    if name in Z3_TWINS:
        assert Z3_TWINS[name] in " ".join(doc.split()), f"{name}: the docstring does not name its Z3 twin"


@pytest.mark.parametrize("name", sorted(Z3_TWINS))
def test_arithmetic_mutants_have_a_z3_twin(name: str) -> None:
    names = {ob.name: ob for ob in spec.obligations("tp_prefetch")}
    twin = names[Z3_TWINS[name]]
    assert twin.twin_of is not None


@functools.cache
def kill(name: str) -> MutantVerdict:
    (verdict,) = kill_mutants({name: MUTANTS[name]}, component="tp_prefetch", profile="ci")
    return verdict


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    verdict = kill(name)
    assert verdict.killed, f"mutant {name} survived the tp_prefetch suite (ci profile) on every config"
    assert "HarnessError" not in verdict.evidence and "crashed" not in verdict.evidence, verdict.evidence
    assert re.search(EVIDENCE[name], verdict.evidence), f"{name} killed for another reason: {verdict.evidence}"
