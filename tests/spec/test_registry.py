"""Shape of the obligation registry: unique names, twins, docstrings, filters, verdict rules."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import z3

import kvproof.spec as spec
from kvproof.reference import COMPONENTS
from kvproof.reference.registry import Component
from kvproof.spec import OBLIGATIONS, TEST_BUDGET, TEST_RLIMIT, Obligation, Result, obligations, run
from kvproof.spec._solver import Expect, as_int, model_values

SOUND = [ob for ob in OBLIGATIONS if ob.twin_of is None]
TWINS = [ob for ob in OBLIGATIONS if ob.twin_of is not None]


def test_names_are_unique_dotted_ids() -> None:
    names = [ob.name for ob in OBLIGATIONS]
    assert len(names) == len(set(names))
    assert all("." in name and " " not in name for name in names)


def test_sound_obligations_expect_proof_and_twins_expect_counterexamples() -> None:
    assert all(ob.expect == "proved" for ob in SOUND)
    assert all(ob.expect == "counterexample" for ob in TWINS)


@pytest.mark.parametrize("sound", SOUND, ids=[ob.name for ob in SOUND])
def test_every_sound_obligation_has_a_broken_twin(sound: Obligation) -> None:
    assert any(twin.twin_of == sound.name for twin in TWINS), f"{sound.name} has no broken twin"


def test_every_twin_names_an_existing_sound_obligation() -> None:
    sound_names = {ob.name for ob in SOUND}
    assert {ob.twin_of for ob in TWINS} <= sound_names


def _families() -> set[str]:
    """Every family module's FAMILY: a component module is its own family or lists its FAMILY_MODULES."""
    modules = [m for c in spec.COMPONENT_MODULES.values() for m in getattr(c, "FAMILY_MODULES", (c,))]
    return {m.FAMILY for m in modules}


def test_fields_are_filled() -> None:
    families = _families()
    for ob in OBLIGATIONS:
        assert ob.component in COMPONENTS
        assert ob.family in families
        # swa_allocator spans several families; every other component is one family of its own name
        assert ob.component == "swa_allocator" or ob.family == ob.component
        assert ob.statement and "\n" not in ob.statement


def _spec_modules() -> list[str]:
    return ["kvproof.spec"] + [f"kvproof.spec.{m.name}" for m in pkgutil.iter_modules(spec.__path__)]


@pytest.mark.parametrize("name", _spec_modules())
def test_every_module_has_a_docstring_citing_the_semantics(name: str) -> None:
    doc = importlib.import_module(name).__doc__
    assert doc and "sglang_semantics.md" in doc, f"{name}: docstring must cite sglang_semantics.md"


def test_spec_components_are_the_registry_components() -> None:
    """``kvproof.spec`` is a leaf and lists the component names itself; they must be the registry's."""
    assert tuple(c.value for c in Component) == spec.COMPONENTS
    for component in spec.COMPONENTS:
        assert all(system.component == component for system in spec.systems(component))


def test_collect_rejects_misnamed_and_duplicate_obligations() -> None:
    import types

    def module(*names: str, component: str = "swa_allocator") -> types.ModuleType:
        mod = types.ModuleType(f"kvproof.spec.{component}")
        mod.OBLIGATIONS = tuple(Obligation(n, component, component, "s", "proved", list, str) for n in names)
        return mod

    assert spec.collect({"swa_allocator": module("swa_allocator.free.x")})
    with pytest.raises(spec.ObligationRegistryError, match="must be named 'swa_allocator"):
        spec.collect({"swa_allocator": module("free_swa.clears_mapping")})
    with pytest.raises(spec.ObligationRegistryError, match="duplicated"):
        spec.collect({"swa_allocator": module("swa_allocator.a.b", "swa_allocator.a.b")})
    with pytest.raises(spec.ObligationRegistryError, match="belong to component 'loc_cache'"):
        spec.collect({"loc_cache": module("loc_cache.x.y", component="swa_allocator")})
    with pytest.raises(spec.ObligationRegistryError, match="unknown component"):
        spec.systems("nope")


