"""The ``admission`` mutants: each is killed by the scheduler suite, for the reason it was written, and, where the
mistake is arithmetic, the Z3 twin that catches the same mistake exists.

Two checks per mutant, as for ``decode_prealloc``: the kill (``kill_mutants`` under the ``ci`` profile, the suite's
default configs) must name the divergence the bug causes, and a short hand-written call sequence (the ``Differs:``
of its docstring) shows the intended difference against the unmutated runtime.
"""

from __future__ import annotations

import functools
import re

import pytest

from kvproof import spec
from kvproof.conformance.check import MutantVerdict, kill_mutants, mutants_of
from kvproof.conformance.mutants.admission import MUTANTS
from kvproof.gpu_runtime.admission import AdmissionRuntime
from kvproof.reference import admission as ad
from kvproof.reference.admission import AddReqResult, AdmissionPolicy, ChunkedResult, Node, ReqStatus, SwaValue
from kvproof.reference.errors import OutOfMemory

DEVICE, HOST = SwaValue.DEVICE, SwaValue.HOST
DECISION = r"^add_one_req admitted request \d+ .* the reference refused it \(the admission decision differs\)$"
#: What the kill's evidence line must say, per mutant.
EVIDENCE: dict[str, str] = {
    "budget_without_host_term": DECISION,
    "admits_at_equality": DECISION,
    "no_lock_recheck": DECISION,
    "host_hit_not_page_rounded": DECISION,
    # a stale term errs either way: too small (a tree evicted since the match) or too big (restored since)
    "stale_match_value": r"^add_one_req (admitted|refused) request \d+ .* the reference (refused|admitted) it \(the "
                         r"admission decision differs\)$",
    # the restored node is not locked
    "load_back_without_lock": r"^tree node \d+: .*lock_ref 0; reference .*lock_ref 1$",
    # whole tombstones restored: more pages taken than the reference's capped restore
    "uncapped_load_back": r"^available SWA pages (\d+), reference (\d+)$|^add_one_req raised OutOfMemory",
    # the reservation counts the host term again
    "reserve_counts_host_term": r"^prefill adder rem_swa_token_offset=(\d+) .*, reference rem_swa_token_offset=(\d+)",
    # the finished request's window stays locked
    "finish_keeps_lock": r"^tree node \d+: .*lock_ref (\d+); reference .*lock_ref (\d+)$",
    # the continuation takes the page #23174 leaves: a bigger chunk, or one where the reference defers
    "continuation_without_page": r"^add_chunked_req added a chunk of (\d+) tokens for request \d+ .*; the reference "
                                 r"(added a chunk of (\d+) tokens|deferred it) \(available_chunk_tokens",
    # a page of the window freed: fewer pages kept
    "release_frees_in_window_page": r"^after cache_unfinished_req request \d+ holds (\d+) SWA pages, the reference "
                                    r"(\d+): of its \d+ own tokens",
    # whole new pages: more than the pages past the partly filled one
    "continuation_whole_new_pages": r"^after prepare_for_extend request \d+ holds (\d+) SWA pages, the reference "
                                    r"(\d+): its chunk of \d+ tokens after \d+ own",
    # the continuation's chunk not reserved
    "continuation_not_reserved": r"^prefill adder rem_swa_token_offset=(\d+) .*, reference "
                                 r"rem_swa_token_offset=(\d+)",
}
#: The Z3 twins that catch the arithmetic mistakes (``kvproof prove -k <name>``: a counterexample each).
Z3_TWINS: dict[str, tuple[str, ...]] = {
    "budget_without_host_term": ("admission.add_one_req.a1_upstream_27391.pre_27391",
                                 "admission.add_one_req.a1_upstream_27391_minimal.no_host_term"),
    "no_lock_recheck": ("admission.add_one_req.a1_corrected.no_lock_recheck",),
    "stale_match_value": ("admission.add_one_req.a1_corrected.snapshot_reused",),
    "uncapped_load_back": ("admission.add_one_req.a1_corrected.uncapped_load_back",),
    "continuation_without_page": ("admission.add_chunked_req.a1.no_page_left",),
    "release_frees_in_window_page": ("admission.cache_unfinished_req.frees_out_of_window_only.in_window_page",),
    "continuation_whole_new_pages": ("admission.prepare_for_extend.continuation_pages_exact.whole_new_pages",),
    "continuation_not_reserved": ("admission.add_chunked_req.keeps_round_invariant.no_reservation",),
}
#: Arithmetic mistakes no A1 twin can catch, and the obligation that says why.
NO_A1_TWIN = {"admits_at_equality": "admission.add_one_req.a1_upstream_27391_minimal"}


