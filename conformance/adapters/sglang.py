"""The real SGLang 0.5.23 SWA allocator behind kvproof's conformance protocol, on CPU.

``--impl kvproof.conformance.adapters.sglang:SGLangSWAAllocator`` builds, for a kvproof
:class:`~kvproof.reference.config.PoolConfig`, SGLang's own

* ``sglang.srt.mem_cache.swa_memory_pool.SWAKVPool`` (two ``MHATokenToKVPool``), and
* ``sglang.srt.mem_cache.allocator.swa.SWATokenToKVPoolAllocator`` over it
  (``need_sort=False``; ``TokenToKVPoolAllocator`` pools at P == 1,
  ``PagedTokenToKVPoolAllocator`` at P > 1, both on their torch code path because the
  base platform has ``supports_triton == False``),

and exposes them as :class:`~kvproof.reference.contract.SWAAllocatorUnderTest`. Every
call goes to SGLang; the adapter only translates signalling and observation:

* ``None`` from an allocation becomes :class:`~kvproof.reference.errors.OutOfMemory`.
  The adapter does not roll anything back: if SGLang consumed pages before returning
  ``None`` (``alloc_decode``, §2.11 R7) the message says so and the harness reports the
  changed state as a divergence.
* :meth:`SGLangSWAAllocator.snapshot` reads, without copying SGLang's logic:
  ``full_attn_allocator`` / ``swa_attn_allocator``'s ``free_pages`` tensors (hand-out
  order) followed by their ``release_pages`` (P == 1) / ``staged_pages`` (P > 1) —
  both empty with ``need_sort=False`` — their ``num_pages`` (P > 1) / ``size`` (P == 1),
  and the allocator's ``full_to_swa_index_mapping`` tensor (the same object the pool
  registered).
* ``get_kvcache().set_kv_buffer(layer_id, loc, k, v)`` plays 0.5.23's attention
  backend: it translates ``loc`` once (``translate_loc_from_full_to_swa``) and passes
  ``KVWriteLoc(loc, swa_loc=...)`` to ``SWAKVPool.set_kv_buffer`` with a layer object
  carrying ``layer_id``.

Capabilities are declared from what 0.5.23 has, per page size (its composite ``alloc``
asserts P == 1; ``alloc_extend`` / ``alloc_decode`` / ``alloc_extend_swa_tail`` assert
P > 1): no ``BACKUP_RESTORE`` (removed before 0.5.23), no ``REJECTS_MISUSE`` (SGLang
asserts or corrupts on misuse, it never rejects cleanly). For ``--component loc_cache``
the engine hooks ``forward`` (translate once, every layer's ``set_kv_buffer``) and
``register_mapping`` (a fresh mapping, as the constructor registers) are declared;
``capture`` / ``replay`` are not (no CUDA graphs on CPU). Findings and their
classification: ``docs/sglang-findings.md`` and :mod:`.sglang_findings`.

Ring configs (``PoolConfig.swa_ring_size``): the adapter sets ``swa_req_ring_size`` on the real ``SWAKVPool``
instance before it builds the allocator, as DeepSeek-V4's pool sets its field (the only 0.5.23 pool that does), and
passes a real ``ReqToTokenPool`` of ``num_req_slots`` rows: the allocator's own ring branches run (ring cost, the
slot-counted ``swa_available_size``, full-only allocations, the no-op SWA releases). ``alloc_req_slots`` /
``free_req_slots`` are that pool's ``alloc_rows`` / ``free_rows``.

Importing this module never imports SGLang. The first construction does (6-9 s, once per
process): it installs kvproof's ``triton`` / ``torchvision`` stand-ins
(``_stubs/``) for whichever of the two is not importable, logs which, and imports the
pool modules. Without SGLang installed, construction raises ``ImportError`` naming
the install command.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import time
import types
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvproof.conformance.adapters.sglang_known import FINDINGS
from kvproof.conformance.errors import UsageError
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.errors import OutOfMemory
from kvproof.reference.registry import Component
from kvproof.reference.snapshot import AllocatorSnapshot, PoolSnapshot

__all__ = [
    "INSTALL_HINT",
    "SGLANG_VERSION",
    "SGLangKVPool",
    "SGLangModules",
    "SGLangSWAAllocator",
    "SGLangSWAAllocatorSorted",
    "capabilities_for",
    "import_sglang_modules",
    "load_sglang",
    "sglang_available",
]

logger = logging.getLogger(__name__)

#: the release this adapter is written against (constructor signatures differ in 0.5.13)
SGLANG_VERSION = "0.5.23"
INSTALL_HINT = ("python -m kvproof.conformance.adapters.install_sglang [--venv PATH]  (or: make sglang, "
                "which creates .venv-sglang)")
STUBS_DIR = Path(__file__).resolve().parent / "_stubs"
#: modules kvproof can stand in for; installed only when the real one is not importable
STUBBABLE = ("triton", "torchvision")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
C = Capability


# ---------------------------------------------------------------- importing SGLang once


class _StubFinder(importlib.abc.MetaPathFinder):
    """Finds the named top-level stand-ins in ``_stubs/`` (appended last: a real module always wins)."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = frozenset(names)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname in self.names:
            return importlib.machinery.PathFinder.find_spec(fullname, [str(STUBS_DIR)])
        return None


