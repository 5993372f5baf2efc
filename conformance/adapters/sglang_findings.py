"""What the lockstep suite finds in SGLang 0.5.23, each with a reproduction in SGLang's own terms.

Written up in ``docs/sglang-findings.md``. :data:`FINDINGS` lists every divergence
the ``swa_allocator`` suite reports against
``kvproof.conformance.adapters.sglang:SGLangSWAAllocator``; :func:`classify` maps a
failure message to its finding (``None``: an unexplained divergence, which is new).
The ``reproduce_*`` functions build SGLang's classes directly (no kvproof adapter in
the loop) and return what they observed; ``tests/adapters/test_sglang.py`` asserts
on them, so a SGLang release that changes the behaviour makes those tests fail.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["FINDINGS", "Finding", "classify", "reproduce_alloc_decode_leak", "reproduce_p1_free_released_swa"]


@dataclass(frozen=True)
class Finding:
    """One documented divergence: its id, a title, its classification, and how the harness words it."""

    id: str
    title: str
    kind: str  # "sglang-bug" or "model-gap"
    patterns: tuple[str, ...]  # regexes over the harness's failure message

    def matches(self, failure: str) -> bool:
        return any(re.search(p, failure) for p in self.patterns)


FINDINGS: tuple[Finding, ...] = (
    Finding("F1", "alloc_decode is not atomic: a short SWA pool leaks the full pages it already took (R7)",
            "sglang-bug", (r"alloc_decode failed with OutOfMemory but changed the allocator",
                           r"alloc_decode: .*SGLang returned None but did not roll back")),
    Finding("F2", "P == 1: free / free_swa of a full slot whose SWA peer is already released puts the reserved "
                  "SWA slot 0 into the free list", "model-gap",
            (r"swa pool: implementation has \d+ free pages \[[^\]]*\b0\b",
             r"swa pool: implementation free list contains the reserved page 0",
             r"free(_swa)? crashed with AssertionError",
             r"swa pool: implementation free list has a duplicate page")),
)


def classify(failure: str) -> Finding | None:
    """The documented finding a harness failure message shows, or ``None`` if it is not one of them."""
    head = failure.split("operations so far:", 1)[0]
    return next((f for f in FINDINGS if f.matches(head)), None)


# ---------------------------------------------------------------- reproductions in SGLang's terms


def _sglang_allocator(size: int, size_swa: int, page_size: int) -> Any:
    from kvproof.conformance.adapters.sglang import load_sglang

    sg = load_sglang()  # kvproof's triton/torchvision stand-ins where needed, then SGLang's pool modules
    pool = sg.SWAKVPool(size=size, size_swa=size_swa, page_size=page_size, dtype=torch.float32, head_num=1,
                        head_dim=2, swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    return sg.SWATokenToKVPoolAllocator(size, size_swa, page_size, torch.float32, "cpu", pool, need_sort=False)


def _t(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def reproduce_alloc_decode_leak() -> dict[str, Any]:
    """F1: fill the SWA pool, then decode into a new page: SGLang returns None and keeps a full page."""
    a = _sglang_allocator(size=16, size_swa=8, page_size=4)
    loc = a.alloc_extend(_t(0), _t(0), _t(8), _t(8), _t(-1), 8)  # 2 full + 2 SWA pages: the SWA pool is now empty
    before = (a.full_available_size(), a.swa_available_size())  # (8, 0)
    out = a.alloc_decode(_t(9), _t(9), loc[-1:])  # position 8 opens a new page in both pools
    after = (a.full_available_size(), a.swa_available_size())  # (4, 0): a full page is gone
    a.free(loc)  # the request ends
    return {"result": out, "before": before, "after": after, "full_free_after_release": a.full_available_size(),
            "size_full": a.size_full}


def reproduce_p1_free_released_swa() -> dict[str, Any]:
    """F2: at P == 1, ``free`` after a window eviction (``free_swa``) of the first position hands out SWA slot 0."""
    b = _sglang_allocator(size=12, size_swa=8, page_size=1)
    req_a, _req_b = b.alloc(2), b.alloc(1)  # A: full [1, 2] -> SWA [1, 2]; B: full [3] -> SWA [3] (stays live)
    b.free_swa(req_a[:1])  # window eviction of A's position 0: M[1] = 0
    b.free(req_a)  # free_swa reads M[[1, 2]] = [0, 2] and releases SWA slot 0 with slot 2
    swa_free = [int(x) for x in b.swa_attn_allocator.free_pages.tolist()]
    req_c = b.alloc(7)  # takes every free SWA slot, slot 0 last
    return {"swa_free_pages": swa_free, "swa_available": b.swa_available_size(), "size_swa": b.size_swa,
            "c_swa_slots": [int(x) for x in b.translate_loc_from_full_to_swa(req_c).tolist()]}
