"""Lockstep state machine for the ``swa_allocator`` component (sglang_semantics.md §1.5, §2.7, §2.8, §7).

Each rule applies one operation -- named exactly like the reference function and
the SGLang method -- to the pure reference and to the implementation under test,
and requires the same outcome class (success, ``OutOfMemory``, ``InvalidOperation``).
After a failed operation the implementation's snapshot must be unchanged. After
every step the invariant compares both sides up to a renaming of pages
(:mod:`kvproof.conformance.compare`), the available sizes, the KV rows of every
live token that its current owner wrote (other rows are implementation-defined:
:mod:`kvproof.reference.kv`), and checks the reference's own invariants (G1-G3, M1, M2, M5).

The harness plays the engine: it keeps a table of requests (positions -> reference
full slots), extends them with ``alloc_extend`` / ``alloc_decode``, preallocates
tails with ``alloc_extend_swa_tail``, evicts sliding windows with ``free_swa``,
drafts under ``backup_state``/``restore_state``, retracts requests to CPU copies
and resumes them (``get_cpu_copy`` / ``load_cpu_copy``), and writes KV. Sizes are
biased to page and window boundaries (kP-1, kP, kP+1, W+-1). Misuse is exercised
only for implementations declaring ``Capability.REJECTS_MISUSE``.

Ring configs (``PoolConfig.swa_ring_size``, :data:`~kvproof.conformance.configs.RING_CONFIGS`): the harness also plays
``ReqToTokenPool``: a new request first takes a request slot (``alloc_req_slots``; none free: it is not admitted),
and a request the table drops gives it back (``free_req_slots``), as 0.5.23's scheduler does around the allocator;
every position's SWA side is its slot's ring, so every request extends and the segment calls treat every page as
having its SWA side (``free_segment``, ``free_swa_segment``), as the engine calls them on a ring.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvproof.conformance import strategies as st
from kvproof.conformance.check import Suite
from kvproof.conformance.compare import Divergence, Renaming
from kvproof.conformance.configs import CONFORMANCE_CONFIGS, RING_CONFIGS
from kvproof.conformance.findings import Evidence, follows
from kvproof.conformance.lockstep import (
    Lockstep,
    MisuseCall,
    check_after_each_step,
    misuse,
    operation,
    scenario,
    unwrap,
)
from kvproof.conformance.swa_ghost import SWAGhost
from kvproof.conformance.tensors import int64s
from kvproof.reference import swa_allocator as ref
from kvproof.reference.arith import ceil_p, floor_p, swa_tail_len
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability, SWAAllocatorUnderTest
from kvproof.reference.invariants import check_invariants
from kvproof.reference.paged import LEAKED
from kvproof.reference.registry import Component
from kvproof.reference.snapshot import AllocatorSnapshot

__all__ = ["SUITE", "Pending", "Req", "Retracted", "SWAAllocatorMachine", "SWALockstep"]

C = Capability


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


@functools.lru_cache(maxsize=256)
def _sizes(p: int, w: int, top: int) -> st.SearchStrategy[int]:
    """Token counts biased to page and window boundaries, within ``1..top`` (one strategy object per shape: building
    and validating it on every draw cost more than the draw)."""
    near = {k * p + d for k in range(1, 6) for d in (-1, 0, 1)} | {w - 1, w, w + 1, w + p - 1, w + p, w + p + 1, 1, 2}
    edges = sorted(x for x in near if 1 <= x <= top)
    return st.one_of(st.sampled_from(edges), st.integers(1, top))


class SWALockstep(Lockstep[PoolConfig, SWAAllocatorUnderTest]):
    """What the machines of the SWA composite allocator share (``swa_allocator``, ``loc_cache``,
    ``decode_prealloc``): the reference allocator, the page renaming, the request table, the
    calls that allocate and release, and the comparison after every step.

    It declares no rules; :class:`SWAAllocatorMachine` and the decode-node machine do.
    """

    snapshot_type = AllocatorSnapshot

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        cfg = self.config
        self.p, self.w = cfg.page_size, cfg.sliding_window_size
        self.ref = ref.initial_state(cfg)
        self._checked: ref.SWAAllocatorState | None = None  # the reference state whose invariants were checked last
        self.names = Renaming(self.p, exact=C.EXACT_PAGE_ORDER in self.caps)
        self.device = self.impl.device  # where the implementation takes its index tensors (read once)
        self.reqs: dict[int, Req] = {}
        self.retracted: list[Retracted] = []
        self.pending: Pending | None = None
        self.next_rid, self.tag = 1, 0
        self.layers: dict[str, set[int]] = {"full": set(), "swa": set()}  # layer ids written per pool
        self.decoding: tuple[list[int], list[int]] | None = None  # the last alloc_decode's (seq_lens, last_loc)
        self.followed: tuple[ref.SWAAllocatorState, ref.SWAAllocatorState] | None = None  # (before, after) F1
        self.ring = cfg.ring  # the per-request SWA ring: request slots are admitted and released around the calls
        self.req_slot: dict[int, tuple[int, int]] = {}  # ring: request id -> (reference slot, implementation slot)

    # ------------------------------------------------------------ plumbing

    def _t(self, values: list[int]) -> torch.Tensor:
        return int64s(values, self.device)

    def _about_to_change(self, impl_slots: list[int]) -> None:
        """Called before an operation rewrites the mapping of ``impl_slots`` (a subclass may look first)."""

    def _last_loc_tensor(self, values: list[int]) -> torch.Tensor:
        """The ``last_loc`` argument (a subclass may place it at a chosen address)."""
        return self._t(values)

    @staticmethod
    def _cpu(values: list[int]) -> torch.Tensor:
        return int64s(values)

    def _impl_slots(self, ref_slots: list[int]) -> list[int]:
        return [self.names.impl_slot(s) for s in ref_slots]

    def _new_rid(self) -> int:
        self.next_rid += 1
        return self.next_rid - 1

    def _extendable(self, req: Req) -> bool:
        """A 1:1 extend may continue ``req``: page-aligned, or its last token still has an SWA slot (M5); on a ring
        always (its SWA side is the request slot's ring)."""
        return self.ring or len(req.slots) % self.p == 0 or self.ref.full_to_swa_index_mapping[req.slots[-1]] > 0

    def _has_swa(self, slot: int) -> bool:
        """The position at reference full ``slot`` still has its SWA side: mapped, or (ring) its request's ring."""
        return self.ring or self.ref.full_to_swa_index_mapping[slot] > 0

    # ------------------------------------------------------------ request slots (ring configs: ReqToTokenPool)

    def _admit(self, rids: list[int]) -> bool:
        """Ring configs: the new requests ``rids`` take a request slot each (``alloc_req_slots``), or none is admitted
        (both sides short: the scheduler leaves them waiting). Without a ring: nothing to take."""
        if not self.ring or not rids:
            return True
        out = self.call("alloc_req_slots", f"need_size={len(rids)} for request(s) {rids}",
                        lambda: ref.alloc_req_slots(self.ref, len(rids)),
                        lambda: self.impl.alloc_req_slots(len(rids)))
        if not out:
            return False
        (state, ref_slots), impl_slots = out
        impl_list = [int(x) for x in impl_slots]
        if len(impl_list) != len(ref_slots) or len(set(impl_list)) != len(impl_list) or set(impl_list) & {
                i for _, i in self.req_slot.values()}:
            self.fail(f"alloc_req_slots returned {impl_list} for {len(rids)} new request(s); held: "
                      f"{sorted(i for _, i in self.req_slot.values())}", check="result")
        self.ref = state
        self.req_slot.update({rid: pair for rid, pair in zip(rids, zip(ref_slots, impl_list, strict=True),
                                                             strict=True)})
        return True

    def _retire(self, rids: list[int]) -> None:
        """Ring configs: the requests ``rids`` that hold a request slot give it back (``free_req_slots``)."""
        held = [rid for rid in rids if rid in self.req_slot]
        if not held:
            return
        ref_slots = [self.req_slot[rid][0] for rid in held]
        impl_slots = [self.req_slot[rid][1] for rid in held]
        out = self.call("free_req_slots", f"request(s) {held}", lambda: (ref.free_req_slots(self.ref, ref_slots), None),
                        lambda: self.impl.free_req_slots(impl_slots))
        if out:
            self.ref = out[0][0]
        for rid in held:
            del self.req_slot[rid]

    def _drop(self, rid: int) -> None:
        """``rid`` leaves the request table (freed, retracted): its request slot goes back."""
        self.reqs.pop(rid, None)
        self._retire([rid])

    def _retire_unlisted(self) -> None:
        """Give back the request slots of admitted requests the table does not hold (an allocation that failed or
        took no token, a restore that dropped the requests made after its backup)."""
        self._retire([rid for rid in sorted(self.req_slot) if rid not in self.reqs])

    # ------------------------------------------------------------ helpers for allocation and release

    def _max_tokens(self) -> int:
        return self.config.size_swa + self.p  # beyond the SWA pool (tails matter), rarely past the full pool


    def _draw_batch(self, data: Any, ok: Callable[[Req], bool], *, grow: bool
                    ) -> list[tuple[int, int, int]]:
        """1-3 distinct requests (new ones only when ``grow``) as ``(rid, prefix_len, seq_len)``. Without ``grow`` the
        size is at most the number of requests ``ok`` accepts; the new requests of a batch of k share the pool (each
        at most 1/k of the longest)."""
        batch: list[tuple[int, int, int]] = []
        most = 3 if grow else min(3, sum(1 for r in self.reqs.values() if ok(r)))
        size = data.draw(st.integers(1, most), label="batch_size") if most else 0
        for _ in range(size):
            candidates = [r for r in self.reqs.values() if ok(r) and r.rid not in {b[0] for b in batch}]
            if grow and (not candidates or data.draw(st.booleans(), label="new_request")):
                top = max(self.p, self._max_tokens() // size)
                seq_len = data.draw(_sizes(self.p, self.w, top), label="seq_len")
                batch.append((self._new_rid(), 0, seq_len))
            elif candidates:
                req = data.choose(candidates, "request")
                grow_by = data.draw(_sizes(self.p, self.w, 2 * self.p + 2), label="extend_len") if grow else 1
                batch.append((req.rid, len(req.slots), len(req.slots) + grow_by))
        return batch

    def _extend(self, op: str, batch: list[tuple[int, int, int]]) -> None:
        if not batch:
            return
        self.note(f"{op} batch size", len(batch))
        rids = [b[0] for b in batch]
        if not self._admit([r for r in rids if r not in self.reqs]):
            return
        pre, seq = [b[1] for b in batch], [b[2] for b in batch]
        last = [self.reqs[r].slots[-1] if p else -1 for r, p, _ in batch]
        impl_last = [self.names.impl_slot(s) if s >= 0 else -1 for s in last]
        ext = sum(seq) - sum(pre)
        args = ", ".join(f"request {r}: {p}->{s}" for r, p, s in batch)
        if op == "alloc_decode":
            self.decoding = (seq, last)  # what a follower of a failed decode needs (_alloc_decode_keeps_pages)
            out = self.call(op, args, lambda: ref.alloc_decode(self.ref, seq, last, owners=rids),
                            lambda: self.impl.alloc_decode(self._t(seq), self._cpu(seq),
                                                           self._last_loc_tensor(impl_last)))
        else:
            out = self.call(op, args, lambda: ref.alloc_extend(self.ref, pre, seq, last, ext, owners=rids),
                            lambda: self.impl.alloc_extend(self._t(pre), self._cpu(pre), self._t(seq), self._cpu(seq),
                                                           self._last_loc_tensor(impl_last), ext))
        if out:
            self._adopt(op, out, [(r, self.reqs[r].slots if r in self.reqs else [], s - p) for r, p, s in batch])
        self._retire_unlisted()

    def _adopt(self, op: str, out: tuple[Any, Any], grown: list[tuple[int, list[int], int]]) -> None:
        """Take the new reference state, bind the returned pages, extend the request table."""
        (state, ref_slots), impl_slots = out
        self.require_indices(op, impl_slots, len(ref_slots))
        impl_list = [int(x) for x in impl_slots.reshape(-1).tolist()]
        self.ref = state
        try:
            self.names.bind_full(op, list(ref_slots), impl_list)
        except Divergence as err:
            self.fail(str(err), check="result", detail=err.detail)
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
        out = self.call(op, f"request {req.rid}, {where}", lambda: (call[0](self.ref, ref_slots), None),
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
        self.call(op, args, ref_call, impl_call, expect_misuse=True)

    # ------------------------------------------------------------ structural coverage

    def measure(self) -> dict[str, int]:
        p = self.p
        return {"requests alive at once": len(self.reqs),
                "full pages of one request": max((-(-len(r.slots) // p) for r in self.reqs.values()), default=0),
                "full pool exhausted": int(not self.ref.full.free_pages),
                "swa pool exhausted": int(not self.ref.swa.free_pages),
                **({"request slots exhausted": int(not self.ref.req_slots)} if self.ring else {})}

    # ------------------------------------------------------------ the invariant

    @check_after_each_step
    def agrees_with_reference(self) -> None:
        """Reference invariants hold; the implementation's state equals it under the renaming; KV rows agree."""
        self.stats.steps += 1
        self._after_step()
        if self.ref is not self._checked:  # a frozen value: one that passed passes again (a failed operation's)
            check_invariants(self.ref)
            self._checked = self.ref
        try:
            snap = self.snapshot()
            self.names.compare(self.ref, snap)
            sizes = self.query("available_size(), full_available_size(), swa_available_size()",
                               lambda impl: (impl.available_size(), impl.full_available_size(),
                                             impl.swa_available_size()))
            for what, mine, theirs in zip(("available_size", "full_available_size", "swa_available_size"),
                                          (ref.available_size(self.ref), ref.full_available_size(self.ref),
                                           ref.swa_available_size(self.ref)), sizes, strict=True):
                if int(theirs) != mine:
                    self.fail(f"{what}() = {theirs}, reference {mine}", check="state",
                              detail={"code": "available_size", "query": what, "implementation": int(theirs),
                                      "reference": mine})
            written = [layer for layer in range(self.config.kv.num_layers) if ref.kv_written(self.ref, layer)]
            if written and self.supports(C.KV_BUFFER):  # a layer nobody wrote has no row to compare
                buffers = self.query("get_kvcache().get_kv_buffer()",
                                     lambda impl: {layer: impl.get_kvcache().get_kv_buffer(layer) for layer in written})
                self.observe("get_kvcache().get_kv_buffer()", lambda: self._compare_kv(snap, buffers))
        except Divergence as err:
            self.fail(str(err), check="state", detail={**err.detail, "ring": True} if self.ring else err.detail)
        self.trace.next_step()

    def _after_step(self) -> None:
        """Hook run after every step, before the comparison (a subclass may probe)."""

    def ghost(self) -> SWAGhost | None:
        """The implementation driven alone from here (:mod:`kvproof.conformance.swa_ghost`), each request holding
        what the harness's table says it holds, in the implementation's slots."""
        owners: dict[int, list[int]] = {}
        for rid, req in sorted(self.reqs.items()):
            try:
                owners[rid] = self._impl_slots(req.slots)
            except (KeyError, IndexError):  # a page the divergence left unbound: the request is not followed
                continue
        return SWAGhost(unwrap(self.impl), self.config, self.caps, owners, self.next_rid, self.op_timeout)

    # ------------------------------------------------------------ evidence, and the documented behaviours followed

    def unchanged(self, before: AllocatorSnapshot, after: AllocatorSnapshot) -> bool:
        """Equal snapshots; without ``EXACT_PAGE_ORDER`` the order of a free list is policy, not state: a failed call
        may reorder it (SGLang's ``need_sort=True`` merges and sorts its staged pages before it finds a pool short)."""
        if before == after or self.names.exact:
            return before == after
        return (before.full_to_swa_index_mapping == after.full_to_swa_index_mapping
                and all(sorted(getattr(before, pool).free_pages) == sorted(getattr(after, pool).free_pages)
                        for pool in ("full", "swa")))

    def describe_change(self, before: AllocatorSnapshot, after: AllocatorSnapshot) -> dict[str, Any]:
        """Per pool, the implementation's pages that left its free list and those that joined it, and how many
        mapping entries changed (the evidence of a failed call that changed the allocator)."""
        out: dict[str, Any] = {}
        for pool in ("full", "swa"):
            b, a = getattr(before, pool).free_pages, getattr(after, pool).free_pages
            kept, had = set(a), set(b)
            out[f"{pool}_pages_taken"] = [g for g in b if g not in kept]
            out[f"{pool}_pages_given"] = [g for g in a if g not in had]
        out["mapping_entries_changed"] = sum(x != y for x, y in zip(before.full_to_swa_index_mapping,
                                                                      after.full_to_swa_index_mapping, strict=False))
        return out

    @follows("non-atomic alloc_decode")
    def _alloc_decode_keeps_pages(self, evidence: Evidence, *, before: AllocatorSnapshot,
                                  after: AllocatorSnapshot, error: Exception) -> bool:
        """A failed ``alloc_decode`` that kept the pages of every pool that had room (SGLang 0.5.23, §2.11 R7: F1):
        the reference leaks the same pages (``ref.leak_failed_alloc_decode``), bound to the implementation's, if the
        implementation took exactly those, from the front of each free list, and changed nothing else."""
        if evidence.op != "alloc_decode" or self.decoding is None:
            return False
        seq, last = self.decoding
        leaked = ref.leak_failed_alloc_decode(self.ref, seq, last)
        taken: dict[str, tuple[int, ...]] = {}
        for pool in ("full", "swa"):
            k = len(getattr(self.ref, pool).free_pages) - len(getattr(leaked, pool).free_pages)
            b, a = getattr(before, pool).free_pages, getattr(after, pool).free_pages
            if self.names.exact:  # from the front of the free list, the rest in order
                if tuple(b[k:]) != tuple(a):
                    return False
                taken[pool] = tuple(b[:k])
            else:  # k pages left the free list and none joined it (its order is policy: need_sort reorders)
                left, joined = evidence.detail[f"{pool}_pages_taken"], evidence.detail[f"{pool}_pages_given"]
                if joined or len(left) != k:
                    return False
                taken[pool] = tuple(left)
        if after.full_to_swa_index_mapping != before.full_to_swa_index_mapping:
            return False
        # in the order the reference's free list handed them out, as the implementation's were taken (a sorted list
        # would pair them crosswise once the free list is out of order: found by a fuzz campaign)
        ref_pages = [g for g in self.ref.full.free_pages if leaked.full.owner[g] == LEAKED]
        try:
            for ref_page, impl_page in zip(ref_pages, taken["full"], strict=True):
                self.names.bind_full_page("a leaked full page (F1 followed)", ref_page, impl_page)
        except Divergence:
            return False
        self.followed, self.ref = (self.ref, leaked), leaked
        return True

    def _compare_kv(self, snap: AllocatorSnapshot, buffers: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Every defined KV row of every live token, per layer, equals the implementation's row at its slot.

        The (reference slot, implementation slot) pairs are the same for every layer of a pool: they are built once
        per pool, each layer's defined rows are gathered in one indexing and compared as one tensor; the rows are
        looked at one by one only to name the first that differs."""
        geo, m = self.config.kv, self.ref.full_to_swa_index_mapping
        snap_m, impl_slot = snap.full_to_swa_index_mapping, self.names.impl_slot
        full = [(r, impl_slot(r), rid) for rid, req in sorted(self.reqs.items()) for r in req.slots]
        swa = [(m[r], snap_m[i], rid) for r, i, rid in full if m[r] > 0]
        for layer in buffers:  # the layers some row of which is defined (agrees_with_reference)
            pairs = swa if geo.is_swa_layer(layer) else full
            want = ref.kv_rows(self.ref, layer, [a for a, _, _ in pairs])
            defined = [(pair, row) for pair, row in zip(pairs, want, strict=True) if row is not None]
            if not defined:
                continue
            k, v = buffers[layer]
            idx = int64s([b for (_, b, _), _ in defined], k.device)
            got = torch.cat([k[idx].reshape(len(defined), -1), v[idx].reshape(len(defined), -1)], dim=1).float()
            expected = torch.tensor([row for _, row in defined], dtype=torch.float32, device=got.device)
            if torch.equal(got, expected):
                continue
            for ((a, b, rid), row), have in zip(defined, got.cpu().tolist(), strict=True):
                if tuple(have) != row:
                    kind = "SWA" if geo.is_swa_layer(layer) else "full"
                    self.fail(f"KV of layer {layer} ({kind}) for request {rid}: reference slot {a} holds {list(row)}, "
                              f"implementation slot {b} holds {have}", check="kv",
                              detail={"layer": layer, "pool": kind.lower()})


#: the pages one ``alloc`` asks for (Hypothesis favours the first: not 0)
ALLOC_PAGES = (1, 2, 3, 4, 0)
#: the rules that make a request longer than one ``alloc`` makes it
GROWING = frozenset({"alloc_extend", "alloc_decode", "alloc_extend_swa_tail"})


def longest_request(config: PoolConfig, na: tuple[str, ...]) -> int:
    """The most full pages one request can hold on ``config``: as many as the SWA pool has; where none of the rules
    that grow a request applies (SGLang 0.5.23's allocator at page size 1, whose adapter declares none of them), the
    most one ``alloc`` asks for; 0 where ``alloc`` does not apply either (no rule makes a request)."""
    if GROWING - set(na):
        return config.num_pages_swa
    return 0 if "alloc" in na else min(max(ALLOC_PAGES), config.num_pages_swa)


class SWAAllocatorMachine(SWALockstep):
    """The ``swa_allocator`` rules: every composite operation, drafts, retraction/resumption, misuse."""

    component = Component.SWA_ALLOCATOR
    targets = ("full pool exhausted", "swa pool exhausted", "requests alive at once")

    @classmethod
    def structure(cls, config: PoolConfig, na: tuple[str, ...] = ()) -> dict[str, int]:
        """Batches of 1-3 requests; several requests alive, one as long as the SWA pool (as long as the rules the
        implementation has can make it: :func:`longest_request`); both pools exhausted; two restores and two remaps
        in one example; every layer of each pool written."""
        geo, aligned = config.kv, config.page_size == 1  # at P == 1 every length is page aligned
        if config.ring:  # no SWA page is ever taken (nothing to exhaust, re-map or release early); slots run out
            return {"misuse alloc_extend_swa_tail:unaligned_tail": 0 if aligned else 1,
                    "misuse release_batch:unaligned_start": 0 if aligned else 1,
                    "misuse alloc_decode:swa_released": 0, "misuse free_full:live_swa_peer": 0,
                    "misuse release_batch:released_peer": 0, "misuse set_full_to_swa_mapping:foreign_swa_slot": 0,
                    "alloc_extend batch size": 3, "alloc_decode batch size": 3,
                    "requests alive at once": min(4, config.num_req_slots or 0),
                    "full pages of one request": longest_request(config, na), "full pool exhausted": 1,
                    "request slots exhausted": 1, "restore_state per example": 2,
                    "full layers written": len(geo.full_attention_layer_ids),
                    "swa layers written": len(geo.swa_attention_layer_ids)}
        return {"misuse alloc_extend_swa_tail:unaligned_tail": 0 if aligned else 1,  # U1 needs a page of P > 1
                "misuse release_batch:unaligned_start": 0 if aligned else 1,  # so does a segment's unaligned start
                "misuse alloc_decode:swa_released": 0 if aligned else 1,  # M5: an aligned request always extends
                "alloc_extend batch size": 3, "alloc_decode batch size": 3,
                "requests alive at once": min(4, config.num_pages_swa),
                "full pages of one request": longest_request(config, na), "full pool exhausted": 1,
                "swa pool exhausted": 1,
                "restore_state per example": 2, "set_full_to_swa_mapping per example": 2,
                "full layers written": len(geo.full_attention_layer_ids),
                "swa layers written": len(geo.swa_attention_layer_ids)}

    @operation(needs={C.ALLOC}, pages=st.sampled_from(ALLOC_PAGES))
    def alloc(self, pages: int) -> None:
        n, rid = pages * self.p, self._new_rid()
        if not self._admit([rid]):
            return
        self._about_to_change([g * self.p for g in self.snapshot().full.free_pages[:pages]])
        out = self.call("alloc", f"need_size={n}", lambda: ref.alloc(self.ref, n, owner=rid),
                        lambda: self.impl.alloc(n))
        if out:
            self._adopt("alloc", out, [(rid, [], n)])
        self._retire_unlisted()

    @operation(needs={C.ALLOC_EXTEND}, data=st.data())
    def alloc_extend(self, data: Any) -> None:
        batch = self._draw_batch(data, lambda req: self._extendable(req), grow=True)
        self._extend("alloc_extend", batch)

    @operation(needs={C.ALLOC_DECODE}, when=lambda self: any(self._extendable(r) for r in self.reqs.values()),
               data=st.data())
    def alloc_decode(self, data: Any) -> None:
        batch = self._draw_batch(data, lambda req: self._extendable(req), grow=False)
        self._extend("alloc_decode", [(rid, prefix, prefix + 1) for rid, prefix, _ in batch])

    @operation(needs={C.ALLOC_EXTEND_SWA_TAIL}, data=st.data())
    def alloc_extend_swa_tail(self, data: Any) -> None:
        existing = [r for r in self.reqs.values()]
        req = data.choose(existing, "request") if existing and data.draw(
            st.integers(0, 3), label="extend_existing") == 0 else None
        prefix = len(req.slots) if req else 0
        seq = ceil_p(prefix, self.p) + data.draw(_sizes(self.p, self.w, self._max_tokens()), label="extend_len")
        valid = [t for t in range(seq - prefix + 1) if (seq - t) % self.p == 0]
        natural = swa_tail_len(seq, self.w, self.p)
        tail = natural if natural in valid and data.draw(st.integers(0, 3), label="other_tail") else data.draw(
            st.sampled_from(valid), label="swa_tail_len")
        rid = req.rid if req else self._new_rid()
        if req is None and not self._admit([rid]):
            return
        self._about_to_change([g * self.p + o for g in self.snapshot().full.free_pages[:2] for o in range(self.p)])
        last = req.slots[-1] if req else -1
        impl_last = self.names.impl_slot(last) if req else -1
        ext = seq - prefix
        out = self.call(
            "alloc_extend_swa_tail", f"prefix={prefix}, seq={seq}, swa_tail_len={tail}, request={rid}",
            lambda: ref.alloc_extend_swa_tail(self.ref, [prefix], [seq], [last], ext, tail, owners=[rid]),
            lambda: self.impl.alloc_extend_swa_tail(self._t([prefix]), self._cpu([prefix]), self._t([seq]),
                                                    self._cpu([seq]), self._last_loc_tensor([impl_last]), ext, tail))
        if out:
            self._adopt("alloc_extend_swa_tail", out, [(rid, req.slots if req else [], ext)])
        self._retire_unlisted()

    @operation(when=lambda self: self.reqs and self.pending is None, data=st.data())
    def free(self, data: Any) -> None:
        req = data.choose(sorted(self.reqs.values(), key=lambda r: r.rid), "request")
        if self._free_request(req):
            self._drop(req.rid)

    def _free_request(self, req: Req) -> bool:
        """Release all of ``req``: ``free``, or, when the implementation does not declare
        ``FREE_RELEASED_SWA`` and some position's SWA side is gone, ``free_swa`` of the still-mapped
        positions then ``free_full`` (``False``: neither is possible, the request stays). Requests with an odd id
        take that second path whenever ``FREE_FULL`` is declared, as SGLang 0.5.23's callers release a request at
        P == 1, so ``free_full`` runs in every run that frees (no draw decides it: the examples stay as they were)."""
        split = self.supports(C.FREE_FULL) and req.rid % 2 == 1
        if not split and (self.supports(C.FREE_RELEASED_SWA) or all(self._has_swa(s) for s in req.slots)):
            self._release("free", req, req.slots)
            return True
        if not self.supports(C.FREE_FULL):
            self.stats.rules["free:not_applicable"] += 1
            return False
        mapped = [s for s in req.slots if self._has_swa(s)]
        if mapped:
            self._release("free_swa", req, mapped, "its still-mapped positions")
        self._release("free_full", req, req.slots)
        return True

    @operation(when=lambda self: self.reqs and self.pending is None, data=st.data())
    def free_swa(self, data: Any) -> None:
        req = data.choose(sorted(self.reqs.values(), key=lambda r: r.rid), "request")
        self._evict(req, data)

    def _evict(self, req: Req, data: Any) -> None:
        """``free_swa`` of a part of ``req``: all of it, what left the window (§1.6), or any range before its last
        page."""
        last_page_start = floor_p(len(req.slots) - 1, self.p)
        if last_page_start == 0 or data.draw(st.integers(0, 5), label="release_all") == 0:
            lo, hi = 0, len(req.slots)  # whole request, e.g. before free_full
        elif data.draw(st.booleans(), label="window_rule"):
            lo, hi = 0, max(1, floor_p(max(0, len(req.slots) - 1 - self.w - self.p), self.p))  # _evict_swa (§1.6)
        else:
            hi = data.draw(st.integers(1, last_page_start), label="evict_end")
            lo = data.draw(st.integers(0, hi - 1), label="evict_start")
        slots = req.slots[lo:hi]
        if not self.supports(C.FREE_RELEASED_SWA):  # only positions whose SWA side is still there
            slots = [s for s in slots if self._has_swa(s)]
            if not slots:
                self.stats.rules["free_swa:not_applicable"] += 1
                return
        self._release("free_swa", req, slots, f"positions [{lo}, {hi})")

    # ------------------------------------------------------------ kv-row segments and free groups (§1.5a, 0.5.23)

    @scenario(needs_any={C.FREE_GROUP, C.FREE_SEGMENT}, when=lambda self: self.reqs and self.pending is None,
              data=st.data())
    def release_batch(self, data: Any) -> None:
        """One scheduler round's releases as 0.5.23's engine makes them (§1.5a), 1-3 of: a request freed whole
        (``free``, or ``free_swa`` + ``free_full``), a request freed by kv-row segments (``free_kv_row_segments``
        with ``swa_evicted_seqlen`` where the window eviction got to, when the positions without their SWA side are a
        prefix; else ``free_segment`` / ``free_full_segment`` per run of pages), a window eviction (``free_swa``),
        or one by segment (``free_swa_segment`` of whole pages before the last, from a page boundary); inside a free
        group (``free_group_begin`` / ``free_group_end``) when the implementation has them. Inside a group the state
        is compared after each release (the mapping is cleared at once, the free lists wait) and after the end."""
        grouped = self.supports(C.FREE_GROUP) and (not self.supports(C.FREE_SEGMENT)
                                                   or data.draw(st.booleans(), label="free_group"))
        if grouped:
            out = self.call("free_group_begin", "", lambda: (ref.free_group_begin(self.ref), None),
                            self.impl.free_group_begin)
            if not out:
                return
            self.ref = out[0][0]
        ways = ["free", "evict"] + (["segments", "evict_segment"] if self.supports(C.FREE_SEGMENT) else [])
        size = data.draw(st.integers(1, min(3, len(self.reqs))), label="batch_size")
        self.note("release_batch size", size)
        for _ in range(size):
            req = data.choose(sorted(self.reqs.values(), key=lambda r: r.rid), "request")
            way = data.draw(st.sampled_from(ways), label="release")
            if way == "evict":
                self._evict(req, data)
            elif way == "evict_segment":
                self._evict_segment(req, data)
            elif self._free_by_segments(req, data) if way == "segments" else self._free_request(req):
                self._drop(req.rid)
            if grouped:
                self._compare_now("inside a free group")
            if not self.reqs:
                break
        if grouped:
            out = self.call("free_group_end", "", lambda: (ref.free_group_end(self.ref), None),
                            self.impl.free_group_end)
            if out:
                self.ref = out[0][0]
                self.count("free groups per example")

    def _evict_segment(self, req: Req, data: Any) -> None:
        """``free_swa_segment`` of whole pages before ``req``'s last page that still have their SWA side."""
        end = floor_p(len(req.slots) - 1, self.p)
        runs = [(lo, min(hi, end)) for lo, hi, mapped in self._page_runs(req) or () if mapped and lo < end]
        if not runs:
            self.stats.rules["release_batch:evict_segment_not_applicable"] += 1
            return
        lo, hi = data.choose(runs, "run")
        first = data.draw(st.integers(lo // self.p, (hi - 1) // self.p), label="first_page") * self.p
        self._release_segment("free_swa_segment", req, first, hi)

    def _compare_now(self, where: str) -> None:
        """The per-step state comparison in the middle of a step (a free group's releases)."""
        try:
            self.names.compare(self.ref, self.snapshot())
        except Divergence as err:
            self.fail(f"{err} ({where})", check="state", detail=err.detail)

    def _page_runs(self, req: Req) -> list[tuple[int, int, bool]] | None:
        """``req``'s positions as maximal runs of whole pages with and without their SWA side, ``(start, end,
        mapped)`` (``None`` where a page is split: not a shape the segment calls take)."""
        p = self.p
        runs: list[tuple[int, int, bool]] = []
        for start in range(0, len(req.slots), p):
            mapped = [self._has_swa(s) for s in req.slots[start:start + p]]
            if any(mapped) != all(mapped):
                return None
            end = min(start + p, len(req.slots))
            if runs and runs[-1][2] == mapped[0]:
                runs[-1] = (runs[-1][0], end, mapped[0])
            else:
                runs.append((start, end, mapped[0]))
        return runs

    def _free_by_segments(self, req: Req, data: Any) -> bool:
        runs = self._page_runs(req)
        if runs is None:
            self.stats.rules["release_batch:segments_not_applicable"] += 1
            return False
        dead_prefix = len(runs) <= 2 and all(mapped for _, _, mapped in runs[1:])
        if dead_prefix and data.draw(st.booleans(), label="kv_row_segments"):
            evicted = 0 if runs[0][2] else runs[0][1]  # swa_evicted_seqlen: the positions the window left
            pages = -(-len(req.slots) // self.p)
            cuts = sorted({c * self.p for c in data.draw(st.lists(st.integers(1, max(1, pages - 1)), max_size=2),
                                                          label="cuts") if c < pages})
            bounds = [0, *cuts, len(req.slots)]
            ref_segments = [(req.slots[a:b], a) for a, b in itertools.pairwise(bounds)]
            out = self.call("free_kv_row_segments", f"request {req.rid}, segments at {bounds[:-1]}, "
                                                    f"swa_evicted_seqlen={evicted}",
                            lambda: (ref.free_kv_row_segments(self.ref, ref_segments, evicted), None),
                            lambda: self.impl.free_kv_row_segments(
                                [(self._t(self._impl_slots(sl)), a) for sl, a in ref_segments],
                                swa_evicted_seqlen=evicted))
            if out:
                self.ref = out[0][0]
            return bool(out)
        for lo, hi, mapped in runs:
            if not self._release_segment("free_segment" if mapped else "free_full_segment", req, lo, hi):
                return False
        return True

    def _release_segment(self, op: str, req: Req, lo: int, hi: int) -> bool:
        ref_slots = req.slots[lo:hi]
        impl_slots = self._impl_slots(ref_slots)
        self._about_to_change(impl_slots)
        call = {"free_segment": (ref.free_segment, self.impl.free_segment),
                "free_swa_segment": (ref.free_swa_segment, self.impl.free_swa_segment),
                "free_full_segment": (ref.free_full_segment, self.impl.free_full_segment)}[op]
        out = self.call(op, f"request {req.rid}, positions [{lo}, {hi})",
                        lambda: (call[0](self.ref, ref_slots, lo), None),
                        lambda: call[1](self._t(impl_slots), start_pos=lo))
        if out:
            self.ref = out[0][0]
        return bool(out)

    @operation(needs={C.FREE_FULL}, when=lambda self: self.pending is None and self._swa_released(), data=st.data())
    def free_full(self, data: Any) -> None:
        req = data.choose(self._swa_released(), "request")
        self._release("free_full", req, req.slots)
        self._drop(req.rid)

    @operation(when=lambda self: len(self.reqs) >= 2)  # clearing an almost empty pool teaches nothing
    def clear(self) -> None:
        self._about_to_change([self.names.impl_slot(s) for _, r in sorted(self.reqs.items()) for s in r.slots[-1:]])
        out = self.call("clear", "", lambda: (ref.clear(self.ref), None), self.impl.clear)
        if out:
            self.ref = out[0][0]
            self.reqs.clear()
            self.pending = None
            self.names.reset()
            self._retire_unlisted()  # the requests are gone; ReqToTokenPool keeps their slots until given back

    @operation(needs={C.SET_FULL_TO_SWA_MAPPING}, when=lambda self: self.pending is None and self._swappable(),
               on=lambda config: not config.ring, data=st.data())
    def set_full_to_swa_mapping(self, data: Any) -> None:
        """Swap the SWA pages of two full pages of one request (a legal re-attachment, §1.5). Not on a ring config:
        there no SWA page is taken and the mapping stays unwritten, so there is nothing to re-attach (its misuse
        cases are still staged there)."""
        req, pages = data.choose(self._swappable(), "request")
        a, b = data.choose([(x, y) for x in pages for y in pages if x < y], "pages")
        ref_full, ref_swa = self._swap(req, a, b, self.ref.full_to_swa_index_mapping, lambda s: s)
        impl_m = self.snapshot().full_to_swa_index_mapping
        impl_full, impl_swa = self._swap(req, a, b, impl_m, self.names.impl_slot)
        self._about_to_change(impl_full)
        out = self.call("set_full_to_swa_mapping", f"request {req.rid}: swap the SWA pages of its full pages {a}, {b}",
                        lambda: (ref.set_full_to_swa_mapping(self.ref, ref_full, ref_swa), None),
                        lambda: self.impl.set_full_to_swa_mapping(self._t(impl_full), self._t(impl_swa)))
        if out:
            self.ref = out[0][0]
            self.count("set_full_to_swa_mapping per example")

    @operation(needs={C.BACKUP_RESTORE}, when=lambda self: self.pending is None and self.reqs)
    def backup_state(self) -> None:
        """Speculative decoding drafts for running requests: nothing to draft for without one."""
        out = self.call("backup_state", "", lambda: (ref.backup_state(self.ref), None), self.impl.backup_state)
        if out:
            self.pending = Pending(out[0][0], out[1], {rid: list(r.slots) for rid, r in self.reqs.items()})

    @operation(needs={C.BACKUP_RESTORE}, when=lambda self: self.pending is not None)
    def restore_state(self) -> None:
        pending = self.pending
        if pending is None:  # the declaration's `when` guarantees a backup
            return
        out = self.call("restore_state", "", lambda: (ref.restore_state(self.ref, pending.ref_backup), None),
                        lambda: self.impl.restore_state(pending.impl_backup))
        if out:
            self.ref = out[0][0]
            self.reqs = {rid: Req(rid, slots) for rid, slots in pending.reqs.items()}
            self.pending = None
            self._retire_unlisted()  # the drafts' requests are gone
            self.count("restore_state per example")

    @operation(needs={C.KV_BUFFER}, when=lambda self: self.reqs, data=st.data())
    def set_kv_buffer(self, data: Any) -> None:
        req = data.choose(sorted(self.reqs.values(), key=lambda r: r.rid), "request")
        layer = data.draw(st.integers(0, self.config.kv.num_layers - 1), label="layer_id")
        hi = data.draw(st.integers(1, len(req.slots)), label="end")
        lo = data.draw(st.integers(0, hi - 1), label="start")
        ref_slots = req.slots[lo:hi]
        k, v = self._rows(len(ref_slots))
        impl_slots = self._impl_slots(ref_slots)
        shape = (len(ref_slots), self.config.kv.head_num, self.config.kv.head_dim)
        dtype = self.impl.get_kvcache().get_kv_buffer(layer)[0].dtype
        out = self.call(
            "set_kv_buffer", f"layer_id={layer}, request {req.rid}, positions [{lo}, {hi})",
            lambda: (ref.set_kv_buffer(self.ref, layer, ref_slots, k, v), None),
            lambda: self.impl.get_kvcache().set_kv_buffer(
                layer, self._t(impl_slots), torch.tensor(k, dtype=dtype, device=self.impl.device).reshape(shape),
                torch.tensor(v, dtype=dtype, device=self.impl.device).reshape(shape)))
        if out:
            self.ref = out[0][0]
            pool = "swa" if self.config.kv.is_swa_layer(layer) else "full"
            self.layers[pool].add(layer)
            self.note(f"{pool} layers written", len(self.layers[pool]))

    @operation(needs={C.CPU_COPY}, when=lambda self: self.reqs and self.pending is None, data=st.data())
    def get_cpu_copy(self, data: Any) -> None:
        """Retract: copy a request's KV to the CPU, then free it (§1.6)."""
        req = data.choose(sorted(self.reqs.values(), key=lambda r: r.rid), "request")
        impl_slots = self._impl_slots(req.slots)
        out = self.call("get_cpu_copy", f"request {req.rid}, {len(req.slots)} positions",
                        lambda: (self.ref, ref.get_cpu_copy(self.ref, req.slots)),
                        lambda: self.impl.get_cpu_copy(self._t(impl_slots)))
        if out and self._free_request(req):  # retracted only once its slots are released
            self.retracted.append(Retracted(len(req.slots), out[0][1], out[1]))
            self._drop(req.rid)

    @operation(needs={C.CPU_COPY}, needs_any={C.ALLOC_EXTEND, C.ALLOC_EXTEND_SWA_TAIL},
               when=lambda self: self.retracted, data=st.data())
    def load_cpu_copy(self, data: Any) -> None:
        """Resume: allocate the same positions again (tail or 1:1), then load the CPU copy (§2.8)."""
        index = data.draw(st.integers(0, len(self.retracted) - 1), label="retracted")
        saved = self.retracted[index]
        rid, n = self._new_rid(), saved.length
        if not self._admit([rid]):
            return
        tail_ok = self.supports(C.ALLOC_EXTEND_SWA_TAIL)
        if tail_ok and (not self.supports(C.ALLOC_EXTEND) or data.draw(st.booleans(), label="resume_with_tail")):
            tail = swa_tail_len(n, self.w, self.p)
            out = self.call("alloc_extend_swa_tail", f"resume {n} positions as request {rid}, swa_tail_len={tail}",
                            lambda: ref.alloc_extend_swa_tail(self.ref, [0], [n], [-1], n, tail, owners=[rid]),
                            lambda: self.impl.alloc_extend_swa_tail(self._t([0]), self._cpu([0]), self._t([n]),
                                                                    self._cpu([n]), self._t([-1]), n, tail))
            op = "alloc_extend_swa_tail"
        else:
            out = self.call("alloc_extend", f"resume {n} positions as request {rid}",
                            lambda: ref.alloc_extend(self.ref, [0], [n], [-1], n, owners=[rid]),
                            lambda: self.impl.alloc_extend(self._t([0]), self._cpu([0]), self._t([n]), self._cpu([n]),
                                                           self._t([-1]), n))
            op = "alloc_extend"
        if not out:
            self._retire_unlisted()
            return
        self._adopt(op, out, [(rid, [], n)])
        slots = self.reqs[rid].slots
        done = self.call("load_cpu_copy", f"request {rid}, {n} positions",
                         lambda: (ref.load_cpu_copy(self.ref, saved.ref_copy, slots), None),
                         lambda: self.impl.load_cpu_copy(saved.impl_copy, self._t(self._impl_slots(slots))))
        if done:
            self.ref = done[0][0]
            self.retracted.pop(index)

    # ------------------------------------------------------------ misuse (REJECTS_MISUSE): both sides reject

    def _requests(self) -> list[Req]:
        return sorted(self.reqs.values(), key=lambda r: r.rid)

    def _has_free_page(self) -> bool:
        return len(self.ref.full.free_pages) > 0  # both sides agree on the count after every step

    def _double_free(self, op: str) -> MisuseCall:
        p = self.p
        ref_slot, impl_slot = self.ref.full.free_pages[0] * p, self.snapshot().full.free_pages[0] * p
        fn = {"free": (ref.free, self.impl.free), "free_swa": (ref.free_swa, self.impl.free_swa)}[op]
        return MisuseCall(f"free_index=[{ref_slot}] (a free page: double free)",
                          lambda: (fn[0](self.ref, [ref_slot]), None), lambda: fn[1](self._t([impl_slot])))

    @misuse("free", "double_free", when=lambda self: self.pending is None and self._has_free_page())
    def _free_double_free(self, data: Any) -> MisuseCall:
        return self._double_free("free")

    @misuse("free_swa", "double_free", when=lambda self: self.pending is None and self._has_free_page())
    def _free_swa_double_free(self, data: Any) -> MisuseCall:
        return self._double_free("free_swa")

    @misuse("free", "reserved_page", when=lambda self: self.pending is None)
    def _free_reserved(self, data: Any) -> MisuseCall:
        slot = data.draw(st.integers(0, self.p - 1), label="slot")
        return MisuseCall(f"free_index=[{slot}] (reserved page 0)", lambda: (ref.free(self.ref, [slot]), None),
                          lambda: self.impl.free(self._t([slot])))

    @misuse("free", "out_of_range", when=lambda self: self.pending is None)
    def _free_out_of_range(self, data: Any) -> MisuseCall:
        slot = (self.config.num_pages_full + 1) * self.p
        return MisuseCall(f"free_index=[{slot}] (past the pool)", lambda: (ref.free(self.ref, [slot]), None),
                          lambda: self.impl.free(self._t([slot])))

    @misuse("free", "duplicate_slot", when=lambda self: self.pending is None and bool(self.reqs))
    def _free_duplicate(self, data: Any) -> MisuseCall:
        req = data.choose(self._requests(), "request")
        r = [req.slots[0], req.slots[0]]
        return MisuseCall(f"request {req.rid}, its first slot twice", lambda: (ref.free(self.ref, r), None),
                          lambda: self.impl.free(self._t(self._impl_slots(r))))

    def _live_swa_peer(self) -> list[Req]:
        m = self.ref.full_to_swa_index_mapping
        return [r for _, r in sorted(self.reqs.items()) if any(m[s] > 0 for s in r.slots)]

    @misuse("free_full", "live_swa_peer", when=lambda self: self.pending is None and bool(self._live_swa_peer()))
    def _free_full_live_peer(self, data: Any) -> MisuseCall:
        req = data.choose(self._live_swa_peer(), "request")
        return MisuseCall(f"request {req.rid} (its SWA side is still live)",
                          lambda: (ref.free_full(self.ref, req.slots), None),
                          lambda: self.impl.free_full(self._t(self._impl_slots(req.slots))))

    def _released_runs(self) -> list[tuple[Req, tuple[int, int]]]:
        """Runs of whole pages whose SWA side is released, per request (what ``free_segment`` must refuse)."""
        if self.ring:  # every page has its SWA side (the ring): nothing released to refuse
            return []
        return [(r, (lo, hi)) for r in self._requests() for lo, hi, mapped in self._page_runs(r) or () if not mapped]

    @misuse("release_batch", "released_peer",
            when=lambda self: self.supports(C.FREE_SEGMENT) and self.pending is None and bool(self._released_runs()))
    def _segment_released_peer(self, data: Any) -> MisuseCall:
        req, (lo, hi) = data.choose(self._released_runs(), "run")
        slots = req.slots[lo:hi]
        return MisuseCall(f"request {req.rid}, positions [{lo}, {hi}) (their SWA side is released: F2's segment "
                          "shape)", lambda: (ref.free_segment(self.ref, slots, lo), None),
                          lambda: self.impl.free_segment(self._t(self._impl_slots(slots)), start_pos=lo))

    @misuse("release_batch", "unaligned_start",
            when=lambda self: self.p > 1 and self.supports(C.FREE_SEGMENT) and self.pending is None
            and any(len(r.slots) > 1 for r in self._requests()))
    def _segment_unaligned(self, data: Any) -> MisuseCall:
        req = data.choose([r for r in self._requests() if len(r.slots) > 1], "request")
        slots = req.slots[1:]
        return MisuseCall(f"request {req.rid}, positions [1, {len(req.slots)}) with start_pos=1",
                          lambda: (ref.free_segment(self.ref, slots, 1), None),
                          lambda: self.impl.free_segment(self._t(self._impl_slots(slots)), start_pos=1))

    @misuse("release_batch", "end_without_begin", when=lambda self: self.supports(C.FREE_GROUP))
    def _group_end_alone(self, data: Any) -> MisuseCall:
        return MisuseCall("free_group_end() with no group open", lambda: (ref.free_group_end(self.ref), None),
                          self.impl.free_group_end)

    @misuse("alloc", "unaligned_size")
    def _alloc_unaligned(self, data: Any) -> MisuseCall:
        n = data.draw(st.sampled_from([-1] + ([self.p + 1] if self.p > 1 else [])), label="need_size")
        return MisuseCall(f"need_size={n}", lambda: ref.alloc(self.ref, n), lambda: self.impl.alloc(n))

    @misuse("alloc_extend", "last_loc_without_prefix", when=lambda self: bool(self.reqs))
    def _extend_bad_last_loc(self, data: Any) -> MisuseCall:
        req = data.choose(self._requests(), "request")
        n = len(req.slots)
        return MisuseCall(f"request {req.rid}: {n}->{n + 1} with last_loc=-1",
                          lambda: ref.alloc_extend(self.ref, [n], [n + 1], [-1], 1),
                          lambda: self.impl.alloc_extend(self._t([n]), self._cpu([n]), self._t([n + 1]),
                                                         self._cpu([n + 1]), self._t([-1]), 1))

    @misuse("alloc_extend", "extend_num_tokens")
    def _extend_bad_count(self, data: Any) -> MisuseCall:
        return MisuseCall("0->3 with extend_num_tokens=2", lambda: ref.alloc_extend(self.ref, [0], [3], [-1], 2),
                          lambda: self.impl.alloc_extend(self._t([0]), self._cpu([0]), self._t([3]), self._cpu([3]),
                                                         self._t([-1]), 2))

    @misuse("alloc_extend_swa_tail", "unaligned_tail", when=lambda self: self.p > 1)
    def _tail_unaligned(self, data: Any) -> MisuseCall:
        seq = data.draw(st.integers(self.p + 1, 3 * self.p + 1), label="seq_len")
        tail = seq - 1  # tail starts at position 1, not a page boundary (U1)
        return MisuseCall(f"0->{seq}, swa_tail_len={tail} (tail start not page aligned)",
                          lambda: ref.alloc_extend_swa_tail(self.ref, [0], [seq], [-1], seq, tail),
                          lambda: self.impl.alloc_extend_swa_tail(self._t([0]), self._cpu([0]), self._t([seq]),
                                                                  self._cpu([seq]), self._t([-1]), seq, tail))

    def _unaligned(self) -> list[Req]:
        return [r for _, r in sorted(self.reqs.items()) if len(r.slots) % self.p]

    @misuse("alloc_decode", "swa_released",
            when=lambda self: not self.ring and self.pending is None and bool(self._unaligned()))
    def _decode_swa_released(self, data: Any) -> MisuseCall:
        """A request mid-page whose last page's SWA side is released (staged here, with a legal ``free_swa`` of its
        still-mapped positions, when it is not so already: the state is otherwise rare)."""
        req = data.choose(self._unaligned(), "request")
        m = self.ref.full_to_swa_index_mapping
        mapped = [s for s in req.slots if m[s] > 0]
        if m[req.slots[-1]] > 0:
            self._release("free_swa", req, mapped, "its still-mapped positions")
        n, last = len(req.slots), req.slots[-1]
        return MisuseCall(f"request {req.rid} at {n + 1} (its last page's SWA side is released: M5)",
                          lambda: ref.alloc_decode(self.ref, [n + 1], [last]),
                          lambda: self.impl.alloc_decode(self._t([n + 1]), self._cpu([n + 1]),
                                                         self._t([self.names.impl_slot(last)])))

    @misuse("restore_state", "after_release", when=lambda self: self.pending is None and bool(self.reqs))
    def _restore_after_release(self, data: Any) -> MisuseCall:
        req = data.choose(self._requests(), "request")
        out = self.call("backup_state", "", lambda: (ref.backup_state(self.ref), None), self.impl.backup_state)
        if out is None:  # backup_state never fails in the reference
            self.fail("backup_state failed on both sides")
        ref_backup, impl_backup = out[0][0], out[1]
        self._release("free", req, req.slots)
        self._drop(req.rid)
        return MisuseCall("after a free since backup_state", lambda: (ref.restore_state(self.ref, ref_backup), None),
                          lambda: self.impl.restore_state(impl_backup))

    @misuse("set_kv_buffer", "bad_layer", when=lambda self: bool(self.reqs))
    def _set_kv_bad_layer(self, data: Any) -> MisuseCall:
        req = data.choose(self._requests(), "request")
        layer, geo = self.config.kv.num_layers, self.config.kv
        rows = torch.zeros((1, geo.head_num, geo.head_dim), dtype=self.impl.get_kvcache().get_kv_buffer(0)[0].dtype)
        return MisuseCall(f"layer_id={layer} (no such layer)",
                          lambda: (ref.set_kv_buffer(self.ref, layer, req.slots[:1], [[0.0] * geo.row_width],
                                                     [[0.0] * geo.row_width]), None),
                          lambda: self.impl.get_kvcache().set_kv_buffer(
                              layer, self._t(self._impl_slots(req.slots[:1])), rows, rows))

    def _two_mapped(self) -> list[tuple[Req, Req]]:
        m = self.ref.full_to_swa_index_mapping
        mapped = [r for _, r in sorted(self.reqs.items()) if m[r.slots[-1]] > 0]
        return [(a, b) for a in mapped for b in mapped if a.rid != b.rid]

    @misuse("set_full_to_swa_mapping", "foreign_swa_slot", when=lambda self: bool(self._two_mapped()))
    def _remap_foreign(self, data: Any) -> MisuseCall:
        m = self.ref.full_to_swa_index_mapping
        mine, theirs = data.choose(self._two_mapped(), "requests")
        f, s = mine.slots[-1], theirs.slots[-1]
        impl_m = self.snapshot().full_to_swa_index_mapping
        return MisuseCall(f"request {mine.rid}'s slot to request {theirs.rid}'s SWA slot",
                          lambda: (ref.set_full_to_swa_mapping(self.ref, [f], [m[s]]), None),
                          lambda: self.impl.set_full_to_swa_mapping(self._t([self.names.impl_slot(f)]),
                                                                    self._t([impl_m[self.names.impl_slot(s)]])))

    @misuse("set_full_to_swa_mapping", "lengths", when=lambda self: bool(self.reqs))
    def _remap_lengths(self, data: Any) -> MisuseCall:
        req = data.choose(self._requests(), "request")
        return MisuseCall(f"request {req.rid}: one full slot, two SWA slots",
                          lambda: (ref.set_full_to_swa_mapping(self.ref, req.slots[:1], [0, 0]), None),
                          lambda: self.impl.set_full_to_swa_mapping(self._t(self._impl_slots(req.slots[:1])),
                                                                    self._t([0, 0])))


SUITE = Suite(SWAAllocatorMachine, CONFORMANCE_CONFIGS + RING_CONFIGS)
