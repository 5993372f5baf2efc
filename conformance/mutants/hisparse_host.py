"""Deliberately broken variants of the torch HiSparse host pool (sglang_semantics.md §4.4-§4.8, H0-H4).

Each mutant is a subclass of :class:`~kvproof.gpu_runtime.hisparse_host.HiSparseHostPool`
with one small override reproducing a real or plausible bug of the paged host pool:
the pre-#23606 coordinator, page arithmetic off by a rounding, a release path that
breaks H0 or H3, upstream's non-atomic failure, a dropped precondition. The
``hisparse_host`` lockstep suite must kill every one (``kvproof mutants``);
``tests/conformance/test_hisparse_host.py`` also runs the short differing sequence
named in each docstring.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvproof.gpu_runtime.hisparse_host import HiSparseHostPool
from kvproof.reference.arith import ceil_p
from kvproof.reference.errors import OutOfMemory

__all__ = ["MUTANTS"]

Tensor = torch.Tensor
_I64 = torch.int64


class TokenGranularStaging(HiSparseHostPool):
    """The pre-#23606 staging: ``alloc(prefill_len)`` token-granular, the row written explicitly (§4.7).

    Upstream with P_h > 1 this trips ``alloc``'s page assertion; this variant takes
    exactly ``n`` slots anyway (the P_h = 1 behaviour), so the allocated length is not
    a page multiple (H1) and the released slots break the free list's pages (H0).
    Differs: P=4, staging 5 tokens: allocated length 5, not 8.
    """

    def admit_request_into_staging(self, req: int, values: Sequence[int] | Tensor) -> Tensor:
        vals = torch.as_tensor(values, dtype=_I64).reshape(-1)
        n = vals.numel()
        self._check_staging(req, n)
        if n > self._count:
            raise OutOfMemory("admit_request_into_staging", "host", -(-n // self.page_size),
                              self._count // self.page_size, request=req)
        idx = (self._head + torch.arange(n, dtype=_I64)) % self.size
        slots = self._ring[idx]
        self._head, self._count = (self._head + n) % self.size, self._count - n
        self.req_to_host_pool[req, :n] = slots.to(self.device)
        self.allocated_len[req] = n
        self.set_host_data(slots, vals)
        self.skip_first_backup[req] = True
        return self.req_to_host_pool[req, :n]


class FloorNewPages(HiSparseHostPool):
    """New pages counted as ``floor((end - a) / P)``: the last partial page is never allocated.

    The returned slots past the allocated length are -1 (H1: covers the request).
    Differs: P=4, ``alloc_paged_token_slots(r, 0, 5)``: one page, allocated length 4.
    """

    def _new_pages(self, allocated_len: int, end: int) -> int:
        return max(0, end - allocated_len) // self.page_size


class ReleaseKeepsLength(HiSparseHostPool):
    """``request_finished`` frees the pages and resets the row but not ``allocated_len`` (H3).

    The next request in that slot finds ``pe <= a`` and receives -1 (or, with the
    row not reset, the previous owner's) slots without allocating (§4.6 H3).
    Differs: stage 4 tokens at P=4, finish: allocated length stays 4.
    """

    def request_finished(self, req: int) -> None:
        kept = int(self.allocated_len[req])
        super().request_finished(req)
        self.allocated_len[req] = kept


class ReleaseReversed(HiSparseHostPool):
    """The release appends the host slots in reverse order (e.g. a descending sort before ``free``).

    The free list stops being aligned page runs in order (H0); the next ``alloc_page``
    hands out a "page" whose slots run backwards, so rows stop being aligned pages (H1).
    Differs: P=4, stage 4 tokens, finish: the free list ends ..., 3, 2, 1, 0.
    """

    def free(self, slots: Tensor) -> int:
        return super().free(slots.to("cpu", _I64).reshape(-1).flip(0))


class BackupNotAtomic(HiSparseHostPool):
    """Upstream's eager backup: requests are served in batch order and the first short one raises.

    The pages taken for the earlier requests stay taken when the batch fails with
    ``OutOfMemory`` (kvproof requires all-or-nothing, §4.8: the raise comes from inside
    the scheduler step). Differs: two requests each opening a page with one page free.
    """

    def eager_backup_previous_token(self, reqs: Sequence[int] | Tensor, seq_lens: Sequence[int] | Tensor,
                                    values: Sequence[int] | Tensor) -> Tensor:
        r = torch.as_tensor(reqs, dtype=_I64).reshape(-1).tolist()
        s = torch.as_tensor(seq_lens, dtype=_I64).reshape(-1).tolist()
        v = torch.as_tensor(values, dtype=_I64).reshape(-1).tolist()
        kept = [(q, sl, val) for q, sl, val in zip(r, s, v, strict=True) if not bool(self.skip_first_backup[q])]
        opens = [q for q, sl, _ in kept if sl - 2 == int(self.allocated_len[q])]
        if len(opens) * self.page_size > self._count:  # serve the ones that fit, then fail like upstream
            for q in opens[: self._count // self.page_size]:
                self.alloc_paged_token_slots(q, int(self.allocated_len[q]), 1)
            raise OutOfMemory("eager_backup_previous_token", "host", 1, 0, request=opens[-1])
        return super().eager_backup_previous_token(reqs, seq_lens, values)


class NoHoleCheck(HiSparseHostPool):
    """The ``start_pos <= allocated`` assertion dropped: a range past the allocated length is accepted.

    The pages for the gap ``[a, start)`` are reserved and never written (H4: no holes).
    Differs: P=4, stage 4 tokens, ``alloc_paged_token_slots(r, 9, 1)`` succeeds.
    """

    def alloc_paged_token_slots(self, req: int, start_pos: int, num_tokens: int) -> Tensor:
        a = int(self.allocated_len[req]) if 0 <= req < self.config.max_req_slots else 0
        if num_tokens > 0 and start_pos > a and ceil_p(start_pos + num_tokens, self.page_size) <= self.config.row_width:
            return super().alloc_paged_token_slots(req, a, start_pos + num_tokens - a)[start_pos - a:]
        return super().alloc_paged_token_slots(req, start_pos, num_tokens)


class NoSkipFirstBackup(HiSparseHostPool):
    """The first backup after admission is not skipped: position ``n - 1`` of the staged prefill is
    overwritten with whatever the device buffer holds at that step (§4.5 ``_skip_first_backup``).

    Differs: stage 3 tokens, backup at seq_len 4: host data of position 2 changes.
    """

    def admit_request_into_staging(self, req: int, values: Sequence[int] | Tensor) -> Tensor:
        slots = super().admit_request_into_staging(req, values)
        self.skip_first_backup[req] = False
        return slots


class UnpaddedRow(HiSparseHostPool):
    """``req_to_host_pool`` rows of width ``max_context_len`` without the ``+ P_h`` padding (§4.3).

    A request whose rounded end passes ``max_context_len`` is refused (or, upstream,
    its page slice is silently truncated). Differs: P=4, max_context_len 14, staging
    14 tokens (rounded end 16 > 14).
    """

    def alloc_paged_token_slots(self, req: int, start_pos: int, num_tokens: int) -> Tensor:
        end = start_pos + num_tokens
        if num_tokens > 0 and ceil_p(end, self.page_size) > self.config.max_context_len:
            raise OutOfMemory("alloc_paged_token_slots", "host row", 1, 0, request=req)
        return super().alloc_paged_token_slots(req, start_pos, num_tokens)


#: name -> factory ``HostPoolConfig -> HostPoolUnderTest``; the suite must kill every one.
MUTANTS = {
    "token_granular_staging": TokenGranularStaging,
    "floor_new_pages": FloorNewPages,
    "release_keeps_length": ReleaseKeepsLength,
    "release_reversed": ReleaseReversed,
    "backup_not_atomic": BackupNotAtomic,
    "no_hole_check": NoHoleCheck,
    "no_skip_first_backup": NoSkipFirstBackup,
    "unpadded_row": UnpaddedRow,
}
