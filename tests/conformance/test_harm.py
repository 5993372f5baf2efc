"""The harm continuation (kvproof.conformance.harm): after a divergence, the implementation alone under a ghost
ownership model, until the divergence becomes a consequence. Tested against kvproof's correct runtime (no false
alarm, every move made) and the mutants (each harm kind found where the mutant causes it, none invented where the
mutant's difference is harmless)."""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvproof.cli import main
from kvproof.conformance.check import get_suite, run_check
from kvproof.conformance.configs import CONFORMANCE_CONFIGS
from kvproof.conformance.errors import UsageError
from kvproof.conformance.harm import HARMS, Harm, _walk, continue_for_harm
from kvproof.conformance.mutants.decode_prealloc import MUTANTS as DECODE_MUTANTS
from kvproof.conformance.mutants.hisparse_host import MUTANTS as HOST_MUTANTS
from kvproof.conformance.mutants.swa_allocator import MUTANTS
from kvproof.conformance.swa_ghost import SWAGhost
from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator

P2 = next(c for c in CONFORMANCE_CONFIGS if c.label() == "P2-W3-F24-S12")

#: the harm each mutant's shrunk P2 failure turns into ("none": a difference the walk cannot make harmful)
EXPECTED = {
    "leak_on_failed_alloc": "capacity lost",  # the full pages it took are neither free nor held
    "nonatomic_alloc_decode": "capacity lost",  # F1's shape
    "free_swa_keeps_mapping": "freed while owned",
    "swa_last_loc_untranslated": "freed while owned",
    "free_full_unchecked": "freed while owned",
    "double_free_accepted": "duplicate in a free list",
    "slot_zero_handed_out": "reserved page handed out",
    "wrong_page_rounding": "raised",  # a short result for the positions asked
    "free_order_append": "none",  # free-list order is policy: nothing a caller can be hurt by
}


def _failure(name: str) -> dict:
    report = run_check("swa_allocator", MUTANTS[name], P2, failures_dir=None, isolation="in-process",
                       impl_name=name)
    assert not report.passed and report.vector is not None, f"{name} was not caught on {P2.label()}"
    return report.vector


@pytest.mark.parametrize("config", CONFORMANCE_CONFIGS, ids=lambda c: c.label())
def test_the_correct_runtime_walks_without_a_harm_and_makes_every_move(config) -> None:
    """No false alarm: 24 walks of 40 calls from an empty pool, then settling, on the correct runtime; and the walks
    did extend, decode, evict and free (a walk that never frees could not be wrong about freeing)."""
    moves: Counter[str] = Counter()
    for t in range(24):
        impl = SWATokenToKVPoolAllocator(config)
        ghost = SWAGhost(impl, config, frozenset(impl.capabilities), {}, 1, 30.0)
        walk, harm = _walk(ghost, random.Random(t), 40)
        assert harm is None, "\n".join([*walk, str(harm)])
        moves.update(line.split(" ", 1)[0] for line in walk)
    assert {"alloc_extend", "alloc_decode", "free_swa", "free"} <= set(moves), moves


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_mutant_divergence_continues_into_its_harm(name: str) -> None:
    found = continue_for_harm(_failure(name), MUTANTS[name], impl_name=name, tries=8, isolation="in-process")
    assert not found.note, found.note
    assert (found.harm.kind if found.harm else "none") == EXPECTED[name], found.text()
    text = found.text()
    assert "owners at the divergence" in text
    if found.harm is not None:
        assert f"HARM ({found.harm.kind})" in text


def test_the_continuation_is_the_same_for_the_same_seed_and_shortest_first() -> None:
    vector = _failure("free_swa_keeps_mapping")
    one = continue_for_harm(vector, MUTANTS["free_swa_keeps_mapping"], impl_name="m", tries=6, seed=3,
                            isolation="in-process")
    two = continue_for_harm(vector, MUTANTS["free_swa_keeps_mapping"], impl_name="m", tries=6, seed=3,
                            isolation="in-process")
    assert one.to_json() == two.to_json()
    assert len(one.tried) == 6 and one.harm is not None


def test_capacity_lost_names_the_pages_and_probes_the_largest_request() -> None:
    found = continue_for_harm(_failure("leak_on_failed_alloc"), MUTANTS["leak_on_failed_alloc"], impl_name="m",
                              tries=2, isolation="in-process")
    assert found.harm is not None and "neither free nor held" in found.harm.text
    free_full = int(re.search(r"full pool (\d+) of 12 pages free", found.harm.text).group(1))
    assert free_full < 12
    # the probe asks for the SWA pool's size (6 pages of 2): refused exactly when fewer full pages are left
    refused = free_full < 6
    assert ("a request that fits the empty pool is refused" in found.harm.text) == refused
    assert any("fits the empty pool" in line and line.endswith("out of memory" if refused else "ok")
               for line in found.walk)


