"""A legal tensor-parallel prefetch group written from the contract (``TPPrefetchUnderTest``), not kvproof's runtime.

Written from docs/contract.md ("``TPPrefetchUnderTest``"), the protocol in the module docstring of
``kvproof.reference.tp_prefetch`` (packed layouts per variant, the five operations, the commit rules) and
sglang_semantics.md §6 (upstream_0523_vllm_fuzz.md §2 for 0.5.23). It uses only the reference's *types* and the
shared process harness ``kvproof.gpu_runtime._ranks`` (N rank processes over a real gloo group, every
``torch.distributed.all_reduce`` observed); every decision is this module's own.

**One rank** (:class:`RankWorker`, in its own process) keeps

* its **host path** below the anchor as a list of :class:`_Node` (length in tokens, its Full host page ids,
  its SWA host page ids or ``None`` for an SWA tombstone);
* its two **host pools** (Full: ``2 * max_request_pages`` pages, SWA: ``max_request_pages + max(sw_pages,
  max_request_pages)``) as free lists of page ids (:class:`~tests.legal.swa_allocator._Pool`, the page-reuse
  policy);
* the **prefetch in progress** (:class:`_Prefetch`): its staged Full host pages and its window buffer, the rank's
  progress, and what each operation derived (synced hit, the IO thread's result, the decision, the reduced
  counts). The IO thread writes into each SWA buffer slot the token position whose KV it fetched
  (:attr:`RankWorker.swa_data`); the commit reads it back (``swa_from``).

**Staging** (docs/contract.md): before 0.5.23 a registered rank takes ``R`` Full pages and its window keys' SWA
pages at ``initial_state``; 0.5.23 takes nothing there and stages right after the hit-query MIN: a synced hit
``h = 0`` revokes (the rank drops the prefetch; the group reports ``revoked``), else ``min(h, host_free_pages)``
Full pages and ``min(window keys, h)`` SWA pages. The IO thread's *target* is ``min(h, staged)``; 0.5.23's IO
thread shrinks a buffer longer than its SWA keys (F6) and releases the tail. The buffers are held until the commit
on a proceeding rank; the snapshot reports them as ``full_held`` / ``swa_held``. **Continuation**: the group
remembers the request whose check ended ``waiting``; the next ``initial_state`` must repeat it (storage hits,
policies, transfer sets, registration, host capacity: else :class:`~kvproof.reference.errors.InvalidOperation`)
and each rank keeps its synced hit and buffers, so its hit query makes no collective. **0.5.23's ACK**: a rank
that learned (ACK drain) that some IO thread is still running reduces nothing and takes 0 completed, 0 per pool,
transfers not done.

Each operation packs this rank's vector, calls a real ``torch.distributed.all_reduce`` of an ``int64`` tensor named
with ``_ranks.naming(op, slots)``, and unpacks the result; a rank that the protocol leaves out of a collective
does not call it. 0.5.23's ranks learn that every rank's IO thread finished through an internal MIN
(``_ack_drain``, every rank, after the termination vote): it is not part of the compared exchange.

**The group** (:class:`LegalTPPrefetch`, in the caller's process) sends each operation to every rank at once
(``RankGroup.command``) and assembles the :class:`~kvproof.reference.tp_prefetch.PhaseReport` from the replies:
the observed calls, position by position (``_``-named calls left out); the first position where the ranks'
calls differ in presence, op or length, or where a call failed or hung, is a
:class:`~kvproof.reference.tp_prefetch.CollectiveMismatch` (phase ``mismatched``; the group is broken and closed).

**Where the contract was not enough** (each found by a failing lockstep run, then settled by reading the
reference's per-rank functions; docs/contract.md should say them): 0.5.23's pool-hit ACK packs ``kv = 0`` (no
rank "fetches" KV as a pool) and is reduced only once *every* rank's IO thread finished (the ACK drain), not
each rank's own; ``RankCommit.attached`` means the window passed the all-or-nothing check (the walk ran), even
where no slice finds a tombstone; the sidecar keys before the sidecar step are the placeholders (SWA: one per
buffer page; Mamba: 1, and ``min(1, hit)`` after); a rank's IO ``terminated`` (the #27264-era vote) is
"finished and (short of the hit, or hit 0)"; in flight are the fetched buffer pages of a reached, unfinished IO
thread; 0.5.23 discards only a prefetch with transfers (Full: ``[0, m)`` on the release queue, the rest the IO
thread's; SWA: the release queue if the pool ACK was applied or ``best_effort_release``, else the IO thread's),
and a kept one's Full tail past ``m`` is the IO thread's; ``written_after_release`` is every in-flight page the
IO thread does not own. Hit-time staging, revoke, continuation and the ACK rule (written from the contract)
passed the default run at once; under ``--ranks mixed`` / ``host_pressure`` the first run missed 0.5.23's shrink of
a window buffer longer than the SWA keys (``swa_held`` stayed at ``min(window keys, h)``).

Host page ids and their reuse order are the only freedom (docs/contract.md): :func:`fifo` (released pages at
the back of the free list), :func:`lifo` (at the front), :func:`randomized` (each at a seeded random place).
No capability is declared.
"""

