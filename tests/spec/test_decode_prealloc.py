"""decode_prealloc: the Z3 terms must not drift from the reference, and the D1 counterexample is real.

Each builder of ``kvproof.spec.decode_prealloc`` is evaluated on concrete integers and
compared with ``kvproof.reference.decode_prealloc`` on a real allocator state
(sglang_semantics.md §2.3-§2.5, §1.6). The ``d1_upstream_round`` model and the S2
vector are replayed through the reference's ``pop_preallocated``: admitted, then
``_pre_alloc`` runs out (§9 S2); the same numbers under ``CORRECTED`` do not crash.
"""

from __future__ import annotations

import z3
from hypothesis import given
from hypothesis import strategies as st

from kvproof.reference import decode_prealloc as dp
from kvproof.reference import swa_allocator as sa
from kvproof.reference.arith import ceil_div, floor_p
from kvproof.reference.config import PoolConfig
from kvproof.spec import decode_prealloc as spec
from kvproof.spec import obligations
from kvproof.spec._solver import closed_value as value


@st.composite
def requests(draw: st.DrawFn, rid: int) -> dp.DecodeRequest:
    out = draw(st.integers(1, 40))
    return dp.DecodeRequest(rid=rid, origin_input_len=draw(st.integers(1, 3000)), output_len=out,
                            max_new_tokens=draw(st.integers(out + 1, 6000)))


@st.composite
def situations(draw: st.DrawFn) -> tuple[dp.DecodeNode, sa.SWAAllocatorState, dp.DecodeRequest, int]:
    """A node (policy, R, CLIP, running and retracted requests), pools with some pages taken, a candidate."""
    p = draw(st.integers(2, 64))
    w = draw(st.integers(1, 400))
    swa_pages = draw(st.integers(1, 30))
    full_pages = draw(st.integers(swa_pages, 60))
    allocator = sa.initial_state(PoolConfig(size_full=full_pages * p, size_swa=swa_pages * p, page_size=p,
                                            sliding_window_size=w))
    taken = draw(st.integers(0, swa_pages))  # pages taken in both pools...
    if taken:
        allocator, slots = sa.alloc(allocator, taken * p)
        released = draw(st.integers(0, taken))  # ...of which some gave their SWA side back (eviction)
        if released:
            allocator = sa.free_swa(allocator, list(slots[: released * p]))
    config = dp.DecodeConfig(reserved_decode_tokens=draw(st.integers(0, 600)),
                             clip_max_new_tokens=draw(st.integers(1, 5000)),
                             policy=draw(st.sampled_from(dp.PreallocPolicy)), write_kv=False)
    running = tuple(dp.RunningRequest(**draw(requests(rid)).model_dump(), slots=(), swa_evicted_seqlen=0)
                    for rid in range(draw(st.integers(0, 3))))
    retracted = tuple(draw(requests(10 + rid)) for rid in range(draw(st.integers(0, 2))))
    # model_copy skips validation: the retracted entries carry no CPU copy, which budgets never read
    node = dp.initial_node(config).model_copy(update={"running": running, "retracted": retracted})
    return node, allocator, draw(requests(99)), draw(st.integers(0, 3))


def knobs(node: dp.DecodeNode, allocator: sa.SWAAllocatorState) -> spec.Knobs:
    c = allocator.config
    return spec.Knobs.of(c.page_size, c.sliding_window_size, node.config.reserved_decode_tokens,
                         node.config.clip_max_new_tokens)


def req_terms(r: dp.DecodeRequest) -> spec.Req:
    return spec.Req.of(r.origin_input_len, r.output_len, r.max_new_tokens)