def test_registered_under_admission() -> None:
    assert mutants_of("admission") is MUTANTS
    assert len(MUTANTS) >= 6
    assert set(EVIDENCE) == set(MUTANTS)


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_documents_its_bug(name: str) -> None:
    doc = MUTANTS[name].__doc__ or ""
    assert re.search(r"§\d+\.\d+", doc), f"{name}: the docstring names no section"
    assert "Differs:" in doc, f"{name} docstring gives no differing call sequence"
    for twin in Z3_TWINS.get(name, ()):
        assert twin.removeprefix("admission.") in doc or twin in doc, f"{name} docstring does not name {twin}"


@pytest.mark.parametrize("name", sorted(Z3_TWINS))
def test_arithmetic_mutants_have_a_z3_twin(name: str) -> None:
    names = {ob.name: ob for ob in spec.obligations("admission")}
    for twin in Z3_TWINS[name]:
        assert twin in names and names[twin].twin_of is not None, twin
    for _, proved in NO_A1_TWIN.items():
        assert proved in names and names[proved].twin_of is None


# ---------------------------------------------------------------- killed by the suite, for the right reason


@functools.cache
def kill(name: str) -> MutantVerdict:
    """One mutant against the admission suite (``ci`` profile, default configs, ``corrected``), once per session."""
    (verdict,) = kill_mutants({name: MUTANTS[name]}, component="admission", profile="ci", policy="corrected")
    return verdict


@pytest.mark.parametrize("name", sorted(MUTANTS))
def test_mutant_is_killed(name: str) -> None:
    verdict = kill(name)
    assert verdict.killed, f"mutant {name} survived the admission suite (ci profile) on every config"
    assert "HarnessError" not in verdict.evidence and "crashed" not in verdict.evidence, verdict.evidence
    found = re.search(EVIDENCE[name], verdict.evidence)
    assert found, f"{name} was killed for another reason than its bug: {verdict.evidence}"
    if name in ("reserve_counts_host_term", "continuation_whole_new_pages"):
        assert int(found.group(1)) > int(found.group(2)), verdict.evidence
    if name == "finish_keeps_lock":  # one lock more: the finished request's
        assert int(found.group(1)) == int(found.group(2)) + 1, verdict.evidence
    if name == "stale_match_value":
        assert found.group(1) != found.group(2), verdict.evidence
    if name in ("continuation_not_reserved", "release_frees_in_window_page"):
        assert int(found.group(1)) < int(found.group(2)), verdict.evidence
    if name == "continuation_without_page" and found.group(3) is not None:
        assert int(found.group(1)) > int(found.group(3)), verdict.evidence
    if name in ("host_hit_not_page_rounded", "release_frees_in_window_page"):  # W not a page multiple
        assert verdict.config is not None and verdict.config.startswith(("page_edge-", "unaligned_chunk-"))
    if name == "continuation_whole_new_pages":  # only a chunk that is no page multiple ends inside a page
        assert verdict.config is not None and verdict.config.startswith("unaligned_chunk-")
    # how long a kill takes is for `kvproof mutants` to print (a timed assertion fails on a loaded machine)


# ---------------------------------------------------------------- the intended difference, call by call


def setup(*nodes: Node, p: int = 2, w: int = 4, pages: int = 8, chunk: int | None = 8) -> ad.AdmissionSetup:
    config = ad.AdmissionConfig(page_size=p, sliding_window=w, swa_pages=pages, chunk_size=chunk,
                                policy=AdmissionPolicy.CORRECTED)
    return ad.AdmissionSetup(name="t", config=config, nodes=nodes)


def node(length: int, swa: SwaValue, parent: int = -1) -> Node:
    return Node(parent=parent, length=length, full_on_device=True, swa=swa)


def both(name: str, s: ad.AdmissionSetup) -> tuple[AdmissionRuntime, AdmissionRuntime]:
    return AdmissionRuntime(s), MUTANTS[name](s)


