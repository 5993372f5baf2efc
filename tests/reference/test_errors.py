"""The reference's one contract for failures: require / ensure, the typed errors, and the live-mapping rules."""

from __future__ import annotations

import pytest

from kvproof.reference import loc_cache as lc
from kvproof.reference import swa_allocator as sa
from kvproof.reference.config import PoolConfig
from kvproof.reference.errors import (
    ConfigError,
    InvalidOperation,
    InvariantViolation,
    PoolError,
    ensure,
    require,
)

CFG = PoolConfig(size_full=32, size_swa=16, page_size=4, sliding_window_size=4)


def test_require_raises_invalid_operation_naming_op_and_argument() -> None:
    require(True, "free", "free_index", "never shown")
    with pytest.raises(InvalidOperation) as e:
        require(False, "free", "free_index", "slot 3 lies in the reserved page 0")
    assert (e.value.op, e.value.argument) == ("free", "free_index")
    assert str(e.value) == "free: free_index: slot 3 lies in the reserved page 0"
    assert isinstance(e.value, ValueError) and isinstance(e.value, PoolError)


def test_ensure_raises_invariant_violation_naming_the_invariant() -> None:
    ensure(True, "G1", "never shown")
    with pytest.raises(InvariantViolation) as e:
        ensure(False, "G1", "full free list has a duplicate page")
    assert e.value.invariant == "G1" and str(e.value) == "[G1] full free list has a duplicate page"
    assert isinstance(e.value, AssertionError) and isinstance(e.value, PoolError)


def test_a_callable_message_is_built_only_on_failure() -> None:
    built: list[str] = []

    def message() -> str:
        built.append("built")
        return "expensive"

    require(True, "op", "arg", message)
    ensure(True, "M2", message)
    assert built == []
    with pytest.raises(InvalidOperation, match=r"^op: arg: expensive$"):
        require(False, "op", "arg", message)
    with pytest.raises(InvariantViolation, match=r"^\[M2\] expensive$"):
        ensure(False, "M2", message)
    assert built == ["built", "built"]


def test_config_error_names_model_and_field() -> None:
    e = ConfigError("PoolConfig", "size_swa", "must not exceed size_full (8), got 16")
    assert (e.model, e.field) == ("PoolConfig", "size_swa")
    assert str(e) == "PoolConfig.size_swa: must not exceed size_full (8), got 16"
    assert str(ConfigError("PoolConfig", "", "whole-model rule")) == "PoolConfig: whole-model rule"
    assert isinstance(e, ValueError) and isinstance(e, PoolError)


def test_replay_before_capture_is_invalid_not_an_assertion() -> None:
    system = lc.initial_system(CFG)
    with pytest.raises(InvalidOperation) as e:
        lc.replay(system, {0: ([[1.0, 2.0]], [[3.0, 4.0]])})
    assert (e.value.op, e.value.argument) == ("replay", "graph") and not isinstance(e.value, AssertionError)


# ---------------------------------------------------------------- the live-mapping rules on plain values

#: full pages 1, 2 (owner 1) and 3 (owner 2); SWA pages 1, 2 (owner 1) and 3 (owner 2); P = 4
FULL_OWNER = (None, 1, 1, 2, None)
SWA_OWNER = {1: 1, 2: 1, 3: 2}
GOOD = [(4, 4), (5, 5), (6, 6), (7, 7), (8, 8), (9, 9), (12, 12), (13, 13)]


def with_pairs(**changes: int) -> list[tuple[int, int]]:
    """GOOD with ``f<slot>=<swa slot>`` changes (0 drops the pair: no SWA slot)."""
    pairs = dict(GOOD)
    for key, s in changes.items():
        pairs[int(key[1:])] = s
    return [(f, s) for f, s in sorted(pairs.items()) if s > 0]


@pytest.mark.parametrize(
    ("pairs", "message"),
    [
        (with_pairs(f4=16), "[M2] live full slot 4 maps to SWA slot 16 in free page 4"),
        (with_pairs(f12=0, f13=0, f8=12, f9=13), "[M2] full slot 8 (page 2) maps to SWA slot 12 in page 3 of another "
                                                 "owner"),
        (with_pairs(f5=4), "[M2] full slots 4 and 5 both map to SWA slot 4"),
        (with_pairs(f4=5, f5=4), "[M5] full slot 4 (offset 0) maps to SWA slot 5 (offset 1)"),
        (with_pairs(f4=0, f5=0, f8=4, f9=5), "[M5] SWA page 1 is shared by full pages 1 and 2"),
        (with_pairs(f12=0, f13=0), "[G3] SWA pages owned but mapped from no live full slot: [3]"),
    ],
)
def test_live_pair_rules_name_the_first_broken_slot(pairs: list[tuple[int, int]], message: str) -> None:
    with pytest.raises(InvariantViolation) as e:
        sa.check_live_pairs(4, pairs, FULL_OWNER, SWA_OWNER)
    assert (e.value.invariant, str(e.value)) == (message[1:3], message)


def test_live_pair_rules_accept_a_well_formed_mapping() -> None:
    sa.check_live_pairs(4, GOOD, FULL_OWNER, SWA_OWNER)
    sa.check_live_pairs(4, with_pairs(f4=8, f5=9, f6=10, f7=11, f8=4, f9=5), FULL_OWNER, SWA_OWNER)  # pages swapped


def test_set_mapping_turns_a_broken_rule_into_invalid_operation() -> None:
    s = sa.initial_state(CFG)
    s, _ = sa.alloc_extend(s, [0], [6], [-1], 6)
    s, _ = sa.alloc_extend(s, [0], [2], [-1], 2)
    before = sa.snapshot(s)
    with pytest.raises(InvalidOperation) as e:
        sa.set_full_to_swa_mapping(s, [5], [4])
    assert (e.value.op, e.value.argument) == ("set_full_to_swa_mapping", "swa_indices")
    assert str(e.value) == ("set_full_to_swa_mapping: swa_indices: the mapping would break "
                            "[M2] full slots 4 and 5 both map to SWA slot 4")
    assert sa.snapshot(s) == before
    sa.check_live_mapping(s)
