"""admission reference: S8 and S9 as concrete runs, one test per operation, accounting, typed errors.

sglang_semantics.md §5 (the budget, add_one_req, the window walk, load-back), §9 S8 S9;
upstream_0523_vllm_fuzz.md §1.2 (estimate_swa_kv_tokens, SWAPrefillBudget).
"""

from __future__ import annotations

import random

import pytest

from kvproof.reference import admission as ad
from kvproof.reference.errors import ConfigError, InvalidOperation, OutOfMemory

Policy = ad.AdmissionPolicy
HOST, DEVICE, NONE = ad.SwaValue.HOST, ad.SwaValue.DEVICE, ad.SwaValue.NONE
FIXED = (Policy.UPSTREAM_27391, Policy.UPSTREAM_0523, Policy.CORRECTED)


def config(policy: Policy, swa_pages: int, chunk: int | None = 512, *, window: int = 128, page: int = 64
           ) -> ad.AdmissionConfig:
    return ad.AdmissionConfig(page_size=page, sliding_window=window, swa_pages=swa_pages, chunk_size=chunk,
                              policy=policy)


def checked(state: ad.AdmissionState) -> ad.AdmissionState:
    """Accounting (available + evictable + locked == total) and balanced lock refs hold."""
    ad.check_admission(state)
    return state


def admit(state: ad.AdmissionState, rid: int) -> tuple[ad.AdmissionState, ad.AddReqResult]:
    """One round for one request: get_new_batch_prefill, match_prefix_for_req, add_one_req (not prepared)."""
    state = checked(ad.get_new_batch_prefill(state))
    state = checked(ad.match_prefix_for_req(state, rid))
    state, result = ad.add_one_req(state, rid)
    return checked(state), result


# ---- S8 (§5.5, §9 S8) ------------------------------------------------------------------------------


def s8(policy: Policy) -> tuple[ad.AdmissionState, int]:
    """W=128, P=64, chunk 512; prompt 2000 whose first 1024 tokens are on host only, the last 192 of them a host
    SWA tombstone in the window; the SWA pool has 10 free pages (§5.5's "700 free" as whole pages: 640 tokens)."""
    nodes = [ad.Node(parent=-1, length=832, full_on_device=False, swa=NONE),
             ad.Node(parent=0, length=192, full_on_device=False, swa=HOST)]
    state = ad.initial_state(config(policy, swa_pages=10), nodes)
    return ad.arrive(state, 2000, 16, 1)


def test_s8_pre_27391_admits_then_prefill_runs_out_of_swa() -> None:
    state, rid = s8(Policy.PRE_27391)
    state, _ = admit(state, rid)
    # budget max(min(2000, 512), 128) + 64 = 576 < 640: admitted
    assert state.adder is not None and state.adder.can_run == (rid,)
    assert state.requests[rid].match == ad.MatchResult(device_prefix_len=0, host_hit_length=1024,
                                                       swa_host_hit_length=0)
    # load-back allocated and locked the 192-token tombstone: 3 pages, 7 left; the chunk is 512 tokens = 8 pages
    assert state.available == 7 and ad.swa_protected_pages(state) == 3
    assert state.requests[rid].extend_len == 512
    with pytest.raises(OutOfMemory) as err:
        ad.prepare_for_extend(state)
    assert (err.value.op, err.value.pages_needed, err.value.pages_free) == ("prepare_for_extend", 8, 7)


def test_s8_upstream_27391_and_corrected_wait() -> None:
    for policy in (Policy.UPSTREAM_27391, Policy.CORRECTED):
        state, rid = s8(policy)
        before = checked(ad.match_prefix_for_req(ad.get_new_batch_prefill(state), rid))
        after, result = ad.add_one_req(before, rid)
        # 27391: 576 + ceil_64(192) = 768 >= 640; corrected: max(min(976, 512), 128) + 64 + 128 = 704 >= 640
        assert result is ad.AddReqResult.NO_TOKEN and after == before, policy


def test_s8_upstream_0523_takes_the_never_fits_chunk_cap_and_fits() -> None:
    state, rid = s8(Policy.UPSTREAM_0523)
    state, _ = admit(state, rid)
    # needed = 384 + 128 + 64 + 192 = 768 >= size_swa 640 (never fits): cap floor_64(640 - (16 + 64 + 192)) = 320
    assert state.requests[rid].extend_len == 320 and state.available == 7
    state = checked(ad.prepare_for_extend(state))
    assert state.available == 2 and state.requests[rid].status is ad.ReqStatus.RUNNING


# ---- S9 (§5.7, §9 S9) -----------------------------------------------------------------------------


