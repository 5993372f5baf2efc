"""SGLang 0.5.23's decode preallocation queue's budget functions, driven on the real allocator (capability
``DECODE_BUDGETS`` of component ``decode_prealloc``; issue 15 item 2).

:class:`SGLangDecodeNode` is :class:`~kvproof.conformance.adapters.sglang.SGLangSWAAllocator` (the real pools, every
allocator call of the decode-node simulation replayed on them) plus ``decode_budgets``: it evaluates 0.5.23's own
``DecodePreallocQueue`` methods -- ``_pre_alloc_fill_len``, ``_swa_tail_len``, ``_swa_retractable_len``,
``_prealloc_kv_lens``, ``_prealloc_required_tokens`` and the admission round's budgets
(``_swa_aware_allocatable_token_budgets`` in tail mode, else ``_allocatable_token_budgets``, with the
retractable counts ``pop_preallocated`` passes) -- on the real allocator as it stands.

The queue is not constructed (its ``__init__`` builds a KV transfer manager and a bootstrap server); the methods run
on an instance made with ``object.__new__`` holding only what they read: the real allocator and KV pool, R, and a
scheduler view of the node (the running batch and the retracted queue as ``Req``-shaped records, an empty transfer
and waiting queue, no prebuilt batch, no HiSparse). The decode node has no prefix cache, so the tree cache is a
stand-in (:class:`NothingEvictable`: ``swa_evictable_size() == 0``, and an eviction frees nothing; a radix cache on
the decode node is not modelled). The server config is published once per process as upstream's unit tests do
(``disaggregation_decode_enable_radix_cache`` and ``disable_radix_cache`` keep their defaults).

Admission decisions on the real code (extending sglang_semantics.md §2.5 to 0.5.23: the reservation test and the
SWA reclaim of ``pop_preallocated`` and ``resume_retracted_reqs``):

* ``reservation_fits`` -- for each queued request, 0.5.23's ``_prealloc_reservation_fits`` (the allocator's
  ``prealloc_fits``) on what ``pop_preallocated`` passes for a request without a prefix match: the full admission
  requirement ``_required_admission_tokens(req, _required_alloc_tokens(fill_len, 0), 0, retractable)`` and, with an
  SWA budget, ``max(swa_required, swa_len + min(max_new_tokens, CLIP) - retractable_swa)``, against the round's
  budgets; for each retracted request, the same function on ``_prealloc_required_tokens`` against the budgets
  ``resume_retracted_reqs`` computes (``count_retracted=False``, no retractable counts passed).
* ``reclaim`` -- 0.5.23's ``_reclaim_swa_tail_capacity`` (``SWATokenToKVPoolAllocator.reclaim_for_prealloc`` on the
  page-rounded tail), for the requests 0.5.23 calls it for (``reclaim_called``): a queued request when the round has
  an SWA budget (``_uses_swa_reservation()``: tail mode); a retracted one only when the allocator's
  ``prealloc_fits_assumes_reclaim()`` (False for separate pools); either, in ``_pre_alloc``, only with a decode radix
  cache (``disaggregation_decode_enable_radix_cache``, off). Its answer is ``None`` (ready) or the shortfall, parsed
  here into ``{"needed", "available", "message"}``. It is evaluated for every queued request, on the pools as they
  stand (0.5.23 calls it for one that passed the reservation test, at that moment of its round; the question is the
  same). On a shortfall 0.5.23 first asks the tree cache to evict the difference (``EvictParams(swa_num_tokens=..)``):
  the stand-in's ``evict_for_alloc`` evicts nothing (SGLang's own ``EvictResult()``: 0 tokens evicted), so the answer
  is the SWA pool's free tokens against the page-rounded tail.

HiCache, HiSparse, priority scheduling, the req-to-token pool and the metadata buffers are off or unbounded here,
as on the node the reference models.
"""

from __future__ import annotations

import re
import types
from typing import Any

