"""block_pool drift: every transition of the Z3 model accepts the steps the reference takes.

Seeded reference runs of ``kvproof.reference.block_pool`` (the model's bounded instance: 6 blocks, block 0 the null
block, two request slots, a full-attention and a sliding-window group, ``B`` in 1..4; docs/block_pool.md §1-§4) play
a scheduler: waiting requests look up their prefix (``get_computed_blocks``) and are admitted with the hit
(``allocate_slots``, with and without the ``full_sequence_must_fit`` gate), running ones release their out-of-window
blocks (``remove_skipped_blocks``) and take chunks or decode tokens, finish (``free``); ``cache_blocks``,
``evict_blocks`` and ``reset_prefix_cache`` come in between. Mostly valid calls, some misuse.

Each step is abstracted into the model's state (:class:`kvproof.spec.block_pool.State`, a projection: the free count
and queue membership, the counts, per block whether it is cached and its key's group and index; per request slot
whether it is known, its computed tokens and per group its list's length, leading nulls, ``num_cached`` and the
index of each real block) and action (the call's counts, the hit's blocks per group at their index, the blocks each
group popped at their index, the evicted ids, ``ok``); the model's fields the reference does not keep (the key of a
free block no longer cached, the index of a block a list no longer holds) carry their previous value, as every
transition keeps them. The transition of the same name must accept the pair; a refused ``allocate_slots``
(``OutOfMemory``, vLLM's ``None``) is the model's ``ok = False`` step that changes nothing, and it has no step with
``ok = True``; a call the reference rejects as misuse has no successor where the model has that precondition.
Deliberately wrong transitions reject sampled steps, so these checks can fail.

``get_computed_blocks`` is a read: the model has no transition and no obligation of its name (its hit is the
``hit`` / ``adopt`` argument of ``allocate_slots``, its shape the obligation ``contiguous_blocks_for_hit``); its
answers are checked as hits the model's ``allocate_slots`` can adopt.
"""

from __future__ import annotations

import dataclasses
import functools
import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import z3

from kvproof.reference import block_pool as bp
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.spec import _ts, obligations, systems
from kvproof.spec import block_pool as spec

SYSTEM = spec.SYSTEM
N = spec.N_BLOCKS
SLOTS = spec.REQS
NULL = spec.NULL
GROUPS = spec.GROUPS
RUNS, STEPS = 60, 32

Values = dict[str, Any]
Pins = list[tuple[z3.ExprRef, z3.ExprRef]]

REFERENCE_OPS = ("get_computed_blocks", "allocate_slots", "remove_skipped_blocks", "free", "cache_blocks",
                 "evict_blocks", "reset_prefix_cache")
"""The operations of ``kvproof.reference.block_pool`` (the first is a read, with no transition)."""


@dataclasses.dataclass(frozen=True)
class Sample:
    """One reference call as the model sees it. ``post`` is None when the reference rejected the call as misuse;
    a refused ``allocate_slots`` (``OutOfMemory``) is the step ``ok = False`` with ``post == pre``. ``modelled``:
    the misuse breaks a precondition the model has (else the model may well take the step)."""

    op: str
    pre: Values
    action: Values
    post: Values | None
    error: str = ""
    kind: str = ""
    modelled: bool = True


# ---- the abstraction --------------------------------------------------------------------------------------------


def _leading_nulls(blocks: Sequence[int]) -> int:
    n = 0
    while n < len(blocks) and blocks[n] == NULL:
        n += 1
    return n


def initial_view(config: bp.BlockPoolConfig) -> Values:
    """The model's ``init`` for ``config``, the fields ``init`` leaves open (indices of held-by-none blocks) at 0."""
    return abstract(bp.initial_state(config), None)


