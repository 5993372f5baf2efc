"""The ``decode_prealloc`` mutants: each is killed by the decode-node suite, for the reason it was written.

Two checks per mutant. The kill (``kill_mutants`` under the ``ci`` profile, the suite's
default configs) must name the divergence the bug causes -- a mutant that "dies" of a
crash or of an unrelated divergence would otherwise pass unnoticed. And a short
hand-written call sequence (the ``Differs:`` hint of its docstring) shows the intended
difference against the unmutated runtime, value by value.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from hypothesis import settings

from kvproof.conformance.check import MutantVerdict, get_suite, kill_mutants, mutants_of, run_check
from kvproof.conformance.mutants.decode_prealloc import MUTANTS
from kvproof.conformance.mutants.swa_allocator import MUTANTS as SWA_ALLOCATOR_MUTANTS
from kvproof.conformance.profiles import get_profile
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference import PoolConfig
from kvproof.reference.errors import OutOfMemory

# test_mutant_is_killed and test_kill_happens_on_the_mutated_path share each mutant's kill (``kill``, cached): on
# one pytest-xdist worker (``make test`` runs ``--dist loadgroup``) it is computed once, not once per worker
pytestmark = pytest.mark.xdist_group("decode_prealloc_mutants")

Allocator = SWATokenToKVPoolAllocator
CPU = torch.device("cpu")

#: What the kill's evidence line (the divergence the suite reports) must say, per mutant.
#: An eviction that releases one SWA page too many or too few, in the step where the request finishes: its other
#: pages come back with it, so the pool holds the same pages in another order.
_SWA_ORDER = r"|^swa pool order: implementation free list \[[\d, ]+\], reference \[[\d, ]+\]"
EVIDENCE: dict[str, str] = {
    # the preallocation took one SWA page more than the reference
    "tail_ceil_as_floor_plus_one": r"^swa pool: implementation has (\d+) free pages .*, reference (\d+) ",
    # the decode step took an SWA page where the reference continued its page
    "decode_opens_swa_page_late": r"^swa pool: implementation has (\d+) free pages .*, reference (\d+) ",
    # the second page-opening request of the batch got the first one's page
    "decode_batch_shares_page": r"^alloc_decode: full page \d+ in the reference is page \d+ in the implementation",
    # the eviction freed one SWA page more than the reference
    "evict_one_page_too_many": r"^swa pool: implementation has (\d+) free pages .*, reference (\d+) " + _SWA_ORDER,
    # the eviction kept one SWA page the reference released
    "evict_one_page_too_few": r"^swa pool: implementation has (\d+) free pages .*, reference (\d+) " + _SWA_ORDER,
    # after a resume, an SWA row differs from the saved one
    "retract_drops_last_swa_row": r"^KV of layer \d+ \(SWA\) for request \d+: reference slot \d+ holds",
    # the freed request's full pages are not all back
    "free_forgets_evicted_pages": r"^full pool: implementation has (\d+) free pages .*, reference (\d+) ",
    # the very first comparison: the SWA size (and the min of both) is off by one page
    "swa_available_counts_reserved_page": r"^(swa_)?available_size\(\) = (\d+), reference (\d+)$",
}
#: The sign of ``implementation free pages - reference free pages`` in a pool-count divergence, where the bug
#: fixes it (a page opened late shows as a surplus or, after the next step, a shortfall: either way).
SURPLUS = {"tail_ceil_as_floor_plus_one": -1, "evict_one_page_too_many": 1, "evict_one_page_too_few": -1,
           "free_forgets_evicted_pages": -1}
#: Mutants of the tail preallocation / page opening: they need P > 1.
PAGED_ONLY = {"tail_ceil_as_floor_plus_one", "decode_opens_swa_page_late"}
#: Where the kill must happen: the node rule of the diverging step and the allocator call it must contain
#: (``None``: the divergence precedes every operation).
DIVERGES_AT: dict[str, tuple[set[str], str] | None] = {
    "tail_ceil_as_floor_plus_one": ({"pop_preallocated", "resume_retracted_reqs"}, "alloc_extend_swa_tail"),
    "decode_opens_swa_page_late": ({"decode"}, "alloc_decode"),
    "decode_batch_shares_page": ({"decode"}, "alloc_decode"),
    "evict_one_page_too_many": ({"decode"}, "free_swa"),
    "evict_one_page_too_few": ({"decode"}, "free_swa"),
    "retract_drops_last_swa_row": ({"resume_retracted_reqs"}, "load_cpu_copy"),
    "free_forgets_evicted_pages": ({"decode", "retract"}, "free"),
    "swa_available_counts_reserved_page": None,
}


# ---------------------------------------------------------------- registry and documentation


def test_registered_under_decode_prealloc() -> None:
    assert mutants_of("decode_prealloc") is MUTANTS
    assert len(MUTANTS) >= 5
    assert set(EVIDENCE) == set(DIVERGES_AT) == set(MUTANTS)


def test_not_copies_of_swa_allocator_mutants() -> None:
    shared = {name for name in MUTANTS if name in SWA_ALLOCATOR_MUTANTS}
    shared |= {name for name, cls in MUTANTS.items() if cls in SWA_ALLOCATOR_MUTANTS.values()}
    assert not shared, f"decode_prealloc mutants duplicated from swa_allocator: {sorted(shared)}"


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_documents_its_bug(name: str) -> None:
    doc = MUTANTS[name].__doc__ or ""
    first = doc.strip().splitlines()[0]
    assert re.search(r"§\d+\.\d+", first), f"{name}: the first docstring line names no section: {first!r}"
    assert re.search(r"\b(G[1-5]|M[1-5]|D[1-3])\b", doc), f"{name} docstring names no invariant"
    assert "Differs:" in doc, f"{name} docstring gives no differing call sequence"


# ---------------------------------------------------------------- killed by the suite, for the right reason


@functools.cache
def kill(name: str) -> MutantVerdict:
    """One mutant against the decode_prealloc suite (``ci`` profile, the suite's default configs), once per session."""
    (verdict,) = kill_mutants({name: MUTANTS[name]}, component="decode_prealloc", profile="ci")
    return verdict


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    verdict = kill(name)
    assert verdict.killed, f"mutant {name} survived the decode_prealloc suite (ci profile) on every config"
    assert verdict.component == "decode_prealloc"
    assert "HarnessError" not in verdict.evidence and "crashed" not in verdict.evidence, verdict.evidence
    found = re.search(EVIDENCE[name], verdict.evidence)
    assert found, f"{name} was killed for another reason than its bug: {verdict.evidence}"
    if name in SURPLUS and found.group(1) is not None:  # a count divergence (not an eviction's order: _SWA_ORDER)
        impl, ref = int(found.group(1)), int(found.group(2))
        assert (impl - ref) * SURPLUS[name] > 0, verdict.evidence
    if name == "swa_available_counts_reserved_page":
        assert int(found.group(2)) > int(found.group(3)), verdict.evidence
    assert verdict.config is not None
    if name in PAGED_ONLY:
        assert not verdict.config.startswith("P1-"), f"{name} changes nothing at P = 1, yet died on {verdict.config}"
    assert verdict.seconds < 30, f"{name} took {verdict.seconds:.1f} s to kill"


def _last_step(failure: str) -> tuple[str, list[str]]:
    """The rule heading the trace's last step and the allocator calls under it."""
    block = failure.split("operations so far:\n")[1].split("\n\n")[0]
    heads = list(re.finditer(r"^\s+\d+\. (\w+)\(", block, flags=re.M))
    assert heads, f"no step in the trace:\n{block}"
    rest = block[heads[-1].end():]
    return heads[-1].group(1), re.findall(r"^\s+then (\w+)\(", rest, flags=re.M)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_kill_happens_on_the_mutated_path(name: str) -> None:
    """The same run as the kill (no shrinking), replayed for its trace: the divergence follows the mutated call."""
    verdict = kill(name)
    assert verdict.killed, f"mutant {name} survived"
    (config,) = [c for c in get_suite("decode_prealloc").configs if c.label() == verdict.config]
    base = get_profile("ci")
    no_shrink = settings(base, phases=[p for p in base.phases if p.name != "shrink"])
    report = run_check("decode_prealloc", MUTANTS[name], config, settings=no_shrink, failures_dir=None)
    assert report.failure is not None, f"{name} passed on {verdict.config} this time"
    assert verdict.evidence in report.failure, "not the run that killed it"
    where = DIVERGES_AT[name]
    if where is None:
        assert "(no operation yet)" in report.failure, report.failure
        return
    rules, call = where
    rule, calls = _last_step(report.failure)
    assert rule in rules and call in calls, f"{name} diverged after {rule}() calling {calls}, not on {where}"


# ---------------------------------------------------------------- the intended difference, call by call


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def both(name: str, config: PoolConfig) -> tuple[Allocator, Allocator]:
    """The correct runtime and the mutant on the same config."""
    return SWATokenToKVPoolAllocator(config, CPU), MUTANTS[name](config)


def tail(a: Allocator, seq: int, swa_tail_len: int) -> list[int]:
    out = a.alloc_extend_swa_tail(t([0]), t([0]), t([seq]), t([seq]), t([-1]), seq, swa_tail_len)
    return [int(x) for x in out.tolist()]


def extend(a: Allocator, seq: int) -> list[int]:
    return [int(x) for x in a.alloc_extend(t([0]), t([0]), t([seq]), t([seq]), t([-1]), seq).tolist()]


def decode(a: Allocator, seqs: list[int], last: list[int]) -> list[int]:
    return [int(x) for x in a.alloc_decode(t(seqs), t(seqs), t(last)).tolist()]


def mapping(a: Allocator, slots: list[int]) -> list[int]:
    return [int(a.full_to_swa_index_mapping[s]) for s in slots]


def swa_free(a: Allocator) -> tuple[int, ...]:
    return a.snapshot().swa.free_pages


def full_free(a: Allocator) -> tuple[int, ...]:
    return a.snapshot().full.free_pages


def test_tail_ceil_as_floor_plus_one() -> None:
    runtime, mutant = both("tail_ceil_as_floor_plus_one", PoolConfig(size_full=32, size_swa=16, page_size=4,
                                                                     sliding_window_size=4))
    assert tail(runtime, 8, 4) == tail(mutant, 8, 4) == list(range(4, 12))
    assert mapping(runtime, list(range(4, 12))) == mapping(mutant, list(range(4, 12))) == [0] * 4 + [4, 5, 6, 7]
    assert swa_free(runtime) == (2, 3, 4)
    assert swa_free(mutant) == (3, 4), "the page-aligned tail takes 2 SWA pages, one never mapped"
    # a tail that does not end on a page boundary is counted right: no difference there
    runtime, mutant = both("tail_ceil_as_floor_plus_one", PoolConfig(size_full=32, size_swa=16, page_size=4,
                                                                     sliding_window_size=4))
    assert tail(runtime, 7, 3) == tail(mutant, 7, 3) and swa_free(runtime) == swa_free(mutant) == (2, 3, 4)
    # G4: with exactly one SWA page free the mutant refuses what the reference grants
    runtime, mutant = both("tail_ceil_as_floor_plus_one", PoolConfig(size_full=32, size_swa=4, page_size=4,
                                                                     sliding_window_size=4))
    assert tail(runtime, 8, 4) == list(range(4, 12)) and swa_free(runtime) == ()
    with pytest.raises(OutOfMemory, match="swa pool needs 2 page"):
        tail(mutant, 8, 4)
    assert swa_free(mutant) == (1,) and len(full_free(mutant)) == 8, "the failed call changed nothing"


def test_decode_opens_swa_page_late() -> None:
    runtime, mutant = both("decode_opens_swa_page_late", PoolConfig(size_full=16, size_swa=16, page_size=2,
                                                                    sliding_window_size=2))
    for a in (runtime, mutant):
        assert tail(a, 2, 2) == [2, 3] and mapping(a, [2, 3]) == [2, 3]
    # position 2 (in-page offset 0): the runtime opens SWA page 2; the mutant runs on past page 1's end
    assert decode(runtime, [3], [3]) == decode(mutant, [3], [3]) == [4]
    assert mapping(runtime, [4]) == mapping(mutant, [4]) == [4]
    assert 2 not in swa_free(runtime)
    assert 2 in swa_free(mutant), "slot 4 is mapped, but its SWA page 2 was never taken (M2)"
    # position 3 (offset 1): the runtime continues; the mutant opens a page at offset 0 (M5)
    assert decode(runtime, [4], [4]) == decode(mutant, [4], [4]) == [5]
    assert mapping(runtime, [4, 5]) == [4, 5]
    assert mapping(mutant, [4, 5]) == [4, 4], "two positions share SWA slot 4, at offset 0 for offset 1"
    # P = 1: every token opens its page, so there is nothing to be late for
    runtime, mutant = both("decode_opens_swa_page_late", PoolConfig(size_full=8, size_swa=8, page_size=1,
                                                                    sliding_window_size=2))
    for a in (runtime, mutant):
        a.alloc(1)
    assert decode(runtime, [2], [1]) == decode(mutant, [2], [1]) and runtime.snapshot() == mutant.snapshot()


def test_decode_batch_shares_page() -> None:
    runtime, mutant = both("decode_batch_shares_page", PoolConfig(size_full=8, size_swa=8, page_size=1,
                                                                  sliding_window_size=2))
    for a in (runtime, mutant):
        assert [int(x) for x in a.alloc(1).tolist()] == [1] and [int(x) for x in a.alloc(1).tolist()] == [2]
    assert decode(runtime, [2, 2], [1, 2]) == [3, 4]
    assert decode(mutant, [2, 2], [1, 2]) == [3, 3], "both requests got the first new slot"
    assert full_free(runtime) == full_free(mutant) == (5, 6, 7, 8), "slot 4 was taken all the same (leak)"
    # P = 2: two requests whose decoded token opens a page
    runtime, mutant = both("decode_batch_shares_page", PoolConfig(size_full=16, size_swa=16, page_size=2,
                                                                  sliding_window_size=2))
    for a in (runtime, mutant):
        assert extend(a, 2) == [2, 3] and extend(a, 2) == [4, 5]
    assert decode(runtime, [3, 3], [3, 5]) == [6, 8]
    assert decode(mutant, [3, 3], [3, 5]) == [6, 6]
    assert mapping(mutant, [6]) == [6] and swa_free(mutant) == swa_free(runtime)


def test_evict_one_page_too_many() -> None:
    runtime, mutant = both("evict_one_page_too_many", PoolConfig(size_full=16, size_swa=16, page_size=2,
                                                                 sliding_window_size=2))
    for a in (runtime, mutant):
        assert extend(a, 4) == [2, 3, 4, 5] and mapping(a, [2, 3, 4, 5]) == [2, 3, 4, 5]
        a.free_swa(t([2, 3]))
    assert mapping(runtime, [2, 3, 4, 5]) == [0, 0, 4, 5]
    assert mapping(mutant, [2, 3, 4, 5]) == [0, 0, 0, 0], "the next page's SWA slots went too"
    assert swa_free(runtime) == (1, 3, 4, 5, 6, 7, 8)
    assert swa_free(mutant) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert full_free(runtime) == full_free(mutant), "the full side is untouched"


def test_evict_one_page_too_few() -> None:
    runtime, mutant = both("evict_one_page_too_few", PoolConfig(size_full=16, size_swa=16, page_size=2,
                                                                sliding_window_size=2))
    for a in (runtime, mutant):
        assert extend(a, 4) == [2, 3, 4, 5]
        a.free_swa(t([2, 3, 4, 5]))
    assert mapping(runtime, [2, 3, 4, 5]) == [0, 0, 0, 0]
    assert mapping(mutant, [2, 3, 4, 5]) == [0, 0, 4, 5], "the last page stays mapped behind the window"
    assert swa_free(runtime) == (1, 2, 3, 4, 5, 6, 7, 8)
    assert 2 not in swa_free(mutant) and len(swa_free(mutant)) == 7


def test_retract_drops_last_swa_row() -> None:
    config = PoolConfig(size_full=8, size_swa=8, page_size=1, sliding_window_size=2)
    runtime, mutant = both("retract_drops_last_swa_row", config)
    swa_layer = config.kv.swa_attention_layer_ids[0]
    rows = torch.tensor([[[1.0, 2.0]], [[3.0, 4.0]]])
    loaded = {}
    for name, a in (("runtime", runtime), ("mutant", mutant)):
        old = a.alloc(2)
        pool = a.get_kvcache()
        pool.set_kv_buffer(swa_layer, old, rows, rows + 10)
        copy = a.get_cpu_copy(old)
        a.free(old)
        new = a.alloc(2)
        assert new.tolist() == [3, 4], "the resumed positions get fresh slots"
        a.load_cpu_copy(copy, new)
        keys = pool.get_key_buffer(swa_layer)
        loaded[name] = (copy, keys[a.full_to_swa_index_mapping[new]].clone())
    (ref_copy, ref_k), (mut_copy, mut_k) = loaded["runtime"], loaded["mutant"]
    assert ref_copy["swa_mask"] is not None and mut_copy["swa_mask"] is not None
    assert ref_copy["swa_mask"].tolist() == [True, True]
    assert mut_copy["swa_mask"].tolist() == [True, False], "the last position's SWA row is not saved"
    assert torch.equal(ref_k, rows)
    assert torch.equal(mut_k[0], rows[0]) and torch.equal(mut_k[1], torch.zeros_like(rows[1])), (
        "position 1 keeps the new slot's old (zero) row")


def test_free_forgets_evicted_pages() -> None:
    runtime, mutant = both("free_forgets_evicted_pages", PoolConfig(size_full=16, size_swa=16, page_size=2,
                                                                    sliding_window_size=2))
    everything = tuple(range(1, 9))
    for a in (runtime, mutant):
        assert tail(a, 4, 2) == [2, 3, 4, 5] and mapping(a, [2, 3, 4, 5]) == [0, 0, 2, 3]
        a.free(t([2, 3, 4, 5]))
        assert sorted(swa_free(a)) == list(everything), "the SWA side is released in both"
    assert sorted(full_free(runtime)) == list(everything)
    assert sorted(full_free(mutant)) == list(range(2, 9)), "full page 1 (the unmapped head) stays taken"
    # a 1:1 request with an evicted first page: that page is forgotten too
    runtime, mutant = both("free_forgets_evicted_pages", PoolConfig(size_full=16, size_swa=16, page_size=2,
                                                                    sliding_window_size=2))
    for a in (runtime, mutant):
        assert extend(a, 4) == [2, 3, 4, 5]
        a.free_swa(t([2, 3]))
        a.free(t([2, 3, 4, 5]))
    assert sorted(full_free(runtime)) == list(everything)
    assert 1 not in full_free(mutant) and 2 in full_free(mutant)


def test_swa_available_counts_reserved_page() -> None:
    runtime, mutant = both("swa_available_counts_reserved_page", PoolConfig(size_full=32, size_swa=16, page_size=4,
                                                                            sliding_window_size=4))
    assert (runtime.swa_available_size(), mutant.swa_available_size()) == (16, 20)
    assert (runtime.available_size(), mutant.available_size()) == (16, 20)
    assert runtime.full_available_size() == mutant.full_available_size() == 32
    tail(runtime, 8, 4)
    tail(mutant, 8, 4)
    assert (runtime.swa_available_size(), mutant.swa_available_size()) == (12, 16)
    assert runtime.snapshot() == mutant.snapshot(), "only the report is wrong, not the pools"
