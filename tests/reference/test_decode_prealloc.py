"""decode_prealloc reference: S2 (upstream crash vs corrected), §2.10 capacity, typed errors, retract/resume."""

import pytest

from kvproof.reference import decode_prealloc as dp
from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import KVGeometry, PoolConfig
from kvproof.reference.errors import InvalidOperation, OutOfMemory

S2_POOL = PoolConfig(size_full=64 * 20, size_swa=64 * 5, page_size=64, sliding_window_size=128)


def s2(policy: dp.PreallocPolicy) -> dp.StepResult:
    node = dp.initial_node(dp.DecodeConfig(reserved_decode_tokens=0, policy=policy, write_kv=False))
    node = dp.arrive(dp.arrive(node, 1, 200, 1, 2), 2, 200, 1, 2)
    return dp.pop_preallocated(node, sa.initial_state(S2_POOL))


def test_s2_upstream_admits_then_crashes() -> None:
    """S2 (§9): swa budget 320; request 1 charged 136 but takes 3 pages; request 2 passes 137 <= 184 and fails."""
    result = s2(dp.PreallocPolicy.UPSTREAM)
    assert result.rids == (1,)
    assert result.crash is not None and result.crash.rid == 2
    assert result.crash.budgets == (1024, 184) and result.crash.required == (200, 136)
    assert [c.ok for c in result.calls] == [True, False]
    # the recorded outcome is the reference's own error: op, pool and page counts, as the harness replays it
    err = result.calls[1].error
    assert isinstance(err, OutOfMemory) and result.calls[0].error is None
    assert (err.op, err.pool, err.pages_needed, err.pages_free) == ("alloc_extend_swa_tail", "swa", 3, 2)
    assert str(err) == result.crash.message == "alloc_extend_swa_tail: swa pool needs 3 page(s), 2 free"


def test_s2_corrected_stops_at_the_gate() -> None:
    result = s2(dp.PreallocPolicy.CORRECTED)
    assert result.rids == (1,) and result.crash is None
    assert [r.rid for r in result.node.queue] == [2]  # waits for the next round
    dp.check_node(result.node, result.allocator)


def capacity(tail: bool) -> int:
    """§2.10: full pool ~100k tokens, SWA pool ~10k, W=128, P=64, R=512, 8k prompts."""
    pool = PoolConfig(size_full=64 * 1562, size_swa=64 * 156, page_size=64, sliding_window_size=128,
                      kv=KVGeometry())
    node = dp.initial_node(dp.DecodeConfig(policy=dp.PreallocPolicy.CORRECTED, swa_tail_prealloc=tail,
                                           write_kv=False))
    for rid in range(1, 21):
        node = dp.arrive(node, rid, 8192, 1, 128)
    result = dp.pop_preallocated(node, sa.initial_state(pool))
    assert result.crash is None
    return len(result.rids)


def test_capacity_of_section_2_10() -> None:
    """Before: one 8k request fits (its SWA reservation is the whole prompt); after: ~11 (full pool binds)."""
    assert capacity(tail=False) == 1
    assert capacity(tail=True) == 11


@pytest.mark.parametrize(
    ("args", "argument"),
    [
        ((1, 0, 1, 4), "origin_input_len"),
        ((1, -5, 1, 4), "origin_input_len"),
        ((1, 8, 0, 4), "output_len"),
        ((1, 8, 1, 0), "max_new_tokens"),
        ((1, 8, 1, -2), "max_new_tokens"),
        ((1, 8, 4, 4), "output_len"),
        ((7, 8, 1, 4), "rid"),
    ],
)
def test_invalid_arrivals_are_typed_and_change_nothing(args: tuple[int, int, int, int], argument: str) -> None:
    node = dp.arrive(dp.initial_node(), 7, 4, 1, 2)
    with pytest.raises(InvalidOperation) as info:
        dp.arrive(node, *args)
    assert info.value.argument == argument
    assert node.queue == (dp.DecodeRequest(rid=7, origin_input_len=4, output_len=1, max_new_tokens=2),)


def test_a_running_request_cannot_arrive_again() -> None:
    """A request id preallocated twice: rejected while it runs (and while it is retracted)."""
    pool = PoolConfig(size_full=64, size_swa=32, page_size=4, sliding_window_size=4)
    node = dp.arrive(dp.initial_node(dp.DecodeConfig(reserved_decode_tokens=0)), 3, 5, 1, 4)
    result = dp.pop_preallocated(node, sa.initial_state(pool))
    assert result.rids == (3,)
    with pytest.raises(InvalidOperation, match="already on this node"):
        dp.arrive(result.node, 3, 5, 1, 4)
    back = dp.retract(result.node, result.allocator, 3)
    with pytest.raises(InvalidOperation, match="already on this node"):
        dp.arrive(back.node, 3, 5, 1, 4)
    with pytest.raises(InvalidOperation) as info:
        dp.retract(back.node, back.allocator, 3)
    assert info.value.argument == "rid"


