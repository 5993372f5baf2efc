"""``decode_prealloc``: the PD decode node's preallocation, D1 and D3 (sglang_semantics.md §2, §7 D1-D3, §9 S2).

Obligations are named ``decode_prealloc.<op>.<claim>`` after the reference operation they
are about (``arrive``, ``pop_preallocated``, ``decode``, ``retract``,
``resume_retracted_reqs``), or ``decode_prealloc.accounting.<claim>`` for the whole-state
invariant; a broken twin appends what it breaks.

**The transition system** (:data:`SYSTEM`, built with :mod:`kvproof.spec._ts`): a node of
:data:`N_SLOTS` request slots numbered by arrival (status, request, SWA eviction mark
``m * P``, full and SWA pages held, retraction stamp), both pools' free pages and a crash
flag, with one relation per reference operation, named like it (:func:`arrive`,
:func:`pop_preallocated`, :func:`decode`, :func:`retract`, :func:`resume_retracted_reqs`).
The rounds (:func:`round_of`) admit in queue order against the budgets of §2.4 with the
gates of §2.5, take ``ceil(A/P)`` full and ``ceil(tail/P)`` SWA pages (§2.6, §2.7) and
crash on a short pool (D1 violated); ``decode`` opens pages, evicts the window (§1.6) and
releases finished requests. ``tests/spec/test_drift_decode_prealloc.py`` checks that each
transition accepts the steps of seeded reference runs. Over it:

* ``accounting.initiation`` and ``<op>.keeps_accounting`` for every op: the invariant
  :func:`invariant_clauses` (free + held pages == pool size in each pool, a running request
  holds ``ceil(L/P)`` full and ``ceil(L/P) - m`` SWA pages, only running requests hold pages,
  the mark below ``max(0, L - W)``, valid requests, distinct stamps) is inductive. Twins:
  page 0 counted free; an ``arrive`` without the new-rid check; the PR-era mark left at 0
  on admission and resume (R6, before #28085); upstream's non-atomic ``alloc_decode``
  (R7); a ``retract`` that frees SWA pages by length. ``decode.ceil_step`` is the lemma
  whose instances ``decode.keeps_accounting`` uses (twin: the opening rule read at the new
  length);
* ``pop_preallocated.d1_no_crash`` / ``resume_retracted_reqs.d1_no_crash``: D1 over the
  transitions, ``CORRECTED`` rounds of two admissions never crash; twins ``.upstream``:
  ``UPSTREAM`` rounds that do (a step table).

**The arithmetic** (symbolic integers, tail mode ``P >= 2``): the requirements of
``prealloc_required_tokens`` (unrounded under ``UPSTREAM``, page-rounded under
``CORRECTED``, §2.3, R4), the budgets of ``allocatable_token_budgets`` (§2.4:
``reserved = R * n_active``, the "can finish" term ``need``, which the resume budgets leave
out as SGLang's ``resume_retracted_reqs`` does (model gap M1 in docs/sglang-findings.md), the
SWA growth cap ``min(reserved, max(0, n_active * W - swa_used))``, the retracted queue), the gates
(§2.5), the pages ``_pre_alloc`` takes, the eviction mark of ``_evict_swa`` and the resume
tail. ``tests/spec/test_decode_prealloc.py`` evaluates these builders on concrete integers
against the reference. Pools are page-granular (``F`` free pages hold ``F * P`` tokens);
the running batch enters the budgets only through its aggregate (:class:`Batch`), which
the step lemmas leave symbolic (any integers), so they hold for every running batch and
retracted queue, and ``extra`` (other active requests) is any count ``>= 0``.

D1 (admitted => ``_pre_alloc`` succeeds, §7), under ``pop_preallocated``:

* ``d1_fresh_budget_within_free``: a budget computed from the pools never exceeds the
  free tokens of its pool (every reservation term is ``>= 0``);
* ``d1_corrected_step``: under ``CORRECTED``, for any pool state, aggregate, ``R``, ``W``,
  ``P`` and request, passing the gates (``pop_preallocated``'s, with the can-finish
  clauses, or ``resume_retracted_reqs``'s, whose budgets keep no can-finish room: M1) against
  budgets computed from that pool state implies ``ceil(A/P) <= free full pages`` and
  ``ceil(tail/P) <= free SWA pages``.
  ``CORRECTED`` recomputes both budgets after every admission (``_refresh``), so the
  one-step lemma covers rounds of any length; ``d1_corrected_round`` checks an explicit
  two-admission round anyway;
* ``d1_unrounded_recomputed`` (finding): the page rounding is not what makes ``CORRECTED``
  sound: ``A + R <= budget <= F * P`` already implies ``ceil(A/P) <= F`` on a
  page-granular pool (twin: a token-granular free count);
* ``d1_rounded_decremented_step`` (finding): nor is the recomputation: a budget
  ``b <= F * P`` decremented by the *page-rounded* requirement stays ``<= F' * P`` after
  the allocation, so every admission of a round passes (the SWA budget of
  ``pop_preallocated``, both budgets of ``resume_retracted_reqs``);
* ``d1_upstream_reserve_covers_rounding`` (finding): even ``UPSTREAM``'s unrounded
  decrement keeps ``b <= F * P`` when ``R >= P - 1`` (the decrement covers the
  ``ceil_P(n) - n <= P - 1`` drift); S2 needs ``R = 0``; SGLang's default ``R = 512``
  covers every page size up to 513;
* ``d1_upstream_round`` / ``d1_s2_vector``: an ``UPSTREAM`` round (empty running batch,
  two queued requests, S2-sized search) whose second request passes its gate with the
  decremented SWA budget and finds too few SWA pages; and S2's exact numbers (P=64, W=128,
  R=0, two 200-token prompts, 5 free SWA pages).

D3 (residency, §1.6, §2.8, §7):

* ``decode.d3_residency``: after ``_evict_swa`` at length ``L`` (mark
  ``floor_P(max(e, L - 1 - W - P))`` from a page-aligned ``e <= max(0, L - 1 - W)``, the
  invariant this obligation re-establishes; the prealloc tail starts at
  ``A - swa_tail_len(A)``), the SWA-resident positions ``[max(tail start, mark), L)`` lie
  in ``[floor_P(max(0, L - 1 - W - P)), L)`` (at most ``W + 2P`` of them) and contain the
  window ``[L - W, L)``;
* ``resume_retracted_reqs.d3_resume_within_saved``: the tail a request of ``L`` KV
  positions gets on resume, ``[floor_P(max(0, L - W)), L)``, lies within the positions
  still SWA-resident at its retraction (right after prealloc or after an eviction at
  ``L``) and contains the window, so ``load_cpu_copy`` restores every in-window row
  (``New ⊆ Old``, §2.8). ``L`` counts KV positions (the reference's ``len(slots)``);
  §2.8's ``floor_P(L - 1 - W)`` writes the same start with ``L = seqlen``. The findings
  ``d3_resume_no_margin_floor`` and ``d3_resume_margin_ceil`` (with its lemma
  ``page_index_order``) say which of floor and margin the eviction needs.

The per-request SWA saving of tail preallocation (``ceil(tail/P)`` pages against
``ceil(L/P)`` before) is ``swa_tail.saving`` of component ``swa_allocator``.

Queries are quantifier-free linear-plus-products Int arithmetic; every page-aligned
value is a product ``k * P`` with an explicit witness ``k`` (see
``terms.part2_pages_term``).
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
    decode_opens_page_term,
    floor_p_term,
    lift,
    swa_tail_term,
    zmax,
    zmin,
)

__all__ = [
    "ABSENT",
    "FINISHED",
    "N_SLOTS",
    "OBLIGATIONS",
    "QUEUED",
    "RETRACTED",
    "RUNNING",
    "S2",
    "STATUS",
    "SYSTEM",
    "Action",
    "Batch",
    "Budgets",
    "Gate",
    "Knobs",
    "Policy",
    "Pools",
    "Req",
    "RoundTerms",
    "RoundVars",
    "Slot",
    "State",
    "admission_gate_terms",
    "arrive",
    "batch_of",
    "batch_terms",
    "budgets_terms",
    "ceil_step",
    "cells",
    "clipped_term",
    "columns",
    "d1_hypotheses",
    "decode",
    "describe",
    "evict_mark_term",
    "fill_len_term",
    "init",
    "invariant_clauses",
    "pop_preallocated",
    "prealloc_kv_lens_terms",
    "prealloc_pages_terms",
    "required_tokens_terms",
    "resident_low_term",
    "resume_gate_terms",
    "resume_retracted_reqs",
    "resume_tail_start_term",
    "retract",
    "round_of",
    "round_values",
    "swa_retractable_len_term",
    "system",
    "tail_mark_term",
]

COMPONENT = "decode_prealloc"
FAMILY = "decode_prealloc"


class Policy(enum.StrEnum):
    """The reference's ``PreallocPolicy`` (same values): rounding and budget refresh between admissions."""

    UPSTREAM = "upstream"  # unrounded requirements, SWA budget (resume: both) decremented
    CORRECTED = "corrected"  # page-rounded requirements, budgets recomputed from the pools


# ---- symbolic state ----------------------------------------------------------------------


@dataclass(frozen=True)
class Knobs:
    """Page size ``P``, window ``W``, reserved decode tokens ``R``, ``CLIP`` of max_new_tokens."""

    P: z3.ArithRef
    W: z3.ArithRef
    R: z3.ArithRef
    CLIP: z3.ArithRef

    @staticmethod
    def fresh() -> Knobs:
        return Knobs(*z3.Ints("P W R CLIP"))

    @staticmethod
    def of(P: int, W: int, R: int, CLIP: int) -> Knobs:
        return Knobs(z3.IntVal(P), z3.IntVal(W), z3.IntVal(R), z3.IntVal(CLIP))

    def hypotheses(self) -> list[z3.BoolRef]:
        """Tail mode needs paged pools (``uses_tail``: ``P > 1``)."""
        return [self.P >= 2, self.W >= 1, self.R >= 0, self.CLIP >= 1]


@dataclass(frozen=True)
class Req:
    """A queued (or retracted) request: prompt length, outputs so far, output limit."""

    orig: z3.ArithRef
    out: z3.ArithRef
    max_new: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> Req:
        return Req(z3.Int(f"orig{tag}"), z3.Int(f"out{tag}"), z3.Int(f"max_new{tag}"))

    @staticmethod
    def of(orig: int, out: int, max_new: int) -> Req:
        return Req(z3.IntVal(orig), z3.IntVal(out), z3.IntVal(max_new))

    def hypotheses(self) -> list[z3.BoolRef]:
        """``arrive``'s validation: the prefill produced the first token, something is left to decode."""
        return [self.orig >= 1, self.out >= 1, self.max_new > self.out]


@dataclass(frozen=True)
class Pools:
    """Free full pages, free SWA pages, SWA pages in use (``swa_used = used_swa * P``)."""

    free_full: z3.ArithRef
    free_swa: z3.ArithRef
    used_swa: z3.ArithRef

    @staticmethod
    def fresh(tag: str = "") -> Pools:
        return Pools(z3.Int(f"free_full{tag}"), z3.Int(f"free_swa{tag}"), z3.Int(f"used_swa{tag}"))

    def hypotheses(self) -> list[z3.BoolRef]:
        return [self.free_full >= 0, self.free_swa >= 0, self.used_swa >= 0]

    def after(self, full_pages: IntLike, swa_pages: IntLike) -> Pools:
        """The pools once an allocation took ``full_pages`` and ``swa_pages``."""
        return Pools(self.free_full - full_pages, self.free_swa - swa_pages, self.used_swa + swa_pages)


@dataclass(frozen=True)
class Batch:
    """What the budgets and gates read of the running batch and the retracted queue (§2.4, §2.5)."""

    n_running: z3.ArithRef
    retractable: z3.ArithRef  # sum of len(origin) + len(output) over running
    retractable_swa: z3.ArithRef  # sum of swa_retractable_len over running
    need: z3.ArithRef  # need_space_for_single_req(retractable)
    need_swa: z3.ArithRef  # the SWA override of need (default need)
    retracted_full: z3.ArithRef  # sum of prealloc_required_tokens(r).full over retracted
    retracted_swa: z3.ArithRef  # sum of prealloc_required_tokens(r).swa over retracted

    @staticmethod
    def fresh() -> Batch:
        return Batch(*z3.Ints("n_running retractable retractable_swa need need_swa retracted_full retracted_swa"))

    @staticmethod
    def empty() -> Batch:
        zero = z3.IntVal(0)
        return Batch(zero, zero, zero, zero, zero, zero, zero)

    def hypotheses(self) -> list[z3.BoolRef]:
        """Any aggregate: an empty batch reads as all zero; requirements are non-negative."""
        zero = z3.And(self.retractable == 0, self.retractable_swa == 0, self.need == 0, self.need_swa == 0)
        return [self.n_running >= 0, z3.Implies(self.n_running == 0, zero),
                self.retracted_full >= 0, self.retracted_swa >= 0]


