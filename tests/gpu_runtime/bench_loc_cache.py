"""Cost of a loc-cache hit vs a miss (a script, not a test: ``.venv/bin/python tests/gpu_runtime/bench_loc_cache.py``).

Per call, in µs, for index tensors of 64 and 4096 elements on the default device:
``SWAKVPool.translate_loc_from_full_to_swa`` on a hit (same tensor again) and on a
miss (after ``invalidate_loc_cache()``, whose two attribute stores are included), next
to the bare gather ``M[x]``; and a forward over 2 SWA layers + 1 full layer vs the
same writes translated afresh per layer (C2: one gather per forward). CUDA timings
synchronise after every call, so they include the launch and the sync.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference import KVGeometry, PoolConfig


def per_call_us(fn: Callable[[], object], seconds: float, sync: bool) -> float:
    """Best of 5 rounds, µs per call."""
    for _ in range(50):
        fn()
    best = float("inf")
    for _ in range(5):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 5:
            for _ in range(100):
                fn()
                if sync:
                    torch.cuda.synchronize()
            n += 100
        best = min(best, (time.perf_counter() - start) / n * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    geo = KVGeometry(head_num=8, head_dim=64, full_attention_layer_ids=(1,), swa_attention_layer_ids=(0, 2))
    cfg = PoolConfig(size_full=1 << 16, size_swa=1 << 16, page_size=1, sliding_window_size=128, kv=geo)
    a = SWATokenToKVPoolAllocator(cfg)
    sync = a.device.type == "cuda"
    slots = a.alloc(4096)
    print(f"device={a.device} torch={torch.__version__} threads={args.threads}")
    for n in (64, 4096):
        bench_size(a, slots[:n], args.seconds, sync)


def bench_size(a: SWATokenToKVPoolAllocator, x: torch.Tensor, seconds: float, sync: bool) -> None:
    """One line pair of the report: translations and forwards of the ``x.numel()`` slots ``x``."""
    pool, m, geo, n = a.get_kvcache(), a.full_to_swa_index_mapping, a.config.kv, x.numel()

    def miss() -> object:
        pool.invalidate_loc_cache()
        return pool.translate_loc_from_full_to_swa(x)

    hit = per_call_us(lambda: pool.translate_loc_from_full_to_swa(x), seconds, sync)
    print(f"n={n:5d}  hit {hit:7.2f} us   miss {per_call_us(miss, seconds, sync):7.2f} us   "
          f"bare M[x] {per_call_us(lambda: m[x], seconds, sync):7.2f} us")
    k = {i: torch.zeros(n, geo.head_num, geo.head_dim, device=a.device) for i in (0, 1, 2)}
    cached = per_call_us(lambda: a.forward(x, k, k), seconds, sync)
    fresh = per_call_us(lambda: [pool.set_kv_buffer(i, x, k[i], k[i]) for i in (0, 1, 2)], seconds, sync)
    print(f"         forward (1 gather) {cached:8.2f} us   3 x set_kv_buffer (fresh gathers) {fresh:8.2f} us")


if __name__ == "__main__":
    main()
