"""tp_prefetch reference: S10, each variant, T1-T5 on random rank vectors, typed errors that change nothing.

sglang_semantics.md §6 (the protocol), §7 T1-T5, §9 S10; upstream_0523_vllm_fuzz.md §2 (0.5.23).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvproof.reference import tp_prefetch as tp
from kvproof.reference.errors import ConfigError, InvalidOperation, InvariantViolation

V = tp.TPPrefetchVariant
Policy = tp.TerminationPolicy
Pool = tp.PoolName
FIXED = (V.UPSTREAM_27264, V.UPSTREAM_0523, V.SUM_HITS, V.BEST_EFFORT_RELEASE)


def config(variant: V, **kw: object) -> tp.TPPrefetchConfig:
    base: dict[str, object] = {"page_size": 64, "sliding_window": 128, "request_pages": 10, "variant": variant}
    return tp.TPPrefetchConfig(**{**base, **kw})


def s10_ranks() -> list[tp.RankProgress]:
    """§6.6: rank 0 loads all 10 Full pages and both SWA window pages (tokens 512-639); rank 1 times out after 7."""
    return [tp.RankProgress(storage_hit=10, full_pages=10, policy=Policy.TIMEOUT),
            tp.RankProgress(storage_hit=10, full_pages=7, io_done=False, deadline_passed=True, policy=Policy.TIMEOUT)]


def commits(state: tp.PrefetchState) -> list[tp.RankCommit]:
    out = [r.commit for r in state.ranks]
    assert all(c is not None for c in out), state.phase
    return [c for c in out if c is not None]


def violation(state: tp.PrefetchState) -> str | None:
    """The invariant ``check_tp_prefetch`` reports (``None``: all hold)."""
    try:
        tp.check_tp_prefetch(state)
    except InvariantViolation as err:
        return err.invariant
    return None


# ---- S10 ---------------------------------------------------------------------------------------------------


def test_s10_pre_27264_attaches_the_swa_of_512_639_to_tokens_320_447_on_one_rank_only() -> None:
    state = tp.check_prefetch_progress(config(V.PRE_27264), s10_ranks())
    assert state.phase is tp.Phase.COMMITTED
    rank0, rank1 = commits(state)
    assert rank0.total_len == rank1.total_len == 448  # both insert the MIN of completed: 7 pages
    assert rank0.attached and not rank1.attached
    attached = [(n.length, n.swa_pages, n.swa_from) for n in rank0.nodes if n.swa_pages]
    assert attached == [(128, (0, 1), 512)]  # the node of tokens 320-447 holds the SWA KV of tokens 512-639
    assert tp.tree_shape(rank0) == ((320, False, True), (128, True, True))
    assert tp.tree_shape(rank1) == ((448, False, True),)
    assert rank0.swa_split == 320 and rank1.swa_split is None
    with pytest.raises(InvariantViolation, match=r"\[T1\].*differs from rank 1"):
        tp.check_tp_prefetch(state)
    # the packed MIN carried only completed; the SWA hits stayed rank-local
    reduce = [c for c in state.collectives if c.name == "reduce_prefetch_ack"]
    assert [p.layout for p in reduce[0].packed if p] == [("completed",), ("completed",)]
    assert reduce[0].result == (7,)


@pytest.mark.parametrize("variant", FIXED)
def test_s10_the_fixed_variants_build_one_tree(variant: V) -> None:
    state = tp.check_prefetch_progress(config(variant), s10_ranks())
    assert state.phase is tp.Phase.COMMITTED
    rank0, rank1 = commits(state)
    assert tp.tree_shape(rank0) == tp.tree_shape(rank1)
    assert not rank0.attached and not rank1.attached
    assert violation(state) is None
    if variant is V.UPSTREAM_27264:  # MIN(2, 0) = 0 < 2: both drop the window and release the buffer
        assert rank0.total_len == rank1.total_len == 448
        assert rank0.swa_slots == rank1.swa_slots == (tp.SlotOwner.FREED,) * 2
        reduce = next(c for c in state.collectives if c.name == "reduce_prefetch_ack")
        assert [p.values for p in reduce.packed if p] == [(10, 2), (7, 0)] and reduce.result == (7, 0)
    else:  # 0.5.23: completed 7 < hit 10 on the agreed count: the whole prefetch is discarded
        assert rank0.discarded and rank1.discarded and rank0.total_len == 0
        # rank 1's IO thread is still running: the pool ACK was not reduced, the IO thread releases the buffers
        # (best_effort_release: the scheduler does; rank 0's IO thread is done, so nothing is written after)
        owner = tp.SlotOwner.RELEASE_QUEUE if variant is V.BEST_EFFORT_RELEASE else tp.SlotOwner.IO_THREAD
        assert rank0.swa_slots == (owner,) * 2 and not rank0.written_after_release


def test_s10_shape_case_is_a_typed_mismatch_naming_ranks_and_shapes() -> None:
    """§9 S10: rank 0 built an SWA transfer, rank 1 none (its prefetch was truncated below one window)."""
    ranks = [tp.RankProgress(storage_hit=10, full_pages=10),
             tp.RankProgress(storage_hit=10, full_pages=10, transfers=())]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_27264), ranks)
    assert state.phase is tp.Phase.MISMATCHED and state.mismatch is not None
    assert state.mismatch.name == "reduce_prefetch_ack"
    assert state.mismatch.groups() == {"MIN shape (2,)": (0,), "MIN shape (1,)": (1,)}
    text = state.mismatch.describe()
    assert "rank 0: all_reduce(MIN) of 2 value(s) [completed, swa]" in text
    assert "rank 1: all_reduce(MIN) of 1 value(s) [completed]" in text
    with pytest.raises(InvariantViolation, match=r"\[T5\] mismatched collective reduce_prefetch_ack"):
        tp.check_tp_prefetch(state)
    # before #27264 only completed was packed: no mismatch (and no sync of the hits)
    assert tp.check_prefetch_progress(config(V.PRE_27264), ranks).phase is tp.Phase.COMMITTED
    # 0.5.23: the hit query's flag vector already differs (inferred T5 residue)
    m = tp.check_prefetch_progress(config(V.UPSTREAM_0523), ranks).mismatch
    assert m is not None and m.name == "sync_prefetch_hit_query"
    assert m.groups() == {"MIN shape (14,)": (0,), "MIN shape (4,)": (1,)}


# ---- each variant ------------------------------------------------------------------------------------------


def test_all_reduce_is_a_pure_function_of_the_packed_vectors() -> None:
    a = tp.Packed(op=tp.ReduceOp.MIN, values=(3, 1), layout=("completed", "swa"))
    b = tp.Packed(op=tp.ReduceOp.MIN, values=(2, 4), layout=("completed", "swa"))
    call = tp.all_reduce("x", [a, b])
    assert isinstance(call, tp.CollectiveCall) and call.result == (2, 1) and not call.mixed
    assert tp.all_reduce("x", [None, None]) is None
    skip = tp.all_reduce("x", [a, None])
    assert isinstance(skip, tp.CollectiveMismatch) and skip.groups() == {"MIN shape (2,)": (0,), "no call": (1,)}
    other_op = tp.all_reduce("x", [a, a.model_copy(update={"op": tp.ReduceOp.MAX})])
    assert isinstance(other_op, tp.CollectiveMismatch)
    mixed = tp.all_reduce("x", [a, b.model_copy(update={"layout": ("completed", "mamba")})])
    assert isinstance(mixed, tp.CollectiveCall) and mixed.mixed and mixed.result == (2, 1)


def test_upstream_27264_packs_completed_and_each_transfer_pool_in_component_order() -> None:
    ranks = [tp.RankProgress(storage_hit=10, full_pages=10, transfers=(Pool.SWA, Pool.MAMBA), mamba_missing=True),
             tp.RankProgress(storage_hit=9, full_pages=10, transfers=(Pool.SWA, Pool.MAMBA))]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_27264), ranks)
    reduce = next(c for c in state.collectives if c.name == "reduce_prefetch_ack")
    assert [p.layout for p in reduce.packed if p] == [("completed", "swa", "mamba")] * 2
    assert [p.values for p in reduce.packed if p] == [(9, 2, 0), (9, 2, 1)] and reduce.result == (9, 2, 0)
    assert [r.synced_hits for r in state.ranks] == [{Pool.SWA: 2, Pool.MAMBA: 0}] * 2
    rank0, _ = commits(state)
    assert rank0.attached and rank0.total_len == 9 * 64 and violation(state) is None


def test_same_shape_other_pool_is_reduced_silently_and_reported() -> None:
    ranks = [tp.RankProgress(storage_hit=4, full_pages=4), tp.RankProgress(storage_hit=4, full_pages=4,
                                                                            transfers=(Pool.MAMBA,))]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_27264, request_pages=4), ranks)
    assert state.phase is tp.Phase.COMMITTED
    assert any(c.mixed for c in state.collectives)
    with pytest.raises(InvariantViolation, match=r"\[T5\] reduce_prefetch_ack: same shape, different slots"):
        tp.check_tp_prefetch(state)


def test_hits_by_sum_count_a_page_in_the_middle_that_did_not_arrive() -> None:
    """R5-c: rank 0 misses window page 0 of 3, rank 1 page 2; the sum says 2 on both, the leading run 0 and 2."""
    ranks = [tp.RankProgress(storage_hit=8, full_pages=8, swa_missing=(0,)),
             tp.RankProgress(storage_hit=8, full_pages=8, swa_missing=(2,))]
    for variant, synced in ((V.UPSTREAM_27264, 2), (V.SUM_HITS, 2), (V.UPSTREAM_0523, 0)):
        state = tp.check_prefetch_progress(config(variant, sliding_window=192, request_pages=8), ranks)
        assert {r.synced_hits[Pool.SWA] for r in state.ranks if r.synced_hits} == {synced}, variant
        assert violation(state) is None  # harmless for SWA: nobody attaches a window with a missing page
        assert not any(c.attached for c in commits(state))
        if variant.leading_run:
            tp.check_hit_counts(state)
        else:
            with pytest.raises(InvariantViolation, match=r"\[R5-c\] rank 0 reads 2 SWA pages as fetched, but rank 0 "
                                                         r"misses window page\(s\) \[0\]"):
                tp.check_hit_counts(state)


def test_count_pool_hits_leading_run_and_sum() -> None:
    assert tp.count_pool_hits([True, False, True], leading_run=True) == 1
    assert tp.count_pool_hits([True, False, True], leading_run=False) == 2
    assert tp.count_pool_hits([], leading_run=True) == tp.count_pool_hits([], leading_run=False) == 0


def test_r5d_best_effort_releases_a_buffer_the_io_thread_still_writes() -> None:
    """A best_effort check while rank 0's SWA fetch is in flight: 27264 and best_effort_release free the buffer the
    IO thread writes into; 0.5.23 leaves it to the IO thread (pool_transfers_done is False)."""
    ranks = [tp.RankProgress(storage_hit=4, full_pages=4, io_done=False, policy=Policy.BEST_EFFORT),
             tp.RankProgress(storage_hit=4, full_pages=4, policy=Policy.BEST_EFFORT)]
    cfg = config(V.UPSTREAM_27264, request_pages=4)
    for variant, hazard in ((V.PRE_27264, (0, 1)), (V.UPSTREAM_27264, (0, 1)), (V.UPSTREAM_0523, ()),
                            (V.SUM_HITS, ()), (V.BEST_EFFORT_RELEASE, (0, 1))):
        state = tp.check_prefetch_progress(cfg.with_variant(variant), ranks)
        rank0 = commits(state)[0]
        assert rank0.written_after_release == hazard, variant
        if variant is V.PRE_27264:  # it also breaks T1 here (rank 1 attaches alone)
            assert violation(state) == "T1"
        elif hazard:
            with pytest.raises(InvariantViolation, match=r"\[T4\].*released by the scheduler while the IO thread "
                                                         r"still writes them"):
                tp.check_tp_prefetch(state)
        else:
            assert rank0.swa_slots == (tp.SlotOwner.IO_THREAD,) * 2 and violation(state) is None


def test_any_terminated_lets_an_in_flight_rank_proceed_under_wait_complete() -> None:
    """Model finding from §6.3's vote: rank 1's IO stopped early (terminated), so the MAX vote proceeds although
    rank 0's SWA fetch is in flight and its own guard said "not done"."""
    ranks = [tp.RankProgress(storage_hit=4, full_pages=4, io_done=False),
             tp.RankProgress(storage_hit=4, full_pages=2)]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_27264, request_pages=4), ranks)
    vote = next(c for c in state.collectives if c.name == "can_terminate_prefetch")
    assert [p.values for p in vote.packed if p] == [(1, 0), (1, 1)] and vote.result == (1, 1)
    assert commits(state)[0].written_after_release == (0, 1)
    # 0.5.23's wait_complete waits for the ACK drain instead
    assert tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=4), ranks).phase is tp.Phase.WAITING