def abstract(state: bp.BlockPoolState, prev: Values | None) -> Values:
    """The model's view of a reference state; what the reference does not keep is ``prev``'s (0 at the start)."""
    c, b = state.config, state.config.block_size
    held_at: dict[int, tuple[int, int]] = {}
    reqs = []
    for r in range(SLOTS):
        q = state.requests.get(r)
        groups = []
        for g in GROUPS:
            blocks = q.blocks[g] if q is not None else ()
            held = [False] * N
            idx = list(prev["reqs"][r]["groups"][g]["idx"]) if prev is not None else [0] * N
            for i, x in enumerate(blocks):
                if x != NULL:
                    held[x], idx[x] = True, i
                    held_at[x] = (g, i)
            groups.append({"length": len(blocks), "nulls": _leading_nulls(blocks),
                           "ncached": q.num_cached[g] if q is not None else 0, "held": held, "idx": idx})
        reqs.append({"active": q is not None, "computed": q.computed if q is not None else 0, "groups": groups})
    kgrp = list(prev["kgrp"]) if prev is not None else [0] * N
    kpos = list(prev["kpos"]) if prev is not None else [0] * N
    for x, key in enumerate(state.block_key):
        if key is not None:
            kgrp[x], kpos[x] = key[0], len(key[1]) // b - 1
        elif x in held_at:
            kgrp[x], kpos[x] = held_at[x]
    free = set(state.free)
    return {"B": b, "W": c.sliding_window, "L": c.max_model_len, "T": c.in_flight, "nfree": len(state.free),
            "ref": list(state.ref_cnt), "inq": [x in free for x in range(N)],
            "cached": [k is not None for k in state.block_key], "kgrp": kgrp, "kpos": kpos, "reqs": reqs}


def blank_action() -> Values:
    return {"req": 0, "ntok": 0, "n": 0, "new": 0, "hit": 0, "must_fit": False, "ok": False,
            "adopt": [[False] * N for _ in GROUPS], "take": [[False] * N for _ in GROUPS],
            "pos": [[-1] * N for _ in GROUPS], "ids": [False] * N}


def hit_action(action: Values, hit: bp.Hit | None, block_size: int) -> None:
    """The hit as the model reads it: ``hb`` blocks, and per group every real block of the hit list at its index."""
    if hit is None:
        return
    action["hit"] = hit.num_tokens // block_size
    for g, blocks in enumerate(hit.blocks):
        for i, x in enumerate(blocks):
            if x != NULL:
                action["adopt"][g][x], action["pos"][g][x] = True, i


# ---- reference runs ---------------------------------------------------------------------------------------------


