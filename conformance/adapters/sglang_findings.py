"""What the lockstep suite finds in SGLang 0.5.23, each with a reproduction in SGLang's own terms.

Written up in ``docs/sglang-findings.md``. :data:`FINDINGS` lists every divergence
the suites report against ``kvproof.conformance.adapters.sglang:SGLangSWAAllocator``
(``swa_allocator``, ``loc_cache``, ``decode_prealloc``),
``kvproof.conformance.adapters.sglang_host:SGLangHostPool`` (``hisparse_host``) and
``kvproof.conformance.adapters.sglang_admission:SGLangAdmission`` (``admission``) and
``kvproof.conformance.adapters.sglang_tp_prefetch:SGLangTPPrefetch`` (``tp_prefetch``), each matched by the
evidence of a verdict (:mod:`kvproof.conformance.findings`: the operation, the check, what changed), never by its
wording; the adapters declare them (their ``findings``), so every report labels a failure with its finding or
``new``, and ``--accept F1`` looks past F1 (the suite follows the documented non-atomic ``alloc_decode``).
:func:`classify` maps a report's evidence to its finding (``None``: new).
The ``reproduce_*`` functions build SGLang's classes directly (no kvproof adapter in
the loop) and return what they observed; ``tests/adapters/test_sglang.py`` asserts
on them, so a SGLang release that changes the behaviour makes those tests fail.
"""

from __future__ import annotations

from typing import Any

import torch

from kvproof.conformance.adapters.sglang_known import FINDINGS, classify

__all__ = [
    "FINDINGS",
    "classify",
    "reproduce_alloc_decode_leak",
    "reproduce_alloc_decode_leak_mirror",
    "reproduce_host_backup_not_atomic",
    "reproduce_p1_free_released_swa",
    "reproduce_ring_alloc_drains_paged_swa",
    "reproduce_window_tombstone_starves",
]


# ---------------------------------------------------------------- reproductions in SGLang's terms


