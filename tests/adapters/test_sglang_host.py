"""The SGLang 0.5.23 HiSparse host pool adapter: importable without SGLang, and, where SGLang is
installed (``.venv-sglang``: ``make sglang``), the real ``MLATokenToKVPoolHost`` behind the
``hisparse_host`` protocol, S7 through it, a lockstep run per ``HOST_CONFIGS`` config, and one test
per documented finding (docs/sglang-findings.md, "hisparse_host: SGLang's host pool").

Tests that need SGLang are skipped with one reason, naming the install command, when it is not
importable (the main ``.venv`` has no SGLang on purpose).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvproof.conformance.adapters import sglang as sglang_adapter
from kvproof.conformance.adapters import sglang_findings
from kvproof.conformance.adapters import sglang_host as adapter
from kvproof.conformance.check import run_check
from kvproof.conformance.hisparse_host import HOST_CONFIGS
from kvproof.reference.contract import Capability, HostPoolUnderTest
from kvproof.reference.hisparse_host import Coordinator, HostPoolConfig

SKIP_REASON = f"SGLang is not installed here; install it with: {adapter.INSTALL_HINT}"
needs_sglang = pytest.mark.skipif(not adapter.sglang_available(), reason=SKIP_REASON)
C = Capability
S7 = HostPoolConfig(page_size=64, num_pages=20, max_req_slots=2, max_context_len=2048)


# ---------------------------------------------------------------- without SGLang (any venv)


def test_importing_the_host_adapter_does_not_import_sglang() -> None:
    code = ("import sys, kvproof.conformance.adapters.sglang_host, kvproof.conformance.adapters.sglang_findings; "
            "assert 'sglang' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_constructing_without_sglang_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang_adapter, "_LOADED", None)
    monkeypatch.setattr(adapter, "_HOST", None)
    monkeypatch.setattr(sglang_adapter, "sglang_available", lambda: False)
    with pytest.raises(ImportError, match=r"install_sglang") as err:
        adapter.SGLangHostPool(HOST_CONFIGS[0])
    assert "make sglang" in str(err.value)


def test_only_the_paged_coordinator() -> None:
    pre = HostPoolConfig(page_size=1, num_pages=8, max_req_slots=2, max_context_len=8, device_page_size=4,
                         coordinator=Coordinator.PRE_23606)
    with pytest.raises(ValueError, match="paged coordinator"):
        adapter.SGLangHostPool(pre)


def test_capabilities_are_declared() -> None:
    assert adapter.SGLangHostPool.capabilities == frozenset({C.EXACT_PAGE_ORDER})


def test_classify_names_f3() -> None:
    from kvproof.conformance.findings import Evidence

    for check in ("unchanged_on_failure", "result"):
        assert sglang_findings.classify(Evidence("hisparse_host", "eager_backup_previous_token", check, 6)).id == "F3"
    assert sglang_findings.classify(Evidence("hisparse_host", "eager_backup_previous_token", "kv", 6)) is None


# ---------------------------------------------------------------- with SGLang


@pytest.fixture(scope="module")
def host_modules() -> adapter.SGLangHostModules:
    return adapter.load_sglang_host()


@needs_sglang
@pytest.mark.parametrize("config", HOST_CONFIGS, ids=lambda c: c.label())
def test_adapter_builds_the_real_pool_and_meets_the_protocol(host_modules, config) -> None:
    impl = adapter.SGLangHostPool(config)
    assert isinstance(impl, HostPoolUnderTest)
    assert type(impl.host) is host_modules.MLATokenToKVPoolHost
    assert isinstance(impl.host, host_modules.HiSparseHostPoolMixin)
    assert (impl.host.page_num, impl.host.size, impl.host.page_size) == (config.num_pages, config.size,
                                                                         config.page_size)
    assert impl.host.kv_buffer is not None and impl.host.kv_buffer.shape[1] == config.size  # a real host buffer
    snap = impl.snapshot()
    assert snap.free_slots == tuple(range(config.size)) and impl.available_size() == config.size
    assert snap.allocated_len == (0,) * config.max_req_slots
    assert snap.rows == ((-1,) * config.row_width,) * config.max_req_slots


@needs_sglang
def test_s7_through_the_real_pool(host_modules) -> None:
    """S7 (§4.7): P = 64, a 1 000-token prefill -> 16 pages (1 024); position 1 024 -> 1 088; finish frees 17."""
    import torch

    impl, p = adapter.SGLangHostPool(S7), 64
    slots = impl.admit_request_into_staging(0, torch.arange(1000))
    assert slots.tolist() == list(range(1000)) and impl.snapshot().allocated_len[0] == 1024
    assert impl.available_size() == (20 - 16) * p
    assert impl.eager_backup_previous_token(torch.tensor([0]), torch.tensor([1001]), torch.tensor([-1])).numel() == 0
    for seq_len in range(1002, 1026):  # positions 1 000 ... 1 023: slots already reserved, no allocation
        impl.eager_backup_previous_token(torch.tensor([0]), torch.tensor([seq_len]), torch.tensor([seq_len]))
    assert impl.snapshot().allocated_len[0] == 1024
    out = impl.eager_backup_previous_token(torch.tensor([0]), torch.tensor([1026]), torch.tensor([7]))
    assert impl.snapshot().allocated_len[0] == 1088 and out.tolist() == [1024]
    assert impl.get_host_data(out).tolist() == [7] and impl.get_host_data(torch.tensor([999])).tolist() == [999]
    assert len(impl.allocated_host_indices(0)) == 17 * p
    impl.request_finished(0)
    assert impl.available_size() == 20 * p and impl.snapshot().allocated_len[0] == 0
    assert impl.snapshot().free_slots[-17 * p:] == tuple(range(17 * p))  # the 17 pages, back in row order


@needs_sglang
def test_out_of_memory_is_raised_and_changes_nothing(host_modules) -> None:
    import torch

    from kvproof.reference.errors import OutOfMemory

    impl = adapter.SGLangHostPool(HOST_CONFIGS[3])  # P4, 8 pages, rows of 18
    impl.admit_request_into_staging(0, torch.arange(14))  # 4 pages
    impl.admit_request_into_staging(1, torch.arange(13))  # 4 pages: the pool is empty
    before = impl.snapshot()
    with pytest.raises(OutOfMemory, match=r"host pool needs 1 page\(s\) for request 0, 0 free"):
        impl.alloc_paged_token_slots(0, 16, 1)
    with pytest.raises(OutOfMemory):
        impl.admit_request_into_staging(2, torch.arange(1))
    assert impl.snapshot() == before


@needs_sglang
@pytest.mark.parametrize("config", HOST_CONFIGS, ids=lambda c: c.label())
def test_lockstep_divergences_are_the_documented_findings(host_modules, config) -> None:
    """A ``ci`` lockstep run per config passes: F3 is a declared difference (no ``ATOMIC_BACKUP_BATCH``),
    so the harness cuts a short backup batch to what both sides serve alike, and counts the cuts."""
    report = run_check("hisparse_host", adapter.SGLangHostPool, config, profile="ci", failures_dir=None)
    assert report.steps > 0
    assert report.passed, report.failure
    assert report.calls.get("eager_backup_previous_token", 0) > 0


@needs_sglang
def test_f3_backup_batch_is_not_failure_atomic(host_modules) -> None:
    seen = sglang_findings.reproduce_host_backup_not_atomic()
    assert seen["error"] is not None and "alloc failed for 1 pages" in seen["error"]
    assert seen["free_before"] == 2
    assert seen["free_after"] == 0, "SGLang now rolls back a short backup batch: update F3"
    assert seen["allocated_len"] == [4, 4, 2]  # A kept the page it took before B failed
    assert seen["skip_first_backup"] == [False, False, False]  # C's flag is gone with nothing backed up