class Tracker:
    """A reference run on a random configuration of the model's instance, with a seeded choice of calls: per request
    slot the tokens of its current request (a prompt drawn from two documents, so prompts share prefixes and hit)."""

    def __init__(self, rng: random.Random, config: bp.BlockPoolConfig | None = None) -> None:
        self.rng, self.state = rng, bp.initial_state(config or self._config(rng))
        self.view = initial_view(self.state.config)
        length = self.state.config.max_model_len
        self.docs = [[rng.randrange(3) for _ in range(length + 2)] for _ in range(2)]
        self.tokens: dict[int, list[int]] = {}
        self.hits: dict[int, bp.Hit] = {}  # the last lookup of a waiting slot's prompt

    @staticmethod
    def _config(rng: random.Random) -> bp.BlockPoolConfig:
        b = rng.choice(spec.BLOCK_SIZES)
        length = rng.randint(2, 5 * b)
        if rng.random() < 0.3:  # a window and an in-flight cap within a block: the admission cap binds
            window, in_flight = rng.randint(2, b + 1), rng.randint(1, b)
        else:
            window, in_flight = rng.randint(2, 2 * b + 1), rng.choice((None, rng.randint(1, length)))
        return bp.BlockPoolConfig(block_size=b, num_blocks=N, sliding_window=window, max_model_len=length,
                                  max_in_flight_tokens=in_flight)

    # -- choices

    def _prompt(self) -> list[int]:
        rng, cfg = self.rng, self.state.config
        n = rng.randint(1, cfg.max_model_len + (rng.random() < 0.15))
        doc = self.docs[rng.random() < 0.2]
        keep = n if rng.random() < 0.8 else rng.randint(0, n)
        return doc[:keep] + [rng.randrange(3, 6) for _ in range(n - keep)]

    def _running(self) -> list[int]:
        return [r for r in range(SLOTS) if r in self.state.requests]

    def _waiting(self) -> list[int]:
        return [r for r in range(SLOTS) if r not in self.state.requests]

    def _slot(self, mine: list[int]) -> int:
        return self.rng.choice(mine) if mine and self.rng.random() < 0.9 else self.rng.randrange(SLOTS)

    def step(self) -> Sample:
        rng = self.rng
        running, waiting = self._running(), self._waiting()
        op = rng.choice(["get_computed_blocks"] * (2 if waiting else 0) + ["allocate_slots"] * 6
                        + ["remove_skipped_blocks"] * (2 if running else 1) + ["free"] * (2 if running else 1)
                        + ["cache_blocks", "evict_blocks", "reset_prefix_cache"])
        if op == "get_computed_blocks":
            return self.lookup(rng.choice(waiting))
        if op == "allocate_slots":
            r = self._slot(running if running and (not waiting or rng.random() < 0.6) else waiting)
            if r not in self.state.requests:
                return self._admit(r)
            if self.state.requests[r].computed < self.state.config.max_model_len or rng.random() < 0.15:
                return self._extend(r)
            return self.free(r)  # the request is done (at max_model_len): it finishes
        if op == "remove_skipped_blocks":
            behind = [r for r in running if self._releasable(r)]  # the window moved past a held block
            return self._release(rng.choice(behind) if behind and rng.random() < 0.7 else self._slot(running))
        if op == "free":
            return self.free(self._slot(running))
        if op == "cache_blocks":
            return self._cache(self._slot(running))
        if op == "evict_blocks":
            return self._evict()
        return self._run(op, {}, functools.partial(bp.reset_prefix_cache, self.state))

    def free(self, r: int) -> Sample:
        self.hits.pop(r, None)
        return self._run("free", {"req": r}, functools.partial(bp.free, self.state, r))

    def lookup(self, r: int, tokens: list[int] | None = None) -> Sample:
        """A waiting slot gets a new prompt and looks it up (now and then with a hit length out of range)."""
        tokens = self.tokens[r] = tokens if tokens is not None else self._prompt()
        action = {**blank_action(), "req": r, "ntok": len(tokens)}
        if self.rng.random() < 0.08:
            bad = self.rng.choice((-1, len(tokens) + 1))
            return self._run("get_computed_blocks", action,
                             functools.partial(bp.get_computed_blocks, self.state, tokens, bad),
                             kind="hit_length_out_of_range", modelled=False)
        hit = self.hits[r] = bp.get_computed_blocks(self.state, tokens)
        return self._run("get_computed_blocks", action, lambda: hit)

    def _stale(self, hit: bp.Hit, tokens: Sequence[int]) -> bool:
        """The hit is not what the prefix cache gives ``tokens`` now (the reference's check)."""
        return hit.num_tokens >= len(tokens) or bp.get_computed_blocks(self.state, tokens, hit.num_tokens) != hit

    def _admit(self, r: int) -> Sample:
        """A waiting request joins with its hit and a first chunk; some calls are misuse."""
        rng, cfg = self.rng, self.state.config
        if r not in self.tokens or rng.random() < 0.3:
            self.tokens[r] = self._prompt()
            self.hits.pop(r, None)
        tokens = self.tokens[r]
        hit: bp.Hit | None = bp.get_computed_blocks(self.state, tokens)
        kind = ""
        roll = rng.random()
        if roll < 0.25 and r in self.hits and self.hits[r] != hit:
            hit = self.hits[r]  # looked up before the cache changed
            kind = "stale_hit" if self._stale(hit, tokens) else ""
        elif roll < 0.3:
            hit = bp.get_computed_blocks(self.state, self._prompt())  # another prompt's
            kind = "stale_hit" if self._stale(hit, tokens) else ""
        elif roll < 0.35 and hit is not None and not hit.num_tokens:
            hit = None
        h = hit.num_tokens if hit is not None else 0
        left = min(len(tokens), cfg.max_model_len) - h
        must_fit = rng.random() < 0.4
        small = must_fit or rng.random() < 0.5  # a first chunk (the gate looks at the whole prompt)
        new = rng.randint(1, min(left, cfg.in_flight)) if left >= 1 and small else max(left, 0)
        computed = 0
        if h + new > cfg.max_model_len:
            kind = kind or "past_max_model_len"
        if rng.random() < 0.1:
            kind = kind or rng.choice(("computed_not_zero", "past_tokens", "nothing_to_compute"))
            if kind == "computed_not_zero":
                computed = rng.randint(1, 3)
            elif kind == "past_tokens":
                new = len(tokens) - h + rng.randint(1, 2)
            elif kind == "nothing_to_compute":
                new, kind = 0, "" if h else kind  # with a hit to adopt, no new token is fine
        return self.allocate(r, tokens, computed, new, hit, must_fit, kind=kind)

    def allocate(self, r: int, tokens: list[int], computed: int, new: int, hit: bp.Hit | None = None,
                 must_fit: bool = False, *, kind: str = "") -> Sample:
        """One ``allocate_slots`` call (``kind``: the misuse it is, if any)."""
        if kind == "stale_hit" and hit is not None and hit.num_tokens >= len(tokens):
            kind = "hit_covers_prompt"  # another prompt's hit, as long as this one: nothing left to compute
        action = {**blank_action(), "req": r, "ntok": len(tokens), "n": computed, "new": new, "must_fit": must_fit}
        hit_action(action, hit, self.state.config.block_size)
        # a stale hit is in the model only as far as a block of it is no longer cached at its group and index
        view = self.view
        stale_seen = any(action["adopt"][g][x] and not (view["cached"][x] and view["kgrp"][x] == g
                                                        and view["kpos"][x] == action["pos"][g][x])
                         for g in GROUPS for x in range(N))
        return self._run("allocate_slots", action, functools.partial(
            bp.allocate_slots, self.state, r, tokens, computed, new, hit, must_fit), kind=kind,
            modelled=kind != "stale_hit" or stale_seen)

    def _extend(self, r: int) -> Sample:
        """A running request takes a chunk of its prompt or decodes a token; some calls are misuse."""
        rng, cfg = self.rng, self.state.config
        q, tokens = self.state.requests[r], self.tokens[r]
        if q.computed == len(tokens) and len(tokens) < cfg.max_model_len + 1:
            tokens.append(rng.randrange(6))  # the token the last step sampled
        left = min(len(tokens), cfg.max_model_len) - q.computed
        new = rng.randint(1, left) if left >= 1 else 0
        computed, hit, kind = q.computed, None, ""
        if left < 1:
            kind = "past_tokens" if q.computed < cfg.max_model_len else "past_max_model_len"
            new = 1
        elif rng.random() < 0.12:
            kind = rng.choice(("wrong_computed", "past_tokens", "nothing_to_compute", "running_hit"))
            if kind == "wrong_computed":
                computed = rng.choice((q.computed - 1, q.computed + 1))
            elif kind == "past_tokens":
                new = len(tokens) - q.computed + 1
            elif kind == "nothing_to_compute":
                new = 0
            else:
                hit = bp.get_computed_blocks(self.state, tokens)
                kind = "running_hit" if hit.num_tokens else ""
        return self.allocate(r, tokens, computed, new, hit, rng.random() < 0.2, kind=kind)

    def _releasable(self, r: int) -> bool:
        q, cfg = self.state.requests[r], self.state.config
        upto = bp.get_num_skipped_tokens(cfg, spec.SWA, q.computed) // cfg.block_size
        return any(x != NULL for x in q.blocks[spec.SWA][:upto])

    def _release(self, r: int) -> Sample:
        q = self.state.requests.get(r)
        computed = q.computed if q is not None else 0
        n, kind = self.rng.randint(max(0, computed - 2), computed), ""
        if q is not None and self._releasable(r) and self.rng.random() < 0.8:
            n = computed
        if self.rng.random() < 0.15:
            n, kind = self.rng.choice((-1, computed + 1)), "bad_count"
            kind = "" if q is None and n >= 0 else kind
        return self._run("remove_skipped_blocks", {"req": r, "n": n},
                         functools.partial(bp.remove_skipped_blocks, self.state, r, n), kind=kind)

    def _cache(self, r: int) -> Sample:
        q = self.state.requests.get(r)
        tokens = self.tokens.get(r) or [0]
        computed = q.computed if q is not None else 0
        n, kind = self.rng.randint(0, computed), "" if q is not None else "not_running"
        if q is not None and self.rng.random() < 0.15:
            n, kind = self.rng.choice((-1, computed + 1)), "bad_count"
        return self._run("cache_blocks", {"req": r, "n": n, "ntok": len(tokens)},
                         functools.partial(bp.cache_blocks, self.state, r, tokens, n), kind=kind)

    def evict(self, ids: list[int]) -> Sample:
        return self._run("evict_blocks", {"ids": [x in ids for x in range(N)]},
                         functools.partial(bp.evict_blocks, self.state, ids))

    def _evict(self) -> Sample:
        rng = self.rng
        cached = [x for x in range(N) if self.state.block_key[x] is not None]
        ids = rng.sample(cached, k=rng.randint(1, len(cached))) if cached and rng.random() < 0.7 else []
        ids += rng.sample(range(N), k=rng.randint(0, 2))
        kind = ""
        if rng.random() < 0.08:
            ids.append(rng.choice((-1, N, N + 3)))
            kind = "out_of_range"  # the model's ids are flags over the pool's blocks: no such argument
        action = {"ids": [x in ids for x in range(N)]}
        return self._run("evict_blocks", action, functools.partial(bp.evict_blocks, self.state, ids), kind=kind,
                         modelled=not kind)

    # -- one call

    def _run(self, op: str, fields: Values, call: Callable[[], Any], *, kind: str = "",
             modelled: bool = True) -> Sample:
        pre, state = self.view, self.state
        action = {**blank_action(), **fields}
        try:
            out = call()
        except OutOfMemory as err:
            if op != "allocate_slots" or kind:  # the reference checks its arguments before the free count
                raise
            return Sample(op, pre, {**action, "ok": False}, pre, type(err).__name__, kind)
        except InvalidOperation as err:
            return Sample(op, pre, action, None, type(err).__name__, kind, modelled)
        if kind and op != "get_computed_blocks":
            raise AssertionError(f"the reference took the misuse {kind}: {op}{fields}")
        if op == "get_computed_blocks":
            hit_action(action, out, state.config.block_size)
            return Sample(op, pre, action, pre)
        if op == "reset_prefix_cache":
            self.state, action["ok"] = out
        elif op == "allocate_slots":
            self.state, taken = out
            action["ok"] = True
            after = self.state.requests[int(action["req"])]
            for g, blocks in enumerate(taken):
                for x in blocks:
                    action["take"][g][x], action["pos"][g][x] = True, after.blocks[g].index(x)
        else:
            self.state = out
        bp.check_block_pool(self.state)
        self.view = abstract(self.state, pre)
        return Sample(op, pre, action, self.view)


