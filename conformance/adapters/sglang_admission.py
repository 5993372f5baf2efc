"""SGLang 0.5.23's real prefill adder behind kvproof's ``admission`` suite, on CPU.

``--impl kvproof.conformance.adapters.sglang_admission:SGLangAdmission --budget upstream_0523``
drives, for a kvproof :class:`~kvproof.reference.admission.AdmissionSetup`, SGLang's own

* ``sglang.srt.managers.schedule_policy.PrefillAdder`` (built once per round, as the
  scheduler's ``get_new_batch_prefill`` builds it: ``rem_chunk_tokens`` = the setup's chunk
  size, no running batch, no mixed decode) and its ``add_one_req`` -- the selection
  (``_select_prefill_admission``), the tree locks (``_lock_node``), the load-back call, the
  commit (``_commit_prefill_admission``) and ``budget_state`` -- with
* ``sglang.srt.mem_cache.prefill_budget.SWAPrefillBudget`` (what the real
  ``SWATokenToKVPoolAllocator.create_prefill_budget`` returns: ``check_prefill``,
  ``estimate_swa_kv_tokens``, ``reserve``, ``has_capacity``),
* ``sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator`` over an ``SWAKVPool``
  (the SWA pool of ``swa_pages`` pages; a Full pool large enough never to bind, as the
  reference assumes), whose SWA page allocator hands out and takes back every SWA page of
  the run, and
* real ``Req`` objects (``Req(rid, "", input_ids, SamplingParams(max_new_tokens=m))``) whose
  match is adopted by SGLang's own ``Req.init_next_round_input`` / ``match_kv_cache``,

with the server config published once per process as upstream's unit tests do
(``set_global_server_args_for_scheduler(ServerArgs(model_path="dummy", page_size=P))``;
upstream_0523_vllm_fuzz.md §1.4).

**The stand-in tree** (:class:`StandInTree`, the adapter's; a real ``UnifiedRadixCache`` needs
CUDA fixtures in 0.5.23) is the reference's tree semantics over real pages: nodes with Full KV
on device or host and SWA on device (real SWA pages from the allocator), host only (a
tombstone) or neither. What SGLang calls on it:

* ``match_prefix`` returns a real ``MatchResult`` for the request's best-match node: the Full
  device prefix and its last node, the Full host hit, the window walk's whole host tombstones
  as ``swa_host_hit_length`` (sglang_semantics.md §5.4);
* ``lock(node)`` / ``unlock(lock)`` lock the window walk from ``node``, moving its device SWA
  from evictable to protected (``swa_evictable_size`` drops), and release exactly those nodes;
* ``init_load_back`` restores the host tombstones of the walk from ``best_match_node`` as
  0.5.23's tree does, whole nodes, allocating their SWA pages from the real allocator (evicting
  unlocked device SWA first, ascending node index); short, it changes nothing and returns
  ``None`` (upstream's rollback), and the adapter raises
  :class:`~kvproof.reference.errors.OutOfMemory` for that ``add_one_req`` (the reference's
  signal for A1 broken);
* ``swa_evictable_size`` / ``full_evictable_size`` and the storage-prefetch bookkeeping
  (no-ops: no storage tier).

A chunked request is continued by SGLang's own ``PrefillAdder.add_chunked_req`` (after
``Req.init_next_round_input()``, as the scheduler calls it); ``cache_unfinished_req`` is the
adapter's: the prefix grows to ``extend_end`` (``checkpoint_kv_cache``) and the pages of the
request's own tokens that left the window go back to the real allocator, oldest first.

The round's allocation (``prepare_for_extend``: ``ceil(extend / P)`` SWA pages per admitted
request, evicting first, all or nothing), eviction and completion are the adapter's, through
the real allocator; ``ScheduleBatch.prepare_for_extend`` needs a model runner.

Signalling: load-back short -> :class:`OutOfMemory` (``init_load_back``, ``"swa"``), the round's
allocation short -> :class:`OutOfMemory` (``prepare_for_extend``). ``AddReqResult`` is mapped by
name. Capabilities: none (SGLang asserts or corrupts on misuse, it never rejects cleanly). Only
the ``upstream_0523`` budget is SGLang 0.5.23's: any other ``--budget`` is a ``ConfigError``.

Importing this module never imports SGLang; the first construction does, through
:func:`kvproof.conformance.adapters.sglang.load_sglang`, and raises ``ImportError`` naming the
install command without SGLang.
"""

from __future__ import annotations

