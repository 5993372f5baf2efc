"""``kvproof.spec``: Z3 proof obligations for SGLang's SWA hybrid KV allocator and its loc cache.

Claims about the semantics in ../shared/research/sglang_semantics.md (§1.3 paged
allocator, §1.5 composite allocator, §2.3/§2.7/§2.8 PD decode tail preallocation,
§7 invariants G/M/D, §9 scenarios S3/S4), one module per invariant family:

* :mod:`.swa_tail` — lemma D2, ``swa_tail_len`` for symbolic ``L, W, P`` (§2.3);
* :mod:`.page_arith` — ``alloc_extend`` parts 1/2/3, ``get_num_new_pages``,
  ``alloc_decode`` (§1.3);
* :mod:`.swa_mask` — ``get_cpu_copy`` / ``load_cpu_copy`` mask symmetry (§2.8, S4);
* :mod:`.swa_mapping` — the full-to-SWA mapping M under ``free_swa``,
  ``alloc_extend_swa_tail`` and ``alloc_extend`` (§1.5, §2.7, §7 M3-M5);
* :mod:`.swa_s3` — scenario S3 (R1 + R3, stale mapping -> SWA double free) found by
  bounded model checking, and the post-#25805 model proved safe by induction (§9);
* :mod:`.loc_cache` (component ``loc_cache``) — the full->SWA translation cache of
  PR #25824 / #26152: no stale read under the upstream invalidation points and the
  environment contract E1 (induction), every point needed, S5, S6, a cache shared by
  two pools, E1 needed, C4 (§3, §7 C1-C4, §9 S5 S6);
* :mod:`.decode_prealloc` (component ``decode_prealloc``) — the PD decode node's
  preallocation budgets and gates: D1 (admitted => ``_pre_alloc`` succeeds) proved for
  the corrected policy, refuted for the upstream one (S2), which of rounding and
  recomputation it needs, and D3 residency / resume-tail lemmas (§2, §7 D1-D3, §9 S2);
* :mod:`.hisparse_host` (component ``hisparse_host``) — the HiSparse paged host pool of
  PR #23606: ``alloc_paged_token_slots`` keeps rows whole aligned pages (H1), covers the
  request, takes ``ceil((end - a)/P)`` pages, gives distinct in-page slots, reserves no
  page without a requested position under ``start <= a`` (H4), fits the ``+ P`` row
  width; release restores the pool (H2); eager backups never leave a hole (induction);
  S7's numbers (§4, §4.6 H0-H4, §9 S7).

Each family module exports ``OBLIGATIONS``; this package concatenates them in a
stable order. :func:`run` checks one obligation with a fresh solver.
"""

from __future__ import annotations

from collections import Counter
from fnmatch import fnmatchcase

from kvproof.spec import decode_prealloc, hisparse_host, loc_cache, page_arith, swa_mapping, swa_mask, swa_s3, swa_tail
from kvproof.spec._solver import Obligation, Result, run

__all__ = ["Obligation", "Result", "run", "OBLIGATIONS", "FAMILY_MODULES", "obligations"]

FAMILY_MODULES = (swa_tail, page_arith, swa_mask, swa_mapping, swa_s3, loc_cache, decode_prealloc, hisparse_host)

OBLIGATIONS: tuple[Obligation, ...] = tuple(ob for module in FAMILY_MODULES for ob in module.OBLIGATIONS)

_duplicates = sorted(name for name, count in Counter(ob.name for ob in OBLIGATIONS).items() if count > 1)
assert not _duplicates, f"obligation names must be unique, duplicated: {_duplicates}"


def obligations(component: str | None = None, name_filter: str | None = None) -> tuple[Obligation, ...]:
    """The registered obligations, optionally narrowed.

    ``component`` must match exactly. ``name_filter`` is a glob (``fnmatch``) when
    it contains ``*``, ``?`` or ``[``, else a substring of the name.
    """

    def wanted(ob: Obligation) -> bool:
        if component is not None and ob.component != component:
            return False
        if name_filter is None:
            return True
        if any(ch in name_filter for ch in "*?["):
            return fnmatchcase(ob.name, name_filter)
        return name_filter in ob.name

    return tuple(ob for ob in OBLIGATIONS if wanted(ob))
