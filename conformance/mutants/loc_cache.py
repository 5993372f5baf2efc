"""Deliberately broken loc caches of the torch runtime, for mutation testing (sglang_semantics.md §3.3-§3.6, §9).

Each mutant is a subclass of the correct ``SWATokenToKVPoolAllocator`` that drops one
invalidation point of PR #25824 / #26152, keys the cache by the storage's base address
(S5), or shares one cache between pools. Its docstring names the upstream point or bug
and the witness it breaks. A *witness* (:data:`WITNESSES`, same names) is the matching
trace of ``tests/reference/test_loc_cache.py`` replayed on an allocator, with index
tensors at addresses it controls (:class:`IndexArena`): every trace keeps contract E1
(``kvproof.reference.loc_cache``), so the correct runtime reads nothing stale on it,
and the mutant does. A witness returns :data:`Observation` s ``(what, got, want)``:
``want`` is computed from the live mapping (``M[contents]``) or from the rows written;
``got != want`` is a stale read (or its effect: a wrong SWA continuation, KV at the
wrong slot).

:data:`MUTANTS` maps a name to a factory ``PoolConfig -> allocator`` (the class itself).
They only change the loc cache, never what ``kvproof.conformance.mutants.swa_allocator``'s
lockstep checks see on fresh index tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from kvproof.gpu_runtime.loc_cache import GraphRunner
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.gpu_runtime.swa_kv_pool import SWAKVPool
from kvproof.reference.config import PoolConfig
from kvproof.reference.loc_cache import UPSTREAM_POINTS, InvalidationPoint, KeyScheme

__all__ = ["MUTANTS", "WITNESSES", "IndexArena", "Observation", "Witness", "stale"]

Tensor = torch.Tensor
P = InvalidationPoint
Factory = Callable[[PoolConfig], SWATokenToKVPoolAllocator]
#: ``(what, got, want)``: one value the run used, next to the fresh value it should have been.
Observation = tuple[str, Any, Any]


# ---------------------------------------------------------------- one point dropped (§3.3)


class NoInvalidateAlloc(SWATokenToKVPoolAllocator):
    """``alloc`` keeps the loc cache (point ``alloc``: one of #25824's seven allocator mutators).

    Witness ``alloc``: translate [2] while slot 2 is free (0), ``alloc(2)`` maps slot 2 -> 2,
    translate the same tensor again: the cache answers 0.
    """

    invalidate_at = UPSTREAM_POINTS - {P.ALLOC}


class NoInvalidateAllocExtend(SWATokenToKVPoolAllocator):
    """``alloc_extend`` translates ``last_loc`` without invalidating first (point ``alloc_extend``, C4).

    Witness ``alloc_extend``: a forward caches out_cache_loc [2] at address B; the next
    batch's ``last_loc`` [4] sits at B (address reuse): the SWA side continues from the
    stale 2 (SWA slot 3, request 1's page) instead of M[4] = 4 (M2, M5).
    """

    invalidate_at = UPSTREAM_POINTS - {P.ALLOC_EXTEND}


class NoInvalidateAllocDecode(SWATokenToKVPoolAllocator):
    """``alloc_decode`` translates ``last_loc`` without invalidating first (point ``alloc_decode``, C4).

    Witness ``alloc_decode``: as ``alloc_extend``, with a decode step of request 2.
    """

    invalidate_at = UPSTREAM_POINTS - {P.ALLOC_DECODE}


class NoInvalidateAllocExtendSwaTail(SWATokenToKVPoolAllocator):
    """``alloc_extend_swa_tail`` keeps the loc cache (point ``alloc_extend_swa_tail``).

    Witness ``alloc_extend_swa_tail``: translate [2] (free: 0), tail allocation 0 -> 2 with
    tail 2 maps slot 2 -> 2, translate again: the cache answers 0.
    """

    invalidate_at = UPSTREAM_POINTS - {P.ALLOC_EXTEND_SWA_TAIL}


class NoInvalidateFreeSwa(SWATokenToKVPoolAllocator):
    """``free_swa`` (and ``free``) keep the loc cache (point ``free_swa``).

    Witness ``free_swa``: slots 2..5 -> SWA 2..5, translate [2] (2), ``free_swa([2, 3])``
    zeroes M[2]: the cache still answers 2, an SWA slot that is free now (M3).
    """

    invalidate_at = UPSTREAM_POINTS - {P.FREE_SWA}


class NoInvalidateSetFullToSwaMapping(SWATokenToKVPoolAllocator):
    """``set_full_to_swa_mapping`` keeps the loc cache (point ``set_full_to_swa_mapping``, HiCache load-back).

    Witness ``set_full_to_swa_mapping``: translate [2] (2), swap the request's two SWA
    pages (M[2] = 4): the cache still answers 2.
    """

    invalidate_at = UPSTREAM_POINTS - {P.SET_FULL_TO_SWA_MAPPING}


class NoInvalidateClear(SWATokenToKVPoolAllocator):
    """``clear`` keeps the loc cache (point ``clear``).

    Witness ``clear``: translate [2] (2), ``clear()``: the cache still answers 2 for a free slot.
    """

    invalidate_at = UPSTREAM_POINTS - {P.CLEAR}


class NoInvalidateRegisterMapping(SWATokenToKVPoolAllocator):
    """The pool's ``register_mapping`` keeps its cache (point ``register_mapping``; #25889 fixed it for DSV4).

    Witness ``register_mapping``: translate [2] (2), a fresh mapping is registered (all 0):
    the cache still answers 2, a translation of the old mapping tensor.
    """

    invalidate_at = UPSTREAM_POINTS - {P.REGISTER_MAPPING}


class NoInvalidateForward(SWATokenToKVPoolAllocator):
    """No per-forward invalidation at all (point ``forward``, ``_forward_raw``).

    Witness ``forward``: a forward caches out_cache_loc [2] at address B; the next batch's
    out_cache_loc [4] sits at B: its SWA rows land in request 1's SWA slot 2, request 2's
    slot 4 gets nothing (§3.5's corruption, back).
    """

    invalidate_at = UPSTREAM_POINTS - {P.FORWARD}


class NoInvalidateRunOnce(SWATokenToKVPoolAllocator):
    """The graph runner's ``run_once`` does not invalidate (point ``run_once``; S6, R2-e).

    Warm-up 1 fills the cache, the capture run hits it and records no gather, so every
    replay writes SWA rows at the warm-up's translation of the padding buffer.
    Witness ``run_once``: capture on [0], allocate slot 2, static buffer <- [2], replay:
    the SWA rows land on padding slot 0, slot 2 gets nothing.
    """

    invalidate_at = UPSTREAM_POINTS - {P.RUN_ONCE}


# ---------------------------------------------------------------- other designs


class _EagerOnlyGraphRunner(GraphRunner):
    def _replay_invalidation(self) -> None:
        pass  # #25824: _forward_raw invalidated after the can_run_graph early return


class ForwardPointEagerOnly(SWATokenToKVPoolAllocator):
    """#25824 as merged: the per-forward invalidation sits after the graph branch, so replays skip it (#26152).

    Witness ``forward_point_eager_only``: a forward caches out_cache_loc [2] at B; batch
    preparation fills the static buffer with [4] and allocates a new out_cache_loc [4]
    at B; after the replay the scheduler translates it (quiet phase): the cache answers
    2 (R2-a; the warning of #26152 fired on every graph forward).
    """

    graph_runner_class = _EagerOnlyGraphRunner


class _StorageBasePool(SWAKVPool):
    key_scheme = KeyScheme.STORAGE_BASE


class StorageBaseKey(SWATokenToKVPoolAllocator):
    """The cache key is ``(x.untyped_storage().data_ptr(), numel)`` (an intermediate revision of #25824: S5, R2-b).

    Equal-length views of one storage collide. Witness ``storage_base_key`` (S5):
    x = [5..10], translate x[0:3], then x[3:6]: the second returns M[[5, 6, 7]].
    """

    kv_pool_class = _StorageBasePool


class _SharedCachePool(SWAKVPool):
    """One ``(_cached_loc_key, _cached_swa_loc)`` for every instance: class-level, not per pool."""

    _shared: ClassVar[list[Any]] = [None, None]

    @property
    def _cached_loc_key(self) -> tuple[int, int] | None:
        return _SharedCachePool._shared[0]

    @_cached_loc_key.setter
    def _cached_loc_key(self, key: tuple[int, int] | None) -> None:
        _SharedCachePool._shared[0] = key

    @property
    def _cached_swa_loc(self) -> Tensor | None:
        return _SharedCachePool._shared[1]

    @_cached_swa_loc.setter
    def _cached_swa_loc(self, value: Tensor | None) -> None:
        _SharedCachePool._shared[1] = value


class CacheSharedAcrossPools(SWATokenToKVPoolAllocator):
    """One loc cache for every SWA pool of the process (e.g. target and draft model), not one per pool.

    Upstream keeps the fields on each ``SWAKVPool`` (§3.2; the DSV4 pool has its own, #25889);
    here they are class-level, so a translation through one pool's mapping is served to another. Witness
    ``cache_shared_across_pools``: pool A maps slots 1..4, translate [1, 2] through A
    (1, 2), then through an idle pool B: B answers A's 1, 2 instead of its own 0, 0.
    """

    kv_pool_class = _SharedCachePool


MUTANTS: dict[str, Factory] = {
    "no_invalidate_alloc": NoInvalidateAlloc,
    "no_invalidate_alloc_extend": NoInvalidateAllocExtend,
    "no_invalidate_alloc_extend_swa_tail": NoInvalidateAllocExtendSwaTail,
    "no_invalidate_alloc_decode": NoInvalidateAllocDecode,
    "no_invalidate_free_swa": NoInvalidateFreeSwa,
    "no_invalidate_set_full_to_swa_mapping": NoInvalidateSetFullToSwaMapping,
    "no_invalidate_clear": NoInvalidateClear,
    "no_invalidate_register_mapping": NoInvalidateRegisterMapping,
    "no_invalidate_forward": NoInvalidateForward,
    "no_invalidate_run_once": NoInvalidateRunOnce,
    "forward_point_eager_only": ForwardPointEagerOnly,
    "storage_base_key": StorageBaseKey,
    "cache_shared_across_pools": CacheSharedAcrossPools,
}


# ---------------------------------------------------------------- index memory with chosen addresses


class IndexArena:
    """Index tensors at byte offsets the caller picks, so that address reuse is reproducible (R2-a).

    On the CPU every :meth:`storage` is a storage of its own (``torch.frombuffer`` over one
    ``bytearray``): a new storage may take a "freed" one's address, as the CUDA caching
    allocator hands a freed block to the next tensor of that size. On CUDA each is a view
    of one arena tensor: the same addresses, hence the same ``data_ptr`` keys.
    """

    def __init__(self, device: torch.device, nbytes: int = 1 << 14) -> None:
        self.device = device
        self._bytes = bytearray(nbytes)
        self._arena = None if device.type == "cpu" else torch.zeros(nbytes // 8, dtype=torch.int64, device=device)

    def storage(self, offset: int, values: Sequence[int]) -> Tensor:
        """``len(values)`` int64 elements at byte ``offset`` of the arena, holding ``values``."""
        n = len(values)
        if self._arena is None:
            x = torch.frombuffer(memoryview(self._bytes)[offset:offset + 8 * n], dtype=torch.int64)
        else:
            x = self._arena[offset // 8:offset // 8 + n]
        x.copy_(torch.tensor(list(values), dtype=torch.int64))
        return x


# ---------------------------------------------------------------- the witnesses (tests/reference/test_loc_cache.py)

CFG = PoolConfig(size_full=16, size_swa=8, page_size=2, sliding_window_size=2)  # layer 0 SWA, layer 1 full
CFG1 = PoolConfig(size_full=16, size_swa=16, page_size=1, sliding_window_size=2)
B, L0, S = 1024, 2048, 3072  # byte offsets: out_cache_loc / last_loc, the no-prefix last_loc, a static buffer


def _t(values: Sequence[int], device: torch.device) -> Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def _rows(a: SWATokenToKVPoolAllocator, first: float) -> Tensor:
    """One K (or V) row for one token, in the pool's geometry and dtype."""
    kv = a.get_kvcache()
    return (torch.arange(kv.head_num * kv.head_dim, dtype=kv.dtype) + first).reshape(1, kv.head_num, kv.head_dim)


def _extend(a: SWATokenToKVPoolAllocator, pre: int, seq: int, last: Tensor) -> Tensor:
    d, cpu = a.device, torch.device("cpu")
    return a.alloc_extend(_t([pre], d), _t([pre], cpu), _t([seq], d), _t([seq], cpu), last, seq - pre)


def _translated(what: str, a: SWATokenToKVPoolAllocator, x: Tensor) -> Observation:
    got = a.translate_loc_from_full_to_swa(x).tolist()
    return (what, got, a.full_to_swa_index_mapping[x].tolist())


def _continued(what: str, a: SWATokenToKVPoolAllocator, last: int, new: Tensor) -> Observation:
    """The SWA slot of the token after ``last``: must continue ``M[last]``'s page (M5)."""
    m = a.full_to_swa_index_mapping
    return (what, m[new].tolist(), [int(m[last]) + 1])


def _swa_row(what: str, a: SWATokenToKVPoolAllocator, full_slot: int, k: Tensor, v: Tensor) -> Observation:
    """Layer 0's K / V rows at the SWA slot of ``full_slot`` (``M[full_slot]``), next to the rows written."""
    kbuf, vbuf = a.get_kvcache().get_kv_buffer(0)
    s = int(a.full_to_swa_index_mapping[full_slot])
    return (what, (kbuf[s].cpu().flatten().tolist(), vbuf[s].cpu().flatten().tolist()),
            (k.cpu().flatten().tolist(), v.cpu().flatten().tolist()))


def _forward(a: SWATokenToKVPoolAllocator, loc: Tensor, first: float) -> tuple[Tensor, Tensor]:
    k, v = _rows(a, first), _rows(a, first + 10)
    a.forward(loc, {0: k.to(a.device)}, {0: v.to(a.device)})
    return k, v


def w_alloc(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    v = mem.storage(B, [2])
    seen = [_translated("translate [2], slot 2 free", a, v)]
    a.alloc(2)  # hands out page 1: M[2] = 2
    return seen + [_translated("translate [2] after alloc", a, v)]


def _two_requests(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    l0 = mem.storage(L0, [-1])
    _extend(a, 0, 1, l0)  # request 1 at slot 2 (SWA 2)
    _extend(a, 0, 1, l0)  # request 2 at slot 4 (SWA 4)
    f = mem.storage(B, [2])
    k, v = _forward(a, f, 1.0)  # caches key(f) -> [2]
    return [_swa_row("forward of request 1", a, 2, k, v)]


def w_alloc_extend(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    seen = _two_requests(a, mem)
    last = mem.storage(B, [4])  # out_cache_loc freed; its address reused for request 2's last_loc
    new = _extend(a, 1, 2, last)
    return seen + [_continued("alloc_extend continues request 2", a, 4, new)]


def w_alloc_decode(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    seen = _two_requests(a, mem)
    last = mem.storage(B, [4])
    new = a.alloc_decode(_t([2], a.device), _t([2], torch.device("cpu")), last)
    return seen + [_continued("alloc_decode continues request 2", a, 4, new)]


def w_tail(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    v = mem.storage(B, [2])
    seen = [_translated("translate [2], slot 2 free", a, v)]
    d, cpu = a.device, torch.device("cpu")
    a.alloc_extend_swa_tail(_t([0], d), _t([0], cpu), _t([2], d), _t([2], cpu), _t([-1], d), 2, 2)
    return seen + [_translated("translate [2] after the tail allocation", a, v)]


def _mapped(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> tuple[Tensor, Tensor, list[Observation]]:
    slots = _extend(a, 0, 4, mem.storage(L0, [-1]))  # slots 2..5 -> SWA 2..5
    v = mem.storage(B, [2])
    return v, slots, [_translated("translate [2]", a, v)]


def w_free_swa(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    v, slots, seen = _mapped(a, mem)
    a.free_swa(slots[:2])
    return seen + [_translated("translate [2] after free_swa", a, v)]


def w_set_mapping(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    v, slots, seen = _mapped(a, mem)
    a.set_full_to_swa_mapping(slots, _t([4, 5, 2, 3], a.device))  # swap the request's two SWA pages
    return seen + [_translated("translate [2] after set_full_to_swa_mapping", a, v)]


def w_clear(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    v, _, seen = _mapped(a, mem)
    a.clear()
    return seen + [_translated("translate [2] after clear", a, v)]


def w_register(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    v, _, seen = _mapped(a, mem)
    a.register_mapping()
    return seen + [_translated("translate [2] after register_mapping", a, v)]


def w_forward(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    seen = _two_requests(a, mem)
    f2 = mem.storage(B, [4])  # the next batch's out_cache_loc at the same address
    k, v = _forward(a, f2, 21.0)
    return seen + [_swa_row("forward of request 2", a, 4, k, v), _swa_row("request 1 untouched", a, 2, *_rows2(a))]


def _rows2(a: SWATokenToKVPoolAllocator) -> tuple[Tensor, Tensor]:
    return _rows(a, 1.0), _rows(a, 11.0)  # what the first forward wrote


def w_run_once(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    static = mem.storage(B, [0])  # padding while capturing
    k, v = torch.zeros_like(_rows(a, 0.0)).to(a.device), torch.zeros_like(_rows(a, 0.0)).to(a.device)
    a.capture(static, {0: k}, {0: v})
    _extend(a, 0, 1, mem.storage(L0, [-1]))  # slot 2
    static.copy_(_t([2], a.device))  # batch preparation fills the static buffers
    k.copy_(_rows(a, 31.0))
    v.copy_(_rows(a, 41.0))
    a.replay()
    return [_swa_row("replay writes slot 2", a, 2, k, v)]


def w_eager_only(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    static = mem.storage(S, [0])
    zeros = torch.zeros_like(_rows(a, 0.0)).to(a.device)
    a.capture(static, {0: zeros}, {0: zeros.clone()})
    seen = _two_requests(a, mem)
    static.copy_(_t([4], a.device))  # batch preparation: static buffer <- request 2's slot,
    f2 = mem.storage(B, [4])  # and the scheduler's new out_cache_loc at the freed address
    a.replay()
    return seen + [_translated("translate out_cache_loc after the replay", a, f2)]


def w_storage_base(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    a.alloc(10)  # slots 1..10 -> SWA 1..10
    x = mem.storage(B, [5, 6, 7, 8, 9, 10])
    return [_translated("translate x[0:3]", a, x[0:3]), _translated("translate x[3:6]", a, x[3:6])]


@dataclass(frozen=True)
class Witness:
    """A stale-read trace for one config; ``pools`` allocators are built with the factory under test."""

    config: PoolConfig
    trace: Callable[..., list[Observation]]
    pools: int = 1

    def run(self, factory: Factory) -> list[Observation]:
        pools = [factory(self.config) for _ in range(self.pools)]
        return self.trace(*pools, IndexArena(pools[0].device))


def w_shared(a: SWATokenToKVPoolAllocator, b: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[Observation]:
    a.alloc(4)  # pool A: slots 1..4 -> SWA 1..4; pool B stays idle
    v = mem.storage(B, [1, 2])
    return [_translated("translate through pool A", a, v), _translated("translate through pool B", b, v)]


WITNESSES: dict[str, Witness] = {
    "no_invalidate_alloc": Witness(CFG, w_alloc),
    "no_invalidate_alloc_extend": Witness(CFG, w_alloc_extend),
    "no_invalidate_alloc_extend_swa_tail": Witness(CFG, w_tail),
    "no_invalidate_alloc_decode": Witness(CFG, w_alloc_decode),
    "no_invalidate_free_swa": Witness(CFG, w_free_swa),
    "no_invalidate_set_full_to_swa_mapping": Witness(CFG, w_set_mapping),
    "no_invalidate_clear": Witness(CFG, w_clear),
    "no_invalidate_register_mapping": Witness(CFG, w_register),
    "no_invalidate_forward": Witness(CFG, w_forward),
    "no_invalidate_run_once": Witness(CFG, w_run_once),
    "forward_point_eager_only": Witness(CFG, w_eager_only),
    "storage_base_key": Witness(CFG1, w_storage_base),
    "cache_shared_across_pools": Witness(CFG1, w_shared, pools=2),
}


def stale(observations: list[Observation]) -> list[Observation]:
    """The observations whose value differs from the fresh one."""
    return [o for o in observations if o[1] != o[2]]