import importlib
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from kvproof.conformance.adapters.sglang import (
    INSTALL_HINT,
    SGLANG_VERSION,
    import_sglang_modules,
    load_sglang,
    sglang_available,
)
from kvproof.conformance.adapters.sglang_known import FINDINGS
from kvproof.reference import admission as ad
from kvproof.reference.admission import (
    AddReqResult,
    AdmissionPolicy,
    AdmissionSetup,
    AdmissionSnapshot,
    ChunkedResult,
    ReqStatus,
)
from kvproof.reference.contract import Capability
from kvproof.reference.errors import ConfigError, OutOfMemory
from kvproof.reference.registry import Component

__all__ = ["FULL_POOL_TOKENS", "INSTALL_HINT", "SGLANG_VERSION", "SGLangAdmission", "SGLangSchedulerModules",
           "StandInTree", "load_sglang_scheduler", "publish_server_args", "sglang_available"]

#: the Full pool's size: large enough that the Full budget (``total_tokens < remaining_total``) never binds
FULL_POOL_TOKENS = 1 << 16
#: ``rem_input_tokens`` (``max_prefill_tokens``): large enough never to bind (the reference does not model it)
MAX_PREFILL_TOKENS = 1 << 20
ROOT = -1


@dataclass(frozen=True)
class SGLangSchedulerModules:
    """The scheduler-side classes the adapter drives (imported after :func:`load_sglang`)."""

    version: str
    PrefillAdder: type
    AddReqResult: type
    Req: type
    SamplingParams: type
    MatchResult: type
    SWAKVPool: type
    SWATokenToKVPoolAllocator: type


_SCHED: SGLangSchedulerModules | None = None
_PUBLISHED: set[int] = set()


def load_sglang_scheduler() -> SGLangSchedulerModules:
    """SGLang's scheduler modules, imported once per process (``ImportError`` naming the install command)."""
    global _SCHED
    if _SCHED is not None:
        return _SCHED
    sg = load_sglang()
    policy, batch, sampling, prefix = import_sglang_modules(
        "sglang.srt.managers.schedule_policy", "sglang.srt.managers.schedule_batch",
        "sglang.srt.sampling.sampling_params", "sglang.srt.mem_cache.base_prefix_cache")
    _SCHED = SGLangSchedulerModules(sg.version, policy.PrefillAdder, policy.AddReqResult, batch.Req,
                                    sampling.SamplingParams, prefix.MatchResult, sg.SWAKVPool,
                                    sg.SWATokenToKVPoolAllocator)
    return _SCHED


def publish_server_args(page_size: int) -> None:
    """Publish a dummy server config once per page size, as upstream's unit tests do (``get_exec()`` needs one)."""
    if page_size in _PUBLISHED:
        return
    server_args = importlib.import_module("sglang.srt.server_args")
    server_args.set_global_server_args_for_scheduler(server_args.ServerArgs(model_path="dummy", page_size=page_size))
    _PUBLISHED.clear()
    _PUBLISHED.add(page_size)


@dataclass
class _Node:
    parent: int
    length: int
    full_on_device: bool
    swa: ad.SwaValue
    lock_ref: int = 0
    pages: list[int] = field(default_factory=list)  # real SWA page ids while swa is DEVICE


@dataclass
class _Request:
    req: Any  # sglang Req
    prompt_len: int
    max_new_tokens: int
    node: int
    status: ReqStatus = ReqStatus.WAITING
    match: ad.MatchResult | None = None
    lock: tuple[int, ...] | None = None  # what the commit's tree.lock returned
    prefix_len: int = 0
    extend_len: int = 0
    done: int = 0  # own tokens computed (the chunks run so far)
    pages: list[int] = field(default_factory=list)