def test_upstream_0523_packs_flags_and_pool_verdicts_and_reduces_pool_acks_over_poolname() -> None:
    ranks = [tp.RankProgress(storage_hit=3, full_pages=3, transfers=(Pool.SWA, Pool.MAMBA)),
             tp.RankProgress(storage_hit=4, full_pages=4, transfers=(Pool.SWA, Pool.MAMBA))]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=4), ranks)
    query, completed, pools = state.collectives
    assert query.packed[0] is not None and query.packed[0].layout == (
        "flag_0", "flag_1", "flag_2", "flag_3", "flag_4", "kv", "mamba", "swa")
    assert [p.values for p in query.packed if p] == [(1, 1, 1, 1, 0, 3, 3, 3), (1, 1, 1, 1, 1, 4, 4, 4)]
    assert query.result == (1, 1, 1, 1, 0, 3, 3, 3) and {r.synced_hit for r in state.ranks} == {3}
    assert completed.result == (3,)
    assert [p.layout for p in pools.packed if p] == [("kv", "mamba", "swa")] * 2
    assert pools.result == (0, 1, 2)
    assert all(c.attached and c.total_len == 3 * 64 for c in commits(state)) and violation(state) is None


def test_upstream_0523_votes_on_deadlines_and_otherwise_waits_for_every_io_thread() -> None:
    cfg = config(V.UPSTREAM_0523, request_pages=4)
    running = [tp.RankProgress(storage_hit=4, full_pages=2, io_done=False, policy=p) for p in (Policy.TIMEOUT,) * 2]
    assert tp.check_prefetch_progress(cfg, running).phase is tp.Phase.WAITING
    late = [running[0], running[1].model_copy(update={"deadline_passed": True})]
    state = tp.check_prefetch_progress(cfg, late)
    vote = next(c for c in state.collectives if c.name == "can_terminate_prefetch")
    assert vote.result == (1,) and all(r.proceeds for r in state.ranks)
    done = [tp.RankProgress(storage_hit=4, full_pages=4)] * 2
    assert tp.check_prefetch_progress(cfg, done).phase is tp.Phase.COMMITTED  # the final ACK drained everywhere


