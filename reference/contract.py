"""The contract an implementation meets to be checked by kvproof: capabilities and protocols.

It lives in the reference layer, below the torch runtime that fulfils it and the
conformance harness that checks it (README, "Architecture"). Tensors appear only in
annotations: this module does not import torch.

Every implementation declares ``capabilities`` (a frozenset of :class:`Capability`) and
may declare ``components`` (a frozenset of ``kvproof.reference.registry.Component``):
the suites it serves; without it, it serves any suite whose protocol it meets.

The SWA composite allocator (components ``swa_allocator``, ``loc_cache``, ``decode_prealloc``):

Method names and tensor conventions are SGLang's ``SWATokenToKVPoolAllocator`` /
``SWAKVPool`` (sglang_semantics.md §1.5, §2.7, §2.8), so SGLang's own classes fit
through a thin adapter. Two differences, both about *signalling*:

* failure is raised, never returned: ``OutOfMemory`` when a pool is short (state
  unchanged), ``InvalidOperation`` for misuse (state unchanged), both from
  ``kvproof.reference.errors``. An adapter turns SGLang's ``None`` into
  ``OutOfMemory``.
* the allocator reports what it holds through :meth:`snapshot`; the harness never
  reads private fields.

Index tensors are ``int64`` on ``device`` (``*_cpu`` twins on the CPU); KV tensors
are ``(n, head_num, head_dim)`` in the config's dtype. An implementation is built
by a factory ``Callable[[PoolConfig], SWAAllocatorUnderTest]`` and declares what it
supports in ``capabilities``: rules needing an undeclared capability are reported as
not applicable and counted, never silently skipped.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvproof.reference.admission import AddReqResult, AdmissionSetup, AdmissionSnapshot, ChunkedResult
from kvproof.reference.block_pool import BlockPoolConfig, BlockPoolSnapshot, Hit
from kvproof.reference.config import PoolConfig
from kvproof.reference.hisparse_host import HostPoolConfig, HostPoolSnapshot
from kvproof.reference.registry import Component
from kvproof.reference.snapshot import AllocatorSnapshot
from kvproof.reference.tp_prefetch import PhaseReport, RankProgress, TPPrefetchGroup, TPPrefetchSnapshot

if TYPE_CHECKING:
    import torch

__all__ = ["CALLER_OWNED_RESULTS", "PROTOCOLS", "AdmissionFactory", "AdmissionSystemUnderTest", "AllocatorFactory",
           "BlockPoolFactory", "BlockPoolUnderTest", "BudgetRequest", "Capability", "DecodeBudgetsUnderTest",
           "HostPoolFactory", "HostPoolUnderTest",
           "KVPoolUnderTest", "LocCacheSystemUnderTest", "SWAAllocatorUnderTest", "TPPrefetchFactory",
           "TPPrefetchUnderTest"]


class Capability(enum.StrEnum):
    """Optional parts of the contract; declared by the implementation, never sniffed."""

    ALLOC = "alloc"  # bulk alloc(need_size) in whole pages (SGLang: page_size == 1 only)
    ALLOC_EXTEND = "alloc_extend"
    ALLOC_DECODE = "alloc_decode"
    ALLOC_EXTEND_SWA_TAIL = "alloc_extend_swa_tail"
    FREE_FULL = "free_full"  # 0.5.23: release full slots whose SWA side is already released
    # free / free_swa accept slots whose SWA side is already released (M == 0) and skip them (SGLang at P > 1);
    # without it the harness frees such requests as free_swa(still mapped) + free_full(all)
    FREE_RELEASED_SWA = "free_released_swa"
    # hisparse_host: a backup batch the host pool cannot serve raises OutOfMemory having taken no page and
    # cleared no skip flag (kvproof); without it the harness cuts such batches to what either side serves alike
    ATOMIC_BACKUP_BATCH = "atomic_backup_batch"
    # 0.5.23 free groups (free_group_begin / free_group_end: releases held back until the end, §1.5a)
    FREE_GROUP = "free_group"
    # 0.5.23 kv-row segment releases: free_segment / free_swa_segment / free_full_segment / free_kv_row_segments
    FREE_SEGMENT = "free_segment"
    # decode_prealloc: the engine's own preallocation-queue budget functions on this allocator (decode_budgets)
    DECODE_BUDGETS = "decode_budgets"
    BACKUP_RESTORE = "backup_restore"  # backup_state / restore_state (gone in SGLang 0.5.23)
    CPU_COPY = "cpu_copy"  # get_cpu_copy / load_cpu_copy with swa_mask
    KV_BUFFER = "kv_buffer"  # get_kvcache().set_kv_buffer / get_kv_buffer
    REJECTS_MISUSE = "rejects_misuse"  # raises InvalidOperation for observable misuse, state unchanged
    EXACT_PAGE_ORDER = "exact_page_order"  # hands out pages in the reference's (SGLang 0.5.23) order
    SET_FULL_TO_SWA_MAPPING = "set_full_to_swa_mapping"  # re-attach SWA slots to live full slots
    # loc_cache (sglang_semantics.md §3): the engine-level hooks of LocCacheSystemUnderTest
    REGISTER_MAPPING = "register_mapping"  # a fresh mapping (all pages free) registered with the KV pool
    FORWARD = "forward"  # a forward pass writing every layer's KV through the (cached) translation
    GRAPH_CAPTURE = "graph_capture"  # capture run_once on static buffers; replay it
    # tp_prefetch: a commit's slot owners say who releases each host slot (freed at once, the release queue, the IO
    # thread); without it the harness compares them as "released" (an engine whose releases all end in one drain)
    SLOT_RELEASE_PATHS = "slot_release_paths"


@runtime_checkable
class KVPoolUnderTest(Protocol):
    """The KV buffers behind the allocator (``SWAKVPool``)."""

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write rows for full slots ``loc``; SWA layers write at ``translate(loc)``."""

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's whole K and V buffers, indexed by pool slot (SWA slots for SWA layers)."""


