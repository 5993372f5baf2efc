"""Stateful simulation of a prefill scheduler over a HiCache tree (component ``admission``, sglang_semantics.md §5).

Each config is an :class:`~kvproof.reference.admission.AdmissionSetup`: an SWA pool (``W``,
``P``, pages, chunk size) and the tree the server has cached, with prompts sharing prefixes,
device SWA nodes, host tombstones shorter than, equal to and much longer than the window,
nodes with neither (a window walk stops there), and a chunk size that is not a page multiple (a
continuation then ends inside a page). The run option ``--budget`` picks the
prefill adder's budget (``pre_27391``, ``upstream_27391``, ``upstream_0523``, ``corrected``).

The machine plays the scheduler: requests arrive at a best-match node with a prompt that
extends it; a round (``get_new_batch_prefill``) matches the waiting requests in arrival
order (``match_prefix_for_req``) and adds them (``add_one_req``: check, lock, re-check,
load-back, chunk, reservation) until one is refused or the adder says stop; the round's
batch allocates its chunks (``prepare_for_extend``); a chunk that leaves prompt is cached before
the next round opens (``cache_unfinished_req``: the prefix grows, out-of-window pages are freed)
and continued first thing in that round, before any ``add_one_req`` (``add_chunked_req``: its next
chunk, or deferred), as the scheduler does (§5.3); requests whose prompt is done finish
(``cache_finished_req``); eviction runs at any time (``evict``, also between a match and
the add, which makes upstream's match-time value stale, §5.7). Every operation runs on the
reference and on the implementation: same outcome, same verdict, same state.

After every step:

* **A1**: no admitted request ran out of memory: a load-back inside ``add_one_req`` or the
  round's ``prepare_for_extend`` raising ``OutOfMemory`` is a verdict (S8 with
  ``pre_27391``), even though both sides agree;
* accounting ``available + evictable + locked == total`` and balanced lock refs on the
  reference (``check_admission``), and on the implementation the SWA pages behind its
  state: each device node holds its pages, each running request its chunk, and nodes,
  requests and the free list partition the pool (``check_admission_snapshot``);
* the implementation's state equals the reference's (tree, lock refs, requests, the adder:
  the exact admit / refuse decision);
* **liveness**: a request that fits the empty pool (``fits_empty_pool``) and is refused in
  :data:`STARVATION_BOUND` rounds in which the pool was idle (nothing admitted, running,
  locked or reserved) is starved -- a refusal changes nothing, so it would be refused
  forever (S9 with ``upstream_27391``). A chunked request holds pages and its window lock, so
  the pool is not idle while one waits for its next chunk: its own deferral is the check. A
  continuation deferred in :data:`STARVATION_BOUND` rounds in which nothing else held SWA
  (every other request waiting or finished, nothing reserved before it) is deadlocked: a
  deferral changes nothing, eviction cannot touch what it holds and nothing else will
  finish, so it never runs and never releases its pages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvproof.conformance import strategies as st
from kvproof.conformance.check import Suite
from kvproof.conformance.findings import Evidence, follows
from kvproof.conformance.lockstep import Lockstep, MisuseCall, check_after_each_step, misuse, operation, scenario
from kvproof.reference import admission as ad
from kvproof.reference.admission import AdmissionPolicy, AdmissionSetup, AdmissionSnapshot, Node, ReqStatus
from kvproof.reference.contract import AdmissionSystemUnderTest
from kvproof.reference.errors import InvariantViolation
from kvproof.reference.registry import Component

__all__ = ["ADMISSION_CONFIGS", "STARVATION_BOUND", "SUITE", "AdmissionMachine"]

#: Idle rounds a request that fits the empty pool may be refused in before it counts as starved.
STARVATION_BOUND = 2
#: Unfinished requests at most (arrivals wait for completions; with every request finished they are enabled again).
MAX_REQUESTS = 10

DEVICE, HOST, NONE = ad.SwaValue.DEVICE, ad.SwaValue.HOST, ad.SwaValue.NONE


def _node(parent: int, length: int, swa: ad.SwaValue, *, full: bool = True) -> Node:
    return Node(parent=parent, length=length, full_on_device=full, swa=swa)


def _chunked_prefill(setup: AdmissionSetup) -> bool:
    """Chunked prefill is on: a prompt can be left after its round, so chunks are cached and continued (without it,
    ``add_chunked_req`` and ``cache_unfinished_req`` have nothing to act on)."""
    return setup.config.chunk_size is not None


def _config(p: int, w: int, pages: int, chunk: int | None) -> ad.AdmissionConfig:
    return ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=pages, chunk_size=chunk)


#: Small pools on purpose (budgets meet the pool's edge); the default policy is ``corrected``.
ADMISSION_CONFIGS: tuple[AdmissionSetup, ...] = (
    # a shared device prefix; tombstones shorter than and equal to W; a Full host hit under a window with neither
    AdmissionSetup(name="shared", config=_config(2, 4, 10, 6), nodes=(
        _node(-1, 4, DEVICE), _node(0, 2, HOST), _node(1, 4, DEVICE), _node(0, 4, HOST),
        _node(-1, 6, NONE, full=False), _node(4, 4, HOST, full=False))),
    # S9's shape: a host tombstone of 12 pages over a pool of 8 (W = 2 pages)
    AdmissionSetup(name="long_tombstone", config=_config(2, 4, 8, 8), nodes=(
        _node(-1, 24, HOST), _node(-1, 2, DEVICE))),
    # W not a page multiple (the capped restore rounds up): tombstones of 1 and 3 pages, a 2-page device prefix
    AdmissionSetup(name="page_edge", config=_config(4, 6, 8, 8), nodes=(
        _node(-1, 8, DEVICE), _node(0, 4, HOST), _node(1, 4, DEVICE), _node(-1, 12, HOST), _node(3, 4, DEVICE))),
    # a Full host prefix under a device SWA node: the best-match window (a host tombstone) lies below the last device
    # node's, which 0.5.23's selection pin protects (found by driving SGLang's real PrefillAdder, F5)
    AdmissionSetup(name="host_prefix", config=_config(2, 4, 8, 6), nodes=(
        _node(-1, 4, DEVICE), _node(0, 2, HOST, full=False), _node(1, 4, HOST, full=False), _node(-1, 4, DEVICE))),
    # a chunk of 2.5 pages: continuations end inside a page (their pages start past the partly filled one); W not a
    # page multiple either, a device node under a tombstone the capped restore cuts
    AdmissionSetup(name="unaligned_chunk", config=_config(4, 6, 11, 10), nodes=(
        _node(-1, 8, DEVICE), _node(0, 8, HOST), _node(1, 4, DEVICE), _node(-1, 4, HOST))),
    # P = 1, chunked prefill off: tombstones of W and of 8 W
    AdmissionSetup(name="no_chunk", config=_config(1, 3, 12, None), nodes=(
        _node(-1, 2, DEVICE), _node(0, 3, HOST), _node(1, 1, DEVICE), _node(-1, 24, HOST), _node(3, 1, HOST))),
)


class AdmissionMachine(Lockstep[AdmissionSetup, AdmissionSystemUnderTest]):
    """The scheduler's calls on the reference and on the implementation, in lockstep."""

    component = Component.ADMISSION
    snapshot_type = AdmissionSnapshot

    @classmethod
    def effective_config(cls, config: AdmissionSetup, options: dict[str, Any]) -> AdmissionSetup:
        """The run option ``policy`` (``--budget``): both sides are built under that policy."""
        policy = options.get("policy")
        return config if policy is None else config.with_policy(policy)

    def __init__(self, binding: Any) -> None:
        binding = dataclasses.replace(binding, config=self.effective_config(binding.config, binding.options))
        super().__init__(binding)
        self.ref = ad.initial_state(self.config.config, self.config.nodes)
        c = self.config.config
        self.p, self.w, self.total = c.page_size, c.sliding_window, c.swa_pages
        self.queue: list[int] = []  # the open round's waiting requests, in arrival order, not yet added
        self.matched: set[int] = set()  # matched in the open round
        self.stopped = False  # the adder said stop (or refused the head): no more add_one_req this round
        self.continuing: list[int] = []  # the open round's chunked requests, continued before any add_one_req
        self.idle_refusals: dict[int, int] = {}
        self.set_aside: set[int] = set()  # starved requests a run looks past (--accept F4/F5): never offered again
        self.idle_deferrals: dict[int, int] = {}
        # 0.5.23's scheduler matches each request right before its add (get_new_batch_prefill's loop); the seed-era
        # one matched the whole queue first, so an earlier load-back or an eviction could make a match stale (§5.7)
        self.match_each = c.policy is AdmissionPolicy.UPSTREAM_0523

    # ------------------------------------------------------------ structural coverage

    @classmethod
    def structure(cls, config: AdmissionSetup, na: tuple[str, ...] = ()) -> dict[str, int]:
        """Several requests waiting, admitted in one round and running at once; a refusal and two continuations of
        one request (where chunked prefill is on); the SWA pool exhausted; evictions and rounds in one example.
        Without chunked prefill a request's prompt is never left after its round, so ``cache_finished_req``'s
        ``prompt_left`` misuse cannot be staged there (maximum 0).

        ``add_chunked_req deferred`` is measured (the reports show it) but not a target: no default config reached
        it in 25,000 steps each (the continuation goes first in its round, and every policy's reservations leave
        it room there); a deferral is driven directly by tests/spec/test_drift_admission.py and
        tests/gpu_runtime/test_admission.py."""
        chunked = _chunked_prefill(config)
        return {"requests waiting at once": 8, "requests admitted in one round": 2, "requests running at once": 5,
                "add_one_req refused": 1, "add_chunked_req per request": 2 if chunked else 0,
                "misuse cache_finished_req:prompt_left": 1 if chunked else 0,
                "swa pool exhausted": 1, "evict per example": 4, "get_new_batch_prefill per example": 6}

    def measure(self) -> dict[str, int]:
        statuses = [r.status for r in self.ref.requests]
        return {"requests waiting at once": statuses.count(ReqStatus.WAITING),
                "requests running at once": statuses.count(ReqStatus.RUNNING),
                "swa pool exhausted": int(self.ref.available == 0)}

    # ------------------------------------------------------------ helpers

    def _round_open(self) -> bool:
        return self.ref.adder is not None

    def _waiting(self) -> list[int]:
        return [rid for rid, r in enumerate(self.ref.requests)
                if r.status is ReqStatus.WAITING and rid not in self.set_aside]

    def _unfinished(self) -> int:
        return sum(r.status is not ReqStatus.FINISHED for r in self.ref.requests)

    def _running(self) -> list[int]:
        return [rid for rid, r in enumerate(self.ref.requests) if r.status is ReqStatus.RUNNING]

    def _prompt_done(self, rid: int) -> bool:
        r = self.ref.requests[rid]
        return r.prefix_len + r.extend_len == r.prompt_len

    def _finishing(self) -> list[int]:
        """Running requests whose prompt is done: they may finish."""
        return [rid for rid in self._running() if self._prompt_done(rid)]

    def _uncached(self) -> list[int]:
        """Running requests with prompt left: their chunk ran, cache_unfinished_req comes before the next round."""
        return [rid for rid in self._running() if not self._prompt_done(rid)]

    def _chunked(self) -> list[int]:
        return [rid for rid, r in enumerate(self.ref.requests) if r.status is ReqStatus.CHUNKED]

    def _boundaries(self) -> list[int]:
        """Nodes a request can match up to: the root (-1) and every node whose window walk does not stop."""
        return [-1] + [i for i in range(len(self.ref.nodes)) if not ad.window_walk(self.ref, i).stopped]

    def _idle(self) -> bool:
        """Nothing admitted, running, locked or reserved: the pool could serve any request that fits it empty."""
        adder = self.ref.adder
        return (adder is not None and adder.rem_swa_token_offset == 0 and not adder.can_run
                and all(r.status in (ReqStatus.WAITING, ReqStatus.FINISHED) for r in self.ref.requests)
                and all(n.lock_ref == 0 for n in self.ref.nodes))

    def _alone(self, rid: int) -> bool:
        """The open round reserved nothing yet and every request but ``rid`` is waiting or finished: nothing else holds
        SWA (only ``rid``'s pages and window lock) and nothing else will release any."""
        adder = self.ref.adder
        return (adder is not None and adder.rem_swa_token_offset == 0 and not adder.can_run
                and all(r.status in (ReqStatus.WAITING, ReqStatus.FINISHED)
                        for i, r in enumerate(self.ref.requests) if i != rid))

    def _head(self) -> int | None:
        """The next request add_one_req takes; none while continuations are pending or once the adder stopped."""
        return self.queue[0] if self.queue and not self.stopped and not self.continuing else None

    def _why_refused(self, rid: int) -> tuple[str, str]:
        """What makes a request that fits the empty pool too big for the budget, in the state it is refused in: a
        short code (the evidence of a liveness verdict) and its explanation."""
        r, c = self.ref.requests[rid], self.ref.config
        walk = ad.window_walk(self.ref, r.node)
        if walk.host_tokens > walk.capped_tokens:
            return "tombstones_charged_whole", (
                f"S9: the budget charges the window's host tombstones whole, {walk.host_tokens} tokens, where "
                f"load-back within the window needs {walk.capped_tokens}")
        last = ad.last_device_node(self.ref, r.node)
        pinned = ad.window_walk(self.ref, last).unlocked_device_pages - walk.unlocked_device_pages
        if c.policy is AdmissionPolicy.UPSTREAM_0523 and pinned > 0:
            return "selection_pin", (f"the selection pin of node {last}, the match's last device node, protects "
                                     f"{pinned} device SWA page(s) outside the request's window")
        return "other", "S9"

    def _describe(self, rid: int) -> str:
        r = self.ref.requests[rid]
        walk = ad.window_walk(self.ref, r.node)
        return (f"request {rid} (prompt {r.prompt_len}, max_new_tokens {r.max_new_tokens}, node {r.node}: "
                f"{ad.path_len(self.ref, r.node)} tokens matched, window walk {walk.covered} tokens, "
                f"{walk.host_tokens} of them host tombstones)")

    # ------------------------------------------------------------ rules

    @scenario(when=lambda self: self._unfinished() < MAX_REQUESTS, data=st.data())
    def arrive(self, data: Any) -> None:
        """1-2 requests arrive, each extending a cached prefix (prompt lengths biased to page, window, chunk edges)."""
        c = self.config.config
        for _ in range(data.draw(st.integers(1, 2), label="arrivals")):
            node = data.draw(st.sampled_from(self._boundaries()), label="node")
            p, w, chunk = self.p, self.w, c.chunk_size or 2 * self.w
            edges = sorted({x for x in (1, p - 1, p, p + 1, w - 1, w, w + 1, chunk - 1, chunk, chunk + 1, 2 * chunk)
                            if x >= 1})
            extra = data.draw(st.one_of(st.sampled_from(edges), st.integers(1, c.size_swa + w)), label="extend")
            prompt = ad.path_len(self.ref, node) + extra
            max_new = data.draw(st.integers(0, 2 * w), label="max_new_tokens")
            self._arrive(prompt, max_new, node)

    def _arrive(self, prompt: int, max_new: int, node: int) -> None:
        out = self.call("arrive", f"prompt {prompt}, max_new_tokens {max_new}, node {node}",
                        lambda: ad.arrive(self.ref, prompt, max_new, node),
                        lambda: self.impl.arrive(prompt, max_new, node))
        if out:
            (self.ref, rid), got = out
            if got != rid:
                self.fail(f"arrive returned request id {got}, the reference {rid}")

    @operation(when=lambda self: not self._round_open() and (self._waiting() or self._chunked())
               and not self._uncached())
    def get_new_batch_prefill(self) -> None:
        """A round starts (once every chunk that ran is cached): the prefill adder is built; the chunked requests are
        continued first, then the waiting requests are its queue, in arrival order."""
        out = self.call("get_new_batch_prefill", "", lambda: (ad.get_new_batch_prefill(self.ref), None),
                        self.impl.get_new_batch_prefill)
        if out:
            self.ref = out[0][0]
            self.count("get_new_batch_prefill per example")
            self.queue, self.matched, self.stopped = self._waiting(), set(), False
            self.continuing = self._chunked()

    @operation(when=lambda self: self._round_open() and self.continuing, on=_chunked_prefill)
    def add_chunked_req(self) -> None:
        """A chunked request's next chunk, first thing in the round (§5.3): ``min(rem_chunk, rem_swa_tokens - P)``
        tokens, or deferred when that is not positive (liveness: a deferral with nothing else holding SWA is a
        deadlock). The adder stops once its budget_state is OTHER, as the scheduler's loop does."""
        rid = self.continuing.pop(0)
        alone = self._alone(rid)
        rem = ad.rem_swa_tokens(self.ref)
        r = self.ref.requests[rid]
        described = (f"request {rid} (prompt {r.prompt_len}, {r.prompt_len - r.prefix_len} left, "
                     f"{ad.own_len(self.ref, rid)} computed, holding {r.swa_pages} SWA pages and a window lock on "
                     f"{len(r.locked)} nodes)")
        out = self.call("add_chunked_req", described, lambda: ad.add_chunked_req(self.ref, rid),
                        lambda: self.impl.add_chunked_req(rid))
        if out is None:  # both raised OutOfMemory: a continuation only reserves, it allocates nothing
            self.fail(f"add_chunked_req raised OutOfMemory for {described} on both sides; it allocates nothing (the "
                      "round's prepare_for_extend does)")
        (self.ref, want), got = out
        mine, theirs = self.snapshot().state.requests[rid], self.ref.requests[rid]
        if (mine.status, mine.extend_len) != (theirs.status, theirs.extend_len):
            def chunk(r: ad.Request) -> str:
                return "deferred it" if r.status is ReqStatus.CHUNKED else f"added a chunk of {r.extend_len} tokens"
            self.fail(f"add_chunked_req {chunk(mine)} for {described} with rem_swa_tokens {rem}; the reference "
                      f"{chunk(theirs)} (available_chunk_tokens = min(rem_chunk, rem_swa_tokens - P) differs)")
        if got != want:
            self.fail(f"add_chunked_req returned {got} for {described} with rem_swa_tokens {rem}, the reference "
                      f"{want}")
        self.trace.outcome(f" -> {want.value}")
        self.count("add_chunked_req per request", rid)
        self.note("add_chunked_req deferred", int(want is ad.ChunkedResult.DEFERRED))
        if ad.budget_state(self.ref) is ad.AddReqResult.OTHER:
            self.stopped = True
        if want is ad.ChunkedResult.DEFERRED and alone:
            self.idle_deferrals[rid] = self.idle_deferrals.get(rid, 0) + 1
            if self.idle_deferrals[rid] >= STARVATION_BOUND:
                c = self.ref.config
                self.fail(f"liveness violated: the continuation of {described} was deferred in "
                          f"{self.idle_deferrals[rid]} rounds in which nothing else held SWA (rem_swa_tokens {rem}: "
                          f"available_chunk_tokens = min(rem_chunk, {rem} - {c.page_size}) <= 0); a deferral changes "
                          f"nothing, eviction cannot free what it holds and no other request will finish, so it never "
                          f"runs and never releases its pages (deadlock, policy {c.policy.value})")

    def _to_match(self) -> list[int]:
        if self.match_each:
            head = self._head()
            return [head] if head is not None and head not in self.matched else []
        return [r for r in self.queue if r not in self.matched]

    @operation(when=lambda self: self._round_open() and self._to_match())
    def match_prefix_for_req(self) -> None:
        """The round's queue is matched, request by request (the match-time snapshots, §5.4), before the adds: an
        earlier request's load-back (which evicts) or an eviction can change a later request's window meanwhile.
        Under ``upstream_0523`` each request is matched right before its add, as 0.5.23's scheduler does."""
        for rid in self._to_match():
            self._match(rid)

    def _match(self, rid: int) -> None:
        out = self.call("match_prefix_for_req", self._describe(rid),
                        lambda: (ad.match_prefix_for_req(self.ref, rid), None),
                        lambda: self.impl.match_prefix_for_req(rid))
        if out:
            self.ref = out[0][0]
            self.matched.add(rid)

    @operation(when=lambda self: self._head() is not None and self._head() in self.matched)
    def add_one_req(self) -> None:
        """The round's head is added: check, lock, re-check, load-back, chunk, reservation (A1 and liveness here)."""
        rid = self.queue.pop(0)
        idle = self._idle() and ad.fits_empty_pool(self.ref, rid)
        rem = ad.rem_swa_tokens(self.ref)
        described = self._describe(rid)
        reason, why = self._why_refused(rid)
        out = self.call("add_one_req", described, lambda: ad.add_one_req(self.ref, rid),
                        lambda: self.impl.add_one_req(rid))
        if out is None:  # both ran out of SWA: the budget admitted a request whose load-back does not fit
            self.fail(f"A1 violated: add_one_req admitted {described} with rem_swa_tokens {rem}, then its load-back "
                      f"ran out of SWA memory (the {self.ref.config.policy.value} budget does not count what "
                      f"load-back allocates: S8)", check="invariant",
                      detail={"invariant": "A1", "finding": "S8", "policy": self.ref.config.policy.value})
        (self.ref, want), got = out
        mine = self.snapshot().state.requests[rid].status
        theirs = self.ref.requests[rid].status
        if mine is not theirs:
            verb = {ReqStatus.WAITING: "refused", ReqStatus.ADMITTED: "admitted"}
            self.fail(f"add_one_req {verb.get(mine, mine.value)} {described} with rem_swa_tokens {rem}; the "
                      f"reference {verb.get(theirs, theirs.value)} it (the admission decision differs)")
        if got != want:
            self.fail(f"add_one_req returned {got} for request {rid}, the reference {want}")
        self.trace.outcome(f" -> {want.value}")
        refused = self.ref.requests[rid].status is ReqStatus.WAITING
        self.note("add_one_req refused", int(refused))
        if refused or want is not ad.AddReqResult.CONTINUE:
            self.stopped = True
        if refused and idle:
            self.idle_refusals[rid] = self.idle_refusals.get(rid, 0) + 1
            if self.idle_refusals[rid] >= STARVATION_BOUND:
                detail = {"reason": reason, "policy": self.ref.config.policy.value,
                          "finding": "S9" if reason != "selection_pin" else "new"}
                if self.looks_past(self.evidence("liveness", detail), rid=rid):
                    return
                self.fail(f"liveness violated: {described} was refused in {self.idle_refusals[rid]} idle rounds "
                          f"(nothing admitted, running, locked or reserved; rem_swa_tokens {rem} of "
                          f"{self.ref.config.size_swa}) although it fits the empty pool; a refusal changes nothing, "
                          f"so it waits forever and blocks the queue behind it ({why}, policy "
                          f"{self.ref.config.policy.value})", check="liveness", detail=detail)

    @follows("starves forever")
    def _set_the_starved_request_aside(self, evidence: Evidence, *, rid: int) -> bool:
        """A request that fits the idle pool and is refused in every idle round (0.5.23's budget: F4, F5). Both sides
        refused it alike (compared above), and a refusal changes nothing, so the run sets it aside: it stays waiting
        on both sides, is never offered again, and the requests behind it are served (the queue it blocked goes
        on; a scheduler would abort it after its timeout)."""
        if evidence.check != "liveness" or rid in self.set_aside:
            return False
        self.set_aside.add(rid)
        self.queue = [r for r in self.queue if r != rid]
        return True

    @operation(when=lambda self: self._round_open() and self._head() is None and not self.continuing)
    def prepare_for_extend(self) -> None:
        """Once the adder stopped (or the queue is done) the round's batch allocates every admitted chunk (A1: it
        must fit); the round closes."""
        pending = [rid for rid in self.ref.adder.can_run] if self.ref.adder else []
        self.note("requests admitted in one round", len(pending))
        pages = {rid: ad.chunk_pages(self.ref, rid) for rid in pending}
        done = {rid: ad.own_len(self.ref, rid) for rid in pending}
        out = self.call("prepare_for_extend", f"requests {pending}", lambda: (ad.prepare_for_extend(self.ref), None),
                        self.impl.prepare_for_extend)
        if out is None:
            self.fail(f"A1 violated: 'Prefill out of memory': the round admitted requests {pending} whose chunks do "
                      f"not fit the SWA pool after their load-back (S8)", check="invariant",
                      detail={"invariant": "A1", "finding": "S8", "policy": self.ref.config.policy.value})
        self.ref = out[0][0]
        self._held_pages("prepare_for_extend", pending, lambda rid: (
            f"its chunk of {self.ref.requests[rid].extend_len} tokens after {done[rid]} own takes {pages[rid]} pages "
            "past its last partly filled one"))
        self.queue, self.matched, self.stopped, self.continuing = [], set(), False, []

    def _between_match_and_add(self) -> bool:
        head = self._head()
        return self.match_each and head is not None and head in self.matched

    @operation(when=lambda self: ad.swa_evictable_pages(self.ref) > 0 and not self._between_match_and_add(),
               data=st.data())
    def evict(self, data: Any) -> None:
        """The tree evicts device SWA of unlocked nodes (any time: also between a match and the add, but under
        ``upstream_0523``, whose scheduler adds a request right after matching it)."""
        n = data.draw(st.integers(0, self.total), label="num_pages")
        out = self.call("evict", f"num_pages {n}", lambda: (ad.evict(self.ref, n), None),
                        lambda: self.impl.evict(n))
        if out:
            self.ref = out[0][0]
            self.count("evict per example")

    @operation(when=lambda self: not self._round_open() and self._uncached(), on=_chunked_prefill,
               data=st.data())
    def cache_unfinished_req(self, data: Any) -> None:
        """A running chunk with prompt left ran (its round closed, the next not open): its prefix grows by the chunk,
        its own pages wholly out of the window are freed; it is continued in the next round."""
        rid = data.draw(st.sampled_from(self._uncached()), label="request")
        out = self.call("cache_unfinished_req", f"request {rid}",
                        lambda: (ad.cache_unfinished_req(self.ref, rid), None),
                        lambda: self.impl.cache_unfinished_req(rid))
        if out:
            self.ref = out[0][0]
            done, w, p = ad.own_len(self.ref, rid), self.w, self.p
            self._held_pages("cache_unfinished_req", [rid], lambda _: (
                f"of its {done} own tokens the {ad.out_of_window_pages(done, window=w, page_size=p)} pages wholly "
                f"below done - W = {done - w} are freed (W={w}, P={p})"))

    def _held_pages(self, op: str, rids: list[int], why: Any) -> None:
        """Each request in ``rids`` holds as many SWA pages as in the reference, or a verdict saying ``why(rid)``."""
        snap = self.snapshot().state
        for rid in rids:
            mine, theirs = snap.requests[rid].swa_pages, self.ref.requests[rid].swa_pages
            if mine != theirs:
                self.fail(f"after {op} request {rid} holds {mine} SWA pages, the reference {theirs}: {why(rid)}")

    @operation(when=lambda self: self._finishing(), data=st.data())
    def cache_finished_req(self, data: Any) -> None:
        """A running request whose prompt is done finishes: its pages back, its window lock released."""
        rid = data.draw(st.sampled_from(self._finishing()), label="request")
        out = self.call("cache_finished_req", f"request {rid}", lambda: (ad.cache_finished_req(self.ref, rid), None),
                        lambda: self.impl.cache_finished_req(rid))
        if out:
            self.ref = out[0][0]

    # ------------------------------------------------------------ the comparison

    @check_after_each_step
    def agrees_with_reference(self) -> None:
        """Accounting and lock refs (reference), the pages behind the state (implementation), the same state."""
        self.stats.steps += 1
        try:
            ad.check_admission(self.ref)
        except InvariantViolation as err:
            self.fail(f"the reference breaks {err}")
        snap = self.snapshot()
        try:
            ad.check_admission_snapshot(snap)
        except InvariantViolation as err:
            self.fail(f"the implementation breaks {err}")
        if snap.state != self.ref:
            self.fail(_state_difference(snap.state, self.ref))
        self.trace.next_step()

    # ------------------------------------------------------------ misuse (REJECTS_MISUSE): both sides reject

    @misuse("get_new_batch_prefill", "round_open", when=lambda self: self._round_open())
    def _round_already_open(self, data: Any) -> MisuseCall:
        return MisuseCall("(a round is open)", lambda: (ad.get_new_batch_prefill(self.ref), None),
                          self.impl.get_new_batch_prefill)

    @misuse("add_one_req", "unmatched",
            when=lambda self: self._round_open() and any(r.match is None for r in self._reqs_waiting()))
    def _unmatched(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from([i for i in self._waiting() if self.ref.requests[i].match is None]),
                        label="request")
        return MisuseCall(f"request {rid} (never matched)", lambda: ad.add_one_req(self.ref, rid),
                          lambda: self.impl.add_one_req(rid))

    @misuse("cache_finished_req", "not_running",
            when=lambda self: any(r.status is not ReqStatus.RUNNING for r in self.ref.requests))
    def _not_running(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from([i for i, r in enumerate(self.ref.requests)
                                         if r.status is not ReqStatus.RUNNING]), label="request")
        return MisuseCall(f"request {rid} ({self.ref.requests[rid].status.value})",
                          lambda: (ad.cache_finished_req(self.ref, rid), None),
                          lambda: self.impl.cache_finished_req(rid))

    @misuse("cache_finished_req", "prompt_left", when=lambda self: self._uncached())
    def _prompt_left(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from(self._uncached()), label="request")
        return MisuseCall(f"request {rid} (prompt left after its chunk)",
                          lambda: (ad.cache_finished_req(self.ref, rid), None),
                          lambda: self.impl.cache_finished_req(rid))

    @misuse("cache_unfinished_req", "not_unfinished",
            when=lambda self: any(not (r.status is ReqStatus.RUNNING and r.prefix_len + r.extend_len < r.prompt_len)
                                  for r in self.ref.requests))
    def _not_unfinished(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from([i for i, r in enumerate(self.ref.requests) if not (
            r.status is ReqStatus.RUNNING and r.prefix_len + r.extend_len < r.prompt_len)]), label="request")
        r = self.ref.requests[rid]
        what = "prompt done" if r.status is ReqStatus.RUNNING else r.status.value
        return MisuseCall(f"request {rid} ({what})", lambda: (ad.cache_unfinished_req(self.ref, rid), None),
                          lambda: self.impl.cache_unfinished_req(rid))

    @misuse("add_chunked_req", "not_chunked",
            when=lambda self: self._round_open() and any(r.status is not ReqStatus.CHUNKED for r in self.ref.requests))
    def _not_chunked(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from([i for i, r in enumerate(self.ref.requests)
                                         if r.status is not ReqStatus.CHUNKED]), label="request")
        return MisuseCall(f"request {rid} ({self.ref.requests[rid].status.value})",
                          lambda: ad.add_chunked_req(self.ref, rid), lambda: self.impl.add_chunked_req(rid))

    def _reqs_waiting(self) -> list[ad.Request]:
        return [self.ref.requests[i] for i in self._waiting()]

    def misuse_allowed(self) -> bool:
        """Misuse on every fourth step only, so that it does not crowd out the scheduler."""
        return len(self.trace) % 4 == 3


