"""Deliberately broken variants of kvproof's torch block pool (vLLM 0.33.0's v1 KV cache manager, docs/block_pool.md).

Each mutant is a subclass of :class:`~kvproof.gpu_runtime.block_pool.BlockPoolRuntime` with one small override
reproducing a bug class of vLLM's manager (docs/block_pool.md §5): the null block put into circulation, the free
queue's prepend/append rule broken, a hash kept past a block's reuse (stale hits), the window's skip off by one, a
hybrid allocation that takes one group's blocks before the other's check, a duplicate free accepted, a lookup that
trusts an index eviction never updates, the admission gate charging the whole sequence to the sliding-window group
(#39734), the tail freed first-to-last, and the capacity count without the joined hit's free blocks. The
``block_pool`` lockstep suite must kill every one (``kvproof mutants``); ``tests/conformance/test_block_pool.py``
also runs the short differing sequence named in each docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvproof.gpu_runtime.block_pool import ABSENT, BlockPoolRuntime
from kvproof.reference.arith import ceil_div
from kvproof.reference.block_pool import NULL_BLOCK, SWA, BlockKey, Hit
from kvproof.reference.errors import OutOfMemory

__all__ = ["MUTANTS"]

Tensor = torch.Tensor
_I64 = torch.int64


class NullBlockFreed(BlockPoolRuntime):
    """``free`` releases the sliding-window list with its leading null blocks (no ``trim_null_head``): the null
    block enters the free queue and is later handed out as a real block (V3).
    Differs: B=1, W=3: 4 tokens, ``remove_skipped_blocks`` to 4, ``free``: the queue's front is block 0."""

    def free(self, req: int) -> None:
        q = self._requests.get(req)
        nulls = q.nulls if q is not None else 0
        super().free(req)
        if nulls and self.rank[NULL_BLOCK] == ABSENT:
            self._front -= 1
            self.rank[NULL_BLOCK] = self._front
            self._num_free += 1


class UncachedAppended(BlockPoolRuntime):
    """``free_blocks`` appends every block of count 0, uncached ones too (no LIFO reuse): the next allocation takes
    another block than vLLM's. Differs: 3 tokens at B=4 freed: the block goes to the back of the queue."""

    def _free_blocks(self, blocks: Tensor) -> None:
        if not blocks.numel():
            return
        self.ref_cnt.index_add_(0, blocks, torch.full_like(blocks, -1))
        last = blocks[self.ref_cnt.index_select(0, blocks) == 0]
        if last.numel():
            self.rank[last] = torch.arange(self._back + 1, self._back + 1 + last.numel(), dtype=_I64,
                                           device=self.device)
            self._back += last.numel()
            self._num_free += last.numel()


class KeyKeptOnReuse(BlockPoolRuntime):
    """``get_new_blocks`` does not evict the popped block from the prefix cache: its old key still maps to it while
    a new request writes other tokens into it; a later lookup of the old prefix reads them (V6/V7, the stale-hash
    class). Differs: B=2, 2 blocks: cache [1, 2, 3], free, allocate [7, 8, 9]: block 1 keeps the key of [1, 2]."""

    def _get_new_blocks(self, n: int) -> Tensor:
        if n == 0:
            return torch.empty(0, dtype=_I64, device=self.device)
        taken = torch.topk(self.rank, n, largest=False, sorted=True).indices
        self.rank[taken] = ABSENT
        self.ref_cnt[taken] = 1
        self.content[taken] = -1
        self._num_free -= n
        return taken


class WindowSkipOffByOne(BlockPoolRuntime):
    """``get_num_skipped_tokens`` as ``max(0, n - W + 2)``: one token too many leaves the window, so a block the
    next token still attends to is released. Differs: B=1, W=3: after 3 tokens two blocks are null, not one."""

    def _skipped(self, group: int, num_computed_tokens: int) -> int:
        window = self.config.sliding_window
        if group == SWA and window is not None:
            return max(0, num_computed_tokens - window + 2)
        return super()._skipped(group, num_computed_tokens)


