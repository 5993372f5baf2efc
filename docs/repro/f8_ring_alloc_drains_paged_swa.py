"""F8 (SGLang 0.5.23, per-request SWA ring, page size 1): ``alloc`` has no ring branch: it takes paged SWA slots and
writes ``full_to_swa_index_mapping``, which the ring's ``free`` (``free_swa`` is a no-op there) never clears nor gives
back; once the unused paged SWA pool is drained, ``alloc`` returns None while ``available_size()`` (full only in ring
mode) says there is room.

Every other allocation (``alloc_extend``, ``alloc_decode``, ``alloc_extend_swa_tail``) has the ring branch, and they
assert page_size > 1; ``alloc`` asserts page_size == 1. 0.5.23 sets ``swa_req_ring_size`` only on DeepSeek-V4's pool,
whose model override forces page_size 256 (128 on NPU): no 0.5.23 caller reaches this.

    python f8_ring_alloc_drains_paged_swa.py   # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed (the ring's alloc leaves the paged SWA pool and the mapping alone).
"""
import sys

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

pool = SWAKVPool(size=12, size_swa=4, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
                 swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
pool.swa_req_ring_size = 4  # as DeepSeek-V4's pool sets it: SWA KV is a per-request ring
slots = ReqToTokenPool(size=3, max_context_len=16, device="cpu", enable_memory_saver=False)
a = SWATokenToKVPoolAllocator(12, 4, 1, torch.float32, "cpu", pool, need_sort=False, req_to_token_pool=slots)
mapped, refused = [], []
for _ in range(3):  # three requests in turn, each 2 tokens, each freed whole when it ends
    req = a.alloc(2)
    if req is None:
        refused.append(a.available_size())
        continue
    mapped.append(a.translate_loc_from_full_to_swa(req).tolist())
    a.free(req)
left = a.full_to_swa_index_mapping[1:13].tolist()
print(f"ring mode: {a.swa_req_ring}; SWA slots the requests were mapped to: {mapped}")
print("expected: every alloc succeeds (available_size() is the full pool's), no SWA slot taken, the mapping stays 0")
print(f"actual:   alloc refused with available_size() = {refused}; paged SWA free slots left: "
      f"{a.swa_attn_allocator.available_size()}; mapping entries left after every free: {sum(x != 0 for x in left)}")
sys.exit(10 if refused or any(x != 0 for x in left) else 0)
