"""``make lint``: ruff, mypy and the layering contract (import-linter), as CI runs them.

kvproof's folders are mapped onto ``kvproof.<layer>`` by ``package-dir`` and installed
editable; neither mypy nor import-linter can follow setuptools' editable finder. So this
script lays the folders out as the package they are (``build/lint/kvproof/<layer>`` ->
``<layer>/``, symlinks), points both tools there, and runs:

* ``ruff check`` over the tree, tests included (rules in ``pyproject.toml``);
* ``mypy`` over every package of the product (strict on ``kvproof.reference`` and
  ``kvproof.spec``, per ``[tool.mypy]`` in ``pyproject.toml``); the tests are not
  type-checked, so they carry no ``type: ignore``;
* ``lint-imports``: the layers ``cli > conformance > gpu_runtime > reference`` and
  ``spec`` as a leaf (``[tool.importlinter]``).

Exit status: non-zero if any tool fails; each tool's output is printed as it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("spec", "reference", "gpu_runtime", "conformance", "cli")
TREE = ROOT / "build" / "lint"


def _tree() -> Path:
    """``build/lint/kvproof/<layer>`` -> ``<layer>/``, rebuilt each run (a new module needs no reinstall)."""
    package = TREE / "kvproof"
    package.mkdir(parents=True, exist_ok=True)
    for layer in LAYERS:
        link = package / layer
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(ROOT / layer, target_is_directory=True)
    return TREE


def _run(name: str, argv: list[str], env: dict[str, str]) -> bool:
    print(f"--- {name}: {' '.join(argv)}", flush=True)
    done = subprocess.run(argv, cwd=ROOT, env=env, check=False)
    print(f"--- {name}: {'ok' if done.returncode == 0 else f'FAILED (exit {done.returncode})'}", flush=True)
    return done.returncode == 0


def main() -> int:
    tree = _tree()
    env = {**os.environ, "PYTHONPATH": str(tree), "MYPYPATH": str(tree)}
    bindir = Path(sys.executable).parent
    packages = [arg for layer in LAYERS for arg in ("-p", f"kvproof.{layer}")]
    results = [
        _run("ruff", [str(bindir / "ruff"), "check", "."], env),
        _run("mypy", [str(bindir / "mypy"), *packages], {**env, "PWD": str(tree)}),
        _run("layers", [str(bindir / "lint-imports")], env),
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