def s9(policy: Policy) -> tuple[ad.AdmissionState, int]:
    """W=128, P=64, an SWA pool of 2048 tokens (32 pages), a 4096-token host tombstone (Full on device) right
    before the request's 64 new tokens."""
    state = ad.initial_state(config(policy, swa_pages=32), [ad.Node(parent=-1, length=4096, full_on_device=True,
                                                                     swa=HOST)])
    return ad.arrive(state, 4160, 16, 0)


@pytest.mark.parametrize("policy", [Policy.UPSTREAM_27391, Policy.UPSTREAM_0523])
def test_s9_upstream_refuses_forever_a_request_that_fits_an_empty_idle_pool(policy: Policy) -> None:
    state, rid = s9(policy)
    assert ad.fits_empty_pool(state, rid)  # 128 + 64 + 128 = 320 < 2048
    for _ in range(5):
        before = state
        state, result = admit(state, rid)
        assert result is ad.AddReqResult.NO_TOKEN and state.adder == ad.PrefillAdder(rem_chunk_tokens=512)
        state = checked(ad.prepare_for_extend(state))
        # nothing changed: every later round sees the same numbers
        assert state.model_copy(update={"requests": before.requests}) == before
        assert state.requests[rid].status is ad.ReqStatus.WAITING


def test_s9_corrected_admits_in_the_first_round_and_restores_one_window() -> None:
    state, rid = s9(Policy.CORRECTED)
    state, result = admit(state, rid)
    assert result is ad.AddReqResult.CONTINUE
    # the tombstone is split: its last 128 tokens restored (2 pages, locked), 3968 stay on host
    assert [(n.length, n.swa, n.lock_ref) for n in state.nodes] == [(128, DEVICE, 1), (3968, HOST, 0)]
    assert state.nodes[0].parent == 1 and ad.path_len(state, 0) == 4096
    state = checked(ad.prepare_for_extend(state))
    assert state.available == 32 - 2 - 1
    state = checked(ad.cache_finished_req(state, rid))
    assert state.available == 30 and ad.swa_evictable_pages(state) == 2  # the restored window stays cached


def test_s9_pre_27391_admits_and_load_back_runs_out() -> None:
    state, rid = s9(Policy.PRE_27391)
    state = ad.match_prefix_for_req(ad.get_new_batch_prefill(state), rid)
    with pytest.raises(OutOfMemory) as err:
        ad.add_one_req(state, rid)
    assert (err.value.op, err.value.pages_needed, err.value.pages_free) == ("init_load_back", 64, 32)


# ---- 0.5.23's selection pin (F5, docs/sglang-findings.md) --------------------------------------------


def host_prefix(policy: Policy) -> tuple[ad.AdmissionState, int]:
    """P=2, W=4, 8 pages, chunk 6: a device node (4 tokens, its SWA on device) above a Full host prefix whose last
    node is a 4-token host tombstone; another device node elsewhere. A request extends the tombstone by 5 tokens."""
    nodes = [ad.Node(parent=-1, length=4, full_on_device=True, swa=DEVICE),
             ad.Node(parent=0, length=2, full_on_device=False, swa=HOST),
             ad.Node(parent=1, length=4, full_on_device=False, swa=HOST),
             ad.Node(parent=-1, length=4, full_on_device=True, swa=DEVICE)]
    state = ad.initial_state(config(policy, swa_pages=8, chunk=6, window=4, page=2), nodes)
    return ad.arrive(state, 15, 0, 2)


def test_upstream_0523_pins_the_last_device_node_and_refuses_forever_what_fits() -> None:
    """The pin protects node 0 (2 pages outside the request's window): 12 tokens left for a 12-token estimate."""
    state, rid = host_prefix(Policy.UPSTREAM_0523)
    assert ad.last_device_node(state, 2) == 0 and ad.window_walk(state, 2).nodes == (2,)
    assert ad.fits_empty_pool(state, rid)
    for _ in range(3):
        before = state
        state, result = admit(state, rid)
        assert result is ad.AddReqResult.NO_TOKEN
        state = checked(ad.prepare_for_extend(state))
        assert state.model_copy(update={"requests": before.requests}) == before  # nothing changed, every round
    # unpinned, the same estimate fits: the reference's other policies admit in the first round
    for policy in (Policy.UPSTREAM_27391, Policy.CORRECTED):
        state, rid = host_prefix(policy)
        state, result = admit(state, rid)
        assert state.requests[rid].status is ad.ReqStatus.ADMITTED, policy
        assert state.requests[rid].locked == (2,) and state.nodes[0].lock_ref == 0  # the pin is gone


