"""Legal implementations that differ from the reference in page choice: the harness must accept them.

``RelabelledReference`` is the reference with every page id renamed by a fixed
permutation (page 0 stays 0). Its behaviour is correct but every slot id differs,
so it passes only if the harness compares up to renaming -- and it must fail when it
falsely declares ``EXACT_PAGE_ORDER``.
"""

from __future__ import annotations

import torch

from kvproof.conformance.reference_impl import ReferenceAllocator
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot


def _perm(n: int) -> list[int]:
    """A fixed derangement-ish permutation of 1..n (index 0 -> 0)."""
    order = list(range(1, n + 1))
    order = order[1::2][::-1] + order[0::2]
    return [0] + order


class _Names:
    def __init__(self, pages: int, p: int) -> None:
        self.p, self.fwd = p, _perm(pages)
        self.back = [0] * len(self.fwd)
        for i, g in enumerate(self.fwd):
            self.back[g] = i

    def out(self, slot: int) -> int:
        return self.fwd[slot // self.p] * self.p + slot % self.p if 0 <= slot < len(self.fwd) * self.p else slot

    def into(self, slot: int) -> int:
        return self.back[slot // self.p] * self.p + slot % self.p if 0 <= slot < len(self.fwd) * self.p else slot


class _KV:
    def __init__(self, owner: RelabelledReference) -> None:
        self.o = owner

    def set_kv_buffer(self, layer_id, loc, cache_k, cache_v):
        self.o._inner.get_kvcache().set_kv_buffer(layer_id, self.o._into_full(loc), cache_k, cache_v)

    def get_kv_buffer(self, layer_id):
        k, v = self.o._inner.get_kvcache().get_kv_buffer(layer_id)
        names = self.o._swa if self.o.config.kv.is_swa_layer(layer_id) else self.o._full
        idx = torch.tensor([names.into(i) for i in range(k.shape[0])])
        return k[idx], v[idx]


class RelabelledReference:
    """The reference under a fixed renaming of pages in both pools."""

    device = "cpu"
    capabilities = frozenset(Capability) - {Capability.EXACT_PAGE_ORDER, Capability.REGISTER_MAPPING,
                                            Capability.FORWARD, Capability.GRAPH_CAPTURE, Capability.FREE_GROUP,
                                            Capability.FREE_SEGMENT, Capability.DECODE_BUDGETS}

    def __init__(self, config: PoolConfig) -> None:
        self.config, self._inner = config, ReferenceAllocator(config)
        self._full = _Names(config.num_pages_full, config.page_size)
        self._swa = _Names(config.num_pages_swa, config.page_size)

    def _into_full(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self._full.into(int(x)) for x in t.tolist()], dtype=torch.int64)

    def _out_full(self, t: torch.Tensor) -> torch.Tensor:
        return torch.tensor([self._full.out(int(x)) for x in t.tolist()], dtype=torch.int64)

    def alloc(self, need_size):
        return self._out_full(self._inner.alloc(need_size))

    def alloc_extend(self, pre, pre_cpu, seq, seq_cpu, last, n):
        return self._out_full(self._inner.alloc_extend(pre, pre_cpu, seq, seq_cpu, self._into_full(last), n))

    def alloc_decode(self, seq, seq_cpu, last):
        return self._out_full(self._inner.alloc_decode(seq, seq_cpu, self._into_full(last)))

    def alloc_extend_swa_tail(self, pre, pre_cpu, seq, seq_cpu, last, n, tail):
        out = self._inner.alloc_extend_swa_tail(pre, pre_cpu, seq, seq_cpu, self._into_full(last), n, tail)
        return self._out_full(out)

    def free(self, idx):
        self._inner.free(self._into_full(idx))

    def free_swa(self, idx):
        self._inner.free_swa(self._into_full(idx))

    def free_full(self, idx):
        self._inner.free_full(self._into_full(idx))

    def clear(self) -> None:
        self._inner.clear()

    def backup_state(self):
        return self._inner.backup_state()

    def restore_state(self, state) -> None:
        self._inner.restore_state(state)

    def available_size(self) -> int:
        return self._inner.available_size()

    def full_available_size(self) -> int:
        return self._inner.full_available_size()

    def swa_available_size(self) -> int:
        return self._inner.swa_available_size()

    def translate_loc_from_full_to_swa(self, idx):
        out = self._inner.translate_loc_from_full_to_swa(self._into_full(idx))
        return torch.tensor([self._swa.out(int(x)) if x > 0 else int(x) for x in out.tolist()], dtype=torch.int64)

    def set_full_to_swa_mapping(self, full, swa) -> None:
        swa_in = torch.tensor([self._swa.into(int(x)) if x > 0 else int(x) for x in swa.tolist()], dtype=torch.int64)
        self._inner.set_full_to_swa_mapping(self._into_full(full), swa_in)

    def get_cpu_copy(self, idx):
        return self._inner.get_cpu_copy(self._into_full(idx))

    def load_cpu_copy(self, copy, idx) -> None:
        self._inner.load_cpu_copy(copy, self._into_full(idx))

    def get_kvcache(self) -> _KV:
        return _KV(self)

    def snapshot(self) -> AllocatorSnapshot:
        s = self._inner.snapshot()
        m = list(s.full_to_swa_index_mapping)
        out = [0] * len(m)
        for f, v in enumerate(m[:-1]):
            out[self._full.out(f)] = self._swa.out(v) if v > 0 else v
        out[-1] = m[-1]
        return AllocatorSnapshot(
            full=PoolSnapshot(page_size=s.full.page_size, num_pages=s.full.num_pages,
                              free_pages=tuple(self._full.fwd[g] for g in s.full.free_pages)),
            swa=PoolSnapshot(page_size=s.swa.page_size, num_pages=s.swa.num_pages,
                             free_pages=tuple(self._swa.fwd[g] for g in s.swa.free_pages)),
            full_to_swa_index_mapping=tuple(out))


class RelabelledClaimingExactOrder(RelabelledReference):
    """The same, but it (falsely) declares EXACT_PAGE_ORDER: the harness must reject it."""

    capabilities = RelabelledReference.capabilities | {Capability.EXACT_PAGE_ORDER}
