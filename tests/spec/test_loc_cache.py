"""kvproof.spec.loc_cache: one transition per reference op, the per-point traces, witness drift, non-vacuity.

The component module's ``SYSTEM`` has a transition named like every operation of
``kvproof.reference.loc_cache``, ``kvproof prove -k <op>`` finds obligations about each,
and the combined step the BMC queries use agrees with the per-op relations. The
witness drift test replays the traces of ``tests/reference/test_loc_cache.py`` (the
same functions, with the reference module recorded call by call) and checks that
every recorded step, abstracted to the model's concrete values, is a step of the
transition of its name, and that the model's translations return what the reference
returned and flag the same stale reads (sglang_semantics.md §3, §9 S5 S6). Sampled
runs are in ``test_drift_loc_cache.py``.
"""

from __future__ import annotations

import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import z3

from kvproof.reference import loc_cache as ref
from kvproof.reference import swa_allocator as sa
from kvproof.spec import OBLIGATIONS, obligations, run, systems
from kvproof.spec import loc_cache as lc
from kvproof.spec._ts import Unrolling, combine_agrees
from kvproof.spec.loc_cache import (
    ADDRS,
    NF,
    OPS,
    POINT_OF,
    POINT_OPS,
    REAL_SLOTS,
    RESERVED,
    SYSTEM,
    UPSTREAM,
    Action,
    K,
    Point,
    State,
    Variant,
    find_trace,
    stale,
    witness,
    witness_search,
)

# ---- one transition per reference op, one name per op ----------------------------------------

#: The reference's queries, constants and values: everything but the operations.
QUERIES = {"initial_system", "view_contents", "data_ptr", "cache_key", "fresh_translation", "ELEMENT_BYTES",
           "UPSTREAM_POINTS"}
REFERENCE_OPS = sorted(name for name in set(ref.__all__) - QUERIES if not inspect.isclass(getattr(ref, name)))


def test_the_component_exports_its_system_and_obligations() -> None:
    assert lc.SYSTEMS == (SYSTEM,)
    assert systems("loc_cache") == lc.SYSTEMS
    assert SYSTEM.component == "loc_cache"
    assert obligations(component="loc_cache") == lc.OBLIGATIONS


def test_every_reference_op_has_a_transition_of_its_name() -> None:
    assert len(REFERENCE_OPS) == 21, REFERENCE_OPS
    assert sorted(SYSTEM.ops) == REFERENCE_OPS
    assert SYSTEM.ops == OPS


@pytest.mark.parametrize("op", REFERENCE_OPS)
def test_prove_k_op_finds_obligations_about_the_op(op: str) -> None:
    """``kvproof prove -k <op>`` selects by substring; some obligations are named after the op itself, a sound one
    and a broken twin."""
    named = [ob for ob in obligations(name_filter=op) if ob.name.startswith(f"loc_cache.{op}.")]
    assert named, f"no obligation named loc_cache.{op}.*"
    assert any(ob.twin_of is None for ob in named) and any(ob.twin_of is not None for ob in named), named


def test_obligation_names_follow_component_op_claim() -> None:
    for ob in lc.OBLIGATIONS:
        component, head, *claim = ob.name.split(".")
        assert component == "loc_cache" and claim, ob.name
        assert head in OPS or head == "no_stale_read", f"{ob.name}: {head!r} is neither an op nor an invariant"
        if ob.twin_of is not None:
            assert ob.twin_of in {o.name for o in lc.OBLIGATIONS if o.twin_of is None}, ob.name


#: Every broken part at once (the twins' systems): combine must agree with the per-op relations for them too.
BROKEN = Variant(policy=lc.Policy(points=frozenset({Point.FORWARD, Point.CLEAR}), key_scheme=lc.KeyScheme.STORAGE_BASE,
                                  shared_across_pools=True),
                 e1=False, in_place_writes=False, reuse_rewrites=False, write_rewrites=False, free_scrubs=True,
                 view_checks_live=False, invalidate_ignores_pool=True, c4_disjoint=False,
                 free_full_writes_mapping=True, restore_writes_mapping=True, replay_invalidates=False)


@pytest.mark.parametrize("variant", [UPSTREAM, BROKEN], ids=["upstream", "broken"])
@pytest.mark.parametrize("op", OPS)
def test_the_combined_step_agrees_with_each_transition(op: str, variant: Variant) -> None:
    """BMC and induction use ``combine`` (one frame of If chains); the drift tests and the per-op obligations use
    ``transitions[op]``: with the op chosen, both are the same relation."""
    system = lc.system(variant)
    assert system.combine is not None
    assert combine_agrees(system, op), f"combine and transitions[{op!r}] differ"


