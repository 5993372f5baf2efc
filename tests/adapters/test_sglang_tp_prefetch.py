"""SGLang 0.5.23's real TP prefetch sync and commit path on 2 (and 4) gloo CPU ranks, against kvproof's reference.

Each scenario runs a few prefetches on one real group (:func:`run_ranks`), computes
``check_prefetch_progress(config, ranks)`` with ``variant=upstream_0523`` for each, and compares every rank's
collectives (in kvproof's layout: :meth:`SGLangRankWorker._project`) and its commit with the reference. Where they
differ the test pins the difference (``KNOWN``: each one classified in /work/notes/sglang_tp_prefetch.md), so a
change on either side fails the test. Run with
``.venv-sglang/bin/python -m pytest tests/adapters/test_sglang_tp_prefetch.py``.
"""

from __future__ import annotations

import importlib.util
import os
import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvproof.reference.tp_prefetch import (
    HostNode,
    Phase,
    PoolName,
    RankProgress,
    SlotOwner,
    TerminationPolicy,
    TPPrefetchConfig,
    TPPrefetchVariant,
    check_prefetch_progress,
)

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("sglang") is None,
                                 reason="SGLang is not installed in this environment (make sglang: .venv-sglang)"),
              pytest.mark.xdist_group("ranks")]  # rank processes: one worker at a time on the 2-core machine

PHASES = ("sync_prefetch_hit_query", "page_transfer", "can_terminate_prefetch", "reduce_prefetch_ack",
          "handle_prefetch_result", "snapshot")
RP, TP = RankProgress, TerminationPolicy


@dataclass
class Prefetch:
    """One check of a prefetch on every rank (``continued``: the same prefetch, after a check that said wait)."""

    request_pages: int
    ranks: list[RankProgress]
    continued: bool = False
    finish_io: bool = False  # afterwards, let an IO thread still in flight end (not a kvproof operation)


@dataclass
class Outcome:
    divergences: list[str] = field(default_factory=list)
    replies: list[list[dict[str, Any]]] = field(default_factory=list)
    states: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    keys: list[tuple[Any, ...]] = field(default_factory=list)  # (prefetch, rank or None, what) per divergence

    def add(self, key: tuple[Any, ...], message: str) -> None:
        self.keys.append(key)
        self.divergences.append(message)

    def explain(self) -> str:
        return "\n".join(self.divergences) or "no divergence"


def _script(prefetches: list[Prefetch], before: list[Any] | None = None) -> list[Any]:
    script: list[Any] = list(before or [])
    for p in prefetches:
        script.append(("initial_state", [(p.request_pages, r) for r in p.ranks]))
        script += [(m, None) for m in PHASES]
        if p.finish_io:
            script += [("finish_io", None), ("snapshot", None)]
    return script


def _real_calls(replies: list[dict[str, Any]], phases: tuple[str, ...] = PHASES) -> list[tuple[Any, ...]]:
    """This rank's calls in kvproof's layout, in the five operations (``finish_io``'s are not kvproof's)."""
    return [(c["kvproof"]["name"], c["kvproof"]["op"], tuple(c["kvproof"]["values"]), tuple(c["kvproof"]["result"]))
            for r in replies if r.get("method") in phases for c in r.get("calls", []) if c.get("kvproof")]


def _ref_calls(state: Any, rank: int, continued: bool) -> list[tuple[Any, ...]]:
    return [(c.name, c.op.value, tuple(c.packed[rank].values), tuple(c.result)) for c in state.collectives
            if c.packed[rank] is not None and not (continued and c.name == "sync_prefetch_hit_query")]


def _tree_owned(owners: Any) -> list[bool]:
    return [o is SlotOwner.TREE or o == "tree" for o in owners]


#: the reference's slot owners as the adapter observes them right after the check (release queues drained)
_OWNER = {SlotOwner.TREE: "tree", SlotOwner.FREED: "freed", SlotOwner.RELEASE_QUEUE: "freed",
          SlotOwner.IO_THREAD: "held", SlotOwner.HELD: "held"}


