"""``SWAKVPool``: the K/V buffers behind the SWA composite allocator (sglang_semantics.md §1.5, §2.8).

Full-attention layers are indexed by full slots (``size_full + P`` rows), sliding-window
layers by SWA slots (``size_swa + P`` rows); row 0 / page 0 is the padding that writes
through unmapped slots land on (§1.4). Each pool is one tensor of shape
``(layers, 2, rows, head_num, head_dim)`` (index 0 = K, 1 = V), so a CPU copy of all
layers is a single gather. Layer ids map to ``(index in pool, is_swa)`` exactly as
SGLang's ``layers_mapping`` (position in ``full_attention_layer_ids`` /
``swa_attention_layer_ids``).

The allocator hands the pool its ``full_to_swa_index_mapping`` (the same tensor
object, ``register_mapping``) and its liveness check (``register_slot_check``), so
writes and copies through unallocated slots are rejected with the reference's op and
argument names, before anything is written.

CPU copy format (``get_cpu_copy``), all CPU tensors::

    {"full": (n_full_layers, 2, n, H, D), "swa": (n_swa_layers, 2, m, H, D) | None, "swa_mask": bool (n,)}

``swa_mask[j] = M[indices[j]] > 0``; ``swa`` holds the ``m`` mapped positions in order.
``load_cpu_copy`` restores a saved SWA row iff its position is mapped now too:
``row_mask = new_mask[old_mask]``, destinations ``t[old_mask][row_mask]`` (§2.8).

Loc cache (PR #25824 / #26152, §3.2-§3.4): ``translate_loc_from_full_to_swa(x)``
memoises ``M[x]`` under ``(x.data_ptr(), x.numel())`` in two fields of this pool
instance (``_cached_loc_key``, ``_cached_swa_loc``); a hit returns the cached tensor
object itself. The cache cannot see what ``x`` holds nor ``M``: it stays fresh only
because its owners call ``invalidate_loc_cache()`` at the invalidation points (the
allocator's mutators, ``register_mapping``, every forward, every graph ``run_once``;
``kvproof.reference.loc_cache``). The layer writes of a forward (:meth:`store`, called
by ``kvproof.gpu_runtime.loc_cache``) translate through it, so the first SWA layer
of a forward misses and the others hit (C2). While a graph capture records
(:mod:`._recording`), gathers and row writes are handed to the recording instead of
(emulated) or as well as (CUDA) running.

A ``set_kv_buffer`` called on its own, outside a forward, translates afresh and leaves
the cache alone. Upstream calls it only inside a forward, after the per-forward
invalidation; a caller outside one (the ``swa_allocator`` lockstep harness writes rows
from fresh tensors, which the CUDA caching allocator places at recycled addresses)
keeps no contract E1, and a cached translation would serve it the previous tensor's
slots (R2-a).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import partial
from typing import ClassVar, Protocol

import torch

from kvproof.gpu_runtime._recording import Launch, Recording
from kvproof.gpu_runtime.paged import as_index, resolve_device
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, require
from kvproof.reference.loc_cache import KeyScheme

__all__ = ["KVCpuCopy", "SWAKVPool", "SlotCheck"]

Tensor = torch.Tensor
#: ``get_cpu_copy``'s result: ``{"full": ..., "swa": ..., "swa_mask": ...}``.
KVCpuCopy = dict[str, Tensor | None]


class SlotCheck(Protocol):
    """Raises ``InvalidOperation(op, argument, ...)`` unless every full slot is live."""

    def __call__(self, op: str, argument: str, slots: Tensor, *, duplicates_ok: bool) -> object: ...


class SWAKVPool:
    """Per-layer K and V rows of the full and SWA pools, written through the full-to-SWA mapping."""

    #: what the loc cache is keyed by: the view's own address (#25824 as merged); a
    #: mutant switches to the storage's base address (an intermediate revision, S5)
    key_scheme: ClassVar[KeyScheme] = KeyScheme.DATA_PTR
    #: ``register_mapping`` drops the cache (point ``register_mapping``, #25889); an
    #: allocator whose policy lacks that point turns it off on its pool
    register_invalidates: bool = True

    def __init__(self, config: PoolConfig, device: torch.device | str | None = None) -> None:
        geo, p = config.kv, config.page_size
        self.device = resolve_device(device)
        self.dtype: torch.dtype = getattr(torch, geo.dtype)
        self.page_size, self.head_num, self.head_dim = p, geo.head_num, geo.head_dim
        self.full_attention_layer_ids = geo.full_attention_layer_ids
        self.swa_attention_layer_ids = geo.swa_attention_layer_ids
        self.layers_mapping: dict[int, tuple[int, bool]] = {
            **{lid: (i, False) for i, lid in enumerate(geo.full_attention_layer_ids)},
            **{lid: (i, True) for i, lid in enumerate(geo.swa_attention_layer_ids)},
        }
        shape = (2, geo.head_num, geo.head_dim)
        self.full_kv = self._buffer(len(geo.full_attention_layer_ids), config.size_full + p, shape)
        self.swa_kv = self._buffer(len(geo.swa_attention_layer_ids), config.size_swa + p, shape)
        self.full_to_swa_index_mapping: Tensor | None = None
        self._slot_check: SlotCheck = self._in_range
        # the loc cache lives in this instance: one cache per pool (§3.2)
        self._cached_loc_key: tuple[int, int] | None = None
        self._cached_swa_loc: Tensor | None = None
        self._recording: Recording | None = None  # set while a graph capture records

    def _buffer(self, layers: int, rows: int, shape: tuple[int, int, int]) -> Tensor:
        kv, h, d = shape
        return torch.zeros((layers, kv, rows, h, d), dtype=self.dtype, device=self.device)

    # ------------------------------------------------------------ wiring

    def register_mapping(self, full_to_swa_index_mapping: Tensor) -> None:
        """Hold the allocator's mapping tensor itself (its writes are visible here), then drop the cache."""
        self.full_to_swa_index_mapping = full_to_swa_index_mapping
        if self.register_invalidates:
            # a translation cached from the old mapping tensor says nothing about the new one
            self.invalidate_loc_cache()

    def require_mapping(self, op: str) -> Tensor:
        """The registered mapping tensor; ``InvalidOperation(op, "full_to_swa_index_mapping")`` if none is yet."""
        mapping = self.full_to_swa_index_mapping
        if mapping is None:
            raise InvalidOperation(op, "full_to_swa_index_mapping", "no mapping registered (call register_mapping)")
        return mapping

    def register_slot_check(self, check: SlotCheck) -> None:
        """Validate full slots with the allocator's liveness check (it owns ``fill``)."""
        self._slot_check = check

    def _in_range(self, op: str, argument: str, slots: Tensor, *, duplicates_ok: bool) -> None:
        # standalone pool (no allocator): only keep indexing in bounds
        rows = self.full_kv.shape[2]
        require(bool(((slots >= 0) & (slots < rows)).all()), op, argument, f"slots outside [0, {rows})")

    # ------------------------------------------------------------ buffers

    def _layer(self, op: str, layer_id: int) -> tuple[int, bool]:
        require(isinstance(layer_id, int) and layer_id in self.layers_mapping, op, "layer_id",
                lambda: f"{layer_id} is outside [0, {len(self.layers_mapping)})")
        return self.layers_mapping[layer_id]

    def _pool(self, is_swa: bool) -> Tensor:
        return self.swa_kv if is_swa else self.full_kv

    def get_kv_buffer(self, layer_id: int) -> tuple[Tensor, Tensor]:
        """The layer's whole K and V buffers ``(rows, H, D)``, indexed by pool slot."""
        i, is_swa = self._layer("get_kv_buffer", layer_id)
        k, v = self._pool(is_swa)[i].unbind(0)
        return k, v

    def get_key_buffer(self, layer_id: int) -> Tensor:
        return self.get_kv_buffer(layer_id)[0]

    def get_value_buffer(self, layer_id: int) -> Tensor:
        return self.get_kv_buffer(layer_id)[1]

    def is_swa_layer(self, layer_id: int) -> bool:
        return layer_id in self.swa_attention_layer_ids

    # ------------------------------------------------------------ loc cache (§3.2, §3.3)

    def invalidate_loc_cache(self) -> None:
        """Drop the cached translation; the next one gathers afresh."""
        self._cached_loc_key = None
        self._cached_swa_loc = None

    def loc_cache_key(self, x: Tensor) -> tuple[int, int]:
        """``(address, numel)`` of ``x`` under :attr:`key_scheme` -- never its contents."""
        ptr = x.data_ptr() if self.key_scheme is KeyScheme.DATA_PTR else x.untyped_storage().data_ptr()
        return (ptr, x.numel())

    def translate_loc_from_full_to_swa(self, kv_indices: Tensor) -> Tensor:
        """``M[kv_indices]`` through the cache: a hit returns the cached tensor itself; -1 yields -1 (sentinel).

        Unchecked (the allocator range-checks its callers' indices). Freshness is the
        invalidation points' business: a key says where ``kv_indices`` lives, not what
        it holds (C1).
        """
        mapping = self.require_mapping("translate_loc_from_full_to_swa")
        key, cached = self.loc_cache_key(kv_indices), self._cached_swa_loc
        if cached is not None and key == self._cached_loc_key:
            return cached  # a hit launches nothing (under a capture: records nothing, S6)
        value = self._gather(mapping, kv_indices)
        self._cached_loc_key, self._cached_swa_loc = key, value
        return value

    def _gather(self, mapping: Tensor, x: Tensor) -> Tensor:
        if self._recording is None:
            return torch.take(mapping, x if x.dtype == torch.int64 else x.long())  # -1 wraps onto the sentinel
        # a capture records the gather into the output tensor the cache will hold (C3)
        out = torch.empty(x.shape, dtype=mapping.dtype, device=mapping.device)
        self._recording.launch(partial(_take, mapping, x, out), gather=True)
        return out

    @contextmanager
    def recording(self, recording: Recording) -> Iterator[Recording]:
        """Hand gathers and row writes to ``recording`` while the block runs (a graph capture)."""
        self._recording = recording
        try:
            yield recording
        finally:
            self._recording = None

    def _launch(self, fn: Launch) -> None:
        if self._recording is None:
            fn()
        else:
            self._recording.launch(fn)

    # ------------------------------------------------------------ writes

    def set_kv_buffer(self, layer_id: int, loc: Tensor, cache_k: Tensor, cache_v: Tensor) -> None:
        """Write rows of the tokens at full slots ``loc``; SWA layers write at ``M[loc]`` (fresh: not in a forward).

        ``loc`` holds live slots, or 0 for padding tokens (CUDA-graph padding writes into
        the reserved slot by design, §1.4); a write through an unmapped slot (``M == 0``)
        lands on padding row 0 too.
        """
        op = "set_kv_buffer"
        loc = as_index(loc, self.device)
        index, is_swa, k, v = self.check_rows(op, layer_id, loc, cache_k, cache_v)
        self.check_loc(op, loc)
        self.store(index, is_swa, loc, k, v, cached=False)

    def check_rows(self, op: str, layer_id: int, loc: Tensor, cache_k: Tensor, cache_v: Tensor
                   ) -> tuple[int, bool, Tensor, Tensor]:
        """Layer id and row shapes (reference order); returns ``(index in pool, is_swa, K, V)``."""
        i, is_swa = self._layer(op, layer_id)
        k = cache_k if isinstance(cache_k, Tensor) else torch.as_tensor(cache_k)
        v = cache_v if isinstance(cache_v, Tensor) else torch.as_tensor(cache_v)
        n, width = loc.numel(), self.head_num * self.head_dim
        # one K and one V row per slot
        require(k.dim() >= 1 and v.dim() >= 1 and k.shape[0] == n == v.shape[0], op, "cache_k",
                lambda: f"{tuple(k.shape)} K and {tuple(v.shape)} V rows for {n} slots")
        # each row holds head_num * head_dim values
        require(k.numel() == n * width == v.numel(), op, "cache_k", lambda: f"rows must hold {width} values each")
        # an SWA layer writes through the mapping
        require(not is_swa or self.full_to_swa_index_mapping is not None, op, "layer_id",
                "SWA layer but no mapping registered")
        return i, is_swa, k, v

    def check_loc(self, op: str, loc: Tensor, argument: str = "loc") -> None:
        """Every non-padding slot of ``loc`` (1-D) is live, and none appears twice."""
        real = loc.nonzero()  # one sync, as a masked selection
        self._slot_check(op, argument, loc if real.numel() == loc.numel() else loc.index_select(0, real.view(-1)),
                         duplicates_ok=False)

    def check_translatable(self, op: str, loc: Tensor) -> None:
        """Entries are -1 (no prefix) or full slot ids: what a gather through M may index."""
        n = self.require_mapping(op).numel() - 1
        require(torch.equal(loc.clamp(-1, n - 1), loc), op, "loc", lambda: f"entries outside [-1, {n})")

    def store(self, index: int, is_swa: bool, loc: Tensor, k: Tensor, v: Tensor, *, cached: bool = True) -> None:
        """The unchecked write of one layer of a forward: one launch writes K and V.

        SWA layers write at the translation of ``loc``: through the cache (``cached``), else afresh.
        """
        if not is_swa:
            dest = loc
        elif cached:
            dest = self.translate_loc_from_full_to_swa(loc)
        else:
            dest = self.require_mapping("set_kv_buffer").index_select(0, loc)
        self._launch(partial(_write_rows, self._pool(is_swa)[index], dest, k, v))

    # ------------------------------------------------------------ CPU copies (§2.8)

    def get_cpu_copy(self, indices: Tensor) -> KVCpuCopy:
        """Full rows of every position, SWA rows of the mapped ones, and the mask saying which."""
        op = "get_cpu_copy"
        idx = as_index(indices, self.device)
        self._slot_check(op, "indices", idx, duplicates_ok=True)
        full = self.full_kv.index_select(2, idx).cpu()
        if self.full_to_swa_index_mapping is None:
            return {"full": full, "swa": None, "swa_mask": None}
        swa_slots = self.full_to_swa_index_mapping.index_select(0, idx)
        mask = swa_slots > 0  # slot 0 is the padding: 0 means "no SWA KV here"
        mapped = mask.nonzero().view(-1)
        swa = self.swa_kv.index_select(2, swa_slots.index_select(0, mapped)).cpu() if mapped.numel() else None
        return {"full": full, "swa": swa, "swa_mask": mask.cpu()}

    def load_cpu_copy(self, kv_cache_cpu: Mapping[str, Tensor | None], indices: Tensor) -> None:
        """Load a copy into new full slots ``indices`` of the same positions (§2.8)."""
        op = "load_cpu_copy"
        idx = as_index(indices, self.device)
        full, swa, old_mask = self._unpack_copy(op, kv_cache_cpu)
        positions = old_mask.numel() if old_mask is not None else full.shape[2]
        # position alignment: the copy and the destination cover the same positions
        require(idx.numel() == positions, op, "indices",
                lambda: f"{idx.numel()} destination slots for a copy of {positions} positions")
        self._check_copy_shapes(op, full, swa, old_mask, positions)
        self._slot_check(op, "indices", idx, duplicates_ok=False)
        self.full_kv.index_copy_(2, idx, full.to(self.device, self.dtype))
        if swa is None or old_mask is None or self.full_to_swa_index_mapping is None:
            return
        t = self.full_to_swa_index_mapping.index_select(0, idx)
        rows, dest = self._swa_rows_to_load(swa.to(self.device, self.dtype), old_mask.to(self.device), t)
        if dest.numel():
            self.swa_kv.index_copy_(2, dest, rows)

    def _swa_rows_to_load(self, swa: Tensor, old_mask: Tensor, t: Tensor) -> tuple[Tensor, Tensor]:
        """Saved rows whose position is mapped now, and their SWA destinations (mask symmetry)."""
        t_saved = t.index_select(0, old_mask.nonzero().view(-1))  # the saved rows' positions, now
        keep = (t_saved > 0).nonzero().view(-1)  # row_mask = new_mask[old_mask]: still has an SWA slot?
        return swa.index_select(2, keep), t_saved.index_select(0, keep)

    def _unpack_copy(self, op: str, kv: object) -> tuple[Tensor, Tensor | None, Tensor | None]:
        if not (isinstance(kv, Mapping) and isinstance(kv.get("full"), Tensor)):
            raise InvalidOperation(op, "kv_cache_cpu", "expected get_cpu_copy's {'full', 'swa', 'swa_mask'} dict")
        mask = kv.get("swa_mask")
        # the legacy (maskless) format cannot say which saved row is which position
        require(kv.get("swa") is None or mask is not None, op, "kv_cache_cpu", "SWA rows without swa_mask")
        return kv["full"], kv.get("swa"), None if mask is None else torch.as_tensor(mask, dtype=torch.bool)

    def _check_copy_shapes(self, op: str, full: Tensor, swa: Tensor | None, mask: Tensor | None, n: int) -> None:
        h, d = self.head_num, self.head_dim
        require(full.dim() == 5 and full.shape[0] == self.full_kv.shape[0], op, "kv_cache_cpu",
                "copy has a different number of full layers")
        require(tuple(full.shape[1:]) == (2, n, h, d), op, "kv_cache_cpu",
                lambda: f"full rows of shape {tuple(full.shape)}")
        if swa is not None and mask is not None:
            m = int(mask.sum())
            require(tuple(swa.shape) == (self.swa_kv.shape[0], 2, m, h, d), op, "kv_cache_cpu",
                    lambda: f"SWA rows of shape {tuple(swa.shape)} for {m} mapped positions")


def _write_rows(buf: Tensor, dest: Tensor, k: Tensor, v: Tensor) -> None:
    """``buf[0, dest] = K``, ``buf[1, dest] = V`` for one layer's ``(2, rows, H, D)`` buffer.

    Reads ``k`` / ``v`` when it runs: a recorded write replays from the static tensors' current contents.
    """
    shape = (dest.numel(), buf.shape[2], buf.shape[3])
    rows = torch.stack((k.reshape(shape).to(buf.device, buf.dtype), v.reshape(shape).to(buf.device, buf.dtype)))
    buf.index_copy_(1, dest.reshape(-1), rows)


def _take(mapping: Tensor, x: Tensor, out: Tensor) -> None:
    """``out = M[x]``, -1 -> -1 (``take`` wraps negative indices onto the sentinel); ``x`` may be int32."""
    torch.take(mapping, x.long(), out=out)