def _state_difference(got: ad.AdmissionState, want: ad.AdmissionState) -> str:
    """The first difference between the implementation's state and the reference's, in words."""
    if got.available != want.available:
        return f"available SWA pages {got.available}, reference {want.available}"
    if got.adder != want.adder:
        return f"prefill adder {got.adder}, reference {want.adder}"
    if len(got.nodes) != len(want.nodes):
        return f"{len(got.nodes)} tree nodes, reference {len(want.nodes)} (a load-back split differs)"
    for i, (g, w) in enumerate(zip(got.nodes, want.nodes, strict=True)):
        if g != w:
            return f"tree node {i}: {_node_text(g)}; reference {_node_text(w)}"
    if len(got.requests) != len(want.requests):
        return f"{len(got.requests)} requests, reference {len(want.requests)}"
    for rid, (g2, w2) in enumerate(zip(got.requests, want.requests, strict=True)):
        if g2 != w2:
            return f"request {rid}: {g2}, reference {w2}"
    return f"state {got}, reference {want}"


def _node_text(n: Node) -> str:
    full = "device" if n.full_on_device else "host"
    return f"parent {n.parent}, {n.length} tokens, Full on {full}, SWA {n.swa.value}, lock_ref {n.lock_ref}"


def _policy(value: str) -> dict[str, Any]:
    return {"policy": AdmissionPolicy(value).value}


SUITE = Suite(AdmissionMachine, ADMISSION_CONFIGS, apply={"budget": _policy})
