"""``block_pool``: vLLM 0.33.0's v1 KV cache manager (block pool, prefix cache, sliding window) as pure operations.

Models the request-level manager of a hybrid model as vLLM builds it (docs/block_pool.md §1-§4): one
``BlockPool`` of ``num_blocks`` blocks whose block 0 is the *null block* (never handed out, its count not
maintained), a free queue (``FreeKVCacheBlockQueue``: ``popleft`` hands out the front; ``free_blocks`` puts blocks
without a hash at the front, LIFO, and hashed ones at the back, LRU), reference counts shared by the requests a
prefix-cache hit joins, the hash -> block map (``BlockHashToBlockMap``, duplicates kept, the first returned), and
two groups of one block size B sharing the pool: group 0 full attention (``FullAttentionManager``), group 1 a
sliding window of W tokens (``SlidingWindowManager``) whose out-of-window blocks become the null block. The
coordinator (``HybridKVCacheCoordinator``) sums what every group needs before touching any (all or nothing).

A block hash is modelled by what it stands for: the key ``(group, tokens[:(i + 1) * B])`` of block ``i`` of a
request, the exact, collision-free version of vLLM's chained hash with its group id. Block *content* (the tokens a
request computed into a block) is kept too, so a hit can be checked against what its blocks hold (V6).

[Differs from vLLM 0.33.0, in signalling only:]

* ``allocate_slots`` raises :class:`OutOfMemory` where vLLM returns ``None``; vLLM releases out-of-window blocks
  (``remove_skipped_blocks``) *before* its capacity check, so its ``None`` can change state: here that release
  is its own operation, which the scheduler (the lockstep rule) calls first, after which the refusal changes
  nothing (docs/block_pool.md §2.2);
* caller misuse vLLM asserts on or leaves unchecked raises :class:`InvalidOperation`: a block id out of range
  (``evict_blocks``), a hit that is not the current one, a running request given a hit, counts past the
  request's tokens or the model length, caching tokens not computed yet.

Scope (docs/block_pool.md §6): ``hash_block_size == block_size``, prefix caching on, no EAGLE, no KV connector
(external tokens), no lookahead tokens, watermark 0, no reserved blocks, synchronous scheduling (no in-flight
tokens), so no partial-block caching and no copy-on-write; prefix-cache retention ``None`` (``KVCacheConfig``'s
default: every non-null sliding-window block is cached; the engine's ``CacheConfig`` default of 0 caches only the
window blocks a replay can reach, which is not modelled). A step's total is at most ``max_model_len`` (misuse
otherwise; vLLM silently caps it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvproof.reference.arith import ceil_div
from kvproof.reference.config import ConfigModel
from kvproof.reference.errors import ConfigError, OutOfMemory, ensure, require

__all__ = [
    "FULL",
    "NULL_BLOCK",
    "SWA",
    "BlockKey",
    "BlockPoolConfig",
    "BlockPoolSnapshot",
    "BlockPoolState",
    "Hit",
    "RequestBlocks",
    "allocate_slots",
    "block_key",
    "cache_blocks",
    "check_block_pool",
    "check_snapshot",
    "contiguous_blocks_for_hit",
    "coordinator_get_num_blocks_to_allocate",
    "evict_blocks",
    "free",
    "get_block_ids",
    "get_computed_blocks",
    "get_num_blocks_to_allocate",
    "get_num_free_blocks",
    "get_num_skipped_tokens",
    "initial_state",
    "max_admission_blocks_per_request",
    "num_evictable_computed_blocks",
    "remove_skipped_blocks",
    "require_cache",
    "require_release",
    "require_step",
    "reset_prefix_cache",
    "snapshot",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

#: the null block: padding for out-of-window positions, never handed out, never in the free queue
NULL_BLOCK = 0
#: group ids (KVCacheConfig.kv_cache_groups order)
FULL, SWA = 0, 1
#: a block's prefix-cache key: (group, the request's tokens up to the block's end) -- vLLM's BlockHashWithGroupId
BlockKey = tuple[int, tuple[int, ...]]
#: an unwritten token position of a block's content
UNWRITTEN = -1


class BlockPoolConfig(ConfigModel):
    """One pool shared by a full-attention group and, with ``sliding_window``, a sliding-window group."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    block_size: int = Field(ge=1, description="B: tokens per block (every group, and the hash block size)")
    num_blocks: int = Field(ge=2, description="blocks in the pool, the null block 0 included")
    sliding_window: int | None = Field(default=None, ge=2, description="W: the SWA group's window; None: full only")
    max_model_len: int = Field(ge=1, description="L: the longest sequence")
    max_in_flight_tokens: int | None = Field(default=None, ge=1,
                                             description="T: the SWA admission cap's in-flight tokens (None: L)")

    @model_validator(mode="after")
    def _fits(self) -> BlockPoolConfig:
        if self.max_in_flight_tokens is not None and self.sliding_window is None:
            raise ConfigError("BlockPoolConfig", "max_in_flight_tokens", "only the sliding-window group has an "
                              "admission cap; set sliding_window or leave max_in_flight_tokens unset")
        return self

    @property
    def groups(self) -> tuple[int, ...]:
        return (FULL,) if self.sliding_window is None else (FULL, SWA)

    @property
    def in_flight(self) -> int:
        return self.max_in_flight_tokens or self.max_model_len

    def label(self) -> str:
        window = f"-W{self.sliding_window}" if self.sliding_window is not None else "-full"
        cap = f"-T{self.max_in_flight_tokens}" if self.max_in_flight_tokens is not None else ""
        return f"B{self.block_size}-N{self.num_blocks}{window}-L{self.max_model_len}{cap}"


