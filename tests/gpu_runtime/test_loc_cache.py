"""The torch runtime's loc cache against ``kvproof.reference.loc_cache`` (sglang_semantics.md §3, §9 S5, S6).

Index tensors live at addresses the test picks (``IndexArena``: ``torch.frombuffer``
over one ``bytearray`` on the CPU), so the reference's traces -- address reuse
included -- replay exactly. Under the upstream design every translation the runtime
uses equals ``M[contents]`` at that moment; hits really happen (the same tensor object
comes back); the graph emulation replays fresh gathers, or the warm-up's constant
when ``run_once`` does not invalidate (S6), and matches a real CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from kvproof.conformance.mutants.loc_cache import CFG, CFG1, WITNESSES, IndexArena, stale
from kvproof.gpu_runtime import SWAKVPool, SWATokenToKVPoolAllocator
from kvproof.reference import KVGeometry, PoolConfig, check_invariants
from kvproof.reference import loc_cache as lc
from kvproof.reference import swa_allocator as sa
from kvproof.reference.contract import LocCacheSystemUnderTest
from kvproof.reference.errors import InvalidOperation, PoolError

Tensor = torch.Tensor
P = lc.InvalidationPoint
B = 1024
CPU = torch.device("cpu")
TWO_SWA = PoolConfig(size_full=16, size_swa=16, page_size=1, sliding_window_size=2,
                     kv=KVGeometry(full_attention_layer_ids=(1,), swa_attention_layer_ids=(0, 2)))


def t(values: Any, device: str | torch.device = "cpu") -> Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def extend(a: SWATokenToKVPoolAllocator, pre: int, seq: int, last: Tensor) -> Tensor:
    d = a.device
    return a.alloc_extend(t([pre], d), t([pre]), t([seq], d), t([seq]), last, seq - pre)


def rows(first: float, n: int = 1, device: str | torch.device = "cpu") -> Tensor:
    """``n`` K (or V) rows of the default geometry (1 head x 2)."""
    return (torch.arange(2 * n, dtype=torch.float32) + first).reshape(n, 1, 2).to(device)


class SpyPool(SWAKVPool):
    """Logs every translation it hands out (outside captures) next to ``M[x]`` at that moment."""

    def __init__(self, config: PoolConfig, device: torch.device | str | None = None) -> None:
        super().__init__(config, device)
        self.log: list[tuple[Tensor, list[int], list[int]]] = []

    def translate_loc_from_full_to_swa(self, kv_indices: Tensor) -> Tensor:
        out = super().translate_loc_from_full_to_swa(kv_indices)
        if self._recording is None:
            assert self.full_to_swa_index_mapping is not None
            self.log.append((out, out.tolist(), self.full_to_swa_index_mapping[kv_indices].tolist()))
        return out


class Spied(SWATokenToKVPoolAllocator):
    kv_pool_class = SpyPool


def spy_log(a: SWATokenToKVPoolAllocator) -> list[tuple[Tensor, list[int], list[int]]]:
    pool = a.get_kvcache()
    assert isinstance(pool, SpyPool)
    return pool.log


# ---------------------------------------------------------------- the witnesses, upstream design


@pytest.mark.parametrize("name", sorted(WITNESSES))
def test_witness_reads_nothing_stale_upstream(name: str, device: str) -> None:
    built: list[SWATokenToKVPoolAllocator] = []

    def factory(config: PoolConfig) -> SWATokenToKVPoolAllocator:
        built.append(Spied(config, device=device))
        return built[-1]

    seen = WITNESSES[name].run(factory)
    assert seen and stale(seen) == [], f"{name}: the upstream design read {stale(seen)}"
    log = [entry for a in built for entry in spy_log(a)]
    assert log, "the trace translated nothing"
    assert all(got == fresh for _, got, fresh in log), "a translation differed from M[contents] when it was used"
    for a in built:
        a.check_invariants()


def test_second_swa_layer_hits_the_first_layers_translation(device: str) -> None:
    """C2: one gather per forward; the other SWA layers get the cached tensor itself."""
    a = Spied(TWO_SWA, device=device)
    loc = a.alloc(4)
    a.forward(loc, {i: rows(i, 4, device) for i in (0, 1, 2)}, {i: rows(i + 9, 4, device) for i in (0, 1, 2)})
    (first, got, fresh), (second, _, _) = spy_log(a)
    assert second is first and got == fresh == loc.tolist()
    for layer in (0, 2):  # SWA layers, at M[loc]
        assert torch.equal(a.get_kvcache().get_kv_buffer(layer)[0][first], rows(layer, 4, device))
    assert torch.equal(a.get_kvcache().get_kv_buffer(1)[0][loc], rows(1, 4, device))


def test_same_address_view_hits_other_offset_misses(device: str) -> None:
    """PR #25824's own test: ``loc[:4]`` twice is one key; ``loc[0:5]`` / ``loc[5:10]`` are two."""
    a = SWATokenToKVPoolAllocator(TWO_SWA, device=device)
    pool, loc = a.get_kvcache(), a.alloc(10)
    view_a, view_b = loc[:4], loc[:4]
    assert view_a is not view_b and view_a.data_ptr() == view_b.data_ptr()
    assert pool.translate_loc_from_full_to_swa(view_b) is pool.translate_loc_from_full_to_swa(view_a)
    lo, hi = pool.translate_loc_from_full_to_swa(loc[0:5]), pool.translate_loc_from_full_to_swa(loc[5:10])
    assert lo is not hi and lo.tolist() == loc[:5].tolist() and hi.tolist() == loc[5:].tolist()