def test_upstream_0523_decides_the_chunk_before_loading_back() -> None:
    """A chunk limit below a page: OTHER, and nothing was loaded back (0.5.23 selects before init_load_back)."""
    nodes = [ad.Node(parent=-1, length=2, full_on_device=True, swa=HOST)]
    state = ad.initial_state(config(Policy.UPSTREAM_0523, swa_pages=16, chunk=3, window=4, page=2), nodes)
    state, first = ad.arrive(state, 4, 0, -1)  # 4 tokens: the chunk of 3 takes 2 (rem_chunk 3 -> 1 after ceil 2)
    state, second = ad.arrive(state, 9, 0, 0)
    state = ad.match_prefix_for_req(ad.get_new_batch_prefill(state), first)
    state, result = ad.add_one_req(state, first)
    # a chunk of 2 was admitted; 0.5.23's budget_state goes on (rem_chunk 1 > 0), the next add finds no page
    assert result is ad.AddReqResult.CONTINUE and state.adder is not None and state.adder.rem_chunk_tokens == 1
    state = ad.match_prefix_for_req(state, second)
    after, result = ad.add_one_req(state, second)
    assert result is ad.AddReqResult.OTHER and after == state  # the tombstone of node 0 is still on host
    assert after.nodes[0].swa is HOST


# ---- stale match-time value (§5.7) ------------------------------------------------------------------


def test_a_stale_match_value_lets_upstream_27391_run_out() -> None:
    """W=64, P=64, 6 SWA pages all held by request 1's window (a 384-token device node, evictable); request 0's
    window is a 64-token host tombstone. Both are matched at the round's start (request 1: no host hit);
    request 0's load-back evicts request 1's window, which is a 384-token host tombstone when request 1's
    add_one_req runs with its match-time ``swa_host_hit_length = 0``."""
    outcome = {}
    for policy in (Policy.UPSTREAM_27391, Policy.CORRECTED):
        nodes = [ad.Node(parent=-1, length=384, full_on_device=True, swa=DEVICE),
                 ad.Node(parent=-1, length=64, full_on_device=True, swa=HOST)]
        state = ad.initial_state(config(policy, swa_pages=6, chunk=None, window=64), nodes)
        state, a = ad.arrive(state, 128, 0, 1)
        state, b = ad.arrive(state, 385, 0, 0)
        state = ad.get_new_batch_prefill(state)
        state = ad.match_prefix_for_req(ad.match_prefix_for_req(state, a), b)
        assert state.requests[b].match == ad.MatchResult(device_prefix_len=384, host_hit_length=0,
                                                         swa_host_hit_length=0)
        state, first = ad.add_one_req(state, a)  # 64 + 64 + 64 = 192 < 384; load-back evicts node 0
        assert first is ad.AddReqResult.CONTINUE and state.nodes[0].swa is HOST and state.available == 5
        try:
            state, second = ad.add_one_req(state, b)
            checked(ad.prepare_for_extend(state))
            outcome[policy] = second.value
        except OutOfMemory as err:
            outcome[policy] = f"{err.op}: {err.pages_needed} > {err.pages_free}"
    # 27391: 64 + 64 = 128 < 5*64 - 128 = 192 admits; the load-back needs the whole 6-page tombstone.
    # corrected recomputes the host term (one window: 64) under the lock: 192 >= 192 waits.
    assert outcome == {Policy.UPSTREAM_27391: "init_load_back: 6 > 5", Policy.CORRECTED: "no_token"}


# ---- operations --------------------------------------------------------------------------------------


def test_swa_budget_for_req_and_estimate() -> None:
    assert ad.swa_budget_for_req(2000, 0, window=128, page_size=64, rem_chunk_tokens=512) == 576
    assert ad.swa_budget_for_req(2000, 192, window=128, page_size=64, rem_chunk_tokens=512) == 768
    assert ad.swa_budget_for_req(10, 1, window=128, page_size=64, rem_chunk_tokens=None) == 128 + 64 + 64
    assert ad.estimate_swa_kv_tokens(1024, 16, window=128, page_size=64, allocation_limit=512,
                                     host_hit_length=192) == 384 + 128 + 64 + 192
    assert ad.estimate_swa_kv_tokens(64, 0, window=128, page_size=64) == 0 + 64 + 64


