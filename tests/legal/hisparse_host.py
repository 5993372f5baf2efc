"""A legal HiSparse host pool written from the contract (``HostPoolUnderTest``), not from kvproof's runtime.

What it keeps (sglang_semantics.md §4, docs/contract.md):

* a host pool of ``num_pages * P_h`` token slots, slot 0 *not* reserved (§4.2), whose
  free list is always whole aligned host pages (H0, §4.6);
* the request table ``req_to_host_pool``: one row per request slot, ``max_context_len + P_h``
  wide, valid exactly below its allocated length, which grows by whole host pages
  (#23606, §4.3, §4.4: ``alloc_paged_token_slots``);
* the coordinator's call sites (§4.5): staging a prefill, the eager backup of the previous
  token of a decode batch (the first backup after admission is skipped), release;
* one int64 of host data per host slot.

A backup batch is all-or-nothing (``ATOMIC_BACKUP_BATCH``): it counts the pages of the
whole batch before it takes any. Page reuse is the policy parameter, as for the legal
SWA allocator: :func:`fifo` (released pages at the back; SGLang's free list, §4.2),
:func:`lifo` (at the front), :func:`randomized` (each released page at a seeded random
page boundary). Neither ``EXACT_PAGE_ORDER`` nor ``REJECTS_MISUSE`` is declared.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Sequence

import torch

from kvproof.reference.contract import Capability
from kvproof.reference.errors import OutOfMemory
from kvproof.reference.hisparse_host import HostPoolConfig, HostPoolSnapshot
from kvproof.reference.registry import Component

from .swa_allocator import Policy

__all__ = ["LegalHostPool", "fifo", "lifo", "randomized"]


class LegalHostPool:
    """Host pool, request table and coordinator calls with a page-reuse policy."""

    capabilities = frozenset({Capability.ATOMIC_BACKUP_BATCH})
    components = frozenset({Component.HISPARSE_HOST})
    device = torch.device("cpu")

    def __init__(self, config: HostPoolConfig, policy: Policy = Policy.FIFO, seed: int = 0) -> None:
        self.config, self.p, self.policy = config, config.page_size, policy
        self.version = f"legal-{policy.value}"
        self._rng = random.Random(seed)
        self.free: list[int] = list(range(config.size))
        self.rows: list[list[int]] = [[] for _ in range(config.max_req_slots)]
        self.skip = [False] * config.max_req_slots
        self.data = torch.full((config.size,), -1, dtype=torch.int64)

    # ------------------------------------------------------------ pool and table (§4.2-§4.4)

    def available_size(self) -> int:
        """Free host *slots* (tokens), a multiple of P_h."""
        return len(self.free)

    def _pages_for(self, req: int, start_pos: int, num_tokens: int) -> int:
        """New host pages ``[start_pos, start_pos + num_tokens)`` needs: the row grows to ``ceil_P(end)``."""
        if num_tokens <= 0:
            return 0
        end = -(-(start_pos + num_tokens) // self.p) * self.p
        return max(0, end - len(self.rows[req])) // self.p

    def _release(self, slots: Sequence[int]) -> None:
        pages = [list(slots[i:i + self.p]) for i in range(0, len(slots), self.p)]
        if self.policy is Policy.FIFO:
            for page in pages:
                self.free.extend(page)
        elif self.policy is Policy.LIFO:
            self.free[:0] = [s for page in pages for s in page]
        else:
            for page in pages:
                at = self._rng.randrange(len(self.free) // self.p + 1) * self.p  # a page boundary (H0)
                self.free[at:at] = page

    def alloc_paged_token_slots(self, req: int, start_pos: int, num_tokens: int) -> torch.Tensor:
        """The row's host slots for the positions, after growing it by whole pages from the free list's front."""
        if num_tokens <= 0:
            return torch.zeros(0, dtype=torch.int64)
        k = self._pages_for(req, start_pos, num_tokens)
        if k * self.p > len(self.free):
            raise OutOfMemory("alloc_paged_token_slots", "host", k, len(self.free) // self.p, request=req)
        taken, self.free = self.free[:k * self.p], self.free[k * self.p:]
        self.rows[req] += taken
        return torch.tensor(self.rows[req][start_pos:start_pos + num_tokens], dtype=torch.int64)

    def allocated_host_indices(self, req: int) -> torch.Tensor:
        return torch.tensor(self.rows[req], dtype=torch.int64)

    def request_finished(self, req: int) -> None:
        """Host pages back, row emptied (-1), length 0, skip flag cleared (§4.5)."""
        self._release(self.rows[req])
        self.rows[req], self.skip[req] = [], False

    # ------------------------------------------------------------ coordinator (§4.5)

    def admit_request_into_staging(self, req: int, values: torch.Tensor) -> torch.Tensor:
        """Stage a prefill of ``len(values)`` tokens into the empty row ``req``; its first backup is skipped."""
        slots = self.alloc_paged_token_slots(req, 0, values.numel())
        self.data[slots] = values.reshape(-1).to(torch.int64)
        self.skip[req] = True
        return slots

    def eager_backup_previous_token(self, reqs: torch.Tensor, seq_lens: torch.Tensor,
                                    values: torch.Tensor) -> torch.Tensor:
        """Back up position ``seq_len - 2`` of each request not skipped; all or nothing (pages counted first)."""
        rs, ss, vs = (_ints(t) for t in (reqs, seq_lens, values))
        kept = [(r, s - 2, v) for r, s, v in zip(rs, ss, vs, strict=True) if not self.skip[r]]
        need = sum(self._pages_for(r, pos, 1) for r, pos, _ in kept)
        if need * self.p > len(self.free):
            short = next(r for r, pos, _ in kept if self._pages_for(r, pos, 1))
            raise OutOfMemory("eager_backup_previous_token", "host", need, len(self.free) // self.p, request=short)
        for r in rs:
            self.skip[r] = False
        written: list[int] = []
        for r, pos, v in kept:
            (slot,) = _ints(self.alloc_paged_token_slots(r, pos, 1))
            self.data[slot] = v
            written.append(slot)
        return torch.tensor(written, dtype=torch.int64)

    def get_host_data(self, slots: torch.Tensor) -> torch.Tensor:
        """One int64 per host slot, on the CPU (a copy: the caller owns it)."""
        return self.data[slots.reshape(-1).to(torch.int64)].clone()

    def snapshot(self) -> HostPoolSnapshot:
        """Free list in hand-out order, allocated lengths, whole rows (-1 past the allocated length)."""
        width = self.config.row_width
        return HostPoolSnapshot(page_size=self.p, size=self.config.size, free_slots=tuple(self.free),
                                allocated_len=tuple(len(r) for r in self.rows),
                                rows=tuple(tuple(r) + (-1,) * (width - len(r)) for r in self.rows))


def _ints(t: torch.Tensor) -> list[int]:
    return [int(x) for x in t.reshape(-1).tolist()]


def fifo(config: HostPoolConfig) -> LegalHostPool:
    return LegalHostPool(config, Policy.FIFO)


def lifo(config: HostPoolConfig) -> LegalHostPool:
    return LegalHostPool(config, Policy.LIFO)


def randomized(config: HostPoolConfig) -> LegalHostPool:
    return LegalHostPool(config, Policy.RANDOMIZED, seed=zlib.crc32(config.label().encode()))
