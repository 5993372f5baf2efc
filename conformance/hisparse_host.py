"""Lockstep state machine for the ``hisparse_host`` component (sglang_semantics.md §4, §4.6 H0-H4, §9 S7).

The harness plays the HiSparse coordinator of a decode server: requests are admitted
into request slots with a staging backup of their prefill
(``admit_request_into_staging``), decode one token per step with the eager backup of
the previous token (``eager_backup_previous_token``, a batch of running requests),
ask for token slots directly (``alloc_paged_token_slots`` over ranges starting at or
below the allocated length), and finish (``request_finished``). Every operation runs
on the pure reference and on the implementation and must end the same way (success,
``OutOfMemory``, ``InvalidOperation``); a failed operation must change nothing.
Misuse (holes, rows too short, request slots out of range, staging an occupied slot)
is exercised for implementations declaring ``Capability.REJECTS_MISUSE``.

After every step:

* the reference keeps H0-H3 (``check_host_pool``) and the implementation's snapshot
  keeps H0-H2 (``check_host_snapshot``): the free list is whole aligned pages, rows
  are valid exactly below their allocated length and made of aligned host pages,
  slots are disjoint across requests and free + owned partition the pool;
* allocated lengths and available sizes agree (with ``EXACT_PAGE_ORDER``: the free
  list and rows agree slot for slot; otherwise rows agree up to a renaming of pages,
  which H0-H2 make a bijection);
* every host slot the reference holds data for reads back the same value in the
  implementation, through other requests' allocations and releases.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvproof.conformance import strategies as st
from kvproof.conformance.check import Suite
from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.lockstep import Lockstep, MisuseCall, check_after_each_step, index_problem, misuse, operation
from kvproof.reference import hisparse_host as hh
from kvproof.reference.arith import ceil_p
from kvproof.reference.contract import Capability, HostPoolUnderTest
from kvproof.reference.errors import InvariantViolation, OutOfMemory
from kvproof.reference.registry import Component

__all__ = ["HOST_CONFIGS", "SUITE", "HostPoolMachine"]

C = Capability

#: Small host pools on purpose (out of memory is reached): P_h = 1, 2, 3, 4, 8; row
#: widths that are and are not page multiples.
HOST_CONFIGS: tuple[hh.HostPoolConfig, ...] = (
    hh.HostPoolConfig(page_size=1, num_pages=20, max_req_slots=3, max_context_len=9),
    hh.HostPoolConfig(page_size=2, num_pages=12, max_req_slots=3, max_context_len=11),
    hh.HostPoolConfig(page_size=3, num_pages=9, max_req_slots=3, max_context_len=10),
    hh.HostPoolConfig(page_size=4, num_pages=8, max_req_slots=4, max_context_len=14),
    hh.HostPoolConfig(page_size=8, num_pages=6, max_req_slots=3, max_context_len=21),
)


@dataclass
class Running:
    """A request in a request slot: its sequence length (the next backup writes ``seq_len - 2``)."""

    rid: int
    seq_len: int


class HostPoolMachine(Lockstep[hh.HostPoolConfig, HostPoolUnderTest]):
    """The coordinator's calls on the reference and on the implementation, in lockstep."""

    component = Component.HISPARSE_HOST
    snapshot_type = hh.HostPoolSnapshot

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        self.ref = hh.initial_state(self.config)
        self.p = self.config.page_size
        self.running: dict[int, Running] = {}  # request slot -> request
        self.next_rid, self.tag = 1, 0
        self.used_slots: set[int] = set()  # request slots admitted into in this example

    # ------------------------------------------------------------ helpers

    def _values(self, n: int) -> list[int]:
        """``n`` fresh host data values (unique across the run: a lost or moved row cannot go unnoticed)."""
        self.tag += n
        return list(range(self.tag - n + 1, self.tag + 1))

    def _free_slots(self) -> list[int]:
        return [r for r in range(self.config.max_req_slots) if r not in self.running]

    def _backupable(self) -> list[int]:
        """Running requests whose previous token fits the row (longer ones only finish)."""
        width = self.config.row_width
        return [r for r, req in sorted(self.running.items()) if ceil_p(req.seq_len - 1, self.p) <= width]

    def _pre_change(self) -> bool:
        return self.config.coordinator is hh.Coordinator.PRE_23606

    def _coordinator(self, op: str, args: str, ref_call: Callable[[], Any], impl_call: Callable[[], Any]
                     ) -> tuple[Any, Any] | None:
        """A coordinator call; under the pre-#23606 coordinator the reference's own refusal is the finding."""
        try:
            return self.call(op, args, ref_call, impl_call)
        except HarnessBug as err:
            if not self._pre_change():
                raise
            self.fail(f"the pre-#23606 coordinator breaks the page rule: {err.__cause__}")
        return None

    def _check_returned(self, op: str, req: int, positions: list[int], impl_slots: torch.Tensor) -> None:
        """The returned slots are the request's row entries for ``positions``, in position order."""
        self.require_indices(op, impl_slots, len(positions))
        got = [int(x) for x in impl_slots.reshape(-1).tolist()]
        row = self.snapshot().rows[req]
        want = [row[j] for j in positions]
        if got != want:
            self.fail(f"{op} returned host slots {got[:12]} for positions {positions[:12]} of request slot {req}, "
                       f"but the row holds {want[:12]} there")

    # ------------------------------------------------------------ structural coverage

    @classmethod
    def structure(cls, config: hh.HostPoolConfig, na: tuple[str, ...] = ()) -> dict[str, int]:
        """Every request slot running at once and backed up in one batch; a row allocated to its last page; the
        host pool exhausted; a request finished and its slot admitted again in one example."""
        return {"requests running at once": config.max_req_slots,
                "eager_backup_previous_token batch size": config.max_req_slots,
                "host pages of one request": config.row_width // config.transfer_page_size,
                "host pool exhausted": 1, "slots reused per example": 2}

    def measure(self) -> dict[str, int]:
        t = self.config.transfer_page_size
        return {"requests running at once": len(self.running),
                "host pages of one request": max((-(-len(row) // t) for row in self.ref.rows), default=0),
                "host pool exhausted": int(hh.available_size(self.ref) == 0)}

    # ------------------------------------------------------------ rules

    @operation(when=lambda self: self._free_slots(), data=st.data())
    def admit_request_into_staging(self, data: Any) -> None:
        """Admit a request into a free request slot and back up its prefill of ``n`` tokens."""
        r = data.draw(st.sampled_from(self._free_slots()), label="request_slot")
        top, p = self.config.max_context_len, self.p
        edges = sorted({x for k in range(1, 5) for x in (k * p - 1, k * p, k * p + 1)} | {1, top, top - 1})
        n = data.draw(st.one_of(st.sampled_from([x for x in edges if 1 <= x <= top]), st.integers(1, top)),
                      label="prefill_len")
        values = self._values(n)
        rid = self.next_rid
        out = self._coordinator("admit_request_into_staging", f"request {rid} in slot {r}, {n} tokens",
                                lambda: hh.admit_request_into_staging(self.ref, r, values),
                                lambda: self.impl.admit_request_into_staging(r, torch.tensor(values)))
        if out:
            (self.ref, _), impl_slots = out
            if r in self.used_slots:
                self.count("slots reused per example")  # a slot an earlier request of this example held
            self.used_slots.add(r)
            self.next_rid += 1
            self.running[r] = Running(rid, n + 1)
            self._check_returned("admit_request_into_staging", r, list(range(n)), impl_slots)

    @operation(when=lambda self: self._backupable(), data=st.data())
    def eager_backup_previous_token(self, data: Any) -> None:
        """One decode step of a batch: back up each request's previous token, then each decodes one more."""
        batch = data.draw(st.lists(st.sampled_from(self._backupable()), min_size=1, unique=True),
                          label="batch")  # request slots: plain values
        if not self.supports(C.ATOMIC_BACKUP_BATCH):
            batch = self._cut_short_batch(batch)
        self.note("eager_backup_previous_token batch size", len(batch))
        seqs = [self.running[r].seq_len for r in batch]
        values = self._values(len(batch))
        args = ", ".join(f"slot {r}: seq_len {s}" for r, s in zip(batch, seqs, strict=True))
        kept = [(r, s - 2) for r, s in zip(batch, seqs, strict=True) if not self.ref.skip_first_backup[r]]
        out = self._coordinator("eager_backup_previous_token", args,
                                lambda: hh.eager_backup_previous_token(self.ref, batch, seqs, values),
                                lambda: self.impl.eager_backup_previous_token(torch.tensor(batch), torch.tensor(seqs),
                                                                              torch.tensor(values)))
        if out:
            (self.ref, _), impl_slots = out
            for r in batch:
                self.running[r].seq_len += 1
            self.require_indices("eager_backup_previous_token", impl_slots, len(kept))
            got = [int(x) for x in impl_slots.reshape(-1).tolist()]
            rows = self.snapshot().rows
            want = [rows[r][pos] for r, pos in kept]
            if got != want:
                self.fail(f"eager_backup_previous_token returned host slots {got} for (slot, position) {kept}, "
                           f"the rows hold {want} there")

    def _cut_short_batch(self, batch: list[int]) -> list[int]:
        """Without ``ATOMIC_BACKUP_BATCH``: a batch the reference refuses for want of pages becomes one both
        sides handle alike (upstream serves requests in order and raises at the first short one, §4.8):
        the longest prefix the reference accepts, or, with no page free, the first request that opens one."""
        def fits(part: list[int]) -> bool:
            try:
                hh.eager_backup_previous_token(self.ref, part, [self.running[r].seq_len for r in part], [0] * len(part))
            except OutOfMemory:
                return False
            return True

        if fits(batch):
            return batch
        self.stats.rules["eager_backup_previous_token:batch_cut"] += 1
        prefix = next((batch[:n] for n in range(len(batch) - 1, 0, -1) if fits(batch[:n])), [])
        if prefix:
            return prefix
        return next([r] for r in batch if not fits([r]))

    @operation(when=lambda self: self.running, data=st.data())
    def alloc_paged_token_slots(self, data: Any) -> None:
        """Token slots for a range starting at or below the allocated length (overlapping ranges reuse slots)."""
        r = data.draw(st.sampled_from(sorted(self.running)), label="request_slot")
        a, width, p = len(self.ref.rows[r]), self.config.row_width, self.p
        start = data.draw(st.one_of(st.just(a), st.integers(0, a)), label="start_pos")
        room = width - start  # the rounded end must fit the row: end <= floor_P(width)
        top = (start + room) // p * p - start
        n = data.draw(st.integers(0, max(0, min(top, 3 * p + 1))), label="num_tokens")
        out = self.call("alloc_paged_token_slots", f"slot {r}, start_pos {start}, num_tokens {n}",
                        lambda: hh.alloc_paged_token_slots(self.ref, r, start, n),
                        lambda: self.impl.alloc_paged_token_slots(r, start, n))
        if out:
            (self.ref, _), impl_slots = out
            self._check_returned("alloc_paged_token_slots", r, list(range(start, start + n)), impl_slots)

    @operation(when=lambda self: self.running, data=st.data())
    def request_finished(self, data: Any) -> None:
        """Finish (or abort, or retract) a request: its host pages back, its row and length reset."""
        r = data.draw(st.sampled_from(sorted(self.running)), label="request_slot")
        out = self.call("request_finished", f"slot {r} (request {self.running[r].rid})",
                        lambda: (hh.request_finished(self.ref, r), None), lambda: self.impl.request_finished(r))
        if out:
            self.ref = out[0][0]
            del self.running[r]

    def misuse_allowed(self) -> bool:
        """Misuse on every third step only, so that it does not crowd out the lifecycle."""
        return len(self.trace) % 3 == 2

    # ------------------------------------------------------------ the comparison

    @check_after_each_step
    def agrees_with_reference(self) -> None:
        """H0-H3 on both sides, same lengths and sizes, same rows (up to page renaming), same host data."""
        self.stats.steps += 1
        try:
            hh.check_host_pool(self.ref)
        except InvariantViolation as err:
            if not self._pre_change():
                raise
            self.fail(f"the pre-#23606 coordinator breaks {err}")
        snap = self.snapshot()
        try:
            hh.check_host_snapshot(snap, self.config.transfer_page_size)
        except InvariantViolation as err:
            self.fail(f"the implementation breaks {err}")
        mine = hh.snapshot(self.ref)
        if snap.allocated_len != mine.allocated_len:
            self.fail(f"allocated lengths {list(snap.allocated_len)}, reference {list(mine.allocated_len)}")
        available = self.observe("available_size()", self.impl.available_size)
        if available != mine.available_size:
            self.fail(f"available_size() = {available}, reference {mine.available_size}")
        if self.supports(C.EXACT_PAGE_ORDER) and (snap.free_slots, snap.rows) != (mine.free_slots, mine.rows):
            self.fail(f"free list / rows differ from the reference's FIFO order (declared EXACT_PAGE_ORDER): "
                       f"free {snap.free_slots[:12]} vs {mine.free_slots[:12]}")
        self._compare_data(snap, mine)
        self.trace.next_step()

    def _compare_data(self, snap: hh.HostPoolSnapshot, mine: hh.HostPoolSnapshot) -> None:
        """Host data of every row position the request wrote: ``hh.alloc`` forgets the data of every slot it
        hands out (whole pages), so what an earlier owner left is never compared, whatever page an
        implementation reuses (issue 11, observation 1)."""
        where, want = [], []
        for r, row in enumerate(self.ref.rows):
            for j, slot in enumerate(row):
                if self.ref.data[slot] is not None:
                    where.append((r, j))
                    want.append(self.ref.data[slot])
        if not where:
            return
        impl_slots = torch.tensor([snap.rows[r][j] for r, j in where], dtype=torch.int64, device=self.impl.device)
        data = self.observe("get_host_data()", lambda: self.impl.get_host_data(impl_slots))
        problem = index_problem(data, len(where), "cpu")  # host data: int64 on the CPU
        if problem:
            self.fail(f"get_host_data returned {problem}")
        got = [int(x) for x in data.reshape(-1).tolist()]
        bad = [(w, g, v) for w, g, v in zip(where, got, want, strict=True) if g != v]
        if bad:
            (r, j), g, v = bad[0]
            self.fail(f"host data of request slot {r} position {j} reads {g}, written {v} "
                       f"({len(bad)} position(s) differ)")


    # ------------------------------------------------------------ misuse (REJECTS_MISUSE): both sides reject

    @misuse("alloc_paged_token_slots", "hole", when=lambda self: bool(self.running))
    def _hole(self, data: Any) -> MisuseCall:
        r = data.draw(st.sampled_from(sorted(self.running)), label="request_slot")
        start = len(self.ref.rows[r]) + data.draw(st.integers(1, 2 * self.p), label="past")
        return MisuseCall(f"slot {r}, start_pos {start}, num_tokens 1",
                          lambda: hh.alloc_paged_token_slots(self.ref, r, start, 1),
                          lambda: self.impl.alloc_paged_token_slots(r, start, 1))

    @misuse("alloc_paged_token_slots", "row_overflow", when=lambda self: bool(self.running))
    def _row_overflow(self, data: Any) -> MisuseCall:
        r = data.draw(st.sampled_from(sorted(self.running)), label="request_slot")
        width, p = self.config.row_width, self.p
        n = width // p * p + 1  # from 0: rounds up past the row
        return MisuseCall(f"slot {r}, start_pos 0, num_tokens {n}",
                          lambda: hh.alloc_paged_token_slots(self.ref, r, 0, n),
                          lambda: self.impl.alloc_paged_token_slots(r, 0, n))

    @misuse("alloc_paged_token_slots", "slot_out_of_range")
    def _slot_out_of_range(self, data: Any) -> MisuseCall:
        r = data.draw(st.sampled_from([-1, self.config.max_req_slots]), label="request_slot")
        return MisuseCall(f"slot {r}, start_pos 0, num_tokens 1", lambda: hh.alloc_paged_token_slots(self.ref, r, 0, 1),
                          lambda: self.impl.alloc_paged_token_slots(r, 0, 1))

    @misuse("admit_request_into_staging", "stage_occupied", when=lambda self: bool(self.running))
    def _stage_occupied(self, data: Any) -> MisuseCall:
        r = data.draw(st.sampled_from(sorted(self.running)), label="request_slot")
        values = self._values(1)
        return MisuseCall(f"slot {r} (occupied), 1 token", lambda: hh.admit_request_into_staging(self.ref, r, values),
                          lambda: self.impl.admit_request_into_staging(r, torch.tensor(values)))

    @misuse("eager_backup_previous_token", "backup_unstaged", when=lambda self: bool(self._free_slots()))
    def _backup_unstaged(self, data: Any) -> MisuseCall:
        r = data.draw(st.sampled_from(self._free_slots()), label="request_slot")
        values = self._values(1)
        return MisuseCall(f"slot {r} (empty): seq_len 3",
                          lambda: hh.eager_backup_previous_token(self.ref, [r], [3], values),
                          lambda: self.impl.eager_backup_previous_token(torch.tensor([r]), torch.tensor([3]),
                                                                        torch.tensor(values)))


SUITE = Suite(HostPoolMachine, HOST_CONFIGS)