class FullGroupFirst(BlockPoolRuntime):
    """A hybrid allocation that takes the full-attention group's blocks before checking the sliding-window group
    (not all or nothing): when the pool holds enough for the first group only, those blocks are taken and leaked
    as the call fails (the "Cannot get N free blocks" class). Differs: a pool one block short of a decode step that
    opens a block in both groups."""

    def allocate_slots(self, req: int, tokens: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                       hit: Hit | None = None, full_sequence_must_fit: bool = False) -> tuple[tuple[int, ...], ...]:
        try:
            return super().allocate_slots(req, tokens, num_computed_tokens, num_new_tokens, hit,
                                          full_sequence_must_fit)
        except OutOfMemory:
            q = self._requests.get(req)
            if q is not None and len(self.groups) > 1:
                count = ceil_div(num_computed_tokens + num_new_tokens, self.block_size) - self._length(q)
                if 0 < count <= self._num_free:
                    self._get_new_blocks(count)  # the full group's blocks, then the window's check fails
            raise


class DuplicateFreeAccepted(BlockPoolRuntime):
    """A second ``free`` of a finished request releases its blocks again (its block list kept after the first):
    counts go below zero or another owner's block is released (V2/V3, the free-queue corruption class).
    Differs: allocate 3 tokens, ``free`` twice: block 1's count is -1."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._released: dict[int, Tensor] = {}

    def free(self, req: int) -> None:
        q = self._requests.get(req)
        if q is None:
            again = self._released.pop(req, None)
            if again is not None:
                self._free_blocks(again)
            return
        length = self._length(q)
        held = torch.cat([self.block_table[g, q.row, (q.nulls if g == SWA else 0):length].flip(0)
                          for g in self.groups])
        super().free(req)
        self._released[req] = held


class StaleLookup(BlockPoolRuntime):
    """Lookups go through an index of every key ever cached, never pruned when a key is evicted or its block
    reused: a hit returns a block that now holds other tokens (hit soundness, V6).
    Differs: cache a prefix, ``evict_blocks`` it, look it up again: a hit of the evicted block."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._ever: dict[BlockKey, list[int]] = {}

    def _cache(self, q: object, tokens: Sequence[int], num_tokens: int) -> None:
        super()._cache(q, tokens, num_tokens)  # type: ignore[arg-type]
        for key, ids in self.cached.items():
            self._ever.setdefault(key, list(ids))

    def get_computed_blocks(self, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> Hit:
        live = self.cached
        self.cached = {**self._ever, **live}
        try:
            return super().get_computed_blocks(tokens, max_cache_hit_length)
        finally:
            self.cached = live

    def _check_hit(self, op: str, tokens: Sequence[int], hit: Hit) -> None:
        return None  # the stale hit is taken as given


class UncappedAdmission(BlockPoolRuntime):
    """The admission gate charges the whole sequence to the sliding-window group (no
    ``max_admission_blocks_per_request`` cap): a request that fits is refused (#39734's deadlock class).
    Differs: B=3, W=5, T=4, 15 tokens on 9 free blocks: refused, the reference admits it (5 + 4 blocks)."""

    def _admission_cap(self, group: int) -> int | None:
        return None


class FreeHitUncharged(BlockPoolRuntime):
    """The capacity count leaves out the hit blocks of count 0 (``get_num_blocks_to_allocate`` without
    ``num_evictable_computed_blocks``): joining them takes them off the free queue, so an allocation the count passed
    runs out of blocks half done. Differs: B=2, 5 blocks: request 1 (5 tokens) cached and freed, request 2 takes 2
    blocks, request 3 (7 tokens) hits request 1's 2 full blocks and needs 2 more: the reference refuses (2 new + 2
    joined > 2 free), the mutant admits it and hands it a block of its own hit (the free queue then holds the null
    block)."""

    def _charged_hit(self, evictable: int) -> int:
        return 0


class FreeInOrder(BlockPoolRuntime):
    """``free`` releases a request's blocks first to last (not reversed): its head, not its tail, is reused or
    evicted first. Differs: 6 tokens at B=2 freed: the cached blocks are appended as [1, 2, 3], not [3, 2, 1]."""

    def _free_blocks(self, blocks: Tensor) -> None:
        super()._free_blocks(blocks.flip(0))


MUTANTS = {
    "null_block_freed": NullBlockFreed,
    "uncached_appended": UncachedAppended,
    "key_kept_on_reuse": KeyKeptOnReuse,
    "window_skip_off_by_one": WindowSkipOffByOne,
    "full_group_first": FullGroupFirst,
    "duplicate_free_accepted": DuplicateFreeAccepted,
    "stale_lookup": StaleLookup,
    "uncapped_admission": UncappedAdmission,
    "free_in_order": FreeInOrder,
    "free_hit_uncharged": FreeHitUncharged,
}
