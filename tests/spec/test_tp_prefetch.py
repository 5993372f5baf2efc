"""tp_prefetch: every twin reads as numbers, the proofs are not vacuous.

``kvproof.spec.tp_prefetch`` (sglang_semantics.md §6, §7 T1-T5, §9 S10): names ``tp_prefetch.<op>.<claim>`` after
the reference operation they are about; the S10 twin prints the numbers the reference's run shows
(tests/reference/test_tp_prefetch.py), the F6 twin reads like F6 (sglang-findings.md); witnesses show that the
premises of the proofs admit the runs they are about (windows attached, split, up to 8 ranks, 0.5.23's revokes and
short hits at the root).
"""

from __future__ import annotations

import functools
import re

import pytest
import z3

from kvproof.reference import tp_prefetch as tp
from kvproof.spec import TEST_BUDGET, Result, collect, run
from kvproof.spec import tp_prefetch as spec

NAMES = {ob.name: ob for ob in spec.OBLIGATIONS}
#: per-rank functions of the reference that obligations are about besides the transitions
OPS = {*spec.SYSTEM.ops, "commit_prefetch", "count_pool_hits"}


@functools.cache
def result(name: str) -> Result:
    return run(NAMES[name], **TEST_BUDGET)


def test_the_module_has_the_registry_shape() -> None:
    """Names ``tp_prefetch.<op>.<claim>`` with ``op`` a reference function; each sound obligation has a twin."""
    assert collect({"tp_prefetch": spec}) == spec.OBLIGATIONS
    for ob in spec.OBLIGATIONS:
        op = ob.name.split(".")[1]
        assert op in OPS and callable(getattr(tp, op)), ob.name
        if ob.twin_of is not None:
            assert ob.twin_of in NAMES and NAMES[ob.twin_of].twin_of is None and ob.name.startswith(ob.twin_of + ".")
    sound = {ob.name for ob in spec.OBLIGATIONS if ob.twin_of is None}
    assert sound == {ob.twin_of for ob in spec.OBLIGATIONS if ob.twin_of is not None}
    for op in spec.SYSTEM.ops:  # every transition is the subject of obligations (kvproof prove -k <op>)
        assert any(name.startswith(f"tp_prefetch.{op}.") for name in NAMES), op


def test_every_transition_is_named_like_a_reference_operation() -> None:
    assert spec.SYSTEM.ops == ("sync_prefetch_hit_query", "page_transfer", "can_terminate_prefetch",
                               "reduce_prefetch_ack", "handle_prefetch_result")
    for op in spec.SYSTEM.ops:
        assert callable(getattr(tp, op)), op
    assert [v.value for v in spec.Variant] == [v.value for v in tp.TPPrefetchVariant]
    assert all(s.component == "tp_prefetch" for s in spec.SYSTEMS)
    assert spec.RANKS == tp.MAX_WORLD_SIZE


def test_every_twin_prints_readable_numbers() -> None:
    for ob in spec.OBLIGATIONS:
        if ob.twin_of is None:
            continue
        detail = result(ob.name).detail
        assert re.search(r"\d", detail) and "div0" not in detail and "mod0" not in detail, detail
        assert re.search(r"\b(T[1-5]|R5-[cd]|D1) broken\b|the ranks (load|decide)", detail), (ob.name, detail)
        if ".swa_slots_conserved" not in ob.name and ".count_pool_hits" not in ob.name:
            assert "page size P=64" in detail and "rank 0:" in detail and "rank 1:" in detail, (ob.name, detail)


def test_s10_twin_prints_the_references_numbers() -> None:
    detail = result("tp_prefetch.commit_prefetch.aligned_window.pre_27264_s10").detail
    assert "pre_27264: page size P=64, window 2 pages (128 tokens), request R=10 pages" in detail
    assert "min completed 7, reads SWA count 2: inserts 7 pages (448 tokens), attaches its 2-page window at tokens " \
           "320-447, whose buffer holds the SWA KV of tokens 512-639" in detail
    assert "T3 broken: rank 0's tokens 320-447 get the SWA KV of tokens 512-639" in detail
    # the same numbers through the reference
    cfg = tp.TPPrefetchConfig(page_size=64, sliding_window=128, request_pages=10,
                              variant=tp.TPPrefetchVariant.PRE_27264)
    ranks = [tp.RankProgress(storage_hit=10, full_pages=10, policy=tp.TerminationPolicy.TIMEOUT),
             tp.RankProgress(storage_hit=10, full_pages=7, io_done=False, deadline_passed=True,
                             policy=tp.TerminationPolicy.TIMEOUT)]
    commit = tp.check_prefetch_progress(cfg, ranks).ranks[0].commit
    assert commit is not None and [(n.length, n.swa_from) for n in commit.nodes if n.swa_pages] == [(128, 512)]


