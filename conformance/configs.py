"""Small pool configurations the lockstep suite runs on (4-16 pages per pool).

Tiny pools on purpose: ShardStore's one escaped bug lived on a cache-miss path no
test reached because every test cache was large (verification_anchors.md §1.1).
They cover P = 1, 2, 3, 4, windows below, at and above the page size, and a
bfloat16 multi-head geometry.
"""

from __future__ import annotations

from kvproof.reference.config import KVGeometry, PoolConfig

__all__ = ["CONFORMANCE_CONFIGS", "RING_CONFIGS", "RING_P1_CONFIG"]

CONFORMANCE_CONFIGS: tuple[PoolConfig, ...] = (
    PoolConfig(size_full=12, size_swa=8, page_size=1, sliding_window_size=3),
    PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3),
    PoolConfig(size_full=48, size_swa=24, page_size=4, sliding_window_size=6),
    PoolConfig(size_full=32, size_swa=16, page_size=4, sliding_window_size=2),
    PoolConfig(size_full=30, size_swa=15, page_size=3, sliding_window_size=4,
               kv=KVGeometry(head_num=2, head_dim=2, full_attention_layer_ids=(0, 2),
                             swa_attention_layer_ids=(1,), dtype="bfloat16")),
)


#: Ring configs (``swa_allocator`` only): 0.5.23's per-request SWA ring (``swa_req_ring_size``, DeepSeek-V4's pool), a
#: ring not a multiple of the page size (cost rounded up to pages) and few request slots, so that admission runs out of
#: slots. P > 1 only, as every 0.5.23 caller builds it (DeepSeek-V4 forces page_size 256, 128 on NPU).
RING_CONFIGS: tuple[PoolConfig, ...] = (
    PoolConfig(size_full=24, size_swa=12, page_size=2, sliding_window_size=3, swa_ring_size=3, num_req_slots=4),
    PoolConfig(size_full=32, size_swa=16, page_size=4, sliding_window_size=6, swa_ring_size=6, num_req_slots=3),
)

#: A ring at P == 1, where 0.5.23's ``alloc`` (no ring branch) is the only allocation: finding F8
#: (docs/sglang-findings.md); kept out of the suite's list, which has the shapes 0.5.23 builds.
RING_P1_CONFIG = PoolConfig(size_full=12, size_swa=4, page_size=1, sliding_window_size=3, swa_ring_size=4,
                            num_req_slots=3)
