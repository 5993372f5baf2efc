"""SGLang 0.5.23's real cross-rank prefetch sync and commit path, one rank per process, over a real gloo group.

:class:`SGLangRankWorker` lives in one rank process, after ``torch.distributed.init_process_group("gloo", ...)`` of
the TP group. It builds, per rank, a real ``UnifiedRadixCache`` (components FULL + SWA, the Python tree core so that
the SWA component's ``_commit_prefetch`` runs; ``tree_core="rust"`` selects 0.5.23's default Rust core), real device
pools (``SWAKVPool`` + ``SWATokenToKVPoolAllocator``), and a real ``HybridCacheController`` object whose constructor
is skipped (``object.__new__``): it carries stand-in host pools and a stand-in storage backend, and its own methods
run (``_storage_hit_query``, ``_sync_prefetch_hit_query``, ``_page_transfer`` with ``_page_transfer_sidecar``,
``_reduce_prefetch_ack``, ``append_host_mem_release``, ``allocate_storage_hit``, ``terminate_prefetch``). The
scheduler side is the cache's own: ``drain_storage_control_queues`` (its qsize MIN), ``_can_terminate_prefetch``,
``check_prefetch_progress``, ``_handle_prefetch_result`` / ``_check_hybrid_prefetch_result``, ``insert_host``,
``commit_hicache_transfers`` -> ``SWAComponent._commit_prefetch``. What is stood in and why, file:line for every
call, and the differences from kvproof's reference: ``/work/notes/sglang_tp_prefetch.md``.

The phases follow kvproof's five operations (:mod:`kvproof.reference.tp_prefetch`); each returns the collectives this
rank made (``torch.distributed.all_reduce`` is wrapped for the duration: 0.5.23 calls it as a module attribute,
``torch.distributed.all_reduce(...)``, managers/cache_controller.py:447 and mem_cache/unified_radix_cache.py:359/362).

The lockstep suite drives the same worker through :class:`SGLangTPPrefetch` (``--impl
kvproof.conformance.adapters.sglang_tp_prefetch:SGLangTPPrefetch``): one :class:`SGLangRank` per rank process of
kvproof's shared harness (:mod:`kvproof.gpu_runtime._ranks`), the collectives named and projected there.
:func:`run_ranks` is a small self-contained launcher (processes forked from a fork server that imported SGLang once,
a free loopback port, a bounded wait, every process killed and joined) for scripted scenarios the suite does not draw
(``fill_host``: another request's buffers, F7's two requests in flight, the Rust tree core, ``match_prefix`` under
the consensus checker).
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_mod
import socket
import threading
import time
import traceback
from array import array
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from kvproof.conformance.adapters.sglang_known import FINDINGS
from kvproof.gpu_runtime import _ranks
from kvproof.gpu_runtime.tp_prefetch import TPPrefetchRuntime

__all__ = ["SGLangRank", "SGLangRankWorker", "SGLangTPPrefetch", "SGLangTPPrefetchConsensus", "run_ranks"]

#: this process's gloo groups for SGLang (the TP group, the controller's hits and completion groups, the harness's):
#: built once per rank process, reused by every worker built there (gloo groups are not freed by garbage collection)
_GROUPS: tuple[Any, Any, Any, Any] | None = None


class _Checks:
    """How many events SGLang's rank-consensus checker has been handed in this process and how many its worker thread
    has checked (observed by wrapping its queue's ``put`` and its ``_check_for_consensus``, which exits the process
    on a divergence), so a call can wait until every event it made is checked. The thread checks events in batches
    of what every rank has queued, so a call's two events (its parameters, its result) may be checked apart: waiting
    for one check is not enough."""

    def __init__(self) -> None:
        self.queued = 0
        self.checked = 0
        self._done = threading.Condition()

    def watch(self, rcc: Any) -> None:
        real_check, real_put = rcc._check_for_consensus, rcc._q.put

        def check(events: list[str]) -> None:
            real_check(events)
            with self._done:
                self.checked += len(events)
                self._done.notify_all()

        def put(event: Any, *args: Any, **kwargs: Any) -> None:
            if event is not None:  # None: shutdown's sentinel, never checked
                with self._done:
                    self.queued += 1
            real_put(event, *args, **kwargs)

        rcc._check_for_consensus = check
        rcc._q.put = put

    def wait_all_checked(self, timeout_s: float) -> None:
        """Until every event queued so far is checked (a divergence exits the process meanwhile)."""
        with self._done:
            target = self.queued
            if not self._done.wait_for(lambda: self.checked >= target, timeout=timeout_s):
                raise RuntimeError(f"SGLang's rank-consensus checker did not check within {timeout_s:g} s")


_CONSENSUS_CHECKS = _Checks()


def _process_groups(ranks: list[int], bound: timedelta) -> tuple[Any, Any, Any, Any]:
    """The four groups every worker of this process uses, each with the bounded timeout (``new_group`` does not
    inherit ``init_process_group``'s); the barrier first lines the ranks up after their uneven SGLang imports."""
    global _GROUPS
    groups = _GROUPS
    if groups is None:
        torch.distributed.barrier()
        tp, hits, completion, harness = (torch.distributed.new_group(ranks, backend="gloo", timeout=bound)
                                         for _ in range(4))
        groups = _GROUPS = (tp, hits, completion, harness)
    return groups

class _HostSlots:
    """A page-granular host slot allocator standing in for one host pool's allocator (alloc / free / available_size).

    Stand-in because the real ``MHATokenToKVPoolHost`` needs a full buffer geometry; only slot ownership matters
    here. Frees are recorded so the worker can say who released which slot.
    """

    def __init__(self, name: str, pages: int, page_size: int) -> None:
        self.name, self.page_size, self.size = name, page_size, pages * page_size
        self.free_slots = torch.arange(self.size, dtype=torch.int64)
        self.freed: list[int] = []

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need: int) -> torch.Tensor | None:
        if need > self.free_slots.numel():
            return None
        out, self.free_slots = self.free_slots[:need].clone(), self.free_slots[need:]
        return out

    def free(self, indices: torch.Tensor) -> int:
        if indices is None or indices.numel() == 0:
            return 0
        live = set(self.free_slots.tolist())
        dup = [int(i) for i in indices.tolist() if int(i) in live]
        if dup:
            raise RuntimeError(f"{self.name} host slots freed twice: {dup}")
        self.freed += [int(i) for i in indices.tolist()]
        self.free_slots = torch.cat([self.free_slots, indices.to(torch.int64)])
        return int(indices.numel())


class _Entry:
    def __init__(self, name: Any, host_pool: _HostSlots) -> None:
        self.name, self.host_pool, self.is_primary_index_anchor = name, host_pool, False


class _HostGroup:
    """Stands in for ``HostPoolGroup`` (the controller's ``mem_pool_host`` and the cache's ``host_pool_group``)."""

    def __init__(self, pool_name_swa: Any, full: _HostSlots, swa: _HostSlots) -> None:
        self.full, self.swa = full, swa
        self.page_size = full.page_size
        self.anchor_entry = _Entry("kv", full)
        self.entry_map = {pool_name_swa: _Entry(pool_name_swa, swa)}
        self.entries = [self.anchor_entry, *self.entry_map.values()]
        self.size = full.size
        self.logical_size = full.size

    def alloc(self, need: int) -> torch.Tensor | None:
        return self.full.alloc(need)

    def free(self, indices: torch.Tensor, pool: Any = None) -> int:
        return (self.full if pool is None or str(pool) == "kv" else self.swa).free(indices)

    def available_size(self) -> int:
        return self.full.available_size()

    def clear(self) -> None:
        pass

    @contextlib.contextmanager
    def layout_lease(self) -> Iterator[None]:
        yield


