"""loc_cache reference: S5, S6, one stale-read witness per invalidation point, and the upstream theorem on samples.

Each witness is a short trace that respects the environment contract E1 (see
``kvproof.reference.loc_cache``). Under the upstream policy it reads nothing stale;
with the named point removed (or the storage-base key, or one cache for two pools)
it reads stale data. The same traces are the Z3 counterexamples' concrete twins.
"""

from collections.abc import Callable

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from kvproof.reference import loc_cache as lc
from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, PoolError

P = lc.InvalidationPoint
CFG = PoolConfig(size_full=16, size_swa=8, page_size=2, sliding_window_size=2)
CFG1 = PoolConfig(size_full=16, size_swa=16, page_size=1, sliding_window_size=2)
ROWS = {0: ([[1.0, 2.0]], [[3.0, 4.0]])}  # layer 0 is the SWA layer of the default geometry
B = 1024  # base address of the first index storage


def storage(sys: lc.LocCacheSystem, values: list[int], base: int = B) -> tuple[lc.LocCacheSystem, lc.IndexView]:
    sys, sid = lc.new_storage(sys, base, values)
    return sys, lc.make_view(sys, sid, 0, len(values))


def minus_one(sys: lc.LocCacheSystem, base: int) -> tuple[lc.LocCacheSystem, lc.IndexView]:
    return storage(sys, [-1], base)