def test_isolated_continuation_gives_the_in_process_result() -> None:
    vector = _failure("double_free_accepted")
    here = continue_for_harm(vector, MUTANTS["double_free_accepted"], impl_name="m", tries=3, isolation="in-process")
    there = continue_for_harm(vector, MUTANTS["double_free_accepted"], impl_name="m", tries=3)
    assert here.to_json() == there.to_json()


def test_no_continuation_is_said_so_with_the_reason() -> None:
    vector = _failure("double_free_accepted")
    passing = continue_for_harm(vector, SWATokenToKVPoolAllocator, impl_name="runtime", tries=2,
                                isolation="in-process")
    assert passing.harm is None and "does not fail on this implementation" in passing.text()
    for component, mutants in (("hisparse_host", HOST_MUTANTS), ("decode_prealloc", DECODE_MUTANTS)):
        vector = next(r.vector for name, factory in sorted(mutants.items()) for config in get_suite(component).configs
                      if (r := run_check(component, factory, config, failures_dir=None, isolation="in-process",
                                         impl_name=name, shrink_with="vector")).vector is not None)
        factory = mutants[vector["impl"]]
        found = continue_for_harm(vector, factory, impl_name=vector["impl"], tries=2, isolation="in-process")
        assert found.harm is None and f"no continuation for component {component}" in found.text()
    assert "scheduler's" in found.note  # decode_prealloc says why


def test_bad_arguments_are_usage_errors() -> None:
    with pytest.raises(UsageError, match="tries must be >= 1"):
        continue_for_harm({"component": "swa_allocator", "config": {}}, SWATokenToKVPoolAllocator, impl_name="x",
                          tries=0)
    with pytest.raises(UsageError, match="harm kind"):
        Harm("bad luck", "")
    assert HARMS[0] == "cross-request KV read" and HARMS[-1] == "capacity lost"


def test_replay_and_conform_print_the_continuation_under_the_trace(tmp_path: Path) -> None:
    runner = CliRunner()
    impl = "kvproof.conformance.mutants.swa_allocator:DoubleFreeAccepted"
    report, vector = tmp_path / "r.json", tmp_path / "v.json"
    conform = runner.invoke(main, ["conform", "--impl", impl, "--component", "swa_allocator", "--config", P2.label(),
                                   "--harm", "--fresh", "--in-process", "--json-report", str(report)])
    assert conform.exit_code == 1, conform.output
    out = conform.output
    assert out.index("operations so far") < out.index("harm continuation") < out.index("HARM (duplicate")
    result = json.loads(report.read_text())["results"][0]
    assert result["harm"]["harm"]["kind"] == "duplicate in a free list"
    vector.write_text(json.dumps(result["vector"]))
    replay = runner.invoke(main, ["replay", str(vector), "--harm", "--harm-tries", "4", "--in-process"])
    assert replay.exit_code == 1, replay.output
    assert "HARM (duplicate in a free list)" in replay.output and "seed 0, 4 tries" in replay.output
    plain = runner.invoke(main, ["replay", str(vector), "--in-process"])
    assert "harm continuation" not in plain.output  # only when asked


class _Aliasing(SWATokenToKVPoolAllocator):
    """Test the tester: every allocation of as many positions as an earlier one returns the earlier one's slots (the
    new pages are taken and dropped): two requests share pages."""

    def alloc_extend(self, *args, **kwargs):
        out = super().alloc_extend(*args, **kwargs)
        seen = self.__dict__.setdefault("_seen", {})
        return seen.setdefault(int(out.numel()), out)


@pytest.mark.parametrize("kv", [True, False], ids=["with_kv", "without_kv"])
def test_pages_with_two_owners_are_a_cross_request_read_or_two_owners(kv: bool) -> None:
    """With KV the tags read back name the other request (the most severe kind); without KV (no ``KV_BUFFER``) the
    page ownership alone shows two owners. (A walk may first meet the dropped pages' consequence: a write our runtime
    refuses on slots it no longer counts as allocated, ``raised``.)"""
    impl = _Aliasing(P2)
    caps = frozenset(impl.capabilities) - (set() if kv else {"kv_buffer"})
    kinds = set()
    for t in range(6):
        impl = _Aliasing(P2)
        _, harm = _walk(SWAGhost(impl, P2, caps, {}, 1, 30.0), random.Random(t), 40)
        kinds.add(harm.kind if harm else "none")
    if kv:  # the tag of the request written last is what the other one reads
        assert "cross-request KV read" in kinds, kinds
    else:
        assert "two owners" in kinds and "cross-request KV read" not in kinds, kinds
