"""The torch admission runtime: the reference's decisions, real SWA pages behind them, typed failures."""

from __future__ import annotations

import random

import pytest

from kvproof.gpu_runtime.admission import AdmissionRuntime
from kvproof.reference import admission as ad
from kvproof.reference.admission import AddReqResult, AdmissionPolicy, ChunkedResult, Node, ReqStatus, SwaValue
from kvproof.reference.contract import AdmissionSystemUnderTest
from kvproof.reference.errors import InvalidOperation, OutOfMemory
from kvproof.reference.registry import Component

DEVICE, HOST, NONE = SwaValue.DEVICE, SwaValue.HOST, SwaValue.NONE


def setup(policy: AdmissionPolicy, *, p: int = 64, w: int = 128, pages: int = 10, chunk: int | None = 512,
          nodes: tuple[Node, ...] = ()) -> ad.AdmissionSetup:
    config = ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=pages, chunk_size=chunk, policy=policy)
    return ad.AdmissionSetup(name="t", config=config, nodes=nodes)


def s8_tree() -> tuple[Node, ...]:
    """S8 (sglang_semantics.md §9): a 1024-token Full host hit, a 192-token SWA host tombstone in the window."""
    return (Node(parent=-1, length=832, full_on_device=False, swa=NONE),
            Node(parent=0, length=192, full_on_device=False, swa=HOST))


def admit(rt: AdmissionRuntime, prompt: int, max_new: int, node: int) -> tuple[int, AddReqResult]:
    rid = rt.arrive(prompt, max_new, node)
    rt.get_new_batch_prefill()
    rt.match_prefix_for_req(rid)
    return rid, rt.add_one_req(rid)


def test_declares_its_component_and_meets_the_contract() -> None:
    rt = AdmissionRuntime(setup(AdmissionPolicy.CORRECTED))
    assert AdmissionRuntime.components == frozenset({Component.ADMISSION})
    assert isinstance(rt, AdmissionSystemUnderTest)
    snap = rt.snapshot()
    ad.check_admission_snapshot(snap)
    assert snap.state == ad.initial_state(rt.config)


def test_s8_pre_27391_admits_then_prefill_runs_out(device: str) -> None:
    """S8: budget 576 < 640 admits; load-back takes 3 pages; the 512-token chunk needs 8 of the 7 left."""
    rt = AdmissionRuntime(setup(AdmissionPolicy.PRE_27391, nodes=s8_tree()), device=device)
    rid, result = admit(rt, 2000, 0, 1)
    # admitted; the reservation (576) uses up what the load-back left (7 pages = 448 tokens): no_token next
    assert rt.snapshot().state.requests[rid].status is ReqStatus.ADMITTED and result is AddReqResult.NO_TOKEN
    assert rt.available() == 7  # the load-back's 3 pages are really taken from the SWA pool
    before = rt.snapshot()
    with pytest.raises(OutOfMemory):
        rt.prepare_for_extend()
    assert rt.snapshot() == before


@pytest.mark.parametrize("policy", [AdmissionPolicy.UPSTREAM_27391, AdmissionPolicy.CORRECTED])
def test_s8_the_fixed_budgets_wait(policy: AdmissionPolicy) -> None:
    rt = AdmissionRuntime(setup(policy, nodes=s8_tree()))
    rid, result = admit(rt, 2000, 0, 1)
    assert result is AddReqResult.NO_TOKEN and rt.snapshot().state.requests[rid].status is ReqStatus.WAITING


