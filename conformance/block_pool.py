"""Lockstep state machine for the ``block_pool`` component (vLLM 0.33.0's v1 KV cache manager, docs/block_pool.md).

The harness plays vLLM's scheduler over the manager: it admits waiting requests with a prefix-cache lookup
(``get_computed_blocks``, then ``allocate_slots`` with the lookup's hit and the admission gate), prefills them in
chunks, decodes (the sampled token appended, then one slot), releases out-of-window blocks
(``remove_skipped_blocks``, always right before an ``allocate_slots`` of a running request, as vLLM does inside
it), preempts (``free``, back to waiting from nothing computed) and finishes (``free``), caches computed blocks
(``cache_blocks``), evicts blocks from the prefix cache by id (``evict_blocks``) and resets it
(``reset_prefix_cache``). Prompts are drawn from a few base sequences so requests share prefixes: two of them
differ in their first token only, so a lookup keyed by a block's own tokens instead of its whole prefix returns
another request's KV.

Every operation runs on the reference and on the implementation and must end the same way (success,
``OutOfMemory``, ``InvalidOperation``); a refused ``allocate_slots`` changes nothing (the out-of-window release it
does first in vLLM is its own call here, made before). The harness also writes, as the model would, each computed
token into the implementation's block at its position (a ghost of the KV memory), so a block's content is what the
implementation's own block tables put there.

After every step (docs/block_pool.md §4):

* the reference keeps V1-V5 and V7 (``check_block_pool``), the implementation's snapshot V1-V5 (``check_snapshot``):
  conservation, reference counts equal to the (request, group) slots holding a block, the free queue exactly the
  blocks of count 0 but the null block with no duplicate, the map and the blocks' keys agree, null blocks only at
  the head of a sliding-window list;
* the snapshots are equal: the free queue, the counts, the keys, the map and the block lists. With
  ``EXACT_PAGE_ORDER`` (vLLM's order: the runtime, vLLM itself) the reference chooses and the free queue is compared
  in order. Without it, which free block ``allocate_slots`` hands out (and so which cached block it evicts, and every
  later hit) and which of the blocks cached under one key a lookup returns are the implementation's choice: the
  reference follows it (``allocate_slots(..., take=)`` with the blocks the implementation handed out, once they are
  free there; the implementation's hit, once its blocks are cached under the request's keys there), and the free
  queue and each key's blocks are compared as sets. The reference following, every outcome and every hit's length
  are still the reference's to decide (docs/contract.md "What is implementation-defined"; tests/legal: FIFO, LIFO
  and random managers pass);
* every block the implementation has cached holds, in the ghost KV memory, the last B tokens of its key (V7), and
  every block a lookup returns holds the request's tokens at that position (V6, hit soundness); the hit is as
  long as the reference's (hit completeness as vLLM promises it).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvproof.conformance import strategies as st
from kvproof.conformance.check import Suite
from kvproof.conformance.lockstep import Lockstep, MisuseCall, check_after_each_step, misuse, operation
from kvproof.reference import block_pool as bp
from kvproof.reference.arith import ceil_div
from kvproof.reference.contract import BlockPoolUnderTest, Capability
from kvproof.reference.errors import InvalidOperation, InvariantViolation, OutOfMemory
from kvproof.reference.registry import Component

__all__ = ["BLOCK_POOL_CONFIGS", "SUITE", "BlockPoolMachine"]

C = Capability

#: Small pools on purpose (full pools, evictions of cached blocks, admission refusals are reached): B = 1..4, windows
#: that are and are not block multiples, one pool without a window, two whose admission cap binds (T < L).
BLOCK_POOL_CONFIGS: tuple[bp.BlockPoolConfig, ...] = (
    bp.BlockPoolConfig(block_size=1, num_blocks=9, sliding_window=3, max_model_len=8),
    bp.BlockPoolConfig(block_size=2, num_blocks=11, sliding_window=4, max_model_len=12),
    bp.BlockPoolConfig(block_size=4, num_blocks=13, sliding_window=6, max_model_len=16),
    bp.BlockPoolConfig(block_size=4, num_blocks=9, max_model_len=16),
    bp.BlockPoolConfig(block_size=3, num_blocks=13, sliding_window=5, max_model_len=15, max_in_flight_tokens=4),
    # #39734's setting: charged the whole sequence, the window group alone (8 blocks) plus the full group's would
    # exceed the pool; capped (3 blocks), a 16-token request fits and runs in chunks
    bp.BlockPoolConfig(block_size=2, num_blocks=14, sliding_window=3, max_model_len=16, max_in_flight_tokens=2),
)


@dataclass
class Req:
    """A request as the scheduler keeps it: its tokens (prompt, then sampled ones) and how many are computed."""

    rid: int
    base: int  # which base sequence its prompt follows (decoding continues it, or not)
    tokens: list[int] = field(default_factory=list)
    computed: int = 0


class BlockPoolMachine(Lockstep[bp.BlockPoolConfig, BlockPoolUnderTest]):
    """vLLM's scheduler over the reference and over the implementation, in lockstep."""

    component = Component.BLOCK_POOL
    snapshot_type = bp.BlockPoolSnapshot
    targets = ("pool exhausted", "prefix-cache hit blocks")

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        cfg = self.config
        self.ref = bp.initial_state(cfg)
        self.b = cfg.block_size
        self.groups = cfg.groups
        self.waiting: dict[int, Req] = {}
        self.running: dict[int, Req] = {}
        self.finished: list[int] = []
        self.next_rid = 1
        self.fresh = 10_000  # token ids no base sequence uses (a divergent suffix, an unexpected sample)
        top = cfg.max_model_len + 1
        first = list(range(1, top + 1))
        # base 1 differs from base 0 in its first token only: same block contents from block 1 on, other prefixes
        self.bases = (first, [0, *first[1:]], list(range(500, 500 + top)))
        self.kv: dict[int, list[int]] = {}  # the implementation's block -> the token at each position (ghost KV)

    # ------------------------------------------------------------ structural coverage

    @classmethod
    def structure(cls, config: bp.BlockPoolConfig, na: tuple[str, ...] = ()) -> dict[str, int]:
        """Three requests running at once; a request holding as many blocks as the model length and the pool allow; the
        pool exhausted; a hit of two blocks; a request preempted and admitted again; a block evicted from the prefix
        cache; the prefix cache reset; an admission refused only for the free blocks its hit would take off the free
        queue; with a window, a block released for leaving it."""
        # a request holds cdiv(L, B) full-attention blocks at most, and the pool must keep its window's blocks too:
        # computing the token that opens its k-th block, it holds cdiv(W - 1, B) blocks of the W - 1 tokens before
        # it and the token's own (the blocks before them released, remove_skipped_blocks, the null block not counted)
        window = (bp.contiguous_blocks_for_hit(config.sliding_window, config.block_size) + 1
                  if config.sliding_window else 0)
        longest = min(ceil_div(config.max_model_len, config.block_size), config.num_blocks - 1 - window)
        dims = {"requests running at once": 3, "blocks of one request": longest,
                "pool exhausted": 1, "prefix-cache hit blocks": 2, "preemptions per example": 1,
                "cached blocks evicted": 1, "prefix cache reset": 1, "admission refused for its hit's free blocks": 1}
        if config.sliding_window is not None:
            dims["null blocks of one request"] = 1
        return dims

    def measure(self) -> dict[str, int]:
        lists = [blocks for q in self.ref.requests.values() for blocks in q.blocks]
        out = {"requests running at once": len(self.ref.requests),
               "blocks of one request": max((len(x) for x in lists), default=0),
               "pool exhausted": int(not self.ref.free)}
        if self.config.sliding_window is not None:
            out["null blocks of one request"] = max(
                (sum(1 for x in q.blocks[bp.SWA] if x == bp.NULL_BLOCK) for q in self.ref.requests.values()),
                default=0)
        return out

    # ------------------------------------------------------------ the scheduler's side

    def _prompt(self, data: Any) -> Req:
        """A new request: a prefix of a base sequence (block edges likely), maybe a divergent suffix."""
        base = data.draw(st.sampled_from(range(len(self.bases))), label="base")
        top, b = self.config.max_model_len, self.b
        edges = sorted({x for k in range(1, 5) for x in (k * b - 1, k * b, k * b + 1)} | {1, top})
        n = data.draw(st.one_of(st.sampled_from([x for x in edges if 1 <= x <= top]), st.integers(1, top)),
                      label="prompt_len")
        tokens = list(self.bases[base][:n])
        diverge = data.draw(st.integers(0, min(2, top - n)), label="divergent_suffix")
        for _ in range(diverge):
            tokens.append(self._fresh_token())
        req = Req(self.next_rid, base, tokens)
        self.next_rid += 1
        return req

    def _fresh_token(self) -> int:
        self.fresh += 1
        return self.fresh

    def _extendable(self) -> list[int]:
        """Running requests with a token to compute or room to decode one more."""
        top = self.config.max_model_len
        return [r for r, q in sorted(self.running.items()) if q.computed < len(q.tokens) or len(q.tokens) < top]

    def _write_kv(self, req: Req, start: int, end: int) -> None:
        """The model computes tokens ``[start, end)`` of ``req`` into the implementation's blocks (ghost KV)."""
        lists = self.snapshot().requests.get(req.rid)
        if lists is None:
            self.fail(f"allocate_slots succeeded for request {req.rid}, but snapshot() shows no block list for it")
        for g, blocks in enumerate(lists):
            for p in range(start, end):
                i = p // self.b
                if i >= len(blocks) or blocks[i] == bp.NULL_BLOCK:
                    self.fail(f"allocate_slots gave request {req.rid} no block for position {p} in group {g} "
                              f"(its blocks: {list(blocks)})", check="V5")
                row = self.kv.setdefault(blocks[i], [bp.UNWRITTEN] * self.b)
                row[p % self.b] = req.tokens[p]

    def _compare_hit(self, req: Req, mine: bp.Hit, theirs: Any) -> None:
        """Hit completeness (as long as the reference's) and soundness (V6): every block holds the request's tokens."""
        if not isinstance(theirs, bp.Hit):
            self.fail(f"get_computed_blocks returned a {type(theirs).__name__}, not a Hit")
        if theirs.num_tokens != mine.num_tokens or [len(x) for x in theirs.blocks] != [len(x) for x in mine.blocks]:
            self.fail(f"get_computed_blocks for request {req.rid} ({len(req.tokens)} tokens) hit "
                      f"{theirs.num_tokens} tokens in blocks {list(map(list, theirs.blocks))}; the reference hits "
                      f"{mine.num_tokens} in {list(map(list, mine.blocks))}", check="hit")
        for g, blocks in enumerate(theirs.blocks):
            for i, x in enumerate(blocks):
                want = req.tokens[i * self.b:(i + 1) * self.b]
                if (x == bp.NULL_BLOCK) != (mine.blocks[g][i] == bp.NULL_BLOCK):
                    self.fail(f"get_computed_blocks returned block {x} for block {i} of group {g}; the reference "
                              f"hits block {mine.blocks[g][i]} there (the null block where the window skips)",
                              check="hit")
                if x == bp.NULL_BLOCK:
                    continue
                held = self.kv.get(x)
                if held != want:
                    self.fail(f"hit soundness (V6): get_computed_blocks returned block {x} for block {i} of group {g} "
                              f"of request {req.rid}, which holds {held} but the request's tokens there are {want}",
                              check="V6", detail={"block": x, "group": g})
        if self.supports(C.EXACT_PAGE_ORDER) and theirs != mine:
            self.fail(f"get_computed_blocks returned blocks {list(map(list, theirs.blocks))}; the reference "
                      f"{list(map(list, mine.blocks))} (declared EXACT_PAGE_ORDER)", check="hit")
        hit_blocks = sum(1 for x in mine.blocks[0] if x != bp.NULL_BLOCK)
        self.note("prefix-cache hit blocks", hit_blocks)

    def _followed_hit(self, req: Req, mine: bp.Hit, theirs: bp.Hit) -> bp.Hit:
        """The hit the reference joins: its own with ``EXACT_PAGE_ORDER``; else the implementation's (which of the
        blocks cached under one key a lookup returns is its choice), once every block of it is cached under the
        request's key at its position in the reference too."""
        if self.supports(C.EXACT_PAGE_ORDER):
            return mine
        tokens = req.tokens
        for g, blocks in enumerate(theirs.blocks):
            for i, x in enumerate(blocks):
                key = bp.block_key(g, tokens, i, self.b)
                if x != bp.NULL_BLOCK and x not in self.ref.cached.get(key, ()):
                    self.fail(f"get_computed_blocks returned block {x} for block {i} of group {g} of request "
                              f"{req.rid}; the reference caches that prefix in blocks "
                              f"{list(self.ref.cached.get(key, ()))} only", check="V6", detail={"block": x, "group": g})
        return bp.Hit(blocks=tuple(tuple(int(x) for x in blocks) for blocks in theirs.blocks),
                      num_tokens=theirs.num_tokens)

    def _compare_new(self, state: bp.BlockPoolState, mine: Sequence[Sequence[int]], theirs: Any,
                     follow: Callable[..., tuple[bp.BlockPoolState, Any]]) -> bp.BlockPoolState:
        """The implementation's new blocks against the reference's; the reference state after the step. With
        ``EXACT_PAGE_ORDER`` they are the same blocks; else the reference takes the implementation's
        (``follow(take=...)``: the reference's step again, handing them out) if they are free there, as many per
        group."""
        got = [list(x) for x in theirs] if isinstance(theirs, tuple | list) else theirs
        want = [list(x) for x in mine]
        if not isinstance(got, list) or [len(x) for x in got] != [len(x) for x in want]:
            self.fail(f"allocate_slots returned new blocks {got}; the reference took {want}")
        if self.supports(C.EXACT_PAGE_ORDER):
            if got != want:
                self.fail(f"allocate_slots returned new blocks {got}; the reference took {want} (declared "
                          "EXACT_PAGE_ORDER)")
            return state
        try:
            followed: bp.BlockPoolState = follow(take=[[int(x) for x in blocks] for blocks in got])[0]
        except InvalidOperation as err:
            self.fail(f"allocate_slots handed out blocks {got}, which are not free blocks of the pool ({err})",
                      check="V3", detail={"blocks": got})
        return followed

    def _admit(self, data: Any) -> None:
        """Admit a waiting request (or a new one): prefix lookup, then its first chunk through the admission gate."""
        waiting = sorted(self.waiting)
        req = (self.waiting[data.draw(st.sampled_from(waiting), label="waiting")]
               if waiting and data.draw(st.booleans(), label="readmit") else self._prompt(data))
        tokens = list(req.tokens)
        mine = bp.get_computed_blocks(self.ref, tokens)
        self.trace.op(f"get_computed_blocks(request {req.rid}, {len(tokens)} tokens)", aside="lookup")
        theirs = self.impl.get_computed_blocks(tokens)
        self._compare_hit(req, mine, theirs)
        joined = self._followed_hit(req, mine, theirs)
        hit = mine.num_tokens
        n = data.draw(st.one_of(st.just(len(tokens) - hit), st.just(self._edge_chunk(req.rid, tokens, joined)),
                                st.integers(1, len(tokens) - hit)), label="chunk")
        must_fit = data.draw(st.booleans(), label="full_sequence_must_fit")
        step = functools.partial(bp.allocate_slots, self.ref, req.rid, tokens, 0, n, joined, must_fit)
        out = self.call("allocate_slots", f"request {req.rid} (waiting, {len(tokens)} tokens, hit {hit}), "
                        f"{n} new, full_sequence_must_fit={must_fit}", step,
                        lambda: self.impl.allocate_slots(req.rid, tokens, 0, n, theirs, must_fit))
        if out is None:
            self.note("admission refused for its hit's free blocks", int(self._refused_for_free_hit(
                req.rid, tokens, n, joined, must_fit)))
            self.waiting[req.rid] = req
            return
        (state, new), impl_new = out
        self.ref = self._compare_new(state, new, impl_new, step)
        self.waiting.pop(req.rid, None)
        req.computed = hit + n
        self.running[req.rid] = req
        self._write_kv(req, hit, hit + n)

    def _edge_chunk(self, rid: int, tokens: list[int], hit: bp.Hit) -> int:
        """The pool's edge for an admission: the longest first chunk whose new blocks, the hit's free blocks not
        counted, fit the free blocks (1 if none does). When the hit joins free blocks, the reference refuses it
        exactly when those blocks tip it over: the boundary of docs/block_pool.md R3."""
        room = len(self.ref.free) + self._charged(hit)
        return next((n for n in range(len(tokens) - hit.num_tokens, 0, -1)  # the count grows with the chunk
                     if self._needed(rid, hit.num_tokens + n, hit, capped=False) <= room), 1)

    def _refused_for_free_hit(self, rid: int, tokens: list[int], n: int, hit: bp.Hit, must_fit: bool) -> bool:
        """Whether the reference refused this admission only because the hit blocks it would join are free (count 0:
        joining takes them off the free queue, ``num_evictable_computed_blocks``): a gate refused, and every gate has
        room for the new blocks alone. The boundary a capacity count without that charge gets wrong."""
        free, charged = len(self.ref.free), self._charged(hit)
        gates = [(min(len(tokens), self.config.max_model_len), True)] if must_fit else []
        refused = False
        for num_tokens, capped in (*gates, (hit.num_tokens + n, False)):
            need = self._needed(rid, num_tokens, hit, capped=capped)
            if need - charged > free:
                return False  # refused without the charge too
            refused = refused or need > free
        return refused

    def _needed(self, rid: int, num_tokens: int, hit: bp.Hit, *, capped: bool) -> int:
        """The reference's count of blocks an admission with ``hit`` needs for ``num_tokens``."""
        return bp.coordinator_get_num_blocks_to_allocate(self.ref, rid, num_tokens, hit.blocks, hit.num_tokens, capped)

    def _charged(self, hit: bp.Hit) -> int:
        """The hit's blocks of count 0, which joining it takes off the free queue (every group)."""
        return sum(bp.num_evictable_computed_blocks(self.ref, g, hit.blocks[g], hit.num_tokens) for g in self.groups)

    def _extend(self, data: Any) -> None:
        """The next step of a running request: a prefill chunk, or a decode (the sampled token appended first)."""
        rid = data.draw(st.sampled_from(self._extendable()), label="running")
        req = self.running[rid]
        if req.computed == len(req.tokens):
            follow = self.bases[req.base]
            nxt = len(req.tokens)
            sampled = follow[nxt] if data.draw(st.booleans(), label="follow_base") else self._fresh_token()
            req.tokens.append(sampled)
            n = 1
        else:
            left = len(req.tokens) - req.computed
            n = data.draw(st.one_of(st.just(left), st.integers(1, left)), label="chunk")
        tokens, computed = list(req.tokens), req.computed
        # vLLM's scheduler leaves the release to allocate_slots itself; a refused allocate_slots has then released
        # already (docs/vllm-findings.md C1), so the harness releases first unless the reference says it succeeds
        if data.draw(st.booleans(), label="release_first") or not self._would_allocate(rid, tokens, computed, n):
            released = self.call("remove_skipped_blocks", f"request {rid}, {computed} computed",
                                 lambda: (bp.remove_skipped_blocks(self.ref, rid, computed), None),
                                 lambda: self.impl.remove_skipped_blocks(rid, computed), aside="released first")
            if released is not None:
                self.ref = released[0][0]
        step = functools.partial(bp.allocate_slots, self.ref, rid, tokens, computed, n)
        out = self.call("allocate_slots", f"request {rid} (running, {len(tokens)} tokens, {computed} computed), "
                        f"{n} new", step, lambda: self.impl.allocate_slots(rid, tokens, computed, n))
        if out is None:
            # vLLM's FCFS scheduler, when a step finds the pool short, preempts the last request of its running
            # queue (the newest); readmitted while the pool is still tight, it hits its own blocks off the free
            # queue (docs/block_pool.md R3)
            if data.draw(st.booleans(), label="preempt_on_oom"):
                self._free(max(self.running), "preempt")
            return
        (state, new), impl_new = out
        self.ref = self._compare_new(state, new, impl_new, step)
        req.computed = computed + n
        self._write_kv(req, computed, computed + n)

    def _would_allocate(self, rid: int, tokens: list[int], computed: int, n: int) -> bool:
        try:
            bp.allocate_slots(self.ref, rid, tokens, computed, n)
        except OutOfMemory:
            return False
        return True

    # ------------------------------------------------------------ rules

    @operation(data=st.data())
    def allocate_slots(self, data: Any) -> None:
        """Admit a request (lookup + first chunk) or take the next step of a running one."""
        if self._extendable() and data.draw(st.booleans(), label="step_running"):
            self._extend(data)
        else:
            self._admit(data)

    @operation(when=lambda self: self.running or self.finished or self.waiting, data=st.data())
    def free(self, data: Any) -> None:
        """Finish or preempt a running request, or free one that holds nothing (finished, waiting): a no-op."""
        kinds = (["finish", "preempt"] if self.running else []) + (["idle"] if self.finished or self.waiting else [])
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "idle":
            rid = data.draw(st.sampled_from(sorted(self.finished[-3:]) + sorted(self.waiting)), label="request")
        else:
            rid = data.draw(st.sampled_from(sorted(self.running)), label="request")
        self._free(rid, kind)

    def _free(self, rid: int, kind: str) -> None:
        """``free`` on both sides; the scheduler's books follow ``kind`` (finish, preempt, idle)."""
        out = self.call("free", f"request {rid} ({kind})", lambda: (bp.free(self.ref, rid), None),
                        lambda: self.impl.free(rid))
        if out is None:
            return
        self.ref = out[0][0]
        if kind == "finish":
            del self.running[rid]
            self.finished.append(rid)
        elif kind == "preempt":
            req = self.running.pop(rid)
            req.computed = 0
            self.waiting[rid] = req
            self.count("preemptions per example")

    @operation(when=lambda self: self.running, data=st.data())
    def remove_skipped_blocks(self, data: Any) -> None:
        """Release out-of-window blocks of a running request up to a processed count (at most what it computed)."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="request")
        top = self.running[rid].computed
        n = data.draw(st.one_of(st.just(top), st.integers(0, top)), label="num_computed_tokens")
        out = self.call("remove_skipped_blocks", f"request {rid}, {n} computed",
                        lambda: (bp.remove_skipped_blocks(self.ref, rid, n), None),
                        lambda: self.impl.remove_skipped_blocks(rid, n))
        if out is not None:
            self.ref = out[0][0]

    @operation(when=lambda self: self.running, data=st.data())
    def cache_blocks(self, data: Any) -> None:
        """Cache a running request's full computed blocks up to a count (those cached already stay)."""
        rid = data.draw(st.sampled_from(sorted(self.running)), label="request")
        req = self.running[rid]
        n = data.draw(st.integers(0, req.computed), label="num_tokens")
        tokens = list(req.tokens)
        out = self.call("cache_blocks", f"request {rid}, {n} tokens",
                        lambda: (bp.cache_blocks(self.ref, rid, tokens, n), None),
                        lambda: self.impl.cache_blocks(rid, tokens, n))
        if out is not None:
            self.ref = out[0][0]

    @operation(data=st.data())
    def evict_blocks(self, data: Any) -> None:
        """Drop blocks from the prefix cache by id (a KV connector reporting them lost): cached ones mostly."""
        cached = sorted({x for ids in self.ref.cached.values() for x in ids})
        pool = st.sampled_from(cached) if cached else st.integers(0, self.config.num_blocks - 1)
        ids = data.draw(st.lists(st.one_of(pool, st.integers(0, self.config.num_blocks - 1)), min_size=1,
                                 max_size=3, unique=True), label="block_ids")
        if any(x in cached for x in ids):
            self.note("cached blocks evicted")
        out = self.call("evict_blocks", f"blocks {ids}", lambda: (bp.evict_blocks(self.ref, ids), None),
                        lambda: self.impl.evict_blocks(ids))
        if out is not None:
            self.ref = out[0][0]

    @operation(when=lambda self: not self.running)
    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache (RLHF weight updates): only with nothing in use."""
        out = self.call("reset_prefix_cache", "", lambda: bp.reset_prefix_cache(self.ref),
                        lambda: self.impl.reset_prefix_cache())
        if out is None:
            return
        (self.ref, done), theirs = out
        if theirs is not done:
            self.fail(f"reset_prefix_cache returned {theirs!r}; the reference {done!r}")
        if done:
            self.note("prefix cache reset")

    # ------------------------------------------------------------ the comparison

    @check_after_each_step
    def agrees_with_reference(self) -> None:
        """V1-V5 on both sides, V7 on the reference, the snapshots equal (or equal up to block ids), V7 on the
        implementation's ghost KV."""
        self.stats.steps += 1
        bp.check_block_pool(self.ref)
        snap = self.snapshot()
        try:
            bp.check_snapshot(snap, self.config)
        except InvariantViolation as err:
            self.fail(f"the implementation breaks {err}", check=err.invariant)
        mine = bp.snapshot(self.ref)
        free = self.query("get_num_free_blocks()", lambda impl: impl.get_num_free_blocks())
        if free != len(mine.free):
            self.fail(f"get_num_free_blocks() = {free}, the reference has {len(mine.free)} free")
        self._compare_exact(snap, mine, exact=self.supports(C.EXACT_PAGE_ORDER))
        for x, key in enumerate(snap.block_key):
            if key is not None and self.kv.get(x) != list(key[1][-self.b:]):
                self.fail(f"block {x} is cached under the key of tokens ...{list(key[1][-self.b:])} (group {key[0]}) "
                          f"but holds {self.kv.get(x)}: a later hit would read other tokens' KV", check="V7",
                          detail={"block": x})
        self.trace.next_step()

    def _compare_exact(self, snap: bp.BlockPoolSnapshot, mine: bp.BlockPoolSnapshot, *, exact: bool) -> None:
        """The snapshots equal; without ``exact`` (no ``EXACT_PAGE_ORDER``: the reference follows the
        implementation's reuse order) the free queue and each key's blocks as sets."""
        def unordered(value: Any, name: str) -> Any:
            if exact:
                return value
            if name == "free":
                return sorted(value)
            if name == "cached":
                return {k: sorted(v) for k, v in value.items()}
            return value

        for name in ("free", "requests", "num_cached", "block_key", "cached"):
            theirs, want = unordered(getattr(snap, name), name), unordered(getattr(mine, name), name)
            if theirs != want:
                declared = " (declared EXACT_PAGE_ORDER)" if exact else ""
                self.fail(f"{name} differs from the reference{declared}: {_show(theirs)} vs the reference's "
                          f"{_show(want)}", check=name)
        if snap.ref_cnt[1:] != mine.ref_cnt[1:]:
            self.fail(f"reference counts {list(snap.ref_cnt[1:])} (blocks 1..), the reference's "
                      f"{list(mine.ref_cnt[1:])}", check="ref_cnt")

    # ------------------------------------------------------------ misuse (REJECTS_MISUSE): both sides reject

    @misuse("evict_blocks", "out_of_range")
    def _evict_out_of_range(self, data: Any) -> MisuseCall:
        x = self.config.num_blocks + data.draw(st.integers(0, 2), label="past")
        return MisuseCall(f"blocks [{x}] (pool of {self.config.num_blocks})",
                          lambda: bp.evict_blocks(self.ref, [x]), lambda: self.impl.evict_blocks([x]))

    @misuse("allocate_slots", "past_tokens", when=lambda self: bool(self.running))
    def _past_tokens(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="request")
        req = self.running[rid]
        tokens, n = list(req.tokens), len(req.tokens) - req.computed + 1
        return MisuseCall(f"request {rid}, {req.computed} computed, {n} new of {len(tokens)} tokens",
                          lambda: bp.allocate_slots(self.ref, rid, tokens, req.computed, n),
                          lambda: self.impl.allocate_slots(rid, tokens, req.computed, n))

    @misuse("allocate_slots", "nothing_to_compute", when=lambda self: bool(self.running))
    def _nothing_to_compute(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="request")
        req = self.running[rid]
        tokens = list(req.tokens)
        return MisuseCall(f"request {rid}, {req.computed} computed, 0 new",
                          lambda: bp.allocate_slots(self.ref, rid, tokens, req.computed, 0),
                          lambda: self.impl.allocate_slots(rid, tokens, req.computed, 0))

    @misuse("remove_skipped_blocks", "past_computed", when=lambda self: bool(self.running))
    def _past_computed(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="request")
        n = self.running[rid].computed + data.draw(st.integers(1, self.b + 1), label="past")
        return MisuseCall(f"request {rid}, {n} computed (it computed {self.running[rid].computed})",
                          lambda: bp.remove_skipped_blocks(self.ref, rid, n),
                          lambda: self.impl.remove_skipped_blocks(rid, n))

    @misuse("cache_blocks", "uncomputed", when=lambda self: bool(self.running))
    def _uncomputed(self, data: Any) -> MisuseCall:
        rid = data.draw(st.sampled_from(sorted(self.running)), label="request")
        req = self.running[rid]
        tokens, n = list(req.tokens), req.computed + 1
        return MisuseCall(f"request {rid}, {n} tokens (it computed {req.computed})",
                          lambda: bp.cache_blocks(self.ref, rid, tokens, n),
                          lambda: self.impl.cache_blocks(rid, tokens, n))

    def misuse_allowed(self) -> bool:
        """Misuse on every third step only, so that it does not crowd out the lifecycle."""
        return len(self.trace) % 3 == 2


def _show(value: Any, n: int = 10) -> str:
    text = repr(value)
    return text if len(text) <= 240 else text[:240] + " ..."


SUITE = Suite(BlockPoolMachine, BLOCK_POOL_CONFIGS)