def _owners(ref: Any, n: int, io_finished: bool) -> list[str]:
    """The reference's owners of the first ``n`` pages (0.5.23 allocates Full staging for the synced hit only); an IO
    thread that finished has released its pages (its completed_req ACK is drained in the same step)."""
    io = "freed" if io_finished else "held"
    return [io if o is SlotOwner.IO_THREAD else _OWNER[o] for o in ref][:n]


def run_scenario(world_size: int, group: dict[str, Any], prefetches: list[Prefetch],
                 timeout_s: float = 150.0, before: list[Any] | None = None) -> Outcome:
    from kvproof.conformance.adapters.sglang_tp_prefetch import run_ranks

    t0 = time.perf_counter()
    replies = run_ranks(world_size, group, _script(prefetches, before), timeout_s=timeout_s)
    out = Outcome(replies=replies, seconds=time.perf_counter() - t0)
    path = tuple(HostNode(length=n, swa_host=s) for n, s in group.get("existing", ()))
    step = len(before or [])
    for i, p in enumerate(prefetches):
        n_steps = 1 + len(PHASES) + (2 if p.finish_io else 0)
        mine = [[x for x in replies[r] if step <= x.get("step", -9) < step + n_steps] for r in range(world_size)]
        errors = [(r, x["error"]) for r in range(world_size) for x in replies[r] if "error" in x]
        config = TPPrefetchConfig(page_size=group["page_size"], sliding_window=group["sliding_window"],
                                  request_pages=p.request_pages, anchor_is_root=group.get("anchor_is_root", False),
                                  existing=path, variant=TPPrefetchVariant.UPSTREAM_0523)
        state = check_prefetch_progress(config, p.ranks)
        out.states.append(state)
        if errors:
            out.add((i, None, "error"), f"prefetch {i}: error " + "; ".join(
                f"rank {r}: {e if len(e) < 300 else e[:110] + ' ... ' + e[-150:]}" for r, e in errors))
            return out
        for r in range(world_size):
            by = {x["method"]: x for x in mine[r]}
            real = _real_calls(mine[r])
            ref = _ref_calls(state, r, p.continued)
            if real != ref:
                out.add((i, r, "calls"), f"prefetch {i} rank {r}: calls real {real} != reference {ref}")
            rank_state = state.ranks[r]
            handled = by["handle_prefetch_result"]
            ref_proceeds = bool(rank_state.proceeds) and state.phase is Phase.COMMITTED
            if handled["proceeds"] != ref_proceeds:
                out.add((i, r, "proceeds"), f"prefetch {i} rank {r}: proceeds real {handled['proceeds']} != reference "
                                       f"{ref_proceeds} (phase {state.phase.value})")
                continue
            if not ref_proceeds:
                continue
            commit, ref_commit = handled["commit"], rank_state.commit
            # the IO threads' slots come back once every rank's ACKs drained (rank-min): all IO threads finished
            fin = all(rs.io is not None and rs.io.finished for rs in state.ranks)
            ref_nodes = [(n.length, n.swa_host) for n in ref_commit.nodes]
            real_nodes = [tuple(n) for n in commit["nodes"]]
            checks = {"nodes": (real_nodes, ref_nodes), "attached": (commit["attached"], ref_commit.attached),
                      "discarded": (commit["discarded"], ref_commit.discarded),
                      "total_len": (commit["total_len"], ref_commit.total_len),
                      "prefix_len": (commit["prefix_len"], ref_commit.prefix_len),
                      "full pages in the tree": (_tree_owned(commit["full_slots"]).count(True),
                                                 _tree_owned(ref_commit.full_slots).count(True)),
                      "swa pages attached": (_tree_owned(commit["swa_slots"]).count(True),
                                             _tree_owned(ref_commit.swa_slots).count(True)),
                      "full slot owners": (commit["full_slots"], _owners(ref_commit.full_slots,
                                                                         len(commit["full_slots"]), fin)),
                      "swa slot owners": (commit["swa_slots"], _owners(ref_commit.swa_slots,
                                                                       len(commit["swa_slots"]), fin))}
            for what, (a, b) in checks.items():
                if a != b:
                    out.add((i, r, what), f"prefetch {i} rank {r}: {what} real {a} != reference {b}")
        if os.environ.get("KVPROOF_SGTP_VERBOSE"):
            for r in range(world_size):
                h = next(x for x in mine[r] if x["method"] == "handle_prefetch_result")
                c, rc = h["commit"] or {}, state.ranks[r].commit
                ref_c = None if rc is None else (rc.discarded, rc.attached, rc.total_len)
                real_c = (c.get("discarded"), c.get("attached"), c.get("total_len"))
                print(f"prefetch {i} rank {r}: ref phase {state.phase.value} proceeds {state.ranks[r].proceeds} "
                      f"commit {ref_c} | real via {h['via']} {real_c}")
        if p.finish_io:  # every slot an in-flight IO thread owned has come back
            last = [[x for x in mine[r] if x["method"] == "snapshot"][-1] for r in range(world_size)]
            for r, snap in enumerate(last):
                if snap["full_io_thread"] or snap["swa_io_thread"] or snap["pending_acks"]:
                    out.add((i, r, "io leak"), f"prefetch {i} rank {r}: after finish_io still owned by IO: "
                                           f"full {snap['full_io_thread']} swa {snap['swa_io_thread']} pages, "
                                           f"{snap['pending_acks']} ACK(s) pending")
        trees = {tuple(tuple(n) for n in [x for x in mine[r] if x["method"] == "snapshot"][-1]["nodes"])
                 for r in range(world_size)}
        if len(trees) != 1:
            out.add((i, None, "trees differ"), f"prefetch {i}: the ranks' host trees differ: {sorted(trees)}")
        if state.phase is Phase.COMMITTED and all(rs.commit is not None for rs in state.ranks):
            commit0 = state.ranks[0].commit
            assert commit0 is not None
            path = tuple(HostNode(length=n.length, swa_host=n.swa_host) for n in commit0.nodes)  # path_after
        step += n_steps
    return out


