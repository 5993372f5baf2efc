"""F4 (SGLang 0.5.23): ``SWAPrefillBudget`` refuses forever, on an idle pool, a request whose sliding window holds a
host tombstone longer than the SWA pool.

The match reports ``swa_host_hit_length`` as whole tombstones (``SWAComponent.finalize_match_result``, its
``TODO(hzh)``), although loading back needs only the window, ``ceil_P(W)`` tokens. Page size 2, window 4, an SWA pool
of 16 tokens, chunked prefill of 8: a 24-token tombstone is charged 24 and the request never fits.

    python f4_window_tombstone_starves.py   # on CPU without Triton: PYTHONPATH=<kvproof>/conformance/adapters/_stubs

Exit 10: reproduced; 0: fixed (the request is admitted on the idle pool).
"""
import sys

import torch
from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

W, P, SWA_TOKENS, CHUNK, TOMBSTONE = 4, 2, 16, 8, 24


class IdleTree:  # what SWAPrefillBudget reads from the tree cache: nothing cached, nothing evictable
    sliding_window_size = W

    def supports_mamba(self):
        return False

    def full_evictable_size(self):
        return 0

    def swa_evictable_size(self):
        return 0


pool = SWAKVPool(size=4096, size_swa=SWA_TOKENS, page_size=P, dtype=torch.float32, head_num=1, head_dim=2,
                 swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
a = SWATokenToKVPoolAllocator(4096, SWA_TOKENS, P, torch.float32, "cpu", pool, need_sort=False)


def check(swa_host_hit_length):  # a fresh budget per round, as PrefillAdder builds one
    return a.create_prefill_budget(IdleTree()).check_prefill(
        extend_input_len=1, total_tokens=1 + P, max_new_tokens=0, input_tokens=TOMBSTONE + 1,
        swa_host_hit_length=swa_host_hit_length, chunk_limit=CHUNK)


rounds = [check(TOMBSTONE) for _ in range(3)]
window = check(-(-W // P) * P)
print(f"check_prefill with the whole tombstone charged, 3 rounds: {rounds}")
print(f"check_prefill with the window charged (ceil_P(W) = {-(-W // P) * P} tokens): {window}")
print("expected: admitted (one token to extend, the window to load back, an idle pool of 16 SWA tokens)")
print(f"actual:   {rounds[-1]} in every round, forever")
sys.exit(10 if not any(admitted for admitted, _ in rounds) else 0)
