"""The block_pool reference (vLLM 0.33.0's v1 KV cache manager, docs/block_pool.md): the free-queue order, hits,
the sliding window, the admission gate, eviction and reset, each as vLLM 0.33.0 does it on CPU (the numbers in the
docstrings are vLLM's own answers to the same calls), and the typed errors that leave the state unchanged."""

from __future__ import annotations

import pytest

from kvproof.reference import block_pool as bp
from kvproof.reference.arith import ceil_div
from kvproof.reference.errors import ConfigError, InvalidOperation, InvariantViolation, OutOfMemory

W8 = bp.BlockPoolConfig(block_size=4, num_blocks=16, sliding_window=8, max_model_len=64)
FULL = bp.BlockPoolConfig(block_size=4, num_blocks=6, max_model_len=32)


def _admit(state: bp.BlockPoolState, req: int, tokens: list[int], n: int | None = None, must_fit: bool = True
           ) -> tuple[bp.BlockPoolState, tuple[tuple[int, ...], ...]]:
    hit = bp.get_computed_blocks(state, tokens)
    new = len(tokens) - hit.num_tokens if n is None else n
    state, blocks = bp.allocate_slots(state, req, tokens, 0, new, hit, must_fit)
    bp.check_block_pool(state)
    return state, blocks


def test_allocate_and_free_in_vllms_order() -> None:
    """vLLM 0.33.0: 10 tokens at B=4, W=8 on 16 blocks take ([1,2,3],[4,5,6]); freeing puts each group's uncached
    tail block at the front (LIFO) and its cached blocks, last first, at the back (LRU): [6,3,7..15,2,1,5,4]."""
    state, new = _admit(bp.initial_state(W8), 1, list(range(10)))
    assert new == ((1, 2, 3), (4, 5, 6))
    assert state.free == tuple(range(7, 16))
    state = bp.free(state, 1)
    bp.check_block_pool(state)
    assert state.free == (6, 3, *range(7, 16), 2, 1, 5, 4)
    assert set(state.cached) == {bp.block_key(g, list(range(10)), i, 4) for g in (0, 1) for i in (0, 1)}


def test_a_shared_prefix_hits_its_cached_blocks_and_touches_them_out_of_the_free_queue() -> None:
    """vLLM: after the free, a request sharing the 10-token prefix hits 8 tokens in ([1,2],[4,5])."""
    state, _ = _admit(bp.initial_state(W8), 1, list(range(10)))
    state = bp.free(state, 1)
    tokens = [*range(10), 99]
    hit = bp.get_computed_blocks(state, tokens)
    assert hit == bp.Hit(blocks=((1, 2), (4, 5)), num_tokens=8)
    state, new = bp.allocate_slots(state, 2, tokens, 0, 3, hit, True)
    bp.check_block_pool(state)
    assert new == ((6,), (3,))  # the front of the queue: the freed tails
    assert all(b not in state.free for b in (1, 2, 4, 5)) and state.ref_cnt[1] == 1


