"""F3 (SGLang 0.5.23, HiSparse): the eager backup of a decode batch is not failure-atomic.

``HiSparseCoordinator._eager_backup_previous_token`` first consumes every skip-first-backup flag of the batch, then
calls the host pool's ``alloc_paged_token_slots`` once per kept request with no capacity check. On a host pool one
page short, earlier requests keep the pages they took and the batch's flags are gone when the call raises. Below:
the coordinator's two loops on the real ``MLATokenToKVPoolHost`` (page size 2, 5 host pages, one free).

    python f3_host_backup_not_atomic.py   # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed (a failed backup leaves the pool, the lengths and the flags as they were).
"""
import sys

import torch
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

P, PAGES = 2, 5
cap = (PAGES - 1) * P  # the host pool adds one page
dev = MLATokenToKVPool(size=cap, page_size=P, dtype=torch.int64, kv_lora_rank=1, qk_rope_head_dim=0, layer_num=1,
                       device="cpu", enable_memory_saver=False)
with host_memory_budget_scope(64 << 20):
    host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, host_to_device_ratio=1.0, host_size=0,
                                page_size=P, layout="layer_first", pin_memory=False, device="cpu",
                                device_capacity_tokens=cap, start_layer=dev.start_layer, end_layer=dev.end_layer,
                                target_layer_num=dev.layer_num)
table = torch.full((3, 8 + P), -1, dtype=torch.int64)  # req_to_host_pool
alloc_len = torch.zeros(3, dtype=torch.int64)  # req_to_host_pool_allocated_len
for r, n in ((0, 2), (1, 4), (2, 1)):  # requests A, B, C staged (C just admitted: its first backup is skipped)
    host.alloc_paged_token_slots(table, alloc_len, r, 0, n)
skip = [False, False, True]
state_before = (host.available_size(), alloc_len.tolist(), list(skip))
batch, seq_lens = [2, 0, 1], [2, 4, 6]  # the decode batch [C, A, B]
kept = []
for i, r in enumerate(batch):  # loop 1: consume the flags
    if skip[r]:
        skip[r] = False
        continue
    kept.append(i)
try:
    for i in kept:  # loop 2: one host allocation per kept request, no pre-check
        host.alloc_paged_token_slots(table, alloc_len, batch[i], seq_lens[i] - 2, 1)
    error = None
except RuntimeError as err:
    error = err
state_after = (host.available_size(), alloc_len.tolist(), skip)
print(f"backup raised: {error!r}")
print(f"expected: (free slots, allocated lengths, flags) {state_before} after the failed backup")
print(f"actual:   {state_after}: A took the last page, C's flag is consumed")
sys.exit(10 if error is not None and state_after != state_before else 0)
