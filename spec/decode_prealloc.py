"""``decode_prealloc``: D1 and D3 of the PD decode node's preallocation (sglang_semantics.md §2, §7 D1-D3, §9 S2).

Z3 terms mirroring ``kvproof.reference.decode_prealloc`` (tail mode, ``P >= 2``) over
symbolic integers: the requirements of ``prealloc_required_tokens`` (unrounded under
``UPSTREAM``, page-rounded under ``CORRECTED``, §2.3, R4), the full and SWA budgets of
``allocatable_token_budgets`` (§2.4: ``reserved = R * n_active``, the "can finish"
term ``need``, the SWA growth cap ``min(reserved, max(0, n_active * W - swa_used))``,
the retracted queue), the gates of ``admission_gate`` / ``resume_retracted_reqs``
(§2.5), what ``_pre_alloc`` takes (``ceil(A/P)`` full pages, ``ceil(tail/P)`` SWA
pages, §2.6, §2.7), the eviction mark of ``_evict_swa`` (§1.6) and the resume tail.
``tests/spec/test_decode_prealloc.py`` evaluates the builders on concrete integers
and compares them with the reference (drift test).

Pools are page-granular: a pool with ``F`` free pages has ``F * P`` free tokens. The
running batch enters the budgets only through its aggregate (:class:`Batch`: count,
``retractable``, ``retractable_swa``, ``need``, ``need_swa``, the retracted queue's
summed requirements, SWA pages in use); the D1 proofs leave the aggregate symbolic
(any integers, ``need``/``need_swa`` of any sign), so they hold for every running
batch and retracted queue, and ``extra`` (other active requests: SGLang's transfer and
waiting queues) is any count ``>= 0``.

D1 (admitted => ``_pre_alloc`` succeeds, §7):

* ``pop_preallocated.d1_fresh_budget_within_free``: a budget computed from the pools never exceeds
  the free tokens of its pool (every reservation term is ``>= 0``);
* ``pop_preallocated.d1_corrected_step``: under ``CORRECTED``, for any pool state, aggregate, ``R``,
  ``W``, ``P`` and request, passing the gates (``pop_preallocated``'s, with the can-finish
  clauses, or ``resume_retracted_reqs``'s) against budgets computed from that pool state
  implies ``ceil(A/P) <= free full pages`` and ``ceil(tail/P) <= free SWA pages``.
  ``CORRECTED`` recomputes both budgets from the actual pools after every admission
  (``_refresh``), so every admission of a round, and of a resume, is such a step: the
  one-step lemma covers rounds of any length. ``pop_preallocated.d1_corrected_round`` checks an explicit
  two-admission round anyway;
* ``pop_preallocated.d1_unrounded_recomputed`` (finding): the page rounding is not what makes
  ``CORRECTED`` sound. With unrounded requirements and recomputed budgets D1 still holds,
  because ``A + R <= budget <= F * P`` already implies ``ceil(A/P) <= F`` on a
  page-granular pool (twin: a token-granular free count);
* ``pop_preallocated.d1_rounded_decremented_step`` (finding): nor is the recomputation. A budget ``b``
  with ``b <= F * P`` (true of a fresh one) decremented by the *page-rounded*
  requirement stays ``<= F' * P`` after the allocation, so by induction every admission
  of a round passes (for the SWA budget of ``pop_preallocated`` and both budgets of
  ``resume_retracted_reqs``);
* ``pop_preallocated.d1_upstream_reserve_covers_rounding`` (finding): even ``UPSTREAM``'s unrounded
  decrement keeps ``b <= F * P`` when ``R >= P - 1``: the decrement ``n + R`` covers the
  ``ceil_P(n) - n <= P - 1`` drift. S2 needs ``R = 0``; SGLang's default ``R = 512``
  covers every page size up to 513;
* ``pop_preallocated.d1_upstream_round`` / ``pop_preallocated.d1_s2_vector``: an ``UPSTREAM`` round (empty running batch,
  two queued requests, search narrowed to S2-sized numbers) in which both requests
  pass their gates with the decremented SWA budget but the second one's tail needs
  more SWA pages than remain free; and S2's exact numbers (P=64, W=128, R=0, two
  200-token prompts, 5 free SWA pages), a concrete witness.

D3 (residency, §1.6, §2.8, §7):

* ``decode.d3_residency``: after ``_evict_swa`` at length ``L`` (mark
  ``floor_P(max(e, L - 1 - W - P))`` from a page-aligned mark ``e <= max(0, L - 1 - W)``,
  the invariant this obligation re-establishes at ``L``; the prealloc tail starts at
  ``A - swa_tail_len(A)``), the SWA-resident positions ``[max(tail start, mark), L)``
  lie in ``[floor_P(max(0, L - 1 - W - P)), L)`` (so at most ``W + 2P`` of them) and
  contain the window ``[L - W, L)``;
* ``resume_retracted_reqs.d3_resume_within_saved``: the tail a request of ``L`` KV positions gets on resume,
  ``[floor_P(max(0, L - W)), L)``, lies within the positions still SWA-resident at its
  retraction (right after prealloc or after an eviction at ``L``) and contains the
  window, so ``load_cpu_copy`` restores every in-window row and leaves no resumed SWA
  slot without data (``New ⊆ Old``, §2.8). Here ``L`` counts KV positions (the
  reference's ``len(slots)``); §2.8's ``floor_P(L - 1 - W)`` writes the same start with
  ``L = seqlen = KV positions + 1``.

The per-request SWA saving of tail preallocation (``ceil(tail/P)`` pages against
``ceil(L/P)`` before, at most ``ceil((W-1)/P) + 1``) is ``swa_tail.saving`` of
component ``swa_allocator``; it is not repeated here.

Queries are quantifier-free linear-plus-products Int arithmetic; every page-aligned
value is a product ``k * P`` with an explicit witness ``k`` (see
``terms.part2_pages_term``).
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec._solver import Obligation, as_bool, as_int
from kvproof.spec.terms import IntLike, ceil_div_term, ceil_p_term, floor_p_term, lift, swa_tail_term, zmax, zmin

__all__ = [
    "OBLIGATIONS",
    "Policy",
    "Knobs",
    "Req",
    "Pools",
    "Batch",
    "Budgets",
    "Gate",
    "fill_len_term",
    "clipped_term",
    "prealloc_kv_lens_terms",
    "required_tokens_terms",
    "swa_retractable_len_term",
    "batch_terms",
    "budgets_terms",
    "admission_gate_terms",
    "resume_gate_terms",
    "prealloc_pages_terms",
    "evict_mark_term",
    "resident_low_term",
    "resume_tail_start_term",
    "RoundVars",
    "round_values",
    "S2",
]

COMPONENT = "decode_prealloc"
FAMILY = "decode_prealloc"


class Policy(str, enum.Enum):
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
    def of(P: int, W: int, R: int, CLIP: int) -> Knobs:  # noqa: N803
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
                  clamp_growth: bool = True) -> Budgets:
    """``allocatable_token_budgets`` (§2.4) with ``n_active = n_running + extra``.

    ``clamp_growth=False`` is a broken twin: the SWA growth cap without ``max(0, .)``.
    """
    n_active = batch.n_running + lift(extra)
    reserved = k.R * n_active
    full = pools.free_full * k.P - zmax(reserved, batch.need)
    growth = n_active * k.W - pools.used_swa * k.P
    if clamp_growth:
        growth = zmax(0, growth)
    swa = pools.free_swa * k.P - zmax(zmin(reserved, growth), batch.need_swa)
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


def evict_mark_term(mark: IntLike, length: IntLike, W: IntLike, P: IntLike, *,  # noqa: N803
                    ceil: bool = False, margin: bool = True) -> z3.ArithRef:
    """``_evict_swa``'s new mark ``floor_P(max(e, L - 1 - W - P))`` (twins: ``ceil_P``, no ``- P``)."""
    x = zmax(mark, lift(length) - 1 - lift(W) - (lift(P) if margin else 0))
    return ceil_p_term(x, P) if ceil else floor_p_term(x, P)