def test_int32_indices_are_keyed_by_the_callers_tensor() -> None:
    """A converted copy would be a fresh tensor per call, at whatever address the allocator recycles."""
    a = SWATokenToKVPoolAllocator(TWO_SWA, device="cpu")
    a.alloc(4)
    x = torch.tensor([1, 2, -1], dtype=torch.int32)
    first = a.translate_loc_from_full_to_swa(x)
    assert a.translate_loc_from_full_to_swa(x) is first and first.tolist() == [1, 2, -1]
    assert a.get_kvcache()._cached_loc_key == (x.data_ptr(), 3)


# ---------------------------------------------------------------- keys: S5 and R2-a, against the reference


class StorageBasePool(SWAKVPool):
    key_scheme = lc.KeyScheme.STORAGE_BASE


class StorageBaseKey(SWATokenToKVPoolAllocator):
    kv_pool_class = StorageBasePool


def _s5_reference(policy: lc.LocCachePolicy) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    sys = lc.initial_system(CFG1, policy)
    sys, _ = lc.alloc(sys, 10)
    sys, sid = lc.new_storage(sys, B, [5, 6, 7, 8, 9, 10])
    sys, low = lc.translate_loc_from_full_to_swa(sys, lc.make_view(sys, sid, 0, 3))
    sys, high = lc.translate_loc_from_full_to_swa(sys, lc.make_view(sys, sid, 3, 3))
    return low, high, len(sys.stale_reads)


@pytest.mark.parametrize(("cls", "scheme"), [(SWATokenToKVPoolAllocator, lc.KeyScheme.DATA_PTR),
                                             (StorageBaseKey, lc.KeyScheme.STORAGE_BASE)])
def test_s5_views_of_one_storage(cls: type[SWATokenToKVPoolAllocator], scheme: lc.KeyScheme) -> None:
    a = cls(CFG1, device="cpu")
    a.alloc(10)  # slots 1..10 -> SWA 1..10
    x = IndexArena(CPU).storage(B, [5, 6, 7, 8, 9, 10])
    low, high = x[0:3], x[3:6]
    assert low.data_ptr() != high.data_ptr()
    assert low.untyped_storage().data_ptr() == high.untyped_storage().data_ptr()
    got = tuple(tuple(a.translate_loc_from_full_to_swa(view).tolist()) for view in (low, high))
    ref_low, ref_high, ref_stale = _s5_reference(lc.LocCachePolicy(key_scheme=scheme))
    assert got == (ref_low, ref_high)
    assert (got[1] == (5, 6, 7)) == (scheme is lc.KeyScheme.STORAGE_BASE) == (ref_stale == 1)