def _sglang_allocator(size: int, size_swa: int, page_size: int) -> Any:
    from kvproof.conformance.adapters.sglang import load_sglang

    sg = load_sglang()  # kvproof's triton/torchvision stand-ins where needed, then SGLang's pool modules
    pool = sg.SWAKVPool(size=size, size_swa=size_swa, page_size=page_size, dtype=torch.float32, head_num=1,
                        head_dim=2, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    return sg.SWATokenToKVPoolAllocator(size, size_swa, page_size, torch.float32, "cpu", pool, need_sort=False)


def _t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def reproduce_alloc_decode_leak() -> dict[str, Any]:
    """F1: fill the SWA pool, then decode into a new page: SGLang returns None and keeps a full page."""
    a = _sglang_allocator(size=16, size_swa=8, page_size=4)
    loc = a.alloc_extend(_t(0), _t(0), _t(8), _t(8), _t(-1), 8)  # 2 full + 2 SWA pages: the SWA pool is now empty
    before = (a.full_available_size(), a.swa_available_size())  # (8, 0)
    out = a.alloc_decode(_t(9), _t(9), loc[-1:])  # position 8 opens a new page in both pools
    after = (a.full_available_size(), a.swa_available_size())  # (4, 0): a full page is gone
    a.free(loc)  # the request ends
    return {"result": out, "before": before, "after": after, "full_free_after_release": a.full_available_size(),
            "size_full": a.size_full}


def reproduce_alloc_decode_leak_mirror() -> dict[str, Any]:
    """F1's mirror: the *full* pool is the short one. ``alloc_decode`` calls the SWA allocator anyway (both calls
    come before the ``None`` check), so the SWA page it took leaks. Three requests fill the full pool; window
    evictions (``free_swa`` of each one's first page) leave one SWA page free."""
    a = _sglang_allocator(size=16, size_swa=8, page_size=4)
    first = a.alloc_extend(_t(0), _t(0), _t(8), _t(8), _t(-1), 8)
    a.free_swa(first[:4])
    for _ in range(2):
        a.free_swa(a.alloc_extend(_t(0), _t(0), _t(4), _t(4), _t(-1), 4)[:4])
    before = (a.full_available_size(), a.swa_available_size())  # (0, 4)
    out = a.alloc_decode(_t(9), _t(9), first[-1:])  # position 8 opens a new page: the full pool has none
    return {"result": out, "before": before, "after": (a.full_available_size(), a.swa_available_size())}


def reproduce_p1_free_released_swa() -> dict[str, Any]:
    """F2: at P == 1, ``free`` after a window eviction (``free_swa``) of the first position hands out SWA slot 0."""
    b = _sglang_allocator(size=12, size_swa=8, page_size=1)
    req_a, _req_b = b.alloc(2), b.alloc(1)  # A: full [1, 2] -> SWA [1, 2]; B: full [3] -> SWA [3] (stays live)
    b.free_swa(req_a[:1])  # window eviction of A's position 0: M[1] = 0
    b.free(req_a)  # free_swa reads M[[1, 2]] = [0, 2] and releases SWA slot 0 with slot 2
    swa_free = [int(x) for x in b.swa_attn_allocator.free_pages.tolist()]
    req_c = b.alloc(7)  # takes every free SWA slot, slot 0 last
    return {"swa_free_pages": swa_free, "swa_available": b.swa_available_size(), "size_swa": b.size_swa,
            "c_swa_slots": [int(x) for x in b.translate_loc_from_full_to_swa(req_c).tolist()]}


def reproduce_ring_alloc_drains_paged_swa(requests: int = 3) -> dict[str, Any]:
    """F8: a per-request SWA ring at P == 1 (``swa_req_ring_size`` set on the pool instance, as DeepSeek-V4's pool
    sets it, and a real ``ReqToTokenPool``): requests of 2 tokens in turn, each freed whole; ``alloc`` maps them to
    paged SWA slots that no ``free`` gives back, until it returns None with ``available_size()`` > 0."""
    from kvproof.conformance.adapters.sglang import load_sglang

    sg = load_sglang()
    pool = sg.SWAKVPool(size=12, size_swa=4, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
                        swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    pool.swa_req_ring_size = 4
    slots = sg.ReqToTokenPool(size=3, max_context_len=16, device="cpu", enable_memory_saver=False)
    a = sg.SWATokenToKVPoolAllocator(12, 4, 1, torch.float32, "cpu", pool, need_sort=False, req_to_token_pool=slots)
    mapped: list[list[int]] = []
    refused: list[int] = []
    for _ in range(requests):
        req = a.alloc(2)
        if req is None:
            refused.append(int(a.available_size()))
            continue
        mapped.append(a.translate_loc_from_full_to_swa(req).tolist())
        a.free(req)
    return {"ring": bool(a.swa_req_ring), "swa_available_size": int(a.swa_available_size()),
            "mapped": mapped, "refused_with_available": refused,
            "paged_swa_free": int(a.swa_attn_allocator.available_size()),
            "mapping_entries_left": int((a.full_to_swa_index_mapping[1:13] != 0).sum())}


def _sglang_host_pool(num_pages: int, page_size: int) -> Any:
    """SGLang's ``MLATokenToKVPoolHost`` (``HiSparseHostPoolMixin``) with exactly ``num_pages`` pages, on CPU."""
    from kvproof.conformance.adapters.sglang_host import HOST_BUDGET_BYTES, load_sglang_host

    sg = load_sglang_host()
    capacity = (num_pages - 1) * page_size  # HostKVCache adds one page: page_num = capacity // P + 1
    dev = sg.MLATokenToKVPool(size=capacity, page_size=page_size, dtype=torch.int64, kv_lora_rank=1,
                              qk_rope_head_dim=0, layer_num=1, device="cpu", enable_memory_saver=False)
    with sg.host_memory_budget_scope(HOST_BUDGET_BYTES):
        return sg.MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=1.0,
                                       host_size=0, page_size=page_size, layout="layer_first", pin_memory=False,
                                       device="cpu", device_capacity_tokens=capacity, start_layer=dev.start_layer,
                                       end_layer=dev.end_layer, target_layer_num=dev.layer_num)


def reproduce_host_backup_not_atomic() -> dict[str, Any]:
    """F3: ``HiSparseCoordinator._eager_backup_previous_token``'s host calls on a pool one page short.

    P = 2, 5 host pages. A (slot 0) staged 2 tokens, B (slot 1) 4 tokens, C (slot 2)
    1 token and just admitted (flagged). One free page. The decode batch [C, A, B]
    (seq_lens 2, 4, 6): the coordinator's first loop consumes C's flag; its second
    loop calls ``alloc_paged_token_slots(.., r, seq_len - 2, 1)`` per kept request in
    batch order: A's position 2 takes the last page, B's position 4 raises.
    """
    p = 2
    host = _sglang_host_pool(num_pages=5, page_size=p)
    table = torch.full((3, 8 + p), -1, dtype=torch.int64)  # req_to_host_pool (max_context_len 8)
    alloc_len = torch.zeros(3, dtype=torch.int64)  # req_to_host_pool_allocated_len
    skip = [False, False, False]  # _skip_first_backup
    for r, n in ((0, 2), (1, 4), (2, 1)):  # admit_request_into_staging: alloc_paged_token_slots(.., r, 0, n)
        host.alloc_paged_token_slots(table, alloc_len, r, 0, n)
    skip[2] = True  # collect_ready_reqs: C's staging copy completed
    free_before = host.available_size()  # 2 slots: one page
    batch, seq_lens = [2, 0, 1], [2, 4, 6]
    backup = []
    for i, r in enumerate(batch):  # _eager_backup_previous_token, loop 1 (compress ratio 1)
        if skip[r]:
            skip[r] = False
            continue
        backup.append(i)
    error = None
    try:
        for i in backup:  # loop 2: one alloc_paged_token_slots per kept request, no pre-check
            host.alloc_paged_token_slots(table, alloc_len, batch[i], seq_lens[i] - 2, 1)
    except RuntimeError as err:
        error = str(err)
    return {"error": error, "free_before": free_before, "free_after": host.available_size(),
            "allocated_len": [int(x) for x in alloc_len.tolist()], "skip_first_backup": skip}


class _BudgetTree:
    """The four things ``SWAPrefillBudget`` reads from a tree cache (upstream_0523_vllm_fuzz.md §1.4): an idle tree,
    nothing evictable."""

    def __init__(self, window: int) -> None:
        self.sliding_window_size = window

    def supports_mamba(self) -> bool:
        return False

    def full_evictable_size(self) -> int:
        return 0

    def swa_evictable_size(self) -> int:
        return 0


def reproduce_window_tombstone_starves(rounds: int = 3) -> dict[str, Any]:
    """F4: S9's numbers on 0.5.23's real ``SWAPrefillBudget`` over its real ``SWATokenToKVPoolAllocator``.

    P = 2, W = 4, an SWA pool of 8 pages (16 tokens), chunked prefill of 8 tokens, nothing locked, running or
    reserved. A request matched a 24-token prefix whose SWA lives only on host as one tombstone node: the match
    reports ``swa_host_hit_length = 24`` (0.5.23's ``SWAComponent.finalize_match_result`` adds whole tombstones,
    see its ``TODO(hzh)``), although load-back needs only the window, ``ceil_P(W) = 4`` tokens. One token to
    extend, no decode. Every round builds a fresh budget (as ``PrefillAdder`` does) and asks ``check_prefill``.
    """
    w, p, pages, chunk, h = 4, 2, 8, 8, 24
    a = _sglang_allocator(size=1 << 12, size_swa=pages * p, page_size=p)
    verdicts = []
    for _ in range(rounds):
        budget = a.create_prefill_budget(_BudgetTree(w))
        verdicts.append(budget.check_prefill(extend_input_len=1, total_tokens=1 + p, max_new_tokens=0,
                                             input_tokens=h + 1, swa_host_hit_length=h, chunk_limit=chunk))
    capped = a.create_prefill_budget(_BudgetTree(w)).check_prefill(
        extend_input_len=1, total_tokens=1 + p, max_new_tokens=0, input_tokens=h + 1,
        swa_host_hit_length=-(-w // p) * p, chunk_limit=chunk)
    return {"verdicts": verdicts, "remaining_swa": a.create_prefill_budget(_BudgetTree(w)).remaining_swa,
            "size_swa": a.size_swa, "with_window_capped_host_hit": capped}


class _PinTree(_BudgetTree):
    """F5's tree, as ``PrefillAdder`` sees it: node ``"a"`` (4 tokens, device Full and SWA) under the root, then a
    Full host prefix ``"b"`` (2 tokens) and ``"c"`` (4 tokens, its SWA a host tombstone), and another device node
    elsewhere. Locking a node protects the device SWA of the window (W = 4 tokens) ending at it: ``lock("a")`` pins
    a's 4 tokens; ``lock("c")`` covers the window with c's tombstone and pins nothing. ``pin_device_match=False``
    is the counterfactual lock that protects nothing for ``"a"`` either."""

    buffer_pipeline = None
    disable = False

    def __init__(self, *, pin_device_match: bool = True) -> None:
        super().__init__(window=4)
        self.evictable, self.pinned, self.pin_device_match = 8, 0, pin_device_match  # a's 4 + the other node's 4
        self.loaded = False

    def supports_prefix_sharing(self) -> bool:
        return True

    def swa_evictable_size(self) -> int:
        return self.evictable - self.pinned

    def lock(self, node: str) -> int:
        tokens = 4 if node == "a" and self.pin_device_match else 0
        self.pinned += tokens
        return tokens

    def unlock(self, tokens: int) -> None:
        self.pinned -= tokens

    def init_load_back(self, params: Any) -> tuple[int, str]:
        self.loaded = True  # the Full host hit and c's window come back (their pages are not the point here)
        return params.host_hit_length, params.best_match_node

    def load_back_is_cache_owned(self) -> bool:
        return False

    def finish_storage_prefetch_admission(self, *args: Any, **kwargs: Any) -> None:
        return None

    def discard_storage_prefetch_accounting(self, *args: Any, **kwargs: Any) -> None:
        return None


def reproduce_selection_pin_starves(rounds: int = 3) -> dict[str, Any]:
    """F5: 0.5.23's ``PrefillAdder.add_one_req`` on an idle pool, its real ``SWAPrefillBudget`` and allocator.

    P = 2, an SWA pool of 8 pages (16 tokens) of which the tree's two device nodes hold 4 (evictable), chunked
    prefill of 6 tokens. The request (15 tokens) matched ``"a"`` on device (``prefix_len`` 4, ``last_node`` "a")
    and the Full host prefix b, c (``host_hit_length`` 6, ``best_match_node`` "c"); its window is c's 4-token
    host tombstone (``swa_host_hit_length`` 4). ``add_one_req`` selects under ``_lock_node(req.last_node)``: the pin
    of a's window leaves ``remaining_swa`` 12, and the estimate of 5 tokens to extend plus the 4 to load back is
    12: refused, in every round. With a lock that does not pin a (whose SWA is outside the request's window) 16 are
    left and the same request is admitted.
    """
    from array import array

    from kvproof.conformance.adapters.sglang_admission import load_sglang_scheduler, publish_server_args

    sg = load_sglang_scheduler()
    publish_server_args(2)

    def one_round(tree: _PinTree) -> tuple[str, int, bool]:
        a = _sglang_allocator(size=1 << 12, size_swa=16, page_size=2)
        a.swa_attn_allocator.alloc(8)  # the SWA pages of the tree's two device nodes
        adder = sg.PrefillAdder(2, tree, a, None, 1.0, 1 << 20, 6)
        req = sg.Req("r", "", array("q", range(15)), sg.SamplingParams(max_new_tokens=0))
        req.refresh_fill_ids()
        req.prefix_len, req.last_node, req.best_match_node = 4, "a", "c"
        req.host_hit_length, req.swa_host_hit_length = 6, 4
        remaining = int(adder.memory_budget.remaining_swa)
        result = adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None)
        return result.name, remaining, req in adder.can_run_list

    pinned = [one_round(_PinTree()) for _ in range(rounds)]
    return {"pinned": pinned, "unpinned": one_round(_PinTree(pin_device_match=False))}