from kvproof.conformance.adapters.sglang import SGLangSWAAllocator, import_sglang_modules
from kvproof.conformance.errors import HarnessBug
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import BudgetRequest, Capability
from kvproof.reference.registry import Component

__all__ = ["SGLangDecodeNode"]


def _req(shape: BudgetRequest, rid: str = "") -> Any:
    origin, output, max_new = shape
    return types.SimpleNamespace(rid=rid, origin_input_ids=[0] * origin, output_ids=[0] * output,
                                 sampling_params=types.SimpleNamespace(max_new_tokens=max_new),
                                 pd_rebootstrap_in_progress=False)


class NothingEvictable:
    """The decode node's tree cache: no prefix cache, so nothing is evictable and an eviction frees nothing.

    ``evict_for_alloc`` answers SGLang's own ``EvictResult()`` (0 tokens evicted) and counts the calls, keeping the
    last ``EvictParams`` it was asked with, so a test can see a reclaim reached it."""

    def __init__(self, evict_result: type) -> None:
        self._result = evict_result
        self.evictions = 0
        self.last_asked: Any = None

    def swa_evictable_size(self) -> int:
        return 0

    def evict_for_alloc(self, params: Any) -> Any:
        self.evictions += 1
        self.last_asked = params
        return self._result()


_SHORTFALL = re.compile(r"needed=(-?\d+), available=(-?\d+)")


def _shortfall(message: str | None) -> dict[str, object] | None:
    """0.5.23's reclaim answer: ``None`` (ready) or ``{"needed", "available", "message"}`` read from its message."""
    if message is None:
        return None
    found = _SHORTFALL.search(message)
    if found is None:
        raise HarnessBug(f"reclaim_for_prealloc's shortfall does not read as 'needed=N, available=M': {message!r}")
    return {"needed": int(found[1]), "available": int(found[2]), "message": message}