def test_address_reuse_without_invalidation_is_stale_even_upstream() -> None:
    """R2-a: the key is an address, not contents; a scheduler-side translation in batch preparation breaks E1."""
    a, mem = SWATokenToKVPoolAllocator(CFG1, device="cpu"), IndexArena(CPU)
    a.alloc(10)
    x = mem.storage(B, [5, 6, 7, 8, 9, 10])
    assert a.translate_loc_from_full_to_swa(x).tolist() == [5, 6, 7, 8, 9, 10]
    y = mem.storage(B, [1, 2, 3, 4, 5, 6])  # a new storage at the freed address, same numel
    assert y.untyped_storage() is not x.untyped_storage() and y.data_ptr() == x.data_ptr()
    assert a.translate_loc_from_full_to_swa(y).tolist() == [5, 6, 7, 8, 9, 10]  # as the reference's R2-a test


def test_each_pool_has_its_own_cache() -> None:
    a, b = SWATokenToKVPoolAllocator(CFG1, device="cpu"), SWATokenToKVPoolAllocator(CFG1, device="cpu")
    a.alloc(4)
    v = IndexArena(CPU).storage(B, [1, 2])
    assert a.translate_loc_from_full_to_swa(v).tolist() == [1, 2]
    assert b.translate_loc_from_full_to_swa(v).tolist() == [0, 0]  # reference: pool 1 answers (0, 0)
    assert a.get_kvcache()._cached_loc_key is not None and b.get_kvcache()._cached_loc_key is not None


# ---------------------------------------------------------------- where the invalidation points are


Setup = Callable[[SWATokenToKVPoolAllocator, dict[str, Any]], None]


def _base(a: SWATokenToKVPoolAllocator, m: dict[str, Any]) -> None:
    """Two requests at P=2: A on slots 2..5 (pages 1, 2), B on slot 6 (page 3)."""
    m["A"], m["B"] = extend(a, 0, 4, t([-1])), extend(a, 0, 1, t([-1]))
    m["backup"] = a.backup_state()


CALLS: dict[str, tuple[Callable[[SWATokenToKVPoolAllocator, dict[str, Any]], object], bool]] = {
    # name: (call, invalidates?)
    "alloc": (lambda a, m: a.alloc(2), True),
    "alloc (fails)": (lambda a, m: a.alloc(3), True),
    "alloc_extend": (lambda a, m: extend(a, 1, 2, t([6])), True),
    "alloc_extend (fails)": (lambda a, m: extend(a, 1, 2, t([5])), True),
    "alloc_decode": (lambda a, m: a.alloc_decode(t([2]), t([2]), t([6])), True),
    "alloc_extend_swa_tail": (lambda a, m: a.alloc_extend_swa_tail(t([0]), t([0]), t([4]), t([4]), t([-1]), 4, 2),
                              True),
    "alloc_extend_swa_tail (fails)": (lambda a, m: a.alloc_extend_swa_tail(t([0]), t([0]), t([4]), t([4]), t([-1]),
                                                                           4, 1), True),
    "free": (lambda a, m: a.free(m["B"]), True),
    "free_swa": (lambda a, m: a.free_swa(m["A"][:2]), True),
    "free_swa (double free fails)": (lambda a, m: a.free_swa(t([8])), True),
    "set_full_to_swa_mapping": (lambda a, m: a.set_full_to_swa_mapping(m["A"], t([4, 5, 2, 3])), True),
    "set_full_to_swa_mapping (fails after the checks)": (lambda a, m: a.set_full_to_swa_mapping(t([8]), t([2])),
                                                         True),
    "set_full_to_swa_mapping (empty)": (lambda a, m: a.set_full_to_swa_mapping(t([]), t([])), False),
    "set_full_to_swa_mapping (lengths: fails first)": (lambda a, m: a.set_full_to_swa_mapping(t([2]), t([])), False),
    "clear": (lambda a, m: a.clear(), True),
    "register_mapping": (lambda a, m: a.register_mapping(), True),
    "free_full": (lambda a, m: a.free_full(m["B"]), False),
    "backup_state": (lambda a, m: a.backup_state(), False),
    "restore_state": (lambda a, m: a.restore_state(m["backup"]), False),
    "forward": (lambda a, m: a.forward(m["A"][:1], {0: rows(1)}, {0: rows(2)}), True),
    "capture": (lambda a, m: a.capture(t([0]), {0: rows(0)}, {0: rows(0)}), True),
    "translate (a hit)": (lambda a, m: a.translate_loc_from_full_to_swa(m["x"]), False),
}


