"""``tp_prefetch``: cross-rank sidecar hit sync and all-or-nothing SWA prefetch (PR #27264; sglang_semantics.md §6.1-
§6.7, §7 T1-T5, §8 item 9, §9 S10; upstream_0523_vllm_fuzz.md §2 for SGLang 0.5.23; sglang-findings.md D1-D4, F6 for
its hit-time staging).

The model mirrors ``kvproof.reference.tp_prefetch`` operation by operation, over ``RANKS = 8`` rank slots of which
the first ``N`` (1..8) are active. All lengths are whole pages (the key is page-aligned); ``P`` only turns them into
tokens in the texts.

**State** (:class:`State`): the constants (``P``; ``sw`` = ``ceil(W / P)`` window pages; ``R`` request pages; ``N``;
whether the anchor is the root; the host path before the prefetch: up to two nodes along the key, ``e1``/``e2``
pages, with or without an SWA host value), each rank's inputs (constants, the reference's ``RankProgress``: storage
``hit``, Full pages loaded ``full``, IO ``done``, deadline ``dl``, policy ``pol`` (0 best_effort, 1 wait_complete,
2 timeout), its transfer set (``swa``, ``mamba``), the first window-buffer page whose SWA fetch fails
``first_miss`` (``n``: none), ``mamba_ok``, ``reg``, and 0.5.23's Full host pages free at hit time ``hfree``
(``host_free_pages``; 0: enough, the reference's ``None``)), the phase, which collective mismatched (``mism``),
whether a collective reduced different pools' slots together (``mix``), and per rank what each operation derived:
the synced hit ``H``, the Full pages ``staged`` for the prefetch and the SWA ``window`` buffer pages (the
reference's ``RankState.staged`` / ``window``: ``R`` and the window keys from the start before 0.5.23, set at hit
time in 0.5.23), completed pages ``C``, whether the sidecar step ran (``reach``), the recorded SWA / Mamba counts
``cnt`` / ``mcnt``, SWA writes in flight ``infl``, IO finished ``fin``, ``go`` (terminates now), the completed count
the insert uses ``M``, the SWA / Mamba counts the commit reads ``S`` / ``Sm``, ``tdone`` (pool transfers done), and
the result: inserted up to ``total`` pages, ``attach``, ``disc`` (0.5.23 discard), ``hazard`` (a window page released
by the scheduler while its IO thread writes it), ``prefix`` (pages already present) and the split points
``ins_split`` / ``swa_split`` (pages; ``-1``: none). The action of ``page_transfer`` is each rank's number of
successful SWA fetches among its keys (``succ``): the sum that #27264 counts, constrained by ``first_miss``.

**0.5.23's staging** (the reference's ``staged_pages`` / ``swa_buffer_pages`` / ``rank_target``): after the hit
query a synced hit of 0 pages revokes the check on every rank (phase ``revoked``: no IO, no collective, no commit;
D2); otherwise each rank stages ``min(H, hfree)`` Full pages (F6: a rank short of host pages truncates its own
length after the sync) and a window buffer of ``min(window keys, H)`` pages (D1); its IO thread's target is
``min(H, staged)``, which the all-or-nothing check compares ``M`` with. ``reduce_prefetch_ack`` reduces nothing while
some rank's IO is in flight (D3: every rank reads 0 completed and no pool result).

**Transitions** (:data:`SYSTEMS`, one per variant; named like the reference's operations):
:func:`sync_prefetch_hit_query`, :func:`page_transfer`, :func:`can_terminate_prefetch`,
:func:`reduce_prefetch_ack`, :func:`handle_prefetch_result`; each is the builder of the same name applied to
the pre-state (guard: the phase it runs at, so nothing runs after ``revoked``, ``waiting`` or ``mismatched``).
``tests/spec/test_drift_tp_prefetch.py`` checks that each accepts the steps of seeded reference runs. The model covers
one check from the start; a continued check (the reference's ``initial_state(..., continues=...)``) is not modelled.

**Obligations** (``tp_prefetch.<op>.<claim>``; a twin appends what it breaks): the whole check is composed from the
builders (:func:`run`) for any per-rank progress vector of up to 8 ranks:

* ``sync_prefetch_hit_query.same_hit`` (twin ``.no_sync``): every rank loads against one synced hit, at most its own;
  ``sync_prefetch_hit_query.aligned_0523`` (twin ``.transfer_sets_differ``: 0.5.23 keeps T5 in the hit query);
  ``sync_prefetch_hit_query.revoke_agreed_0523`` (D2: every rank revokes or none, nothing staged; twin ``.no_sync``);
* ``page_transfer.sidecars_after_full`` / ``sidecars_after_full_0523`` (T3: SWA hits are recorded only once every Full
  page up to the rank's target completed; twins ``.no_full_guard``);
* ``can_terminate_prefetch.agreed`` / ``agreed_0523``: one policy on every rank => the vote lines up and every rank
  makes the same decision (twins ``.mixed_policies``: a mismatched vote; in 0.5.23 no collective sees it and one
  rank commits while another waits);
* ``reduce_prefetch_ack.aligned`` (T5; twins ``.transfer_sets_differ`` = S10's shape case, ``.same_shape_other_pool``:
  SWA and Mamba slots reduced together), ``reduce_prefetch_ack.fixed_layout_0523`` (the ``PoolName`` packing lines
  up whatever non-empty sets the ranks built; twin ``.comp_xfers_order``);
* ``handle_prefetch_result.same_tree`` / ``same_tree_0523`` (T1: the same full prefix, attach decision and split
  points; 0.5.23 without host pressure; twins ``.pre_27264`` = S10, ``.no_pool_sync``, ``.host_pressure`` = F6),
  ``handle_prefetch_result.full_slots_conserved`` (T4, Full host pages; twin ``.max_reduce``),
  ``handle_prefetch_result.no_write_after_release_0523`` (R5-d; twins ``.best_effort_release``, ``.upstream_27264``,
  ``.upstream_27264_any_terminated``: a model finding from §6.3's vote, to confirm on the real code);
* ``commit_prefetch.whole_window`` / ``whole_window_0523`` (T2; 0.5.23 without host pressure; twins ``.pre_27264``,
  ``.partial_window``, ``.host_pressure``: a rank short of host pages shrinks its window buffer to its keys and
  attaches it at the root while the others did not fetch theirs whole),
  ``commit_prefetch.short_hit_at_root_0523`` (D1: at the root a hit shorter than the window is a whole window, attached
  on every rank; twin ``.staged_at_start``),
  ``commit_prefetch.aligned_window`` (T3; twin ``.pre_27264_s10``: tokens 320-447 get the SWA of 512-639),
  ``commit_prefetch.swa_slots_conserved`` (T4, the walk over any host path; twins ``.no_prefix_release``,
  ``.split_at_absolute_offset``);
* ``count_pool_hits.synced_prefix_fetched`` (R5-c: the MIN of leading runs is a prefix every rank fetched; twin
  ``.sum``) and ``count_pool_hits.all_or_nothing_agrees`` (sum and leading run agree on "all keys arrived", so R5-c
  is harmless for SWA; twin ``.prefix_reading``).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import z3

from kvproof.spec import _ts
from kvproof.spec._solver import Obligation, as_bool, as_int, fmt_bools
from kvproof.spec.terms import zmax, zmin

__all__ = [
    "OBLIGATIONS",
    "RANKS",
    "S10",
    "SYSTEM",
    "SYSTEMS",
    "SYSTEMS_BY_VARIANT",
    "Action",
    "Run",
    "State",
    "Twist",
    "Variant",
    "can_terminate_prefetch",
    "handle_prefetch_result",
    "init",
    "page_transfer",
    "reduce_prefetch_ack",
    "run",
    "sync_prefetch_hit_query",
    "system",
]

COMPONENT = "tp_prefetch"
FAMILY = "tp_prefetch"
RANKS = 8
BE, WC, TO = 0, 1, 2
POLICIES = ("best_effort", "wait_complete", "timeout")
STARTED, QUERIED, TRANSFERRED, DECIDED, REDUCED, COMMITTED, WAITING, MISMATCHED, REVOKED = range(9)
PHASES = ("started", "queried", "transferred", "decided", "reduced", "committed", "waiting", "mismatched", "revoked")
AT_HIT_QUERY, AT_VOTE, AT_REDUCE = 1, 2, 3
COLLECTIVES = ("", "sync_prefetch_hit_query", "can_terminate_prefetch", "reduce_prefetch_ack")
POOLS = 3  # 0.5.23's pool slots: kv, mamba, swa


class Variant(enum.StrEnum):
    """The reference's ``TPPrefetchVariant`` (same values)."""

    PRE_27264 = "pre_27264"
    UPSTREAM_27264 = "upstream_27264"
    UPSTREAM_0523 = "upstream_0523"
    SUM_HITS = "sum_hits"
    BEST_EFFORT_RELEASE = "best_effort_release"

    @property
    def protocol_0523(self) -> bool:
        return self in (Variant.UPSTREAM_0523, Variant.SUM_HITS, Variant.BEST_EFFORT_RELEASE)

    @property
    def leading_run(self) -> bool:
        return self in (Variant.UPSTREAM_0523, Variant.BEST_EFFORT_RELEASE)


@dataclass(frozen=True)
class Twist:
    """A broken twin's change to a variant (the defaults are the variant itself)."""

    no_hit_sync: bool = False  # each rank loads against its own storage hit
    max_reduce: bool = False  # the packed MIN replaced by MAX
    partial_window: bool = False  # the commit attaches on a synced count >= 1
    no_pool_sync: bool = False  # 0.5.23: the pool-hit ACK not reduced (rank-local counts)
    no_full_guard: bool = False  # the IO thread fetches the sidecars whether or not every Full page completed
    staged_at_start: bool = False  # 0.5.23 staging R Full pages and the whole window before the hit, no revoke
    ack_in_flight: bool = False  # 0.5.23 reducing the ACKs while an IO thread is in flight (the drift test's, D3)


SOUND = Twist()

Ints = tuple[z3.ArithRef, ...]
Bools = tuple[z3.BoolRef, ...]


