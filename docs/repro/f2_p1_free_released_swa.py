"""F2 (SGLang 0.5.23, page size 1): ``free`` of a slot whose SWA peer was already released (``free_swa``, a window
eviction) puts the reserved SWA slot 0 into the free list, and a later ``alloc`` hands it to a live token.

At page size > 1 ``free`` skips released peers; at page size 1 it reads ``M[slot] == 0`` and frees SWA slot 0.
SGLang's own check ``swa.peer_mapped`` ("caller wants free_full") names the call misuse when
SGLANG_INVARIANT_CHECK >= 1; with the default (off) nothing stops it.

    python f2_p1_free_released_swa.py   # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed (slot 0 never becomes free).
"""
import sys

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

pool = SWAKVPool(size=12, size_swa=8, page_size=1, dtype=torch.float32, head_num=1, head_dim=2,
                 swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
b = SWATokenToKVPoolAllocator(12, 8, 1, torch.float32, "cpu", pool, need_sort=False)
req_a, req_b = b.alloc(2), b.alloc(1)  # A: full [1, 2] -> SWA [1, 2]; B: full [3] -> SWA [3], stays live
b.free_swa(req_a[:1])  # window eviction of A's position 0: M[1] = 0
b.free(req_a)  # A ends: reads M[[1, 2]] = [0, 2] and frees SWA slots 0 and 2
swa_free = b.swa_attn_allocator.free_pages.tolist()
req_c = b.alloc(7)  # takes every free SWA slot
c_swa = b.translate_loc_from_full_to_swa(req_c).tolist()
print(f"SWA free list after A ends: {swa_free}; request C's SWA slots: {c_swa}")
print("expected: slot 0 (reserved for padding writes) is never free nor handed out")
print(f"actual:   slot 0 {'is' if 0 in swa_free else 'is not'} in the free list; C maps a live token to SWA slot "
      f"{c_swa[-1]}")
sys.exit(10 if 0 in swa_free or 0 in c_swa else 0)
