"""``block_pool``: vLLM 0.33.0's v1 KV cache manager (docs/block_pool.md §1-§5; the house style of
sglang_semantics.md §7: an inductive invariant over a transition system, broken twins refuted with step tables).

vLLM's ``BlockPool`` with its null block 0, the free queue, reference counts and the prefix-cache map, shared by a
full-attention group (0) and a sliding-window group (1, window ``W``) of one block size ``B``, allocated all or
nothing by the hybrid coordinator (``KVCacheManager.allocate_slots``). Obligations are named
``block_pool.<op>.<claim>`` after the reference operation (or the vLLM function whose formula they are about) and
``block_pool.pool.<claim>`` for the whole state; a broken twin appends what it breaks.

**The arithmetic** (docs/block_pool.md §3; :func:`skipped_tokens_term`, :func:`contiguous_blocks_for_hit_term`,
:func:`max_admission_blocks_term`, :func:`num_blocks_to_allocate_term`, mirrored by ``kvproof.reference.block_pool``
and compared with it in ``tests/spec/test_block_pool.py``), for **any** ``B >= 1``, ``W >= 2``, ``T >= 1``,
``L >= 1``:

* ``get_num_skipped_tokens.window_reads_kept``: ``max(0, n - W + 1)`` (single_type_kv_cache_manager.py:1148) never
  skips a block holding a position the window of token ``n`` reads (``>= n - W + 1``); twin ``.plus_two``;
* ``max_admission_blocks_per_request.bounds_real_held``: after the release of the out-of-window blocks
  (``remove_skipped_blocks`` runs in ``allocate_slots`` before every chunk) a chunk of ``t <= T`` tokens leaves
  ``cdiv(c + t, B) - skipped(c) // B <= cdiv(min(W - 1 + T, L), B) + 1`` blocks real (kv_cache_interface.py:918, the
  comment at single_type_kv_cache_manager.py:176-266); twin ``.no_plus_one``. The historical ``max(0, n - W)``
  keeps at most that one block more: it stays within the cap (the ``+ 1`` absorbs it), it is refuted by
  ``allocate_slots.holds_window_blocks`` instead;
* ``contiguous_blocks_for_hit.run_is_window``: a hit of ``hb`` blocks whose last ``cdiv(W - 1, B)`` blocks are cached
  starts its real blocks exactly at ``skipped(hb * B) // B`` (what ``add_local_computed_blocks`` pads with nulls);
  twin ``.floor`` (``(W - 1) // B``).

**The transition system** (:data:`SYSTEM`, or :func:`system` for a twin's :class:`Variant`; docs/block_pool.md §1,
§2): a bounded instance of ``kvproof.reference.block_pool`` with ``N_BLOCKS = 6`` blocks (block 0 the null block, 5
usable) and ``REQS = 2`` request slots; symbolic ``W``, ``L`` (``max_model_len``), ``T`` (``max_in_flight_tokens``)
and token counts, and a block size ``B`` in ``BLOCK_SIZES = 1..4`` (every division by ``B`` is an ``If`` chain of
divisions by constants, so every query is linear). Per block: its count (the null block's included: not
maintained, 0), free-queue membership, whether it is cached, and its key as the group and the index of the block in
its prefix (``(kgrp, tokens[:(kpos + 1) * B])``; the tokens themselves are abstracted away: a hit may adopt any
cached block of its group at its index). The free queue is membership flags plus its length: its *order* is
abstracted (any free block may be the one popped, an over-approximation of ``popleft``; evict-first / evict-last
only order the queue). Per request slot: whether the manager knows it, its computed tokens, and per group its list
as ``length`` entries, the first ``nulls`` of them the null block, each real block with its index, and
``num_cached``. One relation per reference operation, named like it (built once on the selected request slot, the
post-state one frame of ``If`` chains): :func:`allocate_slots` (admission gate, release of a running request's
out-of-window blocks, the summed check, the hit joined, ``cdiv(total, B) - length`` new blocks per group, the full
blocks cached; ``ok``: vLLM returned blocks, else nothing changed), :func:`free`, :func:`remove_skipped_blocks`,
:func:`cache_blocks`, :func:`evict_blocks`, :func:`reset_prefix_cache`. The invariant (:func:`invariant_clauses`) is
V1-V5 of docs/block_pool.md §4 on these counts, with V4 as "a held block sits at its key's group and index, full
when cached or shared".

* ``pool.initiation`` and consecution through all six operations (``<op>.keeps_invariant``; ``allocate_slots`` in
  three parts, ``.keeps_counts`` / ``.keeps_lists`` / ``.keeps_keys``, each from the whole invariant, for speed):
  V1 ``free + #referenced == N - 1``, V2 (a count is the list entries holding the block), V3 (queued iff count 0,
  once; the null block never), no negative count, V4, V5 are inductive. Twins: the queue ``range(0, N)``; a touch
  that leaves a hit block queued; new blocks sized by the chunk alone; caching the partial last block (after the
  allocation and in ``cache_blocks``); a free of the null entries (its count goes below zero); a duplicate free (the
  bookkeeping not popped: counts below zero, by BMC from the start); the null block's count maintained and the null
  block freed into the queue (BMC); a release that does not null the entry; an eviction that frees held blocks; a
  reset that rebuilds the queue while blocks are held;
* ``remove_skipped_blocks.keeps_window`` (twin ``.plus_two``): no released block holds a position ``>= n - W + 1``;
* all or nothing: ``allocate_slots.refusal_changes_nothing`` (twin ``.group_by_group``: group 0 checked and
  allocated, then a refusal for group 1), ``allocate_slots.accepted_never_runs_out`` (every group gets its
  ``cdiv(total, B)`` entries; twin ``.each_group_alone``: each need checked alone, then the SWA group's
  ``get_new_blocks`` runs out), ``get_num_blocks_to_allocate.sum_leaves_the_queue`` (the summed need, count-0 hit
  blocks included, is exactly what leaves the free queue; twin ``.evictable_not_counted``);
* ``allocate_slots.holds_window_blocks``: after the call the full group holds ``cdiv(total, B)`` real blocks and the
  SWA group ``cdiv(total, B) - skipped(c) // B`` (twins ``.skipped_n_minus_w``, ``.no_removal``). With
  ``max_admission_blocks_per_request.bounds_real_held`` this is "the cap bounds the SWA group's real blocks at every
  chunk" (a direct obligation on the model would be vacuous: with 5 usable blocks both groups together never exceed
  the cap);
* ``allocate_slots.admits_alone`` (V8): a new request without a hit on a pool where no block is referenced, with
  ``len(tokens) <= L``, a first chunk ``<= T`` and ``cdiv(len, B) + min(cdiv(len, B), cap) <= N - 1``, passes the
  ``full_sequence_must_fit`` gate and the check; twin ``.gate_without_cap`` (vLLM issue #39734: the SWA group charged
  ``cdiv(len, B)``, a request that fits is never admitted);
* ``reset_prefix_cache.only_when_idle``: True exactly when no block is referenced, then nothing stays cached (twin
  ``.null_counted_free``: ``num_used == 0`` never holds, the null block counts as used).

Residual risks (docs/block_pool.md §5): the queue order and the token contents (V4's key <-> map agreement, V6, V7)
are not modelled; the proofs over the transition system hold for ``B <= 4``, 5 usable blocks and 2 requests; the
model's hit is any cached block at its index (``tests/spec/test_block_pool.py`` checks on the reference that a hit's
SWA entries from ``skipped // B`` on are real blocks, the shape the model adopts).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Obligation, as_bool, as_int
from kvproof.spec.terms import IntLike, lift, zmax, zmin

__all__ = [
    "BLOCK_SIZES",
    "FULL",
    "GROUPS",
    "NO_KEY",
    "NULL",
    "N_BLOCKS",
    "OBLIGATIONS",
    "REQS",
    "SOUND",
    "SWA",
    "SYSTEM",
    "Action",
    "Group",
    "Request",
    "State",
    "Variant",
    "allocate_slots",
    "cache_blocks",
    "cdiv_term",
    "cells",
    "columns",
    "contiguous_blocks_for_hit_term",
    "describe",
    "evict_blocks",
    "free",
    "init",
    "invariant_clauses",
    "max_admission_blocks_term",
    "num_blocks_to_allocate_term",
    "remove_skipped_blocks",
    "reset_prefix_cache",
    "skipped_tokens_term",
    "system",
]

COMPONENT = "block_pool"
FAMILY = "block_pool"

#: Blocks of the model's pool, the null block 0 included (5 usable).
N_BLOCKS = 6
#: Request slots of the model.
REQS = 2
#: The null block (vLLM pops block 0 at start: never handed out, count not maintained).
NULL = 0
#: Group ids (``KVCacheConfig.kv_cache_groups`` order).
FULL, SWA = 0, 1
GROUPS = (FULL, SWA)
#: ``key[b]``: the block is in no prefix-cache entry.
NO_KEY = -1
#: The block sizes the transition system covers (a division by ``B`` is an ``If`` chain over them).
BLOCK_SIZES = (1, 2, 3, 4)

BLOCKS = range(N_BLOCKS)
REAL = range(1, N_BLOCKS)

Div = Callable[[z3.ArithRef, IntLike], z3.ArithRef]


# ---- term builders (mirror kvproof.reference.block_pool, docs/block_pool.md §3) ---------------------------


def floor_div(x: IntLike, d: IntLike) -> z3.ArithRef:
    """``x // d`` for ``d >= 1`` (Z3's Euclidean ``div`` is the floor for a positive divisor)."""
    return lift(x) / lift(d)


def bounded_div(x: IntLike, d: IntLike) -> z3.ArithRef:
    """``x // d`` for ``d`` in :data:`BLOCK_SIZES`: an ``If`` chain of divisions by constants (linear)."""
    x = lift(x)
    if isinstance(d, int):
        return x / d
    term: z3.ArithRef = x / BLOCK_SIZES[-1]
    for size in reversed(BLOCK_SIZES[:-1]):
        term = z3.If(d == size, x if size == 1 else x / size, term)
    return term


def bounded_mul(x: IntLike, d: IntLike) -> z3.ArithRef:
    """``x * d`` for ``d`` in :data:`BLOCK_SIZES` (linear)."""
    x = lift(x)
    if isinstance(d, int):
        return x * d
    term: z3.ArithRef = x * BLOCK_SIZES[-1]
    for size in reversed(BLOCK_SIZES[:-1]):
        term = z3.If(d == size, x * size, term)
    return term


