"""A misbehaving implementation never breaks the harness: each gets a verdict naming the operation and the step.

Unexpected exceptions, wrong return types, dtypes, devices and lengths, a hung call
(the per-operation timeout), a broken ``snapshot()`` and a factory that cannot build
all end in a failed report, and a multi-config run goes on to the next config.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from kvproof.conformance.check import replay_vector, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.hisparse_host import HOST_CONFIGS
from kvproof.conformance.plan import Impl, plan, run_plan
from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator

CONFIG = CONFORMANCE_CONFIGS[2]


class RaisesUnexpected(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        raise KeyError("boom")


class ReturnsList(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        return super().alloc_extend(*args, **kwargs).tolist()


class ReturnsInt32(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        return super().alloc_extend(*args, **kwargs).to(torch.int32)


class ReturnsOneTooMany(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        out = super().alloc_extend(*args, **kwargs)
        return torch.cat([out, out[-1:]])


class ReturnsOnMeta(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        return super().alloc_extend(*args, **kwargs).to("meta")


class Hangs(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        time.sleep(30)
        return super().alloc_extend(*args, **kwargs)


class SnapshotRaises(SWATokenToKVPoolAllocator):
    def snapshot(self):
        raise RuntimeError("cannot observe")


class SnapshotWrongType(SWATokenToKVPoolAllocator):
    def snapshot(self):
        return {"free": []}


def cannot_build(config):
    raise OSError("no device")


CASES = {
    "unexpected exception": (RaisesUnexpected, "alloc_extend crashed with KeyError: 'boom'"),
    "wrong type": (ReturnsList, "alloc_extend returned a list, not a torch.Tensor"),
    "wrong dtype": (ReturnsInt32, "alloc_extend returned dtype torch.int32, not torch.int64"),
    "wrong length": (ReturnsOneTooMany, "indices, the reference returned"),
    "wrong device": (ReturnsOnMeta, "alloc_extend returned a tensor on meta, not on cpu"),
    "snapshot raises": (SnapshotRaises, "snapshot() raised RuntimeError: cannot observe"),
    "snapshot wrong type": (SnapshotWrongType, "snapshot() returned a dict, not a AllocatorSnapshot"),
    "factory fails": (cannot_build, "the factory could not build an implementation for P4-W6-F48-S24: OSError"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_misbehaviour_gets_a_verdict(case: str) -> None:
    factory, expected = CASES[case]
    report = run_check("swa_allocator", factory, CONFIG, profile="ci", impl_name=case, failures_dir=None)
    assert not report.passed
    assert expected in (report.failure or ""), report.failure
    if case != "factory fails":
        assert "step" in (report.failure or "")


def test_a_hung_call_times_out_and_the_run_ends() -> None:
    start = time.perf_counter()
    report = run_check("swa_allocator", Hangs, CONFIG, profile="ci", impl_name="hangs", failures_dir=None,
                       op_timeout=0.3)
    assert time.perf_counter() - start < 20  # not one 30 s sleep per example
    assert not report.passed
    assert re.search(r"at step \d+:\n  alloc_extend did not return within 0.3 s \(hung\)", report.failure or "")
    # the vector ends at the hung step: replayed, it hangs there again; the runtime passes it
    assert report.vector and report.vector["steps"]
    again = replay_vector(report.vector, Hangs, op_timeout=0.3)
    assert again.failure and "alloc_extend did not return within 0.3 s" in again.failure
    assert again.steps == len(report.vector["steps"]) - 1
    assert replay_vector(report.vector, SWATokenToKVPoolAllocator).passed


class HostBackupHangs(HiSparseHostPool):
    def eager_backup_previous_token(self, reqs, seq_lens, values):
        time.sleep(30)


def test_a_hung_host_pool_call_times_out() -> None:
    report = run_check("hisparse_host", HostBackupHangs, HOST_CONFIGS[3], profile="ci", failures_dir=None,
                       op_timeout=0.3)
    assert not report.passed and "eager_backup_previous_token did not return within 0.3 s" in (report.failure or "")


def test_the_run_goes_on_to_the_next_config() -> None:
    labels = [c.label() for c in CONFORMANCE_CONFIGS[:2]]
    impl = Impl("tests:RaisesUnexpected", RaisesUnexpected, None)
    outcomes, _ = run_plan(plan(["swa_allocator"], [impl], labels), profile="ci")
    reports = [o.report for o in outcomes if o.report is not None]
    assert [r.config.label() for r in reports] == labels
    assert not any(r.passed for r in reports)


def test_a_hung_call_off_the_main_thread_uses_the_worker() -> None:
    """Off the main thread (no SIGALRM there) the call runs on an abandonable worker thread."""
    import threading

    box = []
    runner = threading.Thread(target=lambda: box.append(run_check(
        "swa_allocator", Hangs, CONFIG, profile="ci", impl_name="hangs", failures_dir=None, op_timeout=0.3)))
    runner.start()
    runner.join(60)
    assert box and not box[0].passed
    assert "alloc_extend did not return within 0.3 s (hung)" in (box[0].failure or "")
