"""``admission``: the SWA admission budget against HiCache load-back (PR #27391; sglang_semantics.md §5, §7 A1-A3,
§8 item 8, §9 S8 S9; upstream_0523_vllm_fuzz.md §1.2).

Obligations are named ``admission.<op>.<claim>`` after the reference operation of
``kvproof.reference.admission`` they are about (``add_one_req``, ``swa_budget_for_req``,
``match_prefix_for_req`` ...) or ``admission.round.<claim>`` for the round invariant; a broken
twin appends what it breaks. The policies are the reference's :class:`Policy` values.

**The transition systems** (:data:`SYSTEMS`, one per policy, :data:`SYSTEM` = ``CORRECTED``; built with
:mod:`kvproof.spec._ts`): the SWA pool in pages as ``room`` (free + evictable: every decision reads the
sum, §5.1 ``rem_swa_tokens``; eviction only moves pages inside it), ``locked`` (protected tree pages),
``held`` (pages running requests' chunks hold), and the open round's adder (``offset`` =
``rem_swa_token_offset``, ``rem_chunk``, ``pending`` = chunk pages admitted and not allocated yet,
``chunked``); constants ``P``, ``W``, the pool's pages ``T``, the chunk size ``C`` and whether chunked
prefill is on. The tree enters through the action: what the window walk finds when ``add_one_req``
runs (:class:`Action`: ``own`` unlocked device pages of its window, ``lb_whole`` / ``lb_cap`` pages the
whole / window-capped load-back restores) and the match-time ``swa_host_hit_length`` (``h_snap``,
any value: a stale one differs from ``lb_whole``). One relation per reference operation, named like
it: :func:`get_new_batch_prefill`, :func:`match_prefix_for_req`, :func:`add_one_req`,
:func:`init_load_back`, :func:`add_chunked_req`, :func:`prepare_for_extend`, :func:`evict`,
:func:`cache_unfinished_req`, :func:`cache_finished_req`. A continuation enters through its action too: ``e`` =
the prompt left, ``done`` = the tokens the request computed beyond its matched prefix (which is whole pages),
``m``.
``tests/spec/test_drift_admission.py`` checks that each accepts the steps of seeded reference runs.

A1 ("admitted => load-back and the next chunk's allocation succeed", §5.6): the decision terms of
:func:`decide` from any state of the round invariant (:func:`invariant_clauses`: accounting
``room + locked + held == T``, ``pending <= room``, ``pending * P <= offset``):

* ``add_one_req.a1_corrected`` / ``a1_upstream_27391`` / ``a1_upstream_0523``: an admitted request's
  load-back fits and the round's pending chunks (its own included) fit afterwards; the upstream
  policies under the stated assumption (the match-time value is what load-back restores now:
  ``h_snap == lb_whole * P``; nothing else consumes SWA between the check and the allocations is the
  model: one ``add_one_req`` step), ``corrected`` with none. Twins: ``a1_upstream_27391.pre_27391``
  (S8's shape, the budget without the host term), ``.pre_27391_s8`` (S8's numbers),
  ``a1_upstream_27391_minimal`` (finding: neither the strict ``>=`` nor the ``+ P`` page is needed for A1 on a
  page-granular pool, only the host term; twin ``.no_host_term``),
  ``.stale_match`` (27391 and 0523 with a stale value), ``a1_corrected.no_lock_recheck``,
  ``.uncapped_load_back``, ``.snapshot_reused``;
* ``round.initiation`` / ``round.consecution``: the invariant is inductive over every op but a
  standalone ``init_load_back`` under ``corrected`` (twins: the standalone load-back, i.e. SWA consumed
  between check and allocation; ``upstream_27391`` with stale values); ``round.consecution_upstream_27391``:
  the same under ``upstream_27391`` with fresh values (twin: ``pre_27391``);
* ``add_one_req.live_idle_pool`` (liveness): in an idle round (nothing locked, held, reserved or
  pending) a request that fits the empty pool (:func:`fits_empty_pool_term`) is admitted; a refused
  ``add_one_req`` changes nothing, so in an idle pool a request refused once is refused in every round.
  Twins ``.upstream_27391`` (S9), ``.upstream_27391_s9`` (S9's numbers), ``.upstream_0523``,
  ``.pre_27391``.

Chunked prefill (§5.3, last paragraph; upstream_0523_vllm_fuzz.md §1.2 ``available_chunk_tokens``):

* ``add_chunked_req.keeps_round_invariant`` (the other policies reserve as ``corrected``): twins
  ``.no_reservation`` (the chunk not reserved, as 0.5.23 does for a ring continuation) and ``.no_swa_cap``
  (capped by ``rem_chunk_tokens`` alone); ``add_chunked_req.keeps_round_invariant_upstream_0523`` (its
  reservation reads ``m``; twin ``.limit_after_decrement``: ``rem_chunk_tokens`` after its decrement as the
  allocation limit);
  ``cache_unfinished_req.keeps_round_invariant`` (twin ``.double_count``: the freed pages back in ``room`` and
  still ``held``);
* ``add_chunked_req.a1``: an added continuation's chunk fits the room the round's pending chunks leave, with a
  page to spare (#23174: "add_chunked_req must leave one page"); twin ``.no_page_left`` (``rem_swa_tokens``
  without ``- P``); ``add_chunked_req.a1_minimal`` (finding: the fit alone does not need the ``- P``: the pool
  is page-granular and the reservations cover the pending pages; twin ``.no_swa_cap``);
* ``cache_unfinished_req.frees_out_of_window_only``: the release frees no page the window reaches, never frees a
  page twice and keeps at most ``W + P - 1`` tokens (twin ``.in_window_page``: ``ceil`` for ``floor``);
* ``prepare_for_extend.continuation_pages_exact``: a continuation's ``ceil((done + e)/P) - ceil(done/P)`` pages
  hold its tokens with no empty page (twin ``.whole_new_pages``: ``ceil(e/P)``, the partly filled page ignored).

A2 (§5.6): ``swa_budget_for_req.a2_monotone`` (twin ``.host_hit_in_chunk``),
``swa_budget_for_req.a2_stricter`` (27391 >= the pre-fix budget, equal at ``h = 0``; twin
``.upstream_0523``: 0.5.23's estimate is below the pre-fix budget for some requests), and
``add_one_req.a2_monotone`` (admission is monotone in ``e``, ``h`` under ``corrected``, also
``_upstream_27391`` and ``_pre_27391``; twin ``.upstream_0523``: the never-fits chunk cap admits a bigger
request that a smaller one, waiting on a transient shortage, is not).

A3 (§5.6): ``add_one_req.a3_load_back_trigger`` (twin ``.host_hit_only``) and
``match_prefix_for_req.a3_host_hit_is_full_only`` (twin ``.pre_27391_flag``).

Every host hit is a sum of node lengths, whole pages, so the models carry it in pages (``ceil_P(h) ==
h``); the budget builders (:func:`swa_budget_term`, :func:`estimate_swa_kv_tokens_term`) take tokens and
are checked against the reference on concrete integers in ``tests/spec/test_admission.py``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Obligation, as_bool, as_int
from kvproof.spec.terms import (
    IntLike,
    ceil_div_term,
    ceil_p_term,
    floor_p_term,
    lift,
    num_new_pages_term,
    zmax,
    zmin,
)

__all__ = [
    "CONTINUE",
    "DEFERRED",
    "LAST",
    "NO_TOKEN",
    "OBLIGATIONS",
    "OTHER",
    "S8",
    "S9",
    "SYSTEM",
    "SYSTEMS",
    "SYSTEMS_BY_POLICY",
    "TRUNCATED",
    "Action",
    "Continuation",
    "Decision",
    "Policy",
    "State",
    "Variant",
    "add_chunked_req",
    "add_one_req",
    "cache_finished_req",
    "cache_unfinished_req",
    "check_prefill_terms",
    "continuation",
    "decide",
    "estimate_swa_kv_tokens_term",
    "evict",
    "fits_empty_pool_term",
    "get_new_batch_prefill",
    "init",
    "init_load_back",
    "invariant_clauses",
    "match_prefix_for_req",
    "out_of_window_pages_term",
    "prepare_for_extend",
    "swa_budget_term",
    "system",
]

COMPONENT = "admission"
FAMILY = "admission"
CONTINUE, NO_TOKEN, OTHER = 0, 1, 2
RESULTS = ("CONTINUE", "NO_TOKEN", "OTHER")
DEFERRED, TRUNCATED, LAST = 0, 1, 2  # add_chunked_req's outcome (the reference's ChunkedResult)
CHUNK_RESULTS = ("DEFERRED", "TRUNCATED", "LAST")


class Policy(enum.StrEnum):
    """The reference's ``AdmissionPolicy`` (same values)."""

    PRE_27391 = "pre_27391"
    UPSTREAM_27391 = "upstream_27391"
    UPSTREAM_0523 = "upstream_0523"
    CORRECTED = "corrected"


# ---- term builders (mirror kvproof.reference.admission) --------------------------------------


def swa_budget_term(e: IntLike, h: IntLike, W: IntLike, P: IntLike, rem_chunk: IntLike,
                    chunking: z3.BoolRef | bool) -> z3.ArithRef:
    """``_swa_budget_for_req`` (§5.2): ``max(a, W) + P + (ceil_P(h) if h > 0)``, ``a = min(e, rem_chunk)`` when
    chunked prefill is on."""
    e, h = lift(e), lift(h)
    a = z3.If(chunking, zmin(e, rem_chunk), e)
    return zmax(a, W) + lift(P) + z3.If(h > 0, ceil_p_term(h, P), 0)


