"""What kvproof's installers of a serving engine share: CPU only, never a CUDA package.

An engine's wheel (SGLang, vLLM) declares a CUDA torch, triton and ``nvidia-*`` among its
dependencies. kvproof only imports its pure-Python KV-cache code, which runs on the local
CPU wheel ``torch==2.13.0``, so every installer (``install_sglang``, ``install_vllm``) takes
the same four steps, here once:

1. the target interpreter must already have torch 2.13.0 (the local CPU wheel);
   a missing torch is installed as ``torch==2.13.0`` first, any other version is refused;
2. ``pip install --no-deps`` of the engine's own pins (their metadata pins CUDA builds);
3. ``pip install -r <requirements>`` with torch constrained to the installed version, after a
   ``--dry-run --report`` of that very command has shown that the plan holds no ``torch``,
   ``triton`` or ``nvidia-*`` distribution;
4. ``pip list`` afterwards: no ``nvidia-*`` / ``triton`` distribution, torch still 2.13.0,
   every ``--no-deps`` pin at its version.

:class:`Engine` names what differs between engines; :func:`install` and :func:`main` run the
steps for one. The pure parts (:func:`forbidden`, :func:`plan_names`, :func:`plan_violations`,
:func:`requirement_names`) are what the tests check without pip.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["TORCH_VERSION", "Engine", "InstallError", "canonical", "forbidden", "install", "installed", "main",
           "pip", "plan_names", "plan_violations", "python_of", "requirement_names", "requirements_path",
           "torch_ok", "verify"]

#: the CPU wheel kvproof runs on
TORCH_VERSION = "2.13.0"


class InstallError(RuntimeError):
    """A step failed or the venv would hold / holds a forbidden distribution."""


@dataclass(frozen=True)
class Engine:
    """One engine's installer: what it installs and how it is called."""

    #: the distribution the venv is for (``sglang``, ``vllm``); its version is printed at the end
    name: str
    #: ``name==version`` pins installed with ``--no-deps`` (their metadata pins CUDA builds)
    no_deps: tuple[str, ...]
    #: the requirements file's name under ``requirements/`` (pure-Python dependencies, all pinned)
    requirements: str
    #: ``python -m ...`` module the installer is run as (its messages are prefixed with the last part)
    module: str
    #: one line for ``--help``
    description: str

    def default_requirements(self) -> Path:
        """The requirements file of the source checkout this module lives in."""
        return requirements_path(self.requirements)


def requirements_path(name: str) -> Path:
    """``requirements/<name>`` of the source checkout this module lives in."""
    return Path(__file__).resolve().parents[2] / "requirements" / name


def canonical(name: str) -> str:
    """A distribution name as pip compares them: lower case, ``_`` and ``.`` as ``-``."""
    return name.lower().replace("_", "-").replace(".", "-")


def forbidden(names: Sequence[str]) -> list[str]:
    """The distributions among ``names`` that must never be installed here: triton and nvidia-*."""
    bad = []
    for name in names:
        n = canonical(name)
        if n in {"triton", "pytorch-triton"} or n.startswith("nvidia-"):
            bad.append(name)
    return sorted(bad)


def plan_names(report: Mapping[str, Any]) -> list[str]:
    """The distributions a ``pip install --dry-run --report`` report would install."""
    return [str(item["metadata"]["name"]) for item in report.get("install", [])]


def plan_violations(names: Sequence[str]) -> list[str]:
    """What a dependency plan must not bring: triton, nvidia-* and any torch (it would replace the CPU wheel)."""
    return sorted(forbidden(names) + [n for n in names if canonical(n) == "torch"])


