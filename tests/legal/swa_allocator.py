"""A legal SWA composite allocator written from the contract, not from kvproof's runtime.

Written from ``kvproof.reference.contract`` (``SWAAllocatorUnderTest``, ``KVPoolUnderTest``),
docs/contract.md and sglang_semantics.md, to check that kvproof's suites accept every
*correct* allocator, whatever order it reuses pages in (issue 11, observation 1):

* two paged pools, page 0 reserved in each (sglang_semantics.md §1.3, §1.4);
* the full->SWA mapping ``M`` with its trailing ``-1`` sentinel (§1.5);
* 1:1 allocations (``alloc``, ``alloc_extend``, ``alloc_decode``, §1.3, §1.5), atomic on
  failure; the SWA tail allocation (§2.7, post-#25805: non-tail slots map to 0, also for
  a tail of 0);
* ``free`` = ``free_swa`` then the full pages; ``free_swa`` releases the SWA pages of the
  live slots of every full page it touches and zeroes ``M`` on those whole pages (§1.5,
  §1.6 window eviction); ``free_full`` releases full pages whose SWA side is gone;
* ``backup_state``/``restore_state`` restore the free lists only, never ``M`` (§1.5, §2.11 R3);
* KV rows per layer (SWA layers indexed by SWA slot), CPU copies with ``swa_mask`` (§2.8);
* ring configs (``PoolConfig.swa_ring_size``, 0.5.23's per-request SWA ring): allocations take full pages only and
  never map, ``free_swa`` releases nothing, ``available_size`` is the full pool's, ``swa_available_size`` free request
  slots x ``ceil(ring / P) * P``; request slots are handed out from the front of their own free list (any order is
  legal: the harness pairs them).

Page reuse is the policy parameter: :func:`fifo` (freed pages go to the back of the free
list, like SGLang's token allocator, §1.2), :func:`lifo` (freed pages are reused first, like
its paged allocator, §1.3) and :func:`randomized` (each freed page is inserted at a seeded
random place: deterministic per instance). The free lists are always reported in hand-out
order. None of them declares ``EXACT_PAGE_ORDER``, nor ``REJECTS_MISUSE`` (misuse is not
checked: a caller's mistake has undefined behaviour here, as in SGLang).
"""

from __future__ import annotations

import enum
import random
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.registry import Component
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot

__all__ = [
    "SMALL",
    "LegalKVPool",
    "LegalSWAAllocator",
    "Policy",
    "config_seed",
    "fifo",
    "fifo_small",
    "lifo",
    "lifo_small",
    "randomized",
    "randomized_small",
]

C = Capability
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class Policy(enum.StrEnum):
    """Where a freed page goes in the free list (pages are always handed out from the front)."""

    FIFO = "fifo"
    LIFO = "lifo"
    RANDOMIZED = "randomized"


class _Pool:
    """One paged pool's free list of page ids ``1..num_pages`` (page 0 reserved, §1.4)."""

    def __init__(self, num_pages: int, policy: Policy, rng: random.Random) -> None:
        self.num_pages, self.policy, self.rng = num_pages, policy, rng
        self.free: list[int] = list(range(1, num_pages + 1))

    def take(self, k: int) -> list[int]:
        pages, self.free = self.free[:k], self.free[k:]
        return pages

    def release(self, pages: Sequence[int]) -> None:
        if self.policy is Policy.FIFO:
            self.free.extend(pages)
        elif self.policy is Policy.LIFO:
            self.free[:0] = pages
        else:
            for page in pages:
                self.free.insert(self.rng.randrange(len(self.free) + 1), page)


@dataclass
class _CpuCopy:
    """What :meth:`LegalSWAAllocator.get_cpu_copy` returns: rows per layer id, the SWA mask per position."""

    full: dict[int, tuple[torch.Tensor, torch.Tensor]]
    swa: dict[int, tuple[torch.Tensor, torch.Tensor]] | None  # rows of the mapped positions only
    swa_mask: list[bool]


