"""The prefill adder's SWA admission against HiCache load-back over torch state (sglang_semantics.md §5).

The same admission path as ``kvproof.reference.admission`` (its module docstring states the
model, the four policies and the simplifications), held in tensors on the runtime's device:

* the radix tree as columns ``parent``, ``length``, ``full`` (Full KV on device), ``swa``
  (0 device, 1 host tombstone, 2 neither), ``lock_ref``, one row per node (a load-back split
  appends the root-side rest), and the **page table of the SWA device pool**: ``node_pages``
  ``[nodes, max pages]`` (the device SWA pages of each node, -1 padded);
* the requests as columns (prompt, ``max_new_tokens``, best-match node, status, prefix,
  extend, chunk pages) and the match-time snapshot ``[requests, 3]`` (-1: not matched); the
  SWA pages of its own tokens each request holds, in token order (a chunked request's
  continuation appends its pages; ``cache_unfinished_req`` frees the oldest, out of the window);
* the SWA device pool itself: kvproof's paged allocator
  (:class:`~kvproof.gpu_runtime.paged.PagedTokenToKVPoolAllocator`, the SWA side of
  ``SWATokenToKVPoolAllocator``): load-back and the round's prefill take real pages from it,
  eviction and completion give them back, so ``available`` is its free-page count and an
  admitted request really allocates.

Evictable pages and eviction are vectorised over the node columns (eviction picks unlocked
device nodes in index order by a prefix sum, as the reference's loop does); the window walk
reads the path once. The budget (``_budget``, ``_estimate``), the checks and the reservation
are written here again, not imported, so that the lockstep suite compares two
implementations. Every operation validates before it changes anything and raises the
reference's typed errors (``OutOfMemory``: nothing changed, the load-back's lock released).
Hooks (:meth:`AdmissionRuntime._budget_terms`, :meth:`~AdmissionRuntime._admits`,
:meth:`~AdmissionRuntime._window_lock` ...) are where the mutants of
``kvproof.conformance.mutants.admission`` change one thing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvproof.gpu_runtime.paged import PagedTokenToKVPoolAllocator, resolve_device
from kvproof.reference.admission import (
    AddReqResult,
    AdmissionPolicy,
    AdmissionSetup,
    AdmissionSnapshot,
    AdmissionState,
    ChunkedResult,
    MatchResult,
    Node,
    PrefillAdder,
    ReqStatus,
    Request,
    SwaValue,
)
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory, require
from kvproof.reference.registry import Component

__all__ = ["AdmissionRuntime"]

Tensor = torch.Tensor
_I64 = torch.int64
_DEVICE, _HOST, _NONE = 0, 1, 2
_SWA = (SwaValue.DEVICE, SwaValue.HOST, SwaValue.NONE)
_STATUS = (ReqStatus.WAITING, ReqStatus.ADMITTED, ReqStatus.RUNNING, ReqStatus.FINISHED, ReqStatus.CHUNKED)
_WAITING, _ADMITTED, _RUNNING, _FINISHED, _CHUNKED = range(5)
# request columns
_PROMPT, _MAX_NEW, _NODE, _STAT, _PREFIX, _EXTEND, _PAGES = range(7)


def _ceil_p(x: int, p: int) -> int:
    return -(-x // p) * p


def _ceil_div(x: int, p: int) -> int:
    return -(-x // p)


@dataclass
class _Adder:
    offset: int = 0
    rem_chunk: int | None = None
    can_run: list[int] = field(default_factory=list)
    new_chunked: int | None = None


@dataclass(frozen=True)
class _Walk:
    nodes: tuple[int, ...]
    covered: int
    stopped: bool
    device_pages: int
    host_tokens: int  # whole host tombstones (swa_host_hit_length)
    restores: tuple[tuple[int, int, int], ...]  # (node, its length, window-capped tokens), leaf first


class AdmissionRuntime:
    """A prefill scheduler's admission over a HiCache tree and kvproof's paged SWA pool."""

    capabilities = frozenset({Capability.REJECTS_MISUSE})
    components = frozenset({Component.ADMISSION})

    def __init__(self, setup: AdmissionSetup, device: torch.device | str | None = None) -> None:
        self.setup, self.config = setup, setup.config
        c = setup.config
        self.device = resolve_device(device)
        self.page_size, self.window, self.policy = c.page_size, c.sliding_window, c.policy
        self.pool = PagedTokenToKVPoolAllocator(c.swa_pages * c.page_size, c.page_size, self.device, "swa")
        nodes, p, dev = setup.nodes, c.page_size, self.device
        self.parent = torch.tensor([n.parent for n in nodes], dtype=_I64, device=dev)
        self.length = torch.tensor([n.length for n in nodes], dtype=_I64, device=dev)
        self.full = torch.tensor([n.full_on_device for n in nodes], dtype=torch.bool, device=dev)
        self.swa = torch.tensor([_SWA.index(n.swa) for n in nodes], dtype=torch.int8, device=dev)
        self.lock_ref = torch.tensor([n.lock_ref for n in nodes], dtype=_I64, device=dev)
        width = max([n.length // p for n in nodes], default=1)
        self.node_pages = torch.full((len(nodes), width), -1, dtype=_I64, device=dev)
        for i, n in enumerate(nodes):  # the cached tree's device SWA, in node order
            if n.swa is SwaValue.DEVICE:
                self.node_pages[i, :n.length // p] = self.pool.take_pages(n.length // p)
        self.reqs = torch.zeros((0, 7), dtype=_I64, device=dev)
        self.match = torch.zeros((0, 3), dtype=_I64, device=dev)
        self.locked: list[tuple[int, ...]] = []
        self.req_pages: list[Tensor] = []
        self.adder: _Adder | None = None

    # ------------------------------------------------------------ queries

    def available(self) -> int:
        return self.pool.num_free_pages()

    def evictable_pages(self) -> int:
        """Device SWA pages of unlocked nodes."""
        mask = (self.swa == _DEVICE) & (self.lock_ref == 0)
        return int((self.length * mask).sum()) // self.page_size

    def rem_swa_tokens(self) -> int:
        offset = self.adder.offset if self.adder is not None else 0
        return (self.available() + self.evictable_pages()) * self.page_size - offset

    def _path(self, node: int) -> list[int]:
        parent = self.parent.tolist()
        out = []
        while node != -1:
            out.append(node)
            node = parent[node]
        return out

    def _path_len(self, node: int) -> int:
        length = self.length.tolist()
        return sum(length[i] for i in self._path(node))

    def _walk(self, node: int) -> _Walk:
        """The window walk (§5.4): covered tokens, visited nodes, device pages, host tombstones, the capped restore."""
        parent, length, swa = self.parent.tolist(), self.length.tolist(), self.swa.tolist()
        w, p = self.window, self.page_size
        visited: list[int] = []
        restores: list[tuple[int, int, int]] = []
        covered = dev = host = 0
        stopped = False
        while node != -1 and covered < w:
            if swa[node] == _NONE:
                stopped = True
                break
            visited.append(node)
            if swa[node] == _DEVICE:
                dev += length[node] // p
            else:
                host += length[node]
                restores.append((node, length[node], self._capped(length[node], covered)))
            covered += length[node]
            node = parent[node]
        return _Walk(tuple(visited), covered, stopped, dev, host, tuple(restores))

    def _capped(self, length: int, covered: int) -> int:
        """What ``corrected`` restores of a host tombstone at covered length ``c``: ``min(len, ceil_P(W - c))``."""
        return min(length, _ceil_p(self.window - covered, self.page_size))

    # ------------------------------------------------------------ validation

    def _check_node(self, op: str, node: int) -> None:
        n = self.parent.numel()
        require(node == -1 or 0 <= node < n, op, "node", f"node {node} out of range [0, {n})")

    def _check_rid(self, op: str, rid: int) -> int:
        n = self.reqs.shape[0]
        require(0 <= rid < n, op, "rid", f"request {rid} out of range [0, {n})")
        return int(self.reqs[rid, _STAT])

    def _open_adder(self, op: str) -> _Adder:
        if self.adder is None:
            raise InvalidOperation(op, "state", "no round is open (get_new_batch_prefill first)")
        return self.adder

    def _waiting(self, op: str, rid: int) -> None:
        status = self._check_rid(op, rid)
        require(status == _WAITING, op, "rid", f"request {rid} is {_STATUS[status].value}, not waiting")

    # ------------------------------------------------------------ tree operations

    def _window_lock(self, node: int) -> tuple[int, ...]:
        """The nodes the window lock of ``node`` holds (``inc_lock_ref``: the whole walk)."""
        return self._walk(node).nodes

    def _inc_lock_ref(self, node: int) -> tuple[int, ...]:
        held = self._window_lock(node)
        if held:
            self.lock_ref[list(held)] += 1
        return held

    def _dec_lock_ref(self, held: tuple[int, ...]) -> None:
        if held:
            self.lock_ref[list(held)] -= 1

    def evict(self, num_pages: int) -> None:
        """Tombstone unlocked device SWA nodes in index order until ``num_pages`` pages are freed (best effort)."""
        require(num_pages >= 0, "evict", "num_pages", f"must be >= 0, got {num_pages}")
        cand = (self.swa == _DEVICE) & (self.lock_ref == 0)
        pages = torch.where(cand, self.length // self.page_size, 0)
        before = torch.cumsum(pages, 0) - pages  # pages freed before each node, in index order
        sel = cand & (before < num_pages)
        rows = self.node_pages[sel]
        freed = rows[rows >= 0]
        if freed.numel():
            self.pool.release_pages(torch.sort(freed).values)
        self.swa[sel] = _HOST
        self.node_pages[sel] = -1

    def _alloc(self, op: str, pages: int, rid: int | None) -> Tensor:
        """Take ``pages`` SWA pages, evicting first when short; ``OutOfMemory`` (nothing changed) if still short."""
        free = self.available()
        if pages > free:
            room = free + self.evictable_pages()
            if pages > room:
                raise OutOfMemory(op, "swa", pages, room, request=rid)
            self.evict(pages - free)
        return self.pool.take_pages(pages)

    def _append_node(self, parent: int, length: int, full: bool, swa: int) -> int:
        dev = self.device
        self.parent = torch.cat([self.parent, torch.tensor([parent], dtype=_I64, device=dev)])
        self.length = torch.cat([self.length, torch.tensor([length], dtype=_I64, device=dev)])
        self.full = torch.cat([self.full, torch.tensor([full], dtype=torch.bool, device=dev)])
        self.swa = torch.cat([self.swa, torch.tensor([swa], dtype=torch.int8, device=dev)])
        self.lock_ref = torch.cat([self.lock_ref, torch.zeros(1, dtype=_I64, device=dev)])
        self.node_pages = torch.cat([self.node_pages, torch.full((1, self.node_pages.shape[1]), -1, dtype=_I64,
                                                                  device=dev)])
        return self.parent.numel() - 1

    # ------------------------------------------------------------ the scheduler's operations

    def arrive(self, prompt_len: int, max_new_tokens: int, node: int) -> int:
        op = "arrive"
        require(max_new_tokens >= 0, op, "max_new_tokens", f"must be >= 0, got {max_new_tokens}")
        self._check_node(op, node)
        matched = self._path_len(node)
        require(matched < prompt_len, op, "prompt_len", f"{prompt_len} tokens, {matched} matched: nothing to extend")
        require(not self._walk(node).stopped, op, "node",
                f"the window of node {node} reaches a node with neither device nor host SWA (not a valid boundary)")
        row = torch.tensor([[prompt_len, max_new_tokens, node, _WAITING, 0, 0, 0]], dtype=_I64, device=self.device)
        self.reqs = torch.cat([self.reqs, row])
        self.match = torch.cat([self.match, torch.full((1, 3), -1, dtype=_I64, device=self.device)])
        self.locked.append(())
        self.req_pages.append(torch.zeros(0, dtype=_I64, device=self.device))
        return self.reqs.shape[0] - 1

    def get_new_batch_prefill(self) -> None:
        require(self.adder is None, "get_new_batch_prefill", "state", "a round is already open")
        self.adder = _Adder(rem_chunk=self.config.chunk_size)

    def match_prefix_for_req(self, rid: int) -> None:
        op = "match_prefix_for_req"
        self._waiting(op, rid)
        node = int(self.reqs[rid, _NODE])
        path = self._path(node)
        full, length = self.full.tolist(), self.length.tolist()
        device = sum(length[i] for i in path if full[i])
        host = sum(length[i] for i in path if not full[i])
        swa_host = self._walk(node).host_tokens
        if self.policy is AdmissionPolicy.PRE_27391:  # no SWA field; a tombstone only flags the Full host hit (§5.5)
            values = [device, max(host, 1) if swa_host else host, 0]
        else:
            values = [device, host, swa_host]
        self.match[rid] = torch.tensor(values, dtype=_I64, device=self.device)

    def _restores(self, walk: _Walk) -> list[tuple[int, int]]:
        """(node, tokens) load-back restores: whole tombstones upstream, the window-capped part under ``corrected``."""
        if self.policy is AdmissionPolicy.CORRECTED:
            return [(i, capped) for i, _, capped in walk.restores]
        return [(i, length) for i, length, _ in walk.restores]

    def init_load_back(self, rid: int) -> int:
        """Restore the host tombstones of ``rid``'s window walk (its lock held); ``OutOfMemory``: nothing changed."""
        op = "init_load_back"
        self._check_rid(op, rid)
        node = int(self.reqs[rid, _NODE])
        require(bool(self.locked[rid]) or node == -1, op, "rid", f"request {rid} does not hold its window lock")
        return self._load_back(rid, node)

    def _load_back(self, rid: int, node: int) -> int:
        op, p = "init_load_back", self.page_size
        restores = self._restores(self._walk(node))
        pages = sum(t for _, t in restores) // p
        taken = self._alloc(op, pages, rid)
        path = self._path(node)
        if path:  # the Full host hit is loaded back too (the Full pool is not modelled)
            self.full[path] = True
        at = 0
        for i, tokens in restores:
            k = tokens // p
            if tokens < int(self.length[i]):  # split: the root-side rest keeps the host copy, outside the window
                rest = self._append_node(int(self.parent[i]), int(self.length[i]) - tokens, True, _HOST)
                self.length[i], self.parent[i] = tokens, rest
            self.swa[i] = _DEVICE
            self.node_pages[i, :k] = taken[at:at + k]
            at += k
        return pages

    def _match_of(self, rid: int) -> tuple[int, int, int]:
        device, host, swa_host = (int(x) for x in self.match[rid].tolist())
        return device, host, swa_host

    def _budget(self, extend: int, host: int, chunk: int | None) -> int:
        """``_swa_budget_for_req`` (§5.2): ``max(min(e, C), W) + P (+ ceil_P(h))``."""
        alloc = extend if chunk is None else min(extend, chunk)
        budget = max(alloc, self.window) + self.page_size
        return budget + _ceil_p(host, self.page_size) if host > 0 else budget

    def _estimate(self, extend: int, max_new: int, limit: int | None, host: int) -> int:
        """0.5.23's ``estimate_swa_kv_tokens``."""
        a = extend if limit is None else min(extend, limit)
        needed = max(a - self.window, 0) + min(extend + max_new, self.window) + self.page_size
        return needed + _ceil_p(host, self.page_size) if host > 0 else needed

    def _admits(self, budget: int, rem: int) -> bool:
        """Upstream: ``budget >= rem_swa_tokens`` -> NO_TOKEN."""
        return budget < rem

    def _budget_terms(self, rid: int) -> tuple[int, int]:
        """(extend, host term) of the 27391-style budget under the policy."""
        prompt, node = int(self.reqs[rid, _PROMPT]), int(self.reqs[rid, _NODE])
        device, _, swa_host = self._match_of(rid)
        if self.policy is AdmissionPolicy.CORRECTED:  # recomputed from the tree now, e' without the Full host hit
            return prompt - self._path_len(node), sum(capped for _, _, capped in self._walk(node).restores)
        return prompt - device, swa_host  # PRE_27391's match leaves swa_host 0

    def _fits(self, rid: int, adder: _Adder) -> tuple[bool, int | None]:
        chunk, rem = adder.rem_chunk, self.rem_swa_tokens()
        extend, host = self._budget_terms(rid)
        return self._admits(self._budget(extend, host, chunk), rem), chunk

    def _check_prefill(self, rid: int, rem: int, chunk: int | None, e_after: int) -> tuple[bool, int | None]:
        """``SWAPrefillBudget.check_prefill`` with the never-fits chunk cap (upstream_0523 §1.2)."""
        p = self.page_size
        max_new, (_, _, host) = int(self.reqs[rid, _MAX_NEW]), self._match_of(rid)
        needed = self._estimate(_ceil_p(e_after, p), max_new, chunk, host)
        if needed < rem:
            return True, chunk
        if needed >= self.config.size_swa:
            cap = (rem - self._estimate(0, max_new, None, host)) // p * p
            if chunk is not None and cap > 0:
                return True, min(chunk, cap)
        return False, None

    #: the check inside the tree lock (a mutant drops it)
    recheck = True

    def add_one_req(self, rid: int) -> AddReqResult:
        """``PrefillAdder.add_one_req`` (§5.3): check, lock, re-check, load back, chunk, reserve."""
        op = "add_one_req"
        adder = self._open_adder(op)
        self._waiting(op, rid)
        if int(self.match[rid, 0]) < 0:
            raise InvalidOperation(op, "rid", f"request {rid} has no match (match_prefix_for_req first)")
        p, node = self.page_size, int(self.reqs[rid, _NODE])
        if self.policy is AdmissionPolicy.UPSTREAM_0523:
            return self._add_one_req_0523(rid, adder)
        if not self._fits(rid, adder)[0]:  # the check outside the lock
            return AddReqResult.NO_TOKEN
        held = self._inc_lock_ref(node)
        ok, limit = self._fits(rid, adder) if self.recheck else (True, adder.rem_chunk)
        if not ok:
            self._dec_lock_ref(held)
            return AddReqResult.NO_TOKEN
        self.locked[rid] = held
        try:
            self.init_load_back(rid)
        except OutOfMemory:
            self.locked[rid] = ()
            self._dec_lock_ref(held)
            raise
        prefix = self._path_len(node)
        e = int(self.reqs[rid, _PROMPT]) - prefix
        if limit is None or _ceil_p(e, p) <= limit:
            extend, input_tokens, max_new, chunked = e, _ceil_p(e, p), int(self.reqs[rid, _MAX_NEW]), False
        else:
            trunc = limit // p * p
            if trunc <= 0:  # no room for a page: the lock is released, the loaded nodes stay (evictable)
                self.locked[rid] = ()
                self._dec_lock_ref(held)
                return AddReqResult.OTHER
            extend, input_tokens, max_new, chunked = trunc, trunc, 0, True
        return self._commit(rid, adder, prefix, extend, input_tokens, max_new, chunked)

    def _commit(self, rid: int, adder: _Adder, prefix: int, extend: int, input_tokens: int, max_new: int,
                chunked: bool) -> AddReqResult:
        """An admission: the reservation, the request in ``can_run`` (its lock already in ``locked``)."""
        self.update_prefill_budget(input_tokens, max_new)
        adder.can_run.append(rid)
        if chunked:
            adder.new_chunked = rid
        self.reqs[rid, _STAT], self.reqs[rid, _PREFIX], self.reqs[rid, _EXTEND] = _ADMITTED, prefix, extend
        return self._budget_state()

    def _last_device_node(self, node: int) -> int:
        """The match's ``last_device_node``: the deepest node on the path whose Full KV is on device."""
        return next((i for i in self._path(node) if bool(self.full[i])), -1)

    def _add_one_req_0523(self, rid: int, adder: _Adder) -> AddReqResult:
        """0.5.23: select under a pin of the last device node (check, chunk), load back if the match found a host
        hit, lock the best-match node's window, unpin (upstream_0523_vllm_fuzz.md §1.1)."""
        p, node = self.page_size, int(self.reqs[rid, _NODE])
        device, host_full, swa_host = self._match_of(rid)
        pin = self._inc_lock_ref(self._last_device_node(node))
        prefix = device + host_full
        e = int(self.reqs[rid, _PROMPT]) - prefix
        ok, limit = self._check_prefill(rid, self.rem_swa_tokens(), adder.rem_chunk, e)
        if not ok:
            self._dec_lock_ref(pin)
            return AddReqResult.NO_TOKEN
        if limit is None or _ceil_p(e, p) <= limit:
            extend, input_tokens, max_new, chunked = e, _ceil_p(e, p), int(self.reqs[rid, _MAX_NEW]), False
        else:
            extend, input_tokens, max_new, chunked = limit // p * p, limit // p * p, 0, True
            if extend <= 0:  # no page of chunk left: nothing was loaded, nothing changes
                self._dec_lock_ref(pin)
                return AddReqResult.OTHER
        if host_full > 0 or swa_host > 0:  # needs_host_load_back, under the pin only
            try:
                self._load_back(rid, node)
            except OutOfMemory:
                self._dec_lock_ref(pin)
                raise
        self.locked[rid] = self._inc_lock_ref(node)
        self._dec_lock_ref(pin)
        return self._commit(rid, adder, prefix, extend, input_tokens, max_new, chunked)

    def update_prefill_budget(self, input_tokens: int, max_new_tokens: int) -> None:
        """The reservation without the host term (load-back already took its pages); ``rem_chunk -= ceil_P(e)``."""
        adder = self._open_adder("update_prefill_budget")
        e = _ceil_p(input_tokens, self.page_size)
        if self.policy is AdmissionPolicy.UPSTREAM_0523:
            reserve = self._estimate(e, max_new_tokens, adder.rem_chunk, 0)
        else:
            reserve = self._budget(e, 0, adder.rem_chunk)
        adder.offset += reserve
        if adder.rem_chunk is not None:
            adder.rem_chunk -= e

    def _budget_state(self) -> AddReqResult:
        adder = self.adder
        if adder is None or self.rem_swa_tokens() <= 0:
            return AddReqResult.NO_TOKEN
        stop_at_chunk = self.policy is not AdmissionPolicy.UPSTREAM_0523 and adder.new_chunked is not None
        if stop_at_chunk or (adder.rem_chunk is not None and adder.rem_chunk <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    def prepare_for_extend(self) -> None:
        """The round's batch allocates every admitted chunk's SWA pages at once (evicting first); the round closes."""
        op = "prepare_for_extend"
        adder = self._open_adder(op)
        counts = [self._chunk_pages(self._own_len(rid), int(self.reqs[rid, _EXTEND])) for rid in adder.can_run]
        taken = self._alloc(op, sum(counts), adder.can_run[0] if adder.can_run else None)
        at = 0
        for rid, k in zip(adder.can_run, counts, strict=True):
            self.req_pages[rid] = torch.cat([self.req_pages[rid], taken[at:at + k]])
            self.reqs[rid, _STAT] = _RUNNING
            self.reqs[rid, _PAGES] += k
            at += k
        self.adder = None

    def _own_len(self, rid: int) -> int:
        """Tokens the request computed itself: its prefix beyond the matched path (0 before its first chunk ran)."""
        return int(self.reqs[rid, _PREFIX]) - self._path_len(int(self.reqs[rid, _NODE]))

    def _chunk_pages(self, done: int, extend: int) -> int:
        """Pages a chunk of ``extend`` tokens after ``done`` own tokens takes: past the last, partly filled page."""
        return _ceil_div(done + extend, self.page_size) - _ceil_div(done, self.page_size)

    def _out_of_window(self, done: int) -> int:
        """Pages of ``done`` own tokens wholly below ``done - W``: ``max(0, floor((done - W) / P))``."""
        return max(0, done - self.window) // self.page_size

    def _available_chunk_tokens(self, adder: _Adder) -> int:
        """``available_chunk_tokens``: ``min(rem_chunk, rem_swa_tokens - P)`` (without chunking, the SWA term)."""
        avail = self.rem_swa_tokens() - self.page_size
        return avail if adder.rem_chunk is None else min(adder.rem_chunk, avail)

    def add_chunked_req(self, rid: int) -> ChunkedResult:
        """``PrefillAdder.add_chunked_req`` (§5.3): a chunked request's next chunk, deferred when no page is left."""
        op = "add_chunked_req"
        adder = self._open_adder(op)
        status = self._check_rid(op, rid)
        require(status == _CHUNKED, op, "rid",
                f"request {rid} is {_STATUS[status].value}, not chunked (cache_unfinished_req makes it so)")
        avail = self._available_chunk_tokens(adder)
        if avail <= 0:
            return ChunkedResult.DEFERRED
        rest = int(self.reqs[rid, _PROMPT]) - int(self.reqs[rid, _PREFIX])
        new_len, truncated = min(rest, avail), rest > avail
        self.update_prefill_budget(_ceil_p(new_len, self.page_size), 0 if truncated else int(self.reqs[rid, _MAX_NEW]))
        adder.can_run.append(rid)
        self.reqs[rid, _STAT], self.reqs[rid, _EXTEND] = _ADMITTED, new_len
        return ChunkedResult.TRUNCATED if truncated else ChunkedResult.LAST

    def cache_unfinished_req(self, rid: int) -> None:
        """A chunk ran with prompt left (between rounds): the prefix grows, the out-of-window pages are freed."""
        op = "cache_unfinished_req"
        status = self._check_rid(op, rid)
        require(status == _RUNNING, op, "rid", f"request {rid} is {_STATUS[status].value}, not running")
        prefix, extend, prompt = (int(self.reqs[rid, c]) for c in (_PREFIX, _EXTEND, _PROMPT))
        require(prefix + extend < prompt, op, "rid", f"request {rid} computed its whole prompt ({prompt} tokens): "
                "cache_finished_req, not cache_unfinished_req")
        require(self.adder is None, op, "state", "a round is open (the chunk's forward runs between rounds)")
        done = self._own_len(rid)
        freed = self._out_of_window(done + extend) - self._out_of_window(done)
        pages = self.req_pages[rid]
        if freed > 0:  # the oldest own pages, the lowest positions
            self.pool.release_pages(torch.sort(pages[:freed]).values)
            self.req_pages[rid] = pages[freed:]
        self.reqs[rid, _STAT], self.reqs[rid, _PREFIX], self.reqs[rid, _EXTEND] = _CHUNKED, prefix + extend, 0
        self.reqs[rid, _PAGES] -= freed

    def cache_finished_req(self, rid: int) -> None:
        """Completion of a request whose prompt is done: its pages back to the pool, the window lock released."""
        op = "cache_finished_req"
        status = self._check_rid(op, rid)
        require(status == _RUNNING, op, "rid", f"request {rid} is {_STATUS[status].value}, not running")
        left = int(self.reqs[rid, _PROMPT]) - int(self.reqs[rid, _PREFIX]) - int(self.reqs[rid, _EXTEND])
        require(left == 0, op, "rid", f"request {rid} has {left} prompt tokens left after its chunk: "
                "cache_unfinished_req, not cache_finished_req")
        self._release_lock(rid)
        if self.req_pages[rid].numel():
            self.pool.release_pages(torch.sort(self.req_pages[rid]).values)
        self.req_pages[rid] = torch.zeros(0, dtype=_I64, device=self.device)
        self.reqs[rid, _STAT], self.reqs[rid, _PAGES] = _FINISHED, 0

    def _release_lock(self, rid: int) -> None:
        self._dec_lock_ref(self.locked[rid])
        self.locked[rid] = ()

    # ------------------------------------------------------------ observation

    def snapshot(self) -> AdmissionSnapshot:
        """The decision state in the reference's terms and the SWA pages behind it."""
        parent, length, full = self.parent.tolist(), self.length.tolist(), self.full.tolist()
        swa, locks = self.swa.tolist(), self.lock_ref.tolist()
        nodes = tuple(Node(parent=parent[i], length=length[i], full_on_device=full[i], swa=_SWA[swa[i]],
                           lock_ref=locks[i]) for i in range(len(parent)))
        requests = []
        for rid, row in enumerate(self.reqs.tolist()):
            m = self.match[rid].tolist()
            match = None if m[0] < 0 else MatchResult(device_prefix_len=m[0], host_hit_length=m[1],
                                                      swa_host_hit_length=m[2])
            requests.append(Request(prompt_len=row[_PROMPT], max_new_tokens=row[_MAX_NEW], node=row[_NODE],
                                    status=_STATUS[row[_STAT]], match=match, locked=self.locked[rid],
                                    prefix_len=row[_PREFIX], extend_len=row[_EXTEND], swa_pages=row[_PAGES]))
        a = self.adder
        adder = None if a is None else PrefillAdder(rem_swa_token_offset=a.offset, rem_chunk_tokens=a.rem_chunk,
                                                    can_run=tuple(a.can_run), new_chunked_req=a.new_chunked)
        state = AdmissionState(config=self.config, available=self.available(), nodes=nodes,
                               requests=tuple(requests), adder=adder)
        node_pages = tuple(tuple(q for q in row if q >= 0) for row in self.node_pages.tolist())
        return AdmissionSnapshot(state=state, node_pages=node_pages,
                                 request_pages=tuple(tuple(t.tolist()) for t in self.req_pages),
                                 free_pages=tuple(self.pool.free_pages.tolist()))
