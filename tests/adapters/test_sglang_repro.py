"""The standalone reproductions under docs/repro/ (issue 15 item 6), and SGLang's own oracles on each (item 4).

Each script imports only SGLang and torch (kvproof's triton / torchvision stand-ins on ``PYTHONPATH`` where the real
ones are missing) and exits 10 while its finding reproduces, 0 once fixed. Every script runs in a fresh process under
SGLang's default settings and under each of SGLang's own checks (``SGLANG_INVARIANT_CHECK=1`` warn, ``=2`` strict,
``SGLANG_DEBUG_MEMORY_POOL=1``): :data:`EXPECTED` is docs/repro/README.md's table. A release that fixes a finding,
or whose own checks start catching one, fails here and names the script and the setting.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvproof.conformance.adapters import sglang as adapter
from kvproof.conformance.adapters.sglang import STUBS_DIR

ROOT = Path(__file__).resolve().parents[2]
REPRO = ROOT / "docs" / "repro"
needs_sglang = pytest.mark.skipif(not adapter.sglang_available(),
                                  reason=f"SGLang is not installed here; install it with: {adapter.INSTALL_HINT}")

SETTINGS = {
    "default": {},
    "invariant_check_warn": {"SGLANG_INVARIANT_CHECK": "1"},
    "invariant_check_strict": {"SGLANG_INVARIANT_CHECK": "2"},
    "debug_memory_pool": {"SGLANG_DEBUG_MEMORY_POOL": "1"},
}
SILENT = "reproduced"
_PEER_MAPPED = "caught: invariant-check FAILED [swa.peer_mapped]: is_true: caller wants free_full, at b.free(req_a)"

#: script -> setting -> what happens: "reproduced" (exit 10, SGLang's checks silent), "fixed" (exit 0), or
#: "caught: <SGLang's error>, at <the script's line>"
EXPECTED: dict[str, dict[str, str]] = {
    "f1_alloc_decode_leak.py": dict.fromkeys(SETTINGS, SILENT),
    "f1_alloc_decode_leak_mirror.py": dict.fromkeys(SETTINGS, SILENT),
    "f2_p1_free_released_swa.py": {"default": SILENT, "invariant_check_warn": _PEER_MAPPED,
                                   "invariant_check_strict": _PEER_MAPPED, "debug_memory_pool": SILENT},
    "f2_segment_free_released_swa.py": {
        "default": SILENT,
        "invariant_check_warn": _PEER_MAPPED.replace("b.free(req_a)", "a.free_segment(row, start_pos=0)"),
        "invariant_check_strict": _PEER_MAPPED.replace("b.free(req_a)", "a.free_segment(row, start_pos=0)"),
        "debug_memory_pool": "caught: swa pages do not match the mapped pages, at a.free_segment(row, start_pos=0)"},
    "f3_host_backup_not_atomic.py": dict.fromkeys(SETTINGS, SILENT),
    "f4_window_tombstone_starves.py": dict.fromkeys(SETTINGS, SILENT),
    "f5_selection_pin_starves.py": dict.fromkeys(SETTINGS, SILENT),
    # SGLANG_INVARIANT_CHECK=1 logs swa.peer_released hits (a GUARD: warned, not raised) and the script reproduces
    "f8_ring_alloc_drains_paged_swa.py": {
        "default": SILENT, "invariant_check_warn": SILENT,
        "invariant_check_strict": "caught: invariant-check FAILED [swa.peer_released]: is_true: caller wants free, "
                                  "at a.free(req)",
        "debug_memory_pool": SILENT},
}


def _verdict(path: Path, code: int, stderr: str) -> str:
    """What an exit means, as in :data:`EXPECTED`."""
    if code == 10:
        return SILENT
    if code == 0:
        return "fixed"
    errors = [line for line in stderr.splitlines() if re.match(r"^[A-Za-z_.]+(Error|Exception):", line)]
    frames = re.findall(rf'File "{re.escape(str(path))}", line (\d+)', stderr)
    where = path.read_text().splitlines()[int(frames[-1]) - 1].split("#")[0].strip() if frames else "?"
    error = errors[-1].split(": ", 1)[1] if errors else f"exit {code}"
    return f"caught: {error}, at {where}"


def _env(setting: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    return {**env, **setting, "PYTHONPATH": str(STUBS_DIR), "PYTHONWARNINGS": "ignore"}


def run_repro(script: str) -> tuple[str, str]:
    """One reproduction in a fresh process, SGLang's defaults, as a maintainer runs it: (what happened, output)."""
    path = REPRO / script
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=240, env=_env({}),
                         cwd=REPRO, check=False)
    return _verdict(path, out.returncode, out.stderr), out.stdout + out.stderr


@pytest.fixture(scope="module")
def oracle_matrix() -> dict[tuple[str, str], tuple[str, str]]:
    """Every script under every setting, run by repro_driver.py (SGLang imported once, a forked child per run)."""
    scripts = [str(REPRO / s) for s in EXPECTED]
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("repro_driver.py")), json.dumps(SETTINGS),
                          *scripts], capture_output=True, text=True, timeout=600, env=_env({}), check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    return {(Path(s).name, setting): (_verdict(Path(s), code, err), o + err) for s, setting, code, o, err in rows}


def test_every_script_is_declared_and_standalone() -> None:
    """Every script under docs/repro/ has its row, imports nothing of kvproof and fits on one screen."""
    scripts = sorted(p.name for p in REPRO.glob("*.py"))
    assert scripts == sorted(EXPECTED)
    for name in scripts:
        text = (REPRO / name).read_text()
        imports = re.findall(r"^(?:from|import) ([\w.]+)", text, flags=re.MULTILINE)
        assert all(m.split(".")[0] in {"sys", "torch", "sglang", "array"} for m in imports), (name, imports)
        code = [line for line in text.split('"""', 2)[2].splitlines() if line.strip()]
        assert len(code) <= 60, (name, len(code))
        assert "expected:" in text and "actual:" in text and "sys.exit(10 if" in text


@needs_sglang
@pytest.mark.parametrize("script", list(EXPECTED))
def test_each_reproduction_runs_alone_and_reproduces(script: str) -> None:
    """As a maintainer runs it: a fresh interpreter, SGLang's defaults, exit 10 while the finding is there."""
    seen, text = run_repro(script)
    assert seen == EXPECTED[script]["default"], f"{script}: {seen!r}: update docs/repro/README.md\n{text[-3000:]}"


@needs_sglang
def test_sglangs_own_checks_on_each_reproduction(oracle_matrix: dict[tuple[str, str], tuple[str, str]]) -> None:
    """The oracle column of docs/repro/README.md and docs/sglang-findings.md: which of SGLang's checks catches which
    finding, at which call."""
    wrong = {key: seen for key, (seen, _) in oracle_matrix.items() if seen != EXPECTED[key[0]][key[1]]}
    assert not wrong, "\n".join(f"{s} under {setting}: {seen!r}, expected {EXPECTED[s][setting]!r}\n"
                                f"{oracle_matrix[(s, setting)][1][-1500:]}" for (s, setting), seen in wrong.items())
    assert len(oracle_matrix) == len(EXPECTED) * len(SETTINGS)