@pytest.mark.parametrize("name", sorted(CALLS))
def test_invalidation_points(name: str) -> None:
    """Every mutator of M drops the cache at its start (failing calls too); free_full / backup / restore do not."""
    call, invalidates = CALLS[name]
    a, m = SWATokenToKVPoolAllocator(CFG, device="cpu"), dict[str, Any]()
    _base(a, m)
    if name == "free_full":
        a.free_swa(m["B"])  # free_full needs the SWA side released first
    m["x"] = IndexArena(CPU).storage(B, [2, 3])
    before = a.translate_loc_from_full_to_swa(m["x"])
    try:
        call(a, m)
    except PoolError:
        assert "fails" in name, f"{name} raised"
    after = a.translate_loc_from_full_to_swa(m["x"])
    assert (after is not before) == invalidates
    assert after.tolist() == a.full_to_swa_index_mapping[m["x"]].tolist()


def test_replay_invalidates_before_the_graph() -> None:
    a, m = SWATokenToKVPoolAllocator(CFG, device="cpu"), dict[str, Any]()
    _base(a, m)
    a.capture(t([0]), {0: rows(0)}, {0: rows(0)})
    x = IndexArena(CPU).storage(B, [2])
    before = a.translate_loc_from_full_to_swa(x)
    a.replay()
    assert a.translate_loc_from_full_to_swa(x) is not before


def test_alloc_extend_leaves_a_fresh_translation_of_last_loc_c4() -> None:
    """C4: the cache is refilled inside the mutator with ``M[last_loc]``, which the call never writes."""
    a = SWATokenToKVPoolAllocator(CFG, device="cpu")
    first = extend(a, 0, 3, t([-1]))  # slots 2, 3, 4 -> SWA 2, 3, 4
    last = t([4])
    extend(a, 3, 4, last)
    pool = a.get_kvcache()
    assert pool._cached_loc_key == pool.loc_cache_key(last)
    assert pool._cached_swa_loc is not None
    assert pool._cached_swa_loc.tolist() == [4] == a.full_to_swa_index_mapping[last].tolist()
    assert a.translate_loc_from_full_to_swa(last) is pool._cached_swa_loc  # a hit, and still fresh
    assert a.full_to_swa_index_mapping[5].tolist() == 5 and first.tolist() == [2, 3, 4]


# ---------------------------------------------------------------- graph capture / replay (C3, S6)


class NoRunOnce(SWATokenToKVPoolAllocator):
    invalidate_at = lc.UPSTREAM_POINTS - {P.RUN_ONCE}


def _graph_batches(a: SWATokenToKVPoolAllocator, mem: IndexArena) -> list[tuple[list[float], list[float]]]:
    """Capture on [0], then three batches: a new request's slot into the static buffer, new rows, replay.

    Returns, per batch, the SWA row at ``M[slot]`` and the rows written there.
    """
    d = a.device
    static, k, v = mem.storage(B, [0]), torch.zeros(1, 1, 2, device=d), torch.zeros(1, 1, 2, device=d)
    a.capture(static, {0: k, 1: k}, {0: v, 1: v})
    seen = []
    for i in range(3):
        slot = int(extend(a, 0, 1, mem.storage(2048, [-1]))[0])
        static.copy_(t([slot], d))
        k.copy_(rows(10 * i + 1, device=d))
        v.copy_(rows(10 * i + 5, device=d))
        a.replay()
        swa_k, _ = a.get_kvcache().get_kv_buffer(0)
        full_k, _ = a.get_kvcache().get_kv_buffer(1)
        seen.append((swa_k[int(a.full_to_swa_index_mapping[slot])].cpu().flatten().tolist(),
                     k.cpu().flatten().tolist()))
        assert full_k[slot].cpu().flatten().tolist() == k.cpu().flatten().tolist()  # full layers never translate
    return seen


