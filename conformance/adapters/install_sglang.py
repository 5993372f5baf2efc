"""Install SGLang 0.5.23's CPU-usable part into a venv, never a CUDA package.

Usage::

    python -m kvproof.conformance.adapters.install_sglang [--venv PATH] [--requirements FILE]
    make sglang          # creates .venv-sglang (torch 2.13.0 + kvproof[test]) and runs this

Steps (../shared/research/real_pools_on_cpu.md §1A; the steps themselves are
:mod:`kvproof.conformance.adapters.cpu_install`'s, shared with ``install_vllm``):

1. the target interpreter must already have torch 2.13.0 (the local CPU wheel);
   a missing torch is installed as ``torch==2.13.0`` first, any other version is refused;
2. ``pip install --no-deps sglang==0.5.23 compressed-tensors==0.18.0 apache-tvm-ffi==0.1.11``
   (their declared deps would pull a CUDA torch, triton and nvidia-*);
3. ``pip install -r requirements/sglang-cpu.txt`` with torch constrained to the
   installed version, after a ``--dry-run --report`` of that very command has shown
   that the plan holds no ``torch``, ``triton`` or ``nvidia-*`` distribution;
4. ``pip list`` afterwards: no ``nvidia-*`` / ``triton`` distribution, torch still 2.13.0.

The ``triton`` and ``torchvision`` stand-ins the adapter needs are not installed: the
adapter puts them on ``sys.path`` itself, only when the real module is missing.
Exit status 0 on success; 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvproof.conformance.adapters import cpu_install
from kvproof.conformance.adapters.cpu_install import TORCH_VERSION, InstallError, forbidden, installed

__all__ = ["INSTALL_COMMAND", "SGLANG_NO_DEPS", "TORCH_VERSION", "InstallError", "default_requirements", "forbidden",
           "install", "installed", "main", "verify"]

#: installed with ``--no-deps``: their metadata pins CUDA builds (torch==2.14.1, triton, nvidia-*)
SGLANG_NO_DEPS: tuple[str, ...] = ("sglang==0.5.23", "compressed-tensors==0.18.0", "apache-tvm-ffi==0.1.11")
INSTALL_COMMAND = "python -m kvproof.conformance.adapters.install_sglang --venv PATH  (or: make sglang)"

ENGINE = cpu_install.Engine(
    name="sglang", no_deps=SGLANG_NO_DEPS, requirements="sglang-cpu.txt",
    module="kvproof.conformance.adapters.install_sglang",
    description="Install SGLang 0.5.23 for CPU-only conformance runs (no torch upgrade, no triton, no nvidia-*).")


def default_requirements() -> Path:
    """``requirements/sglang-cpu.txt`` of the source checkout this module lives in."""
    return ENGINE.default_requirements()


def verify(python: str) -> dict[str, str]:
    """Raise :class:`InstallError` unless torch is 2.13.0, no triton / nvidia-* is installed and the
    ``--no-deps`` pins are at their versions."""
    return cpu_install.verify(python, SGLANG_NO_DEPS)


def install(venv: Path | None = None, requirements: Path | None = None) -> dict[str, float]:
    """Run the four steps; return seconds per step. Raise :class:`InstallError` on any failure."""
    return cpu_install.install(ENGINE, venv, requirements)


def main(argv: Sequence[str] | None = None) -> int:
    return cpu_install.main(ENGINE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