# ---- state and action ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class State:
    """Constants, each rank's inputs (constants), the phase and each rank's derived values (module docstring)."""

    P: z3.ArithRef
    sw: z3.ArithRef
    R: z3.ArithRef
    N: z3.ArithRef
    root: z3.BoolRef
    e1: z3.ArithRef
    e2: z3.ArithRef
    s1: z3.BoolRef
    s2: z3.BoolRef
    hit: Ints
    full: Ints
    done: Bools
    dl: Bools
    pol: Ints
    swa: Bools
    mamba: Bools
    first_miss: Ints
    mamba_ok: Bools
    reg: Bools
    hfree: Ints
    phase: z3.ArithRef
    mism: z3.ArithRef
    mix: z3.BoolRef
    H: Ints
    staged: Ints
    window: Ints
    C: Ints
    reach: Bools
    cnt: Ints
    mcnt: Ints
    infl: Bools
    fin: Bools
    go: Bools
    M: Ints
    S: Ints
    Sm: Ints
    tdone: Bools
    total: Ints
    attach: Bools
    disc: Bools
    hazard: Bools
    prefix: Ints
    ins_split: Ints
    swa_split: Ints

    @staticmethod
    def inputs() -> dict[str, object]:
        """The constants and the rank inputs: the same symbols in every state."""
        def ints(name: str) -> Ints:
            return tuple(z3.Int(f"{name}[{r}]") for r in range(RANKS))

        def bools(name: str) -> Bools:
            return tuple(z3.Bool(f"{name}[{r}]") for r in range(RANKS))

        return {"P": z3.Int("P"), "sw": z3.Int("sw"), "R": z3.Int("R"), "N": z3.Int("N"), "root": z3.Bool("root"),
                "e1": z3.Int("e1"), "e2": z3.Int("e2"), "s1": z3.Bool("s1"), "s2": z3.Bool("s2"),
                "hit": ints("hit"), "full": ints("full"), "done": bools("done"), "dl": bools("dl"),
                "pol": ints("pol"), "swa": bools("swa"), "mamba": bools("mamba"), "first_miss": ints("first_miss"),
                "mamba_ok": bools("mamba_ok"), "reg": bools("reg"), "hfree": ints("hfree")}

    @staticmethod
    def fresh(tag: str) -> State:
        """Derived variables ``name[r]@tag``; the inputs are shared constants."""
        def ints(name: str) -> Ints:
            return tuple(z3.Int(f"{name}[{r}]@{tag}") for r in range(RANKS))

        def bools(name: str) -> Bools:
            return tuple(z3.Bool(f"{name}[{r}]@{tag}") for r in range(RANKS))

        derived: dict[str, object] = {"phase": z3.Int(f"phase@{tag}"), "mism": z3.Int(f"mism@{tag}"),
                                      "mix": z3.Bool(f"mix@{tag}")}
        for name in _INT_FIELDS:
            derived[name] = ints(name)
        for name in _BOOL_FIELDS:
            derived[name] = bools(name)
        return State(**State.inputs(), **derived)  # type: ignore[arg-type]

    @staticmethod
    def initial(v: Variant) -> State:
        """The state before any operation (the obligations' start): the derived values as literals, but before 0.5.23
        each registered rank's ``staged`` / ``window`` (allocated at the start: the reference's ``initial_state``)."""
        zero, false = (z3.IntVal(0),) * RANKS, (z3.BoolVal(False),) * RANKS
        derived: dict[str, object] = {"phase": z3.IntVal(STARTED), "mism": z3.IntVal(0), "mix": z3.BoolVal(False)}
        for name in _INT_FIELDS:
            derived[name] = tuple(z3.IntVal(-1) for _ in range(RANKS)) if name in _SPLITS else zero
        for name in _BOOL_FIELDS:
            derived[name] = false
        start = State(**State.inputs(), **derived)  # type: ignore[arg-type]
        return start if v.protocol_0523 else _staging(v, start, [z3.IntVal(0)] * RANKS)


_INT_FIELDS = ("H", "staged", "window", "C", "cnt", "mcnt", "M", "S", "Sm", "total", "prefix", "ins_split", "swa_split")
_BOOL_FIELDS = ("reach", "infl", "fin", "go", "tdone", "attach", "disc", "hazard")
_SPLITS = ("ins_split", "swa_split")


@dataclass(frozen=True)
class Action:
    """``page_transfer``'s argument: each rank's successful SWA fetches among its keys."""

    succ: Ints

    @staticmethod
    def fresh(tag: str) -> Action:
        return Action(tuple(z3.Int(f"succ[{r}]@{tag}") for r in range(RANKS)))


# ---- helpers ---------------------------------------------------------------------------------------------------


def active(s: State, r: int) -> z3.BoolRef:
    return z3.IntVal(r) < s.N


def _fold(values: Sequence[z3.ArithRef], mask: Sequence[z3.BoolRef], pick: Callable[[z3.ArithRef, z3.ArithRef],
                                                                                    z3.ArithRef]) -> z3.ArithRef:
    """``pick`` (zmin / zmax) over the values whose mask holds (0 when none does)."""
    acc: z3.ArithRef = z3.IntVal(0)
    seen: z3.BoolRef = z3.BoolVal(False)
    for v, m in zip(values, mask, strict=True):
        acc = z3.If(m, z3.If(seen, pick(acc, v), v), acc)
        seen = z3.Or(seen, m)
    return acc


def _min(values: Sequence[z3.ArithRef], mask: Sequence[z3.BoolRef]) -> z3.ArithRef:
    return _fold(values, mask, zmin)


def _all_equal(values: Sequence[z3.ExprRef], mask: Sequence[z3.BoolRef]) -> z3.BoolRef:
    """Every masked value equals rank 0's (the masks are the active ranks: rank 0 is active, ``N >= 1``)."""
    return z3.And([z3.Implies(mask[r], values[r] == values[0]) for r in range(1, RANKS)])


def window_pages(v: Variant, s: State, r: int) -> z3.ArithRef:
    """The rank's SWA window keys before the hit (the reference's ``window_pages``; #34798: 0.5.23 at the root with a
    request shorter than the window, the request)."""
    n = z3.If(s.sw > s.R, s.R, s.sw) if v.protocol_0523 else s.sw
    return z3.If(s.swa[r], n, 0)


def _staged_at_hit(v: Variant, tw: Twist) -> bool:
    return v.protocol_0523 and not tw.staged_at_start


def staged_pages(v: Variant, s: State, r: int, hit: z3.ArithRef, tw: Twist = SOUND) -> z3.ArithRef:
    """The Full host pages the rank stages (the reference's ``staged_pages``): ``R`` before 0.5.23; 0.5.23
    ``min(hit, hfree)`` (``allow_partial``, F6); 0 on a rank that never registered."""
    n = z3.If(s.hfree[r] == 0, hit, zmin(hit, s.hfree[r])) if _staged_at_hit(v, tw) else s.R
    return z3.If(s.reg[r], n, 0)


def swa_buffer_pages(v: Variant, s: State, r: int, hit: z3.ArithRef, tw: Twist = SOUND) -> z3.ArithRef:
    """The rank's SWA window-buffer pages (the reference's ``swa_buffer_pages``): the window keys before 0.5.23;
    0.5.23 ``min(window keys, hit)`` (``_alloc_prefetch_aux_staging``, D1); 0 on a rank that never registered."""
    n = window_pages(v, s, r)
    return z3.If(s.reg[r], zmin(n, hit) if _staged_at_hit(v, tw) else n, 0)


def _staging(v: Variant, s: State, hits: Sequence[z3.ArithRef], tw: Twist = SOUND,
             ended: z3.BoolRef | None = None) -> State:
    """Every active rank's ``staged`` / ``window`` against its synced hit (none where the check ``ended``)."""
    def at(value: Callable[[int], z3.ArithRef]) -> Callable[[int], z3.ArithRef]:
        return value if ended is None else lambda r: z3.If(ended, 0, value(r))

    return dataclasses.replace(s, staged=_ranks(s, "staged", at(lambda r: staged_pages(v, s, r, hits[r], tw))),
                               window=_ranks(s, "window", at(lambda r: swa_buffer_pages(v, s, r, hits[r], tw))))


def rank_target(s: State, r: int) -> z3.ArithRef:
    """The Full pages the rank's IO thread fetches (the reference's ``rank_target``): the synced hit, or fewer where
    0.5.23 staged fewer (F6)."""
    return zmin(s.H[r], s.staged[r])


def keys_swa(s: State, r: int) -> z3.ArithRef:
    """SWA keys: the last ``min(window, target)`` hashes once the sidecar step runs, else ``window`` placeholders."""
    n = s.window[r]
    return z3.If(s.reach[r], zmin(n, rank_target(s, r)), n)


def _per_rank(s: State, r: int, new: z3.ExprRef, field: str) -> z3.ExprRef:
    """``new`` for an active rank; an inactive slot keeps its value."""
    return z3.If(active(s, r), new, getattr(s, field)[r])


def _ranks(s: State, field: str, make: Callable[[int], z3.ExprRef]) -> tuple[z3.ExprRef, ...]:
    return tuple(_per_rank(s, r, make(r), field) for r in range(RANKS))


def valid_inputs(v: Variant, s: State) -> list[z3.BoolRef]:
    """What ``initial_state`` and the reference's config / progress models accept."""
    facts = [s.P >= 1, s.sw >= 1, s.R >= 1, s.N >= 1, s.N <= RANKS, s.e1 >= 0, s.e2 >= 0,
             z3.Implies(s.e2 > 0, s.e1 > 0), s.e1 + s.e2 <= s.R, z3.Implies(s.e1 == 0, z3.Not(s.s1)),
             z3.Implies(s.e2 == 0, z3.Not(s.s2)), z3.Or([z3.And(active(s, r), s.reg[r]) for r in range(RANKS)])]
    for r in range(RANKS):
        swa_ok = z3.Or(s.sw <= s.R, s.root) if v.protocol_0523 else s.sw <= s.R
        facts.append(z3.Implies(active(s, r), z3.And(
            s.hit[r] >= 0, s.hit[r] <= s.R, s.full[r] >= 0, s.full[r] <= s.R, s.pol[r] >= 0, s.pol[r] <= 2,
            s.first_miss[r] >= 0, s.first_miss[r] <= window_pages(v, s, r), z3.Implies(s.swa[r], swa_ok),
            s.hfree[r] >= 0 if v.protocol_0523 else s.hfree[r] == 0)))
    return facts


def init(s: State, v: Variant = Variant.UPSTREAM_27264) -> z3.BoolRef:
    """``initial_state``: valid inputs, nothing derived yet (before 0.5.23: but the staging, :meth:`State.initial`)."""
    start = State.initial(v)
    return z3.And(*valid_inputs(v, s), *[a == b for a, b in zip(_ts.terms_of(s), _ts.terms_of(start), strict=True)
                                         if not a.eq(b)])


# ---- the operations: builders (the reference's functions over terms) -------------------------------------------


def sync_prefetch_hit_query_terms(v: Variant, s: State, tw: Twist = SOUND) -> State:
    """The storage-hit MIN: every registered rank calls it; #27264 era ``[hit]``, 0.5.23 ``R + 1`` flags (a rank
    with a sidecar transfer) or ``[hit]``, plus 3 pool verdicts. Mismatch: a rank that never registered, or two
    shapes. The synced hit is the MIN (0.5.23's flags over contiguous storage give the same). 0.5.23 then stages at
    hit time (:func:`_staging`), or revokes the check on every rank when the synced hit is 0 (D2)."""
    act = [active(s, r) for r in range(RANKS)]
    if v.protocol_0523:
        shape = [z3.If(z3.Or(s.swa[r], s.mamba[r]), s.R + 1, 1) + POOLS for r in range(RANKS)]
    else:
        shape = [z3.IntVal(1)] * RANKS
    mism = z3.Not(z3.And(z3.And([z3.Implies(act[r], s.reg[r]) for r in range(RANKS)]), _all_equal(shape, act)))
    low = _min(s.hit, act)
    hits = _ranks(s, "H", lambda r: z3.If(mism, 0, s.hit[r] if tw.no_hit_sync else low))
    post = dataclasses.replace(s, H=hits, phase=z3.If(mism, MISMATCHED, QUERIED), mism=z3.If(mism, AT_HIT_QUERY, 0))
    if not v.protocol_0523:
        return post  # staged at the start (State.initial)
    revoked = z3.BoolVal(False) if tw.staged_at_start else z3.And(
        z3.Not(mism), *[z3.Implies(act[r], hits[r] == 0) for r in range(RANKS)])
    return dataclasses.replace(_staging(v, post, hits, tw, z3.Or(mism, revoked)),
                               phase=z3.If(mism, MISMATCHED, z3.If(revoked, REVOKED, QUERIED)))