@dataclass(frozen=True)
class Budgets:
    """``(full_allocatable_tokens, swa_allocatable_tokens)``."""

    full: z3.ArithRef
    swa: z3.ArithRef


@dataclass(frozen=True)
class Gate:
    """An admission decision and the numbers it compared."""

    admit: z3.BoolRef
    full_need: z3.ArithRef
    swa_need: z3.ArithRef
    full_required: z3.ArithRef
    swa_required: z3.ArithRef


# ---- term builders (mirror kvproof.reference.decode_prealloc, tail mode) --------------------


def fill_len_term(orig: IntLike, out: IntLike) -> z3.ArithRef:
    """``A = len(origin) + max(len(output) - 1, 0)``."""
    return lift(orig) + zmax(lift(out) - 1, 0)


def clipped_term(max_new: IntLike, clip: IntLike) -> z3.ArithRef:
    """``min(max_new_tokens, CLIP)``."""
    return zmin(max_new, clip)


def prealloc_kv_lens_terms(k: Knobs, req: Req) -> tuple[z3.ArithRef, z3.ArithRef]:
    """``(A, swa_tail_len(A))``."""
    a = fill_len_term(req.orig, req.out)
    return a, swa_tail_term(a, k.W, k.P)


def required_tokens_terms(k: Knobs, req: Req, *, rounded: bool) -> tuple[z3.ArithRef, z3.ArithRef]:
    """``prealloc_required_tokens``: ``(A + R, tail + R)``, page-rounded lengths when ``rounded``."""
    a, tail = prealloc_kv_lens_terms(k, req)
    if rounded:
        a, tail = ceil_p_term(a, k.P), ceil_p_term(tail, k.P)
    return a + k.R, tail + k.R


def swa_retractable_len_term(k: Knobs, req: Req) -> z3.ArithRef:
    """``swa_tail_len(len(origin)) + len(output)``."""
    return swa_tail_term(req.orig, k.W, k.P) + req.out


def batch_terms(k: Knobs, running: Sequence[Req], retracted: Sequence[Req], *, rounded: bool) -> Batch:
    """The aggregate of a concrete list of running and retracted requests (for the drift test)."""
    retractable = z3.Sum([r.orig + r.out for r in running]) if running else z3.IntVal(0)
    retractable_swa = z3.Sum([swa_retractable_len_term(k, r) for r in running]) if running else z3.IntVal(0)
    need: z3.ArithRef = z3.IntVal(0)
    need_swa: z3.ArithRef = z3.IntVal(0)
    if running:
        terms = [clipped_term(r.max_new, k.CLIP) + r.orig - retractable for r in running]
        swa_terms = [swa_tail_term(r.orig, k.W, k.P) + clipped_term(r.max_new, k.CLIP) - retractable_swa
                     for r in running]
        need, need_swa = terms[0], swa_terms[0]
        for t, s in zip(terms[1:], swa_terms[1:], strict=True):
            need, need_swa = zmax(need, t), zmax(need_swa, s)
    reqs = [required_tokens_terms(k, r, rounded=rounded) for r in retracted]
    ret_full = z3.Sum([f for f, _ in reqs]) if reqs else z3.IntVal(0)
    ret_swa = z3.Sum([s for _, s in reqs]) if reqs else z3.IntVal(0)
    return Batch(z3.IntVal(len(running)), retractable, retractable_swa, need, need_swa, ret_full, ret_swa)


def budgets_terms(k: Knobs, pools: Pools, batch: Batch, extra: IntLike, *, count_retracted: bool = True,
                  clamp_growth: bool = True, reserve_finish: bool = True) -> Budgets:
    """``allocatable_token_budgets`` (§2.4) with ``n_active = n_running + extra``.

    ``reserve_finish=False``: without the "can finish" room (``need``, ``need_swa`` taken as 0), the budgets of
    ``resume_retracted_reqs``, which passes SGLang's budget functions no retractable counts (model gap M1,
    docs/sglang-findings.md). ``clamp_growth=False`` is a broken twin: the SWA growth cap without ``max(0, .)``.
    """
    n_active = batch.n_running + lift(extra)
    reserved = k.R * n_active
    need, need_swa = (batch.need, batch.need_swa) if reserve_finish else (z3.IntVal(0), z3.IntVal(0))
    full = pools.free_full * k.P - zmax(reserved, need)
    growth = n_active * k.W - pools.used_swa * k.P
    if clamp_growth:
        growth = zmax(0, growth)
    swa = pools.free_swa * k.P - zmax(zmin(reserved, growth), need_swa)
    if count_retracted:
        full, swa = full - batch.retracted_full, swa - batch.retracted_swa
    return Budgets(full, swa)


def admission_gate_terms(k: Knobs, batch: Batch, budgets: Budgets, req: Req, *, rounded: bool,
                         swa_len_of: Callable[[Knobs, Req], z3.ArithRef] | None = None) -> Gate:
    """``admission_gate``: the full gate and the SWA gate, each with its can-finish clause.

    ``swa_len_of`` replaces the SWA length the gate uses (a broken twin sizes it from the prompt).
    """
    full_req, swa_req = required_tokens_terms(k, req, rounded=rounded)
    swa_len = prealloc_kv_lens_terms(k, req)[1]
    if swa_len_of is not None:
        swa_len = swa_len_of(k, req)
        swa_req = (ceil_p_term(swa_len, k.P) if rounded else swa_len) + k.R
    c = clipped_term(req.max_new, k.CLIP)
    full_need = zmax(full_req, req.orig + c - batch.retractable)
    swa_need = zmax(swa_req, swa_len + c - batch.retractable_swa)
    admit = z3.And(full_need <= budgets.full, swa_need <= budgets.swa)
    return Gate(admit, full_need, swa_need, full_req, swa_req)


def resume_gate_terms(k: Knobs, budgets: Budgets, req: Req, *, rounded: bool) -> Gate:
    """``resume_retracted_reqs``' gate: both requirements within both budgets (no can-finish clause)."""
    full_req, swa_req = required_tokens_terms(k, req, rounded=rounded)
    admit = z3.And(full_req <= budgets.full, swa_req <= budgets.swa)
    return Gate(admit, full_req, swa_req, full_req, swa_req)


def prealloc_pages_terms(k: Knobs, req: Req) -> tuple[z3.ArithRef, z3.ArithRef]:
    """Pages ``_pre_alloc`` takes (``alloc_extend_swa_tail``, prefix 0): ``ceil(A/P)`` full, ``ceil(tail/P)`` SWA."""
    a, tail = prealloc_kv_lens_terms(k, req)
    return ceil_div_term(a, k.P), ceil_div_term(tail, k.P)


def evict_mark_term(mark: IntLike, length: IntLike, W: IntLike, P: IntLike, *,
                    ceil: bool = False, margin: bool = True) -> z3.ArithRef:
    """``_evict_swa``'s new mark ``floor_P(max(e, L - 1 - W - P))`` (twins: ``ceil_P``, no ``- P``)."""
    x = zmax(mark, lift(length) - 1 - lift(W) - (lift(P) if margin else 0))
    return ceil_p_term(x, P) if ceil else floor_p_term(x, P)


def resident_low_term(length: IntLike, W: IntLike, P: IntLike) -> z3.ArithRef:
    """D3's lower bound of SWA residency, ``floor_P(max(0, L - 1 - W - P))`` (``check_node``)."""
    return floor_p_term(zmax(0, lift(length) - 1 - lift(W) - lift(P)), P)


def resume_tail_start_term(length: IntLike, W: IntLike, P: IntLike) -> z3.ArithRef:
    """First SWA position of a resumed request of ``L`` KV positions: ``L - swa_tail_len(L)``."""
    return lift(length) - swa_tail_term(length, W, P)


# ---- helpers for obligations -----------------------------------------------------------


def _facts(*groups: Sequence[z3.BoolRef] | z3.BoolRef) -> list[z3.BoolRef]:
    out: list[z3.BoolRef] = []
    for g in groups:
        out.extend([g] if isinstance(g, z3.BoolRef) else g)
    return out


def _knobs_text(m: z3.ModelRef, k: Knobs) -> str:
    return f"P={as_int(m, k.P)} W={as_int(m, k.W)} R={as_int(m, k.R)} CLIP={as_int(m, k.CLIP)}"


def _req_text(m: z3.ModelRef, k: Knobs, r: Req) -> str:
    a, tail = prealloc_kv_lens_terms(k, r)
    return (f"request orig={as_int(m, r.orig)} out={as_int(m, r.out)} max_new={as_int(m, r.max_new)} "
            f"(A={as_int(m, a)}, tail={as_int(m, tail)})")


def _batch_text(m: z3.ModelRef, b: Batch, extra: z3.ArithRef) -> str:
    return (f"running {as_int(m, b.n_running)} (retractable {as_int(m, b.retractable)}, "
            f"retractable_swa {as_int(m, b.retractable_swa)}, need {as_int(m, b.need)}, "
            f"need_swa {as_int(m, b.need_swa)}), extra active {as_int(m, extra)}, retracted requirements "
            f"full {as_int(m, b.retracted_full)} swa {as_int(m, b.retracted_swa)}")


_obligation = functools.partial(Obligation.of_component, COMPONENT)


# ---- D1: one admission against fresh budgets ------------------------------------------------


@dataclass(frozen=True)
class StepVars:
    """One admission: knobs, pools, aggregate, extra active requests, the request, pop or resume.

    ``running`` is empty for the proofs (the aggregate is then free); the twins' searches
    use two symbolic running requests and an empty retracted queue instead, so every
    counterexample is a batch the reference can hold.
    """

    k: Knobs
    pools: Pools
    batch: Batch
    extra: z3.ArithRef
    req: Req
    resume: z3.BoolRef
    running: tuple[Req, ...] = ()

    @staticmethod
    def fresh(*, shaped: int | None = None) -> StepVars:
        """``shaped=None``: a free aggregate; ``shaped=n``: ``n`` symbolic running requests, nothing retracted."""
        k = Knobs.fresh()
        running = tuple(Req.fresh(f"_run{i + 1}") for i in range(shaped or 0))
        batch = Batch.fresh() if shaped is None else batch_terms(k, running, (), rounded=True)
        return StepVars(k, Pools.fresh(), batch, z3.Int("extra"), Req.fresh(""), z3.Bool("resume"), running)

    def hypotheses(self) -> list[z3.BoolRef]:
        facts = _facts(self.k.hypotheses(), self.pools.hypotheses(), self.batch.hypotheses(), self.extra >= 0,
                       self.req.hypotheses())
        if self.running:
            # each running request holds between 1 and ceil(L/P) SWA pages, each other active request
            # (SGLang's transfer queue) at most its prealloc tail's ceil((W - 1)/P) + 1 (swa_tail.saving)
            held = [ceil_div_term(fill_len_term(r.orig, r.out), self.k.P) for r in self.running]
            tails = self.extra * (ceil_div_term(self.k.W - 1, self.k.P) + 1)
            facts += [f for r in self.running for f in r.hypotheses()]
            facts += [self.pools.used_swa >= len(self.running), self.pools.used_swa <= z3.Sum(held) + tails]
        return facts

    def small(self) -> list[z3.BoolRef]:
        """Bounds for the twins' counterexample search (any run found is a run of the model)."""
        k, pools = self.k, self.pools
        facts = [k.P <= 8, k.W <= 16, k.R <= 16, k.CLIP <= 64, self.extra <= 2,
                 pools.free_full <= 32, pools.free_swa <= 32, pools.used_swa <= 32]
        for r in (self.req, *self.running):
            facts += [r.orig <= 64, r.max_new <= 64]
        return facts


@dataclass(frozen=True)
class StepVariant:
    """What the gate and the budgets get wrong (all False: the reference)."""

    rounded: bool = True
    clamp_growth: bool = True
    token_pool: bool = False  # free counts in tokens (not pages): budgets from a non-page-aligned count
    swa_len_from_prompt: bool = False