def test_effects_are_memoised_per_variant() -> None:
    """The memo keys on the variant and the terms: the same state under another variant is another effect."""
    s, a = State.fresh("m"), Action.fresh("m")
    assert lc.effect(UPSTREAM, "clear", s, a) is lc.effect(UPSTREAM, "clear", State.fresh("m"), Action.fresh("m"))
    broken = Variant(policy=lc.Policy().without(Point.CLEAR))
    assert lc.effect(broken, "clear", s, a) is not lc.effect(UPSTREAM, "clear", s, a)
    assert z3.is_true(z3.simplify(lc.effect(broken, "clear", s, a).post.caches[0].valid == s.caches[0].valid))


# ---- the per-point traces -------------------------------------------------------------------


def test_points_match_the_reference() -> None:
    assert {p.value for p in Point} == {p.value for p in ref.InvalidationPoint}
    assert {p.value for p in POINT_OF.values()} == {p.value for p in Point}
    assert set(POINT_OF) <= set(OPS)


def test_every_point_has_a_twin_of_the_sound_obligation() -> None:
    names = {ob.name: ob for ob in OBLIGATIONS}
    for point in Point:
        twin = names[f"loc_cache.no_stale_read.without_{point.value}"]
        assert twin.expect == "counterexample" and twin.twin_of == "loc_cache.no_stale_read.consecution"


def _reads(row: Any) -> str:
    """The translations column of a trace row (the system's step cells come first)."""
    return str(row.cells[0])


@pytest.mark.parametrize("point", list(Point), ids=[p.value for p in Point])
def test_without_point_trace_is_short_and_passes_the_point(point: Point) -> None:
    variant = Variant(policy=lc.Policy().without(point))
    search = witness_search(*POINT_OPS[point])
    trace = find_trace(variant, stale(variant, search.ops), search)
    assert trace is not None, point
    steps = trace.rows[1:]
    assert 1 <= len(steps) <= 8
    passing = {op for op, p in POINT_OF.items() if p is point}
    removed = [row for row in steps if row.op in passing and f"point {point.value} removed" in row.call]
    assert removed, trace.table()
    assert "STALE" in _reads(steps[-1]) and "stale read" in trace.violation
    assert all("STALE" not in _reads(row) for row in steps[:-1])
    # the same op sequence reads nothing stale under the upstream policy
    assert witness(UPSTREAM, [row.op for row in steps]) is not None


def _detail(name: str) -> str:
    result = run(next(ob for ob in OBLIGATIONS if ob.name == name))
    assert result.status == "counterexample", result.detail
    return result.detail


def test_rendered_point_trace_reads_like_the_witness() -> None:
    detail = _detail("loc_cache.no_stale_read.without_forward")
    for column in ("step", "op(arguments)", "returned vs fresh", "cache key -> value", "index memory", "M (* = live)"):
        assert column in detail
    assert "forward(" in detail and "STALE: fresh M[" in detail
    assert "backup held" not in detail, "a column empty in every row is left out"


def test_s6_trace_captures_without_gather_then_replays_the_constant() -> None:
    detail = _detail("loc_cache.replay.s6_capture_without_run_once")
    assert "miss/hit/hit -> recorded_gather=False" in detail
    assert "replay: constant" in detail and "STALE" in detail.splitlines()[-2]


def test_e1_trace_reuses_an_address() -> None:
    detail = _detail("loc_cache.translate_loc_from_full_to_swa.e1_needed")
    assert "reuses a freed address" in detail and "batch prep" in detail and "freed @" in detail


def test_single_step_twins_show_only_what_they_are_about() -> None:
    """The pins of a twin (pool 1 idle, M = 0 on dead slots, no graph, no backup) keep its table short."""
    detail = _detail("loc_cache.alloc.keeps_invariant.without_point")
    assert "(any invariant state)" in detail and "[point alloc removed: no invalidation]" in detail
    assert "pool 1" not in detail and "backup held" not in detail
    assert detail.splitlines()[-1].startswith("broken after step 1: C1: pool 0 quiet")


# ---- non-vacuity ----------------------------------------------------------------------------

