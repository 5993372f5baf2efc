"""A legal ``loc_cache`` system written from the contract: the legal SWA allocator plus a translation cache.

``LocCacheSystemUnderTest`` (kvproof.reference.contract, docs/contract.md): the KV pool
memoises ``translate_loc_from_full_to_swa(x)`` under the key ``(x.data_ptr(), x.numel())``
(sglang_semantics.md §3.2, as merged in PR #25824) and drops the whole cache at the
invalidation points of §3.3: at the start of every allocator mutator of ``M``
(``alloc``, ``alloc_extend``, ``alloc_decode``, ``alloc_extend_swa_tail``, ``free_swa``
and so ``free``, ``set_full_to_swa_mapping``, ``clear``), in ``register_mapping``
(#25889), at every forward (#26152) and in every ``run_once`` of a captured graph (warm-up,
capture, replay; §9 S6). Under the caller's contract E1 (index memory is rewritten only
while a batch is prepared, §3.4 C1) every translation it returns is ``M[x]``.

A forward translates ``out_cache_loc`` once (through the cache) and writes every layer:
full layers at ``out_cache_loc``, SWA layers at the translation (§3.3). Page reuse is
the policy of :mod:`tests.legal.swa_allocator`: :func:`fifo`, :func:`lifo`, :func:`randomized`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.errors import InvalidOperation
from kvproof.reference.registry import Component

from . import swa_allocator as base

__all__ = ["LegalLocCacheSystem", "fifo", "lifo", "randomized"]

C = Capability


class _CachedKVPool(base.LegalKVPool):
    """The KV pool whose SWA writes go through the owner's (cached) translation."""

    _owner: LegalLocCacheSystem

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        if layer_id not in self.k:
            raise InvalidOperation("set_kv_buffer", "layer_id", f"no layer {layer_id}")
        dest = self._owner.translate_loc_from_full_to_swa(loc) if self._owner.config.kv.is_swa_layer(layer_id) else loc
        self.write(layer_id, dest, cache_k, cache_v)

    def write(self, layer_id: int, dest: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        idx = dest.reshape(-1).to(torch.int64)
        self.k[layer_id][idx] = cache_k.to(self.k[layer_id].dtype)
        self.v[layer_id][idx] = cache_v.to(self.v[layer_id].dtype)

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self._owner.translate_loc_from_full_to_swa(kv_indices)


def _invalidating(name: str) -> Callable[..., Any]:
    """The allocator method ``name``, dropping the translation cache first (its invalidation point)."""
    method = getattr(base.LegalSWAAllocator, name)

    def mutator(self: LegalLocCacheSystem, *args: Any) -> Any:
        self.invalidate_loc_cache()
        return method(self, *args)

    mutator.__name__ = mutator.__qualname__ = name
    mutator.__doc__ = method.__doc__
    return mutator


class LegalLocCacheSystem(base.LegalSWAAllocator):
    """The legal allocator with a pointer-keyed translation cache and the engine's hooks."""

    capabilities = base.LegalSWAAllocator.capabilities | {C.REGISTER_MAPPING, C.FORWARD, C.GRAPH_CAPTURE}
    components = frozenset({Component.LOC_CACHE})

    def __init__(self, config: PoolConfig, policy: base.Policy = base.Policy.FIFO, seed: int = 0) -> None:
        self._cache: dict[tuple[int, int], torch.Tensor] = {}
        self._graph: tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]] | None = None
        super().__init__(config, policy, seed)
        self._kv = _CachedKVPool(self)

    def invalidate_loc_cache(self) -> None:
        self._cache.clear()

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        """``M[x]``, memoised under ``(x.data_ptr(), x.numel())`` (§3.2)."""
        key = (kv_indices.data_ptr(), kv_indices.numel())
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = super().translate_loc_from_full_to_swa(kv_indices)
        return hit.clone()  # the caller owns what it gets; the cache keeps its own copy

    alloc = _invalidating("alloc")
    alloc_extend = _invalidating("alloc_extend")
    alloc_decode = _invalidating("alloc_decode")
    alloc_extend_swa_tail = _invalidating("alloc_extend_swa_tail")
    free_swa = _invalidating("free_swa")
    set_full_to_swa_mapping = _invalidating("set_full_to_swa_mapping")
    clear = _invalidating("clear")

    def register_mapping(self) -> None:
        """A fresh mapping (every page free) registered with the KV pool: the cache keyed on the old one goes."""
        self.clear()

    def _run(self, loc: torch.Tensor, cache_k: dict[int, torch.Tensor], cache_v: dict[int, torch.Tensor]) -> None:
        swa_loc = self.translate_loc_from_full_to_swa(loc)  # once per forward, shared by every SWA layer
        for layer in sorted(cache_k):
            dest = swa_loc if self.config.kv.is_swa_layer(layer) else loc
            self._kv.write(layer, dest, cache_k[layer], cache_v[layer])

    def forward(self, out_cache_loc: torch.Tensor, cache_k: dict[int, torch.Tensor],
                cache_v: dict[int, torch.Tensor]) -> None:
        """The per-forward invalidation point, then every layer's KV at ``out_cache_loc`` (§3.3, #26152)."""
        self.invalidate_loc_cache()
        self._run(out_cache_loc, cache_k, cache_v)

    def _run_once(self) -> None:
        if self._graph is None:
            raise InvalidOperation("replay", "graph", "nothing was captured")
        self.invalidate_loc_cache()  # run_once's own point (§9 S6)
        self._run(*self._graph)

    def capture(self, static_loc: torch.Tensor, static_k: dict[int, torch.Tensor],
                static_v: dict[int, torch.Tensor]) -> None:
        """Keep the static buffers (read at every replay) and run ``run_once`` as warm-up and capture."""
        self._graph = (static_loc, static_k, static_v)
        self._run_once()
        self._run_once()

    def replay(self) -> None:
        """``run_once`` on the static buffers' current contents."""
        self._run_once()


def fifo(config: PoolConfig) -> LegalLocCacheSystem:
    return LegalLocCacheSystem(config, base.Policy.FIFO)


def lifo(config: PoolConfig) -> LegalLocCacheSystem:
    return LegalLocCacheSystem(config, base.Policy.LIFO)


def randomized(config: PoolConfig) -> LegalLocCacheSystem:
    return LegalLocCacheSystem(config, base.Policy.RANDOMIZED, seed=base.config_seed(config))