class StandInTree:
    """The tree cache SGLang's prefill adder talks to (module docstring): the reference's tree over real SWA pages."""

    buffer_pipeline = None
    linker = None
    disable = False

    def __init__(self, owner: SGLangAdmission, nodes: list[_Node]) -> None:
        self._owner = owner
        self.nodes = nodes
        self.sliding_window_size = owner.config.sliding_window
        self.page_size = owner.config.page_size
        self.load_back_failed: tuple[int, int] | None = None  # (pages wanted, room) of the last failed load-back

    # ------------------------------------------------------------ what PrefillAdder / SWAPrefillBudget read

    def supports_mamba(self) -> bool:
        return False

    def supports_prefix_sharing(self) -> bool:
        return True

    def swa_reprefill_tail_tokens(self, req: Any) -> int:
        return 0

    def full_evictable_size(self) -> int:
        return 0  # the Full pool is never short (FULL_POOL_TOKENS)

    def evictable_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return self.evictable_pages() * self.page_size

    def load_back_is_cache_owned(self) -> bool:
        return False

    def finish_storage_prefetch_admission(self, *args: Any, **kwargs: Any) -> None:
        return None  # no storage tier

    def discard_storage_prefetch_accounting(self, *args: Any, **kwargs: Any) -> None:
        return None

    # ------------------------------------------------------------ the tree

    def path(self, node: int) -> list[int]:
        out = []
        while node != ROOT:
            out.append(node)
            node = self.nodes[node].parent
        return out

    def walk(self, node: int) -> list[int]:
        """The window walk from ``node`` (sglang_semantics.md §5.4): the nodes it visits, leaf first."""
        visited, covered, w = [], 0, self.sliding_window_size
        while node != ROOT and covered < w:
            n = self.nodes[node]
            if n.swa is ad.SwaValue.NONE:
                break
            visited.append(node)
            covered += n.length
            node = n.parent
        return visited

    def evictable_pages(self) -> int:
        return sum(len(n.pages) for n in self.nodes if n.swa is ad.SwaValue.DEVICE and n.lock_ref == 0)

    def match_prefix(self, params: Any) -> Any:
        """A real ``MatchResult`` for the request's best-match node (its prompt extends that node's path)."""
        node = self._owner.node_of(params.req)
        path = self.path(node)
        device = [i for i in path if self.nodes[i].full_on_device]
        return self._owner.sg.MatchResult(
            device_prefix_len=sum(self.nodes[i].length for i in device),
            last_device_node=device[0] if device else ROOT,
            last_host_node=node,
            best_match_node=node,
            host_hit_length=sum(self.nodes[i].length for i in path if not self.nodes[i].full_on_device),
            swa_host_hit_length=sum(self.nodes[i].length for i in self.walk(node)
                                    if self.nodes[i].swa is ad.SwaValue.HOST))

    def lock(self, node: int) -> tuple[int, ...]:
        held = tuple(self.walk(node))
        for i in held:
            self.nodes[i].lock_ref += 1
        return held

    def unlock(self, lock: tuple[int, ...]) -> None:
        for i in lock:
            self.nodes[i].lock_ref -= 1

    def evict(self, num_pages: int) -> int:
        """Tombstone unlocked device SWA nodes, ascending index, whole nodes, until ``num_pages`` pages are free."""
        freed = 0
        for n in self.nodes:
            if freed >= num_pages:
                break
            if n.swa is ad.SwaValue.DEVICE and n.lock_ref == 0:
                self._owner.free_pages(n.pages)
                freed += len(n.pages)
                n.pages, n.swa = [], ad.SwaValue.HOST
        return freed

    def init_load_back(self, params: Any) -> tuple[int, int] | None:
        """Restore the host tombstones of the window walk from ``best_match_node`` (whole nodes) and the Full host
        hit; short of SWA pages: nothing changed, ``None``."""
        node = params.best_match_node
        restore = [i for i in self.walk(node) if self.nodes[i].swa is ad.SwaValue.HOST]
        pages = sum(self.nodes[i].length for i in restore) // self.page_size
        taken = self._owner.take_pages(pages)
        if taken is None:
            self.load_back_failed = (pages, self._owner.free_count() + self.evictable_pages())
            return None
        for i in restore:
            k = self.nodes[i].length // self.page_size
            self.nodes[i].pages, taken = taken[:k], taken[k:]
            self.nodes[i].swa = ad.SwaValue.DEVICE
        for i in self.path(node):
            self.nodes[i].full_on_device = True
        return params.host_hit_length, node


