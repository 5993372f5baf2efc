"""Install SGLang 0.5.23's CPU-usable part into a venv, never a CUDA package.

Usage::

    python -m kvproof.conformance.adapters.install_sglang [--venv PATH] [--requirements FILE]
    make sglang          # creates .venv-sglang (torch 2.13.0 + kvproof[test]) and runs this

Steps (../shared/research/real_pools_on_cpu.md §1A):

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

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["SGLANG_NO_DEPS", "TORCH_VERSION", "default_requirements", "forbidden", "install", "main"]

#: installed with ``--no-deps``: their metadata pins CUDA builds (torch==2.14.1, triton, nvidia-*)
SGLANG_NO_DEPS: tuple[str, ...] = ("sglang==0.5.23", "compressed-tensors==0.18.0", "apache-tvm-ffi==0.1.11")
#: the CPU wheel kvproof runs on
TORCH_VERSION = "2.13.0"
INSTALL_COMMAND = "python -m kvproof.conformance.adapters.install_sglang --venv PATH  (or: make sglang)"


class InstallError(RuntimeError):
    """A step failed or the venv would hold / holds a forbidden distribution."""


def default_requirements() -> Path:
    """``requirements/sglang-cpu.txt`` of the source checkout this module lives in."""
    return Path(__file__).resolve().parents[2] / "requirements" / "sglang-cpu.txt"


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def forbidden(names: Sequence[str]) -> list[str]:
    """The distributions among ``names`` that must never be installed here: triton and nvidia-*."""
    bad = []
    for name in names:
        n = _canonical(name)
        if n in {"triton", "pytorch-triton"} or n.startswith("nvidia-"):
            bad.append(name)
    return sorted(bad)


def _python_of(venv: Path | None) -> str:
    if venv is None:
        return sys.executable
    python = venv / "bin" / "python"
    if not python.exists():
        raise InstallError(f"{venv} is not a venv (no bin/python); create it with: python3 -m venv {venv}")
    return str(python)


def _pip(python: str, *args: str, capture: bool = False) -> str:
    cmd = [python, "-m", "pip", *args]
    print("+ " + " ".join(cmd[1:] if capture else cmd), flush=True)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    done = subprocess.run(cmd, env=env, text=True, capture_output=capture, check=False)
    if done.returncode:
        tail = (done.stderr or "")[-3000:] if capture else ""
        raise InstallError(f"pip {args[0]} failed with exit status {done.returncode}\n{tail}".rstrip())
    return done.stdout or ""


def installed(python: str) -> dict[str, str]:
    """``{canonical name: version}`` of every distribution in the interpreter's environment (``pip list``)."""
    out = _pip(python, "list", "--format=json", capture=True)
    return {_canonical(d["name"]): d["version"] for d in json.loads(out)}


def _torch_ok(version: str | None) -> bool:
    return version is not None and version.split("+", 1)[0] == TORCH_VERSION


def verify(python: str) -> dict[str, str]:
    """Raise :class:`InstallError` unless torch is 2.13.0 and no triton / nvidia-* is installed."""
    dists = installed(python)
    bad = forbidden(list(dists))
    if bad:
        raise InstallError(f"CUDA packages got installed: {bad}; remove them (pip uninstall -y {' '.join(bad)})")
    if not _torch_ok(dists.get("torch")):
        raise InstallError(f"torch is {dists.get('torch')}, expected {TORCH_VERSION} (the local CPU wheel)")
    for pin in SGLANG_NO_DEPS:
        name, version = pin.split("==")
        if dists.get(_canonical(name)) != version:
            raise InstallError(f"{name} is {dists.get(_canonical(name))}, expected {version}")
    return dists


def install(venv: Path | None = None, requirements: Path | None = None) -> dict[str, float]:
    """Run the four steps; return seconds per step. Raise :class:`InstallError` on any failure."""
    python = _python_of(venv)
    reqs = requirements or default_requirements()
    if not reqs.exists():
        raise InstallError(f"requirements file not found: {reqs} (run from a kvproof source checkout or pass "
                           "--requirements)")
    times: dict[str, float] = {}
    t = time.perf_counter()
    torch_version = installed(python).get("torch")
    if torch_version is None:
        _pip(python, "install", "--quiet", f"torch=={TORCH_VERSION}")
        torch_version = installed(python).get("torch")
    if not _torch_ok(torch_version):
        raise InstallError(f"the target has torch {torch_version}; kvproof needs the CPU wheel torch=={TORCH_VERSION} "
                           "(pip would replace it with a CUDA build)")
    times["torch check"] = time.perf_counter() - t

    t = time.perf_counter()
    _pip(python, "install", "--quiet", "--no-deps", *SGLANG_NO_DEPS)
    times["sglang (--no-deps)"] = time.perf_counter() - t

    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={torch_version}\n")
        args = ["install", "-r", str(reqs), "-c", str(constraints)]
        t = time.perf_counter()
        report_path = Path(tmp) / "plan.json"
        _pip(python, *args, "--dry-run", "--quiet", "--report", str(report_path), capture=True)
        plan = json.loads(report_path.read_text())
        names = [item["metadata"]["name"] for item in plan.get("install", [])]
        bad = forbidden(names) + [n for n in names if _canonical(n) == "torch"]
        if bad:
            raise InstallError(f"refusing to install: the plan for {reqs.name} would bring {sorted(bad)}")
        times["dependency plan"] = time.perf_counter() - t
        t = time.perf_counter()
        _pip(python, *args, "--quiet")
        times["dependencies"] = time.perf_counter() - t

    t = time.perf_counter()
    dists = verify(python)
    times["verify"] = time.perf_counter() - t
    print(f"ok: sglang {dists['sglang']}, torch {dists['torch']}, no triton / nvidia-* in {python}", flush=True)
    return times


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvproof.conformance.adapters.install_sglang",
                                     description="Install SGLang 0.5.23 for CPU-only conformance runs "
                                                 "(no torch upgrade, no triton, no nvidia-*).")
    parser.add_argument("--venv", type=Path, default=None,
                        help="the venv to install into (default: the running interpreter's environment)")
    parser.add_argument("--requirements", type=Path, default=None,
                        help=f"pure-Python dependencies (default: {default_requirements()})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        times = install(args.venv, args.requirements)
    except InstallError as err:
        print(f"install_sglang: {err}", file=sys.stderr)
        return 1
    steps = ", ".join(f"{k} {v:.1f}s" for k, v in times.items())
    print(f"install_sglang: done in {time.perf_counter() - start:.1f}s ({steps})", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