def resident_low_term(length: IntLike, W: IntLike, P: IntLike) -> z3.ArithRef:  # noqa: N803
    """D3's lower bound of SWA residency, ``floor_P(max(0, L - 1 - W - P))`` (``check_node``)."""
    return floor_p_term(zmax(0, lift(length) - 1 - lift(W) - lift(P)), P)


def resume_tail_start_term(length: IntLike, W: IntLike, P: IntLike) -> z3.ArithRef:  # noqa: N803
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
    res_b = budgets_terms(k, v.pools, v.batch, v.extra, count_retracted=False, clamp_growth=variant.clamp_growth)
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
    """Twin: the budgets of §2.4 over free *token* counts ``free_full`` / ``free_swa`` (not pages)."""
    n_active = v.batch.n_running + v.extra
    reserved = k.R * n_active
    full = v.pools.free_full - zmax(reserved, v.batch.need)
    swa = v.pools.free_swa - zmax(zmin(reserved, zmax(0, n_active * k.W - v.pools.used_swa * k.P)),
                                  v.batch.need_swa)
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
        b_no = budgets_terms(v.k, v.pools, v.batch, v.extra, count_retracted=False, clamp_growth=clamp_growth)
        full, swa = z3.If(cr, b_yes.full, b_no.full), z3.If(cr, b_yes.swa, b_no.swa)
        within = z3.And(full <= v.pools.free_full * v.k.P, swa <= v.pools.free_swa * v.k.P)
        return _facts(v.hypotheses(), [] if shaped is None else v.small(), z3.Not(within))

    return build


