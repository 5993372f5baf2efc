"""F1, mirror (SGLang 0.5.23): when the *full* pool is the short one, ``alloc_decode`` still calls the SWA allocator
(both calls come before the ``None`` check), so the SWA page it took is lost.

Three requests fill the full pool; evicting each one's first page from the window (``free_swa``) leaves one SWA page
free. A decode into a new page then fails on the full side.

    python f1_alloc_decode_leak_mirror.py   # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed.
"""
import sys

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool


def t(*v):
    return torch.tensor(v, dtype=torch.int64)


pool = SWAKVPool(size=16, size_swa=8, page_size=4, dtype=torch.float32, head_num=1, head_dim=2,
                 swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
a = SWATokenToKVPoolAllocator(16, 8, 4, torch.float32, "cpu", pool, need_sort=False)
first = a.alloc_extend(t(0), t(0), t(8), t(8), t(-1), 8)
a.free_swa(first[:4])  # window eviction of the first page
for _ in range(2):
    a.free_swa(a.alloc_extend(t(0), t(0), t(4), t(4), t(-1), 4)[:4])
before = (a.full_available_size(), a.swa_available_size())
out = a.alloc_decode(t(9), t(9), first[-1:])  # token 9 opens a new page; the full pool has none
after = (a.full_available_size(), a.swa_available_size())
print(f"alloc_decode -> {out}; (full, swa) free tokens before {before}, after {after}")
print(f"expected: {before} after the failed call")
print(f"actual:   {after}: the SWA page the SWA allocator took is owned by nobody")
sys.exit(10 if after != before else 0)