def cdiv_term(a: IntLike, b: IntLike, div: Div = floor_div) -> z3.ArithRef:
    """``cdiv(a, b) = -(-a // b)``, as ``(a + b - 1) // b`` (exact for ``b >= 1``)."""
    return div(lift(a) + lift(b) - 1, b)


def skipped_tokens_term(num_computed_tokens: IntLike, window: IntLike, *, offset: int = 1) -> z3.ArithRef:
    """The SWA group's ``get_num_skipped_tokens(n) = max(0, n - W + 1)`` (single_type_kv_cache_manager.py:1148);
    the full group skips none. ``offset`` is a twin's: ``0`` the historical ``n - W``, ``2`` an unsafe
    ``n - W + 2``."""
    return zmax(0, lift(num_computed_tokens) - lift(window) + offset)


def contiguous_blocks_for_hit_term(window: IntLike, block_size: IntLike, div: Div = floor_div) -> z3.ArithRef:
    """Cached blocks in a row a SWA hit needs: ``cdiv(W - 1, B)`` (single_type_kv_cache_manager.py:956, no EAGLE)."""
    return cdiv_term(lift(window) - 1, block_size, div)


def max_admission_blocks_term(window: IntLike, block_size: IntLike, in_flight: IntLike, max_model_len: IntLike,
                              div: Div = floor_div, *, plus_one: bool = True) -> z3.ArithRef:
    """The SWA group's admission cap ``cdiv(min(W - 1 + T, L), B) + 1`` (kv_cache_interface.py:918; ``plus_one=False``
    is a twin's)."""
    tokens = zmin(lift(window) - 1 + lift(in_flight), max_model_len)
    return cdiv_term(tokens, block_size, div) + (1 if plus_one else 0)


def num_blocks_to_allocate_term(block_size: IntLike, num_tokens: IntLike, *, running: z3.BoolRef | bool,
                                held: IntLike, hit_blocks: IntLike, skipped_blocks: IntLike, evictable: IntLike,
                                cap: IntLike | None = None, div: Div = floor_div) -> z3.ArithRef:
    """``get_num_blocks_to_allocate`` of one group (single_type_kv_cache_manager.py:176-266): ``required =
    cdiv(num_tokens, B)`` (capped by ``cap``); a running request needs ``max(required - held, 0)``; a new one
    ``max(required - max(skipped_blocks, hit_blocks + held), 0)`` plus the ``evictable`` hit blocks (count 0: they
    leave the free queue when touched)."""
    required = cdiv_term(num_tokens, block_size, div)
    if cap is not None:
        required = zmin(required, cap)
    held, hit = lift(held), lift(hit_blocks)
    new = zmax(required - zmax(skipped_blocks, hit + held), 0) + lift(evictable)
    return z3.If(running, zmax(required - held, 0), new) if isinstance(running, z3.BoolRef) else (
        zmax(required - held, 0) if running else new)


# ---- the arithmetic obligations (any B) -------------------------------------------------------------------

_obligation = functools.partial(Obligation.of_component, COMPONENT)


def _window_build(offset: int) -> Callable[[], list[z3.BoolRef]]:
    """Block ``i < skipped(n) // B`` is released; it must hold no position ``>= n - W + 1``."""

    def build() -> list[z3.BoolRef]:
        n, W, B, i = z3.Ints("n W B i")
        skipped = skipped_tokens_term(n, W, offset=offset)
        return [n >= 0, W >= 2, B >= 1, i >= 0, i < skipped / B, (i + 1) * B > n - W + 1]

    return build


def _window_render(offset: int) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        n, W, B, i = (as_int(m, v) for v in z3.Ints("n W B i"))
        skipped = max(0, n - W + offset)
        first = n - W + 1
        return (f"B={B} W={W} n={n}: skipped={skipped} tokens, so blocks [0, {skipped // B}) are released; block {i} "
                f"(positions {i * B}-{i * B + B - 1}) holds position {max(first, i * B)} >= n - W + 1 = {first}, "
                f"which the window of token {n} reads")

    return render


def _cap_vars() -> tuple[z3.ArithRef, ...]:
    return tuple(z3.Int(name) for name in ("c", "t", "W", "B", "T", "L"))