# ---------------------------------------------------------------- scenarios

MID = {"page_size": 2, "sliding_window": 4, "anchor_is_root": False, "existing": [(4, True)],
       "max_request_pages": 8}
ROOT = {"page_size": 2, "sliding_window": 4, "anchor_is_root": True, "existing": [], "max_request_pages": 8}
#: both tree cores: the Python one (its SWAComponent._commit_prefetch) and 0.5.23's default, the Rust one (no API to
#: build an existing node with an SWA host value there, so its path starts as an SWA tombstone)
CORES = ("python", "rust")


def mid(core: str) -> dict[str, Any]:
    return {**MID, "tree_core": core} if core == "python" else {**MID, "tree_core": core, "existing": [(4, False)]}


@pytest.mark.parametrize("core", CORES)
def test_same_progress_and_differing_hits_window_and_pace_world_2(core: str) -> None:
    prefetches = [
        Prefetch(6, [RP(storage_hit=6, full_pages=6), RP(storage_hit=6, full_pages=6)]),  # all equal: attach
        Prefetch(8, [RP(storage_hit=8, full_pages=8), RP(storage_hit=7, full_pages=7)]),  # hits differ: MIN
        Prefetch(8, [RP(storage_hit=8, full_pages=8), RP(storage_hit=8, full_pages=8, swa_missing=(1,))]),
        Prefetch(8, [RP(storage_hit=8, full_pages=8), RP(storage_hit=8, full_pages=8, swa_missing=(0,))]),
        Prefetch(8, [RP(storage_hit=8, full_pages=8), RP(storage_hit=8, full_pages=5)]),  # a Full read fails
    ]
    out = run_scenario(2, mid(core), prefetches)
    print(f"{len(prefetches)} prefetches on 2 ranks in {out.seconds:.1f}s ({core} tree core)")
    assert out.keys == [], out.explain()