class Hit(BaseModel):
    """``get_computed_blocks``' answer: per group the hit blocks (the null block left of a SWA run) and the
    number of tokens they cover (a multiple of B)."""

    model_config = _FROZEN

    blocks: tuple[tuple[int, ...], ...]
    num_tokens: int


class RequestBlocks(BaseModel):
    """A running request: per group its block list (``req_to_blocks``), blocks already hashed
    (``num_cached_block``), and the tokens computed so far."""

    model_config = _FROZEN

    blocks: tuple[tuple[int, ...], ...]
    num_cached: tuple[int, ...]
    computed: int


class BlockPoolState(BaseModel):
    """The pool, the prefix cache and the requests. Never mutated: every operation returns a new state (the
    ``dict`` fields are copied before a change, never changed in place)."""

    model_config = _FROZEN

    config: BlockPoolConfig
    free: tuple[int, ...]  # the free queue, front (next handed out) first
    ref_cnt: tuple[int, ...]  # per block; the null block's stays 0 (not maintained, as in vLLM)
    block_key: tuple[BlockKey | None, ...]  # per block: the key it is cached under (its primary hash)
    cached: dict[BlockKey, tuple[int, ...]]  # key -> blocks cached under it, in insertion order
    content: tuple[tuple[int, ...], ...]  # per block: the token at each of its B positions (UNWRITTEN: none)
    requests: dict[int, RequestBlocks]


class BlockPoolSnapshot(BaseModel):
    """What every implementation reports: the free queue in order, the counts, the keys, the map, the requests."""

    model_config = _FROZEN

    num_blocks: int
    free: tuple[int, ...]
    ref_cnt: tuple[int, ...]  # index 0 (the null block) is not compared: vLLM does not maintain it
    block_key: tuple[BlockKey | None, ...]
    cached: dict[BlockKey, tuple[int, ...]]
    requests: dict[int, tuple[tuple[int, ...], ...]]  # request -> block list per group
    num_cached: dict[int, tuple[int, ...]]


# ---------------------------------------------------------------- arithmetic (mirrored in kvproof.spec.block_pool)


def get_num_skipped_tokens(config: BlockPoolConfig, group: int, num_computed_tokens: int) -> int:
    """Tokens before the window of the next token (docs/block_pool.md §3): none for full attention;
    ``max(0, n - W + 1)`` for the sliding window (single_type_kv_cache_manager.py:1148)."""
    if group == FULL or config.sliding_window is None:
        return 0
    return max(0, num_computed_tokens - config.sliding_window + 1)


def contiguous_blocks_for_hit(window: int, block_size: int) -> int:
    """Cached blocks in a row a sliding-window hit needs: ``cdiv(W - 1, B)`` (no EAGLE)."""
    return ceil_div(window - 1, block_size)


def max_admission_blocks_per_request(config: BlockPoolConfig, group: int) -> int | None:
    """The SWA group's per-request admission cap ``cdiv(min(W - 1 + T, L), B) + 1`` (kv_cache_interface.py:918):
    the blocks a request really holds at any chunk, so the admission gate charges no more; ``None`` (no cap) for
    full attention."""
    if group == FULL or config.sliding_window is None:
        return None
    tokens = min(config.sliding_window - 1 + config.in_flight, config.max_model_len)
    return ceil_div(tokens, config.block_size) + 1