from __future__ import annotations

import os
import random
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from kvproof.gpu_runtime import _ranks
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation
from kvproof.reference.registry import Component
from kvproof.reference.tp_prefetch import (
    COMPONENT_ORDER,
    NO_POOL_VERDICT,
    POOL_ORDER,
    CollectiveCall,
    CollectiveMismatch,
    Packed,
    Phase,
    PhaseReport,
    PoolName,
    RankCommit,
    RankProgress,
    RankSnapshot,
    ReduceOp,
    SlotOwner,
    TerminationPolicy,
    TPPrefetchGroup,
    TPPrefetchSnapshot,
    TPPrefetchVariant,
    TreeNode,
)

from .swa_allocator import Policy, _Pool

__all__ = ["LegalTPPrefetch", "RankWorker", "fifo", "lifo", "randomized"]

V = TPPrefetchVariant
SWA, MAMBA, KV = PoolName.SWA, PoolName.MAMBA, PoolName.KV
TREE, FREED, QUEUED, IO_THREAD, HELD = (SlotOwner.TREE, SlotOwner.FREED, SlotOwner.RELEASE_QUEUE,
                                        SlotOwner.IO_THREAD, SlotOwner.HELD)
#: the worker class the rank processes build (``module:Class``)
WORKER = f"{__name__}:RankWorker"
#: seconds a rank waits in one collective before it gives up (a mismatched call: gloo errs or hangs)
COLLECTIVE_TIMEOUT = 5.0


# ---------------------------------------------------------------- one rank (in its own process)


@dataclass(eq=False)
class _Node:
    """A host node on the path below the anchor: tokens, its Full host pages, its SWA host pages (None: tombstone)."""

    length: int
    full: list[int]
    swa: list[int] | None
    inserted: bool = False  # inserted by the check being committed
    attached: list[int] = field(default_factory=list)  # window-buffer positions attached now
    swa_from: int | None = None


@dataclass
class _Prefetch:
    """The prefetch this rank registered: its buffers (held from the staging until the commit) and what each
    operation derived."""

    r: int
    full: list[int]  # the staged Full host pages (page i holds request page i): R, or 0.5.23 min(hit, free)
    window: list[int]  # the window buffer's SWA host pages
    progress: RankProgress
    synced_hit: int = 0
    queried: bool = False  # the hit query was made (a continued check makes none)
    completed: int = 0  # Full pages its IO thread completed
    reached: bool = False  # all Full pages completed: the sidecar step ran (or runs)
    finished: bool = False  # the IO thread ended (pool_transfers_done)
    keys: dict[PoolName, int] = field(default_factory=dict)
    hits: dict[PoolName, int] = field(default_factory=dict)
    in_flight: tuple[int, ...] = ()  # buffer positions the IO thread still writes
    all_finished: bool = False  # 0.5.23: every rank's IO thread finished (the ACK drain)
    proceeds: bool = False
    min_completed: int = 0
    synced_hits: dict[PoolName, int] = field(default_factory=dict)
    transfers_done: bool = False