@pytest.mark.parametrize("core", CORES)
def test_pace_wait_complete_then_best_effort_world_2(core: str) -> None:
    prefetches = [
        Prefetch(8, [RP(storage_hit=8, full_pages=8), RP(storage_hit=8, full_pages=5, io_done=False)]),
        Prefetch(8, [RP(storage_hit=8, full_pages=8), RP(storage_hit=8, full_pages=8)], continued=True),
        Prefetch(8, [RP(storage_hit=8, full_pages=8, policy=TP.BEST_EFFORT),
                     RP(storage_hit=8, full_pages=3, io_done=False, policy=TP.BEST_EFFORT)], finish_io=True),
    ]
    out = run_scenario(2, mid(core), prefetches)
    # D3 (docs/sglang-findings.md, now modelled): a rank whose IO is in flight has emitted no ACK, so nothing is
    # reduced at that check; both discard, the slots stay with the IO threads until the ACKs drain (rank-min)
    assert out.keys == [], out.explain()


@pytest.mark.parametrize("core", CORES)
def test_root_sub_window_and_zero_hit_world_2(core: str) -> None:
    prefetches = [
        Prefetch(6, [RP(storage_hit=1, full_pages=6), RP(storage_hit=1, full_pages=6)]),  # hit < window at root
        Prefetch(6, [RP(storage_hit=0, full_pages=0), RP(storage_hit=3, full_pages=3)]),  # synced hit 0
    ]
    out = run_scenario(2, {**ROOT, "tree_core": core}, prefetches)
    # D1 and D2 (now modelled): a hit-sized buffer at the root is a whole window, attached; a synced hit of 0 revokes
    assert out.keys == [], out.explain()
    assert out.states[1].phase is Phase.REVOKED



@pytest.mark.parametrize("core", CORES)
def test_timeout_vote_world_2(core: str) -> None:
    prefetches = [
        Prefetch(8, [RP(storage_hit=8, full_pages=8, policy=TP.TIMEOUT),
                     RP(storage_hit=8, full_pages=2, io_done=False, deadline_passed=True, policy=TP.TIMEOUT)],
                 finish_io=True),
    ]
    out = run_scenario(2, mid(core), prefetches)
    assert out.keys == [], out.explain()  # the deadline vote: MAX of [0] and [1]; D3 as in the pace scenario


def test_different_transfer_sets_is_a_bounded_mismatch_world_2() -> None:
    prefetches = [Prefetch(6, [RP(storage_hit=6, full_pages=6), RP(storage_hit=6, full_pages=6, transfers=())])]
    t0 = time.perf_counter()
    out = run_scenario(2, MID, prefetches, timeout_s=60)
    took = time.perf_counter() - t0
    state = out.states[0]
    assert state.phase is Phase.MISMATCHED and state.mismatch is not None
    assert state.mismatch.name == "sync_prefetch_hit_query"
    print("reference:", state.mismatch.describe())
    print(f"real, verdict after {took:.1f}s (rank start-up included):", out.divergences)
    assert out.keys == [(0, None, "error")], out.explain()
    # the verdict names both ranks and the shapes they entered the collective with (R = 6: 7 flags + 23 verdicts on
    # the rank with an SWA transfer, 1 hit + 23 on the other)
    verdict = out.divergences[0]
    assert "rank 0:" in verdict and "rank 1:" in verdict
    assert "sync_prefetch_hit_query all_reduce(MIN) of 30 value(s)" in verdict
    assert "sync_prefetch_hit_query all_reduce(MIN) of 24 value(s)" in verdict
    assert took < 60
    import multiprocessing
    assert multiprocessing.active_children() == []


