"""``SWAKVPool`` through the runtime allocator: buffers, translation, CPU copies (sglang_semantics.md §2.8, §9 S4)."""

from __future__ import annotations

from typing import Any

import torch

from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference import KVGeometry, PoolConfig

GEO = KVGeometry(head_num=2, head_dim=3, full_attention_layer_ids=(2, 0), swa_attention_layer_ids=(1,))


def t(values: Any, device: str | torch.device = "cpu") -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def rows(n: int, base: float) -> torch.Tensor:
    return torch.arange(n * 6, dtype=torch.float32).reshape(n, 2, 3) + base


def test_buffers_shape_dtype_and_layer_mapping(device: str) -> None:
    cfg = PoolConfig(size_full=16, size_swa=8, page_size=4, sliding_window_size=4,
                     kv=GEO.model_copy(update={"dtype": "bfloat16"}))
    pool = SWATokenToKVPoolAllocator(cfg, device=device).get_kvcache()
    assert pool.layers_mapping == {2: (0, False), 0: (1, False), 1: (0, True)}
    k, v = pool.get_kv_buffer(0)
    assert k.shape == v.shape == (20, 2, 3) and k.dtype == torch.bfloat16
    assert pool.get_key_buffer(1).shape == (12, 2, 3)  # SWA layer: size_swa + P rows
    assert pool.get_value_buffer(1).device.type == torch.device(device).type


def test_set_kv_buffer_writes_swa_layers_through_the_mapping(device: str) -> None:
    cfg = PoolConfig(size_full=16, size_swa=8, page_size=4, sliding_window_size=4, kv=GEO)
    a, d = SWATokenToKVPoolAllocator(cfg, device=device), device
    a.alloc_extend_swa_tail(t([0], d), t([0]), t([8], d), t([8]), t([-1], d), 8, 4)  # full 4..11, SWA 4..7 for 8..11
    assert a.translate_loc_from_full_to_swa(t([-1, 4, 8, 11], d)).tolist() == [-1, 0, 4, 7]
    pool, loc = a.get_kvcache(), t(range(4, 12), d)
    pool.set_kv_buffer(1, loc, rows(8, 0).to(d), rows(8, 100).to(d))
    pool.set_kv_buffer(2, loc, rows(8, 0).to(d), rows(8, 100).to(d))
    k_swa, v_swa = pool.get_kv_buffer(1)
    assert torch.equal(k_swa[4:8].cpu(), rows(8, 0)[4:]) and torch.equal(v_swa[4:8].cpu(), rows(8, 100)[4:])
    assert torch.equal(pool.get_key_buffer(2)[4:12].cpu(), rows(8, 0))
    assert not pool.get_key_buffer(0).any()  # the other full layer is untouched


def test_s4_swa_mask_round_trip(device: str) -> None:
    """S4 (§9): M = [0,0,9,10,11,12] at copy time, [0,0,0,0,21,22] at load time.

    ``row_mask = new_mask[old_mask] = [F,F,T,T]``: the saved rows of positions 4, 5
    land at SWA slots 21, 22; the saved rows of positions 2, 3 are dropped.
    """
    cfg = PoolConfig(size_full=32, size_swa=32, page_size=1, sliding_window_size=4, kv=GEO)
    a, d = SWATokenToKVPoolAllocator(cfg, device=device), device

    def tail(n: int, k: int) -> torch.Tensor:
        return a.alloc_extend_swa_tail(t([0], d), t([0]), t([n], d), t([n]), t([-1], d), n, k)

    a.alloc(8)  # full 1..8, SWA 1..8: the next SWA slot is 9
    old = tail(6, 4)  # positions 0..5 at full 9..14; SWA 9..12 for positions 2..5
    assert old.tolist() == list(range(9, 15))
    assert a.translate_loc_from_full_to_swa(old).tolist() == [0, 0, 9, 10, 11, 12]
    pool = a.get_kvcache()
    pool.set_kv_buffer(1, old, rows(6, 0).to(d), rows(6, 50).to(d))
    pool.set_kv_buffer(0, old, rows(6, 200).to(d), rows(6, 300).to(d))
    copy = a.get_cpu_copy(old)
    mask, swa = copy["swa_mask"], copy["swa"]
    assert mask is not None and swa is not None
    assert mask.tolist() == [False, False, True, True, True, True]
    assert swa.shape == (1, 2, 4, 2, 3) and swa.device.type == "cpu"
    a.free(old)
    a.alloc(8)  # SWA 13..20
    new = tail(6, 2)  # SWA 21, 22 for positions 4, 5
    assert a.translate_loc_from_full_to_swa(new).tolist() == [0, 0, 0, 0, 21, 22]
    swa_before = pool.get_kv_buffer(1)[0].clone()
    a.load_cpu_copy(copy, new)
    k_swa, v_swa = pool.get_kv_buffer(1)
    assert torch.equal(k_swa[21:23].cpu(), rows(6, 0)[4:6]) and torch.equal(v_swa[21:23].cpu(), rows(6, 50)[4:6])
    changed = (k_swa != swa_before).flatten(1).any(dim=1).nonzero().flatten().tolist()
    assert set(changed) <= {21, 22}  # rows of positions 2, 3 went nowhere
    assert torch.equal(pool.get_key_buffer(0)[new].cpu(), rows(6, 200))  # full rows: every position


def test_get_cpu_copy_without_mapped_positions(device: str) -> None:
    cfg = PoolConfig(size_full=16, size_swa=8, page_size=4, sliding_window_size=4, kv=GEO)
    a, d = SWATokenToKVPoolAllocator(cfg, device=device), device
    out = a.alloc_extend_swa_tail(t([0], d), t([0]), t([4], d), t([4]), t([-1], d), 4, 0)
    copy = a.get_cpu_copy(out)
    mask, full = copy["swa_mask"], copy["full"]
    assert copy["swa"] is None and mask is not None and full is not None
    assert mask.tolist() == [False] * 4 and full.shape == (2, 2, 4, 2, 3)
    a.load_cpu_copy(copy, out)  # no SWA rows to place: a no-op on the SWA side