def get_num_blocks_to_allocate(state: BlockPoolState, group: int, req: int, num_tokens: int,
                               new_computed_blocks: Sequence[int], total_computed_tokens: int,
                               apply_admission_cap: bool = False) -> int:
    """Blocks ``allocate_slots`` takes from the free queue for ``group`` (docs/block_pool.md §3,
    single_type_kv_cache_manager.py:176): new blocks for the positions not covered, plus the hit blocks that
    leave the free queue when touched (their count is 0)."""
    b = state.config.block_size
    required = ceil_div(num_tokens, b)
    cap = max_admission_blocks_per_request(state.config, group) if apply_admission_cap else None
    if cap is not None:
        required = min(required, cap)
    running = state.requests.get(req)
    if running is not None:
        return max(required - len(running.blocks[group]), 0)
    skipped = get_num_skipped_tokens(state.config, group, total_computed_tokens) // b
    new = max(required - max(skipped, len(new_computed_blocks)), 0)
    return new + num_evictable_computed_blocks(state, group, new_computed_blocks, total_computed_tokens)


def coordinator_get_num_blocks_to_allocate(state: BlockPoolState, req: int, num_tokens: int,
                                           hit_blocks: Sequence[Sequence[int]], total_computed_tokens: int,
                                           apply_admission_cap: bool = False) -> int:
    """Blocks ``allocate_slots`` takes from the free queue in all (``KVCacheCoordinator.get_num_blocks_to_allocate``,
    docs/block_pool.md §3.4): :func:`get_num_blocks_to_allocate` summed over the groups, ``hit_blocks`` per group.
    The count each of ``allocate_slots``' gates compares with the free queue (Z3:
    ``get_num_blocks_to_allocate.sum_leaves_the_queue``)."""
    return sum(get_num_blocks_to_allocate(state, g, req, num_tokens, hit_blocks[g], total_computed_tokens,
                                          apply_admission_cap) for g in state.config.groups)


def num_evictable_computed_blocks(state: BlockPoolState, group: int, new_computed_blocks: Sequence[int],
                                  total_computed_tokens: int) -> int:
    """The hit blocks a waiting request joins (past those the window skips, not null) that have count 0: joining
    takes them off the free queue, so they count against the free blocks (docs/block_pool.md R3)."""
    skipped = get_num_skipped_tokens(state.config, group, total_computed_tokens) // state.config.block_size
    return sum(1 for x in new_computed_blocks[skipped:] if x != NULL_BLOCK and state.ref_cnt[x] == 0)


def block_key(group: int, tokens: Sequence[int], index: int, block_size: int) -> BlockKey:
    """The key block ``index`` of a request with ``tokens`` is cached under in ``group``."""
    return group, tuple(tokens[:(index + 1) * block_size])


# ---------------------------------------------------------------- construction and queries


def initial_state(config: BlockPoolConfig) -> BlockPoolState:
    """Every block but the null block free, in id order (``BlockPool.__init__`` pops block 0 as the null block)."""
    n, b = config.num_blocks, config.block_size
    return BlockPoolState(config=config, free=tuple(range(1, n)), ref_cnt=(0,) * n, block_key=(None,) * n,
                          cached={}, content=((UNWRITTEN,) * b,) * n, requests={})


def get_num_free_blocks(state: BlockPoolState) -> int:
    return len(state.free)


def get_block_ids(state: BlockPoolState, req: int) -> tuple[tuple[int, ...], ...]:
    """The request's block list per group (empty lists for a request holding nothing)."""
    running = state.requests.get(req)
    return running.blocks if running is not None else ((),) * len(state.config.groups)


def snapshot(state: BlockPoolState) -> BlockPoolSnapshot:
    return BlockPoolSnapshot(num_blocks=state.config.num_blocks, free=state.free, ref_cnt=state.ref_cnt,
                             block_key=state.block_key, cached=dict(state.cached),
                             requests={r: q.blocks for r, q in state.requests.items()},
                             num_cached={r: q.num_cached for r, q in state.requests.items()})


