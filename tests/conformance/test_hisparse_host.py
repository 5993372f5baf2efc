"""The hisparse_host lockstep suite: holds for the runtime and the reference, kills every mutant, rediscovers the
pre-#23606 coordinator (sglang_semantics.md §4.7) as a failing variant."""

import re

import pytest
import torch

from kvproof.conformance.check import check, kill_mutants, run_check
from kvproof.conformance.hisparse_host import HOST_CONFIGS, SUITE
from kvproof.conformance.mutants.hisparse_host import MUTANTS
from kvproof.conformance.reference_impl import ReferenceHostPool
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
from kvproof.reference import hisparse_host as hh
from kvproof.reference.errors import InvalidOperation

from ..devices import DEVICES
from .runtime_runs import group, runtime_run

IDS = [c.label() for c in HOST_CONFIGS]
P4 = next(c for c in HOST_CONFIGS if c.page_size == 4)


@group("hisparse_host")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", HOST_CONFIGS, ids=IDS)
def test_runtime_conforms(config: hh.HostPoolConfig, device: str) -> None:
    report = runtime_run("hisparse_host", config, device)
    assert report.passed, report.failure
    ops = {name for name in report.rules if not name.startswith("misuse")}
    assert ops == set(SUITE.needs(config)) - {"misuse"}, report.rules  # every rule ran
    assert report.rules["misuse"] > 0
    assert report.outcomes["ok"] > 0 and report.outcomes["OutOfMemory"] > 0 and report.outcomes["InvalidOperation"] > 0
    assert report.never_run == ()


def test_reference_conforms() -> None:
    check("hisparse_host", ReferenceHostPool, P4, profile="ci", impl_name="reference")


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    (verdict,) = kill_mutants({name: MUTANTS[name]}, component="hisparse_host", profile="ci")
    assert verdict.killed, f"mutant {name} survived the ci profile on every host config"
    assert "HarnessError" not in verdict.evidence, verdict.evidence


def test_at_least_five_mutants() -> None:
    assert len(MUTANTS) >= 5


def _steps(failure: str) -> list[str]:
    block = failure.split("operations so far:")[1].split("\n\n")[0]
    return re.findall(r"^\s+\d+\. (\w+)\(", block, flags=re.M)


def test_pre_23606_coordinator_breaks_the_page_rule() -> None:
    """§4.7 as a failing variant: host pages of P_h = 4 with the old token-granular staging alloc(n)."""
    config = P4.model_copy(update={"coordinator": hh.Coordinator.PRE_23606})
    report = run_check("hisparse_host", ReferenceHostPool, config, profile="ci", impl_name="pre-#23606",
                       failures_dir=None)
    assert not report.passed
    assert "pre-#23606 coordinator breaks the page rule" in (report.failure or "")
    assert "is not a multiple of page_size 4" in (report.failure or "")
    assert _steps(report.failure or "") == ["admit_request_into_staging"]  # shrunk to one staging


def test_pre_23606_host_pages_of_one_break_transfer_pages() -> None:
    """§4.7: P_h = 1 under device pages of 4: the rows stop being whole transfer pages (H1)."""
    config = hh.HostPoolConfig(page_size=1, num_pages=24, max_req_slots=3, max_context_len=12, device_page_size=4,
                               coordinator=hh.Coordinator.PRE_23606)
    report = run_check("hisparse_host", ReferenceHostPool, config, profile="ci", impl_name="pre-#23606",
                       failures_dir=None)
    assert not report.passed
    assert "[H1]" in (report.failure or "") and "aligned 4-slot page" in (report.failure or "")
    assert len(_steps(report.failure or "")) <= 3


# ---------------------------------------------------------------- each mutant differs where its docstring says


def _pool(cls: type = HiSparseHostPool, config: hh.HostPoolConfig = P4) -> HiSparseHostPool:
    return cls(config, device="cpu")


def _stage(pool: HiSparseHostPool, req: int, n: int) -> torch.Tensor:
    return pool.admit_request_into_staging(req, torch.arange(100, 100 + n))


def test_token_granular_staging_differs() -> None:
    pool = _pool(MUTANTS["token_granular_staging"])
    _stage(pool, 0, 5)
    assert int(pool.allocated_len[0]) == 5  # the correct runtime: 8
    assert int(_pool().admit_request_into_staging(0, torch.arange(5)).numel()) == 5


def test_floor_new_pages_differs() -> None:
    pool = _pool(MUTANTS["floor_new_pages"])
    slots = pool.alloc_paged_token_slots(0, 0, 5)
    assert int(pool.allocated_len[0]) == 4 and int(slots[-1]) == -1


def test_release_keeps_length_differs() -> None:
    pool = _pool(MUTANTS["release_keeps_length"])
    _stage(pool, 0, 4)
    pool.request_finished(0)
    assert int(pool.allocated_len[0]) == 4


def test_release_reversed_differs() -> None:
    pool = _pool(MUTANTS["release_reversed"])
    _stage(pool, 0, 4)
    pool.request_finished(0)
    assert pool.snapshot().free_slots[-4:] == (3, 2, 1, 0)


def test_backup_not_atomic_differs() -> None:
    config = hh.HostPoolConfig(page_size=2, num_pages=5, max_req_slots=3, max_context_len=20)
    for cls, keeps in ((HiSparseHostPool, True), (MUTANTS["backup_not_atomic"], False)):
        pool = _pool(cls, config)
        for req, n in ((0, 2), (1, 2), (2, 4)):
            _stage(pool, req, n)
        pool.eager_backup_previous_token([0, 1, 2], [3, 3, 5], [0, 0, 0])  # skipped once after staging
        before = pool.snapshot()
        with pytest.raises(Exception, match="host pool needs"):
            pool.eager_backup_previous_token([0, 1], [4, 4], [9, 9])
        assert (pool.snapshot() == before) is keeps


def test_no_hole_check_differs() -> None:
    pool = _pool(MUTANTS["no_hole_check"])
    _stage(pool, 0, 4)
    assert pool.alloc_paged_token_slots(0, 9, 1).numel() == 1
    good = _pool()
    _stage(good, 0, 4)
    with pytest.raises(InvalidOperation):
        good.alloc_paged_token_slots(0, 9, 1)


def test_no_skip_first_backup_differs() -> None:
    pool = _pool(MUTANTS["no_skip_first_backup"])
    slots = _stage(pool, 0, 3)
    pool.eager_backup_previous_token([0], [4], [999])
    assert int(pool.get_host_data(slots[2:3])) == 999  # the staged position 2 was overwritten


def test_unpadded_row_differs() -> None:
    pool = _pool(MUTANTS["unpadded_row"])
    with pytest.raises(Exception, match="host row"):
        _stage(pool, 0, 14)  # rounded end 16 > max_context_len 14
    assert _stage(_pool(), 0, 14).numel() == 14


# ---------------------------------------------------------------- the harness itself


def test_misuse_cases_are_all_reachable() -> None:
    """Each misuse case ran at least once over the configs (no dead case)."""
    seen: set[str] = set()
    for config in HOST_CONFIGS:
        report = run_check("hisparse_host", HiSparseHostPool, config, profile="ci", failures_dir=None)
        assert report.passed, report.failure
        seen |= {name.split(":", 1)[1] for name, count in report.rules.items() if name.startswith("misuse:") and count}
    assert seen == set(SUITE.misuse_cases)