@pytest.mark.parametrize("core", CORES)
def test_rank_local_host_pressure_breaks_t1_world_2(core: str) -> None:
    """F6 (docs/sglang-findings.md): rank 1 has 5 free Full host pages, rank 0 17. The synced hit is 8 pages on
    both; rank 1's ``_try_alloc_storage_hit`` allocates 5 (``allow_partial``) and truncates its ``hash_value`` to 5
    pages, after the hit query. The completed ACKs MIN to 5 pages on both; rank 0 expects 8 and discards, rank 1
    expects 5 and inserts 10 tokens with the SWA window of pages 3-4 attached: the host trees differ (T1),
    silently."""
    empty = {**MID, "existing": [], "tree_core": core}
    prefetches = [Prefetch(8, [RP(storage_hit=8, full_pages=8), RP(storage_hit=8, full_pages=8)])]
    out = run_scenario(2, empty, prefetches, before=[("fill_host", [(0, 0), (12, 0)])])
    assert set(out.keys) == KNOWN_PRESSURE, out.explain()
    handled = [next(x for x in out.replies[r] if x.get("method") == "handle_prefetch_result") for r in (0, 1)]
    assert handled[0]["commit"]["discarded"] and not handled[1]["commit"]["discarded"]
    assert [tuple(n) for n in handled[1]["commit"]["nodes"]] == [(6, False), (4, True)]


#: F6: the reference has no host pressure (each rank holds its request's pages: both commit 16 tokens); 0.5.23's
#: rank 0 discards, its rank 1 commits 10 tokens, the trees differ.
KNOWN_PRESSURE: set[tuple[Any, ...]] = {(0, None, "trees differ"), (0, 0, "calls"), (0, 1, "calls")} | {
    (0, 0, w) for w in ("nodes", "attached", "discarded", "total_len", "full pages in the tree", "swa pages attached",
                        "full slot owners", "swa slot owners")} | {
    (0, 1, w) for w in ("nodes", "total_len", "full pages in the tree")}


def test_a_rank_that_skips_the_collective_times_out_world_2() -> None:
    """Rank 1 never registered the prefetch (``registered=False``): it makes no hit-query collective, rank 0 does and
    times out after the group's bounded 5 s (every group, the dedicated ones included, is built with it); rank 1's
    next collective (the queue-size MIN of its scheduler step) times out too. The reference: a mismatch with "no
    call" for rank 1."""
    prefetches = [Prefetch(6, [RP(storage_hit=6, full_pages=6), RP(storage_hit=6, full_pages=6, registered=False)])]
    t0 = time.perf_counter()
    out = run_scenario(2, MID, prefetches, timeout_s=60)
    took = time.perf_counter() - t0
    state = out.states[0]
    assert state.phase is Phase.MISMATCHED and state.mismatch is not None
    assert state.mismatch.groups() == {"MIN shape (10,)": (0,), "no call": (1,)}
    print(f"real, verdict after {took:.1f}s:", out.divergences)
    assert out.keys == [(0, None, "error")], out.explain()
    assert "Timed out" in out.divergences[0]
    assert took < 60


def test_swa_and_mamba_transfer_sets_same_shape_world_2() -> None:
    """Rank 0 fetches an SWA window, rank 1 a Mamba checkpoint: both TRAILING_PAGES, so the hit queries (flags + the
    23 verdicts, ``-1`` for the pool a rank omitted) and the pool ACKs (by ``PoolName``) have the same shapes; the MIN
    gives each rank 0 for the pool it fetched, so both discard and the trees agree. Then both ranks with SWA and
    Mamba, one rank's Mamba fetch failing (both discard), and none failing (both attach)."""
    prefetches = [
        Prefetch(6, [RP(storage_hit=6, full_pages=6), RP(storage_hit=6, full_pages=6, transfers=(PoolName.MAMBA,))]),
        Prefetch(6, [RP(storage_hit=6, full_pages=6, transfers=(PoolName.SWA, PoolName.MAMBA)),
                     RP(storage_hit=6, full_pages=6, transfers=(PoolName.SWA, PoolName.MAMBA), mamba_missing=True)]),
        Prefetch(6, [RP(storage_hit=6, full_pages=6, transfers=(PoolName.SWA, PoolName.MAMBA))] * 2),
    ]
    out = run_scenario(2, MID, prefetches)
    assert out.keys == [], out.explain()