class SGLangAdmission:
    """SGLang 0.5.23's ``PrefillAdder`` / ``SWAPrefillBudget`` over its real SWA allocator and a stand-in tree."""

    components = frozenset({Component.ADMISSION})
    findings = FINDINGS  # what kvproof found in it, matched by evidence (docs/sglang-findings.md)
    capabilities: frozenset[Capability] = frozenset()

    def __init__(self, setup: AdmissionSetup, device: str = "cpu") -> None:
        c = setup.config
        if c.policy is not AdmissionPolicy.UPSTREAM_0523:
            raise ConfigError("SGLangAdmission", "policy",
                              f"SGLang {SGLANG_VERSION}'s prefill adder is the upstream_0523 budget; got "
                              f"{c.policy.value} (run with --budget upstream_0523)")
        self.sg = load_sglang_scheduler()
        publish_server_args(c.page_size)
        self.version = f"sglang {self.sg.version}"
        self.setup, self.config, self.device = setup, c, torch.device(device)
        self.kvcache = self.sg.SWAKVPool(
            size=FULL_POOL_TOKENS, size_swa=c.size_swa, page_size=c.page_size, dtype=torch.float32, head_num=1,
            head_dim=1, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device=device)
        self.allocator = self.sg.SWATokenToKVPoolAllocator(FULL_POOL_TOKENS, c.size_swa, c.page_size, torch.float32,
                                                           device, self.kvcache, need_sort=False)
        nodes = [_Node(n.parent, n.length, n.full_on_device, n.swa) for n in setup.nodes]
        self.tree = StandInTree(self, nodes)
        for n in nodes:
            if n.swa is ad.SwaValue.DEVICE:
                taken = self.take_pages(n.length // c.page_size, evict=False)
                if taken is None:
                    raise ConfigError("SGLangAdmission", "nodes", "the tree's device SWA exceeds the pool")
                n.pages = taken
        self.requests: list[_Request] = []
        self.adder: Any = None
        self._by_req: dict[int, int] = {}

    def __repr__(self) -> str:
        return f"SGLangAdmission(sglang {self.sg.version}, {self.setup.label()})"

    # ------------------------------------------------------------ real SWA pages

    @property
    def _swa(self) -> Any:
        return self.allocator.swa_attn_allocator

    def free_count(self) -> int:
        return int(self.allocator.swa_available_size()) // self.config.page_size

    def take_pages(self, pages: int, *, evict: bool = True) -> list[int] | None:
        """``pages`` SWA pages from the real allocator, evicting unlocked tree nodes first when short; ``None``."""
        if pages == 0:
            return []
        if evict and pages > self.free_count():
            if pages > self.free_count() + self.tree.evictable_pages():
                return None
            self.tree.evict(pages - self.free_count())
        out = self._swa.alloc(pages * self.config.page_size)
        if out is None:
            return None
        p = self.config.page_size
        return [int(x) // p for x in out.tolist()[::p]] if p > 1 else [int(x) for x in out.tolist()]

    def free_pages(self, pages: list[int]) -> None:
        if pages:
            p = self.config.page_size
            self._swa.free(torch.tensor([q * p for q in pages], dtype=torch.int64, device=self.device))

    def node_of(self, req: Any) -> int:
        return self.requests[self._by_req[id(req)]].node

    # ------------------------------------------------------------ the scheduler's calls

    def arrive(self, prompt_len: int, max_new_tokens: int, node: int) -> int:
        rid = len(self.requests)
        req = self.sg.Req(str(rid), "", array("q", range(prompt_len)),
                          self.sg.SamplingParams(max_new_tokens=max_new_tokens))
        self.requests.append(_Request(req, prompt_len, max_new_tokens, node))
        self._by_req[id(req)] = rid
        return rid

    def get_new_batch_prefill(self) -> None:
        self.adder = self.sg.PrefillAdder(self.config.page_size, self.tree, self.allocator, None, 1.0,
                                          MAX_PREFILL_TOKENS, self.config.chunk_size)

    def match_prefix_for_req(self, rid: int) -> None:
        r = self.requests[rid]
        r.req.init_next_round_input(self.tree)  # SGLang's match_kv_cache adopts the stand-in's MatchResult
        r.match = ad.MatchResult(device_prefix_len=r.req.prefix_len, host_hit_length=r.req.host_hit_length,
                                 swa_host_hit_length=r.req.swa_host_hit_length)

    def add_one_req(self, rid: int) -> AddReqResult:
        r = self.requests[rid]
        self.tree.load_back_failed = None
        before = len(self.adder.can_run_list)
        res = self.adder.add_one_req(r.req, has_chunked_req=False, truncation_align_size=None)
        if self.tree.load_back_failed is not None:
            pages, room = self.tree.load_back_failed
            raise OutOfMemory("init_load_back", "swa", pages, room, request=rid)
        if len(self.adder.can_run_list) > before and self.adder.can_run_list[-1] is r.req:
            r.status, r.lock = ReqStatus.ADMITTED, r.req.lock
            r.prefix_len, r.extend_len = int(r.req.prefix_len), int(r.req.extend_len)
        return AddReqResult[res.name]

    def add_chunked_req(self, rid: int) -> ChunkedResult:
        """The scheduler's continuation: ``init_next_round_input()`` (no tree), then SGLang's
        ``PrefillAdder.add_chunked_req`` (``available_chunk_tokens``, ``reserve(is_chunked_continuation=True)``)."""
        r = self.requests[rid]
        r.req.init_next_round_input()
        before = len(self.adder.can_run_list)
        left = self.adder.add_chunked_req(r.req)
        if len(self.adder.can_run_list) == before:
            return ChunkedResult.DEFERRED
        r.status, r.extend_len = ReqStatus.ADMITTED, int(r.req.extend_len)
        return ChunkedResult.TRUNCATED if left is r.req else ChunkedResult.LAST

    def cache_unfinished_req(self, rid: int) -> None:
        """After the chunk's forward: the prefix grows to ``extend_end`` (as ``checkpoint_kv_cache`` sets it) and
        the pages of own tokens that left the window go back to the real allocator, oldest first (the tree's SWA
        eviction of the request's out-of-window part; the rule is the reference's ``out_of_window_pages``)."""
        r = self.requests[rid]
        w, p = self.config.sliding_window, self.config.page_size
        done = r.done + r.extend_len
        freed = ad.out_of_window_pages(done, window=w, page_size=p) - ad.out_of_window_pages(r.done, window=w,
                                                                                             page_size=p)
        self.free_pages(r.pages[:freed])
        r.pages, r.done = r.pages[freed:], done
        r.req.prefix_len = r.req.extend_end
        r.status, r.prefix_len, r.extend_len = ReqStatus.CHUNKED, int(r.req.prefix_len), 0

    def init_load_back(self, rid: int) -> int:
        r = self.requests[rid]
        params = type("InitLoadBackParams", (), {})()
        params.best_match_node, params.host_hit_length, params.req = r.node, r.req.host_hit_length, r.req
        before = self.free_count() + self.tree.evictable_pages()
        self.tree.load_back_failed = None
        if self.tree.init_load_back(params) is None and self.tree.load_back_failed is not None:
            pages, room = self.tree.load_back_failed
            raise OutOfMemory("init_load_back", "swa", pages, room, request=rid)
        return before - (self.free_count() + self.tree.evictable_pages())

    def prepare_for_extend(self) -> None:
        p = self.config.page_size
        admitted = [self._by_req[id(req)] for req in self.adder.can_run_list]
        # a continuation first fills its last, partly filled page (get_num_new_pages)
        want = {rid: -(-(r.done + r.extend_len) // p) - -(-r.done // p)
                for rid in admitted for r in [self.requests[rid]]}
        taken = self.take_pages(sum(want.values()))
        if taken is None:
            raise OutOfMemory("prepare_for_extend", "swa", sum(want.values()),
                              self.free_count() + self.tree.evictable_pages(),
                              request=admitted[0] if admitted else None)
        for rid, k in want.items():
            self.requests[rid].pages += taken[:k]
            taken = taken[k:]
            self.requests[rid].status = ReqStatus.RUNNING
        self.adder = None

    def evict(self, num_pages: int) -> None:
        self.tree.evict(num_pages)

    def cache_finished_req(self, rid: int) -> None:
        r = self.requests[rid]
        if r.lock is not None:
            self.tree.unlock(r.lock)
        self.free_pages(r.pages)
        r.pages, r.lock, r.status = [], None, ReqStatus.FINISHED

    # ------------------------------------------------------------ observation

    def snapshot(self) -> AdmissionSnapshot:
        nodes = tuple(ad.Node(parent=n.parent, length=n.length, full_on_device=n.full_on_device, swa=n.swa,
                              lock_ref=n.lock_ref) for n in self.tree.nodes)
        requests = tuple(ad.Request(prompt_len=r.prompt_len, max_new_tokens=r.max_new_tokens, node=r.node,
                                    status=r.status, match=r.match, locked=r.lock or (),
                                    prefix_len=r.prefix_len, extend_len=r.extend_len, swa_pages=len(r.pages))
                         for r in self.requests)
        adder = None
        if self.adder is not None:
            chunked = self.adder.new_chunked_req
            adder = ad.PrefillAdder(rem_swa_token_offset=int(self.adder.memory_budget.swa_offset),
                                    rem_chunk_tokens=self.adder.rem_chunk_tokens,
                                    can_run=tuple(self._by_req[id(q)] for q in self.adder.can_run_list),
                                    new_chunked_req=None if chunked is None else self._by_req[id(chunked)])
        state = ad.AdmissionState(config=self.config, available=self.free_count(), nodes=nodes, requests=requests,
                                  adder=adder)
        # need_sort=False: nothing is parked; free_pages lists page ids at P > 1 and slots (= pages) at P == 1
        return AdmissionSnapshot(state=state, node_pages=tuple(tuple(n.pages) for n in self.tree.nodes),
                                 request_pages=tuple(tuple(r.pages) for r in self.requests),
                                 free_pages=tuple(int(x) for x in self._swa.free_pages.tolist()))
