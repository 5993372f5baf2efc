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
and waiting queue, no prebuilt batch, no HiSparse). The decode node has no prefix cache, so the tree cache answers
``swa_evictable_size() == 0`` (a stand-in: a radix cache on the decode node is not modelled). The server config is
published once per process as upstream's unit tests do (``disaggregation_decode_enable_radix_cache`` and
``disable_radix_cache`` keep their defaults).
"""

from __future__ import annotations

import types
from typing import Any

from kvproof.conformance.adapters.sglang import SGLangSWAAllocator, import_sglang_modules
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import BudgetRequest, Capability
from kvproof.reference.registry import Component

__all__ = ["SGLangDecodeNode"]


def _req(shape: BudgetRequest) -> Any:
    origin, output, max_new = shape
    return types.SimpleNamespace(origin_input_ids=[0] * origin, output_ids=[0] * output,
                                 sampling_params=types.SimpleNamespace(max_new_tokens=max_new),
                                 pd_rebootstrap_in_progress=False)


class SGLangDecodeNode(SGLangSWAAllocator):
    """The real allocator and the real preallocation-queue budget functions (``decode_prealloc`` only)."""

    components = frozenset({Component.DECODE_PREALLOC})

    def __init__(self, config: PoolConfig, device: str = "cpu") -> None:
        super().__init__(config, device)
        self.capabilities = self.capabilities | {Capability.DECODE_BUDGETS}
        from kvproof.conformance.adapters.sglang_admission import _publish_server_args

        _publish_server_args(config.page_size)
        (self._decode,) = import_sglang_modules("sglang.srt.disaggregation.decode")

    def decode_budgets(self, running: list[BudgetRequest], retracted: list[BudgetRequest],
                       queued: list[BudgetRequest], *, reserved_decode_tokens: int,
                       sliding_window_size: int) -> dict[str, object]:
        queue_cls = self._decode.DecodePreallocQueue
        q = object.__new__(queue_cls)
        run, ret = [_req(r) for r in running], [_req(r) for r in retracted]
        q.token_to_kv_pool_allocator, q.token_to_kv_pool = self.allocator, self.kvcache
        q.num_reserved_decode_tokens = reserved_decode_tokens
        q.scheduler = types.SimpleNamespace(sliding_window_size=sliding_window_size, enable_hisparse=False,
                                            running_batch=types.SimpleNamespace(reqs=run), waiting_queue=[],
                                            last_batch=None)
        q.transfer_queue = types.SimpleNamespace(queue=[])
        q.retracted_queue = ret
        q.tree_cache = types.SimpleNamespace(swa_evictable_size=lambda: 0)
        retractable = sum(len(r.origin_input_ids) + len(r.output_ids) for r in run)
        if q._uses_swa_reservation():
            swa_retractable = sum(q._swa_retractable_len(r) for r in run)
            full, swa = q._swa_aware_allocatable_token_budgets(retractable_tokens=retractable,
                                                               retractable_swa_tokens=swa_retractable,
                                                               count_retracted=True)
        else:
            full, swa = q._allocatable_token_budgets(retractable_tokens=retractable, count_retracted=True), None
        requests = []
        for r in [*run, *ret, *(_req(x) for x in queued)]:
            fill = queue_cls._pre_alloc_fill_len(r)
            requests.append({"fill_len": fill, "swa_tail_len": q._swa_tail_len(fill),
                             "swa_retractable_len": q._swa_retractable_len(r),
                             "prealloc_kv_lens": tuple(q._prealloc_kv_lens(r)),
                             "prealloc_required_tokens": tuple(q._prealloc_required_tokens(r))})
        return {"clip": self._decode.CLIP_MAX_NEW_TOKEN, "budgets": (full, swa), "requests": requests}
