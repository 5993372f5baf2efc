"""loc_cache lockstep suite: kvproof's runtime and the reference pass; every cache mutant dies twice.

Each mutant of ``kvproof.conformance.mutants.loc_cache`` must be killed by the state
machine under the ``ci`` profile with a shrunk trace of at most 10 steps, and by its
Z3 twin in ``kvproof.spec.loc_cache`` (a counterexample).
"""

import re

import pytest

from kvproof import spec
from kvproof.conformance.check import check_loc_cache, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.loc_cache import LocCacheMachine
from kvproof.conformance.mutants.loc_cache import MUTANTS
from kvproof.conformance.reference_impl import ReferenceAllocator
from kvproof.conformance.swa_allocator import SWAAllocatorMachine
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator

from ..devices import DEVICES
from .runtime_runs import group, runtime_run

IDS = [c.label() for c in CONFORMANCE_CONFIGS]
LOC_RULES = set(LocCacheMachine.operations) - set(SWAAllocatorMachine.operations)

#: The Z3 obligation that must refute the same broken design as each runtime mutant.
Z3_TWIN = {
    **{f"no_invalidate_{p}": f"loc_cache.no_stale_read.without_{p}" for p in (
        "alloc", "alloc_extend", "alloc_extend_swa_tail", "alloc_decode", "free_swa", "set_full_to_swa_mapping",
        "clear", "register_mapping", "forward", "run_once")},
    "forward_point_eager_only": "loc_cache.replay.forward_point_eager_only",
    "storage_base_key": "loc_cache.translate_loc_from_full_to_swa.s5_storage_base_key",
    "cache_shared_across_pools": "loc_cache.translate_loc_from_full_to_swa.cache_shared_across_pools",
}


@group("loc_cache")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS, ids=IDS)
def test_runtime_passes_loc_cache_suite(config, device: str) -> None:
    report = runtime_run("loc_cache", config, device)
    assert report.passed, report.failure
    assert report.not_applicable == ()
    assert not LOC_RULES & set(report.never_run), f"loc_cache rules never executed: {report.never_run}"


@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS[:2], ids=IDS[:2])
def test_reference_passes_loc_cache_suite(config) -> None:
    check_loc_cache(ReferenceAllocator, config, profile="ci", impl_name="reference")


def test_every_mutant_has_a_z3_twin() -> None:
    assert set(Z3_TWIN) == set(MUTANTS)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_killed_by_z3_twin(name: str) -> None:
    (obligation,) = [ob for ob in spec.OBLIGATIONS if ob.name == Z3_TWIN[name]]
    result = spec.run(obligation)
    assert result.status == "counterexample", result.detail


def _steps(failure: str) -> list[str]:
    block = failure.split("operations so far:")[1].split("\n\n")[0]
    return re.findall(r"^\s+\d+\. (\w+)\(", block, flags=re.M)


#: Mutants whose failure Hypothesis' shrinker takes 30-100 s to shrink on a 2-core machine (the slowest tests of the
#: suite): shrunk by replaying the vector instead (``--shrink vector``, the same examples, the same failure kind). The
#: other nine keep Hypothesis' shrinker, the default, so its trace length is still checked on this suite.
SHRUNK_BY_VECTOR = frozenset({"forward_point_eager_only", "no_invalidate_alloc_decode", "no_invalidate_alloc_extend",
                              "storage_base_key"})


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_killed_by_state_machine_with_short_trace(name: str) -> None:
    shrink_with = "vector" if name in SHRUNK_BY_VECTOR else "hypothesis"
    for config in CONFORMANCE_CONFIGS:
        report = run_check("loc_cache", MUTANTS[name], config, profile="ci", impl_name=f"mutant {name}",
                           failures_dir=None, shrink_with=shrink_with)
        if not report.passed:
            break
    else:
        pytest.fail(f"mutant {name} survived the loc_cache suite on every config")
    failure = report.failure or ""
    assert "LockstepFailure" in failure and "HarnessError" not in failure, failure
    steps = _steps(failure)
    assert 1 <= len(steps) <= 10, f"shrunk trace has {len(steps)} steps:\n{failure}"


def test_a_batch_too_large_for_the_freed_address_takes_a_fresh_one() -> None:
    """A decode batch of more indices than one cell holds (3 requests growing by P + 1 at P = 4: 15) that draws the
    freed batch address gets a fresh storage instead of overlapping the storage after that address (a randomized
    run found the overlap: the reference's index memory refused it as a harness error)."""
    from kvproof.conformance.check import Binding
    from kvproof.reference import index_memory as im

    class Reuse:  # draws "reuse" (the last choice) and nothing else
        def draw(self, strategy: object, label: str | None = None) -> bool:
            assert label == "reuse", label
            return True

    machine = LocCacheMachine(Binding(SWATokenToKVPoolAllocator, CONFORMANCE_CONFIGS[2], op_timeout=5.0))
    freed = machine._store([1])
    neighbour = machine._store([2])
    machine.memory = im.free_storage(machine.memory, freed)
    machine.phase, machine.reuse_base = "prep", machine.memory.storages[freed].base
    small = machine._batch_storage(Reuse(), [7] * 8)  # fits the cell: reuses the address
    assert machine.memory.storages[small].base == machine.reuse_base
    machine.memory = im.free_storage(machine.memory, small)
    large = machine._batch_storage(Reuse(), list(range(10, 25)))
    assert machine.memory.storages[large].base not in (machine.reuse_base, machine.memory.storages[neighbour].base)
    assert machine.memory.storages[neighbour].alive
