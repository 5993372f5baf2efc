"""pytest plugin: run kvproof's conformance suites against an implementation from any test session.

Options (also ``$KVPROOF_IMPL``)::

    pytest -p kvproof.conformance.pytest_plugin --pyargs kvproof.conformance.suite \
        --kvproof-impl mypkg.adapter:MyAllocator [--kvproof-component swa_allocator] \
        [--kvproof-profile ci] [--kvproof-skip-file F] [--kvproof-xfail-file F]

One test per component x config (id ``component/config``), so pytest's own reports
(``--junitxml``, ``-k``) apply. Skip and expected-failure files work as for
``kvproof conform`` (expected failures are strict: a pass fails); entries matching no
test are reported as warnings. Any test may also request the fixtures ``kvproof_case``
(a ``(component, config)`` pair) and ``kvproof_factory``. The suites cite
sglang_semantics.md per component.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import pytest

from kvproof.reference import COMPONENTS

__all__ = ["pytest_addoption", "pytest_generate_tests", "kvproof_factory", "kvproof_profile"]


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvproof", "kvproof conformance suites")
    group.addoption("--kvproof-impl", action="append", default=None, metavar="MODULE:FACTORY",
                    help="implementation factory, repeatable: each serves the components it declares "
                         "(default: $KVPROOF_IMPL, space-separated, else each component's torch runtime)")
    group.addoption("--kvproof-component", action="append", default=None, choices=list(COMPONENTS),
                    help="component suite to run; repeatable (default: all)")
    group.addoption("--kvproof-profile", default="ci", help="Hypothesis profile: ci, nightly, dev, smoke")
    group.addoption("--kvproof-skip-file", default=None, help="lines 'component/config  # reason': skipped")
    group.addoption("--kvproof-xfail-file", default=None, help="lines 'component/config  # reason': expected to fail")


def _impl_specs(config: pytest.Config) -> list[str]:
    return list(config.getoption("kvproof_impl") or os.environ.get("KVPROOF_IMPL", "").split())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "kvproof_case" not in metafunc.fixturenames:
        return
    from kvproof.conformance.check import get_suite
    from kvproof.conformance.report import load_selection

    opt = metafunc.config.getoption
    selection = load_selection(opt("kvproof_skip_file"), opt("kvproof_xfail_file"))
    params = []
    for component in opt("kvproof_component") or COMPONENTS:
        for cfg in get_suite(component).configs:
            test_id = f"{component}/{cfg.label()}"
            chosen = selection.match(test_id)
            marks: list[Any] = []
            if chosen and chosen[0] == "skip":
                marks.append(pytest.mark.skip(reason=chosen[1]))
            elif chosen:
                marks.append(pytest.mark.xfail(reason=chosen[1], strict=True))
            params.append(pytest.param((component, cfg), id=test_id, marks=marks))
    for warning in selection.unmatched():
        warnings.warn(warning, stacklevel=1)
    metafunc.parametrize("kvproof_case", params)


@pytest.fixture
def kvproof_factory(request: pytest.FixtureRequest, kvproof_case: tuple[str, Any]) -> Any:
    """The implementation factory: ``--kvproof-impl`` / ``$KVPROOF_IMPL``, else the component's default."""
    from kvproof.cli.impl import load_factory
    from kvproof.conformance.check import get_suite, impl_for

    given = [(spec, load_factory(spec)) for spec in _impl_specs(request.config)]
    return impl_for(kvproof_case[0], given)[1] or load_factory(get_suite(kvproof_case[0]).default_impl)


@pytest.fixture
def kvproof_profile(request: pytest.FixtureRequest) -> str:
    return str(request.config.getoption("kvproof_profile"))
