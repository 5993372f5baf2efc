"""Deliberately broken variants of the torch admission runtime (sglang_semantics.md §5, §7 A1-A3).

Each mutant is a subclass of :class:`~kvproof.gpu_runtime.admission.AdmissionRuntime` with
one small override of the prefill adder's admission path, run under the ``corrected``
policy (the suite's default): a budget term dropped or mis-rounded, a comparison loosened,
a check skipped, a lock not taken, a value reused from the match; a chunked request's
continuation without its page, not reserved, or allocated as whole pages; a release that
frees a page of the window. The ``admission``
suite must kill every one (``kvproof mutants --component admission``);
``tests/conformance/test_admission_mutants.py`` also runs the short differing sequence
named in each docstring (``Differs:``) against the unmutated runtime. The Z3 twin that
catches the same mistake, where it is arithmetic, is named in the docstring.

:data:`MUTANTS` maps a name to a factory ``AdmissionSetup -> runtime`` (the class itself).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvproof.gpu_runtime.admission import _NODE, AdmissionRuntime, _Adder, _ceil_p, _Walk
from kvproof.reference.admission import AddReqResult, ChunkedResult

__all__ = ["MUTANTS"]


class BudgetWithoutHostTerm(AdmissionRuntime):
    """The budget without the host term: ``max(min(e', C), W) + P``, what load-back restores not counted (§5.2, S8).

    Admits a request whose window holds a host tombstone at the pool's edge, where the reference refuses it.
    Z3: ``admission.add_one_req.a1_upstream_27391.pre_27391`` and
    ``admission.add_one_req.a1_upstream_27391_minimal.no_host_term``.
    Differs: P=2, W=4, chunk 8, 7 pages, a 12-token host tombstone, a request of 8 more tokens: budget 10 < 14
    admits; the reference's 10 + 4 (the capped restore) is not below 14: no_token.
    """

    def _budget_terms(self, rid: int) -> tuple[int, int]:
        extend, _ = super()._budget_terms(rid)
        return extend, 0


class AdmitsAtEquality(AdmissionRuntime):
    """``budget >= rem_swa_tokens -> NO_TOKEN`` turned into ``>``: a budget equal to what is left admits (§5.3).

    A1 still holds (``admission.add_one_req.a1_upstream_27391_minimal`` proves the fixed budget safe without the
    strict comparison on a page-granular pool), so no A1 twin can catch it: the suite kills it by comparing the
    exact decision with the reference's. Differs: P=2, W=4, chunk 8, 7 pages, a 12-token host tombstone, a request
    of 8 more tokens: budget 14 == rem_swa_tokens 14, admitted here, no_token in the reference.
    """

    def _admits(self, budget: int, rem: int) -> bool:
        return budget <= rem


class NoLockRecheck(AdmissionRuntime):
    """The check inside the tree lock dropped: the request's own window pages, evictable before the lock and
    protected after it, are counted as room (§5.3 step 4).

    Z3: ``admission.add_one_req.a1_corrected.no_lock_recheck``. Differs: P=2, W=4, 4 pages, a 2-page device
    prefix, a request of 2 more tokens: budget 6 passes the outer check (rem 8) and fails the inner one (rem 4,
    its own window protected): no_token in the reference, admitted here.
    """

    recheck = False


class LoadBackWithoutLock(AdmissionRuntime):
    """Load-back restores the host tombstones but does not lock them: the window lock keeps only the nodes that were
    on device, so the pages load-back just allocated for an admitted request are evictable again (§5.4, §1.7).

    Differs: P=2, W=4, 8 pages, a request of 2 more tokens over a 4-token tombstone: after ``add_one_req`` the
    restored node has ``lock_ref`` 0 (the reference: 1) and its 2 pages count as evictable.
    """

    def init_load_back(self, rid: int) -> int:
        known = 0 <= rid < self.reqs.shape[0]
        restored = [i for i, _, _ in self._walk(int(self.reqs[rid, _NODE])).restores] if known else []
        pages = super().init_load_back(rid)
        if restored:
            self.lock_ref[restored] -= 1
            self.locked[rid] = tuple(i for i in self.locked[rid] if i not in restored)
        return pages


class HostHitNotPageRounded(AdmissionRuntime):
    """``corrected``'s host term in raw tokens: ``min(len, W - c)`` per tombstone and no ``ceil_P`` on the sum, while
    load-back still restores whole pages (§5.2: every SWA term of the budget is page-rounded).

    Rounding either per node or on the sum is enough (node lengths are whole pages, so ``ceil_P`` of the raw sum
    equals the sum of ``min(len, ceil_P(W - c))``: dropping only one of them is an equivalent mutant). With both
    gone the budget undercounts by up to ``P - 1`` tokens when ``W`` is not a page multiple. No Z3 twin: the spec
    carries host hits in whole pages. Differs: P=4, W=6, chunk 8, 5 pages, a 4-token device node under a 12-token
    tombstone, a request of 8 more tokens: term 2, budget 14 < 16 admits; the reference's term 4, budget 16:
    no_token.
    """

    def _budget_terms(self, rid: int) -> tuple[int, int]:
        extend, _ = super()._budget_terms(rid)
        walk = self._walk(int(self.reqs[rid, _NODE]))
        return extend, sum(self._raw_capped(walk, i) for i, _, _ in walk.restores)

    def _raw_capped(self, walk: _Walk, node: int) -> int:
        covered, length = 0, self.length.tolist()
        for i in walk.nodes:
            if i == node:
                return min(length[i], self.window - covered)
            covered += length[i]
        return 0

    def _budget(self, extend: int, host: int, chunk: int | None) -> int:
        return super()._budget(extend, 0, chunk) + host


class StaleMatchValue(AdmissionRuntime):
    """``corrected``'s host term taken at match time and reused at both checks (§5.7): a tree changed since the
    match (an eviction, an earlier request's load-back) makes it stale.

    Z3: ``admission.add_one_req.a1_corrected.snapshot_reused``. Differs: P=2, W=4, chunk 8, 7 pages, a request of 8
    more tokens over a 2-page device node; match it, evict the node (now a host tombstone in its window), add it:
    the stale term 0 gives budget 10 < 14, admitted; the reference's term 4 gives 14: no_token.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._terms: dict[int, int] = {}

    def match_prefix_for_req(self, rid: int) -> None:
        super().match_prefix_for_req(rid)
        self._terms[rid] = super()._budget_terms(rid)[1]

    def _budget_terms(self, rid: int) -> tuple[int, int]:
        extend, _ = super()._budget_terms(rid)
        return extend, self._terms.get(rid, 0)


class UncappedLoadBack(AdmissionRuntime):
    """``corrected``'s window-capped budget with upstream's whole-node load-back: a long tombstone is restored
    whole, more than the budget counted (§5.4; S9's fix half applied).

    Z3: ``admission.add_one_req.a1_corrected.uncapped_load_back``. Differs: P=2, W=4, 8 pages, a 24-token tombstone,
    a request of 2 more tokens: the reference restores 4 tokens (2 pages, the node split), this 24 (12 pages):
    out of memory.
    """

    def _restores(self, walk: _Walk) -> list[tuple[int, int]]:
        return [(i, length) for i, length, _ in walk.restores]


class ReserveCountsHostTerm(AdmissionRuntime):
    """``update_prefill_budget`` reserves the host term again although load-back already took its pages out of
    ``available`` (§5.3: the reservation omits it): later requests of the round are refused for nothing.

    Differs: P=2, W=4, 8 pages, a request of 2 more tokens over a 4-token tombstone: offset 10 after it, the
    reference's 6.
    """

    def add_one_req(self, rid: int) -> AddReqResult:
        known = 0 <= rid < self.reqs.shape[0]
        host = sum(t for _, t in self._restores(self._walk(int(self.reqs[rid, _NODE])))) if known else 0
        result = super().add_one_req(rid)
        if self.adder is not None and rid in self.adder.can_run:
            self.adder.offset += _ceil_p(host, self.page_size)
        return result


class FinishKeepsLock(AdmissionRuntime):
    """``cache_finished_req`` returns the chunk's pages but never releases the window lock: the request's window
    stays protected forever (§1.7, §5.3; the pool shrinks by the window).

    Differs: P=2, W=4, 8 pages, a request over a 2-page device prefix runs and finishes: the node's ``lock_ref``
    stays 1 (the reference: 0).
    """

    def _release_lock(self, rid: int) -> None:
        return None  # the lock (and the request's record of it) stays


class ContinuationWithoutPage(AdmissionRuntime):
    """``available_chunk_tokens`` without the ``- P``: ``min(rem_chunk, rem_swa_tokens)`` (§5.3, last paragraph; #23174
    "add_chunked_req must leave one page"): a continuation takes the page the step needed, and one that should wait
    is forced.

    Z3: ``admission.add_chunked_req.a1.no_page_left``. Differs: P=4, W=8, chunk 8, 6 pages; a chunked request (8 own
    tokens, 2 pages, 12 prompt tokens left) after a request that reserved 12 of the 16 tokens left: the reference
    defers it (min(4, 4 - 4) = 0), this adds a chunk of 4.
    """

    def _available_chunk_tokens(self, adder: _Adder) -> int:
        rem = self.rem_swa_tokens()
        return rem if adder.rem_chunk is None else min(adder.rem_chunk, rem)


class ReleaseFreesInWindowPage(AdmissionRuntime):
    """``cache_unfinished_req`` rounds the out-of-window pages up: ``ceil((done - W) / P)`` frees the page that holds
    the window's first tokens, which the next chunk attends to (§5.3; the kept tail of ``swa_tail_len``, §2.3).

    Z3: ``admission.cache_unfinished_req.frees_out_of_window_only.in_window_page``. Differs: P=4, W=6, chunk 8: a
    first chunk of 8 tokens cached frees ceil(2 / 4) = 1 page here, none in the reference (tokens 2..7 are the
    window).
    """

    def _out_of_window(self, done: int) -> int:
        return -(-max(0, done - self.window) // self.page_size)


class ContinuationWholeNewPages(AdmissionRuntime):
    """A continuing chunk allocated as whole new pages, ``ceil(e / P)``, ignoring the free slots of the request's last,
    partly filled page (§1.3 ``get_num_new_pages``; 0.5.23's continuation is not page-floored): a page taken for
    nothing.

    Z3: ``admission.prepare_for_extend.continuation_pages_exact.whole_new_pages``. Differs: P=4, W=8, chunk 10: a
    request with 18 own tokens continues with 10 more: the reference takes ceil(28/4) - ceil(18/4) = 2
    pages, this 3.
    """

    def _chunk_pages(self, done: int, extend: int) -> int:
        return -(-extend // self.page_size)


class ContinuationNotReserved(AdmissionRuntime):
    """The continuation's chunk is not reserved (0.5.23 skips the reservation of ``is_chunked_continuation`` for a
    pool with per-request rings; here there are none): requests added after it in the round see its pages as free
    (§5.3).

    Z3: ``admission.add_chunked_req.keeps_round_invariant.no_reservation``. Differs: P=4, W=8, chunk 10, 12 pages: the
    continuation of 10 tokens leaves the adder's offset at 0, the reference's 14.
    """

    def add_chunked_req(self, rid: int) -> ChunkedResult:
        offset = self.adder.offset if self.adder is not None else 0
        result = super().add_chunked_req(rid)
        if self.adder is not None:
            self.adder.offset = offset
        return result


MUTANTS: dict[str, Callable[..., AdmissionRuntime]] = {
    "budget_without_host_term": BudgetWithoutHostTerm,
    "admits_at_equality": AdmitsAtEquality,
    "no_lock_recheck": NoLockRecheck,
    "load_back_without_lock": LoadBackWithoutLock,
    "host_hit_not_page_rounded": HostHitNotPageRounded,
    "stale_match_value": StaleMatchValue,
    "uncapped_load_back": UncappedLoadBack,
    "reserve_counts_host_term": ReserveCountsHostTerm,
    "finish_keeps_lock": FinishKeepsLock,
    "continuation_without_page": ContinuationWithoutPage,
    "release_frees_in_window_page": ReleaseFreesInWindowPage,
    "continuation_whole_new_pages": ContinuationWholeNewPages,
    "continuation_not_reserved": ContinuationNotReserved,
}
