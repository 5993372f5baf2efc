"""Scenario S3 (sglang_semantics.md §9, R1 + R3): the BMC trace and the fixed model's non-vacuity."""

from __future__ import annotations

import z3

from kvproof.spec import _ts, swa_s3
from kvproof.spec.swa_s3 import DRAFTS, FIXED, PRE_25805, S3_DEPTH, S3_EVENT, SEARCH, system


def _s3_trace() -> _ts.Trace:
    solver = z3.Solver()
    solver.add(*_ts.bmc(system(PRE_25805), S3_EVENT, S3_DEPTH, search=DRAFTS))
    assert solver.check() == z3.sat
    return _ts.trace_of(system(PRE_25805), solver.model(), S3_EVENT)


def test_s3_trace_is_a_draft_then_tail_then_free_swa() -> None:
    trace = _s3_trace()
    ops = trace.ops()[1:]
    backup = ops.index("backup_state")
    restore = ops.index("restore_state", backup)
    assert any(op in swa_s3.ALLOCATIONS for op in ops[backup + 1:restore]), trace.table()
    tail = ops.index("alloc_extend_swa_tail", restore)
    assert ops[-1] == "free_swa" and len(ops) - 1 > tail, "the trace ends at the harmful free_swa"
    assert "released while live full slots" in trace.violation
    table = trace.table()
    assert "backup_state" in table and "restore_state" in table and "free_swa" in table


def test_s3_trace_frees_the_tails_own_page() -> None:
    trace = _s3_trace()
    before, after = trace.rows[-2].values, trace.rows[-1].values
    released = {q for q in swa_s3.PAGES if after[f"swa_free_{q}"] and not before[f"swa_free_{q}"]}
    still_used = {after[f"M_{x}"] // swa_s3.P for x in swa_s3.REAL_SLOTS if after[f"live_{x}"] and after[f"M_{x}"] > 0}
    assert released & still_used, trace.table()


def test_the_fixed_model_has_no_s3_run() -> None:
    """The same BMC question for the post-#25805 model is unsatisfiable (the twin's premise is the fix)."""
    solver = z3.Solver()
    solver.add(*_ts.bmc(system(FIXED), S3_EVENT, S3_DEPTH, search=DRAFTS))
    assert solver.check() == z3.unsat


def test_fixed_model_runs_the_s3_ops_safely() -> None:
    """Non-vacuity: the post-#25805 model can execute the S3 op sequence (and more)."""
    ops = ["backup_state", "alloc_extend", "restore_state", "alloc_extend_swa_tail", "free_swa", "free",
           "alloc_extend"]
    trace = _ts.witness(swa_s3.SYSTEM, ops, search=SEARCH, changes=True)
    assert trace is not None
    assert trace.ops() == ["init", *ops]


def test_every_op_is_enabled_from_clear_and_changes_the_state() -> None:
    """Every transition can fire, and (but for the reads) change something, right after an allocation."""
    reads = {"translate_loc_from_full_to_swa"}
    for op in swa_s3.SYSTEM.ops:
        prefix = [] if op in (*swa_s3.ALLOCATIONS, "backup_state") else ["alloc_extend"]
        if op in ("free_full", "free_full_segment"):
            prefix = ["alloc_extend", "free_swa"]
        if op == "free_group_end":  # gives back what a release inside the group held
            prefix = ["alloc_extend", "free_group_begin", "free"]
        if op == "restore_state":
            prefix = ["backup_state", "alloc_extend"]
        if op == "load_cpu_copy":
            prefix = ["alloc_extend", "set_kv_buffer", "get_cpu_copy", "free", "alloc_extend"]
        trace = _ts.witness(swa_s3.SYSTEM, [*prefix, op], search=SEARCH, changes=op not in reads)
        assert trace is not None, op