def page_transfer_terms(v: Variant, s: State, a: Action, tw: Twist = SOUND) -> tuple[State, list[z3.BoolRef]]:
    """Each rank's IO thread (the reference's ``rank_page_transfer``): Full pages up to its target, then the sidecars;
    and what ``succ`` may be. 0.5.23 re-aligns the SWA keys to the target and shrinks a longer window buffer to them
    (``_sync_trailing_keys``: only a rank that staged fewer pages than the window, F6)."""
    facts: list[z3.BoolRef] = []
    C, reach, cnt, mcnt, infl, fin, win = [], [], [], [], [], [], []
    for r in range(RANKS):
        target = rank_target(s, r)
        c = zmin(s.full[r], target)
        rch = s.reg[r] if tw.no_full_guard else z3.And(s.reg[r], c == target)
        k = zmin(s.window[r], target)
        lead = zmin(s.first_miss[r], k)
        facts.append(z3.Implies(active(s, r), z3.And(a.succ[r] >= lead, a.succ[r] <= k,
                                                      (a.succ[r] == k) == (s.first_miss[r] >= k))))
        count = lead if v.leading_run else a.succ[r]
        C.append(c)
        reach.append(rch)
        cnt.append(z3.If(z3.And(rch, s.swa[r], s.done[r]), count, 0))
        mcnt.append(z3.If(z3.And(rch, s.mamba[r], s.done[r]), z3.If(z3.And(s.mamba_ok[r], target >= 1), 1, 0), 0))
        infl.append(z3.And(rch, s.swa[r], z3.Not(s.done[r]), a.succ[r] >= 1))
        fin.append(z3.Or(s.done[r], z3.And(rch, z3.Not(s.swa[r]), z3.Not(s.mamba[r]))))
        win.append(z3.If(z3.And(rch, s.swa[r]), k, s.window[r]) if _staged_at_hit(v, tw) else s.window[r])
    post = dataclasses.replace(s, phase=z3.IntVal(TRANSFERRED), C=_ranks(s, "C", lambda r: C[r]),
                               window=_ranks(s, "window", lambda r: win[r]),
                               reach=_ranks(s, "reach", lambda r: reach[r]), cnt=_ranks(s, "cnt", lambda r: cnt[r]),
                               mcnt=_ranks(s, "mcnt", lambda r: mcnt[r]), infl=_ranks(s, "infl", lambda r: infl[r]),
                               fin=_ranks(s, "fin", lambda r: fin[r]))
    return post, facts


def _can(s: State, r: int) -> z3.BoolRef:
    """The #27264-era rank-local ``can`` (§6.3 step 2)."""
    completed = z3.And(s.H[r] > 0, s.C[r] == s.H[r])
    can = z3.If(s.pol[r] == WC, completed, z3.Or(completed, s.dl[r]))
    guard = z3.And(completed, z3.Not(s.fin[r]), z3.Or(s.swa[r], s.mamba[r]))  # component transfers not done
    return z3.Or(s.pol[r] == BE, z3.And(can, z3.Not(guard)))


def can_terminate_prefetch_terms(v: Variant, s: State) -> State:
    """The vote: #27264 era ``[not_can, terminated]`` MAX on the ranks that are not best_effort; 0.5.23 ``[deadline]``
    MAX on the timeout ranks. Mismatch: some ranks call it and some do not."""
    act = [z3.And(active(s, r), s.reg[r]) for r in range(RANKS)]
    if v.protocol_0523:
        part = [z3.And(act[r], s.pol[r] == TO) for r in range(RANKS)]
        mism = z3.And(z3.Or(part), z3.Or([z3.And(act[r], s.pol[r] != TO) for r in range(RANKS)]))
        voted = z3.Or([z3.And(part[r], s.dl[r]) for r in range(RANKS)])
        finished = z3.And([z3.Implies(active(s, r), s.fin[r]) for r in range(RANKS)])
        go = [z3.And(act[r], z3.Or(s.pol[r] == BE, z3.And(s.pol[r] == TO, voted), finished)) for r in range(RANKS)]
    else:
        part = [z3.And(act[r], s.pol[r] != BE) for r in range(RANKS)]
        mism = z3.And(z3.Or(part), z3.Or([z3.And(act[r], s.pol[r] == BE) for r in range(RANKS)]))
        not_can = z3.Or([z3.And(part[r], z3.Not(_can(s, r))) for r in range(RANKS)])
        terminated = z3.Or([z3.And(part[r], s.fin[r], z3.Or(s.C[r] < s.H[r], s.H[r] == 0)) for r in range(RANKS)])
        go = [z3.And(act[r], z3.Or(s.pol[r] == BE, z3.Not(not_can), terminated)) for r in range(RANKS)]
    gos = _ranks(s, "go", lambda r: z3.And(z3.Not(mism), go[r]))
    phase = z3.If(mism, MISMATCHED, z3.If(z3.Or(go), DECIDED, WAITING))
    return dataclasses.replace(s, go=gos, phase=phase, mism=z3.If(mism, AT_VOTE, 0))


def reduce_prefetch_ack_terms(v: Variant, s: State, tw: Twist = SOUND) -> State:
    """The packed MIN (the reference's ``pack_prefetch_ack`` / ``unpack_prefetch_ack``). 0.5.23 reduces nothing while
    some rank's IO thread is in flight (D3: no collective, every rank reads 0 completed and no pool result)."""
    act = [active(s, r) for r in range(RANKS)]
    pick = zmax if tw.max_reduce else zmin
    m_all = _fold(s.C, act, pick)
    zero = z3.IntVal(0)
    no_ack: z3.BoolRef = z3.BoolVal(False)  # no ACK reduced at this check
    if v.protocol_0523:
        finished = z3.And([z3.Implies(act[r], s.fin[r]) for r in range(RANKS)])
        no_ack = z3.BoolVal(False) if tw.ack_in_flight else z3.Not(finished)
        with_ = [z3.And(act[r], z3.Or(s.swa[r], s.mamba[r])) for r in range(RANKS)]
        mism = z3.And(z3.Not(no_ack), z3.Or(with_), z3.Or([z3.And(act[r], z3.Not(z3.Or(s.swa[r], s.mamba[r])))
                                                          for r in range(RANKS)]))
        applied = z3.And(z3.Or(with_), finished)
        s_all, m_pool = _fold(s.cnt, act, pick), _fold(s.mcnt, act, pick)
        S = _ranks(s, "S", lambda r: z3.If(z3.And(z3.Not(mism), applied, s.swa[r]),
                                           s.cnt[r] if tw.no_pool_sync else s_all, zero))
        Sm = _ranks(s, "Sm", lambda r: z3.If(z3.And(z3.Not(mism), applied, s.mamba[r]),
                                             s.mcnt[r] if tw.no_pool_sync else m_pool, zero))
        tdone = _ranks(s, "tdone", lambda r: z3.And(z3.Not(mism), applied))
        mix: z3.BoolRef = z3.BoolVal(False)
    else:
        pre = v is Variant.PRE_27264
        shape = [z3.IntVal(1)] * RANKS if pre else [1 + z3.If(s.swa[r], 1, 0) + z3.If(s.mamba[r], 1, 0)
                                                     for r in range(RANKS)]
        mism = z3.Or(z3.Or([z3.And(act[r], z3.Not(s.go[r])) for r in range(RANKS)]), z3.Not(_all_equal(shape, act)))
        swa_only = [z3.And(act[r], s.swa[r], z3.Not(s.mamba[r])) for r in range(RANKS)]
        mamba_only = [z3.And(act[r], s.mamba[r], z3.Not(s.swa[r])) for r in range(RANKS)]
        mix = z3.BoolVal(False) if pre else z3.And(z3.Not(mism), z3.Or(swa_only), z3.Or(mamba_only))
        slot1 = [z3.If(s.swa[r], s.cnt[r], s.mcnt[r]) for r in range(RANKS)]
        red1 = _fold(slot1, [z3.And(act[r], z3.Or(s.swa[r], s.mamba[r])) for r in range(RANKS)], pick)
        red2 = _fold(s.mcnt, [z3.And(act[r], s.swa[r], s.mamba[r]) for r in range(RANKS)], pick)
        if pre:
            S = _ranks(s, "S", lambda r: z3.If(mism, zero, s.cnt[r]))
            Sm = _ranks(s, "Sm", lambda r: z3.If(mism, zero, s.mcnt[r]))
        else:
            S = _ranks(s, "S", lambda r: z3.If(z3.And(z3.Not(mism), s.swa[r]), red1, zero))
            Sm = _ranks(s, "Sm", lambda r: z3.If(z3.And(z3.Not(mism), s.mamba[r]),
                                                 z3.If(s.swa[r], red2, red1), zero))
        tdone = _ranks(s, "tdone", lambda r: z3.And(z3.Not(mism), s.fin[r]))
    M = _ranks(s, "M", lambda r: z3.If(z3.Or(mism, no_ack), zero, m_all))
    return dataclasses.replace(s, M=M, S=S, Sm=Sm, tdone=tdone, mix=mix, phase=z3.If(mism, MISMATCHED, REDUCED),
                               mism=z3.If(mism, AT_REDUCE, 0))


def handle_prefetch_result_terms(v: Variant, s: State, tw: Twist = SOUND) -> State:
    """Each proceeding rank: 0.5.23's all-or-nothing check, the insert (its split), the SWA commit (attach, its split),
    the hazard (the reference's ``rank_handle_prefetch_result``). 0.5.23's check compares ``M`` with the rank's own
    target (its staged length: F6 when one rank staged fewer)."""
    E = s.e1 + s.e2
    out: dict[str, list[z3.ExprRef]] = {k: [] for k in ("total", "attach", "disc", "hazard", "prefix", "ins_split",
                                                        "swa_split")}
    for r in range(RANKS):
        go = s.go[r]
        n, target = s.window[r], rank_target(s, r)
        if v.protocol_0523:
            k_m = z3.If(s.reach[r], zmin(1, target), 1)
            ok = z3.And(s.M[r] == target, z3.Implies(s.swa[r], s.S[r] == keys_swa(s, r)),
                        z3.Implies(s.mamba[r], s.Sm[r] == k_m))
            disc = z3.And(go, z3.Or(s.swa[r], s.mamba[r]), z3.Not(ok))
        else:
            disc = z3.BoolVal(False)
        kept = z3.And(go, z3.Not(disc))
        total = z3.If(kept, s.M[r], 0)
        enough = s.S[r] >= (1 if tw.partial_window else n)
        mid_tree_ok = z3.Or(s.root, n >= s.sw) if v.protocol_0523 else z3.BoolVal(True)
        attach = z3.And(kept, s.swa[r], total > 0, n > 0, enough, mid_tree_ok)
        low = total - n
        inside = z3.Or(z3.And(low > 0, low < zmin(s.e1, total), z3.Not(s.s1)),
                       z3.And(s.e1 < low, low < zmin(E, total), z3.Not(s.s2)),
                       z3.And(low > E, low < total))
        if v.protocol_0523:
            released = z3.Or(z3.Not(disc), s.tdone[r], v is Variant.BEST_EFFORT_RELEASE)
        else:
            released = z3.BoolVal(True)
        out["total"].append(total)
        out["attach"].append(attach)
        out["disc"].append(disc)
        out["hazard"].append(z3.And(go, s.infl[r], released))
        out["prefix"].append(z3.If(kept, zmin(E, total), 0))
        out["ins_split"].append(z3.If(z3.And(kept, z3.Or(z3.And(total > 0, total < s.e1),
                                                          z3.And(s.e1 < total, total < E))), total, -1))
        out["swa_split"].append(z3.If(z3.And(attach, inside), low, -1))
    return dataclasses.replace(s, phase=z3.IntVal(COMMITTED),
                               **{k: _ranks(s, k, lambda r, k=k: out[k][r]) for k in out})  # type: ignore[misc]


# ---- the transitions --------------------------------------------------------------------------------------


def _equal(post: State, built: State) -> list[z3.BoolRef]:
    return [a == b for a, b in zip(_ts.terms_of(post), _ts.terms_of(built), strict=True) if not a.eq(b)]