def test_replay_gathers_afresh_every_time(device: str) -> None:
    seen = _graph_batches(SWATokenToKVPoolAllocator(CFG, device=device), IndexArena(torch.device(device)))
    assert all(got == want for got, want in seen)


def test_s6_capture_without_run_once_replays_the_warmup_translation(device: str) -> None:
    a = NoRunOnce(CFG, device=device)
    seen = _graph_batches(a, IndexArena(torch.device(device)))
    assert all(got == [0.0, 0.0] for got, _ in seen)  # request slots never get their SWA rows
    swa_k, _ = a.get_kvcache().get_kv_buffer(0)
    assert swa_k[0].cpu().flatten().tolist() == seen[-1][1]  # they all landed on padding slot 0
    # the reference: the capture hit the cache, recorded no gather, replays the constant (0,)
    sys = lc.initial_system(CFG, lc.LocCachePolicy().without(P.RUN_ONCE))
    sys, sid = lc.new_storage(sys, B, [0])
    sys = lc.capture(sys, lc.make_view(sys, sid, 0, 1))
    assert sys.graph is not None and not sys.graph.recorded_gather and sys.graph.constant == (0,)


def test_replay_after_register_mapping_follows_the_new_mapping(device: str) -> None:
    """The reference's replay reads the live mapping; a graph captured before ``register_mapping`` follows it."""
    a, d = SWATokenToKVPoolAllocator(CFG, device=device), device
    extend(a, 0, 1, t([-1], d))  # slot 2 -> SWA 2 under the old mapping
    a.free_swa(t([2], d))  # old M[2] = 0
    static, k = t([0], d), torch.zeros(1, 1, 2, device=d)
    a.capture(static, {0: k}, {0: k})
    old = a.full_to_swa_index_mapping
    a.register_mapping()
    slot = int(extend(a, 0, 1, t([-1], d))[0])  # slot 2 again, SWA 2 under the new mapping
    static.fill_(slot)
    k.copy_(rows(5, device=d))
    a.replay()
    swa_k, _ = a.get_kvcache().get_kv_buffer(0)
    assert a.full_to_swa_index_mapping is not old and int(a.full_to_swa_index_mapping[slot]) == 2
    assert swa_k[2].cpu().flatten().tolist() == [5.0, 6.0]


def test_capture_records_without_effect_and_leaves_m_static_cached(device: str) -> None:
    a, d = SWATokenToKVPoolAllocator(CFG, device=device), device
    static, k = t([0], d), rows(7, device=d)
    a.capture(static, {0: k, 1: k}, {0: k, 1: k}, warmups=0)
    pool = a.get_kvcache()
    assert not bool(pool.full_kv.any()) and not bool(pool.swa_kv.any())  # the capture run only recorded
    assert pool._cached_loc_key == pool.loc_cache_key(static)  # the recorded gather's output, settled
    assert a.translate_loc_from_full_to_swa(static).tolist() == [0]
    a.replay()  # padding writes
    assert pool.swa_kv[0, 0, 0].cpu().flatten().tolist() == k.cpu().flatten().tolist()