def test_mixed_policies_mismatch_the_vote_or_split_the_ranks() -> None:
    ranks = [tp.RankProgress(storage_hit=4, full_pages=2, io_done=False, policy=Policy.BEST_EFFORT),
             tp.RankProgress(storage_hit=4, full_pages=2, io_done=False, policy=Policy.WAIT_COMPLETE)]
    seed = tp.check_prefetch_progress(config(V.UPSTREAM_27264, request_pages=4), ranks)
    assert seed.mismatch is not None and seed.mismatch.groups() == {"no call": (0,), "MAX shape (2,)": (1,)}
    split = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=4), ranks)
    assert split.phase is tp.Phase.COMMITTED and [r.proceeds for r in split.ranks] == [True, False]
    assert commits(split)[1].full_slots == (tp.SlotOwner.HELD,) * 4
    with pytest.raises(InvariantViolation, match=r"\[T1\] ranks \[0\] committed the prefetch while ranks \[1\]"):
        tp.check_tp_prefetch(split)


def test_a_rank_that_never_registered_hangs_the_first_collective() -> None:
    ranks = [tp.RankProgress(storage_hit=4, full_pages=4), tp.RankProgress(storage_hit=4, full_pages=4,
                                                                            registered=False)]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_27264, request_pages=4), ranks)
    assert state.mismatch is not None and state.mismatch.name == "sync_prefetch_hit_query"
    assert "rank 1: no call (it never reaches this collective: the others hang)" in state.mismatch.describe()