def test_check_prefill_escape_hatch_only_for_never_fits() -> None:
    c = config(Policy.UPSTREAM_0523, swa_pages=16)  # size_swa 1024
    assert ad.check_prefill(c, 64, 0, 0, 200, 512) == (True, 512)  # needed 0 + 64 + 64 = 128 < 200
    # a transient shortage waits: needed 384 + 128 + 64 = 576 >= 576, below size_swa
    assert ad.check_prefill(c, 2000, 0, 0, 576, 512) == (False, None)
    # a request that never fits (576 + 448 = 1024 >= size_swa) gets floor_64(576 - (64 + 448)) = 64 tokens:
    # admission is not monotone under 0.5.23 (the bigger request runs, the smaller waits)
    assert ad.check_prefill(c, 2000, 0, 448, 576, 512) == (True, 64)
    assert ad.check_prefill(c, 2000, 0, 448, 512, 512) == (False, None)  # cap 0
    assert ad.check_prefill(c, 2000, 0, 448, 576, None) == (False, None)  # no chunking: no cap


def test_update_prefill_budget_reserves_without_the_host_term() -> None:
    adder = ad.PrefillAdder(rem_chunk_tokens=512)
    c = config(Policy.UPSTREAM_27391, swa_pages=16)
    out = ad.update_prefill_budget(adder, c, 100, 7)  # ceil_64(100) = 128 -> max(128, 128) + 64
    assert (out.rem_swa_token_offset, out.rem_chunk_tokens) == (192, 384)
    c523 = config(Policy.UPSTREAM_0523, swa_pages=16)
    out = ad.update_prefill_budget(adder, c523, 512, 0)  # estimate(512, 0, L=512) = 384 + 128 + 64
    assert (out.rem_swa_token_offset, out.rem_chunk_tokens) == (576, 0)
    assert ad.update_prefill_budget(ad.PrefillAdder(), c, 100, 0).rem_chunk_tokens is None


def test_needs_host_load_back_a3() -> None:
    assert not ad.needs_host_load_back(ad.MatchResult(device_prefix_len=64, host_hit_length=0, swa_host_hit_length=0))
    assert ad.needs_host_load_back(ad.MatchResult(device_prefix_len=64, host_hit_length=0, swa_host_hit_length=64))
    assert ad.needs_host_load_back(ad.MatchResult(device_prefix_len=0, host_hit_length=64, swa_host_hit_length=0))


def test_pre_27391_match_sets_the_host_hit_flag() -> None:
    """§5.5: before the fix a pure SWA host hit showed up as ``host_hit_length = 1``."""
    state = ad.initial_state(config(Policy.PRE_27391, swa_pages=8), [ad.Node(parent=-1, length=128,
                                                                               full_on_device=True, swa=HOST)])
    state, rid = ad.arrive(state, 200, 0, 0)
    state = ad.match_prefix_for_req(state, rid)
    assert state.requests[rid].match == ad.MatchResult(device_prefix_len=128, host_hit_length=1,
                                                       swa_host_hit_length=0)


def tree() -> list[ad.Node]:
    """root - 0 (device 128) - 1 (host 192) - 2 (device 64); 0 - 3 (none 64): W=128 walks from 2: 2, 1."""
    return [ad.Node(parent=-1, length=128, full_on_device=True, swa=DEVICE),
            ad.Node(parent=0, length=192, full_on_device=True, swa=HOST),
            ad.Node(parent=1, length=64, full_on_device=True, swa=DEVICE),
            ad.Node(parent=0, length=64, full_on_device=True, swa=NONE)]


def test_window_walk_counts_whole_and_capped() -> None:
    state = ad.initial_state(config(Policy.CORRECTED, swa_pages=8), tree())
    walk = ad.window_walk(state, 2)
    assert (walk.nodes, walk.covered, walk.device_pages, walk.host_tokens, walk.capped_tokens) == ((2, 1), 256, 1,
                                                                                                   192, 64)
    assert walk.restores == ((1, 64),) and not walk.stopped
    assert ad.window_walk(state, 3).stopped and ad.window_walk(state, -1).nodes == ()
    assert ad.path_len(state, 2) == 384 and state.available == 8 - 3


def test_inc_dec_lock_ref_move_pages_between_evictable_and_protected() -> None:
    state = ad.initial_state(config(Policy.CORRECTED, swa_pages=8), tree())
    locked, held = ad.inc_lock_ref(state, 2)
    assert held == (2, 1) and ad.swa_protected_pages(locked) == 1 and ad.swa_evictable_pages(locked) == 2
    assert ad.dec_lock_ref(locked, held) == state
    with pytest.raises(InvalidOperation, match="not locked"):
        ad.dec_lock_ref(state, held)
    with pytest.raises(InvalidOperation, match="out of range"):
        ad.inc_lock_ref(state, 9)


