"""admission: twins read as numbers, the Z3 budgets are the reference's.

The budget builders of ``kvproof.spec.admission`` are evaluated on concrete integers and compared with
``kvproof.reference.admission`` (sglang_semantics.md §5.2, upstream_0523_vllm_fuzz.md §1.2); the S8 and S9
twins print the numbers the reference's runs show (tests/reference/test_admission.py); every obligation is
named so that ``kvproof prove -k admission.<op>`` selects it, and the module has the shape the registry
collects (``kvproof.spec.collect``), so registering the component later needs no change here.
"""

from __future__ import annotations

import functools
import re

import pytest
import z3
from hypothesis import given
from hypothesis import strategies as st

from kvproof.reference import admission as ad
from kvproof.reference.arith import ceil_p
from kvproof.spec import TEST_BUDGET, Result, collect, run
from kvproof.spec import admission as spec
from kvproof.spec._solver import closed_value as value

NAMES = {ob.name: ob for ob in spec.OBLIGATIONS}


@functools.cache
def result(name: str) -> Result:
    return run(NAMES[name], **TEST_BUDGET)


def test_the_module_has_the_registry_shape() -> None:
    """Names ``admission.<op or round>.<claim>``, twins naming a sound obligation, one per family at least."""
    assert collect({"admission": spec}) == spec.OBLIGATIONS
    ops = {"add_one_req", "swa_budget_for_req", "match_prefix_for_req", "round", "get_new_batch_prefill",
           "add_chunked_req", "prepare_for_extend", "evict", "cache_unfinished_req", "cache_finished_req"}
    for ob in spec.OBLIGATIONS:
        assert ob.name.split(".")[1] in ops, ob.name
        if ob.twin_of is not None:
            assert ob.twin_of in NAMES and NAMES[ob.twin_of].twin_of is None and ob.name.startswith(ob.twin_of + ".")
    sound = {ob.name for ob in spec.OBLIGATIONS if ob.twin_of is None}
    twinned = {ob.twin_of for ob in spec.OBLIGATIONS if ob.twin_of is not None}
    # every sound obligation has a twin (tests/spec/test_registry.py requires it of every component)
    assert sound == twinned


def _numbers(detail: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"\b([A-Za-z_]+)=(-?\d+)", detail)}


def test_every_twin_prints_readable_numbers() -> None:
    for ob in spec.OBLIGATIONS:
        if ob.twin_of is None:
            continue
        detail = result(ob.name).detail
        assert re.search(r"\d", detail) and "div0" not in detail and "mod0" not in detail, detail
        if ob.name.startswith("admission.add_one_req.") and (".a1_" in ob.name or ".live_idle_pool" in ob.name):
            x = _numbers(detail)
            assert {"P", "W", "T", "e", "swa_host_hit_length"} <= x.keys(), (ob.name, detail)
            assert "page size" in detail and "window" in detail and "SWA pool" in detail, detail


def test_s8_twin_prints_the_references_numbers() -> None:
    detail = result("admission.add_one_req.a1_upstream_27391.pre_27391_s8").detail
    assert "pre_27391: page size P=64, window W=128, chunk C=512" in detail
    assert "SWA pool T=10 pages" in detail and "e=2000 (Full host hit 1024 -> e'=976)" in detail
    assert "budget 576 against rem_swa_tokens 640" in detail
    assert "load-back takes 3 pages -> 7 left; the chunk of 512 tokens needs 8 pages" in detail
    # the same numbers through the reference (tests/reference/test_admission.py::test_s8_*)
    assert ad.swa_budget_for_req(2000, 0, window=128, page_size=64, rem_chunk_tokens=512) == 576


def test_s9_twin_prints_the_references_numbers() -> None:
    detail = result("admission.add_one_req.live_idle_pool.upstream_27391_s9").detail
    assert "upstream_27391: page size P=64, window W=128" in detail and "idle SWA pool of T=32 pages" in detail
    assert "swa_host_hit_length=4096" in detail and "budget 4288 >= rem_swa_tokens 2048" in detail
    assert ad.swa_budget_for_req(64, 4096, window=128, page_size=64, rem_chunk_tokens=512) == 4288


