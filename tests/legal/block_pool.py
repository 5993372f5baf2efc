"""A legal vLLM-style KV cache manager (component ``block_pool``) written from the contract, not from kvproof's runtime.

Written from ``BlockPoolUnderTest`` (kvproof.reference.contract) and docs/block_pool.md (vLLM 0.33.0's v1
``KVCacheManager`` over one ``BlockPool``, a ``FullAttentionManager`` and optionally a ``SlidingWindowManager``):

* blocks ``0..N-1``; block 0 is the null block: never handed out, never free, never cached, its count not kept
  (§1.1); it stands in a sliding-window list for every block left of the window;
* reference counts shared through prefix hits (§1.3); a block of count 0 is free, and if it carries a key it stays
  in the prefix cache (an eviction candidate a hit revives) until it is handed out again or evicted (§1.2, §2.4);
* the prefix cache keyed ``(group, token prefix)`` (:func:`block_key`, §1.5), several blocks per key allowed (§1.4);
* the hit of §2.1: full attention's longest cached run from block 0 within ``len(tokens) - 1`` tokens, then the
  window's right-to-left search for ``contiguous_blocks_for_hit`` cached blocks in a row (null blocks left of it; a
  shorter run touching block 0 counts), the full group cut to the window's hit;
* ``allocate_slots`` (§2.2): the admission gate (``full_sequence_must_fit``, the window group charged at most
  ``max_admission_blocks_per_request``), the out-of-window release of a running request, what every group needs
  summed before any block is taken (``OutOfMemory``, nothing changed), the hit joined in every group, new blocks,
  the full blocks of the tokens computed cached eagerly;
* ``remove_skipped_blocks`` (§2.7), ``free`` (§2.6: group by group, tail first, the null head dropped),
  ``cache_blocks`` (§2.5), ``evict_blocks`` (§2.8), ``reset_prefix_cache`` (§2.9).

Block reuse is the policy parameter (vLLM's free queue order is not part of the contract without
``EXACT_PAGE_ORDER``): :func:`fifo` hands out the block that became free longest ago (initially ids 1..N-1 in
order) and a lookup returns the earliest block cached under a key; :func:`lifo` the most recently freed block and
the latest cached one; :func:`randomized` a seeded random free block and a random one of the key's blocks. Neither
``EXACT_PAGE_ORDER`` nor ``REJECTS_MISUSE`` is declared: arguments are checked only where a mistake would corrupt
the state.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence

from kvproof.reference.arith import ceil_div
from kvproof.reference.block_pool import (
    FULL,
    NULL_BLOCK,
    SWA,
    BlockKey,
    BlockPoolConfig,
    BlockPoolSnapshot,
    Hit,
    block_key,
    contiguous_blocks_for_hit,
    get_num_skipped_tokens,
    max_admission_blocks_per_request,
)
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.registry import Component

from .swa_allocator import Policy, config_seed

__all__ = ["LegalBlockPool", "fifo", "lifo", "randomized"]


class _Request:
    """A request holding blocks: per group its block list (null blocks at a window list's head) and how many leading
    blocks are hashed already."""

    __slots__ = ("blocks", "num_cached")

    def __init__(self, groups: int) -> None:
        self.blocks: list[list[int]] = [[] for _ in range(groups)]
        self.num_cached: list[int] = [0] * groups


class LegalBlockPool:
    """One block pool, its prefix cache and the requests' block tables, with a block-reuse policy."""

    capabilities: frozenset[Capability] = frozenset()
    components = frozenset({Component.BLOCK_POOL})
    device = "cpu"

    def __init__(self, config: BlockPoolConfig, policy: Policy = Policy.FIFO, seed: int = 0) -> None:
        self.config, self.policy = config, policy
        self.version = f"legal-{policy.value}"
        self.b, self.n = config.block_size, config.num_blocks
        self.groups = config.groups
        self._rng = random.Random(seed)
        # free blocks in the order they became free (a dict as an ordered set): the oldest first
        self._free: dict[int, None] = dict.fromkeys(range(1, self.n))
        self._ref = [0] * self.n
        self._key: list[BlockKey | None] = [None] * self.n
        self._cached: dict[BlockKey, list[int]] = {}  # key -> its blocks, in the order they were cached
        self._requests: dict[int, _Request] = {}

    # ------------------------------------------------------------ the pool

    def _pick_free(self) -> int:
        """The free block the policy hands out next."""
        if self.policy is Policy.FIFO:
            return next(iter(self._free))
        if self.policy is Policy.LIFO:
            return next(reversed(self._free))
        return self._rng.choice(list(self._free))

    def _pick_cached(self, blocks: Sequence[int]) -> int:
        """Which of the blocks cached under one key a lookup returns."""
        if self.policy is Policy.FIFO:
            return blocks[0]
        if self.policy is Policy.LIFO:
            return blocks[-1]
        return self._rng.choice(list(blocks))

    def _uncache(self, block: int) -> None:
        """The block leaves the prefix cache (its key and its place under the key); count and freedom unchanged."""
        key = self._key[block]
        if key is None:
            return
        rest = [x for x in self._cached.get(key, []) if x != block]
        if rest:
            self._cached[key] = rest
        else:
            self._cached.pop(key, None)
        self._key[block] = None

    def _get_new_blocks(self, k: int) -> list[int]:
        """``k`` free blocks (the caller checked they exist), each evicted from the prefix cache, count 1."""
        taken = []
        for _ in range(k):
            x = self._pick_free()
            del self._free[x]
            self._uncache(x)
            self._ref[x] = 1
            taken.append(x)
        return taken

    def _touch(self, blocks: Iterable[int]) -> None:
        """A hit joins the blocks: a free one leaves the free set (keeping its key), every count + 1."""
        for x in blocks:
            if x == NULL_BLOCK:
                continue
            if self._ref[x] == 0:
                del self._free[x]
            self._ref[x] += 1

    def _free_blocks(self, ordered: Iterable[int]) -> None:
        """Count - 1 in order; a block reaching 0 becomes free (the newest free block), cached or not."""
        for x in ordered:
            if x == NULL_BLOCK:
                continue
            self._ref[x] -= 1
            if self._ref[x] == 0:
                self._free[x] = None

    # ------------------------------------------------------------ the prefix cache lookup (§2.1)

    def _lookup(self, group: int, tokens: Sequence[int], index: int) -> int | None:
        blocks = self._cached.get(block_key(group, tokens, index, self.b))
        return self._pick_cached(blocks) if blocks else None

    def get_computed_blocks(self, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> Hit:
        limit = len(tokens) - 1 if max_cache_hit_length is None else max_cache_hit_length
        full: list[int] = []
        for i in range(max(limit, 0) // self.b):
            x = self._lookup(FULL, tokens, i)
            if x is None:
                break
            full.append(x)
        if self.config.sliding_window is None:
            return Hit(blocks=(tuple(full),), num_tokens=len(full) * self.b)
        need = contiguous_blocks_for_hit(self.config.sliding_window, self.b)
        window = [NULL_BLOCK] * len(full)
        run, end = 0, None
        for i in range(len(window) - 1, -1, -1):
            x = self._lookup(SWA, tokens, i)
            if x is None:
                run = 0
                continue
            window[i] = x
            run += 1
            if run >= need:
                end = i + run
                break
        window = window[:run if end is None else end]
        return Hit(blocks=(tuple(full[:len(window)]), tuple(window)), num_tokens=len(window) * self.b)

    # ------------------------------------------------------------ allocation (§2.2-§2.4, §3.4)

    def _needed(self, group: int, req: int, num_tokens: int, hit: Sequence[int], computed: int,
                cap: int | None) -> int:
        """Blocks ``group`` takes from the free set: new ones past what the request (and its hit) covers, plus the hit
        blocks that are free now (joining them takes them out of the free set)."""
        required = ceil_div(num_tokens, self.b)
        if cap is not None:
            required = min(required, cap)
        running = self._requests.get(req)
        if running is not None:
            return max(required - len(running.blocks[group]), 0)
        skipped = get_num_skipped_tokens(self.config, group, computed) // self.b
        new = max(required - max(skipped, len(hit)), 0)
        return new + sum(1 for x in hit[skipped:] if x != NULL_BLOCK and self._ref[x] == 0)

    def allocate_slots(self, req: int, tokens: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                       hit: Hit | None = None, full_sequence_must_fit: bool = False
                       ) -> tuple[tuple[int, ...], ...]:
        op, cfg = "allocate_slots", self.config
        running = self._requests.get(req)
        if running is not None and hit is not None and (hit.num_tokens or any(hit.blocks)):
            raise InvalidOperation(op, "hit", f"request {req} is running: it takes no prefix-cache hit")
        hit_tokens = hit.num_tokens if hit is not None and running is None else 0
        if num_new_tokens <= 0 and hit_tokens == 0:
            raise InvalidOperation(op, "num_new_tokens", "must be > 0 when there are no computed tokens to adopt")
        hit_blocks: tuple[tuple[int, ...], ...] = (
            hit.blocks if hit is not None and running is None and hit.blocks else ((),) * len(self.groups))
        if len(hit_blocks) != len(self.groups):
            raise InvalidOperation(op, "hit", f"{len(hit_blocks)} block lists for {len(self.groups)} groups")
        computed = num_computed_tokens + hit_tokens
        total = min(computed + num_new_tokens, cfg.max_model_len)
        if full_sequence_must_fit:  # the admission gate: the whole sequence, the window group capped
            whole = min(len(tokens), cfg.max_model_len)
            need = sum(self._needed(g, req, whole, hit_blocks[g], computed, max_admission_blocks_per_request(cfg, g))
                       for g in self.groups)
            if need > len(self._free):
                raise OutOfMemory(op, "block", need, len(self._free), request=req)
        if running is not None:  # vLLM releases out-of-window blocks before the capacity check
            self.remove_skipped_blocks(req, computed)
        need = sum(self._needed(g, req, total, hit_blocks[g], computed, None) for g in self.groups)
        if need > len(self._free):
            raise OutOfMemory(op, "block", need, len(self._free), request=req)
        if running is None:  # join the hit in every group before any group takes a block
            running = _Request(len(self.groups))
            for g in self.groups:
                skipped = get_num_skipped_tokens(cfg, g, computed) // self.b
                kept = list(hit_blocks[g][skipped:])
                self._touch(kept)
                running.blocks[g] = [NULL_BLOCK] * skipped + kept
                running.num_cached[g] = len(running.blocks[g])
            self._requests[req] = running
        new = []
        for g in self.groups:
            taken = self._get_new_blocks(max(ceil_div(total, self.b) - len(running.blocks[g]), 0))
            running.blocks[g] += taken
            new.append(tuple(taken))
        self._cache(running, tokens, min(computed + num_new_tokens, len(tokens)))
        return tuple(new)

    # ------------------------------------------------------------ release and caching (§2.5-§2.9)

    def remove_skipped_blocks(self, req: int, num_computed_tokens: int) -> None:
        running = self._requests.get(req)
        if running is None:
            return
        for g in self.groups:
            skipped = get_num_skipped_tokens(self.config, g, num_computed_tokens)
            if skipped <= 0:
                continue
            blocks = running.blocks[g]
            released = []
            for i in range(min(skipped // self.b, len(blocks)) - 1, -1, -1):
                if blocks[i] == NULL_BLOCK:
                    break
                released.append(blocks[i])
                blocks[i] = NULL_BLOCK
            self._free_blocks(released)

    def free(self, req: int) -> None:
        running = self._requests.pop(req, None)
        if running is None:
            return
        for blocks in running.blocks:
            head = 0
            while head < len(blocks) and blocks[head] == NULL_BLOCK:
                head += 1
            self._free_blocks(reversed(blocks[head:]))

    def _cache(self, running: _Request, tokens: Sequence[int], num_tokens: int) -> None:
        """Key the request's full blocks up to ``num_tokens`` that are not keyed yet (duplicates allowed)."""
        full = min(num_tokens, len(tokens)) // self.b
        for g in self.groups:
            blocks = running.blocks[g]
            if running.num_cached[g] >= full:
                continue
            for i in range(running.num_cached[g], min(full, len(blocks))):
                x = blocks[i]
                if x == NULL_BLOCK:
                    continue
                key = block_key(g, tokens, i, self.b)
                if self._key[x] is not None:  # cached already (under this key: only partial blocks change keys)
                    continue
                self._key[x] = key
                self._cached.setdefault(key, []).append(x)
            running.num_cached[g] = full

    def cache_blocks(self, req: int, tokens: Sequence[int], num_tokens: int) -> None:
        running = self._requests.get(req)
        if running is None:
            raise InvalidOperation("cache_blocks", "req", f"request {req} holds no blocks")
        self._cache(running, tokens, num_tokens)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        bad = [x for x in block_ids if not 0 <= x < self.n]
        if bad:
            raise InvalidOperation("evict_blocks", "block_ids", f"{bad} are not block ids of a pool of {self.n}")
        for x in block_ids:
            self._uncache(x)

    def reset_prefix_cache(self) -> bool:
        if len(self._free) != self.n - 1:
            return False
        self._cached = {}
        self._key = [None] * self.n
        return True

    def get_num_free_blocks(self) -> int:
        return len(self._free)

    def snapshot(self) -> BlockPoolSnapshot:
        """Free blocks in hand-out order (for FIFO and LIFO; any order for random), counts, keys, map, requests."""
        free = list(self._free)
        if self.policy is Policy.LIFO:
            free.reverse()
        return BlockPoolSnapshot(
            num_blocks=self.n, free=tuple(free), ref_cnt=tuple(self._ref), block_key=tuple(self._key),
            cached={k: tuple(v) for k, v in self._cached.items()},
            requests={r: tuple(tuple(x) for x in q.blocks) for r, q in self._requests.items()},
            num_cached={r: tuple(q.num_cached) for r, q in self._requests.items()})


def fifo(config: BlockPoolConfig) -> LegalBlockPool:
    """The block free longest hands out first (initially 1..N-1); a lookup returns a key's earliest block."""
    return LegalBlockPool(config, Policy.FIFO)


def lifo(config: BlockPoolConfig) -> LegalBlockPool:
    """The most recently freed block hands out first; a lookup returns a key's latest block."""
    return LegalBlockPool(config, Policy.LIFO)


def randomized(config: BlockPoolConfig) -> LegalBlockPool:
    """A seeded random free block, a seeded random block of a key (seed from the config: same run, same choices)."""
    return LegalBlockPool(config, Policy.RANDOMIZED, seed=config_seed(config))