def test_graph_misuse_is_typed_and_writes_nothing(device: str) -> None:
    a, d = SWATokenToKVPoolAllocator(CFG, device=device), device
    k = rows(1, device=d)
    cases: list[tuple[Callable[[], object], tuple[str, str]]] = [
        (a.replay, ("replay", "graph")),
        (lambda: a.capture(t([2], d), {0: k}, {0: k}), ("capture", "loc")),
        (lambda: a.capture(t([0], d), {0: k}, {0: k}, warmups=-1), ("capture", "warmups")),
        (lambda: a.capture(t([0], d), {0: k}, {1: k}), ("capture", "static_v")),
        (lambda: a.capture(t([0], d), {5: k}, {5: k}), ("capture", "layer_id")),
        (lambda: a.capture(t([0, 0], d), {0: k}, {0: k}), ("capture", "cache_k")),
    ]
    for call, want in cases:
        with pytest.raises(InvalidOperation) as e:
            call()
        assert (e.value.op, e.value.argument) == want
    static = t([0], d)
    a.capture(static, {0: k}, {0: k})
    before = a.get_kvcache().swa_kv.clone()
    static.fill_(6)  # never handed out
    with pytest.raises(InvalidOperation) as e:
        a.replay()
    assert (e.value.op, e.value.argument) == ("replay", "out_cache_loc")
    assert torch.equal(a.get_kvcache().swa_kv, before)


class EmulatedGraphs(SWATokenToKVPoolAllocator):
    emulate_graphs = True


class EmulatedNoRunOnce(NoRunOnce):
    emulate_graphs = True


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
@pytest.mark.parametrize(("real", "emulated"), [(SWATokenToKVPoolAllocator, EmulatedGraphs),
                                                (NoRunOnce, EmulatedNoRunOnce)])
def test_emulation_matches_a_real_cuda_graph(real: type[SWATokenToKVPoolAllocator],
                                             emulated: type[SWATokenToKVPoolAllocator]) -> None:
    """The same trace under a real ``torch.cuda.CUDAGraph`` and under the emulation, on CUDA and on the CPU."""
    runs = []
    for cls, device in ((real, "cuda"), (emulated, "cuda"), (real, "cpu")):
        a = cls(CFG, device=device)
        assert a._graph_runner.emulate == (cls is emulated or device == "cpu")
        seen = _graph_batches(a, IndexArena(torch.device(device)))
        runs.append((seen, a.get_kvcache().full_kv.cpu(), a.get_kvcache().swa_kv.cpu()))
    for seen, full, swa in runs[1:]:
        assert seen == runs[0][0] and torch.equal(full, runs[0][1]) and torch.equal(swa, runs[0][2])


# ---------------------------------------------------------------- forward validation, against the reference


def _reference_forward(loc: list[int], rows_by_layer: dict[int, tuple[list[list[float]], list[list[float]]]]
                       ) -> tuple[Any, sa.SWAAllocatorState | None]:
    sys, l0 = lc.new_storage(lc.initial_system(CFG), 2048, [-1])
    sys, _ = lc.alloc_extend(sys, [0], [4], lc.make_view(sys, l0, 0, 1), 4)
    sys, sid = lc.new_storage(sys, B, loc)
    try:
        return ("ok",), lc.forward(sys, lc.make_view(sys, sid, 0, len(loc)), rows_by_layer).allocator
    except InvalidOperation as e:
        return ("err", e.op, e.argument), None


@pytest.mark.parametrize(("loc", "layers", "width"), [
    ([2, 3], (0, 1), 2), ([2, 0], (0, 1), 2), ([9], (0, 1), 2), ([99], (0,), 2), ([99], (1,), 2),
    ([2, 2], (1,), 2), ([2], (0, 7), 2), ([2], (0,), 3), ([2], (), 2),
])
def test_forward_matches_the_reference(loc: list[int], layers: tuple[int, ...], width: int) -> None:
    """Outcome (or op / argument of the error) and KV rows; a rejected forward writes nothing."""
    a = SWATokenToKVPoolAllocator(CFG, device="cpu")
    extend(a, 0, 4, t([-1]))
    n = len(loc)
    ks = {layer: torch.arange(n * width, dtype=torch.float32).reshape(n, 1, width) + layer for layer in layers}
    vs = {layer: k + 50 for layer, k in ks.items()}
    want, state = _reference_forward(loc, {layer: (ks[layer].reshape(n, -1).tolist(), vs[layer].reshape(n, -1).tolist())
                                           for layer in layers})
    before = (a.get_kvcache().full_kv.clone(), a.get_kvcache().swa_kv.clone())
    try:
        a.forward(IndexArena(CPU).storage(B, loc), ks, vs)
        got: Any = ("ok",)
    except InvalidOperation as e:
        got = ("err", e.op, e.argument)
    assert got == want
    if state is None:
        assert torch.equal(a.get_kvcache().full_kv, before[0]) and torch.equal(a.get_kvcache().swa_kv, before[1])
        return
    for layer in layers:
        slots = [s for s in (loc if layer == 1 else [int(a.full_to_swa_index_mapping[f]) for f in loc]) if s]
        kbuf, vbuf = a.get_kvcache().get_kv_buffer(layer)
        got_rows = [kbuf[s].flatten().tolist() + vbuf[s].flatten().tolist() for s in slots]
        assert got_rows == [list(r) for r in sa.kv_rows(state, layer, slots)]