@pytest.mark.parametrize("core", CORES)
def test_rank_local_revoke_pairs_acks_across_requests_world_2(core: str) -> None:
    """F7 (docs/sglang-findings.md): rank 1 has no free Full host page when request 1's synced hit arrives:
    ``_try_alloc_storage_hit``
    revokes it there only (after the hit query). Rank 0 fetches it and queues three ACKs that rank 1 never emits.
    Request 2 then runs on both; the sync threads pair rank 0's request-1 ACKs with rank 1's request-2 ACKs (same
    shapes): rank 0 applies MIN(16, 12) = 12 tokens to request 1 and discards it (it expects 16), rank 1 commits
    request 2 (12 tokens, window attached), rank 0's request 2 waits behind ACKs that pair with whatever comes
    next. The host trees differ."""
    from kvproof.conformance.adapters.sglang_tp_prefetch import run_ranks

    steps = [(m, None) for m in PHASES]
    script = [("fill_host", [(0, 0), (17, 0)]), ("initial_state", [(8, RP(storage_hit=8, full_pages=8))] * 2),
              *steps, ("unpin_host", None),
              ("initial_state", [(6, RP(storage_hit=6, full_pages=6), True)] * 2), *steps]
    out = run_ranks(2, {**MID, "existing": [], "tree_core": core}, script, timeout_s=120)
    assert all("error" not in x for r in (0, 1) for x in out[r]), out
    query = [[x for x in out[r] if x["method"] == "sync_prefetch_hit_query"] for r in (0, 1)]
    assert [q[0]["revoked"] for q in query] == [False, True]  # request 1: revoked on rank 1 only, after the sync
    reduced = [[x for x in out[r] if x["method"] == "reduce_prefetch_ack"][-1] for r in (0, 1)]
    acks = [[c["kvproof"]["values"] for c in red["calls"]] for red in reduced]
    assert acks == [[[8], [0, 0, 2]], [[6], [0, 0, 2]]]  # rank 0 reduces request 1's ACKs, rank 1 request 2's
    handled = [[x for x in out[r] if x["method"] == "handle_prefetch_result"][-1] for r in (0, 1)]
    assert handled[0]["handled"] == [{"rid": "req-1", "usable": False, "completed_tokens": 12, "expected_tokens": 16}]
    assert handled[1]["handled"] == [{"rid": "req-2", "usable": True, "completed_tokens": 12, "expected_tokens": 12}]
    trees = [[tuple(n) for n in [x for x in out[r] if x["method"] == "snapshot"][-1]["nodes"]] for r in (0, 1)]
    assert trees == [[], [(8, False), (4, True)]]


def test_rank_consensus_checker_catches_f6_world_2() -> None:
    """With SGLang's own checker on (``SGLANG_ENABLE_RANK_CONSENSUS_CHECKER=1``), F6's divergent trees surface at the
    next ``match_prefix`` (``@rank_consensus`` on ``full_kv_hit_length`` / ``swa_host_hit_length``): its worker thread
    compares the digests and ``os._exit(1)``s every rank. Without host pressure the same run passes the checker."""
    group = {**MID, "existing": [], "rank_consensus": True}
    tail = [(m, None) for m in (*PHASES, "match_prefix")]
    start = [("initial_state", [(8, RP(storage_hit=8, full_pages=8))] * 2)]
    from kvproof.conformance.adapters.sglang_tp_prefetch import run_ranks

    calm = run_ranks(2, group, start + tail, timeout_s=90)
    matched = [next(x for x in calm[r] if x.get("method") == "match_prefix") for r in (0, 1)]
    assert all("error" not in x for r in (0, 1) for x in calm[r]), calm
    assert matched[0]["host_hit_length"] == matched[1]["host_hit_length"]
    pressed = run_ranks(2, group, [("fill_host", [(0, 0), (12, 0)]), *start, *tail], timeout_s=90)
    last = [pressed[r][-1] for r in (0, 1)]
    assert [x.get("exitcode") for x in last] == [1, 1], last
    assert [x.get("method") for r in (0, 1) for x in pressed[r]].count("match_prefix") == 0  # died inside it