def sync_prefetch_hit_query(s: State, a: Action, t: State, *, variant: Variant = Variant.UPSTREAM_27264,
                            twist: Twist = SOUND) -> z3.BoolRef:
    """At ``started``: the storage-hit MIN (or the mismatch)."""
    return z3.And(s.phase == STARTED, *_equal(t, sync_prefetch_hit_query_terms(variant, s, twist)))


def page_transfer(s: State, a: Action, t: State, *, variant: Variant = Variant.UPSTREAM_27264,
                  twist: Twist = SOUND) -> z3.BoolRef:
    """At ``queried``: every rank's IO thread."""
    post, facts = page_transfer_terms(variant, s, a, twist)
    return z3.And(s.phase == QUERIED, *facts, *_equal(t, post))


def can_terminate_prefetch(s: State, a: Action, t: State, *, variant: Variant = Variant.UPSTREAM_27264) -> z3.BoolRef:
    """At ``transferred``: the vote (``decided``, ``waiting`` or the mismatch)."""
    return z3.And(s.phase == TRANSFERRED, *_equal(t, can_terminate_prefetch_terms(variant, s)))


def reduce_prefetch_ack(s: State, a: Action, t: State, *, variant: Variant = Variant.UPSTREAM_27264,
                        twist: Twist = SOUND) -> z3.BoolRef:
    """At ``decided``: the packed MIN (or the mismatch)."""
    return z3.And(s.phase == DECIDED, *_equal(t, reduce_prefetch_ack_terms(variant, s, twist)))


def handle_prefetch_result(s: State, a: Action, t: State, *, variant: Variant = Variant.UPSTREAM_27264,
                           twist: Twist = SOUND) -> z3.BoolRef:
    """At ``reduced``: insert, commit, release on every proceeding rank."""
    return z3.And(s.phase == REDUCED, *_equal(t, handle_prefetch_result_terms(variant, s, twist)))


# ---- rendering ---------------------------------------------------------------------------------------------


def _rank_cell(m: z3.ModelRef, s: State, r: int) -> str:
    if not as_bool(m, z3.IntVal(r) < s.N):
        return ""
    phase = as_int(m, s.phase)
    if phase == STARTED:
        return _inputs_text(m, s, r)
    hit, staged = as_int(m, s.H[r]), as_int(m, s.staged[r])
    parts = [f"H={hit}" + (f" staged={staged}" if staged < hit else "")]
    if phase not in (QUERIED, MISMATCHED, REVOKED) or as_int(m, s.C[r]):
        flight = " inflight" if as_bool(m, s.infl[r]) else ""
        parts.append(f"C={as_int(m, s.C[r])} cnt={as_int(m, s.cnt[r])}{flight}")
    if as_bool(m, s.go[r]):
        parts.append(f"go M={as_int(m, s.M[r])} S={as_int(m, s.S[r])}")
    if phase == COMMITTED and as_bool(m, s.go[r]):
        parts.append(f"total={as_int(m, s.total[r])}" + (" attach" if as_bool(m, s.attach[r]) else "")
                     + (" discard" if as_bool(m, s.disc[r]) else "") + (" HAZARD" if as_bool(m, s.hazard[r]) else ""))
    return " ".join(parts)


def _inputs_text(m: z3.ModelRef, s: State, r: int) -> str:
    pools = [name for name, flag in (("swa", s.swa[r]), ("mamba", s.mamba[r])) if as_bool(m, flag)]
    pol = as_int(m, s.pol[r])
    return (f"{POLICIES[pol] if 0 <= pol < 3 else pol}, transfers {{{', '.join(pools)}}}, hit={as_int(m, s.hit[r])}, "
            f"loaded={as_int(m, s.full[r])}" + ("" if as_bool(m, s.done[r]) else ", IO running")
            + (", deadline passed" if as_bool(m, s.dl[r]) else "")
            + (", Mamba fetch fails" if as_bool(m, s.mamba[r]) and not as_bool(m, s.mamba_ok[r]) else "")
            + ("" if as_bool(m, s.reg[r]) else ", unregistered")
            + (f", {as_int(m, s.hfree[r])} Full host page(s) free" if as_int(m, s.hfree[r]) else ""))


COLUMNS = ("phase", *(f"rank {r}" for r in range(RANKS)))


def cells(m: z3.ModelRef, s: State) -> tuple[str, ...]:
    phase = as_int(m, s.phase)
    name = PHASES[phase] if 0 <= phase < len(PHASES) else str(phase)
    if phase == MISMATCHED:
        name += f" at {COLLECTIVES[as_int(m, s.mism)]}"
    return (name, *(_rank_cell(m, s, r) for r in range(RANKS)))


def describe(m: z3.ModelRef, step: _ts.Step[State, Action]) -> str:
    op = step.op_name(m)
    if op == "page_transfer":
        n = as_int(m, step.pre.N)
        return f"page_transfer(succ={[as_int(m, x) for x in step.action.succ[:n]]})"
    return f"{op}()"


def system(variant: Variant = Variant.UPSTREAM_27264, twist: Twist = SOUND) -> _ts.TransitionSystem[State, Action]:
    """The model under ``variant`` (a twin: with ``twist``)."""
    return _ts.TransitionSystem(
        component=COMPONENT, state=State.fresh, action=Action.fresh, init=functools.partial(init, v=variant),
        transitions={
            "sync_prefetch_hit_query": functools.partial(sync_prefetch_hit_query, variant=variant, twist=twist),
            "page_transfer": functools.partial(page_transfer, variant=variant, twist=twist),
            "can_terminate_prefetch": functools.partial(can_terminate_prefetch, variant=variant),
            "reduce_prefetch_ack": functools.partial(reduce_prefetch_ack, variant=variant, twist=twist),
            "handle_prefetch_result": functools.partial(handle_prefetch_result, variant=variant, twist=twist)},
        columns=COLUMNS, cells=cells, describe=describe)


SYSTEMS_BY_VARIANT: dict[Variant, _ts.TransitionSystem[State, Action]] = {v: system(v) for v in Variant}
SYSTEMS: tuple[_ts.TransitionSystem[State, Action], ...] = tuple(SYSTEMS_BY_VARIANT.values())
SYSTEM: _ts.TransitionSystem[State, Action] = SYSTEMS_BY_VARIANT[Variant.UPSTREAM_27264]
"""Every operation of ``kvproof.reference.tp_prefetch``'s check, by its name, under ``upstream_27264``."""


# ---- the whole check, composed ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Run:
    """One check from the initial state: the state after each operation (terms), the action, the input facts."""

    variant: Variant
    states: tuple[State, ...]  # s0 (initial) .. s5 (after handle_prefetch_result)
    action: Action
    facts: tuple[z3.BoolRef, ...]

    @property
    def last(self) -> State:
        return self.states[-1]

    @property
    def queried(self) -> z3.BoolRef:
        """The hit query neither mismatched nor revoked the check: the later operations ran (the states after a
        mismatch or a revoke are the builders' terms, which no transition reaches)."""
        return self.states[1].phase == QUERIED

    @property
    def revoked(self) -> z3.BoolRef:
        return self.states[1].phase == REVOKED

    @property
    def mismatched(self) -> z3.BoolRef:
        s1, s3, s4 = self.states[1], self.states[3], self.states[4]
        return z3.Or(s1.mism != 0, z3.And(self.queried, z3.Or(s3.mism != 0, z3.And(s3.phase == DECIDED,
                                                                                    s4.mism != 0))))

    @property
    def waiting(self) -> z3.BoolRef:
        return z3.And(self.queried, self.states[3].phase == WAITING)

    @property
    def committed(self) -> z3.BoolRef:
        """Neither mismatched, waiting nor revoked: ``handle_prefetch_result`` ran."""
        return z3.And(self.queried, z3.Not(self.mismatched), z3.Not(self.waiting))

    def mismatch_at(self) -> z3.ArithRef:
        s1, s3, s4 = self.states[1], self.states[3], self.states[4]
        return z3.If(s1.mism != 0, s1.mism, z3.If(s3.mism != 0, s3.mism, s4.mism))


def run(variant: Variant, twist: Twist = SOUND, tag: str = "run") -> Run:
    """The five operations composed on the initial state (any valid per-rank progress vector)."""
    s0 = State.initial(variant)
    a = Action.fresh(tag)
    states = [s0, *(State.fresh(f"{tag}{i}") for i in range(1, 6))]
    built, facts = page_transfer_terms(variant, states[1], a, twist)
    steps = [sync_prefetch_hit_query_terms(variant, s0, twist), built,
             can_terminate_prefetch_terms(variant, states[2]), reduce_prefetch_ack_terms(variant, states[3], twist),
             handle_prefetch_result_terms(variant, states[4], twist)]
    # each state's derived values are variables defined by the step (smaller queries than one nested term)
    defined = [f for post, b in zip(states[1:], steps, strict=True) for f in _equal(post, b)]
    return Run(variant, tuple(states), a, (*valid_inputs(variant, s0), *facts, *defined))


def _pages(m: z3.ModelRef, s: State, lo: int, hi: int) -> str:
    p = as_int(m, s.P)
    return f"tokens {lo * p}-{hi * p - 1}"


def run_text(m: z3.ModelRef, rn: Run, verdict: str) -> str:
    """A counterexample check as text: the setup, each rank's inputs, what each rank derived, the verdict."""
    s0, s5 = rn.states[0], rn.last
    p, n_ranks = as_int(m, s0.P), as_int(m, s0.N)
    path = []
    for length, flag in ((s0.e1, s0.s1), (s0.e2, s0.s2)):
        if as_int(m, length):
            path.append(f"{as_int(m, length) * p} tokens ({'SWA host' if as_bool(m, flag) else 'SWA tombstone'})")
    lines = [f"{rn.variant.value}: page size P={p}, window {as_int(m, s0.sw)} pages ({as_int(m, s0.sw) * p} tokens), "
             f"request R={as_int(m, s0.R)} pages, anchor {'root' if as_bool(m, s0.root) else 'mid-tree'}, host path "
             f"below it: {', '.join(path) or 'none'}; N={n_ranks} ranks"]
    s2, s4 = rn.states[2], rn.states[4]
    ended = as_bool(m, rn.mismatched) or as_bool(m, rn.revoked)
    for r in range(n_ranks):
        miss = as_int(m, s0.first_miss[r])
        wp = as_int(m, window_pages(rn.variant, s0, r))
        lines.append(f"  rank {r}: {_inputs_text(m, s0, r)}, SWA window {wp} pages"
                     + (f" (page {miss} fails first)" if miss < wp else "")
                     + f", SWA successes succ={as_int(m, rn.action.succ[r])}")
        if ended:
            continue
        n = as_int(m, s2.window[r])
        staging = f", stages {as_int(m, s2.staged[r])} Full and {n} window page(s)" if rn.variant.protocol_0523 else ""
        lines.append(f"    synced hit {as_int(m, s2.H[r])}{staging}, completed {as_int(m, s2.C[r])}, SWA count "
                     f"recorded {as_int(m, s2.cnt[r])}" + (", SWA writes in flight" if as_bool(m, s2.infl[r]) else "")
                     + (", proceeds" if as_bool(m, s5.go[r]) else ", waits"))
        if not as_bool(m, s5.go[r]):
            continue
        total, low = as_int(m, s5.total[r]), as_int(m, s5.total[r]) - n
        res = f"min completed {as_int(m, s4.M[r])}, reads SWA count {as_int(m, s4.S[r])}: "
        if as_bool(m, s5.disc[r]):
            res += "discards the prefetch"
        else:
            res += f"inserts {total} pages ({total * p} tokens)"
        if as_bool(m, s5.attach[r]):
            keys = as_int(m, keys_swa(s2, r))
            src = as_int(m, rank_target(s2, r)) - keys
            before = f" ({-low} page(s) before the anchor released)" if low < 0 else ""
            res += (f", attaches its {n}-page window at {_pages(m, s0, max(low, 0), total)}{before}, whose buffer "
                    f"holds the SWA KV of {_pages(m, s0, src, src + keys)} ({as_int(m, s4.S[r])} page(s) counted)")
        elif n:
            res += ", releases its window buffer"
        if as_bool(m, s5.hazard[r]):
            res += "; the scheduler releases window pages its IO thread is still writing"
        lines.append("    " + res)
    if as_bool(m, rn.mismatched):
        lines.append(f"  mismatched collective at {COLLECTIVES[as_int(m, rn.mismatch_at())]}")
    elif as_bool(m, rn.revoked):
        lines.append("  synced hit 0: the check is revoked on every rank (nothing staged, no IO, no ACK, no commit)")
    return "\n".join([*lines, verdict])


