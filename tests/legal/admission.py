"""A legal admission system written from the contract (``AdmissionSystemUnderTest``), not from kvproof's runtime.

What it keeps (sglang_semantics.md §5, docs/contract.md "``AdmissionSystemUnderTest``"):

* the **SWA device pool** as a Python list of free page ids ``1..swa_pages`` (page 0 is
  reserved, §1.4), with a page-reuse policy;
* the **radix tree** as :class:`_Node` objects linked by parent references (``None``: a child of
  the root), each holding its SWA device pages; the protocol's node ids are positions in
  :attr:`LegalAdmission.nodes` (the setup's order; a load-back split appends the root-side rest);
* the **requests** as :class:`_Request` objects, rid = arrival position, each with the nodes its
  window lock holds (leaf first) and the SWA pages of its own tokens (out-of-window ones freed);
* the open **round** (:class:`_Round`): the prefill adder's SWA offset, the chunk tokens left,
  the admitted requests, the chunked one.

The scheduler's steps, as the contract states them (§5.1-§5.4; 0.5.23 for ``upstream_0523``):
a request arrives at its best-match node; a round matches it (the Full device prefix, the Full
host hit and the window walk's host tombstones at match time); ``add_one_req`` checks the
budget of the setup's policy outside the tree lock, takes the window lock, checks again, loads
back the window's host tombstones (``corrected``: only what the window needs, splitting the
node), cuts a chunk and reserves. ``upstream_0523`` orders it as 0.5.23 does: a pin on the
match's last device node (the deepest on the path with Full KV on device), the one check and the
chunk from the match-time lengths under it (no page of chunk: ``OTHER``, nothing changed), the
load-back only when the match found a host hit, then the window lock, then the pin dropped; its
``budget_state`` does not stop at a chunked request. ``prepare_for_extend`` allocates the
round's chunks (a continuation's pages start past its last, partly filled page);
``cache_unfinished_req`` (a chunk ran, prompt left) grows the prefix and frees the pages of the
request's own tokens wholly below ``done - W``, keeping its window lock; ``add_chunked_req``, first
in the next round, adds ``min(rest, rem_chunk, rem_swa_tokens - P)`` tokens (not page-cut) or
defers when that bound is not positive; ``cache_finished_req`` (prompt done) gives every page
back and releases the lock. Allocation evicts unlocked device SWA nodes, whole, in node order
(the contract's stand-in for LRU), when the free list is short; a short pool raises
``OutOfMemory`` having changed nothing.

Which page is handed out is the only freedom (docs/contract.md): :func:`fifo` (released pages at
the back of the free list), :func:`lifo` (at the front), :func:`randomized` (each at a seeded
random place, the initial list shuffled too). Pages are always taken from the front.
``REJECTS_MISUSE`` is declared (misuse raises ``InvalidOperation`` before anything changes);
``EXACT_PAGE_ORDER`` is not.

The operations compose the steps :meth:`LegalAdmission._fits`, :meth:`~LegalAdmission._lock`,
:meth:`~LegalAdmission._load_back`, :meth:`~LegalAdmission._chunk`, :meth:`~LegalAdmission._reserve` and
:meth:`~LegalAdmission._admit`.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from kvproof.reference.admission import (
    AddReqResult,
    AdmissionConfig,
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
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.registry import Component

from .swa_allocator import Policy

__all__ = ["LegalAdmission", "fifo", "lifo", "randomized"]

DEVICE, HOST, NONE = SwaValue.DEVICE, SwaValue.HOST, SwaValue.NONE
WAITING, ADMITTED, RUNNING, FINISHED, CHUNKED = (ReqStatus.WAITING, ReqStatus.ADMITTED, ReqStatus.RUNNING,
                                                 ReqStatus.FINISHED, ReqStatus.CHUNKED)


def _up(x: int, p: int) -> int:
    """``x`` rounded up to whole pages (``ceil_P``)."""
    return -(-x // p) * p


def _down(x: int, p: int) -> int:
    """``x`` rounded down to whole pages (``floor_P``)."""
    return x // p * p


# ---------------------------------------------------------------- the pieces of state


@dataclass(eq=False)
class _Node:
    """A radix node: its position in the node list, its parent object, length, where its KV lives, its pages."""

    index: int
    parent: _Node | None
    length: int  # tokens, whole pages
    full: bool  # Full KV on device
    swa: SwaValue
    lock_ref: int = 0
    pages: list[int] = field(default_factory=list)  # SWA device pages (exactly length / P when swa is DEVICE)

    def to_root(self) -> Iterator[_Node]:
        """This node, its parent, ... up to the child of the root."""
        node: _Node | None = self
        while node is not None:
            yield node
            node = node.parent


class _Match(NamedTuple):
    device_prefix: int  # Full KV on device along the path
    host_hit: int  # Full KV on host along the path (pre_27391: at least 1 when the window holds a tombstone)
    swa_host_hit: int  # whole host tombstones of the window walk (pre_27391: 0)


@dataclass(eq=False)
class _Request:
    prompt_len: int
    max_new_tokens: int
    node: _Node | None  # best match (None: nothing matched)
    status: ReqStatus = WAITING
    match: _Match | None = None
    locked: list[_Node] = field(default_factory=list)  # the window lock, leaf first
    prefix_len: int = 0  # matched (after load-back) plus the chunks already run and cached
    extend_len: int = 0  # the scheduled chunk (0 while chunked)
    pages: list[int] = field(default_factory=list)  # SWA pages of its own tokens, in token order, less those freed


@dataclass
class _Round:
    """The prefill adder of one scheduling round (§5.1)."""

    rem_chunk: int | None
    offset: int = 0  # rem_swa_token_offset: tokens reserved for the round's admitted requests
    admitted: list[int] = field(default_factory=list)  # can_run, in order
    chunked: int | None = None  # new_chunked_req


@dataclass
class _Walk:
    """What the window walk from a node finds (§5.4)."""

    nodes: list[_Node]  # visited (to be locked), leaf first
    covered: int  # tokens of device SWA and host tombstones visited
    stopped: bool  # reached a node with neither before covering the window
    host_tokens: int  # whole host tombstones (upstream's swa_host_hit_length and load-back)
    restores: list[tuple[_Node, int]]  # (tombstone, tokens the window needs of it: min(len, ceil_P(W - covered)))


class _FreePages:
    """The SWA pool's free list: taken from the front, released where the policy says."""

    def __init__(self, num_pages: int, policy: Policy, rng: random.Random) -> None:
        self.policy, self.rng = policy, rng
        self.pages = list(range(1, num_pages + 1))
        if policy is Policy.RANDOMIZED:
            rng.shuffle(self.pages)

    def __len__(self) -> int:
        return len(self.pages)

    def take(self, k: int) -> list[int]:
        taken, self.pages = self.pages[:k], self.pages[k:]
        return taken

    def release(self, pages: Sequence[int]) -> None:
        if self.policy is Policy.FIFO:
            self.pages.extend(pages)
        elif self.policy is Policy.LIFO:
            self.pages[:0] = pages
        else:
            for page in pages:
                self.pages.insert(self.rng.randrange(len(self.pages) + 1), page)