def test_component_modules_are_all_registered() -> None:
    assert tuple(spec.COMPONENT_MODULES) == tuple(COMPONENTS)
    assert [ob.name for ob in OBLIGATIONS] == [ob.name for m in spec.COMPONENT_MODULES.values() for ob in m.OBLIGATIONS]
    for component, module in spec.COMPONENT_MODULES.items():
        assert module.__name__ == f"kvproof.spec.{component}"
        assert all(ob.name.startswith(f"{component}.") and ob.component == component for ob in module.OBLIGATIONS)


def test_obligations_filters() -> None:
    assert obligations() == OBLIGATIONS
    assert obligations(component="swa_allocator") == tuple(ob for ob in OBLIGATIONS if ob.component == "swa_allocator")
    loc = obligations(component="loc_cache")
    assert loc and all(ob.name.startswith("loc_cache.") for ob in loc)
    by_component = [set(obligations(component=c)) for c in COMPONENTS]
    assert all(by_component), "every component has obligations"
    assert set().union(*by_component) == set(OBLIGATIONS)
    assert sum(map(len, by_component)) == len(OBLIGATIONS)
    assert obligations(component="nope") == ()
    tail = obligations(name_filter="swa_tail_len.")
    assert tail and all("swa_tail_len." in ob.name for ob in tail)
    upper = obligations(name_filter="swa_allocator.swa_tail_len.upper_bound*")
    assert upper[0].name == "swa_allocator.swa_tail_len.upper_bound"
    assert obligations(name_filter="s3_pre_25805")[0].name == "swa_allocator.no_double_free.bounded.s3_pre_25805"


def _toy(expect: Expect, *facts: z3.BoolRef) -> Obligation:
    return Obligation("toy.x", "test", "toy", "a toy claim", expect, lambda: list(facts), lambda m: "x=1")


def test_unknown_is_never_ok_and_carries_the_reason() -> None:
    x, y, z = z3.Ints("x y z")
    hard = _toy("proved", x > 0, y > 0, z > 0, x * x * x + y * y * y == z * z * z)
    result = run(hard, timeout_ms=1)
    assert result.status == "unknown"
    assert not result.ok
    assert "unknown" in result.detail and result.detail != "solver returned unknown: "
    assert not Result(_toy("counterexample"), "unknown", 0.0, "timeout").ok


def test_a_work_budget_bounds_the_solver_whatever_the_clock() -> None:
    """``rlimit``: the solver stops at that much work (Z3's resource units), long before the clock's backstop, with
    ``unknown``; the test suite's budget proves what a default run proves."""
    x, y, z = z3.Ints("x y z")
    hard = _toy("proved", x > 0, y > 0, z > 0, x * x * x + y * y * y == z * z * z)
    result = run(hard, **{**TEST_BUDGET, "rlimit": 1_000})
    assert result.status == "unknown" and not result.ok and result.seconds < 60, result
    assert run(_toy("proved", x > 0, x < 0), rlimit=TEST_RLIMIT).ok


def test_verdicts_match_expectations() -> None:
    x = z3.Int("x")
    assert run(_toy("proved", x > 0, x < 0)).ok
    refuted = run(_toy("counterexample", x > 0))
    assert refuted.ok and refuted.detail == "x=1"
    assert not run(_toy("proved", x > 0)).ok


def test_model_values_skip_division_by_zero_artefacts() -> None:
    n, d = z3.Ints("n d")
    solver = z3.Solver()
    solver.add(d == 0, n / d == 7, n % d == 3, n == 5)
    assert solver.check() == z3.sat
    model = solver.model()
    assert model_values(model) == {"d": 0, "n": 5}
    assert as_int(model, n + 1) == 6
