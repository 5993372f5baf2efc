"""The four folders are importable only as kvproof subpackages (aesthetics_anchors.md Part 2)."""

import importlib.util

import pytest


@pytest.mark.parametrize("bare", ["spec", "reference", "gpu_runtime", "conformance", "cli"])
def test_bare_folder_names_are_not_importable(bare: str) -> None:
    assert importlib.util.find_spec(bare) is None, f"'{bare}' shadows kvproof.{bare}: run pytest, not python -m pytest"


@pytest.mark.parametrize("name", ["kvproof.spec", "kvproof.reference", "kvproof.gpu_runtime", "kvproof.conformance",
                                  "kvproof.cli"])
def test_subpackages_import(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__doc__, f"{name} has no module docstring"