def test_a1_twins_admit_and_run_out() -> None:
    for name in ("add_one_req.a1_upstream_27391.pre_27391", "add_one_req.a1_upstream_27391.stale_match",
                 "add_one_req.a1_upstream_0523.stale_match", "add_one_req.a1_corrected.no_lock_recheck",
                 "add_one_req.a1_corrected.uncapped_load_back", "add_one_req.a1_corrected.snapshot_reused"):
        detail = result(f"admission.{name}").detail
        assert ": admitted." in detail and "runs out of SWA" in detail, (name, detail)
    for name in ("add_one_req.a1_upstream_27391.stale_match", "add_one_req.a1_upstream_0523.stale_match"):
        detail = result(f"admission.{name}").detail
        snap = int(re.search(r"swa_host_hit_length=(\d+) at match time", detail).group(1))
        whole = int(re.search(r"load-back restores (\d+) tokens whole", detail).group(1))
        assert whole > snap, detail  # stale: load-back restores more than the match-time value said


# ---- the builders against the reference ------------------------------------------------------


@given(e=st.integers(0, 5000), h=st.integers(0, 5000), w=st.integers(1, 600), p=st.integers(1, 128),
       chunk=st.none() | st.integers(0, 4000))
def test_swa_budget_term(e: int, h: int, w: int, p: int, chunk: int | None) -> None:
    term = spec.swa_budget_term(e, h, w, p, chunk or 0, chunk is not None)
    assert value(term) == ad.swa_budget_for_req(e, h, window=w, page_size=p, rem_chunk_tokens=chunk)


@given(e=st.integers(0, 5000), m=st.integers(0, 600), h=st.integers(0, 5000), w=st.integers(1, 600),
       p=st.integers(1, 128), limit=st.none() | st.integers(0, 4000))
def test_estimate_term(e: int, m: int, h: int, w: int, p: int, limit: int | None) -> None:
    term = spec.estimate_swa_kv_tokens_term(e, m, w, p, limit or 0, limit is not None, h)
    assert value(term) == ad.estimate_swa_kv_tokens(e, m, window=w, page_size=p, allocation_limit=limit,
                                                    host_hit_length=h)


@given(e=st.integers(1, 3000), m=st.integers(0, 300), h_pages=st.integers(0, 40), p=st.sampled_from([1, 2, 16, 64]),
       w=st.integers(1, 300), pages=st.integers(1, 60), remaining=st.integers(-200, 4000),
       limit=st.none() | st.integers(1, 2000))
def test_check_prefill_terms(e: int, m: int, h_pages: int, p: int, w: int, pages: int, remaining: int,
                             limit: int | None) -> None:
    c = ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=pages, policy=ad.AdmissionPolicy.UPSTREAM_0523)
    admit, cap = spec.check_prefill_terms(e, m, h_pages * p, remaining, c.size_swa, w, p, limit or 0,
                                          limit is not None)
    ok, chunk = ad.check_prefill(c, e, m, h_pages * p, remaining, limit)
    assert value(admit) == ok
    if ok and chunk is not None:
        assert value(cap) == chunk


@given(e=st.integers(1, 3000), own=st.integers(0, 20), w=st.integers(1, 300), p=st.sampled_from([1, 4, 64]),
       pages=st.integers(1, 80), chunk=st.none() | st.integers(64, 1000))
def test_fits_empty_pool_term(e: int, own: int, w: int, p: int, pages: int, chunk: int | None) -> None:
    """The reference's ``fits_empty_pool`` on a one-node tree (a device node of ``own`` pages, the request's window)."""
    chunk = None if chunk is None else max(chunk, p)
    nodes = [ad.Node(parent=-1, length=own * p, full_on_device=True, swa=ad.SwaValue.DEVICE)] if own else []
    c = ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=max(pages, own), chunk_size=chunk)
    state, rid = ad.arrive(ad.initial_state(c, nodes), own * p + e, 0, 0 if own else -1)
    walk_own = ad.window_walk(state, state.requests[rid].node).device_pages
    term = spec.fits_empty_pool_term(e, walk_own, w, p, c.swa_pages, chunk or p, chunk is not None)
    assert value(term) == ad.fits_empty_pool(state, rid)
    a = e if chunk is None else min(e, chunk)
    assert ad.fits_empty_pool(state, rid) == (max(a, w) + p + ceil_p(w, p) < (c.swa_pages - walk_own) * p)


