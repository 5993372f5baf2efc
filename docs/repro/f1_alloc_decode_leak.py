"""F1 (SGLang 0.5.23): ``SWATokenToKVPoolAllocator.alloc_decode`` is not atomic.

It calls the full allocator, then the SWA allocator, and returns ``None`` if either failed, without giving back
what the other took. Here the SWA pool is short: the full page the first call took is lost until ``clear()``.

    python f1_alloc_decode_leak.py      # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed (a failed alloc_decode leaves both pools as they were).
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
loc = a.alloc_extend(t(0), t(0), t(8), t(8), t(-1), 8)  # one request, 8 tokens: 2 full + 2 SWA pages (SWA now full)
before = (a.full_available_size(), a.swa_available_size())
out = a.alloc_decode(t(9), t(9), loc[-1:])  # token 9 opens a new page in both pools; the SWA pool has none
after = (a.full_available_size(), a.swa_available_size())
a.free(loc)  # the request ends
print(f"alloc_decode -> {out}; (full, swa) free tokens before {before}, after {after}")
print(f"expected: {before} after the failed call, and 16 full tokens free once the request ends")
print(f"actual:   {after}, and {a.full_available_size()} full tokens free once the request ends")
sys.exit(10 if after != before else 0)
