"""The torch block_pool runtime (vLLM 0.33.0's v1 KV cache manager) against the reference, call by call.

* a seeded differential run plays vLLM's scheduler (admissions through ``get_computed_blocks`` and the admission
  gate, prefill chunks, decodes, out-of-window releases, preemptions, caching, evictions, resets) on the runtime and
  on ``kvproof.reference.block_pool`` at once: every return value, every error (class, op, argument, sizes), the
  snapshot (free-queue order included: ``EXACT_PAGE_ORDER``), the free count and the block contents must be equal
  after every call, and the runtime's snapshot must keep V1-V5 (``check_snapshot``) and its cached blocks V7. The
  run counts the situations it reached, so it cannot pass without hits, refusals, null blocks, evictions and resets;
* misuse raises ``InvalidOperation`` naming the reference's argument, and a refusal (``OutOfMemory``) changes
  nothing, the out-of-window release vLLM does before its capacity check included;
* the same on ``cuda`` through the ``device`` fixture (skipped, with its reason, on a machine without one).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvproof.gpu_runtime.block_pool import BlockPoolRuntime
from kvproof.reference import block_pool as bp
from kvproof.reference.contract import BlockPoolUnderTest, Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.registry import Component

#: small pools on purpose (they fill: refusals, reuse of cached blocks); B in {1, 2, 4} with and without a window,
#: windows that are and are not block multiples, one admission cap that binds (T < L)
CONFIGS = (
    bp.BlockPoolConfig(block_size=1, num_blocks=9, sliding_window=3, max_model_len=8),
    bp.BlockPoolConfig(block_size=2, num_blocks=11, sliding_window=4, max_model_len=12),
    bp.BlockPoolConfig(block_size=4, num_blocks=13, sliding_window=6, max_model_len=16),
    bp.BlockPoolConfig(block_size=2, num_blocks=10, sliding_window=5, max_model_len=14, max_in_flight_tokens=3),
    bp.BlockPoolConfig(block_size=1, num_blocks=7, max_model_len=8),
    bp.BlockPoolConfig(block_size=4, num_blocks=9, max_model_len=16),
)
STEPS = 900
SEEDS = (0, 1, 2)


@dataclass
class Req:
    rid: int
    base: int
    tokens: list[int]
    computed: int = 0


@dataclass
class Lockstep:
    """The scheduler over both implementations; ``seen`` counts the situations reached."""

    config: bp.BlockPoolConfig
    device: str
    seed: int
    seen: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        cfg = self.config
        self.rng = random.Random(f"{self.seed}-{cfg.label()}")
        self.ref = bp.initial_state(cfg)
        self.rt = BlockPoolRuntime(cfg, device=self.device)
        self.b = cfg.block_size
        top = cfg.max_model_len + 1
        first = list(range(1, top + 1))
        # base 1 differs from base 0 in its first token only: same block contents from block 1 on, other prefixes
        self.bases = (first, [0, *first[1:]], list(range(500, 500 + top)))
        self.waiting: dict[int, Req] = {}
        self.running: dict[int, Req] = {}
        self.finished: list[int] = []
        self.next_rid = 1
        self.fresh = 10_000
        self.before_keys = self.ref.block_key  # the reference's keys before the current call (reuse counting)

    # ------------------------------------------------------------ one call on both sides

    def both(self, what: str, ref_call: Callable[[], Any], rt_call: Callable[[], Any], *, query: bool = False
             ) -> tuple[Any, Any, Exception | None]:
        """Run a call on the reference and on the runtime; they must end alike; then compare the states.

        ``ref_call`` returns the reference's new state, or ``(state, value)``; a ``query`` returns a value only.
        Returns the reference's value, the runtime's and the error (None: success)."""
        self.before_keys = self.ref.block_key
        ref_out: Any = None
        rt_out: Any = None
        ref_err: Exception | None = None
        rt_err: Exception | None = None
        try:
            ref_out = ref_call()
        except (OutOfMemory, InvalidOperation) as err:
            ref_err = err
        try:
            rt_out = rt_call()
        except (OutOfMemory, InvalidOperation) as err:
            rt_err = err
        assert type(rt_err) is type(ref_err), f"{what}: runtime {rt_err!r}, reference {ref_err!r}"
        if ref_err is None and not query:
            if isinstance(ref_out, tuple):
                self.ref, ref_out = ref_out
            else:
                self.ref, ref_out = ref_out, None
        if ref_err is None:  # the same answer: a Hit, the new blocks per group, reset's bool, or None
            assert rt_out == ref_out and type(rt_out) is type(ref_out), f"{what}: {rt_out!r} vs {ref_out!r}"
        if isinstance(ref_err, InvalidOperation):
            assert isinstance(rt_err, InvalidOperation)
            assert (rt_err.op, rt_err.argument) == (ref_err.op, ref_err.argument), f"{what}: {rt_err} vs {ref_err}"
            self.seen["misuse rejected"] += 1
        if isinstance(ref_err, OutOfMemory):
            assert isinstance(rt_err, OutOfMemory)
            mine = (rt_err.op, rt_err.pages_needed, rt_err.pages_free, rt_err.request)
            assert mine == (ref_err.op, ref_err.pages_needed, ref_err.pages_free, ref_err.request), what
            self.seen["out of memory"] += 1
        self.compare(what)
        return ref_out, rt_out, ref_err

    def compare(self, what: str) -> None:
        snap = self.rt.snapshot()
        bp.check_snapshot(snap, self.config)
        bp.check_block_pool(self.ref)
        assert snap == bp.snapshot(self.ref), f"after {what}"
        assert self.rt.get_num_free_blocks() == len(self.ref.free), what
        content = self.rt.content.tolist()
        assert content == [list(c) for c in self.ref.content], f"block contents after {what}"
        for x, key in enumerate(snap.block_key):  # V7 on the runtime's own contents
            if key is not None:
                assert content[x] == list(key[1][-self.b:]), f"block {x} after {what}"
        if any(bp.NULL_BLOCK in lists[bp.SWA] for lists in snap.requests.values() if len(lists) > 1):
            self.seen["SWA null blocks held"] += 1

    # ------------------------------------------------------------ the scheduler

    def fresh_token(self) -> int:
        self.fresh += 1
        return self.fresh

    def prompt(self) -> Req:
        top, b = self.config.max_model_len, self.b
        base = self.rng.randrange(len(self.bases))
        edges = [x for k in range(1, 5) for x in (k * b - 1, k * b, k * b + 1) if 1 <= x <= top]
        n = self.rng.choice(edges) if self.rng.random() < 0.6 else self.rng.randint(1, top)
        tokens = list(self.bases[base][:n])
        for _ in range(self.rng.randint(0, min(2, top - n))):
            tokens.append(self.fresh_token())
        req = Req(self.next_rid, base, tokens)
        self.next_rid += 1
        return req

    def admit(self) -> None:
        waiting = sorted(self.waiting)
        req = self.waiting[self.rng.choice(waiting)] if waiting and self.rng.random() < 0.5 else self.prompt()
        tokens = list(req.tokens)
        mine, theirs, _ = self.both(f"get_computed_blocks({tokens})", lambda: bp.get_computed_blocks(self.ref, tokens),
                                    lambda: self.rt.get_computed_blocks(tokens), query=True)
        assert theirs == mine
        for g, blocks in enumerate(theirs.blocks):  # V6: a hit block holds the request's tokens at its position
            for i, x in enumerate(blocks):
                if x != bp.NULL_BLOCK:
                    assert self.rt.content[x].tolist() == tokens[i * self.b:(i + 1) * self.b], (g, i, x)
        if mine.num_tokens:
            self.seen["prefix-cache hits"] += 1
        if len(mine.blocks) > 1 and bp.NULL_BLOCK in mine.blocks[bp.SWA]:
            self.seen["SWA hits with null blocks"] += 1
        hit = mine.num_tokens
        n = len(tokens) - hit if self.rng.random() < 0.5 else self.rng.randint(1, len(tokens) - hit)
        must_fit = self.rng.random() < 0.8
        _, new, err = self.both(
            f"allocate_slots(request {req.rid}, {len(tokens)} tokens, hit {hit}, {n} new, must_fit={must_fit})",
            lambda: bp.allocate_slots(self.ref, req.rid, tokens, 0, n, mine, must_fit),
            lambda: self.rt.allocate_slots(req.rid, tokens, 0, n, theirs, must_fit))
        if err is not None:
            self.waiting[req.rid] = req
            return
        self.note_reuse(new)
        self.waiting.pop(req.rid, None)
        req.computed = hit + n
        self.running[req.rid] = req

    def note_reuse(self, new: tuple[tuple[int, ...], ...]) -> None:
        """Count the blocks handed out that were cached before the call (evicted by ``popleft``)."""
        if any(self.before_keys[x] is not None for blocks in new for x in blocks):
            self.seen["cached blocks reused"] += 1

    def extend(self) -> None:
        top = self.config.max_model_len
        rids = [r for r, q in sorted(self.running.items()) if q.computed < len(q.tokens) or len(q.tokens) < top]
        if not rids:
            self.admit()
            return
        req = self.running[self.rng.choice(rids)]
        if req.computed == len(req.tokens):  # decode: the sampled token first
            follow = self.bases[req.base]
            req.tokens.append(follow[len(req.tokens)] if self.rng.random() < 0.7 else self.fresh_token())
            n = 1
        else:
            left = len(req.tokens) - req.computed
            n = left if self.rng.random() < 0.5 else self.rng.randint(1, left)
        tokens, computed, rid = list(req.tokens), req.computed, req.rid
        # vLLM releases out-of-window blocks inside allocate_slots before its capacity check: its own call here
        self.both(f"remove_skipped_blocks({rid}, {computed})",
                              lambda: bp.remove_skipped_blocks(self.ref, rid, computed),
                              lambda: self.rt.remove_skipped_blocks(rid, computed))
        _, new, err = self.both(f"allocate_slots(request {rid} running, {computed} computed, {n} new)",
                                  lambda: bp.allocate_slots(self.ref, rid, tokens, computed, n),
                                  lambda: self.rt.allocate_slots(rid, tokens, computed, n))
        if err is not None:
            # vLLM's scheduler preempts its newest running request to make room (mostly)
            if self.rng.random() < 0.6:
                victim = max(self.running)
                self.both(f"free({victim}) (preempted)", lambda: bp.free(self.ref, victim),
                          lambda: self.rt.free(victim))
                self.waiting[victim] = self.running.pop(victim)
                self.waiting[victim].computed = 0
                self.seen["preemptions"] += 1
            return
        self.note_reuse(new)
        req.computed = computed + n

    def free(self) -> None:
        if self.running and self.rng.random() < 0.85:
            rid = self.rng.choice(sorted(self.running))
            preempt = self.rng.random() < 0.4
        else:
            pool = sorted(self.finished[-3:]) + sorted(self.waiting) + [self.next_rid + 7]
            rid, preempt = self.rng.choice(pool), False
        self.both(f"free({rid})", lambda: bp.free(self.ref, rid), lambda: self.rt.free(rid))
        if rid in self.running:
            req = self.running.pop(rid)
            if preempt:
                req.computed = 0
                self.waiting[rid] = req
                self.seen["preemptions"] += 1
            else:
                self.finished.append(rid)

    def remove_skipped(self) -> None:
        if not self.running:
            return
        rid = self.rng.choice(sorted(self.running))
        top = self.running[rid].computed
        n = top if self.rng.random() < 0.5 else self.rng.randint(0, top)
        self.both(f"remove_skipped_blocks({rid}, {n})", lambda: bp.remove_skipped_blocks(self.ref, rid, n),
                              lambda: self.rt.remove_skipped_blocks(rid, n))

    def cache(self) -> None:
        if not self.running:
            return
        req = self.running[self.rng.choice(sorted(self.running))]
        n, tokens = self.rng.randint(0, req.computed), list(req.tokens)
        self.both(f"cache_blocks({req.rid}, {n})", lambda: bp.cache_blocks(self.ref, req.rid, tokens, n),
                              lambda: self.rt.cache_blocks(req.rid, tokens, n))

    def evict(self) -> None:
        n = self.config.num_blocks
        cached = sorted({x for ids in self.ref.cached.values() for x in ids})
        ids = list({self.rng.choice(cached) if cached and self.rng.random() < 0.8 else self.rng.randrange(n)
                    for _ in range(self.rng.randint(1, 3))})
        if any(x in cached for x in ids):
            self.seen["cached blocks evicted"] += 1
        self.both(f"evict_blocks({ids})", lambda: bp.evict_blocks(self.ref, ids),
                              lambda: self.rt.evict_blocks(ids))

    def reset(self) -> None:
        if self.rng.random() < 0.5:  # drain first, so that the reset can succeed
            for rid in sorted(self.running):
                self.both(f"free({rid})", lambda rid=rid: bp.free(self.ref, rid),
                                      lambda rid=rid: self.rt.free(rid))
                self.finished.append(rid)
            self.running.clear()
        want, done, _ = self.both("reset_prefix_cache()", lambda: bp.reset_prefix_cache(self.ref),
                                  lambda: self.rt.reset_prefix_cache())
        assert done is want
        if done:
            self.seen["reset succeeded"] += 1

    def misuse(self) -> None:
        """A call both must reject the same way (``both`` compares op and argument)."""
        n, rids = self.config.num_blocks, sorted(self.running)
        calls: list[tuple[str, Callable[[], Any], Callable[[], Any]]]
        if not rids:
            ids = [n + self.rng.randrange(3)]
            calls = [("evict_blocks(out of range)", lambda: bp.evict_blocks(self.ref, ids),
                      lambda: self.rt.evict_blocks(ids))]
        else:
            rid = self.rng.choice(rids)
            tokens, c = list(self.running[rid].tokens), self.running[rid].computed
            k = len(tokens) - c + 1
            calls = [
                ("allocate_slots(past tokens)", lambda: bp.allocate_slots(self.ref, rid, tokens, c, k),
                 lambda: self.rt.allocate_slots(rid, tokens, c, k)),
                ("allocate_slots(stale computed)", lambda: bp.allocate_slots(self.ref, rid, tokens, c + 1, 1),
                 lambda: self.rt.allocate_slots(rid, tokens, c + 1, 1)),
                ("remove_skipped_blocks(past computed)", lambda: bp.remove_skipped_blocks(self.ref, rid, c + 1),
                 lambda: self.rt.remove_skipped_blocks(rid, c + 1)),
                ("cache_blocks(uncomputed)", lambda: bp.cache_blocks(self.ref, rid, tokens, c + 1),
                 lambda: self.rt.cache_blocks(rid, tokens, c + 1)),
            ]
        what, ref_call, rt_call = self.rng.choice(calls)
        err = self.both(what, ref_call, rt_call)[2]
        assert isinstance(err, InvalidOperation), f"{what} was accepted by both sides"

    def run(self, steps: int) -> Counter[str]:
        ops = [(self.admit, 5), (self.extend, 9), (self.free, 3), (self.remove_skipped, 1), (self.cache, 1),
               (self.evict, 1), (self.reset, 0.4), (self.misuse, 0.6)]
        calls, weights = zip(*ops, strict=True)
        for _ in range(steps):
            self.rng.choices(calls, weights)[0]()
        return self.seen


def _run_all(device: str) -> Counter[str]:
    seen: Counter[str] = Counter()
    per_config = []
    # one seed on cuda (a kernel launch and a sync per tensor op): each seed alone reaches every situation
    seeds = SEEDS if device == "cpu" else SEEDS[:1]
    for config in CONFIGS:
        got: Counter[str] = Counter()
        for seed in seeds:
            got += Lockstep(config, device, seed).run(STEPS)
        per_config.append((config, got))
        seen += got
    # every pool hits its prefix cache, fills (refusals, reuse of cached blocks, preemptions), is evicted from and
    # reset; every pool with a window holds null blocks and hits runs of cached blocks right of null ones
    for config, got in per_config:
        wanted = ["prefix-cache hits", "out of memory", "reset succeeded", "cached blocks evicted",
                  "cached blocks reused", "preemptions", "misuse rejected"]
        if config.sliding_window is not None:
            wanted += ["SWA null blocks held", "SWA hits with null blocks"]
        for what in wanted:
            assert got[what] > 0, f"{config.label()}: no '{what}' reached: {dict(got)}"
    return seen


def test_differential_against_the_reference(device: str) -> None:
    seen = _run_all(device)
    print(dict(seen))  # the situations reached (pytest -s shows them)
    assert seen["prefix-cache hits"] >= 100 and seen["out of memory"] >= 100 and seen["reset succeeded"] >= 10, seen
    if device == "cpu":  # the counts of the seeded run, so that a change of the scheduler's mix shows
        assert seen["SWA hits with null blocks"] >= 50 and seen["cached blocks evicted"] >= 200, seen


# ------------------------------------------------------------ misuse and refusals, one by one

W4 = bp.BlockPoolConfig(block_size=2, num_blocks=12, sliding_window=4, max_model_len=16)
PROMPT = list(range(1, 10))  # request 1's 9 tokens
TWO = [1, 2, 3, 4, 70, 71, 72]  # request 2's 7 tokens (5 computed)


def _setup(device: str) -> tuple[bp.BlockPoolState, BlockPoolRuntime]:
    """Request 1 computed its 9 tokens and finished (its blocks cached, free); request 2 runs with 5 of 7 tokens."""
    state, rt = bp.initial_state(W4), BlockPoolRuntime(W4, device=device)
    state, _ = bp.allocate_slots(state, 1, PROMPT, 0, 9)
    rt.allocate_slots(1, PROMPT, 0, 9)
    state = bp.free(state, 1)
    rt.free(1)
    hit = bp.get_computed_blocks(state, TWO)
    state, _ = bp.allocate_slots(state, 2, TWO, 0, 5 - hit.num_tokens, hit)
    rt.allocate_slots(2, TWO, 0, 5 - hit.num_tokens, rt.get_computed_blocks(TWO))
    assert rt.snapshot() == bp.snapshot(state)
    return state, rt


def _hit(state: bp.BlockPoolState) -> bp.Hit:
    return bp.get_computed_blocks(state, [*PROMPT, 99])


MISUSE: list[tuple[str, str, Callable[[bp.BlockPoolState], tuple[str, tuple[Any, ...]]]]] = [
    ("evict past the pool", "block_ids", lambda s: ("evict_blocks", ([3, 12],))),
    ("evict a negative id", "block_ids", lambda s: ("evict_blocks", ([-1],))),
    ("empty tokens (lookup)", "tokens", lambda s: ("get_computed_blocks", ([],))),
    ("negative token", "tokens", lambda s: ("get_computed_blocks", ([1, -2],))),
    ("lookup limit past tokens", "max_cache_hit_length", lambda s: ("get_computed_blocks", ([1, 2], 3))),
    ("negative lookup limit", "max_cache_hit_length", lambda s: ("get_computed_blocks", ([1, 2], -1))),
    ("empty tokens (allocate)", "tokens", lambda s: ("allocate_slots", (3, [], 0, 1))),
    ("negative computed", "num_computed_tokens", lambda s: ("allocate_slots", (2, TWO, -1, 1))),
    ("negative new", "num_new_tokens", lambda s: ("allocate_slots", (2, TWO, 5, -1))),
    ("running, stale computed", "num_computed_tokens",
     lambda s: ("allocate_slots", (2, TWO, 4, 1))),
    ("running, nothing to compute", "num_new_tokens", lambda s: ("allocate_slots", (2, TWO, 5, 0))),
    ("running, past its tokens", "num_new_tokens", lambda s: ("allocate_slots", (2, TWO, 5, 3))),
    ("running, given a hit", "hit", lambda s: ("allocate_slots", (2, [*PROMPT, 99], 5, 1, _hit(s)))),
    ("waiting, computed tokens", "num_computed_tokens", lambda s: ("allocate_slots", (3, [1, 2, 3], 1, 1))),
    ("past max_model_len", "num_new_tokens", lambda s: ("allocate_slots", (3, list(range(200, 217)), 0, 17))),
    ("stale hit", "hit", lambda s: ("allocate_slots", (
        3, [*PROMPT, 99], 0, 1, bp.Hit(blocks=tuple(x[::-1] for x in _hit(s).blocks), num_tokens=_hit(s).num_tokens)))),
    ("hit for other groups", "hit", lambda s: ("allocate_slots", (3, [*PROMPT, 99], 0, 1, bp.Hit(blocks=((),),
                                                                                                 num_tokens=0)))),
    ("hit of every token", "hit", lambda s: ("allocate_slots", (3, PROMPT[:8], 0, 0, bp.Hit(
        blocks=_hit(s).blocks, num_tokens=8)))),
    ("hit with a negative length", "max_cache_hit_length", lambda s: ("allocate_slots", (
        3, PROMPT, 0, 1, bp.Hit(blocks=((), ()), num_tokens=-2)))),
    ("release past computed", "num_computed_tokens", lambda s: ("remove_skipped_blocks", (2, 6))),
    ("release negative", "num_computed_tokens", lambda s: ("remove_skipped_blocks", (2, -1))),
    ("cache uncomputed", "num_tokens", lambda s: ("cache_blocks", (2, TWO, 6))),
    ("cache negative", "num_tokens", lambda s: ("cache_blocks", (2, TWO, -1))),
    ("cache for nobody", "req", lambda s: ("cache_blocks", (9, [1, 2, 3], 1))),
]


@pytest.mark.parametrize(("case", "argument", "call"), MISUSE, ids=[m[0] for m in MISUSE])
def test_misuse_is_typed_and_changes_nothing(case: str, argument: str, call: Any, device: str) -> None:
    state, rt = _setup(device)
    method, args = call(state)
    before = rt.snapshot()
    content = rt.content.clone()
    with pytest.raises(InvalidOperation) as mine:
        getattr(rt, method)(*args)
    with pytest.raises(InvalidOperation) as theirs:
        getattr(bp, method)(state, *args)
    assert mine.value.argument == argument == theirs.value.argument, case
    assert mine.value.op == theirs.value.op
    assert rt.snapshot() == before == bp.snapshot(state)
    assert torch.equal(rt.content, content)


def test_out_of_memory_changes_nothing_not_even_the_window_release(device: str) -> None:
    """A running sliding-window request whose next chunk does not fit: vLLM would have released its out-of-window
    blocks before refusing; the runtime (like the reference) counts them and refuses with the state unchanged."""
    cfg = bp.BlockPoolConfig(block_size=1, num_blocks=8, sliding_window=2, max_model_len=16)
    state, rt = bp.initial_state(cfg), BlockPoolRuntime(cfg, device=device)
    tokens = list(range(1, 11))
    state, _ = bp.allocate_slots(state, 1, tokens, 0, 3)
    rt.allocate_slots(1, tokens, 0, 3)  # 3 + 3 blocks of 7
    before = rt.snapshot()
    assert before == bp.snapshot(state) and rt.get_num_free_blocks() == 1
    with pytest.raises(OutOfMemory) as mine:
        rt.allocate_slots(1, tokens, 3, 4)  # 4 + 4 more; the window gives 2 back: 3 free
    with pytest.raises(OutOfMemory) as theirs:
        bp.allocate_slots(state, 1, tokens, 3, 4)
    assert (mine.value.pages_needed, mine.value.pages_free) == (theirs.value.pages_needed, theirs.value.pages_free)
    assert (mine.value.pages_needed, mine.value.pages_free, mine.value.request) == (8, 3, 1)
    assert rt.snapshot() == before
    # the admission gate refuses a request whose whole sequence does not fit, also changing nothing
    hit = rt.get_computed_blocks(list(range(50, 60)))
    with pytest.raises(OutOfMemory) as gate:
        rt.allocate_slots(2, list(range(50, 60)), 0, 1, hit, full_sequence_must_fit=True)
    assert gate.value.pages_free == 1
    assert rt.snapshot() == before


def test_many_requests_grow_the_block_table(device: str) -> None:
    cfg = bp.BlockPoolConfig(block_size=2, num_blocks=100, sliding_window=3, max_model_len=8)
    state, rt = bp.initial_state(cfg), BlockPoolRuntime(cfg, device=device)
    for r in range(20):
        tokens = [r % 3, r, r + 1]
        hit = bp.get_computed_blocks(state, tokens)
        state, want = bp.allocate_slots(state, r, tokens, 0, 3 - hit.num_tokens, hit)
        assert rt.allocate_slots(r, tokens, 0, 3 - hit.num_tokens, rt.get_computed_blocks(tokens)) == want
    assert rt.block_table.shape[1] >= 20
    for r in range(0, 20, 3):
        state = bp.free(state, r)
        rt.free(r)
    assert rt.snapshot() == bp.snapshot(state)


def test_contract_placement_and_order(device: str) -> None:
    rt = BlockPoolRuntime(W4, device=device)
    assert isinstance(rt, BlockPoolUnderTest)
    assert rt.capabilities == {Capability.EXACT_PAGE_ORDER, Capability.REJECTS_MISUSE}
    assert rt.components == {Component.BLOCK_POOL}
    for t in (rt.ref_cnt, rt.rank, rt.content, rt.block_table):
        assert t.device.type == torch.device(device).type and t.dtype == torch.int64
    # vLLM 0.33.0: 10 tokens at B=4, W=8 take ([1,2,3],[4,5,6]); freeing puts each group's uncached tail first
    cfg = bp.BlockPoolConfig(block_size=4, num_blocks=16, sliding_window=8, max_model_len=64)
    rt = BlockPoolRuntime(cfg, device=device)
    assert rt.allocate_slots(1, list(range(10)), 0, 10) == ((1, 2, 3), (4, 5, 6))
    rt.free(1)
    assert rt.snapshot().free == (6, 3, *range(7, 16), 2, 1, 5, 4)
