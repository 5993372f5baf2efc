"""The ghost ownership model of an SWA composite allocator: the harm continuation of ``swa_allocator``,
``loc_cache`` and ``decode_prealloc`` (:mod:`kvproof.conformance.harm`).

After a divergence the reference cannot judge the implementation, so :class:`SWAGhost` drives the implementation
alone and keeps, from what each call handed out, which request holds each position's full slot, and which SWA slot
the mapping gave it when it was allocated (sglang_semantics.md §1.5: ``M[full] = swa``, 0 = none). It plays a
correct engine: extends (``alloc_extend``; §2.7 M5: only a request whose last token still has its SWA slot or
that ends on a page boundary), decodes (``alloc_decode``), evicts the part of a request that left the window
(``free_swa`` of the still-mapped positions older than ``W + P``, §1.6 ``_evict_swa``), frees (``free``, or
``free_swa`` + ``free_full`` where the implementation does not free released positions, §2.7), and writes each
position's KV once, with a tag naming the write, on one full and one SWA layer. After every call it looks at the
implementation's free lists and mapping and reads every tag back (:meth:`SWAGhost.harm`).
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

import torch

from kvproof.conformance.harm import Harm, severity
from kvproof.conformance.lockstep import call_with_timeout
from kvproof.conformance.tensors import int64s
from kvproof.reference.arith import floor_p
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.errors import OutOfMemory

__all__ = ["SWAGhost"]

C = Capability
#: A tag is a write's number in base :data:`BASE` over the first two values of a row (exact in bfloat16); a walk
#: makes far fewer than ``BASE ** 2`` writes (one per position allocated).
BASE = 200


class SWAGhost:
    """An SWA composite allocator driven alone; ``owners``: request id -> the implementation full slot of each
    position (the harness's table at the divergence)."""

    def __init__(self, impl: Any, config: PoolConfig, caps: frozenset[Capability], owners: dict[int, list[int]],
                 next_rid: int, op_timeout: float | None) -> None:
        self.impl, self.config, self.caps, self.timeout = impl, config, caps, op_timeout
        self.p, self.w = config.page_size, config.sliding_window_size
        self.slots: dict[int, list[int]] = {rid: list(s) for rid, s in owners.items() if s}
        self.next_rid = next_rid
        geo = config.kv
        self.layers: dict[str, int] = {}
        if C.KV_BUFFER in caps and geo.row_width >= 2:
            self.layers = {"full": geo.full_attention_layer_ids[0]}
            if geo.swa_attention_layer_ids:
                self.layers["swa"] = geo.swa_attention_layer_ids[0]
        self.writes: dict[int, tuple[int, int]] = {}  # tag -> (request, position), every write ever made
        self.tags: dict[tuple[str, int, int], int] = {}  # (pool, request, position) -> the tag it wrote last
        self.swa_slot: dict[tuple[int, int], int] = {}  # (request, position) -> the SWA slot it was written at
        self.fresh: set[tuple[int, int]] = set()  # positions the last call allocated
        snap = self._snap()
        self.early: Harm | None = None  # a write at the divergence that raised (reported by the first harm())
        for rid, slots in self.slots.items():  # tag what the requests hold at the divergence
            self.early = self.early or self._write(rid, range(len(slots)), snap)

    # ------------------------------------------------------------ calls

    def _call(self, fn: Any) -> Any:
        return call_with_timeout(fn, self.timeout)

    def _snap(self) -> Any:
        return self._call(self.impl.snapshot)

    def _t(self, values: list[int]) -> torch.Tensor:
        return int64s(values, self.impl.device)

    @staticmethod
    def _cpu(values: list[int]) -> torch.Tensor:
        return int64s(values)

    def _write(self, rid: int, positions: Any, snap: Any) -> Harm | None:
        """Tag ``rid``'s ``positions`` on each watched layer (SWA: only those with an SWA slot); a write the
        implementation refuses on slots it handed out is a harm."""
        m, width = snap.full_to_swa_index_mapping, self.config.kv.row_width
        for pool, layer in self.layers.items():
            chosen = [i for i in positions if pool == "full" or m[self.slots[rid][i]] > 0]
            chosen = chosen[:max(0, BASE * BASE - 1 - len(self.writes))]
            if not chosen:
                continue
            tags = [len(self.writes) + 1 + n for n in range(len(chosen))]
            rows = [[float(tag % BASE), float(tag // BASE)] + [0.0] * (width - 2) for tag in tags]
            kv = self._call(self.impl.get_kvcache)
            dtype = self._call(lambda: kv.get_kv_buffer(layer))[0].dtype  # noqa: B023 - called at once
            shape = (len(chosen), self.config.kv.head_num, self.config.kv.head_dim)
            rows_t = torch.tensor(rows, dtype=dtype, device=self.impl.device).reshape(shape)
            slots = self._t([self.slots[rid][i] for i in chosen])
            harm = self._guard(f"set_kv_buffer(layer {layer}) of request {rid}'s positions {chosen[0]}..{chosen[-1]}",
                               lambda: kv.set_kv_buffer(layer, slots, rows_t, rows_t.clone()))  # noqa: B023
            if harm is not None:  # nothing was written: no tag to read back
                return harm
            for i, tag in zip(chosen, tags, strict=True):
                self.writes[tag] = (rid, i)
                self.tags[(pool, rid, i)] = tag
                if pool == "swa":
                    self.swa_slot[(rid, i)] = m[self.slots[rid][i]]
        return None

    # ------------------------------------------------------------ the engine's moves

    def _extendable(self, rid: int, m: tuple[int, ...]) -> bool:
        slots = self.slots[rid]
        return len(slots) % self.p == 0 or m[slots[-1]] > 0

    def step(self, rng: random.Random) -> tuple[str, Harm | None] | None:
        self.fresh = set()  # only an allocation's own positions are fresh
        snap = self._snap()
        m = snap.full_to_swa_index_mapping
        moves: list[str] = ["extend"]
        if any(self._extendable(r, m) for r in self.slots):
            moves += ["extend", "decode"]
        if self.slots:
            moves += ["free", "free"]
            if any(self._evictable(r, m) for r in self.slots):
                moves.append("evict")
        move = rng.choice(moves)
        if move == "free":
            rid = rng.choice(sorted(self.slots))
            return self._free(rid, m)
        if move == "evict":
            rid = rng.choice([r for r in sorted(self.slots) if self._evictable(r, m)])
            gone = self._evictable(rid, m)
            line = f"free_swa request {rid}: positions {gone[0]}..{gone[-1]} left the window"
            return line, self._guard(line, lambda: self.impl.free_swa(self._t([self.slots[rid][i] for i in gone])))
        if move == "decode":
            ready = [r for r in sorted(self.slots) if self._extendable(r, m)]
            batch = rng.sample(ready, min(len(ready), rng.choice((1, 1, 2, 3))))
            return self._extend("alloc_decode", [(r, 1) for r in batch], m)
        ready = [r for r in sorted(self.slots) if self._extendable(r, m)]
        if ready and rng.random() < 0.4:
            rid = rng.choice(ready)
            grow = rng.choice((1, self.p - 1 or 1, self.p, self.p + 1, self.w))
        else:
            rid = self.next_rid
            self.next_rid += 1
            top = self.config.size_swa
            grow = rng.choice((1, self.p, self.p + 1, self.w, self.w + self.p, top // 2 or 1, top,
                               rng.randint(1, top)))
        return self._extend("alloc_extend", [(rid, grow)], m)

    def _evictable(self, rid: int, m: tuple[int, ...]) -> list[int]:
        """The still-mapped positions of ``rid`` below its window (§1.6: ``floor_p(len - 1 - W - P)``)."""
        slots = self.slots[rid]
        end = floor_p(max(0, len(slots) - 1 - self.w - self.p), self.p)
        return [i for i in range(end) if m[slots[i]] > 0]

    def _guard(self, line: str, fn: Any) -> Harm | None:
        try:
            self._call(fn)
        except OutOfMemory:
            return Harm("raised", f"{line} raised OutOfMemory: a release may not run out of memory")
        except Exception as err:  # noqa: BLE001 - a legal call that raises is the consequence looked for
            return Harm("raised", f"{line} raised {type(err).__name__}: {err}")
        return None

    def _extend(self, op: str, batch: list[tuple[int, int]], m: tuple[int, ...]) -> tuple[str, Harm | None]:
        pre = [len(self.slots.get(r, [])) for r, _ in batch]
        seq = [p + n for p, (_, n) in zip(pre, batch, strict=True)]
        last = [self.slots[r][-1] if p else -1 for p, (r, _) in zip(pre, batch, strict=True)]
        line = f"{op} " + ", ".join(f"request {r}: {p}->{s}" for (r, _), p, s in zip(batch, pre, seq, strict=True))
        if Capability(op) not in self.caps:  # SGLang at P == 1: the engine extends and decodes with alloc (§1.2)
            op = "alloc"
            line = "alloc " + line.split(" ", 1)[1]
        try:
            if op == "alloc":
                out = self._call(lambda: self.impl.alloc(sum(seq) - sum(pre)))
            elif op == "alloc_decode":
                out = self._call(lambda: self.impl.alloc_decode(self._t(seq), self._cpu(seq), self._t(last)))
            else:
                out = self._call(lambda: self.impl.alloc_extend(self._t(pre), self._cpu(pre), self._t(seq),
                                                                self._cpu(seq), self._t(last), sum(seq) - sum(pre)))
        except OutOfMemory:
            return f"{line} -> out of memory", None
        except Exception as err:  # noqa: BLE001 - the consequence looked for
            return f"{line} -> raised", Harm("raised", f"{line} raised {type(err).__name__}: {err}")
        got = [int(x) for x in out.reshape(-1).tolist()]
        if len(got) != sum(seq) - sum(pre):
            return f"{line} -> {len(got)} slots", Harm("raised", f"{line} returned {len(got)} slots for "
                                                                 f"{sum(seq) - sum(pre)} new positions")
        at, self.fresh = 0, set()
        for (rid, n), p in zip(batch, pre, strict=True):
            self.slots.setdefault(rid, []).extend(got[at:at + n])
            self.fresh |= {(rid, i) for i in range(p, p + n)}
            at += n
        snap = self._snap()
        harm = None
        for (rid, _), p, s in zip(batch, pre, seq, strict=True):
            harm = harm or self._write(rid, range(p, s), snap)
        return f"{line} -> full slots {_span(got)}", harm

    def _free(self, rid: int, m: tuple[int, ...]) -> tuple[str, Harm | None]:
        """Release all of ``rid`` the way a correct caller may (§2.7)."""
        slots = self.slots[rid]
        mapped = [s for s in slots if m[s] > 0]
        if len(mapped) == len(slots) or C.FREE_RELEASED_SWA in self.caps:
            line = f"free request {rid} ({len(slots)} positions)"
            harm = self._guard(line, lambda: self.impl.free(self._t(slots)))
        elif C.FREE_FULL in self.caps:
            line = f"free_swa + free_full request {rid} ({len(slots)} positions, {len(mapped)} still in the window)"
            harm = (self._guard(line, lambda: self.impl.free_swa(self._t(mapped))) if mapped else None) or \
                self._guard(line, lambda: self.impl.free_full(self._t(slots)))
        else:
            return f"request {rid} cannot be freed (released positions, no free_full)", None
        self.slots.pop(rid)
        for key in [k for k in self.tags if k[1] == rid]:
            self.tags.pop(key)
        return line, harm

    # ------------------------------------------------------------ what a maintainer cares about

    def owners(self) -> str:
        if not self.slots:
            return "no request holds anything"
        snap = self._snap()
        m, p = snap.full_to_swa_index_mapping, self.p
        return "\n".join(f"request {rid}: {len(s)} positions, full pages {sorted({x // p for x in s})}, SWA pages "
                         f"{sorted({m[x] // p for x in s if m[x] > 0})}" for rid, s in sorted(self.slots.items()))

    def harm(self) -> Harm | None:
        snap = self._snap()
        found = [h for h in (self.early, self._kv(snap), *self._pages(snap)) if h is not None]
        return min(found, key=lambda h: severity(h.kind)) if found else None

    def _pages(self, snap: Any) -> list[Harm | None]:
        m, p = snap.full_to_swa_index_mapping, self.p
        out: list[Harm | None] = []
        for pool in ("full", "swa"):
            held: dict[int, set[int]] = defaultdict(set)
            for rid, slots in self.slots.items():
                for i, s in enumerate(slots):
                    if pool == "full":
                        held[s // p].add(rid)
                    elif m[s] > 0:
                        held[m[s] // p].add(rid)
                    elif (rid, i) in self.fresh and pool == "swa":
                        out.append(Harm("reserved page handed out",
                                        f"request {rid}'s position {i}, allocated by the last call, has no SWA slot "
                                        f"(its mapping entry at full slot {s} reads 0): the reserved page went out"))
            free = getattr(snap, pool).free_pages
            seen: set[int] = set()
            for page in free:
                if page in seen:
                    out.append(Harm("duplicate in a free list", f"{pool} page {page} is in the {pool} free list twice "
                                                                f"(two later allocations will both get it)"))
                seen.add(page)
                if held.get(page):
                    out.append(Harm("freed while owned", f"{pool} page {page} is in the {pool} free list while "
                                                         f"request(s) {sorted(held[page])} hold it"))
            for page, rids in sorted(held.items()):
                if len(rids) > 1:
                    out.append(Harm("two owners", f"{pool} page {page} is held by requests {sorted(rids)} at once"))
                if page == 0:
                    out.append(Harm("reserved page handed out", f"the reserved {pool} page 0 is held by request(s) "
                                                                f"{sorted(rids)}"))
        return out

    def _kv(self, snap: Any) -> Harm | None:
        """Every tag read back: another request's tag at a position is a cross-request read."""
        if not self.layers:
            return None
        m = snap.full_to_swa_index_mapping
        kv = self._call(self.impl.get_kvcache)
        for pool, layer in self.layers.items():
            k = self._call(lambda: kv.get_kv_buffer(layer))[0]  # noqa: B023 - called at once
            want: list[tuple[int, int, int, int]] = []  # (request, position, slot read, tag)
            for (where, rid, i), tag in self.tags.items():
                if where != pool:
                    continue
                full = self.slots[rid][i]
                slot = full if pool == "full" else self.swa_slot[(rid, i)]
                if pool == "swa" and m[full] != slot:  # evicted or moved since: not this request's row any more
                    continue
                want.append((rid, i, slot, tag))
            if not want:
                continue
            rows = k[self._t([w[2] for w in want])].reshape(len(want), -1)[:, :2].float().cpu().tolist()
            for (rid, i, slot, tag), row in zip(want, rows, strict=True):
                have = int(row[0]) + int(row[1]) * BASE
                if have == tag:
                    continue
                other = self.writes.get(have)
                if other is not None and other[0] != rid:
                    return Harm("cross-request KV read",
                                f"request {rid} reads position {i}'s {pool} KV (layer {layer}, slot {slot}) and "
                                f"gets what request {other[0]} wrote for its position {other[1]}")
                by = f"by its own position {other[1]}" if other else "by a write the walk did not make"
                return Harm("two owners", f"request {rid}'s {pool} KV at position {i} (layer {layer}, slot {slot}) "
                                          f"was overwritten {by}: one slot serves two positions")
        return None

    def settle(self) -> tuple[list[str], Harm | None]:
        self.fresh, lines = set(), []
        for rid in sorted(self.slots):
            line, harm = self._free(rid, self._snap().full_to_swa_index_mapping)
            lines.append(line)
            if harm is not None:
                return lines, harm
            harm = self.harm()
            if harm is not None:
                return lines, harm
        if self.slots:  # some could not be freed: nothing to conclude about capacity
            return lines, None
        snap = self._snap()
        lost = {pool: getattr(snap, pool).num_pages - len(set(getattr(snap, pool).free_pages) - {0})
                for pool in ("full", "swa")}
        if not any(lost.values()):
            return lines, None
        n = self.config.size_swa
        probe = f"alloc_extend request {self.next_rid}: 0->{n} (the SWA pool's size: fits the empty pool)"
        if C.ALLOC_EXTEND not in self.caps:
            probe = "alloc" + probe[len("alloc_extend"):]
        try:
            if C.ALLOC_EXTEND in self.caps:
                out = self._call(lambda: self.impl.alloc_extend(self._t([0]), self._cpu([0]), self._t([n]),
                                                                self._cpu([n]), self._t([-1]), n))
            else:
                out = self._call(lambda: self.impl.alloc(n))
        except OutOfMemory:
            refused = True
        else:
            refused = False
            self._call(lambda: self.impl.free(out))
        lines.append(probe + (" -> out of memory" if refused else " -> ok"))
        pools = ", ".join(f"{pool} pool {getattr(snap, pool).num_pages - lost[pool]} of "
                          f"{getattr(snap, pool).num_pages} pages free" for pool in ("full", "swa"))
        consequence = ("a request that fits the empty pool is refused" if refused else
                       "the pool still admits its largest request, with less slack")
        return lines, Harm("capacity lost", f"every request freed, yet {pools}: {sum(lost.values())} page(s) "
                                            f"neither free nor held; {consequence}")


def _span(slots: list[int]) -> str:
    """A slot list, runs of consecutive slots shortened (``[4..7, 12]``)."""
    if not slots:
        return "[]"
    runs, start, prev = [], slots[0], slots[0]
    for s in slots[1:]:
        if s == prev + 1:
            prev = s
            continue
        runs.append(f"{start}..{prev}" if prev > start else str(start))
        start = prev = s
    runs.append(f"{start}..{prev}" if prev > start else str(start))
    return "[" + ", ".join(runs) + "]"
