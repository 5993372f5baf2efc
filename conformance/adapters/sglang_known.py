"""The findings kvproof has classified in SGLang 0.5.23 (``docs/sglang-findings.md``), as the SGLang adapters declare
them (their ``findings``): each matched by the evidence of a verdict (:mod:`kvproof.conformance.findings`: the
operation, the check, what changed), never by its wording. Kept apart from the reproductions
(:mod:`.sglang_findings`, which import the adapters) so that the adapters can declare them.
"""

from __future__ import annotations

from typing import Any

from kvproof.conformance.findings import Evidence, Finding

__all__ = ["FINDINGS", "classify"]

_SWA = ("swa_allocator", "loc_cache", "decode_prealloc")


def _alloc_decode_kept_pages(e: Evidence) -> bool:
    """A failed ``alloc_decode`` that took pages from a free list and changed nothing else (R7)."""
    d = e.detail
    return (e.op == "alloc_decode" and e.check == "unchanged_on_failure" and not d.get("mapping_entries_changed")
            and not d.get("full_pages_given") and not d.get("swa_pages_given")
            and bool(d.get("full_pages_taken") or d.get("swa_pages_taken")))


def _slot_zero_freed(e: Evidence) -> bool:
    """After a release at P == 1, the SWA free list holds the reserved slot 0 (or SGLang asserted on it)."""
    d = e.detail
    return e.op in ("free", "free_swa") and (
        (e.check == "state" and d.get("pool") == "swa" and bool(d.get("reserved_page_free")))
        or (e.check == "crash" and d.get("implementation") == "AssertionError"))


def _ring_alloc_takes_swa(e: Evidence) -> bool:
    """On a ring config, ``alloc`` left the (unused) paged SWA pool or the mapping unlike the ring's reference."""
    return e.op == "alloc" and e.check == "state" and bool(e.detail.get("ring"))


def _backup_not_atomic(e: Evidence) -> bool:
    """A failed eager backup that kept what it took, or a short backup batch."""
    return e.op == "eager_backup_previous_token" and e.check in ("unchanged_on_failure", "result")


def _starved(reason: str) -> Any:
    def matches(e: Evidence) -> bool:
        return (e.check == "liveness" and e.detail.get("reason") == reason
                and e.detail.get("policy") == "upstream_0523")
    return matches


FINDINGS: tuple[Finding, ...] = (
    Finding("F1", "alloc_decode is not atomic: a short pool leaks the pages the other pool's call already took (R7)",
            "sglang-hazard", _SWA, _alloc_decode_kept_pages, behaviour="non-atomic alloc_decode"),
    # ^ reclassified from sglang-bug: 0.5.23's only caller (alloc_for_decode) is guarded exactly, in pages, on both
    #   pools (ScheduleBatch.check_decode_mem), and a None there is a fatal RuntimeError (docs/sglang-findings.md)
    Finding("F8", "per-request SWA ring (P == 1): alloc has no ring branch: it takes paged SWA slots and writes the "
                  "mapping, which the ring's free never clears nor gives back; the unused paged SWA pool drains and "
                  "alloc then returns None while available_size() (full only) has room. 0.5.23 builds a ring only "
                  "for DeepSeek-V4, at page size 256 (NPU: 128), where alloc asserts page_size == 1: no caller "
                  "reaches it", "sglang-hazard", ("swa_allocator",), _ring_alloc_takes_swa),
    Finding("F2", "P == 1: free / free_swa of a full slot whose SWA peer is already released puts the reserved "
                  "SWA slot 0 into the free list (the segment calls do it at every P); SGLang's own swa.peer_mapped "
                  "check names it caller misuse and no 0.5.23 caller commits it", "model-gap", _SWA, _slot_zero_freed),
    # hisparse_host (adapters.sglang_host:SGLangHostPool)
    Finding("F3", "hisparse_host: the eager backup of a decode batch is not failure-atomic: a short host pool "
                  "raises after earlier requests took pages and after every skip-first-backup flag of the batch "
                  "was consumed (documented difference: upstream's RuntimeError is fatal)", "model-gap",
            ("hisparse_host",), _backup_not_atomic),
    # admission (adapters.sglang_admission:SGLangAdmission, --budget upstream_0523)
    Finding("F4", "admission: SWAPrefillBudget refuses forever, on an idle pool, a request whose sliding window "
                  "holds a host tombstone longer than the SWA pool (S9 persists in 0.5.23: the match counts whole "
                  "tombstones, the never-fits chunk cap subtracts them too)", "sglang-bug", ("admission",),
            _starved("tombstones_charged_whole"), behaviour="starves forever"),
    Finding("F5", "admission: 0.5.23's selection pin of the match's last device node makes SWAPrefillBudget count "
                  "device SWA outside the request's window as taken: a request whose window is a host tombstone "
                  "under a Full host prefix is refused forever on an idle pool it fits", "sglang-bug",
            ("admission",), _starved("selection_pin"), behaviour="starves forever"),
    # tp_prefetch (adapters.sglang_tp_prefetch:SGLangTPPrefetch, --ranks host_pressure)
    Finding("F6", "tp_prefetch: rank-local host pressure breaks T1: a rank stages fewer Full pages than the synced "
                  "hit after the sync, so the ranks expect different lengths and one inserts while the other "
                  "discards (conditional hazard)", "sglang-hazard", ("tp_prefetch",),
            lambda e: e.check == "invariant" and e.detail.get("finding") == "F6"),
)


def classify(evidence: Evidence | dict[str, Any] | None) -> Finding | None:
    """The documented finding a verdict's evidence shows (a report's ``evidence``), or ``None``: new."""
    if isinstance(evidence, dict):
        evidence = Evidence.from_json(evidence)
    if evidence is None:
        return None
    return next((f for f in FINDINGS if f(evidence)), None)
