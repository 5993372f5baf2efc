"""Lockstep state machine for the ``swa_allocator`` component (sglang_semantics.md §1.5, §2.7, §2.8, §7).

Each rule applies one operation -- named exactly like the reference function and
the SGLang method -- to the pure reference and to the implementation under test,
and requires the same outcome class (success, ``OutOfMemory``, ``InvalidOperation``).
After a failed operation the implementation's snapshot must be unchanged. After
every step the invariant compares both sides up to a renaming of pages
(:mod:`kvproof.conformance.compare`), the available sizes, the KV rows of every
live token, and checks the reference's own invariants (G1-G3, M1, M2, M5).

The harness plays the engine: it keeps a table of requests (positions -> reference
full slots), extends them with ``alloc_extend`` / ``alloc_decode``, preallocates
tails with ``alloc_extend_swa_tail``, evicts sliding windows with ``free_swa``,
drafts under ``backup_state``/``restore_state``, retracts requests to CPU copies
and resumes them (``get_cpu_copy`` / ``load_cpu_copy``), and writes KV. Sizes are
biased to page and window boundaries (kP-1, kP, kP+1, W+-1). Misuse is exercised
only for implementations declaring ``Capability.REJECTS_MISUSE``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition, rule

from kvproof.conformance.compare import Divergence, Renaming
from kvproof.conformance.lockstep import HarnessError, LockstepCore, LockstepFailure, Stats
from kvproof.reference.contract import AllocatorFactory, Capability, SWAAllocatorUnderTest
from kvproof.conformance.vector import recorded
from kvproof.reference import swa_allocator as ref
from kvproof.reference.arith import ceil_p, floor_p, swa_tail_len
from kvproof.reference.config import PoolConfig
from kvproof.reference.invariants import check_invariants
from kvproof.reference.snapshot import AllocatorSnapshot

__all__ = ["LockstepMachine", "SWAAllocatorMachine", "RULE_CAPABILITIES", "MISUSE_CASES", "machine_for", "HarnessError", "LockstepFailure"]

C = Capability
#: Capabilities each rule needs; a rule whose needs are not declared is "not applicable".
RULE_CAPABILITIES: dict[str, frozenset[Capability]] = {
    "alloc": frozenset({C.ALLOC}),
    "alloc_extend": frozenset({C.ALLOC_EXTEND}),
    "alloc_decode": frozenset({C.ALLOC_DECODE}),
    "alloc_extend_swa_tail": frozenset({C.ALLOC_EXTEND_SWA_TAIL}),
    "free": frozenset(),
    "free_swa": frozenset(),
    "free_full": frozenset({C.FREE_FULL}),
    "clear": frozenset(),
    "backup_state": frozenset({C.BACKUP_RESTORE}),
    "restore_state": frozenset({C.BACKUP_RESTORE}),
    "set_kv_buffer": frozenset({C.KV_BUFFER}),
    "set_full_to_swa_mapping": frozenset({C.SET_FULL_TO_SWA_MAPPING}),
    "get_cpu_copy": frozenset({C.CPU_COPY}),
    "load_cpu_copy": frozenset({C.CPU_COPY}),
    "misuse": frozenset({C.REJECTS_MISUSE}),
}
_ALLOCATING = (C.ALLOC, C.ALLOC_EXTEND, C.ALLOC_EXTEND_SWA_TAIL)


@dataclass
class Req:
    """A request as the engine sees it: the reference full slot of each position."""

    rid: int
    slots: list[int]


@dataclass
class Retracted:
    """A request copied to CPU and freed, waiting to be resumed (§1.6 retraction)."""

    length: int
    ref_copy: ref.KVCpuCopy
    impl_copy: object


@dataclass
class Pending:
    """What ``backup_state`` saved on both sides plus the harness's request table."""

    ref_backup: ref.AllocatorBackup
    impl_backup: object
    reqs: dict[int, list[int]]


def _sizes(p: int, w: int, top: int) -> st.SearchStrategy[int]:
    """Token counts biased to page and window boundaries, within ``1..top``."""
    edges = {k * p + d for k in range(1, 6) for d in (-1, 0, 1)} | {w - 1, w, w + 1, w + p - 1, w + p, w + p + 1, 1, 2}
    edges = sorted(x for x in edges if 1 <= x <= top)
    return st.one_of(st.sampled_from(edges), st.integers(1, top))


