"""The ``ci`` runs of every component's default configs against kvproof's runtime, each computed once per worker.

Two kinds of tests assert on the same runs: each component's own conformance test (``test_runtime_conforms`` and
its kin: the runtime passes a config, and runs the rules that config is for) and ``test_structure`` (over all of a
component's configs, every structural dimension reaches its maximum). Both read the run here, the plan
``kvproof conform --component <c>`` makes (the registry's default implementation and options, ``ci``: derandomized,
so the run is the same wherever it is made), and both carry :func:`group`'s mark, so ``--dist loadgroup`` sends them to
one worker, which makes each run once. A run on another device than the runtime's default is made once per worker too.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import pytest

from kvproof.conformance.check import CheckReport, run_check
from kvproof.conformance.plan import PlannedTest, load_impls, plan
from kvproof.gpu_runtime.paged import default_device, resolve_device
from kvproof.reference.registry import Component


def group(component: Component | str) -> pytest.MarkDecorator:
    """The xdist group of the tests reading ``component``'s runs (``tp_prefetch``: the rank processes' group, one
    worker at a time on the 2-core machine)."""
    name = Component(component).value
    return pytest.mark.xdist_group("ranks" if name == Component.TP_PREFETCH.value else f"runtime-runs-{name}")


@functools.cache
def planned(component: Component | str) -> tuple[PlannedTest, ...]:
    """The tests ``kvproof conform --component <c>`` plans: the default configs, implementation and options."""
    return plan((Component(component),), load_impls(()), (), None, {}).tests


def _test(component: Component, config: Any) -> PlannedTest:
    """The planned test of ``config``; for a config outside the defaults, the same implementation and options."""
    tests = planned(component)
    return next((t for t in tests if t.config.label() == config.label()), None) or dataclasses.replace(
        tests[0], config=config)


@functools.cache
def _run(component: Component, config: Any, device: str | None) -> CheckReport:
    """The ``ci`` run of ``config`` against the registry's default implementation (``device``: on that device; ``None``:
    the implementation's default)."""
    test = _test(component, config)
    factory = test.impl.factory if device is None else functools.partial(test.impl.factory, device=device)
    name = test.impl.spec if device is None else f"{test.impl.spec}[{device}]"
    return run_check(test.component, factory, test.config, profile="ci", impl_name=name, failures_dir=None,
                     **test.options)


def default_run(component: Component | str, config: Any) -> CheckReport:
    """The ``ci`` run of ``component``'s suite on ``config`` against the registry's default implementation, kvproof's
    runtime on its default device, as ``kvproof conform --component <c>`` makes it."""
    return _run(Component(component), config, None)


def runtime_run(component: Component | str, config: Any, device: str) -> CheckReport:
    """:func:`default_run` on ``device``: the same run where ``device`` is the runtime's default, else a run of the
    registry's default implementation on ``device``."""
    return _run(Component(component), config, None if resolve_device(device) == default_device() else device)
