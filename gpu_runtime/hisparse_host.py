"""HiSparse host pool over torch tensors: host buffers on the CPU, the request table on the device.

Models PR #23606 (sglang_semantics.md §4): ``HostKVCache`` with host page size P_h
(§4.2), the coordinator's ``req_to_host_pool`` / ``req_to_host_pool_allocated_len``
(§4.3), ``HiSparseHostPoolMixin`` (§4.4) and the coordinator call sites (§4.5), with
the observable behaviour of ``kvproof.reference.hisparse_host`` (coordinator
``PAGED`` only; the pre-#23606 coordinator is a mutant,
``kvproof.conformance.mutants.hisparse_host``).

State:

* ``free_slots``: the FIFO free list of host token slots, a ring over one CPU int64
  buffer of ``size`` entries (``[head, head + count)`` mod ``size``): taking and
  returning slots cost O(slots moved), not O(pool) as ``torch.cat`` does;
* ``req_to_host_pool``: int64 ``[max_req_slots, max_context_len + P_h]`` on the device,
  -1 where no host slot; ``allocated_len``: int64 per request slot on the CPU;
* ``host_data``: the host buffer, int64 per host slot on the CPU (a stand-in for the
  per-layer KV rows: one value per token is enough to see data move or get lost);
* ``skip_first_backup``: bool per request slot on the CPU.

The per-step eager backup is vectorised: one page per request whose backed-up position
opens a page, all taken from the free list at once and scattered into the rows.
Every operation validates before it changes anything and raises the reference's typed
errors (``OutOfMemory`` names the request and the pages asked).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvproof.gpu_runtime.paged import resolve_device
from kvproof.reference.arith import ceil_p
from kvproof.reference.contract import Capability
from kvproof.reference.errors import ConfigError, OutOfMemory, require
from kvproof.reference.hisparse_host import Coordinator, HostPoolConfig, HostPoolSnapshot
from kvproof.reference.registry import Component

__all__ = ["HiSparseHostPool"]

Tensor = torch.Tensor
_I64 = torch.int64


class HiSparseHostPool:
    """The host pool, its request table and the coordinator's staging / backup / release."""

    capabilities = frozenset({Capability.REJECTS_MISUSE, Capability.EXACT_PAGE_ORDER, Capability.ATOMIC_BACKUP_BATCH})
    components = frozenset({Component.HISPARSE_HOST})

    def __init__(self, config: HostPoolConfig, device: torch.device | str | None = None) -> None:
        if config.coordinator is not Coordinator.PAGED:
            raise ConfigError("HostPoolConfig", "coordinator",
                              f"the runtime implements the PAGED coordinator only, got {config.coordinator.value}")
        self.config = config
        self.device = resolve_device(device)
        self.page_size = config.page_size
        self.size = config.size
        self._ring = torch.arange(self.size, dtype=_I64)
        self._head, self._count = 0, self.size
        self.req_to_host_pool = torch.full((config.max_req_slots, config.row_width), -1, dtype=_I64,
                                           device=self.device)
        self.allocated_len = torch.zeros(config.max_req_slots, dtype=_I64)
        self.host_data = torch.zeros(self.size, dtype=_I64)
        self.skip_first_backup = torch.zeros(config.max_req_slots, dtype=torch.bool)

    # ------------------------------------------------------------ queries

    def available_size(self) -> int:
        return self._count

    def free_slots(self) -> Tensor:
        """The free list in hand-out order (a copy)."""
        idx = (self._head + torch.arange(self._count, dtype=_I64)) % self.size
        return self._ring[idx]

    def allocated_host_indices(self, req: int) -> Tensor:
        """The valid host slots of request slot ``req`` (entries ``>= 0`` of its row, §4.4)."""
        self._check_req("allocated_host_indices", req)
        n = min(ceil_p(int(self.allocated_len[req]), self.page_size), self.config.row_width)
        row = self.req_to_host_pool[req, :n]
        return row[row >= 0]

    def get_host_data(self, slots: Tensor) -> Tensor:
        return self.host_data[slots.to("cpu", _I64)]

    def snapshot(self) -> HostPoolSnapshot:
        rows = self.req_to_host_pool.cpu()
        return HostPoolSnapshot(page_size=self.page_size, size=self.size,
                                free_slots=tuple(self.free_slots().tolist()),
                                allocated_len=tuple(self.allocated_len.tolist()),
                                rows=tuple(tuple(r) for r in rows.tolist()))

    # ------------------------------------------------------------ the pool (§4.2)

    def alloc(self, need_size: int, *, req: int | None = None) -> Tensor:
        """The first ``need_size`` free slots (whole pages only), CPU int64."""
        op, p = "alloc", self.page_size
        require(need_size >= 0, op, "need_size", f"must be >= 0, got {need_size}")
        # the page rule: the host pool hands out whole pages only
        require(need_size % p == 0, op, "need_size", f"{need_size} is not a multiple of page_size {p} (page rule)")
        if need_size > self._count:
            raise OutOfMemory(op, "host", need_size // p, self._count // p, request=req)
        idx = (self._head + torch.arange(need_size, dtype=_I64)) % self.size
        taken = self._ring[idx]
        self._head, self._count = (self._head + need_size) % self.size, self._count - need_size
        return taken

    def alloc_page(self, k: int, *, req: int | None = None) -> Tensor:
        require(k >= 0, "alloc_page", "k", f"must be >= 0, got {k}")
        return self.alloc(k * self.page_size, req=req)

    def free(self, slots: Tensor) -> int:
        """Append ``slots`` to the free list (upstream: no checks, §4.2)."""
        slots = slots.to("cpu", _I64).reshape(-1)
        n = slots.numel()
        idx = (self._head + self._count + torch.arange(n, dtype=_I64)) % self.size
        self._ring[idx] = slots
        self._count += n
        return n

    # ------------------------------------------------------------ the mixin (§4.4)

    def alloc_paged_token_slots(self, req: int, start_pos: int, num_tokens: int) -> Tensor:
        """Token slots ``[start_pos, start_pos + num_tokens)`` of ``req``, extending its row by whole pages."""
        op, p = "alloc_paged_token_slots", self.page_size
        self._check_req(op, req)
        if num_tokens <= 0:  # upstream returns an empty tensor before any other check
            return torch.empty(0, dtype=_I64, device=self.device)
        require(start_pos >= 0, op, "start_pos", f"must be >= 0, got {start_pos}")
        a = int(self.allocated_len[req])
        # no holes: a request's host row is filled left to right
        require(start_pos <= a, op, "start_pos", f"{start_pos} > allocated length {a} of request {req} (hole)")
        end = start_pos + num_tokens
        pe = ceil_p(end, p)
        # the rounded end must fit the row
        require(pe <= self.config.row_width, op, "num_tokens",
                f"end {end} rounds up to {pe} > row width {self.config.row_width}")
        k = self._new_pages(a, end)
        if k:
            pages = self.alloc_page(k, req=req)
            self.req_to_host_pool[req, a:a + k * p] = pages.to(self.device, non_blocking=True)
            self.allocated_len[req] = a + k * p
        return self.req_to_host_pool[req, start_pos:end]

    def _new_pages(self, allocated_len: int, end: int) -> int:
        """Pages to add so the row covers ``end``: ``(ceil_P(end) - a) / P`` when positive."""
        return max(0, ceil_p(end, self.page_size) - allocated_len) // self.page_size

    # ------------------------------------------------------------ coordinator (§4.5)

    def request_finished(self, req: int) -> None:
        """Pages back to the pool, row reset to -1, length 0, skip flag cleared."""
        self._check_req("request_finished", req)
        host = self.allocated_host_indices(req)
        if host.numel():
            self.free(host)
        self.req_to_host_pool[req, :] = -1
        self.allocated_len[req] = 0
        self.skip_first_backup[req] = False

    def set_host_data(self, slots: Tensor, values: Sequence[int] | Tensor) -> None:
        """The device-to-host copy (synchronous here)."""
        vals = torch.as_tensor(values, dtype=_I64).reshape(-1)
        slots = slots.to("cpu", _I64).reshape(-1)
        require(slots.numel() == vals.numel(), "set_host_data", "values",
                f"{vals.numel()} values for {slots.numel()} slots")
        self.host_data[slots] = vals

    def admit_request_into_staging(self, req: int, values: Sequence[int] | Tensor) -> Tensor:
        """``alloc_paged_token_slots(req, 0, n)`` for a prefill of ``n`` tokens, copy, flag the first backup."""
        vals = torch.as_tensor(values, dtype=_I64).reshape(-1)
        self._check_staging(req, vals.numel())
        slots = self.alloc_paged_token_slots(req, 0, vals.numel())
        self.set_host_data(slots, vals)
        self.skip_first_backup[req] = True
        return slots

    def _check_staging(self, req: int, n: int) -> None:
        op = "admit_request_into_staging"
        self._check_req(op, req)
        require(n >= 1, op, "values", "a prefill has at least one token")
        # H3: staging starts from an empty row
        require(int(self.allocated_len[req]) == 0, op, "req",
                f"request slot {req} still holds {int(self.allocated_len[req])} host slots")
        require(n <= self.config.max_context_len, op, "values",
                f"{n} tokens > max_context_len {self.config.max_context_len}")

    def eager_backup_previous_token(self, reqs: Sequence[int] | Tensor, seq_lens: Sequence[int] | Tensor,
                                    values: Sequence[int] | Tensor) -> Tensor:
        """Back up position ``seq_len - 2`` of each running request, one vectorised page allocation."""
        op, p = "eager_backup_previous_token", self.page_size
        r = torch.as_tensor(reqs, dtype=_I64).reshape(-1).cpu()
        s = torch.as_tensor(seq_lens, dtype=_I64).reshape(-1).cpu()
        v = torch.as_tensor(values, dtype=_I64).reshape(-1).cpu()
        require(r.numel() == s.numel() == v.numel(), op, "seq_lens",
                f"{r.numel()} requests, {s.numel()} seq_lens, {v.numel()} values")
        require(torch.unique(r).numel() == r.numel(), op, "reqs", lambda: f"duplicate request slots in {r.tolist()}")
        n_req = self.config.max_req_slots
        out_of_range = (r < 0) | (r >= n_req)
        # request slots index req_to_host_pool's rows
        require(not bool(out_of_range.any()), op, "req",
                lambda: f"request slot {r[out_of_range].tolist()[:1]} out of range [0, {n_req})")
        a = self.allocated_len[r]
        # the request is staged and its previous token exists
        staged = (a > 0) & (s >= 2)
        require(bool(staged.all()), op, "seq_lens",
                lambda: f"request slots {r[~staged].tolist()} have no previous token to back up")
        kept = ~self.skip_first_backup[r]
        rk, pos, vk, ak = r[kept], s[kept] - 2, v[kept], a[kept]
        # H4: the backed-up position is at most the allocated length (no hole)
        require(bool((pos <= ak).all()), op, "seq_lens", lambda: f"positions {pos[pos > ak].tolist()} of request slots "
                f"{rk[pos > ak].tolist()} pass their allocated lengths (hole)")
        require(bool(((pos < ak) | (ak + p <= self.config.row_width)).all()), op, "seq_lens",
                f"a backed-up position rounds past the row width {self.config.row_width}")
        opens = pos == ak  # the position starts a new page (start <= a, one token)
        k = int(opens.sum())
        if k * p > self._count:
            raise OutOfMemory(op, "host", k, self._count // p, request=int(rk[opens][0]))
        self.skip_first_backup[r] = False
        if k:
            pages = self.alloc_page(k).reshape(k, p)
            ro, ao = rk[opens], ak[opens]
            cols = ao.unsqueeze(1) + torch.arange(p, dtype=_I64)
            self.req_to_host_pool[ro.to(self.device).unsqueeze(1), cols.to(self.device)] = pages.to(self.device)
            self.allocated_len[ro] = ao + p
        slots = self.req_to_host_pool[rk.to(self.device), pos.to(self.device)]
        self.set_host_data(slots, vk)
        return slots

    # ------------------------------------------------------------ helpers

    def _check_req(self, op: str, req: int) -> None:
        # request slots index req_to_host_pool's rows
        require(0 <= req < self.config.max_req_slots, op, "req",
                f"request slot {req} out of range [0, {self.config.max_req_slots})")
