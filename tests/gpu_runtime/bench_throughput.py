"""Throughput of the torch runtime's hot paths.

A script, not a test: ``.venv/bin/python tests/gpu_runtime/bench_throughput.py``.

Measures ``alloc_extend`` (bs requests, prefix 0 -> n tokens) + ``free`` pairs per second,
and ``alloc_decode`` (bs requests, one token each) + the matching ``free``, on the
default device (CUDA when present: synchronised per pair, so the numbers include
the reductions' device syncs). Validation is on, as always.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference import PoolConfig


def rate(fn: Callable[[], None], seconds: float, rounds: int = 5) -> float:
    """Calls per second of ``fn``: the best of ``rounds`` runs of about ``seconds / rounds`` each (after a warm-up)."""
    for _ in range(20):
        fn()
    best = 0.0
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / rounds:
            for _ in range(25):
                fn()
            n += 25
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = max(best, n / (time.perf_counter() - start))
    return best


def extend_free(a: SWATokenToKVPoolAllocator, bs: int, n: int) -> Callable[[], None]:
    d, cpu = a.device, torch.device("cpu")
    pre_cpu, seq_cpu = torch.zeros(bs, dtype=torch.int64), torch.full((bs,), n, dtype=torch.int64)
    pre, seq, last = pre_cpu.to(d), seq_cpu.to(d), torch.full((bs,), -1, dtype=torch.int64, device=d)

    def pair() -> None:
        a.free(a.alloc_extend(pre, pre_cpu, seq, seq_cpu, last, bs * n))
    assert cpu.type == "cpu"
    return pair


def decode_free(a: SWATokenToKVPoolAllocator, bs: int) -> Callable[[], None]:
    d = a.device
    seq_cpu = torch.ones(bs, dtype=torch.int64)
    seq, last = seq_cpu.to(d), torch.full((bs,), -1, dtype=torch.int64, device=d)
    return lambda: a.free(a.alloc_decode(seq, seq_cpu, last))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (small ops: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"device={'cuda' if torch.cuda.is_available() else 'cpu'} torch={torch.__version__} threads={args.threads}")
    for p in (1, 4):
        cfg = PoolConfig(size_full=1 << 16, size_swa=1 << 16, page_size=p, sliding_window_size=128)
        a = SWATokenToKVPoolAllocator(cfg)
        for bs, n in ((1, 1), (1, 16), (1, 128), (1, 1024), (8, 128)):
            pairs = rate(extend_free(a, bs, n), args.seconds)
            print(f"P={p} alloc_extend(bs={bs}, 0->{n}) + free: {pairs:9.0f} pairs/s")
        for bs in (1, 64):
            print(f"P={p} alloc_decode(bs={bs}) + free:          {rate(decode_free(a, bs), args.seconds):9.0f} pairs/s")
        a.check_invariants()


if __name__ == "__main__":
    main()