def _within_free_render(clamp_growth: bool, *, shaped: int | None = None) -> Callable[[z3.ModelRef], str]:
    def render(m: z3.ModelRef) -> str:
        v = StepVars.fresh(shaped=shaped)
        cr = as_bool(m, z3.Bool("count_retracted"))
        b = budgets_terms(v.k, v.pools, v.batch, v.extra, count_retracted=cr, clamp_growth=clamp_growth)
        n_active = v.batch.n_running + v.extra
        growth = n_active * v.k.W - v.pools.used_swa * v.k.P
        P, ff, fs = as_int(m, v.k.P), as_int(m, v.pools.free_full), as_int(m, v.pools.free_swa)  # noqa: N806
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
        P, F, b, r, k = (as_int(m, x) for x in (v.P, v.F, v.b, req, pages))  # noqa: N806
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
    return [k.P == S2["P"], k.W == S2["W"], k.R == S2["R"], k.CLIP == S2["CLIP"],
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
        return ResidencyVars(*z3.Ints("P W A L j"), z3.Bool("never_decoded"))

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
        P, W, A, L, e, ts = (as_int(m, t) for t in (v.P, v.W, v.A, v.L, v.e, v.tail_start))  # noqa: N806
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
        P, W, A, L, e = (as_int(m, t) for t in (v.P, v.W, v.A, v.L, v.e))  # noqa: N806
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
            _round_render(Policy.UPSTREAM, empty=True), expect="counterexample", twin_of="pop_preallocated.d1_corrected_round",
        ),
        _obligation(
            "pop_preallocated.d1_s2_vector",
            "S2 (P=64, W=128, R=0, two 200-token prompts, 5 free SWA pages) under UPSTREAM: request 2 is admitted "
            "with 3 SWA pages needed and 2 free",
            _round_build(Policy.UPSTREAM, empty=True, narrow=_s2_facts, swa_crash=True),
            _round_render(Policy.UPSTREAM, empty=True), expect="counterexample", twin_of="pop_preallocated.d1_corrected_round",
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
            _resume_build(ResumeVariant(evict=ceil_no_margin), True), _resume_render(ResumeVariant(evict=ceil_no_margin)),
            expect="counterexample", twin_of="resume_retracted_reqs.d3_resume_no_margin_floor",
        ),
        _obligation(
            "resume_retracted_reqs.page_index_order",
            "for P >= 1 and integers a, b: a*P < b*P implies a < b (instances are hypotheses of resume_retracted_reqs.d3_resume_margin_ceil)",
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


OBLIGATIONS: tuple[Obligation, ...] = _obligations()