@dataclass(frozen=True)
class SGLangModules:
    """What :func:`load_sglang` imported, and how."""

    version: str
    stubs: tuple[str, ...]  # the stand-ins installed (the real modules were not importable)
    import_seconds: float
    SWAKVPool: type
    SWATokenToKVPoolAllocator: type
    KVWriteLoc: type
    ReqToTokenPool: type  # mem_cache.memory_pool.ReqToTokenPool (the ring's request slots)
    free_kv_row_segments: Any  # mem_cache.common.free_kv_row_segments (the engine's kv-row release)


_LOADED: SGLangModules | None = None


def sglang_available() -> bool:
    """Whether SGLang is installed (does not import it)."""
    return importlib.util.find_spec("sglang") is not None


def _install_stubs() -> tuple[str, ...]:
    missing = tuple(name for name in STUBBABLE if name not in sys.modules and importlib.util.find_spec(name) is None)
    if missing:
        sys.meta_path.append(_StubFinder(missing))
        logger.warning("kvproof: %s not importable; using kvproof's import-time stand-ins from %s (no Triton kernel "
                       "or torchvision op can run; SGLang's torch code paths are the ones exercised)",
                       " and ".join(missing), STUBS_DIR)
    return missing


def load_sglang() -> SGLangModules:
    """Import SGLang's pool modules once per process (stubs first, where needed); cached.

    Raises ``ImportError`` with the install command if SGLang is missing, and
    ``RuntimeError`` if the environment selects SGLang's CPU engine (which needs
    ``sgl_kernel``).
    """
    global _LOADED
    if _LOADED is not None:
        return _LOADED
    if not sglang_available():
        raise ImportError(f"SGLang is not installed in this environment ({sys.executable}); install SGLang "
                          f"{SGLANG_VERSION} for CPU with: {INSTALL_HINT}")
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "").lower() in {"1", "true", "yes"}:
        raise UsageError("unset SGLANG_USE_CPU_ENGINE: it makes SGLang import sgl_kernel's CPU ops; the pools run "
                           "on CPU without it")
    from importlib.metadata import version

    installed = version("sglang")
    if installed != SGLANG_VERSION:
        logger.warning("kvproof: this adapter targets SGLang %s, found %s", SGLANG_VERSION, installed)
    start = time.perf_counter()
    stubs = _install_stubs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns about CUDA-only quantization methods at import
        swa_pool = importlib.import_module("sglang.srt.mem_cache.swa_memory_pool")
        swa_alloc = importlib.import_module("sglang.srt.mem_cache.allocator.swa")
        memory_pool = importlib.import_module("sglang.srt.mem_cache.memory_pool")
        common = importlib.import_module("sglang.srt.mem_cache.common")
    _LOADED = SGLangModules(installed, stubs, time.perf_counter() - start, swa_pool.SWAKVPool,
                            swa_alloc.SWATokenToKVPoolAllocator, memory_pool.KVWriteLoc, memory_pool.ReqToTokenPool,
                            common.free_kv_row_segments)
    logger.info("kvproof: imported SGLang %s in %.1fs (stubs: %s)", installed, _LOADED.import_seconds,
                ", ".join(stubs) or "none")
    return _LOADED


def import_sglang_modules(*names: str) -> list[types.ModuleType]:
    """SGLang modules by name, after :func:`load_sglang` (stubs where needed), SGLang's import-time warnings muted."""
    load_sglang()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SGLang warns about CUDA-only quantization methods at import
        return [importlib.import_module(name) for name in names]


# ---------------------------------------------------------------- the adapter