def test_evict_tombstones_unlocked_nodes_in_order_and_keeps_a_host_copy() -> None:
    state = ad.initial_state(config(Policy.CORRECTED, swa_pages=8), tree())
    locked, _ = ad.inc_lock_ref(state, 2)
    out = ad.evict(locked, 1)  # node 0 (2 pages, whole) goes first
    assert [n.swa for n in out.nodes] == [HOST, HOST, DEVICE, NONE] and out.available == 7
    assert ad.evict(locked, 10).available == 7  # node 2 is locked: best effort
    assert checked(ad.evict(state, 10)).available == 8
    with pytest.raises(InvalidOperation):
        ad.evict(state, -1)


def test_init_load_back_needs_the_lock_and_rolls_back_when_short() -> None:
    state = ad.initial_state(config(Policy.UPSTREAM_27391, swa_pages=5), tree())
    state, rid = ad.arrive(state, 400, 0, 2)
    with pytest.raises(InvalidOperation, match="window lock"):
        ad.init_load_back(state, rid)
    locked, held = ad.inc_lock_ref(state, 2)
    locked = locked.model_copy(update={"requests": (state.requests[rid].model_copy(update={"locked": held}),)})
    loaded, pages = ad.init_load_back(locked, rid)  # whole node: 3 pages; 2 free, so node 0 (2 pages) is evicted
    assert pages == 3 and loaded.available == 1 and loaded.nodes[0].swa is HOST
    assert loaded.nodes[1].swa is DEVICE and ad.swa_protected_pages(loaded) == 4
    checked(loaded)
    short = locked.model_copy(update={"available": 0})  # 0 free + 2 evictable < 3
    with pytest.raises(OutOfMemory) as err:
        ad.init_load_back(short, rid)
    assert (err.value.pages_needed, err.value.pages_free) == (3, 2)


def test_add_one_req_misuse_is_typed_and_changes_nothing() -> None:
    state, rid = s8(Policy.CORRECTED)
    with pytest.raises(InvalidOperation, match="no round is open"):
        ad.add_one_req(state, rid)
    opened = ad.get_new_batch_prefill(state)
    with pytest.raises(InvalidOperation, match="already open"):
        ad.get_new_batch_prefill(opened)
    with pytest.raises(InvalidOperation, match="no match"):
        ad.add_one_req(opened, rid)
    with pytest.raises(InvalidOperation, match="out of range"):
        ad.add_one_req(opened, 7)
    with pytest.raises(InvalidOperation, match="not running"):
        ad.cache_finished_req(opened, rid)
    with pytest.raises(InvalidOperation, match="no round is open"):
        ad.prepare_for_extend(state)


def test_arrive_validates() -> None:
    state = ad.initial_state(config(Policy.CORRECTED, swa_pages=8), tree())
    with pytest.raises(InvalidOperation, match="nothing to extend"):
        ad.arrive(state, 384, 0, 2)
    with pytest.raises(InvalidOperation, match="neither device nor host"):
        ad.arrive(state, 500, 0, 3)
    with pytest.raises(InvalidOperation, match="max_new_tokens"):
        ad.arrive(state, 500, -1, 2)


def test_config_and_tree_errors() -> None:
    with pytest.raises(ConfigError, match="chunk_size"):
        config(Policy.CORRECTED, swa_pages=8, chunk=32)
    with pytest.raises(ConfigError, match="exceeds the pool"):
        ad.initial_state(config(Policy.CORRECTED, swa_pages=1), tree())
    with pytest.raises(ConfigError, match="multiple of page_size"):
        ad.initial_state(config(Policy.CORRECTED, swa_pages=8), [ad.Node(parent=-1, length=10, full_on_device=True,
                                                                          swa=DEVICE)])
    with pytest.raises(ConfigError, match="without Full KV"):
        ad.initial_state(config(Policy.CORRECTED, swa_pages=8), [ad.Node(parent=-1, length=64,
                                                                          full_on_device=False, swa=DEVICE)])


# ---- accounting over random runs --------------------------------------------------------------------


