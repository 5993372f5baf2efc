"""``tp_prefetch`` over real ``torch.distributed``: N rank processes, each with its own host tree and host pools.

Models PR #27264 and SGLang 0.5.23's cache controller (sglang_semantics.md §6, §7 T1-T5, §9 S10;
upstream_0523_vllm_fuzz.md §2) with the observable behaviour of ``kvproof.reference.tp_prefetch``, variant by
variant. :class:`TPPrefetchRuntime` is the implementation the suite drives (the parent); it runs one
:class:`TPPrefetchRank` in each of ``world_size`` processes of a :mod:`kvproof.gpu_runtime._ranks` group (gloo on
loopback; NCCL when ``world_size`` GPUs are present), started by the harness, reused while healthy, torn down on a
mismatch and at exit.

**One rank** holds, in its own process:

* its host tree along the key below the anchor: a path of nodes, each with its Full host slots (one int64 host page
  id per node page) and, unless it is an SWA tombstone, its SWA host slots;
* two host pools (Full and SWA): free lists of host page ids (int64 tensors) and a data tensor per pool holding,
  for every slot, the token position whose KV it holds (-1: none). The IO thread writes them; the commit reads the
  SWA data back to record which positions an attached slice holds (T3 is checked on data, not on arithmetic);
* the prefetch in progress: its Full buffer and SWA window buffer (``R`` host pages and the window, allocated at the
  start before 0.5.23; in 0.5.23 staged after the hit query: ``min(hit, host free)`` Full pages and ``min(window,
  hit)`` SWA pages, or nothing when the synced hit is 0 and the prefetch is revoked), its IO result, its decision.

**The collectives** are built as upstream builds them: an int64 tensor of the packed values (layouts in
``kvproof.reference.tp_prefetch``'s docstring), ``torch.distributed.all_reduce`` with ``ReduceOp.MIN`` (or
``MAX`` for the termination vote) on the group, unpacked in place. 0.5.23's ACK drain, which tells every rank that
every IO thread finished (the reference's ``all_finished``), is one more MIN all-reduce, ``_ack_drain``: an
internal collective, not compared (names starting with ``_``).

**The parent** sends each operation to every rank at once and assembles the ranks' replies into a
:class:`~kvproof.reference.tp_prefetch.PhaseReport`: the collectives every rank made (its packed values as it
reported them *before* the call, the result after), or, when a collective failed, hung or was called with
different shapes, a :class:`~kvproof.reference.tp_prefetch.CollectiveMismatch` naming each rank's call (within
``collective_timeout`` plus a grace period: a rank that skips a collective leaves the others waiting until the
group's timeout, which is then the verdict's time). A mismatch breaks the group: it is torn down, and the runtime
refuses further operations (the suite builds a new one).

A check that ended waiting is continued by the next ``initial_state``: the buffers and the synced hit are kept and
the hit query is not made again. In 0.5.23 the ACKs are reduced only once every rank's IO thread finished (the
ranks learn it from ``_ack_drain``): a check with an IO thread in flight reduces nothing.

[Differs from SGLang:] one prefetch at a time; the IO thread's effect is applied in ``page_transfer`` from the
rank's progress snapshot (no thread); the release queue and the IO thread's releases are drained at the end of
``handle_prefetch_result`` (upstream: the scheduler's next step, the IO thread's end); a rank's free host pages at
hit time (``host_free_pages``, F6) are a number the progress states, not another request's buffers; the #27264-era
packed MIN runs for any world size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from kvproof.gpu_runtime import _ranks
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation, require
from kvproof.reference.registry import Component
from kvproof.reference.tp_prefetch import (
    COMPONENT_ORDER,
    NO_POOL_VERDICT,
    POOL_ORDER,
    CollectiveCall,
    CollectiveMismatch,
    HostNode,
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

__all__ = ["COLLECTIVE_TIMEOUT_S", "TPPrefetchRank", "TPPrefetchRuntime"]

Tensor = torch.Tensor
_I64 = torch.int64
#: Seconds every collective may take before the group's timeout fails it (``KVPROOF_COLLECTIVE_TIMEOUT``).
COLLECTIVE_TIMEOUT_S = float(os.environ.get("KVPROOF_COLLECTIVE_TIMEOUT", "3"))


# ---------------------------------------------------------------- one rank (in its own process)


@dataclass
class _Node:
    """A host tree node on one rank: tokens, its Full host slots, its SWA host slots (``None``: a tombstone)."""

    length: int
    full: Tensor
    swa: Tensor | None
    inserted: bool = False  # marks of the latest commit (RankCommit.nodes)
    swa_pages: tuple[int, ...] = ()
    swa_from: int | None = None

    def split(self, at: int, page_size: int) -> tuple[_Node, _Node]:
        """``_split_node``: the first ``at`` tokens become the parent; each keeps its share of both values."""
        k = at // page_size
        upper = _Node(at, self.full[:k].clone(), None if self.swa is None else self.swa[:k].clone(), self.inserted,
                      self.swa_pages, self.swa_from)
        lower = _Node(self.length - at, self.full[k:].clone(), None if self.swa is None else self.swa[k:].clone(),
                      self.inserted, self.swa_pages, self.swa_from)
        return upper, lower


class _Pool:
    """A host pool: free host page ids (ascending hand-out from the front, frees appended) and per-slot data."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.free = torch.arange(capacity, dtype=_I64)
        self.data = torch.full((capacity,), -1, dtype=_I64)

    def alloc(self, n: int, op: str) -> Tensor:
        require(n <= self.free.numel(), op, "host pool", f"{n} pages asked, {self.free.numel()} free")
        out, self.free = self.free[:n].clone(), self.free[n:]
        self.data[out] = -1
        return out

    def release(self, slots: Tensor) -> None:
        if slots.numel():
            self.free = torch.cat([self.free, slots])