def test_the_shape_twin_names_the_packed_layouts_the_reference_packs() -> None:
    detail = result("tp_prefetch.reduce_prefetch_ack.aligned.transfer_sets_differ").detail
    assert "rank 0: MIN [completed, swa] (2 values); rank 1: MIN [completed] (1 value)" in detail
    detail = result("tp_prefetch.sync_prefetch_hit_query.aligned_0523.transfer_sets_differ").detail
    assert re.search(r"rank 0: MIN \[flag_0\.\.flag_\d+, kv, mamba, swa\] \(\d+ values\); rank 1: MIN \[hit, kv, "
                     r"mamba, swa\] \(4 values\)", detail), detail
    assert "rank 0: no call (best_effort); rank 1: MAX [not_can, terminated] (2 values)" in result(
        "tp_prefetch.can_terminate_prefetch.agreed.mixed_policies").detail


def test_the_f6_twin_stages_fewer_pages_on_one_rank_after_the_sync() -> None:
    """F6 (sglang-findings.md): one policy and one transfer set, every rank finds and loads the request; one rank is
    short of Full host pages at hit time, stages fewer than the synced hit, and the trees differ."""
    detail = result("tp_prefetch.handle_prefetch_result.same_tree_0523.host_pressure").detail
    assert re.search(r"rank 1: wait_complete, transfers \{swa\}, hit=(\d+), loaded=\1, (\d+) Full host page\(s\) free",
                     detail), detail
    assert re.search(r"synced hit (\d+), stages (?!\1 )\d+ Full", detail), detail
    assert re.search(r"T1 broken: the ranks' host trees differ in total: .*rank 1 staged only \d+ of the synced "
                     r"hit's \d+ Full pages, after the sync \(host pressure, F6\)", detail), detail


def _witness(variant: spec.Variant, *facts: object, committed: bool = True) -> z3.ModelRef:
    rn = spec.run(variant)
    solver = z3.Solver()
    solver.add(*rn.facts, *((rn.committed,) if committed else ()), *(f(rn) if callable(f) else f for f in facts))
    assert solver.check() == z3.sat, f"{variant}: no run with these facts (a proof about them would be vacuous)"
    return solver.model()


@pytest.mark.parametrize("variant", [spec.Variant.UPSTREAM_27264, spec.Variant.UPSTREAM_0523])
def test_the_proofs_premises_admit_eight_ranks_attaching_one_split_window(variant: spec.Variant) -> None:
    """Non-vacuity of same_tree / whole_window / aligned_window: one transfer set and one policy on 8 ranks, every
    rank attaches its window, split at the window start inside a tombstone below an existing node."""
    m = _witness(variant, spec.same_sets, spec.one_policy, spec.no_host_pressure, lambda rn: rn.last.N == 8,
                 lambda rn: z3.And([rn.last.attach[r] for r in range(8)]),
                 lambda rn: rn.last.swa_split[0] >= 0, lambda rn: rn.last.e1 >= 1)
    rn = spec.run(variant)
    text = spec.run_text(m, rn, "witness")
    assert text.count("attaches its") == 8, text


def test_the_hazard_proof_admits_in_flight_swa_writes() -> None:
    """Non-vacuity of no_write_after_release_0523: a committing rank with SWA writes in flight exists."""
    _witness(spec.Variant.UPSTREAM_0523, lambda rn: z3.And(rn.last.go[0], rn.states[2].infl[0]))


def test_the_0523_proofs_admit_revokes_short_hits_at_the_root_and_acks_in_flight() -> None:
    """Non-vacuity of revoke_agreed_0523 (8 ranks revoke), short_hit_at_root_0523 (its premise on 8 ranks) and of
    D3 in the proofs over committed checks (a best_effort rank commits while another's IO is in flight)."""
    rn = spec.run(spec.Variant.UPSTREAM_0523)
    text = spec.run_text(_witness(spec.Variant.UPSTREAM_0523, lambda rn: rn.revoked, lambda rn: rn.last.N == 8,
                                  committed=False), rn, "witness")
    assert "the check is revoked on every rank" in text, text
    _witness(spec.Variant.UPSTREAM_0523, spec.short_hit_at_root, lambda rn: rn.last.N == 8)
    _witness(spec.Variant.UPSTREAM_0523, lambda rn: z3.And(rn.last.go[0], rn.last.pol[0] == spec.BE,
                                                           z3.Not(rn.states[2].fin[1]), rn.last.N == 2))
