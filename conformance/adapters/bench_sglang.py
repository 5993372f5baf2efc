"""Side by side: kvproof's torch runtime and SGLang 0.5.23's allocator on one operation sequence, one process.

``python -m kvproof.conformance.adapters.bench_sglang [--ops N] [--repeat R]`` prints a table;
:func:`side_by_side` returns the rows. Both allocators run on the CPU with one torch
thread, pools large enough that no operation runs out of memory, and the same seeded
sequence of about half allocations, half frees (at most 64 live requests of 1-8 tokens):

* P > 1: ``alloc_extend`` of a new request (prefix 0 -> n tokens, ``last_loc`` -1);
* P == 1: ``alloc(n)`` (SGLang's composite has ``alloc_extend`` only for P > 1);
* ``free`` of a random live request (all its slots).

Each implementation runs the sequence once to warm up, then ``repeat`` times; the best
run counts. The ratio is kvproof's ops/s over SGLang's (> 1: kvproof is faster).
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvproof.conformance.errors import HarnessBug
from kvproof.reference.config import PoolConfig

__all__ = ["main", "operations", "side_by_side"]

_MAX_LIVE, _MAX_TOKENS = 64, 8


def operations(ops: int, seed: int = 0) -> list[tuple[str, int]]:
    """``("alloc", n)`` (a new request of n tokens) or ``("free", k)`` (the k-th live request), ``ops`` of them."""
    rng, live, seq = random.Random(seed), 0, []
    for _ in range(ops):
        if live and (live >= _MAX_LIVE or rng.random() < 0.5):
            seq.append(("free", rng.randrange(live)))
            live -= 1
        else:
            seq.append(("alloc", rng.randint(1, _MAX_TOKENS)))
            live += 1
    return seq


def _config(page_size: int) -> PoolConfig:
    pages = _MAX_LIVE * -(-_MAX_TOKENS // page_size) + 8  # room for every live request: never out of memory
    return PoolConfig(size_full=pages * page_size, size_swa=pages * page_size, page_size=page_size,
                      sliding_window_size=4)


def _run(allocator: Any, page_size: int, seq: Sequence[tuple[str, int]]) -> float:
    """Seconds to play ``seq`` on ``allocator`` (SGLang's or kvproof's: the same method names)."""
    i64 = torch.int64
    zero, minus_one = torch.zeros(1, dtype=i64), torch.full((1,), -1, dtype=i64)
    lens = {n: torch.tensor([n], dtype=i64) for n in range(1, _MAX_TOKENS + 1)}
    live: list[torch.Tensor] = []
    start = time.perf_counter()
    for op, arg in seq:
        if op == "free":
            allocator.free(live.pop(arg))
            continue
        if page_size == 1:
            out = allocator.alloc(arg)
        else:
            out = allocator.alloc_extend(zero, zero, lens[arg], lens[arg], minus_one, arg)
        if out is None:
            raise HarnessBug(f"{type(allocator).__name__} ran out of memory in the benchmark")
        live.append(out)
    elapsed = time.perf_counter() - start
    for held in live:
        allocator.free(held)
    return elapsed


def _kvproof(config: PoolConfig) -> Any:
    from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(config, device="cpu")


def _sglang(config: PoolConfig) -> Any:
    from kvproof.conformance.adapters.sglang import SGLangSWAAllocator

    return SGLangSWAAllocator(config).allocator  # SGLang's own object: None on OOM, no adapter in the loop


def side_by_side(page_sizes: Sequence[int] = (1, 4), ops: int = 10_000, repeat: int = 3, seed: int = 0,
                 threads: int = 1) -> list[dict[str, Any]]:
    """One row per page size: ops, ops/s of kvproof's runtime and of SGLang, and their ratio."""
    seq = operations(ops, seed)
    makers: dict[str, Callable[[PoolConfig], Any]] = {"kvproof": _kvproof, "sglang": _sglang}
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rows = []
    try:
        for p in page_sizes:
            config = _config(p)
            row: dict[str, Any] = {"page_size": p, "ops": len(seq), "op": "alloc" if p == 1 else "alloc_extend"}
            for name, make in makers.items():
                allocator = make(config)
                _run(allocator, p, seq)  # warm-up
                best = min(_run(allocator, p, seq) for _ in range(repeat))
                row[f"{name}_ops_per_s"] = len(seq) / best
                row[f"{name}_us_per_op"] = best / len(seq) * 1e6
            row["ratio"] = row["kvproof_ops_per_s"] / row["sglang_ops_per_s"]
            rows.append(row)
    finally:
        torch.set_num_threads(previous)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    from rich.console import Console
    from rich.table import Table

    parser = argparse.ArgumentParser(prog="python -m kvproof.conformance.adapters.bench_sglang",
                                     description="kvproof's torch runtime vs SGLang 0.5.23's allocator, same ops")
    parser.add_argument("--ops", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 4])
    args = parser.parse_args(argv)
    rows = side_by_side(args.page_sizes, args.ops, args.repeat)
    table = Table(title=f"SWA allocator, {args.ops} ops (alloc/alloc_extend + free), CPU, 1 thread, best of "
                        f"{args.repeat}")
    for col in ("P", "allocation op", "kvproof ops/s", "SGLang ops/s", "kvproof/SGLang"):
        table.add_column(col, justify="left" if col == "allocation op" else "right")
    for r in rows:
        table.add_row(str(r["page_size"]), r["op"], f"{r['kvproof_ops_per_s']:,.0f}", f"{r['sglang_ops_per_s']:,.0f}",
                      f"{r['ratio']:.2f}x")
    Console().print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
