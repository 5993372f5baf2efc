"""The reference behind the conformance protocol: ``ReferenceAllocator``.

A thin stateful shell over the pure operations of
``kvproof.reference.swa_allocator``, speaking the tensor protocol of
:mod:`kvproof.reference.contract`. It lets the lockstep harness run the
reference against itself (a suite that the reference cannot pass proves nothing)
and gives third parties an executable model with SGLang's method names.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvproof.conformance.tensors import int64s
from kvproof.reference import block_pool as bp
from kvproof.reference import hisparse_host as hh
from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation
from kvproof.reference.registry import Component
from kvproof.reference.snapshot import AllocatorSnapshot

__all__ = ["ReferenceAllocator", "ReferenceBlockPool", "ReferenceHostPool", "ReferenceKVPool"]

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


class ReferenceKVPool:
    """``SWAKVPool``'s KV surface over the reference state."""

    def __init__(self, owner: ReferenceAllocator) -> None:
        self._owner = owner

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        n = cache_k.shape[0]
        k = cache_k.reshape(n, -1).tolist()
        v = cache_v.reshape(n, -1).tolist()
        self._owner.state = ref.set_kv_buffer(self._owner.state, layer_id, _ints(loc), k, v)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self._owner.config
        rows = self._owner.state.kv.layers[layer_id]
        w = cfg.kv.row_width
        data = torch.tensor([list(r) if r is not None else [0.0] * (2 * w) for r in rows], dtype=torch.float32)
        shape = (len(rows), cfg.kv.head_num, cfg.kv.head_dim)
        dtype = _DTYPES[cfg.kv.dtype]
        return data[:, :w].reshape(shape).to(dtype), data[:, w:].reshape(shape).to(dtype)


