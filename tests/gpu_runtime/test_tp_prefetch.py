"""The multi-process ``tp_prefetch`` runtime: real rank processes over a real gloo group, checked against the
reference call by call; mismatched collectives as bounded verdicts; nothing left running."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvproof.gpu_runtime import _ranks
from kvproof.gpu_runtime.tp_prefetch import TPPrefetchRuntime
from kvproof.reference import tp_prefetch as tp
from kvproof.reference.contract import TPPrefetchUnderTest
from kvproof.reference.errors import InvalidOperation, InvariantViolation
from kvproof.reference.registry import Component
from kvproof.reference.tp_prefetch import HostNode, Phase, PoolName, RankProgress, TerminationPolicy, TPPrefetchVariant

pytestmark = pytest.mark.xdist_group("ranks")  # rank processes: one worker at a time on the 2-core machine

OPS = ("sync_prefetch_hit_query", "page_transfer", "can_terminate_prefetch", "reduce_prefetch_ack",
       "handle_prefetch_result")
TIMEOUT = 2.0  # the group's collective timeout in these tests (the default is 3 s)


def group(n: int, variant: TPPrefetchVariant = TPPrefetchVariant.UPSTREAM_0523, *, p: int = 2, w: int = 4,
          r: int = 8, existing: tuple[HostNode, ...] = (HostNode(length=4, swa_host=True),
                                                         HostNode(length=2, swa_host=False))) -> tp.TPPrefetchGroup:
    return tp.TPPrefetchGroup(name="t", world_size=n, page_size=p, sliding_window=w, max_request_pages=r,
                              existing=existing, variant=variant)


@pytest.fixture(autouse=True)
def _nothing_left(no_rank_left: None) -> None:
    """Every test ends with no rank process of this pytest process running."""


def check(runtime: TPPrefetchRuntime, g: tp.TPPrefetchGroup, path: tuple[HostNode, ...], r: int,
          ranks: list[RankProgress], continues: tp.PrefetchState | None = None) -> tp.PrefetchState:
    """One check on both sides (``continues``: the waiting check it continues), compared operation by operation; the
    reference's final state."""
    state = tp.initial_state(g.check_config(r, path), ranks, continues=continues)
    runtime.initial_state(r, ranks)
    for op in OPS:
        before = state
        state = getattr(tp, op)(state)
        got = getattr(runtime, op)()
        assert got.compared() == tp.phase_report(op, before, state).compared(), op
        if state.phase in (Phase.WAITING, Phase.MISMATCHED, Phase.REVOKED):
            break
    return state


def random_progress(rnd: random.Random, r: int, window: int, policy: TerminationPolicy) -> RankProgress:
    missing = tuple(sorted(rnd.sample(range(window), rnd.randint(0, min(1, window)))))
    hit = 0 if rnd.random() < 0.05 else rnd.randint(1, r)  # a synced hit of 0 revokes the prefetch (0.5.23)
    return RankProgress(storage_hit=hit, full_pages=rnd.randint(0, r), io_done=rnd.random() < 0.7,
                        deadline_passed=rnd.random() < 0.5, policy=policy, transfers=(PoolName.SWA,),
                        swa_missing=missing)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_the_runtime_agrees_with_the_reference_on_random_checks(n: int) -> None:
    """60 checks of prefetches on a growing host path (continued after a wait, some revoked): every collective,
    decision and commit as the reference's; the paths equal across ranks and to the reference's, every host slot
    accounted for."""
    g = group(n)
    runtime = TPPrefetchRuntime(g, collective_timeout=TIMEOUT)
    assert isinstance(runtime, TPPrefetchUnderTest) and Component.TP_PREFETCH in runtime.components
    rnd = random.Random(n)
    path, waiting, committed, revoked = g.existing, None, 0, 0
    for _ in range(60):
        r = waiting.config.request_pages if waiting else rnd.randint(max(g.path_pages(path), 1), g.max_request_pages)
        window = g.sw_pages if r >= g.sw_pages else r
        policy = waiting.ranks[0].progress.policy if waiting else rnd.choice(list(TerminationPolicy))
        ranks = [random_progress(rnd, r, window, policy) for _ in range(n)]
        if waiting:  # the same request continues: what the storage answered stays, the pace only moves on
            ranks = [w.progress if w.progress.io_done else q.model_copy(update={
                "storage_hit": w.progress.storage_hit, "full_pages": max(q.full_pages, w.progress.full_pages),
                "deadline_passed": q.deadline_passed or w.progress.deadline_passed})
                for q, w in zip(ranks, waiting.ranks, strict=True)]
        state = check(runtime, g, path, r, ranks, waiting)
        waiting = state if state.phase is Phase.WAITING else None
        revoked += state.phase is Phase.REVOKED
        if state.phase is Phase.COMMITTED:
            committed += 1
            tp.check_tp_prefetch(state)
            path = tp.path_after(state.ranks[0].commit)  # type: ignore[arg-type]
        for rank in runtime.snapshot().ranks:
            assert rank.nodes == path
            assert rank.conservation_problem(g.page_size) is None
    assert committed >= 20 and revoked >= 1