def _step_parts(v: StepVars, variant: StepVariant) -> tuple[Budgets, Gate, z3.BoolRef, z3.BoolRef]:
    """Budgets, the gate that applies (pop or resume), and the two allocation outcomes."""
    k = v.k
    pop_b = budgets_terms(k, v.pools, v.batch, v.extra, count_retracted=True, clamp_growth=variant.clamp_growth)
    res_b = budgets_terms(k, v.pools, v.batch, v.extra, count_retracted=False, clamp_growth=variant.clamp_growth,
                          reserve_finish=False)
    if variant.token_pool:  # the free counts are tokens (any integers), read directly by the budgets
        pop_b = _token_budgets(k, v, count_retracted=True)
        res_b = _token_budgets(k, v, count_retracted=False)
    swa_len_of = (lambda kk, r: swa_tail_term(r.orig, kk.W, kk.P)) if variant.swa_len_from_prompt else None
    pop_g = admission_gate_terms(k, v.batch, pop_b, v.req, rounded=variant.rounded, swa_len_of=swa_len_of)
    res_g = resume_gate_terms(k, res_b, v.req, rounded=variant.rounded)
    budgets = Budgets(z3.If(v.resume, res_b.full, pop_b.full), z3.If(v.resume, res_b.swa, pop_b.swa))
    gate = Gate(z3.If(v.resume, res_g.admit, pop_g.admit), z3.If(v.resume, res_g.full_need, pop_g.full_need),
                z3.If(v.resume, res_g.swa_need, pop_g.swa_need), pop_g.full_required, pop_g.swa_required)
    full_pages, swa_pages = prealloc_pages_terms(k, v.req)
    if variant.token_pool:
        full_ok = full_pages * k.P <= v.pools.free_full
        swa_ok = swa_pages * k.P <= v.pools.free_swa
    else:
        full_ok = full_pages <= v.pools.free_full
        swa_ok = swa_pages <= v.pools.free_swa
    return budgets, gate, full_ok, swa_ok


def _token_budgets(k: Knobs, v: StepVars, *, count_retracted: bool) -> Budgets:
    """Twin: the budgets of §2.4 over free *token* counts ``free_full`` / ``free_swa`` (not pages); the resume
    budgets (``count_retracted=False``) without the "can finish" room, as :func:`budgets_terms`' (M1)."""
    n_active = v.batch.n_running + v.extra
    reserved = k.R * n_active
    need, need_swa = (v.batch.need, v.batch.need_swa) if count_retracted else (z3.IntVal(0), z3.IntVal(0))
    full = v.pools.free_full - zmax(reserved, need)
    swa = v.pools.free_swa - zmax(zmin(reserved, zmax(0, n_active * k.W - v.pools.used_swa * k.P)), need_swa)
    if count_retracted:
        full, swa = full - v.batch.retracted_full, swa - v.batch.retracted_swa
    return Budgets(full, swa)


def _step_build(variant: StepVariant, *, shaped: int | None = None) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = StepVars.fresh(shaped=shaped)
        _, gate, full_ok, swa_ok = _step_parts(v, variant)
        return _facts(v.hypotheses(), [] if shaped is None else v.small(), gate.admit, z3.Not(z3.And(full_ok, swa_ok)))

    return build


def _running_text(m: z3.ModelRef, v: StepVars) -> str:
    if not v.running:
        return ""
    reqs = ", ".join(f"(orig {as_int(m, r.orig)}, out {as_int(m, r.out)}, max_new {as_int(m, r.max_new)})"
                     for r in v.running)
    return f"running requests {reqs}; "


def _step_render(variant: StepVariant, *, shaped: int | None = None) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = StepVars.fresh(shaped=shaped)
        budgets, gate, full_ok, swa_ok = _step_parts(v, variant)
        full_pages, swa_pages = prealloc_pages_terms(v.k, v.req)
        unit = "tokens" if variant.token_pool else "pages"
        where = "resume_retracted_reqs" if as_bool(m, v.resume) else "pop_preallocated"
        fails = [name for name, ok in (("full", full_ok), ("SWA", swa_ok)) if not as_bool(m, ok)]
        return (f"{_knobs_text(m, v.k)}; free full {unit} {as_int(m, v.pools.free_full)}, free SWA {unit} "
                f"{as_int(m, v.pools.free_swa)}, SWA pages in use {as_int(m, v.pools.used_swa)}; "
                f"{_running_text(m, v)}{_batch_text(m, v.batch, v.extra)}; {_req_text(m, v.k, v.req)}; {where}: "
                f"budgets full "
                f"{as_int(m, budgets.full)} swa {as_int(m, budgets.swa)}, gate full {as_int(m, gate.full_need)} <= "
                f"{as_int(m, budgets.full)} and swa {as_int(m, gate.swa_need)} <= {as_int(m, budgets.swa)}: admitted; "
                f"_pre_alloc needs {as_int(m, full_pages)} full + {as_int(m, swa_pages)} SWA pages -> "
                f"{' and '.join(fails)} pool short (crash)")

    return render


def _within_free_build(clamp_growth: bool, *, shaped: int | None = None) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = StepVars.fresh(shaped=shaped)
        cr = z3.Bool("count_retracted")
        b_yes = budgets_terms(v.k, v.pools, v.batch, v.extra, count_retracted=True, clamp_growth=clamp_growth)
        b_no = budgets_terms(v.k, v.pools, v.batch, v.extra, count_retracted=False, clamp_growth=clamp_growth,
                             reserve_finish=False)  # the resume budgets (M1)
        full, swa = z3.If(cr, b_yes.full, b_no.full), z3.If(cr, b_yes.swa, b_no.swa)
        within = z3.And(full <= v.pools.free_full * v.k.P, swa <= v.pools.free_swa * v.k.P)
        return _facts(v.hypotheses(), [] if shaped is None else v.small(), z3.Not(within))

    return build


def _within_free_render(clamp_growth: bool, *, shaped: int | None = None) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = StepVars.fresh(shaped=shaped)
        cr = as_bool(m, z3.Bool("count_retracted"))
        b = budgets_terms(v.k, v.pools, v.batch, v.extra, count_retracted=cr, clamp_growth=clamp_growth,
                          reserve_finish=cr)
        n_active = v.batch.n_running + v.extra
        growth = n_active * v.k.W - v.pools.used_swa * v.k.P
        P, ff, fs = as_int(m, v.k.P), as_int(m, v.pools.free_full), as_int(m, v.pools.free_swa)
        over = [f"{name} budget {as_int(m, t)} > {free * P} free tokens"
                for name, t, free in (("full", b.full, ff), ("SWA", b.swa, fs)) if as_int(m, t) > free * P]
        return (f"{_knobs_text(m, v.k)}; free pages full {ff}, SWA {fs}, SWA pages in use "
                f"{as_int(m, v.pools.used_swa)}; {_running_text(m, v)}{_batch_text(m, v.batch, v.extra)}; "
                f"count_retracted={cr}; n_active*W - swa_used = {as_int(m, growth)}: " + "; ".join(over))

    return render


# ---- D1: a budget decremented between admissions (one pool) --------------------------------


@dataclass(frozen=True)
class DecVars:
    """One pool: ``F`` free pages, budget ``b``; a request of ``n`` tokens in that pool (tail or fill)."""

    P: z3.ArithRef
    R: z3.ArithRef
    F: z3.ArithRef
    b: z3.ArithRef
    n: z3.ArithRef

    @staticmethod
    def fresh() -> DecVars:
        return DecVars(*z3.Ints("P R F b n"))

    def hypotheses(self) -> list[z3.BoolRef]:
        """Invariant ``b <= F * P`` (a fresh budget: ``d1_fresh_budget_within_free``)."""
        return [self.P >= 2, self.R >= 0, self.F >= 0, self.n >= 1, self.b <= self.F * self.P]


def _dec_parts(v: DecVars, rounded: bool) -> tuple[z3.ArithRef, z3.ArithRef, z3.BoolRef, z3.BoolRef]:
    req = (ceil_p_term(v.n, v.P) if rounded else v.n) + v.R
    pages = ceil_div_term(v.n, v.P)
    return req, pages, pages <= v.F, v.b - req <= (v.F - pages) * v.P


def _dec_build(rounded: bool, reserve: Callable[[DecVars], z3.BoolRef] | None) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = DecVars.fresh()
        req, _, fits, keeps = _dec_parts(v, rounded)
        extra = [] if reserve is None else [reserve(v)]
        return _facts(v.hypotheses(), extra, req <= v.b, z3.Not(z3.And(fits, keeps)))

    return build


def _dec_render(rounded: bool) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = DecVars.fresh()
        req, pages, fits, _ = _dec_parts(v, rounded)
        P, F, b, r, k = (as_int(m, x) for x in (v.P, v.F, v.b, req, pages))
        head = (f"P={P} R={as_int(m, v.R)}; {F} free pages ({F * P} tokens), budget {b}; request of "
                f"{as_int(m, v.n)} tokens charged {r} <= {b}, takes {k} pages")
        if not as_bool(m, fits):
            return f"{head}: only {F} free (crash)"
        return (f"{head} -> {F - k} free ({(F - k) * P} tokens), budget {b} -> {b - r} > {(F - k) * P}: "
                f"the next request can pass the gate and find the pool short")

    return render


# ---- D1: an explicit two-admission round -----------------------------------------------------


@dataclass(frozen=True)
class RoundVars:
    """A ``pop_preallocated`` round with two queued requests."""

    k: Knobs
    pools: Pools
    batch: Batch
    extra: z3.ArithRef
    r1: Req
    r2: Req

    @staticmethod
    def fresh(*, empty: bool = False) -> RoundVars:
        batch, extra = (Batch.empty(), z3.IntVal(0)) if empty else (Batch.fresh(), z3.Int("extra"))
        pools = Pools.fresh()
        if empty:  # nothing running, nothing retracted: no SWA page in use
            pools = Pools(pools.free_full, pools.free_swa, z3.IntVal(0))
        return RoundVars(Knobs.fresh(), pools, batch, extra, Req.fresh("1"), Req.fresh("2"))

    def hypotheses(self) -> list[z3.BoolRef]:
        return _facts(self.k.hypotheses(), self.pools.hypotheses(), self.batch.hypotheses(), self.extra >= 0,
                      self.r1.hypotheses(), self.r2.hypotheses())


@dataclass(frozen=True)
class Round:
    """The terms of one round: budgets and gates of both admissions, pages, outcomes."""

    b1: Budgets
    g1: Gate
    pages1: tuple[z3.ArithRef, z3.ArithRef]
    ok1: z3.BoolRef
    b2: Budgets
    g2: Gate
    pages2: tuple[z3.ArithRef, z3.ArithRef]
    full_ok2: z3.BoolRef
    swa_ok2: z3.BoolRef


def round_terms(v: RoundVars, policy: Policy) -> Round:
    """``pop_preallocated`` for two requests: the full budget is always recomputed (``extra + 1``
    reservations), the SWA budget recomputed (CORRECTED) or decremented by ``swa_req`` (UPSTREAM)."""
    rounded = policy is Policy.CORRECTED
    b1 = budgets_terms(v.k, v.pools, v.batch, v.extra)
    g1 = admission_gate_terms(v.k, v.batch, b1, v.r1, rounded=rounded)
    f1, s1 = prealloc_pages_terms(v.k, v.r1)
    ok1 = z3.And(f1 <= v.pools.free_full, s1 <= v.pools.free_swa)
    after = v.pools.after(f1, s1)
    fresh = budgets_terms(v.k, after, v.batch, v.extra + 1)
    b2 = fresh if policy is Policy.CORRECTED else Budgets(fresh.full, b1.swa - g1.swa_required)
    g2 = admission_gate_terms(v.k, v.batch, b2, v.r2, rounded=rounded)
    f2, s2 = prealloc_pages_terms(v.k, v.r2)
    return Round(b1, g1, (f1, s1), ok1, b2, g2, (f2, s2), f2 <= after.free_full, s2 <= after.free_swa)


def _search_bounds(v: RoundVars) -> list[z3.BoolRef]:
    """Counterexample search narrowed to S2-sized numbers (any run found is a run of the model)."""
    k = v.k
    return [k.P <= 64, k.W <= 128, k.CLIP == 4096, v.r1.orig <= 200, v.r2.orig <= 200, v.r1.out == 1,
            v.r2.out == 1, v.r1.max_new <= 16, v.r2.max_new <= 16, v.pools.free_swa >= 1,
            v.pools.free_swa <= 5, v.pools.free_full >= v.pools.free_swa, v.pools.free_full <= 20]


S2 = {"P": 64, "W": 128, "R": 0, "CLIP": 4096, "orig": 200, "out": 1, "max_new": 2, "free_full": 20, "free_swa": 5}
"""§9 S2 (``max_new_tokens = 2``: the reference requires ``output_len = 1 < max_new_tokens``)."""