@pytest.mark.parametrize(("e", "m", "h", "remaining", "size", "expect"), [
    (976, 16, 192, 640, 640, (True, 320)),  # S8 under 0.5.23: never fits, the chunk cap admits 320 tokens
    (2000, 0, 0, 576, 1024, (False, None)),  # transient shortage: waits
    (2000, 0, 448, 576, 1024, (True, 64)),  # never fits, cap 64: admitted while the smaller request above waits
    (64, 16, 4096, 2048, 2048, (False, None)),  # S9: the whole tombstone leaves no cap
])
def test_check_prefill_terms_escape_hatch(e: int, m: int, h: int, remaining: int, size: int,
                                          expect: tuple[bool, int | None]) -> None:
    """W=128, P=64, rem_chunk 512: the reference and the term agree on the never-fits chunk cap."""
    c = ad.AdmissionConfig(page_size=64, sliding_window=128, swa_pages=size // 64,
                           policy=ad.AdmissionPolicy.UPSTREAM_0523)
    assert ad.check_prefill(c, e, m, h, remaining, 512) == expect
    admit, cap = spec.check_prefill_terms(e, m, h, remaining, size, 128, 64, 512, True)
    assert value(admit) == expect[0] and (not expect[0] or value(cap) == expect[1])


@given(done=st.integers(0, 400), w=st.integers(1, 300), p=st.integers(1, 64))
def test_out_of_window_pages_term(done: int, w: int, p: int) -> None:
    assert value(spec.out_of_window_pages_term(done, w, p)) == ad.out_of_window_pages(done, window=w, page_size=p)


def _concrete(state: ad.AdmissionState) -> spec.State:
    """The model's state of a reference state with an open round (no tree: ``room`` is ``available``)."""
    c, adder = state.config, state.adder
    assert adder is not None
    chunk = c.chunk_size or c.page_size
    return spec.State(*(z3.IntVal(v) for v in (c.page_size, c.sliding_window, c.swa_pages, chunk)),
                      z3.BoolVal(c.chunk_size is not None), z3.IntVal(state.available), z3.IntVal(0), z3.IntVal(0),
                      z3.BoolVal(True), z3.IntVal(adder.rem_swa_token_offset),
                      z3.IntVal(chunk if adder.rem_chunk_tokens is None else adder.rem_chunk_tokens), z3.IntVal(0),
                      z3.BoolVal(False))


@pytest.mark.parametrize("policy", list(spec.Policy))
@given(p=st.sampled_from([1, 2, 4, 64]), w=st.integers(1, 200), pages=st.integers(1, 40),
       done=st.integers(0, 300), rest=st.integers(1, 400), m=st.integers(0, 100), offset=st.integers(0, 300),
       chunk=st.none() | st.integers(1, 600))
def test_continuation_terms(policy: spec.Policy, p: int, w: int, pages: int, done: int, rest: int, m: int,
                            offset: int, chunk: int | None) -> None:
    """``continuation`` against the reference's ``add_chunked_req`` and ``chunk_pages`` on a request with ``done`` own
    tokens (matched at the root) and ``rest`` prompt tokens left, in a round with ``offset`` reserved."""
    chunk = None if chunk is None else max(chunk, p)
    c = ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=pages, chunk_size=chunk,
                           policy=ad.AdmissionPolicy(policy.value))
    req = ad.Request(prompt_len=done + rest, max_new_tokens=m, node=-1, status=ad.ReqStatus.CHUNKED, prefix_len=done)
    state = ad.AdmissionState(config=c, available=pages, requests=(req,),
                              adder=ad.PrefillAdder(rem_swa_token_offset=offset, rem_chunk_tokens=chunk))
    s = _concrete(state)
    a = spec.Action(*(z3.IntVal(v) for v in (rest, 0, m, 0, 0, 0, 0, 0, 0, 0, 0, 0, done)))
    k = spec.continuation(policy, s, a)
    after, outcome = ad.add_chunked_req(state, 0)
    assert (value(k.avail) <= 0) == (outcome is ad.ChunkedResult.DEFERRED)
    if outcome is ad.ChunkedResult.DEFERRED:
        assert after == state
        return
    assert value(k.truncated) == (outcome is ad.ChunkedResult.TRUNCATED)
    assert value(k.new) == after.requests[0].extend_len and value(k.pages) == ad.chunk_pages(after, 0)
    assert after.adder is not None
    assert value(k.reserve) == after.adder.rem_swa_token_offset - offset