@runtime_checkable
class SWAAllocatorUnderTest(Protocol):
    """``SWATokenToKVPoolAllocator``'s surface, failure by exception, observation by snapshot."""

    capabilities: frozenset[Capability]
    device: str | torch.device

    def alloc(self, need_size: int) -> torch.Tensor: ...

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor: ...

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor,
                     last_loc: torch.Tensor) -> torch.Tensor: ...

    def alloc_req_slots(self, need_size: int) -> list[int]:
        """Ring configs only (``PoolConfig.swa_ring_size``): take request slots, each with its SWA ring
        (``ReqToTokenPool.alloc_rows``); ``OutOfMemory`` when too few are free."""

    def free_req_slots(self, indices: list[int]) -> None:
        """Ring configs only: give request slots back (``ReqToTokenPool.free_rows``)."""

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                              seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> torch.Tensor: ...

    def free(self, free_index: torch.Tensor) -> None: ...

    def free_swa(self, free_index: torch.Tensor) -> None: ...

    def free_full(self, free_index: torch.Tensor) -> None: ...

    def free_group_begin(self) -> None:
        """Capability ``FREE_GROUP``: hold releases back until :meth:`free_group_end`."""

    def free_group_end(self) -> None: ...

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """Capability ``FREE_SEGMENT``: release ``kv_row[start_pos : start_pos + n]`` of one request (§1.5a)."""

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None: ...

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None: ...

    def free_kv_row_segments(self, segments: list[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int,
                             swa_dead_lo: int = 0) -> None:
        """0.5.23 ``mem_cache.common.free_kv_row_segments`` on this allocator."""

    def clear(self) -> None: ...

    def backup_state(self) -> object: ...

    def restore_state(self, state: object) -> None: ...

    def available_size(self) -> int: ...

    def full_available_size(self) -> int: ...

    def swa_available_size(self) -> int: ...

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor: ...

    def get_cpu_copy(self, indices: torch.Tensor) -> object: ...

    def load_cpu_copy(self, kv_cache_cpu: object, indices: torch.Tensor) -> None: ...

    def get_kvcache(self) -> KVPoolUnderTest: ...

    def snapshot(self) -> AllocatorSnapshot: ...

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        """``M[full] = swa`` (HiCache load-back); the live mapping must stay well formed."""


@runtime_checkable
class LocCacheSystemUnderTest(SWAAllocatorUnderTest, Protocol):
    """An allocator whose KV pool translates full -> SWA locations through a cache (component ``loc_cache``).

    ``translate_loc_from_full_to_swa`` (on the allocator and on ``get_kvcache()``) may
    memoise; ``forward`` / ``capture`` / ``replay`` are the engine's hooks (model runner
    and CUDA-graph runner) and carry its invalidation points. Index tensors the harness
    passes live in memory whose addresses it controls, so address reuse is
    reproducible. Whatever the implementation caches, every translation it returns
    must equal ``M[contents]`` at that moment, provided the caller keeps contract E1
    (``kvproof.reference.loc_cache``).
    """

    def register_mapping(self) -> None:
        """Replace the mapping with a fresh one (every page free) and register it with the KV pool."""

    def forward(self, out_cache_loc: torch.Tensor, cache_k: dict[int, torch.Tensor],
                cache_v: dict[int, torch.Tensor]) -> None:
        """One forward: the per-forward hook, then each layer's ``set_kv_buffer`` (``cache_k``) at ``out_cache_loc``."""

    def capture(self, static_loc: torch.Tensor, static_k: dict[int, torch.Tensor],
                static_v: dict[int, torch.Tensor]) -> None:
        """Warm up and capture ``run_once`` (each layer's ``set_kv_buffer`` from the static buffers at
        ``static_loc``); ``static_loc`` holds padding (0) while capturing. Replaces an earlier graph."""

    def replay(self) -> None:
        """A forward that replays the captured graph on the static buffers' current contents."""


AllocatorFactory = Callable[[PoolConfig], SWAAllocatorUnderTest]


@runtime_checkable
class HostPoolUnderTest(Protocol):
    """Component ``hisparse_host`` (sglang_semantics.md §4): the host pool, its request table, the coordinator.

    Method names are SGLang's (``HiSparseHostPoolMixin``, ``HiSparseCoordinator``);
    request slots index ``req_to_host_pool``. Host slots are int64; values are one
    int64 per host slot (the stand-in for KV rows). Declared capabilities:
    ``REJECTS_MISUSE`` (holes, rows too short, slots out of range raise
    ``InvalidOperation``), ``EXACT_PAGE_ORDER`` (FIFO hand-out exactly as SGLang).
    """

    capabilities: frozenset[Capability]
    device: torch.device

    def available_size(self) -> int: ...

    def alloc_paged_token_slots(self, req: int, start_pos: int, num_tokens: int) -> torch.Tensor: ...

    def allocated_host_indices(self, req: int) -> torch.Tensor: ...

    def request_finished(self, req: int) -> None: ...

    def admit_request_into_staging(self, req: int, values: torch.Tensor) -> torch.Tensor: ...

    def eager_backup_previous_token(self, reqs: torch.Tensor, seq_lens: torch.Tensor,
                                    values: torch.Tensor) -> torch.Tensor: ...

    def get_host_data(self, slots: torch.Tensor) -> torch.Tensor: ...

    def snapshot(self) -> HostPoolSnapshot: ...


HostPoolFactory = Callable[[HostPoolConfig], HostPoolUnderTest]


@runtime_checkable
class BlockPoolUnderTest(Protocol):
    """Component ``block_pool`` (docs/block_pool.md): a request-level KV cache manager over one block pool with a
    null block, a prefix cache, a full-attention group and optionally a sliding-window group.

    Method names and arguments are vLLM 0.33.0's ``KVCacheManager`` ones in kvproof's terms: a request is an
    ``int`` id with its token ids passed in (the scheduler owns them, as vLLM's ``Request``); block lists are per
    group, group 0 full attention, group 1 the sliding window; block 0 is the null block. Failure is raised:
    ``OutOfMemory`` where vLLM's ``allocate_slots`` returns ``None`` (state unchanged once
    ``remove_skipped_blocks`` ran), ``InvalidOperation`` for misuse. ``snapshot`` reports block keys as
    ``(group, token prefix)``: an implementation hashing blocks maps its hashes back to the prefixes they cover.
    Declared capabilities: ``EXACT_PAGE_ORDER`` (the free queue in vLLM's order), ``REJECTS_MISUSE``.
    """

    capabilities: frozenset[Capability]

    def get_computed_blocks(self, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> Hit: ...

    def allocate_slots(self, req: int, tokens: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                       hit: Hit | None = None, full_sequence_must_fit: bool = False
                       ) -> tuple[tuple[int, ...], ...]: ...

    def remove_skipped_blocks(self, req: int, num_computed_tokens: int) -> None: ...

    def free(self, req: int) -> None: ...

    def cache_blocks(self, req: int, tokens: Sequence[int], num_tokens: int) -> None: ...

    def evict_blocks(self, block_ids: Sequence[int]) -> None: ...

    def reset_prefix_cache(self) -> bool: ...

    def get_num_free_blocks(self) -> int: ...

    def snapshot(self) -> BlockPoolSnapshot: ...


BlockPoolFactory = Callable[[BlockPoolConfig], BlockPoolUnderTest]

@runtime_checkable
class AdmissionSystemUnderTest(Protocol):
    """Component ``admission`` (sglang_semantics.md §5): a prefill scheduler's SWA admission over a HiCache tree.

    Built from an :class:`~kvproof.reference.admission.AdmissionSetup` (pool, policy, the cached tree). Method
    names and arguments are the operations of ``kvproof.reference.admission`` without the state: requests are
    rids in arrival order, nodes indices in the tree's order (a split appends the root-side rest). Failure is
    raised: ``OutOfMemory`` when load-back or the round's allocation is short (state unchanged),
    ``InvalidOperation`` for misuse. :meth:`snapshot` reports the decision state in the reference's terms and the
    SWA pages behind it. ``Capability.REJECTS_MISUSE``: misuse is rejected with ``InvalidOperation``.

    Chunked prefill: a request admitted as a chunk runs it (``prepare_for_extend``); with prompt left,
    ``cache_unfinished_req`` (between rounds) grows its prefix and frees its own out-of-window pages; the next
    round's ``add_chunked_req`` (first in the round) adds its next chunk or defers it; ``cache_finished_req`` only
    once its prompt is done.
    """

    capabilities: frozenset[Capability]
    device: torch.device

    def arrive(self, prompt_len: int, max_new_tokens: int, node: int) -> int: ...

    def get_new_batch_prefill(self) -> None: ...

    def match_prefix_for_req(self, rid: int) -> None: ...

    def add_one_req(self, rid: int) -> AddReqResult: ...

    def init_load_back(self, rid: int) -> int: ...

    def add_chunked_req(self, rid: int) -> ChunkedResult: ...

    def prepare_for_extend(self) -> None: ...

    def evict(self, num_pages: int) -> None: ...

    def cache_unfinished_req(self, rid: int) -> None: ...

    def cache_finished_req(self, rid: int) -> None: ...

    def snapshot(self) -> AdmissionSnapshot: ...


AdmissionFactory = Callable[[AdmissionSetup], AdmissionSystemUnderTest]


@runtime_checkable
class TPPrefetchUnderTest(Protocol):
    """Component ``tp_prefetch`` (sglang_semantics.md §6): one L3 prefetch at a time on a tensor-parallel group.

    Built from a :class:`~kvproof.reference.tp_prefetch.TPPrefetchGroup` (world size, geometry, the host path every
    rank starts from, the protocol variant). Each rank holds its own host tree and host pools (in its own process,
    for a real group). One check of a prefetch is :meth:`initial_state` (the request and each rank's progress) and
    the five operations of ``kvproof.reference.tp_prefetch`` in order; each returns a
    :class:`~kvproof.reference.tp_prefetch.PhaseReport`: the collectives every rank made (its packed values and
    the reduced result), a mismatched collective naming the ranks and shapes (within a bounded time: never a
    hang), each rank's termination decision and commit. A check that waits (no rank terminates) keeps the
    prefetch's buffers; the next :meth:`initial_state` continues the same request. After a mismatch the group is
    unusable: the harness builds a new implementation. :meth:`close` stops every rank (idempotent).
    """

    capabilities: frozenset[Capability]
    world_size: int

    def initial_state(self, request_pages: int, ranks: Sequence[RankProgress]) -> None: ...

    def sync_prefetch_hit_query(self) -> PhaseReport: ...

    def page_transfer(self) -> PhaseReport: ...

    def can_terminate_prefetch(self) -> PhaseReport: ...

    def reduce_prefetch_ack(self) -> PhaseReport: ...

    def handle_prefetch_result(self) -> PhaseReport: ...

    def snapshot(self) -> TPPrefetchSnapshot: ...

    def close(self) -> None: ...


TPPrefetchFactory = Callable[[TPPrefetchGroup], TPPrefetchUnderTest]

#: A decode-node request as the budget functions see it: (prompt length, outputs so far, max_new_tokens).
BudgetRequest = tuple[int, int, int]


@runtime_checkable
class DecodeBudgetsUnderTest(Protocol):
    """Capability ``DECODE_BUDGETS`` of a ``decode_prealloc`` allocator: the engine's own preallocation-queue budget
    functions, evaluated on this allocator's pools as they stand (sglang_semantics.md §2.3-§2.5)."""

    def decode_budgets(self, running: list[BudgetRequest], retracted: list[BudgetRequest],
                       queued: list[BudgetRequest], *, reserved_decode_tokens: int,
                       sliding_window_size: int) -> dict[str, object]:
        """``{"clip": CLIP, "budgets": (full, swa or None), "requests": [{"fill_len", "swa_tail_len",
        "swa_retractable_len", "prealloc_kv_lens", "prealloc_required_tokens"} per request of running + retracted +
        queued, in that order]}``; a retracted or queued request's entry also has its admission decision on the pools
        as they stand: ``"reservation_fits"`` (the resume round's, resp. the next ``pop_preallocated`` round's,
        reservation test), ``"reclaim_called"`` (whether admitting it reclaims SWA room for its tail first) and
        ``"reclaim"`` (that reclaim's answer: ``None`` when ready or not called, else ``{"needed": page-rounded tail,
        "available": free SWA tokens after evicting, ...}``)."""

#: The protocols an implementation of each component meets (an allocator's KV pool included): every
#: lockstep operation that acts on the implementation is a method of one of them (tests/test_registry.py).
PROTOCOLS: dict[Component, tuple[type, ...]] = {
    Component.SWA_ALLOCATOR: (SWAAllocatorUnderTest, KVPoolUnderTest),
    Component.LOC_CACHE: (LocCacheSystemUnderTest, KVPoolUnderTest),
    Component.DECODE_PREALLOC: (SWAAllocatorUnderTest, KVPoolUnderTest),
    Component.HISPARSE_HOST: (HostPoolUnderTest,),
    Component.ADMISSION: (AdmissionSystemUnderTest,),
    Component.TP_PREFETCH: (TPPrefetchUnderTest,),
    Component.BLOCK_POOL: (BlockPoolUnderTest,),
}

#: Methods that only report: they do not change what ``snapshot()`` reports (the lockstep harness takes one snapshot
#: between two calls that may change it). ``translate_loc_from_full_to_swa`` may fill the loc cache: a memo, not state.
QUERIES: frozenset[str] = frozenset({
    "snapshot", "available_size", "full_available_size", "swa_available_size", "get_kvcache", "get_kv_buffer",
    "translate_loc_from_full_to_swa", "allocated_host_indices", "get_host_data", "get_computed_blocks",
    "get_num_free_blocks",
})

#: Methods that hand the caller index tensors it owns from then on: no later call may write into what they
#: returned (the harness keeps a copy and compares, kvproof.conformance.custody). Live views of the
#: implementation's state are not among them: ``get_kv_buffer``, ``allocated_host_indices``, and
#: ``alloc_paged_token_slots`` / ``admit_request_into_staging``, which return a view of the request's row of
#: ``req_to_host_pool`` as upstream does (sglang_semantics.md §4.2; ``request_finished`` resets it to -1);
#: nor are data reads (``get_host_data``, ``get_cpu_copy``). A result sharing storage with an argument is exempt.
CALLER_OWNED_RESULTS: frozenset[str] = frozenset({
    "alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "translate_loc_from_full_to_swa",
    "eager_backup_previous_token",
})