# ---- obligations over a run ----------------------------------------------------------------------------------


Claim = Callable[[Run], z3.BoolRef]
Explain = Callable[[z3.ModelRef, Run], str]


def _check(variant: Variant, claim: Claim, explain: Explain, *, premise: Claim | None = None,
           twist: Twist = SOUND, pin: Callable[[Run], list[z3.BoolRef]] | None = None) -> _ts.Check:
    """No valid progress vector (under ``premise``) breaks ``claim``; ``pin`` narrows a twin's search."""

    def build() -> list[z3.BoolRef]:
        rn = run(variant, twist)
        return [*rn.facts, *((premise(rn),) if premise else ()), *(pin(rn) if pin else []), z3.Not(claim(rn))]

    def render(m: z3.ModelRef) -> str:
        rn = run(variant, twist)
        return run_text(m, rn, explain(m, rn))

    return _ts.Check(build, render)


def _pairs() -> list[tuple[int, int]]:
    return [(r, q) for r in range(RANKS) for q in range(r + 1, RANKS)]


def _both(rn: Run, r: int, q: int) -> z3.BoolRef:
    s = rn.last
    return z3.And(active(s, r), active(s, q))


def same_sets(rn: Run) -> z3.BoolRef:
    s = rn.last
    return z3.And([z3.Implies(_both(rn, r, q), z3.And(s.swa[r] == s.swa[q], s.mamba[r] == s.mamba[q]))
                   for r, q in _pairs()])


def one_policy(rn: Run) -> z3.BoolRef:
    s = rn.last
    return z3.And([z3.Implies(_both(rn, r, q), s.pol[r] == s.pol[q]) for r, q in _pairs()])


def all_registered(rn: Run) -> z3.BoolRef:
    s = rn.last
    return z3.And([z3.Implies(active(s, r), s.reg[r]) for r in range(RANKS)])


def _and(*claims: Claim) -> Claim:
    return lambda rn: z3.And([c(rn) for c in claims])


def _small(rn: Run) -> list[z3.BoolRef]:
    """A twin's search: two ranks, small numbers (any counterexample refutes it)."""
    s = rn.last
    return [s.N == 2, s.P == 64, s.R <= 10, s.sw <= 4, s.e1 == 0, s.e2 == 0]


def _swa_only(rn: Run) -> list[z3.BoolRef]:
    """:func:`_small` with an SWA transfer (and no Mamba one) on both ranks."""
    s = rn.last
    return [*_small(rn), *[z3.And(s.swa[r], z3.Not(s.mamba[r])) for r in range(2)]]


def _policies(first: int, second: int) -> Callable[[Run], list[z3.BoolRef]]:
    return lambda rn: [*_swa_only(rn), rn.last.pol[0] == first, rn.last.pol[1] == second]


def _partial(rn: Run) -> list[z3.BoolRef]:
    """A 2-page window, a 4-page request every rank found and loaded."""
    s = rn.last
    return [*_swa_only(rn), s.sw == 2, s.R == 4, *[z3.And(s.hit[r] == 4, s.full[r] == 4, s.done[r])
                                                   for r in range(2)]]


def _host_short(rn: Run) -> list[z3.BoolRef]:
    """upstream_0523, :func:`_partial` with 1 Full host page free on rank 1 at hit time (F6)."""
    s = rn.last
    return [*_partial(rn), s.hfree[0] == 0, s.hfree[1] == 1]


def _host_short_root(rn: Run) -> list[z3.BoolRef]:
    """:func:`_swa_only` at the root, rank 0 with host pages enough, rank 1 with 1 Full host page free at hit time."""
    s = rn.last
    return [*_swa_only(rn), s.root, s.hfree[0] == 0, s.hfree[1] == 1]


def _f6(rn: Run) -> list[z3.BoolRef]:
    """F6 (sglang-findings.md): mid-tree, wait_complete, both ranks find and load the whole request and its window;
    rank 0 has host pages enough, rank 1 may be short."""
    s = rn.last
    return [*_swa_only(rn), z3.Not(s.root), s.hfree[0] == 0, *[z3.And(
        s.pol[r] == WC, s.hit[r] == s.R, s.full[r] == s.R, s.done[r], s.first_miss[r] == s.sw) for r in range(2)]]


def _own_hits(rn: Run) -> list[z3.BoolRef]:
    """Rank 0's storage holds nothing, rank 1's something; both have host pages enough and finished their IO."""
    s = rn.last
    return [*_swa_only(rn), s.hit[0] == 0, s.hit[1] >= 1, *[z3.And(s.hfree[r] == 0, s.done[r]) for r in range(2)]]


def no_host_pressure(rn: Run) -> z3.BoolRef:
    """Every rank stages the whole synced hit (0.5.23: no rank is short of Full host pages at hit time)."""
    s = rn.states[1]
    return z3.And([z3.Implies(active(s, r), s.staged[r] >= s.H[r]) for r in range(RANKS)])


def short_hit_at_root(rn: Run) -> z3.BoolRef:
    """At the root, a synced hit of 1 page or more but shorter than the window; every rank registered, one policy and
    one transfer set with SWA, no host pressure, each IO thread done with every page it looks for."""
    s0, s1 = rn.states[0], rn.states[1]
    fetched = [z3.Implies(active(s0, r), z3.And(s0.reg[r], s0.swa[r], s0.done[r], s0.full[r] >= s0.hit[r],
                                                z3.Implies(s0.mamba[r], s0.mamba_ok[r]),
                                                s0.first_miss[r] >= window_pages(rn.variant, s0, r)))
               for r in range(RANKS)]
    return z3.And(s0.root, s1.H[0] >= 1, s1.H[0] < s0.sw, same_sets(rn), one_policy(rn), no_host_pressure(rn),
                  *fetched)


def _same_hit(rn: Run) -> z3.BoolRef:
    s = rn.states[1]
    return z3.Implies(s.mism == 0, z3.And(
        _all_equal(s.H, [active(s, r) for r in range(RANKS)]),
        z3.And([z3.Implies(active(s, r), s.H[r] <= s.hit[r]) for r in range(RANKS)])))


def _no_mismatch_at(op: int) -> Claim:
    def claim(rn: Run) -> z3.BoolRef:
        s1, s3, s4 = rn.states[1], rn.states[3], rn.states[4]
        if op == AT_HIT_QUERY:
            return s1.mism == 0
        if op == AT_VOTE:
            return z3.Implies(rn.queried, s3.mism == 0)
        return z3.Implies(z3.And(rn.queried, s3.phase == DECIDED), z3.And(s4.mism == 0, z3.Not(s4.mix)))
    return claim


def _revoke_agreed(rn: Run) -> z3.BoolRef:
    """Every rank's synced hit is 0 (it revokes) or none is, the check is revoked exactly then, and nothing is
    staged."""
    s = rn.states[1]
    act = [active(s, r) for r in range(RANKS)]
    empty = z3.And([z3.Implies(act[r], z3.And(s.staged[r] == 0, s.window[r] == 0)) for r in range(RANKS)])
    return z3.Implies(s.mism == 0, z3.And(_all_equal([h == 0 for h in s.H], act), rn.revoked == (s.H[0] == 0),
                                          z3.Implies(rn.revoked, empty)))


def _agreed(rn: Run) -> z3.BoolRef:
    s = rn.states[3]
    return z3.Implies(rn.queried, z3.And(s.mism == 0, _all_equal(s.go, [active(s, r) for r in range(RANKS)])))


def _same_tree(rn: Run) -> z3.BoolRef:
    s = rn.last
    act = [active(s, r) for r in range(RANKS)]
    return z3.Implies(rn.committed, z3.And([_all_equal(getattr(s, f), act)
                                            for f in ("go", "total", "attach", "ins_split", "swa_split")]))


def _whole_window(rn: Run) -> z3.BoolRef:
    s, s2 = rn.last, rn.states[2]
    n = s2.window
    everyone = z3.And([z3.Implies(active(s, q), z3.And(s2.reach[q], s.done[q], keys_swa(s2, q) == n[q],
                                                       s.first_miss[q] >= n[q])) for q in range(RANKS)])
    return z3.Implies(rn.committed, z3.And([z3.Implies(z3.And(active(s, r), s.attach[r]), z3.And(
        everyone, z3.Or(n[r] == s.sw, z3.And(s.root, s.total[r] == n[r])))) for r in range(RANKS)]))


def _short_hit_attached(rn: Run) -> z3.BoolRef:
    """Every rank commits the synced hit and attaches a window buffer of all of it (D1)."""
    s, s1, s2 = rn.last, rn.states[1], rn.states[2]
    return z3.And(rn.committed, *[z3.Implies(active(s, r), z3.And(s.attach[r], s.total[r] == s1.H[r],
                                                                 s2.window[r] == s1.H[r])) for r in range(RANKS)])


def _aligned_window(rn: Run) -> z3.BoolRef:
    s, s2 = rn.last, rn.states[2]
    return z3.Implies(rn.committed, z3.And([z3.Implies(z3.And(active(s, r), s.attach[r]), z3.And(
        s.total[r] == rank_target(s2, r), s.total[r] - s2.window[r] == rank_target(s2, r) - keys_swa(s2, r)))
        for r in range(RANKS)]))


def _full_slots(rn: Run) -> z3.BoolRef:
    s, s2 = rn.last, rn.states[2]
    return z3.Implies(rn.committed, z3.And([z3.Implies(z3.And(active(s, r), s.go[r], z3.Not(s.disc[r])), z3.And(
        s.prefix[r] >= 0, s.prefix[r] <= s.total[r], s.total[r] <= s2.C[r], s2.C[r] <= rank_target(s2, r),
        s2.staged[r] <= s.R)) for r in range(RANKS)]))


def _sidecars_after_full(rn: Run) -> z3.BoolRef:
    s2 = rn.states[2]
    return z3.And([z3.Implies(z3.And(active(s2, r), s2.cnt[r] > 0), z3.And(
        s2.C[r] == rank_target(s2, r), s2.cnt[r] <= keys_swa(s2, r), keys_swa(s2, r) <= s2.window[r]))
        for r in range(RANKS)])


def _explain_sidecars(m: z3.ModelRef, rn: Run) -> str:
    s2 = rn.states[2]
    r = _first(m, rn, lambda s, r: z3.And(s2.cnt[r] > 0, s2.C[r] < rank_target(s2, r)))
    return (f"T3 broken: rank {r} records {as_int(m, s2.cnt[r])} SWA page(s) fetched for the window ending at its "
            f"target {as_int(m, rank_target(s2, r))} (synced hit {as_int(m, s2.H[r])}) although it completed only "
            f"{as_int(m, s2.C[r])} Full pages")


def _no_hazard(rn: Run) -> z3.BoolRef:
    s = rn.last
    return z3.Implies(rn.committed, z3.And([z3.Implies(active(s, r), z3.Not(s.hazard[r])) for r in range(RANKS)]))


