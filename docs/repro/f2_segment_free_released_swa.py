"""F2, segment API (SGLang 0.5.23, every page size): ``free_segment`` of a row whose first page's SWA peer was already
released (``free_swa_segment``, a window eviction) puts the reserved SWA page 0 into the free list.

``free`` / ``free_swa`` drop released peers at page size > 1 (``_release_swa`` filters ``> 0``); the segment calls,
which SGLang's own callers use, go through ``_free_swa_pages`` unfiltered at every page size. SGLang's callers split a
row at the request's SWA cursor and send the released part to ``free_full_segments``, so none does this; its own
check ``swa.peer_mapped`` names it misuse when SGLANG_INVARIANT_CHECK >= 1.

    python f2_segment_free_released_swa.py   # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed (page 0 never becomes free).
"""
import sys

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool


def t(*v):
    return torch.tensor(v, dtype=torch.int64)


pool = SWAKVPool(size=16, size_swa=24, page_size=2, dtype=torch.float32, head_num=1, head_dim=2,
                 swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
a = SWATokenToKVPoolAllocator(16, 24, 2, torch.float32, "cpu", pool, need_sort=False)
other = a.alloc_extend(t(0), t(0), t(2), t(2), t(-1), 2)  # another live request
row = a.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)  # a 4-token row: 2 full pages, 2 SWA pages
a.free_swa_segment(row[:2], start_pos=0)  # window eviction of the row's first page
a.free_segment(row, start_pos=0)  # the row ends: a plain segment free of all of it
swa_free = a.swa_attn_allocator.free_pages.tolist()
print(f"SWA free pages after the row ends: {swa_free}")
print("expected: page 0 (reserved for padding writes) is never free")
print(f"actual:   page 0 {'is' if 0 in swa_free else 'is not'} in the free list")
sys.exit(10 if 0 in swa_free else 0)