def _s2_facts(v: RoundVars) -> list[z3.BoolRef]:
    k = v.k
    return [S2["P"] == k.P, S2["W"] == k.W, S2["R"] == k.R, S2["CLIP"] == k.CLIP,
            *(x == S2[name] for r in (v.r1, v.r2) for x, name in ((r.orig, "orig"), (r.out, "out"),
                                                                  (r.max_new, "max_new"))),
            v.pools.free_full == S2["free_full"], v.pools.free_swa == S2["free_swa"]]


def _round_build(policy: Policy, *, empty: bool, narrow: Callable[[RoundVars], list[z3.BoolRef]] | None,
                 swa_crash: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = RoundVars.fresh(empty=empty)
        rnd = round_terms(v, policy)
        facts = _facts(v.hypotheses(), [] if narrow is None else narrow(v), rnd.g1.admit)
        if swa_crash:  # request 1 preallocates; request 2 passes, its full pages fit, its SWA tail does not
            return _facts(facts, rnd.ok1, rnd.g2.admit, rnd.full_ok2, z3.Not(rnd.swa_ok2))
        return _facts(facts, z3.Or(z3.Not(rnd.ok1), z3.And(rnd.g2.admit, z3.Not(z3.And(rnd.full_ok2, rnd.swa_ok2)))))

    return build


def round_values(model: z3.ModelRef, policy: Policy, *, empty: bool) -> dict[str, int | bool]:
    """The concrete numbers of a round model (the render, and the reference replay in the tests)."""
    v = RoundVars.fresh(empty=empty)
    rnd = round_terms(v, policy)
    names: dict[str, z3.ArithRef] = {
        "P": v.k.P, "W": v.k.W, "R": v.k.R, "CLIP": v.k.CLIP, "free_full": v.pools.free_full,
        "free_swa": v.pools.free_swa, "used_swa": v.pools.used_swa, "extra": v.extra,
        "orig1": v.r1.orig, "out1": v.r1.out, "max_new1": v.r1.max_new,
        "orig2": v.r2.orig, "out2": v.r2.out, "max_new2": v.r2.max_new,
        "budget1_full": rnd.b1.full, "budget1_swa": rnd.b1.swa, "swa_need1": rnd.g1.swa_need,
        "swa_req1": rnd.g1.swa_required, "full_pages1": rnd.pages1[0], "swa_pages1": rnd.pages1[1],
        "budget2_full": rnd.b2.full, "budget2_swa": rnd.b2.swa, "swa_need2": rnd.g2.swa_need,
        "full_need2": rnd.g2.full_need, "full_pages2": rnd.pages2[0], "swa_pages2": rnd.pages2[1],
        "n_running": v.batch.n_running,
    }
    out: dict[str, int | bool] = {name: as_int(model, t) for name, t in names.items()}
    out["ok1"] = as_bool(model, rnd.ok1)
    out["admit2"] = as_bool(model, rnd.g2.admit)
    out["full_ok2"], out["swa_ok2"] = as_bool(model, rnd.full_ok2), as_bool(model, rnd.swa_ok2)
    return out


def _round_render(policy: Policy, *, empty: bool) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        x = round_values(m, policy, empty=empty)
        free2 = x["free_swa"] - x["swa_pages1"]
        head = (f"P={x['P']} W={x['W']} R={x['R']} prompts [{x['orig1']}, {x['orig2']}] (outputs "
                f"[{x['out1']}, {x['out2']}], max_new [{x['max_new1']}, {x['max_new2']}]) free SWA pages "
                f"{x['free_swa']}, free full pages {x['free_full']}")
        if not empty:
            head += f", running {x['n_running']}, extra active {x['extra']}, SWA pages in use {x['used_swa']}"
        if not x["ok1"]:
            return (f"{head}: request 1 gate {x['swa_need1']} <= {x['budget1_swa']} admitted, needs "
                    f"{x['full_pages1']} full + {x['swa_pages1']} SWA pages -> crash")
        refresh = "recomputed" if policy is Policy.CORRECTED else "decremented"
        short = "full" if not x["full_ok2"] else "SWA"
        return (f"{head} : request 1 admitted (swa_req {x['swa_req1']}, charged {x['swa_pages1']} pages), "
                f"budget {x['budget1_swa']} -> {x['budget2_swa']} ({refresh}); request 2 gate {x['swa_need2']} <= "
                f"{x['budget2_swa']} admitted (full {x['full_need2']} <= {x['budget2_full']}), needs "
                f"{x['swa_pages2']} pages, {free2} free ({short} pool short: _pre_alloc asserts)")

    return render


# ---- D3: residency after _evict_swa, and the resume tail -----------------------------------


@dataclass(frozen=True)
class ResidencyVars:
    """``P``, ``W``, fill length ``A`` at prealloc, current length ``L``, mark ``e = j * P`` before eviction."""

    P: z3.ArithRef
    W: z3.ArithRef
    A: z3.ArithRef
    L: z3.ArithRef
    j: z3.ArithRef
    fresh_req: z3.BoolRef

    @staticmethod
    def fresh() -> ResidencyVars:
        p, w, a, length, j = (z3.Int(name) for name in ("P", "W", "A", "L", "j"))
        return ResidencyVars(p, w, a, length, j, z3.Bool("never_decoded"))

    @property
    def e(self) -> z3.ArithRef:
        return self.j * self.P

    @property
    def tail_start(self) -> z3.ArithRef:
        return self.A - swa_tail_term(self.A, self.W, self.P)

    def hypotheses(self) -> list[z3.BoolRef]:
        """The mark before the step is page aligned and satisfies D3's invariant at length ``L - 1``."""
        return [self.P >= 2, self.W >= 1, self.A >= 1, self.j >= 0, self.e <= zmax(0, self.L - 1 - self.W)]


@dataclass(frozen=True)
class EvictVariant:
    ceil: bool = False
    margin: bool = True


def _residency_parts(v: ResidencyVars, ev: EvictVariant) -> dict[str, z3.ArithRef]:
    mark = evict_mark_term(v.e, v.L, v.W, v.P, ceil=ev.ceil, margin=ev.margin)
    start = zmax(v.tail_start, mark)
    return {"mark": mark, "start": start, "low": resident_low_term(v.L, v.W, v.P), "window": zmax(0, v.L - v.W)}


def _residency_build(ev: EvictVariant, bound: Callable[[ResidencyVars], z3.ArithRef] | None,
                     narrow: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = ResidencyVars.fresh()
        x = _residency_parts(v, ev)
        most = (v.W + 2 * v.P) if bound is None else bound(v)
        goal = z3.And(x["mark"] >= v.e, x["mark"] <= x["window"], x["start"] >= x["low"],
                      x["start"] <= x["window"], v.L - x["start"] <= most)
        small = [v.P <= 8, v.W <= 16, v.L <= 64, x["mark"] <= v.L] if narrow else []
        return _facts(v.hypotheses(), v.L >= v.A + 1, small, z3.Not(goal))

    return build


def _residency_render(ev: EvictVariant, bound: Callable[[ResidencyVars], z3.ArithRef] | None) -> Callable[
        [z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = ResidencyVars.fresh()
        x = {name: as_int(m, t) for name, t in _residency_parts(v, ev).items()}
        P, W, A, L, e, ts = (as_int(m, t) for t in (v.P, v.W, v.A, v.L, v.e, v.tail_start))
        most = W + 2 * P if bound is None else as_int(m, bound(v))
        formula = f"{'ceil' if ev.ceil else 'floor'}_P(max({e}, L-1-W{'-P' if ev.margin else ''}))"
        broken = []
        if x["start"] > x["window"]:
            broken.append(f"window positions [{x['window']}, {x['start']}) lost their SWA rows")
        if x["start"] < x["low"]:
            broken.append(f"resident below floor_P(max(0, L-1-W-P))={x['low']}")
        if L - x["start"] > most:
            broken.append(f"{L - x['start']} resident positions > {most}")
        if x["mark"] < e or x["mark"] > x["window"]:
            broken.append(f"mark {x['mark']} outside [{e}, {x['window']}]")
        return (f"P={P} W={W}: prealloc A={A} (tail starts at {ts}), mark e={e}; decode to L={L}: evict to "
                f"{formula}={x['mark']}, SWA-resident [{x['start']}, {L}), window [{L - W}, {L}): "
                + "; ".join(broken))

    return render


@dataclass(frozen=True)
class ResumeVariant:
    evict: EvictVariant = EvictVariant()
    resume_start: Callable[[ResidencyVars], z3.ArithRef] | None = None  # default: L - swa_tail_len(L)
    copy_drops_last: bool = False  # retraction saves positions [0, L - 1) only
    witnesses: bool = False  # the rounded mark and the resume start as q * P, f * P with defining bounds


def _resume_witnesses(v: ResidencyVars, rv: ResumeVariant) -> tuple[dict[str, z3.ArithRef], list[z3.BoolRef]]:
    """The tail start ``t * P``, the eviction mark ``q * P`` and the resume start ``f * P`` by their
    defining inequalities instead of ``div`` terms.

    ``t * P = floor_P(max(0, A - W))`` (``A - swa_tail_len(A)`` for ``A >= 1``, D2);
    ``q * P`` is ``ceil_P(x)`` (``x <= qP < x + P``) or ``floor_P(x)`` (``qP <= x < qP + P``) of
    ``x = max(e, L - 1 - W [- P])``; ``f * P = floor_P(max(0, L - W))``, the resume start
    ``L - swa_tail_len(L)``. Z3 proves the ceil variant in milliseconds this way and, depending
    on term order, times out on the ``div`` form.
    """
    t, q, f = z3.Int("t"), z3.Int("q"), z3.Int("f")
    x = zmax(v.e, v.L - 1 - v.W - (v.P if rv.evict.margin else 0))
    tp, qp, fp = t * v.P, q * v.P, f * v.P
    a, y = zmax(0, v.A - v.W), zmax(0, v.L - v.W)
    mark = [qp >= x, qp - v.P < x] if rv.evict.ceil else [qp <= x, qp + v.P > x]
    defs = [tp <= a, tp + v.P > a, *mark, fp <= y, fp + v.P > y]
    # instances of page_index_order (proved below): page indices compare like their first positions
    defs += [page_index_order(i, k, v.P) for i, k in ((q, f + 1), (v.j, f + 1), (t, f + 1), (q, v.j + 1))]
    return {"tail_start": tp, "evicted": qp, "start": fp}, defs


def page_index_order(a: IntLike, b: IntLike, page_size: IntLike) -> z3.BoolRef:
    """``a * P < b * P  =>  a < b`` (valid for ``P >= 1``; obligation ``resume_retracted_reqs.page_index_order``)."""
    a, b, p = lift(a), lift(b), lift(page_size)
    return z3.Implies(a * p < b * p, a < b)


def _resume_parts(v: ResidencyVars, rv: ResumeVariant) -> tuple[dict[str, z3.ArithRef], list[z3.BoolRef]]:
    defs: list[z3.BoolRef] = []
    if rv.witnesses:
        w, defs = _resume_witnesses(v, rv)
        ts, evicted, start = w["tail_start"], w["evicted"], w["start"]
    else:
        ts = v.tail_start
        evicted = evict_mark_term(v.e, v.L, v.W, v.P, ceil=rv.evict.ceil, margin=rv.evict.margin)
        start = resume_tail_start_term(v.L, v.W, v.P)
    if rv.resume_start is not None:
        start = rv.resume_start(v)
    mark = z3.If(v.fresh_req, ts, evicted)
    parts = {"saved_lo": zmax(ts, mark), "saved_hi": v.L - 1 if rv.copy_drops_last else v.L,
             "start": start, "window": zmax(0, v.L - v.W)}
    return parts, defs


def _resume_build(rv: ResumeVariant, narrow: bool) -> Callable[[], list[z3.BoolRef]]:
    def build() -> list[z3.BoolRef]:
        v = ResidencyVars.fresh()
        x, defs = _resume_parts(v, rv)
        shape = z3.If(v.fresh_req, v.L == v.A, v.L >= v.A + 1)
        if rv.witnesses:  # after an eviction only (right after prealloc the mark is the tail start, as above)
            shape = z3.And(z3.Not(v.fresh_req), v.L >= v.A + 1)
        goal = z3.And(x["saved_lo"] <= x["start"], x["start"] <= x["window"], x["saved_hi"] >= v.L)
        small = [v.P <= 8, v.W <= 16, v.L <= 64, x["saved_lo"] <= v.L] if narrow else []
        return _facts(v.hypotheses(), defs, shape, small, z3.Not(goal))

    return build


def _resume_render(rv: ResumeVariant) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = ResidencyVars.fresh()
        x = {name: as_int(m, t) for name, t in _resume_parts(v, rv)[0].items()}
        P, W, A, L, e = (as_int(m, t) for t in (v.P, v.W, v.A, v.L, v.e))
        if as_bool(m, v.fresh_req):
            how = f"retracted right after prealloc (A=L={L})"
        else:
            how = f"prealloc A={A}, mark e={e}, decoded to L={L} and evicted"
        lost = []
        if x["start"] < x["saved_lo"]:
            lost.append(f"positions [{x['start']}, {x['saved_lo']}) get SWA slots but no saved row")
        if x["start"] > x["window"]:
            lost.append(f"window positions [{x['window']}, {x['start']}) get no SWA slot")
        if x["saved_hi"] < L:
            lost.append(f"position {L - 1} was never saved")
        return (f"P={P} W={W}: {how}; SWA rows saved for [{x['saved_lo']}, {x['saved_hi']}), resumed tail "
                f"[{x['start']}, {L}), window [{L - W}, {L}): " + "; ".join(lost))

    return render


# ---- the transition system: one transition per operation of kvproof.reference.decode_prealloc ------
#
# A bounded node of ``n`` request slots, numbered by arrival (so the prealloc queue is in slot order):
# per slot a status, its request, its SWA eviction mark ``m * P``, the full and SWA pages it holds and
# a retraction stamp (the retracted queue is in stamp order); both pools' free pages, a crash flag
# (D1 violated: ``_pre_alloc`` asserted and the node died) and the stamp clock. The knobs, the policy
# and the pool sizes are constants: one Z3 symbol shared by every state.


ABSENT, QUEUED, RUNNING, RETRACTED, FINISHED = range(5)
STATUS = ("absent", "queued", "running", "retracted", "finished")
N_SLOTS = 2
"""Request slots of the model the obligations check: two queued requests make a round of two
admissions. The transitions take any number of slots (the drift tests run three)."""

_SLOT_FIELDS = ("status", "orig", "out", "max_new", "m", "full", "swa", "at")


@dataclass(frozen=True)
class Slot:
    """One request slot: status, request, eviction mark ``m * P``, pages held, retraction stamp.

    ``m`` is the page index of ``swa_evicted_seqlen`` while running, and the mark at retraction
    while retracted (the saved SWA rows are ``[m * P, L)``). A finished slot keeps its request and
    its mark before the last step, and holds nothing.
    """

    status: z3.ArithRef
    orig: z3.ArithRef
    out: z3.ArithRef
    max_new: z3.ArithRef
    m: z3.ArithRef
    full: z3.ArithRef
    swa: z3.ArithRef
    at: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> Slot:
        return Slot(*(z3.Int(f"{name}{tag}") for name in _SLOT_FIELDS))

    @property
    def req(self) -> Req:
        return Req(self.orig, self.out, self.max_new)

    @property
    def length(self) -> z3.ArithRef:
        """``L = fill_len``: the KV positions of a running request (``len(slots)``), a retracted one's length."""
        return fill_len_term(self.orig, self.out)

    def is_(self, status: int) -> z3.BoolRef:
        return self.status == status

    @property
    def on_node(self) -> z3.BoolRef:
        return z3.Or(self.is_(QUEUED), self.is_(RUNNING), self.is_(RETRACTED))

    def values(self) -> tuple[z3.ArithRef, ...]:
        return tuple(getattr(self, name) for name in _SLOT_FIELDS)


@dataclass(frozen=True)
class State:
    """The node and both pools in pages, as far as budgets, gates and allocations read them."""

    k: Knobs
    corrected: z3.BoolRef
    full_total: z3.ArithRef
    swa_total: z3.ArithRef
    free_full: z3.ArithRef
    free_swa: z3.ArithRef
    crashed: z3.BoolRef
    clock: z3.ArithRef
    slots: tuple[Slot, ...]

    @staticmethod
    def fresh(tag: str, n: int = N_SLOTS) -> State:
        """Variables ``name@tag``; the constants (knobs, policy, pool sizes) are the same symbols in every state."""
        return State(Knobs.fresh(), z3.Bool("corrected"), z3.Int("full_total"), z3.Int("swa_total"),
                     z3.Int(f"free_full@{tag}"), z3.Int(f"free_swa@{tag}"), z3.Bool(f"crashed@{tag}"),
                     z3.Int(f"clock@{tag}"), tuple(Slot.fresh(f"{i}@{tag}") for i in range(n)))

    @property
    def pools(self) -> Pools:
        return Pools(self.free_full, self.free_swa, self.swa_total - self.free_swa)


@dataclass(frozen=True)
class Action:
    """An operation's arguments: the slot (``arrive``'s new request, ``retract``'s victim) and
    ``arrive``'s request (``rid`` is the slot: slots are numbered by arrival)."""

    slot: z3.ArithRef
    orig: z3.ArithRef
    out: z3.ArithRef
    max_new: z3.ArithRef

    @staticmethod
    def fresh(tag: str) -> Action:
        return Action(*(z3.Int(f"{name}_arg@{tag}") for name in ("slot", "orig", "out", "max_new")))


def _same(a: Sequence[z3.ExprRef], b: Sequence[z3.ExprRef]) -> z3.BoolRef:
    return z3.And([x == y for x, y in zip(a, b, strict=True)])


def _kept(u: Slot, v: Slot, *names: str) -> z3.BoolRef:
    return _same([getattr(u, n) for n in names], [getattr(v, n) for n in names])


def _total(terms: Sequence[IntLike], members: Sequence[z3.BoolRef]) -> z3.ArithRef:
    return z3.Sum([z3.If(c, lift(x), 0) for c, x in zip(members, terms, strict=True)])


def _policy_required(k: Knobs, corrected: z3.BoolRef, req: Req) -> tuple[z3.ArithRef, z3.ArithRef]:
    rounded, unrounded = required_tokens_terms(k, req, rounded=True), required_tokens_terms(k, req, rounded=False)
    return z3.If(corrected, rounded[0], unrounded[0]), z3.If(corrected, rounded[1], unrounded[1])


def batch_of(s: State) -> Batch:
    """:class:`Batch` from the state: the running slots' sums and maxima, the retracted slots' requirements."""
    k, running = s.k, [r.is_(RUNNING) for r in s.slots]
    retractable = _total([r.orig + r.out for r in s.slots], running)
    retractable_swa = _total([swa_retractable_len_term(k, r.req) for r in s.slots], running)
    need: z3.ArithRef = z3.IntVal(0)
    need_swa: z3.ArithRef = z3.IntVal(0)
    seen: z3.BoolRef = z3.BoolVal(False)
    for r, on in zip(s.slots, running, strict=True):
        c = clipped_term(r.max_new, k.CLIP)
        full, swa = c + r.orig - retractable, swa_tail_term(r.orig, k.W, k.P) + c - retractable_swa
        need = z3.If(on, z3.If(seen, zmax(need, full), full), need)
        need_swa = z3.If(on, z3.If(seen, zmax(need_swa, swa), swa), need_swa)
        seen = z3.Or(seen, on)
    retracted = [r.is_(RETRACTED) for r in s.slots]
    required = [_policy_required(k, s.corrected, r.req) for r in s.slots]
    return Batch(_total([1] * len(s.slots), running), retractable, retractable_swa, need, need_swa,
                 _total([f for f, _ in required], retracted), _total([w for _, w in required], retracted))


def tail_mark_term(length: IntLike, W: IntLike, P: IntLike) -> z3.ArithRef:
    """The page index of ``L - swa_tail_len(L) = floor_P(max(0, L - W))``, where ``_start`` puts the mark."""
    return zmax(0, lift(length) - lift(W)) / lift(P)


@dataclass(frozen=True)
class RoundTerms:
    """A ``pop_preallocated`` / ``resume_retracted_reqs`` round, per slot: member of the queue, considered
    (every earlier member admitted and preallocated), the budgets its gate read, admitted, pages fit."""

    member: tuple[z3.BoolRef, ...]
    considered: tuple[z3.BoolRef, ...]
    budgets: tuple[Budgets, ...]
    admit: tuple[z3.BoolRef, ...]
    fits: tuple[z3.BoolRef, ...]
    pages: tuple[tuple[z3.ArithRef, z3.ArithRef], ...]

    def runs(self, i: int) -> z3.BoolRef:
        """Slot ``i`` is admitted and preallocated."""
        return z3.And(self.considered[i], self.admit[i], self.fits[i])

    def crashes(self, i: int) -> z3.BoolRef:
        """Slot ``i`` is admitted and its pages do not fit: ``_pre_alloc`` asserts (D1 violated)."""
        return z3.And(self.considered[i], self.admit[i], z3.Not(self.fits[i]))

    @property
    def crash(self) -> z3.BoolRef:
        return z3.Or([self.crashes(i) for i in range(len(self.member))])


def round_of(s: State, t: State, *, resume: bool, reserve_finish: bool | None = None) -> RoundTerms:
    """The admissions of one round (§2.5): members in queue order (slot order for the prealloc queue, stamp
    order for the retracted queue), head-of-line. A member's gate reads budgets recomputed from the pools
    after the earlier admissions (``CORRECTED``), or decremented by their unrounded requirements
    (``UPSTREAM``: the SWA budget of ``pop_preallocated``, both on resume); the running batch is the one
    before the round, ``extra`` the admissions before it.

    Relational: whether an earlier member was admitted and preallocated is read from ``post`` (it runs
    now), so every member's gate is a term of the states, whatever the (symbolic) stamp order.

    ``reserve_finish``: whether the budgets keep the "can finish" room; by default the pop round's do and the
    resume round's do not (M1). A resume round that keeps it is the model before M1 (sglang_semantics.md §2.5's
    "the same budgets"): the drift test's wrong transition.
    """
    k, batch, n = s.k, batch_of(s), len(s.slots)
    member = tuple(r.is_(RETRACTED if resume else QUEUED) for r in s.slots)
    ran = [z3.And(member[j], t.slots[j].is_(RUNNING)) for j in range(n)]
    pages = tuple(prealloc_pages_terms(k, r.req) for r in s.slots)
    unrounded = [required_tokens_terms(k, r.req, rounded=False) for r in s.slots]
    room = not resume if reserve_finish is None else reserve_finish
    b0 = budgets_terms(k, s.pools, batch, 0, count_retracted=not resume, reserve_finish=room)
    considered, budgets, admit, fits = [], [], [], []
    for i, r in enumerate(s.slots):
        earlier = [z3.And(member[j], s.slots[j].at < r.at if resume else z3.BoolVal(j < i)) if j != i
                   else z3.BoolVal(False) for j in range(n)]
        considered.append(z3.And(member[i], *(z3.Implies(e, d) for e, d in zip(earlier, ran, strict=True))))
        free_full = s.free_full - _total([p[0] for p in pages], earlier)
        free_swa = s.free_swa - _total([p[1] for p in pages], earlier)
        fresh = budgets_terms(k, Pools(free_full, free_swa, s.swa_total - free_swa), batch,
                              _total([1] * n, earlier), count_retracted=not resume, reserve_finish=room)
        spent_full, spent_swa = _total([u[0] for u in unrounded], earlier), _total([u[1] for u in unrounded], earlier)
        upstream = Budgets(b0.full - spent_full if resume else fresh.full, b0.swa - spent_swa)
        b = Budgets(z3.If(s.corrected, fresh.full, upstream.full), z3.If(s.corrected, fresh.swa, upstream.swa))
        if resume:
            gates = [resume_gate_terms(k, b, r.req, rounded=x) for x in (True, False)]
        else:
            gates = [admission_gate_terms(k, batch, b, r.req, rounded=x) for x in (True, False)]
        budgets.append(b)
        admit.append(z3.If(s.corrected, gates[0].admit, gates[1].admit))
        fits.append(z3.And(pages[i][0] <= free_full, pages[i][1] <= free_swa))
    return RoundTerms(member, tuple(considered), tuple(budgets), tuple(admit), tuple(fits), pages)


def _round(s: State, t: State, *, resume: bool, marks_tail: bool = True,
           reserve_finish: bool | None = None) -> z3.BoolRef:
    """A round's relation: who runs now with which pages and mark, the pools, the crash flag."""
    rnd = round_of(s, t, resume=resume, reserve_finish=reserve_finish)
    facts = [z3.Not(s.crashed), t.clock == s.clock, t.crashed == rnd.crash]
    for i, (u, v) in enumerate(zip(s.slots, t.slots, strict=True)):
        (full, swa), runs = rnd.pages[i], rnd.runs(i)
        mark = tail_mark_term(u.length, s.k.W, s.k.P) if marks_tail else z3.IntVal(0)
        facts += [v.status == z3.If(runs, RUNNING, u.status), v.full == z3.If(runs, full, u.full),
                  v.swa == z3.If(runs, swa, u.swa), v.m == z3.If(runs, mark, u.m),
                  _kept(u, v, "orig", "out", "max_new", "at")]
    runs = [rnd.runs(i) for i in range(len(s.slots))]
    facts += [t.free_full == s.free_full - _total([p[0] for p in rnd.pages], runs),
              t.free_swa == s.free_swa - _total([p[1] for p in rnd.pages], runs)]
    return z3.And(facts)


def arrive(s: State, a: Action, t: State, *, checks_rid: bool = True) -> z3.BoolRef:
    """``arrive``: a prefilled request joins the prealloc queue in the next slot, validated (``orig >= 1``,
    ``1 <= out < max_new``, a new ``rid``).

    ``checks_rid=False`` is a broken twin: without ``rid not in known`` the request takes the slot of a
    request still on the node.
    """
    facts = [z3.Not(s.crashed), a.slot >= 0, a.slot < len(s.slots), *Req(a.orig, a.out, a.max_new).hypotheses(),
             t.crashed == s.crashed, t.clock == s.clock, t.free_full == s.free_full, t.free_swa == s.free_swa]
    if checks_rid:  # a new rid gets the next slot: the slots before it were all used
        facts += [z3.Implies(a.slot > j, r.status != ABSENT) for j, r in enumerate(s.slots)]
        facts.append(z3.Or([z3.And(a.slot == j, r.is_(ABSENT)) for j, r in enumerate(s.slots)]))
    for j, (u, v) in enumerate(zip(s.slots, t.slots, strict=True)):
        queued = z3.And(v.is_(QUEUED), v.orig == a.orig, v.out == a.out, v.max_new == a.max_new, v.m == 0,
                        v.full == 0, v.swa == 0, v.at == u.at)
        facts.append(z3.If(a.slot == j, queued, _same(u.values(), v.values())))
    return z3.And(facts)


def pop_preallocated(s: State, a: Action, t: State, *, marks_tail: bool = True) -> z3.BoolRef:
    """``pop_preallocated``: one round over the prealloc queue (§2.5, §2.6). An admitted request runs with
    ``ceil(A/P)`` full and ``ceil(tail/P)`` SWA pages and its mark at the tail start (``_start``, #28085);
    one whose pages do not fit crashes the node (D1 violated) and ends the round.

    ``marks_tail=False`` is the PR-era ``_pre_alloc`` (before #28085): the mark stays 0 although only the
    tail holds SWA pages (§2.6 step 7, R6).
    """
    return _round(s, t, resume=False, marks_tail=marks_tail)


def decode(s: State, a: Action, t: State, *, atomic: bool = True) -> z3.BoolRef:
    """``decode``: one token for every running request (§1.3, §1.6): a new full and SWA page when
    ``(L + 1) - 1`` is a multiple of ``P`` (all or nothing: short pools stall the batch), the window
    eviction to ``floor_P(max(mark, L + 1 - 1 - W - P))`` (``free_swa`` of whole pages), and the release
    of every request that reached ``max_new_tokens``.

    ``atomic=False`` is a broken twin: upstream's composite ``alloc_decode`` takes the full pages before
    it finds the SWA pool short (§2.11 R7).
    """
    k = s.k
    running = [r.is_(RUNNING) for r in s.slots]
    opens = [z3.And(on, decode_opens_page_term(r.length + 1, k.P)) for on, r in zip(running, s.slots, strict=True)]
    need = _total([1] * len(opens), opens)
    stall = z3.Or(need > s.free_full, need > s.free_swa)
    facts = [z3.Not(s.crashed), t.crashed == s.crashed, t.clock == s.clock]
    freed_full, freed_swa = [], []
    for u, v, on, opened in zip(s.slots, t.slots, running, opens, strict=True):
        page = z3.If(opened, 1, 0)
        m2 = zmax(u.m, (u.length - k.W - k.P) / k.P)  # floor_P(max(m*P, (L + 1) - 1 - W - P)) / P
        full2, swa2 = u.full + page, u.swa + page - (m2 - u.m)
        fin = u.out + 1 >= u.max_new
        steps = z3.And(on, z3.Not(stall))
        facts += [v.status == z3.If(steps, z3.If(fin, FINISHED, RUNNING), u.status),
                  v.out == z3.If(steps, u.out + 1, u.out), v.m == z3.If(z3.And(steps, z3.Not(fin)), m2, u.m),
                  v.full == z3.If(steps, z3.If(fin, 0, full2), u.full),
                  v.swa == z3.If(steps, z3.If(fin, 0, swa2), u.swa), _kept(u, v, "orig", "max_new", "at")]
        freed_full.append(z3.If(z3.And(on, fin), full2, 0))
        freed_swa.append(z3.If(on, m2 - u.m + z3.If(fin, swa2, 0), 0))
    leaked = 0 if atomic else z3.If(need > s.free_full, 0, need)  # R7: the full half, before the SWA half fails
    facts += [t.free_full == z3.If(stall, s.free_full - leaked, s.free_full - need + z3.Sum(freed_full)),
              t.free_swa == z3.If(stall, s.free_swa, s.free_swa - need + z3.Sum(freed_swa))]
    return z3.And(facts)


def retract(s: State, a: Action, t: State, *, swa_by_length: bool = False) -> z3.BoolRef:
    """``retract``: a running request's KV goes to the CPU, its pages back to the pools (``free``), and it
    joins the retracted queue with the next stamp; its mark stays (the saved SWA rows are ``[m*P, L)``).

    ``swa_by_length=True`` is a broken twin: the SWA pages given back are counted from the length
    (``ceil(L/P)``, as many as the full pages) instead of the pages the request still holds.
    """
    facts = [z3.Not(s.crashed), a.slot >= 0, a.slot < len(s.slots), t.crashed == s.crashed,
             t.clock == s.clock + 1]
    back_full, back_swa = [], []
    for j, (u, v) in enumerate(zip(s.slots, t.slots, strict=True)):
        hit = a.slot == j
        gone = z3.And(v.is_(RETRACTED), v.full == 0, v.swa == 0, v.at == s.clock,
                      _kept(u, v, "orig", "out", "max_new", "m"))
        facts += [z3.Implies(hit, u.is_(RUNNING)), z3.If(hit, gone, _same(u.values(), v.values()))]
        back_full.append(z3.If(hit, u.full, 0))
        back_swa.append(z3.If(hit, u.full if swa_by_length else u.swa, 0))
    facts += [t.free_full == s.free_full + z3.Sum(back_full), t.free_swa == s.free_swa + z3.Sum(back_swa)]
    return z3.And(facts)


def resume_retracted_reqs(s: State, a: Action, t: State, *, marks_tail: bool = True,
                          reserve_finish: bool = False) -> z3.BoolRef:
    """``resume_retracted_reqs``: one round over the retracted queue in stamp order (§2.5): budgets without
    the retracted queue and without the "can finish" room (SGLang passes its budget functions no retractable
    counts: M1), the resume gate (both requirements within both budgets), ``_pre_alloc`` and
    ``load_cpu_copy``; the mark at the tail start of ``L``.

    ``marks_tail=False``: the PR-era mark left at 0 (R6), as in ``pop_preallocated``. ``reserve_finish=True``: the
    budgets keep the "can finish" room, as this model did before M1 (stricter than SGLang, not unsafe).
    """
    return _round(s, t, resume=True, marks_tail=marks_tail, reserve_finish=reserve_finish)


def init(s: State) -> z3.BoolRef:
    """``initial_node`` and a fresh allocator: every slot absent, every page free, no crash."""
    empty = [_same(r.values(), (ABSENT, 0, 0, 0, 0, 0, 0, 0)) for r in s.slots]
    return z3.And(*s.k.hypotheses(), s.full_total >= 0, s.swa_total >= 0, s.free_full == s.full_total,
                  s.free_swa == s.swa_total, z3.Not(s.crashed), s.clock == 0, *empty)


def invariant_clauses(s: State) -> list[tuple[str, z3.BoolRef]]:
    """The accounting invariant, clause by clause (§7 G2, G3; §2.6, §1.6).

    Each pool's free pages plus the pages the running requests hold are its size (no leak, no double
    free); only running requests hold pages: ``ceil(L/P)`` full pages, and the SWA pages of positions
    ``[m*P, L)``, ``ceil(L/P) - m`` of them (``m >= 0``, at most ``ceil(L/P)``). Every request on the node
    has ``orig >= 1`` and ``1 <= out < max_new``; retraction stamps are distinct and below the clock.
    """
    k = s.k
    clauses = [("knobs: P >= 2, W >= 1, R >= 0, CLIP >= 1",
                z3.And(*k.hypotheses(), s.full_total >= 0, s.swa_total >= 0, s.clock >= 0)),
               ("full pages: free + held == size",
                z3.And(s.free_full >= 0, s.free_full + z3.Sum([r.full for r in s.slots]) == s.full_total)),
               ("SWA pages: free + held == size",
                z3.And(s.free_swa >= 0, s.free_swa + z3.Sum([r.swa for r in s.slots]) == s.swa_total))]
    for i, r in enumerate(s.slots):
        holds = z3.If(r.is_(RUNNING),
                      z3.And(r.full == ceil_div_term(r.length, k.P), r.swa + r.m == r.full, r.m >= 0, r.swa >= 0),
                      z3.And(r.full == 0, r.swa == 0))
        stamps = [z3.Implies(z3.And(r.is_(RETRACTED), q.is_(RETRACTED)), r.at != q.at) for q in s.slots[i + 1:]]
        window = z3.Implies(z3.Or(r.is_(RUNNING), r.is_(RETRACTED)),
                            z3.And(r.m >= 0, r.m * k.P <= zmax(0, r.length - k.W)))
        valid = z3.And(r.status >= ABSENT, r.status <= FINISHED, z3.Implies(r.on_node, z3.And(r.req.hypotheses())))
        clauses += [(f"slot {i}: a request on the node is valid", valid),
                    (f"slot {i}: pages held are ceil(L/P) full, ceil(L/P) - m SWA, none off the running batch", holds),
                    (f"slot {i}: the mark is at most max(0, L - W) (D3: the window is SWA-resident)", window),
                    (f"slot {i}: retraction stamps distinct, below the clock",
                     z3.And(z3.Implies(r.is_(RETRACTED), z3.And(r.at >= 0, r.at < s.clock)), *stamps))]
    return clauses


def ceil_step(length: IntLike, P: IntLike) -> z3.BoolRef:
    """``ceil((L + 1)/P) == ceil(L/P) + 1`` exactly when decoding token ``L`` opens a page (``L mod P == 0``).

    Valid for ``P >= 1``, ``L >= 1`` (obligation ``decode.ceil_step``); its instances are hypotheses of
    ``decode.keeps_accounting`` (Z3 proves the lemma in milliseconds, the composed query only with it).
    """
    L, p = lift(length), lift(P)
    return ceil_div_term(L + 1, p) == ceil_div_term(L, p) + z3.If(decode_opens_page_term(L + 1, p), 1, 0)


# ---- rendering: a state as table cells, a step as its call ------------------------------------------


def _slot_cell(m: z3.ModelRef, s: State, r: Slot) -> str:
    status = as_int(m, r.status)
    if status == ABSENT:
        return ""
    name = STATUS[status] if 0 <= status < len(STATUS) else f"status {status}"
    orig, out, max_new = as_int(m, r.orig), as_int(m, r.out), as_int(m, r.max_new)
    cell = f"{name} {orig}+{out}/{max_new}"
    if status in (RUNNING, RETRACTED):
        cell += f" L={orig + max(out - 1, 0)} mark={as_int(m, r.m) * as_int(m, s.k.P)}"
    if status == RUNNING or as_int(m, r.full) or as_int(m, r.swa):
        cell += f" pages {as_int(m, r.full)}/{as_int(m, r.swa)}"
    if status == RETRACTED:
        cell += f" #{as_int(m, r.at)}"
    return cell


def columns(n: int = N_SLOTS) -> tuple[str, ...]:
    return ("knobs", "free pages full/SWA", *(f"slot {i}" for i in range(n)), "crashed")


def cells(m: z3.ModelRef, s: State) -> tuple[str, ...]:
    """A state's row: the knobs, free pages of both pools (of their sizes), each slot, the crash flag.

    A slot reads ``status orig+out/max_new``, then ``L``, the mark and ``pages full/SWA`` held.
    """
    k = s.k
    knobs = (f"P={as_int(m, k.P)} W={as_int(m, k.W)} R={as_int(m, k.R)} CLIP={as_int(m, k.CLIP)} "
             f"{'corrected' if as_bool(m, s.corrected) else 'upstream'}")
    pools = (f"{as_int(m, s.free_full)}/{as_int(m, s.free_swa)} of "
             f"{as_int(m, s.full_total)}/{as_int(m, s.swa_total)}")
    return (knobs, pools, *(_slot_cell(m, s, r) for r in s.slots), "CRASH" if as_bool(m, s.crashed) else "")


def describe(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
    """The call of a step and whom it touched: ``arrive(slot 1: 3+1/4)``, ``pop_preallocated() -> [0, 1]``."""
    op, a, s, t = step.op_name(m), step.action, step.pre, step.post
    if op == "arrive":
        return (f"arrive(slot {as_int(m, a.slot)}: {as_int(m, a.orig)}+{as_int(m, a.out)}/"
                f"{as_int(m, a.max_new)})")
    if op == "retract":
        return f"retract(slot {as_int(m, a.slot)})"
    moved = [i for i, (u, v) in enumerate(zip(s.slots, t.slots, strict=True))
             if as_int(m, u.status) != as_int(m, v.status)]
    crash = " crash" if as_bool(m, t.crashed) and not as_bool(m, s.crashed) else ""
    return f"{op}() -> {moved}{crash}" if moved or crash else f"{op}()"


def system(n: int = N_SLOTS) -> _ts.TransitionSystem[State, Action]:
    """The model with ``n`` request slots (every relation is written for any ``n``)."""
    return _ts.TransitionSystem(
        component=COMPONENT, state=functools.partial(State.fresh, n=n), action=Action.fresh, init=init,
        transitions={"arrive": arrive, "pop_preallocated": pop_preallocated, "decode": decode,
                     "retract": retract, "resume_retracted_reqs": resume_retracted_reqs},
        invariant=invariant_clauses, columns=columns(n), cells=cells, describe=describe)


SYSTEM: _ts.TransitionSystem[State, Action] = system()
"""Every state-changing operation of ``kvproof.reference.decode_prealloc``, by its name, over two slots."""


# ---- obligations over the transitions ------------------------------------------------------------


def _init_page0_counted(s: State) -> z3.BoolRef:
    """Twin: the initial full pool counts the reserved page 0 as free (§1.4)."""
    fresh = State(s.k, s.corrected, s.full_total, s.swa_total, s.free_full - 1, s.free_swa, s.crashed, s.clock,
                  s.slots)
    return init(fresh)


def _decode_consecution(sys: _ts.TransitionSystem[State, Action]) -> _ts.Check:
    """Consecution through ``decode`` with the :func:`ceil_step` instances of the pre-state's slots."""

    def build() -> list[z3.BoolRef]:
        step = _ts.Step.fresh(sys)
        lemmas = [ceil_step(r.length, step.pre.k.P) for r in step.pre.slots]
        return [sys.holds(step.pre), *lemmas, step.relation(["decode"]), z3.Not(sys.holds(step.post))]

    def render(m: z3.ModelRef) -> str:
        step = _ts.Step.fresh(sys)
        return _ts.step_table(sys, m, step, f"broken after step 1: {_ts.first_broken(sys, m, step.post)}")

    return _ts.Check(build, render)


def _small(step: _ts.Step[State, Action]) -> list[z3.BoolRef]:
    """Bounds for the twins' counterexample search (any run found is a run of the model)."""
    s = step.pre
    facts = [s.k.P <= 8, s.k.W <= 16, s.k.R <= 8, s.k.CLIP <= 64, s.full_total <= 16, s.swa_total <= 16]
    return facts + [x <= 64 for r in s.slots for x in (r.orig, r.out, r.max_new)]


def d1_hypotheses(s: State) -> list[z3.BoolRef]:
    """What D1 reads of the accounting invariant: the knobs, free pages >= 0, valid requests on the node.

    A subset of :func:`invariant_clauses` (so D1 holds for every reachable state, and for more): the
    budgets never exceed the free tokens whatever the running batch holds.
    """
    return [*s.k.hypotheses(), s.free_full >= 0, s.free_swa >= 0, z3.Not(s.crashed),
            *(z3.Implies(r.on_node, z3.And(r.req.hypotheses())) for r in s.slots)]


def _d1(op: str, *, corrected: bool) -> _ts.Check:
    """D1 over the transition ``op``: from any state of :func:`d1_hypotheses`, no admission crashes.

    ``corrected=False`` (a twin): the same under ``UPSTREAM``, the search narrowed to small numbers and
    every slot in the round's queue (any run found is a run of the model).
    """
    resume = op == "resume_retracted_reqs"

    def build() -> list[z3.BoolRef]:
        step = _ts.Step.fresh(SYSTEM)
        s = step.pre
        # the twins search nodes whose every slot waits in the round's queue (so nothing is held)
        waiting = [z3.And(r.is_(RETRACTED if resume else QUEUED), r.full == 0, r.swa == 0, r.at >= 0, r.at < s.clock)
                   for r in s.slots]
        narrow = [] if corrected else [*_small(step), *waiting, s.free_full == s.full_total,
                                       s.free_swa == s.swa_total]
        return [*d1_hypotheses(s), s.corrected == corrected, *narrow, step.relation([op]), step.post.crashed]

    def render(m: z3.ModelRef) -> str:
        step = _ts.Step.fresh(SYSTEM)
        return _ts.step_table(SYSTEM, m, step, explain(m, step), start="(any state)" if corrected else "(a state)")

    def explain(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
        rnd = round_of(step.pre, step.post, resume=resume)
        for i in range(len(step.pre.slots)):
            if as_bool(m, rnd.crashes(i)):
                b, (full, swa) = rnd.budgets[i], rnd.pages[i]
                spent = [rnd.pages[j] for j in range(len(step.pre.slots)) if j != i and as_bool(m, rnd.runs(j))]
                left = (as_int(m, step.pre.free_full) - sum(as_int(m, f) for f, _ in spent),
                        as_int(m, step.pre.free_swa) - sum(as_int(m, w) for _, w in spent))
                return (f"slot {i} passes its gate against budgets full {as_int(m, b.full)} SWA {as_int(m, b.swa)} "
                        f"and needs {as_int(m, full)} full + {as_int(m, swa)} SWA pages with {left[0]}/{left[1]} "
                        f"free: _pre_alloc asserts (D1 violated)")
        return "no crash"

    return _ts.Check(build, render)


def _ceil_step_check(*, at_new_length: bool = False) -> _ts.Check:
    """:func:`ceil_step` for any ``L >= 1``, ``P >= 1``; ``at_new_length`` (a twin) reads the page-opening rule
    at the new length: ``(L + 1) mod P == 0``."""
    L, P = z3.Ints("L P")
    seq_len = L + 2 if at_new_length else L + 1  # decode_opens_page_term(s) is (s - 1) mod P == 0

    def claim() -> z3.BoolRef:
        return ceil_div_term(L + 1, P) == ceil_div_term(L, P) + z3.If(decode_opens_page_term(seq_len, P), 1, 0)

    def render(m: z3.ModelRef) -> str:
        lv, pv = as_int(m, L), as_int(m, P)
        says = "opens" if as_bool(m, decode_opens_page_term(seq_len, P)) else "does not open"
        return (f"P={pv} L={lv}: ceil((L+1)/P) = {-(-(lv + 1) // pv)}, ceil(L/P) = {-(-lv // pv)}, but the rule "
                f"says decoding position {lv} {says} a page")

    return _ts.Check(lambda: [P >= 1, L >= 1, z3.Not(claim())], render)


def _transition_obligations() -> tuple[Obligation, ...]:
    def ob(suffix: str, statement: str, check: _ts.Check, twin_of: str | None = None) -> Obligation:
        return _ts.obligation(SYSTEM, suffix, statement, check, family=FAMILY, twin_of=twin_of)

    twin = SYSTEM.with_transitions
    return (
        ob("accounting.initiation",
           "the initial node (every slot absent, every page free) satisfies the accounting invariant",
           _ts.initiation(SYSTEM)),
        ob("accounting.initiation.page0_counted",
           "an initial full pool that counts the reserved page 0 as free has one page more than its size",
           _ts.initiation(dataclasses.replace(SYSTEM, init=_init_page0_counted)), "accounting.initiation"),
        ob("arrive.keeps_accounting",
           "arrive (validated, a new rid in the next slot) keeps the accounting invariant",
           _ts.consecution(SYSTEM, ["arrive"])),
        ob("arrive.keeps_accounting.rid_reused",
           "an arrive without the new-rid check takes the slot of a request on the node: its pages belong to "
           "nobody",
           _ts.consecution(twin(arrive=functools.partial(arrive, checks_rid=False)), ["arrive"]),
           "arrive.keeps_accounting"),
        ob("pop_preallocated.keeps_accounting",
           "a pop_preallocated round (any policy, crash or not) keeps the accounting invariant: admitted requests "
           "hold ceil(A/P) full and ceil(tail/P) SWA pages, taken from the pools",
           _ts.consecution(SYSTEM, ["pop_preallocated"])),
        ob("pop_preallocated.keeps_accounting.mark_left_at_zero",
           "the PR-era _pre_alloc leaves swa_evicted_seqlen at 0 (R6, before #28085): the SWA pages the books "
           "expect of positions [0, L) are more than the tail holds",
           _ts.consecution(twin(pop_preallocated=functools.partial(pop_preallocated, marks_tail=False)),
                           ["pop_preallocated"]),
           "pop_preallocated.keeps_accounting"),
        ob("pop_preallocated.d1_no_crash",
           "D1 over the transition: CORRECTED, from any state with valid requests and free pages >= 0 (implied by "
           "the accounting invariant), no request a pop_preallocated round admits finds its pages short",
           _d1("pop_preallocated", corrected=True)),
        ob("pop_preallocated.d1_no_crash.upstream",
           "UPSTREAM (unrounded, SWA budget decremented) a pop_preallocated round can admit a request whose pages "
           "do not fit (search narrowed to small numbers)",
           _d1("pop_preallocated", corrected=False), "pop_preallocated.d1_no_crash"),
        ob("decode.ceil_step",
           "for P >= 1, L >= 1: ceil((L+1)/P) == ceil(L/P) + 1 exactly when decoding position L opens a page "
           "((L+1) - 1 mod P == 0), else ceil(L/P) (instances are hypotheses of decode.keeps_accounting)",
           _ceil_step_check()),
        ob("decode.ceil_step.opens_at_seq_len",
           "a page-opening rule read at the new length ((L+1) mod P == 0 instead of (L+1) - 1) misses the "
           "page the token opens",
           _ceil_step_check(at_new_length=True), "decode.ceil_step"),
        ob("decode.keeps_accounting",
           "a decode step (all or nothing, window eviction, release of finished requests) keeps the accounting "
           "invariant",
           _decode_consecution(SYSTEM)),
        ob("decode.keeps_accounting.non_atomic_alloc_decode",
           "upstream's alloc_decode takes the full pages before it finds the SWA pool short (R7): the stalled "
           "batch leaks full pages",
           _decode_consecution(twin(decode=functools.partial(decode, atomic=False))),
           "decode.keeps_accounting"),
        ob("retract.keeps_accounting",
           "retract gives back exactly the pages the request holds and keeps the accounting invariant",
           _ts.consecution(SYSTEM, ["retract"])),
        ob("retract.keeps_accounting.swa_pages_by_length",
           "a retract that gives back ceil(L/P) SWA pages (as many as full pages, ignoring the tail and the "
           "eviction) frees SWA pages it does not hold",
           _ts.consecution(twin(retract=functools.partial(retract, swa_by_length=True)), ["retract"]),
           "retract.keeps_accounting"),
        ob("resume_retracted_reqs.keeps_accounting",
           "a resume round (any policy, crash or not) keeps the accounting invariant",
           _ts.consecution(SYSTEM, ["resume_retracted_reqs"])),
        ob("resume_retracted_reqs.keeps_accounting.mark_left_at_zero",
           "a resume whose _pre_alloc leaves the mark at 0 (R6) books SWA pages for positions the tail does not "
           "hold",
           _ts.consecution(twin(resume_retracted_reqs=functools.partial(resume_retracted_reqs, marks_tail=False)),
                           ["resume_retracted_reqs"]),
           "resume_retracted_reqs.keeps_accounting"),
        ob("resume_retracted_reqs.d1_no_crash",
           "D1 over the transition: CORRECTED, from any state with valid requests and free pages >= 0 (implied by "
           "the accounting invariant), no request a resume round admits finds its pages short",
           _d1("resume_retracted_reqs", corrected=True)),
        ob("resume_retracted_reqs.d1_no_crash.upstream",
           "UPSTREAM (unrounded, both budgets decremented) a resume round can admit a request whose pages do not "
           "fit (search narrowed to small numbers)",
           _d1("resume_retracted_reqs", corrected=False), "resume_retracted_reqs.d1_no_crash"),
    )


# ---- the obligations -------------------------------------------------------------------------


def _obligations() -> tuple[Obligation, ...]:
    sound = StepVariant()
    resume_off_by_one = ResumeVariant(resume_start=lambda v: floor_p_term(zmax(0, v.L - 1 - v.W), v.P))
    resume_late = ResumeVariant(resume_start=lambda v: floor_p_term(zmax(0, v.L + 1 - v.W), v.P))
    ceil_no_margin = EvictVariant(ceil=True, margin=False)
    return (
        _obligation(
            "pop_preallocated.d1_fresh_budget_within_free",
            "for any pool state, running/retracted aggregate, extra, R, W, P: both budgets of "
            "allocatable_token_budgets are at most their pool's free tokens (every reservation term is >= 0)",
            _within_free_build(True), _within_free_render(True),
        ),
        _obligation(
            "pop_preallocated.d1_fresh_budget_within_free.unclamped_growth",
            "without max(0, .) the SWA growth cap n_active*W - swa_used goes negative and the SWA budget "
            "exceeds the free SWA tokens",
            _within_free_build(False, shaped=2), _within_free_render(False, shaped=2), expect="counterexample",
            twin_of="pop_preallocated.d1_fresh_budget_within_free",
        ),
        _obligation(
            "pop_preallocated.d1_corrected_step",
            "CORRECTED: for any pool state, aggregate, R, W, P and request, passing the pop or resume gates against "
            "budgets computed from the pools implies ceil(A/P) <= free full pages and ceil(tail/P) <= free SWA "
            "pages (budgets are recomputed after every admission, so this covers every admission of a round)",
            _step_build(sound), _step_render(sound),
        ),
        _obligation(
            "pop_preallocated.d1_corrected_step.swa_len_from_prompt",
            "a gate that sizes the SWA tail from len(origin) (as _swa_payload does, R9) while _pre_alloc takes "
            "swa_tail_len(A) admits a resumed request whose tail needs more SWA pages",
            _step_build(StepVariant(swa_len_from_prompt=True), shaped=0),
            _step_render(StepVariant(swa_len_from_prompt=True), shaped=0),
            expect="counterexample", twin_of="pop_preallocated.d1_corrected_step",
        ),
        _obligation(
            "pop_preallocated.d1_corrected_step.unclamped_growth",
            "with the SWA growth cap unclamped (no max(0, .)) a CORRECTED admission can find the SWA pool short",
            _step_build(StepVariant(clamp_growth=False), shaped=1),
            _step_render(StepVariant(clamp_growth=False), shaped=1),
            expect="counterexample", twin_of="pop_preallocated.d1_corrected_step",
        ),
        _obligation(
            "pop_preallocated.d1_unrounded_recomputed",
            "unrounded requirements (A + R, tail + R) with budgets recomputed from page-granular pools still imply "
            "that both preallocations succeed: A + R <= F*P - (reservations >= 0) gives ceil(A/P) <= F",
            _step_build(StepVariant(rounded=False)), _step_render(StepVariant(rounded=False)),
        ),
        _obligation(
            "pop_preallocated.d1_unrounded_recomputed.token_granular_pool",
            "the same unrounded gate over free token counts that are not page multiples admits a request whose "
            "last page does not fit",
            _step_build(StepVariant(rounded=False, token_pool=True), shaped=2),
            _step_render(StepVariant(rounded=False, token_pool=True), shaped=2),
            expect="counterexample", twin_of="pop_preallocated.d1_unrounded_recomputed",
        ),
        _obligation(
            "pop_preallocated.d1_rounded_decremented_step",
            "a budget b <= F*P decremented by the page-rounded requirement ceil_P(n) + R after an admission with "
            "ceil_P(n) + R <= b: the allocation of ceil(n/P) pages succeeds and b' <= F'*P again (any round length)",
            _dec_build(True, None), _dec_render(True),
        ),
        _obligation(
            "pop_preallocated.d1_rounded_decremented_step.unrounded",
            "decremented by the unrounded n + R (UPSTREAM, R4) the budget can exceed the free tokens after an "
            "admission",
            _dec_build(False, None), _dec_render(False), expect="counterexample",
            twin_of="pop_preallocated.d1_rounded_decremented_step",
        ),
        _obligation(
            "pop_preallocated.d1_upstream_reserve_covers_rounding",
            "UPSTREAM's unrounded decrement n + R keeps b <= F*P and every admission's allocation succeeds when "
            "R >= P - 1 (the per-request reserve covers the ceil_P(n) - n <= P - 1 drift)",
            _dec_build(False, lambda v: v.R >= v.P - 1), _dec_render(False),
        ),
        _obligation(
            "pop_preallocated.d1_upstream_reserve_covers_rounding.reserve_p_minus_2",
            "R = P - 2 does not cover the drift of a request one token into its last page",
            _dec_build(False, lambda v: v.R == v.P - 2), _dec_render(False), expect="counterexample",
            twin_of="pop_preallocated.d1_upstream_reserve_covers_rounding",
        ),
        _obligation(
            "pop_preallocated.d1_corrected_round",
            "CORRECTED pop_preallocated with two queued requests, any pool state and aggregate: every admitted "
            "request's preallocation succeeds in both pools",
            _round_build(Policy.CORRECTED, empty=False, narrow=None, swa_crash=False),
            _round_render(Policy.CORRECTED, empty=False),
        ),
        _obligation(
            "pop_preallocated.d1_upstream_round",
            "UPSTREAM pop_preallocated (empty running batch, two queued requests, S2-sized search): both pass their "
            "gates with the decremented SWA budget but the second one's tail needs more SWA pages than remain free",
            _round_build(Policy.UPSTREAM, empty=True, narrow=_search_bounds, swa_crash=True),
            _round_render(Policy.UPSTREAM, empty=True), expect="counterexample",
            twin_of="pop_preallocated.d1_corrected_round",
        ),
        _obligation(
            "pop_preallocated.d1_s2_vector",
            "S2 (P=64, W=128, R=0, two 200-token prompts, 5 free SWA pages) under UPSTREAM: request 2 is admitted "
            "with 3 SWA pages needed and 2 free",
            _round_build(Policy.UPSTREAM, empty=True, narrow=_s2_facts, swa_crash=True),
            _round_render(Policy.UPSTREAM, empty=True), expect="counterexample",
            twin_of="pop_preallocated.d1_corrected_round",
        ),
        _obligation(
            "decode.d3_residency",
            "after _evict_swa at length L (page-aligned mark e <= max(0, L-1-W)), SWA residency [max(tail start, "
            "mark), L) lies in [floor_P(max(0, L-1-W-P)), L) (at most W + 2P positions), contains [L-W, L), and "
            "the new mark keeps the invariant",
            _residency_build(EvictVariant(), None, False), _residency_render(EvictVariant(), None),
        ),
        _obligation(
            "decode.d3_residency.ceil_without_margin",
            "evicting to ceil_P(max(e, L-1-W)) (ceil and no - P margin) releases SWA pages of window positions",
            _residency_build(ceil_no_margin, None, True), _residency_render(ceil_no_margin, None),
            expect="counterexample", twin_of="decode.d3_residency",
        ),
        _obligation(
            "decode.d3_residency.tail_sized_bound",
            "a running request can hold more than W + P - 1 SWA positions (the prealloc tail's bound) between "
            "evictions: up to W + 2P",
            _residency_build(EvictVariant(), lambda v: v.W + v.P - 1, True),
            _residency_render(EvictVariant(), lambda v: v.W + v.P - 1),
            expect="counterexample", twin_of="decode.d3_residency",
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_within_saved",
            "the resume tail [floor_P(max(0, L-W)), L) of a request retracted at L KV positions (right after "
            "prealloc or after an eviction at L) lies within its saved SWA rows and contains the window",
            _resume_build(ResumeVariant(), False), _resume_render(ResumeVariant()),
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_no_margin_floor",
            "finding: evicting to floor_P(max(e, L-1-W)) (without the - P margin) still keeps the resume tail "
            "within the saved SWA rows and the window resident: for D3 the margin is redundant given floor_P",
            _resume_build(ResumeVariant(evict=EvictVariant(margin=False)), False),
            _resume_render(ResumeVariant(evict=EvictVariant(margin=False))),
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_no_margin_floor.ceil",
            "with ceil_P instead of floor_P as well (ceil_P(max(e, L-1-W))) the resume tail starts before the saved "
            "rows: in-window positions get SWA slots without data",
            _resume_build(ResumeVariant(evict=ceil_no_margin), True),
            _resume_render(ResumeVariant(evict=ceil_no_margin)),
            expect="counterexample", twin_of="resume_retracted_reqs.d3_resume_no_margin_floor",
        ),
        _obligation(
            "resume_retracted_reqs.page_index_order",
            "for P >= 1 and integers a, b: a*P < b*P implies a < b (instances are hypotheses of "
            "resume_retracted_reqs.d3_resume_margin_ceil)",
            lambda: [z3.Int("P") >= 1, z3.Not(page_index_order(z3.Int("a"), z3.Int("b"), z3.Int("P")))],
            lambda m: f"P={as_int(m, z3.Int('P'))} a={as_int(m, z3.Int('a'))} b={as_int(m, z3.Int('b'))}",
        ),
        _obligation(
            "resume_retracted_reqs.page_index_order.zero_page",
            "without P >= 1 (P = 0 or negative) the order of page indices is not that of their positions",
            lambda: [z3.Not(page_index_order(z3.Int("a"), z3.Int("b"), z3.Int("P")))],
            lambda m: (f"P={as_int(m, z3.Int('P'))} a={as_int(m, z3.Int('a'))} b={as_int(m, z3.Int('b'))}: "
                       f"a*P < b*P but a >= b"),
            expect="counterexample", twin_of="resume_retracted_reqs.page_index_order",
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_margin_ceil",
            "finding: evicting to ceil_P(max(e, L-1-W-P)) (ceil, with the - P margin) also keeps the resume tail "
            "of a decoded request within the saved SWA rows: the margin absorbs the rounding (witness form)",
            _resume_build(ResumeVariant(evict=EvictVariant(ceil=True), witnesses=True), False),
            _resume_render(ResumeVariant(evict=EvictVariant(ceil=True), witnesses=True)),
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_margin_ceil.without_margin",
            "the same ceil_P eviction without the - P margin loses in-window rows (witness form)",
            _resume_build(ResumeVariant(evict=ceil_no_margin, witnesses=True), True),
            _resume_render(ResumeVariant(evict=ceil_no_margin, witnesses=True)),
            expect="counterexample", twin_of="resume_retracted_reqs.d3_resume_margin_ceil",
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_within_saved.resume_window_off_by_one",
            "a resume tail starting at floor_P(max(0, L-1-W)) (seqlen's window applied to L KV positions) can start "
            "a page before the prealloc tail of a request retracted before its first decode step",
            _resume_build(resume_off_by_one, True), _resume_render(resume_off_by_one),
            expect="counterexample", twin_of="resume_retracted_reqs.d3_resume_within_saved",
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_within_saved.resume_window_late",
            "a resume tail starting at floor_P(max(0, L+1-W)) misses the first window position",
            _resume_build(resume_late, True), _resume_render(resume_late),
            expect="counterexample", twin_of="resume_retracted_reqs.d3_resume_within_saved",
        ),
        _obligation(
            "resume_retracted_reqs.d3_resume_within_saved.copy_drops_last",
            "a retraction that saves positions [0, L-1) only (seqlen - 1 applied to L KV positions) loses the "
            "last in-window row",
            _resume_build(ResumeVariant(copy_drops_last=True), True),
            _resume_render(ResumeVariant(copy_drops_last=True)),
            expect="counterexample", twin_of="resume_retracted_reqs.d3_resume_within_saved",
        ),
    )


OBLIGATIONS: tuple[Obligation, ...] = _obligations() + _transition_obligations()