def _first(m: z3.ModelRef, rn: Run, cond: Callable[[State, int], z3.BoolRef]) -> int:
    s = rn.last
    return next((r for r in range(as_int(m, s.N)) if as_bool(m, cond(s, r))), 0)


def _explain_tree(m: z3.ModelRef, rn: Run) -> str:
    s, s1 = rn.last, rn.states[1]
    n = as_int(m, s.N)
    short = "".join(f"; rank {r} staged only {as_int(m, s1.staged[r])} of the synced hit's {as_int(m, s1.H[r])} "
                    "Full pages, after the sync (host pressure, F6)" for r in range(n)
                    if as_int(m, s1.staged[r]) < as_int(m, s1.H[r]))
    for f in ("go", "total", "attach", "ins_split", "swa_split"):
        values = [as_int(m, x) if not z3.is_bool(x) else as_bool(m, x) for x in getattr(s, f)[:n]]
        if len(set(values)) > 1:
            return f"T1 broken: the ranks' host trees differ in {f}: {values} (rank 0 .. rank {n - 1}){short}"
    return "T1 broken" + short


def _explain_window(m: z3.ModelRef, rn: Run) -> str:
    r = _first(m, rn, lambda s, r: s.attach[r])
    return (f"T2 broken: rank {r} attaches an SWA window although not every rank fetched every page of it "
            f"(the commit read SWA count {as_int(m, rn.last.S[r])})")


def _explain_aligned(m: z3.ModelRef, rn: Run) -> str:
    r = _first(m, rn, lambda s, r: s.attach[r])
    s, s2 = rn.last, rn.states[2]
    n, target = as_int(m, s2.window[r]), as_int(m, rank_target(s2, r))
    total, src = as_int(m, s.total[r]), target - as_int(m, keys_swa(s2, r))
    return (f"T3 broken: rank {r}'s {_pages(m, s, total - n, total)} get the SWA KV of {_pages(m, s, src, src + n)} "
            f"(inserted {total} pages, the window was fetched for its target {target}, the synced hit "
            f"{as_int(m, s2.H[r])})")


def _explain_short_hit(m: z3.ModelRef, rn: Run) -> str:
    s2 = rn.states[2]
    r = _first(m, rn, lambda st, r: z3.Not(st.attach[r]))
    return (f"D1 broken: at the root rank {r}'s synced hit of {as_int(m, s2.H[r])} page(s), shorter than the window, "
            f"is a whole window from token 0, but its {as_int(m, s2.window[r])}-page window buffer gets only "
            f"{as_int(m, keys_swa(s2, r))} key(s), so the commit drops the window")


def _explain_revoke(m: z3.ModelRef, rn: Run) -> str:
    s = rn.states[1]
    hits = [as_int(m, h) for h in s.H[:as_int(m, s.N)]]
    return (f"the ranks decide differently whether to revoke: synced hits {hits}; a rank with 0 revokes the prefetch "
            "alone after the hit query while the others stage and fetch (F7: their ACKs then pair with the next "
            "request's)")


def _layout(m: z3.ModelRef, rn: Run, at: int, r: int) -> str:
    """What rank ``r`` passes to the collective ``at`` (the reference's ``pack_*``), as slot names."""
    s0, s3 = rn.states[0], rn.states[3]
    v = rn.variant
    pools = [name for name, flag in (("swa", s0.swa[r]), ("mamba", s0.mamba[r])) if as_bool(m, flag)]
    pol = as_int(m, s0.pol[r])
    if not as_bool(m, s0.reg[r]):
        return "no call"
    if at == AT_HIT_QUERY:
        if not v.protocol_0523:
            return "MIN [hit] (1 value)"
        head = f"flag_0..flag_{as_int(m, s0.R)}" if pools else "hit"
        width = (as_int(m, s0.R) + 1 if pools else 1) + POOLS
        return f"MIN [{head}, kv, mamba, swa] ({width} values)"
    if at == AT_VOTE:
        if v.protocol_0523:
            return "MAX [deadline] (1 value)" if pol == TO else f"no call ({POLICIES[pol]})"
        return "MAX [not_can, terminated] (2 values)" if pol != BE else "no call (best_effort)"
    if v.protocol_0523:
        return "MIN [kv, mamba, swa] (3 values)" if pools else "no call (no sidecar transfer: no pool ACK)"
    if not as_bool(m, s3.go[r]):
        return "no call (it waits)"
    slots = ["completed"] if v is Variant.PRE_27264 else ["completed", *pools]
    return f"MIN [{', '.join(slots)}] ({len(slots)} value{'s' if len(slots) > 1 else ''})"


def _explain_mismatch(m: z3.ModelRef, rn: Run) -> str:
    s1, s3, s4 = rn.states[1], rn.states[3], rn.states[4]
    n = as_int(m, s1.N)
    if as_int(m, s1.mism) or as_int(m, s3.mism) or as_int(m, s4.mism):
        at = as_int(m, rn.mismatch_at())
        calls = "; ".join(f"rank {r}: {_layout(m, rn, at, r)}" for r in range(n))
        return f"T5 broken: mismatched collective {COLLECTIVES[at]}: {calls} (an error or a hang on a real group)"
    calls = "; ".join(f"rank {r}: {_layout(m, rn, AT_REDUCE, r)}" for r in range(n))
    return (f"T5 broken: reduce_prefetch_ack: {calls}: the same shape, but slot 1 is SWA on one rank and Mamba on "
            "another: the MIN mixes two pools' hit counts silently")


def _explain_go(m: z3.ModelRef, rn: Run) -> str:
    s3 = rn.states[3]
    n = as_int(m, s3.N)
    if as_int(m, s3.mism):
        calls = "; ".join(f"rank {r}: {_layout(m, rn, AT_VOTE, r)}" for r in range(n))
        return f"T5 broken: the vote is mismatched: {calls}"
    return (f"the ranks decide differently with no collective to notice: proceeds = "
            f"{[as_bool(m, g) for g in s3.go[:n]]} (one rank commits its tree now, another later)")


def _explain_full(m: z3.ModelRef, rn: Run) -> str:
    s, s2 = rn.last, rn.states[2]
    r = _first(m, rn, lambda st, r: z3.And(st.go[r], st.total[r] > s2.C[r]))
    return (f"T4 broken: rank {r}'s tree takes Full host pages [{as_int(m, s.prefix[r])}, {as_int(m, s.total[r])}) "
            f"but it completed only {as_int(m, s2.C[r])}: pages [{as_int(m, s2.C[r])}, {as_int(m, s.total[r])}) are in "
            "its tree and unloaded (owned twice: by the tree and the IO thread)")


def _explain_hazard(m: z3.ModelRef, rn: Run) -> str:
    r = _first(m, rn, lambda s, r: s.hazard[r])
    return (f"R5-d broken: rank {r}'s scheduler releases its SWA window buffer while its IO thread still writes it "
            "(a slot released, then written)")


def _explain_hit(m: z3.ModelRef, rn: Run) -> str:
    s = rn.states[1]
    n = as_int(m, s.N)
    return f"the ranks load against different hits {[as_int(m, h) for h in s.H[:n]]}: their trees will differ"


# ---- commit_prefetch's walk over any host path (T4, window-buffer pages) ---------------------------------------


@dataclass(frozen=True)
class Walk:
    """A path of up to three nodes below the anchor (two that were there, one inserted), the window, its slices."""

    e1: z3.ArithRef
    e2: z3.ArithRef
    s1: z3.BoolRef
    s2: z3.BoolRef
    total: z3.ArithRef
    n: z3.ArithRef

    @staticmethod
    def fresh() -> Walk:
        e1, e2, total, n = z3.Ints("e1 e2 total n")
        return Walk(e1, e2, z3.Bool("s1"), z3.Bool("s2"), total, n)

    def facts(self) -> list[z3.BoolRef]:
        return [self.e1 >= 0, self.e2 >= 0, z3.Implies(self.e2 > 0, self.e1 > 0), self.total >= 1, self.n >= 1]

    def nodes(self) -> list[tuple[z3.ArithRef, z3.ArithRef, z3.BoolRef]]:
        """``(start, end, swa_host)`` of each node after the insert, clipped at ``total`` (empty ones included)."""
        E = self.e1 + self.e2
        return [(z3.IntVal(0), zmin(self.e1, self.total), self.s1),
                (zmin(self.e1, self.total), zmin(E, self.total), self.s2),
                (zmin(E, self.total), self.total, z3.BoolVal(False))]

    def slices(self, *, absolute_split: bool = False) -> list[tuple[z3.ArithRef, z3.ArithRef, z3.ArithRef]]:
        """Per node: ``(fill, attached, node length after the commit's split)`` (pages)."""
        low = self.total - self.n
        out = []
        for start, end, swa in self.nodes():
            fill_start = zmax(start, low)
            fill = z3.If(end > low, zmax(0, end - fill_start), 0)
            attached = z3.If(swa, 0, fill)
            split_at = fill_start if absolute_split else fill_start - start
            length = z3.If(z3.And(attached > 0, fill_start > start), end - start - split_at, end - start)
            out.append((fill, attached, length))
        return out


def _walk_check(*, prefix_release: bool = True, absolute_split: bool = False) -> _ts.Check:
    def parts() -> tuple[Walk, list[tuple[z3.ArithRef, z3.ArithRef, z3.ArithRef]], z3.ArithRef]:
        w = Walk.fresh()
        slices = w.slices(absolute_split=absolute_split)
        before = zmax(0, w.n - w.total) if prefix_release else z3.IntVal(0)
        return w, slices, before

    def build() -> list[z3.BoolRef]:
        w, slices, before = parts()
        covered = z3.Sum([f for f, _, _ in slices]) + before == w.n
        fits = z3.And([z3.Implies(att > 0, length == att) for _, att, length in slices])
        return [*w.facts(), z3.Not(z3.And(covered, fits))]

    def render(m: z3.ModelRef) -> str:
        w, slices, before = parts()
        nodes = w.nodes()
        rows = []
        for i, ((start, end, swa), (fill, att, length)) in enumerate(zip(nodes, slices, strict=True)):
            a, b = as_int(m, start), as_int(m, end)
            if a == b:
                continue
            kind = "inserted now" if i == 2 else "SWA host" if as_bool(m, swa) else "SWA tombstone"
            rows.append(f"node [{a}, {b}) ({kind}): {as_int(m, fill)} window page(s) overlap it, "
                        f"{as_int(m, att)} attached, node length after the commit {as_int(m, length)}")
        n, total = as_int(m, w.n), as_int(m, w.total)
        accounted = sum(as_int(m, f) for f, _, _ in slices) + as_int(m, before)
        return (f"a window of n={n} pages ending at page total={total} (buffer covers pages [{total - n}, {total})), "
                f"path below the anchor (pages):\n  " + "\n  ".join(rows)
                + f"\n  released before the anchor: {as_int(m, before)} page(s)\nT4 broken: {accounted} of the {n} "
                "window pages are attached or released" + ("" if accounted == n else " (the rest leak)")
                + ("; an attached node's length differs from its slice" if accounted == n else ""))

    return _ts.Check(build, render)


# ---- count_pool_hits: leading run vs sum (R5-c) -------------------------------------------------------------

KEYS = 8  # bits per rank for the bounded R5-c twins


def _bits(tag: str) -> list[list[z3.BoolRef]]:
    return [[z3.Bool(f"{tag}[{r}][{i}]") for i in range(KEYS)] for r in range(RANKS)]


def _lead(bits: Sequence[z3.BoolRef], k: z3.ArithRef) -> z3.ArithRef:
    """The leading run of successes among the first ``k`` bits."""
    acc: z3.ArithRef = k
    for i in reversed(range(KEYS)):
        acc = z3.If(z3.And(i < k, z3.Not(bits[i])), z3.IntVal(i), acc)
    return acc


