"""vLLM 0.33.0's v1 KV cache manager over torch tensors: one block pool, a prefix cache, full + sliding-window groups.

kvproof's own implementation of component ``block_pool`` (docs/block_pool.md; vLLM's ``BlockPool``,
``FullAttentionManager``, ``SlidingWindowManager``, ``HybridKVCacheCoordinator`` and ``KVCacheManager`` with equal
block sizes), with the observable behaviour of ``kvproof.reference.block_pool`` on every call, the free-queue order
included (``EXACT_PAGE_ORDER``).

State (every tensor int64 unless said, on ``device``):

* ``ref_cnt [N]``: reference counts; the null block 0's is not maintained (stays 0, as in vLLM);
* ``rank [N]``: the free queue as an order key: a block is free iff its rank is not :data:`ABSENT`, the queue is
  the free blocks by ascending rank. ``popleft_n`` takes the ``n`` smallest ranks (``topk``); ``prepend_n`` gives
  ranks below the lowest ever given, in list order; ``append_n`` ranks above the highest ever given; a block that
  leaves the queue (handed out, touched by a hit) takes :data:`ABSENT`. The null block is never free;
* ``content [N, B]``: the token each block position was computed from (-1: unwritten), cleared when handed out;
* ``has_key [N]`` (bool): the block carries a prefix-cache key; the key itself is host metadata
  (``block_key[b]``, vLLM's ``KVCacheBlock.block_hash``), and the map ``cached`` is a dict from
  ``(group, token prefix)`` to block ids in insertion order (vLLM's ``BlockHashToBlockMap``);
* ``block_table [G, R, M]``: per group a row per request (``M = cdiv(max_model_len, B)``), 0 the null block,
  -1 past the request's blocks; rows are handed to requests from a free-row stack and the table doubles when full.
  Per request the host keeps its row, tokens computed, the leading null blocks of its sliding-window list and the
  blocks already hashed per group. Both groups always hold ``cdiv(computed, B)`` blocks.

Every operation checks its preconditions (the reference's, in its order, with its argument names) and the
capacity before it changes anything: misuse raises ``InvalidOperation``, a pool too small ``OutOfMemory``, and
the state is unchanged. The release of out-of-window blocks that vLLM's ``allocate_slots`` does before its
capacity check is counted, not done, until the check has passed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvproof.gpu_runtime.paged import resolve_device
from kvproof.reference.arith import ceil_div
from kvproof.reference.block_pool import (
    FULL,
    NULL_BLOCK,
    SWA,
    UNWRITTEN,
    BlockKey,
    BlockPoolConfig,
    BlockPoolSnapshot,
    Hit,
    require_cache,
    require_release,
    require_step,
)
from kvproof.reference.contract import Capability
from kvproof.reference.errors import OutOfMemory, ensure, require
from kvproof.reference.registry import Component

__all__ = ["ABSENT", "BlockPoolRuntime"]

Tensor = torch.Tensor
_I64 = torch.int64
#: the rank of a block that is not in the free queue
ABSENT = torch.iinfo(_I64).max
#: request rows the block table starts with (it doubles when they are all taken)
_INITIAL_ROWS = 8


@dataclass
class _Request:
    """Host metadata of a running request (the scheduler's side of vLLM's ``req_to_blocks``)."""

    row: int
    computed: int  # tokens computed: every group holds cdiv(computed, B) blocks
    num_cached: list[int]  # per group: blocks already hashed (vLLM's num_cached_block)
    nulls: int = 0  # leading null blocks of the sliding-window list (0 for full attention)


class BlockPoolRuntime:
    """The manager: lookups, all-or-nothing allocation over the groups, releases, caching, eviction, reset."""

    capabilities = frozenset({Capability.EXACT_PAGE_ORDER, Capability.REJECTS_MISUSE})
    components = frozenset({Component.BLOCK_POOL})

    def __init__(self, config: BlockPoolConfig, device: torch.device | str | None = None) -> None:
        self.config = config
        self.device = resolve_device(device)
        n, b = config.num_blocks, config.block_size
        self.block_size = b
        self.groups = config.groups
        self.max_blocks = ceil_div(config.max_model_len, b)
        self.ref_cnt = torch.zeros(n, dtype=_I64, device=self.device)
        self.rank = torch.arange(n, dtype=_I64, device=self.device)
        self.rank[NULL_BLOCK] = ABSENT  # BlockPool.__init__ pops block 0 as the null block
        self._front, self._back = 1, n - 1  # the lowest and the highest rank ever given
        self._num_free = n - 1
        self.content = torch.full((n, b), UNWRITTEN, dtype=_I64, device=self.device)
        self.has_key = torch.zeros(n, dtype=torch.bool, device=self.device)
        self.block_key: list[BlockKey | None] = [None] * n
        self.cached: dict[BlockKey, list[int]] = {}
        self.block_table = torch.full((len(self.groups), _INITIAL_ROWS, self.max_blocks), -1, dtype=_I64,
                                      device=self.device)
        self._free_rows = list(range(_INITIAL_ROWS - 1, -1, -1))
        self._requests: dict[int, _Request] = {}

    # ------------------------------------------------------------ queries

    def get_num_free_blocks(self) -> int:
        return self._num_free

    def free_queue(self) -> Tensor:
        """The free queue, front (next handed out) first."""
        return torch.sort(self.rank, stable=True).indices[:self._num_free]

    def snapshot(self) -> BlockPoolSnapshot:
        tables = self.block_table.tolist()
        requests, num_cached = {}, {}
        for r, q in self._requests.items():
            length = self._length(q)
            requests[r] = tuple(tuple(tables[g][q.row][:length]) for g in range(len(self.groups)))
            num_cached[r] = tuple(q.num_cached)
        return BlockPoolSnapshot(num_blocks=self.config.num_blocks, free=tuple(self.free_queue().tolist()),
                                 ref_cnt=tuple(self.ref_cnt.tolist()), block_key=tuple(self.block_key),
                                 cached={k: tuple(v) for k, v in self.cached.items()}, requests=requests,
                                 num_cached=num_cached)

    def get_computed_blocks(self, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> Hit:
        """The longest prefix-cache hit (``KVCacheManager.get_computed_blocks`` through the hybrid coordinator's
        one pass): full attention's run of cached blocks from the start, then the sliding window's rightmost run of
        ``cdiv(W - 1, B)`` cached blocks within it (or the run touching block 0), the full list cut to it."""
        op, b = "get_computed_blocks", self.block_size
        _check_tokens(op, tokens)
        toks = tuple(tokens)
        limit = len(toks) - 1 if max_cache_hit_length is None else max_cache_hit_length
        require(0 <= limit <= len(toks), op, "max_cache_hit_length",
                lambda: f"{limit} is not in [0, {len(toks)}] (the request's tokens)")
        full: list[int] = []
        for i in range(limit // b):
            ids = self.cached.get((FULL, toks[:(i + 1) * b]))
            if not ids:
                break
            full.append(ids[0])
        if self.config.sliding_window is None:
            return Hit(blocks=(tuple(full),), num_tokens=len(full) * b)
        window = self._window_hit(toks, len(full), self.config.sliding_window)
        return Hit(blocks=(tuple(full[:len(window)]), tuple(window)), num_tokens=len(window) * b)

    def _window_hit(self, toks: tuple[int, ...], max_blocks: int, window: int) -> list[int]:
        """``SlidingWindowManager.find_longest_cache_hit``: right to left, stop at ``need`` cached in a row."""
        b = self.block_size
        need = ceil_div(window - 1, b)
        run: list[int] = []  # the current run of cached blocks, right to left
        for i in range(max_blocks - 1, -1, -1):
            ids = self.cached.get((SWA, toks[:(i + 1) * b]))
            if not ids:
                run = []
                continue
            run.append(ids[0])
            if len(run) >= need:
                return [NULL_BLOCK] * i + run[::-1]  # the blocks left of the run are the null block
        return run[::-1]  # no run long enough: the one touching block 0 counts

    # ------------------------------------------------------------ allocation

    def allocate_slots(self, req: int, tokens: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                       hit: Hit | None = None, full_sequence_must_fit: bool = False) -> tuple[tuple[int, ...], ...]:
        """Slots for ``num_new_tokens`` more tokens of ``req`` (``KVCacheManager.allocate_slots``): the blocks
        taken from the free queue, per group. Checks everything (misuse, the admission gate, the capacity after the
        out-of-window release) before the release, the hit's join, the new blocks, the content and the caching."""
        op, cfg, b = "allocate_slots", self.config, self.block_size
        groups = self.groups
        running = self._requests.get(req)
        require_step(cfg, req, tokens, num_computed_tokens, num_new_tokens,
                     None if running is None else running.computed, hit)
        if running is None and hit is not None:
            self._check_hit(op, tokens, hit)
        hit_tokens = hit.num_tokens if hit is not None else 0
        computed = num_computed_tokens + hit_tokens
        total = computed + num_new_tokens

        # ---- what each group needs (single_type_kv_cache_manager.get_num_blocks_to_allocate), nothing changed yet
        held = self._length(running) if running is not None else 0
        empty: tuple[tuple[int, ...], ...] = ((),) * len(groups)
        hit_lists = hit.blocks if hit is not None and running is None else empty
        skipped = [self._skipped(g, computed) // b for g in groups]
        # per group: the hit blocks the request joins (past the skipped ones, not null), and how many of them have
        # count 0 (they leave the free queue when joined, so they count against the free blocks)
        joined = [[x for x in hit_lists[g][skipped[g]:] if x != NULL_BLOCK] for g in groups]
        evictable = [0] * len(groups)
        if any(joined):
            ids = torch.tensor([x for j in joined for x in j], dtype=_I64, device=self.device)
            zero = (self.ref_cnt.index_select(0, ids) == 0).tolist()
            start = 0
            for g in groups:
                evictable[g] = sum(zero[start:start + len(joined[g])])
                start += len(joined[g])

        def need(num_tokens: int, admission: bool) -> int:
            out = 0
            for g in groups:
                required = ceil_div(num_tokens, b)
                cap = self._admission_cap(g) if admission else None
                if cap is not None:
                    required = min(required, cap)
                if running is not None:
                    out += max(required - held, 0)
                else:
                    out += max(required - max(skipped[g], len(hit_lists[g])), 0) + self._charged_hit(evictable[g])
            return out

        if full_sequence_must_fit:
            gate = need(min(len(tokens), cfg.max_model_len), admission=True)
            if gate > self._num_free:
                raise OutOfMemory(op, "block", gate, self._num_free, request=req)
        release = self._release_plan(running, computed) if running is not None else None
        regained = 0
        if release is not None and release.numel():
            regained = int((self.ref_cnt.index_select(0, release) == 1).sum())
        wanted = need(total, admission=False)
        if wanted > self._num_free + regained:
            raise OutOfMemory(op, "block", wanted, self._num_free + regained, request=req)

        # ---- the step: release, join the hit (every group before any block is taken), take, write, cache
        if running is None:
            running = self._admit(req, computed, hit_lists, skipped, joined, sum(evictable))
        elif release is not None:
            self._release(running, release)
        length = self._length(running)
        count = max(ceil_div(total, b) - length, 0)  # every group holds cdiv(total, B) blocks after the step
        taken = self._get_new_blocks(count * len(groups)).view(len(groups), count)  # group 0's first (popleft order)
        if count:
            self.block_table[:, running.row, length:length + count] = taken
        self._write(running.row, tokens, computed, total)
        running.computed = total
        self._cache(running, tokens, total)
        return tuple(tuple(x) for x in taken.tolist())

    def _check_hit(self, op: str, tokens: Sequence[int], hit: Hit) -> None:
        """The hit is the current one: ``get_computed_blocks`` gives it now (the scheduler asks right before)."""
        require(len(hit.blocks) == len(self.groups), op, "hit",
                lambda: f"{len(hit.blocks)} block lists for {len(self.groups)} groups")
        require(hit.num_tokens < len(tokens), op, "hit", lambda: f"a hit of {hit.num_tokens} tokens leaves none of "
                f"the request's {len(tokens)} to compute")
        now = self.get_computed_blocks(tokens, hit.num_tokens)
        require(now == hit, op, "hit", lambda: f"stale hit {list(map(list, hit.blocks))} ({hit.num_tokens} tokens): "
                f"the prefix cache gives {list(map(list, now.blocks))} ({now.num_tokens} tokens) now")

    def _admit(self, req: int, computed: int, hit_lists: tuple[tuple[int, ...], ...], skipped: list[int],
               joined: list[list[int]], leaving: int) -> _Request:
        """``add_local_computed_blocks`` for every group: a row holding the hit, its skipped blocks null, the rest
        touched (count + 1, out of the free queue: ``leaving`` of them were in it)."""
        row = self._take_row()
        lists = [(NULL_BLOCK,) * skipped[g] + tuple(hit_lists[g][skipped[g]:]) for g in self.groups]
        ensure(all(len(x) == ceil_div(computed, self.block_size) for x in lists), "V5",
               lambda: f"hit lists of lengths {[len(x) for x in lists]} for {computed} tokens")
        for g, blocks in enumerate(lists):
            if blocks:
                self.block_table[g, row, :len(blocks)] = torch.tensor(blocks, dtype=_I64, device=self.device)
        ids = [x for j in joined for x in j]
        if ids:
            touched = torch.tensor(ids, dtype=_I64, device=self.device)
            self.rank[touched] = ABSENT  # those of count 0 leave the free queue (the others are not in it)
            self.ref_cnt.index_add_(0, touched, torch.ones_like(touched))
            self._num_free -= leaving
        nulls = len(lists[SWA]) - len(_trim_null_head(lists[SWA])) if len(lists) > 1 else 0
        q = _Request(row=row, computed=computed, num_cached=[len(x) for x in lists], nulls=nulls)
        self._requests[req] = q
        return q

    def _get_new_blocks(self, n: int) -> Tensor:
        """``popleft_n``: the ``n`` smallest ranks, out of the prefix cache, count 1, content cleared."""
        if n == 0:
            return torch.empty(0, dtype=_I64, device=self.device)
        taken = torch.topk(self.rank, n, largest=False, sorted=True).indices
        self._evict(taken)
        self.rank[taken] = ABSENT
        self.ref_cnt[taken] = 1
        self.content[taken] = UNWRITTEN
        self._num_free -= n
        return taken

    def _write(self, row: int, tokens: Sequence[int], start: int, end: int) -> None:
        """The step computes tokens ``[start, end)`` into the request's blocks (the null block is never written)."""
        if end <= start:
            return
        b = self.block_size
        pos = torch.arange(start, end, dtype=_I64, device=self.device)
        blocks = self.block_table[:, row, :].index_select(1, torch.div(pos, b, rounding_mode="floor"))  # [G, n]
        offset = (pos % b).expand_as(blocks)
        toks = torch.tensor(list(tokens[start:end]), dtype=_I64, device=self.device).expand_as(blocks)
        old = self.content[blocks, offset]
        self.content[blocks, offset] = torch.where(blocks != NULL_BLOCK, toks, old)

    def _cache(self, q: _Request, tokens: Sequence[int], num_tokens: int) -> None:
        """``cache_full_blocks`` per group: blocks ``[num_cached, full)`` not null get their key; ``num_cached``
        moves to ``full``."""
        b = self.block_size
        full = min(num_tokens, len(tokens)) // b
        if all(c >= full for c in q.num_cached):
            return
        toks = tuple(tokens)
        length = self._length(q)
        plan: list[tuple[int, BlockKey]] = []
        for g in self.groups:
            first, last = q.num_cached[g], min(full, length)
            if last <= first:
                continue
            row: list[int] = self.block_table[g, q.row, first:last].tolist()
            for i, x in enumerate(row, start=first):
                if x == NULL_BLOCK:
                    continue
                key = (g, toks[:(i + 1) * b])
                if self.block_key[x] == key or x in self.cached.get(key, ()):
                    continue
                # only a partial block promoted to full may carry a key already (not in this scope)
                if self.block_key[x] is not None:
                    ensure(False, "V4", f"cache_blocks: block {x} is cached already")
                plan.append((x, key))
        for x, key in plan:
            self.block_key[x] = key
            self.cached.setdefault(key, []).append(x)
        if plan:
            self.has_key[torch.tensor([x for x, _ in plan], dtype=_I64, device=self.device)] = True
        q.num_cached = [max(c, full) for c in q.num_cached]

    # ------------------------------------------------------------ releases

    def remove_skipped_blocks(self, req: int, num_computed_tokens: int) -> None:
        """Release the request's sliding-window blocks the window no longer reads (``remove_skipped_blocks``): the
        first ``skipped // B`` (at most the ones it holds), walked backwards to the first null block, each replaced
        by the null block and released in that order. Full attention skips nothing."""
        q = self._requests.get(req)
        require_release(req, num_computed_tokens, None if q is None else q.computed)
        if q is None:
            return
        release = self._release_plan(q, num_computed_tokens)
        if release is not None:
            self._release(q, release)

    def _release_plan(self, q: _Request, num_computed_tokens: int) -> Tensor | None:
        """The sliding-window blocks ``remove_skipped_blocks`` would release, in its (backward) order, or None."""
        if len(self.groups) < 2:
            return None
        k = min(self._skipped(SWA, num_computed_tokens) // self.block_size, self._length(q))
        if k <= q.nulls:
            return None
        return self.block_table[SWA, q.row, q.nulls:k].flip(0)

    def _release(self, q: _Request, blocks: Tensor) -> None:
        k = q.nulls + blocks.numel()
        self.block_table[SWA, q.row, q.nulls:k] = NULL_BLOCK
        q.nulls = k
        self._free_blocks(blocks)

    def free(self, req: int) -> None:
        """A finished or preempted request gives its blocks back, group by group, each without its leading null
        blocks and last first. A request holding nothing frees nothing."""
        q = self._requests.pop(req, None)
        if q is None:
            return
        length = self._length(q)
        for g in self.groups:
            first = q.nulls if g == SWA else 0
            # the slice is copied: the row is reset below
            self._free_blocks(self.block_table[g, q.row, first:length].flip(0))
        self.block_table[:, q.row, :] = -1
        self._free_rows.append(q.row)

    def _free_blocks(self, blocks: Tensor) -> None:
        """``BlockPool.free_blocks`` (distinct, non-null blocks, eviction order): count - 1; at 0 a block without a
        key is prepended (the first of them becomes the front), a cached one appended (evicted last)."""
        if not blocks.numel():
            return
        self.ref_cnt.index_add_(0, blocks, torch.full_like(blocks, -1))
        zero = self.ref_cnt.index_select(0, blocks) == 0
        keyed = self.has_key.index_select(0, blocks)
        first, last = blocks[zero & ~keyed], blocks[zero & keyed]
        n_first, n_last = first.numel(), last.numel()
        if n_first:
            self.rank[first] = torch.arange(self._front - n_first, self._front, dtype=_I64, device=self.device)
            self._front -= n_first
        if n_last:
            self.rank[last] = torch.arange(self._back + 1, self._back + 1 + n_last, dtype=_I64, device=self.device)
            self._back += n_last
        self._num_free += n_first + n_last

    # ------------------------------------------------------------ the prefix cache

    def cache_blocks(self, req: int, tokens: Sequence[int], num_tokens: int) -> None:
        """Cache the request's full blocks up to ``num_tokens`` (only computed tokens can be cached)."""
        q = self._requests.get(req)
        require_cache(req, tokens, num_tokens, None if q is None else q.computed)
        if q is not None:  # require_cache refuses a request holding nothing
            self._cache(q, tokens, num_tokens)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        """Drop blocks from the prefix cache by id: their keys and map entries go; counts and queue places stay."""
        op, n = "evict_blocks", self.config.num_blocks
        ids = torch.as_tensor(list(block_ids), dtype=_I64)
        bad = ids[(ids < 0) | (ids >= n)]
        require(not bad.numel(), op, "block_ids",
                lambda: f"{bad[:8].tolist()} are not block ids of a pool of {n} blocks")
        if ids.numel():
            self._evict(ids.to(self.device))

    def _evict(self, blocks: Tensor) -> None:
        """``_maybe_evict_cached_block`` for each of ``blocks``: those with a key leave the prefix cache (the key,
        the block's entry in the map)."""
        keyed = blocks[self.has_key.index_select(0, blocks)]
        if not keyed.numel():
            return
        for x in keyed.tolist():
            key = self.block_key[x]
            if key is None:  # named twice
                continue
            ids = self.cached[key]
            ids.remove(x)
            if not ids:
                del self.cached[key]
            self.block_key[x] = None
        self.has_key[keyed] = False

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, only when nothing but the null block is in use."""
        if self._num_free != self.config.num_blocks - 1:
            return False
        self.cached = {}
        self.block_key = [None] * self.config.num_blocks
        self.has_key.zero_()
        return True

    # ------------------------------------------------------------ helpers

    def _skipped(self, group: int, num_computed_tokens: int) -> int:
        """``get_num_skipped_tokens``: none for full attention, ``max(0, n - W + 1)`` for the window."""
        window = self.config.sliding_window
        if group == FULL or window is None:
            return 0
        return max(0, num_computed_tokens - window + 1)

    def _charged_hit(self, evictable: int) -> int:
        """Blocks of a joined hit charged against the free blocks: those of count 0, which leave the free queue when
        joined (``num_evictable_computed_blocks`` of ``get_num_blocks_to_allocate``)."""
        return evictable

    def _admission_cap(self, group: int) -> int | None:
        """``cdiv(min(W - 1 + T, L), B) + 1`` for the window, no cap for full attention."""
        window = self.config.sliding_window
        if group == FULL or window is None:
            return None
        return ceil_div(min(window - 1 + self.config.in_flight, self.config.max_model_len), self.block_size) + 1

    def _length(self, q: _Request) -> int:
        return ceil_div(q.computed, self.block_size)

    def _take_row(self) -> int:
        if not self._free_rows:
            rows = self.block_table.shape[1]
            grown = torch.full_like(self.block_table, -1)
            self.block_table = torch.cat([self.block_table, grown], dim=1)
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        return self._free_rows.pop()


def _trim_null_head(blocks: Sequence[int]) -> Sequence[int]:
    n = 0
    while n < len(blocks) and blocks[n] == NULL_BLOCK:
        n += 1
    return blocks[n:]


def _check_tokens(op: str, tokens: Sequence[int]) -> None:
    require(len(tokens) >= 1, op, "tokens", "a request has at least one token")
    require(min(tokens) >= 0, op, "tokens", "token ids are >= 0")