class _Storage:
    """The stand-in storage backend: answers from this rank's :class:`RankProgress` (module docstring of the notes)."""

    def __init__(self) -> None:
        self.hit = 0  # pages the existence query reports
        self.full_pages = 0  # Full pages whose read succeeds (the rest fail: the rank's pace/failure)
        self.swa_missing: tuple[int, ...] = ()
        self.mamba_missing = False
        self.pools: tuple[str, ...] = ()  # pools the existence query reports a verdict for
        self.result_cls: Any = None
        self.kv_reads = 0
        self.written: dict[int, Any] = {}  # SWA host slot -> the key (page hash) fetched into it

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return min(self.hit, len(keys))

    def batch_exists_v2(self, keys: list[str], pool_transfers: Any, extra_info: Any = None) -> Any:
        hit = min(self.hit, len(keys))
        return self.result_cls(kv_hit_pages=hit, extra_pool_hit_pages={p: hit for p in self.pools})

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None) -> list[bool]:
        start, self.kv_reads = self.kv_reads, self.kv_reads + len(keys)
        return [start + i < self.full_pages for i in range(len(keys))]

    def batch_get_v2(self, transfers: Any, extra_info: Any = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            n = len(t.keys or ())
            if str(t.name) == "swa":
                out[str(t.name)] = [i not in self.swa_missing for i in range(n)]
                page = len(t.host_indices) // n if n and t.host_indices is not None else 0
                for i, ok in enumerate(out[str(t.name)]):
                    for slot in (t.host_indices[i * page:(i + 1) * page].tolist() if ok and page else ()):
                        self.written[int(slot)] = t.keys[i]
            else:
                out[str(t.name)] = [not self.mamba_missing] * n
        return out


class _Recorder:
    """Wraps ``torch.distributed.all_reduce`` while installed: records op, values passed, result, and which group."""

    def __init__(self, groups: dict[Any, str], project: Any) -> None:
        self.groups, self.project = groups, project
        self.calls: list[dict[str, Any]] = []
        self.silent: set[Any] = set()
        self.on_call: Any = None  # called with each call before it enters the collective (the launcher streams it)
        #: on kvproof's shared rank harness (:mod:`kvproof.gpu_runtime._ranks`): every call is named there too (the
        #: public ones in kvproof's layout through ``layout_of`` / ``project``; the rest, and all while ``internal``,
        #: with a leading ``_``: reported, never compared)
        self.ranks_harness = False
        self.internal = False
        self.layout_of: Any = None
        self._real = torch.distributed.all_reduce

    @contextlib.contextmanager
    def installed(self) -> Iterator[list[dict[str, Any]]]:
        self.calls = []
        real = self._real

        def all_reduce(tensor: torch.Tensor, op: Any = torch.distributed.ReduceOp.SUM, group: Any = None,
                       async_op: bool = False) -> Any:
            name = self.groups.get(group, f"unknown_group_{id(group)}")
            if self.ranks_harness:
                return self._named(real, name, tensor, op, group, async_op)
            if group in self.silent:
                return real(tensor, op=op, group=group, async_op=async_op)
            values = [int(v) for v in tensor.flatten().tolist()]
            kind = "min" if op == torch.distributed.ReduceOp.MIN else "max" if op == torch.distributed.ReduceOp.MAX \
                else str(op)
            entry = {"name": name, "op": kind, "values": values, "result": None}
            self.calls.append(entry)
            if self.on_call is not None:
                self.on_call(entry)
            out = real(tensor, op=op, group=group, async_op=async_op)
            entry["result"] = [int(v) for v in tensor.flatten().tolist()]
            entry["kvproof"] = self.project(entry)
            return out

        torch.distributed.all_reduce = all_reduce
        try:
            yield self.calls
        finally:
            torch.distributed.all_reduce = real

    def _named(self, real: Any, name: str, tensor: torch.Tensor, op: Any, group: Any, async_op: bool) -> Any:
        """One call on kvproof's rank harness, named for it (``_ranks.naming``)."""
        raw = tuple(int(v) for v in tensor.flatten().tolist())
        public = not self.internal and group not in self.silent and self.project(
            {"name": name, "op": "", "values": list(raw), "result": []}) is not None
        if not public:
            with _ranks.naming(f"_{name}"):
                return real(tensor, op=op, group=group, async_op=async_op)

        def project(values: tuple[int, ...]) -> tuple[int, ...]:
            out = self.project({"name": name, "op": "", "values": list(values), "result": list(values)})
            return tuple(out["values"]) if out is not None else values

        with _ranks.naming(name, self.layout_of(name, project(raw)), project):
            return real(tensor, op=op, group=group, async_op=async_op)


class SGLangRankWorker:
    """One rank of SGLang 0.5.23's TP prefetch, on CPU (module docstring; the notes file says what is real)."""

    def __init__(self, group: dict[str, Any], rank: int, world_size: int) -> None:
        from kvproof.conformance.adapters.sglang import import_sglang_modules, load_sglang
        from kvproof.conformance.adapters.sglang_admission import publish_server_args

        self.rank, self.world_size = rank, world_size
        self.P, self.W = int(group["page_size"]), int(group["sliding_window"])
        self.anchor_is_root = bool(group.get("anchor_is_root", False))
        self.max_pages = int(group["max_request_pages"])
        self.tree_core_name = str(group.get("tree_core", "python"))
        self.rust = self.tree_core_name == "rust"
        self.consensus = bool(group.get("rank_consensus", False))
        if self.consensus:  # read by @rank_consensus at SGLang's import time (utils/rank_consensus_checker.py:87)
            os.environ["SGLANG_ENABLE_RANK_CONSENSUS_CHECKER"] = "1"
        sg = load_sglang()
        publish_server_args(self.P)
        (self.urc, cip, ctm, mp, rk, bpc, hs, hcc, base) = import_sglang_modules(
            "sglang.srt.mem_cache.unified_radix_cache", "sglang.srt.mem_cache.cache_init_params",
            "sglang.srt.mem_cache.unified_cache.component_type", "sglang.srt.mem_cache.memory_pool",
            "sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.base_prefix_cache",
            "sglang.srt.mem_cache.hicache_storage", "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
            "sglang.srt.mem_cache.unified_cache.components.base")
        self.hs, self.hcc, self.RadixKey, self.Handle = hs, hcc, rk.RadixKey, bpc.CacheRequestHandle
        self.CT, self.Phase = ctm.ComponentType, base.CacheTransferPhase
        ps = self.P
        sw_pages = -(-self.W // ps)
        host_pages = 2 * self.max_pages + 2  # + the anchor
        swa_host_pages = self.max_pages + max(sw_pages, self.max_pages) + 2
        size = 4 * (self.max_pages + 2) * ps
        kv = sg.SWAKVPool(size=size, size_swa=size, page_size=ps, dtype=torch.float32, head_num=1, head_dim=2,
                          swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
        alloc = sg.SWATokenToKVPoolAllocator(size, size, ps, torch.float32, "cpu", kv, need_sort=False)
        r2t = mp.ReqToTokenPool(size=4, max_context_len=size, device="cpu", enable_memory_saver=False)
        ranks = list(range(world_size))
        # 0.5.23 builds dedicated gloo groups for the two controller reductions (cache_controller.py:404-429,
        # create_custom_parallel_group(backend="gloo")); new_group(backend="gloo") is the same kind of group.
        # Every group SGLang uses is built here with the bounded timeout (new_group does not inherit
        # init_process_group's, and the default group may carry a longer one for start-up); the barrier first lines
        # the ranks up after their (uneven) SGLang imports, so the groups' own connection never waits long.
        bound = timedelta(seconds=float(group.get("collective_timeout_s", 5.0)))
        world, self.hits_group, self.completion_group, self.harness_group = _process_groups(ranks, bound)
        self.tp_group = world
        params = cip.CacheInitParams(disable=False, req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                                     page_size=ps, sliding_window_size=self.W, tp_cache_group=world,
                                     tree_components=(self.CT.FULL, self.CT.SWA), tree_core_backend=self.tree_core_name)
        cache = self.cache = self.urc.UnifiedRadixCache(params)
        self.swa = cache.components[self.CT.SWA]
        self.full_host = _HostSlots("Full", host_pages, ps)
        self.swa_host = _HostSlots("SWA", swa_host_pages, ps)
        host = _HostGroup(hs.PoolName.SWA, self.full_host, self.swa_host)
        # What init_hicache (unified_radix_cache.py:455) would have set, without its HybridCacheController.__init__
        # (which starts IO threads and attaches a real storage backend).
        self.swa._swa_kv_pool_host = self.swa_host
        cache.components[self.CT.FULL]._full_kv_pool_host = self.full_host  # evicted Full host values come back here
        cache.host_pool_group = host
        cc = self.cc = object.__new__(hcc.HybridCacheController)
        cc.page_size = ps
        cc.mem_pool_host = host
        cc.host_memory_mode = "cache"
        cc.prefetch_capacity_limit = 1 << 30
        cc.prefetch_tokens_occupied = 0
        cc.pp_prefetch_decisions = {}
        cc.prefetch_hits_sync_groups = [self.hits_group]
        cc.prefetch_completion_sync_groups = [self.completion_group]
        cc.host_mem_release_queue = queue_mod.Queue()
        cc.extra_host_mem_release_queues = {hs.PoolName.SWA: queue_mod.Queue()}
        for name in ("prefetch_queue", "prefetch_hit_queue", "prefetch_buffer", "prefetch_sync_queue",
                     "ack_prefetch_queue", "ack_backup_queue"):
            setattr(cc, name, queue_mod.Queue())
        cc.storage_backend = self.storage = _Storage()
        self.storage.result_cls = hs.PoolTransferResult
        cc.page_get_func = cc._page_get_zero_copy
        cc.enable_storage = True
        cache.cache_controller = cc
        cache.tree_core.set_hicache_enabled()
        cache.tree_core.has_swa_host_pool = True
        cache.enable_storage = True
        cache.prefetch_threshold = ps  # one page (default 256 tokens): a synced hit of 0 is revoked (below threshold)
        self.recorder = _Recorder({self.hits_group: "sync_prefetch_hit_query",
                                   self.completion_group: "reduce_prefetch_ack",
                                   world: "drain_storage_control_queues"}, self._project)
        self.recorder.silent.add(self.harness_group)
        if self.consensus:  # SGLang's own divergence detector: its worker thread, its dedicated gloo group(s)
            import types

            (rcc,) = import_sglang_modules("sglang.srt.utils.rank_consensus_checker")
            if not rcc.enabled():  # once per process: the checker's thread and groups serve every worker here
                rcc.configure([types.SimpleNamespace(cpu_group=world)])
                _CONSENSUS_CHECKS.watch(rcc)
            self.recorder.silent.update(rcc._sync_groups)
            self.rcc = rcc
        self.tokens = list(range(1000, 1000 + (self.max_pages + 1) * ps))
        self.pinned: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)  # fill_host's slots
        self.leaf: Any = None  # Rust core: the deepest node an insert_host returned (its id survives splits)
        self.leaf_end = -1
        if self.rust:
            real_insert_host = cache.tree_core.insert_host

            def insert_host(*args: Any, **kwargs: Any) -> Any:  # the real insert, its deepest node remembered
                res = real_insert_host(*args, **kwargs)
                if res.inserted_host_node is not None:
                    (path,) = cache.tree_core.collect_path_info([res.inserted_host_node])
                    if path[-1].path_end > self.leaf_end:
                        self.leaf, self.leaf_end = res.inserted_host_node, path[-1].path_end
                return res

            cache.tree_core.insert_host = insert_host
        self.anchor = self._build_anchor()
        self._build_existing(group.get("existing", ()))
        self.handle: Any = None
        self.prefetches = 0
        self.vote: bool | None = None
        self.io_ran = False

    def _project(self, call: dict[str, Any]) -> dict[str, Any] | None:
        """The call in kvproof's packed layout (reference/tp_prefetch.py docstring), or None where kvproof has no such
        collective: the verdict slots cut from ``len(PoolName)`` (23 in 0.5.23) to kvproof's KV, MAMBA, SWA (the first
        three members, the same order), completed tokens divided by the page size."""
        n_pools = len(self.hs.PoolName)
        values, result = call["values"], call["result"] or []

        def cut(v: list[int]) -> list[int]:
            if call["name"] == "sync_prefetch_hit_query":  # a lone head is the hit in tokens, flags are 0/1
                head = v[:len(v) - n_pools]
                head = [x // self.P for x in head] if len(head) == 1 else head
                return head + v[len(v) - n_pools:][:3]
            if call["name"] == "reduce_prefetch_ack":
                return [x // self.P for x in v] if len(v) == 1 else v[:3]
            return v

        if call["name"] == "drain_storage_control_queues":
            return None
        return {"name": call["name"], "op": call["op"], "values": cut(values), "result": cut(result)}

    # ------------------------------------------------------------ set-up of the host path (identical on every rank)

    def _key(self, start: int, end: int) -> Any:
        return self.RadixKey(array("q", self.tokens[start:end]))  # int64 token ids, as the Rust core requires

    def _offset(self) -> int:
        return 0 if self.anchor_is_root else self.P

    def _build_anchor(self) -> Any:
        core = self.cache.tree_core
        root = core.root_node_handle() if self.rust else core.root_node.id
        if self.anchor_is_root:
            return root
        res = core.insert_host(root, self._key(0, self.P), self.full_host.alloc(self.P), ["anchor-hash"])
        self.cache._apply_cache_actions(res.cache_actions)
        return res.inserted_host_node

    def _build_existing(self, existing: Sequence[Any]) -> None:
        core, off, pos = self.cache.tree_core, self._offset(), 0
        for item in existing:
            length, swa_host = (item["length"], item.get("swa_host", False)) if isinstance(item, dict) else item
            if swa_host and self.rust:  # no Rust-core API attaches a host SWA value (attach_swa_window: device)
                raise ValueError("tree_core='rust': an existing node with swa_host=True cannot be built; start from "
                                 "SWA tombstones and let a prefetch attach windows")
            new = self.full_host.alloc(length)
            if new is None:
                raise RuntimeError(f"the host pool cannot hold the existing path ({length} more tokens)")
            value = torch.cat([torch.full((pos,), -1, dtype=torch.int64), new])
            hashes = [f"pre-{i}" for i in range((pos + length) // self.P)]
            res = core.insert_host(self.anchor, self._key(off, off + pos + length), value, hashes)
            self.cache._apply_cache_actions(res.cache_actions)
            if swa_host:
                node = core.node_by_id(res.inserted_host_node)
                self.swa._attach_swa_host_value(node, self.swa_host.alloc(length))
            pos += length

    def _nodes(self) -> list[dict[str, Any]]:
        """The nodes below the anchor along the key: id, length, SWA host value present, and (Python core) the host
        slots each holds. The Rust core: ``collect_path_info`` of the deepest node any ``insert_host`` returned and
        ``component_has_host_value_only(node, SWA)`` (host-only nodes here), no slot values."""
        core, off = self.cache.tree_core, self._offset()
        out: list[dict[str, Any]] = []
        if self.rust:
            if self.leaf is None:
                return out
            (path,) = core.collect_path_info([self.leaf])
            for info in path:
                if info.path_start >= off and info.node_id != self.anchor:
                    out.append({"id": info.node_id, "length": info.path_end - info.path_start,
                                "swa_host": bool(core.component_has_host_value_only(info.node_id, self.CT.SWA)),
                                "full_vals": None, "swa_vals": None, "swa_first": None})
            return out
        node, pos = core.node_by_id(self.anchor), 0
        while True:
            child = next((c for c in node.children.values()
                          if list(c.key.token_ids[:1]) == self.tokens[off + pos:off + pos + 1]), None)
            if child is None:
                return out
            full = child.component_data[self.CT.FULL].host_value
            swa = child.component_data[self.CT.SWA].host_value
            out.append({"id": child.id, "length": len(child.key), "swa_host": swa is not None,
                        "full_vals": set() if full is None else set(full.tolist()),
                        "swa_vals": set() if swa is None else set(swa.tolist()),
                        "swa_first": None if swa is None or not len(swa) else int(swa[0])})  # its first position's slot
            pos += len(child.key)
            node = child

    # ------------------------------------------------------------ the phases

    def _phase(self, fn: Any, tp_name: str = "drain_storage_control_queues") -> dict[str, Any]:
        """Run one phase with ``all_reduce`` recorded; a call on the TP group is named ``tp_name`` (the vote in
        ``can_terminate_prefetch``, else the scheduler's qsize MIN, which kvproof does not model)."""
        self.recorder.groups[self.tp_group] = tp_name
        with self.recorder.installed() as calls:
            out = fn() or {}
        return {"calls": list(calls), **out}

    def initial_state(self, request_pages: int, progress: Any, new: bool = False) -> dict[str, Any]:
        """Start one prefetch of ``request_pages`` pages below the anchor, or update the progress of the ongoing one
        (after a check that said wait; ``new=True`` starts another request even then: two prefetches in flight, the
        phases then act on the newest while the ACK reductions and drains serve both). Mirrors prefetch_from_storage
        (unified_radix_cache.py:2081-2257) with the components' real prepare_prefetch / build_hicache_transfers; no
        collective."""
        st = self.storage
        st.hit, st.full_pages = int(progress.storage_hit), int(progress.full_pages)
        st.swa_missing, st.mamba_missing = tuple(progress.swa_missing), bool(progress.mamba_missing)
        self.progress = progress
        self.cache.prefetch_stop_policy = str(progress.policy.value)
        if not new and self.handle is not None and self.handle in self.cache.ongoing_prefetch:
            self._set_deadline()
            return {"calls": [], "continued": True}
        self.request_pages, self.handle, self.vote, self.io_ran = int(request_pages), None, None, False
        self.prefetches += 1
        st.kv_reads = 0
        if not progress.registered:
            return {"calls": [], "registered": False}
        hs, cache, off, ps = self.hs, self.cache, self._offset(), self.P
        key = self._key(off, off + self.request_pages * ps)
        handle = self.Handle(f"req-{self.prefetches}", 0)
        lock = cache.inc_host_lock_ref(self.anchor).to_dec_params()
        comp_xfers: dict[Any, list[Any]] = {}
        names = [str(p.value) for p in progress.transfers]
        if "swa" in names:
            prep = self.swa.prepare_prefetch(self.anchor, prefetch_tokens=len(key))
            if prep.staging_tokens:
                xfers = cache.tree_core.build_hicache_transfers(
                    self.CT.SWA, self.anchor, self.Phase.PREFETCH, token_ids=key.token_ids,
                    prefetch_tokens=len(key), staging_tokens=prep.staging_tokens, last_hash=None)
                if xfers:
                    comp_xfers[self.CT.SWA] = xfers
        aux = [x for xs in comp_xfers.values() for x in xs]
        if "mamba" in names:  # no Mamba component in this tree: a bare trailing-page transfer (notes §stand-ins)
            aux.append(hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=["__placeholder__"],
                                       hit_policy=hs.PoolHitPolicy.TRAILING_PAGES))
        st.pools = tuple(str(t.name) for t in aux)
        op = self.hcc.PrefetchOperation(handle, key, None, None, aux or None)
        op.stats_requested_tokens = len(key)
        cache.ongoing_prefetch[handle] = self.urc._OngoingPrefetch(self.anchor, key, None, op, lock, comp_xfers)
        self.cc.prefetch_tokens_occupied += len(key)
        self.handle, self.op, self.comp_xfers = handle, op, comp_xfers
        self._set_deadline()
        return {"calls": [], "registered": True, "window_buffer_pages": self._window_keys(),
                "transfers": list(st.pools)}

    def _window_keys(self) -> int:
        xs = self.comp_xfers.get(self.CT.SWA, []) if self.handle is not None else []
        return len(xs[0].keys or ()) if xs else 0

    def _set_deadline(self) -> None:
        if self.handle is None:
            return
        wait = self.cache._storage_prefetch_wait.get(self.handle)
        if self.progress.deadline_passed:
            if wait is None:
                wait = self.urc._StoragePrefetchWait(timeout_s=0.0)
                self.cache._storage_prefetch_wait[self.handle] = wait
            wait.expired = True

    def _ongoing(self) -> bool:
        return self.handle is not None and self.handle in self.cache.ongoing_prefetch

    def sync_prefetch_hit_query(self) -> dict[str, Any]:
        """The prefetch thread's work (cache_controller.py:1333-1369): the real ``_storage_hit_query``
        (hybrid_cache_controller.py:1419) and ``_sync_prefetch_hit_query`` (:1468, one MIN), the truncation, then the
        scheduler's real ``drain_storage_control_queues`` (unified_radix_cache.py:3298: a qsize MIN over the TP group,
        then ``_try_alloc_storage_hit``: hit-sized Full and SWA staging, or a revoke below the threshold)."""
        def run() -> dict[str, Any]:
            if not self._ongoing() or self.op.host_indices is not None or self.io_ran:
                return {"skipped": True}
            cc, op = self.cc, self.op
            hash_value, count = cc._storage_hit_query(op)
            synced = cc._sync_prefetch_hit_query(op, count)
            op.hash_value = hash_value[: synced // self.P]
            op.storage_hit_count = synced
            cc.prefetch_hit_queue.put(op)
            free = getattr(self.progress, "host_free_pages", None)
            pinned = self._pin_host(free)
            path = self._nodes()[-1]["id"] if free is not None and self._nodes() else None
            lock = self.cache.inc_host_lock_ref(path).to_dec_params() if path is not None else None
            try:  # the hit-time staging sees only the rank's free host pages (rank-local pressure: F6); the path is
                self.cache.drain_storage_control_queues()  # in use (locked): kvproof models no host eviction
            finally:
                if lock is not None:
                    self.cache.dec_host_lock_ref(path, lock)
                if pinned is not None:
                    self.full_host.free(pinned)
            out = {"local_hit": count // self.P, "synced_hit": synced // self.P,
                   "revoked": not self._ongoing(), "query_pool_hit_pages": {str(k): v for k, v in
                                                                            op.query_pool_hit_pages.items()}}
            if self._ongoing():
                out["full_staging_pages"] = int(op.host_indices.numel()) // self.P
                xs = self.comp_xfers.get(self.CT.SWA, [])
                out["swa_staging_pages"] = (int(xs[0].host_indices.numel()) // self.P
                                            if xs and xs[0].host_indices is not None else 0)
            return out
        return self._phase(run)

    def _pin_host(self, free_pages: int | None) -> torch.Tensor | None:
        """Hold all but ``free_pages`` of the free Full host pages (another request's buffers) for the staging."""
        if free_pages is None:
            return None
        extra = self.full_host.available_size() // self.P - free_pages
        return self.full_host.alloc(extra * self.P) if extra > 0 else None

    def _io_finishes(self) -> bool:
        """The rank's IO thread finishes at this check: it is done, or it has nothing left once its Full pages are in
        (no sidecar transfer; the reference's ``IOResult.finished``)."""
        p = self.progress
        return bool(p.io_done or (not p.transfers and p.full_pages >= len(self.op.hash_value)))

    def page_transfer(self) -> dict[str, Any]:
        """The IO aux thread (cache_controller.py:1247-1267): the real ``_page_transfer_with_stable_layout``
        (hybrid_cache_controller.py:1608: KV batches, one completed-tokens ACK each, then ``_page_transfer_sidecar``
        :1615, one pool-hits ACK), then the completed_req ACK. Runs only once the rank's IO is done
        (``io_done``); before that it is in flight and has emitted no ACK (one 128-page batch)."""
        def run() -> dict[str, Any]:
            if self.handle is None or self.io_ran or self.op.host_indices is None:
                return {"ran": False}
            if not self._io_finishes():
                return {"ran": False, "in_flight": True}
            op, cc = self.op, self.cc
            try:
                cc._page_transfer_with_stable_layout(op)
            finally:
                cc.prefetch_sync_queue.put(self._completed_req_ack(op))
            self.io_ran = True
            return {"ran": True, "acks": [self._ack_kind(a) for a in list(cc.prefetch_sync_queue.queue)]}
        return self._phase(run)

    def _completed_req_ack(self, op: Any) -> Any:
        """The ACK the IO aux thread sends when the transfer ends (managers/cache_controller.py:1261-1267)."""
        from sglang.srt.managers.cache_controller import PrefetchAck
        return PrefetchAck(rid=op.request_id, completed_req=True, operation=op)

    @staticmethod
    def _ack_kind(ack: Any) -> str:
        if ack.completed_tokens is not None:
            return f"completed_tokens={ack.completed_tokens}"
        if ack.pool_hits is not None:
            return f"pool_hits={dict(ack.pool_hits)}"
        return "completed_req"

    def can_terminate_prefetch(self) -> dict[str, Any]:
        """The real ``_can_terminate_prefetch`` (unified_radix_cache.py:2295): best_effort True, wait_complete False,
        timeout: a MAX of the deadline verdict over the TP group."""
        def run() -> dict[str, Any]:
            if not self._ongoing() or self.op.is_terminated():
                self.vote = None
                return {"proceeds": False, "ongoing": self._ongoing()}
            self.vote = bool(self.cache._can_terminate_prefetch(self.op))
            return {"proceeds": self.vote}
        return self._phase(run, tp_name="can_terminate_prefetch")

    def reduce_prefetch_ack(self) -> dict[str, Any]:
        """The sync thread (hybrid_cache_controller.py:1940): the real ``_reduce_prefetch_ack`` (:1920 and
        cache_controller.py:1475) on each ACK, in lockstep. The ranks reduce the first ``k`` queued ACKs, ``k`` the
        fewest any rank has queued (a harness exchange, not recorded): a real sync thread blocks in the (k+1)-th
        all-reduce until the slow rank's ACK arrives."""
        return self._phase(self._reduce_acks)

    def _reduce_acks(self) -> dict[str, Any]:
        cc = self.cc
        pending = torch.tensor([cc.prefetch_sync_queue.qsize()], dtype=torch.int)
        torch.distributed.all_reduce(pending, op=torch.distributed.ReduceOp.MIN, group=self.harness_group)
        k, kinds = int(pending.item()), []
        for _ in range(k):
            ack = cc.prefetch_sync_queue.get_nowait()
            kinds.append(self._ack_kind(ack))
            cc._reduce_prefetch_ack(ack)
            cc.ack_prefetch_queue.put(ack)
        return {"reduced_acks": kinds, "pending_acks": cc.prefetch_sync_queue.qsize()}

    def handle_prefetch_result(self) -> dict[str, Any]:
        """The scheduler step: the real ``drain_storage_control_queues`` (its ``_drain_ack_prefetch``,
        unified_radix_cache.py:3210, applies the reduced ACKs and on ``completed_req`` calls ``_handle_prefetch_result``
        itself), then, if this rank's vote said terminate, the real ``check_prefetch_progress`` (:2391) with
        ``_can_terminate_prefetch`` answering the vote already taken (no second collective)."""
        def run() -> dict[str, Any]:
            if self.handle is None:
                return {"proceeds": False, "commit": None, "via": "unregistered"}
            before = self._path_ids()
            freed_full0, freed_swa0 = len(self.full_host.freed), len(self.swa_host.freed)
            ongoing0 = self._ongoing()
            info = self.cache.ongoing_prefetch.get(self.handle)
            verdicts: list[bool] = []
            real_check = self.cache._check_hybrid_prefetch_result

            handled: list[dict[str, Any]] = []

            def check(request: Any, operation: Any, *args: Any, **kwargs: Any) -> bool:  # the real check, recorded
                ok = bool(real_check(request, operation, *args, **kwargs))
                if request == self.handle:
                    verdicts.append(ok)
                handled.append({"rid": request.rid, "usable": ok, "completed_tokens": int(operation.completed_tokens),
                                "expected_tokens": len(operation.hash_value) * self.P})
                return ok

            self.cache._check_hybrid_prefetch_result = check
            staging = self._staging(info)
            try:
                self.cache.drain_storage_control_queues()
                via = "ack_drain" if ongoing0 and not self._ongoing() else None
                if self._ongoing() and self.vote:
                    vote = self.vote
                    self.cache._can_terminate_prefetch = lambda op: vote
                    try:
                        self.cache.check_prefetch_progress(self.handle)
                    finally:
                        del self.cache._can_terminate_prefetch
                    via = "check_prefetch_progress"
            finally:
                del self.cache._check_hybrid_prefetch_result
            proceeds = ongoing0 and not self._ongoing()
            commit = None
            if proceeds:
                commit = self._commit_report(before, staging, freed_full0, freed_swa0,
                                             discarded=bool(verdicts) and not verdicts[-1])
            return {"proceeds": proceeds, "via": via or "waiting", "commit": commit, "handled": handled,
                    "rid": self.handle.rid}
        return self._phase(run)

    def finish_io(self, only_terminated: bool = False) -> dict[str, Any]:
        """Let an IO thread still in flight end (its prefetch was terminated or, unless ``only_terminated``, is
        waiting): the real IO sees ``is_terminated`` and stops; its ACKs are reduced (lockstep, as
        :meth:`reduce_prefetch_ack`) and drained, so the slots it owns come back (``_drain_ack_prefetch`` on
        ``completed_req``). Not a kvproof operation; every rank calls it (the ACK reduction is collective)."""
        def run() -> dict[str, Any]:
            ran = False
            if self.handle is not None and not self.io_ran and self.op.host_indices is not None and not (
                    only_terminated and self._ongoing()):
                try:
                    self.cc._page_transfer_with_stable_layout(self.op)
                finally:
                    self.cc.prefetch_sync_queue.put(self._completed_req_ack(self.op))
                self.io_ran = ran = True
            reduced = self._reduce_acks()
            self.cache.drain_storage_control_queues()
            self._drain_releases()
            return {"ran": ran, "reduced_acks": reduced["reduced_acks"], "pending_acks": reduced["pending_acks"]}
        return self._phase(run)

    def unpin_host(self) -> dict[str, Any]:
        """Free what :meth:`fill_host` pinned. Not a kvproof operation; no collective."""
        full, swa = self.pinned
        if full is not None:
            self.full_host.free(full)
        if swa is not None:
            self.swa_host.free(swa)
        self.pinned = (None, None)
        return {"calls": [], "full_free": self.full_host.available_size() // self.P}

    def match_prefix(self) -> dict[str, Any]:
        """The real ``match_prefix`` (URC:609, ``@rank_consensus`` on its hit lengths) of the longest key: what the
        scheduler does next with the host tree. Not a kvproof operation."""
        def run() -> dict[str, Any]:
            from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

            res = self.cache.match_prefix(MatchPrefixParams(key=self._key(0, len(self.tokens))))
            if self.consensus:  # the checker's thread compares this call's events with the peers' before the reply
                _CONSENSUS_CHECKS.wait_all_checked(timeout_s=30.0)
            return {"device_prefix": int(res.device_prefix_len), "host_hit_length": int(res.host_hit_length),
                    "swa_host_hit_length": int(getattr(res, "swa_host_hit_length", 0))}
        return self._phase(run)

    def fill_host(self, full_pages: int, swa_pages: int = 0) -> dict[str, Any]:
        """Pin host slots on this rank outside the tree (another request's buffers): rank-local host pressure, the
        premise of R5-a (sglang_semantics.md §6.7). Not a kvproof operation; no collective."""
        full = self.full_host.alloc(full_pages * self.P) if full_pages else None
        swa = self.swa_host.alloc(swa_pages * self.P) if swa_pages else None
        self.pinned = (full, swa)
        return {"calls": [], "full_free": self.full_host.available_size() // self.P,
                "swa_free": self.swa_host.available_size() // self.P}

    # ------------------------------------------------------------ observation

    def _path_ids(self) -> list[int]:
        return [n["id"] for n in self._nodes()]

    def _staging(self, info: Any) -> dict[str, list[int]]:
        if info is None or info.host_indices is None:
            return {"full": [], "swa": []}
        xs = info.comp_xfers.get(self.CT.SWA, [])
        swa = xs[0].host_indices.tolist() if xs and xs[0].host_indices is not None else []
        return {"full": info.host_indices.tolist(), "swa": swa}

    def _commit_report(self, before: list[int], staging: dict[str, list[int]], f0: int, s0: int,
                       discarded: bool) -> dict[str, Any]:
        self._drain_releases()
        ps, pos = self.P, 0
        full_in_tree: set[int] = set()
        swa_in_tree: set[int] = set()
        path, old = [], set(before)
        for n in self._nodes():
            full_in_tree |= n["full_vals"] or set()
            swa_in_tree |= n["swa_vals"] or set()
            path.append({"length": n["length"], "swa_host": n["swa_host"], "existed": n["id"] in old, "start": pos})
            pos += n["length"]
        freed_full = set(self.full_host.freed[f0:])
        freed_swa = set(self.swa_host.freed[s0:])

        def owner(slot: int, in_tree: set[int], freed: set[int]) -> str:
            if slot in freed:
                return "freed"
            if self.rust:  # no slot values from the Rust core: a kept slot is the tree's unless the result was dropped
                return "held" if discarded else "tree"
            return "tree" if slot in in_tree else "held"

        full_owner = [owner(slot, full_in_tree, freed_full) for slot in staging["full"][::ps]]
        swa_owner = [owner(slot, swa_in_tree, freed_swa) for slot in staging["swa"][::ps]]
        total = int(self.op.completed_tokens) if not discarded else 0
        return {"nodes": [(p["length"], p["swa_host"]) for p in path], "attached": "tree" in swa_owner,
                "discarded": discarded, "loaded_tokens": self._loaded(),
                "inserted_tokens": sum(p["length"] for p in path if not p["existed"]),
                "total_len": total, "prefix_len": (total - self._loaded()) if total else 0,
                "splits": [p["start"] for p in path if p["start"] > 0],
                "full_slots": full_owner, "swa_slots": swa_owner, "path": path}

    def _loaded(self) -> int:
        return int(self.cache.prefetch_loaded_tokens_by_reqid.get(self.handle, 0))

    def _drain_releases(self) -> None:
        """Free what the release queues hold (upstream: the next scheduler step's drain)."""
        cc = self.cc
        while not cc.host_mem_release_queue.empty():
            self.full_host.free(cc.host_mem_release_queue.get_nowait())
        for q in cc.extra_host_mem_release_queues.values():
            while not q.empty():
                self.swa_host.free(q.get_nowait())

    def snapshot(self) -> dict[str, Any]:
        self._drain_releases()
        nodes = self._nodes()
        # host-only nodes: a node's Full host value spans the node, and so does an SWA host value (the commit splits
        # a tombstone so that the window is its own node); the Python core's values are counted, not assumed
        full_tree = sum(len(n["full_vals"]) if n["full_vals"] is not None else n["length"] for n in nodes)
        swa_tree = sum(len(n["swa_vals"]) if n["swa_vals"] is not None else n["length"] * n["swa_host"]
                       for n in nodes)
        held_full = held_swa = 0
        for info in self.cache.ongoing_prefetch.values():
            st = self._staging(info)
            held_full += len(st["full"])
            held_swa += len(st["swa"])
        ps = self.P
        anchor = (0 if self.anchor_is_root else 1) + sum(
            int(t.numel()) // ps for t in self.pinned[:1] if t is not None)
        full_free, swa_free = self.full_host.available_size() // ps, self.swa_host.available_size() // ps
        return {"nodes": [(n["length"], n["swa_host"]) for n in nodes],
                # slots neither free, in the tree below the anchor, the anchor's, nor held by an ongoing prefetch:
                # owned by an IO thread still in flight (released by its completed_req ACK's drain)
                "full_io_thread": self.full_host.size // ps - full_free - full_tree // ps - held_full // ps - anchor,
                "swa_io_thread": self.swa_host.size // ps - swa_free - swa_tree // ps - held_swa // ps,
                "full_capacity": self.full_host.size // ps, "full_free": self.full_host.available_size() // ps,
                "full_in_tree": full_tree // ps, "full_held": held_full // ps,
                "swa_capacity": self.swa_host.size // ps, "swa_free": self.swa_host.available_size() // ps,
                "swa_in_tree": swa_tree // ps, "swa_held": held_swa // ps,
                "ongoing": self._ongoing(), "pending_acks": self.cc.prefetch_sync_queue.qsize()}


# ---------------------------------------------------------------- the lockstep suite's implementation


def _kvproof_layout(name: str, values: tuple[int, ...]) -> tuple[str, ...]:
    """kvproof's slot names for a projected call (``kvproof.reference.tp_prefetch``'s packed layouts)."""
    pools = ("kv", "mamba", "swa")
    if name == "sync_prefetch_hit_query":
        head = len(values) - len(pools)
        return (("hit",) if head == 1 else tuple(f"flag_{i}" for i in range(head))) + pools
    if name == "can_terminate_prefetch":  # 0.5.23's vote: the MAX of the timeout ranks' deadlines
        return ("deadline",)
    return ("completed",) if len(values) == 1 else pools


class SGLangRank:
    """One rank of SGLang 0.5.23's TP prefetch as kvproof's contract sees it (``TPPrefetchRank``'s methods), built in a
    rank process of kvproof's shared harness (:mod:`kvproof.gpu_runtime._ranks`) by :class:`SGLangTPPrefetch`.

    Each method runs the :class:`SGLangRankWorker` phase of the same name (SGLang's own code) and reports what it
    observes, never what kvproof's model says it should be: the collectives as SGLang made them (projected onto
    kvproof's layout, ``_``-named where kvproof has no such collective), the decision (the vote, or every IO thread
    finished: the ACK drain then completes the prefetch), and the commit read back from the real tree and host
    pools (which staged slots a node holds, which SWA key the stand-in storage wrote into an attached slot, where
    the insert and the commit split a node, whether the SWA commit walked the path or returned at its
    all-or-nothing check). Python tree core only: the Rust core hands out no slot values.
    """

    def __init__(self, *, rank: int, world_size: int, group: Any, rank_consensus: bool = False,
                 collective_timeout_s: float = 3.0) -> None:
        spec = {"page_size": group.page_size, "sliding_window": group.sliding_window,
                "anchor_is_root": group.anchor_is_root, "max_request_pages": group.max_request_pages,
                "existing": [(n.length, n.swa_host) for n in group.existing], "tree_core": "python",
                "rank_consensus": rank_consensus, "collective_timeout_s": collective_timeout_s}
        self.w = SGLangRankWorker(spec, rank, world_size)
        self.w.recorder.ranks_harness, self.w.recorder.layout_of = True, _kvproof_layout
        self.P = self.w.P
        self.walked: bool | None = None  # the latest SWA commit: walked the path (True) or returned early (False)
        self._watch_swa_commit()

    def _watch_swa_commit(self) -> None:
        """Observe the real ``_commit_prefetch``: it walked the path unless it released the buffer tensor itself."""
        swa = self.w.swa
        real_commit, real_release = swa._commit_prefetch, swa._release_swa_host
        buffer: list[Any] = []

        def commit(anchor: Any, transfers: Any, **kwargs: Any) -> Any:
            buffer[:] = [transfers[0].host_indices] if transfers else []
            self.walked = bool(transfers)
            return real_commit(anchor, transfers, **kwargs)

        def release(host_indices: Any, cache_actions: Any) -> Any:
            if buffer and host_indices is buffer[0]:
                self.walked = False
            return real_release(host_indices, cache_actions)

        swa._commit_prefetch, swa._release_swa_host = commit, release

    # ------------------------------------------------------------ the contract's operations

    def initial_state(self, request_pages: int, progress: Any) -> None:
        self.w.initial_state(request_pages, progress)
        self.walked = None

    def sync_prefetch_hit_query(self) -> dict[str, Any]:
        out = self.w.sync_prefetch_hit_query()
        if out.get("skipped"):  # a continued check (or a rank that never registered): no hit query
            return {"synced_hit": 0, "revoked": False}
        return {"synced_hit": int(out["synced_hit"]), "revoked": bool(out["revoked"])}

    def page_transfer(self) -> None:
        self.w.page_transfer()

    def can_terminate_prefetch(self) -> bool:
        """The vote as SGLang takes it, or the ACK drain's completion: every rank's IO thread finished (learnt here
        through an internal MIN, as the drain learns it when it applies the last ACK)."""
        vote = bool(self.w.can_terminate_prefetch().get("proceeds"))
        mine = int(self.w._ongoing() and (self.w.io_ran or self.w._io_finishes()))
        flag = torch.tensor([mine], dtype=torch.int64)
        with _ranks.naming("_ack_drain"):
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=self.w.harness_group)
        return self.w._ongoing() and (vote or bool(flag.item()))

    def reduce_prefetch_ack(self) -> None:
        self.w.reduce_prefetch_ack()

    def handle_prefetch_result(self) -> Any:
        """The real scheduler step, then the IO threads of terminated prefetches run out and their ACKs drain
        (internal collectives: kvproof's reference drains the release queue and the IO thread by the end of a
        check); the commit as observed."""
        from kvproof.reference.tp_prefetch import RankCommit, SlotOwner, TreeNode

        w = self.w
        info = w.cache.ongoing_prefetch.get(w.handle) if w.handle is not None else None
        staging = w._staging(info)
        before = [(n["length"], n["swa_host"]) for n in w._nodes()]
        out = w.handle_prefetch_result()
        w.recorder.internal = True
        try:
            w.finish_io(only_terminated=True)
        finally:
            w.recorder.internal = False
        p, nodes = self.P, w._nodes()
        held = bool(out.get("commit") is None)
        full_pages, swa_pages = staging["full"][::p], staging["swa"][::p]
        if held:  # still waiting: its staging is the prefetch's
            return RankCommit(nodes=tuple(TreeNode(length=n, swa_host=s) for n, s in before), prefix_len=0,
                              total_len=0, attached=False, discarded=False, insert_split=None, swa_split=None,
                              full_slots=(SlotOwner.HELD,) * len(full_pages),
                              swa_slots=(SlotOwner.HELD,) * len(swa_pages), written_after_release=())
        commit = out["commit"]
        full_in_tree = set().union(*(n["full_vals"] for n in nodes))
        swa_in_tree = set().union(*(n["swa_vals"] for n in nodes))
        swa_page = {slot: i for i, first in enumerate(swa_pages) for slot in range(first, first + p)}
        keys = list(w.op.hash_value)
        tree_nodes, ends, pos = [], set(), 0
        for n in nodes:
            attached = sorted({swa_page[s] for s in n["swa_vals"] if s in swa_page})
            # the slot of the node's first position (host slots need not ascend with positions: after frees a page
            # with a lower id can hold a later position; the lowest id named the wrong token: found by a campaign)
            first = n["swa_first"] if attached else None
            key = w.storage.written.get(first) if first is not None else None
            tree_nodes.append(TreeNode(length=n["length"], swa_host=n["swa_host"],
                                       inserted=bool(n["full_vals"] & set(staging["full"])),
                                       swa_pages=tuple(attached),
                                       swa_from=keys.index(key) * p if key in keys else None))
            pos += n["length"]
            ends.add(pos)
        old = {sum(n for n, _ in before[:i + 1]) for i in range(len(before))}
        total, old_end = int(commit["total_len"]), sum(n for n, _ in before)
        window = len(swa_pages)
        start = total - window * p
        new = ends - old
        return RankCommit(
            nodes=tuple(tree_nodes), prefix_len=int(commit["prefix_len"]), total_len=total,
            attached=bool(self.walked), discarded=bool(commit["discarded"]),
            insert_split=total if total in new and total < old_end else None,
            swa_split=start if self.walked and start > 0 and start in new and start != total else None,
            full_slots=tuple(SlotOwner.TREE if s in full_in_tree else SlotOwner.FREED for s in full_pages),
            swa_slots=tuple(SlotOwner.TREE if s in swa_in_tree else SlotOwner.FREED for s in swa_pages),
            written_after_release=())

    def snapshot(self) -> Any:
        """The rank's path and host pools: capacity is the pool less the anchor's page (outside the path); a slot
        neither free, in the tree nor held by the prefetch in progress (an IO thread's, a leak) breaks conservation."""
        from kvproof.reference.tp_prefetch import HostNode, RankSnapshot

        if self.w.consensus:  # SGLang's own checker compares the ranks' view of the tree (it exits both on a
            self.w.match_prefix()  # divergence: the harness sees the ranks die)
        snap = self.w.snapshot()
        anchor = 0 if self.w.anchor_is_root else 1
        return RankSnapshot(nodes=tuple(HostNode(length=n, swa_host=bool(s)) for n, s in snap["nodes"]),
                            full_capacity=snap["full_capacity"] - anchor, full_free=snap["full_free"],
                            full_in_tree=snap["full_in_tree"], full_held=snap["full_held"],
                            swa_capacity=snap["swa_capacity"], swa_free=snap["swa_free"],
                            swa_in_tree=snap["swa_in_tree"], swa_held=snap["swa_held"])


class SGLangTPPrefetch(TPPrefetchRuntime):
    """SGLang 0.5.23's real prefetch sync and commit path as a ``tp_prefetch`` implementation: :class:`SGLangRank` in
    each rank process of kvproof's shared harness (gloo on loopback, a bounded timeout on every collective), driven
    by the lockstep suite against the ``upstream_0523`` reference (``--impl
    kvproof.conformance.adapters.sglang_tp_prefetch:SGLangTPPrefetch``). Who releases a slot (freed at once, the
    release queue, the IO thread) all ends in the same drains here: it declares no ``SLOT_RELEASE_PATHS``."""

    capabilities = frozenset()
    findings = FINDINGS  # what kvproof found in it, matched by evidence (docs/sglang-findings.md)
    worker = "kvproof.conformance.adapters.sglang_tp_prefetch:SGLangRank"
    purpose = "sglang"
    start_seconds = 90.0  # each rank imports SGLang and builds its cache when its worker is built
    version = "sglang 0.5.23"
    rank_consensus = False

    def worker_options(self) -> dict[str, Any]:
        return {"rank_consensus": self.rank_consensus, "collective_timeout_s": self.collective_timeout}


class SGLangTPPrefetchConsensus(SGLangTPPrefetch):
    """:class:`SGLangTPPrefetch` with SGLang's own rank-consensus checker switched on
    (``SGLANG_ENABLE_RANK_CONSENSUS_CHECKER=1``): every snapshot runs the real ``match_prefix`` on each rank, whose
    ``@rank_consensus`` the checker compares across ranks in its own thread; on a divergence it exits every rank."""

    purpose = "sglang-consensus"
    rank_consensus = True


# ---------------------------------------------------------------- a small launcher (replaced by the shared harness)


#: script methods whose args are one entry per rank
_PER_RANK = frozenset({"initial_state", "fill_host"})


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(rank: int, world_size: int, port: int, group: dict[str, Any], script: list[Any],
               replies: Any, collective_timeout_s: float, startup_timeout_s: float) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        from kvproof.conformance.adapters.sglang import load_sglang

        if group.get("rank_consensus"):  # read by @rank_consensus at SGLang's import time
            os.environ["SGLANG_ENABLE_RANK_CONSENSUS_CHECKER"] = "1"
        load_sglang()  # import before the rendezvous: the ranks' imports take uneven time on a loaded machine
        # the default group only starts the ranks (rendezvous, the start-up barrier): it gets the parent's budget
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                             world_size=world_size, timeout=timedelta(seconds=startup_timeout_s))
        worker = SGLangRankWorker({**group, "collective_timeout_s": collective_timeout_s}, rank, world_size)
        replies.put((rank, -1, "ready", {}))
        current = [0]
        worker.recorder.on_call = lambda entry: replies.put((rank, -3, "call", {
            "step": current[0], "name": entry["name"], "op": entry["op"], "n": len(entry["values"])}))
        for step, (method, args) in enumerate(script):
            current[0] = step
            mine = args[rank] if isinstance(args, list) and len(args) == world_size and method in _PER_RANK else args
            t0 = time.perf_counter()
            try:
                out = getattr(worker, method)(*(mine or ()))
            except Exception as exc:  # noqa: BLE001 - a failed collective or SGLang error: report it, stop this rank
                replies.put((rank, step, method, {"error": f"{type(exc).__name__}: {exc}",
                                                  "seconds": time.perf_counter() - t0,
                                                  "calls": list(worker.recorder.calls)}))
                return
            out["seconds"] = time.perf_counter() - t0
            replies.put((rank, step, method, out))
    except Exception:  # noqa: BLE001 - any start-up failure becomes this rank's reply
        replies.put((rank, -2, "crash", {"error": traceback.format_exc()}))
    finally:
        with contextlib.suppress(Exception):
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()


#: what the fork server imports once (SGLang's modules, with kvproof's stand-ins), so that a rank starts in a fork
PRELOAD = "kvproof.conformance.adapters.sglang_preload"


def _rank_context(rank_consensus: bool) -> Any:
    """How :func:`run_ranks` starts its ranks: forked from a fork server that imported SGLang once (a rank starts in
    well under a second instead of re-importing SGLang, about 6 s of CPU each on a 2-core machine); a fresh spawned
    interpreter where the group turns SGLang's rank consensus checker on, which SGLang reads at its import. The fork
    server is a fresh interpreter too (nothing of the caller's state, no CUDA), single-threaded, started on first use;
    it exits with this process."""
    import multiprocessing

    if rank_consensus:
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([PRELOAD])
    return ctx


def run_ranks(world_size: int, group: dict[str, Any], script: list[Any], timeout_s: float = 120.0,
              collective_timeout_s: float = 5.0) -> list[list[dict[str, Any]]]:
    """Run ``script`` (``[(method, args)]``; for ``initial_state`` ``args`` is one ``(request_pages, progress)`` per
    rank) on ``world_size`` rank processes (started by :func:`_rank_context`) in lockstep; each rank's replies in
    order (a failed step ends with ``{"error": ...}``; a rank that never answered gets ``{"error": "no reply ..."}``).
    Never hangs: the parent waits at most ``timeout_s`` in all, then kills and joins every process."""
    ctx = _rank_context(bool(group.get("rank_consensus")))
    replies = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world_size, port, group, script, replies,
                                                  collective_timeout_s, timeout_s), daemon=True)
             for r in range(world_size)]
    out: list[list[dict[str, Any]]] = [[] for _ in range(world_size)]
    inflight: dict[int, dict[str, Any]] = {}  # each rank's last collective entered (its shape)
    deadline = time.monotonic() + timeout_s

    def entered(r: int) -> str:
        c = inflight.get(r)
        return "" if c is None else (f"; its last recorded collective: {c['name']} all_reduce({c['op'].upper()}) of "
                                     f"{c['n']} value(s) at step {c['step']}")
    try:
        for p in procs:
            p.start()
        done = [False] * world_size
        while not all(done) and time.monotonic() < deadline:
            try:
                rank, step, method, reply = replies.get(timeout=min(0.5, max(0.01, deadline - time.monotonic())))
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if not done[r] and p.exitcode is not None:  # died without a last reply (gloo aborts the process)
                        done[r] = True
                        out[r].append({"error": f"rank {r} exited with code {p.exitcode} after {len(out[r])} "
                                                f"step(s) (a negative code is the signal that killed it){entered(r)}",
                                       "exitcode": p.exitcode})
                continue
            if step == -1:
                continue
            if step == -3:
                inflight[rank] = reply
                continue
            reply = {"method": method, "step": step, **reply}
            if "error" in reply:
                reply["error"] += entered(rank)
            out[rank].append(reply)
            if "error" in reply or step == len(script) - 1:
                done[rank] = True
        # late replies already in the queue
        with contextlib.suppress(queue_mod.Empty, OSError, ValueError):
            while True:
                rank, step, method, reply = replies.get(timeout=0.2)
                if step >= 0 or (step == -2 and not done[rank]):
                    out[rank].append({"method": method, "step": step, **reply})
        for r in range(world_size):
            if not out[r] or ("error" not in out[r][-1] and len(out[r]) < len(script)):
                out[r].append({"error": f"no reply from rank {r} after {len(out[r])} step(s) within {timeout_s:.0f}s"
                                        f"{entered(r)}"})
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            if p.pid is not None:
                p.join(timeout=5)
        replies.close()
        replies.join_thread()
    return out