def test_upstream_0523_prefetches_a_sub_window_at_the_root_only() -> None:
    ranks = [tp.RankProgress(storage_hit=1, full_pages=1)] * 2
    root = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=1, anchor_is_root=True), ranks)
    assert all(c.attached and c.swa_slots == (tp.SlotOwner.TREE,) for c in commits(root))
    with pytest.raises(InvalidOperation, match="an SWA transfer mid-tree needs a whole window"):
        tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=1), ranks)


def test_upstream_0523_stages_at_hit_time_a_short_hit_at_the_root_is_a_whole_window() -> None:
    """D1/D4 (docs/sglang-findings.md): 0.5.23 stages the synced hit's Full pages and ``min(window keys, hit)`` SWA
    pages after the hit query; at the root a hit shorter than the window is the whole window from token 0 and is
    attached (mid-tree the same short buffer lacks its head and is dropped)."""
    ranks = [tp.RankProgress(storage_hit=1, full_pages=6), tp.RankProgress(storage_hit=1, full_pages=6)]
    root = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=6, anchor_is_root=True), ranks)
    assert [(r.synced_hit, r.staged, r.window) for r in root.ranks] == [(1, 1, 1)] * 2
    for c in commits(root):
        assert c.attached and c.total_len == 64 and c.full_slots == (tp.SlotOwner.TREE,)
        assert [(n.length, n.swa_pages, n.swa_from) for n in c.nodes] == [(64, (0,), 0)]
    assert violation(root) is None
    mid = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=6), ranks)
    assert all(not c.attached and c.swa_slots == (tp.SlotOwner.FREED,) for c in commits(mid))
    # before 0.5.23 the buffers are allocated at the start: R Full pages, a whole window
    old = tp.check_prefetch_progress(config(V.UPSTREAM_27264, request_pages=6), ranks)
    assert [(r.staged, r.window) for r in old.ranks] == [(6, 2)] * 2


