"""The component is the unit: every component of the registry is complete in every layer, verb and report.

Adding a component is one entry in ``kvproof.reference.registry`` plus one module per layer
(spec, reference, gpu_runtime, conformance, conformance.mutants) and its tests; a layer a
component deliberately lacks is declared in the registry with the reason. These tests fail
for any other gap, and for an operation that does not keep its one name everywhere.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

import click
import pytest

from kvproof import spec
from kvproof.cli import main
from kvproof.cli.bench import SECTIONS
from kvproof.conformance.check import get_suite, mutants_of
from kvproof.conformance.plan import declared_components, load_factory, plan
from kvproof.reference.contract import PROTOCOLS
from kvproof.reference.registry import REGISTRY, Component, Layer, UnknownComponent, info, parse_components

ROOT = Path(__file__).resolve().parent.parent
COMPONENTS = list(Component)
#: the test folder of each layer (mutants are tested with the suite)
TEST_DIRS = {Layer.SPEC: "spec", Layer.REFERENCE: "reference", Layer.RUNTIME: "gpu_runtime",
             Layer.SUITE: "conformance"}


def test_the_registry_lists_every_component_once_in_enum_order() -> None:
    assert list(REGISTRY) == COMPONENTS
    assert all(entry.component is c for c, entry in REGISTRY.items())
    assert parse_components(["hisparse_host", Component.SWA_ALLOCATOR, "hisparse_host"]) == (
        Component.SWA_ALLOCATOR, Component.HISPARSE_HOST)
    with pytest.raises(UnknownComponent, match="choose one of"):
        info("admision")


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_layer_has_its_module_or_a_reasoned_absence(component: Component) -> None:
    entry = info(component)
    for layer in Layer:
        name = entry.module(layer)
        exists = importlib.util.find_spec(name) is not None
        if layer in entry.absent:
            assert entry.absent[layer].strip(), f"{component}: the absence of {layer.value} needs a reason"
            assert not exists, f"{name} exists although the registry declares it absent: drop the absence"
        else:
            assert exists, f"{component}: no module {name} (add it, or declare its absence with a reason)"


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_layer_has_its_tests(component: Component) -> None:
    entry = info(component)
    for layer, folder in TEST_DIRS.items():
        path = ROOT / "tests" / folder / f"test_{component.value}.py"
        assert path.exists() or layer in entry.absent, f"{component}: no {path.relative_to(ROOT)}"


@pytest.mark.parametrize("component", COMPONENTS)
def test_spec_module_states_the_components_obligations(component: Component) -> None:
    module = importlib.import_module(info(component).module(Layer.SPEC))
    names = [ob.name for ob in module.OBLIGATIONS]
    assert names, f"{module.__name__} states no obligation"
    assert all(name.startswith(f"{component.value}.") for name in names), names
    assert all(ob.component == component.value for ob in module.OBLIGATIONS)
    assert [ob.name for ob in spec.obligations(component.value)] == names
    systems = spec.systems(component.value)
    assert systems, f"{module.__name__} exports no transition system (SYSTEM)"
    assert all(system.component == component.value for system in systems)


def _skip_without_suite(component: Component) -> None:
    if Layer.SUITE in info(component).absent:
        pytest.skip(info(component).absent[Layer.SUITE])


@pytest.mark.parametrize("component", COMPONENTS)
def test_suite_and_default_implementation(component: Component) -> None:
    _skip_without_suite(component)
    suite = get_suite(component)
    assert suite.component is component and suite.configs
    factory = load_factory(info(component).default_impl)
    served = declared_components(factory)
    assert served is None or component in served
    assert all(isinstance(c, Component) for c in getattr(factory, "components", ())), \
        "an implementation declares the components it serves as Component values, not strings"


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_operation_keeps_one_name_in_every_layer(component: Component) -> None:
    """A lockstep operation is a reference function, a transition of the component's Z3 model, has obligations
    (``kvproof prove -k <op>``), and, unless it acts on the environment, is a method of the component's contract.
    Without a suite yet: every transition of the Z3 model is a reference function with obligations."""
    reference = importlib.import_module(info(component).module(Layer.REFERENCE))
    if Layer.SUITE in info(component).absent:
        for system in spec.systems(component.value):
            for op in system.ops:
                assert callable(getattr(reference, op, None)), f"{component}: {op} is not in {reference.__name__}"
                assert spec.obligations(component.value, f"{component.value}.{op}."), \
                    f"kvproof prove -k {op} finds no {component} obligation"
        return
    suite = get_suite(component)
    protocol_members = {name for protocol in PROTOCOLS[component] for name in dir(protocol)}
    transitions = {op for system in spec.systems(component.value) for op in system.ops}
    # operations the suite declares itself (a suite may extend another component's, e.g. loc_cache the allocator's)
    ops = {name: op for name, op in suite.machine.operations.items()
           if op.is_operation and suite.machine.declared_by[name] is component}
    assert ops, f"{component}: the suite declares no operation"
    for name, op in ops.items():
        assert callable(getattr(reference, name, None)), f"{component}: {name} is not in {reference.__name__}"
        assert name in transitions, f"{component}: {name} is not a transition of its Z3 model"
        assert spec.obligations(component.value, name), f"kvproof prove -k {name} finds no {component} obligation"
        if not op.environment:
            assert name in protocol_members, f"{component}: {name} is not a method of its contract"


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_has_mutants_its_suite_must_kill(component: Component) -> None:
    if Layer.MUTANTS in info(component).absent:
        pytest.skip(info(component).absent[Layer.MUTANTS])
    assert len(mutants_of(component)) >= 5


def test_the_benchmark_has_a_section_per_component() -> None:
    assert set(SECTIONS) == set(Component)


def _component_choices(command: click.Command) -> list[str] | None:
    for param in command.params:
        if param.name == "components" and isinstance(param.type, click.Choice):
            return list(param.type.choices)
    return None


def test_every_verb_covers_every_component() -> None:
    """Each verb but ``replay`` (whose vector names its component) takes --component with the registry's choices."""
    assert isinstance(main, click.Group)
    verbs = {name: command for name, command in main.commands.items() if name != "replay"}
    assert set(verbs) == {"prove", "conform", "fuzz", "check", "mutants", "bench"}
    for name, command in verbs.items():
        assert _component_choices(command) == [c.value for c in Component], name


def test_a_plan_without_arguments_covers_every_component_and_config() -> None:
    """Every component with a suite runs all its configs; one without is a skip with the registry's reason."""
    the_plan = plan()
    without = {c for c in Component if Layer.SUITE in info(c).absent}
    assert {t.component for t in the_plan.tests} == set(Component) - without
    assert dict(the_plan.absent) == {c: info(c).absent[Layer.SUITE] for c in without}
    assert [(o.component, o.status, o.reason) for o in the_plan.skipped()] == [
        (c.value, "skipped", info(c).absent[Layer.SUITE]) for c in Component if c in without]
    for component in set(Component) - without:
        assert len([t for t in the_plan.tests if t.component is component]) == len(get_suite(component).configs)


def test_the_pytest_plugin_offers_the_registry() -> None:
    out = subprocess.run([str(Path(sys.executable).parent / "pytest"), "--help"], capture_output=True, text=True,
                         cwd=ROOT, timeout=120, check=False).stdout
    assert "--kvproof-component={" + ",".join(c.value for c in Component) + "}" in out
