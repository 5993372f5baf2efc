"""The torch HiSparse host pool: S7, placement (host buffers on CPU, table on the device), failures keep state."""

from __future__ import annotations

import pytest
import torch

from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
from kvproof.reference import hisparse_host as hh
from kvproof.reference.errors import ConfigError, InvalidOperation, OutOfMemory

S7 = hh.HostPoolConfig(page_size=64, num_pages=40, max_req_slots=4, max_context_len=2048)


def test_s7_on_the_runtime(device: str) -> None:
    pool = HiSparseHostPool(S7, device=device)
    slots = pool.admit_request_into_staging(0, torch.arange(1000))
    assert slots.numel() == 1000 and int(pool.allocated_len[0]) == 1024
    for seq_len in range(1001, 1026):
        pool.eager_backup_previous_token([0], [seq_len], [seq_len])
    assert int(pool.allocated_len[0]) == 1024  # positions up to 1 023: no allocation
    written = pool.eager_backup_previous_token([0], [1026], [7])
    assert int(pool.allocated_len[0]) == 1088 and written.tolist() == [1024]
    hh.check_host_snapshot(pool.snapshot())
    before = pool.available_size()
    pool.request_finished(0)
    assert (pool.available_size() - before) // 64 == 17
    hh.check_host_snapshot(pool.snapshot())


def test_placement(device: str) -> None:
    """Host buffers and the free list live on the CPU; the request table on the chosen device."""
    pool = HiSparseHostPool(S7, device=device)
    assert pool.req_to_host_pool.device.type == torch.device(device).type
    assert pool.host_data.device.type == "cpu" and pool.free_slots().device.type == "cpu"
    slots = pool.alloc_paged_token_slots(1, 0, 3)
    assert slots.device.type == torch.device(device).type and slots.dtype == torch.int64


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda p: p.alloc_paged_token_slots(9, 0, 1), "req"),
        (lambda p: p.alloc_paged_token_slots(0, 1100, 1), "start_pos"),
        (lambda p: p.alloc_paged_token_slots(0, 0, 2113), "num_tokens"),
        (lambda p: p.admit_request_into_staging(0, torch.arange(3)), "req"),
        (lambda p: p.eager_backup_previous_token([1], [3], [0]), "seq_lens"),
        (lambda p: p.eager_backup_previous_token([0, 0], [3, 3], [0, 0]), "reqs"),
        (lambda p: p.alloc(3), "need_size"),
    ],
)
def test_misuse_is_typed_and_changes_nothing(call, argument: str, device: str) -> None:
    pool = HiSparseHostPool(S7, device=device)
    pool.admit_request_into_staging(0, torch.arange(1000))
    before = pool.snapshot()
    with pytest.raises(InvalidOperation) as err:
        call(pool)
    assert err.value.argument == argument
    assert pool.snapshot() == before


def test_out_of_host_memory_names_request_and_keeps_state(device: str) -> None:
    config = hh.HostPoolConfig(page_size=4, num_pages=3, max_req_slots=3, max_context_len=20)
    pool = HiSparseHostPool(config, device=device)
    pool.admit_request_into_staging(0, torch.arange(8))
    pool.admit_request_into_staging(1, torch.arange(4))
    pool.eager_backup_previous_token([0, 1], [9, 5], [0, 0])  # skipped: first backup after staging
    before = pool.snapshot()
    with pytest.raises(OutOfMemory) as err:
        pool.eager_backup_previous_token([0, 1], [10, 6], [1, 2])  # positions 8 and 4 open pages; none free
    assert (err.value.request, err.value.pages_needed, err.value.pages_free) == (0, 2, 0)
    assert "for request 0" in str(err.value)
    assert pool.snapshot() == before


def test_vectorised_backup_matches_one_by_one(device: str) -> None:
    """One batch call hands out the same pages, in batch order, as per-request calls."""
    config = hh.HostPoolConfig(page_size=2, num_pages=16, max_req_slots=4, max_context_len=20)
    batch, one = HiSparseHostPool(config, device=device), HiSparseHostPool(config, device=device)
    for pool in (batch, one):
        for req, n in ((2, 2), (0, 3), (1, 4)):
            pool.admit_request_into_staging(req, torch.arange(n))
    seqs = {2: 3, 0: 4, 1: 5}
    for step in range(4):
        order = [1, 2, 0] if step % 2 else [0, 1, 2]
        lens = [seqs[r] + step for r in order]
        batch.eager_backup_previous_token(order, lens, [10 * step + r for r in order])
        for r, s in zip(order, lens, strict=True):
            one.eager_backup_previous_token([r], [s], [10 * step + r])
    assert batch.snapshot() == one.snapshot()


def test_the_runtime_refuses_the_pre_23606_coordinator() -> None:
    config = S7.model_copy(update={"coordinator": hh.Coordinator.PRE_23606})
    with pytest.raises(ConfigError, match=r"^HostPoolConfig\.coordinator: .*PAGED coordinator only"):
        HiSparseHostPool(config, device="cpu")