def test_upstream_0523_revokes_a_synced_hit_of_zero_before_any_io() -> None:
    """D2: below the prefetch threshold (one page) 0.5.23 revokes the prefetch on every rank after the hit query: no
    transfer, no ACK, no commit, nothing staged. Before 0.5.23 the check commits an empty insert."""
    ranks = [tp.RankProgress(storage_hit=0, full_pages=0), tp.RankProgress(storage_hit=3, full_pages=3)]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=4), ranks)
    assert state.phase is tp.Phase.REVOKED and [c.name for c in state.collectives] == ["sync_prefetch_hit_query"]
    assert [(r.synced_hit, r.staged, r.window, r.commit) for r in state.ranks] == [(0, 0, 0, None)] * 2
    with pytest.raises(InvalidOperation, match="phase is revoked"):
        tp.page_transfer(state)
    old = tp.check_prefetch_progress(config(V.UPSTREAM_27264, request_pages=4), ranks)
    assert old.phase is tp.Phase.COMMITTED and all(c.total_len == 0 for c in commits(old))


def test_upstream_0523_reduces_no_ack_while_an_io_thread_is_in_flight() -> None:
    """D3: ACKs come per finished batch and the drain is rank-min, so a best_effort check with one rank's IO in
    flight reduces nothing: both ranks see 0 completed, discard, and every staged slot stays with the IO threads."""
    ranks = [tp.RankProgress(storage_hit=4, full_pages=4, policy=Policy.BEST_EFFORT),
             tp.RankProgress(storage_hit=4, full_pages=2, io_done=False, policy=Policy.BEST_EFFORT)]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=4, sliding_window=64), ranks)
    assert [c.name for c in state.collectives] == ["sync_prefetch_hit_query"]
    assert [r.min_completed for r in state.ranks] == [0, 0]
    for c in commits(state):
        assert c.discarded and c.full_slots == (tp.SlotOwner.IO_THREAD,) * 4
        assert c.swa_slots == (tp.SlotOwner.IO_THREAD,)
    assert violation(state) is None
    # with every IO thread finished the ACKs are reduced as before
    done = [r.model_copy(update={"full_pages": 4, "io_done": True}) for r in ranks]
    state = tp.check_prefetch_progress(config(V.UPSTREAM_0523, request_pages=4, sliding_window=64), done)
    assert [c.name for c in state.collectives] == ["sync_prefetch_hit_query"] + ["reduce_prefetch_ack"] * 2


def test_a_continued_check_keeps_the_synced_hit_and_makes_no_hit_query() -> None:
    """A check that waited continues with later progress: the storage was queried once, the staging is kept."""
    for variant in (V.UPSTREAM_0523, V.UPSTREAM_27264):
        cfg = config(variant, request_pages=4)
        slow = [tp.RankProgress(storage_hit=3, full_pages=3), tp.RankProgress(storage_hit=4, full_pages=1,
                                                                             io_done=False)]
        first = tp.check_prefetch_progress(cfg, slow)
        assert first.phase is tp.Phase.WAITING
        later = [slow[0], slow[1].model_copy(update={"full_pages": 4, "io_done": True})]
        state = tp.initial_state(cfg, later, continues=first)
        state = tp.sync_prefetch_hit_query(state)
        assert state.phase is tp.Phase.QUERIED and state.collectives == ()
        assert [r.synced_hit for r in state.ranks] == [3, 3]
        for step in (tp.page_transfer, tp.can_terminate_prefetch, tp.reduce_prefetch_ack, tp.handle_prefetch_result):
            state = step(state)
        assert state.phase is tp.Phase.COMMITTED and all(c.total_len == 3 * 64 for c in commits(state))
        with pytest.raises(InvalidOperation, match="rank 1: a continued prefetch keeps its storage_hit"):
            tp.initial_state(cfg, [slow[0], later[1].model_copy(update={"storage_hit": 2})], continues=first)
        with pytest.raises(InvalidOperation, match="only a check that ended waiting continues"):
            tp.initial_state(cfg, later, continues=state)


