"""Lockstep state machine for the ``loc_cache`` component (sglang_semantics.md §3, §7 C1-C4, §9 S5 S6).

The ``swa_allocator`` machine plus what a pointer-keyed translation cache can get
wrong: index tensors at addresses the harness controls (:mod:`.index_arena`),
views of one storage at different offsets, equal-length views, a freed index
tensor's address reused by the next batch, scheduler-side translations, forwards
that write every layer's KV through the translation, CUDA-graph capture and
replay, ``register_mapping``, and a second pool (pool 1) that must never see pool
0's translations.

The harness keeps the environment contract E1 of ``kvproof.reference.loc_cache``:
index memory is rewritten only while preparing a batch (``prepare_batch`` up to the
next ``forward`` / ``replay``), and nobody but the allocator's own mutators
translates meanwhile. Within E1 every translation must equal the implementation's
*own* current mapping at the view's contents (freshness; the mapping itself is
compared with the reference by the inherited invariant), and KV written through a
translation must read back from the right SWA slot (the inherited KV comparison).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kvproof.conformance import strategies as st
from kvproof.conformance.check import Suite
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.errors import HarnessBug
from kvproof.conformance.index_arena import IndexArena
from kvproof.conformance.lockstep import Watched, operation, scenario
from kvproof.conformance.swa_allocator import SWAAllocatorMachine
from kvproof.reference import index_memory as im
from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import PoolConfig
from kvproof.reference.contract import Capability
from kvproof.reference.registry import Component

__all__ = ["SUITE", "LocCacheMachine"]

C = Capability
_CELL = 64  # bytes between fresh storages: room for 8 elements, so a reuse never overlaps a neighbour
#: Mutators after which the last translated view is translated again: if the operation
#: changed the mapping under a cached key without invalidating, this read is stale.
PROBE_AFTER = frozenset({"alloc", "alloc_extend_swa_tail", "free", "free_swa", "free_full", "set_full_to_swa_mapping",
                         "clear", "register_mapping", "backup_state", "restore_state"})


@dataclass
class Graph:
    """The captured graph's static buffers (index storage and per-layer K/V)."""

    storage: int
    numel: int
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]


