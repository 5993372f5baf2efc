"""Page and window arithmetic shared by every layer (sglang_semantics.md §1.1, §1.3, §2.3).

Pure integer functions; the Z3 models in ``kvproof.spec`` state the same formulas
over symbolic integers, and ``tests/spec/test_drift.py`` checks they agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproof.reference.errors import InvalidOperation

__all__ = [
    "ceil_div",
    "ceil_p",
    "decode_opens_page",
    "extend_parts",
    "floor_p",
    "num_new_pages",
    "split_kv_row_segments",
    "swa_tail_len",
]


def ceil_div(n: int, d: int) -> int:
    """``ceil(n / d)`` for ``n >= 0``, ``d >= 1``."""
    return -(-n // d)


def ceil_p(x: int, page_size: int) -> int:
    """``ceil_P(x)``: round ``x`` up to a multiple of the page size (§1.1)."""
    return ceil_div(x, page_size) * page_size


def floor_p(x: int, page_size: int) -> int:
    """``floor_P(x)``: round ``x`` down to a multiple of the page size (§1.1)."""
    return (x // page_size) * page_size


def extend_parts(prefix_len: int, seq_len: int, page_size: int) -> tuple[int, int, int]:
    """The three parts of a paged ``alloc_extend`` for one request (§1.3).

    ``n1`` tokens continue the partially filled last page, ``n2`` tokens fill whole
    new pages, ``n3`` tokens start the last new page. ``n1 + n2 + n3 == seq - prefix``.
    """
    # ceil_p / floor_p written out: the reference calls this for every request it extends
    ceil_prefix = -(-prefix_len // page_size) * page_size
    n1 = min(seq_len, ceil_prefix) - prefix_len
    if prefix_len + n1 == seq_len:
        return n1, 0, 0
    floor_seq = (seq_len // page_size) * page_size
    return n1, floor_seq - ceil_prefix, seq_len - floor_seq


def num_new_pages(prefix_len: int, seq_len: int, page_size: int) -> int:
    """Pages one request's extend takes from the free list: ``ceil(s/P) - ceil(p/P)`` (§1.3)."""
    return -(-seq_len // page_size) + (-prefix_len // page_size)  # ceil_div(s, P) - ceil_div(p, P)


def decode_opens_page(seq_len: int, page_size: int) -> bool:
    """Whether decoding token ``seq_len - 1`` opens a new page: ``(s - 1) mod P == 0`` (§1.3)."""
    return (seq_len - 1) % page_size == 0


def swa_tail_len(seq_len: int, window: int, page_size: int) -> int:
    """SWA tokens a tail preallocation keeps for a sequence of ``seq_len`` tokens (§2.3).

    ``ws = floor_P(max(0, L - W))``; the tail is ``L - ws``: it starts on a page
    boundary, covers the last ``W`` positions and is at most ``W + P - 1`` long
    (lemma D2, proved in ``kvproof.spec.swa_tail``). Models the tail-mode branch of
    ``DecodePreallocQueue._swa_tail_len`` with a positive window.
    """
    if seq_len <= 0:
        return 0
    return seq_len - floor_p(max(0, seq_len - window), page_size)


def split_kv_row_segments(segments: Sequence[tuple[Any, int]], swa_evicted_seqlen: int, swa_dead_lo: int,
                          page_size: int) -> tuple[list[tuple[Any, int]], list[tuple[Any, int]]]:
    """``free_kv_row_segments``' split (0.5.23): the ``(slots, start_pos)`` pieces in ``[swa_dead_lo,
    swa_evicted_seqlen)`` (full side only) and the rest, each piece a slice of its segment; raises
    :class:`InvalidOperation` where 0.5.23 asserts (two segments sharing a page, a cursor splitting a page between
    the two sides). ``slots`` may be any sliceable sequence (a list, a tensor)."""
    op, p = "free_kv_row_segments", page_size
    dead_lo, dead_hi = swa_dead_lo, max(swa_evicted_seqlen, swa_dead_lo)
    dead: list[tuple[Any, int]] = []
    alive: list[tuple[Any, int]] = []
    prev_end: int | None = None
    for slots, start in segments:
        n = len(slots)
        if n and prev_end is not None and not start // p > (prev_end - 1) // p:
            raise InvalidOperation(op, "segments", f"the segment at position {start} shares a page with the one "
                                                   f"ending at {prev_end}")
        prev_end = start + n if n else prev_end
        end = start + n
        lo, hi = min(max(dead_lo, start), end), min(max(dead_hi, start), end)
        if hi <= lo:
            alive.append((slots, start))
            continue
        dead.append((slots[lo - start:hi - start], lo))
        if lo > start:
            alive.append((slots[:lo - start], start))
        if end > hi:
            alive.append((slots[hi - start:], hi))
    if dead and alive and swa_evicted_seqlen % p:
        raise InvalidOperation(op, "swa_evicted_seqlen", f"the SWA eviction cursor {swa_evicted_seqlen} splits a page "
                                                         f"(page_size {p})")
    return dead, alive