def test_s10_on_real_ranks_under_pre_27264() -> None:
    """S10 (sglang_semantics.md §9): one rank misses a window page, the other fetched its whole window; with only the
    completed count synced, rank 0 attaches the window and rank 1 drops it: the ranks' trees differ (T1)."""
    g = group(2, TPPrefetchVariant.PRE_27264)
    runtime = TPPrefetchRuntime(g, collective_timeout=TIMEOUT)
    whole = RankProgress(storage_hit=8, full_pages=8)
    state = check(runtime, g, g.existing, 8, [whole, whole.model_copy(update={"swa_missing": (1,)})])
    commits = [r.commit for r in state.ranks]
    assert commits[0] is not None and commits[1] is not None
    assert commits[0].attached and not commits[1].attached
    with pytest.raises(InvariantViolation, match=r"\[T1\]"):
        tp.check_tp_prefetch(state)
    a, b = (runtime.snapshot().ranks[i].nodes for i in (0, 1))
    assert a != b


def test_a_mismatched_collective_is_a_bounded_verdict_naming_ranks_and_shapes() -> None:
    """Ranks with and without a trailing-pages transfer pack hit queries of different lengths (T5): on gloo the short
    rank returns garbage or dies, the long ones time out. The runtime reports the mismatch, each rank's shape, within
    the bound, and takes the group down."""
    g = group(3)
    runtime = TPPrefetchRuntime(g, collective_timeout=TIMEOUT)
    pids = set(runtime.group.pids)
    base = RankProgress(storage_hit=8, full_pages=8)
    runtime.initial_state(8, [base, base, base.model_copy(update={"transfers": ()})])
    start = time.monotonic()
    report = runtime.sync_prefetch_hit_query()
    seconds = time.monotonic() - start
    assert report.phase is Phase.MISMATCHED and report.mismatch is not None
    assert report.mismatch.groups() == {"MIN shape (12,)": (0, 1), "MIN shape (4,)": (2,)}
    assert "rank 2: all_reduce(MIN) of 4 value(s) [hit, kv, mamba, swa]" in report.mismatch.describe()
    assert seconds < 3 * TIMEOUT + _ranks.GRACE_S
    assert not any(_alive(pid) for pid in pids), "the broken group's ranks are still running"
    with pytest.raises(InvalidOperation, match="gone after a failed collective"):
        runtime.page_transfer()