class SGLangDecodeNode(SGLangSWAAllocator):
    """The real allocator and the real preallocation-queue budget functions (``decode_prealloc`` only)."""

    components = frozenset({Component.DECODE_PREALLOC})

    def __init__(self, config: PoolConfig, device: str = "cpu") -> None:
        super().__init__(config, device)
        self.capabilities = self.capabilities | {Capability.DECODE_BUDGETS}
        from kvproof.conformance.adapters.sglang_admission import publish_server_args

        publish_server_args(config.page_size)
        self._decode, prefix_cache = import_sglang_modules("sglang.srt.disaggregation.decode",
                                                           "sglang.srt.mem_cache.base_prefix_cache")
        self.tree_cache = NothingEvictable(prefix_cache.EvictResult)

    def decode_budgets(self, running: list[BudgetRequest], retracted: list[BudgetRequest],
                       queued: list[BudgetRequest], *, reserved_decode_tokens: int,
                       sliding_window_size: int) -> dict[str, object]:
        queue_cls, decode = self._decode.DecodePreallocQueue, self._decode
        q = object.__new__(queue_cls)
        run = [_req(r, f"running-{i}") for i, r in enumerate(running)]
        ret = [_req(r, f"retracted-{i}") for i, r in enumerate(retracted)]
        waiting = [_req(r, f"queued-{i}") for i, r in enumerate(queued)]
        q.token_to_kv_pool_allocator, q.token_to_kv_pool = self.allocator, self.kvcache
        q.num_reserved_decode_tokens = reserved_decode_tokens
        q.scheduler = types.SimpleNamespace(sliding_window_size=sliding_window_size, enable_hisparse=False,
                                            running_batch=types.SimpleNamespace(reqs=run), waiting_queue=[],
                                            last_batch=None)
        q.transfer_queue = types.SimpleNamespace(queue=[])
        q.retracted_queue = ret
        q.tree_cache = self.tree_cache
        retractable = sum(len(r.origin_input_ids) + len(r.output_ids) for r in run)
        swa_retractable = 0
        if q._uses_swa_reservation():
            swa_retractable = sum(q._swa_retractable_len(r) for r in run)
            full, swa = q._swa_aware_allocatable_token_budgets(retractable_tokens=retractable,
                                                               retractable_swa_tokens=swa_retractable,
                                                               count_retracted=True)
            resume = q._swa_aware_allocatable_token_budgets(count_retracted=False)
        else:
            full, swa = q._allocatable_token_budgets(retractable_tokens=retractable, count_retracted=True), None
            resume = (q._allocatable_token_budgets(count_retracted=False), None)
        # _pre_alloc reclaims (for any request) only with a decode radix cache, SWA pages charged
        prealloc_reclaims = bool(decode.get_disagg().disaggregation_decode_enable_radix_cache
                                 and q._uses_swa_tail_prealloc() and not decode.is_swa_req_ring(self.allocator))
        requests = []
        for i, r in enumerate([*run, *ret, *waiting]):
            fill = queue_cls._pre_alloc_fill_len(r)
            entry: dict[str, object] = {
                "fill_len": fill, "swa_tail_len": q._swa_tail_len(fill),
                "swa_retractable_len": q._swa_retractable_len(r),
                "prealloc_kv_lens": tuple(q._prealloc_kv_lens(r)),
                "prealloc_required_tokens": tuple(q._prealloc_required_tokens(r))}
            if len(run) <= i < len(run) + len(ret):
                entry.update(self._resume_decision(q, r, resume, prealloc_reclaims))
            elif i >= len(run) + len(ret):
                entry.update(self._admission_decision(q, r, (full, swa), retractable, swa_retractable,
                                                      prealloc_reclaims))
            requests.append(entry)
        return {"clip": decode.CLIP_MAX_NEW_TOKEN, "budgets": (full, swa), "requests": requests}

    def _admission_decision(self, q: Any, r: Any, budgets: tuple[int, int | None], retractable: int,
                            swa_retractable: int, prealloc_reclaims: bool) -> dict[str, object]:
        """``pop_preallocated``'s reservation test and SWA reclaim for a queued request without a prefix match."""
        full, swa = budgets
        alloc_tokens = q._required_alloc_tokens(fill_len=q._pre_alloc_fill_len(r), prefix_len=0)
        full_need = q._required_admission_tokens(r, alloc_tokens, 0, retractable)
        swa_need, swa_len = 0, alloc_tokens
        if q._uses_swa_tail_prealloc():
            swa_len = q._prealloc_kv_lens(r)[1]
            clipped = min(r.sampling_params.max_new_tokens, self._decode.CLIP_MAX_NEW_TOKEN)
            swa_need = max(q._prealloc_required_tokens(r)[1], swa_len + clipped - swa_retractable)
        elif swa is not None:
            swa_need = full_need
        fits = q._prealloc_reservation_fits(full_need, swa_need, full_allocatable_tokens=full,
                                            swa_allocatable_tokens=swa)
        called = swa is not None or prealloc_reclaims
        reclaim = _shortfall(q._reclaim_swa_tail_capacity(swa_len, r.rid, full_len=alloc_tokens)) if called else None
        return {"reservation_fits": bool(fits), "reclaim_called": called, "reclaim": reclaim}

    def _resume_decision(self, q: Any, r: Any, budgets: tuple[int, int | None],
                         prealloc_reclaims: bool) -> dict[str, object]:
        """``resume_retracted_reqs``'s reservation test and SWA reclaim for a retracted request."""
        full_required, swa_required = q._prealloc_required_tokens(r)
        fits = q._prealloc_reservation_fits(full_required, swa_required, full_allocatable_tokens=budgets[0],
                                            swa_allocatable_tokens=budgets[1])
        called = bool(self.allocator.prealloc_fits_assumes_reclaim()) or prealloc_reclaims
        full_len, swa_len = q._prealloc_kv_lens(r)
        reclaim = _shortfall(q._reclaim_swa_tail_capacity(swa_len, r.rid, full_len=full_len)) if called else None
        return {"reservation_fits": bool(fits), "reclaim_called": called, "reclaim": reclaim}