def random_run(policy: Policy, seed: int, steps: int = 40) -> tuple[int, int]:
    """Random trees, arrivals, rounds, evictions and completions; every step keeps the accounting and the lock
    refs; returns (admitted, out-of-memory) counts. A failed call changes nothing."""
    rng = random.Random(seed)
    page, window = rng.choice((1, 2, 4)), rng.randint(1, 8)
    nodes = random_tree(rng, page, max_pages=4)
    used = sum(n.length // page for n in nodes if n.swa is DEVICE)
    c = ad.AdmissionConfig(page_size=page, sliding_window=window, swa_pages=used + rng.randint(24, 64) // page,
                           chunk_size=rng.choice((None, page, 2 * page, 4 * page)), policy=policy)
    state = checked(ad.initial_state(c, nodes))
    admitted = ooms = 0
    for _ in range(steps):
        before = state
        try:
            kind = rng.random()
            if kind < 0.3:
                node = rng.randrange(-1, len(state.nodes))
                state, _ = ad.arrive(state, ad.path_len(state, node) + rng.randint(1, 20), rng.randint(0, 8), node)
            elif kind < 0.8:
                for rid, r in enumerate(state.requests):  # the chunks that ran are cached before the round
                    if r.status is ad.ReqStatus.RUNNING and r.prefix_len + r.extend_len < r.prompt_len:
                        state = checked(ad.cache_unfinished_req(state, rid))
                state = ad.get_new_batch_prefill(state)
                for rid, r in enumerate(state.requests):  # continued first
                    if r.status is ad.ReqStatus.CHUNKED:
                        state, _ = ad.add_chunked_req(state, rid)
                        checked(state)
                for rid, r in enumerate(state.requests):
                    if r.status is ad.ReqStatus.WAITING:
                        state = ad.match_prefix_for_req(state, rid)
                for rid, r in enumerate(state.requests):
                    if r.status is ad.ReqStatus.WAITING and ad.budget_state(state) is not ad.AddReqResult.OTHER:
                        state, res = ad.add_one_req(state, rid)
                        checked(state)
                        if res is not ad.AddReqResult.CONTINUE:
                            break
                admitted += len(state.adder.can_run) if state.adder else 0
                state = ad.prepare_for_extend(state)
            elif kind < 0.9:
                state = ad.evict(state, rng.randint(0, 3))
            else:
                running = [i for i, r in enumerate(state.requests) if r.status is ad.ReqStatus.RUNNING]
                state = ad.cache_finished_req(state, rng.choice(running) if running else 0)  # misuse if prompt left
        except OutOfMemory:
            ooms += 1
            state = before.model_copy(update={"adder": None})  # the round is abandoned
        except InvalidOperation:
            state = before
        checked(state)
    return admitted, ooms


@pytest.mark.parametrize("policy", list(Policy))
def test_accounting_and_lock_refs_hold_on_random_runs(policy: Policy) -> None:
    totals = [random_run(policy, seed) for seed in range(40)]
    assert sum(a for a, _ in totals) > 40, totals
    if policy is Policy.CORRECTED:
        assert all(o == 0 for _, o in totals), "corrected never runs out after admission"


def test_a_request_without_a_match_is_admitted_and_finishes() -> None:
    """Best-match node -1 (the root): nothing to lock or load; the whole prompt is one chunk."""
    state = ad.initial_state(config(Policy.CORRECTED, swa_pages=8, chunk=None))
    state, rid = ad.arrive(state, 100, 4, -1)
    state, result = admit(state, rid)
    assert result is ad.AddReqResult.CONTINUE and state.requests[rid].locked == ()
    state = checked(ad.prepare_for_extend(state))
    assert state.available == 8 - 2
    assert checked(ad.cache_finished_req(state, rid)).available == 8


def random_tree(rng: random.Random, page: int, max_pages: int = 12) -> list[ad.Node]:
    """Up to 6 nodes of 1 to ``max_pages`` pages: Full on device or host, SWA on device, on host or neither."""
    nodes: list[ad.Node] = []
    for i in range(rng.randint(1, 6)):
        parent = rng.randrange(-1, i)
        full = rng.random() < 0.8 and (parent == -1 or nodes[parent].full_on_device)
        swa = rng.choice((DEVICE, HOST, HOST, NONE)) if full else rng.choice((HOST, NONE))
        nodes.append(ad.Node(parent=parent, length=page * rng.randint(1, max_pages), full_on_device=full, swa=swa))
    return nodes


def first_round_admits(seed: int, policy: Policy) -> bool | None:
    """A random idle pool and a request that fits it (``fits_empty_pool``; None when the draw does not): is the
    request admitted by its first ``add_one_req`` (and its chunk allocated)?"""
    rng = random.Random(seed)
    page, window = rng.choice((1, 2, 4, 8)), rng.randint(1, 24)
    nodes = random_tree(rng, page)
    used = sum(n.length // page for n in nodes if n.swa is DEVICE)
    c = ad.AdmissionConfig(page_size=page, sliding_window=window, swa_pages=used + rng.randint(1, 60) // page + 1,
                           chunk_size=rng.choice((None, page, 3 * page + 1, 16 * page)), policy=policy)
    state = ad.initial_state(c, nodes)
    node = rng.randrange(-1, len(nodes))
    try:
        state, rid = ad.arrive(state, ad.path_len(state, node) + rng.randint(1, 80), rng.randint(0, 9), node)
    except InvalidOperation:
        return None  # a boundary the SWA validator rejects
    if not ad.fits_empty_pool(state, rid):
        return None
    try:
        state, _ = admit(state, rid)
        checked(ad.prepare_for_extend(state))
    except OutOfMemory:
        return False
    return state.requests[rid].status is ad.ReqStatus.ADMITTED or rid in (state.adder.can_run if state.adder else ())


def test_corrected_admits_in_the_first_round_what_fits_an_empty_idle_pool() -> None:
    """The liveness obligation (``admission.add_one_req.live_idle_pool``) on the reference: in an idle pool (no lock,
    nothing held) a request with ``fits_empty_pool`` is admitted by its first ``add_one_req`` under ``corrected``;
    upstream_27391 refuses some of the same requests (whole host tombstones in its budget)."""
    corrected = [first_round_admits(seed, Policy.CORRECTED) for seed in range(300)]
    assert corrected.count(True) >= 80 and False not in corrected
    upstream = [first_round_admits(seed, Policy.UPSTREAM_27391) for seed in range(300)]
    assert upstream.count(False) >= 5, upstream.count(False)


def test_misuse_and_out_of_memory_leave_the_state_as_it_was() -> None:
    """Operations are pure: a typed error leaves the caller's state value intact (frozen, equal to a deep copy)."""
    state, rid = s8(Policy.PRE_27391)
    state, _ = admit(state, rid)
    before = state.model_copy(deep=True)
    with pytest.raises(OutOfMemory):
        ad.prepare_for_extend(state)
    with pytest.raises(InvalidOperation):
        ad.add_one_req(state, rid)  # not waiting any more
    with pytest.raises(InvalidOperation):
        ad.evict(state, -2)
    assert state == before
    checked(state)
    with pytest.raises(ValueError, match="frozen"):
        state.available = 0  # type: ignore[misc]


# ---- chunked prefill continued (§5.3, last paragraph; upstream_0523_vllm_fuzz.md §1.2) ------------------------


def chunked_state(policy: Policy, *, pages: int = 12, chunk: int = 10, prompt: int = 38, max_new: int = 2
                  ) -> tuple[ad.AdmissionState, int]:
    """P=4, W=8, an 8-token device prefix; a request admitted as its first chunk (8 tokens, page-floored), run and
    cached: CHUNKED with 8 own tokens."""
    c = config(policy, swa_pages=pages, chunk=chunk, window=8, page=4)
    state = ad.initial_state(c, [ad.Node(parent=-1, length=8, full_on_device=True, swa=DEVICE)])
    state, rid = ad.arrive(state, prompt, max_new, 0)
    state, result = admit(state, rid)
    # 0.5.23's budget_state does not stop at a chunked request (rem_chunk 2 > 0 left)
    want = ad.AddReqResult.CONTINUE if policy is Policy.UPSTREAM_0523 else ad.AddReqResult.OTHER
    assert result is want and state.adder is not None and state.adder.new_chunked_req == rid
    state = checked(ad.prepare_for_extend(state))
    return checked(ad.cache_unfinished_req(state, rid)), rid


def test_out_of_window_pages_and_chunk_pages() -> None:
    """Pages wholly below done - W: max(0, floor((done - W) / P)); a chunk's pages past the last partly filled one."""
    assert [ad.out_of_window_pages(d, window=8, page_size=4) for d in (0, 8, 11, 12, 18, 28)] == [0, 0, 0, 1, 2, 5]
    state, rid = chunked_state(Policy.CORRECTED)
    assert ad.own_len(state, rid) == 8
    state, _ = ad.add_chunked_req(ad.get_new_batch_prefill(state), rid)
    assert state.requests[rid].extend_len == 10 and ad.chunk_pages(state, rid) == 3  # ceil(18/4) - ceil(8/4)


@pytest.mark.parametrize("policy", list(Policy))
def test_a_chunked_request_is_continued_chunk_by_chunk(policy: Policy) -> None:
    """Chunks 8, 10, 10, 2 of a 30-token extend: each continuation reserves like update_prefill_budget, takes the
    pages past its partly filled one; each cache frees the pages of own tokens wholly below done - W."""
    state, rid = chunked_state(policy)
    assert (state.requests[rid].status, state.requests[rid].prefix_len, state.requests[rid].swa_pages,
            state.available) == (ad.ReqStatus.CHUNKED, 16, 2, 8)
    seen = []
    while True:
        state = checked(ad.get_new_batch_prefill(state))
        state, outcome = ad.add_chunked_req(state, rid)
        assert state.adder is not None and state.adder.can_run == (rid,) and state.adder.new_chunked_req is None
        offset, rem_chunk = state.adder.rem_swa_token_offset, state.adder.rem_chunk_tokens
        state = checked(ad.prepare_for_extend(state))
        r = state.requests[rid]
        seen.append((outcome, r.extend_len, r.swa_pages, offset, rem_chunk))
        if outcome is ad.ChunkedResult.LAST:
            break
        state = checked(ad.cache_unfinished_req(state, rid))
    # a truncated chunk reserves ceil_P(10) = 12 tokens with m = 0: max(min(12, 10), 8) + 4 = 14 (0.5.23:
    # max(10 - 8, 0) + min(12, 8) + 4 = 14); the last, 2 tokens: max(4, 8) + 4 = 12 (0.5.23 with m = 2:
    # 0 + min(6, 8) + 4 = 10)
    last = 10 if policy is Policy.UPSTREAM_0523 else 12
    assert seen == [(ad.ChunkedResult.TRUNCATED, 10, 5, 14, -2), (ad.ChunkedResult.TRUNCATED, 10, 5, 14, -2),
                    (ad.ChunkedResult.LAST, 2, 3, last, 6)]
    state = checked(ad.cache_finished_req(state, rid))
    assert state.available == 10 and state.nodes[0].lock_ref == 0  # the window lock was kept until completion


def test_add_chunked_req_defers_when_no_page_would_be_left() -> None:
    """6 pages: the locked prefix and the request's own 2 leave 2 (8 tokens); with 4 reserved before it, avail =
    min(rem_chunk, 4 - 4) = 0: deferred, unchanged."""
    state, rid = chunked_state(Policy.CORRECTED, pages=6, chunk=8, prompt=28)
    state = ad.get_new_batch_prefill(state)
    state = state.model_copy(update={"adder": state.adder.model_copy(update={"rem_swa_token_offset": 4})})
    assert ad.rem_swa_tokens(state) == 4
    after, outcome = ad.add_chunked_req(state, rid)
    assert outcome is ad.ChunkedResult.DEFERRED and after == state
    # one more token of room: a 1-token chunk, not page-floored (0.5.23), taking 1 page past the 2 it holds
    roomier = state.model_copy(update={"adder": state.adder.model_copy(update={"rem_swa_token_offset": 3})})
    after, outcome = ad.add_chunked_req(roomier, rid)
    assert outcome is ad.ChunkedResult.TRUNCATED and after.requests[rid].extend_len == 1
    assert ad.chunk_pages(after, rid) == 1


def test_chunk_misuse_is_typed_and_changes_nothing() -> None:
    state, rid = chunked_state(Policy.CORRECTED)
    before = state.model_copy(deep=True)
    with pytest.raises(InvalidOperation, match="no round is open"):
        ad.add_chunked_req(state, rid)
    with pytest.raises(InvalidOperation, match="not running"):
        ad.cache_unfinished_req(state, rid)  # cached once
    with pytest.raises(InvalidOperation, match="not running"):
        ad.cache_finished_req(state, rid)  # chunked: its prompt is not done
    with pytest.raises(InvalidOperation, match="out of range"):
        ad.cache_unfinished_req(state, 3)
    assert state == before
    opened = ad.get_new_batch_prefill(state)
    with_waiting, other = ad.arrive(opened, 20, 0, -1)
    with pytest.raises(InvalidOperation, match="waiting, not chunked"):
        ad.add_chunked_req(with_waiting, other)
    running = checked(ad.prepare_for_extend(ad.add_chunked_req(opened, rid)[0]))
    with pytest.raises(InvalidOperation, match="prompt tokens left"):
        ad.cache_finished_req(running, rid)  # 20 tokens left after the chunk
    with pytest.raises(InvalidOperation, match="round is open"):
        ad.cache_unfinished_req(ad.get_new_batch_prefill(running), rid)
    last = ad.cache_unfinished_req(running, rid)
    last = ad.prepare_for_extend(ad.add_chunked_req(ad.get_new_batch_prefill(last), rid)[0])
    last = ad.prepare_for_extend(ad.add_chunked_req(ad.get_new_batch_prefill(
        ad.cache_unfinished_req(last, rid)), rid)[0])
    with pytest.raises(InvalidOperation, match="whole prompt"):
        ad.cache_unfinished_req(last, rid)
    checked(ad.cache_finished_req(last, rid))