def test_f6_rank_local_host_pressure_truncates_one_rank_after_the_sync() -> None:
    """F6 (docs/sglang-findings.md): rank 1 has 5 free Full host pages when the synced hit of 8 is staged; it stages
    5 (``allow_partial``) and expects 5, rank 0 expects 8. The completed MIN is 5: rank 0 discards, rank 1 inserts
    5 pages and attaches the window it fetched (pages 3-4): the host trees differ (T1)."""
    cfg = config(V.UPSTREAM_0523, page_size=2, sliding_window=4, request_pages=8)
    ranks = [tp.RankProgress(storage_hit=8, full_pages=8), tp.RankProgress(storage_hit=8, full_pages=8,
                                                                            host_free_pages=5)]
    state = tp.check_prefetch_progress(cfg, ranks)
    assert [(r.synced_hit, r.staged) for r in state.ranks] == [(8, 8), (8, 5)]
    rank0, rank1 = commits(state)
    assert rank0.discarded and tp.tree_shape(rank0) == ()
    assert not rank1.discarded and rank1.total_len == 10 and rank1.attached
    assert [(n.length, n.swa_host, n.swa_from) for n in rank1.nodes] == [(6, False, None), (4, True, 6)]
    with pytest.raises(InvariantViolation, match=r"\[T1\]"):
        tp.check_tp_prefetch(state)
    with pytest.raises(InvalidOperation, match=r"host_free_pages models 0\.5\.23's hit-time staging"):
        tp.check_prefetch_progress(cfg.with_variant(V.UPSTREAM_27264), ranks)


def test_0523_io_thread_shrinks_a_window_buffer_longer_than_its_keys() -> None:
    """A rank that staged fewer Full pages than the window re-aligns its SWA keys to them and releases the buffer's
    tail (``_sync_trailing_keys``): mid-tree the shorter window is dropped, at the root it is whole and attached."""
    ranks = [tp.RankProgress(storage_hit=6, full_pages=6, host_free_pages=1)] * 2
    for root, attached in ((False, False), (True, True)):
        cfg = config(V.UPSTREAM_0523, page_size=2, sliding_window=8, request_pages=6, anchor_is_root=root)
        state = tp.initial_state(cfg, ranks)
        state = tp.page_transfer(tp.sync_prefetch_hit_query(state))
        assert [(r.staged, r.window) for r in state.ranks] == [(1, 1)] * 2  # staged 1 page; the 4-page buffer -> 1
        state = tp.check_prefetch_progress(cfg, ranks)
        assert [(c.attached, c.swa_slots) for c in commits(state)] == [
            (attached, (tp.SlotOwner.TREE if attached else tp.SlotOwner.FREED,))] * 2
        assert violation(state) is None


# ---- insert and the commit walk (§6.3 step 6, §6.4) ----------------------------------------------------------


def test_commit_walk_splits_a_tombstone_at_the_window_start_and_skips_a_node_with_swa() -> None:
    """Path below the anchor: [0, 192) a tombstone, [192, 256) with SWA; the insert of 384 adds [256, 384); a 4-page
    window (P=64, W=256) covers [128, 384): the new node gets pages 2-3, [192, 256) keeps its SWA (page 1
    released), the tombstone is split at 128 and its suffix [128, 192) gets page 0."""
    cfg = config(V.UPSTREAM_27264, sliding_window=256, request_pages=8,
                 existing=(tp.HostNode(length=192), tp.HostNode(length=64, swa_host=True)))
    inserted = tp.insert_host(cfg, [tp.TreeNode(length=n.length, swa_host=n.swa_host) for n in cfg.existing], 384)
    assert inserted.prefix_len == 256 and inserted.target == 2 and inserted.split is None
    out = tp.commit_prefetch(cfg, inserted, 4, 4, holds_from=128)
    assert out.attached and out.split == 128
    assert [(n.length, n.swa_pages, n.swa_from) for n in out.nodes] == [
        (128, (), None), (64, (0,), 128), (64, (), None), (128, (2, 3), 256)]
    assert out.swa_slots == (tp.SlotOwner.TREE, tp.SlotOwner.FREED, tp.SlotOwner.TREE, tp.SlotOwner.TREE)
    # inserting up to 128 ends inside the first node: it is split there
    short = tp.insert_host(cfg, inserted.nodes[:2], 128)
    assert short.split == 128 and short.prefix_len == 128 and [n.length for n in short.nodes] == [128, 64, 64]


