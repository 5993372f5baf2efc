"""SGLang 0.5.23's real HiSparse host pool behind kvproof's ``hisparse_host`` suite, on CPU.

``--impl kvproof.conformance.adapters.sglang_host:SGLangHostPool`` builds, for a kvproof
:class:`~kvproof.reference.hisparse_host.HostPoolConfig` (coordinator ``PAGED`` only:
0.5.23 has no other), SGLang's own

* ``sglang.srt.mem_cache.memory_pool.MLATokenToKVPool`` (the device pool: one layer,
  ``kv_lora_rank = 1``, ``qk_rope_head_dim = 0``, dtype ``int64``, ``device="cpu"``), and
* ``sglang.srt.mem_cache.pool_host.mla.MLATokenToKVPoolHost`` over its
  ``get_device_pool_infos()[0].buffer_info`` -- the class that mixes in
  ``HiSparseHostPoolMixin`` (``pool_host/hisparse.py``) and that the HiSparse
  coordinator builds for non-DSV4 models -- with ``layout="layer_first"``,
  ``pin_memory=False``, ``device="cpu"``.

Sizing (exact): the coordinator's path, ``host_size=0`` and ``host_to_device_ratio``
times the device capacity, which ``HostKVCache`` rounds as ``page_num = size // P + 1``.
The adapter passes ``device_capacity_tokens = (num_pages - 1) * P`` (also the device
pool's size) and ratio 1, so SGLang's pool has exactly ``config.num_pages`` pages and
``config.size`` slots; the constructor checks ``page_num`` and ``size`` and raises if
SGLang ever sized it otherwise. The pool is built inside SGLang's own
``host_memory_budget_scope`` (64 MiB): its host-memory check otherwise compares against
free RAM minus a 10 GiB reserve, which a small CI machine can fail for a pool of a few
hundred bytes.

What is SGLang and what is the adapter:

* SGLang: the host pool (``alloc`` / ``free`` / ``available_size``, its ``free_slots``
  tensor and lazily merged ``release_slots``, its ``slot_used`` double-alloc /
  double-free asserts) and the mixin's ``alloc_paged_token_slots`` /
  ``allocated_host_indices``, called with the adapter's table.
* the adapter, as ``HiSparseCoordinator`` (``managers/hisparse_coordinator.py``) owns
  them: ``req_to_host_pool`` (int64 ``[max_req_slots, max_context_len + P]``, -1) and
  ``req_to_host_pool_allocated_len`` (int64 per request slot), ``_skip_first_backup``,
  and the coordinator's call sites with compress ratio 1, in SGLang's order:

  - ``admit_request_into_staging``: ``alloc_paged_token_slots(table, len, r, 0, n)``,
    the staging copy, then the flag ``collect_ready_reqs`` sets once the copy is done;
  - ``eager_backup_previous_token``: first the loop over the batch that clears the
    skip flag of every flagged entry (and skips it), then one
    ``alloc_paged_token_slots(table, len, r, seq_len - 2, 1)`` per kept entry in batch
    order, then one copy for all of them. Like upstream it is **not failure-atomic**:
    when a later entry is short, earlier entries keep the pages they took and every
    flag of the batch is already cleared (finding F3, docs/sglang-findings.md);
  - ``request_finished``: ``allocated_host_indices`` (mixin) -> ``free`` if non-empty,
    row -> -1, length -> 0, flag cleared.

* host data: the values live in SGLang's real host KV buffer, one element per host
  slot (``kv_buffer[0, slot, 0, 0]``, int64). The copy itself is the adapter's:
  SGLang's device->host transfer (``backup_from_device_all_layer``) needs
  ``sgl_kernel``'s ``transfer_kv_all_layer_mla`` / ``transfer_kv_direct``, which are not
  importable off CUDA/ROCm/XPU, so the adapter writes the per-layer view
  (``data_refs[0]``) at the host slots SGLang returned.

Signalling: the mixin's ``RuntimeError("HiSparse host mem pool alloc failed for k
pages")`` becomes :class:`~kvproof.reference.errors.OutOfMemory` (``op``, ``"host"``,
``k``, free pages before the call, ``request=r``); SGLang's ``logger.error`` line for
it is filtered out while the adapter translates it. The adapter repairs nothing: if a
backup batch fails after earlier entries took pages, the message says so and the
harness reports the changed state. Any other exception (the mixin's
``assert start_pos <= allocated_len``, a shape error) propagates unchanged.

Capabilities: ``EXACT_PAGE_ORDER`` (``HostKVCache`` hands out ``free_slots`` first and
appends freed runs to ``release_slots``, merged in order on demand: exactly the
reference's FIFO; checked every step). Not ``REJECTS_MISUSE``: SGLang asserts on a
hole, indexes a negative request slot from the end, stages an occupied row without a
check, and fails a row overflow only after taking the pages.

Importing this module never imports SGLang; the first construction does, through
:func:`kvproof.conformance.adapters.sglang.load_sglang` (stubs, once per process), and
raises ``ImportError`` naming the install command without SGLang.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvproof.conformance.adapters.sglang import (
    INSTALL_HINT,
    SGLANG_VERSION,
    import_sglang_modules,
    load_sglang,
    sglang_available,
)
from kvproof.conformance.adapters.sglang_known import FINDINGS
from kvproof.conformance.errors import HarnessBug
from kvproof.reference.contract import Capability
from kvproof.reference.errors import ConfigError, OutOfMemory
from kvproof.reference.hisparse_host import Coordinator, HostPoolConfig, HostPoolSnapshot
from kvproof.reference.registry import Component

__all__ = ["CAPABILITIES", "HOST_BUDGET_BYTES", "INSTALL_HINT", "SGLANG_VERSION", "SGLangHostModules",
           "SGLangHostPool", "load_sglang_host", "sglang_available"]

logger = logging.getLogger(__name__)

C = Capability
CAPABILITIES: frozenset[Capability] = frozenset({C.EXACT_PAGE_ORDER})
#: the host-memory budget SGLang's pool is built under (its own ``host_memory_budget_scope``)
HOST_BUDGET_BYTES = 64 << 20
_I64 = torch.int64
#: the mixin's message when the pool is short (pool_host/hisparse.py)
_OOM = re.compile(r"HiSparse host mem pool alloc failed for (\d+) pages")
_MIXIN_LOGGER = "sglang.srt.mem_cache.pool_host.hisparse"


# ---------------------------------------------------------------- importing SGLang's host pool once


@dataclass(frozen=True)
class SGLangHostModules:
    """The classes the adapter builds (imported after :func:`load_sglang`)."""

    version: str
    MLATokenToKVPool: type
    MLATokenToKVPoolHost: type
    HiSparseHostPoolMixin: type
    host_memory_budget_scope: Any


_HOST: SGLangHostModules | None = None


def load_sglang_host() -> SGLangHostModules:
    """SGLang's host pool modules, imported once per process (``ImportError`` naming the install command)."""
    global _HOST
    if _HOST is not None:
        return _HOST
    sg = load_sglang()  # the SWA adapter's loader: stubs where needed, once per process
    memory_pool, mla, hisparse, base = import_sglang_modules(
        "sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.pool_host.mla",
        "sglang.srt.mem_cache.pool_host.hisparse", "sglang.srt.mem_cache.pool_host.base")
    _HOST = SGLangHostModules(sg.version, memory_pool.MLATokenToKVPool, mla.MLATokenToKVPoolHost,
                              hisparse.HiSparseHostPoolMixin, base.host_memory_budget_scope)
    return _HOST