class LockstepMachine(LockstepCore):
    """Lockstep plumbing shared by the component machines: the implementation, the reference allocator,
    the page renaming, the trace, one call on both sides (:meth:`_run`) and the comparison invariant.

    It has no rules of its own; :class:`SWAAllocatorMachine` and the decode-node machine add them.
    """

    factory: ClassVar[AllocatorFactory]
    config: ClassVar[PoolConfig]
    impl: SWAAllocatorUnderTest
    snapshot_type = AllocatorSnapshot

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        self.p, self.w = cfg.page_size, cfg.sliding_window_size
        self.ref = ref.initial_state(cfg)
        self.names = Renaming(self.p, exact=C.EXACT_PAGE_ORDER in self.caps)
        self.reqs: dict[int, Req] = {}
        self.retracted: list[Retracted] = []
        self.pending: Pending | None = None
        self.next_rid, self.tag = 1, 0

    # ------------------------------------------------------------ plumbing

    def _t(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.impl.device)

    def _about_to_change(self, impl_slots: list[int]) -> None:
        """Called before an operation rewrites the mapping of ``impl_slots`` (a subclass may look first)."""

    def _last_loc_tensor(self, values: list[int]) -> torch.Tensor:
        """The ``last_loc`` argument (a subclass may place it at a chosen address)."""
        return self._t(values)

    @staticmethod
    def _cpu(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64)

    def _impl_slots(self, ref_slots: list[int]) -> list[int]:
        return [self.names.impl_slot(s) for s in ref_slots]

    def _new_rid(self) -> int:
        self.next_rid += 1
        return self.next_rid - 1

    def _extendable(self, req: Req) -> bool:
        """A 1:1 extend may continue ``req``: page-aligned, or its last token still has an SWA slot (M5)."""
        return len(req.slots) % self.p == 0 or self.ref.full_to_swa_index_mapping[req.slots[-1]] > 0

    # ------------------------------------------------------------ helpers for allocation and release

    def _max_tokens(self) -> int:
        return self.config.size_swa + self.p  # beyond the SWA pool (tails matter), rarely past the full pool


    def _draw_batch(self, data: st.DataObject, ok: Callable[[Req], bool], *, grow: bool
                    ) -> list[tuple[int, int, int]]:
        """1-3 distinct requests (new ones only when ``grow``) as ``(rid, prefix_len, seq_len)``."""
        batch: list[tuple[int, int, int]] = []
        for _ in range(data.draw(st.integers(1, 3), label="batch_size")):
            candidates = [r for r in self.reqs.values() if ok(r) and r.rid not in {b[0] for b in batch}]
            if grow and (not candidates or data.draw(st.booleans(), label="new_request")):
                batch.append((self._new_rid(), 0, data.draw(_sizes(self.p, self.w, self._max_tokens()), label="seq_len")))
            elif candidates:
                req = data.draw(st.sampled_from(candidates), label="request")
                grow_by = data.draw(_sizes(self.p, self.w, 2 * self.p + 2), label="extend_len") if grow else 1
                batch.append((req.rid, len(req.slots), len(req.slots) + grow_by))
        return batch

    def _extend(self, op: str, batch: list[tuple[int, int, int]]) -> None:
        if not batch:
            return
        rids = [b[0] for b in batch]
        pre, seq = [b[1] for b in batch], [b[2] for b in batch]
        last = [self.reqs[r].slots[-1] if p else -1 for r, p, _ in batch]
        impl_last = [self.names.impl_slot(s) if s >= 0 else -1 for s in last]
        ext = sum(seq) - sum(pre)
        args = ", ".join(f"request {r}: {p}->{s}" for r, p, s in batch)
        if op == "alloc_decode":
            out = self._run(op, args, lambda: ref.alloc_decode(self.ref, seq, last, owners=rids),
                            lambda: self.impl.alloc_decode(self._t(seq), self._cpu(seq),
                                                           self._last_loc_tensor(impl_last)))
        else:
            out = self._run(op, args, lambda: ref.alloc_extend(self.ref, pre, seq, last, ext, owners=rids),
                            lambda: self.impl.alloc_extend(self._t(pre), self._cpu(pre), self._t(seq), self._cpu(seq),
                                                           self._last_loc_tensor(impl_last), ext))
        if out:
            self._adopt(op, out, [(r, self.reqs[r].slots if r in self.reqs else [], s - p) for r, p, s in batch])

    def _adopt(self, op: str, out: tuple[Any, Any], grown: list[tuple[int, list[int], int]]) -> None:
        """Take the new reference state, bind the returned pages, extend the request table."""
        (state, ref_slots), impl_slots = out
        self._require_indices(op, impl_slots, len(ref_slots))
        impl_list = [int(x) for x in impl_slots.reshape(-1).tolist()]
        self.ref = state
        try:
            self.names.bind_full(op, list(ref_slots), impl_list)
        except Divergence as err:
            self._fail(str(err))
        at = 0
        for rid, old, n in grown:
            if n or old:
                self.reqs[rid] = Req(rid, old + list(ref_slots[at:at + n]))
            at += n


    def _swa_released(self) -> list[Req]:
        m = self.ref.full_to_swa_index_mapping
        return [r for _, r in sorted(self.reqs.items()) if all(m[s] == 0 for s in r.slots)]

    def _release(self, op: str, req: Req, ref_slots: list[int], where: str = "all positions") -> None:
        impl_slots = self._impl_slots(ref_slots)
        self._about_to_change(impl_slots)
        call = {"free": (ref.free, self.impl.free), "free_swa": (ref.free_swa, self.impl.free_swa),
                "free_full": (ref.free_full, self.impl.free_full)}[op]
        out = self._run(op, f"request {req.rid}, {where}", lambda: (call[0](self.ref, ref_slots), None),
                        lambda: call[1](self._t(impl_slots)))
        if out:
            self.ref = out[0][0]


    def _swappable(self) -> list[tuple[Req, list[int]]]:
        """Requests with two or more full pages whose live slots all have an SWA slot."""
        m, p, out = self.ref.full_to_swa_index_mapping, self.p, []
        for _, req in sorted(self.reqs.items()):
            pages = sorted({s // p for s in req.slots})
            mapped = [g for g in pages if all(m[s] > 0 for s in req.slots if s // p == g)]
            if len(mapped) >= 2:
                out.append((req, mapped))
        return out

    def _swap(self, req: Req, a: int, b: int, mapping: tuple[int, ...], to_side: Callable[[int], int]
              ) -> tuple[list[int], list[int]]:
        """Full slots of pages a and b (on one side) and their SWA slots with the two SWA pages exchanged."""
        p = self.p
        group = {g: [s for s in req.slots if s // p == g] for g in (a, b)}
        swa_page = {g: mapping[to_side(group[g][0])] // p for g in (a, b)}
        full, swa = [], []
        for g, other in ((a, b), (b, a)):
            for s in group[g]:
                full.append(to_side(s))
                swa.append(swa_page[other] * p + s % p)
        return full, swa

    def _rows(self, n: int) -> tuple[list[list[float]], list[list[float]]]:
        """Fresh rows of small integers (exact in bfloat16): row values identify the write."""
        width, k, v = self.config.kv.row_width, [], []
        for _ in range(n):
            self.tag += 1
            k.append([float((self.tag * 3 + j) % 251 - 125) for j in range(width)])
            v.append([float((self.tag * 5 + j) % 241 - 120) for j in range(width)])
        return k, v

    def _misuse(self, op: str, args: str, ref_call: Callable[[], Any], impl_call: Callable[[], Any]) -> None:
        self._run(op, args, ref_call, impl_call, expect_misuse=True)

    # ------------------------------------------------------------ the invariant

    @invariant()
    def agrees_with_reference(self) -> None:
        """Reference invariants hold; the implementation's state equals it under the renaming; KV rows agree."""
        self.stats.steps += 1
        self._after_step()
        check_invariants(self.ref)
        try:
            snap = self._snapshot()
            self.names.compare(self.ref, snap)
            for what, mine, theirs in (
                ("available_size", ref.available_size(self.ref), self._observe("available_size()", self.impl.available_size)),
                ("full_available_size", ref.full_available_size(self.ref),
                 self._observe("full_available_size()", self.impl.full_available_size)),
                ("swa_available_size", ref.swa_available_size(self.ref),
                 self._observe("swa_available_size()", self.impl.swa_available_size)),
            ):
                if int(theirs) != mine:
                    self._fail(f"{what}() = {theirs}, reference {mine}")
            if self._has(C.KV_BUFFER):
                self._observe("get_kvcache().get_kv_buffer()", self._compare_kv)
        except Divergence as err:
            self._fail(str(err))
        self.trace.next_step()

    def _after_step(self) -> None:
        """Hook run after every step, before the comparison (a subclass may probe)."""

    def _compare_kv(self) -> None:
        geo, m = self.config.kv, self.ref.full_to_swa_index_mapping
        kvpool = self.impl.get_kvcache()
        snap_m = self._snapshot().full_to_swa_index_mapping
        for layer in range(geo.num_layers):
            is_swa = geo.is_swa_layer(layer)
            pairs: list[tuple[int, int, int]] = []  # (ref slot, impl slot, rid)
            for rid, req in sorted(self.reqs.items()):
                for r in req.slots:
                    if is_swa:
                        if m[r] > 0:
                            pairs.append((m[r], snap_m[self.names.impl_slot(r)], rid))
                    else:
                        pairs.append((r, self.names.impl_slot(r), rid))
            want = ref.kv_rows(self.ref, layer, [a for a, _, _ in pairs])
            defined = [(pair, row) for pair, row in zip(pairs, want, strict=True) if row is not None]
            if not defined:
                continue
            k, v = kvpool.get_kv_buffer(layer)
            idx = torch.tensor([b for (_, b, _), _ in defined], dtype=torch.int64, device=k.device)
            got = torch.cat([k[idx].reshape(len(defined), -1), v[idx].reshape(len(defined), -1)], dim=1)
            got_rows = got.float().cpu().tolist()
            for ((a, b, rid), row), have in zip(defined, got_rows, strict=True):
                if tuple(have) != row:
                    kind = "SWA" if is_swa else "full"
                    self._fail(f"KV of layer {layer} ({kind}) for request {rid}: reference slot {a} holds {list(row)}, "
                               f"implementation slot {b} holds {have}")


class SWAAllocatorMachine(LockstepMachine):
    """The ``swa_allocator`` rules: every composite operation, drafts, retraction/resumption, misuse."""

    @precondition(lambda self: self._has(C.ALLOC))
    @rule(pages=st.integers(0, 4))
    @recorded
    def alloc(self, pages: int) -> None:
        n, rid = pages * self.p, self._new_rid()
        self._about_to_change([g * self.p for g in self._snapshot().full.free_pages[:pages]])
        out = self._run("alloc", f"need_size={n}", lambda: ref.alloc(self.ref, n, owner=rid),
                        lambda: self.impl.alloc(n))
        if out:
            self._adopt("alloc", out, [(rid, [], n)])

    @precondition(lambda self: self._has(C.ALLOC_EXTEND))
    @rule(data=st.data())
    @recorded
    def alloc_extend(self, data: st.DataObject) -> None:
        batch = self._draw_batch(data, lambda req: self._extendable(req), grow=True)
        self._extend("alloc_extend", batch)

    @precondition(lambda self: self._has(C.ALLOC_DECODE) and any(self._extendable(r) for r in self.reqs.values()))
    @rule(data=st.data())
    @recorded
    def alloc_decode(self, data: st.DataObject) -> None:
        batch = self._draw_batch(data, lambda req: self._extendable(req), grow=False)
        self._extend("alloc_decode", [(rid, prefix, prefix + 1) for rid, prefix, _ in batch])

    @precondition(lambda self: self._has(C.ALLOC_EXTEND_SWA_TAIL))
    @rule(data=st.data())
    @recorded
    def alloc_extend_swa_tail(self, data: st.DataObject) -> None:
        existing = [r for r in self.reqs.values()]
        req = data.draw(st.sampled_from(existing), label="request") if existing and data.draw(
            st.integers(0, 3), label="extend_existing") == 0 else None
        prefix = len(req.slots) if req else 0
        seq = ceil_p(prefix, self.p) + data.draw(_sizes(self.p, self.w, self._max_tokens()), label="extend_len")
        valid = [t for t in range(seq - prefix + 1) if (seq - t) % self.p == 0]
        natural = swa_tail_len(seq, self.w, self.p)
        tail = natural if natural in valid and data.draw(st.integers(0, 3), label="other_tail") else data.draw(
            st.sampled_from(valid), label="swa_tail_len")
        rid = req.rid if req else self._new_rid()
        self._about_to_change([g * self.p + o for g in self._snapshot().full.free_pages[:2] for o in range(self.p)])
        last = req.slots[-1] if req else -1
        impl_last = self.names.impl_slot(last) if req else -1
        ext = seq - prefix
        out = self._run(
            "alloc_extend_swa_tail", f"prefix={prefix}, seq={seq}, swa_tail_len={tail}, request={rid}",
            lambda: ref.alloc_extend_swa_tail(self.ref, [prefix], [seq], [last], ext, tail, owners=[rid]),
            lambda: self.impl.alloc_extend_swa_tail(self._t([prefix]), self._cpu([prefix]), self._t([seq]),
                                                    self._cpu([seq]), self._last_loc_tensor([impl_last]), ext, tail))
        if out:
            self._adopt("alloc_extend_swa_tail", out, [(rid, req.slots if req else [], ext)])

    @precondition(lambda self: self.reqs and self.pending is None)
    @rule(data=st.data())
    @recorded
    def free(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
        if self._free_request(req):
            self.reqs.pop(req.rid)

    def _free_request(self, req: Req) -> bool:
        """Release all of ``req``: ``free``, or, when the implementation does not declare
        ``FREE_RELEASED_SWA`` and some position's SWA side is gone, ``free_swa`` of the still-mapped
        positions then ``free_full`` (``False``: neither is possible, the request stays)."""
        m = self.ref.full_to_swa_index_mapping
        if self._has(C.FREE_RELEASED_SWA) or all(m[s] > 0 for s in req.slots):
            self._release("free", req, req.slots)
            return True
        if not self._has(C.FREE_FULL):
            self.stats.rules["free:not_applicable"] += 1
            return False
        mapped = [s for s in req.slots if m[s] > 0]
        if mapped:
            self._release("free_swa", req, mapped, "its still-mapped positions")
        self._release("free_full", req, req.slots)
        return True

    @precondition(lambda self: self.reqs and self.pending is None)
    @rule(data=st.data())
    @recorded
    def free_swa(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
        last_page_start = floor_p(len(req.slots) - 1, self.p)
        if last_page_start == 0 or data.draw(st.integers(0, 5), label="release_all") == 0:
            lo, hi = 0, len(req.slots)  # whole request, e.g. before free_full
        elif data.draw(st.booleans(), label="window_rule"):
            lo, hi = 0, max(1, floor_p(max(0, len(req.slots) - 1 - self.w - self.p), self.p))  # _evict_swa (§1.6)
        else:
            hi = data.draw(st.integers(1, last_page_start), label="evict_end")
            lo = data.draw(st.integers(0, hi - 1), label="evict_start")
        slots = req.slots[lo:hi]
        if not self._has(C.FREE_RELEASED_SWA):  # only positions whose SWA side is still there
            m = self.ref.full_to_swa_index_mapping
            slots = [s for s in slots if m[s] > 0]
            if not slots:
                self.stats.rules["free_swa:not_applicable"] += 1
                return
        self._release("free_swa", req, slots, f"positions [{lo}, {hi})")

    @precondition(lambda self: self._has(C.FREE_FULL) and self.pending is None and self._swa_released())
    @rule(data=st.data())
    @recorded
    def free_full(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self._swa_released()), label="request")
        self._release("free_full", req, req.slots)
        self.reqs.pop(req.rid)

    @precondition(lambda self: len(self.reqs) >= 2)  # clearing an almost empty pool teaches nothing
    @rule()
    @recorded
    def clear(self) -> None:
        self._about_to_change([self.names.impl_slot(s) for _, r in sorted(self.reqs.items()) for s in r.slots[-1:]])
        out = self._run("clear", "", lambda: (ref.clear(self.ref), None), self.impl.clear)
        if out:
            self.ref = out[0][0]
            self.reqs.clear()
            self.pending = None
            self.names.reset()

    @precondition(lambda self: self._has(C.SET_FULL_TO_SWA_MAPPING) and self.pending is None and self._swappable())
    @rule(data=st.data())
    @recorded
    def set_full_to_swa_mapping(self, data: st.DataObject) -> None:
        """Swap the SWA pages of two full pages of one request (a legal re-attachment, §1.5)."""
        req, pages = data.draw(st.sampled_from(self._swappable()), label="request")
        a, b = data.draw(st.sampled_from([(x, y) for x in pages for y in pages if x < y]), label="pages")
        ref_full, ref_swa = self._swap(req, a, b, self.ref.full_to_swa_index_mapping, lambda s: s)
        impl_m = self._snapshot().full_to_swa_index_mapping
        impl_full, impl_swa = self._swap(req, a, b, impl_m, self.names.impl_slot)
        self._about_to_change(impl_full)
        out = self._run("set_full_to_swa_mapping", f"request {req.rid}: swap the SWA pages of its full pages {a}, {b}",
                        lambda: (ref.set_full_to_swa_mapping(self.ref, ref_full, ref_swa), None),
                        lambda: self.impl.set_full_to_swa_mapping(self._t(impl_full), self._t(impl_swa)))
        if out:
            self.ref = out[0][0]

    @precondition(lambda self: self._has(C.BACKUP_RESTORE) and self.pending is None and self.reqs)
    @rule()
    @recorded
    def backup_state(self) -> None:
        """Speculative decoding drafts for running requests: nothing to draft for without one."""
        out = self._run("backup_state", "", lambda: (ref.backup_state(self.ref), None), self.impl.backup_state)
        if out:
            self.pending = Pending(out[0][0], out[1], {rid: list(r.slots) for rid, r in self.reqs.items()})

    @precondition(lambda self: self.pending is not None)
    @rule()
    @recorded
    def restore_state(self) -> None:
        pending = self.pending
        assert pending is not None
        out = self._run("restore_state", "", lambda: (ref.restore_state(self.ref, pending.ref_backup), None),
                        lambda: self.impl.restore_state(pending.impl_backup))
        if out:
            self.ref = out[0][0]
            self.reqs = {rid: Req(rid, slots) for rid, slots in pending.reqs.items()}
            self.pending = None

    @precondition(lambda self: self._has(C.KV_BUFFER) and self.reqs)
    @rule(data=st.data())
    @recorded
    def set_kv_buffer(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
        layer = data.draw(st.integers(0, self.config.kv.num_layers - 1), label="layer_id")
        hi = data.draw(st.integers(1, len(req.slots)), label="end")
        lo = data.draw(st.integers(0, hi - 1), label="start")
        ref_slots = req.slots[lo:hi]
        k, v = self._rows(len(ref_slots))
        impl_slots = self._impl_slots(ref_slots)
        shape = (len(ref_slots), self.config.kv.head_num, self.config.kv.head_dim)
        dtype = self.impl.get_kvcache().get_kv_buffer(layer)[0].dtype
        out = self._run(
            "set_kv_buffer", f"layer_id={layer}, request {req.rid}, positions [{lo}, {hi})",
            lambda: (ref.set_kv_buffer(self.ref, layer, ref_slots, k, v), None),
            lambda: self.impl.get_kvcache().set_kv_buffer(
                layer, self._t(impl_slots), torch.tensor(k, dtype=dtype, device=self.impl.device).reshape(shape),
                torch.tensor(v, dtype=dtype, device=self.impl.device).reshape(shape)))
        if out:
            self.ref = out[0][0]

    @precondition(lambda self: self._has(C.CPU_COPY) and self.reqs and self.pending is None)
    @rule(data=st.data())
    @recorded
    def get_cpu_copy(self, data: st.DataObject) -> None:
        """Retract: copy a request's KV to the CPU, then free it (§1.6)."""
        req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
        impl_slots = self._impl_slots(req.slots)
        out = self._run("get_cpu_copy", f"request {req.rid}, {len(req.slots)} positions",
                        lambda: (self.ref, ref.get_cpu_copy(self.ref, req.slots)),
                        lambda: self.impl.get_cpu_copy(self._t(impl_slots)))
        if out:
            if self._free_request(req):  # retracted only once its slots are released
                self.retracted.append(Retracted(len(req.slots), out[0][1], out[1]))
                self.reqs.pop(req.rid)

    @precondition(lambda self: self._has(C.CPU_COPY) and self.retracted and any(
        self._has(c) for c in (C.ALLOC_EXTEND, C.ALLOC_EXTEND_SWA_TAIL)))
    @rule(data=st.data())
    @recorded
    def load_cpu_copy(self, data: st.DataObject) -> None:
        """Resume: allocate the same positions again (tail or 1:1), then load the CPU copy (§2.8)."""
        index = data.draw(st.integers(0, len(self.retracted) - 1), label="retracted")
        saved = self.retracted[index]
        rid, n = self._new_rid(), saved.length
        tail_ok = self._has(C.ALLOC_EXTEND_SWA_TAIL)
        if tail_ok and (not self._has(C.ALLOC_EXTEND) or data.draw(st.booleans(), label="resume_with_tail")):
            tail = swa_tail_len(n, self.w, self.p)
            out = self._run("alloc_extend_swa_tail", f"resume {n} positions as request {rid}, swa_tail_len={tail}",
                            lambda: ref.alloc_extend_swa_tail(self.ref, [0], [n], [-1], n, tail, owners=[rid]),
                            lambda: self.impl.alloc_extend_swa_tail(self._t([0]), self._cpu([0]), self._t([n]),
                                                                    self._cpu([n]), self._t([-1]), n, tail))
            op = "alloc_extend_swa_tail"
        else:
            out = self._run("alloc_extend", f"resume {n} positions as request {rid}",
                            lambda: ref.alloc_extend(self.ref, [0], [n], [-1], n, owners=[rid]),
                            lambda: self.impl.alloc_extend(self._t([0]), self._cpu([0]), self._t([n]), self._cpu([n]),
                                                           self._t([-1]), n))
            op = "alloc_extend"
        if not out:
            return
        self._adopt(op, out, [(rid, [], n)])
        slots = self.reqs[rid].slots
        done = self._run("load_cpu_copy", f"request {rid}, {n} positions",
                         lambda: (ref.load_cpu_copy(self.ref, saved.ref_copy, slots), None),
                         lambda: self.impl.load_cpu_copy(saved.impl_copy, self._t(self._impl_slots(slots))))
        if done:
            self.ref = done[0][0]
            self.retracted.pop(index)

    @precondition(lambda self: self._has(C.REJECTS_MISUSE))
    @rule(data=st.data())
    @recorded
    def misuse(self, data: st.DataObject) -> None:
        """A call that violates one documented precondition: both sides must raise InvalidOperation."""
        cases = [name for name, (applies, _) in MISUSE_CASES.items() if applies(self)]
        name = data.draw(st.sampled_from(cases), label="case")
        MISUSE_CASES[name][1](self, data)


def _has_free_page(machine: SWAAllocatorMachine) -> bool:
    return len(machine.impl.snapshot().full.free_pages) > 0


def _double_free(op: str) -> Callable[[SWAAllocatorMachine, st.DataObject], None]:
    def run(self: SWAAllocatorMachine, data: st.DataObject) -> None:
        p = self.p
        ref_slot, impl_slot = self.ref.full.free_pages[0] * p, self._snapshot().full.free_pages[0] * p
        fn = {"free": (ref.free, self.impl.free), "free_swa": (ref.free_swa, self.impl.free_swa)}[op]
        self._misuse(op, f"free_index=[{ref_slot}] (a free page: double free)",
                     lambda: (fn[0](self.ref, [ref_slot]), None), lambda: fn[1](self._t([impl_slot])))
    return run


def _free_reserved(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    slot = data.draw(st.integers(0, self.p - 1), label="slot")
    self._misuse("free", f"free_index=[{slot}] (reserved page 0)", lambda: (ref.free(self.ref, [slot]), None),
                 lambda: self.impl.free(self._t([slot])))


def _free_out_of_range(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    slot = (self.config.num_pages_full + 1) * self.p
    self._misuse("free", f"free_index=[{slot}] (past the pool)", lambda: (ref.free(self.ref, [slot]), None),
                 lambda: self.impl.free(self._t([slot])))


def _free_duplicate(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
    r = [req.slots[0], req.slots[0]]
    self._misuse("free", f"request {req.rid}, its first slot twice", lambda: (ref.free(self.ref, r), None),
                 lambda: self.impl.free(self._t(self._impl_slots(r))))


def _free_full_live_peer(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    m = self.ref.full_to_swa_index_mapping
    req = data.draw(st.sampled_from([r for _, r in sorted(self.reqs.items()) if any(m[s] > 0 for s in r.slots)]),
                    label="request")
    self._misuse("free_full", f"request {req.rid} (its SWA side is still live)",
                 lambda: (ref.free_full(self.ref, req.slots), None),
                 lambda: self.impl.free_full(self._t(self._impl_slots(req.slots))))


def _alloc_unaligned(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    n = data.draw(st.sampled_from([-1] + ([self.p + 1] if self.p > 1 else [])), label="need_size")
    self._misuse("alloc", f"need_size={n}", lambda: ref.alloc(self.ref, n), lambda: self.impl.alloc(n))


def _extend_bad_last_loc(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
    n = len(req.slots)
    self._misuse("alloc_extend", f"request {req.rid}: {n}->{n + 1} with last_loc=-1",
                 lambda: ref.alloc_extend(self.ref, [n], [n + 1], [-1], 1),
                 lambda: self.impl.alloc_extend(self._t([n]), self._cpu([n]), self._t([n + 1]), self._cpu([n + 1]),
                                                self._t([-1]), 1))


def _extend_bad_count(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    self._misuse("alloc_extend", "0->3 with extend_num_tokens=2",
                 lambda: ref.alloc_extend(self.ref, [0], [3], [-1], 2),
                 lambda: self.impl.alloc_extend(self._t([0]), self._cpu([0]), self._t([3]), self._cpu([3]),
                                                self._t([-1]), 2))


def _tail_unaligned(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    seq = data.draw(st.integers(self.p + 1, 3 * self.p + 1), label="seq_len")
    tail = seq - 1  # tail starts at position 1, not a page boundary (U1)
    self._misuse("alloc_extend_swa_tail", f"0->{seq}, swa_tail_len={tail} (tail start not page aligned)",
                 lambda: ref.alloc_extend_swa_tail(self.ref, [0], [seq], [-1], seq, tail),
                 lambda: self.impl.alloc_extend_swa_tail(self._t([0]), self._cpu([0]), self._t([seq]),
                                                         self._cpu([seq]), self._t([-1]), seq, tail))


def _decode_swa_released(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    req = data.draw(st.sampled_from([r for _, r in sorted(self.reqs.items()) if not self._extendable(r)]),
                    label="request")
    n, last = len(req.slots), req.slots[-1]
    self._misuse("alloc_decode", f"request {req.rid} at {n + 1} (its last page's SWA side is released: M5)",
                 lambda: ref.alloc_decode(self.ref, [n + 1], [last]),
                 lambda: self.impl.alloc_decode(self._t([n + 1]), self._cpu([n + 1]),
                                                self._t([self.names.impl_slot(last)])))


def _restore_after_release(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
    out = self._run("backup_state", "", lambda: (ref.backup_state(self.ref), None), self.impl.backup_state)
    assert out is not None
    ref_backup, impl_backup = out[0][0], out[1]
    self._release("free", req, req.slots)
    self.reqs.pop(req.rid)
    self._misuse("restore_state", "after a free since backup_state", lambda: (ref.restore_state(self.ref, ref_backup), None),
                 lambda: self.impl.restore_state(impl_backup))


def _set_kv_bad_layer(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
    layer, geo = self.config.kv.num_layers, self.config.kv
    rows = torch.zeros((1, geo.head_num, geo.head_dim), dtype=self.impl.get_kvcache().get_kv_buffer(0)[0].dtype)
    self._misuse("set_kv_buffer", f"layer_id={layer} (no such layer)",
                 lambda: (ref.set_kv_buffer(self.ref, layer, req.slots[:1], [[0.0] * geo.row_width],
                                            [[0.0] * geo.row_width]), None),
                 lambda: self.impl.get_kvcache().set_kv_buffer(layer, self._t(self._impl_slots(req.slots[:1])),
                                                               rows, rows))


def _remap_foreign(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    m = self.ref.full_to_swa_index_mapping
    mine, theirs = data.draw(st.sampled_from(_two_mapped(self)), label="requests")
    f, s = mine.slots[-1], theirs.slots[-1]
    impl_m = self._snapshot().full_to_swa_index_mapping
    self._misuse("set_full_to_swa_mapping", f"request {mine.rid}'s slot to request {theirs.rid}'s SWA slot",
                 lambda: (ref.set_full_to_swa_mapping(self.ref, [f], [m[s]]), None),
                 lambda: self.impl.set_full_to_swa_mapping(self._t([self.names.impl_slot(f)]),
                                                           self._t([impl_m[self.names.impl_slot(s)]])))


def _two_mapped(self: SWAAllocatorMachine) -> list[tuple[Req, Req]]:
    m = self.ref.full_to_swa_index_mapping
    mapped = [r for _, r in sorted(self.reqs.items()) if m[r.slots[-1]] > 0]
    return [(a, b) for a in mapped for b in mapped if a.rid != b.rid]


def _remap_lengths(self: SWAAllocatorMachine, data: st.DataObject) -> None:
    req = data.draw(st.sampled_from(sorted(self.reqs.values(), key=lambda r: r.rid)), label="request")
    self._misuse("set_full_to_swa_mapping", f"request {req.rid}: one full slot, two SWA slots",
                 lambda: (ref.set_full_to_swa_mapping(self.ref, req.slots[:1], [0, 0]), None),
                 lambda: self.impl.set_full_to_swa_mapping(self._t(self._impl_slots(req.slots[:1])), self._t([0, 0])))


_Case = tuple[Callable[[SWAAllocatorMachine], bool], Callable[[SWAAllocatorMachine, st.DataObject], None]]
#: Misuse cases ``"op:case"`` -> (applicable?, run). Each must be rejected by the reference and the implementation.
MISUSE_CASES: dict[str, _Case] = {
    "free:double_free": (lambda m: m.pending is None and _has_free_page(m), _double_free("free")),
    "free:reserved_page": (lambda m: m.pending is None, _free_reserved),
    "free:out_of_range": (lambda m: m.pending is None, _free_out_of_range),
    "free:duplicate_slot": (lambda m: m.pending is None and bool(m.reqs), _free_duplicate),
    "free_swa:double_free": (lambda m: m.pending is None and _has_free_page(m), _double_free("free_swa")),
    "free_full:live_swa_peer": (lambda m: m._has(C.FREE_FULL) and m.pending is None and any(
        any(m.ref.full_to_swa_index_mapping[s] > 0 for s in r.slots) for r in m.reqs.values()), _free_full_live_peer),
    "alloc:unaligned_size": (lambda m: m._has(C.ALLOC), _alloc_unaligned),
    "alloc_extend:last_loc_without_prefix": (lambda m: m._has(C.ALLOC_EXTEND) and bool(m.reqs), _extend_bad_last_loc),
    "alloc_extend:extend_num_tokens": (lambda m: m._has(C.ALLOC_EXTEND), _extend_bad_count),
    "alloc_extend_swa_tail:unaligned_tail": (lambda m: m._has(C.ALLOC_EXTEND_SWA_TAIL) and m.p > 1, _tail_unaligned),
    "alloc_decode:swa_released": (lambda m: m._has(C.ALLOC_DECODE) and any(
        not m._extendable(r) for r in m.reqs.values()), _decode_swa_released),
    "restore_state:after_release": (lambda m: m._has(C.BACKUP_RESTORE) and m.pending is None and bool(m.reqs),
                                    _restore_after_release),
    "set_kv_buffer:bad_layer": (lambda m: m._has(C.KV_BUFFER) and bool(m.reqs), _set_kv_bad_layer),
    "set_full_to_swa_mapping:foreign_swa_slot": (lambda m: m._has(C.SET_FULL_TO_SWA_MAPPING) and bool(_two_mapped(m)),
                                                 _remap_foreign),
    "set_full_to_swa_mapping:lengths": (lambda m: m._has(C.SET_FULL_TO_SWA_MAPPING) and bool(m.reqs), _remap_lengths),
}


def machine_for(factory: AllocatorFactory, config: PoolConfig, *, impl_name: str = "impl",
                replay_hint: str = "") -> type[SWAAllocatorMachine]:
    """A fresh machine class bound to one implementation factory and one config."""
    return type(f"SWAAllocatorMachine_{config.label().replace('-', '_')}", (SWAAllocatorMachine,), {
        "factory": staticmethod(factory), "config": config, "impl_name": impl_name,
        "replay_hint": replay_hint, "stats": Stats(),
    })