def admit(rt: AdmissionRuntime, prompt: int, at: int, *, evict_after_match: int = 0) -> AddReqResult:
    rid = rt.arrive(prompt, 0, at)
    rt.get_new_batch_prefill()
    rt.match_prefix_for_req(rid)
    if evict_after_match:
        rt.evict(evict_after_match)
    return rt.add_one_req(rid)


def status(rt: AdmissionRuntime, rid: int = 0) -> ReqStatus:
    return rt.snapshot().state.requests[rid].status


@pytest.mark.parametrize("name", ["budget_without_host_term", "admits_at_equality"])
def test_host_term_and_equality(name: str) -> None:
    """7 pages (rem 14), a 12-token tombstone, 8 more tokens: budget max(8, 4) + 2 + 4 = 14, not below 14."""
    runtime, mutant = both(name, setup(node(12, HOST), pages=7))
    assert admit(runtime, 20, 0) is AddReqResult.NO_TOKEN and status(runtime) is ReqStatus.WAITING
    admit(mutant, 20, 0)
    assert status(mutant) is ReqStatus.ADMITTED


def test_no_lock_recheck() -> None:
    runtime, mutant = both("no_lock_recheck", setup(node(4, DEVICE), pages=4))
    assert admit(runtime, 6, 0) is AddReqResult.NO_TOKEN and status(runtime) is ReqStatus.WAITING
    admit(mutant, 6, 0)
    assert status(mutant) is ReqStatus.ADMITTED


def test_load_back_without_lock() -> None:
    runtime, mutant = both("load_back_without_lock", setup(node(4, HOST)))
    admit(runtime, 6, 0)
    admit(mutant, 6, 0)
    assert status(runtime) is status(mutant) is ReqStatus.ADMITTED
    assert runtime.snapshot().state.nodes[0].lock_ref == 1 and runtime.evictable_pages() == 0
    assert mutant.snapshot().state.nodes[0].lock_ref == 0 and mutant.evictable_pages() == 2


def test_host_hit_not_page_rounded() -> None:
    s = setup(node(12, HOST), node(4, DEVICE, parent=0), p=4, w=6, pages=5)
    runtime, mutant = both("host_hit_not_page_rounded", s)
    assert admit(runtime, 24, 1) is AddReqResult.NO_TOKEN and status(runtime) is ReqStatus.WAITING
    admit(mutant, 24, 1)
    assert status(mutant) is ReqStatus.ADMITTED


def test_host_hit_rounded_once_is_enough() -> None:
    """Rounding only the sum (or only each node) changes nothing: node lengths are whole pages."""
    class SumRoundedOnly(MUTANTS["host_hit_not_page_rounded"]):
        _budget = AdmissionRuntime._budget  # raw terms per node, the budget's ceil_P on the sum kept

    s = setup(node(12, HOST), node(4, DEVICE, parent=0), p=4, w=6, pages=5)
    rt = SumRoundedOnly(s)
    assert admit(rt, 24, 1) is AddReqResult.NO_TOKEN and status(rt) is ReqStatus.WAITING


def test_stale_match_value() -> None:
    runtime, mutant = both("stale_match_value", setup(node(4, DEVICE), pages=7))
    assert admit(runtime, 12, 0, evict_after_match=2) is AddReqResult.NO_TOKEN
    assert status(runtime) is ReqStatus.WAITING
    admit(mutant, 12, 0, evict_after_match=2)
    assert status(mutant) is ReqStatus.ADMITTED
    # without the eviction the match-time value is fresh: both refuse alike (the tree is what the match saw)
    runtime, mutant = both("stale_match_value", setup(node(4, HOST), pages=7))
    assert admit(runtime, 12, 0) is admit(mutant, 12, 0) is AddReqResult.NO_TOKEN


def test_uncapped_load_back() -> None:
    runtime, mutant = both("uncapped_load_back", setup(node(24, HOST)))
    admit(runtime, 26, 0)
    assert status(runtime) is ReqStatus.ADMITTED and runtime.available() == 6
    assert [n.length for n in runtime.snapshot().state.nodes] == [4, 20]  # split: one window restored
    with pytest.raises(OutOfMemory):
        admit(mutant, 26, 0)