class _DropMixinOOMLog(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("HiSparse: host mem pool alloc failed")


@contextlib.contextmanager
def _translating_oom() -> Iterator[None]:
    """SGLang's ``logger.error`` for a short pool is dropped while the adapter raises ``OutOfMemory`` for it."""
    mixin_logger, drop = logging.getLogger(_MIXIN_LOGGER), _DropMixinOOMLog()
    mixin_logger.addFilter(drop)
    try:
        yield
    finally:
        mixin_logger.removeFilter(drop)


def _ints(values: Sequence[int] | torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(values, dtype=_I64).reshape(-1).cpu()


# ---------------------------------------------------------------- the adapter


class SGLangHostPool:
    """``MLATokenToKVPoolHost`` (``HiSparseHostPoolMixin``) + the coordinator's table and call sites, as
    :class:`~kvproof.reference.contract.HostPoolUnderTest`."""

    components = frozenset({Component.HISPARSE_HOST})
    findings = FINDINGS  # what kvproof found in it, matched by evidence (docs/sglang-findings.md)
    capabilities = CAPABILITIES
    device = torch.device("cpu")

    def __init__(self, config: HostPoolConfig) -> None:
        if config.coordinator is not Coordinator.PAGED:
            raise ConfigError("HostPoolConfig", "coordinator", f"SGLang {SGLANG_VERSION} has the paged "
                              f"coordinator (#23606) only, got {config.coordinator.value}")
        self.sglang = load_sglang_host()
        self.version = f"sglang {self.sglang.version}"  # reported as the implementation's version
        self.config, self.page_size = config, config.page_size
        p, rows = config.page_size, config.max_req_slots
        capacity = (config.num_pages - 1) * p  # HostKVCache: page_num = capacity * 1.0 // P + 1 = num_pages
        self.device_pool = self.sglang.MLATokenToKVPool(
            size=capacity, page_size=p, dtype=_I64, kv_lora_rank=1, qk_rope_head_dim=0, layer_num=1, device="cpu",
            enable_memory_saver=False)
        info = self.device_pool.get_device_pool_infos()[0].buffer_info
        with self.sglang.host_memory_budget_scope(HOST_BUDGET_BYTES):
            self.host = self.sglang.MLATokenToKVPoolHost(
                info, host_to_device_ratio=1.0, host_size=0, page_size=p, layout="layer_first", pin_memory=False,
                device="cpu", device_capacity_tokens=capacity, start_layer=self.device_pool.start_layer,
                end_layer=self.device_pool.end_layer, target_layer_num=self.device_pool.layer_num)
        if (self.host.page_num, self.host.size, self.host.page_size) != (config.num_pages, config.size, p):
            raise HarnessBug(f"SGLang sized the host pool {self.host.page_num} pages x {self.host.page_size} = "
                               f"{self.host.size} slots; the config asks {config.num_pages} x {p} = {config.size}")
        # the coordinator's state (HiSparseCoordinator.__init__, compress ratio 1)
        self.req_to_host_pool = torch.full((rows, config.row_width), -1, dtype=_I64)
        self.req_to_host_pool_allocated_len = torch.zeros(rows, dtype=_I64)
        self._skip_first_backup = [False] * rows
        self._data = self.host.data_refs[0]  # [size, 1, 1] int64 view of kv_buffer's only layer

    def __repr__(self) -> str:
        return f"SGLangHostPool(sglang {self.sglang.version} MLATokenToKVPoolHost, {self.config.label()})"

    # ------------------------------------------------------------ the mixin, with the coordinator's table

    def _alloc(self, op: str, req: int, start_pos: int, num_tokens: int) -> torch.Tensor:
        """``alloc_paged_token_slots`` on SGLang's pool; its short-pool ``RuntimeError`` -> ``OutOfMemory``."""
        free_before = self.host.available_size()
        try:
            with _translating_oom():
                return self.host.alloc_paged_token_slots(self.req_to_host_pool, self.req_to_host_pool_allocated_len,
                                                         req, start_pos, num_tokens)
        except RuntimeError as err:
            short = _OOM.search(str(err))
            if short is None:
                raise
            raise OutOfMemory(op, "host", int(short.group(1)), free_before // self.page_size, request=req) from err

    def alloc_paged_token_slots(self, req: int, start_pos: int, num_tokens: int) -> torch.Tensor:
        return self._alloc("alloc_paged_token_slots", req, start_pos, num_tokens)

    def allocated_host_indices(self, req: int) -> torch.Tensor:
        return self.host.allocated_host_indices(self.req_to_host_pool, req, self.req_to_host_pool_allocated_len[req])

    # ------------------------------------------------------------ the coordinator's call sites (§4.5)

    def request_finished(self, req: int) -> None:
        """``HiSparseCoordinator.request_finished``'s host part (also ``abort_staging_request`` / ``retract_req``)."""
        host_indices = self.host.allocated_host_indices(self.req_to_host_pool, req,
                                                        self.req_to_host_pool_allocated_len[req])
        if host_indices.numel() > 0:
            self.host.free(host_indices)
        self.req_to_host_pool[req, :] = -1
        self.req_to_host_pool_allocated_len[req] = 0
        self._skip_first_backup[req] = False

    def _copy(self, host_indices: torch.Tensor, values: torch.Tensor) -> None:
        """The device->host copy (synchronous): one int64 per host slot in SGLang's host KV buffer."""
        self._data[host_indices.to("cpu", _I64), 0, 0] = values

    def admit_request_into_staging(self, req: int, values: torch.Tensor) -> torch.Tensor:
        """Host slots for the prefill, the staging copy, then ``collect_ready_reqs``' skip flag."""
        vals = _ints(values)
        host_indices = self._alloc("admit_request_into_staging", req, 0, vals.numel())
        self._copy(host_indices, vals)
        self._skip_first_backup[req] = True  # collect_ready_reqs, once the staging copy's event completed
        return host_indices

    def eager_backup_previous_token(self, reqs: torch.Tensor, seq_lens: torch.Tensor,
                                    values: torch.Tensor) -> torch.Tensor:
        """``_eager_backup_previous_token`` with compress ratio 1, in SGLang's order (not failure-atomic)."""
        op = "eager_backup_previous_token"
        req_cpu, seq_cpu, vals = _ints(reqs), _ints(seq_lens), _ints(values)
        backup_indices = []
        for i in range(len(seq_cpu)):  # every flag of the batch is consumed before any allocation
            req_idx = int(req_cpu[i])
            if self._skip_first_backup[req_idx]:
                self._skip_first_backup[req_idx] = False
                continue
            if (int(seq_cpu[i]) - 1) % 1 == 0:  # compress ratio 1: every step produced a token
                backup_indices.append(i)
        if not backup_indices:
            return torch.empty((0,), dtype=_I64, device=self.device)
        host_locs_list: list[torch.Tensor] = []
        free_before = self.host.available_size()
        for i in backup_indices:
            req_idx = int(req_cpu[i])
            start_pos = (int(seq_cpu[i]) - 1) // 1 - 1
            try:
                host_locs_list.append(self._alloc(op, req_idx, start_pos, 1))
            except OutOfMemory as oom:  # SGLang raised midway through the batch: report, do not repair
                taken = (free_before - self.host.available_size()) // self.page_size
                if taken:
                    done = [int(req_cpu[j]) for j in backup_indices[:len(host_locs_list)]]
                    note = (f"SGLang did not roll back: request slots {done} of this batch kept the {taken} page(s) "
                            "they took; the batch's skip-first-backup flags are cleared")
                    oom.args = (f"{oom.args[0]} [{note}]",)
                raise
        host_locs = torch.cat(host_locs_list)
        self._copy(host_locs, vals[backup_indices])
        return host_locs

    # ------------------------------------------------------------ observation

    def available_size(self) -> int:
        return int(self.host.available_size())

    def get_host_data(self, slots: torch.Tensor) -> torch.Tensor:
        return self._data[slots.to("cpu", _I64), 0, 0].clone()

    def free_list(self) -> torch.Tensor:
        """SGLang's free list in hand-out order: ``free_slots`` then the freed runs parked in ``release_slots``."""
        return torch.cat([self.host.free_slots.reshape(-1), *[s.reshape(-1) for s in self.host.release_slots]])

    def snapshot(self) -> HostPoolSnapshot:
        return HostPoolSnapshot(page_size=self.host.page_size, size=int(self.host.size),
                                free_slots=tuple(int(x) for x in self.free_list().tolist()),
                                allocated_len=tuple(int(x) for x in self.req_to_host_pool_allocated_len.tolist()),
                                rows=tuple(tuple(int(x) for x in row) for row in self.req_to_host_pool.tolist()))