def _sum(bits: Sequence[z3.BoolRef], k: z3.ArithRef) -> z3.ArithRef:
    return z3.Sum([z3.If(z3.And(i < k, b), 1, 0) for i, b in enumerate(bits)])


def _prefix_check(*, by_sum: bool, small: bool = False) -> _ts.Check:
    """After the MIN over the active ranks' counts, the first ``c`` keys arrived on every active rank.

    Each count and the MIN are variables with their defining facts (a leading run ``l``: every key below ``l``
    arrived and key ``l`` did not, or ``l == k``; a MIN: at most every count and equal to one)."""
    N, k, c = z3.Ints("N k c")

    def parts() -> tuple[list[list[z3.BoolRef]], list[z3.ArithRef], list[z3.BoolRef]]:
        bits = _bits("fetched")
        counts = [z3.Int(f"count[{r}]") for r in range(RANKS)]
        facts: list[z3.BoolRef] = []
        for r in range(RANKS):
            if by_sum:
                facts.append(counts[r] == _sum(bits[r], k))
            else:
                facts += [counts[r] >= 0, counts[r] <= k,
                          *[z3.Implies(i < counts[r], bits[r][i]) for i in range(KEYS)],
                          *[z3.Implies(z3.And(counts[r] == i, i < k), z3.Not(bits[r][i])) for i in range(KEYS)]]
        act = [z3.IntVal(r) < N for r in range(RANKS)]
        facts += [*[z3.Implies(act[r], c <= counts[r]) for r in range(RANKS)],
                  z3.Or([z3.And(act[r], c == counts[r]) for r in range(RANKS)])]
        return bits, counts, facts

    def build() -> list[z3.BoolRef]:
        bits, _, facts = parts()
        every = z3.And([z3.Implies(z3.And(r < N, i < c), bits[r][i]) for r in range(RANKS) for i in range(KEYS)])
        narrow = [N == 2, k == 3] if small else []
        return [N >= 1, N <= RANKS, k >= 0, k <= KEYS, *facts, *narrow, z3.Not(every)]

    def render(m: z3.ModelRef) -> str:
        bits, counts, _ = parts()
        kk, n = as_int(m, k), as_int(m, N)
        rows = [f"rank {r}: fetched {fmt_bools([as_bool(m, b) for b in bits[r][:kk]])} -> count {as_int(m, counts[r])}"
                for r in range(n)]
        how = "sum of successes" if by_sum else "leading run"
        return (f"{kk} keys, {n} ranks, counted by {how}:\n  " + "\n  ".join(rows)
                + f"\nR5-c broken: the MIN says {as_int(m, c)} key(s) arrived everywhere, but a rank misses one of the "
                  f"first {as_int(m, c)}")

    return _ts.Check(build, render)


def _agree_check(*, prefix_reading: bool) -> _ts.Check:
    """Sum and leading run agree on ``count == k`` (SWA's all-or-nothing reading); a prefix reading ``count >= j``
    tells them apart."""
    k, j = z3.Ints("k j")

    def parts() -> tuple[list[z3.BoolRef], z3.ArithRef, z3.ArithRef]:
        bits = _bits("fetched")[0]
        return bits, _lead(bits, k), _sum(bits, k)

    def build() -> list[z3.BoolRef]:
        _, lead, total = parts()
        agree = (lead >= j) == (total >= j) if prefix_reading else (lead == k) == (total == k)
        return [k >= 0, k <= KEYS, j >= 0, j <= k, z3.Not(agree)]

    def render(m: z3.ModelRef) -> str:
        bits, lead, total = parts()
        kk = as_int(m, k)
        return (f"{kk} keys fetched {fmt_bools([as_bool(m, b) for b in bits[:kk]])}: leading run "
                f"{as_int(m, lead)}, sum {as_int(m, total)}\nR5-c broken for a prefix reading: 'count >= "
                f"{as_int(m, j)}' is {as_int(m, lead) >= as_int(m, j)} for the leading run, "
                f"{as_int(m, total) >= as_int(m, j)} for the sum")

    return _ts.Check(build, render)


# ---- the scenarios ----------------------------------------------------------------------------------------

S10 = {"P": 64, "sw": 2, "R": 10, "hit": 10, "full": (10, 7)}
"""§6.6 / §9 S10: TP = 2, P = 64, W = 128 (2 window pages), storage hit 10 pages on both ranks; rank 0 loads all 10
Full pages and both SWA window pages (tokens 512-639); rank 1 times out after 7."""


def _s10(rn: Run) -> list[z3.BoolRef]:
    s = rn.last
    return [s.N == 2, s.P == 64, s.sw == 2, s.R == 10, s.e1 == 0, s.e2 == 0, z3.Not(s.root),
            *[z3.And(s.hit[r] == 10, s.pol[r] == TO, s.reg[r], s.swa[r], z3.Not(s.mamba[r])) for r in range(2)],
            s.full[0] == 10, s.done[0], s.first_miss[0] == 2, s.full[1] == 7, s.dl[1], z3.Not(s.done[1])]


def _s10_shape(rn: Run) -> list[z3.BoolRef]:
    """S10's shape case: rank 0 built an SWA transfer, rank 1 none (its prefetch was truncated below a window)."""
    s = rn.last
    return [*_small(rn), s.swa[0], z3.Not(s.mamba[0]), z3.Not(s.swa[1]), z3.Not(s.mamba[1]),
            s.pol[0] == WC, s.pol[1] == WC]


