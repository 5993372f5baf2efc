"""The kvproof command line: exit codes, tables, errors that name what was wrong."""

from click.testing import CliRunner

from kvproof.cli import main
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator
from kvproof.reference.contract import Capability
from kvproof.reference.registry import Component


class NoAllocExtend(SWATokenToKVPoolAllocator):
    """kvproof's runtime declaring no ``alloc_extend``, as SGLang's allocator at page size 1: ``decode_prealloc``'s
    suite admits every request through it, so it has nothing to call on any config."""

    capabilities = SWATokenToKVPoolAllocator.capabilities - {Capability.ALLOC_EXTEND}
    components = frozenset({Component.DECODE_PREALLOC})


def run(*args: str):
    return CliRunner().invoke(main, list(args))


def test_prove_filtered_passes_and_prints_rows() -> None:
    result = run("prove", "-k", "swa_tail_len")
    assert result.exit_code == 0, result.output
    assert "swa_allocator.swa_tail_len.upper_bound" in result.output and "0 failed" in result.output


def test_prove_nothing_selected_is_a_usage_error_naming_the_filter() -> None:
    """Observation 7: a -k (or --component and -k) matching nothing printed an empty table with no reason."""
    result = run("prove", "-k", "no-such-obligation")
    assert result.exit_code == 2
    assert "-k 'no-such-obligation' matches no obligation of swa_allocator, loc_cache" in result.output
    assert "kvproof prove" not in result.output  # no empty table
    narrowed = run("prove", "--component", "hisparse_host", "-k", "swa_tail_len")
    assert narrowed.exit_code == 2 and "matches no obligation of hisparse_host" in narrowed.output


def test_conform_bad_impl_names_the_problem() -> None:
    result = run("conform", "--impl", "kvproof.nope:factory")
    assert result.exit_code == 2
    assert "cannot import 'kvproof.nope'" in result.output


def test_conform_unknown_config_lists_choices() -> None:
    result = run("conform", "--config", "P9-W9")
    assert result.exit_code != 0
    assert "P4-W6-F48-S24" in str(result.exception) + result.output


def test_conform_catches_a_broken_implementation_with_a_replay_command() -> None:
    result = run("conform", "--impl", "kvproof.conformance.mutants.swa_allocator:TailStartOffByOne",
                 "--config", "P4-W6-F48-S24", "--profile", "ci", "--component", "swa_allocator")
    assert result.exit_code == 1
    assert "operations so far" in result.output
    assert ("replay: kvproof conform --component swa_allocator --impl "
            "kvproof.conformance.mutants.swa_allocator:TailStartOffByOne") in result.output
    assert "--shrink" not in result.output  # the default shrinker is not named


def test_conform_shrink_vector_reports_the_vector_shrunk_failure() -> None:
    """``--shrink vector``: the same verdict, its operations shrunk by replaying the vector (Hypothesis finds only);
    an unknown shrinker is a usage error naming the choices."""
    result = run("conform", "--impl", "kvproof.conformance.mutants.swa_allocator:DoubleFreeAccepted",
                 "--config", "P2-W3-F24-S12", "--component", "swa_allocator", "--shrink", "vector", "--in-process",
                 "--fresh")
    assert result.exit_code == 1, result.output
    assert "free succeeded; the reference raised InvalidOperation" in result.output
    assert "at step 1:" in result.output and "operations so far:\n  1. free(" in result.output
    assert "[misuse: " in result.output
    # the replay command shrinks the same way, so it ends at this failure
    assert ("replay: kvproof conform --component swa_allocator --impl "
            "kvproof.conformance.mutants.swa_allocator:DoubleFreeAccepted --config P2-W3-F24-S12 --profile ci "
            "--shrink vector") in result.output
    bad = run("conform", "--shrink", "fast")
    assert bad.exit_code == 2 and "'fast' is not one of 'hypothesis', 'vector'" in bad.output


def test_conform_runtime_one_config() -> None:
    result = run("conform", "--config", "P4-W2-F32-S16", "--profile", "dev")
    assert result.exit_code == 0, result.output
    assert "swa_allocator P4-W2-F32-S16: pass" in result.output and "loc_cache P4-W2-F32-S16: pass" in result.output


def test_conform_a_run_that_never_calls_the_implementation_is_skipped_not_passed() -> None:
    """A run that passed without calling the implementation once checked nothing (against SGLang, decode_prealloc at
    page size 1 read "pass" with 0 calls): it is skipped, and the reason names the rules its capabilities rule out."""
    result = run("conform", "--impl", "tests.test_cli:NoAllocExtend", "--config", "P2-W3-F24-S12", "--profile", "dev",
                 "--in-process")
    assert result.exit_code == 0, result.output
    assert "decode_prealloc P2-W3-F24-S12: skipped (nothing checked)" in result.output
    assert ("decode_prealloc P2-W3-F24-S12: skipped (nothing checked: " in result.output
            and "and not one call of the implementation" in result.output), result.output
    assert "(not applicable: decode, pop_preallocated, resume_retracted_reqs, retract)" in result.output
    assert result.output.rstrip().endswith("1 skipped"), result.output[-300:]


def test_conform_hisparse_host_default_runtime_and_a_mutant() -> None:
    """Each component has its own configs and default implementation; --impl replaces it."""
    ok = run("conform", "--component", "hisparse_host", "--config", "P4-H8-R4-C14", "--profile", "ci")
    assert ok.exit_code == 0, ok.output
    assert "hisparse_host P4-H8-R4-C14: pass" in ok.output
    bad = run("conform", "--component", "hisparse_host", "--config", "P4-H8-R4-C14", "--profile", "ci",
              "--impl", "kvproof.conformance.mutants.hisparse_host:ReleaseReversed")
    assert bad.exit_code == 1
    assert ("replay: kvproof conform --component hisparse_host --impl "
            "kvproof.conformance.mutants.hisparse_host:ReleaseReversed --config P4-H8-R4-C14") in bad.output


def test_several_implementations_each_serve_the_components_they_declare() -> None:
    """--impl is repeatable; without --component the declared components of the given factories run."""
    result = run("conform", "--profile", "dev", "--config", "P4-W6-F48-S24", "--config", "P4-H8-R4-C14",
                 "--impl", "kvproof.gpu_runtime.swa_allocator:SWATokenToKVPoolAllocator",
                 "--impl", "kvproof.conformance.mutants.hisparse_host:ReleaseReversed")
    assert result.exit_code == 1, result.output
    for line in ("swa_allocator P4-W6-F48-S24: pass", "loc_cache P4-W6-F48-S24: pass",
                 "decode_prealloc P4-W6-F48-S24: pass", "hisparse_host P4-H8-R4-C14: FAIL"):
        assert line in result.output
    only_host = run("conform", "--profile", "dev", "--component", "swa_allocator",
                    "--impl", "kvproof.gpu_runtime.hisparse_host:HiSparseHostPool")
    assert only_host.exit_code == 2 and "no --impl serves component 'swa_allocator'" in only_host.output
