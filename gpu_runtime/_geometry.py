"""Page geometry of the paged allocations as tensor ops (sglang_semantics.md §1.3).

A *plan* says where every new token of one allocation lands, relative to the pages
that will be taken from the front of a free list:

* part 1 (``n1`` tokens) continues the page of ``last_loc``: slot ``last_loc + 1 + i``;
* after part 1 a request is page aligned, so its ``r``-th remaining token (parts 2
  and 3 together) sits at offset ``r % P`` of the request's ``r // P``-th new page.

A plan depends only on ``prefix_lens`` / ``seq_lens``, never on a pool, so one plan
drives both pools of the SWA composite, which share the geometry (M5). Page counts
come from the ``*_cpu`` twins (no device sync, as SGLang's ``get_num_new_pages``);
per-token tensors live on the device. No per-token Python loop anywhere; a batch of
one request (every prefill chunk) is planned with host integers and slicing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "DecodePlan",
    "ExtendPlan",
    "Plan",
    "SinglePlan",
    "count_new_pages",
    "decode_plan",
    "extend_plan",
    "page_offsets",
    "page_slots",
]

Tensor = torch.Tensor


def count_new_pages(prefix_cpu: Tensor, seq_cpu: Tensor, page_size: int) -> int:
    """``Σ ceil(s/P) - ceil(p/P)``: pages a batched extend takes (``get_num_new_pages``)."""
    p = page_size
    if seq_cpu.numel() == 1:
        (pre,), (seq,) = prefix_cpu.tolist(), seq_cpu.tolist()
        return int(-(-seq // p) + (-pre // p))
    return int(((seq_cpu + p - 1) // p - (prefix_cpu + p - 1) // p).sum())


_OFFSETS: dict[tuple[int, torch.device], Tensor] = {}


def page_offsets(page_size: int, device: torch.device) -> Tensor:
    """``arange(P)`` on ``device``, built once (it is on every paged hot path)."""
    key = (page_size, device)
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.arange(page_size, dtype=torch.int64, device=device)
    return _OFFSETS[key]


def page_slots(pages: Tensor, page_size: int) -> Tensor:
    """All slots of ``pages``, page by page."""
    if page_size == 1:
        return pages
    return (pages[:, None] * page_size + page_offsets(page_size, pages.device)).reshape(-1)


@dataclass(frozen=True, slots=True)
class SinglePlan:
    """One request: ``n1`` slots after ``last_loc``, then ``rest`` slots filling new pages in order."""

    num_new_pages: int
    page_size: int
    n1: int
    rest: int

    def slots(self, pages: Tensor, last_loc: Tensor) -> Tensor:
        fresh = page_slots(pages, self.page_size)[: self.rest]
        if self.n1 == 0:
            return fresh
        cont = torch.arange(1, self.n1 + 1, device=last_loc.device) + last_loc
        return torch.cat((cont, fresh)) if self.rest else cont


@dataclass(frozen=True, slots=True)
class ExtendPlan:
    """Per-token geometry of a batched ``alloc_extend`` (§1.3 parts 1-3)."""

    num_new_pages: int
    page_size: int
    req: Tensor  # request of each new token
    local: Tensor  # index of the token inside its request's extend
    part1: Tensor  # bool: the token continues last_loc's page
    page_rank: Tensor  # index into the taken pages (meaningless where part1)
    offset: Tensor  # in-page offset on the new page (meaningless where part1)

    def slots(self, pages: Tensor, last_loc: Tensor) -> Tensor:
        """Slots of the new tokens given the taken ``pages`` and each request's ``last_loc``."""
        cont = last_loc[self.req] + 1 + self.local
        if pages.numel() == 0:  # nothing past part 1 (a short ``pages`` is a caller bug)
            return cont
        # clamp: part-1 lanes of the last request may point one past the taken pages
        fresh = pages[self.page_rank.clamp(max=pages.numel() - 1)] * self.page_size + self.offset
        return torch.where(self.part1, cont, fresh)


@dataclass(frozen=True, slots=True)
class DecodePlan:
    """One token per request at position ``s - 1``; a new page iff ``(s - 1) mod P == 0`` (§1.3)."""

    num_new_pages: int
    page_size: int
    opens: Tensor  # bool: the token opens a new page
    rank: Tensor  # index into the taken pages (meaningless where not opens)

    def slots(self, pages: Tensor, last_loc: Tensor) -> Tensor:
        cont = last_loc + 1
        if pages.numel() == 0:
            return cont
        return torch.where(self.opens, pages[self.rank.clamp(max=pages.numel() - 1)] * self.page_size, cont)


Plan = SinglePlan | ExtendPlan | DecodePlan


def extend_plan(prefix_lens: Tensor, prefix_cpu: Tensor, seq_lens: Tensor, seq_cpu: Tensor, num_tokens: int,
                new_pages: int, page_size: int) -> SinglePlan | ExtendPlan:
    """The plan of a batched extend from ``prefix_lens`` to ``seq_lens``.

    ``num_tokens`` is ``Σ (s - p)`` and ``new_pages`` the page count, both known on
    the host, so ``repeat_interleave`` needs no device sync.
    """
    p, dev = page_size, prefix_lens.device
    if seq_cpu.numel() == 1:
        (pre,), (seq,) = prefix_cpu.tolist(), seq_cpu.tolist()
        n1 = min(seq, -(-pre // p) * p) - pre
        return SinglePlan(new_pages, p, n1, seq - pre - n1)
    ext = seq_lens - prefix_lens
    n1 = torch.minimum(seq_lens, (prefix_lens + p - 1) // p * p) - prefix_lens
    pages = (seq_lens + p - 1) // p - (prefix_lens + p - 1) // p
    req = torch.repeat_interleave(torch.arange(ext.numel(), device=dev), ext, output_size=num_tokens)
    local = torch.arange(num_tokens, device=dev) - (torch.cumsum(ext, 0) - ext)[req]
    rel = local - n1[req]  # token index past part 1 (negative inside part 1)
    part1 = rel < 0
    rel = rel.clamp(min=0)
    page_rank = (torch.cumsum(pages, 0) - pages)[req] + rel // p
    return ExtendPlan(new_pages, p, req, local, part1, page_rank, rel % p)


def decode_plan(seq_lens: Tensor, seq_cpu: Tensor, page_size: int) -> DecodePlan:
    """The plan of ``alloc_decode``: the k-th page-opening request gets the k-th new page."""
    opens = (seq_lens - 1) % page_size == 0
    new_pages = int(((seq_cpu - 1) % page_size == 0).sum())
    as_int = opens.to(torch.int64)
    return DecodePlan(new_pages, page_size, opens, torch.cumsum(as_int, 0) - as_int)