# ---------------------------------------------------------------- the lockstep suite on the real SGLang


@pytest.mark.parametrize("config", ["pair-N2-P2-W4-R8", "quad-N4-P4-W6-R6"])
def test_the_lockstep_suite_drives_sglang_against_upstream_0523(config: str) -> None:
    """The ``tp_prefetch`` suite itself (its rules draw each rank's storage hit, pace, failed window pages, deadline,
    policy and transfer set; a waiting check continues) drives SGLang's real code on gloo ranks
    (:class:`SGLangTPPrefetch`) in lockstep with the ``upstream_0523`` reference: every collective, decision, commit
    and host path agrees after every step (``kvproof conform --impl ...SGLangTPPrefetch`` runs the ci profile)."""
    from kvproof.conformance.adapters.sglang_tp_prefetch import SGLangTPPrefetch
    from kvproof.conformance.check import run_check
    from kvproof.conformance.tp_prefetch import TP_CONFIGS

    group = next(g for g in TP_CONFIGS if g.label() == config)
    report = run_check("tp_prefetch", SGLangTPPrefetch, group, profile="dev", failures_dir=None)
    assert report.passed, report.failure
    assert report.steps >= 100 and report.never_run == () and report.calls["handle_prefetch_result"] > 10


def test_a_window_in_host_slots_out_of_order_is_read_from_its_first_position() -> None:
    """Found by the deep campaign (root_short, 35 steps, shrunk by rounds to 23): after earlier rounds freed host
    pages, the window attached at the last commit sits in host SWA slots whose ids do not ascend with the positions.
    The adapter read the window's source from the lowest slot id (the KV of tokens 8-9, not 4-5) and reported a T3
    divergence SGLang did not make; it reads the node's first slot now. The vector replays, and passes, on SGLang."""
    from pathlib import Path

    from kvproof.conformance.adapters.sglang_tp_prefetch import SGLangTPPrefetch
    from kvproof.conformance.check import replay_vector
    from kvproof.conformance.vector import load_vector

    vector = load_vector(Path(__file__).with_name("vectors") / "tp_prefetch_root_short_swa_slots_out_of_order.json")
    result = replay_vector(vector, SGLangTPPrefetch, op_timeout=60)
    assert result.passed and result.steps == len(vector["steps"]) == 23, result.failure


def test_the_suite_finds_f6_on_sglang_under_host_pressure() -> None:
    """``--ranks host_pressure``: ranks that agree on everything but their free Full host pages at hit time. The suite
    finds F6 on the real code, shrunk to one check, classified (the reference breaks T1 the same way)."""
    from kvproof.conformance.adapters.sglang_tp_prefetch import SGLangTPPrefetch
    from kvproof.conformance.check import run_check
    from kvproof.conformance.tp_prefetch import TP_CONFIGS

    report = run_check("tp_prefetch", SGLangTPPrefetch, TP_CONFIGS[0], profile="ci", failures_dir=None,
                       ranks="host_pressure")
    failure = report.failure or ""
    assert "the upstream_0523 protocol breaks [T1]" in failure and "known finding: F6" in failure, failure
    assert failure.count("initial_state(") == 1 and "host pages free" in failure