def test_commit_releases_the_part_of_a_window_before_the_anchor() -> None:
    cfg = config(V.PRE_27264, sliding_window=256, request_pages=8)
    inserted = tp.insert_host(cfg, [], 128)
    out = tp.commit_prefetch(cfg, inserted, 4, 4, holds_from=0)
    assert out.swa_slots == (tp.SlotOwner.FREED,) * 2 + (tp.SlotOwner.TREE,) * 2


def test_full_host_pages_have_exactly_one_owner() -> None:
    """T4: [0, prefix) freed, [prefix, M) tree, [M, completed) release queue, [completed, R) IO thread."""
    cfg = config(V.UPSTREAM_27264, existing=(tp.HostNode(length=128),))
    state = tp.check_prefetch_progress(cfg, s10_ranks())
    rank0, rank1 = commits(state)
    own = tp.SlotOwner
    assert rank0.full_slots == (own.FREED,) * 2 + (own.TREE,) * 5 + (own.RELEASE_QUEUE,) * 3
    assert rank1.full_slots == (own.FREED,) * 2 + (own.TREE,) * 5 + (own.IO_THREAD,) * 3
    tp.check_rank_commit(cfg, rank0)


# ---- T1-T5 on random rank vectors --------------------------------------------------------------------------


def random_run(rng: random.Random, variant: V, *, uniform: bool) -> tuple[tp.TPPrefetchConfig, list[tp.RankProgress]]:
    """A random config and per-rank progress (``uniform``: one policy and one transfer set on every rank)."""
    p = rng.choice((1, 2, 4))
    sw = rng.randint(1, 4)
    r_pages = rng.randint(sw, 9)
    existing: list[tp.HostNode] = []
    room = r_pages
    for _ in range(rng.randint(0, 2)):
        if room:
            length = rng.randint(1, room)
            room -= length
            existing.append(tp.HostNode(length=length * p, swa_host=rng.random() < 0.4))
    cfg = tp.TPPrefetchConfig(page_size=p, sliding_window=sw * p - rng.randint(0, p - 1), request_pages=r_pages,
                              anchor_is_root=rng.random() < 0.3, existing=tuple(existing), variant=variant)
    sets = [(Pool.SWA,), (Pool.SWA, Pool.MAMBA), (Pool.MAMBA,), ()]
    shared_set, shared_policy = rng.choice(sets[:2] + sets[:2] + sets[2:]), rng.choice(list(Policy))
    ranks = []
    for _ in range(rng.choice((1, 2, 2, 3, 4, 8))):
        transfers = shared_set if uniform else rng.choice(sets)
        n = tp.window_pages(cfg, tp.RankProgress(storage_hit=0, full_pages=0, transfers=transfers))
        hit = rng.choice((r_pages, r_pages, rng.randint(0, r_pages)))
        ranks.append(tp.RankProgress(
            storage_hit=hit, full_pages=rng.choice((r_pages, r_pages, rng.randint(0, r_pages))),
            io_done=rng.random() < 0.85,
            deadline_passed=rng.random() < 0.5, policy=shared_policy if uniform else rng.choice(list(Policy)),
            transfers=transfers, swa_missing=tuple(i for i in range(n) if rng.random() < 0.05),
            mamba_missing=rng.random() < 0.1))
    return cfg, ranks


@pytest.mark.parametrize("variant", FIXED)
def test_t1_to_t5_hold_for_random_uniform_rank_vectors(variant: V) -> None:
    """One transfer set and one policy on every rank: no mismatch, one tree, whole and aligned windows, every slot
    owned once; the only violation left is R5-d (a buffer released while written), and only where it is expected."""
    rng = random.Random(13)
    attached = hazards = 0
    for _ in range(300):
        cfg, ranks = random_run(rng, variant, uniform=True)
        state = tp.check_prefetch_progress(cfg, ranks)
        assert state.phase is not tp.Phase.MISMATCHED, state.mismatch
        found = violation(state)
        if found is not None:
            assert found == "T4" and variant in (V.UPSTREAM_27264, V.BEST_EFFORT_RELEASE), (found, cfg, ranks)
            assert any(c.written_after_release for c in commits(state))
            hazards += 1
        if state.phase is tp.Phase.COMMITTED:
            attached += any(c.attached for c in commits(state))
            for c, r in zip(commits(state), state.ranks, strict=True):
                assert len(c.swa_slots) in (0, r.window)
                assert len(c.full_slots) in (0, r.staged)
        if variant.leading_run:
            tp.check_hit_counts(state)
    assert attached > 20, "the random runs reach the attach path"
    assert (hazards > 0) == (variant in (V.UPSTREAM_27264, V.BEST_EFFORT_RELEASE))