def capabilities_for(page_size: int) -> frozenset[Capability]:
    """What SGLang 0.5.23's composite supports at this page size (declared, never probed)."""
    common = {C.FREE_FULL, C.CPU_COPY, C.KV_BUFFER, C.SET_FULL_TO_SWA_MAPPING, C.EXACT_PAGE_ORDER,
              C.FORWARD, C.REGISTER_MAPPING, C.FREE_GROUP, C.FREE_SEGMENT}
    if page_size == 1:
        return frozenset(common | {C.ALLOC})  # TokenToKVPoolAllocator pools: alloc only
    # at P > 1 free / free_swa skip slots whose SWA side is released; at P == 1 they do not (F2)
    return frozenset(common | {C.ALLOC_EXTEND, C.ALLOC_DECODE, C.ALLOC_EXTEND_SWA_TAIL, C.FREE_RELEASED_SWA})


class SGLangKVPool:
    """``SWAKVPool``'s KV surface as kvproof's ``KVPoolUnderTest``."""

    def __init__(self, owner: SGLangSWAAllocator) -> None:
        self._owner = owner

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write like 0.5.23's attention backend: translate once, pass ``KVWriteLoc(loc, swa_loc)``."""
        owner = self._owner
        swa_loc = owner.allocator.translate_loc_from_full_to_swa(loc)
        layer = types.SimpleNamespace(layer_id=layer_id)
        owner.kvcache.set_kv_buffer(layer, owner.sglang.KVWriteLoc(loc, swa_loc=swa_loc), cache_k, cache_v)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self._owner.kvcache.get_kv_buffer(layer_id)
        return k, v