def estimate_swa_kv_tokens_term(e: IntLike, m: IntLike, W: IntLike, P: IntLike, limit: IntLike,
                                limited: z3.BoolRef | bool, h: IntLike) -> z3.ArithRef:
    """0.5.23's ``estimate_swa_kv_tokens``: ``max(a - W, 0) + min(e + m, W) + P (+ ceil_P(h))``, ``a = min(e, L)``."""
    e, h = lift(e), lift(h)
    a = z3.If(limited, zmin(e, limit), e)
    return zmax(a - lift(W), 0) + zmin(e + lift(m), W) + lift(P) + z3.If(h > 0, ceil_p_term(h, P), 0)


def check_prefill_terms(e: IntLike, m: IntLike, h: IntLike, remaining: IntLike, size_swa: IntLike, W: IntLike,
                        P: IntLike, limit: IntLike, limited: z3.BoolRef | bool) -> tuple[z3.BoolRef, z3.ArithRef]:
    """``SWAPrefillBudget.check_prefill``'s SWA part: ``(admit, chunk limit)`` (the limit is meaningful when
    ``limited``): ``needed < remaining`` admits with ``limit``; a never-fitting request (``needed >= size_swa``)
    gets ``min(limit, floor_P(remaining - estimate(0, m, h)))`` when that is positive."""
    needed = estimate_swa_kv_tokens_term(ceil_p_term(e, P), m, W, P, limit, limited, h)
    cap = floor_p_term(lift(remaining) - estimate_swa_kv_tokens_term(0, m, W, P, 0, False, h), P)
    fits = needed < lift(remaining)
    on = z3.BoolVal(limited) if isinstance(limited, bool) else limited
    escape = z3.And(needed >= lift(size_swa), on, cap > 0)
    return z3.Or(fits, escape), z3.If(fits, lift(limit), zmin(limit, cap))


def out_of_window_pages_term(done: IntLike, W: IntLike, P: IntLike) -> z3.ArithRef:
    """The reference's ``out_of_window_pages``: ``max(0, floor((done - W) / P))``."""
    return floor_p_term(zmax(0, lift(done) - lift(W)), P) / lift(P)


def fits_empty_pool_term(e_after: IntLike, own: IntLike, W: IntLike, P: IntLike, T: IntLike, C: IntLike,
                         chunking: z3.BoolRef | bool) -> z3.BoolRef:
    """The liveness premise: ``max(min(e', C), W) + P + ceil_P(W) < (T - own) * P`` (the reference's
    ``fits_empty_pool``)."""
    a = z3.If(chunking, zmin(e_after, C), lift(e_after))
    return zmax(a, W) + lift(P) + ceil_p_term(W, P) < (lift(T) - lift(own)) * lift(P)