def test_a_hit_needs_the_whole_prefix_not_the_blocks_own_tokens() -> None:
    state, _ = _admit(bp.initial_state(FULL), 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert bp.get_computed_blocks(state, [0, 2, 3, 4, 5, 6, 7, 8, 9]).num_tokens == 0  # block 1 alike, block 0 not
    assert bp.get_computed_blocks(state, [1, 2, 3, 4, 5, 6, 7, 8, 0]).num_tokens == 8


def test_sliding_window_hit_needs_contiguous_blocks_right_to_left() -> None:
    """W=8, B=4: a hit needs cdiv(7, 4) = 2 cached blocks in a row; blocks left of the run are the null block."""
    cfg = bp.BlockPoolConfig(block_size=4, num_blocks=30, sliding_window=8, max_model_len=64)
    tokens = list(range(25))
    state, _ = _admit(bp.initial_state(cfg), 1, tokens)
    state = bp.free(state, 1)
    hit = bp.get_computed_blocks(state, tokens)
    assert hit.num_tokens == 24
    assert hit.blocks[1][:4] == (0, 0, 0, 0) and 0 not in hit.blocks[1][4:]
    assert len(hit.blocks[0]) == 6 and 0 not in hit.blocks[0]
    assert bp.contiguous_blocks_for_hit(8, 4) == 2


def test_out_of_window_blocks_become_the_null_block_last_first() -> None:
    cfg = bp.BlockPoolConfig(block_size=2, num_blocks=20, sliding_window=4, max_model_len=32)
    state, _ = _admit(bp.initial_state(cfg), 1, list(range(10)))
    swa = state.requests[1].blocks[1]
    state = bp.remove_skipped_blocks(state, 1, 10)  # skipped = 10 - 4 + 1 = 7 tokens: 3 blocks
    bp.check_block_pool(state)
    assert state.requests[1].blocks[1] == (0, 0, 0, *swa[3:])
    assert state.free[-3:] == (swa[2], swa[1], swa[0])  # cached blocks: appended, in the backward walk's order
    again = bp.remove_skipped_blocks(state, 1, 10)
    assert again == state  # stops at the first null block: nothing more to release


def test_admission_gate_caps_the_sliding_window_group() -> None:
    """#39734: charging the whole sequence to the SWA group refuses a request that fits; the cap admits it."""
    cfg = bp.BlockPoolConfig(block_size=2, num_blocks=11, sliding_window=3, max_model_len=12, max_in_flight_tokens=2)
    assert bp.max_admission_blocks_per_request(cfg, bp.SWA) == 3  # cdiv(min(3 - 1 + 2, 12), 2) + 1
    tokens = list(range(12))
    _, new = _admit(bp.initial_state(cfg), 1, tokens, n=2)  # full group 6 + SWA capped 3 = 9 <= 10 free
    assert len(new[0]) == 1
    uncapped = ceil_div(12, 2) * 2
    assert uncapped > cfg.num_blocks - 1  # what an uncapped gate would have charged: more than the pool


def test_all_or_nothing_and_out_of_memory_changes_nothing() -> None:
    state, _ = _admit(bp.initial_state(FULL), 1, list(range(12)))
    with pytest.raises(OutOfMemory, match="needs 3"):
        bp.allocate_slots(state, 2, list(range(100, 112)), 0, 12, bp.get_computed_blocks(state, list(range(100, 112))))
    state2 = bp.free(state, 1)
    assert bp.get_num_free_blocks(state2) == 5


def test_eviction_and_reset() -> None:
    state, _ = _admit(bp.initial_state(FULL), 1, list(range(9)))
    assert state.block_key[1] is not None
    state = bp.evict_blocks(state, [1, 0, 5])
    bp.check_block_pool(state)
    assert state.block_key[1] is None and bp.get_computed_blocks(state, list(range(9))).num_tokens == 0
    state, done = bp.reset_prefix_cache(state)
    assert not done  # blocks in use
    state = bp.free(state, 1)
    state, done = bp.reset_prefix_cache(state)
    assert done and not state.cached and all(k is None for k in state.block_key)


def test_reused_block_leaves_the_prefix_cache() -> None:
    """A cached free block handed out again loses its key (``_maybe_evict_cached_block``): no stale hit."""
    cfg = bp.BlockPoolConfig(block_size=2, num_blocks=4, max_model_len=8)
    state, _ = _admit(bp.initial_state(cfg), 1, [1, 2, 3, 4, 5])
    state = bp.free(state, 1)
    state, _ = _admit(state, 2, [7, 8, 9, 10, 11])
    bp.check_block_pool(state)
    assert bp.get_computed_blocks(state, [1, 2, 3, 4, 5]).num_tokens == 0


@pytest.mark.parametrize(("call", "argument"), [
    (lambda s: bp.evict_blocks(s, [6]), "block_ids"),
    (lambda s: bp.allocate_slots(s, 1, [1, 2, 3], 3, 1), "num_new_tokens"),
    (lambda s: bp.allocate_slots(s, 1, [1, 2, 3], 3, 0), "num_new_tokens"),
    (lambda s: bp.allocate_slots(s, 1, [1, 2, 3], 2, 1), "num_computed_tokens"),
    (lambda s: bp.allocate_slots(s, 9, [1, 2, 3], 1, 1), "num_computed_tokens"),
    (lambda s: bp.allocate_slots(s, 9, [1, 2, 3], 0, 1, bp.Hit(blocks=((1,),), num_tokens=2)), "hit"),
    (lambda s: bp.remove_skipped_blocks(s, 1, 4), "num_computed_tokens"),
    (lambda s: bp.cache_blocks(s, 1, [1, 2, 3], 4), "num_tokens"),
    (lambda s: bp.cache_blocks(s, 9, [1, 2, 3], 1), "req"),
    (lambda s: bp.get_computed_blocks(s, []), "tokens"),
])
def test_misuse_is_a_typed_error_naming_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    state, _ = bp.allocate_slots(bp.initial_state(FULL), 1, [1, 2, 3], 0, 3)
    with pytest.raises(InvalidOperation) as err:
        call(state)
    assert err.value.argument == argument


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="num_blocks"):
        bp.BlockPoolConfig(block_size=4, num_blocks=1, max_model_len=8)
    with pytest.raises(ConfigError, match="max_in_flight_tokens"):
        bp.BlockPoolConfig(block_size=4, num_blocks=4, max_model_len=8, max_in_flight_tokens=2)


def test_the_invariants_catch_a_broken_state() -> None:
    state, _ = _admit(bp.initial_state(FULL), 1, list(range(6)))
    leaked = state.model_copy(update={"free": state.free[1:]})
    with pytest.raises(InvariantViolation, match=r"\[V3\]"):
        bp.check_block_pool(leaked)
    twice = state.model_copy(update={"free": (*state.free, state.free[0])})
    with pytest.raises(InvariantViolation, match="twice"):
        bp.check_block_pool(twice)
    wrong = state.model_copy(update={"content": ((-1, -1, -1, -1),) * 6})
    with pytest.raises(InvariantViolation, match=r"\[V7\]"):
        bp.check_block_pool(wrong)