def test_retract_and_resume_keep_the_window() -> None:
    """A long request is decoded past its window, retracted, resumed: every in-window row survives (D3)."""
    pool = PoolConfig(size_full=128, size_swa=64, page_size=4, sliding_window_size=6)
    node = dp.arrive(dp.initial_node(dp.DecodeConfig(reserved_decode_tokens=0)), 1, 9, 1, 40)
    step = dp.pop_preallocated(node, sa.initial_state(pool))
    for _ in range(12):
        step = dp.decode(step.node, step.allocator)
        dp.check_node(step.node, step.allocator)
    (req,) = step.node.running
    assert req.swa_evicted_seqlen > 0  # the window has moved on
    back = dp.retract(step.node, step.allocator, 1)
    again = dp.resume_retracted_reqs(back.node, back.allocator)
    assert again.rids == (1,) and again.crash is None
    (res,) = again.node.running
    m, w = again.allocator.full_to_swa_index_mapping, pool.sliding_window_size
    for j in range(len(res.slots) - w, len(res.slots)):
        k, v = dp.token_row(1, j, 0, pool.kv.row_width)  # layer 0 is the SWA layer
        assert sa.kv_rows(again.allocator, 0, [m[res.slots[j]]]) == (tuple(k + v),)
    dp.check_node(again.node, again.allocator)


def test_the_swa_reclaim_and_the_resume_budgets_without_the_can_finish_room() -> None:
    """``reclaim_swa_tail``: the page-rounded tail against the free SWA tokens (nothing evictable), asked on admission
    in tail mode only, never on resume; ``reserve_finish=False`` (SGLang's resume round, model gap M1) drops exactly
    the can-finish room from both budgets."""
    pool = PoolConfig(size_full=4 * 16, size_swa=4 * 4, page_size=4, sliding_window_size=5)
    node = dp.initial_node(dp.DecodeConfig(reserved_decode_tokens=0, policy=dp.PreallocPolicy.CORRECTED,
                                           write_kv=False))
    node = dp.arrive(dp.arrive(node, 1, 3, 1, 10), 2, 11, 1, 2)
    first = dp.pop_preallocated(node.model_copy(update={"queue": node.queue[:1]}), sa.initial_state(pool))
    assert first.rids == (1,)
    state, node = first.allocator, first.node.model_copy(update={"queue": node.queue[1:]})
    (queued,) = node.queue
    assert dp.admission_reclaims_swa(node, state) and not dp.resume_reclaims_swa(node, state)
    # request 2: A = 11, tail = 5 + (11 - 5) % 4 = 7, page-rounded 8; request 1 holds one SWA page of four
    ready = dp.reclaim_swa_tail(node, state, queued)
    assert ready == dp.SWAReclaim(needed=8, available=12) and ready.ready
    fuller, _ = sa.alloc_extend_swa_tail(state, [0], [8], [-1], 8, 8)  # two more SWA pages taken
    short = dp.reclaim_swa_tail(node, fuller, queued)
    assert short == dp.SWAReclaim(needed=8, available=4) and not short.ready
    # request 1 running: need = 10 + 3 - 4 = 9 (full), need_swa = 3 + 10 - 4 = 9 (SWA)
    with_room = dp.allocatable_token_budgets(node, state, count_retracted=False)
    without = dp.allocatable_token_budgets(node, state, count_retracted=False, reserve_finish=False)
    assert (with_room.full, with_room.swa) == (60 - 9, 12 - 9)
    assert (without.full, without.swa) == (60, 12)
    assert dp.resume_gate(node, state, with_room, queued).reason == "SWA gate: needs 8 > budget 3"
    assert dp.resume_gate(node, state, without, queued).admit
    paged_one = PoolConfig(size_full=16, size_swa=8, page_size=1, sliding_window_size=5)
    assert not dp.admission_reclaims_swa(node, sa.initial_state(paged_one))


def test_the_resume_round_keeps_no_can_finish_room() -> None:
    """M1: ``resume_retracted_reqs`` resumes a request that budgets keeping the "can finish" room would refuse (SGLang
    passes its resume budgets no retractable counts; sglang_semantics.md §2.5 reads "the same budgets")."""
    pool = PoolConfig(size_full=4 * 16, size_swa=4 * 4, page_size=4, sliding_window_size=5)
    node = dp.initial_node(dp.DecodeConfig(reserved_decode_tokens=0, policy=dp.PreallocPolicy.CORRECTED,
                                           write_kv=False))
    both = dp.pop_preallocated(dp.arrive(dp.arrive(node, 1, 3, 1, 10), 2, 11, 1, 2), sa.initial_state(pool))
    assert both.rids == (1, 2)
    out = dp.retract(both.node, both.allocator, 2)
    (back,) = out.node.retracted
    with_room = dp.allocatable_token_budgets(out.node, out.allocator, count_retracted=False)
    assert dp.resume_gate(out.node, out.allocator, with_room, back).reason == "SWA gate: needs 8 > budget 3"
    resumed = dp.resume_retracted_reqs(out.node, out.allocator)
    assert resumed.rids == (2,) and resumed.crash is None and not resumed.node.retracted
    dp.check_node(resumed.node, resumed.allocator)