def pools(allocator: sa.SWAAllocatorState) -> spec.Pools:
    p = allocator.config.page_size
    free_full, free_swa = sa.full_available_size(allocator), sa.swa_available_size(allocator)
    assert free_full % p == 0 and free_swa % p == 0
    used = allocator.config.size_swa - free_swa
    return spec.Pools(z3.IntVal(free_full // p), z3.IntVal(free_swa // p), z3.IntVal(used // p))


@given(situations())
def test_lengths_requirements_and_pages(s: tuple[dp.DecodeNode, sa.SWAAllocatorState, dp.DecodeRequest, int]) -> None:
    node, allocator, req, _ = s
    k, r = knobs(node, allocator), req_terms(req)
    a, tail = dp.prealloc_kv_lens(node, allocator, req)
    assert (value(spec.prealloc_kv_lens_terms(k, r)[0]), value(spec.prealloc_kv_lens_terms(k, r)[1])) == (a, tail)
    rounded = node.config.policy is dp.PreallocPolicy.CORRECTED
    full_req, swa_req = spec.required_tokens_terms(k, r, rounded=rounded)
    assert (value(full_req), value(swa_req)) == dp.prealloc_required_tokens(node, allocator, req)
    assert value(spec.swa_retractable_len_term(k, r)) == dp.swa_retractable_len(node, allocator, req)
    p = allocator.config.page_size
    full_pages, swa_pages = spec.prealloc_pages_terms(k, r)
    assert (value(full_pages), value(swa_pages)) == (ceil_div(a, p), ceil_div(tail, p))


@given(situations())
def test_budgets_and_gates(s: tuple[dp.DecodeNode, sa.SWAAllocatorState, dp.DecodeRequest, int]) -> None:
    node, allocator, req, extra = s
    k = knobs(node, allocator)
    rounded = node.config.policy is dp.PreallocPolicy.CORRECTED
    batch = spec.batch_terms(k, [req_terms(r) for r in node.running], [req_terms(r) for r in node.retracted],
                             rounded=rounded)
    for count_retracted, reserve_finish in ((True, True), (False, True), (False, False)):  # pop, -, resume (M1)
        want = dp.allocatable_token_budgets(node, allocator, count_retracted=count_retracted,
                                            extra_reserved_reqs=extra, reserve_finish=reserve_finish)
        got = spec.budgets_terms(k, pools(allocator), batch, extra, count_retracted=count_retracted,
                                 reserve_finish=reserve_finish)
        assert (value(got.full), value(got.swa)) == (want.full, want.swa)
        gate = spec.admission_gate_terms(k, batch, got, req_terms(req), rounded=rounded)
        assert value(gate.admit) == dp.admission_gate(node, allocator, want, req).admit
        resume = spec.resume_gate_terms(k, got, req_terms(req), rounded=rounded)
        full_req, swa_req = dp.prealloc_required_tokens(node, allocator, req)
        assert value(resume.admit) == (full_req <= want.full and swa_req <= (want.swa or 0))
        assert value(resume.admit) == dp.resume_gate(node, allocator, want, req).admit


@given(situations())
def test_a_request_the_corrected_gate_admits_finds_its_swa_tail_free(
        s: tuple[dp.DecodeNode, sa.SWAAllocatorState, dp.DecodeRequest, int]) -> None:
    """0.5.23 reclaims SWA room for an admitted request's tail and aborts it on a shortfall: under ``CORRECTED``, with
    nothing evictable, that never happens (the SWA gate's requirement is at least the page-rounded tail, the SWA
    budget at most the free SWA tokens), in either round, the resume round's budgets with the "can finish" room
    (sglang_semantics.md §2.5's reading) or without it (the code's, and the reference's round since M1)."""
    node, allocator, req, extra = s
    reclaim = dp.reclaim_swa_tail(node, allocator, req)
    assert reclaim.needed % allocator.config.page_size == 0 and reclaim.available == sa.swa_available_size(allocator)
    if node.config.policy is not dp.PreallocPolicy.CORRECTED:
        return
    pop = dp.allocatable_token_budgets(node, allocator, extra_reserved_reqs=extra)
    if dp.admission_gate(node, allocator, pop, req).admit:
        assert reclaim.ready, (pop, reclaim)
    for reserve_finish in (True, False):
        resume = dp.allocatable_token_budgets(node, allocator, count_retracted=False, extra_reserved_reqs=extra,
                                              reserve_finish=reserve_finish)
        if dp.resume_gate(node, allocator, resume, req).admit:
            assert reclaim.ready, (resume, reclaim)


@given(P=st.integers(2, 64), W=st.integers(1, 500), L=st.integers(1, 5000), mark_pages=st.integers(0, 80))
def test_eviction_mark_and_residency_bounds(P: int, W: int, L: int, mark_pages: int) -> None:
    mark = mark_pages * P
    assert value(spec.evict_mark_term(mark, L, W, P)) == floor_p(max(mark, L - 1 - W - P), P)  # _evict_swa
    assert value(spec.resident_low_term(L, W, P)) == floor_p(max(0, L - 1 - W - P), P)  # check_node's D3 bound
    node = dp.initial_node(dp.DecodeConfig())
    allocator = sa.initial_state(PoolConfig(size_full=P, size_swa=P, page_size=P, sliding_window_size=W))
    assert value(spec.resume_tail_start_term(L, W, P)) == L - dp.swa_tail_len(node, allocator, L)


def _pop(values: dict[str, int | bool], policy: dp.PreallocPolicy) -> dp.StepResult:
    p = int(values["P"])
    allocator = sa.initial_state(PoolConfig(size_full=int(values["free_full"]) * p,
                                            size_swa=int(values["free_swa"]) * p, page_size=p,
                                            sliding_window_size=int(values["W"])))
    node = dp.initial_node(dp.DecodeConfig(reserved_decode_tokens=int(values["R"]),
                                           clip_max_new_tokens=int(values["CLIP"]), policy=policy, write_kv=False))
    for i in (1, 2):
        node = dp.arrive(node, i, int(values[f"orig{i}"]), int(values[f"out{i}"]), int(values[f"max_new{i}"]))
    return dp.pop_preallocated(node, allocator)


def _model(name: str) -> z3.ModelRef:
    (ob,) = obligations(name_filter=name)
    solver = z3.Solver()
    solver.add(*ob.build())
    assert solver.check() == z3.sat, name
    return solver.model()


def test_upstream_round_counterexample_crashes_the_reference() -> None:
    """The Z3 model of ``d1_upstream_round`` is a real S2-like run: the reference admits request 2 and crashes."""
    model = _model("decode_prealloc.pop_preallocated.d1_upstream_round")
    values = spec.round_values(model, spec.Policy.UPSTREAM, empty=True)
    assert values["ok1"] and values["admit2"] and not values["swa_ok2"]
    result = _pop(values, dp.PreallocPolicy.UPSTREAM)
    assert result.rids == (1,)
    assert result.crash is not None and result.crash.rid == 2
    assert result.crash.budgets[1] == values["budget2_swa"]
    fixed = _pop(values, dp.PreallocPolicy.CORRECTED)
    assert fixed.crash is None  # the corrected gate stops request 2 instead


def test_s2_vector_matches_the_reference() -> None:
    model = _model("decode_prealloc.pop_preallocated.d1_s2_vector")
    values = spec.round_values(model, spec.Policy.UPSTREAM, empty=True)
    assert (values["budget1_swa"], values["budget2_swa"], values["swa_pages2"]) == (320, 184, 3)
    result = _pop(values, dp.PreallocPolicy.UPSTREAM)
    assert result.crash is not None and result.crash.budgets == (1024, 184)