@dataclass
class _Prefetch:
    """The prefetch in progress on this rank."""

    request_pages: int
    progress: RankProgress
    full_buf: Tensor
    swa_buf: Tensor
    synced_hit: int = 0
    queried: bool = False  # the hit query ran (a continued check does not make it again)
    completed: int = 0
    reached: bool = False
    keys: dict[PoolName, int] = field(default_factory=dict)
    hits: dict[PoolName, int] = field(default_factory=dict)
    in_flight: tuple[int, ...] = ()
    finished: bool = False
    all_finished: bool = False
    proceeds: bool = False
    min_completed: int = 0
    synced_hits: dict[PoolName, int] = field(default_factory=dict)
    transfers_done: bool = False


class TPPrefetchRank:
    """One rank's host side and its half of every collective (module docstring). Built in a rank process by the
    :mod:`~kvproof.gpu_runtime._ranks` harness; every method is one operation on this rank."""

    def __init__(self, *, rank: int, world_size: int, group: TPPrefetchGroup) -> None:
        self.rank, self.world_size, self.g = rank, world_size, group
        self.p = group.page_size
        self.full = _Pool(group.host_pages)
        self.swa = _Pool(group.swa_host_pages)
        self.path: list[_Node] = []
        for node in group.existing:
            k = node.length // self.p
            self.path.append(_Node(node.length, self.full.alloc(k, "initial_state"),
                                   self.swa.alloc(k, "initial_state") if node.swa_host else None))
        self.job: _Prefetch | None = None

    # ------------------------------------------------------------ helpers

    @property
    def variant(self) -> TPPrefetchVariant:
        return self.g.variant

    def _window_pages(self, request_pages: int, progress: RankProgress) -> int:
        """The window keys (``prepare_prefetch``): the buffer before 0.5.23; 0.5.23 stages ``min(keys, hit)``."""
        if PoolName.SWA not in progress.transfers:
            return 0
        if self.variant.protocol_0523 and request_pages < self.g.sw_pages:
            return request_pages
        return self.g.sw_pages

    def _job(self, op: str) -> _Prefetch:
        if self.job is None:
            raise InvalidOperation(op, "state", "no prefetch in progress: initial_state first")
        return self.job

    def all_reduce(self, name: str, op: ReduceOp, values: Sequence[int], layout: Sequence[str]) -> list[int]:
        """One all-reduce of ``values`` (an int64 tensor, as upstream packs it) over the group, named for the
        harness; the reduced values."""
        tensor = torch.tensor(list(values), dtype=_I64, device=_ranks.collective_device())
        with _ranks.naming(name, layout):
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN if op is ReduceOp.MIN else dist.ReduceOp.MAX)
        return [int(v) for v in tensor.tolist()]

    def count_hits(self, results: Sequence[bool]) -> int:
        if self.variant.leading_run:
            return next((i for i, ok in enumerate(results) if not ok), len(results))
        return sum(1 for ok in results if ok)

    # ------------------------------------------------------------ the check

    def initial_state(self, request_pages: int, progress: RankProgress) -> None:
        """Start a prefetch of ``request_pages`` pages on this rank's path (its buffers allocated), or continue the
        one a waiting check left (its buffers kept)."""
        op = "initial_state"
        path_pages = sum(n.length for n in self.path) // self.p
        require(path_pages <= request_pages <= self.g.max_request_pages, op, "request_pages",
                f"{request_pages} outside {path_pages}..{self.g.max_request_pages} (the path has {path_pages} pages)")
        require(progress.storage_hit <= request_pages and progress.full_pages <= request_pages, op, "progress",
                f"storage_hit {progress.storage_hit} / full_pages {progress.full_pages} > {request_pages} pages")
        n = self._window_pages(request_pages, progress)
        require(all(i < n for i in progress.swa_missing), op, "progress",
                f"swa_missing {list(progress.swa_missing)} outside the {n}-page window buffer")
        require(progress.host_free_pages is None or self.variant.protocol_0523, op, "progress",
                "host_free_pages models 0.5.23's hit-time staging")
        job, empty = self.job, torch.empty(0, dtype=_I64)
        if job is not None:
            same = ("storage_hit", "policy", "transfers", "registered", "host_free_pages")
            require(job.request_pages == request_pages and all(getattr(job.progress, k) == getattr(progress, k)
                                                               for k in same), op, "progress",
                    f"a waiting prefetch continues with the same request and the same {', '.join(same)}")
            self.job = _Prefetch(request_pages, progress, job.full_buf, job.swa_buf, job.synced_hit, job.queried)
            return
        if not progress.registered or self.variant.protocol_0523:  # 0.5.23 stages at hit time
            self.job = _Prefetch(request_pages, progress, empty, empty)
            return
        self.job = _Prefetch(request_pages, progress, self.full.alloc(request_pages, op), self.swa.alloc(n, op))

    def pack_hit_query(self, job: _Prefetch) -> tuple[list[int], list[str]] | None:
        p = job.progress
        if not p.registered:
            return None
        hit = p.storage_hit
        if not self.variant.protocol_0523:
            return [hit], ["hit"]
        if p.transfers:
            values = [1 if i <= hit else 0 for i in range(job.request_pages + 1)]
            names = [f"flag_{i}" for i in range(job.request_pages + 1)]
        else:
            values, names = [hit], ["hit"]
        values += [hit if pool is PoolName.KV or pool in p.transfers else NO_POOL_VERDICT for pool in POOL_ORDER]
        return values, names + [pool.value for pool in POOL_ORDER]

    def sync_prefetch_hit_query(self) -> dict[str, Any]:
        """The storage-hit MIN (once per prefetch: a continued check keeps it); 0.5.23 then stages the hit's Full
        pages (as many as the rank has free) and ``min(window, hit)`` SWA pages, or revokes a hit of 0 pages."""
        op = "sync_prefetch_hit_query"
        job = self._job(op)
        if job.queried:
            return {"synced_hit": job.synced_hit, "revoked": False}
        job.queried = True
        packed = self.pack_hit_query(job)
        if packed is None:
            job.synced_hit = 0
            return {"synced_hit": 0, "revoked": False}
        result = self.all_reduce(op, ReduceOp.MIN, *packed)
        if self.variant.protocol_0523 and job.progress.transfers:
            flags = result[:job.request_pages + 1]
            job.synced_hit = max(i for i, ok in enumerate(flags) if ok)
        else:
            job.synced_hit = result[0]
        if not self.variant.protocol_0523:
            return {"synced_hit": job.synced_hit, "revoked": False}
        if job.synced_hit == 0:  # below the prefetch threshold: revoked before any IO, nothing staged
            self.job = None
            return {"synced_hit": 0, "revoked": True}
        free = job.progress.host_free_pages
        staged = job.synced_hit if free is None else min(job.synced_hit, free)
        window = min(self._window_pages(job.request_pages, job.progress), job.synced_hit)
        job.full_buf, job.swa_buf = self.full.alloc(staged, op), self.swa.alloc(window, op)
        return {"synced_hit": job.synced_hit, "revoked": False}

    def page_transfer(self) -> dict[str, Any]:
        """The IO thread against the synced hit: Full pages up to it at the rank's pace, written into the Full
        buffer; only after all of them, the sidecar transfers (SWA: the last pages up to the hit into the window
        buffer, except the pages whose fetch fails)."""
        job = self._job("page_transfer")
        p, prog = self.p, job.progress
        target = self._target(job)
        job.completed = min(prog.full_pages, target)
        job.reached = prog.registered and job.completed == target
        n = job.swa_buf.numel()
        keys = {PoolName.SWA: min(n, target) if job.reached else n,
                PoolName.MAMBA: min(1, target) if job.reached else 1}
        job.keys = {pool: k for pool, k in keys.items() if pool in prog.transfers}
        k = job.keys.get(PoolName.SWA)
        if self.variant.protocol_0523 and job.reached and k is not None and k < n:  # _sync_trailing_keys: the
            self.swa.release(job.swa_buf[k:])  # keys re-aligned to a shorter staged range: the buffer's tail goes
            job.swa_buf = job.swa_buf[:k].clone()
        job.finished = prog.io_done or (job.reached and not prog.transfers)
        job.hits = dict.fromkeys(prog.transfers, 0)
        job.in_flight = ()
        if job.completed:
            self.full.data[job.full_buf[:job.completed]] = torch.arange(job.completed, dtype=_I64) * p
        if job.reached and prog.transfers:
            k = job.keys.get(PoolName.SWA, 0)
            ok = [i not in prog.swa_missing for i in range(k)]
            landed = torch.tensor([i for i in range(k) if ok[i]], dtype=_I64)
            if landed.numel():
                self.swa.data[job.swa_buf[landed]] = (target - k + landed) * p
            if prog.io_done:
                if PoolName.SWA in job.hits:
                    job.hits[PoolName.SWA] = self.count_hits(ok)
                if PoolName.MAMBA in job.hits:
                    job.hits[PoolName.MAMBA] = self.count_hits([not prog.mamba_missing] * job.keys[PoolName.MAMBA])
            else:
                job.in_flight = tuple(i for i in range(k) if ok[i])
        return {"completed": job.completed, "hits": {k.value: v for k, v in job.hits.items()}}

    def _target(self, job: _Prefetch) -> int:
        """The Full pages the IO thread fetches: the synced hit, or fewer where 0.5.23 staged fewer (F6)."""
        return min(job.synced_hit, job.full_buf.numel()) if self.variant.protocol_0523 else job.synced_hit

    def _can(self, job: _Prefetch) -> bool:
        policy = job.progress.policy
        if policy is TerminationPolicy.BEST_EFFORT:
            return True
        if self.variant.protocol_0523:
            return False
        completed = job.synced_hit > 0 and job.completed == job.synced_hit
        can = completed if policy is TerminationPolicy.WAIT_COMPLETE else completed or job.progress.deadline_passed
        if completed and not job.finished and job.progress.transfers:
            can = False
        return can

    def can_terminate_prefetch(self) -> bool:
        """The termination vote (#27264 era: MAX of ``[not_can, terminated]`` on the ranks not ``best_effort``;
        0.5.23: MAX of the deadline on ``timeout`` ranks, and the ACK drain)."""
        job = self._job("can_terminate_prefetch")
        prog = job.progress
        if not prog.registered:
            job.proceeds = False
            return False
        can = self._can(job)
        if self.variant.protocol_0523:
            job.all_finished = self.all_reduce("_ack_drain", ReduceOp.MIN, [int(job.finished)], ["finished"])[0] == 1
            voted = False
            if prog.policy is TerminationPolicy.TIMEOUT:
                voted = self.all_reduce("can_terminate_prefetch", ReduceOp.MAX, [int(prog.deadline_passed)],
                                        ["deadline"])[0] == 1
            job.proceeds = can or voted or job.all_finished
            return job.proceeds
        if prog.policy is TerminationPolicy.BEST_EFFORT:
            job.proceeds = can
            return can
        terminated = job.finished and (job.completed < job.synced_hit or job.synced_hit == 0)
        result = self.all_reduce("can_terminate_prefetch", ReduceOp.MAX, [1 - int(can), int(terminated)],
                                 ["not_can", "terminated"])
        job.proceeds = result[0] == 0 or result[1] == 1
        return job.proceeds

    def reduce_prefetch_ack(self) -> dict[str, Any]:
        """The packed MIN(s) of the completed count and the sidecar hits; what the commit will read."""
        job = self._job("reduce_prefetch_ack")
        prog = job.progress
        job.min_completed, job.synced_hits, job.transfers_done = job.completed, dict(job.hits), job.finished
        if not self.variant.protocol_0523:
            if not job.proceeds:
                return {}
            if self.variant is TPPrefetchVariant.PRE_27264:
                job.min_completed = self.all_reduce("reduce_prefetch_ack", ReduceOp.MIN, [job.completed],
                                                    ["completed"])[0]
                return {"min_completed": job.min_completed}
            order = [pool for pool in COMPONENT_ORDER if pool in prog.transfers]
            result = self.all_reduce("reduce_prefetch_ack", ReduceOp.MIN,
                                     [job.completed, *(job.hits[pool] for pool in order)],
                                     ["completed", *(pool.value for pool in order)])
            job.min_completed = result[0]
            job.synced_hits = {pool: result[1 + i] for i, pool in enumerate(order)}
            return {"min_completed": job.min_completed}
        job.synced_hits, job.transfers_done = dict.fromkeys(prog.transfers, 0), False
        if not prog.registered:
            return {}
        if not job.all_finished:  # an IO thread in flight emitted no ACK and the drain is rank-min: nothing reduced
            job.min_completed = 0
            return {"min_completed": 0}
        job.min_completed = self.all_reduce("reduce_prefetch_ack", ReduceOp.MIN, [job.completed], ["completed"])[0]
        if prog.transfers:  # every IO thread finished: the pool ACK is emitted and reduced
            result = self.all_reduce("reduce_prefetch_ack", ReduceOp.MIN,
                                     [job.hits.get(pool, 0) for pool in POOL_ORDER],
                                     [pool.value for pool in POOL_ORDER])
            by_pool = dict(zip(POOL_ORDER, result, strict=True))
            job.synced_hits = {pool: by_pool[pool] for pool in prog.transfers}
            job.transfers_done = True
        return {"min_completed": job.min_completed}

    # ------------------------------------------------------------ the commit

    def _insert(self, job: _Prefetch, total_len: int) -> tuple[int, int | None, int | None]:
        """``_insert_helper_host``: split the node ``total_len`` ends inside, append the part not present with the
        buffer's Full pages. ``(prefix_len, target index, split offset)``."""
        p = self.p
        out: list[_Node] = []
        pos, split, target = 0, None, None
        for node in self.path:
            end = pos + node.length
            if pos < total_len < end:
                upper, lower = node.split(total_len - pos, p)
                out += [upper, lower]
                split, target = total_len, len(out) - 2
            else:
                out.append(node)
                if end == total_len:
                    target = len(out) - 1
            pos = end
        prefix = min(pos, total_len)
        if total_len > pos:
            out.append(_Node(total_len - pos, job.full_buf[pos // p:total_len // p].clone(), None, inserted=True))
            target = len(out) - 1
        self.path = out
        return prefix, (target if total_len > 0 else None), split

    def attach_ok(self, job: _Prefetch, window: int, loaded: int, target: int | None) -> bool:
        """Whether the commit attaches the window buffer (all-or-nothing: a whole window loaded on every rank)."""
        if window == 0:
            return False
        if self.variant.protocol_0523 and not self.g.anchor_is_root and window < self.g.sw_pages:
            return False
        return target is not None and loaded >= window

    def split_at(self, node_start: int, fill_start: int) -> int:
        """Tokens into the node where the in-window suffix starts (pages relative to the anchor in, tokens out)."""
        return (fill_start - node_start) * self.p

    def _commit(self, job: _Prefetch, total_len: int, target: int | None, loaded: int
                ) -> tuple[list[SlotOwner], bool, int | None]:
        """The SWA component's ``_commit_prefetch``: attach each tombstone's in-window slice of the buffer, walking
        from the target to the anchor (a tombstone partly in the window is split first); release the rest."""
        window, p = job.swa_buf.numel(), self.p
        owners = [SlotOwner.FREED] * window
        if target is None or not self.attach_ok(job, window, loaded, target):
            return owners, False, None
        total = total_len // p
        start = total - window
        idx, pos, split = target, total, None
        while idx >= 0 and pos > start:
            node = self.path[idx]
            node_start = pos - node.length // p
            fill_start = max(node_start, start)
            fill = pos - fill_start
            if node.swa is None and fill > 0:
                if fill_start > node_start:
                    at = self.split_at(node_start, fill_start)
                    upper, lower = node.split(at, p)
                    self.path[idx:idx + 1] = [upper, lower]
                    idx += 1
                    split = node_start * p + at
                pages = tuple(range(fill_start - start, pos - start))
                slots = job.swa_buf[list(pages)].clone()
                attached = self.path[idx]
                attached.swa = slots
                attached.swa_pages = pages
                first = int(self.swa.data[slots[0]])
                attached.swa_from = None if first < 0 else first
                for page in pages:
                    owners[page] = SlotOwner.TREE
            pos, idx = node_start, idx - 1
        return owners, True, split

    def handle_prefetch_result(self) -> RankCommit:
        """This rank's ``handle_prefetch_result``: 0.5.23's all-or-nothing check, the insert, the SWA commit, every
        buffer slot to its owner; a rank that does not terminate keeps its buffers (``HELD``)."""
        op = "handle_prefetch_result"
        job = self._job(op)
        for node in self.path:
            node.inserted, node.swa_pages, node.swa_from = False, (), None
        if not job.proceeds:
            nodes = self._tree_nodes()
            if not job.progress.registered:  # it never had a prefetch to keep
                self.job = None
            n_full, n_swa = job.full_buf.numel(), job.swa_buf.numel()
            return RankCommit(nodes=nodes, prefix_len=0, total_len=0, attached=False, discarded=False,
                              insert_split=None, swa_split=None, full_slots=(SlotOwner.HELD,) * n_full,
                              swa_slots=(SlotOwner.HELD,) * n_swa, written_after_release=())
        p, r_pages, m = self.p, job.full_buf.numel(), job.min_completed
        goal, prog, v = self._target(job), job.progress, self.variant
        n = job.swa_buf.numel()
        if v.protocol_0523:
            ok = m == goal and all(job.synced_hits.get(pool, 0) == job.keys[pool] for pool in prog.transfers)
            if prog.transfers and not ok:
                scheduler = job.transfers_done or v is TPPrefetchVariant.BEST_EFFORT_RELEASE
                swa_owner = SlotOwner.RELEASE_QUEUE if scheduler else SlotOwner.IO_THREAD
                swa = (swa_owner,) * n
                commit = RankCommit(nodes=self._tree_nodes(), prefix_len=0, total_len=0, attached=False,
                                    discarded=True, insert_split=None, swa_split=None,
                                    full_slots=(SlotOwner.RELEASE_QUEUE,) * m + (SlotOwner.IO_THREAD,) * (r_pages - m),
                                    swa_slots=swa, written_after_release=tuple(
                                        i for i in job.in_flight if swa[i] is not SlotOwner.IO_THREAD))
                self._finish(job, (), ())
                return commit
        prefix_len, target, insert_split = self._insert(job, m * p)
        owners, attached, swa_split = self._commit(job, m * p, target, job.synced_hits.get(PoolName.SWA, 0))
        prefix = prefix_len // p
        completed = job.completed if not v.protocol_0523 else m
        full = ((SlotOwner.FREED,) * prefix + (SlotOwner.TREE,) * (m - prefix)
                + (SlotOwner.RELEASE_QUEUE,) * (completed - m) + (SlotOwner.IO_THREAD,) * (r_pages - completed))
        commit = RankCommit(nodes=self._tree_nodes(), prefix_len=prefix_len, total_len=m * p, attached=attached,
                            discarded=False, insert_split=insert_split, swa_split=swa_split, full_slots=full,
                            swa_slots=tuple(owners), written_after_release=tuple(
                                i for i in job.in_flight if owners[i] is not SlotOwner.IO_THREAD))
        kept_full = tuple(range(prefix, m))
        kept_swa = tuple(i for i, o in enumerate(owners) if o is SlotOwner.TREE)
        self._finish(job, kept_full, kept_swa)
        return commit

    def _finish(self, job: _Prefetch, kept_full: Sequence[int], kept_swa: Sequence[int]) -> None:
        """Every buffer slot the tree did not take goes back to its pool (freed now, through the release queue or
        by the IO thread: all drained by the end of the check)."""
        self.full.release(_others(job.full_buf, kept_full))
        self.swa.release(_others(job.swa_buf, kept_swa))
        self.job = None

    def _tree_nodes(self) -> tuple[TreeNode, ...]:
        return tuple(TreeNode(length=n.length, swa_host=n.swa is not None, inserted=n.inserted,
                              swa_pages=n.swa_pages, swa_from=n.swa_from) for n in self.path)

    def snapshot(self) -> RankSnapshot:
        job = self.job
        held_full = 0 if job is None else job.full_buf.numel()
        held_swa = 0 if job is None else job.swa_buf.numel()
        return RankSnapshot(nodes=tuple(HostNode(length=n.length, swa_host=n.swa is not None) for n in self.path),
                            full_capacity=self.full.capacity, full_free=int(self.full.free.numel()),
                            full_in_tree=sum(int(n.full.numel()) for n in self.path), full_held=held_full,
                            swa_capacity=self.swa.capacity, swa_free=int(self.swa.free.numel()),
                            swa_in_tree=sum(int(n.swa.numel()) for n in self.path if n.swa is not None),
                            swa_held=held_swa)


def _others(buf: Tensor, kept: Sequence[int]) -> Tensor:
    mask = torch.ones(buf.numel(), dtype=torch.bool)
    if kept:
        mask[list(kept)] = False
    return buf[mask]


# ---------------------------------------------------------------- the group (the parent)


def _packed(call: _ranks.CallRecord) -> Packed:
    layout = call.layout if call.layout is not None else tuple(f"v{i}" for i in range(len(call.values)))
    return Packed(op=ReduceOp(call.op), values=call.values, layout=layout)


def assemble(op: str, replies: Sequence[_ranks.RankReply], seconds: float) -> tuple[list[CollectiveCall],
                                                                                     CollectiveMismatch | None, str]:
    """The collectives of one operation from every rank's reported calls (internal ``_`` ones left out): the calls
    in order, or the first one whose ranks differ in presence, op or shape, or that failed on some rank, as a
    :class:`CollectiveMismatch`; and how the failure was seen (``""`` if none)."""
    per_rank = [[c for c in r.calls if not c.name.startswith("_")] for r in replies]
    failed = [r for r in replies if r.status != "ok" or any(c.error for c in r.calls)]
    calls: list[CollectiveCall] = []
    depth = max((len(c) for c in per_rank), default=0)
    for k in range(depth):
        at = [c[k] if k < len(c) else None for c in per_rank]
        present = [c for c in at if c is not None]
        first = present[0]
        uniform = (len(present) == len(at) and all(c.op == first.op and len(c.values) == len(first.values)
                                                   and c.name == first.name for c in present)
                   and not any(c.error or c.result is None for c in present))
        if not uniform:
            name = first.name
            return calls, CollectiveMismatch(name=name, packed=tuple(None if c is None else _packed(c) for c in at)), \
                _failure_text(replies, seconds)
        result = first.result or ()
        calls.append(CollectiveCall(name=first.name, op=ReduceOp(first.op), packed=tuple(_packed(c) for c in present),
                                    result=result))
    if failed:  # a rank failed outside any compared collective
        return calls, None, _failure_text(replies, seconds)
    return calls, None, ""


def _failure_text(replies: Sequence[_ranks.RankReply], seconds: float) -> str:
    parts = []
    for r in replies:
        errs = [c for c in r.calls if c.error]
        if r.status == "ok" and not errs:
            parts.append(f"rank {r.rank}: returned")
        elif errs:
            parts.append(f"rank {r.rank}: {errs[0].name} failed after {errs[0].seconds:.1f} s ({errs[0].error})")
        else:
            parts.append(f"rank {r.rank}: {r.status} ({r.error})")
    return f"seen after {seconds:.1f} s: " + "; ".join(parts)


class TPPrefetchRuntime:
    """``world_size`` ranks over a real process group, one :class:`TPPrefetchRank` each (module docstring)."""

    capabilities: frozenset[Capability] = frozenset({Capability.SLOT_RELEASE_PATHS})
    components = frozenset({Component.TP_PREFETCH})
    #: the per-rank class the rank processes build (``module:Class``; mutants name their own)
    worker = "kvproof.gpu_runtime.tp_prefetch:TPPrefetchRank"
    #: warm rank groups are shared by runtimes of the same purpose (an adapter importing a real engine: its own)
    purpose = ""
    #: seconds each rank may take to build its worker, beyond its collectives (a real engine's imports)
    start_seconds = 0.0

    def __init__(self, group: TPPrefetchGroup, collective_timeout: float | None = None) -> None:
        self.config = group
        self.world_size = group.world_size
        self.collective_timeout = COLLECTIVE_TIMEOUT_S if collective_timeout is None else collective_timeout
        self.device = torch.device("cpu")
        self.broken = ""
        self.group = _ranks.acquire(group.world_size, self.collective_timeout, self.purpose)
        self._plain("__init__", [(self.worker, {"group": group, **self.worker_options()})] * self.world_size,
                    seconds=self.start_seconds)

    def worker_options(self) -> dict[str, Any]:
        """Keyword arguments of the worker's constructor besides the group (none here; an adapter's options)."""
        return {}

    def _command(self, method: str, args: Sequence[tuple[Any, ...]] | None = None,
                 seconds: float = 0.0) -> list[_ranks.RankReply]:
        """``method`` on every rank (bounded); refused once a mismatch took the group down."""
        if self.broken:
            raise InvalidOperation(method, "state", f"the group is gone after a failed collective ({self.broken})")
        return self.group.command(method, args, collectives=3, seconds=seconds)

    def _plain(self, method: str, args: Sequence[tuple[Any, ...]] | None = None, seconds: float = 0.0) -> list[Any]:
        """A command without compared collectives: every rank's value, or the first rank's error raised."""
        replies = self._command(method, args, seconds)
        bad = [r for r in replies if r.status != "ok"]
        if bad:
            self.broken = self.group.broken
            raise RuntimeError("; ".join(f"rank {r.rank} {r.status}: {r.error}" for r in bad))
        return [r.value for r in replies]

    def _phase(self, op: str, phase: Phase) -> PhaseReport:
        start = time.monotonic()
        replies = self._command(op)
        seconds = time.monotonic() - start
        calls, mismatch, detail = assemble(op, replies, seconds)
        if mismatch is not None or detail:
            self.broken = self.group.broken or detail
            self.group.close()
            if mismatch is None:
                raise RuntimeError(f"{op}: {detail}")
            return PhaseReport(op=op, phase=Phase.MISMATCHED, collectives=tuple(calls), mismatch=mismatch,
                               seconds=seconds, detail=detail)
        if op == "can_terminate_prefetch":
            proceeds = tuple(bool(r.value) for r in replies)
            phase = Phase.DECIDED if any(proceeds) else Phase.WAITING
            return PhaseReport(op=op, phase=phase, collectives=tuple(calls), proceeds=proceeds, seconds=seconds)
        if op == "handle_prefetch_result":
            return PhaseReport(op=op, phase=phase, collectives=tuple(calls), commits=tuple(r.value for r in replies),
                               seconds=seconds)
        if op == "sync_prefetch_hit_query" and any(r.value["revoked"] for r in replies):
            phase = Phase.REVOKED  # the synced hit is the same on every rank: all of them revoked
        return PhaseReport(op=op, phase=phase, collectives=tuple(calls), seconds=seconds)

    # ------------------------------------------------------------ the contract

    def initial_state(self, request_pages: int, ranks: Sequence[RankProgress]) -> None:
        require(len(ranks) == self.world_size, "initial_state", "ranks",
                f"{len(ranks)} progress values for {self.world_size} ranks")
        require(any(p.registered for p in ranks), "initial_state", "ranks", "no rank registered the prefetch")
        self._plain("initial_state", [(request_pages, p) for p in ranks])

    def sync_prefetch_hit_query(self) -> PhaseReport:
        return self._phase("sync_prefetch_hit_query", Phase.QUERIED)

    def page_transfer(self) -> PhaseReport:
        return self._phase("page_transfer", Phase.TRANSFERRED)

    def can_terminate_prefetch(self) -> PhaseReport:
        return self._phase("can_terminate_prefetch", Phase.DECIDED)

    def reduce_prefetch_ack(self) -> PhaseReport:
        return self._phase("reduce_prefetch_ack", Phase.REDUCED)

    def handle_prefetch_result(self) -> PhaseReport:
        return self._phase("handle_prefetch_result", Phase.COMMITTED)

    def snapshot(self) -> TPPrefetchSnapshot:
        return TPPrefetchSnapshot(ranks=tuple(self._plain("snapshot")))

    def close(self) -> None:
        """Nothing of this runtime's own to stop: the warm group serves the next runtime (``_ranks.release_all``
        closes it at exit); after a mismatch it is already gone."""
        self.broken = self.broken or "closed"