PREFIX: dict[str, list[str]] = {
    "translate_loc_from_full_to_swa": ["new_storage"],
    "make_view": ["new_storage"],
    "invalidate_loc_cache": ["new_storage", "translate_loc_from_full_to_swa"],
    "forward": ["alloc", "new_storage"],
    "capture": ["new_storage"],
    "replay": ["new_storage", "capture", "alloc", "write_index"],
    "free_storage": ["new_storage"],
    "write_index": ["new_storage"],
    "alloc_extend": ["new_storage"],
    "alloc_decode": ["alloc", "new_storage"],
    "free_swa": ["alloc"],
    "free": ["alloc"],
    "free_full": ["alloc", "free_swa"],
    "set_full_to_swa_mapping": ["alloc"],
    "clear": ["alloc"],
    "register_mapping": ["alloc"],
    "restore_state": ["backup_state", "alloc"],
}
#: Ops that change no state (make_view only constrains its view).
STUTTERS = {"make_view"}


@pytest.mark.parametrize("op", OPS)
def test_every_transition_is_enabled_and_effective_from_a_reachable_state(op: str) -> None:
    trace = witness(UPSTREAM, [*PREFIX.get(op, []), op], changes=op not in STUTTERS)
    assert trace is not None, op
    assert trace.ops()[-1] == op


def test_upstream_runs_the_witness_shapes_without_stale_reads() -> None:
    """Address reuse, refill by alloc_extend, capture and replay: all fresh under the upstream policy."""
    ops = ["new_storage", "alloc_extend", "new_storage", "forward", "free_storage", "new_storage", "alloc_extend",
           "capture"]
    assert witness(UPSTREAM, ops, changes=True) is not None


def test_the_invariant_is_not_vacuous() -> None:
    """A reachable state with a valid entry in a quiet pool and a captured graph satisfies it."""
    u = Unrolling.fresh(SYSTEM, 3)
    ops = ("new_storage", "capture", "translate_loc_from_full_to_swa")
    solver = z3.Solver()
    solver.add(*u.path(), *u.run(ops))
    last = u.states[-1]
    solver.add(last.quiet[0], last.caches[0].valid, last.graph.captured, SYSTEM.holds(last))
    assert solver.check() == z3.sat


# ---- drift: the reference witnesses against the transitions ------------------------------------

REF_TESTS = Path(__file__).resolve().parents[1] / "reference" / "test_loc_cache.py"