class LocCacheMachine(SWAAllocatorMachine):
    """The allocator machine plus index memory, translations, forwards, capture/replay."""

    component = Component.LOC_CACHE

    def __init__(self, binding: Any) -> None:
        super().__init__(binding)
        self.arena = IndexArena(self.impl.device)
        self.memory = im.IndexMemory()
        self.tensors: dict[int, torch.Tensor] = {}
        self.views: list[im.IndexView] = []
        self.next_base = 0
        self.phase = "quiet"
        self.reuse_base: int | None = None  # the freed out_cache_loc address the next batch's tensors may take
        self.batch_storage: int | None = None  # the last forward's out_cache_loc
        self.graph: Graph | None = None
        self.sticky: im.IndexView | None = None  # the last view translated on pool 0
        self.batch_len = 1  # tokens of the last forward: the next batch is often the same size
        # pool 1: an idle pool of the same geometry, under the same deadline as pool 0
        self.other = Watched(self._deadline("the factory (pool 1)", lambda: binding.factory(binding.config)), self)

    # ------------------------------------------------------------ structural coverage

    @classmethod
    def structure(cls, config: PoolConfig, na: tuple[str, ...] = ()) -> dict[str, int]:
        """The allocator's dimensions, plus: runs of 1-3 translations on both pools; forwards of 1-3 tokens; two
        replays of a captured graph and a mapping registered twice in one example."""
        return {**super().structure(config, na), "translate_loc_from_full_to_swa in a row": 3,
                "translate_loc_from_full_to_swa on pool 0": 1, "translate_loc_from_full_to_swa on pool 1": 1,
                "forward tokens": 3, "replay per example": 2, "register_mapping per example": 2}

    # ------------------------------------------------------------ index memory

    def _store(self, contents: list[int], base: int | None = None) -> int:
        """A storage holding ``contents`` at ``base`` (default: a fresh address)."""
        if base is None:
            base, self.next_base = self.next_base, self.next_base + max(_CELL, 8 * len(contents))
        self.memory, sid = im.new_storage(self.memory, base, contents)
        self.tensors[sid] = self.arena.tensor(base, contents)
        return sid

    def _tensor(self, view: im.IndexView) -> torch.Tensor:
        return self.tensors[view.storage][view.offset:view.offset + view.numel]

    def _describe(self, view: im.IndexView) -> str:
        return (f"storage {view.storage}[{view.offset}:{view.offset + view.numel}] at "
                f"{im.data_ptr(self.memory, view)} = {list(im.view_contents(self.memory, view))}")

    def _t(self, values: list[int]) -> torch.Tensor:
        """Index arguments live in the arena too, at fresh addresses (no accidental reuse)."""
        return self._tensor(self._whole(self._store(values))) if values else super()._t(values)

    def _last_loc_tensor(self, values: list[int]) -> torch.Tensor:
        """During batch preparation ``last_loc`` takes the freed out_cache_loc address (the ABA of R2-a)."""
        base = self.reuse_base
        if self.phase != "prep" or base is None or not values or len(values) * 8 > _CELL:
            return self._t(values)
        return self._tensor(self._whole(self._store_at_reused(values, base)))

    def _store_at_reused(self, contents: list[int], base: int) -> int:
        """A new storage at the freed batch address ``base``; the temporary living there before dies. ``contents``
        fits one cell (``_CELL``): the storage after it starts there."""
        if 8 * len(contents) > _CELL:
            raise HarnessBug(f"{len(contents)} indices at the reused address {base} would overlap the next storage")
        for sid, s in enumerate(self.memory.storages):
            if s.alive and s.base == base:
                self.memory = im.free_storage(self.memory, sid)
        return self._store(contents, base)

    def _about_to_change(self, impl_slots: list[int]) -> None:
        """Quiet phase: the scheduler translates the slots a mutator is about to remap (e.g. PD transfer code);
        the probe after the mutator reads the same key again."""
        if self.phase == "quiet" and impl_slots:
            view = self._whole(self._store(impl_slots[:4]))
            self.views.append(view)
            self._translate(view, 0, aside="scheduler reads the slots about to change")

    def _whole(self, sid: int) -> im.IndexView:
        return im.IndexView(storage=sid, offset=0, numel=len(self.memory.storages[sid].contents))

    def _alive_views(self) -> list[im.IndexView]:
        return [v for v in self.views if self.memory.storages[v.storage].alive]

    def _slot_candidates(self) -> list[int]:
        """Implementation slots worth translating: live ones, the next free pages' slots, padding, -1."""
        live = [self.names.impl_slot(s) for _, r in sorted(self.reqs.items()) for s in r.slots]
        free = [g * self.p for g in self.snapshot().full.free_pages[:3]]
        return sorted(set(live + free)) + [0, -1]

    @operation(environment=True, data=st.data())
    def new_storage(self, data: Any) -> None:
        """A new index tensor at a fresh address (creation rewrites no memory a key may cover)."""
        n = data.draw(st.integers(1, 4), label="numel")
        contents = data.draw(st.lists(st.sampled_from(self._slot_candidates()), min_size=n, max_size=n),
                             label="contents")  # slot numbers: plain values
        view = self._whole(self._store(contents))
        halves = [im.make_view(self.memory, view.storage, o, n // 2) for o in (0, n // 2)] if n % 2 == 0 else []
        self.views += [view, *halves]  # equal-length views of one storage at different offsets (S5)
        self.trace.op(f"new_storage({self._describe(view)})")

    @operation(environment=True, when=lambda self: any(v.numel >= 2 for v in self._alive_views()),
               data=st.data())
    def make_view(self, data: Any) -> None:
        """A view of an existing storage at another offset: same storage, its own address (S5)."""
        base = data.choose([v for v in self._alive_views() if v.numel >= 2], "storage")
        numel = data.draw(st.integers(1, base.numel - 1), label="numel")
        offset = base.offset + data.draw(st.integers(0, base.numel - numel), label="offset")
        view = im.make_view(self.memory, base.storage, offset, numel)
        self.views.append(view)
        self.trace.op(f"make_view({self._describe(view)})")

    # ------------------------------------------------------------ translations

    @operation(when=lambda self: self.phase == "quiet" and self._alive_views(), data=st.data())
    def translate_loc_from_full_to_swa(self, data: Any) -> None:
        """1-3 scheduler-side translations in a row (E1: only in the quiet phase), each on pool 0 or 1.

        Sometimes two equal-length views of one storage at different offsets, back to back (S5).
        """
        siblings = self._siblings()
        if siblings and data.draw(st.booleans(), label="sibling_views"):
            first, second = data.choose(siblings, "views")
            self._translate(first, 0)
            self._translate(second, 0)
            return
        translations = data.draw(st.integers(1, 3), label="translations")
        self.note("translate_loc_from_full_to_swa in a row", translations)
        for _ in range(translations):
            view = data.choose(self._alive_views(), "view")
            self._translate(view, data.draw(st.sampled_from([0, 1]), label="pool"))

    def _siblings(self) -> list[tuple[im.IndexView, im.IndexView]]:
        views = self._alive_views()
        return [(a, b) for a in views for b in views
                if a.storage == b.storage and a.numel == b.numel and a.offset != b.offset]

    def _after_step(self) -> None:
        """Re-translate the last translated view after a mutator of M: a missing invalidation reads stale."""
        view = self.sticky
        if (self.phase == "quiet" and view is not None and self.last_op in PROBE_AFTER
                and self.memory.storages[view.storage].alive):
            self.last_op = ""
            self._translate(view, 0, aside="harness re-reads the last translated view")

    def _translate(self, view: im.IndexView, pool: int, *, aside: str | None = None) -> None:
        """One translation on pool 0 or 1; it must equal that pool's own current mapping at the view's contents
        (freshness; the mapping itself is compared with the reference after every step)."""
        target = self.impl if pool == 0 else self.other
        self.note(f"translate_loc_from_full_to_swa on pool {pool}")
        if pool == 0:
            self.sticky = view
        contents = im.view_contents(self.memory, view)
        mapping = self.snapshot(target).full_to_swa_index_mapping
        want = [mapping[f] for f in contents]
        out = self.call("translate_loc_from_full_to_swa", f"pool {pool}, {self._describe(view)}",
                        lambda: (None, want), lambda: target.translate_loc_from_full_to_swa(self._tensor(view)),
                        aside=aside)
        if out is None:  # the reference side never fails
            return
        self.require_indices("translate_loc_from_full_to_swa", out[1], len(want))
        got = [int(x) for x in out[1].reshape(-1).tolist()]
        if got != want:
            self.fail(f"stale translation on pool {pool}: got {got}, but the mapping now gives {want} "
                      f"for {list(contents)}")
        self.trace.outcome(f" {got}")
        self.last_op = "translate_loc_from_full_to_swa"

    # ------------------------------------------------------------ batches: preparation, forward, capture, replay

    @scenario(needs={C.FORWARD}, when=lambda self: self.phase == "quiet" and self.batch_storage is not None)
    def prepare_batch(self) -> None:
        """The last batch's out_cache_loc is freed; the next batch's tensors may take its address."""
        self._prepare_batch()

    def _prepare_batch(self) -> None:
        sid = self.batch_storage
        if sid is None:  # nothing ran yet: nothing to free
            return
        if self.memory.storages[sid].alive:
            self.memory = im.free_storage(self.memory, sid)
        self.reuse_base, self.phase = self.memory.storages[sid].base, "prep"
        self.last_op = "prepare_batch"
        self.trace.op(f"prepare_batch(address {self.reuse_base} is free again)")

    @operation(needs={C.FORWARD, C.KV_BUFFER}, when=lambda self: self.reqs, data=st.data())
    def forward(self, data: Any) -> None:
        """One forward whose new tokens are a request's last k positions: every layer's KV through the translation."""
        req = data.choose(self._requests(), "request")
        top = min(3, len(req.slots))
        same = self.batch_len <= top and data.draw(st.booleans(), label="same_batch_size")
        k = self.batch_len if same else data.draw(st.integers(1, top), label="tokens")
        self.note("forward tokens", k)
        if self.phase == "quiet" and self.batch_storage is not None and data.draw(st.booleans(), label="prepare"):
            self._prepare_batch()  # the previous out_cache_loc is freed right before this batch
        self._forward_batch(data, req.slots[-k:], f"request {req.rid}")

    def _forward_batch(self, data: Any, ref_slots: list[int], who: str) -> None:
        k = len(ref_slots)
        sid = self._batch_storage(data, self._impl_slots(ref_slots))
        rows = {layer: self._rows(k) for layer in range(self.config.kv.num_layers)}
        loc = self._tensor(self._whole(sid))
        out = self.call("forward", f"{who}, out_cache_loc {self._describe(self._whole(sid))}",
                        lambda: (self._ref_write(ref_slots, rows), None),
                        lambda: self.impl.forward(loc, *self._kv_tensors(rows, k)))
        if out:
            self.ref = out[0][0]
        self._end_batch(sid, k)

    def _end_batch(self, sid: int, k: int) -> None:
        """The forward ran: back to the quiet phase; its out_cache_loc may be translated by the scheduler."""
        self.phase, self.reuse_base, self.batch_storage, self.batch_len = "quiet", None, sid, k
        if self._whole(sid) not in self.views:
            self.views.append(self._whole(sid))

    @scenario(needs={C.FORWARD, C.KV_BUFFER, C.ALLOC_DECODE, C.ALLOC_EXTEND},
              when=lambda self: any(self._extendable(r) for r in self.reqs.values()), data=st.data())
    def decode_step(self, data: Any) -> None:
        """1-4 steps of a running batch in a row, as the scheduler runs them (a pointer-keyed cache goes stale
        across consecutive batches: R2-a, #26152); each iteration is :meth:`_decode_iteration`."""
        for _ in range(data.draw(st.integers(1, 4), label="iterations")):
            if not any(self._extendable(r) for r in self.reqs.values()) or not self._decode_iteration(data):
                return

    def _decode_iteration(self, data: Any) -> bool:
        """One step of a running batch: the last out_cache_loc is freed, the batch grows (alloc_decode or
        alloc_extend; last_loc may land on the freed block), then a forward -- or a replay -- writes the new
        tokens at an out_cache_loc that may reuse the block too, and sometimes the scheduler reads that
        out_cache_loc afterwards (R2-a, the #26152 warning). ``False`` if the allocation failed."""
        if self.phase == "quiet" and self.batch_storage is not None:
            self._prepare_batch()
        ready = [r for _, r in sorted(self.reqs.items()) if self._extendable(r)]
        graph = self.graph
        use_graph = graph is not None and len(ready) >= graph.numel and data.draw(st.booleans(), label="graph_batch")
        if use_graph and graph is not None:
            size, grow = graph.numel, 1  # a decode batch of the captured size replays the graph
        else:
            size = min(self.batch_len, len(ready)) if data.draw(st.booleans(), label="same_batch_size") else \
                data.draw(st.integers(1, min(3, len(ready))), label="batch_size")
            grow = 1 if data.draw(st.booleans(), label="decode") else data.draw(st.integers(1, self.p + 1),
                                                                                label="grow")
        order = data.draw(st.permutations(range(len(ready))), label="batch_order")  # indices: replayable
        batch = [ready[i] for i in order[:size]]
        op = "alloc_decode" if grow == 1 else "alloc_extend"
        before = {r.rid: len(r.slots) for r in batch}
        self._extend(op, [(r.rid, len(r.slots), len(r.slots) + grow) for r in batch])
        if any(len(self.reqs[rid].slots) == n for rid, n in before.items() if rid in self.reqs):
            return False  # the allocation failed: the batch waits (still preparing)
        ref_slots = [s for r in batch for s in self.reqs[r.rid].slots[before[r.rid]:]]
        if use_graph and graph is not None:
            self._replay_batch(data, graph, ref_slots, f"requests {[r.rid for r in batch]}")
        else:
            self._forward_batch(data, ref_slots, f"requests {[r.rid for r in batch]}")
        if self.batch_storage is not None and data.draw(st.booleans(), label="scheduler_reads_out_cache_loc"):
            self._translate(self._whole(self.batch_storage), 0, aside="scheduler reads the new out_cache_loc")
        return True

    def _batch_storage(self, data: Any, contents: list[int]) -> int:
        """out_cache_loc: at the freed address (batch preparation), in place, or fresh."""
        choices = ["fresh"]
        last = self.batch_storage
        if self.phase == "prep" and self.reuse_base is not None:
            choices.append("reuse_address")
        if last is not None and self.memory.storages[last].alive and len(self.memory.storages[last].contents) == len(
                contents):
            choices.append("in_place")
        how = choices[-1] if len(choices) > 1 and data.draw(st.booleans(), label="reuse") else data.draw(
            st.sampled_from(choices), label="out_cache_loc")
        if how == "reuse_address" and self.reuse_base is not None and 8 * len(contents) <= _CELL:
            return self._store_at_reused(contents, self.reuse_base)  # (a larger batch would overlap the next cell:
            # it takes a fresh address instead, with no other draw, so the examples around it stay what they were)
        if how == "in_place" and last is not None:
            self.memory = im.write_index(self.memory, last, 0, contents)
            self.tensors[last].copy_(torch.tensor(contents, dtype=torch.int64))
            return last
        return self._store(contents)

    def _ref_write(self, ref_slots: list[int], rows: dict[int, tuple[list[list[float]], list[list[float]]]]
                   ) -> ref.SWAAllocatorState:
        state = self.ref
        for layer in sorted(rows):
            state = ref.set_kv_buffer(state, layer, ref_slots, *rows[layer])
        return state

    def _kv_tensors(self, rows: dict[int, tuple[list[list[float]], list[list[float]]]], n: int
                    ) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        geo, dtype = self.config.kv, self.impl.get_kvcache().get_kv_buffer(0)[0].dtype
        shape = (n, geo.head_num, geo.head_dim)
        to = {"dtype": dtype, "device": self.impl.device}
        return ({layer: torch.tensor(k, **to).reshape(shape) for layer, (k, _) in rows.items()},
                {layer: torch.tensor(v, **to).reshape(shape) for layer, (_, v) in rows.items()})

    @operation(needs={C.GRAPH_CAPTURE, C.KV_BUFFER}, when=lambda self: self.graph is None, numel=st.integers(1, 3))
    def capture(self, numel: int) -> None:
        """Capture run_once on a static padding buffer (warm-ups, then the capture run)."""
        sid = self._store([0] * numel)
        zeros = {layer: [[0.0] * self.config.kv.row_width] * numel for layer in range(self.config.kv.num_layers)}
        static_k, static_v = self._kv_tensors({layer: (z, z) for layer, z in zeros.items()}, numel)
        static = self._tensor(self._whole(sid))
        out = self.call("capture", f"static out_cache_loc {self._describe(self._whole(sid))}",
                        lambda: (self.ref, None), lambda: self.impl.capture(static, static_k, static_v))
        if out:
            self.graph = Graph(sid, numel, static_k, static_v)

    @operation(needs={C.GRAPH_CAPTURE, C.KV_BUFFER}, when=lambda self: self.graph is not None and any(
        len(r.slots) >= self.graph.numel for r in self.reqs.values()), data=st.data())
    def replay(self, data: Any) -> None:
        """Fill the static buffers with a batch (batch preparation), then replay the captured graph."""
        graph = self.graph
        if graph is None:  # the declaration's `when` guarantees a graph
            return
        req = data.choose([r for _, r in sorted(self.reqs.items()) if len(r.slots) >= graph.numel], "request")
        if self.phase == "quiet" and self.batch_storage is not None and data.draw(st.booleans(), label="prepare"):
            self._prepare_batch()
        self._replay_batch(data, graph, req.slots[-graph.numel:], f"request {req.rid}")

    def _replay_batch(self, data: Any, graph: Graph, ref_slots: list[int], who: str) -> None:
        impl_slots = self._impl_slots(ref_slots)
        batch = self._batch_storage(data, impl_slots)  # the batch's own out_cache_loc, copied into the static buffer
        self.memory = im.write_index(self.memory, graph.storage, 0, impl_slots)
        self.tensors[graph.storage].copy_(torch.tensor(impl_slots, dtype=torch.int64))
        rows = {layer: self._rows(graph.numel) for layer in range(self.config.kv.num_layers)}
        ks, vs = self._kv_tensors(rows, graph.numel)
        for layer in rows:
            graph.k[layer].copy_(ks[layer])
            graph.v[layer].copy_(vs[layer])
        out = self.call("replay", f"{who}, static out_cache_loc = {impl_slots}",
                        lambda: (self._ref_write(ref_slots, rows), None), self.impl.replay)
        if out:
            self.ref = out[0][0]
            self.count("replay per example")
        self._end_batch(batch, graph.numel)

    # ------------------------------------------------------------ register_mapping

    @operation(needs={C.REGISTER_MAPPING}, when=lambda self: self.pending is None and self.reqs)
    def register_mapping(self) -> None:
        """A fresh mapping (every page free) registered with the same KV pool (#25889)."""
        out = self.call("register_mapping", "", lambda: (ref.clear(self.ref), None), self.impl.register_mapping)
        if out:
            self.ref = out[0][0]
            self.reqs.clear()
            self.names.reset()
            self.count("register_mapping per example")



SUITE = Suite(LocCacheMachine, CONFORMANCE_CONFIGS)