def test_a_rank_that_skips_a_collective_is_seen_at_the_timeout() -> None:
    """A rank that never joins the completed-count all-reduce (the mutant ``last_rank_skips_ack``): the other waits
    in it until the group's timeout; the runtime names both (the skipping rank: no call) after about that time."""
    from kvproof.conformance.mutants.tp_prefetch import MUTANTS

    g = group(2)
    runtime = MUTANTS["last_rank_skips_ack"](g, collective_timeout=TIMEOUT)
    whole = RankProgress(storage_hit=8, full_pages=8)
    runtime.initial_state(8, [whole, whole])
    for op in OPS[:3]:
        getattr(runtime, op)()
    start = time.monotonic()
    report = runtime.reduce_prefetch_ack()
    seconds = time.monotonic() - start
    assert report.phase is Phase.MISMATCHED and report.mismatch is not None
    assert report.mismatch.groups() == {"MIN shape (1,)": (0,), "no call": (1,)}
    assert TIMEOUT * 0.8 < seconds < 2 * TIMEOUT + _ranks.GRACE_S
    assert "rank 0: reduce_prefetch_ack failed after" in report.detail


def test_bad_input_is_refused_before_any_rank_changes() -> None:
    g = group(2)
    runtime = TPPrefetchRuntime(g, collective_timeout=TIMEOUT)
    before = runtime.snapshot()
    with pytest.raises(InvalidOperation, match="progress values for 2 ranks"):
        runtime.initial_state(8, [RankProgress(storage_hit=8, full_pages=8)])
    with pytest.raises(InvalidOperation, match="no rank registered"):
        runtime.initial_state(8, [RankProgress(storage_hit=8, full_pages=8, registered=False)] * 2)
    assert runtime.snapshot() == before


def test_the_group_refuses_bad_sizes_and_a_broken_group() -> None:
    with pytest.raises(_ranks.RankGroupError, match=r"outside 1\.\.8"):
        _ranks.RankGroup(9)
    group_ = _ranks.RankGroup(2, collective_timeout=TIMEOUT)
    group_.close()
    with pytest.raises(_ranks.RankGroupError, match="broken"):
        group_.command("snapshot")


def test_a_dead_rank_is_named_with_its_last_words() -> None:
    """A rank that dies in a command is reported dead, with its exit code and the last line it wrote to stderr (kept
    in an unnamed file); the group is broken and torn down."""
    group_ = _ranks.RankGroup(2, collective_timeout=TIMEOUT)
    try:
        group_.command("__init__", [("types:SimpleNamespace", {"say": os.write, "die": os._exit})] * 2)
        group_.command("say", [(2, b"UserWarning: not these\n"), (2, b"rank 1: the pool ran dry\nUserWarning: x\n")])
        replies = group_.command("die", [(0,), (3,)])
        assert [r.status for r in replies] == ["dead", "dead"]
        assert replies[0].error == "rank 0 died (exit code 0)"
        assert replies[1].error == "rank 1 died (exit code 3): rank 1: the pool ran dry"
        assert "rank 1 dead" in group_.broken and not group_.alive()
    finally:
        group_.close()


def test_ranks_die_with_a_killed_parent(tmp_path: Path) -> None:
    """A parent killed with SIGKILL (no atexit, no close) leaves no rank behind: each rank exits when its connection
    closes, or the kernel kills it (PR_SET_PDEATHSIG). Nor anything on disk: its temporary directory stays empty (a
    forked, isolated check ends with ``os._exit``, as a killed one, without closing its groups)."""
    script = textwrap.dedent("""
        import sys, time
        from kvproof.gpu_runtime import _ranks
        g = _ranks.RankGroup(2, collective_timeout=2.0)
        print(" ".join(map(str, g.pids)), flush=True)
        time.sleep(60)
    """)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              env=dict(os.environ, TMPDIR=str(tmp)))
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2
        assert not list(tmp.iterdir()), "a started group left files in its temporary directory"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        deadline = time.monotonic() + 10
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [p for p in pids if _alive(p)]
            time.sleep(0.05)
        assert not alive, f"ranks {alive} outlived their killed parent"
        assert not list(tmp.iterdir()), "a killed group left files in its temporary directory"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
