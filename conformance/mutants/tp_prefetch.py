"""Deliberately broken variants of the multi-process ``tp_prefetch`` runtime (sglang_semantics.md §6, §7 T1-T5).

Each mutant is a :class:`~kvproof.gpu_runtime.tp_prefetch.TPPrefetchRank` subclass with one small override (it
runs in every rank process of the group) and the runtime that names it as its worker. The ``tp_prefetch`` lockstep
suite must kill every one (``kvproof mutants``); the arithmetic ones are also broken twins of the Z3 model
(``kvproof prove -k tp_prefetch``: the twin each mirrors is named in its docstring).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvproof.gpu_runtime.tp_prefetch import TPPrefetchRank, TPPrefetchRuntime, _Prefetch
from kvproof.reference.tp_prefetch import PoolName, RankCommit, ReduceOp

__all__ = ["MUTANTS"]


class MinAsMax(TPPrefetchRank):
    """Every packed MIN reduced with MAX (§6.3 step 5): a rank loads and commits what only the fastest rank has (Z3
    twin ``tp_prefetch.handle_prefetch_result.full_slots_conserved.max_reduce``). Differs: two ranks with storage
    hits 8 and 3: the synced hit is 8, not 3."""

    def all_reduce(self, name: str, op: ReduceOp, values: Sequence[int], layout: Sequence[str]) -> list[int]:
        return super().all_reduce(name, ReduceOp.MAX if op is ReduceOp.MIN else op, values, layout)


class LocalAckValue(TPPrefetchRank):
    """``reduce_prefetch_ack`` calls the collective but keeps its own values (§6.3 step 5, the reduced tensor unread):
    each rank inserts what it loaded itself (Z3 twin ``tp_prefetch.handle_prefetch_result.same_tree_0523.no_pool_sync``,
    for the completed count too). Differs: ranks that loaded 8 and 5 pages insert 8 and 5 (T1)."""

    def all_reduce(self, name: str, op: ReduceOp, values: Sequence[int], layout: Sequence[str]) -> list[int]:
        result = super().all_reduce(name, op, values, layout)
        return list(values) if name == "reduce_prefetch_ack" else result


class SwaHitsNotWrittenBack(TPPrefetchRank):
    """The pool-hit ACK is reduced, but the commit reads the rank's own SWA count (§6.3 step 5: the write-back of the
    MIN into ``hit_pages`` dropped; Z3 twin ``tp_prefetch.handle_prefetch_result.same_tree_0523.no_pool_sync``).
    Differs: one rank misses a window page, the other keeps its whole window: it inserts what the other drops."""

    def reduce_prefetch_ack(self) -> dict[str, object]:
        out = super().reduce_prefetch_ack()
        job = self.job
        if job is not None and PoolName.SWA in job.synced_hits:
            job.synced_hits[PoolName.SWA] = job.hits.get(PoolName.SWA, 0)
        return out


class AttachPartialWindow(TPPrefetchRank):
    """The commit attaches a window buffer of which at least one page arrived, not only a whole window (§6.4; Z3
    twin ``tp_prefetch.commit_prefetch.whole_window_0523.partial_window``). Differs: a synced hit of 1 page under a
    2-page window: the reference releases the buffer."""

    def attach_ok(self, job: _Prefetch, window: int, loaded: int, target: int | None) -> bool:
        return window > 0 and target is not None and loaded >= 1


class ReleaseAttachedSlot(TPPrefetchRank):
    """After attaching a window, the commit also returns the first attached SWA host slot to the free pool (§6.4): a
    slot owned by the tree and free at once (T4). Differs: any attached window (slot conservation breaks)."""

    def handle_prefetch_result(self) -> RankCommit:
        commit = super().handle_prefetch_result()
        for node in self.path:
            if node.swa_pages and node.swa is not None:
                self.swa.release(node.swa[:1].clone())
                break
        return commit


class SplitOnePageLate(TPPrefetchRank):
    """A tombstone partly inside the window is split one page too late (§6.4's ``_split_node``): the attached node
    starts a page after the window (T3). Differs: path ``[4+swa, 2]``, a request of 8 pages: the reference splits
    at token 12, this one at 14."""

    def split_at(self, node_start: int, fill_start: int) -> int:
        return super().split_at(node_start, fill_start) + self.p


class LastRankSkipsAck(TPPrefetchRank):
    """The last rank skips the completed-count collective of ``reduce_prefetch_ack`` (§8 item 9: a missing None guard
    turned early return): the other ranks wait in a collective it never joins (T5: on gloo, an error after the
    group's timeout). Differs: any check that reaches the ACK reduction."""

    def all_reduce(self, name: str, op: ReduceOp, values: Sequence[int], layout: Sequence[str]) -> list[int]:
        if name == "reduce_prefetch_ack" and self.rank == self.world_size - 1:
            return list(values)
        return super().all_reduce(name, op, values, layout)


class HitsBySum(TPPrefetchRank):
    """0.5.23's leading-run hit count replaced by the #27264-era sum of successes (§6.6, R5-c; Z3 twin
    ``tp_prefetch.count_pool_hits.synced_prefix_fetched.sum``). Differs: a 2-page window whose first page fails:
    the sum says 1, the leading run 0."""

    def count_hits(self, results: Sequence[bool]) -> int:
        return sum(1 for ok in results if ok)


def _runtime(rank: type[TPPrefetchRank]) -> type[TPPrefetchRuntime]:
    """The runtime whose rank processes build ``rank`` (a module attribute, so a replay can name it)."""
    name = rank.__name__ + "Runtime"
    cls = type(name, (TPPrefetchRuntime,), {"worker": f"{__name__}:{rank.__name__}", "__doc__": rank.__doc__,
                                            "__module__": __name__, "__qualname__": name})
    globals()[name] = cls
    return cls


MUTANTS: dict[str, Callable[..., TPPrefetchRuntime]] = {
    "min_as_max": _runtime(MinAsMax),
    "local_ack_value": _runtime(LocalAckValue),
    "swa_hits_not_written_back": _runtime(SwaHitsNotWrittenBack),
    "attach_partial_window": _runtime(AttachPartialWindow),
    "release_attached_slot": _runtime(ReleaseAttachedSlot),
    "split_one_page_late": _runtime(SplitOnePageLate),
    "last_rank_skips_ack": _runtime(LastRankSkipsAck),
    "hits_by_sum": _runtime(HitsBySum),
}
