"""``kvproof.gpu_runtime``: the SWA KV pools of SGLang 0.5.23 over torch tensors, CUDA or CPU.

* :mod:`.paged` -- ``PagedTokenToKVPoolAllocator``: one paged pool (P == 1 is the token allocator);
* :mod:`.swa_kv_pool` -- ``SWAKVPool``: per-layer K/V buffers, CPU copies with ``swa_mask``;
* :mod:`.swa_allocator` -- ``SWATokenToKVPoolAllocator``: the composite, with the
  reference's exact observable behaviour (``kvproof.reference.swa_allocator``), and the
  loc cache's invalidation points (``kvproof.reference.loc_cache``);
* :mod:`.loc_cache` -- ``ModelRunner`` / ``GraphRunner``: the engine hooks of the loc
  cache (per-forward invalidation, CUDA-graph capture and replay, emulated off CUDA).

Semantics: sglang_semantics.md §1.2-§1.5, §2.7, §2.8, §3 (cited per module). The device is
chosen at construction: ``cuda`` when available, else ``cpu``.
"""

from kvproof.gpu_runtime.loc_cache import GraphRunner, ModelRunner
from kvproof.gpu_runtime.paged import PagedTokenToKVPoolAllocator, default_device
from kvproof.gpu_runtime.swa_allocator import SWAAllocatorBackup, SWATokenToKVPoolAllocator
from kvproof.gpu_runtime.swa_kv_pool import SWAKVPool

__all__ = [
    "GraphRunner",
    "ModelRunner",
    "PagedTokenToKVPoolAllocator",
    "SWAAllocatorBackup",
    "SWAKVPool",
    "SWATokenToKVPoolAllocator",
    "default_device",
]
