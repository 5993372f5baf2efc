"""Device parametrisation for the torch runtime tests: ``cpu`` always, ``cuda`` when present."""

from __future__ import annotations

import pytest

from ..devices import DEVICES


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)