def _obligations() -> tuple[Obligation, ...]:
    def ob(suffix: str, statement: str, check: _ts.Check, twin_of: str | None = None) -> Obligation:
        return _ts.obligation(SYSTEM, suffix, statement, check, family=FAMILY, twin_of=twin_of)

    up, pre, v0523 = Variant.UPSTREAM_27264, Variant.PRE_27264, Variant.UPSTREAM_0523
    aligned = _and(same_sets, one_policy, all_registered)
    t5_any = _and(_no_mismatch_at(AT_HIT_QUERY), _no_mismatch_at(AT_VOTE), _no_mismatch_at(AT_REDUCE))
    committed_same = _and(same_sets, one_policy)
    same_0523 = _and(committed_same, no_host_pressure)
    any_n = "for any progress vector of up to 8 ranks"
    return (
        # the storage-hit MIN
        ob("sync_prefetch_hit_query.same_hit",
           f"{any_n}: after the storage-hit MIN every rank loads against the same synced hit, at most its own",
           _check(up, _same_hit, _explain_hit)),
        ob("sync_prefetch_hit_query.same_hit.no_sync",
           "without the storage-hit MIN each rank loads against its own hit",
           _check(up, _same_hit, _explain_hit, twist=Twist(no_hit_sync=True), pin=_swa_only),
           "sync_prefetch_hit_query.same_hit"),
        ob("sync_prefetch_hit_query.aligned_0523",
           f"upstream_0523, {any_n} with the same transfer set on every rank, all registered: the hit query's flag "
           "and verdict vectors have one shape", _check(v0523, _no_mismatch_at(AT_HIT_QUERY), _explain_mismatch,
                                                       premise=_and(same_sets, all_registered))),
        ob("sync_prefetch_hit_query.aligned_0523.transfer_sets_differ",
           "upstream_0523: a rank with a sidecar transfer packs R + 1 flags, a rank without one packs [hit]: the hit "
           "query is mismatched (T5 remains in 0.5.23; inferred from its _sync_prefetch_hit_query)",
           _check(v0523, _no_mismatch_at(AT_HIT_QUERY), _explain_mismatch, premise=all_registered, pin=_s10_shape),
           "sync_prefetch_hit_query.aligned_0523"),
        ob("sync_prefetch_hit_query.revoke_agreed_0523",
           f"D2, upstream_0523, {any_n}: after the hit query every rank's synced hit is 0 or none is, the check is "
           "revoked exactly when it is 0 (on every rank, before any IO), and a revoked check stages nothing",
           _check(v0523, _revoke_agreed, _explain_revoke)),
        ob("sync_prefetch_hit_query.revoke_agreed_0523.no_sync",
           "upstream_0523 without the storage-hit MIN: a rank whose own hit is 0 would revoke alone while another "
           "stages and fetches", _check(v0523, _revoke_agreed, _explain_revoke, twist=Twist(no_hit_sync=True),
                                        pin=_own_hits), "sync_prefetch_hit_query.revoke_agreed_0523"),
        # the IO threads
        ob("page_transfer.sidecars_after_full",
           f"T3, upstream_27264, {any_n}: a rank records SWA hits only once every Full page up to its target (the "
           "synced hit) completed, and at most one per key (keys: the last min(window, target) page hashes)",
           _check(up, _sidecars_after_full, _explain_sidecars)),
        ob("page_transfer.sidecars_after_full_0523",
           f"T3, upstream_0523, {any_n}: the same for 0.5.23's IO thread, whose target is the synced hit or the "
           "fewer Full pages it staged (F6), into the window buffer staged at hit time",
           _check(v0523, _sidecars_after_full, _explain_sidecars)),
        ob("page_transfer.sidecars_after_full.no_full_guard",
           "an IO thread that fetches the SWA window whether or not every Full page completed records hits for a "
           "window that does not end where its Full prefix does",
           _check(up, _sidecars_after_full, _explain_sidecars, twist=Twist(no_full_guard=True), pin=_swa_only),
           "page_transfer.sidecars_after_full"),
        ob("page_transfer.sidecars_after_full_0523.no_full_guard",
           "upstream_0523 without the Full-completion guard of _page_transfer_sidecar: the same",
           _check(v0523, _sidecars_after_full, _explain_sidecars, twist=Twist(no_full_guard=True), pin=_swa_only),
           "page_transfer.sidecars_after_full_0523"),
        # the vote
        ob("can_terminate_prefetch.agreed",
           f"upstream_27264, {any_n} with one termination policy: the vote lines up and every rank makes the same "
           "decision", _check(up, _agreed, _explain_go, premise=_and(one_policy, all_registered))),
        ob("can_terminate_prefetch.agreed.mixed_policies",
           "upstream_27264: a best_effort rank skips the MAX vote its wait_complete peer calls: a mismatched "
           "collective",
           _check(up, _agreed, _explain_go, premise=all_registered, pin=_policies(BE, WC)),
           "can_terminate_prefetch.agreed"),
        ob("can_terminate_prefetch.agreed_0523",
           f"upstream_0523, {any_n} with one termination policy: every rank makes the same decision",
           _check(v0523, _agreed, _explain_go, premise=_and(one_policy, all_registered))),
        ob("can_terminate_prefetch.agreed_0523.mixed_policies",
           "upstream_0523: best_effort on one rank and wait_complete on another call no collective, and one rank "
           "commits while the other waits (no collective notices; only the rank-consensus checker would)",
           _check(v0523, _agreed, _explain_go, premise=all_registered, pin=_policies(BE, WC)),
           "can_terminate_prefetch.agreed_0523"),
        # the packed MIN (T5)
        ob("reduce_prefetch_ack.aligned",
           f"T5, upstream_27264, {any_n} with the same transfer set and policy on every rank, all registered: every "
           "collective lines up (presence, op, shape) and every packed slot names the same pool on every rank",
           _check(up, t5_any, _explain_mismatch, premise=aligned)),
        ob("reduce_prefetch_ack.aligned.transfer_sets_differ",
           "S10's shape case: rank 0 built an SWA transfer, rank 1 none: packed [completed, swa] (2) against "
           "[completed] (1), a mismatched collective",
           _check(up, t5_any, _explain_mismatch, premise=_and(one_policy, all_registered), pin=_s10_shape),
           "reduce_prefetch_ack.aligned"),
        ob("reduce_prefetch_ack.aligned.same_shape_other_pool",
           "rank 0 built an SWA transfer, rank 1 a Mamba one: both pack 2 values and the MIN reduces SWA hits with "
           "Mamba hits silently",
           _check(up, t5_any, _explain_mismatch, premise=_and(one_policy, all_registered),
                  pin=lambda rn: [*_small(rn), rn.last.swa[0], z3.Not(rn.last.mamba[0]), rn.last.mamba[1],
                                  z3.Not(rn.last.swa[1])]),
           "reduce_prefetch_ack.aligned"),
        ob("reduce_prefetch_ack.fixed_layout_0523",
           f"upstream_0523, {any_n} with one policy and a non-empty transfer set on every rank (any, e.g. SWA on one "
           "rank, Mamba on another): the pool-hit ACK packed over PoolName lines up and mixes no pools",
           _check(v0523, _no_mismatch_at(AT_REDUCE), _explain_mismatch, premise=_and(
               one_policy, all_registered, lambda rn: z3.And([z3.Implies(active(rn.last, r), z3.Or(
                   rn.last.swa[r], rn.last.mamba[r])) for r in range(RANKS)])))),
        ob("reduce_prefetch_ack.fixed_layout_0523.comp_xfers_order",
           "the #27264 packing of the same transfer sets (comp_xfers order) reduces an SWA slot with a Mamba slot",
           _check(up, _no_mismatch_at(AT_REDUCE), _explain_mismatch, premise=_and(one_policy, all_registered),
                  pin=lambda rn: [*_small(rn), rn.last.swa[0], z3.Not(rn.last.mamba[0]), rn.last.mamba[1],
                                  z3.Not(rn.last.swa[1])]),
           "reduce_prefetch_ack.fixed_layout_0523"),
        # the trees (T1) and the Full host pages (T4)
        ob("handle_prefetch_result.same_tree",
           f"T1, upstream_27264, {any_n} with the same transfer set and policy on every rank: every rank commits the "
           "same tree (the same full prefix, attach or drop decision, split points)",
           _check(up, _same_tree, _explain_tree, premise=committed_same)),
        ob("handle_prefetch_result.same_tree.pre_27264",
           "pre_27264 (no sync of sidecar hits, S10's shape): a rank with a whole window attaches it at the min "
           "completed prefix while a rank with none drops it",
           _check(pre, _same_tree, _explain_tree, premise=committed_same, pin=_swa_only),
           "handle_prefetch_result.same_tree"),
        ob("handle_prefetch_result.same_tree_0523",
           f"T1, upstream_0523, {any_n} with the same transfer set and policy on every rank and no host pressure "
           "(every rank stages the whole synced hit; without it: F6, twin .host_pressure): every rank commits the "
           "same tree",
           _check(v0523, _same_tree, _explain_tree, premise=same_0523)),
        ob("handle_prefetch_result.same_tree_0523.no_pool_sync",
           "upstream_0523 without the pool-hit MIN: one rank's SWA fetch missed a page, its all-or-nothing check "
           "discards while the other rank inserts",
           _check(v0523, _same_tree, _explain_tree, premise=same_0523, twist=Twist(no_pool_sync=True),
                  pin=_swa_only), "handle_prefetch_result.same_tree_0523"),
        ob("handle_prefetch_result.same_tree_0523.host_pressure",
           "F6, upstream_0523 with one policy and one transfer set on every rank, but a rank short of Full host pages "
           "at hit time: it stages fewer pages than the synced hit after the sync, its all-or-nothing check expects "
           "its own length, and the ranks' trees differ",
           _check(v0523, _same_tree, _explain_tree, premise=committed_same, pin=_f6),
           "handle_prefetch_result.same_tree_0523"),
        ob("handle_prefetch_result.full_slots_conserved",
           f"T4, upstream_27264, {any_n}: on every rank that commits, 0 <= prefix <= M <= completed <= target (the "
           "synced hit) and staged <= R, so the Full host pages split into freed / tree / release queue / IO thread",
           _check(up, _full_slots, _explain_full)),
        ob("handle_prefetch_result.full_slots_conserved.max_reduce",
           "the packed MIN replaced by MAX: a rank's tree takes Full pages it never loaded",
           _check(up, _full_slots, _explain_full, twist=Twist(max_reduce=True), pin=_swa_only),
           "handle_prefetch_result.full_slots_conserved"),
        ob("handle_prefetch_result.no_write_after_release_0523",
           f"R5-d, upstream_0523, {any_n}: no rank's scheduler releases a window page its IO thread still writes "
           "(sidecar slots go to the IO thread unless pool_transfers_done)", _check(v0523, _no_hazard,
                                                                                   _explain_hazard)),
        ob("handle_prefetch_result.no_write_after_release_0523.best_effort_release",
           "best_effort_release: a best_effort rank terminates while its SWA fetch is in flight and its discard "
           "releases the buffer the IO thread writes",
           _check(Variant.BEST_EFFORT_RELEASE, _no_hazard, _explain_hazard, pin=_policies(BE, BE)),
           "handle_prefetch_result.no_write_after_release_0523"),
        ob("handle_prefetch_result.no_write_after_release_0523.upstream_27264",
           "upstream_27264 (R5-d): best_effort terminates while a rank's SWA fetch is in flight, and the drop path "
           "releases the buffer", _check(up, _no_hazard, _explain_hazard, pin=_policies(BE, BE)),
           "handle_prefetch_result.no_write_after_release_0523"),
        ob("handle_prefetch_result.no_write_after_release_0523.upstream_27264_any_terminated",
           "upstream_27264 under wait_complete (model finding from §6.3's vote, to confirm on the real code): another "
           "rank's IO terminated early, 'any terminated' lets a rank whose SWA fetch is in flight proceed past the "
           "'transfers not done' guard, and the drop path releases the buffer",
           _check(up, _no_hazard, _explain_hazard, pin=_policies(WC, WC)),
           "handle_prefetch_result.no_write_after_release_0523"),
        # the SWA commit (T2, T3, T4)
        ob("commit_prefetch.whole_window",
           f"T2, upstream_27264, {any_n}: a rank attaches an SWA window only if every rank fetched every page of a "
           "full window", _check(up, _whole_window, _explain_window, premise=committed_same)),
        ob("commit_prefetch.whole_window.pre_27264",
           "pre_27264: rank 0's local count says its window is whole while rank 1 fetched none of it",
           _check(pre, _whole_window, _explain_window, premise=committed_same, pin=_swa_only),
           "commit_prefetch.whole_window"),
        ob("commit_prefetch.whole_window.partial_window",
           "a commit that attaches on a synced count >= 1 attaches a partial window",
           _check(up, _whole_window, _explain_window, premise=committed_same, twist=Twist(partial_window=True),
                  pin=_partial), "commit_prefetch.whole_window"),
        ob("commit_prefetch.whole_window_0523",
           f"T2, upstream_0523, {any_n}, without host pressure: attached only if every rank fetched every page of its "
           "window buffer, a full window (or, at the root, a buffer as long as the whole inserted prefix: a request "
           "or synced hit shorter than the window, D1)",
           _check(v0523, _whole_window, _explain_window, premise=same_0523)),
        ob("commit_prefetch.whole_window_0523.host_pressure",
           "upstream_0523 with host pressure: a rank that staged fewer Full pages than the window shrinks its buffer "
           "to its keys (_sync_trailing_keys), fetches them and attaches that short window at the root while the "
           "other ranks did not fetch theirs whole (F6's kin)",
           _check(v0523, _whole_window, _explain_window, premise=committed_same, pin=_host_short_root),
           "commit_prefetch.whole_window_0523"),
        ob("commit_prefetch.whole_window_0523.partial_window",
           "upstream_0523 with a commit that attaches on a synced count >= 1: a rank short of Full host pages stages "
           "fewer than the window (F6), fetches only that many window keys, passes its all-or-nothing check (count "
           "== its keys) and attaches a partial window",
           _check(v0523, _whole_window, _explain_window, premise=committed_same, twist=Twist(partial_window=True),
                  pin=_host_short), "commit_prefetch.whole_window_0523"),
        ob("commit_prefetch.short_hit_at_root_0523",
           f"D1, upstream_0523, {any_n}: at the root, with a synced hit of 1 page or more but shorter than the window, "
           "one policy and one transfer set with SWA and no host pressure on every rank, and every page fetched: "
           "every rank "
           "commits the hit and attaches a window buffer of all of it (staged at hit time)",
           _check(v0523, _short_hit_attached, _explain_short_hit, premise=short_hit_at_root)),
        ob("commit_prefetch.short_hit_at_root_0523.staged_at_start",
           "upstream_0523 with the window buffer staged before the hit (the whole window, as before 0.5.23): the "
           "short hit fills only part of it and the commit drops a window that was whole",
           _check(v0523, _short_hit_attached, _explain_short_hit, premise=short_hit_at_root,
                  twist=Twist(staged_at_start=True), pin=_swa_only), "commit_prefetch.short_hit_at_root_0523"),
        ob("commit_prefetch.aligned_window",
           f"T3, upstream_27264, {any_n}: an attached window ends at the synced storage hit, so its pages hold the "
           "SWA KV of the positions they are attached at", _check(up, _aligned_window, _explain_aligned,
                                                                 premise=committed_same)),
        ob("commit_prefetch.aligned_window.pre_27264_s10",
           "S10: P=64, W=128, hit 10 pages on both ranks, rank 1 times out after 7: pre_27264 inserts 448 tokens on "
           "both and rank 0 attaches the window of tokens 512-639 at tokens 320-447",
           _check(pre, _aligned_window, _explain_aligned, premise=committed_same, pin=_s10),
           "commit_prefetch.aligned_window"),
        ob("commit_prefetch.swa_slots_conserved",
           "T4: over any host path (two nodes with or without SWA, one inserted) and any window, the attach-or-release "
           "walk attaches or releases each window page exactly once and each attached node is exactly its slice",
           _walk_check()),
        ob("commit_prefetch.swa_slots_conserved.no_prefix_release",
           "a walk without step 6 leaks the buffer pages that fall before the anchor",
           _walk_check(prefix_release=False), "commit_prefetch.swa_slots_conserved"),
        ob("commit_prefetch.swa_slots_conserved.split_at_absolute_offset",
           "a walk that splits at the window start's offset from the anchor instead of from the node's start "
           "attaches a node longer or shorter than its slice",
           _walk_check(absolute_split=True), "commit_prefetch.swa_slots_conserved"),
        # count_pool_hits (R5-c)
        ob("count_pool_hits.synced_prefix_fetched",
           f"R5-c, up to 8 ranks and {KEYS} keys: the MIN of the ranks' leading runs c means the first c keys arrived "
           "on every rank", _prefix_check(by_sum=False)),
        ob("count_pool_hits.synced_prefix_fetched.sum",
           "hits counted by sum (#27264, sum_hits): the MIN counts a key a rank misses",
           _prefix_check(by_sum=True, small=True), "count_pool_hits.synced_prefix_fetched"),
        ob("count_pool_hits.all_or_nothing_agrees",
           f"up to {KEYS} keys: sum and leading run agree on 'every key arrived', so R5-c is harmless for SWA's "
           "all-or-nothing commit", _agree_check(prefix_reading=False)),
        ob("count_pool_hits.all_or_nothing_agrees.prefix_reading",
           "a prefix reading (count >= j) of the same counts differs between sum and leading run",
           _agree_check(prefix_reading=True), "count_pool_hits.all_or_nothing_agrees"),
    )


OBLIGATIONS: tuple[Obligation, ...] = _obligations()
