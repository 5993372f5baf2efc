"""Scenario S3 (sglang_semantics.md §9, R1 + R3): the BMC trace and the fixed model's non-vacuity."""

from __future__ import annotations

from kvproof.spec import swa_s3
from kvproof.spec.swa_s3 import FIXED, PRE_25805, Op, find_trace, witness


def test_s3_trace_is_draft_then_tail_then_free_swa() -> None:
    trace = find_trace(PRE_25805)
    assert trace is not None
    steps = trace.rows[1:]
    assert len(steps) <= 8
    ops = [row.op for row in steps]
    draft = next(i for i, row in enumerate(steps) if "backup_state" in row.args and "restore_state" in row.args)
    tail = next(i for i, op in enumerate(ops) if op == "alloc_extend_swa_tail" and i > draft)
    evict = next(i for i, op in enumerate(ops) if op == "free_swa" and i > tail)
    assert evict == len(steps) - 1, "the trace ends at the harmful free_swa"
    assert "released while live full slots" in trace.violation
    table = trace.table()
    assert "backup_state" in table and "restore_state" in table and "free_swa" in table


def test_s3_trace_frees_the_tails_own_page() -> None:
    trace = find_trace(PRE_25805)
    assert trace is not None
    before, after = trace.rows[-2], trace.rows[-1]
    released = set(after.swa_free) - set(before.swa_free)
    still_used = {m // swa_s3.P for slot, m in after.mapping if slot in dict(after.live)}
    assert released & still_used, trace.table()


def test_fixed_model_runs_the_s3_ops_safely() -> None:
    """Non-vacuity: the post-#25805 model can execute the S3 op sequence (and more)."""
    ops = [Op.DRAFT, Op.ALLOC_EXTEND_SWA_TAIL, Op.FREE_SWA, Op.FREE, Op.ALLOC_EXTEND]
    trace = witness(FIXED, ops)
    assert trace is not None
    assert trace.ops() == ["init", "draft", "alloc_extend_swa_tail", "free_swa", "free", "alloc_extend"]


def test_every_op_is_enabled_from_clear() -> None:
    for op in Op:
        prefix = [Op.ALLOC_EXTEND_SWA_TAIL] if op in (Op.FREE_SWA, Op.FREE) else []
        assert witness(FIXED, [*prefix, op]) is not None, op.name