def test_s9_upstream_refuses_every_round_corrected_admits_and_restores_one_window() -> None:
    tree = (Node(parent=-1, length=4096, full_on_device=True, swa=HOST),)
    up = AdmissionRuntime(setup(AdmissionPolicy.UPSTREAM_27391, pages=32, nodes=tree))
    rid, result = admit(up, 4096 + 256, 0, 0)
    up.prepare_for_extend()
    up.get_new_batch_prefill()
    up.match_prefix_for_req(rid)
    assert (result, up.add_one_req(rid)) == (AddReqResult.NO_TOKEN, AddReqResult.NO_TOKEN)
    cor = AdmissionRuntime(setup(AdmissionPolicy.CORRECTED, pages=32, nodes=tree))
    rid, _ = admit(cor, 4096 + 256, 0, 0)
    cor.prepare_for_extend()
    snap = cor.snapshot()
    ad.check_admission_snapshot(snap)
    # the node is split: 128 tokens (2 pages) restored and locked, the 3968-token rest stays a host tombstone
    assert [(n.length, n.swa, n.lock_ref) for n in snap.state.nodes] == [(128, DEVICE, 1), (3968, HOST, 0)]
    assert snap.state.requests[rid].status is ReqStatus.RUNNING and len(snap.node_pages[0]) == 2
    assert len(snap.request_pages[rid]) == 4 and snap.state.available == 32 - 2 - 4
    cor.cache_finished_req(rid)
    assert cor.snapshot().state.nodes[0].lock_ref == 0 and cor.available() == 30


def test_eviction_frees_the_pages_of_unlocked_nodes_in_order() -> None:
    tree = (Node(parent=-1, length=128, full_on_device=True, swa=DEVICE),
            Node(parent=0, length=64, full_on_device=True, swa=DEVICE),
            Node(parent=-1, length=64, full_on_device=True, swa=DEVICE))
    rt = AdmissionRuntime(setup(AdmissionPolicy.CORRECTED, pages=10, nodes=tree))
    assert rt.available() == 6 and rt.evictable_pages() == 4
    rt.evict(3)  # node 0 (2 pages), then node 1 (1 page): 3 freed, node 2 kept
    snap = rt.snapshot()
    ad.check_admission_snapshot(snap)
    assert [n.swa for n in snap.state.nodes] == [HOST, HOST, DEVICE] and snap.state.available == 9


def test_misuse_is_typed_and_changes_nothing() -> None:
    rt = AdmissionRuntime(setup(AdmissionPolicy.CORRECTED, nodes=s8_tree()))
    rid = rt.arrive(2000, 0, 1)
    before = rt.snapshot()
    for call in (lambda: rt.add_one_req(rid), lambda: rt.prepare_for_extend(), lambda: rt.cache_finished_req(rid),
                 lambda: rt.arrive(100, 0, 1), lambda: rt.arrive(2000, 0, 0), lambda: rt.evict(-1),
                 lambda: rt.match_prefix_for_req(5)):
        with pytest.raises(InvalidOperation):
            call()
        assert rt.snapshot() == before
    rt.get_new_batch_prefill()
    with pytest.raises(InvalidOperation, match="no match"):
        rt.add_one_req(rid)


