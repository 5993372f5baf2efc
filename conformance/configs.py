"""Small pool configurations the lockstep suite runs on (4-16 pages per pool).

Tiny pools on purpose: ShardStore's one escaped bug lived on a cache-miss path no
test reached because every test cache was large (verification_anchors.md §1.1).
They cover P = 1, 2, 3, 4, windows below, at and above the page size, and a
bfloat16 multi-head geometry.
"""

from __future__ import annotations

from kvproof.reference.config import KVGeometry, PoolConfig

__all__ = ["CONFORMANCE_CONFIGS"]

CONFORMANCE_CONFIGS: tuple[PoolConfig, ...] = (
    PoolConfig(size_full=12, size_swa=8, page_size=1, sliding_window_size=3),
    PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3),
    PoolConfig(size_full=48, size_swa=24, page_size=4, sliding_window_size=6),
    PoolConfig(size_full=32, size_swa=16, page_size=4, sliding_window_size=2),
    PoolConfig(size_full=30, size_swa=15, page_size=3, sliding_window_size=4,
               kv=KVGeometry(head_num=2, head_dim=2, full_attention_layer_ids=(0, 2),
                             swa_attention_layer_ids=(1,), dtype="bfloat16")),
)

