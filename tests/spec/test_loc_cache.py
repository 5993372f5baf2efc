"""kvproof.spec.loc_cache: the per-point traces, drift against the reference witnesses, non-vacuity.

The drift test replays the witness traces of ``tests/reference/test_loc_cache.py``
(the same functions, with the reference module recorded call by call) and checks
that every recorded step, abstracted to the model's concrete values, satisfies the
model's transition relation, and that the model's translations return what the
reference returned and flag the same stale reads (sglang_semantics.md §3, §9 S5 S6).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import z3

from kvproof.reference import loc_cache as ref
from kvproof.reference import swa_allocator as sa
from kvproof.spec import OBLIGATIONS, run
from kvproof.spec import loc_cache as lc
from kvproof.spec.loc_cache import (
    ADDRS,
    K,
    NF,
    POINT_OF,
    POINT_OPS,
    RESERVED,
    REAL_SLOTS,
    STALE,
    UPSTREAM,
    Action,
    Op,
    Point,
    State,
    Variant,
    find_trace,
    witness,
    witness_search,
)

# ---- the per-point traces -------------------------------------------------------------------


def test_points_match_the_reference() -> None:
    assert {p.value for p in Point} == {p.value for p in ref.InvalidationPoint}
    assert {p.value for p in POINT_OF.values()} == {p.value for p in Point}


def test_every_point_has_a_twin_of_the_sound_obligation() -> None:
    names = {ob.name: ob for ob in OBLIGATIONS}
    for point in Point:
        twin = names[f"loc_cache.no_stale_read.without_{point.value}"]
        assert twin.expect == "counterexample" and twin.twin_of == "loc_cache.no_stale_read.consecution"


@pytest.mark.parametrize("point", list(Point), ids=[p.value for p in Point])
def test_without_point_trace_is_short_and_passes_the_point(point: Point) -> None:
    variant = Variant(policy=lc.Policy().without(point))
    trace = find_trace(variant, STALE, witness_search(*POINT_OPS[point]))
    assert trace is not None, point
    steps = trace.rows[1:]
    assert 1 <= len(steps) <= 8
    passing = {op.call for op, p in POINT_OF.items() if p is point}
    removed = [row for row in steps if row.op in passing and f"point {point.value} removed" in row.call]
    assert removed, trace.table()
    assert "STALE" in steps[-1].reads and "stale read" in trace.violation
    assert all("STALE" not in row.reads for row in steps[:-1])
    # the same op sequence reads nothing stale under the upstream policy
    assert witness(UPSTREAM, [Op[_op_name(row.op)] for row in steps]) is not None


def _op_name(call: str) -> str:
    return "TRANSLATE" if call == "translate_loc_from_full_to_swa" else call.upper()


def test_rendered_point_trace_reads_like_the_witness() -> None:
    result = run(next(ob for ob in OBLIGATIONS if ob.name == "loc_cache.no_stale_read.without_forward"))
    assert result.status == "counterexample"
    for column in ("step", "op(arguments)", "returned vs fresh", "cache key -> value", "index memory", "M (* = live)"):
        assert column in result.detail
    assert "forward(" in result.detail and "STALE: fresh M[" in result.detail


def test_s6_trace_captures_without_gather_then_replays_the_constant() -> None:
    result = run(next(ob for ob in OBLIGATIONS if ob.name == "loc_cache.s6_capture_without_run_once"))
    assert result.status == "counterexample"
    assert "miss/hit/hit -> recorded_gather=False" in result.detail
    assert "replay: constant" in result.detail and "STALE" in result.detail.splitlines()[-2]


def test_e1_trace_reuses_an_address() -> None:
    result = run(next(ob for ob in OBLIGATIONS if ob.name == "loc_cache.e1_needed"))
    assert "reuses a freed address" in result.detail and "batch prep" in result.detail


# ---- non-vacuity ----------------------------------------------------------------------------

PREFIX: dict[Op, list[Op]] = {
    Op.TRANSLATE: [Op.NEW_STORAGE],
    Op.FORWARD: [Op.ALLOC, Op.NEW_STORAGE],
    Op.CAPTURE: [Op.NEW_STORAGE],
    Op.REPLAY: [Op.NEW_STORAGE, Op.CAPTURE, Op.ALLOC, Op.WRITE_INDEX],
    Op.FREE_STORAGE: [Op.NEW_STORAGE],
    Op.WRITE_INDEX: [Op.NEW_STORAGE],
    Op.ALLOC_EXTEND: [Op.NEW_STORAGE],
    Op.ALLOC_DECODE: [Op.ALLOC, Op.NEW_STORAGE],
    Op.FREE_SWA: [Op.ALLOC],
    Op.FREE: [Op.ALLOC],
    Op.FREE_FULL: [Op.ALLOC, Op.FREE_SWA],
    Op.SET_FULL_TO_SWA_MAPPING: [Op.ALLOC],
    Op.CLEAR: [Op.ALLOC],
    Op.REGISTER_MAPPING: [Op.ALLOC],
    Op.RESTORE_STATE: [Op.ALLOC],
}


@pytest.mark.parametrize("op", list(Op), ids=[op.call for op in Op])
def test_every_transition_is_enabled_and_effective_from_a_reachable_state(op: Op) -> None:
    trace = witness(UPSTREAM, [*PREFIX.get(op, []), op], changes=True)
    assert trace is not None, op
    assert trace.ops()[-1] == op.call


def test_upstream_runs_the_witness_shapes_without_stale_reads() -> None:
    """Address reuse, refill by alloc_extend, capture and replay: all fresh under the upstream policy."""
    ops = [Op.NEW_STORAGE, Op.ALLOC_EXTEND, Op.NEW_STORAGE, Op.FORWARD, Op.FREE_STORAGE, Op.NEW_STORAGE,
           Op.ALLOC_EXTEND, Op.CAPTURE]
    assert witness(UPSTREAM, ops, changes=True) is not None


def test_the_invariant_is_not_vacuous() -> None:
    """A reachable state with a valid entry in a quiet pool and a captured graph satisfies it."""
    u = lc.Unrolling.fresh(3)
    solver = z3.Solver()
    solver.add(*u.path(UPSTREAM), u.actions[0].op == Op.NEW_STORAGE, u.actions[1].op == Op.CAPTURE,
               u.actions[2].op == Op.TRANSLATE)
    last = u.states[-1]
    solver.add(last.quiet[0], last.caches[0].valid, last.graph.captured, lc.invariant(last))
    assert solver.check() == z3.sat


# ---- drift: the reference witnesses against the transition relation ---------------------------

REF_TESTS = Path(__file__).resolve().parents[1] / "reference" / "test_loc_cache.py"


def _load_witnesses() -> Any:
    spec = importlib.util.spec_from_file_location("kvproof_reference_loc_cache_witnesses", REF_TESTS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WIT = _load_witnesses()

RECORDED = {
    "new_storage", "free_storage", "write_index", "translate_loc_from_full_to_swa", "forward", "capture", "replay",
    "alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "free", "free_swa", "free_full",
    "set_full_to_swa_mapping", "clear", "register_mapping", "restore_state",
}


@dataclass
class Call:
    name: str
    args: tuple
    kwargs: dict
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
            after = out[0] if isinstance(out, tuple) else out
            before_quiet = self.quiet
            self.quiet = self._phase(name, args, kwargs, after)
            self.calls.append(Call(name, args, kwargs, system, after, out, before_quiet, self.quiet))
            return out

        return call

    def _phase(self, name: str, args: tuple, kwargs: dict, after: ref.LocCacheSystem) -> tuple[bool, bool]:
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


def _record(trace: Callable, system: ref.LocCacheSystem) -> list[Call]:
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
        op = Op.TRANSLATE if name == "translate_loc_from_full_to_swa" else Op[name.upper()]
        facts = [a.op == op]
        if op in (Op.TRANSLATE, Op.FORWARD, Op.CAPTURE):
            addr, numel = self.view(before, args[0])
            facts += [a.addr == addr, a.numel == numel, a.pool == kwargs.get("pool", 0)]
        elif op in (Op.ALLOC_EXTEND, Op.ALLOC_DECODE):
            last = args[2] if op is Op.ALLOC_EXTEND else args[1]
            addr, numel = self.view(before, last)
            facts += [a.addr == addr, a.numel == numel]
        elif op is Op.NEW_STORAGE:
            base, contents = args
            facts += [a.addr == self.element[base], a.numel == len(contents)]
            facts += [a.data[i] == v for i, v in enumerate(contents)]
        elif op is Op.FREE_STORAGE:
            facts.append(a.addr == self.element[before.memory.storages[args[0]].base])
        elif op is Op.WRITE_INDEX:
            sid, offset, values = args
            assert len(values) == 1, "the model writes one element per step"
            facts += [a.addr == self.element[before.memory.storages[sid].base] + offset, a.data[0] == values[0]]
        return facts


def _check_trace(calls: list[Call], variant: Variant, final: ref.LocCacheSystem) -> set[str]:
    """Every call satisfies the model's step; returns the names of the ops checked."""
    alpha = Abstraction(final)
    checked = set()
    for n, call in enumerate(calls):
        s, a, t = State.fresh("pre"), Action.fresh("act"), State.fresh("post")
        op = Op.TRANSLATE if call.name == "translate_loc_from_full_to_swa" else Op[call.name.upper()]
        eff = lc.effects(s, a, variant, (op,))
        solver = z3.Solver()
        solver.add(lc.transition(eff, s, a, t), *alpha.state(call.before, call.quiet_before, s),
                   *alpha.state(call.after, call.quiet_after, t), *alpha.action(call, a))
        assert solver.check() == z3.sat, f"step {n + 1} {call.name}{call.args} is not a model transition"
        model = solver.model()
        newly_stale = len(call.after.stale_reads) > len(call.before.stale_reads)
        assert z3.is_true(model.eval(lc.stale_read(eff, a), model_completion=True)) == newly_stale, call.name
        if op is Op.TRANSLATE:
            returned = call.result[1]
            got = [model.eval(x, model_completion=True).as_long() for x in eff[op].reads[0].returned[: len(returned)]]
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
            "free_storage", "write_index", "alloc_extend", "alloc_decode", "alloc"} <= checked


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
def test_s5_and_shared_cache_traces_are_model_runs(trace: Callable, broken: ref.LocCachePolicy) -> None:
    for policy in (ref.LocCachePolicy(), broken):
        calls = _record(trace, ref.initial_system(CFG, policy))
        final = calls[-1].after
        assert (final.stale_reads != ()) == (policy is broken)
        _check_trace(calls, _variant(policy), final)


def test_drift_check_rejects_a_wrong_after_state() -> None:
    """The drift check has teeth: a translation that caches the wrong value is no model step."""
    calls = _record(WIT.w_alloc, ref.initial_system(CFG))
    call = next(c for c in calls if c.name == "translate_loc_from_full_to_swa")
    alpha = Abstraction(calls[-1].after)
    s, a, t = State.fresh("pre"), Action.fresh("act"), State.fresh("post")
    solver = z3.Solver()
    solver.add(lc.step(s, a, t, UPSTREAM), *alpha.state(call.before, call.quiet_before, s),
               *alpha.state(call.after, call.quiet_after, t), *alpha.action(call, a))
    assert solver.check() == z3.sat
    solver.add(t.caches[0].value[0] == 7)
    assert solver.check() == z3.unsat
