"""``kvproof.spec.swa_allocator``: one transition per reference op, one name per op (sglang_semantics.md §1.3-§2.8).

The component module's ``SYSTEM`` has a transition named like every state-changing
operation of ``kvproof.reference.swa_allocator``, ``kvproof prove -k <op>`` finds
obligations about each, and the combined step relation the BMC queries use agrees
with the per-op relations the drift test checks.
"""

from __future__ import annotations

import inspect
import random
from collections.abc import Callable

import pytest
import z3

from kvproof.reference import swa_allocator as reference
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.spec import _ts, obligations, swa_allocator, swa_ring, swa_s3, systems
from kvproof.spec._solver import TEST_BUDGET, Obligation, run
from kvproof.spec._ts import combine_agrees

#: The reference's operations that change the allocator or read it for the caller (everything but the queries).
QUERIES = {"initial_state", "available_size", "full_available_size", "swa_available_size", "is_live", "snapshot",
           "check_live_mapping", "check_live_pairs"}
OPS = sorted(set(reference.__all__) - QUERIES - {name for name in reference.__all__
                                                  if inspect.isclass(getattr(reference, name))})


#: ring mode's request slots (ReqToTokenPool): transitions of the ring's system only (the bounded allocator has none)
RING_ONLY = {"alloc_req_slots", "free_req_slots"}


def test_the_component_exports_its_system_and_obligations() -> None:
    assert swa_allocator.SYSTEMS == (swa_allocator.SYSTEM, swa_allocator.RING_SYSTEM)
    assert systems("swa_allocator") == swa_allocator.SYSTEMS
    assert swa_allocator.SYSTEM.component == "swa_allocator"
    assert obligations(component="swa_allocator") == swa_allocator.OBLIGATIONS


def test_every_reference_op_has_a_transition_of_its_name() -> None:
    assert len(OPS) == 23, OPS
    assert sorted(swa_allocator.SYSTEM.ops) == sorted(set(OPS) - RING_ONLY)
    assert swa_allocator.SYSTEM.ops == swa_s3.OPS
    # the ring's system: the request slots and every op that changes or reads the ring, each a reference op
    assert RING_ONLY <= set(swa_ring.OPS) <= set(OPS)
    assert set(swa_ring.OPS) >= {"alloc", "alloc_extend", "alloc_decode", "alloc_extend_swa_tail", "free", "free_swa",
                                 "free_full", "free_segment", "free_swa_segment", "free_full_segment", "clear"}


@pytest.mark.parametrize("op", OPS)
def test_prove_k_op_finds_obligations_about_the_op(op: str) -> None:
    """``kvproof prove -k <op>`` selects by substring; at least one obligation is named after the op itself."""
    named = [ob for ob in obligations(name_filter=op) if ob.name.startswith(f"swa_allocator.{op}.")]
    assert named, f"no obligation named swa_allocator.{op}.*"
    assert any(ob.twin_of is None for ob in named) and any(ob.twin_of is not None for ob in named)


def test_obligation_names_follow_component_op_claim() -> None:
    invariants = {"no_double_free", "swa_tail_len", "ring"}
    for ob in swa_allocator.OBLIGATIONS:
        component, head, *claim = ob.name.split(".")
        assert component == "swa_allocator" and claim, ob.name
        assert head in OPS or head in invariants, f"{ob.name}: {head!r} is neither an op nor an invariant"


@pytest.mark.parametrize("op", swa_s3.OPS)
def test_the_combined_step_agrees_with_each_transition(op: str) -> None:
    """BMC and induction use ``combine`` (the allocations and releases share one formula); the drift test and the
    per-op obligations use ``transitions[op]``: with the op chosen, both are the same relation."""
    system = swa_s3.SYSTEM
    assert system.combine is not None
    assert combine_agrees(system, op), f"combine and transitions[{op!r}] differ"


def test_the_combined_step_agrees_for_the_broken_variants() -> None:
    """The twins' systems too: every variant flag set, each op's combined relation equals its own."""
    variant = swa_s3.Variant(clears_non_tail=False, alloc_writes_mapping=False, checks_continuation=False,
                             atomic_decode=False, free_releases_swa=False, free_swa_clears=False,
                             free_full_checks_peer=False)
    system = swa_s3.system(variant)
    for op in (*swa_s3.ALLOCATIONS, *swa_s3.RELEASES):
        assert combine_agrees(system, op), op


# ---- ring mode: the reference's ring steps are steps of the ring's system (drift), obligations named per op

RING = PoolConfig(size_full=12, size_swa=6, page_size=2, sliding_window_size=3, swa_ring_size=3, num_req_slots=3)