def test_reserve_counts_host_term() -> None:
    runtime, mutant = both("reserve_counts_host_term", setup(node(4, HOST)))
    admit(runtime, 6, 0)
    admit(mutant, 6, 0)
    offsets = [rt.snapshot().state.adder.rem_swa_token_offset for rt in (runtime, mutant)]
    assert offsets == [6, 10]


def test_finish_keeps_lock() -> None:
    runtime, mutant = both("finish_keeps_lock", setup(node(4, DEVICE)))
    for rt in (runtime, mutant):
        admit(rt, 6, 0)
        rt.prepare_for_extend()
        rt.cache_finished_req(0)
    assert runtime.snapshot().state.nodes[0].lock_ref == 0
    assert mutant.snapshot().state.nodes[0].lock_ref == 1
    assert (runtime.evictable_pages(), mutant.evictable_pages()) == (2, 0)  # the window stays pinned


# ---- chunked prefill continued (§5.3, last paragraph)


def cached_chunk(rt: AdmissionRuntime, prompt: int, at: int = -1) -> int:
    """A request admitted as its first chunk, run and cached (chunked)."""
    admit(rt, prompt, at)
    rt.prepare_for_extend()
    rid = rt.reqs.shape[0] - 1
    rt.cache_unfinished_req(rid)
    return rid


def test_continuation_without_page() -> None:
    """P=4, W=8, chunk 8, 6 pages: 8 own tokens (2 pages), 12 left; a request reserved 12 of the 16 tokens left."""
    runtime, mutant = both("continuation_without_page", setup(p=4, w=8, pages=6, chunk=8))
    outcomes = []
    for rt in (runtime, mutant):
        rid = cached_chunk(rt, 20)
        other = rt.arrive(4, 0, -1)
        rt.get_new_batch_prefill()
        rt.match_prefix_for_req(other)
        assert rt.add_one_req(other) is AddReqResult.CONTINUE
        outcomes.append((rt.add_chunked_req(rid), rt.snapshot().state.requests[rid].extend_len))
    assert outcomes == [(ChunkedResult.DEFERRED, 0), (ChunkedResult.TRUNCATED, 4)]


def test_release_frees_in_window_page() -> None:
    """P=4, W=6, chunk 8: a first chunk of 8 tokens; tokens 2..7 are the window: page 0 (tokens 0..3) stays."""
    runtime, mutant = both("release_frees_in_window_page", setup(p=4, w=6, pages=8, chunk=8))
    kept = []
    for rt in (runtime, mutant):
        rid = cached_chunk(rt, 20)
        kept.append((rt.snapshot().state.requests[rid].swa_pages, rt.available()))
    assert kept == [(2, 6), (1, 7)]


def test_continuation_whole_new_pages() -> None:
    """P=4, W=8, chunk 10, 12 pages: own tokens 8 -> 18 -> 28; the second continuation takes 2 pages, not 3."""
    runtime, mutant = both("continuation_whole_new_pages", setup(p=4, w=8, pages=12, chunk=10))
    held = []
    for rt in (runtime, mutant):
        rid = cached_chunk(rt, 40)
        for _ in range(2):
            rt.get_new_batch_prefill()
            assert rt.add_chunked_req(rid) is ChunkedResult.TRUNCATED
            rt.prepare_for_extend()
            held.append(rt.snapshot().state.requests[rid].swa_pages)
            rt.cache_unfinished_req(rid)  # 18 own tokens: 2 pages freed; 28: 3 more
    # 8 -> 18: ceil(18/4) - ceil(8/4) = 3 = ceil(10/4) pages, alike (5 held); 18 -> 28: ceil(28/4) - ceil(18/4) = 2
    # past the partly filled page (3 + 2 held), the mutant ceil(10/4) = 3 (3 + 3)
    assert held == [5, 5, 5, 6]


def test_continuation_not_reserved() -> None:
    runtime, mutant = both("continuation_not_reserved", setup(p=4, w=8, pages=12, chunk=10))
    offsets = []
    for rt in (runtime, mutant):
        rid = cached_chunk(rt, 40)
        rt.get_new_batch_prefill()
        rt.add_chunked_req(rid)
        offsets.append(rt.snapshot().state.adder.rem_swa_token_offset)
    assert offsets == [14, 0]  # max(min(12, 10), 8) + 4