# ---------------------------------------------------------------- set_full_to_swa_mapping, register_mapping (reference)


def _three_requests(a: SWATokenToKVPoolAllocator) -> tuple[list[int], list[int], list[int]]:
    """P=2: A on slots 2, 3, 4 (pages 1 full, 2 one slot), B on 6, 7, C on 8 (SWA free: none left at 8 SWA slots)."""
    return (extend(a, 0, 3, t([-1])).tolist(), extend(a, 0, 2, t([-1])).tolist(), extend(a, 0, 1, t([-1])).tolist())


def _state_after(calls: list[tuple[str, Any, Any]]) -> sa.SWAAllocatorState:
    s = sa.initial_state(CFG)
    for _, pre_seq, last in calls:
        s, _ = sa.alloc_extend(s, [0], [pre_seq], [last], pre_seq)
    return s


MAPPINGS: dict[str, tuple[Callable[[list[int], list[int], list[int]], tuple[list[int], list[int]]], str | None]] = {
    # name: (the slots of A, B, C -> (full, swa), the argument of the expected error or None)
    "swap A's SWA pages (fills 2 and 1)": (lambda a, b, c: (a, [4, 5, 2]), None),
    "A's page 2 takes B's SWA page (owners differ)": (lambda a, b, c: (a + b, [2, 3, 6, 4, 5]), "swa_indices"),
    "two slots on one SWA slot": (lambda a, b, c: ([a[0]], [b[0]]), "swa_indices"),
    "SWA slot in a free page": (lambda a, b, c: ([a[0]], [10]), "swa_indices"),
    "SWA slot past the pool": (lambda a, b, c: ([a[0]], [52]), "swa_indices"),
    "SWA slot in page 0": (lambda a, b, c: ([a[0]], [1]), "swa_indices"),
    "offsets differ (M5)": (lambda a, b, c: ([a[0]], [3]), "swa_indices"),
    "an SWA page left unreached (G3)": (lambda a, b, c: (c, [0]), "swa_indices"),
    "full slot never handed out": (lambda a, b, c: ([5], [0]), "full_indices"),
    "full slot twice": (lambda a, b, c: ([a[0], a[0]], [2, 2]), "full_indices"),
    "reserved full slot": (lambda a, b, c: ([1], [0]), "full_indices"),
    "lengths": (lambda a, b, c: ([a[0]], []), "swa_indices"),
    "empty": (lambda a, b, c: ([], []), None),
    "unmap one slot of a page": (lambda a, b, c: ([a[1]], [0]), None),
}