def get_computed_blocks(state: BlockPoolState, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> Hit:
    """The longest prefix-cache hit for a waiting request (docs/block_pool.md §2.1; kv_cache_manager.py:266,
    kv_cache_coordinator.py:806): at most ``len(tokens) - 1`` tokens (the last is recomputed for its logits).

    Full attention takes the longest run of cached blocks from the start. The sliding window then searches, right
    to left within that length, for ``contiguous_blocks_for_hit`` cached blocks in a row (the ones left of the run
    are the null block); without such a run, a run that starts at block 0 counts. The hybrid hit is the window's;
    the full group keeps the blocks it covers (the coordinator's one pass for a full + SWA pair).
    """
    op, b = "get_computed_blocks", state.config.block_size
    _check_tokens(op, tokens)
    limit = len(tokens) - 1 if max_cache_hit_length is None else max_cache_hit_length
    require(0 <= limit <= len(tokens), op, "max_cache_hit_length",
            lambda: f"{limit} is not in [0, {len(tokens)}] (the request's tokens)")
    full: list[int] = []
    for i in range(limit // b):
        hit = state.cached.get(block_key(FULL, tokens, i, b))
        if not hit:
            break
        full.append(hit[0])
    length = len(full) * b
    if state.config.sliding_window is None:
        return Hit(blocks=(tuple(full),), num_tokens=length)
    window = _swa_hit(state, tokens, length)
    length = len(window) * b
    return Hit(blocks=(tuple(full[:ceil_div(length, b)]), tuple(window)), num_tokens=length)


def _swa_hit(state: BlockPoolState, tokens: Sequence[int], max_length: int) -> list[int]:
    """``SlidingWindowManager.find_longest_cache_hit`` (single_type_kv_cache_manager.py:969)."""
    b, window = state.config.block_size, state.config.sliding_window
    assert window is not None  # only called with a window (a type narrowing, not a check)
    need = contiguous_blocks_for_hit(window, b)
    blocks = [NULL_BLOCK] * (max_length // b)
    run = 0
    for i in range(len(blocks) - 1, -1, -1):
        hit = state.cached.get(block_key(SWA, tokens, i, b))
        if hit:
            blocks[i] = hit[0]
            run += 1
            if run >= need:
                return blocks[:i + run]
        else:
            run = 0
    return blocks[:run]


# ---------------------------------------------------------------- the free queue (block_pool.py:706-850)


class _Pool:
    """A scratch copy of the pool's fields an operation changes; :meth:`state` freezes it again."""

    def __init__(self, state: BlockPoolState) -> None:
        self.origin = state
        self.free = list(state.free)
        self.ref_cnt = list(state.ref_cnt)
        self.block_key = list(state.block_key)
        self.cached = dict(state.cached)
        self.content = list(state.content)
        self.requests = dict(state.requests)

    def state(self) -> BlockPoolState:
        return self.origin.model_copy(update={
            "free": tuple(self.free), "ref_cnt": tuple(self.ref_cnt), "block_key": tuple(self.block_key),
            "cached": self.cached, "content": tuple(self.content), "requests": self.requests})

    def evict(self, block: int) -> None:
        """``_maybe_evict_cached_block``: the block leaves the prefix cache (its key, its entry in the map)."""
        key = self.block_key[block]
        if key is None:
            return
        rest = tuple(x for x in self.cached.get(key, ()) if x != block)
        if rest:
            self.cached[key] = rest
        else:
            self.cached.pop(key, None)
        self.block_key[block] = None

    def get_new_blocks(self, n: int, take: Sequence[int] | None = None) -> list[int]:
        """``popleft_n``: the front ``n`` blocks, each evicted from the prefix cache, count 1, content cleared.
        ``take``: these ``n`` free blocks instead of the front ones (another manager's reuse order, followed)."""
        if take is None:
            taken, self.free = self.free[:n], self.free[n:]
        else:
            free = set(self.free)
            require(len(take) == n and len(set(take)) == n and free.issuperset(take), "allocate_slots", "take",
                    lambda: f"{list(take)} is not {n} distinct free blocks (free: {_head(sorted(free))})")
            taken = list(take)
            self.free = [x for x in self.free if x not in set(taken)]
        blank = (UNWRITTEN,) * self.origin.config.block_size
        for x in taken:
            self.evict(x)
            ensure(self.ref_cnt[x] == 0, "V3", lambda: f"block {x} handed out with count {self.ref_cnt[x]}")
            self.ref_cnt[x] = 1
            self.content[x] = blank
        return taken

    def touch(self, blocks: Iterable[int]) -> None:
        """A hit joins ``blocks``: count + 1, out of the free queue if it was 0 (the null block skipped)."""
        for x in blocks:
            if x == NULL_BLOCK:
                continue
            if self.ref_cnt[x] == 0:
                self.free.remove(x)
            self.ref_cnt[x] += 1

    def free_blocks(self, ordered: Iterable[int]) -> None:
        """``BlockPool.free_blocks``: count - 1; at 0 a block without a key goes to the front (reused first, in
        the given order), a cached one to the back (evicted last)."""
        first: list[int] = []
        last: list[int] = []
        for x in ordered:
            if x == NULL_BLOCK:
                continue
            ensure(self.ref_cnt[x] > 0, "V2", lambda: f"block {x} released with count {self.ref_cnt[x]}")
            self.ref_cnt[x] -= 1
            if self.ref_cnt[x] == 0:
                (first if self.block_key[x] is None else last).append(x)
        self.free = first + self.free + last


# ---------------------------------------------------------------- operations (docs/block_pool.md §2)


def allocate_slots(state: BlockPoolState, req: int, tokens: Sequence[int], num_computed_tokens: int,
                   num_new_tokens: int, hit: Hit | None = None, full_sequence_must_fit: bool = False,
                   take: Sequence[Sequence[int]] | None = None) -> tuple[BlockPoolState, tuple[tuple[int, ...], ...]]:
    """Slots for ``num_new_tokens`` more tokens of request ``req`` (``KVCacheManager.allocate_slots``,
    kv_cache_manager.py:380); returns the blocks taken from the free queue, per group.

    A waiting request (not running) starts at ``num_computed_tokens == 0`` and may adopt ``hit`` (the current
    ``get_computed_blocks`` answer); with ``full_sequence_must_fit`` the admission gate first asks for the whole
    sequence, the sliding-window group capped by :func:`max_admission_blocks_per_request`. Then the out-of-window
    blocks are released (:func:`remove_skipped_blocks`), what every group needs is summed
    (:func:`coordinator_get_num_blocks_to_allocate`) and compared with the free queue (:class:`OutOfMemory`,
    nothing changed), the hit is joined, new blocks are taken group by group,
    the computed tokens written, and the full blocks cached (:func:`cache_blocks`).

    ``take`` (per group, the blocks to hand out instead of the free queue's front ones: ``InvalidOperation`` unless
    they are as many as the group takes, distinct and free once the hit is joined) lets a suite follow a manager
    whose reuse order is its own (which free block it hands out, and so which cached block it evicts); whether the
    step succeeds does not depend on it.
    """
    op, cfg = "allocate_slots", state.config
    b, groups = cfg.block_size, cfg.groups
    running = state.requests.get(req)
    require_step(cfg, req, tokens, num_computed_tokens, num_new_tokens, None if running is None else running.computed,
                 hit)
    if running is None and hit is not None:
        _check_hit(state, op, tokens, hit)
    hit_tokens = hit.num_tokens if hit is not None else 0
    computed = num_computed_tokens + hit_tokens
    total = computed + num_new_tokens
    hit_blocks = hit.blocks if hit is not None else ((),) * len(groups)
    if full_sequence_must_fit:
        whole = min(len(tokens), cfg.max_model_len)
        need = coordinator_get_num_blocks_to_allocate(state, req, whole, hit_blocks, computed, apply_admission_cap=True)
        if need > len(state.free):
            raise OutOfMemory(op, "block", need, len(state.free), request=req)
    released = remove_skipped_blocks(state, req, computed) if running is not None else state
    if running is not None:  # the release nulls blocks of the request's lists in place (vLLM's req_to_blocks)
        running = released.requests[req]
    need = coordinator_get_num_blocks_to_allocate(released, req, total, hit_blocks, computed)
    if need > len(released.free):
        raise OutOfMemory(op, "block", need, len(released.free), request=req)
    pool = _Pool(released)
    if running is None:
        lists = []
        for g in groups:  # add_local_computed_blocks: every group's hit is joined before any block is taken
            skipped = get_num_skipped_tokens(cfg, g, computed) // b
            kept = hit_blocks[g][skipped:]
            pool.touch(kept)
            lists.append((NULL_BLOCK,) * skipped + tuple(kept))
        running = RequestBlocks(blocks=tuple(lists), num_cached=tuple(len(x) for x in lists), computed=0)
    require(take is None or len(take) == len(groups), op, "take",
            lambda: f"{len(take or ())} groups of blocks, the pool has {len(groups)}")
    new, lists = [], []
    for g in groups:  # allocate_new_blocks
        taken = pool.get_new_blocks(max(ceil_div(total, b) - len(running.blocks[g]), 0),
                                    None if take is None else take[g])
        new.append(tuple(taken))
        lists.append(running.blocks[g] + tuple(taken))
    for g in groups:  # the step computes tokens [computed, total) into the request's blocks
        for i in range(computed // b, ceil_div(total, b)):
            x = lists[g][i]
            if x == NULL_BLOCK:
                continue
            row = list(pool.content[x])
            for p in range(max(computed, i * b), min(total, (i + 1) * b)):
                row[p - i * b] = tokens[p]
            pool.content[x] = tuple(row)
    pool.requests[req] = running.model_copy(update={"blocks": tuple(lists), "computed": total})
    return _cache(pool.state(), op, req, tokens, total), tuple(new)


def require_step(config: BlockPoolConfig, req: int, tokens: Sequence[int], num_computed_tokens: int,
                 num_new_tokens: int, running_computed: int | None, hit: Hit | None) -> None:
    """``allocate_slots``' preconditions on its arguments, given the tokens the manager knows ``req`` computed
    (``running_computed``; ``None``: not running): every implementation of kvproof's checks them alike, in this
    order (whether a waiting request's hit is the current one is checked after, on the implementation's own cache)."""
    op = "allocate_slots"
    _check_tokens(op, tokens)
    require(num_computed_tokens >= 0, op, "num_computed_tokens", lambda: f"must be >= 0, got {num_computed_tokens}")
    require(num_new_tokens >= 0, op, "num_new_tokens", lambda: f"must be >= 0, got {num_new_tokens}")
    hit_tokens = hit.num_tokens if hit is not None else 0
    if running_computed is not None:
        # a running request has no new prefix-cache hits (the coordinator's fast path asserts it)
        require(hit is None or (hit_tokens == 0 and not any(hit.blocks)), op, "hit",
                lambda: f"request {req} is running: it takes no prefix-cache hit")
        require(num_computed_tokens == running_computed, op, "num_computed_tokens",
                lambda: f"request {req} has computed {running_computed} tokens, not {num_computed_tokens}")
    else:
        # a waiting (new or preempted) request starts from nothing computed
        require(num_computed_tokens == 0, op, "num_computed_tokens",
                lambda: f"request {req} is not running: it starts at 0 computed tokens, not {num_computed_tokens}")
    # vLLM raises ValueError: a step needs a token to compute or a hit to adopt
    require(num_new_tokens > 0 or hit_tokens > 0, op, "num_new_tokens",
            "must be > 0 when there are no computed tokens to adopt")
    computed = num_computed_tokens + hit_tokens
    total = computed + num_new_tokens
    require(total <= len(tokens), op, "num_new_tokens",
            lambda: f"{computed} computed + {num_new_tokens} new > the request's {len(tokens)} tokens")
    require(total <= config.max_model_len, op, "num_new_tokens",
            lambda: f"{total} tokens > max_model_len {config.max_model_len}")


def remove_skipped_blocks(state: BlockPoolState, req: int, num_computed_tokens: int) -> BlockPoolState:
    """Release the request's blocks the window no longer reads (docs/block_pool.md §2.7,
    single_type_kv_cache_manager.py:655-720): per group, the first ``skipped // B`` blocks (at most the ones it
    holds), walked backwards to the first null block, each replaced by the null block and released in that order.
    Full attention skips nothing; a request holding nothing is left alone."""
    b = state.config.block_size
    running = state.requests.get(req)
    require_release(req, num_computed_tokens, None if running is None else running.computed)
    if running is None:
        return state
    pool: _Pool | None = None
    lists = list(running.blocks)
    for g in state.config.groups:
        skipped = get_num_skipped_tokens(state.config, g, num_computed_tokens)
        if skipped <= 0:
            continue
        blocks = list(lists[g])
        released = []
        for i in range(min(skipped // b, len(blocks)) - 1, -1, -1):
            if blocks[i] == NULL_BLOCK:
                break
            released.append(blocks[i])
            blocks[i] = NULL_BLOCK
        if released:
            pool = pool or _Pool(state)
            pool.free_blocks(released)
            lists[g] = tuple(blocks)
    if pool is None:
        return state
    pool.requests[req] = running.model_copy(update={"blocks": tuple(lists)})
    return pool.state()


def free(state: BlockPoolState, req: int) -> BlockPoolState:
    """A finished or preempted request gives its blocks back (docs/block_pool.md §2.6): group by group, its blocks
    without the leading null blocks, last first (so the tail is reused or evicted first). A request holding
    nothing frees nothing (vLLM: ``req_to_blocks.pop(request_id, [])``)."""
    running = state.requests.get(req)
    if running is None:
        return state
    pool = _Pool(state)
    for blocks in running.blocks:
        pool.free_blocks(reversed(_trim_null_head(blocks)))
    del pool.requests[req]
    return pool.state()


def cache_blocks(state: BlockPoolState, req: int, tokens: Sequence[int], num_tokens: int) -> BlockPoolState:
    """Cache the request's full blocks up to ``num_tokens`` (docs/block_pool.md §2.5; ``cache_full_blocks``,
    block_pool.py:230): blocks ``[num_cached, min(num_tokens, len(tokens)) // B)`` that are not the null block get
    their key and join the map; ``num_cached`` moves to the end. Only computed tokens can be cached."""
    running = state.requests.get(req)
    require_cache(req, tokens, num_tokens, None if running is None else running.computed)
    return _cache(state, "cache_blocks", req, tokens, num_tokens)


def require_release(req: int, num_computed_tokens: int, running_computed: int | None) -> None:
    """``remove_skipped_blocks``' preconditions, given the tokens ``req`` computed (``None``: it holds nothing)."""
    op = "remove_skipped_blocks"
    require(num_computed_tokens >= 0, op, "num_computed_tokens", lambda: f"must be >= 0, got {num_computed_tokens}")
    # only processed tokens leave the window: a count past what the request computed releases blocks it still reads
    require(running_computed is None or num_computed_tokens <= running_computed, op, "num_computed_tokens",
            lambda: f"{num_computed_tokens} > the {running_computed} tokens request {req} computed")


def require_cache(req: int, tokens: Sequence[int], num_tokens: int, running_computed: int | None) -> None:
    """``cache_blocks``' preconditions, given the tokens ``req`` computed (``None``: it holds nothing)."""
    op = "cache_blocks"
    _check_tokens(op, tokens)
    require(running_computed is not None, op, "req", lambda: f"request {req} holds no blocks")
    require(0 <= num_tokens <= (running_computed or 0), op, "num_tokens",
            lambda: f"{num_tokens} is not in [0, {running_computed}] (the tokens request {req} computed)")


def _cache(state: BlockPoolState, op: str, req: int, tokens: Sequence[int], num_tokens: int) -> BlockPoolState:
    b = state.config.block_size
    running = state.requests[req]
    full = min(num_tokens, len(tokens)) // b
    if all(c >= full for c in running.num_cached):
        return state
    pool = _Pool(state)
    for g in state.config.groups:
        blocks = running.blocks[g]
        for i in range(running.num_cached[g], min(full, len(blocks))):
            x = blocks[i]
            if x == NULL_BLOCK:
                continue
            key = block_key(g, tokens, i, b)
            if pool.block_key[x] == key or x in pool.cached.get(key, ()):
                continue
            # only a partial block promoted to full may carry a key already (not in this scope)
            ensure(pool.block_key[x] is None, "V4", lambda: f"{op}: block {x} is cached already")
            pool.block_key[x] = key
            pool.cached[key] = pool.cached.get(key, ()) + (x,)
    pool.requests[req] = running.model_copy(
        update={"num_cached": tuple(max(c, full) for c in running.num_cached)})
    return pool.state()


def evict_blocks(state: BlockPoolState, block_ids: Sequence[int]) -> BlockPoolState:
    """Drop blocks from the prefix cache by id (docs/block_pool.md §2.8; block_pool.py:851): their keys and map
    entries go; counts and free-queue places stay. Ids must name blocks of the pool (vLLM asserts ``< N``)."""
    op, n = "evict_blocks", state.config.num_blocks
    bad = [x for x in block_ids if not 0 <= x < n]
    require(not bad, op, "block_ids", lambda: f"{bad[:8]} are not block ids of a pool of {n} blocks")
    if not any(state.block_key[x] is not None for x in block_ids):
        return state
    pool = _Pool(state)
    for x in block_ids:
        pool.evict(x)
    return pool.state()


def reset_prefix_cache(state: BlockPoolState) -> tuple[BlockPoolState, bool]:
    """Forget every cached block, only when nothing but the null block is in use (block_pool.py:871): ``False``
    and nothing changed otherwise."""
    if len(state.free) != state.config.num_blocks - 1:
        return state, False
    if not state.cached and all(k is None for k in state.block_key):
        return state, True
    return state.model_copy(update={"cached": {}, "block_key": (None,) * state.config.num_blocks}), True


# ---------------------------------------------------------------- invariants (docs/block_pool.md §4)


def check_snapshot(snap: BlockPoolSnapshot, config: BlockPoolConfig) -> None:
    """V1-V5 on any implementation's snapshot; raises :class:`InvariantViolation`."""
    n, free = snap.num_blocks, snap.free
    ensure(NULL_BLOCK not in free, "V3", "the null block is in the free queue")
    ensure(len(set(free)) == len(free), "V3", lambda: f"blocks in the free queue twice: {_dups(free)}")
    ensure(all(0 < x < n for x in free), "V3", lambda: f"free queue holds ids outside [1, {n}): {_head(free)}")
    held = [0] * n
    for r, lists in snap.requests.items():
        for g, blocks in enumerate(lists):
            nulls = len(_leading_nulls(blocks))
            ensure(NULL_BLOCK not in blocks[nulls:], "V5",
                   lambda: f"request {r} group {g}: a null block after a real one: "
                   f"{_head(blocks)}")
            ensure(g == SWA or nulls == 0, "V5", lambda: f"request {r}: null blocks in the full-attention group")
            for x in blocks[nulls:]:
                ensure(0 < x < n, "V2", lambda: f"request {r} holds block id {x} outside [1, {n})")
                held[x] += 1
    free_set = set(free)
    for x in range(1, n):
        ensure(snap.ref_cnt[x] == held[x], "V2",
               lambda: f"block {x}: count {snap.ref_cnt[x]}, held by {held[x]} request slot(s)")
        ensure((x in free_set) == (held[x] == 0), "V3",
               lambda: f"block {x}: count {held[x]} but {'in' if x in free_set else 'not in'} the free queue")
    referenced = sum(1 for x in range(1, n) if held[x] > 0)
    ensure(len(free) + referenced == n - 1, "V1",
           lambda: f"{len(free)} free + {referenced} referenced != {n - 1} usable blocks")
    for key, ids in snap.cached.items():
        ensure(bool(ids) and len(set(ids)) == len(ids), "V4", lambda: f"key {_key(key)} maps to "
               f"{list(ids)}")
        for x in ids:
            ensure(snap.block_key[x] == key, "V4", lambda: f"block {x} is in the map under {_key(key)} "
                   f"but carries {_key(snap.block_key[x])}")
    for x, carried in enumerate(snap.block_key):
        if carried is not None:
            ensure(x in snap.cached.get(carried, ()), "V4", lambda: f"block {x} carries {_key(carried)} but is "
                   "not in the map under it")
            ensure(x != NULL_BLOCK, "V4", "the null block is cached")
    ensure(set(snap.num_cached) == set(snap.requests), "V2", "num_cached and the block lists name other requests")
    ensure(len(config.groups) == len(next(iter(snap.requests.values()), config.groups)), "V2",
           "a request's block lists do not match the groups")


def check_block_pool(state: BlockPoolState) -> None:
    """V1-V5 and V7 (a cached block holds the last B tokens of its key) on the reference state."""
    check_snapshot(snapshot(state), state.config)
    b = state.config.block_size
    for x, key in enumerate(state.block_key):
        if key is not None:
            ensure(state.content[x] == key[1][-b:], "V7", lambda: f"block {x} is cached under "
                   f"{_key(key)} but holds {list(state.content[x])}")
    for r, q in state.requests.items():
        for g, blocks in enumerate(q.blocks):
            nulls = len(_leading_nulls(blocks))
            ensure(nulls * b <= get_num_skipped_tokens(state.config, g, q.computed), "V5",
                   lambda: f"request {r}: {nulls} null blocks, but only "
                   f"{get_num_skipped_tokens(state.config, SWA, q.computed)} tokens are out of the window")
            ensure(len(blocks) == ceil_div(q.computed, b), "V5", lambda:
                   f"request {r} group {g}: {len(blocks)} blocks for {q.computed} computed tokens")


# ---------------------------------------------------------------- preconditions and helpers


def _check_tokens(op: str, tokens: Sequence[int]) -> None:
    require(len(tokens) >= 1, op, "tokens", "a request has at least one token")
    require(all(t >= 0 for t in tokens), op, "tokens", "token ids are >= 0")


def _check_hit(state: BlockPoolState, op: str, tokens: Sequence[int], hit: Hit) -> None:
    """The hit is a current one (the scheduler asks right before): ``get_computed_blocks`` gives it now, but for which
    of the blocks cached under one key it names (a lookup's choice where a prefix is cached twice: another manager's
    reuse order, followed by a suite, may answer another)."""
    require(len(hit.blocks) == len(state.config.groups), op, "hit",
            lambda: f"{len(hit.blocks)} block lists for {len(state.config.groups)} groups")
    require(hit.num_tokens < len(tokens), op, "hit", lambda: f"a hit of {hit.num_tokens} tokens leaves none of the "
            f"request's {len(tokens)} to compute")
    now = get_computed_blocks(state, tokens, hit.num_tokens)
    b = state.config.block_size
    same = now == hit or (now.num_tokens == hit.num_tokens and all(
        len(mine) == len(theirs) and all(x == y or (x != NULL_BLOCK and y in state.cached[block_key(g, tokens, i, b)])
                                         for i, (x, y) in enumerate(zip(mine, theirs, strict=True)))
        for g, (mine, theirs) in enumerate(zip(now.blocks, hit.blocks, strict=True))))
    require(same, op, "hit", lambda: f"stale hit {list(map(list, hit.blocks))} ({hit.num_tokens} tokens): the "
            f"prefix cache gives {list(map(list, now.blocks))} ({now.num_tokens} tokens) now")


def _leading_nulls(blocks: Sequence[int]) -> Sequence[int]:
    n = 0
    while n < len(blocks) and blocks[n] == NULL_BLOCK:
        n += 1
    return blocks[:n]


def _trim_null_head(blocks: Sequence[int]) -> Sequence[int]:
    return blocks[len(_leading_nulls(blocks)):]


def _key(key: BlockKey | None) -> str:
    if key is None:
        return "no key"
    group, prefix = key
    return f"(group {group}, {len(prefix)} tokens ...{list(prefix[-4:])})"


def _dups(values: Sequence[Any]) -> list[Any]:
    return sorted({v for v in values if values.count(v) > 1})


def _head(values: Sequence[int], n: int = 12) -> str:
    shown = ", ".join(map(str, values[:n]))
    return f"[{shown}{', ...' if len(values) > n else ''}] ({len(values)} entries)"