def scripted() -> list[Sample]:
    """Two runs the random ones rarely reach: the admission gate that only the cap lets through (vLLM #39734), and
    a hit looked up before one of its blocks was evicted."""
    # B = 4, W = 3, T = 2: the cap is cdiv(min(3 - 1 + 2, 16), 4) + 1 = 2 blocks; a 12-token prompt on the empty
    # pool asks 3 + min(3, 2) = 5 of the 5 free blocks (uncapped, 6), then runs in chunks of T = 2
    t = Tracker(random.Random(0), bp.BlockPoolConfig(block_size=4, num_blocks=N, sliding_window=3, max_model_len=16,
                                                     max_in_flight_tokens=2))
    prompt = t.tokens[0] = list(range(12))
    out = [t.allocate(0, prompt, 0, 2, None, True)]
    for computed in range(2, 12, 2):
        out += [t.allocate(0, prompt, computed, 2)]
    out += [t.free(0)]
    # B = 2, W = 3: request 0 caches [1, 2] | [3, 4]; request 1 looks up 4 of its 5 tokens (full [1, 2], window
    # [0, 4]), block 2 is evicted: the old hit is stale (the model sees block 2 uncached)
    t = Tracker(random.Random(0), bp.BlockPoolConfig(block_size=2, num_blocks=N, sliding_window=3, max_model_len=8))
    t.tokens[0] = [1, 2, 3, 4]
    out += [t.allocate(0, t.tokens[0], 0, 4), t.free(0), t.lookup(1, [1, 2, 3, 4, 5]), t.evict([2])]
    old, now = t.hits[1], bp.get_computed_blocks(t.state, t.tokens[1])
    # the current hit (full [1], window [3], both free): 5 tokens need 2 + 1 evictable blocks per group, 6 > 5, so
    # the whole prompt is refused; 3 tokens need 1 + 1 per group
    out += [t.allocate(1, t.tokens[1], 0, 1, old, kind="stale_hit"), t.allocate(1, t.tokens[1], 0, 3, now),
            t.allocate(1, t.tokens[1], 0, 1, now)]
    return out