def _counts(state: reference.SWAAllocatorState) -> dict[str, int]:
    cfg = state.config
    return {"F": len(state.full.free_pages), "S": len(state.swa.free_pages), "R": len(state.req_slots),
            "mapped": sum(1 for x in state.full_to_swa_index_mapping[:-1] if x != 0), "P": cfg.page_size,
            "ring": cfg.swa_ring_size or 0, "NF": cfg.num_pages_full, "NS": cfg.num_pages_swa,
            "NR": cfg.num_req_slots or 0}


def _pins(counts: dict[str, int]) -> Callable[[swa_ring.State], list[z3.BoolRef]]:
    return lambda s: [getattr(s, name) == value for name, value in counts.items()]


def _ring_run(seed: int, steps: int = 25) -> list[tuple[str, reference.SWAAllocatorState, reference.SWAAllocatorState,
                                                         int, int]]:
    """Seeded reference steps on a ring config: (op, pre, post, pages moved, slots moved) for each success."""
    rng, st, out = random.Random(seed), reference.initial_state(RING), []
    reqs: list[tuple[int, ...]] = []
    for _ in range(steps):
        op = rng.choice(["alloc_extend", "alloc", "alloc_decode", "free", "free_swa", "free_full", "clear",
                         "alloc_req_slots", "free_req_slots", "free_swa_segment"])
        pre = st
        try:
            if op == "alloc_extend":
                st, got = reference.alloc_extend(st, [0], [n := rng.randint(1, 5)], [-1], n)
                reqs.append(got)
            elif op == "alloc":
                st, got = reference.alloc(st, 2 * rng.randint(0, 2))
                reqs += [got] if got else []
            elif op == "alloc_decode" and reqs:
                req = rng.choice(reqs)
                st, got = reference.alloc_decode(st, [len(req) + 1], [req[-1]])
                reqs[reqs.index(req)] = req + got
            elif op in ("free", "free_swa", "free_full", "free_swa_segment") and reqs:
                req = rng.choice(reqs)
                if op == "free_swa_segment":
                    st = reference.free_swa_segment(st, list(req), 0)
                else:
                    st = getattr(reference, op)(st, list(req))
                    if op != "free_swa":
                        reqs.remove(req)
            elif op == "clear":
                st, reqs = reference.clear(st), []
            elif op == "alloc_req_slots":
                st, _ = reference.alloc_req_slots(st, rng.randint(0, 2))
            elif op == "free_req_slots":
                held = sorted(set(range(1, 4)) - set(st.req_slots))
                st = reference.free_req_slots(st, rng.sample(held, rng.randint(0, len(held))))
            else:
                continue
        except (OutOfMemory, InvalidOperation):
            continue
        k = abs(len(st.full.free_pages) - len(pre.full.free_pages))
        out.append((op, pre, st, k, abs(len(st.req_slots) - len(pre.req_slots))))
    return out


@pytest.mark.parametrize("seed", range(6))
def test_the_ring_system_accepts_the_references_ring_steps(seed: int) -> None:
    """Drift: every successful reference step on a ring config is a step of the transition of its name."""
    steps = _ring_run(seed)
    assert steps
    for op, pre, post, k, n in steps:
        verdict = _ts.accepts(swa_ring.SYSTEM, op, _pins(_counts(pre)), _pins(_counts(post)),
                              lambda a, k=k, n=n: [a.k == k, a.n == n])
        assert verdict.accepted, f"{op}: {verdict}"


def test_the_ring_system_rejects_a_paged_alloc() -> None:
    """The drift check has teeth: a paged (non-ring) alloc's step is no ring ``alloc`` step (it takes SWA pages)."""
    plain = PoolConfig(size_full=12, size_swa=6, page_size=2, sliding_window_size=3)
    pre = reference.initial_state(plain)
    post, _ = reference.alloc(pre, 2)
    counts = {**_counts(pre), "ring": 3, "NR": 3, "R": 3}, {**_counts(post), "ring": 3, "NR": 3, "R": 3}
    verdict = _ts.accepts(swa_ring.SYSTEM, "alloc", _pins(counts[0]), _pins(counts[1]))
    assert not verdict.accepted


@pytest.mark.parametrize("ob", [ob for ob in swa_allocator.OBLIGATIONS if ob.family == swa_ring.FAMILY],
                         ids=lambda ob: ob.name)
def test_ring_obligations_hold_and_twins_are_refuted(ob: Obligation) -> None:
    result = run(ob, **TEST_BUDGET)
    assert result.ok, f"{ob.name}: {result.status}\n{result.detail}"
    if ob.is_twin:
        assert "|" in result.detail or "P = " in result.detail or "page" in result.detail  # a readable counterexample


def test_ring_obligations_pair_every_claim_with_a_twin() -> None:
    ring = [ob for ob in swa_allocator.OBLIGATIONS if ob.family == swa_ring.FAMILY]
    sound = {ob.name for ob in ring if not ob.is_twin}
    assert len(sound) == 9 and len(ring) - len(sound) == 9
    assert {ob.twin_of for ob in ring if ob.is_twin} == sound