class ReferenceAllocator:
    """Every operation delegates to the pure reference; failures raise the reference's errors."""

    capabilities = frozenset(Capability) - {Capability.DECODE_BUDGETS}
    components = frozenset({Component.SWA_ALLOCATOR, Component.LOC_CACHE, Component.DECODE_PREALLOC})
    device = "cpu"

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.state = ref.initial_state(config)
        self._kv = ReferenceKVPool(self)
        self._graph: tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]] | None = None

    def alloc(self, need_size: int) -> torch.Tensor:
        self.state, slots = ref.alloc(self.state, need_size)
        return int64s(slots)

    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        self.state, slots = ref.alloc_extend(self.state, _ints(prefix_lens_cpu), _ints(seq_lens_cpu),
                                             _ints(last_loc), extend_num_tokens)
        return int64s(slots)

    def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc):
        self.state, slots = ref.alloc_decode(self.state, _ints(seq_lens_cpu), _ints(last_loc))
        return int64s(slots)

    def alloc_extend_swa_tail(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                              extend_num_tokens, swa_tail_len):
        self.state, slots = ref.alloc_extend_swa_tail(self.state, _ints(prefix_lens_cpu), _ints(seq_lens_cpu),
                                                      _ints(last_loc), extend_num_tokens, swa_tail_len)
        return int64s(slots)

    def free(self, free_index: torch.Tensor) -> None:
        self.state = ref.free(self.state, _ints(free_index))

    def free_swa(self, free_index: torch.Tensor) -> None:
        self.state = ref.free_swa(self.state, _ints(free_index))

    def free_full(self, free_index: torch.Tensor) -> None:
        self.state = ref.free_full(self.state, _ints(free_index))

    def free_group_begin(self) -> None:
        self.state = ref.free_group_begin(self.state)

    def free_group_end(self) -> None:
        self.state = ref.free_group_end(self.state)

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.state = ref.free_segment(self.state, _ints(free_index), start_pos)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.state = ref.free_swa_segment(self.state, _ints(free_index), start_pos)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.state = ref.free_full_segment(self.state, _ints(free_index), start_pos)

    def free_kv_row_segments(self, segments: list[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int,
                             swa_dead_lo: int = 0) -> None:
        self.state = ref.free_kv_row_segments(self.state, [(_ints(t), s) for t, s in segments], swa_evicted_seqlen,
                                              swa_dead_lo)

    def clear(self) -> None:
        self.state = ref.clear(self.state)

    def backup_state(self) -> ref.AllocatorBackup:
        return ref.backup_state(self.state)

    def restore_state(self, state: object) -> None:
        if not isinstance(state, ref.AllocatorBackup):
            raise InvalidOperation("restore_state", "state", f"a {type(state).__name__} is not a backup_state()")
        self.state = ref.restore_state(self.state, state)

    def available_size(self) -> int:
        return ref.available_size(self.state)

    def full_available_size(self) -> int:
        return ref.full_available_size(self.state)

    def swa_available_size(self) -> int:
        return ref.swa_available_size(self.state)

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return int64s(ref.translate_loc_from_full_to_swa(self.state, _ints(kv_indices)))

    def get_cpu_copy(self, indices: torch.Tensor) -> ref.KVCpuCopy:
        return ref.get_cpu_copy(self.state, _ints(indices))

    def load_cpu_copy(self, kv_cache_cpu: object, indices: torch.Tensor) -> None:
        if not isinstance(kv_cache_cpu, ref.KVCpuCopy):
            raise InvalidOperation("load_cpu_copy", "kv_cache_cpu", f"a {type(kv_cache_cpu).__name__} is not a "
                                   "get_cpu_copy()")
        self.state = ref.load_cpu_copy(self.state, kv_cache_cpu, _ints(indices))

    def get_kvcache(self) -> ReferenceKVPool:
        return self._kv

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        self.state = ref.set_full_to_swa_mapping(self.state, _ints(full_indices), _ints(swa_indices))

    # ---- loc_cache hooks: the reference translates without a cache, so nothing can be stale

    def register_mapping(self) -> None:
        self.state = ref.clear(self.state)

    def forward(self, out_cache_loc: torch.Tensor, cache_k: dict[int, torch.Tensor],
                cache_v: dict[int, torch.Tensor]) -> None:
        for layer_id in sorted(cache_k):
            self._kv.set_kv_buffer(layer_id, out_cache_loc, cache_k[layer_id], cache_v[layer_id])

    def capture(self, static_loc: torch.Tensor, static_k: dict[int, torch.Tensor],
                static_v: dict[int, torch.Tensor]) -> None:
        self._graph = (static_loc, static_k, static_v)

    def replay(self) -> None:
        if self._graph is None:
            raise InvalidOperation("replay", "graph", "nothing was captured")
        self.forward(*self._graph)

    def snapshot(self) -> AllocatorSnapshot:
        return ref.snapshot(self.state)


class ReferenceHostPool:
    """Component ``hisparse_host``: the pure reference (any coordinator) behind ``HostPoolUnderTest``."""

    capabilities = frozenset({Capability.REJECTS_MISUSE, Capability.EXACT_PAGE_ORDER, Capability.ATOMIC_BACKUP_BATCH})
    components = frozenset({Component.HISPARSE_HOST})
    device = torch.device("cpu")

    def __init__(self, config: hh.HostPoolConfig) -> None:
        self.config = config
        self.state = hh.initial_state(config)

    def available_size(self) -> int:
        return hh.available_size(self.state)

    def alloc_paged_token_slots(self, req: int, start_pos: int, num_tokens: int) -> torch.Tensor:
        self.state, slots = hh.alloc_paged_token_slots(self.state, req, start_pos, num_tokens)
        return int64s(slots)

    def allocated_host_indices(self, req: int) -> torch.Tensor:
        return int64s(hh.allocated_host_indices(self.state, req))

    def request_finished(self, req: int) -> None:
        self.state = hh.request_finished(self.state, req)

    def admit_request_into_staging(self, req: int, values: torch.Tensor) -> torch.Tensor:
        self.state, slots = hh.admit_request_into_staging(self.state, req, _ints(values))
        return int64s(slots)

    def eager_backup_previous_token(self, reqs: torch.Tensor, seq_lens: torch.Tensor,
                                    values: torch.Tensor) -> torch.Tensor:
        self.state, slots = hh.eager_backup_previous_token(self.state, _ints(reqs), _ints(seq_lens), _ints(values))
        return int64s(slots)

    def get_host_data(self, slots: torch.Tensor) -> torch.Tensor:
        return torch.tensor([-1 if v is None else v for v in hh.get_host_data(self.state, _ints(slots))],
                            dtype=torch.int64)

    def snapshot(self) -> hh.HostPoolSnapshot:
        return hh.snapshot(self.state)


class ReferenceBlockPool:
    """Component ``block_pool``: the pure reference behind ``BlockPoolUnderTest``."""

    capabilities = frozenset({Capability.REJECTS_MISUSE, Capability.EXACT_PAGE_ORDER})
    components = frozenset({Component.BLOCK_POOL})

    def __init__(self, config: bp.BlockPoolConfig) -> None:
        self.config = config
        self.state = bp.initial_state(config)

    def get_computed_blocks(self, tokens: Sequence[int], max_cache_hit_length: int | None = None) -> bp.Hit:
        return bp.get_computed_blocks(self.state, tokens, max_cache_hit_length)

    def allocate_slots(self, req: int, tokens: Sequence[int], num_computed_tokens: int, num_new_tokens: int,
                       hit: bp.Hit | None = None, full_sequence_must_fit: bool = False) -> tuple[tuple[int, ...], ...]:
        self.state, new = bp.allocate_slots(self.state, req, tokens, num_computed_tokens, num_new_tokens, hit,
                                            full_sequence_must_fit)
        return new

    def remove_skipped_blocks(self, req: int, num_computed_tokens: int) -> None:
        self.state = bp.remove_skipped_blocks(self.state, req, num_computed_tokens)

    def free(self, req: int) -> None:
        self.state = bp.free(self.state, req)

    def cache_blocks(self, req: int, tokens: Sequence[int], num_tokens: int) -> None:
        self.state = bp.cache_blocks(self.state, req, tokens, num_tokens)

    def evict_blocks(self, block_ids: Sequence[int]) -> None:
        self.state = bp.evict_blocks(self.state, block_ids)

    def reset_prefix_cache(self) -> bool:
        self.state, done = bp.reset_prefix_cache(self.state)
        return done

    def get_num_free_blocks(self) -> int:
        return bp.get_num_free_blocks(self.state)

    def snapshot(self) -> bp.BlockPoolSnapshot:
        return bp.snapshot(self.state)