def test_the_suite_with_sglangs_own_consensus_checker_on() -> None:
    """SGLang's rank-consensus checker switched on (:class:`SGLangTPPrefetchConsensus`): after every step each rank
    runs the real ``match_prefix``, the checker compares the ranks' hit lengths in its own thread (it would exit
    every rank on a divergence) and the suite compares the trees with the reference: both agree throughout."""
    from kvproof.conformance.adapters.sglang_tp_prefetch import SGLangTPPrefetchConsensus
    from kvproof.conformance.check import run_check
    from kvproof.conformance.tp_prefetch import TP_CONFIGS

    report = run_check("tp_prefetch", SGLangTPPrefetchConsensus, TP_CONFIGS[1], profile="dev", failures_dir=None)
    assert report.passed, report.failure
    assert report.steps >= 100


def test_a_reference_of_another_protocol_diverges_from_sglang_at_once() -> None:
    """Test the tester: the same run against the #27264-era reference diverges at the first collective (0.5.23
    packs restorable flags and pool verdicts, #27264 a lone hit)."""
    from kvproof.conformance.adapters.sglang_tp_prefetch import SGLangTPPrefetch
    from kvproof.conformance.check import run_check
    from kvproof.conformance.tp_prefetch import TP_CONFIGS

    report = run_check("tp_prefetch", SGLangTPPrefetch, TP_CONFIGS[0], profile="dev", failures_dir=None,
                       variant="upstream_27264")
    failure = report.failure or ""
    assert "sync_prefetch_hit_query: collective sync_prefetch_hit_query: rank 0 passed MIN {'flag_0': 1" in failure
    assert "the reference MIN {'hit': " in failure


def test_world_4_mixed_progress() -> None:
    if os.environ.get("KVPROOF_SKIP_WORLD4"):
        pytest.skip("KVPROOF_SKIP_WORLD4 set")
    prefetches = [
        Prefetch(6, [RP(storage_hit=6, full_pages=6)] * 3 + [RP(storage_hit=5, full_pages=5)]),
        Prefetch(8, [RP(storage_hit=8, full_pages=8)] * 3 + [RP(storage_hit=8, full_pages=8, swa_missing=(1,))]),
    ]
    out = run_scenario(4, MID, prefetches, timeout_s=240)
    print(f"{len(prefetches)} prefetches on 4 ranks in {out.seconds:.1f}s")
    assert out.keys == [], out.explain()


def test_no_process_left_behind() -> None:
    """After a run, no rank process is alive at any depth: the ranks are forked by ``run_ranks``' fork server, so they
    are its children, not this process's. Python's own helpers, started once and living as long as this process
    (they exit with it), are the only processes allowed: ``multiprocessing.resource_tracker`` and the fork server
    itself (which imported SGLang once); anything below them is a rank left behind."""
    import multiprocessing

    from kvproof.conformance.adapters.sglang_tp_prefetch import run_ranks

    replies = run_ranks(2, MID, [("snapshot", None)], timeout_s=60)
    assert [r[-1].get("method") for r in replies] == ["snapshot", "snapshot"], replies
    assert multiprocessing.active_children() == []
    helpers = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
    mine = _children(os.getpid())
    assert any("multiprocessing.forkserver" in cmd for _, cmd in mine), mine  # the ranks came from the fork server
    left = [(pid, cmd) for pid, cmd in mine if not any(h in cmd for h in helpers)]
    for pid, cmd in mine:
        if any(h in cmd for h in helpers):
            left += _descendants(pid)
    assert left == [], left


def _descendants(pid: int) -> list[tuple[int, str]]:
    kids = _children(pid)
    return kids + [d for kid, _ in kids for d in _descendants(kid)]


def _children(pid: int) -> list[tuple[int, str]]:
    kids: list[tuple[int, str]] = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{entry}/cmdline") as f:
                    cmd = f.read().replace("\0", " ")
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append((int(entry), cmd))
    return kids