@pytest.mark.parametrize("name", sorted(MAPPINGS))
def test_set_full_to_swa_mapping_matches_the_reference(name: str, device: str) -> None:
    build, argument = MAPPINGS[name]
    a = SWATokenToKVPoolAllocator(CFG, device=device)
    req_a, req_b, req_c = _three_requests(a)
    s = _state_after([("A", 3, -1), ("B", 2, -1), ("C", 1, -1)])
    full, swa = build(req_a, req_b, req_c)
    before = a.snapshot()
    assert before == sa.snapshot(s)
    backups = (a.backup_state(), sa.backup_state(s))
    try:
        s = sa.set_full_to_swa_mapping(s, full, swa)
        want = None
    except InvalidOperation as e:
        want = (e.op, e.argument, str(e))
    try:
        a.set_full_to_swa_mapping(t(full, device), t(swa, device))
        got = None
    except InvalidOperation as e:
        got = (e.op, e.argument, str(e))
    # the same violation: the same class, op, argument and message in both layers
    assert got == want
    assert (None if got is None else got[:2]) == (None if argument is None else ("set_full_to_swa_mapping", argument))
    assert a.snapshot() == sa.snapshot(s)
    check_invariants(s)
    a.check_invariants()
    assert _outcome(lambda: a.restore_state(backups[0])) == _outcome(lambda: sa.restore_state(s, backups[1]))
    if got is None and full:  # still usable: a request on the re-attached pages frees cleanly
        a.free(t(req_a, device))
        s = sa.free(s, req_a)
        assert a.snapshot() == sa.snapshot(s)


def _outcome(call: Callable[[], object]) -> tuple[str, str] | None:
    """``(op, argument)`` of the ``InvalidOperation`` ``call`` raises, or ``None`` (the call's effect is dropped)."""
    try:
        call()
    except InvalidOperation as e:
        return e.op, e.argument
    return None


def test_negative_swa_slot_is_rejected_as_by_the_reference() -> None:
    """M1: a mapping entry is 0 or a real SWA slot; -5 is neither (both layers reject it, same names)."""
    a = SWATokenToKVPoolAllocator(CFG, device="cpu")
    req_a, _, _ = _three_requests(a)
    with pytest.raises(InvalidOperation) as e:
        a.set_full_to_swa_mapping(t([req_a[0]]), t([-5]))
    with pytest.raises(InvalidOperation) as e_ref:
        sa.set_full_to_swa_mapping(_state_after([("A", 3, -1), ("B", 2, -1), ("C", 1, -1)]), [req_a[0]], [-5])
    assert (e.value.op, e.value.argument) == (e_ref.value.op, e_ref.value.argument) == (
        "set_full_to_swa_mapping", "swa_indices")
    assert str(e.value) == str(e_ref.value) == (
        "set_full_to_swa_mapping: swa_indices: -5 is neither 0 nor an SWA slot in [2, 10)")


def test_register_mapping_matches_the_reference(device: str) -> None:
    a = SWATokenToKVPoolAllocator(CFG, device=device)
    req_a, _, _ = _three_requests(a)
    a.forward(t(req_a, device), {0: rows(1, 3, device)}, {0: rows(2, 3, device)})
    s = _state_after([("A", 3, -1), ("B", 2, -1), ("C", 1, -1)])
    backup, r_backup = a.backup_state(), sa.backup_state(s)
    old, pool = a.full_to_swa_index_mapping, a.get_kvcache()
    kv = (pool.full_kv.clone(), pool.swa_kv.clone())
    a.register_mapping()
    s = lc.register_mapping(lc.initial_system(CFG).model_copy(update={"allocator": s})).allocator
    assert a.snapshot() == sa.snapshot(s)
    assert a.full_to_swa_index_mapping is not old and pool.full_to_swa_index_mapping is a.full_to_swa_index_mapping
    assert a.get_kvcache() is pool and torch.equal(pool.full_kv, kv[0]) and torch.equal(pool.swa_kv, kv[1])
    with pytest.raises(InvalidOperation) as e:
        a.restore_state(backup)
    with pytest.raises(InvalidOperation) as r:
        sa.restore_state(s, r_backup)
    assert (e.value.op, e.value.argument) == (r.value.op, r.value.argument) == ("restore_state", "state")
    s, want = sa.alloc_extend(s, [0], [3], [-1], 3)
    assert extend(a, 0, 3, t([-1], device)).tolist() == list(want) and a.snapshot() == sa.snapshot(s)
    a.check_invariants()


def test_protocol_surface() -> None:
    a = SWATokenToKVPoolAllocator(CFG, device="cpu")
    assert isinstance(a, LocCacheSystemUnderTest)