# ---- state and action -------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """Constants ``P``, ``W``, ``T`` (pool pages), ``C`` (chunk size), ``chunking``; the pool's ``room`` / ``locked``
    / ``held`` pages; the round's ``open`` flag, ``offset`` (tokens), ``rem_chunk`` (tokens), ``pending``
    (pages) and ``chunked``."""

    P: z3.ArithRef
    W: z3.ArithRef
    T: z3.ArithRef
    C: z3.ArithRef
    chunking: z3.BoolRef
    room: z3.ArithRef
    locked: z3.ArithRef
    held: z3.ArithRef
    open: z3.BoolRef
    offset: z3.ArithRef
    rem_chunk: z3.ArithRef
    pending: z3.ArithRef
    chunked: z3.BoolRef

    @staticmethod
    def fresh(tag: str) -> State:
        """Variables ``name@tag``; the constants are the same symbols in every state."""
        def i(name: str) -> z3.ArithRef:
            return z3.Int(f"{name}@{tag}")

        return State(z3.Int("P"), z3.Int("W"), z3.Int("T"), z3.Int("C"), z3.Bool("chunking"), i("room"), i("locked"),
                     i("held"), z3.Bool(f"open@{tag}"), i("offset"), i("rem_chunk"), i("pending"),
                     z3.Bool(f"chunked@{tag}"))


@dataclass(frozen=True)
class Action:
    """An operation's arguments as the model reads them (tokens unless said).

    ``add_chunked_req``: ``e`` = the prompt left, ``done`` = the request's own computed tokens (beyond its
    matched prefix), ``m``, ``result`` (``DEFERRED`` / ``TRUNCATED`` / ``LAST``); ``cache_unfinished_req`` reads
    ``freed`` (the out-of-window pages it frees).
    ``add_one_req``: ``e`` = prompt - Full device prefix (before load-back), ``host_full`` = the Full host hit
    (``e' = e - host_full``), ``m`` = the clipped ``max_new_tokens``, ``h_snap`` = the match-time
    ``swa_host_hit_length`` in pages, ``own`` = the window's unlocked device pages, ``own_sel`` = the unlocked
    device pages of the window of the match's last *device* node (what 0.5.23's selection pin protects; the
    best-match window's device nodes are among them), ``lb_whole`` /
    ``lb_cap`` = pages the whole / capped load-back restores now, ``back`` = pages an ``OTHER`` verdict's
    unlock returns to evictable, ``result`` = the verdict (``CONTINUE`` / ``NO_TOKEN`` / ``OTHER``).
    ``init_load_back`` reads ``lb_whole`` / ``lb_cap``; ``cache_finished_req`` reads ``freed`` (the
    chunk's pages) and ``back`` (pages its unlock returns); ``evict`` reads ``n``.
    """

    e: z3.ArithRef
    host_full: z3.ArithRef
    m: z3.ArithRef
    h_snap: z3.ArithRef
    own: z3.ArithRef
    own_sel: z3.ArithRef
    lb_whole: z3.ArithRef
    lb_cap: z3.ArithRef
    back: z3.ArithRef
    freed: z3.ArithRef
    n: z3.ArithRef
    result: z3.ArithRef
    done: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> Action:
        return Action(*(z3.Int(f"{name}_arg@{tag}") for name in
                        ("e", "host_full", "m", "h_snap", "own", "own_sel", "lb_whole", "lb_cap", "back", "freed",
                         "n", "result", "done")))

    def walk_facts(self, s: State) -> list[z3.BoolRef]:
        """What the reference's tree guarantees about an ``add_one_req`` call's numbers: a request with something to
        extend, a window whose unlocked device pages are evictable (inside ``room``), a capped restore of at most
        one page-rounded window that is no bigger than the whole one and not empty when the whole one is not."""
        return [self.e >= 1, self.host_full >= 0, self.e - self.host_full >= 1, self.m >= 0, self.h_snap >= 0,
                self.own >= 0, self.own <= self.own_sel, self.own_sel <= s.room, self.lb_cap >= 0,
                self.lb_cap <= self.lb_whole,
                self.lb_cap * s.P <= ceil_p_term(s.W, s.P), z3.Implies(self.lb_whole >= 1, self.lb_cap >= 1)]

    def fresh_match(self) -> z3.BoolRef:
        """The stated assumption of the upstream policies: the match-time value is what load-back restores now."""
        return self.h_snap == self.lb_whole


def constants(s: State) -> list[z3.BoolRef]:
    return [s.P >= 1, s.W >= 1, s.T >= 1, s.C >= s.P]


# ---- the decision of add_one_req ---------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A broken twin's change to a policy's ``add_one_req`` (the defaults are the policy itself)."""

    recheck: bool = True  # the check inside the tree lock
    capped_load: bool | None = None  # None: as the policy (capped for CORRECTED)
    snapshot: bool = False  # CORRECTED's budget from the match-time value (capped at one window)
    strict: bool = True  # upstream's `budget >= rem_swa_tokens -> NO_TOKEN`; False: `>` (admits budget == rem)
    page_overhead: bool = True  # the budget's + P


SOUND = Variant()


@dataclass(frozen=True)
class Decision:
    """``add_one_req``'s numbers: the checks, the load-back, the chunk, the reservation, the verdict."""

    e_after: z3.ArithRef
    budget: z3.ArithRef  # the policy's budget (0.5.23: needed), tokens
    rem_out: z3.ArithRef  # rem_swa_tokens outside the lock
    rem_in: z3.ArithRef  # inside: the window's own pages are protected
    passes: z3.BoolRef  # every check the policy makes passes
    lb: z3.ArithRef  # pages load-back restores
    load_ok: z3.BoolRef
    chunk_pages: z3.ArithRef
    input_tokens: z3.ArithRef
    chunked: z3.BoolRef
    other: z3.BoolRef  # admitted by the checks, no page of chunk left: OTHER, nothing admitted
    admitted: z3.BoolRef
    reserve: z3.ArithRef


def decide(policy: Policy, s: State, a: Action, v: Variant = SOUND) -> tuple[Decision, z3.ArithRef]:
    """The decision terms of ``add_one_req`` and the room after an admission (the reference, §5.3)."""
    P, W = s.P, s.W
    e_after = a.e - a.host_full
    rem_out = s.room * P - s.offset
    upstream_0523 = policy is Policy.UPSTREAM_0523
    pinned = a.own_sel if upstream_0523 else a.own  # 0.5.23 selects under a pin of the last device node
    rem_in = (s.room - pinned) * P - s.offset
    limit, limited = s.rem_chunk, s.chunking
    if upstream_0523:
        passes, limit = check_prefill_terms(e_after, a.m, a.h_snap * P, rem_in, s.T * P, W, P, s.rem_chunk,
                                            s.chunking)
        budget = estimate_swa_kv_tokens_term(ceil_p_term(e_after, P), a.m, W, P, s.rem_chunk, s.chunking,
                                             a.h_snap * P)
    else:
        if policy is Policy.CORRECTED:
            h = zmin(a.h_snap, ceil_div_term(W, P)) if v.snapshot else a.lb_cap
            e = e_after
        else:
            h = a.h_snap if policy is Policy.UPSTREAM_27391 else z3.IntVal(0)
            e = a.e
        budget = swa_budget_term(e, h * P, W, P, s.rem_chunk, s.chunking) - (0 if v.page_overhead else P)

        def fits(rem: z3.ArithRef) -> z3.BoolRef:
            return budget < rem if v.strict else budget <= rem

        passes = z3.And(fits(rem_out), fits(rem_in)) if v.recheck else fits(rem_out)
    capped = policy is Policy.CORRECTED if v.capped_load is None else v.capped_load
    lb = a.lb_cap if capped else a.lb_whole
    if upstream_0523:  # load-back only when the match found a host hit (needs_host_load_back)
        lb = z3.If(z3.Or(a.host_full > 0, a.h_snap > 0), lb, 0)
    load_ok = lb <= s.room - pinned
    epages = ceil_div_term(e_after, P)
    whole = z3.Or(z3.Not(limited), epages * P <= limit)
    trunc = floor_p_term(limit, P)
    other = z3.And(passes, z3.Not(whole), trunc <= 0)
    chunk_pages = z3.If(whole, epages, trunc / P)
    input_tokens = z3.If(whole, epages * P, trunc)
    if policy is Policy.UPSTREAM_0523:
        reserve = estimate_swa_kv_tokens_term(input_tokens, z3.If(whole, a.m, 0), W, P, s.rem_chunk, s.chunking, 0)
    else:
        reserve = swa_budget_term(input_tokens, 0, W, P, s.rem_chunk, s.chunking)
    d = Decision(e_after, budget, rem_out, rem_in, passes, lb, load_ok, chunk_pages, input_tokens,
                 z3.Not(whole), other, z3.And(passes, z3.Not(other)), reserve)
    return d, s.room - a.own - lb


# ---- the continuation of a chunked request ------------------------------------------------------


@dataclass(frozen=True)
class Continuation:
    """``add_chunked_req``'s numbers: ``avail``, the chunk, whether prompt is left after it, its pages, the
    reservation."""

    avail: z3.ArithRef
    new: z3.ArithRef
    truncated: z3.BoolRef
    pages: z3.ArithRef
    input_tokens: z3.ArithRef
    reserve: z3.ArithRef


def continuation(policy: Policy, s: State, a: Action, *, page_left: bool = True, swa_cap: bool = True,
                 limit_after_decrement: bool = False) -> Continuation:
    """``avail = min(rem_chunk, rem_swa_tokens - P)`` (0.5.23's ``available_chunk_tokens``; ``page_left``: the
    ``- P``, ``swa_cap``: the SWA term at all), the chunk ``min(e, avail)``, its pages past the request's last
    partly filled page, and the reservation of ``update_prefill_budget`` (``m`` only for the last chunk; its
    allocation limit is ``rem_chunk`` before the decrement, ``limit_after_decrement``: a twin's after)."""
    P, W = s.P, s.W
    cap = s.room * P - s.offset - (P if page_left else 0)
    avail = z3.If(s.chunking, zmin(s.rem_chunk, cap) if swa_cap else s.rem_chunk, cap)
    new = zmin(a.e, avail)
    truncated = a.e > avail
    input_tokens = ceil_p_term(new, P)
    limit = s.rem_chunk - input_tokens if limit_after_decrement else s.rem_chunk
    if policy is Policy.UPSTREAM_0523:
        reserve = estimate_swa_kv_tokens_term(input_tokens, z3.If(truncated, 0, a.m), W, P, limit, s.chunking, 0)
    else:
        reserve = swa_budget_term(input_tokens, 0, W, P, limit, s.chunking)
    pages = num_new_pages_term(a.done, a.done + new, P)
    return Continuation(avail, new, truncated, pages, input_tokens, reserve)


# ---- the transitions: one per operation of kvproof.reference.admission --------------------------------


def _frame(s: State, t: State, *written: str) -> list[z3.BoolRef]:
    return _ts.unchanged_except(s, t, *written)


def get_new_batch_prefill(s: State, a: Action, t: State) -> z3.BoolRef:
    """A round starts: the adder's offset 0, ``rem_chunk = C``, nothing pending or chunked."""
    return z3.And(z3.Not(s.open), t.open, t.offset == 0, t.rem_chunk == s.C, t.pending == 0, z3.Not(t.chunked),
                  *_frame(s, t, "open", "offset", "rem_chunk", "pending", "chunked"))


def match_prefix_for_req(s: State, a: Action, t: State) -> z3.BoolRef:
    """The match-time snapshot: no pool page moves."""
    return z3.And(_frame(s, t))


def add_one_req(s: State, a: Action, t: State, *, policy: Policy = Policy.CORRECTED,
                variant: Variant = SOUND) -> z3.BoolRef:
    """``add_one_req`` (§5.3): refused -> ``NO_TOKEN``, nothing changes; admitted with a failing load-back -> no
    step (the reference raises ``OutOfMemory``); ``OTHER`` without a page of chunk -> the lock released (``back``
    pages of own + loaded return to evictable); admitted -> the window locked and loaded, the chunk pending, the
    reservation added, the verdict ``budget_state``."""
    d, room_after = decide(policy, s, a, variant)
    rem_after = room_after * s.P - (s.offset + d.reserve)
    chunk_after = s.rem_chunk - z3.If(s.chunking, d.input_tokens, 0)
    chunked_after = z3.Or(s.chunked, d.chunked)
    # 0.5.23's budget_state does not stop at a chunked request
    stop_at_chunk = z3.BoolVal(False) if policy is Policy.UPSTREAM_0523 else chunked_after
    verdict = z3.If(rem_after <= 0, NO_TOKEN,
                    z3.If(z3.Or(stop_at_chunk, z3.And(s.chunking, chunk_after <= 0)), OTHER, CONTINUE))
    refused = z3.And(a.result == NO_TOKEN, *_frame(s, t))
    taken = a.own + d.lb
    gave_up = z3.And(a.result == OTHER, a.back >= 0, a.back <= taken, t.room == s.room - taken + a.back,
                     t.locked == s.locked + taken - a.back, *_frame(s, t, "room", "locked"))
    admitted = z3.And(a.result == verdict, t.room == room_after, t.locked == s.locked + taken,
                      t.pending == s.pending + d.chunk_pages, t.offset == s.offset + d.reserve,
                      t.rem_chunk == chunk_after, t.chunked == chunked_after,
                      *_frame(s, t, "room", "locked", "pending", "offset", "rem_chunk", "chunked"))
    if policy is Policy.UPSTREAM_0523:  # 0.5.23 decides the chunk before loading back: OTHER changes nothing
        unchanged = z3.And(a.result == OTHER, *_frame(s, t))
        return z3.And(s.open, *a.walk_facts(s),
                      z3.If(z3.Not(d.passes), refused, z3.If(d.other, unchanged, z3.And(d.load_ok, admitted))))
    return z3.And(s.open, *a.walk_facts(s),
                  z3.If(z3.Not(d.passes), refused, z3.And(d.load_ok, z3.If(d.other, gave_up, admitted))))


def init_load_back(s: State, a: Action, t: State, *, policy: Policy = Policy.CORRECTED) -> z3.BoolRef:
    """A load-back on its own (its window already locked): ``lb`` pages leave ``room`` and are protected."""
    lb = a.lb_cap if policy is Policy.CORRECTED else a.lb_whole
    return z3.And(a.lb_cap >= 0, a.lb_cap <= a.lb_whole, lb <= s.room, t.room == s.room - lb, t.locked == s.locked + lb,
                  *_frame(s, t, "room", "locked"))


def add_chunked_req(s: State, a: Action, t: State, *, policy: Policy = Policy.CORRECTED, page_left: bool = True,
                    reserved: bool = True, swa_cap: bool = True, limit_after_decrement: bool = False) -> z3.BoolRef:
    """``add_chunked_req`` (§5.3): ``avail <= 0`` -> ``DEFERRED``, nothing changes; else the chunk is pending, its
    reservation added (``reserved=False``: a twin's missing one), ``rem_chunk -= ceil_P(chunk)``; ``TRUNCATED``
    when prompt is left after it, else ``LAST``. The request keeps no new lock; ``chunked`` is not set."""
    k = continuation(policy, s, a, page_left=page_left, swa_cap=swa_cap, limit_after_decrement=limit_after_decrement)
    deferred = z3.And(a.result == DEFERRED, *_frame(s, t))
    added = z3.And(a.result == z3.If(k.truncated, TRUNCATED, LAST), t.pending == s.pending + k.pages,
                   t.offset == s.offset + (k.reserve if reserved else 0),
                   t.rem_chunk == s.rem_chunk - z3.If(s.chunking, k.input_tokens, 0),
                   *_frame(s, t, "pending", "offset", "rem_chunk"))
    return z3.And(s.open, a.e >= 1, a.done >= 0, a.m >= 0, z3.If(k.avail <= 0, deferred, added))


def cache_unfinished_req(s: State, a: Action, t: State) -> z3.BoolRef:
    """Between rounds, a chunk ran with prompt left: ``freed`` of the pages requests hold (its own, out of the window)
    back to the free list; its window lock stays."""
    return z3.And(z3.Not(s.open), a.freed >= 0, a.freed <= s.held, t.room == s.room + a.freed,
                  t.held == s.held - a.freed, *_frame(s, t, "room", "held"))


def prepare_for_extend(s: State, a: Action, t: State) -> z3.BoolRef:
    """The round's batch allocates every pending chunk (short: no step, the reference raises) and the round closes
    (the adder is dropped: ``rem_chunk`` reads ``C`` again)."""
    return z3.And(s.open, s.pending <= s.room, t.room == s.room - s.pending, t.held == s.held + s.pending,
                  t.pending == 0, z3.Not(t.open), t.offset == 0, t.rem_chunk == s.C, z3.Not(t.chunked),
                  *_frame(s, t, "room", "held", "pending", "open", "offset", "rem_chunk", "chunked"))


def evict(s: State, a: Action, t: State) -> z3.BoolRef:
    """Eviction tombstones evictable pages: they stay inside ``room`` (free + evictable)."""
    return z3.And(a.n >= 0, *_frame(s, t))


def cache_finished_req(s: State, a: Action, t: State) -> z3.BoolRef:
    """Completion: ``freed`` chunk pages back to the free list, ``back`` unlocked pages back to evictable."""
    return z3.And(a.freed >= 0, a.freed <= s.held, a.back >= 0, a.back <= s.locked,
                  t.room == s.room + a.freed + a.back, t.held == s.held - a.freed, t.locked == s.locked - a.back,
                  *_frame(s, t, "room", "held", "locked"))


def init(s: State) -> z3.BoolRef:
    """``initial_state``: every device page of the tree evictable, the rest free (``room == T``), no round."""
    return z3.And(*constants(s), s.room == s.T, s.locked == 0, s.held == 0, z3.Not(s.open), s.offset == 0,
                  s.rem_chunk == s.C, s.pending == 0, z3.Not(s.chunked))


def invariant_clauses(s: State) -> list[tuple[str, z3.BoolRef]]:
    """Accounting (§1.4), the closed round's reset, and A1's round clause (the reservations cover the pending
    chunks, which fit)."""
    return [("constants: P >= 1, W >= 1, T >= 1, C >= P", z3.And(constants(s))),
            ("counts >= 0", z3.And(s.room >= 0, s.locked >= 0, s.held >= 0, s.pending >= 0, s.offset >= 0)),
            ("accounting: room (free + evictable) + locked + held == T", s.room + s.locked + s.held == s.T),
            ("a closed round has nothing pending, reserved or chunked",
             z3.Implies(z3.Not(s.open), z3.And(s.pending == 0, s.offset == 0, z3.Not(s.chunked)))),
            ("the chunk left is at most C (C once the round is closed); no chunked request without chunking",
             z3.And(s.rem_chunk <= s.C, z3.Implies(z3.Not(s.open), s.rem_chunk == s.C),
                    z3.Implies(z3.Not(s.chunking), z3.Not(s.chunked)))),
            ("A1: the reservations cover the pending chunks (pending * P <= offset)", s.pending * s.P <= s.offset),
            ("A1: the pending chunks fit (pending <= room)", s.pending <= s.room)]


# ---- rendering --------------------------------------------------------------------------------------


COLUMNS = ("P W T C", "room", "locked", "held", "round: offset rem_chunk pending")


def cells(m: z3.ModelRef, s: State) -> tuple[str, ...]:
    chunk = f"C={as_int(m, s.C)}" if as_bool(m, s.chunking) else "no chunking"
    rnd = (f"{as_int(m, s.offset)} {as_int(m, s.rem_chunk)} {as_int(m, s.pending)}"
           + (" chunked" if as_bool(m, s.chunked) else "")) if as_bool(m, s.open) else "closed"
    return (f"P={as_int(m, s.P)} W={as_int(m, s.W)} T={as_int(m, s.T)} {chunk}", str(as_int(m, s.room)),
            str(as_int(m, s.locked)), str(as_int(m, s.held)), rnd)


def describe(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
    op, a = step.op_name(m), step.action
    p = as_int(m, step.pre.P)
    load = f"load-back {as_int(m, a.lb_whole) * p} whole / {as_int(m, a.lb_cap) * p} capped tokens"
    if op == "add_one_req":
        verdict = as_int(m, a.result)
        return (f"add_one_req(e={as_int(m, a.e)}, host_full={as_int(m, a.host_full)}, m={as_int(m, a.m)}, "
                f"swa_host_hit_length={as_int(m, a.h_snap) * p} at match, own window {as_int(m, a.own)} pages, {load})"
                f" -> {RESULTS[verdict] if 0 <= verdict < 3 else verdict}")
    if op == "init_load_back":
        return f"init_load_back({load})"
    if op == "cache_finished_req":
        return f"cache_finished_req(freed={as_int(m, a.freed)}p back={as_int(m, a.back)}p)"
    if op == "cache_unfinished_req":
        return f"cache_unfinished_req(freed={as_int(m, a.freed)}p)"
    if op == "add_chunked_req":
        verdict = as_int(m, a.result)
        return (f"add_chunked_req(prompt left {as_int(m, a.e)}, done {as_int(m, a.done)}, m={as_int(m, a.m)}) -> "
                f"{CHUNK_RESULTS[verdict] if 0 <= verdict < 3 else verdict}")
    if op == "evict":
        return f"evict({as_int(m, a.n)})"
    return f"{op}()"


def system(policy: Policy = Policy.CORRECTED) -> _ts.TransitionSystem[State, Action]:
    """The model under ``policy`` (its ``add_one_req``, ``init_load_back`` and ``add_chunked_req``)."""
    return _ts.TransitionSystem(
        component=COMPONENT, state=State.fresh, action=Action.fresh, init=init,
        transitions={"get_new_batch_prefill": get_new_batch_prefill, "match_prefix_for_req": match_prefix_for_req,
                     "add_one_req": functools.partial(add_one_req, policy=policy),
                     "init_load_back": functools.partial(init_load_back, policy=policy),
                     "add_chunked_req": functools.partial(add_chunked_req, policy=policy),
                     "prepare_for_extend": prepare_for_extend, "evict": evict,
                     "cache_unfinished_req": cache_unfinished_req, "cache_finished_req": cache_finished_req},
        invariant=invariant_clauses, columns=COLUMNS, cells=cells, describe=describe)


SYSTEMS_BY_POLICY: dict[Policy, _ts.TransitionSystem[State, Action]] = {p: system(p) for p in Policy}
SYSTEMS: tuple[_ts.TransitionSystem[State, Action], ...] = tuple(SYSTEMS_BY_POLICY.values())
SYSTEM: _ts.TransitionSystem[State, Action] = SYSTEMS_BY_POLICY[Policy.CORRECTED]
"""Every operation of ``kvproof.reference.admission``'s scheduler, by its name, under ``CORRECTED``."""


# ---- A1: admitted => load-back and the round's chunks fit -------------------------------------------

S8 = {"P": 64, "W": 128, "C": 512, "T": 10, "e": 2000, "host_full": 1024, "lb": 3}
"""§5.5 / §9 S8: prompt 2000 tokens, 1024 of them Full on host, a 192-token (3-page) host tombstone in the window,
chunk 512, 10 free SWA pages (§5.5's 700 free tokens as whole pages)."""
S9 = {"P": 64, "W": 128, "C": 512, "T": 32, "e": 64, "host_full": 0, "lb": 64}
"""§9 S9: a 4096-token (64-page) host tombstone, Full on device, 64 new tokens, a 2048-token (32-page) pool."""


def _a1_text(m: z3.ModelRef, policy: Policy, s: State, a: Action, d: Decision, room_after: z3.ArithRef) -> str:
    p = as_int(m, s.P)
    chunk = f"chunk C={as_int(m, s.C)} (rem_chunk {as_int(m, s.rem_chunk)})" if as_bool(m, s.chunking) else \
        "no chunking"
    lb, ch, pend = as_int(m, d.lb), as_int(m, d.chunk_pages), as_int(m, s.pending)
    room_in = as_int(m, s.room) - as_int(m, a.own)
    ignored = " (the pre-#27391 budget ignores it)" if policy is Policy.PRE_27391 else ""
    head = (f"{policy.value}: page size P={p}, window W={as_int(m, s.W)}, {chunk}; SWA pool T={as_int(m, s.T)} "
            f"pages: room {as_int(m, s.room)} pages (free + evictable), offset {as_int(m, s.offset)}, pending "
            f"{pend} pages; request e={as_int(m, a.e)} (Full host hit {as_int(m, a.host_full)} -> e'="
            f"{as_int(m, d.e_after)}), m={as_int(m, a.m)}, swa_host_hit_length={as_int(m, a.h_snap) * p} at match "
            f"time{ignored}, own window {as_int(m, a.own)} pages, load-back restores {as_int(m, a.lb_whole) * p} "
            f"tokens whole / {as_int(m, a.lb_cap) * p} capped. ")
    check = (f"budget {as_int(m, d.budget)} against rem_swa_tokens {as_int(m, d.rem_out)} outside the lock, "
             f"{as_int(m, d.rem_in)} inside: admitted. ")
    if lb > room_in:
        return head + check + f"load-back needs {lb} pages, {room_in} left: init_load_back runs out of SWA"
    return head + check + (f"load-back takes {lb} pages -> {as_int(m, room_after)} left; the chunk of "
                           f"{as_int(m, d.input_tokens)} tokens needs {ch} pages (+ {pend} pending): "
                           f"prepare_for_extend runs out of SWA (Prefill out of memory)")


def _a1(policy: Policy, *, fresh: bool, variant: Variant = SOUND,
        pin: Callable[[State, Action], list[z3.BoolRef]] | None = None) -> _ts.Check:
    """From any round-invariant state, an ``add_one_req`` that admits under ``policy`` has a load-back that fits and
    leaves room for every pending chunk (``fresh``: the match-time value is what load-back restores)."""

    def parts() -> tuple[State, Action, Decision, z3.ArithRef]:
        s, a = State.fresh("pre"), Action.fresh("step")
        d, room_after = decide(policy, s, a, variant)
        return s, a, d, room_after

    def build() -> list[z3.BoolRef]:
        s, a, d, room_after = parts()
        facts = [*(c for _, c in invariant_clauses(s)), s.open, *a.walk_facts(s), d.admitted]
        facts += [a.fresh_match()] if fresh else []
        facts += pin(s, a) if pin is not None else []
        return [*facts, z3.Not(z3.And(d.load_ok, s.pending + d.chunk_pages <= room_after))]

    def render(m: z3.ModelRef) -> str:
        s, a, d, room_after = parts()
        return _a1_text(m, policy, s, a, d, room_after)

    return _ts.Check(build, render)


def _small(s: State, a: Action) -> list[z3.BoolRef]:
    """Bounds for a twin's search (any counterexample refutes it): small pages and pools."""
    return [s.P <= 4, s.W <= 8, s.T <= 12, s.C <= 16, a.e <= 40, a.m <= 8, a.lb_whole <= 12, a.h_snap <= 12]


def _pinned(s: State, a: Action, numbers: dict[str, int]) -> list[z3.BoolRef]:
    """A scenario's numbers: constants, the request, its whole load-back and the chunk."""
    pairs = [(s.P, "P"), (s.W, "W"), (s.C, "C"), (s.T, "T"), (a.e, "e"), (a.host_full, "host_full"),
             (a.lb_whole, "lb")]
    return [s.chunking, a.own == 0, a.m == 16, *(term == numbers[key] for term, key in pairs)]


def _small_idle(s: State, a: Action) -> list[z3.BoolRef]:
    """:func:`_small` in a round with nothing reserved or pending and no device page of its own window."""
    return [*_small(s, a), s.offset == 0, s.pending == 0, a.own == 0]


def _s8(s: State, a: Action) -> list[z3.BoolRef]:
    """S8's numbers: an idle round over a pool with 10 free pages, nothing evictable of its own; the capped restore
    would be min(192, ceil_64(128)) = 128 tokens."""
    return [*_pinned(s, a, S8), s.room == s.T, s.locked == 0, s.held == 0, s.offset == 0, s.pending == 0,
            s.rem_chunk == s.C, z3.Not(s.chunked), a.lb_cap == 2]


# ---- liveness -----------------------------------------------------------------------------------------


def _idle(s: State) -> list[z3.BoolRef]:
    """An idle round: nothing locked, held, reserved or pending; the whole pool is room."""
    return [*constants(s), s.open, s.room == s.T, s.locked == 0, s.held == 0, s.offset == 0, s.pending == 0,
            s.rem_chunk == s.C, z3.Not(s.chunked)]


def _live(policy: Policy, pin: Callable[[State, Action], list[z3.BoolRef]] | None = None) -> _ts.Check:
    """In an idle round, a request that fits the empty pool is admitted (a refusal changes nothing, so an idle
    pool would refuse it in every round)."""

    def parts() -> tuple[State, Action, Decision]:
        s, a = State.fresh("pre"), Action.fresh("step")
        return s, a, decide(policy, s, a)[0]

    def build() -> list[z3.BoolRef]:
        s, a, d = parts()
        fits = fits_empty_pool_term(d.e_after, a.own, s.W, s.P, s.T, s.C, s.chunking)
        facts = [*_idle(s), *a.walk_facts(s), a.fresh_match(), fits, *(pin(s, a) if pin else [])]
        return [*facts, z3.Not(d.admitted)]

    def render(m: z3.ModelRef) -> str:
        s, a, d = parts()
        p = as_int(m, s.P)
        chunk = f"chunk C={as_int(m, s.C)}" if as_bool(m, s.chunking) else "no chunking"
        return (f"{policy.value}: page size P={p}, window W={as_int(m, s.W)}, {chunk}; an idle SWA pool of "
                f"T={as_int(m, s.T)} pages; request e={as_int(m, a.e)} (Full host hit {as_int(m, a.host_full)} -> "
                f"e'={as_int(m, d.e_after)}), m={as_int(m, a.m)}, own window {as_int(m, a.own)} pages, "
                f"swa_host_hit_length={as_int(m, a.h_snap) * p} (whole host tombstones; capped restore "
                f"{as_int(m, a.lb_cap) * p}): it fits the empty pool (max(min(e', C), W) + P + ceil_P(W) < "
                f"(T - own) * P), yet budget {as_int(m, d.budget)} >= rem_swa_tokens {as_int(m, d.rem_in)}: "
                f"NO_TOKEN, and the same in every later round (nothing changes)")

    return _ts.Check(build, render)


def _s9(s: State, a: Action) -> list[z3.BoolRef]:
    """S9's numbers; the capped restore is min(4096, ceil_64(128)) = 128 tokens."""
    return [*_pinned(s, a, S9), a.lb_cap == 2]


# ---- chunked prefill: the continuation and the release ----------------------------------------------------


def _a1_chunk(*, spare: int, page_left: bool = True, swa_cap: bool = True) -> _ts.Check:
    """From any round-invariant state, an added continuation's chunk pages fit the room the round's pending chunks
    leave, with ``spare`` pages to spare (``page_left``: ``available_chunk_tokens``'s ``- P``; ``swa_cap``: its SWA
    term at all)."""

    def parts() -> tuple[State, Action, Continuation]:
        s, a = State.fresh("pre"), Action.fresh("step")
        return s, a, continuation(Policy.CORRECTED, s, a, page_left=page_left, swa_cap=swa_cap)

    def build() -> list[z3.BoolRef]:
        s, a, k = parts()
        facts = [*(c for _, c in invariant_clauses(s)), s.open, a.e >= 1, a.done >= 0, a.m >= 0, k.avail > 0]
        return [*facts, z3.Not(s.pending + k.pages + spare <= s.room)]

    def render(m: z3.ModelRef) -> str:
        s, a, k = parts()
        p = as_int(m, s.P)
        chunk = f"rem_chunk {as_int(m, s.rem_chunk)}" if as_bool(m, s.chunking) else "no chunking"
        minus = " - P" if page_left else ""
        avail = f"min(rem_chunk, rem_swa_tokens{minus})" if swa_cap else "rem_chunk"
        return (f"page size P={p}, window W={as_int(m, s.W)}, {chunk}; room {as_int(m, s.room)} pages (free + "
                f"evictable), offset {as_int(m, s.offset)}, pending {as_int(m, s.pending)} pages: rem_swa_tokens "
                f"{as_int(m, s.room) * p - as_int(m, s.offset)}. A chunked request with {as_int(m, a.e)} prompt tokens "
                f"left and {as_int(m, a.done)} computed: avail = {avail} = "
                f"{as_int(m, k.avail)}, a chunk of {as_int(m, k.new)} tokens takes {as_int(m, k.pages)} pages past its "
                f"partly filled one: pending {as_int(m, s.pending) + as_int(m, k.pages)} pages"
                + (f" leave no page of the {as_int(m, s.room)} (#23174: the continuation must leave one)" if spare
                   else f" > room {as_int(m, s.room)}: prepare_for_extend runs out of SWA"))

    return _ts.Check(build, render)


def _out_of_window(*, in_window_page: bool = False) -> _ts.Check:
    """``cache_unfinished_req``'s release after a chunk of ``n`` tokens on ``done``: the pages freed in all are wholly
    below ``done + n - W`` (out of the window), none is freed twice (the count never falls), and at most ``W + P - 1``
    own tokens stay (``in_window_page``: a twin rounding up)."""
    names = ("P", "W", "done", "chunk")

    def freed(d: z3.ArithRef, W: z3.ArithRef, P: z3.ArithRef) -> z3.ArithRef:
        return ceil_div_term(zmax(0, d - W), P) if in_window_page else out_of_window_pages_term(d, W, P)

    def parts() -> tuple[tuple[z3.ArithRef, ...], list[tuple[str, z3.BoolRef]]]:
        P, W, d, n = (z3.Int(f"{x}") for x in names)
        after, before = freed(d + n, W, P), freed(d, W, P)
        claims = [("the freed pages end at or below done - W", after * P <= zmax(0, d + n - W)),
                  ("no page is freed twice", after >= before),
                  ("at most W + P - 1 own tokens are kept", d + n - after * P <= W + P - 1)]
        return (P, W, d, n), claims

    def build() -> list[z3.BoolRef]:
        (P, W, d, n), claims = parts()
        return [P >= 1, W >= 1, d >= 0, n >= 1, z3.Not(z3.And(*(c for _, c in claims)))]

    def render(m: z3.ModelRef) -> str:
        (P, W, d, n), claims = parts()
        v = {x: as_int(m, t) for x, t in zip(names, (P, W, d, n), strict=True)}
        done = v["done"] + v["chunk"]
        broken = "; ".join(text for text, c in claims if not as_bool(m, c))
        pages = as_int(m, freed(d + n, W, P))
        return (f"page size P={v['P']}, window W={v['W']}: a request with {v['done']} own tokens runs a chunk of "
                f"{v['chunk']}: {done} computed, the window is tokens [{done - v['W']}, {done}); {pages} pages freed "
                f"in all (tokens [0, {pages * v['P']})): broken: {broken}")

    return _ts.Check(build, render)


def _continuation_pages(*, whole_new_pages: bool = False) -> _ts.Check:
    """``prepare_for_extend``'s pages for a continuing chunk of ``n`` tokens on ``done``: with the ``ceil(done/P)``
    pages the request's own tokens already span, they hold all ``done + n`` tokens and no empty page
    (``whole_new_pages``: a twin taking ``ceil(n/P)``, as if the last page were full)."""

    def parts() -> tuple[tuple[z3.ArithRef, ...], z3.ArithRef]:
        P, d, n = z3.Ints("P done chunk")
        k = ceil_div_term(n, P) if whole_new_pages else num_new_pages_term(d, d + n, P)
        return (P, d, n), k

    def build() -> list[z3.BoolRef]:
        (P, d, n), k = parts()
        span = (ceil_div_term(d, P) + k) * P
        return [P >= 1, d >= 0, n >= 1, z3.Not(z3.And(span >= d + n, span < d + n + P))]

    def render(m: z3.ModelRef) -> str:
        (P, d, n), k = parts()
        p, dv, nv, kv = as_int(m, P), as_int(m, d), as_int(m, n), as_int(m, k)
        have = -(-dv // p)
        return (f"page size P={p}: {dv} own tokens on {have} pages, a chunk of {nv}: {kv} new pages, "
                f"{(have + kv) * p} slots for {dv + nv} tokens: "
                + ("a page stays empty" if (have + kv) * p >= dv + nv + p else "tokens left without a page"))

    return _ts.Check(build, render)


# ---- A2: monotonicity -----------------------------------------------------------------------------


def _budget_vars() -> tuple[z3.ArithRef, ...]:
    return tuple(z3.Ints("P W rem_chunk e1 e2 h1 h2"))


def _host_hit_in_chunk(e: z3.ArithRef, h: z3.ArithRef, W: z3.ArithRef, P: z3.ArithRef,
                       rc: z3.ArithRef) -> z3.ArithRef:
    """Wrong: the loaded tokens counted against the chunk (``min(e, rem_chunk - h)``)."""
    return zmax(zmin(e, rc - h), W) + P + z3.If(h > 0, ceil_p_term(h, P), 0)


def _sound_budget(e: z3.ArithRef, h: z3.ArithRef, W: z3.ArithRef, P: z3.ArithRef, rc: z3.ArithRef) -> z3.ArithRef:
    return swa_budget_term(e, h, W, P, rc, True)


BudgetRule = Callable[[z3.ArithRef, z3.ArithRef, z3.ArithRef, z3.ArithRef, z3.ArithRef], z3.ArithRef]


def _monotone_check(rule: BudgetRule) -> _ts.Check:
    def build() -> list[z3.BoolRef]:
        P, W, rc, e1, e2, h1, h2 = _budget_vars()
        return [P >= 1, W >= 1, rc >= 0, e1 >= 0, e1 <= e2, h1 >= 0, h1 <= h2,
                rule(e1, h1, W, P, rc) > rule(e2, h2, W, P, rc)]

    def render(m: z3.ModelRef) -> str:
        P, W, rc, e1, e2, h1, h2 = _budget_vars()
        v = {str(x): as_int(m, x) for x in (P, W, rc, e1, e2, h1, h2)}
        return (f"page size P={v['P']}, window W={v['W']}, rem_chunk={v['rem_chunk']}: budget(e={v['e1']}, "
                f"h={v['h1']}) = {as_int(m, rule(e1, h1, W, P, rc))} > budget(e={v['e2']}, h={v['h2']}) = "
                f"{as_int(m, rule(e2, h2, W, P, rc))}")

    return _ts.Check(build, render)


def _stricter_check(upstream_0523: bool) -> _ts.Check:
    """27391 (or 0.5.23's estimate with ``e' <= e``) never admits what the pre-fix budget refused."""
    names = ("P", "W", "rem_chunk", "e", "e_after", "m", "h")

    def parts() -> tuple[tuple[z3.ArithRef, ...], z3.ArithRef, z3.ArithRef]:
        P, W, rc, e, ea, m, h = (z3.Int(n) for n in names)
        pre = swa_budget_term(e, 0, W, P, rc, True)
        new = (estimate_swa_kv_tokens_term(ceil_p_term(ea, P), m, W, P, rc, True, h) if upstream_0523
               else swa_budget_term(e, h, W, P, rc, True))
        return (P, W, rc, e, ea, m, h), pre, new

    def build() -> list[z3.BoolRef]:
        (P, W, rc, e, ea, m, h), pre, new = parts()
        claim = z3.And(new >= pre, z3.Implies(h == 0, new == pre)) if not upstream_0523 else new >= pre
        return [P >= 1, W >= 1, rc >= P, e >= 1, ea >= 1, ea <= e, m >= 0, h >= 0, z3.Not(claim)]

    def render(m: z3.ModelRef) -> str:
        xs, pre, new = parts()
        v = {n: as_int(m, x) for n, x in zip(names, xs, strict=True)}
        return (f"page size P={v['P']}, window W={v['W']}, rem_chunk={v['rem_chunk']}, e={v['e']} (e'="
                f"{v['e_after']}), m={v['m']}, host hit h={v['h']}: pre-#27391 budget {as_int(m, pre)} > "
                f"{'0.5.23 needed' if upstream_0523 else '#27391 budget'} {as_int(m, new)}: a pool with rem_swa_tokens "
                f"in ({as_int(m, new)}, {as_int(m, pre)}] admits what the pre-fix code refused")

    return _ts.Check(build, render)


def _admission_monotone(policy: Policy, *, small: bool = False, drop: str | None = None) -> _ts.Check:
    """Same state, request 2 no bigger than request 1 (``e``, ``e'``, ``h``, load-back); 1 passes => 2 passes.

    ``drop`` (a twin): request 2 is not required to be no bigger in that quantity (``e`` or ``h``)."""

    def parts() -> tuple[State, Action, Action, Decision, Decision]:
        s, a1, a2 = State.fresh("pre"), Action.fresh("big"), Action.fresh("small")
        return s, a1, a2, decide(policy, s, a1)[0], decide(policy, s, a2)[0]

    def build() -> list[z3.BoolRef]:
        s, a1, a2, d1, d2 = parts()
        smaller = [a2.e <= a1.e, d2.e_after <= d1.e_after, a2.h_snap <= a1.h_snap, a2.lb_cap <= a1.lb_cap,
                   a2.lb_whole <= a1.lb_whole, a2.m == a1.m, a2.own == a1.own]
        if drop == "e":
            smaller = smaller[2:]
        elif drop == "h":
            smaller = [c for i, c in enumerate(smaller) if i != 2]
        narrow = [*_small(s, a1), *_small(s, a2), s.chunking] if small else []
        # any state (the checks read room, offset and rem_chunk only): no invariant needed
        return [*constants(s), s.room >= 0, s.offset >= 0, s.open, *a1.walk_facts(s), *a2.walk_facts(s), *smaller,
                *narrow, d1.passes, z3.Not(d2.passes)]

    def render(m: z3.ModelRef) -> str:
        s, a1, a2, d1, d2 = parts()
        p = as_int(m, s.P)

        def req(a: Action, d: Decision) -> str:
            return (f"e={as_int(m, a.e)} (e'={as_int(m, d.e_after)}) m={as_int(m, a.m)} h="
                    f"{as_int(m, a.h_snap) * p}: needed {as_int(m, d.budget)}")

        why = "(a never-fits chunk cap)" if drop is None else f"(request 2 is not smaller in {drop})"
        return (f"{policy.value}: page size P={p}, window W={as_int(m, s.W)}, rem_chunk {as_int(m, s.rem_chunk)}, "
                f"SWA pool T={as_int(m, s.T)} pages, rem_swa_tokens {as_int(m, d1.rem_in)} (size_swa "
                f"{as_int(m, s.T) * p}): request 1 {req(a1, d1)} is admitted {why}, request 2 {req(a2, d2)} waits")

    return _ts.Check(build, render)


# ---- A3: the load-back trigger and the Full host hit ----------------------------------------------------


def _a3_trigger(host_hit_only: bool) -> _ts.Check:
    host, swa, mamba = z3.Ints("host_hit_length swa_host_hit_length mamba_host_hit_length")

    def build() -> list[z3.BoolRef]:
        trigger = host > 0 if host_hit_only else z3.Or(host > 0, swa > 0, mamba > 0)
        any_hit = z3.Or(host > 0, swa > 0, mamba > 0)
        return [host >= 0, swa >= 0, mamba >= 0, trigger != any_hit]

    def render(m: z3.ModelRef) -> str:
        return (f"host_hit_length={as_int(m, host)} swa_host_hit_length={as_int(m, swa)} mamba_host_hit_length="
                f"{as_int(m, mamba)}: a host hit that needs_host_load_back does not see (no load-back; the window's "
                f"SWA is never restored)")

    return _ts.Check(build, render)


def _a3_full_only(pre_flag: bool) -> _ts.Check:
    full_host, swa_host = z3.Ints("full_host_tokens swa_host_hit_length")

    def reported() -> z3.ArithRef:
        return z3.If(swa_host > 0, zmax(full_host, 1), full_host) if pre_flag else full_host

    def build() -> list[z3.BoolRef]:
        return [full_host >= 0, swa_host >= 0, reported() != full_host]

    def render(m: z3.ModelRef) -> str:
        return (f"Full KV on host {as_int(m, full_host)} tokens, SWA host tombstones {as_int(m, swa_host)} tokens in "
                f"the window: host_hit_length reported {as_int(m, reported())} (the pre-#27391 flag pollutes the Full "
                f"host-hit arithmetic)")

    return _ts.Check(build, render)


# ---- the round invariant ---------------------------------------------------------------------------


def _round_consecution(sys: _ts.TransitionSystem[State, Action], ops: Sequence[str],
                       assume_fresh: bool = False, *, admitted_only: bool = False) -> _ts.Check:
    """Consecution of the round invariant; ``assume_fresh``: add_one_req's match-time value is fresh;
    ``admitted_only`` (a twin's search): no ``OTHER`` verdict, nothing of its own window on device."""

    def build() -> list[z3.BoolRef]:
        step = _ts.Step.fresh(sys)
        fresh = [z3.Implies(step.is_("add_one_req"), step.action.fresh_match())] if assume_fresh else []
        narrow = [step.action.result != OTHER, step.action.own == 0] if admitted_only else []
        return [sys.holds(step.pre), *fresh, *narrow, step.relation(ops), z3.Not(sys.holds(step.post))]

    def render(m: z3.ModelRef) -> str:
        step = _ts.Step.fresh(sys)
        return _ts.step_table(sys, m, step, f"broken after step 1: {_ts.first_broken(sys, m, step.post)}")

    return _ts.Check(build, render)


def _reopens_with_pending(s: State, a: Action, t: State) -> z3.BoolRef:
    """Twin: a round opened over chunks still pending (no ``not open`` guard, pending kept, reservation reset)."""
    return z3.And(t.open, t.offset == 0, t.rem_chunk == s.C, z3.Not(t.chunked),
                  *_frame(s, t, "open", "offset", "rem_chunk", "chunked"))


def _chunk_not_held(s: State, a: Action, t: State) -> z3.BoolRef:
    """Twin: the batch's pages leave ``room`` but are not counted as held (a leak)."""
    return z3.And(s.open, s.pending <= s.room, t.room == s.room - s.pending, t.pending == 0, z3.Not(t.open),
                  t.offset == 0, t.rem_chunk == s.C, z3.Not(t.chunked),
                  *_frame(s, t, "room", "pending", "open", "offset", "rem_chunk", "chunked"))


def _evicts_locked(s: State, a: Action, t: State) -> z3.BoolRef:
    """Twin: eviction takes ``n`` pages of locked nodes (no ``lock_ref`` check)."""
    return z3.And(a.n >= 0, t.room == s.room + a.n, t.locked == s.locked - a.n, *_frame(s, t, "room", "locked"))


def _double_free(s: State, a: Action, t: State) -> z3.BoolRef:
    """Twin: a completion that returns more chunk pages than requests hold (no ``freed <= held``)."""
    return z3.And(a.freed >= 0, a.back >= 0, a.back <= s.locked, t.room == s.room + a.freed + a.back,
                  t.held == s.held - a.freed, t.locked == s.locked - a.back, *_frame(s, t, "room", "held", "locked"))


def _double_count(s: State, a: Action, t: State) -> z3.BoolRef:
    """Twin: ``cache_unfinished_req`` returns the out-of-window pages to the free list but still counts them held."""
    return z3.And(z3.Not(s.open), a.freed >= 0, a.freed <= s.held, t.room == s.room + a.freed, *_frame(s, t, "room"))


def _with_transition(op: str, transition: Callable[[State, Action, State], z3.BoolRef]
                     ) -> _ts.TransitionSystem[State, Action]:
    return dataclasses.replace(SYSTEM, transitions={**SYSTEM.transitions, op: transition})


def _init_leftover(s: State) -> z3.BoolRef:
    """Twin: an initial state whose round is open with chunks left pending from before (no reservation)."""
    return z3.And(*constants(s), s.room >= 0, s.held >= 0, s.room + s.held == s.T, s.locked == 0, s.open,
                  s.offset == 0, s.rem_chunk == s.C, s.pending >= 1, z3.Not(s.chunked))


# ---- registry ---------------------------------------------------------------------------------------


def _obligations() -> tuple[Obligation, ...]:
    def ob(suffix: str, statement: str, check: _ts.Check, twin_of: str | None = None) -> Obligation:
        return _ts.obligation(SYSTEM, suffix, statement, check, family=FAMILY, twin_of=twin_of)

    def narrowed(check: _ts.Check, narrow: Callable[[State, Action], list[z3.BoolRef]]) -> _ts.Check:
        return check.also(lambda: narrow(State.fresh("pre"), Action.fresh("step")))

    ops_but_load = [op for op in SYSTEM.ops if op != "init_load_back"]
    pre, up, up523, cor = Policy.PRE_27391, Policy.UPSTREAM_27391, Policy.UPSTREAM_0523, Policy.CORRECTED
    a1 = "after admission the load-back fits in room - own and every pending chunk (its own included) fits in the " \
         "room left"
    return (
        # A1
        ob("add_one_req.a1_corrected", f"corrected, any match-time value: {a1}", _a1(cor, fresh=False)),
        ob("add_one_req.a1_corrected.no_lock_recheck",
           "corrected without the check inside the tree lock counts the request's own window as evictable",
           _a1(cor, fresh=False, variant=Variant(recheck=False)), "add_one_req.a1_corrected"),
        ob("add_one_req.a1_corrected.uncapped_load_back",
           "corrected's window-capped budget with upstream's whole-node load-back runs out",
           _a1(cor, fresh=False, variant=Variant(capped_load=False)), "add_one_req.a1_corrected"),
        ob("add_one_req.a1_corrected.snapshot_reused",
           "corrected's budget from the match-time value (capped at one window) instead of the tree at the lock "
           "runs out when the value is stale",
           _a1(cor, fresh=False, variant=Variant(snapshot=True)), "add_one_req.a1_corrected"),
        ob("add_one_req.a1_upstream_27391",
           f"upstream_27391, the match-time swa_host_hit_length equal to what load-back restores: {a1}",
           _a1(up, fresh=True)),
        ob("add_one_req.a1_upstream_27391.pre_27391",
           "the pre-#27391 budget max(min(e, C), W) + P (no host term) admits a request whose load-back and chunk "
           "do not fit (S8's shape; search narrowed to small numbers, the request first in its round)",
           narrowed(_a1(pre, fresh=True), _small_idle), "add_one_req.a1_upstream_27391"),
        ob("add_one_req.a1_upstream_27391.pre_27391_s8",
           "S8: P=64, W=128, chunk 512, 10 free pages, prompt 2000 with 1024 Full tokens on host and a 192-token host "
           "tombstone: budget 576 < 640 admits, load-back takes 3 pages, the 512-token chunk needs 8 of 7",
           narrowed(_a1(pre, fresh=True), _s8), "add_one_req.a1_upstream_27391"),
        ob("add_one_req.a1_upstream_27391.stale_match",
           "upstream_27391 with a match-time value below what load-back restores now (§5.7) runs out",
           narrowed(_a1(up, fresh=False), _small), "add_one_req.a1_upstream_27391"),
        ob("add_one_req.a1_upstream_27391_minimal",
           "finding: upstream_27391 keeps A1 with `budget > rem_swa_tokens -> NO_TOKEN` (the `>=` turned into `>`) and "
           "without the budget's + P page: the pool is page-granular, so (room - pending) * P - h >= e' already gives "
           "ceil_P(e'); what A1 needs is the host term",
           _a1(up, fresh=True, variant=Variant(strict=False, page_overhead=False))),
        ob("add_one_req.a1_upstream_27391_minimal.no_host_term",
           "the same minimal check without the host term (pre_27391's budget) runs out",
           narrowed(_a1(pre, fresh=True, variant=Variant(strict=False, page_overhead=False)), _small_idle),
           "add_one_req.a1_upstream_27391_minimal"),
        ob("add_one_req.a1_upstream_0523",
           f"upstream_0523 (SWAPrefillBudget, the never-fits chunk cap included), fresh match-time value: {a1}",
           _a1(up523, fresh=True)),
        ob("add_one_req.a1_upstream_0523.stale_match",
           "upstream_0523 with a stale match-time value runs out",
           narrowed(_a1(up523, fresh=False), _small), "add_one_req.a1_upstream_0523"),
        # the round
        ob("round.initiation", "the initial pool (no round, all device SWA evictable) satisfies the round invariant",
           _ts.initiation(SYSTEM)),
        ob("round.initiation.leftover_pending",
           "a round that starts with chunks pending from before and nothing reserved breaks A1's round clause",
           _ts.initiation(dataclasses.replace(SYSTEM, init=_init_leftover)), "round.initiation"),
        ob("round.consecution",
           "corrected: every op but a standalone init_load_back keeps accounting and A1's round clause",
           _round_consecution(SYSTEM, ops_but_load)),
        ob("round.consecution.init_load_back",
           "a load-back outside add_one_req (SWA consumed between the check and the allocation) breaks A1's round "
           "clause", _round_consecution(SYSTEM, ["init_load_back"]), "round.consecution"),
        ob("round.consecution.upstream_27391_stale",
           "upstream_27391's add_one_req with a stale match-time value breaks A1's round clause",
           _round_consecution(SYSTEMS_BY_POLICY[up], ["add_one_req"], admitted_only=True), "round.consecution"),
        ob("round.consecution_upstream_27391",
           "upstream_27391: every op but a standalone init_load_back keeps the round invariant when add_one_req's "
           "match-time value is fresh", _round_consecution(SYSTEMS_BY_POLICY[up], ops_but_load, assume_fresh=True)),
        ob("round.consecution_upstream_27391.pre_27391",
           "pre_27391's add_one_req breaks A1's round clause",
           _round_consecution(SYSTEMS_BY_POLICY[pre], ["add_one_req"], assume_fresh=True, admitted_only=True),
           "round.consecution_upstream_27391"),
        # the round invariant, one operation at a time (each op's own obligation: ``kvproof prove -k <op>``)
        ob("get_new_batch_prefill.keeps_round_invariant",
           "a round opens only after the last one closed: accounting and A1's round clause are kept",
           _round_consecution(SYSTEM, ["get_new_batch_prefill"])),
        ob("get_new_batch_prefill.keeps_round_invariant.reopens_with_pending",
           "a round opened over chunks still pending, with its reservation reset, breaks A1's round clause",
           _round_consecution(_with_transition("get_new_batch_prefill", _reopens_with_pending),
                              ["get_new_batch_prefill"]), "get_new_batch_prefill.keeps_round_invariant"),
        ob("prepare_for_extend.keeps_round_invariant",
           "the round's batch moves its pending chunks from room to held and closes the round: the invariant is kept",
           _round_consecution(SYSTEM, ["prepare_for_extend"])),
        ob("prepare_for_extend.keeps_round_invariant.chunk_not_held",
           "a batch whose chunk pages leave room without being counted as held breaks accounting (a leak)",
           _round_consecution(_with_transition("prepare_for_extend", _chunk_not_held), ["prepare_for_extend"]),
           "prepare_for_extend.keeps_round_invariant"),
        ob("evict.keeps_round_invariant",
           "eviction only tombstones evictable pages, which stay in room (free + evictable): the invariant is kept",
           _round_consecution(SYSTEM, ["evict"])),
        ob("evict.keeps_round_invariant.evicts_locked",
           "an eviction that takes pages of locked nodes (no lock_ref check) drives the locked count below zero",
           _round_consecution(_with_transition("evict", _evicts_locked), ["evict"]), "evict.keeps_round_invariant"),
        ob("cache_finished_req.keeps_round_invariant",
           "completion returns the chunk's pages to room and the window lock's pages to evictable: the invariant is "
           "kept", _round_consecution(SYSTEM, ["cache_finished_req"])),
        ob("cache_finished_req.keeps_round_invariant.double_free",
           "a completion that returns more chunk pages than requests hold (a double free) breaks the counts",
           _round_consecution(_with_transition("cache_finished_req", _double_free), ["cache_finished_req"]),
           "cache_finished_req.keeps_round_invariant"),
        # chunked prefill: the continuation (§5.3, last paragraph) and the release
        ob("add_chunked_req.keeps_round_invariant",
           "corrected (pre_27391 and upstream_27391 reserve alike): a continuation, added or deferred, keeps "
           "accounting and A1's round clause", _round_consecution(SYSTEM, ["add_chunked_req"])),
        ob("add_chunked_req.keeps_round_invariant.no_reservation",
           "a continuation whose chunk is not reserved (0.5.23 skips it for a ring continuation: "
           "is_chunked_continuation on a pool without rings) breaks A1's round clause",
           _round_consecution(_with_transition("add_chunked_req", functools.partial(add_chunked_req, reserved=False)),
                              ["add_chunked_req"]), "add_chunked_req.keeps_round_invariant"),
        ob("add_chunked_req.keeps_round_invariant.no_swa_cap",
           "a continuation capped by rem_chunk_tokens alone (no SWA term) breaks A1's round clause",
           _round_consecution(_with_transition("add_chunked_req", functools.partial(add_chunked_req, swa_cap=False)),
                              ["add_chunked_req"]), "add_chunked_req.keeps_round_invariant"),
        ob("add_chunked_req.keeps_round_invariant_upstream_0523",
           "upstream_0523 (the reservation reads max_new_tokens for the last chunk): a continuation keeps the round "
           "invariant", _round_consecution(SYSTEMS_BY_POLICY[up523], ["add_chunked_req"])),
        ob("add_chunked_req.keeps_round_invariant_upstream_0523.limit_after_decrement",
           "upstream_0523 reserving with rem_chunk_tokens after its decrement as the allocation limit (the tail "
           "max(min(e, L) - W, 0) then shrinks) breaks A1's round clause (search narrowed to small numbers)",
           narrowed(_round_consecution(SYSTEMS_BY_POLICY[up523].with_transitions(add_chunked_req=functools.partial(
               add_chunked_req, policy=up523, limit_after_decrement=True)), ["add_chunked_req"]),
               lambda s, a: [*_small(s, a), a.done <= 40]),
           "add_chunked_req.keeps_round_invariant_upstream_0523"),
        ob("add_chunked_req.a1",
           "an added continuation's chunk fits the room the round's pending chunks leave, with a page to spare "
           "(avail = min(rem_chunk, rem_swa_tokens - P); #23174)", _a1_chunk(spare=1)),
        ob("add_chunked_req.a1.no_page_left",
           "avail = min(rem_chunk, rem_swa_tokens) (no - P) lets the round's chunks take the last page",
           _a1_chunk(spare=1, page_left=False), "add_chunked_req.a1"),
        ob("add_chunked_req.a1_minimal",
           "finding: without the - P the continuation's chunk still fits (pending + pages <= room): the pool is "
           "page-granular and the reservations cover the pending pages; the - P only leaves the page",
           _a1_chunk(spare=0, page_left=False)),
        ob("add_chunked_req.a1_minimal.no_swa_cap",
           "a continuation capped by rem_chunk_tokens alone runs out of SWA at prepare_for_extend",
           _a1_chunk(spare=0, swa_cap=False), "add_chunked_req.a1_minimal"),
        ob("cache_unfinished_req.keeps_round_invariant",
           "between rounds, the release returns held pages to room: the invariant is kept",
           _round_consecution(SYSTEM, ["cache_unfinished_req"])),
        ob("cache_unfinished_req.keeps_round_invariant.double_count",
           "a release that returns the pages to the free list but keeps counting them held breaks accounting",
           _round_consecution(_with_transition("cache_unfinished_req", _double_count), ["cache_unfinished_req"]),
           "cache_unfinished_req.keeps_round_invariant"),
        ob("cache_unfinished_req.frees_out_of_window_only",
           "max(0, floor((done - W) / P)) pages freed in all: each wholly below done - W, none twice, at most "
           "W + P - 1 own tokens kept", _out_of_window()),
        ob("cache_unfinished_req.frees_out_of_window_only.in_window_page",
           "ceil((done - W) / P) frees a page the window still reaches", _out_of_window(in_window_page=True),
           "cache_unfinished_req.frees_out_of_window_only"),
        ob("prepare_for_extend.continuation_pages_exact",
           "a continuing chunk takes ceil((done + e)/P) - ceil(done/P) pages: with the pages its own tokens span, "
           "they hold every token and no empty page", _continuation_pages()),
        ob("prepare_for_extend.continuation_pages_exact.whole_new_pages",
           "ceil(e/P) new pages (the partly filled last page ignored) leave a page empty",
           _continuation_pages(whole_new_pages=True), "prepare_for_extend.continuation_pages_exact"),
        # liveness
        ob("add_one_req.live_idle_pool",
           "corrected: in an idle round a request that fits the empty pool (max(min(e', C), W) + P + ceil_P(W) < "
           "(T - own) * P) is admitted in its first round", _live(cor)),
        ob("add_one_req.live_idle_pool.upstream_27391",
           "upstream_27391 refuses forever a request that fits the empty idle pool (whole host tombstones in the "
           "budget, S9; search narrowed to no Full host hit)", _live(up, lambda s, a: [a.host_full == 0]),
           "add_one_req.live_idle_pool"),
        ob("add_one_req.live_idle_pool.upstream_27391_s9",
           "S9: P=64, W=128, a 4096-token host tombstone, a 2048-token pool: budget >= 4288 > 2048, every round",
           _live(up, _s9), "add_one_req.live_idle_pool"),
        ob("add_one_req.live_idle_pool.upstream_0523",
           "upstream_0523 refuses forever a request that fits the empty idle pool (needed >= size_swa and the chunk "
           "cap has no room for the whole tombstone; search narrowed to no Full host hit)",
           _live(up523, lambda s, a: [a.host_full == 0]), "add_one_req.live_idle_pool"),
        ob("add_one_req.live_idle_pool.pre_27391",
           "pre_27391 (budget from e, the Full host hit included) refuses forever a request that fits once its Full "
           "host hit is loaded", _live(pre), "add_one_req.live_idle_pool"),
        # A2
        ob("swa_budget_for_req.a2_monotone",
           "A2: swa_budget_for_req(e, h) is non-decreasing in e and in h (chunked prefill on)",
           _monotone_check(_sound_budget)),
        ob("swa_budget_for_req.a2_monotone.host_hit_in_chunk",
           "a budget that counts the loaded tokens against the chunk (min(e, rem_chunk - h)) decreases with h",
           _monotone_check(_host_hit_in_chunk), "swa_budget_for_req.a2_monotone"),
        ob("swa_budget_for_req.a2_stricter",
           "A2: the #27391 budget is >= the pre-fix budget and equal to it at h = 0 (the fix only makes admission "
           "stricter)", _stricter_check(False)),
        ob("swa_budget_for_req.a2_stricter.upstream_0523",
           "0.5.23's needed (e' without the Full host hit, headroom min(e + m, W)) is below the pre-fix budget for "
           "some requests: it admits what the pre-fix code refused", _stricter_check(True),
           "swa_budget_for_req.a2_stricter"),
        ob("add_one_req.a2_monotone",
           "A2: corrected admission is monotone: in the same state, if a request passes the checks, a request no "
           "bigger (e, e', host hit, load-back) passes them", _admission_monotone(cor)),
        ob("add_one_req.a2_monotone_upstream_27391", "A2: upstream_27391 admission is monotone",
           _admission_monotone(up)),
        ob("add_one_req.a2_monotone_upstream_27391.bigger_host_hit",
           "upstream_27391: a request with a smaller extend but a bigger match-time host hit can be refused where the "
           "other is admitted (monotone only in both)", _admission_monotone(up, drop="h"),
           "add_one_req.a2_monotone_upstream_27391"),
        ob("add_one_req.a2_monotone_pre_27391", "A2: pre_27391 admission is monotone", _admission_monotone(pre)),
        ob("add_one_req.a2_monotone_pre_27391.bigger_extend",
           "pre_27391: a request with a bigger extend (the Full host hit included) can be refused where a smaller one "
           "is admitted", _admission_monotone(pre, drop="e"), "add_one_req.a2_monotone_pre_27391"),
        ob("add_one_req.a2_monotone.upstream_0523",
           "0.5.23's never-fits chunk cap admits a bigger request while a smaller one waits on a transient shortage",
           _admission_monotone(up523, small=True), "add_one_req.a2_monotone"),
        # A3
        ob("add_one_req.a3_load_back_trigger",
           "A3: needs_host_load_back is false iff the Full, SWA and Mamba host hits are all 0 (a pure SWA host hit "
           "triggers load-back)", _a3_trigger(False)),
        ob("add_one_req.a3_load_back_trigger.host_hit_only",
           "a trigger on host_hit_length alone (the pre-split field without the flag) misses a pure SWA host hit",
           _a3_trigger(True), "add_one_req.a3_load_back_trigger"),
        ob("match_prefix_for_req.a3_host_hit_is_full_only",
           "A3: host_hit_length counts only Full KV tokens on host", _a3_full_only(False)),
        ob("match_prefix_for_req.a3_host_hit_is_full_only.pre_27391_flag",
           "the pre-#27391 match sets host_hit_length = max(host_hit_length, 1) for an SWA host tombstone",
           _a3_full_only(True), "match_prefix_for_req.a3_host_hit_is_full_only"),
    )


OBLIGATIONS: tuple[Obligation, ...] = _obligations()