def requirement_names(text: str) -> list[str]:
    """The distribution names of a pinned requirements file (comments and blank lines skipped)."""
    return [line.split("==")[0].strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def python_of(venv: Path | None) -> str:
    """The interpreter of ``venv`` (the running one for None); refuses a folder that is not a venv."""
    if venv is None:
        return sys.executable
    python = venv / "bin" / "python"
    if not python.exists():
        raise InstallError(f"{venv} is not a venv (no bin/python); create it with: python3 -m venv {venv}")
    return str(python)


def pip(python: str, *args: str, capture: bool = False) -> str:
    """Run ``python -m pip *args``; raise :class:`InstallError` on a non-zero exit. Returns stdout when captured."""
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
    out = pip(python, "list", "--format=json", capture=True)
    return {canonical(d["name"]): d["version"] for d in json.loads(out)}


def torch_ok(version: str | None) -> bool:
    """Whether ``version`` is the CPU wheel's (any local tag: ``2.13.0+cpu``)."""
    return version is not None and version.split("+", 1)[0] == TORCH_VERSION


def verify(python: str, pins: Sequence[str]) -> dict[str, str]:
    """Raise :class:`InstallError` unless torch is 2.13.0, no triton / nvidia-* is installed and every
    ``name==version`` of ``pins`` is installed at that version. Returns ``installed(python)``."""
    dists = installed(python)
    bad = forbidden(list(dists))
    if bad:
        raise InstallError(f"CUDA packages got installed: {bad}; remove them (pip uninstall -y {' '.join(bad)})")
    if not torch_ok(dists.get("torch")):
        raise InstallError(f"torch is {dists.get('torch')}, expected {TORCH_VERSION} (the local CPU wheel)")
    for pin in pins:
        name, version = pin.split("==")
        if dists.get(canonical(name)) != version:
            raise InstallError(f"{name} is {dists.get(canonical(name))}, expected {version}")
    return dists


def _ensure_torch(python: str) -> str:
    torch_version = installed(python).get("torch")
    if torch_version is None:
        pip(python, "install", "--quiet", f"torch=={TORCH_VERSION}")
        torch_version = installed(python).get("torch")
    if torch_version is None or not torch_ok(torch_version):
        raise InstallError(f"the target has torch {torch_version}; kvproof needs the CPU wheel torch=={TORCH_VERSION} "
                           "(pip would replace it with a CUDA build)")
    return torch_version


def install(engine: Engine, venv: Path | None = None, requirements: Path | None = None) -> dict[str, float]:
    """Run the four steps for ``engine``; return seconds per step. Raise :class:`InstallError` on any failure."""
    python = python_of(venv)
    reqs = requirements or engine.default_requirements()
    if not reqs.exists():
        raise InstallError(f"requirements file not found: {reqs} (run from a kvproof source checkout or pass "
                           "--requirements)")
    times: dict[str, float] = {}
    t = time.perf_counter()
    torch_version = _ensure_torch(python)
    times["torch check"] = time.perf_counter() - t

    t = time.perf_counter()
    pip(python, "install", "--quiet", "--no-deps", *engine.no_deps)
    times[f"{engine.name} (--no-deps)"] = time.perf_counter() - t

    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(f"torch=={torch_version}\n")
        args = ["install", "-r", str(reqs), "-c", str(constraints)]
        t = time.perf_counter()
        report_path = Path(tmp) / "plan.json"
        pip(python, *args, "--dry-run", "--quiet", "--report", str(report_path), capture=True)
        bad = plan_violations(plan_names(json.loads(report_path.read_text())))
        if bad:
            raise InstallError(f"refusing to install: the plan for {reqs.name} would bring {bad}")
        times["dependency plan"] = time.perf_counter() - t
        t = time.perf_counter()
        pip(python, *args, "--quiet")
        times["dependencies"] = time.perf_counter() - t

    t = time.perf_counter()
    dists = verify(python, engine.no_deps)
    times["verify"] = time.perf_counter() - t
    print(f"ok: {engine.name} {dists[canonical(engine.name)]}, torch {dists['torch']}, no triton / nvidia-* in "
          f"{python}", flush=True)
    return times


def main(engine: Engine, argv: Sequence[str] | None = None) -> int:
    """The command line of ``engine``'s installer: exit status 0 on success, 1 with the reason on stderr."""
    prog = engine.module.rsplit(".", 1)[-1]
    parser = argparse.ArgumentParser(prog=f"python -m {engine.module}", description=engine.description)
    parser.add_argument("--venv", type=Path, default=None,
                        help="the venv to install into (default: the running interpreter's environment)")
    parser.add_argument("--requirements", type=Path, default=None,
                        help=f"pure-Python dependencies (default: {engine.default_requirements()})")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    try:
        times = install(engine, args.venv, args.requirements)
    except InstallError as err:
        print(f"{prog}: {err}", file=sys.stderr)
        return 1
    steps = ", ".join(f"{k} {v:.1f}s" for k, v in times.items())
    print(f"{prog}: done in {time.perf_counter() - start:.1f}s ({steps})", flush=True)
    return 0