def _load_witnesses() -> Any:
    spec = importlib.util.spec_from_file_location("kvproof_reference_loc_cache_witnesses", REF_TESTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WIT = _load_witnesses()

RECORDED = set(OPS) - {"backup_state"}  # backup_state returns a backup, not a system; the witnesses take none


@dataclass
class Call:
    name: str
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    before: ref.LocCacheSystem
    after: ref.LocCacheSystem
    result: Any
    quiet_before: tuple[bool, bool]
    quiet_after: tuple[bool, bool]


@dataclass
class Recorder:
    """Stands in for the reference module inside the witness functions and logs every top-level op."""

    calls: list[Call] = field(default_factory=list)
    quiet: tuple[bool, bool] = (True, True)
    used: set[int] = field(default_factory=set)  # byte addresses ever allocated

    def __getattr__(self, name: str) -> Any:
        target = getattr(ref, name)
        if name not in RECORDED:
            return target

        def call(system: ref.LocCacheSystem, *args: Any, **kwargs: Any) -> Any:
            out = target(system, *args, **kwargs)
            after = system if name == "make_view" else out[0] if isinstance(out, tuple) else out
            before_quiet = self.quiet
            self.quiet = self._phase(name, args, after)
            self.calls.append(Call(name, args, kwargs, system, after, out, before_quiet, self.quiet))
            return out

        return call

    def _phase(self, name: str, args: tuple[Any, ...], after: ref.LocCacheSystem) -> tuple[bool, bool]:
        """E1: index memory rewritten (in place, or a new storage over used bytes) -> batch preparation."""
        if name == "new_storage":
            base, contents = args
            covered = {base + ref.ELEMENT_BYTES * i for i in range(len(contents))}
            reuse = bool(covered & self.used)
            self.used |= covered
            return (False, False) if reuse else self.quiet
        if name == "write_index":
            return (False, False)
        if name in ("forward", "replay"):
            return (True, self.quiet[1])
        return self.quiet


def _record(trace: Callable[[ref.LocCacheSystem], Any], system: ref.LocCacheSystem) -> list[Call]:
    recorder = Recorder()
    saved = WIT.lc
    WIT.lc = recorder
    try:
        trace(system)
    finally:
        WIT.lc = saved
    return recorder.calls


def _variant(policy: ref.LocCachePolicy) -> Variant:
    return Variant(policy=lc.Policy(points=frozenset(Point(p.value) for p in policy.invalidate_at),
                                    key_scheme=lc.KeyScheme(policy.key_scheme.value),
                                    shared_across_pools=policy.shared_across_pools))


class Abstraction:
    """Byte addresses of the reference's storages -> model element addresses (bases in order of appearance)."""

    def __init__(self, final: ref.LocCacheSystem) -> None:
        sizes: dict[int, int] = {}
        for s in final.memory.storages:
            sizes[s.base] = max(sizes.get(s.base, 0), len(s.contents))
        self.element: dict[int, int] = {}
        nxt = 0
        for base, size in sizes.items():
            for i in range(size):
                self.element[base + ref.ELEMENT_BYTES * i] = nxt + i
            nxt += size
        assert nxt <= len(ADDRS), f"the trace needs {nxt} index elements, the model has {len(ADDRS)}"

    def view(self, system: ref.LocCacheSystem, view: ref.IndexView) -> tuple[int, int]:
        return self.element[ref.data_ptr(system.memory, view)], view.numel

    def state(self, system: ref.LocCacheSystem, quiet: tuple[bool, bool], s: State) -> list[z3.BoolRef]:
        """Equalities pinning ``s`` to the concrete ``system`` (unobservable fields stay free)."""
        mapping, alloc = system.allocator.full_to_swa_index_mapping, system.allocator
        assert all(mapping[x] == 0 and not sa.is_live(alloc, x) for x in RESERVED)
        beyond = range(NF, len(mapping) - 1)
        assert all(mapping[x] == 0 and not sa.is_live(alloc, x) for x in beyond), "slots beyond the model are used"
        facts = [s.M[x] == mapping[x] for x in REAL_SLOTS]
        facts += [s.live[x] == sa.is_live(alloc, x) for x in REAL_SLOTS]
        facts += [s.M2[x] == system.other_mapping[x] for x in REAL_SLOTS]
        for a in ADDRS:
            covering = [st for st in system.memory.storages
                        for i in range(len(st.contents)) if self.element.get(st.base + ref.ELEMENT_BYTES * i) == a]
            facts += [s.used[a] == bool(covering), s.alive[a] == bool(covering and covering[-1].alive)]
            if covering:
                st = covering[-1]
                offset = a - self.element[st.base]
                facts += [s.cont[a] == st.contents[offset], s.base[a] == self.element[st.base]]
        for i, cache in enumerate(system.caches):
            c = s.caches[i]
            if cache.key is None:
                facts.append(z3.Not(c.valid))
                continue
            ptr, numel = cache.key
            assert cache.value is not None and numel <= K
            facts += [c.valid, c.addr == self.element[ptr], c.numel == numel, c.pool == cache.pool]
            facts += [c.value[j] == (cache.value[j] if j < numel else 0) for j in range(K)]
        facts += [s.quiet[0] == quiet[0], s.quiet[1] == quiet[1]]
        g = system.graph
        if g is None:
            facts.append(z3.Not(s.graph.captured))
        else:
            addr, numel = self.view(system, g.loc)
            facts += [s.graph.captured, s.graph.recorded == g.recorded_gather, s.graph.addr == addr,
                      s.graph.numel == numel]
            facts += [s.graph.constant[j] == (g.constant[j] if j < numel else 0) for j in range(K)]
        return facts

    def action(self, call: Call, a: Action) -> list[z3.BoolRef]:
        name, args, kwargs, before = call.name, call.args, call.kwargs, call.before
        facts: list[z3.BoolRef] = []
        if name in ("translate_loc_from_full_to_swa", "forward", "capture"):
            addr, numel = self.view(before, args[0])
            facts += [a.addr == addr, a.numel == numel, a.pool == kwargs.get("pool", 0)]
        elif name in ("alloc_extend", "alloc_decode"):
            addr, numel = self.view(before, args[2] if name == "alloc_extend" else args[1])
            facts += [a.addr == addr, a.numel == numel]
        elif name == "make_view":
            sid, offset, numel = args
            facts += [a.addr == self.element[before.memory.storages[sid].base] + offset, a.numel == numel]
        elif name == "new_storage":
            base, contents = args
            facts += [a.addr == self.element[base], a.numel == len(contents)]
            facts += [a.data[i] == v for i, v in enumerate(contents)]
        elif name == "free_storage":
            facts.append(a.addr == self.element[before.memory.storages[args[0]].base])
        elif name == "write_index":
            sid, offset, values = args
            assert len(values) == 1, "the model writes one element per step"
            facts += [a.addr == self.element[before.memory.storages[sid].base] + offset, a.data[0] == values[0]]
        return facts


def _check_trace(calls: list[Call], variant: Variant, final: ref.LocCacheSystem) -> set[str]:
    """Every call is a step of the transition of its name; returns the names of the ops checked."""
    alpha, system = Abstraction(final), lc.system(variant)
    checked = set()
    for n, call in enumerate(calls):
        s, a, t = State.fresh("pre"), Action.fresh("act"), State.fresh("post")
        solver = z3.Solver()
        solver.add(system.transitions[call.name](s, a, t), *alpha.state(call.before, call.quiet_before, s),
                   *alpha.state(call.after, call.quiet_after, t), *alpha.action(call, a))
        assert solver.check() == z3.sat, f"step {n + 1} {call.name}{call.args} is not a step of its transition"
        model = solver.model()
        reads = lc.effect(variant, call.name, s, a).reads
        newly_stale = len(call.after.stale_reads) > len(call.before.stale_reads)
        model_stale = any(z3.is_true(model.eval(r.stale, model_completion=True)) for r in reads)
        assert model_stale == newly_stale, call.name
        if call.name == "translate_loc_from_full_to_swa":
            returned = call.result[1]
            got = [model.eval(x, model_completion=True).as_long() for x in reads[0].returned[: len(returned)]]
            assert tuple(got) == returned
        checked.add(call.name)
    return checked


CFG = WIT.CFG


@pytest.mark.parametrize("point", sorted(WIT.WITNESSES))
@pytest.mark.parametrize("broken", [False, True], ids=["upstream", "without_point"])
def test_reference_witnesses_are_model_runs(point: str, broken: bool) -> None:
    policy, trace = WIT.WITNESSES[point]
    policy = policy if broken else ref.LocCachePolicy()
    calls = _record(trace, ref.initial_system(CFG, policy))
    final = calls[-1].after
    assert (final.stale_reads != ()) == broken
    _check_trace(calls, _variant(policy), final)


def test_drift_covers_translate_forward_free_swa_capture_replay() -> None:
    checked: set[str] = set()
    for policy, trace in WIT.WITNESSES.values():
        calls = _record(trace, ref.initial_system(CFG, policy))
        checked |= _check_trace(calls, _variant(policy), calls[-1].after)
    assert {"translate_loc_from_full_to_swa", "forward", "free_swa", "capture", "replay", "new_storage",
            "free_storage", "write_index", "alloc_extend", "alloc_decode", "alloc", "make_view"} <= checked


def _s5_small(system: ref.LocCacheSystem) -> None:
    """S5 within the model's three elements: one storage [2, 3], views [0:1] and [1:2]."""
    system, _ = WIT.lc.alloc(system, 2)
    system, sid = WIT.lc.new_storage(system, 1024, [2, 3])
    system, _ = WIT.lc.translate_loc_from_full_to_swa(system, WIT.lc.make_view(system, sid, 0, 1))
    WIT.lc.translate_loc_from_full_to_swa(system, WIT.lc.make_view(system, sid, 1, 1))


def _shared(system: ref.LocCacheSystem) -> None:
    system, _ = WIT.lc.alloc(system, 2)
    system, view = WIT.storage(system, [2])
    system, _ = WIT.lc.translate_loc_from_full_to_swa(system, view, pool=0)
    WIT.lc.translate_loc_from_full_to_swa(system, view, pool=1)


@pytest.mark.parametrize(("trace", "broken"), [
    (_s5_small, ref.LocCachePolicy(key_scheme=ref.KeyScheme.STORAGE_BASE)),
    (_shared, ref.LocCachePolicy(shared_across_pools=True)),
], ids=["s5", "shared"])
def test_s5_and_shared_cache_traces_are_model_runs(trace: Callable[[ref.LocCacheSystem], None],
                                                   broken: ref.LocCachePolicy) -> None:
    for policy in (ref.LocCachePolicy(), broken):
        calls = _record(trace, ref.initial_system(CFG, policy))
        final = calls[-1].after
        assert (final.stale_reads != ()) == (policy is broken)
        _check_trace(calls, _variant(policy), final)


def test_drift_check_rejects_a_wrong_after_state() -> None:
    """The drift check has teeth: a translation that caches the wrong value is no step of translate."""
    calls = _record(WIT.w_alloc, ref.initial_system(CFG))
    call = next(c for c in calls if c.name == "translate_loc_from_full_to_swa")
    alpha = Abstraction(calls[-1].after)
    s, a, t = State.fresh("pre"), Action.fresh("act"), State.fresh("post")
    solver = z3.Solver()
    solver.add(SYSTEM.transitions[call.name](s, a, t), *alpha.state(call.before, call.quiet_before, s),
               *alpha.state(call.after, call.quiet_after, t), *alpha.action(call, a))
    assert solver.check() == z3.sat
    solver.add(t.caches[0].value[0] == 7)
    assert solver.check() == z3.unsat