class SGLangSWAAllocator:
    """SGLang 0.5.23's ``SWATokenToKVPoolAllocator`` + ``SWAKVPool``, failure by exception, observation by snapshot."""

    components = frozenset({Component.SWA_ALLOCATOR, Component.LOC_CACHE, Component.DECODE_PREALLOC})
    findings = FINDINGS  # what kvproof found in it, matched by evidence (docs/sglang-findings.md)
    need_sort = False  # SGLang's constructor argument (SGLangSWAAllocatorSorted: True)

    def __init__(self, config: PoolConfig, device: str = "cpu") -> None:
        self.sglang = load_sglang()
        self.version = f"sglang {self.sglang.version}"  # reported as the implementation's version
        self.config, self.device, self.page_size = config, device, config.page_size
        self.capabilities = capabilities_for(config.page_size)
        geo = config.kv
        self.kvcache = self.sglang.SWAKVPool(
            size=config.size_full, size_swa=config.size_swa, page_size=config.page_size, dtype=_DTYPES[geo.dtype],
            head_num=geo.head_num, head_dim=geo.head_dim,
            swa_attention_layer_ids=list(geo.swa_attention_layer_ids),
            full_attention_layer_ids=list(geo.full_attention_layer_ids), device=device)
        self.req_to_token_pool: Any = None
        if config.swa_ring_size is not None:  # ring mode, as DeepSeek-V4's pool sets it (on the instance)
            self.kvcache.swa_req_ring_size = config.swa_ring_size
            self.req_to_token_pool = self.sglang.ReqToTokenPool(
                size=config.num_req_slots, max_context_len=config.size_full + config.page_size, device=device,
                enable_memory_saver=False)
        self.allocator = self.sglang.SWATokenToKVPoolAllocator(
            config.size_full, config.size_swa, config.page_size, _DTYPES[geo.dtype], device, self.kvcache,
            need_sort=self.need_sort, req_to_token_pool=self.req_to_token_pool)
        self._kv = SGLangKVPool(self)
        self._graph: tuple[torch.Tensor, dict[int, torch.Tensor], dict[int, torch.Tensor]] | None = None

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(sglang {self.sglang.version}, {self.config.label()}, device={self.device}, "
                f"need_sort={self.need_sort})")

    # ------------------------------------------------------------ allocation: None -> OutOfMemory

    def _free_counts(self) -> tuple[int, int]:
        a = self.allocator
        return a.full_attn_allocator.available_size(), a.swa_attn_allocator.available_size()

    def _result(self, op: str, out: torch.Tensor | None, before: tuple[int, int], full_pages: int,
                swa_pages: int) -> torch.Tensor:
        if out is not None:
            return out
        after = self._free_counts()
        short = "full" if full_pages * self.page_size > before[0] else "swa"
        err = OutOfMemory(op, short, full_pages if short == "full" else swa_pages,
                          before[0 if short == "full" else 1] // self.page_size)
        if after != before:  # SGLang returned None but kept what it took: report, do not repair
            note = f"SGLang returned None but did not roll back: free tokens (full, swa) {before} -> {after}"
            err.args = (f"{err.args[0]} [{note}]",)
        raise err

    def _new_pages(self, seq_lens_cpu: torch.Tensor, prefix_lens_cpu: torch.Tensor) -> int:
        p = self.page_size
        seq, pre = seq_lens_cpu.tolist(), prefix_lens_cpu.tolist()
        return sum(-(-s // p) - -(-q // p) for s, q in zip(seq, pre, strict=True))

    def alloc(self, need_size: int) -> torch.Tensor:
        before = self._free_counts()
        return self._result("alloc", self.allocator.alloc(need_size), before, need_size, need_size)

    def alloc_extend(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                     seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int) -> torch.Tensor:
        before = self._free_counts()
        out = self.allocator.alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                          extend_num_tokens)
        k = self._new_pages(seq_lens_cpu, prefix_lens_cpu) if out is None else 0
        return self._result("alloc_extend", out, before, k, k)

    def alloc_decode(self, seq_lens: torch.Tensor, seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor
                     ) -> torch.Tensor:
        before = self._free_counts()
        out = self.allocator.alloc_decode(seq_lens, seq_lens_cpu, last_loc)
        k = self._new_pages(seq_lens_cpu, seq_lens_cpu - 1) if out is None else 0
        return self._result("alloc_decode", out, before, k, k)

    def alloc_extend_swa_tail(self, prefix_lens: torch.Tensor, prefix_lens_cpu: torch.Tensor, seq_lens: torch.Tensor,
                              seq_lens_cpu: torch.Tensor, last_loc: torch.Tensor, extend_num_tokens: int,
                              swa_tail_len: int) -> torch.Tensor:
        before = self._free_counts()
        out = self.allocator.alloc_extend_swa_tail(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
                                                   extend_num_tokens, swa_tail_len)
        full = self._new_pages(seq_lens_cpu, prefix_lens_cpu) if out is None else 0
        return self._result("alloc_extend_swa_tail", out, before, full, -(-swa_tail_len // self.page_size))

    # ------------------------------------------------------------ the ring's request slots (ReqToTokenPool)

    def alloc_req_slots(self, need_size: int) -> list[int]:
        pool = self.req_to_token_pool
        if pool is None:
            raise UsageError("alloc_req_slots: not a ring config (PoolConfig.swa_ring_size is None)")
        got = pool.alloc_rows(need_size)
        if got is None:
            raise OutOfMemory("alloc_req_slots", "req_slots", need_size, int(pool.available_size()))
        return [int(x) for x in got]

    def free_req_slots(self, indices: list[int]) -> None:
        if self.req_to_token_pool is None:
            raise UsageError("free_req_slots: not a ring config (PoolConfig.swa_ring_size is None)")
        self.req_to_token_pool.free_rows(list(indices))

    # ------------------------------------------------------------ release and the rest: straight through

    def free(self, free_index: torch.Tensor) -> None:
        self.allocator.free(free_index)

    def free_swa(self, free_index: torch.Tensor) -> None:
        self.allocator.free_swa(free_index)

    def free_full(self, free_index: torch.Tensor) -> None:
        self.allocator.free_full(free_index)

    def free_group_begin(self) -> None:
        self.allocator.free_group_begin()

    def free_group_end(self) -> None:
        self.allocator.free_group_end()

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.allocator.free_segment(free_index, start_pos=start_pos)

    def free_swa_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.allocator.free_swa_segment(free_index, start_pos=start_pos)

    def free_full_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        self.allocator.free_full_segment(free_index, start_pos=start_pos)

    def free_kv_row_segments(self, segments: list[tuple[torch.Tensor, int]], *, swa_evicted_seqlen: int,
                             swa_dead_lo: int = 0) -> None:
        """SGLang's own ``mem_cache.common.free_kv_row_segments`` on this allocator (the caller's split)."""
        self.sglang.free_kv_row_segments(self.allocator, segments, swa_evicted_seqlen=swa_evicted_seqlen,
                                         swa_dead_lo=swa_dead_lo)

    def clear(self) -> None:
        self.allocator.clear()

    def backup_state(self) -> object:
        raise NotImplementedError("SGLang 0.5.23's SWATokenToKVPoolAllocator has no backup_state "
                                  "(Capability.BACKUP_RESTORE is not declared)")

    def restore_state(self, state: object) -> None:
        raise NotImplementedError("SGLang 0.5.23's SWATokenToKVPoolAllocator has no restore_state "
                                  "(Capability.BACKUP_RESTORE is not declared)")

    def available_size(self) -> int:
        return int(self.allocator.available_size())

    def full_available_size(self) -> int:
        return int(self.allocator.full_available_size())

    def swa_available_size(self) -> int:
        return int(self.allocator.swa_available_size())

    def translate_loc_from_full_to_swa(self, kv_indices: torch.Tensor) -> torch.Tensor:
        return self.allocator.translate_loc_from_full_to_swa(kv_indices)

    def get_cpu_copy(self, indices: torch.Tensor) -> object:
        return self.allocator.get_cpu_copy(indices)

    def load_cpu_copy(self, kv_cache_cpu: object, indices: torch.Tensor) -> None:
        self.allocator.load_cpu_copy(kv_cache_cpu, indices)

    def get_kvcache(self) -> SGLangKVPool:
        return self._kv

    def set_full_to_swa_mapping(self, full_indices: torch.Tensor, swa_indices: torch.Tensor) -> None:
        self.allocator.set_full_to_swa_mapping(full_indices, swa_indices)

    # ------------------------------------------------------------ observation

    def _pool_snapshot(self, pool: Any) -> PoolSnapshot:
        if self.page_size == 1:  # TokenToKVPoolAllocator: slots are pages; need_sort parks frees in release_pages
            num_pages, parked = pool.size, [pool.release_pages]
        else:  # PagedTokenToKVPoolAllocator: need_sort parks frees in staged_pages
            num_pages, parked = pool.num_pages, list(pool.staged_pages)
        pages = torch.cat([pool.free_pages, *parked]) if parked else pool.free_pages
        return PoolSnapshot(page_size=self.page_size, num_pages=int(num_pages),
                            free_pages=tuple(int(x) for x in pages.tolist()))

    def snapshot(self) -> AllocatorSnapshot:
        a = self.allocator
        return AllocatorSnapshot(full=self._pool_snapshot(a.full_attn_allocator),
                                 swa=self._pool_snapshot(a.swa_attn_allocator),
                                 full_to_swa_index_mapping=tuple(int(x) for x in a.full_to_swa_index_mapping.tolist()))

    # ------------------------------------------------------------ engine hooks (component loc_cache)

    def register_mapping(self) -> None:
        """A fresh mapping (every page free), registered with the pool, as the constructor does."""
        a = self.allocator
        a.full_to_swa_index_mapping = torch.zeros_like(a.full_to_swa_index_mapping)
        a.full_to_swa_index_mapping[-1] = -1
        a.clear()
        self.kvcache.register_mapping(a.full_to_swa_index_mapping)

    def forward(self, out_cache_loc: torch.Tensor, cache_k: dict[int, torch.Tensor],
                cache_v: dict[int, torch.Tensor]) -> None:
        """One forward as 0.5.23 runs it: ``swa_loc`` translated once, then every layer's ``set_kv_buffer``."""
        swa_loc = self.allocator.translate_loc_from_full_to_swa(out_cache_loc)
        write_loc = self.sglang.KVWriteLoc(out_cache_loc, swa_loc=swa_loc)
        for layer_id in sorted(cache_k):
            self.kvcache.set_kv_buffer(types.SimpleNamespace(layer_id=layer_id), write_loc, cache_k[layer_id],
                                       cache_v[layer_id])

    def capture(self, static_loc: torch.Tensor, static_k: dict[int, torch.Tensor],
                static_v: dict[int, torch.Tensor]) -> None:
        raise NotImplementedError("no CUDA graphs on CPU (Capability.GRAPH_CAPTURE is not declared)")

    def replay(self) -> None:
        raise NotImplementedError("no CUDA graphs on CPU (Capability.GRAPH_CAPTURE is not declared)")


class SGLangSWAAllocatorSorted(SGLangSWAAllocator):
    """The same allocator as prefill/decode-disaggregated servers build it: ``need_sort=True``.

    Frees are staged (``release_pages`` at P == 1, ``staged_pages`` at P > 1) and merged into the free list, sorted,
    when an allocation finds the free list short (``alloc``: the pages it needs; ``alloc_extend``: the upper bound
    ``extend_num_tokens // P + bs + 1``; ``alloc_decode``: ``bs``), sglang_semantics.md §1.2-§1.3. Every staged page
    counts as available. kvproof's reference does not model the staged order, so this variant does not declare
    ``EXACT_PAGE_ORDER``: the suites check everything else (which pages are free, owned and mapped, each pool's count,
    the KV rows, atomicity up to the order of a free list) and pair the pages by renaming.
    """

    need_sort = True

    def __init__(self, config: PoolConfig, device: str = "cpu") -> None:
        super().__init__(config, device)
        self.capabilities = self.capabilities - {C.EXACT_PAGE_ORDER}