def _reduce(name: str, op: ReduceOp, values: Sequence[int], layout: Sequence[str]) -> list[int]:
    """One real all-reduce of ``values`` (int64), named for the observer; the reduced values."""
    tensor = torch.tensor(list(values), dtype=torch.int64)
    with _ranks.naming(name, layout):
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op is ReduceOp.MIN else dist.ReduceOp.MAX)
    return [int(v) for v in tensor.tolist()]


class RankWorker:
    """One rank's host tree, host pools and prefetch (module docstring); built inside a rank process."""

    def __init__(self, *, rank: int, world_size: int, group: TPPrefetchGroup, policy: str, seed: int) -> None:
        self.rank, self.world_size, self.g = rank, world_size, group
        self.p, self.sw_pages, self.variant = group.page_size, group.sw_pages, group.variant
        rng = random.Random(seed * 131 + rank)
        self.full_pool = _Pool(group.host_pages, Policy(policy), rng)
        self.swa_pool = _Pool(group.swa_host_pages, Policy(policy), rng)
        if Policy(policy) is Policy.RANDOMIZED:
            rng.shuffle(self.full_pool.free)
            rng.shuffle(self.swa_pool.free)
        self.path: list[_Node] = []
        for node in group.existing:
            pages = node.length // self.p
            self.path.append(_Node(node.length, self.full_pool.take(pages),
                                   self.swa_pool.take(pages) if node.swa_host else None))
        self.swa_data: dict[int, int] = {}  # SWA host page -> the token position whose KV it holds
        self.pf: _Prefetch | None = None

    # ------------------------------------------------------------ helpers

    @property
    def v0523(self) -> bool:
        return self.variant in (V.UPSTREAM_0523, V.SUM_HITS, V.BEST_EFFORT_RELEASE)

    def _window_pages(self, r: int, progress: RankProgress) -> int:
        if SWA not in progress.transfers:
            return 0
        if self.v0523 and r < self.sw_pages:  # root-anchored sub-window (#34798)
            return r
        return self.sw_pages

    @property
    def _target(self) -> int:
        """The Full pages the IO thread fetches: the synced hit, or fewer where 0.5.23 staged fewer (F6)."""
        assert self.pf is not None
        return min(self.pf.synced_hit, len(self.pf.full))

    def _release_prefetch(self) -> None:
        """Give back the buffers of a prefetch this rank still holds (a new request after a check it did not commit)."""
        if self.pf is not None:
            self.full_pool.release(self.pf.full)
            self.swa_pool.release(self.pf.window)
            self.pf = None

    def _take(self, pool: _Pool, k: int) -> list[int]:
        pages = pool.take(k)
        if len(pages) != k:
            raise RuntimeError(f"rank {self.rank}: host pool short ({len(pages)} of {k} pages)")
        return pages

    # ------------------------------------------------------------ the operations

    def start(self, r: int, progress: RankProgress, continues: bool) -> None:
        """Register the prefetch, or (``continues``: the check before ended waiting) continue the one this rank holds
        with new progress: the same request, synced hit and buffers. Before 0.5.23 the buffers are staged here."""
        if continues:
            if self.pf is not None:
                pf = self.pf
                self.pf = _Prefetch(pf.r, pf.full, pf.window, progress, synced_hit=pf.synced_hit, queried=True)
            return
        self._release_prefetch()
        if not progress.registered:
            return
        if self.v0523:  # staged at hit time
            self.pf = _Prefetch(r, [], [], progress)
            return
        self.pf = _Prefetch(r, self._take(self.full_pool, r),
                            self._take(self.swa_pool, self._window_pages(r, progress)), progress)

    def sync_prefetch_hit_query(self) -> str | None:
        """The storage-hit MIN; 0.5.23 then stages (or revokes: ``"revoked"``). A continued check makes none."""
        pf = self.pf
        if pf is None:
            return None
        if pf.queried:
            return "queried"
        hit = min(pf.progress.storage_hit, pf.r)
        if self.v0523:
            verdicts = [hit if pool is KV or pool in pf.progress.transfers else NO_POOL_VERDICT for pool in POOL_ORDER]
            names = [pool.value for pool in POOL_ORDER]
            if pf.progress.transfers:  # a trailing-pages transfer: one restorable flag per prefix length
                flags = [1 if i <= hit else 0 for i in range(pf.r + 1)]
                out = _reduce("sync_prefetch_hit_query", ReduceOp.MIN, flags + verdicts,
                              [f"flag_{i}" for i in range(pf.r + 1)] + names)
                synced = 0
                while synced + 1 <= pf.r and out[synced + 1] == 1:
                    synced += 1
            else:
                synced = _reduce("sync_prefetch_hit_query", ReduceOp.MIN, [hit] + verdicts, ["hit"] + names)[0]
        else:
            synced = _reduce("sync_prefetch_hit_query", ReduceOp.MIN, [hit], ["hit"])[0]
        pf.synced_hit, pf.queried = synced, True
        if self.v0523:
            if synced == 0:  # below the prefetch threshold: revoked on every rank, nothing staged
                self.pf = None
                return "revoked"
            free = pf.progress.host_free_pages
            staged = synced if free is None else min(synced, free)
            pf.full = self._take(self.full_pool, staged)
            pf.window = self._take(self.swa_pool, min(self._window_pages(pf.r, pf.progress), synced))
        return "queried"

    def page_transfer(self) -> None:
        """The IO thread against its target: Full pages, then (all of them done) the sidecar transfers."""
        pf = self.pf
        if pf is None:
            return
        prog, hit = pf.progress, self._target
        pf.completed = min(prog.full_pages, hit)
        pf.reached = pf.completed == hit
        pf.finished = prog.io_done or (pf.reached and not prog.transfers)
        # the keys are rewritten only when the sidecar step runs: the last min(n, target) page hashes (Mamba: the
        # checkpoint at the target, none at 0); before that, the placeholders (one per buffer page; Mamba: one)
        pf.keys = {pool: (len(pf.window) if pool is SWA else 1) for pool in prog.transfers}
        results: dict[PoolName, list[bool]] = {}
        if pf.reached:
            if SWA in prog.transfers:
                k = pf.keys[SWA] = min(len(pf.window), hit)
                if self.v0523 and k < len(pf.window):  # fewer keys than buffer pages (F6): shrink, release the tail
                    self.swa_pool.release(pf.window[k:])
                    pf.window = pf.window[:k]
                results[SWA] = [j not in prog.swa_missing for j in range(k)]
                for j in range(k):  # key j (request page target - k + j) goes into buffer page j
                    if j not in prog.swa_missing:
                        self.swa_data[pf.window[j]] = (hit - k + j) * self.p
                if not prog.io_done:  # its writes are in flight
                    pf.in_flight = tuple(j for j in range(k) if j not in prog.swa_missing)
            if MAMBA in prog.transfers:
                pf.keys[MAMBA] = min(1, hit)
                results[MAMBA] = [not prog.mamba_missing] * pf.keys[MAMBA]
        leading = self.variant in (V.UPSTREAM_0523, V.BEST_EFFORT_RELEASE)
        pf.hits = {}
        for pool in prog.transfers:
            got = results.get(pool, []) if pf.finished else []
            pf.hits[pool] = (next((i for i, ok in enumerate(got) if not ok), len(got)) if leading
                             else sum(got))

    def can_terminate_prefetch(self) -> bool:
        pf = self.pf
        if pf is None:
            return False
        policy = pf.progress.policy
        if self.v0523:
            vote = None
            if policy is TerminationPolicy.TIMEOUT:
                vote = _reduce("can_terminate_prefetch", ReduceOp.MAX, [int(pf.progress.deadline_passed)],
                               ["deadline"])[0]
            pf.all_finished = _reduce("_ack_drain", ReduceOp.MIN, [int(pf.finished)], ["finished"])[0] == 1
            if policy is TerminationPolicy.BEST_EFFORT:
                pf.proceeds = True
            else:
                pf.proceeds = pf.all_finished or vote == 1
            return pf.proceeds
        if policy is TerminationPolicy.BEST_EFFORT:
            pf.proceeds = True
            return True
        completed = pf.synced_hit > 0 and pf.completed == pf.synced_hit
        can = completed or (policy is TerminationPolicy.TIMEOUT and pf.progress.deadline_passed)
        if completed and not pf.finished:
            can = False
        terminated = pf.finished and (pf.completed < pf.synced_hit or pf.synced_hit == 0)  # it stopped early
        not_can, any_terminated = _reduce("can_terminate_prefetch", ReduceOp.MAX, [int(not can), int(terminated)],
                                          ["not_can", "terminated"])
        pf.proceeds = not_can == 0 or any_terminated == 1
        return pf.proceeds

    def reduce_prefetch_ack(self) -> None:
        pf = self.pf
        if pf is None:
            return
        transfers = pf.progress.transfers
        if self.v0523:
            pf.min_completed, pf.synced_hits, pf.transfers_done = 0, dict.fromkeys(transfers, 0), False
            if not pf.all_finished:  # some IO thread is still in flight: no ACK to reduce, no collective at all
                return
            pf.min_completed = _reduce("reduce_prefetch_ack", ReduceOp.MIN, [pf.completed], ["completed"])[0]
            if transfers:  # the pool-hit ACK
                values = [pf.hits.get(pool, 0) for pool in POOL_ORDER]  # 0 for a pool it did not fetch (KV)
                out = _reduce("reduce_prefetch_ack", ReduceOp.MIN, values, [pool.value for pool in POOL_ORDER])
                pf.synced_hits = {pool: out[i] for i, pool in enumerate(POOL_ORDER) if pool in transfers}
                pf.transfers_done = True
            return
        if not pf.proceeds:
            return
        pf.transfers_done = pf.finished
        if self.variant is V.PRE_27264:
            pf.min_completed = _reduce("reduce_prefetch_ack", ReduceOp.MIN, [pf.completed], ["completed"])[0]
            pf.synced_hits = dict(pf.hits)
            return
        pools = [pool for pool in COMPONENT_ORDER if pool in transfers]
        out = _reduce("reduce_prefetch_ack", ReduceOp.MIN, [pf.completed] + [pf.hits.get(p, 0) for p in pools],
                      ["completed"] + [p.value for p in pools])
        pf.min_completed = out[0]
        pf.synced_hits = {p: out[1 + i] for i, p in enumerate(pools)}

    def handle_prefetch_result(self) -> RankCommit | None:
        pf = self.pf
        if pf is None:
            return None
        if not pf.proceeds:  # it keeps waiting: its buffers stay held
            return RankCommit(nodes=self._tree_nodes(), prefix_len=0, total_len=0, attached=False, discarded=False,
                              insert_split=None, swa_split=None, full_slots=(HELD,) * len(pf.full),
                              swa_slots=(HELD,) * len(pf.window), written_after_release=())
        discarded, completed = False, pf.completed
        if self.v0523:  # _check_hybrid_prefetch_result: all or nothing (a hybrid prefetch: one with transfers)
            usable = pf.min_completed == self._target and all(
                pf.synced_hits.get(pool, 0) == pf.keys[pool] for pool in pf.progress.transfers)
            discarded = bool(pf.progress.transfers) and not usable
            completed = pf.min_completed  # the IO thread releases the rank-local tail
        m = 0 if discarded else pf.min_completed
        total = m * self.p
        prefix, insert_split = self._insert(total, pf)
        target = self._index_ending_at(total) if total else None
        swa_slots, attached, swa_split = self._commit_window(pf, total, target, discarded)
        full_slots = tuple(FREED if i < prefix // self.p else TREE if i < m else QUEUED if i < completed
                           else IO_THREAD for i in range(len(pf.full)))
        for i, owner in enumerate(full_slots):  # the release queue and the IO thread's releases are drained
            if owner is not TREE:
                self.full_pool.release([pf.full[i]])
        written = tuple(i for i in pf.in_flight if swa_slots[i] is not IO_THREAD)
        commit = RankCommit(nodes=self._tree_nodes(), prefix_len=prefix, total_len=total, attached=attached,
                            discarded=discarded, insert_split=insert_split, swa_split=swa_split,
                            full_slots=full_slots, swa_slots=swa_slots, written_after_release=written)
        for node in self.path:
            node.inserted, node.attached, node.swa_from = False, [], None
        self.pf = None
        return commit

    # ------------------------------------------------------------ the commit's steps

    def _index_ending_at(self, pos: int) -> int:
        end = 0
        for i, node in enumerate(self.path):
            end += node.length
            if end == pos:
                return i
        raise RuntimeError(f"rank {self.rank}: no node ends at token {pos}")

    def _split(self, i: int, at: int) -> None:
        """Split node ``i`` ``at`` tokens into it (its Full and SWA host pages go with their tokens)."""
        node, k = self.path[i], at // self.p
        head = _Node(at, node.full[:k], None if node.swa is None else node.swa[:k], node.inserted)
        tail = _Node(node.length - at, node.full[k:], None if node.swa is None else node.swa[k:], node.inserted)
        self.path[i:i + 1] = [head, tail]

    def _insert(self, total: int, pf: _Prefetch) -> tuple[int, int | None]:
        """``_insert_helper_host``: the request's first ``total`` tokens on the path. (prefix_len, split offset)."""
        length = sum(n.length for n in self.path)
        split = None
        if total < length and total > 0:
            start = 0
            for i, node in enumerate(self.path):
                if start < total < start + node.length:
                    self._split(i, total - start)
                    split = total
                    break
                start += node.length
        prefix = min(total, length)
        if total > length:
            first, last = length // self.p, total // self.p
            self.path.append(_Node(total - length, pf.full[first:last], None, inserted=True))
        return prefix, split

    def _commit_window(self, pf: _Prefetch, total: int, target: int | None, discarded: bool
                       ) -> tuple[tuple[SlotOwner, ...], bool, int | None]:
        """``_commit_prefetch`` (§6.4): attach the window buffer to tombstones or release it. Returns each buffer
        page's owner, whether a slice was attached, the split offset."""
        n = len(pf.window)
        owners: list[SlotOwner | None] = [None] * n

        def release(positions: Sequence[int]) -> None:
            for j in positions:
                owners[j] = FREED
                self.swa_pool.release([pf.window[j]])

        if n == 0:
            return (), False, None
        if discarded:  # the scheduler queues the slots if the transfers are done (#31668's ownership bit)
            scheduler = pf.transfers_done or self.variant is V.BEST_EFFORT_RELEASE
            self.swa_pool.release(pf.window)
            return (QUEUED if scheduler else IO_THREAD,) * n, False, None
        loaded = pf.synced_hits.get(SWA, 0)
        mid_tree_short = self.v0523 and not self.g.anchor_is_root and n < self.sw_pages
        if target is None or loaded < n or mid_tree_short:
            release(range(n))
            return tuple(o or FREED for o in owners), False, None
        start = total - n * self.p
        # ``attached``: the window passed the all-or-nothing check (the walk ran), even where every node it reaches
        # already has its SWA host value and every slice is released (what the reference reports)
        pos, i, attached, swa_split = total, target, True, None
        while i >= 0 and pos > start:
            node = self.path[i]
            node_start = pos - node.length
            fill_start = max(node_start, start)
            fill_len = pos - fill_start
            first = (fill_start - start) // self.p
            positions = list(range(first, first + fill_len // self.p))
            if node.swa is None and fill_len > 0:
                if fill_start > node_start:
                    self._split(i, fill_start - node_start)
                    swa_split = fill_start
                    i += 1
                    node = self.path[i]
                node.swa = [pf.window[j] for j in positions]
                node.attached = positions
                node.swa_from = self.swa_data.get(node.swa[0]) if node.swa else None
                for j in positions:
                    owners[j] = TREE
            else:
                release(positions)
            pos = node_start
            i -= 1
        if pos > start:
            release(range((pos - start) // self.p))
        return tuple(o or FREED for o in owners), attached, swa_split

    # ------------------------------------------------------------ observation

    def _tree_nodes(self) -> tuple[TreeNode, ...]:
        return tuple(TreeNode(length=n.length, swa_host=n.swa is not None, inserted=n.inserted,
                              swa_pages=tuple(n.attached), swa_from=n.swa_from) for n in self.path)

    def snapshot(self) -> RankSnapshot:
        from kvproof.reference.tp_prefetch import HostNode

        full_tree = sum(len(n.full) for n in self.path)
        swa_tree = sum(len(n.swa) for n in self.path if n.swa is not None)
        held = (0, 0) if self.pf is None else (len(self.pf.full), len(self.pf.window))
        return RankSnapshot(nodes=tuple(HostNode(length=n.length, swa_host=n.swa is not None) for n in self.path),
                            full_capacity=self.g.host_pages, full_free=len(self.full_pool.free),
                            full_in_tree=full_tree, full_held=held[0], swa_capacity=self.g.swa_host_pages,
                            swa_free=len(self.swa_pool.free), swa_in_tree=swa_tree, swa_held=held[1])


# ---------------------------------------------------------------- the group (in the caller's process)


def _packed(call: _ranks.CallRecord) -> Packed:
    layout = call.layout if call.layout is not None else tuple(f"v{i}" for i in range(len(call.values)))
    return Packed(op=ReduceOp(call.op), values=call.values, layout=layout)


class LegalTPPrefetch:
    """Every rank's scheduler: each operation on every rank at once, the report assembled from their replies."""

    capabilities: frozenset[Capability] = frozenset({Capability.SLOT_RELEASE_PATHS})  # it reports who releases
    components = frozenset({Component.TP_PREFETCH})
    device = "cpu"
    version = "legal tp_prefetch (tests/legal)"

    def __init__(self, group: TPPrefetchGroup, policy: Policy, seed: int = 0) -> None:
        self.config, self.world_size = group, group.world_size
        root = str(Path(__file__).resolve().parents[2])  # the rank processes import this module from here
        if root not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
            os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        self._worker_args = {"group": group, "policy": policy.value, "seed": seed}
        self._request: tuple[int, tuple[RankProgress, ...]] = (0, ())
        self._ranks: _ranks.RankGroup | None = None  # started at the first command (building one is cheap)
        #: the request of the check that ended waiting (R, each rank's progress): the next one continues it
        self._waiting: tuple[int, tuple[RankProgress, ...]] | None = None

    @property
    def ranks(self) -> _ranks.RankGroup:
        """The rank processes, each with a fresh :class:`RankWorker` of this group (a warm group is reused)."""
        if self._ranks is None:
            self._ranks = _ranks.acquire(self.world_size, COLLECTIVE_TIMEOUT)
            self._ranks.command("__init__", [(WORKER, self._worker_args)] * self.world_size)
        return self._ranks

    def _command(self, method: str, args: Sequence[tuple[Any, ...]] | None = None, *,
                 collectives: int = 3) -> list[_ranks.RankReply]:
        return self.ranks.command(method, args, collectives=collectives)

    def _op(self, op: str, ok_phase: Phase, *, collectives: int = 3) -> tuple[PhaseReport, list[Any]]:
        """``op`` on every rank; the report (collectives, mismatch, phase) and each rank's returned value."""
        start = time.monotonic()
        replies = self._command(op, collectives=collectives)
        seconds = time.monotonic() - start
        observed = [[c for c in r.calls if not c.name.startswith("_")] for r in replies]
        calls: list[CollectiveCall] = []
        for k in range(max((len(o) for o in observed), default=0)):
            at = [o[k] if k < len(o) else None for o in observed]
            present = [c for c in at if c is not None]
            first = present[0]
            agree = (len(present) == len(at) and all(c.op == first.op and len(c.values) == len(first.values)
                                                     for c in present)
                     and all(c.result is not None and c.error is None for c in present))
            if not agree:
                detail = "; ".join(f"rank {r.rank} {r.status}: {r.error}" for r in replies if r.status != "ok")
                for c in present:
                    if c.error:
                        detail = f"{detail}; {c.error}" if detail else c.error
                self.ranks.close()
                mismatch = CollectiveMismatch(name=first.name,
                                              packed=tuple(None if c is None else _packed(c) for c in at))
                proceeds = (None,) * self.world_size if op == "can_terminate_prefetch" else ()
                return PhaseReport(op=op, phase=Phase.MISMATCHED, collectives=tuple(calls), mismatch=mismatch,
                                   proceeds=proceeds, seconds=seconds, detail=detail or "calls differ"), []
            result = present[0].result or ()
            calls.append(CollectiveCall(name=first.name, op=ReduceOp(first.op),
                                        packed=tuple(_packed(c) for c in present), result=result))
        bad = [r for r in replies if r.status != "ok"]
        if bad:
            raise RuntimeError(f"{op}: " + "; ".join(f"rank {r.rank} {r.status}: {r.error}" for r in bad))
        return PhaseReport(op=op, phase=ok_phase, collectives=tuple(calls), seconds=seconds), [r.value for r in replies]

    # ------------------------------------------------------------ the protocol

    def initial_state(self, request_pages: int, ranks: Sequence[RankProgress]) -> None:
        """A new request, or the continuation of the one whose check ended waiting (its storage hits, policies,
        transfer sets, registration and host capacity kept: anything else is refused)."""
        op = "initial_state"
        if len(ranks) != self.world_size:
            raise InvalidOperation(op, "ranks", f"{len(ranks)} ranks for a group of {self.world_size}")
        if not any(p.registered for p in ranks):
            raise InvalidOperation(op, "ranks", "no rank registered the prefetch")
        v0523 = self.config.variant in (V.UPSTREAM_0523, V.SUM_HITS, V.BEST_EFFORT_RELEASE)
        if not v0523 and any(p.host_free_pages is not None for p in ranks):
            raise InvalidOperation(op, "ranks", "host_free_pages is 0.5.23's (staging at hit time)")
        waiting, continues = self._waiting, self._waiting is not None
        if waiting is not None:
            if request_pages != waiting[0]:
                raise InvalidOperation(op, "request_pages", f"the waiting prefetch has {waiting[0]} pages")
            kept = ("storage_hit", "policy", "transfers", "registered", "host_free_pages")
            for i, (before, now) in enumerate(zip(waiting[1], ranks, strict=True)):
                changed = [k for k in kept if getattr(before, k) != getattr(now, k)]
                if changed:
                    raise InvalidOperation(op, "ranks", f"rank {i}: a continued prefetch keeps its {changed}")
        self._waiting = None
        self._command("start", [(request_pages, progress, continues) for progress in ranks])
        self._request = (request_pages, tuple(ranks))

    def sync_prefetch_hit_query(self) -> PhaseReport:
        report, values = self._op("sync_prefetch_hit_query", Phase.QUERIED)
        if report.phase is Phase.MISMATCHED or "revoked" not in values:
            return report
        return report.model_copy(update={"phase": Phase.REVOKED})

    def page_transfer(self) -> PhaseReport:
        return self._op("page_transfer", Phase.TRANSFERRED)[0]

    def can_terminate_prefetch(self) -> PhaseReport:
        report, values = self._op("can_terminate_prefetch", Phase.DECIDED)
        if report.phase is Phase.MISMATCHED:
            return report
        phase = Phase.DECIDED if any(values) else Phase.WAITING
        if phase is Phase.WAITING:  # the next initial_state continues this request
            self._waiting = self._request
        return report.model_copy(update={"phase": phase, "proceeds": tuple(values)})

    def reduce_prefetch_ack(self) -> PhaseReport:
        return self._op("reduce_prefetch_ack", Phase.REDUCED)[0]

    def handle_prefetch_result(self) -> PhaseReport:
        report, values = self._op("handle_prefetch_result", Phase.COMMITTED)
        if report.phase is Phase.MISMATCHED:
            return report
        return report.model_copy(update={"commits": tuple(v for v in values if v is not None)})

    def snapshot(self) -> TPPrefetchSnapshot:
        replies = self._command("snapshot")
        bad = [r for r in replies if r.status != "ok"]
        if bad:
            raise RuntimeError("snapshot: " + "; ".join(f"rank {r.rank} {r.status}: {r.error}" for r in bad))
        return TPPrefetchSnapshot(ranks=tuple(r.value for r in replies))

    def close(self) -> None:
        """The warm group stays for the next implementation (``_ranks.acquire``); a broken one is closed already."""


def _seed(group: TPPrefetchGroup) -> int:
    return zlib.crc32(group.label().encode())


def fifo(group: TPPrefetchGroup) -> LegalTPPrefetch:
    return LegalTPPrefetch(group, Policy.FIFO)


def lifo(group: TPPrefetchGroup) -> LegalTPPrefetch:
    return LegalTPPrefetch(group, Policy.LIFO)


def randomized(group: TPPrefetchGroup) -> LegalTPPrefetch:
    return LegalTPPrefetch(group, Policy.RANDOMIZED, seed=_seed(group))