def test_pre_27264_breaks_t1_on_random_uniform_rank_vectors() -> None:
    rng = random.Random(27264)
    found = set()
    for _ in range(300):
        cfg, ranks = random_run(rng, V.PRE_27264, uniform=True)
        found.add(violation(tp.check_prefetch_progress(cfg, ranks)))
    assert {"T1"} <= found


@pytest.mark.parametrize("variant", list(V))
def test_mixed_rank_vectors_end_in_a_verdict_never_a_crash(variant: V) -> None:
    """Different transfer sets and policies: a typed mismatch (T5) or a T1 split, named, never an exception."""
    rng = random.Random(5)
    seen = set()
    for _ in range(300):
        cfg, ranks = random_run(rng, variant, uniform=False)
        state = tp.check_prefetch_progress(cfg, ranks)
        if state.mismatch is not None:
            assert state.phase is tp.Phase.MISMATCHED and state.mismatch.groups()
        seen.add(violation(state))
    assert "T5" in seen


# ---- typed errors, nothing changed ---------------------------------------------------------------------------


def test_bad_progress_is_refused_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"RankProgress\.transfers: must be sidecar pools in component order"):
        tp.RankProgress(storage_hit=1, full_pages=1, transfers=(Pool.MAMBA, Pool.SWA))
    with pytest.raises(ConfigError, match=r"RankProgress\.storage_hit"):
        tp.RankProgress(storage_hit=-1, full_pages=0)
    with pytest.raises(ConfigError, match=r"RankProgress\.swa_missing"):
        tp.RankProgress(storage_hit=1, full_pages=1, swa_missing=(1, 0))
    with pytest.raises(ConfigError, match=r"TPPrefetchConfig\.existing: the nodes cover 192 tokens"):
        config(V.UPSTREAM_27264, request_pages=2, existing=(tp.HostNode(length=192),))
    with pytest.raises(ConfigError, match="not a multiple of page_size"):
        config(V.UPSTREAM_27264, existing=(tp.HostNode(length=100),))


@pytest.mark.parametrize(("ranks", "match"), [
    ([], "0 ranks, outside 1..8"),
    ([tp.RankProgress(storage_hit=1, full_pages=1)] * 9, "9 ranks, outside 1..8"),
    ([tp.RankProgress(storage_hit=11, full_pages=1)], "storage_hit 11 > request_pages 10"),
    ([tp.RankProgress(storage_hit=1, full_pages=11)], "full_pages 11 > request_pages 10"),
    ([tp.RankProgress(storage_hit=1, full_pages=1, swa_missing=(2,))], r"swa_missing \[2\] outside its 2-page"),
    ([tp.RankProgress(storage_hit=1, full_pages=1, registered=False)], "no rank registered"),
])
def test_bad_rank_vectors_are_invalid_operations(ranks: list[tp.RankProgress], match: str) -> None:
    with pytest.raises(InvalidOperation, match=match):
        tp.initial_state(config(V.UPSTREAM_27264), ranks)


def test_an_swa_transfer_needs_a_window_before_0523() -> None:
    with pytest.raises(InvalidOperation, match=r"floor\(T / P\) >= 2 window pages"):
        tp.initial_state(config(V.UPSTREAM_27264, request_pages=1), [tp.RankProgress(storage_hit=1, full_pages=1)])


@pytest.mark.parametrize("step", [tp.page_transfer, tp.can_terminate_prefetch, tp.reduce_prefetch_ack,
                                  tp.handle_prefetch_result])
def test_an_operation_out_of_order_raises_and_changes_nothing(
        step: Callable[[tp.PrefetchState], tp.PrefetchState]) -> None:
    state = tp.initial_state(config(V.UPSTREAM_27264), s10_ranks())
    before = state.model_dump()
    with pytest.raises(InvalidOperation, match=r"phase is started"):
        step(state)
    assert state.model_dump() == before
    done = tp.check_prefetch_progress(config(V.UPSTREAM_27264), s10_ranks())
    with pytest.raises(InvalidOperation, match="phase is committed, sync_prefetch_hit_query runs at started"):
        tp.sync_prefetch_hit_query(done)


def test_all_reduce_and_insert_refuse_misuse() -> None:
    with pytest.raises(InvalidOperation, match="0 ranks"):
        tp.all_reduce("x", [])
    with pytest.raises(InvalidOperation, match="not a whole number of pages"):
        tp.insert_host(config(V.UPSTREAM_27264), [], 100)