# ---------------------------------------------------------------- the system


class LegalAdmission:
    """Prefill admission over a HiCache tree and an SWA pool with a page-reuse policy (module docstring)."""

    capabilities = frozenset({Capability.REJECTS_MISUSE})
    components = frozenset({Component.ADMISSION})
    device = torch.device("cpu")

    def __init__(self, setup: AdmissionSetup, policy: Policy = Policy.FIFO, seed: int = 0) -> None:
        self.config: AdmissionConfig = setup.config
        c = self.config
        self.p, self.w, self.budget = c.page_size, c.sliding_window, c.policy
        self.version = f"legal-{policy.value}"
        self.free = _FreePages(c.swa_pages, policy, random.Random(seed))
        self.nodes: list[_Node] = []
        for spec in setup.nodes:  # listed parent first; the cached tree's device SWA takes pages in node order
            parent = self.nodes[spec.parent] if spec.parent >= 0 else None
            node = _Node(len(self.nodes), parent, spec.length, spec.full_on_device, spec.swa, spec.lock_ref)
            if spec.swa is DEVICE:
                node.pages = self.free.take(spec.length // self.p)
            self.nodes.append(node)
        self.requests: list[_Request] = []
        self.round: _Round | None = None

    # ------------------------------------------------------------ queries

    def _evictable_pages(self) -> int:
        return sum(len(n.pages) for n in self.nodes if n.swa is DEVICE and n.lock_ref == 0)

    def _rem_swa_tokens(self) -> int:
        """``swa_available + swa_evictable - rem_swa_token_offset`` in tokens (§5.1)."""
        offset = self.round.offset if self.round is not None else 0
        return (len(self.free) + self._evictable_pages()) * self.p - offset

    @staticmethod
    def _path_len(node: _Node | None) -> int:
        return 0 if node is None else sum(n.length for n in node.to_root())

    def _walk(self, node: _Node | None) -> _Walk:
        """From the best match towards the root while less than W is covered; a node with neither SWA stops it."""
        walk = _Walk(nodes=[], covered=0, stopped=False, host_tokens=0, restores=[])
        for n in node.to_root() if node is not None else ():
            if walk.covered >= self.w:
                break
            if n.swa is NONE:
                walk.stopped = True
                break
            walk.nodes.append(n)
            if n.swa is HOST:
                walk.host_tokens += n.length
                walk.restores.append((n, min(n.length, _up(self.w - walk.covered, self.p))))
            walk.covered += n.length
        return walk

    # ------------------------------------------------------------ argument checks (InvalidOperation, nothing changed)

    def _node(self, op: str, node: int) -> _Node | None:
        if node == -1:
            return None
        if not 0 <= node < len(self.nodes):
            raise InvalidOperation(op, "node", f"node {node} out of range [0, {len(self.nodes)})")
        return self.nodes[node]

    def _request(self, op: str, rid: int, status: ReqStatus | None = None) -> _Request:
        if not 0 <= rid < len(self.requests):
            raise InvalidOperation(op, "rid", f"request {rid} out of range [0, {len(self.requests)})")
        req = self.requests[rid]
        if status is not None and req.status is not status:
            raise InvalidOperation(op, "rid", f"request {rid} is {req.status.value}, not {status.value}")
        return req

    def _open_round(self, op: str) -> _Round:
        if self.round is None:
            raise InvalidOperation(op, "state", "no round is open (get_new_batch_prefill first)")
        return self.round

    # ------------------------------------------------------------ pool and tree

    def _tombstone(self, node: _Node) -> None:
        """Eviction of one node's device SWA: its pages back, a host copy kept (write-through)."""
        self.free.release(node.pages)
        node.pages, node.swa = [], HOST

    def evict(self, num_pages: int) -> None:
        """Tombstone unlocked device SWA nodes, whole, in node order, until ``num_pages`` are freed (best effort)."""
        if num_pages < 0:
            raise InvalidOperation("evict", "num_pages", f"must be >= 0, got {num_pages}")
        freed = 0
        for node in self.nodes:
            if freed >= num_pages:
                break
            if node.swa is DEVICE and node.lock_ref == 0:
                freed += len(node.pages)
                self._tombstone(node)

    def _alloc(self, op: str, pages: int, rid: int | None) -> list[int]:
        """``pages`` free pages, evicting first when the free list is short; short even so: ``OutOfMemory``."""
        if pages > len(self.free):
            room = len(self.free) + self._evictable_pages()
            if pages > room:
                raise OutOfMemory(op, "swa", pages, room, request=rid)
            self.evict(pages - len(self.free))
        return self.free.take(pages)

    def _lock(self, node: _Node | None) -> list[_Node]:
        """The window lock (§1.7): every node the walk visits; its device SWA is protected from eviction."""
        held = self._walk(node).nodes
        for n in held:
            n.lock_ref += 1
        return held

    @staticmethod
    def _unlock(held: Sequence[_Node]) -> None:
        for n in held:
            n.lock_ref -= 1

    def _split(self, node: _Node, keep: int) -> None:
        """``node`` keeps its leaf-side ``keep`` tokens; the root-side rest becomes a new node (appended) above it."""
        rest = _Node(len(self.nodes), node.parent, node.length - keep, node.full, node.swa)
        self.nodes.append(rest)
        node.parent, node.length = rest, keep

    def _load_back(self, req: _Request, rid: int) -> int:
        """Restore the window's host tombstones onto fresh SWA pages (the Full prefix comes back too); the pages."""
        walk = self._walk(req.node)
        capped = self.budget is AdmissionPolicy.CORRECTED
        restores = [(n, tokens if capped else n.length) for n, tokens in walk.restores]
        pages = self._alloc("init_load_back", sum(t for _, t in restores) // self.p, rid)
        for n in req.node.to_root() if req.node is not None else ():
            n.full = True
        for n, tokens in restores:
            if tokens < n.length:
                self._split(n, tokens)  # the rest stays a host tombstone, outside the window
            n.swa, n.pages, pages = DEVICE, pages[:tokens // self.p], pages[tokens // self.p:]
        return sum(t for _, t in restores) // self.p

    # ------------------------------------------------------------ budgets (§5.2; upstream_0523 §1.2)

    def _budget_0513(self, extend: int, host: int, chunk: int | None) -> int:
        """``max(min(e, C), W) + P``, plus ``ceil_P(h)`` for a host term ``h > 0``."""
        alloc = extend if chunk is None else min(extend, chunk)
        return max(alloc, self.w) + self.p + (_up(host, self.p) if host > 0 else 0)

    def _estimate(self, extend: int, max_new: int, limit: int | None = None, host: int = 0) -> int:
        """0.5.23's estimate: allocated tail beyond W + capped decode headroom + a page (+ ``ceil_P(h)``)."""
        alloc = extend if limit is None else min(extend, limit)
        tokens = max(alloc - self.w, 0) + min(extend + max_new, self.w) + self.p
        return tokens + (_up(host, self.p) if host > 0 else 0)

    def _fits(self, req: _Request, match: _Match, chunk: int | None) -> tuple[bool, int | None]:
        """The policy's check now: (admit, the chunk limit the request's extend is cut to)."""
        rem = self._rem_swa_tokens()
        extend = req.prompt_len - self._path_len(req.node)  # after load-back: the Full host hit is not computed
        if self.budget is AdmissionPolicy.UPSTREAM_0523:  # the match-time lengths (the match is fresh)
            extend = req.prompt_len - match.device_prefix - match.host_hit
            needed = self._estimate(_up(extend, self.p), req.max_new_tokens, chunk, match.swa_host_hit)
            if needed < rem:
                return True, chunk
            if needed >= self.config.size_swa:  # never fits: a chunk of what is left (#31681, #32700)
                cap = _down(rem - self._estimate(0, req.max_new_tokens, host=match.swa_host_hit), self.p)
                if chunk is not None and cap > 0:
                    return True, min(chunk, cap)
            return False, None
        if self.budget is AdmissionPolicy.CORRECTED:  # the window-capped restore, from the tree as it is now
            host = sum(tokens for _, tokens in self._walk(req.node).restores)
        else:  # the match-time values (pre_27391's SWA term is 0)
            extend, host = req.prompt_len - match.device_prefix, match.swa_host_hit
        return self._budget_0513(extend, host, chunk) < rem, chunk

    def _chunk(self, extend: int, max_new: int, limit: int | None) -> tuple[int, int, int, bool] | None:
        """(extend, input tokens, decode estimate, chunked) of what is admitted; None: not one page fits.

        The whole rest when it fits the limit; else whole pages of it, a chunk that decodes nothing yet.
        """
        if limit is None or _up(extend, self.p) <= limit:
            return extend, _up(extend, self.p), max_new, False
        cut = _down(limit, self.p)
        return (cut, cut, 0, True) if cut > 0 else None

    def _reserve(self, rnd: _Round, input_tokens: int, max_new: int) -> None:
        """``update_prefill_budget``: the SWA reservation without the host term, then the chunk tokens."""
        e = _up(input_tokens, self.p)
        if self.budget is AdmissionPolicy.UPSTREAM_0523:
            rnd.offset += self._estimate(e, max_new, rnd.rem_chunk)
        else:
            rnd.offset += self._budget_0513(e, 0, rnd.rem_chunk)
        if rnd.rem_chunk is not None:
            rnd.rem_chunk -= e

    def _budget_state(self, rnd: _Round) -> AddReqResult:
        if self._rem_swa_tokens() <= 0:
            return AddReqResult.NO_TOKEN
        # 0.5.23 does not stop at a chunked request (its next add finds no page of chunk left)
        stop_at_chunk = rnd.chunked is not None and self.budget is not AdmissionPolicy.UPSTREAM_0523
        if stop_at_chunk or (rnd.rem_chunk is not None and rnd.rem_chunk <= 0):
            return AddReqResult.OTHER
        return AddReqResult.CONTINUE

    # ------------------------------------------------------------ the protocol

    def arrive(self, prompt_len: int, max_new_tokens: int, node: int) -> int:
        op = "arrive"
        if max_new_tokens < 0:
            raise InvalidOperation(op, "max_new_tokens", f"must be >= 0, got {max_new_tokens}")
        best = self._node(op, node)
        if self._path_len(best) >= prompt_len:
            raise InvalidOperation(op, "prompt_len", f"{prompt_len} tokens, {self._path_len(best)} matched")
        if self._walk(best).stopped:
            raise InvalidOperation(op, "node", f"the window of node {node} reaches a node with neither SWA")
        self.requests.append(_Request(prompt_len, max_new_tokens, best))
        return len(self.requests) - 1

    def get_new_batch_prefill(self) -> None:
        if self.round is not None:
            raise InvalidOperation("get_new_batch_prefill", "state", "a round is already open")
        self.round = _Round(rem_chunk=self.config.chunk_size)

    def match_prefix_for_req(self, rid: int) -> None:
        req = self._request("match_prefix_for_req", rid, WAITING)
        path = list(req.node.to_root()) if req.node is not None else []
        device = sum(n.length for n in path if n.full)
        host = sum(n.length for n in path if not n.full)
        swa_host = self._walk(req.node).host_tokens
        if self.budget is AdmissionPolicy.PRE_27391:  # no SWA field: a tombstone only marks a host hit (§5.5)
            req.match = _Match(device, max(host, 1) if swa_host else host, 0)
        else:
            req.match = _Match(device, host, swa_host)

    def add_one_req(self, rid: int) -> AddReqResult:
        op = "add_one_req"
        rnd = self._open_round(op)
        req = self._request(op, rid, WAITING)
        if req.match is None:
            raise InvalidOperation(op, "rid", f"request {rid} has no match (match_prefix_for_req first)")
        chunk = rnd.rem_chunk
        if self.budget is AdmissionPolicy.UPSTREAM_0523:
            return self._add_one_req_0523(rnd, rid, req, req.match)
        if not self._fits(req, req.match, chunk)[0]:
            return AddReqResult.NO_TOKEN  # the check outside the tree lock
        held = self._lock(req.node)
        ok, limit = self._fits(req, req.match, chunk)  # inside the lock: its own window is protected now
        if not ok:
            self._unlock(held)
            return AddReqResult.NO_TOKEN
        req.locked = held
        try:
            self._load_back(req, rid)
        except OutOfMemory:
            self._unlock(held)
            req.locked = []
            raise
        prefix = self._path_len(req.node)
        cut = self._chunk(req.prompt_len - prefix, req.max_new_tokens, limit)
        if cut is None:  # not one page: the lock goes, what was loaded back stays (evictable)
            self._unlock(held)
            req.locked = []
            return AddReqResult.OTHER
        return self._admit(rnd, rid, req, prefix, cut)

    def _add_one_req_0523(self, rnd: _Round, rid: int, req: _Request, match: _Match) -> AddReqResult:
        """0.5.23's order: a pin on the match's last device node; under it the check and the chunk from the match-time
        lengths (``OTHER`` changes nothing), load-back only for a match with a host hit, the window lock, the pin
        dropped."""
        last = req.node
        while last is not None and not last.full:  # the deepest node on the path whose Full KV is on device
            last = last.parent
        pin = self._lock(last)
        ok, limit = self._fits(req, match, rnd.rem_chunk)
        prefix = match.device_prefix + match.host_hit
        cut = self._chunk(req.prompt_len - prefix, req.max_new_tokens, limit) if ok else None
        if cut is None:
            self._unlock(pin)
            return AddReqResult.NO_TOKEN if not ok else AddReqResult.OTHER
        if match.host_hit > 0 or match.swa_host_hit > 0:
            try:
                self._load_back(req, rid)
            except OutOfMemory:
                self._unlock(pin)
                raise
        req.locked = self._lock(req.node)
        self._unlock(pin)
        return self._admit(rnd, rid, req, prefix, cut)

    def _admit(self, rnd: _Round, rid: int, req: _Request, prefix: int, cut: tuple[int, int, int, bool]
               ) -> AddReqResult:
        """The commit: the reservation, the request in the round holding its lock."""
        extend, input_tokens, max_new, chunked = cut
        self._reserve(rnd, input_tokens, max_new)
        rnd.admitted.append(rid)
        if chunked:
            rnd.chunked = rid
        req.status, req.prefix_len, req.extend_len = ADMITTED, prefix, extend
        return self._budget_state(rnd)

    def _own_len(self, req: _Request) -> int:
        """Tokens the request computed itself beyond its matched path (0 before its first chunk ran)."""
        return 0 if req.status is WAITING else req.prefix_len - self._path_len(req.node)

    def add_chunked_req(self, rid: int) -> ChunkedResult:
        """The next chunk of a chunked request: ``min(rem_chunk, rem_swa_tokens - P)`` tokens at most, not page-cut."""
        op = "add_chunked_req"
        rnd = self._open_round(op)
        req = self._request(op, rid, CHUNKED)
        avail = self._rem_swa_tokens() - self.p
        if rnd.rem_chunk is not None:
            avail = min(avail, rnd.rem_chunk)
        if avail <= 0:
            return ChunkedResult.DEFERRED
        rest = req.prompt_len - req.prefix_len
        size = min(rest, avail)
        self._reserve(rnd, _up(size, self.p), req.max_new_tokens if rest <= avail else 0)
        rnd.admitted.append(rid)
        req.status, req.extend_len = ADMITTED, size
        return ChunkedResult.TRUNCATED if rest > avail else ChunkedResult.LAST

    def init_load_back(self, rid: int) -> int:
        req = self._request("init_load_back", rid)
        if not req.locked and req.node is not None:
            raise InvalidOperation("init_load_back", "rid", f"request {rid} does not hold its window lock")
        return self._load_back(req, rid)

    def prepare_for_extend(self) -> None:
        rnd = self._open_round("prepare_for_extend")
        need = {}
        for rid in rnd.admitted:  # a chunk fills the request's last, partly filled page first
            req = self.requests[rid]
            done = self._own_len(req)
            need[rid] = -(-(done + req.extend_len) // self.p) - -(-done // self.p)
        pages = self._alloc("prepare_for_extend", sum(need.values()), rnd.admitted[0] if rnd.admitted else None)
        for rid, k in need.items():
            req, mine = self.requests[rid], pages[:k]
            req.status, pages = RUNNING, pages[k:]
            req.pages.extend(mine)
        self.round = None

    def cache_unfinished_req(self, rid: int) -> None:
        """A chunk ran, prompt is left: the prefix grows, the pages of own tokens wholly below ``done - W`` go back."""
        op = "cache_unfinished_req"
        req = self._request(op, rid, RUNNING)
        if req.prefix_len + req.extend_len >= req.prompt_len:
            raise InvalidOperation(op, "rid", f"request {rid} computed its whole prompt: cache_finished_req")
        if self.round is not None:
            raise InvalidOperation(op, "state", "a round is open (the chunk's forward runs between rounds)")
        done = self._own_len(req) + req.extend_len
        kept = -(-done // self.p) - max(0, done - self.w) // self.p  # the tail from a page boundary covering W
        self.free.release(req.pages[:len(req.pages) - kept])
        req.pages = req.pages[len(req.pages) - kept:]
        req.status, req.prefix_len, req.extend_len = CHUNKED, req.prefix_len + req.extend_len, 0

    def cache_finished_req(self, rid: int) -> None:
        req = self._request("cache_finished_req", rid, RUNNING)
        if req.prefix_len + req.extend_len < req.prompt_len:
            left = req.prompt_len - req.prefix_len - req.extend_len
            raise InvalidOperation("cache_finished_req", "rid", f"request {rid} has {left} prompt tokens left: "
                                                                "cache_unfinished_req")
        self._unlock(req.locked)
        self.free.release(req.pages)
        req.status, req.locked, req.pages = FINISHED, [], []

    # ------------------------------------------------------------ observation

    def snapshot(self) -> AdmissionSnapshot:
        """The decision state in the reference's terms, and the SWA pages behind it."""
        def index(node: _Node | None) -> int:
            return -1 if node is None else node.index

        nodes = tuple(Node(parent=index(n.parent), length=n.length, full_on_device=n.full, swa=n.swa,
                           lock_ref=n.lock_ref) for n in self.nodes)
        requests = tuple(
            Request(prompt_len=r.prompt_len, max_new_tokens=r.max_new_tokens, node=index(r.node), status=r.status,
                    match=None if r.match is None else MatchResult(device_prefix_len=r.match.device_prefix,
                                                                   host_hit_length=r.match.host_hit,
                                                                   swa_host_hit_length=r.match.swa_host_hit),
                    locked=tuple(n.index for n in r.locked), prefix_len=r.prefix_len, extend_len=r.extend_len,
                    swa_pages=len(r.pages))
            for r in self.requests)
        rnd = self.round
        adder = None if rnd is None else PrefillAdder(rem_swa_token_offset=rnd.offset, rem_chunk_tokens=rnd.rem_chunk,
                                                      can_run=tuple(rnd.admitted), new_chunked_req=rnd.chunked)
        state = AdmissionState(config=self.config, available=len(self.free), nodes=nodes, requests=requests,
                               adder=adder)
        return AdmissionSnapshot(state=state, node_pages=tuple(tuple(n.pages) for n in self.nodes),
                                 request_pages=tuple(tuple(r.pages) for r in self.requests),
                                 free_pages=tuple(self.free.pages))


def fifo(setup: AdmissionSetup) -> LegalAdmission:
    return LegalAdmission(setup, Policy.FIFO)


def lifo(setup: AdmissionSetup) -> LegalAdmission:
    return LegalAdmission(setup, Policy.LIFO)


def randomized(setup: AdmissionSetup) -> LegalAdmission:
    return LegalAdmission(setup, Policy.RANDOMIZED, seed=zlib.crc32(setup.label().encode()))