class LegalKVPool:
    """``SWAKVPool``'s KV surface: one K and one V buffer per layer, ``size + P`` rows (§2.8)."""

    def __init__(self, owner: LegalSWAAllocator) -> None:
        cfg, geo = owner.config, owner.config.kv
        self._owner = owner
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for layer in range(geo.num_layers):
            rows = (cfg.size_swa if geo.is_swa_layer(layer) else cfg.size_full) + cfg.page_size
            shape = (rows, geo.head_num, geo.head_dim)
            self.k[layer] = torch.zeros(shape, dtype=_DTYPES[geo.dtype])
            self.v[layer] = torch.zeros(shape, dtype=_DTYPES[geo.dtype])

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Rows for full slots ``loc``; an SWA layer writes at ``M[loc]`` (slot 0: the padding row)."""
        if layer_id not in self.k:
            raise InvalidOperation("set_kv_buffer", "layer_id", f"no layer {layer_id}")
        dest = [int(x) for x in loc.reshape(-1).tolist()]
        if self._owner.config.kv.is_swa_layer(layer_id):
            dest = [self._owner.mapping[f] for f in dest]
        idx = torch.tensor(dest, dtype=torch.int64)
        self.k[layer_id][idx] = cache_k.to(self.k[layer_id].dtype)
        self.v[layer_id][idx] = cache_v.to(self.v[layer_id].dtype)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer_id], self.v[layer_id]


class LegalSWAAllocator:
    """The SWA composite allocator with a page-reuse policy (see the module docstring)."""

    capabilities = frozenset({C.ALLOC, C.ALLOC_EXTEND, C.ALLOC_DECODE, C.ALLOC_EXTEND_SWA_TAIL, C.FREE_FULL,
                              C.FREE_RELEASED_SWA, C.BACKUP_RESTORE, C.CPU_COPY, C.KV_BUFFER,
                              C.SET_FULL_TO_SWA_MAPPING})
    components = frozenset({Component.SWA_ALLOCATOR, Component.DECODE_PREALLOC})
    device = "cpu"

    def __init__(self, config: PoolConfig, policy: Policy = Policy.FIFO, seed: int = 0) -> None:
        self.config, self.policy, self.p = config, policy, config.page_size
        self.version = f"legal-{policy.value}"
        self._seed = seed
        self._kv = LegalKVPool(self)
        self.ring = config.swa_ring_size is not None
        self.req_free: list[int] = list(range(1, (config.num_req_slots or 0) + 1))  # kept by clear()
        self.clear()

    # ------------------------------------------------------------ state

    def clear(self) -> None:
        """Both pools all free in ascending order, ``M`` all 0 but the sentinel (§1.5)."""
        cfg = self.config
        rng = random.Random(self._seed)
        self.full = _Pool(cfg.num_pages_full, self.policy, rng)
        self.swa = _Pool(cfg.num_pages_swa, self.policy, rng)
        self.mapping: list[int] = [0] * (cfg.size_full + self.p) + [-1]
        # live (handed-out) slots per full page: always offsets 0..fill-1 (§1.3: extends fill pages in order)
        self.fill: list[int] = [0] * (cfg.num_pages_full + 1)

    def snapshot(self) -> AllocatorSnapshot:
        """Free lists in hand-out order; ``num_pages`` counts usable pages (page 0 excluded)."""
        def pool(pool: _Pool) -> PoolSnapshot:
            return PoolSnapshot(page_size=self.p, num_pages=pool.num_pages, free_pages=tuple(pool.free))

        return AllocatorSnapshot(full=pool(self.full), swa=pool(self.swa),
                                 full_to_swa_index_mapping=tuple(self.mapping))

    def available_size(self) -> int:
        if self.ring:  # the ring never limits token growth
            return self.full_available_size()
        return min(self.full_available_size(), self.swa_available_size())

    def full_available_size(self) -> int:
        return len(self.full.free) * self.p

    def swa_available_size(self) -> int:
        if self.ring:
            ring = self.config.swa_ring_size or 0
            return len(self.req_free) * (-(-ring // self.p) * self.p)
        return len(self.swa.free) * self.p

    def alloc_req_slots(self, need_size: int) -> list[int]:
        if need_size > len(self.req_free):
            raise OutOfMemory("alloc_req_slots", "req_slots", need_size, len(self.req_free))
        taken, self.req_free = self.req_free[:need_size], self.req_free[need_size:]
        return taken

    def free_req_slots(self, indices: list[int]) -> None:
        self.req_free.extend(indices)

    def get_kvcache(self) -> LegalKVPool:
        return self._kv

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """``M[loc]``; ``-1`` reads the sentinel and stays ``-1`` (§1.5)."""
        return _tensor([self.mapping[int(f)] for f in kv_indices.reshape(-1).tolist()])

    # ------------------------------------------------------------ allocation (§1.3, §1.5, §2.7)

    def _need(self, op: str, full_pages: int, swa_pages: int) -> None:
        swa_pages = 0 if self.ring else swa_pages  # a ring takes no SWA page
        if full_pages > len(self.full.free):
            raise OutOfMemory(op, "full", full_pages, len(self.full.free))
        if swa_pages > len(self.swa.free):
            raise OutOfMemory(op, "swa", swa_pages, len(self.swa.free))

    def _slots(self, prefix: int, seq: int, last: int, pages: Sequence[int]) -> list[int]:
        """One request's extend ``prefix -> seq``: the rest of ``last``'s page, then ``pages`` in order (§1.3)."""
        p = self.p
        n1 = min(seq, -(-prefix // p) * p) - prefix
        slots = [last + 1 + i for i in range(n1)]
        for page in pages:
            slots.extend(page * p + o for o in range(p))
        return slots[:seq - prefix]

    def _hand_out(self, full_slots: Sequence[int], swa_slots: Sequence[int] | None) -> None:
        """Mark ``full_slots`` live and map them 1:1 onto ``swa_slots`` (``None``: no SWA slot, M = 0)."""
        for i, f in enumerate(full_slots):
            self.fill[f // self.p] = max(self.fill[f // self.p], f % self.p + 1)
            self.mapping[f] = 0 if swa_slots is None else swa_slots[i]

    def alloc(self, need_size: int) -> torch.Tensor:
        """``need_size`` tokens in whole pages, 1:1 in both pools (§1.5; a multiple of P here)."""
        k = need_size // self.p
        self._need("alloc", k, k)
        full = self._slots(0, need_size, -1, self.full.take(k))
        swa = None if self.ring else self._slots(0, need_size, -1, self.swa.take(k))
        self._hand_out(full, swa)
        return _tensor(full)

    def _extend(self, op: str, prefix_lens: Sequence[int], seq_lens: Sequence[int], last_loc: Sequence[int]
                ) -> torch.Tensor:
        p = self.p
        counts = [-(-s // p) - -(-pre // p) for pre, s in zip(prefix_lens, seq_lens, strict=True)]
        self._need(op, sum(counts), sum(counts))  # before any change: a failed call changes nothing
        out: list[int] = []
        for pre, s, last, k in zip(prefix_lens, seq_lens, last_loc, counts, strict=True):
            full = self._slots(pre, s, last, self.full.take(k))
            swa_last = self.mapping[last] if pre % p else -1  # the SWA side continues M[last_loc] (M5)
            swa = None if self.ring else self._slots(pre, s, swa_last, self.swa.take(k))
            self._hand_out(full, swa)
            out += full
        return _tensor(out)

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor:
        return self._extend("alloc_extend", _ints(prefix_lens_cpu), _ints(seq_lens_cpu), _ints(last_loc))

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor) -> torch.Tensor:
        """One token per request at position ``s - 1``; atomic (unlike SGLang 0.5.23, §2.11 R7)."""
        seqs = _ints(seq_lens_cpu)
        return self._extend("alloc_decode", [s - 1 for s in seqs], seqs, _ints(last_loc))

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                              seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> torch.Tensor:
        """Full slots for the whole extend, fresh SWA pages for the last ``swa_tail_len`` tokens (§2.7)."""
        (pre,), (s,), (last,), p = _ints(prefix_lens_cpu), _ints(seq_lens_cpu), _ints(last_loc), self.p
        kf, ks = -(-s // p) - -(-pre // p), -(-swa_tail_len // p)
        self._need("alloc_extend_swa_tail", kf, ks)
        full = self._slots(pre, s, last, self.full.take(kf))
        if self.ring:  # full KV only
            self._hand_out(full, None)
            return _tensor(full)
        swa = self._slots(0, swa_tail_len, -1, self.swa.take(ks))
        head = len(full) - swa_tail_len
        self._hand_out(full[:head], None)  # post-#25805: no stale mapping on the non-tail slots
        self._hand_out(full[head:], swa)
        return _tensor(full)

    # ------------------------------------------------------------ release (§1.5, §1.6)

    def _touched(self, free_index: torch.Tensor) -> list[int]:
        return sorted({f // self.p for f in _ints(free_index)})

    def free_swa(self, free_index: torch.Tensor) -> None:
        """SWA pages of the live slots of every touched full page back; ``M`` of those pages zeroed."""
        p, released = self.p, []
        if self.ring:  # the ring owns no paged SWA peer
            return
        for g in self._touched(free_index):
            for f in range(g * p, g * p + self.fill[g]):
                s = self.mapping[f]
                if s > 0 and s // p not in released:
                    released.append(s // p)
            self.mapping[g * p:(g + 1) * p] = [0] * p
        self.swa.release(released)

    def free_full(self, free_index: torch.Tensor) -> None:
        """Full pages touched by ``free_index`` back (their SWA side is already released)."""
        pages = self._touched(free_index)
        for g in pages:
            self.fill[g] = 0
        self.full.release(pages)

    def free(self, free_index: torch.Tensor) -> None:
        """The SWA side, then the full pages (0.5.23 order); slots already without SWA slot are skipped."""
        if free_index.numel() == 0:
            return
        self.free_swa(free_index)
        self.free_full(free_index)

    def backup_state(self) -> tuple[list[int], list[int], list[int]]:
        """Both free lists (and which slots are live); never ``M`` (§2.11 R3)."""
        return list(self.full.free), list(self.swa.free), list(self.fill)

    def restore_state(self, state: object) -> None:
        if not (isinstance(state, tuple) and len(state) == 3):
            raise InvalidOperation("restore_state", "state", "not a backup_state() of this allocator")
        full, swa, fill = state
        self.full.free, self.swa.free, self.fill = list(full), list(swa), list(fill)

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        """``M[full] = swa`` (HiCache load-back, §1.5)."""
        for f, s in zip(_ints(full_indices), _ints(swa_indices), strict=True):
            self.mapping[f] = s

    # ------------------------------------------------------------ CPU copies (§2.8)

    def get_cpu_copy(self, indices: torch.Tensor) -> _CpuCopy:
        """Full rows of every position; SWA rows of the positions with an SWA slot, and that mask."""
        geo, slots = self.config.kv, _ints(indices)
        swa_slots = [self.mapping[f] for f in slots]
        mask = [s > 0 for s in swa_slots]
        idx = torch.tensor(slots, dtype=torch.int64)
        full = {layer: (self._kv.k[layer][idx].clone(), self._kv.v[layer][idx].clone())
                for layer in geo.full_attention_layer_ids}
        mapped = torch.tensor([s for s in swa_slots if s > 0], dtype=torch.int64)
        swa = {layer: (self._kv.k[layer][mapped].clone(), self._kv.v[layer][mapped].clone())
               for layer in geo.swa_attention_layer_ids} if any(mask) else None
        return _CpuCopy(full, swa, mask)

    def load_cpu_copy(self, kv_cache_cpu: object, indices: torch.Tensor) -> None:
        """Full rows into the new slots; a saved SWA row only where the position is mapped now too."""
        if not isinstance(kv_cache_cpu, _CpuCopy):
            raise InvalidOperation("load_cpu_copy", "kv_cache_cpu", "not a get_cpu_copy() of this allocator")
        slots = _ints(indices)
        idx = torch.tensor(slots, dtype=torch.int64)
        for layer, (k, v) in kv_cache_cpu.full.items():
            self._kv.k[layer][idx], self._kv.v[layer][idx] = k, v
        if kv_cache_cpu.swa is None:
            return
        old = [j for j, m in enumerate(kv_cache_cpu.swa_mask) if m]  # positions of the saved rows
        keep = [i for i, j in enumerate(old) if self.mapping[slots[j]] > 0]
        dest = torch.tensor([self.mapping[slots[old[i]]] for i in keep], dtype=torch.int64)
        rows = torch.tensor(keep, dtype=torch.int64)
        for layer, (k, v) in kv_cache_cpu.swa.items():
            self._kv.k[layer][dest], self._kv.v[layer][dest] = k[rows], v[rows]


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def _tensor(values: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64)


def config_seed(config: Any) -> int:
    """The seed of :func:`randomized` for ``config``: the same config, the same reuse order."""
    return zlib.crc32(config.label().encode())


def fifo(config: PoolConfig) -> LegalSWAAllocator:
    """Freed pages go to the back of the free list (reused last)."""
    return LegalSWAAllocator(config, Policy.FIFO)


def lifo(config: PoolConfig) -> LegalSWAAllocator:
    """Freed pages go to the front of the free list (reused first)."""
    return LegalSWAAllocator(config, Policy.LIFO)


def randomized(config: PoolConfig) -> LegalSWAAllocator:
    """Each freed page goes to a random place in the free list (seeded by the config: same run, same order)."""
    return LegalSWAAllocator(config, Policy.RANDOMIZED, seed=config_seed(config))


#: The surface of a small allocator without drafts, CPU copies or ``free_full`` (the issue's newcomer's):
#: with it, the ``ci`` run of P4-W6-F48-S24 reaches the remap of observation 1 (tests/legal/vectors/).
SMALL = frozenset({C.ALLOC, C.ALLOC_EXTEND, C.ALLOC_DECODE, C.ALLOC_EXTEND_SWA_TAIL, C.FREE_RELEASED_SWA,
                   C.KV_BUFFER, C.SET_FULL_TO_SWA_MAPPING})


def _small(allocator: LegalSWAAllocator) -> LegalSWAAllocator:
    allocator.capabilities = SMALL
    allocator.components = frozenset({Component.SWA_ALLOCATOR})
    return allocator


def fifo_small(config: PoolConfig) -> LegalSWAAllocator:
    """:func:`fifo` declaring only :data:`SMALL`."""
    return _small(fifo(config))


def lifo_small(config: PoolConfig) -> LegalSWAAllocator:
    """:func:`lifo` declaring only :data:`SMALL`."""
    return _small(lifo(config))


def randomized_small(config: PoolConfig) -> LegalSWAAllocator:
    """:func:`randomized` declaring only :data:`SMALL`."""
    return _small(randomized(config))