@functools.cache
def samples() -> tuple[Sample, ...]:
    out = scripted()
    for seed in range(RUNS):
        tracker = Tracker(random.Random(seed))
        out += [tracker.step() for _ in range(STEPS)]
    return tuple(out)


# ---- encoding concrete values as facts ----------------------------------------------------------------------


def _each(terms: Sequence[z3.ExprRef], values: Sequence[object], start: int = 0) -> Pins:
    return [(x, _ts.literal(y)) for x, y in zip(terms[start:], values[start:], strict=True)]


def state_pins(s: spec.State, v: Values) -> Pins:
    pins = [(s.B, _ts.literal(v["B"])), (s.W, _ts.literal(v["W"])), (s.L, _ts.literal(v["L"])),
            (s.T, _ts.literal(v["T"])), (s.nfree, _ts.literal(v["nfree"]))]
    for name in ("ref", "inq", "cached", "kgrp", "kpos"):
        pins += _each(getattr(s, name), v[name])
    for q, values in zip(s.reqs, v["reqs"], strict=True):
        pins += [(q.active, _ts.literal(values["active"])), (q.computed, _ts.literal(values["computed"]))]
        for grp, gv in zip(q.groups, values["groups"], strict=True):
            pins += [(grp.length, _ts.literal(gv["length"])), (grp.nulls, _ts.literal(gv["nulls"])),
                     (grp.ncached, _ts.literal(gv["ncached"]))]
            pins += _each(grp.held, gv["held"], 1) + _each(grp.idx, gv["idx"], 1)  # index 0: a constant
    return pins