def _random_run(policy: AdmissionPolicy, seed: int) -> None:
    """Random scheduler steps on the runtime and on the reference: same outcome and state after each."""
    rng = random.Random(seed)
    p, w = rng.choice([1, 2, 4]), rng.choice([2, 3, 4, 6])
    nodes: list[Node] = []
    for i in range(rng.randint(1, 6)):
        parent = rng.choice([-1, *range(i)])
        full = parent == -1 or nodes[parent].full_on_device
        swa = rng.choice([DEVICE, HOST, HOST, NONE]) if full else rng.choice([HOST, NONE])
        nodes.append(Node(parent=parent, length=p * rng.randint(1, 6), full_on_device=full, swa=swa))
    used = sum(n.length // p for n in nodes if n.swa is DEVICE)
    s = setup(policy, p=p, w=w, pages=used + rng.randint(2, 12), chunk=rng.choice([None, 2 * p, 4 * p, 3 * p + 1]),
              nodes=tuple(nodes))
    rt, ref = AdmissionRuntime(s), ad.initial_state(s.config, s.nodes)
    for _ in range(60):
        waiting = [i for i, r in enumerate(ref.requests) if r.status is ReqStatus.WAITING]
        running = [i for i, r in enumerate(ref.requests) if r.status is ReqStatus.RUNNING]
        done = [i for i in running if (r := ref.requests[i]).prefix_len + r.extend_len == r.prompt_len]
        unfinished = [i for i in running if i not in done]
        chunked = [i for i, r in enumerate(ref.requests) if r.status is ReqStatus.CHUNKED]
        op = "cache" if unfinished else rng.choice(["arrive", "round", "evict", "finish"])
        try:
            if op == "arrive":
                node = rng.choice([-1, *range(len(ref.nodes))])
                prompt, m = ad.path_len(ref, node) + rng.randint(1, 4 * w), rng.randint(0, 2 * w)
                ref, _ = ad.arrive(ref, prompt, m, node)
                rt.arrive(prompt, m, node)
            elif op == "cache":  # the chunk ran: cached before the next round, as the scheduler does
                rid = unfinished[0]
                ref = ad.cache_unfinished_req(ref, rid)
                rt.cache_unfinished_req(rid)
            elif op == "round" and (waiting or chunked):
                ref = ad.get_new_batch_prefill(ref)
                rt.get_new_batch_prefill()
                for rid in chunked:  # continued first
                    ref, outcome = ad.add_chunked_req(ref, rid)
                    assert rt.add_chunked_req(rid) is outcome
                for rid in waiting if ad.budget_state(ref) is not AddReqResult.OTHER else ():
                    ref = ad.match_prefix_for_req(ref, rid)
                    rt.match_prefix_for_req(rid)
                    try:
                        ref, want = ad.add_one_req(ref, rid)
                    except OutOfMemory:
                        with pytest.raises(OutOfMemory):
                            rt.add_one_req(rid)
                        break
                    assert rt.add_one_req(rid) is want
                    if want is not AddReqResult.CONTINUE or ref.requests[rid].status is ReqStatus.WAITING:
                        break
                try:
                    ref = ad.prepare_for_extend(ref)
                except OutOfMemory:
                    with pytest.raises(OutOfMemory):
                        rt.prepare_for_extend()
                    return
                rt.prepare_for_extend()
            elif op == "evict":
                k = rng.randint(0, s.config.swa_pages)
                ref = ad.evict(ref, k)
                rt.evict(k)
            elif op == "finish" and done:
                rid = rng.choice(done)
                ref = ad.cache_finished_req(ref, rid)
                rt.cache_finished_req(rid)
        except InvalidOperation:  # an arrival at a node that is no valid boundary: the runtime refuses it too
            with pytest.raises(InvalidOperation):
                rt.arrive(prompt, m, node)
        snap = rt.snapshot()
        ad.check_admission_snapshot(snap)
        assert snap.state == ref


@pytest.mark.parametrize("policy", list(AdmissionPolicy))
def test_agrees_with_the_reference_on_random_runs(policy: AdmissionPolicy) -> None:
    for seed in range(12):
        _random_run(policy, seed)


# ---- chunked prefill continued (§5.3, last paragraph) -------------------------------------------------


def chunked(rt: AdmissionRuntime, prompt: int, node: int = -1, max_new: int = 2) -> int:
    """A request admitted as its first chunk, run and cached (``CHUNKED``)."""
    rid, _ = admit(rt, prompt, max_new, node)
    rt.prepare_for_extend()
    rt.cache_unfinished_req(rid)
    return rid


def test_a_chunked_request_continues_with_unaligned_chunks_and_frees_out_of_window_pages(device: str) -> None:
    """P=4, W=8, chunk 10, 12 pages, an 8-token device prefix: chunks of 8 (page-floored), 10, 10 and the last 2;
    each continuation takes the pages past its last partly filled one, each cache frees floor((done - W) / P)."""
    tree = (Node(parent=-1, length=8, full_on_device=True, swa=DEVICE),)
    rt = AdmissionRuntime(setup(AdmissionPolicy.CORRECTED, p=4, w=8, pages=12, chunk=10, nodes=tree), device=device)
    rid = chunked(rt, 8 + 30, node=0)
    ref = rt.snapshot().state.requests[rid]
    assert (ref.status, ref.prefix_len, ref.swa_pages) == (ReqStatus.CHUNKED, 16, 2)  # done 8: nothing freed
    seen = []
    for _ in range(3):
        rt.get_new_batch_prefill()
        outcome = rt.add_chunked_req(rid)
        rt.prepare_for_extend()
        snap = rt.snapshot()
        ad.check_admission_snapshot(snap)
        ad.check_admission(snap.state)
        seen.append((outcome, snap.state.requests[rid].extend_len, snap.state.requests[rid].swa_pages))
        if outcome is ChunkedResult.LAST:
            break
        rt.cache_unfinished_req(rid)
    # done 8 -> 18: 3 pages (5 in all); cached at 18: 2 freed; 18 -> 28: 2 pages; cached at 28: 3 freed; 28 -> 30: 1
    assert seen == [(ChunkedResult.TRUNCATED, 10, 5), (ChunkedResult.TRUNCATED, 10, 5), (ChunkedResult.LAST, 2, 3)]
    rt.cache_finished_req(rid)
    assert rt.available() == 10 and rt.snapshot().state.nodes[0].lock_ref == 0


def test_a_continuation_is_deferred_when_no_page_would_be_left() -> None:
    """P=4, W=8, chunk 8, 6 pages; the chunked request holds 2 pages (done 8: nothing out of the window). A request
    added before it in the round (the operation allows that order) reserves max(4, 8) + 4 = 12 of the 16 tokens
    left: avail = min(4, 4 - 4) = 0, deferred, nothing changes; after that request finished it continues."""
    rt = AdmissionRuntime(setup(AdmissionPolicy.CORRECTED, p=4, w=8, pages=6, chunk=8))
    rid = chunked(rt, 20, max_new=0)
    other = rt.arrive(4, 0, -1)
    rt.get_new_batch_prefill()
    rt.match_prefix_for_req(other)
    assert rt.add_one_req(other) is AddReqResult.CONTINUE
    before = rt.snapshot()
    assert rt.add_chunked_req(rid) is ChunkedResult.DEFERRED and rt.snapshot() == before
    rt.prepare_for_extend()
    rt.cache_finished_req(other)
    rt.get_new_batch_prefill()
    assert rt.add_chunked_req(rid) is ChunkedResult.TRUNCATED  # min(8, 16 - 4): 8 of the 12 left
    assert rt.snapshot().state.requests[rid].extend_len == 8


def test_chunk_misuse_is_typed_and_changes_nothing() -> None:
    rt = AdmissionRuntime(setup(AdmissionPolicy.CORRECTED, p=4, w=8, pages=12, chunk=8))
    rid, _ = admit(rt, 20, 0, -1)
    rt.prepare_for_extend()  # running with 12 tokens left
    before = rt.snapshot()
    for call in (lambda: rt.cache_finished_req(rid),  # prompt left: not finished
                 lambda: rt.add_chunked_req(rid),  # no round open
                 lambda: rt.cache_unfinished_req(7)):
        with pytest.raises(InvalidOperation):
            call()
        assert rt.snapshot() == before
    rt.get_new_batch_prefill()
    with pytest.raises(InvalidOperation, match="round is open"):
        rt.cache_unfinished_req(rid)  # the chunk's forward runs between rounds
    with pytest.raises(InvalidOperation, match="not chunked"):
        rt.add_chunked_req(rid)  # running, not cached yet
    rt.prepare_for_extend()
    rt.cache_unfinished_req(rid)
    with pytest.raises(InvalidOperation, match="not running"):
        rt.cache_unfinished_req(rid)  # cached once
    short = rt.arrive(3, 0, -1)
    rt.get_new_batch_prefill()
    rt.match_prefix_for_req(short)
    rt.add_one_req(short)
    rt.prepare_for_extend()
    with pytest.raises(InvalidOperation, match="whole prompt"):
        rt.cache_unfinished_req(short)
