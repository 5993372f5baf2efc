"""The decode-node simulation: the corrected policy holds on every config, the upstream one crashes (S2-like)."""

import re

import pytest

from kvproof.conformance.check import check, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.decode_prealloc import DEFAULT_DECODE_CONFIG
from kvproof.conformance.reference_impl import ReferenceAllocator
from kvproof.gpu_runtime import SWATokenToKVPoolAllocator
from kvproof.reference.decode_prealloc import PreallocPolicy

from ..devices import DEVICES
from .runtime_runs import group, runtime_run

IDS = [c.label() for c in CONFORMANCE_CONFIGS]
UPSTREAM = DEFAULT_DECODE_CONFIG.model_copy(update={"policy": PreallocPolicy.UPSTREAM})


@group("decode_prealloc")
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS, ids=IDS)
def test_corrected_policy_holds_on_the_runtime(config, device: str) -> None:
    report = runtime_run("decode_prealloc", config, device)  # the registry's default: DEFAULT_DECODE_CONFIG
    assert report.passed, report.failure
    assert report.rules["pop_preallocated"] > 0 and report.rules["decode"] > 0
    assert report.rules["retract"] > 0 and report.rules["resume_retracted_reqs"] > 0
    assert report.calls.get("load_cpu_copy", 0) > 0


def test_corrected_policy_holds_on_the_reference() -> None:
    check("decode_prealloc", ReferenceAllocator, CONFORMANCE_CONFIGS[2], profile="ci", impl_name="reference")


def test_window_eviction_is_exercised() -> None:
    """Long enough requests decode past their window, so free_swa runs (D3 is not vacuous)."""
    evictions = sum(run_check("decode_prealloc", SWATokenToKVPoolAllocator, c, profile="ci", impl_name="runtime",
                              failures_dir=None).calls.get("free_swa", 0) for c in CONFORMANCE_CONFIGS)
    assert evictions > 0


def test_upstream_policy_crashes_and_shrinks() -> None:
    """R4 / S2: the simulation finds an admitted request whose preallocation fails, in a short trace."""
    for config in CONFORMANCE_CONFIGS:
        report = run_check("decode_prealloc", SWATokenToKVPoolAllocator, config, profile="ci",
                           impl_name="runtime, upstream policy", failures_dir=None, decode_config=UPSTREAM)
        if not report.passed:
            break
    else:
        pytest.fail("the upstream policy never crashed")
    failure = report.failure or ""
    assert "D1 violated in" in failure and "OutOfMemory" in failure, failure
    steps = re.findall(r"^\s+\d+\. (\w+)\(", failure.split("operations so far:")[1].split("\n\n")[0], flags=re.M)
    assert steps[-1] in ("pop_preallocated", "resume_retracted_reqs") and len(steps) <= 8, steps


def test_rules_an_allocator_cannot_serve_are_not_applicable_and_not_run() -> None:
    """Needs follow the page size (P == 1 preallocates with alloc); undeclared needs are reported, never run."""
    from kvproof.conformance.decode_prealloc import allocating_needs
    from kvproof.reference.contract import Capability

    class NoDecode(SWATokenToKVPoolAllocator):
        capabilities = frozenset(Capability) - {Capability.ALLOC_DECODE, Capability.DECODE_BUDGETS}

    assert Capability.ALLOC in allocating_needs(CONFORMANCE_CONFIGS[0])
    assert Capability.ALLOC not in allocating_needs(CONFORMANCE_CONFIGS[2])
    report = run_check("decode_prealloc", NoDecode, CONFORMANCE_CONFIGS[2], profile="dev", failures_dir=None)
    assert report.passed and {"pop_preallocated", "decode", "retract"} <= set(report.not_applicable)
    assert not any(report.rules.get(r) for r in ("pop_preallocated", "decode", "retract", "resume_retracted_reqs"))


def test_the_policy_option_is_declared_once_and_maps_to_the_scheduler() -> None:
    """``--policy`` comes from the registry (the CLI and the plugin need no suite import); the suite applies it."""
    from kvproof.conformance.check import get_suite
    from kvproof.reference.decode_prealloc import PreallocPolicy
    from kvproof.reference.registry import info

    (option,) = info("decode_prealloc").options
    assert option.name == "policy" and set(option.choices) == {p.value for p in PreallocPolicy}
    suite = get_suite("decode_prealloc")
    assert suite.options({"policy": "upstream"})["decode_config"].policy is PreallocPolicy.UPSTREAM
    assert suite.options({})["decode_config"].policy is PreallocPolicy(option.default)