def action_pins(a: spec.Action, v: Values, *, leave: Sequence[str] = ()) -> Pins:
    """Every argument field (``leave``: fields left to the model: ``ok``, ``must_fit``, ``take``, the blocks popped
    with their positions)."""
    pins = [(getattr(a, name), _ts.literal(v[name])) for name in ("req", "ntok", "n", "new", "hit", "must_fit", "ok")
            if name not in leave]
    for g in GROUPS:
        pins += _each(a.adopt[g], v["adopt"][g], 1)
        if "take" not in leave:
            pins += _each(a.take[g], v["take"][g], 1) + _each(a.pos[g], v["pos"][g], 1)
        else:  # the hit's positions stay pinned
            pins += [(a.pos[g][x], _ts.literal(v["pos"][g][x])) for x in range(1, N) if v["adopt"][g][x]]
    return pins + _each(a.ids, v["ids"])


def _pins(sample: Sample) -> tuple[Any, Any, Any]:
    assert sample.post is not None
    pre, post, action = sample.pre, sample.post, sample.action
    return (lambda s: state_pins(s, pre)), (lambda t: state_pins(t, post)), (lambda a: action_pins(a, action))


def evaluates(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> bool | None:
    """The transition with every variable replaced by the sample's value (the kit's fast path)."""
    return _ts.evaluate(system, sample.op, *_pins(sample))


def accepts(system: _ts.TransitionSystem[spec.State, spec.Action], sample: Sample) -> _ts.Acceptance:
    """Evaluated by substitution; a rejection is solved by the kit's ``accepts``, whose verdict names the conflicting
    facts."""
    return _ts.accepts_pinned(system, sample.op, *_pins(sample))


def has_successor(op: str, pre: Values, action: Values, *, leave: Sequence[str] = ()) -> bool:
    """Some post-state satisfies ``op`` from the pinned pre-state and action (``leave``: action fields left open)."""
    return _ts.has_successor(SYSTEM, op, lambda s: state_pins(s, pre), lambda a: action_pins(a, action, leave=leave))


def _show(sample: Sample) -> str:
    return (f"{sample.op} {sample.kind or ''} {sample.error}\npre {sample.pre}\naction {sample.action}\n"
            f"post {sample.post}")


# ---- the tests ----------------------------------------------------------------------------------------------

#: sampled steps per transition (refusals included), at least
MIN_STEPS = {"allocate_slots": 500, "free": 150, "remove_skipped_blocks": 120, "cache_blocks": 40,
             "evict_blocks": 80, "reset_prefix_cache": 80}


def test_every_reference_operation_has_a_transition_and_obligations() -> None:
    """One name everywhere: the reference function, the transition, the obligations' prefix (``prove -k <op>``).
    ``get_computed_blocks`` (a read) has neither: the model's hit is ``allocate_slots``' argument."""
    assert systems("block_pool") == (SYSTEM,)
    assert set(SYSTEM.ops) == set(REFERENCE_OPS) - {"get_computed_blocks"}
    assert set(MIN_STEPS) == set(SYSTEM.ops)
    for op in REFERENCE_OPS:
        assert callable(getattr(bp, op)), op
        found = obligations("block_pool", f"block_pool.{op}.")
        if op == "get_computed_blocks":
            assert not found, [ob.name for ob in found]
            continue
        assert any(ob.twin_of is None for ob in found) and any(ob.twin_of for ob in found), op
    shape = obligations("block_pool", "block_pool.contiguous_blocks_for_hit.")
    assert any(ob.twin_of is None for ob in shape) and any(ob.twin_of for ob in shape)


@pytest.mark.parametrize("op", SYSTEM.ops)
def test_every_sampled_step_is_accepted_by_its_transition(op: str) -> None:
    steps = [s for s in samples() if s.op == op and s.post is not None]
    assert len(steps) >= MIN_STEPS[op], f"only {len(steps)} sampled {op} steps"
    changed = [s for s in steps if s.post != s.pre]
    assert changed or op == "cache_blocks", f"no sampled {op} step changes the state"
    for sample in steps:
        verdict = accepts(SYSTEM, sample)
        assert verdict.accepted, f"{verdict}\n{_show(sample)}"


def test_refused_allocations_change_nothing_and_cannot_succeed() -> None:
    """``OutOfMemory`` (vLLM's ``None``): the model's step is ``ok = False`` with nothing changed (accepted above),
    and with ``ok = True`` it has no step at all, whatever blocks it would pop."""
    refused = [s for s in samples() if s.error == "OutOfMemory"]
    assert len(refused) >= 40, len(refused)
    assert {s.action["must_fit"] for s in refused} == {True, False}
    assert any(s.pre["reqs"][s.action["req"]]["active"] for s in refused), "a running request refused"
    for sample in refused:
        assert sample.op == "allocate_slots" and sample.post == sample.pre
        assert evaluates(SYSTEM, sample) is True, _show(sample)
        assert not has_successor(sample.op, sample.pre, {**sample.action, "ok": True}, leave=("take",)), \
            _show(sample)


def test_calls_the_reference_rejects_have_no_successor() -> None:
    rejected = [s for s in samples() if s.post is None]
    assert {s.error for s in rejected} == {"InvalidOperation"}
    modelled = [s for s in rejected if s.modelled]
    kinds = Counter((s.op, s.kind) for s in modelled)
    assert {op for op, _ in kinds} == {"allocate_slots", "remove_skipped_blocks", "cache_blocks"}, kinds
    assert {k for op, k in kinds if op == "allocate_slots"} >= {
        "computed_not_zero", "past_tokens", "nothing_to_compute", "wrong_computed", "running_hit", "stale_hit"}, kinds
    assert len(modelled) >= 40, kinds
    for sample in modelled:
        assert not has_successor(sample.op, sample.pre, sample.action, leave=("ok", "take")), _show(sample)
    # what the model cannot see: ids outside the pool, a lookup's length (no transition), and a stale hit whose
    # blocks are all still cached at their group and index (the model's hit is any such block: it takes the step)
    unmodelled = Counter((s.op, s.kind) for s in rejected if not s.modelled)
    assert set(unmodelled) <= {("evict_blocks", "out_of_range"), ("get_computed_blocks", "hit_length_out_of_range"),
                               ("allocate_slots", "stale_hit")}, unmodelled
    for sample in rejected:
        if (sample.op, sample.kind) == ("allocate_slots", "stale_hit") and not sample.modelled:
            assert has_successor(sample.op, sample.pre, sample.action, leave=("ok", "take")), _show(sample)


def test_every_lookup_is_a_hit_the_model_adopts() -> None:
    """``get_computed_blocks`` has no transition: each answer, passed to ``allocate_slots`` with one new token from
    the same state, satisfies the model's hit precondition (``hb`` blocks, per group the cached blocks of that group
    at their index from the window's null padding on)."""
    lookups = [s for s in samples() if s.op == "get_computed_blocks" and s.post is not None
               and s.action["hit"] * s.pre["B"] + 1 <= s.pre["L"]]
    assert len(lookups) >= 40, len(lookups)
    hits = [s for s in lookups if s.action["hit"]]
    assert len(hits) >= 15, len(hits)
    assert any(sum(s.action["adopt"][spec.SWA]) < sum(s.action["adopt"][spec.FULL]) for s in hits), \
        "a hit whose window group adopts fewer blocks (null padding)"
    for sample in lookups:
        action = {**sample.action, "new": 1}
        assert has_successor("allocate_slots", sample.pre, action, leave=("ok", "take", "must_fit")), \
            _show(sample)


def test_the_samples_cover_every_kind_of_step() -> None:
    steps = [s for s in samples() if s.post is not None and s.post != s.pre]
    assert {s.pre["B"] for s in steps} == set(spec.BLOCK_SIZES)
    allocs = [s for s in steps if s.op == "allocate_slots"]
    adopted = [s for s in allocs if s.action["hit"]]
    assert len(adopted) >= 20, "admissions with a prefix-cache hit"
    assert any(s.action["adopt"][g][x] and s.pre["ref"][x] == 0 for s in adopted for g in GROUPS
               for x in range(1, N)), "a hit on a free cached block (it leaves the free queue)"
    assert any(s.action["adopt"][g][x] and s.pre["ref"][x] > 0 for s in adopted for g in GROUPS
               for x in range(1, N)), "a hit on a block another request holds (shared)"
    padded = [s for s in adopted if s.post["reqs"][s.action["req"]]["groups"][spec.SWA]["nulls"]]
    assert len(padded) >= 3, "a hit padded with the null block (the window starts later)"
    released = [s for s in allocs if s.pre["reqs"][s.action["req"]]["active"]
                and s.post["reqs"][s.action["req"]]["groups"][spec.SWA]["nulls"]
                > s.pre["reqs"][s.action["req"]]["groups"][spec.SWA]["nulls"]]
    assert len(released) >= 10, "allocations that release out-of-window blocks first"
    assert len([s for s in steps if s.op == "remove_skipped_blocks"]) >= 10, "releases that null blocks"
    assert any(s.post["cached"] != s.pre["cached"] for s in steps if s.op == "evict_blocks"), "evictions"
    resets = [s for s in samples() if s.op == "reset_prefix_cache"]
    assert {s.action["ok"] for s in resets} == {True, False}
    assert any(s.post != s.pre for s in resets), "a reset that drops keys"


# ---- wrong transitions --------------------------------------------------------------------------------------


def _releases_nothing(s: spec.State, a: spec.Action, t: spec.State) -> z3.BoolRef:
    """Wrong: a remove_skipped_blocks that never frees a block (the window's blocks kept until the request ends)."""
    return z3.And(spec.remove_skipped_blocks(s, a, t), t.nfree == s.nfree)


def _wrong(op: str, **variant: Any) -> _ts.TransitionSystem[spec.State, spec.Action]:
    return SYSTEM.with_transitions(**{op: functools.partial(getattr(spec, op), v=spec.Variant(**variant))})


WRONG = {
    "allocate_slots: blocks for the chunk alone": ("allocate_slots", _wrong("allocate_slots", blocks_for_chunk=True)),
    "allocate_slots: no release before the check": ("allocate_slots", _wrong("allocate_slots", removes_first=False)),
    "allocate_slots: the partial last block cached": ("allocate_slots",
                                                      _wrong("allocate_slots", cache_full_only=False)),
    "allocate_slots: the gate without the cap (#39734)": ("allocate_slots", _wrong("allocate_slots", gate_cap=False)),
    "allocate_slots: touch leaves the hit block queued": ("allocate_slots",
                                                          _wrong("allocate_slots", touch_leaves_queue=False)),
    "allocate_slots: evictable hit blocks not counted": ("allocate_slots",
                                                         _wrong("allocate_slots", counts_evictable=False)),
    "allocate_slots: checked group by group": ("allocate_slots", _wrong("allocate_slots", check="group_by_group")),
    "remove_skipped_blocks: n - W + 2": ("remove_skipped_blocks", _wrong("remove_skipped_blocks", skip_offset=2)),
    "remove_skipped_blocks: entries not nulled": ("remove_skipped_blocks",
                                                  _wrong("remove_skipped_blocks", nulls_entries=False)),
    "remove_skipped_blocks: releases nothing": ("remove_skipped_blocks",
                                                SYSTEM.with_transitions(remove_skipped_blocks=_releases_nothing)),
    "free: bookkeeping kept": ("free", _wrong("free", free_pops=False)),
    "free: the null entries freed": ("free", _wrong("free", free_skips_null=False)),
    "cache_blocks: the partial last block cached": ("cache_blocks", _wrong("cache_blocks", cache_full_only=False)),
    "evict_blocks: frees the evicted blocks": ("evict_blocks", _wrong("evict_blocks", evict_frees=True)),
    "reset_prefix_cache: the null block counted free": ("reset_prefix_cache",
                                                        _wrong("reset_prefix_cache", reset="null_counted_free")),
}


@pytest.mark.parametrize("name", list(WRONG))
def test_a_wrong_transition_rejects_sampled_steps(name: str) -> None:
    op, wrong = WRONG[name]
    steps = [s for s in samples() if s.op == op and s.post is not None]
    rejected = next((s for s in steps if evaluates(wrong, s) is False), None)
    assert rejected is not None, f"{name}: accepts all {len(steps)} sampled {op} steps"
    verdict = accepts(wrong, rejected)
    assert verdict.status == "rejected" and verdict.conflict, verdict