def _cap_build(plus_one: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        c, t, W, B, T, L = _cap_vars()
        real = cdiv_term(c + t, B) - skipped_tokens_term(c, W) / B
        cap = max_admission_blocks_term(W, B, T, L, plus_one=plus_one)
        return [c >= 0, t >= 1, t <= T, c + t <= L, W >= 2, B >= 1, T >= 1, L >= 1, real > cap]

    return build


def _cap_render(plus_one: bool) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        c, t, W, B, T, L = (as_int(m, v) for v in _cap_vars())
        skipped = max(0, c - W + 1)
        real = -(-(c + t) // B) - skipped // B
        cap = -(-min(W - 1 + T, L) // B) + (1 if plus_one else 0)
        return (f"B={B} W={W} T={T} L={L}: after c={c} computed tokens (skipped {skipped}, {skipped // B} blocks "
                f"nulled) a chunk of t={t} tokens holds {-(-(c + t) // B)} - {skipped // B} = {real} real blocks > "
                f"cap {cap}")

    return render


def _run_build(need: Callable[[z3.ArithRef, z3.ArithRef], z3.ArithRef]) -> Callable[[], list[z3.BoolRef]]:
    """A hit of ``hb`` blocks: its real blocks are the last ``need`` (or all ``hb`` when fewer) and the window of
    token ``hb * B`` must find them exactly from ``skipped(hb * B) // B`` on."""

    def build() -> list[z3.BoolRef]:
        hb, W, B = z3.Ints("hb W B")
        skipped_blocks = skipped_tokens_term(hb * B, W) / B
        first_real = zmax(0, hb - need(W, B))
        return [hb >= 0, W >= 2, B >= 1, first_real != skipped_blocks]

    return build


def _run_render(need: Callable[[z3.ArithRef, z3.ArithRef], z3.ArithRef]) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        hb, W, B = (as_int(m, v) for v in z3.Ints("hb W B"))
        k = as_int(m, need(z3.IntVal(W), z3.IntVal(B)))
        skipped = max(0, hb * B - W + 1)
        return (f"B={B} W={W} hit of hb={hb} blocks ({hb * B} tokens): the run of {k} cached blocks starts at block "
                f"{max(0, hb - k)}, but the window of token {hb * B} reads from position {hb * B - W + 1}: "
                f"skipped={skipped} tokens, {skipped // B} null blocks")

    return render


def _arith_obligations() -> tuple[Obligation, ...]:
    sound_need = functools.partial(contiguous_blocks_for_hit_term, div=floor_div)
    return (
        _obligation(
            "get_num_skipped_tokens.window_reads_kept",
            "for n >= 0, W >= 2, B >= 1: every block i < max(0, n - W + 1) // B (released by remove_skipped_blocks) "
            "holds only positions < n - W + 1, before the window of token n (single_type_kv_cache_manager.py:1148)",
            _window_build(1), _window_render(1)),
        _obligation(
            "get_num_skipped_tokens.window_reads_kept.plus_two",
            "skipping max(0, n - W + 2) tokens (off by one, unsafe) releases the block holding position n - W + 1, "
            "which the window still reads",
            _window_build(2), _window_render(2), expect="counterexample",
            twin_of="get_num_skipped_tokens.window_reads_kept"),
        _obligation(
            "max_admission_blocks_per_request.bounds_real_held",
            "for c >= 0 processed tokens and a chunk 1 <= t <= T with c + t <= L: cdiv(c + t, B) - skipped(c) // B "
            "<= cdiv(min(W - 1 + T, L), B) + 1 (the cap bounds the SWA group's real blocks at every chunk, "
            "kv_cache_interface.py:918)",
            _cap_build(True), _cap_render(True)),
        _obligation(
            "max_admission_blocks_per_request.bounds_real_held.no_plus_one",
            "the cap without its + 1 (a window that does not start at a block boundary) is exceeded",
            _cap_build(False), _cap_render(False), expect="counterexample",
            twin_of="max_admission_blocks_per_request.bounds_real_held"),
        _obligation(
            "contiguous_blocks_for_hit.run_is_window",
            "for hb >= 0, W >= 2, B >= 1: a SWA hit whose last cdiv(W - 1, B) blocks are cached (all hb when "
            "fewer) has its first real block at skipped(hb * B) // B, the null padding of add_local_computed_blocks",
            _run_build(sound_need), _run_render(sound_need)),
        _obligation(
            "contiguous_blocks_for_hit.run_is_window.floor",
            "a run of (W - 1) // B blocks starts after the first block the window reads (a null block in the window)",
            _run_build(lambda W, B: (W - 1) / B), _run_render(lambda W, B: (W - 1) / B), expect="counterexample",
            twin_of="contiguous_blocks_for_hit.run_is_window"),
    )


# ---- the transition system: state and action ----------------------------------------------------------------


@dataclass(frozen=True)
class Group:
    """One request's list in one group: ``length`` entries, the first ``nulls`` the null block, then the real
    blocks (``held[b]``: block ``b`` is in the list, at ``idx[b]``); ``ncached`` (``num_cached_block``).

    Index 0 of ``held`` / ``idx`` is a constant (the null block is counted by ``nulls``, not listed)."""

    length: z3.ArithRef
    nulls: z3.ArithRef
    ncached: z3.ArithRef
    held: tuple[z3.BoolRef, ...]
    idx: tuple[z3.ArithRef, ...]

    @staticmethod
    def fresh(name: str, tag: str) -> Group:
        return Group(z3.Int(f"{name}_len@{tag}"), z3.Int(f"{name}_nulls@{tag}"), z3.Int(f"{name}_ncached@{tag}"),
                     (z3.BoolVal(False), *(z3.Bool(f"{name}_held{b}@{tag}") for b in REAL)),
                     (z3.IntVal(-1), *(z3.Int(f"{name}_idx{b}@{tag}") for b in REAL)))


@dataclass(frozen=True)
class Request:
    """A request slot: known to the manager (``active``: in ``req_to_blocks``), tokens computed, its lists."""

    active: z3.BoolRef
    computed: z3.ArithRef
    groups: tuple[Group, ...]

    @staticmethod
    def fresh(r: int, tag: str) -> Request:
        return Request(z3.Bool(f"r{r}_active@{tag}"), z3.Int(f"r{r}_computed@{tag}"),
                       tuple(Group.fresh(f"r{r}g{g}", tag) for g in GROUPS))


@dataclass(frozen=True)
class State:
    """The constants ``B``, ``W``, ``L``, ``T`` (one symbol each in every state), the free queue's length, per block
    its count, queue membership and prefix-cache key (``cached``; the key ``(kgrp, tokens[:(kpos + 1) * B])``: the
    group and the index of the block in its prefix, kept for a held block even while it is not cached), and the
    request slots."""

    B: z3.ArithRef
    W: z3.ArithRef
    L: z3.ArithRef
    T: z3.ArithRef
    nfree: z3.ArithRef
    ref: tuple[z3.ArithRef, ...]
    inq: tuple[z3.BoolRef, ...]
    cached: tuple[z3.BoolRef, ...]
    kgrp: tuple[z3.ArithRef, ...]
    kpos: tuple[z3.ArithRef, ...]
    reqs: tuple[Request, ...]

    @staticmethod
    def fresh(tag: str) -> State:
        return State(z3.Int("B"), z3.Int("W"), z3.Int("L"), z3.Int("T"), z3.Int(f"nfree@{tag}"),
                     tuple(z3.Int(f"ref{b}@{tag}") for b in BLOCKS), tuple(z3.Bool(f"inq{b}@{tag}") for b in BLOCKS),
                     tuple(z3.Bool(f"cached{b}@{tag}") for b in BLOCKS),
                     tuple(z3.Int(f"kgrp{b}@{tag}") for b in BLOCKS), tuple(z3.Int(f"kpos{b}@{tag}") for b in BLOCKS),
                     tuple(Request.fresh(r, tag) for r in range(REQS)))


@dataclass(frozen=True)
class Action:
    """An operation's arguments as the model reads them.

    ``req``: the request slot; ``ntok``: ``len(tokens)``; ``n``: ``num_computed_tokens`` (``allocate_slots``,
    ``remove_skipped_blocks``) or ``num_tokens`` (``cache_blocks``); ``new``: ``num_new_tokens``; ``hit``: the hit's
    blocks ``hb`` (``hb * B`` tokens; per group the blocks it adopts, ``adopt``, at ``pos``); ``must_fit``:
    ``full_sequence_must_fit``; ``ok``: ``allocate_slots`` returned blocks (not ``None``), ``reset_prefix_cache``
    returned True; ``take``: the blocks each group pops (at ``pos``); ``ids``: ``evict_blocks``' block ids."""

    req: z3.ArithRef
    ntok: z3.ArithRef
    n: z3.ArithRef
    new: z3.ArithRef
    hit: z3.ArithRef
    must_fit: z3.BoolRef
    ok: z3.BoolRef
    adopt: tuple[tuple[z3.BoolRef, ...], ...]
    take: tuple[tuple[z3.BoolRef, ...], ...]
    pos: tuple[tuple[z3.ArithRef, ...], ...]
    ids: tuple[z3.BoolRef, ...]

    @staticmethod
    def fresh(tag: str) -> Action:
        t = f"_arg@{tag}"
        none = z3.BoolVal(False)
        return Action(
            z3.Int(f"req{t}"), z3.Int(f"ntok{t}"), z3.Int(f"n{t}"), z3.Int(f"new{t}"), z3.Int(f"hit{t}"),
            z3.Bool(f"must_fit{t}"), z3.Bool(f"ok{t}"),
            tuple((none, *(z3.Bool(f"adopt{g}_{b}{t}") for b in REAL)) for g in GROUPS),
            tuple((none, *(z3.Bool(f"take{g}_{b}{t}") for b in REAL)) for g in GROUPS),
            tuple((z3.IntVal(-1), *(z3.Int(f"pos{g}_{b}{t}") for b in REAL)) for g in GROUPS),
            tuple(z3.Bool(f"evict{b}{t}") for b in BLOCKS))


@dataclass(frozen=True)
class Variant:
    """The sound model (:data:`SOUND`) or a broken twin's deviation (one field changed)."""

    skip_offset: int = 1  # get_num_skipped_tokens = max(0, n - W + skip_offset)
    gate_cap: bool = True  # the full_sequence_must_fit gate caps the SWA group (False: #39734)
    check: Literal["sum", "group_by_group", "each_alone"] = "sum"
    counts_evictable: bool = True  # get_num_blocks_to_allocate counts the touched hit blocks of count 0
    removes_first: bool = True  # allocate_slots releases out-of-window blocks before its check
    touch_leaves_queue: bool = True  # touch takes a count-0 hit block out of the free queue
    nulls_entries: bool = True  # remove_skipped_blocks replaces released blocks with the null block
    free_pops: bool = True  # free pops the request's bookkeeping (req_to_blocks.pop)
    free_skips_null: bool = True  # free trims the leading nulls and free_blocks skips the null block
    null_counted: bool = False  # the null block's count is maintained (null entries count, freed like a block)
    cache_full_only: bool = True  # cache_blocks caches num_tokens // B blocks (False: cdiv, a partial block)
    evict_frees: bool = False  # evict_blocks also frees the evicted blocks
    reset: Literal["idle", "rebuild", "null_counted_free"] = "idle"
    init_null_free: bool = False  # the initial free queue holds the null block too
    blocks_for_chunk: bool = False  # allocate_slots sizes the new blocks by cdiv(num_new_tokens, B) alone


SOUND = Variant()


# ---- helpers ------------------------------------------------------------------------------------------------


def _i(flag: z3.BoolRef) -> z3.ArithRef:
    return z3.If(flag, 1, 0)


def _count(flags: Sequence[z3.BoolRef]) -> z3.ArithRef:
    return z3.Sum([_i(f) for f in flags]) if flags else z3.IntVal(0)


def _equal(a: object, b: object) -> z3.BoolRef:
    """Every term of ``a`` equals the matching term of ``b`` (identical terms skipped)."""
    pairs = [x == y for x, y in zip(_ts.terms_of(a), _ts.terms_of(b), strict=True) if not x.eq(y)]
    return z3.And(pairs) if pairs else z3.BoolVal(True)


def _skipped_blocks(s: State, n: IntLike, v: Variant) -> z3.ArithRef:
    """``get_num_skipped_tokens(n) // B`` of the SWA group."""
    return bounded_div(skipped_tokens_term(n, s.W, offset=v.skip_offset), s.B)


def _cdiv(s: State, x: IntLike) -> z3.ArithRef:
    return cdiv_term(x, s.B, bounded_div)


def cap_term(s: State) -> z3.ArithRef:
    """The SWA group's admission cap in the model's state (:func:`max_admission_blocks_term`)."""
    return max_admission_blocks_term(s.W, s.B, s.T, s.L, bounded_div)


@dataclass(frozen=True)
class _Pool:
    """The pool fields as terms (an image being built)."""

    nfree: z3.ArithRef
    ref: tuple[z3.ArithRef, ...]
    inq: tuple[z3.BoolRef, ...]
    cached: tuple[z3.BoolRef, ...]
    kgrp: tuple[z3.ArithRef, ...]
    kpos: tuple[z3.ArithRef, ...]

    @staticmethod
    def of(s: State) -> _Pool:
        return _Pool(s.nfree, s.ref, s.inq, s.cached, s.kgrp, s.kpos)

    def release(self, dec: Sequence[z3.ArithRef]) -> _Pool:
        """``free_blocks`` (block_pool.py:816): each block's count drops by ``dec[b]``; one that reaches 0 on the way
        is queued (the null block only when a twin passes it; the queue's order is not modelled)."""
        ref = tuple(r - d for r, d in zip(self.ref, dec, strict=True))
        back = [z3.And(d > 0, r >= 1, r - d <= 0) for r, d in zip(self.ref, dec, strict=True)]
        inq = tuple(z3.Or(q, k) for q, k in zip(self.inq, back, strict=True))
        return dataclasses.replace(self, nfree=self.nfree + _count(back), ref=ref, inq=inq)

    def image(self, s: State, reqs: Sequence[Request]) -> State:
        return State(s.B, s.W, s.L, s.T, self.nfree, self.ref, self.inq, self.cached, self.kgrp, self.kpos,
                     tuple(reqs))


def _pool_of(s: State) -> _Pool:
    return _Pool.of(s)


def _empty_group(g: Group) -> Group:
    return Group(z3.IntVal(0), z3.IntVal(0), z3.IntVal(0), (g.held[NULL], *(z3.BoolVal(False) for _ in REAL)), g.idx)


def _with_group(q: Request, g: int, group: Group) -> Request:
    groups = list(q.groups)
    groups[g] = group
    return dataclasses.replace(q, groups=tuple(groups))


def _distinct_positions(flags: Sequence[z3.BoolRef], positions: Sequence[z3.ArithRef]) -> list[z3.BoolRef]:
    return [z3.Implies(z3.And(flags[a], flags[b]), positions[a] != positions[b])
            for a, b in itertools.combinations(REAL, 2)]


X = TypeVar("X")


def _merge(cond: z3.BoolRef, a: X, b: X) -> X:
    """``If(cond, a, b)`` term by term (identical terms kept) for a state, a pool, a request or a list: one frame of
    ``If`` chains, so that the solver substitutes the post-state away instead of searching a disjunction of frames."""

    def pick(x: object, y: object) -> object:
        if isinstance(x, z3.ExprRef) and isinstance(y, z3.ExprRef):
            return x if x.eq(y) else z3.If(cond, x, y)
        if isinstance(x, tuple) and isinstance(y, tuple):
            return tuple(pick(u, w) for u, w in zip(x, y, strict=True))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return dataclasses.replace(x, **{f.name: pick(getattr(x, f.name), getattr(y, f.name))
                                             for f in dataclasses.fields(x)})
        raise TypeError(f"cannot merge {type(x).__name__}")

    return pick(a, b)  # type: ignore[return-value]


def _is_slot(req: z3.ArithRef, r: int) -> z3.BoolRef:
    """``req == r`` for ``0 <= req < REQS``, with the atoms of :func:`_selected`'s chain (the last slot: none of the
    others), so that the solver splits on one atom per slot."""
    return req == r if r < REQS - 1 else z3.And([req != o for o in range(REQS - 1)])


def _selected(s: State, req: z3.ArithRef) -> Request:
    """The request slot ``req`` as ``If`` chains over the slots (an operation is built once, on this request)."""
    q = s.reqs[-1]
    for r in reversed(range(REQS - 1)):
        q = _merge(req == r, s.reqs[r], q)
    return q


#: An operation on the selected request: its guard (with the facts its choices obey), the pool and the request after.
Effect = tuple[z3.BoolRef, _Pool, Request]


def _per_request(effect: Callable[[State, Action, Request], Effect]) -> Callable[[State, Action, State], z3.BoolRef]:
    """The relation of an operation on request slot ``req`` (``0 <= req < REQS``): the effect built once on the
    selected request, written back into slot ``req``, every other slot unchanged."""

    def rel(s: State, a: Action, t: State) -> z3.BoolRef:
        guard, pool, q = effect(s, a, _selected(s, a.req))
        reqs = tuple(_merge(_is_slot(a.req, r), q, s.reqs[r]) for r in range(REQS))
        return z3.And(a.req >= 0, a.req < REQS, guard, _equal(t, pool.image(s, reqs)))

    return rel


# ---- remove_skipped_blocks ----------------------------------------------------------------------------------


def _removal(s: State, q: Request, n: IntLike, v: Variant) -> tuple[_Pool, Request, list[z3.BoolRef]]:
    """``remove_skipped_blocks(req, n)`` on a known request ``q``: the SWA blocks at indices below
    ``min(skipped(n) // B, length)`` (walked back to the first null, so the real ones) are nulled and released.
    Returns the pool, the request and the released flags."""
    g = q.groups[SWA]
    upto = zmin(_skipped_blocks(s, n, v), g.length)
    rel = [z3.BoolVal(False)] + [z3.And(g.held[b], g.idx[b] < upto) for b in REAL]
    dec = [z3.IntVal(0)] + [_i(x) for x in rel[1:]]
    if v.null_counted and v.nulls_entries:  # each nulled entry now refers to the null block
        dec[NULL] = -_count(rel[1:])
    pool = _pool_of(s).release(dec)
    if v.nulls_entries:
        group = dataclasses.replace(g, nulls=zmax(g.nulls, upto),
                                    held=(g.held[NULL], *(z3.And(g.held[b], z3.Not(rel[b])) for b in REAL)))
    else:
        group = g
    return pool, _with_group(q, SWA, group), rel


def remove_skipped_blocks(s: State, a: Action, t: State, *, v: Variant = SOUND) -> z3.BoolRef:
    """``remove_skipped_blocks(req, num_computed_tokens)`` (docs/block_pool.md §2; single_type_kv_cache_manager.py:
    655-720): for a known request, ``0 <= n <= computed``; its SWA blocks before ``skipped(n) // B`` are replaced by
    the null block and released; an unknown request is left alone.

    Twins: ``v.skip_offset = 2`` (``n - W + 2``); ``v.nulls_entries = False`` (released but left in the list)."""

    def one(s: State, a: Action, q: Request) -> Effect:
        pool, req, _ = _removal(s, q, a.n, v)
        guard = z3.And(a.n >= 0, z3.Implies(q.active, a.n <= q.computed))
        return guard, _merge(q.active, pool, _pool_of(s)), _merge(q.active, req, q)

    return _per_request(one)(s, a, t)


# ---- free ---------------------------------------------------------------------------------------------------


def free(s: State, a: Action, t: State, *, v: Variant = SOUND) -> z3.BoolRef:
    """``free(req)`` (docs/block_pool.md §2; single_type_kv_cache_manager.py:591): every group's real blocks
    (without the leading nulls) through ``free_blocks``; the request forgotten. An unknown request frees nothing.

    Twins: ``v.free_pops = False`` (the bookkeeping stays: a second free releases again); ``v.free_skips_null =
    False`` (the null entries reach ``free_blocks`` and count down the null block)."""

    def one(s: State, a: Action, q: Request) -> Effect:
        dec = [z3.Sum([_i(grp.held[b]) for grp in q.groups]) for b in BLOCKS]
        dec[NULL] = z3.IntVal(0) if v.free_skips_null else z3.Sum([grp.nulls for grp in q.groups])
        pool = _pool_of(s).release(dec)
        gone = Request(z3.BoolVal(False), z3.IntVal(0), tuple(_empty_group(grp) for grp in q.groups))
        return z3.BoolVal(True), _merge(q.active, pool, _pool_of(s)), _merge(q.active, gone if v.free_pops else q, q)

    return _per_request(one)(s, a, t)


# ---- cache_blocks -------------------------------------------------------------------------------------------


def _cache_keys(pool: _Pool, q: Request, start: Sequence[z3.ArithRef], full: z3.ArithRef) -> _Pool:
    """``cache_full_blocks`` per group: the real blocks at ``[start[g], full)`` without a key get the group's, at
    their index."""
    cached, kgrp, kpos = list(pool.cached), list(pool.kgrp), list(pool.kpos)
    for b in REAL:
        for g in reversed(GROUPS):
            grp = q.groups[g]
            hit = z3.And(grp.held[b], grp.idx[b] >= start[g], grp.idx[b] < full, z3.Not(pool.cached[b]))
            cached[b] = z3.Or(hit, cached[b])
            kgrp[b] = z3.If(hit, g, kgrp[b])
            kpos[b] = z3.If(hit, grp.idx[b], kpos[b])
    return dataclasses.replace(pool, cached=tuple(cached), kgrp=tuple(kgrp), kpos=tuple(kpos))


def cache_blocks(s: State, a: Action, t: State, *, v: Variant = SOUND) -> z3.BoolRef:
    """``cache_blocks(req, tokens, num_tokens)`` (docs/block_pool.md §2; block_pool.py:230): a known request,
    ``0 <= num_tokens <= computed``; per group the real blocks at ``[num_cached, num_tokens // B)`` get their
    group's key (null entries skipped), ``num_cached := max(num_cached, num_tokens // B)``.

    Twin: ``v.cache_full_only = False`` caches ``cdiv(num_tokens, B)`` blocks (the partial last one)."""

    def one(s: State, a: Action, q: Request) -> Effect:
        full = bounded_div(a.n, s.B) if v.cache_full_only else _cdiv(s, a.n)
        pool = _cache_keys(_pool_of(s), q, [grp.ncached for grp in q.groups], full)
        req = dataclasses.replace(q, groups=tuple(dataclasses.replace(grp, ncached=zmax(grp.ncached, full))
                                                  for grp in q.groups))
        return z3.And(q.active, a.n >= 0, a.n <= q.computed), pool, req

    return _per_request(one)(s, a, t)


# ---- evict_blocks / reset_prefix_cache ----------------------------------------------------------------------


def evict_blocks(s: State, a: Action, t: State, *, v: Variant = SOUND) -> z3.BoolRef:
    """``evict_blocks(block_ids)`` (docs/block_pool.md §2; block_pool.py:851): each id's key dropped; counts and
    queue unchanged (ids are blocks of the pool: the reference's ``InvalidOperation`` for others is no step).

    Twin: ``v.evict_frees`` also frees the evicted blocks (count 0, queued) while requests hold them."""
    cached = tuple(z3.And(z3.Not(x), c) for x, c in zip(a.ids, s.cached, strict=True))
    pool = dataclasses.replace(_pool_of(s), cached=cached)
    if v.evict_frees:
        freed = [z3.And(x, r > 0, b != NULL) for b, (x, r) in enumerate(zip(a.ids, s.ref, strict=True))]
        pool = dataclasses.replace(pool, nfree=s.nfree + _count(freed),
                                   ref=tuple(z3.If(f, 0, r) for f, r in zip(freed, s.ref, strict=True)),
                                   inq=tuple(z3.Or(f, q) for f, q in zip(freed, s.inq, strict=True)))
    return _equal(t, pool.image(s, s.reqs))


def reset_prefix_cache(s: State, a: Action, t: State, *, v: Variant = SOUND) -> z3.BoolRef:
    """``reset_prefix_cache()`` (docs/block_pool.md §2; block_pool.py:871): ``ok`` (True) exactly when every non-null
    block is free (vLLM: ``num_gpu_blocks - free == 1``, the null block counted as used); then every key is dropped;
    else nothing changes.

    Twins: ``v.reset = "null_counted_free"`` asks for ``num_used == 0`` (the null block forgotten); ``"rebuild"``
    resets without the check and rebuilds the free queue (every count 0)."""
    cleared = tuple(z3.BoolVal(False) for _ in BLOCKS)
    pool = dataclasses.replace(_pool_of(s), cached=cleared)
    if v.reset == "rebuild":
        pool = _Pool(z3.IntVal(N_BLOCKS - 1), (s.ref[NULL], *(z3.IntVal(0) for _ in REAL)),
                     (s.inq[NULL], *(z3.BoolVal(True) for _ in REAL)), cleared, s.kgrp, s.kpos)
        return z3.And(a.ok, _equal(t, pool.image(s, s.reqs)))
    used = N_BLOCKS - s.nfree
    idle = used == (0 if v.reset == "null_counted_free" else 1)
    return z3.And(a.ok == idle, _equal(t, _merge(idle, pool.image(s, s.reqs), s)))


# ---- allocate_slots -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AllocTerms:
    """What one ``allocate_slots`` call on the selected request reads and computes (terms over the pre-state and
    the action; the relation and the obligations share them)."""

    running: z3.BoolRef
    h: z3.ArithRef  # hit tokens
    total: z3.ArithRef  # computed + hit + new
    skipped_hit: tuple[z3.ArithRef, ...]  # per group: the hit's null padding (new request)
    evictable: tuple[z3.ArithRef, ...]
    need_gate: tuple[z3.ArithRef, ...]
    need: tuple[z3.ArithRef, ...]
    gate_ok: z3.BoolRef
    mid: _Pool  # after the release of the out-of-window blocks (running request)
    mid_req: Request
    nblocks: z3.ArithRef  # cdiv(total, B)
    base_len: tuple[z3.ArithRef, ...]
    base_nulls: tuple[z3.ArithRef, ...]
    base_ncached: tuple[z3.ArithRef, ...]
    k: tuple[z3.ArithRef, ...]  # new blocks per group
    pre: tuple[z3.BoolRef, ...]  # the reference's preconditions and the hit's shape


def alloc_terms(s: State, a: Action, q: Request, v: Variant = SOUND) -> AllocTerms:
    """The quantities of :func:`allocate_slots` on request ``q`` (docs/block_pool.md §2, §3)."""
    running = q.active
    h = bounded_mul(a.hit, s.B)
    total = a.n + h + a.new
    hb = a.hit
    skipped_hit = (z3.IntVal(0), _skipped_blocks(s, h, v))
    pre: list[z3.BoolRef] = [
        a.ntok >= 1, a.n >= 0, a.new >= 0, hb >= 0, z3.Or(a.new > 0, hb > 0), total <= a.ntok, total <= s.L,
        z3.If(running, z3.And(hb == 0, a.n == q.computed), z3.And(a.n == 0, h < a.ntok))]
    for g in GROUPS:  # the hit: group g adopts hb - skipped cached blocks of its group, at [skipped, hb)
        adopt, pos = a.adopt[g], a.pos[g]
        for b in REAL:
            pre.append(z3.Implies(adopt[b], z3.And(z3.Not(running), s.cached[b], s.kgrp[b] == g, pos[b] == s.kpos[b],
                                                   pos[b] >= skipped_hit[g], pos[b] < hb)))
        pre += _distinct_positions(adopt, pos)
        pre.append(_count(adopt[1:]) == z3.If(running, 0, hb - skipped_hit[g]))
    evictable = tuple(_count([z3.And(a.adopt[g][b], s.ref[b] == 0) for b in REAL]) for g in GROUPS)
    counted = evictable if v.counts_evictable else (z3.IntVal(0), z3.IntVal(0))
    cap = cap_term(s)
    whole = zmin(a.ntok, s.L)

    def need_of(g: int, tokens: z3.ArithRef, capped: bool) -> z3.ArithRef:
        return num_blocks_to_allocate_term(
            s.B, tokens, running=running, held=z3.If(running, q.groups[g].length, 0), hit_blocks=hb,
            skipped_blocks=skipped_hit[g], evictable=counted[g], cap=cap if capped and g == SWA else None,
            div=bounded_div)

    need_gate = tuple(need_of(g, whole, v.gate_cap) for g in GROUPS)
    need = tuple(need_of(g, total, False) for g in GROUPS)
    gate_ok = z3.Or(z3.Not(a.must_fit), z3.Sum(need_gate) <= s.nfree)
    if v.removes_first:
        pool, req, _ = _removal(s, q, a.n, v)
        mid, mid_req = _merge(running, pool, _pool_of(s)), req
    else:
        mid, mid_req = _pool_of(s), q
    nblocks = _cdiv(s, total)
    base_len = tuple(z3.If(running, q.groups[g].length, hb) for g in GROUPS)
    base_nulls = tuple(z3.If(running, mid_req.groups[g].nulls, skipped_hit[g]) for g in GROUPS)
    base_ncached = tuple(z3.If(running, q.groups[g].ncached, hb) for g in GROUPS)
    k = tuple(zmax(nblocks - base_len[g], 0) for g in GROUPS)
    if v.blocks_for_chunk:
        k = tuple(_cdiv(s, a.new) for _ in GROUPS)
    return AllocTerms(running, h, total, skipped_hit, evictable, need_gate, need, gate_ok, mid, mid_req, nblocks,
                      base_len, base_nulls, base_ncached, k, tuple(pre))


def _allocated(s: State, a: Action, q0: Request, x: AllocTerms, v: Variant, groups: Sequence[int]
               ) -> tuple[_Pool, Request, list[z3.BoolRef]]:
    """The pool and the request when ``groups`` get their hit and their new blocks (both: the call succeeded;
    group 0 only: a twin's partial allocation), and the facts the chosen blocks obey."""
    q, mid = x.mid_req, x.mid
    no = z3.BoolVal(False)
    adopt = [[a.adopt[g][b] if g in groups else no for b in BLOCKS] for g in GROUPS]
    take = [[a.take[g][b] if g in groups else no for b in BLOCKS] for g in GROUPS]
    facts: list[z3.BoolRef] = [z3.Not(a.take[g][b]) for g in GROUPS if g not in groups for b in REAL]
    for g in groups:
        facts.append(_count(take[g][1:]) == x.k[g])
        for b in REAL:
            touched = z3.Or(a.adopt[FULL][b], a.adopt[SWA][b])
            facts.append(z3.Implies(take[g][b], z3.And(mid.inq[b], z3.Not(touched), a.pos[g][b] >= x.base_len[g],
                                                       a.pos[g][b] < x.base_len[g] + x.k[g])))
        facts += _distinct_positions(take[g], a.pos[g])
    if len(groups) > 1:
        facts += [z3.Not(z3.And(take[FULL][b], take[SWA][b])) for b in REAL]
    touched = [z3.Or(adopt[FULL][b], adopt[SWA][b]) for b in BLOCKS]
    taken = [z3.Or(take[FULL][b], take[SWA][b]) for b in BLOCKS]
    ref = [mid.ref[NULL]] + [mid.ref[b] + _i(adopt[FULL][b]) + _i(adopt[SWA][b]) + _i(take[FULL][b]) +
                             _i(take[SWA][b]) for b in REAL]
    if v.null_counted:  # the padding refers to the null block
        ref[NULL] = mid.ref[NULL] + z3.If(x.running, 0, z3.Sum([x.skipped_hit[g] for g in groups]))
    leaves = [z3.Or(taken[b], touched[b]) if v.touch_leaves_queue else taken[b] for b in BLOCKS]
    inq = [mid.inq[NULL]] + [z3.And(mid.inq[b], z3.Not(leaves[b])) for b in REAL]
    out = _count([z3.And(touched[b], mid.ref[b] == 0) for b in REAL]) if v.touch_leaves_queue else 0
    nfree = mid.nfree - _count(taken[1:]) - out
    cached = [mid.cached[NULL]] + [z3.And(z3.Not(taken[b]), mid.cached[b]) for b in REAL]
    kgrp, kpos = list(mid.kgrp), list(mid.kpos)
    for g in groups:  # a popped block's key is dropped; the group and index it now holds are its key's to be
        for b in REAL:
            kgrp[b] = z3.If(take[g][b], g, kgrp[b])
            kpos[b] = z3.If(take[g][b], a.pos[g][b], kpos[b])
    groups_after: list[Group] = []
    for g in GROUPS:
        grp, pos = q.groups[g], a.pos[g]
        if g in groups:
            new_in = [z3.Or(adopt[g][b], take[g][b]) for b in BLOCKS]
            held = (grp.held[NULL], *(z3.Or(z3.And(x.running, grp.held[b]), new_in[b]) for b in REAL))
            idx = (grp.idx[NULL], *(z3.If(new_in[b], pos[b], grp.idx[b]) for b in REAL))
            groups_after.append(Group(x.base_len[g] + x.k[g], x.base_nulls[g], x.base_ncached[g], held, idx))
        else:  # untouched by a partial allocation: as after the release (running) or empty (new)
            groups_after.append(_merge(x.running, grp, _empty_group(grp)))
    pool = _Pool(nfree, tuple(ref), tuple(inq), tuple(cached), tuple(kgrp), tuple(kpos))
    if len(groups) == len(GROUPS):
        # step (6): cache_blocks up to min(total, len(tokens)) = total
        full = bounded_div(x.total, s.B) if v.cache_full_only else _cdiv(s, x.total)
        req = Request(z3.BoolVal(True), x.total, tuple(groups_after))
        pool = _cache_keys(pool, req, x.base_ncached, full)
        req = dataclasses.replace(req, groups=tuple(dataclasses.replace(grp, ncached=zmax(grp.ncached, full))
                                                    for grp in req.groups))
    else:
        req = Request(z3.BoolVal(True), q0.computed, tuple(groups_after))
    return pool, req, facts


def allocate_slots(s: State, a: Action, t: State, *, v: Variant = SOUND) -> z3.BoolRef:
    """``allocate_slots(req, tokens, num_computed_tokens, num_new_tokens, hit, full_sequence_must_fit)``
    (docs/block_pool.md §2; kv_cache_manager.py:380): (1) the admission gate (``min(len(tokens), L)`` tokens, the SWA
    group capped); (2) a running request's out-of-window blocks released; (3) the sum over the groups of
    ``get_num_blocks_to_allocate`` against the free count; (4) a new request joins its hit (``touch``,
    block_pool.py:792; null padding); (5) per group ``cdiv(total, B) - length`` blocks popped (``get_new_blocks``,
    block_pool.py:706: keys dropped, count 1); (6) the full blocks cached.
    ``ok``: vLLM returned blocks; when it is False (vLLM's ``None``, the reference's ``OutOfMemory``) nothing
    changed. Preconditions the reference checks (``InvalidOperation``) are no step.

    Twins: ``v.check`` ``"group_by_group"`` (group 0 checked and allocated, then group 1 checked: a refusal after
    group 0's blocks were taken) and ``"each_alone"`` (each group checked alone against the free count: accepted,
    then group 1's ``get_new_blocks`` runs out, group 0's blocks taken); ``v.gate_cap = False`` (#39734);
    ``v.counts_evictable = False``; ``v.removes_first = False``; ``v.skip_offset``; ``v.touch_leaves_queue = False``;
    ``v.null_counted`` (padding counts the null block)."""

    def one(s: State, a: Action, q: Request) -> Effect:
        x = alloc_terms(s, a, q, v)
        pool, req, facts = _allocated(s, a, q, x, v, GROUPS)
        free_m = x.mid.nfree
        fits = z3.Sum(x.need) <= free_m
        if v.check == "sum":
            ok = z3.And(x.gate_ok, fits)
            return (z3.And(*x.pre, a.ok == ok, z3.Implies(ok, z3.And(facts))), _merge(ok, pool, _pool_of(s)),
                    _merge(ok, req, q))
        part_pool, part_req, part_facts = _allocated(s, a, q, x, v, (FULL,))
        if v.check == "group_by_group":
            first = x.need[FULL] <= free_m
            ok = z3.And(x.gate_ok, first, x.need[SWA] <= free_m - x.need[FULL])
            partial = z3.And(x.gate_ok, first, z3.Not(ok))
            full = ok
        else:
            ok = z3.And(x.gate_ok, x.need[FULL] <= free_m, x.need[SWA] <= free_m)
            partial = z3.And(ok, z3.Not(fits))
            full = z3.And(ok, fits)
        guard = z3.And(*x.pre, a.ok == ok, z3.Implies(full, z3.And(facts)), z3.Implies(partial, z3.And(part_facts)))
        return (guard, _merge(full, pool, _merge(partial, part_pool, _pool_of(s))),
                _merge(full, req, _merge(partial, part_req, q)))

    return _per_request(one)(s, a, t)


# ---- init, invariant ----------------------------------------------------------------------------------------


def init(s: State, *, v: Variant = SOUND) -> z3.BoolRef:
    """``initial_state``: every block but the null block free (``BlockPool.__init__`` pops block 0), counts 0, no
    key, no request. Twin ``v.init_null_free``: the queue ``range(0, N)``."""
    reqs = []
    for q in s.reqs:
        reqs.append(z3.And(z3.Not(q.active), q.computed == 0,
                           *[z3.And(g.length == 0, g.nulls == 0, g.ncached == 0, *[z3.Not(h) for h in g.held[1:]])
                             for g in q.groups]))
    null_free = v.init_null_free
    return z3.And(_constants(s), s.nfree == (N_BLOCKS if null_free else N_BLOCKS - 1),
                  *[x == 0 for x in s.ref], s.inq[NULL] == null_free, *[s.inq[b] for b in REAL],
                  *[z3.Not(c) for c in s.cached], *[x == 0 for x in s.kgrp], *[x == 0 for x in s.kpos], *reqs)


def _constants(s: State) -> z3.BoolRef:
    return z3.And(z3.Or([size == s.B for size in BLOCK_SIZES]), s.W >= 2, s.L >= 1, s.T >= 1)


def real_held(g: Group) -> z3.ArithRef:
    """The real blocks of a list."""
    return _count(list(g.held[1:]))


def invariant_clauses(s: State) -> list[tuple[str, z3.BoolRef]]:
    """V1-V5 of docs/block_pool.md §4 on the model's counts (V4 as "a key names its holders' group", V5 with the
    full-block rule a cached block obeys)."""
    holders = [z3.Sum([_i(grp.held[b]) for q in s.reqs for grp in q.groups]) for b in BLOCKS]
    full_blocks = [bounded_div(q.computed, s.B) for q in s.reqs]  # block i is full iff i < computed // B
    clauses = [
        ("constants: B in 1..4, W >= 2, L >= 1, T >= 1", _constants(s)),
        ("null: the null block's count is not maintained (0)", s.ref[NULL] == 0),
        ("V3: the null block is never in the free queue", z3.Not(s.inq[NULL])),
        ("V4: the null block has no key", z3.Not(s.cached[NULL])),
        ("counts: no reference count is negative", z3.And([x >= 0 for x in s.ref])),
        ("V2: a block's count is the number of list entries holding it",
         z3.And([s.ref[b] == holders[b] for b in REAL])),
        ("V3: a block is queued iff its count is 0, and queued once (free = #queued)",
         z3.And(*[s.inq[b] == (s.ref[b] == 0) for b in REAL], s.nfree == _count(list(s.inq)))),
        ("V1: free + #referenced == N - 1", s.nfree + _count([s.ref[b] > 0 for b in REAL]) == N_BLOCKS - 1),
        ("V4: a key names a group and a block index", z3.And([z3.Implies(c, z3.And(z3.Or(k == FULL, k == SWA), i >= 0))
                                                               for c, k, i in zip(s.cached, s.kgrp, s.kpos,
                                                                                  strict=True)])),
    ]
    for r, q in enumerate(s.reqs):
        idle = z3.And(q.computed == 0, *[z3.And(g.length == 0, g.nulls == 0, g.ncached == 0,
                                                *[z3.Not(h) for h in g.held[1:]]) for g in q.groups])
        clauses.append((f"V5: unknown request {r} holds nothing", z3.Implies(z3.Not(q.active), idle)))
        clauses.append((f"V5: request {r} computed 0..L tokens", z3.And(q.computed >= 0, q.computed <= s.L)))
        for gi, g in enumerate(q.groups):
            name = f"request {r} group {gi}"
            shape = [g.length == _cdiv(s, q.computed), g.nulls >= 0, g.nulls <= g.length,
                     real_held(g) == g.length - g.nulls, g.ncached >= 0, g.ncached <= g.length,
                     *[z3.Implies(g.held[b], z3.And(g.idx[b] >= g.nulls, g.idx[b] < g.length)) for b in REAL],
                     *_distinct_positions(g.held, g.idx)]
            clauses.append((f"V5: {name} lists cdiv(computed, B) entries, nulls then distinct real blocks",
                            z3.And(shape)))
            bound = g.nulls == 0 if gi == FULL else g.nulls <= _skipped_blocks(s, q.computed, SOUND)
            clauses.append((f"V5: {name}'s nulls are out of the window", bound))
            keyed = [z3.Implies(g.held[b], z3.And(s.kgrp[b] == gi, s.kpos[b] == g.idx[b],
                                                  z3.Implies(z3.Or(s.cached[b], s.ref[b] >= 2),
                                                             g.idx[b] < full_blocks[r])))
                     for b in REAL]
            clauses.append((f"V4: {name}'s blocks sit at their key's group and index (cached or shared: full)",
                            z3.And(keyed)))
    return clauses


# ---- rendering ----------------------------------------------------------------------------------------------


def columns() -> tuple[str, ...]:
    return ("B W L T", "free queue", "counts", "keys", *(f"request {r} (full | swa; 0 = null block)"
                                                         for r in range(REQS)))


def _list(m: z3.ModelRef, g: Group) -> str:
    length, nulls = as_int(m, g.length), as_int(m, g.nulls)
    entries = ["0"] * max(0, nulls) + ["?"] * max(0, length - nulls)
    for b in REAL:
        if as_bool(m, g.held[b]):
            i = as_int(m, g.idx[b])
            if 0 <= i < len(entries):
                entries[i] = str(b) if entries[i] == "?" else f"{entries[i]}+{b}"
            else:
                entries.append(f"{b}@{i}")
    return "[" + ",".join(entries) + "]"


def cells(m: z3.ModelRef, s: State) -> tuple[str, ...]:
    """A state's row: the constants, the free queue (its length and members; order not modelled), the nonzero counts,
    the keys (``b:g0@i``: block ``b`` cached for the full group as block ``i`` of a prefix), each request's lists
    (``c=`` computed tokens, ``cached=`` num_cached per group)."""
    queued = [str(b) for b in BLOCKS if as_bool(m, s.inq[b])]
    counts = " ".join(f"{b}:{as_int(m, s.ref[b])}" for b in BLOCKS if as_int(m, s.ref[b]) or b == NULL)
    keys = " ".join(f"{b}:g{as_int(m, s.kgrp[b])}@{as_int(m, s.kpos[b])}" for b in BLOCKS if as_bool(m, s.cached[b]))

    def request(q: Request) -> str:
        if not as_bool(m, q.active) and not any(as_bool(m, h) for g in q.groups for h in g.held[1:]):
            return ""
        known = "" if as_bool(m, q.active) else "unknown "
        lists = " | ".join(_list(m, g) for g in q.groups)
        cached = ",".join(str(as_int(m, g.ncached)) for g in q.groups)
        return f"{known}c={as_int(m, q.computed)} {lists} cached={cached}"

    consts = f"B={as_int(m, s.B)} W={as_int(m, s.W)} L={as_int(m, s.L)} T={as_int(m, s.T)}"
    return (consts, f"{as_int(m, s.nfree)}: {{{','.join(queued)}}}", counts, keys or "-",
            *(request(q) for q in s.reqs))


def _blocks(m: z3.ModelRef, flags: Sequence[z3.BoolRef]) -> list[int]:
    return [b for b in REAL if as_bool(m, flags[b])]


def describe(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
    """The call of a step: ``allocate_slots(req 0, 6 tokens, computed 0, new 4, hit 0, must_fit) -> full [1,2]
    swa [3,4]`` (or ``-> None``), ``free(req 1)``, ``evict_blocks({2})``."""
    op, a = step.op_name(m), step.action
    req = f"req {as_int(m, a.req)}"
    if op == "allocate_slots":
        hit = as_int(m, a.hit)
        args = (f"{req}, {as_int(m, a.ntok)} tokens, computed {as_int(m, a.n)}, new {as_int(m, a.new)}, "
                f"hit {hit} block{'' if hit == 1 else 's'}" + (", must_fit" if as_bool(m, a.must_fit) else ""))
        if hit:
            args += " " + " ".join(f"g{g}:{_blocks(m, a.adopt[g])}" for g in GROUPS)
        taken = " ".join(f"g{g} {_blocks(m, a.take[g])}" for g in GROUPS)
        return f"{op}({args}) -> " + (f"new {taken}" if as_bool(m, a.ok) else "None")
    if op == "remove_skipped_blocks":
        return f"{op}({req}, {as_int(m, a.n)} tokens)"
    if op == "cache_blocks":
        return f"{op}({req}, {as_int(m, a.n)} tokens)"
    if op == "evict_blocks":
        return f"{op}({{{','.join(str(b) for b in BLOCKS if as_bool(m, a.ids[b]))}}})"
    if op == "reset_prefix_cache":
        return f"{op}() -> {as_bool(m, a.ok)}"
    return f"{op}({req})"


def system(v: Variant = SOUND) -> _ts.TransitionSystem[State, Action]:
    """The model; a twin's :class:`Variant` changes the relations (and ``init``) it names."""
    return _ts.TransitionSystem(
        component=COMPONENT, state=State.fresh, action=Action.fresh, init=functools.partial(init, v=v),
        transitions={
            "allocate_slots": functools.partial(allocate_slots, v=v),
            "free": functools.partial(free, v=v),
            "remove_skipped_blocks": functools.partial(remove_skipped_blocks, v=v),
            "cache_blocks": functools.partial(cache_blocks, v=v),
            "evict_blocks": functools.partial(evict_blocks, v=v),
            "reset_prefix_cache": functools.partial(reset_prefix_cache, v=v),
        },
        invariant=invariant_clauses, columns=columns(), cells=cells, describe=describe)


SYSTEM: _ts.TransitionSystem[State, Action] = system()
"""The six operations of ``kvproof.reference.block_pool`` by their names, over 6 blocks and 2 request slots."""


# ---- obligations over the transitions ----------------------------------------------------------------------

#: The invariant's clauses by the part of it an ``allocate_slots.keeps_*`` obligation proves (their union is all).
CLAUSE_PARTS: dict[str, tuple[str, ...]] = {
    "counts": ("constants", "null", "counts", "V1", "V2", "V3"),
    "lists": ("V5",),
    "keys": ("V4",),
}


def _part(s: State, part: str) -> list[tuple[str, z3.BoolRef]]:
    return [(name, clause) for name, clause in invariant_clauses(s) if name.startswith(CLAUSE_PARTS[part])]


def _keeps(system_: _ts.TransitionSystem[State, Action], op: str, part: str) -> _ts.Check:
    """Consecution of one part of the invariant through ``op``: from a state satisfying the *whole* invariant, every
    ``op`` step keeps the clauses of ``part`` (the parts together are :func:`_ts.consecution`, split for speed)."""

    def build() -> list[z3.BoolRef]:
        step = _ts.Step.fresh(system_)
        return [system_.holds(step.pre), step.relation([op]),
                z3.Not(z3.And([clause for _, clause in _part(step.post, part)]))]

    def render(m: z3.ModelRef) -> str:
        step = _ts.Step.fresh(system_)
        broken = [name for name, clause in _part(step.post, part) if not as_bool(m, clause)]
        return _ts.step_table(system_, m, step, f"broken after step 1: {broken[0] if broken else '?'}")

    return _ts.Check(build, render)


def _after(step: _ts.Step[State, Action]) -> Request:
    return _selected(step.post, step.action.req)


def _step_terms(step: _ts.Step[State, Action], v: Variant) -> AllocTerms:
    """:func:`alloc_terms` of a step's ``allocate_slots`` call, on the request it names, before the call."""
    return alloc_terms(step.pre, step.action, _selected(step.pre, step.action.req), v)


def _changes(m: z3.ModelRef, pre: State, post: State) -> str:
    """The state variables a step changed, ``name a -> b``."""
    out = []
    for x, y in zip(_ts.terms_of(pre), _ts.terms_of(post), strict=True):
        if x.eq(y) or not z3.is_const(x):
            continue
        u = as_bool(m, x) if z3.is_bool(x) else as_int(m, x)
        w = as_bool(m, y) if z3.is_bool(y) else as_int(m, y)
        if u != w:
            out.append(f"{str(x).split('@', 1)[0]} {u} -> {w}")
    return ", ".join(out[:8]) + (" ..." if len(out) > 8 else "")


def _refusal_check(v: Variant) -> _ts.Check:
    sys_ = system(v)

    def safe(step: _ts.Step[State, Action]) -> z3.BoolRef:
        return z3.Implies(z3.Not(step.action.ok), _equal(step.pre, step.post))

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        return f"allocate_slots returned None but changed the state: {_changes(m, step.pre, step.post)}"

    return _ts.safety(sys_, safe, explain, ["allocate_slots"])


def _covers_check(v: Variant) -> _ts.Check:
    """An accepted call gives every group its ``cdiv(total, B)`` entries (no group runs out)."""
    sys_ = system(v)

    def safe(step: _ts.Step[State, Action]) -> z3.BoolRef:
        x = _step_terms(step, v)
        q = _after(step)
        return z3.Implies(step.action.ok, z3.And([q.groups[g].length == x.nblocks for g in GROUPS]))

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        x = _step_terms(step, v)
        q = _after(step)
        want = as_int(m, x.nblocks)
        short = [f"group {g} lists {as_int(m, q.groups[g].length)}" for g in GROUPS
                 if as_int(m, q.groups[g].length) != want]
        return (f"accepted with needs {[as_int(m, n) for n in x.need]} against {as_int(m, x.mid.nfree)} free blocks, "
                f"but {', '.join(short)} of cdiv(total {as_int(m, x.total)}, B) = {want} entries: group 1's "
                f"get_new_blocks ran out")

    return _ts.safety(sys_, safe, explain, ["allocate_slots"])


def _sum_check(v: Variant) -> _ts.Check:
    """An accepted call takes exactly the summed need from the free queue."""
    sys_ = system(v)

    def safe(step: _ts.Step[State, Action]) -> z3.BoolRef:
        x = _step_terms(step, v)
        return z3.Implies(step.action.ok, x.mid.nfree - step.post.nfree == z3.Sum(x.need))

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        x = _step_terms(step, v)
        left = as_int(m, x.mid.nfree) - as_int(m, step.post.nfree)
        return (f"get_num_blocks_to_allocate says {' + '.join(str(as_int(m, n)) for n in x.need)} = "
                f"{as_int(m, z3.Sum(x.need))} blocks, but {left} left the free queue (evictable hit blocks "
                f"{[as_int(m, e) for e in x.evictable]}): the check passed with fewer free blocks than the call takes")

    return _ts.safety(sys_, safe, explain, ["allocate_slots"])


def _window_held_check(v: Variant) -> _ts.Check:
    """After an accepted call group ``g`` holds ``cdiv(total, B) - skipped_g // B`` real blocks (the sound formula)."""
    sys_ = system(v)

    def want(step: _ts.Step[State, Action]) -> list[z3.ArithRef]:
        x = _step_terms(step, v)
        skipped = _skipped_blocks(step.pre, step.action.n + x.h, SOUND)
        return [x.nblocks, x.nblocks - skipped]

    def safe(step: _ts.Step[State, Action]) -> z3.BoolRef:
        q = _after(step)
        return z3.Implies(step.action.ok, z3.And([real_held(q.groups[g]) == w for g, w in zip(GROUPS, want(step),
                                                                                               strict=True)]))

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        q = _after(step)
        s = step.pre
        c = as_int(m, step.action.n) + as_int(m, bounded_mul(step.action.hit, s.B))
        return "; ".join(
            f"group {g} holds {as_int(m, real_held(q.groups[g]))} real blocks, not {as_int(m, w)}"
            + (f" = cdiv(total, B) - max(0, {c} - W + 1) // B" if g == SWA else "")
            for g, w in zip(GROUPS, want(step), strict=True) if as_int(m, real_held(q.groups[g])) != as_int(m, w))

    return _ts.safety(sys_, safe, explain, ["allocate_slots"])


def _admits_check(v: Variant) -> _ts.Check:
    """V8: a new request (no hit, a first chunk of ``1 <= new <= T`` tokens) on a pool where no block is referenced,
    ``len(tokens) <= L`` and a capped requirement within ``N - 1``, asks ``full_sequence_must_fit``: admitted."""

    def facts(s: State, a: Action) -> tuple[AllocTerms, list[z3.BoolRef]]:
        q = _selected(s, a.req)
        x = alloc_terms(s, a, q, v)
        blocks = _cdiv(s, a.ntok)
        capped = blocks + zmin(blocks, cap_term(s))
        hyps = [system(v).holds(s), a.req >= 0, a.req < REQS, *[s.ref[b] == 0 for b in REAL], z3.Not(q.active),
                a.hit == 0, a.n == 0, a.must_fit, a.new >= 1, a.new <= s.T, a.new <= a.ntok, a.ntok <= s.L,
                capped <= N_BLOCKS - 1, *[z3.Not(a.adopt[g][b]) for g in GROUPS for b in REAL]]
        return x, hyps

    def build() -> list[z3.BoolRef]:
        s, a = State.fresh("pre"), Action.fresh("step")
        x, hyps = facts(s, a)
        return [*hyps, *x.pre, z3.Not(z3.And(x.gate_ok, z3.Sum(x.need) <= x.mid.nfree))]

    def render(m: z3.ModelRef) -> str:
        s, a = State.fresh("pre"), Action.fresh("step")
        x, _ = facts(s, a)
        blocks = as_int(m, _cdiv(s, a.ntok))
        cap = as_int(m, cap_term(s))
        return (f"B={as_int(m, s.B)} W={as_int(m, s.W)} T={as_int(m, s.T)} L={as_int(m, s.L)}: a request of "
                f"{as_int(m, a.ntok)} tokens alone on the empty pool ({as_int(m, s.nfree)} free blocks), first chunk "
                f"{as_int(m, a.new)}: capped requirement {blocks} + min({blocks}, cap {cap}) = "
                f"{blocks + min(blocks, cap)} fits, but the full_sequence_must_fit gate asks "
                f"{' + '.join(str(as_int(m, n)) for n in x.need_gate)} = {as_int(m, z3.Sum(x.need_gate))} > "
                f"{as_int(m, s.nfree)}: it is never admitted (the pool cannot get emptier)")

    return _ts.Check(build, render)


def _idle_check(v: Variant) -> _ts.Check:
    """``reset_prefix_cache`` returns True exactly when no block is referenced; then no key is left."""
    sys_ = system(v)

    def safe(step: _ts.Step[State, Action]) -> z3.BoolRef:
        idle = z3.And([step.pre.ref[b] == 0 for b in REAL])
        return z3.And(step.action.ok == idle, z3.Implies(step.action.ok, z3.Not(z3.Or(step.post.cached))))

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        used = [b for b in REAL if as_int(m, step.pre.ref[b])]
        return (f"reset_prefix_cache returned {as_bool(m, step.action.ok)} with {as_int(m, step.pre.nfree)} of "
                f"{N_BLOCKS - 1} blocks free (referenced: {used or 'none'})")

    return _ts.safety(sys_, safe, explain, ["reset_prefix_cache"])


def _keeps_window_check(v: Variant) -> _ts.Check:
    """Every block ``remove_skipped_blocks(req, n)`` releases holds only positions before ``n - W + 1``."""
    sys_ = system(v)

    def released(step: _ts.Step[State, Action]) -> list[z3.BoolRef]:
        before, after = _selected(step.pre, step.action.req), _after(step)
        return [z3.And(before.groups[SWA].held[b], z3.Not(after.groups[SWA].held[b])) for b in BLOCKS]

    def safe(step: _ts.Step[State, Action]) -> z3.BoolRef:
        s, a = step.pre, step.action
        g = _selected(s, a.req).groups[SWA]
        return z3.And([z3.Implies(x, bounded_mul(g.idx[b] + 1, s.B) <= a.n - s.W + 1)
                       for b, x in enumerate(released(step)) if b != NULL])

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        s, a = step.pre, step.action
        g = _selected(s, a.req).groups[SWA]
        bsz, n, w = as_int(m, s.B), as_int(m, a.n), as_int(m, s.W)
        bad = [f"block {b} at index {as_int(m, g.idx[b])} (positions {as_int(m, g.idx[b]) * bsz}-"
               f"{as_int(m, g.idx[b]) * bsz + bsz - 1})" for b, x in enumerate(released(step))
               if b != NULL and as_bool(m, x) and (as_int(m, g.idx[b]) + 1) * bsz > n - w + 1]
        return (f"remove_skipped_blocks(n={n}) released {', '.join(bad)}, but the window of token {n} reads "
                f"positions >= n - W + 1 = {n - w + 1}")

    return _ts.safety(sys_, safe, explain, ["remove_skipped_blocks"])


def _negative_count(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
    low = [f"block {b}: count {as_int(m, x)}" for b, x in enumerate(step.post.ref) if as_int(m, x) < 0]
    return f"step {step.index + 1}: a count below zero ({', '.join(low)})"


NEGATIVE: _ts.Target[State, Action] = _ts.Target(
    "a count below zero", lambda step: z3.Or([x < 0 for x in step.post.ref]), _negative_count)
NULL_QUEUED: _ts.Target[State, Action] = _ts.Target(
    "the null block in the free queue", lambda step: step.post.inq[NULL],
    lambda m, step: (f"step {step.index + 1}: the null block 0 is in the free queue (count "
                     f"{as_int(m, step.post.ref[NULL])}): the next popleft hands it out"))


def _transition_obligations() -> tuple[Obligation, ...]:
    def ob(suffix: str, statement: str, check: _ts.Check, twin_of: str | None = None) -> Obligation:
        return _ts.obligation(SYSTEM, suffix, statement, check, family=FAMILY, twin_of=twin_of)

    def consecution(v: Variant, op: str) -> _ts.Check:
        return _ts.consecution(system(v), [op])

    keeps = "keeps V1-V5 (conservation free + #referenced == N - 1, counts, queue, keys, list shapes)"
    return (
        ob("pool.initiation", "the initial pool (blocks 1..N-1 free, counts 0, no key, no request) satisfies V1-V5",
           _ts.initiation(SYSTEM)),
        ob("pool.initiation.null_block_free", "a free queue built as range(0, N) (the null block not popped first) "
           "starts with the null block queued (V3)", _ts.initiation(system(Variant(init_null_free=True))),
           "pool.initiation"),
        ob("allocate_slots.keeps_counts", "every allocate_slots step from a V1-V5 state keeps the counts: the null "
           "block's count 0 and never queued, no negative count, V2, V3 and V1 free + #referenced == N - 1",
           _keeps(SYSTEM, "allocate_slots", "counts")),
        ob("allocate_slots.keeps_counts.touch_keeps_free", "a touch that leaves a count-0 hit block in the free queue "
           "(touch without free_block_queue.remove) makes it referenced and free at once (V3, V1)",
           _keeps(system(Variant(touch_leaves_queue=False)), "allocate_slots", "counts"),
           "allocate_slots.keeps_counts"),
        ob("allocate_slots.keeps_lists", "every allocate_slots step from a V1-V5 state keeps V5: each list has "
           "cdiv(computed, B) entries, out-of-window nulls then distinct real blocks",
           _keeps(SYSTEM, "allocate_slots", "lists")),
        ob("allocate_slots.keeps_lists.blocks_for_chunk", "sizing the new blocks by cdiv(num_new_tokens, B) alone "
           "(not cdiv(total, B) - the entries held) gives a list the wrong length (V5)",
           _keeps(system(Variant(blocks_for_chunk=True)), "allocate_slots", "lists"), "allocate_slots.keeps_lists"),
        ob("allocate_slots.keeps_keys", "every allocate_slots step from a V1-V5 state keeps V4: a held block sits at "
           "its key's group and index, full when cached or shared; the null block has no key",
           _keeps(SYSTEM, "allocate_slots", "keys")),
        ob("allocate_slots.keeps_keys.caches_partial_block", "caching cdiv(total, B) blocks after the allocation "
           "caches the partial last block (V4: a cached block must be full)",
           _keeps(system(Variant(cache_full_only=False)), "allocate_slots", "keys"), "allocate_slots.keeps_keys"),
        ob("free.keeps_invariant", f"free {keeps}", consecution(SOUND, "free")),
        ob("free.keeps_invariant.null_not_skipped", "a free that hands the leading null entries to free_blocks "
           "without the null check counts the null block below zero",
           consecution(Variant(free_skips_null=False), "free"), "free.keeps_invariant"),
        ob("free.keeps_invariant.duplicate_free", "a free that keeps the request's bookkeeping (req_to_blocks.get, "
           "not pop) accepts a second free of the request: its blocks' counts go below zero (BMC from the start)",
           _ts.reachable(system(Variant(free_pops=False)), NEGATIVE, 3,
                         search=_ts.Search(ops=("allocate_slots", "free"))), "free.keeps_invariant"),
        ob("free.keeps_invariant.null_counted", "maintaining the null block's count (each null entry counts it) and "
           "freeing it like any block queues the null block (BMC from the start)",
           _ts.reachable(system(Variant(null_counted=True, free_skips_null=False)), NULL_QUEUED, 3,
                         search=_ts.Search(ops=("allocate_slots", "remove_skipped_blocks", "free"))),
           "free.keeps_invariant"),
        ob("remove_skipped_blocks.keeps_invariant", f"remove_skipped_blocks {keeps}",
           consecution(SOUND, "remove_skipped_blocks")),
        ob("remove_skipped_blocks.keeps_invariant.not_nulled", "releasing the out-of-window blocks without replacing "
           "their entries by the null block leaves a freed block in the list (V2)",
           consecution(Variant(nulls_entries=False), "remove_skipped_blocks"),
           "remove_skipped_blocks.keeps_invariant"),
        ob("remove_skipped_blocks.keeps_window", "every block remove_skipped_blocks(req, n) releases holds only "
           "positions < n - W + 1 (the window of token n reads from there)", _keeps_window_check(SOUND)),
        ob("remove_skipped_blocks.keeps_window.plus_two", "skipping max(0, n - W + 2) tokens releases a block the "
           "window still reads", _keeps_window_check(Variant(skip_offset=2)), "remove_skipped_blocks.keeps_window"),
        ob("cache_blocks.keeps_invariant", f"cache_blocks {keeps}", consecution(SOUND, "cache_blocks")),
        ob("cache_blocks.keeps_invariant.partial_block", "caching cdiv(num_tokens, B) blocks caches a block whose "
           "tokens are not all computed (V4: a cached block is full)",
           consecution(Variant(cache_full_only=False), "cache_blocks"), "cache_blocks.keeps_invariant"),
        ob("evict_blocks.keeps_invariant", f"evict_blocks {keeps}", consecution(SOUND, "evict_blocks")),
        ob("evict_blocks.keeps_invariant.frees_evicted", "an eviction that also frees the evicted blocks queues "
           "blocks requests still hold (V2, V3)", consecution(Variant(evict_frees=True), "evict_blocks"),
           "evict_blocks.keeps_invariant"),
        ob("reset_prefix_cache.keeps_invariant", f"reset_prefix_cache {keeps}",
           consecution(SOUND, "reset_prefix_cache")),
        ob("reset_prefix_cache.keeps_invariant.rebuild", "a reset without the idle check that rebuilds the free queue "
           "frees blocks requests still hold (V2)", consecution(Variant(reset="rebuild"), "reset_prefix_cache"),
           "reset_prefix_cache.keeps_invariant"),
        ob("reset_prefix_cache.only_when_idle", "reset_prefix_cache returns True exactly when no block is referenced "
           "(free == N - 1: the null block counts as used), and then no block keeps a key", _idle_check(SOUND)),
        ob("reset_prefix_cache.only_when_idle.null_counted_free", "asking num_used == 0 (forgetting that the null "
           "block counts as used) refuses to reset an idle pool", _idle_check(Variant(reset="null_counted_free")),
           "reset_prefix_cache.only_when_idle"),
        ob("allocate_slots.refusal_changes_nothing", "all or nothing: an allocate_slots that returns None (the "
           "summed need exceeds the free blocks, or the gate refuses) changes no state", _refusal_check(SOUND)),
        ob("allocate_slots.refusal_changes_nothing.group_by_group", "checking and allocating group by group takes "
           "group 0's blocks, then refuses for group 1: a None that changed the pool",
           _refusal_check(Variant(check="group_by_group")), "allocate_slots.refusal_changes_nothing"),
        ob("allocate_slots.accepted_never_runs_out", "all or nothing: an accepted allocate_slots gives every group "
           "its cdiv(total, B) entries (no get_new_blocks runs out in the second group)", _covers_check(SOUND)),
        ob("allocate_slots.accepted_never_runs_out.each_group_alone", "checking each group's need alone against "
           "the free count accepts a call whose SWA group then runs out",
           _covers_check(Variant(check="each_alone")), "allocate_slots.accepted_never_runs_out"),
        ob("get_num_blocks_to_allocate.sum_leaves_the_queue", "the sum over the groups of get_num_blocks_to_allocate "
           "(new blocks plus count-0 hit blocks) is exactly what an accepted allocate_slots takes from the free "
           "queue", _sum_check(SOUND)),
        ob("get_num_blocks_to_allocate.sum_leaves_the_queue.evictable_not_counted", "without the evictable hit "
           "blocks the need is smaller than what leaves the free queue",
           _sum_check(Variant(counts_evictable=False)), "get_num_blocks_to_allocate.sum_leaves_the_queue"),
        ob("allocate_slots.holds_window_blocks", "after an accepted allocate_slots the full group holds cdiv(total, "
           "B) real blocks and the SWA group cdiv(total, B) - max(0, c - W + 1) // B (c: computed tokens before the "
           "call, hit included)", _window_held_check(SOUND)),
        ob("allocate_slots.holds_window_blocks.skipped_n_minus_w", "the historical max(0, n - W) keeps one "
           "out-of-window block more than the window needs", _window_held_check(Variant(skip_offset=0)),
           "allocate_slots.holds_window_blocks"),
        ob("allocate_slots.holds_window_blocks.no_removal", "without the release of the out-of-window blocks before "
           "the check (single_type_kv_cache_manager.py:176-266) a running request keeps blocks the window left: its "
           "real blocks are no longer bounded by the admission cap", _window_held_check(Variant(removes_first=False)),
           "allocate_slots.holds_window_blocks"),
        ob("allocate_slots.admits_alone", "V8: a new request without a hit, alone on a pool where no block is "
           "referenced, with len(tokens) <= L, a first chunk 1 <= new <= T and cdiv(len, B) + min(cdiv(len, B), "
           "cap) <= N - 1, is admitted by full_sequence_must_fit", _admits_check(SOUND)),
        ob("allocate_slots.admits_alone.gate_without_cap", "the gate charging the SWA group the whole sequence "
           "cdiv(len, B) (no admission cap, vLLM issue #39734) never admits a request that fits",
           _admits_check(Variant(gate_cap=False)), "allocate_slots.admits_alone"),
    )


OBLIGATIONS: tuple[Obligation, ...] = _arith_obligations() + _transition_obligations()