def w_alloc(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, v = storage(sys, [2])
    sys, _ = lc.translate_loc_from_full_to_swa(sys, v)  # slot 2 is free: M = 0
    sys, _ = lc.alloc(sys, 2)  # hands out page 1: M[2] = 2
    return lc.translate_loc_from_full_to_swa(sys, v)[0]


def _two_requests(sys: lc.LocCacheSystem) -> tuple[lc.LocCacheSystem, lc.IndexView]:
    sys, l0 = minus_one(sys, 2048)
    sys, _ = lc.alloc_extend(sys, [0], [1], l0, 1, owners=[1])  # request 1 at slot 2
    sys, _ = lc.alloc_extend(sys, [0], [1], l0, 1, owners=[2])  # request 2 at slot 4
    sys, f = storage(sys, [2])
    return lc.forward(sys, f, ROWS), f  # caches key(f) -> [2]


def w_alloc_extend(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, f = _two_requests(sys)
    sys = lc.free_storage(sys, f.storage)  # batch preparation: out_cache_loc freed,
    sys, last = storage(sys, [4])  # and its address reused for request 2's last_loc
    return lc.alloc_extend(sys, [1], [2], last, 1, owners=[2])[0]


def w_alloc_decode(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, f = _two_requests(sys)
    sys = lc.free_storage(sys, f.storage)
    sys, last = storage(sys, [4])
    return lc.alloc_decode(sys, [2], last, owners=[2])[0]


def w_tail(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, v = storage(sys, [2])
    sys, _ = lc.translate_loc_from_full_to_swa(sys, v)
    sys, _ = lc.alloc_extend_swa_tail(sys, [0], [2], [-1], 2, 2)
    return lc.translate_loc_from_full_to_swa(sys, v)[0]


def _mapped(sys: lc.LocCacheSystem) -> tuple[lc.LocCacheSystem, lc.IndexView, tuple[int, ...]]:
    sys, l0 = minus_one(sys, 2048)
    sys, slots = lc.alloc_extend(sys, [0], [4], l0, 4)  # slots 2..5 -> SWA 2..5
    sys, v = storage(sys, [2])
    sys, _ = lc.translate_loc_from_full_to_swa(sys, v)
    return sys, v, slots


def w_free_swa(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, v, slots = _mapped(sys)
    sys = lc.free_swa(sys, list(slots[:2]))
    return lc.translate_loc_from_full_to_swa(sys, v)[0]


def w_set_mapping(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, v, slots = _mapped(sys)
    sys = lc.set_full_to_swa_mapping(sys, list(slots), [4, 5, 2, 3])  # swap the request's two SWA pages
    return lc.translate_loc_from_full_to_swa(sys, v)[0]


def w_clear(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, v, _ = _mapped(sys)
    return lc.translate_loc_from_full_to_swa(lc.clear(sys), v)[0]


def w_register(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, v, _ = _mapped(sys)
    return lc.translate_loc_from_full_to_swa(lc.register_mapping(sys), v)[0]


def w_forward(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, f = _two_requests(sys)
    sys = lc.free_storage(sys, f.storage)
    sys, f2 = storage(sys, [4])  # the next batch's out_cache_loc at the same address
    return lc.forward(sys, f2, ROWS)


def w_run_once(sys: lc.LocCacheSystem) -> lc.LocCacheSystem:
    sys, static = storage(sys, [0])  # padding while capturing
    sys = lc.capture(sys, static)
    sys, l0 = minus_one(sys, 2048)
    sys, _ = lc.alloc_extend(sys, [0], [1], l0, 1)  # slot 2
    sys = lc.write_index(sys, static.storage, 0, [2])  # batch preparation fills the static buffer
    return lc.replay(sys, ROWS)


WITNESSES: dict[str, tuple[lc.LocCachePolicy, Callable[[lc.LocCacheSystem], lc.LocCacheSystem]]] = {
    "alloc": (lc.LocCachePolicy().without(P.ALLOC), w_alloc),
    "alloc_extend": (lc.LocCachePolicy().without(P.ALLOC_EXTEND), w_alloc_extend),
    "alloc_decode": (lc.LocCachePolicy().without(P.ALLOC_DECODE), w_alloc_decode),
    "alloc_extend_swa_tail": (lc.LocCachePolicy().without(P.ALLOC_EXTEND_SWA_TAIL), w_tail),
    "free_swa": (lc.LocCachePolicy().without(P.FREE_SWA), w_free_swa),
    "set_full_to_swa_mapping": (lc.LocCachePolicy().without(P.SET_FULL_TO_SWA_MAPPING), w_set_mapping),
    "clear": (lc.LocCachePolicy().without(P.CLEAR), w_clear),
    "register_mapping": (lc.LocCachePolicy().without(P.REGISTER_MAPPING), w_register),
    "forward": (lc.LocCachePolicy().without(P.FORWARD), w_forward),
    "run_once": (lc.LocCachePolicy().without(P.RUN_ONCE), w_run_once),
}


def test_every_point_has_a_witness() -> None:
    assert set(WITNESSES) == {p.value for p in P}


@pytest.mark.parametrize("point", sorted(WITNESSES))
def test_point_is_needed(point: str) -> None:
    broken, trace = WITNESSES[point]
    assert trace(lc.initial_system(CFG)).stale_reads == (), "the upstream design must read nothing stale"
    stale = trace(lc.initial_system(CFG, broken)).stale_reads
    assert stale, f"without {point} the trace should read a stale translation"
    assert all(r.returned != r.fresh for r in stale)


def test_s5_storage_base_key_collides() -> None:
    def trace(sys: lc.LocCacheSystem) -> tuple[lc.LocCacheSystem, tuple[int, ...]]:
        sys, _ = lc.alloc(sys, 10)  # slots 1..10 -> SWA 1..10
        sys, sid = lc.new_storage(sys, B, [5, 6, 7, 8, 9, 10])
        sys, _low = lc.translate_loc_from_full_to_swa(sys, lc.make_view(sys, sid, 0, 3))
        sys, high = lc.translate_loc_from_full_to_swa(sys, lc.make_view(sys, sid, 3, 3))
        return sys, high

    sys, high = trace(lc.initial_system(CFG1))
    assert high == (8, 9, 10) and sys.stale_reads == ()
    sys, high = trace(lc.initial_system(CFG1, lc.LocCachePolicy(key_scheme=lc.KeyScheme.STORAGE_BASE)))
    assert high == (5, 6, 7) and len(sys.stale_reads) == 1


def test_s5_address_reuse_without_invalidation_is_stale_even_upstream() -> None:
    """R2-a: a scheduler-side translation during batch preparation breaks E1."""
    sys = lc.initial_system(CFG1)
    sys, _ = lc.alloc(sys, 10)
    sys, x = storage(sys, [5, 6, 7, 8, 9, 10])
    sys, _ = lc.translate_loc_from_full_to_swa(sys, x)
    sys = lc.free_storage(sys, x.storage)
    sys, y = storage(sys, [1, 2, 3, 4, 5, 6])  # same address, same numel, other contents
    sys, got = lc.translate_loc_from_full_to_swa(sys, y)
    assert got == (5, 6, 7, 8, 9, 10) and sys.stale_reads


def test_cache_shared_across_pools_is_stale() -> None:
    def trace(sys: lc.LocCacheSystem) -> tuple[lc.LocCacheSystem, tuple[int, ...]]:
        sys, _ = lc.alloc(sys, 4)
        sys, v = storage(sys, [1, 2])
        sys, _ = lc.translate_loc_from_full_to_swa(sys, v, pool=0)
        return lc.translate_loc_from_full_to_swa(sys, v, pool=1)

    assert trace(lc.initial_system(CFG1))[1] == (0, 0)
    sys, got = trace(lc.initial_system(CFG1, lc.LocCachePolicy(shared_across_pools=True)))
    assert got == (1, 2) and sys.stale_reads[0].pool == 1


def test_s6_capture_without_run_once_records_no_gather() -> None:
    sys = w_run_once(lc.initial_system(CFG, lc.LocCachePolicy().without(P.RUN_ONCE)))
    assert sys.graph is not None and not sys.graph.recorded_gather
    assert sys.stale_reads[0].op == "replay" and sys.stale_reads[0].returned == (0,)
    good = w_run_once(lc.initial_system(CFG))
    assert good.graph is not None and good.graph.recorded_gather


def test_stale_translation_corrupts_kv_of_another_request() -> None:
    """Without the forward point, request 2's SWA KV is written into request 1's SWA slot."""
    sys = w_forward(lc.initial_system(CFG, lc.LocCachePolicy().without(P.FORWARD)))
    from kvproof.reference.swa_allocator import kv_rows
    assert kv_rows(sys.allocator, 0, [4]) == (None,)  # request 2's SWA slot got nothing
    assert kv_rows(sys.allocator, 0, [2]) == ((1.0, 2.0, 3.0, 4.0),)  # request 1's slot was overwritten


@pytest.mark.parametrize(
    ("call", "argument"),
    [
        (lambda s: lc.new_storage(s, 1024, [1])[0] and lc.new_storage(lc.new_storage(s, 1024, [1])[0], 1024, [2]),
         "base"),
        (lambda s: lc.new_storage(s, 1023, [1]), "base"),
        (lambda s: lc.new_storage(s, 1024, []), "contents"),
        (lambda s: lc.make_view(lc.new_storage(s, 1024, [1, 2])[0], 0, 1, 2), "numel"),
        (lambda s: lc.free_storage(lc.free_storage(lc.new_storage(s, 1024, [1])[0], 0), 0), "storage"),
        (lambda s: lc.replay(s, ROWS), "graph"),
        (lambda s: lc.capture(*storage(s, [2])), "loc"),
        (lambda s: lc.translate_loc_from_full_to_swa(*storage(s, [99])), "loc"),
    ],
)
def test_memory_misuse_is_typed(call: Callable[[lc.LocCacheSystem], object], argument: str) -> None:
    with pytest.raises(InvalidOperation) as info:
        call(lc.initial_system(CFG))
    assert info.value.argument == argument


# ---------------------------------------------------------------- the theorem, on samples


@st.composite
def quiet_traces(draw: st.DrawFn, policy: lc.LocCachePolicy | None = None) -> lc.LocCacheSystem:
    """Random E1-respecting runs: allocations, frees, scheduler translations, forwards with address reuse."""
    sys, base = lc.initial_system(CFG, policy), 4096
    sys, l0 = minus_one(sys, 64)
    views: list[lc.IndexView] = []
    for _ in range(draw(st.integers(1, 25))):
        live = [f for f in range(2, 18) if sa.is_live(sys.allocator, f)]
        kind = draw(st.sampled_from(["alloc_extend", "free_swa", "translate", "view", "forward", "clear"]))
        try:
            if kind == "alloc_extend":
                n = draw(st.integers(1, 4))
                sys, _ = lc.alloc_extend(sys, [0], [n], l0, n)
            elif kind == "free_swa" and live:
                sys = lc.free_swa(sys, [draw(st.sampled_from(live))])
            elif kind == "translate" and views:  # quiet phase: every rewrite below is followed by a forward
                sys, _ = lc.translate_loc_from_full_to_swa(sys, draw(st.sampled_from(views)))
            elif kind == "view":
                sys, v = storage(sys, [draw(st.integers(-1, 17)) for _ in range(draw(st.integers(1, 3)))], base)
                base += 64
                views.append(v)
            elif kind == "forward" and live:
                slot = draw(st.sampled_from(live))
                alive = [v for v in views if sys.memory.storages[v.storage].alive and v.numel == 1]
                reuse: bool = bool(alive) and draw(st.booleans())
                if reuse:  # batch preparation reuses an old out_cache_loc address
                    old = draw(st.sampled_from(alive))
                    sys = lc.free_storage(sys, old.storage)
                    sys, f = storage(sys, [slot], sys.memory.storages[old.storage].base)
                    views = [v for v in views if v.storage != old.storage] + [f]
                else:
                    sys, f = storage(sys, [slot], base)
                    base += 64
                sys = lc.forward(sys, f, ROWS)
            elif kind == "clear":
                sys = lc.clear(sys)
        except PoolError:
            continue
    return sys


@settings(max_examples=150, deadline=None)
@given(quiet_traces())
def test_upstream_policy_reads_nothing_stale_under_e1(sys: lc.LocCacheSystem) -> None:
    assert sys.stale_reads == ()


@pytest.mark.parametrize("point", [P.FORWARD, P.FREE_SWA])
def test_the_sampler_finds_stale_reads_when_a_point_is_missing(point: lc.InvalidationPoint) -> None:
    """The theorem test above is not vacuous: the same sampler breaks a weaker policy."""
    found = find(quiet_traces(lc.LocCachePolicy().without(point)), lambda s: bool(s.stale_reads),
                 settings=settings(max_examples=1000, deadline=None, database=None))
    assert found.stale_reads
