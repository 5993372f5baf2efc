"""Page geometry of the paged allocations as tensor ops (sglang_semantics.md §1.3).

A *plan* says where every new token of one allocation lands, relative to the pages
that will be taken from the front of a free list:

* part 1 (``n1`` tokens) continues the page of ``last_loc``: slot ``last_loc + 1 + i``;
* after part 1 a request is page aligned, so its ``r``-th remaining token (parts 2
  and 3 together) sits at offset ``r % P`` of the request's ``r // P``-th new page.

A plan depends only on ``prefix_lens`` / ``seq_lens``, never on a pool, so one plan
drives both pools of the SWA composite, which share the geometry (M5). Plans are made
on the host from the ``*_cpu`` twins read as Python lists (per request, no device
sync, as SGLang's ``get_num_new_pages``); the slots themselves are device tensors
built with a fixed number of tensor ops per pool, whatever the batch (no per-token
Python loop):

* one request (every prefill chunk): slicing of the taken pages' slots;
* a batch: one gather from ``last_loc``'s continuations and the taken pages' slots,
  by an index made on the device from per-request segments (:class:`ExtendPlan`);
* a decode batch: ``last_loc + 1``, or each opening request's new page, picked on the
  host when every request or none opens a page (:class:`DecodePlan`).

Host-made index vectors reach the device with :func:`host_tensor` (an asynchronous
copy from pageable memory on CUDA, which the driver stages at once: no device sync).
"""

from __future__ import annotations

from collections.abc import Sequence
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
    "host_tensor",
    "page_offsets",
    "page_slots",
]

Tensor = torch.Tensor
_I64 = torch.int64


def host_tensor(values: Sequence[int] | Sequence[Sequence[int]], device: torch.device) -> Tensor:
    """Host ints as an int64 tensor on ``device``, without a device sync (non-blocking copy, staged by the driver)."""
    t = torch.tensor(values, dtype=_I64)
    return t if device.type == "cpu" else t.to(device, non_blocking=True)


def count_new_pages(prefix_cpu: Tensor, seq_cpu: Tensor, page_size: int) -> int:
    """``Σ ceil(s/P) - ceil(p/P)``: pages a batched extend takes (``get_num_new_pages``), from the host twins."""
    p = page_size
    return sum(-(-seq // p) + (-pre // p) for pre, seq in zip(prefix_cpu.tolist(), seq_cpu.tolist(), strict=True))


_OFFSETS: dict[tuple[int, int, torch.device], Tensor] = {}


def page_offsets(page_size: int, device: torch.device, start: int = 0) -> Tensor:
    """``arange(start, P)`` on ``device``, built once (it is on every paged hot path)."""
    key = (page_size, start, device)
    if key not in _OFFSETS:
        _OFFSETS[key] = torch.arange(start, page_size, dtype=_I64, device=device)
    return _OFFSETS[key]


def page_slots(pages: Tensor, page_size: int) -> Tensor:
    """All slots of ``pages``, page by page (``pages`` itself at P == 1)."""
    if page_size == 1:
        return pages
    return torch.add(page_offsets(page_size, pages.device), pages.unsqueeze(1), alpha=page_size).view(-1)


@dataclass(frozen=True, slots=True)
class SinglePlan:
    """One request: ``n1`` slots after ``last_loc``, then ``rest`` slots filling new pages in order."""

    num_new_pages: int
    page_size: int
    n1: int
    rest: int

    def slots(self, pages: Tensor, last_loc: Tensor) -> Tensor:
        fresh = page_slots(pages, self.page_size)
        if self.rest < fresh.numel():  # the last new page is partly used
            fresh = fresh[: self.rest]
        if self.n1 == 0:
            return fresh
        cont = page_offsets(self.page_size, last_loc.device, 1)[: self.n1] + last_loc
        return torch.cat((cont, fresh)) if self.rest else cont


@dataclass(slots=True)
class ExtendPlan:
    """Per-token geometry of a batched ``alloc_extend`` (§1.3 parts 1-3), as segments made on the host.

    The new tokens are a gather from ``cat(cont, fresh)``: ``cont`` holds each request's
    possible part-1 slots ``last_loc + 1 .. last_loc + P - 1`` (row per request; only when
    some request continues a page), ``fresh`` the taken pages' slots. Each request adds
    at most two contiguous segments (its part 1, its fresh tokens) of ``(start - output
    position, length)``; the per-token index is built on the device on first use.
    """

    num_new_pages: int
    page_size: int
    num_tokens: int
    tokens_per_request: tuple[int, ...]  # host: new tokens of each request
    pages_per_request: tuple[int, ...]  # host: new pages of each request, in take order
    continues: bool  # host: some request has a part 1
    segments: tuple[tuple[int, ...], tuple[int, ...]]  # host: (start - output position, length) per segment
    _gather: Tensor | None = None

    def slots(self, pages: Tensor, last_loc: Tensor) -> Tensor:
        """Slots of the new tokens given the taken ``pages`` and each request's ``last_loc``."""
        p, planned = self.page_size, sum(self.pages_per_request)
        if pages.numel() < planned:  # a short ``pages`` is a caller bug: later ranks reuse the last page
            pages = torch.cat((pages, pages[-1:].expand(planned - pages.numel())))
        fresh = page_slots(pages, p)
        if not self.continues and not any(self.segments[0]):  # every token at its own fresh slot: no gather
            return fresh if fresh.numel() == self.num_tokens else fresh[: self.num_tokens]
        src = fresh
        if self.continues:
            cont = (last_loc.unsqueeze(1) + page_offsets(p, last_loc.device, 1)).view(-1)
            src = torch.cat((cont, fresh))
        return src.index_select(0, self._index(pages.device))

    def _index(self, device: torch.device) -> Tensor:
        """The gather index (built once, shared by both pools)."""
        if self._gather is None:
            delta, length = host_tensor(self.segments, device)
            self._gather = delta.repeat_interleave(length, output_size=self.num_tokens) + torch.arange(
                self.num_tokens, dtype=_I64, device=device)
        return self._gather

    def per_page(self, values: Tensor) -> Tensor:
        """A per-request tensor spread over the new pages, in take order (request ``i`` owns its ``k_i`` pages)."""
        return _spread(values, self.pages_per_request)

    def per_token(self, values: Tensor) -> Tensor:
        """A per-request tensor spread over the new tokens, in slot order."""
        return _spread(values, self.tokens_per_request)


def _spread(values: Tensor, counts: tuple[int, ...]) -> Tensor:
    """``values[i]`` repeated ``counts[i]`` times (host counts: no sync)."""
    if all(n == 1 for n in counts):
        return values
    if all(n <= 1 for n in counts):
        return values.index_select(0, host_tensor([i for i, n in enumerate(counts) if n], values.device))
    return values.repeat_interleave(host_tensor(counts, values.device), output_size=sum(counts))


class DecodePlan:
    """One token per request at position ``s - 1``; a new page iff ``(s - 1) mod P == 0`` (§1.3).

    ``opens`` (bool per request: the token opens a new page) and ``rank`` (its index into
    the taken pages) are device tensors. A plan made by :func:`decode_plan` also knows
    ``opens`` on the host (``opens_host``) and builds the tensors only if asked: a batch
    in which every request, or none, opens a page needs neither. A plan built from the
    tensors alone (``DecodePlan(n, P, opens, rank)``) uses them as given.
    """

    __slots__ = ("_opens", "_rank", "device", "num_new_pages", "opens_host", "page_size")

    def __init__(self, num_new_pages: int, page_size: int, opens: Tensor | None = None, rank: Tensor | None = None,
                 *, opens_host: tuple[bool, ...] | None = None, device: torch.device | None = None) -> None:
        if opens_host is None and (opens is None or rank is None):
            raise TypeError("DecodePlan needs opens and rank, or opens_host")
        self.num_new_pages, self.page_size = num_new_pages, page_size
        self._opens, self._rank, self.opens_host = opens, rank, opens_host
        self.device = device if device is not None else opens.device if opens is not None else torch.device("cpu")

    @property
    def opens(self) -> Tensor:
        if self._opens is None:  # only a plan with opens_host lacks it
            self._opens = torch.tensor(self.opens_host or (), dtype=torch.bool).to(self.device, non_blocking=True)
        return self._opens

    @property
    def rank(self) -> Tensor:
        if self._rank is None:
            self._rank = host_tensor(_ranks(self.opens_host or ()), self.device)
        return self._rank

    def slots(self, pages: Tensor, last_loc: Tensor) -> Tensor:
        p, host = self.page_size, self.opens_host
        if host is None:  # the tensors as given
            cont = last_loc + 1
            if pages.numel() == 0:
                return cont
            return torch.where(self.opens, pages[self.rank.clamp(max=pages.numel() - 1)] * p, cont)
        if not any(host):
            return last_loc + 1
        fresh = pages * p if p > 1 else pages
        if all(host):
            return fresh
        # each request takes last_loc + 1 (row i of cat) or the first slot of its new page (row bs + rank)
        bs, ranks = len(host), _ranks(host)
        pick = [bs + r if o else i for i, (o, r) in enumerate(zip(host, ranks, strict=True))]
        return torch.cat((last_loc + 1, fresh)).index_select(0, host_tensor(pick, last_loc.device))

    def per_page(self, values: Tensor) -> Tensor | None:
        """A per-request tensor at the new pages, in take order (``None`` without ``opens_host``)."""
        host = self.opens_host
        return None if host is None else _spread(values, tuple(int(o) for o in host))

    def per_token(self, values: Tensor) -> Tensor:
        """A per-request tensor at the new tokens: one per request."""
        return values


def _ranks(opens: Sequence[bool]) -> list[int]:
    """Index of each opening request's page among the taken ones (exclusive prefix count)."""
    out, n = [], 0
    for o in opens:
        out.append(n)
        n += o
    return out


Plan = SinglePlan | ExtendPlan | DecodePlan


def extend_plan(prefix_lens: Tensor, prefix_cpu: Tensor, seq_lens: Tensor, seq_cpu: Tensor, num_tokens: int,
                new_pages: int, page_size: int) -> SinglePlan | ExtendPlan:
    """The plan of a batched extend from ``prefix_lens`` to ``seq_lens``, from the host twins.

    ``num_tokens`` is ``Σ (s - p)`` and ``new_pages`` the page count, both known on
    the host, so the device needs no sync. ``prefix_lens`` / ``seq_lens`` are not read
    (the twins hold the same values).
    """
    p = page_size
    pre_l, seq_l = prefix_cpu.tolist(), seq_cpu.tolist()
    if len(seq_l) == 1:
        (pre,), (seq,) = pre_l, seq_l
        n1 = min(seq, -(-pre // p) * p) - pre
        return SinglePlan(new_pages, p, n1, seq - pre - n1)
    parts = []  # per request: part 1, fresh tokens, new pages
    for pre, seq in zip(pre_l, seq_l, strict=True):
        q = -(-pre // p)
        n1 = min(seq, q * p) - pre
        parts.append((n1, seq - pre - n1, -(-seq // p) - q))
    continues = any(n1 for n1, _, _ in parts)
    base = len(parts) * (p - 1) if continues else 0  # where the fresh slots start in cat(cont, fresh)
    delta: list[int] = []
    length: list[int] = []
    out = rank = 0
    for i, (n1, rest, k) in enumerate(parts):
        for start, n in ((i * (p - 1), n1), (base + rank * p, rest)):
            if n:
                delta.append(start - out)
                length.append(n)
                out += n
        rank += k
    return ExtendPlan(new_pages, p, out, tuple(n1 + rest for n1, rest, _ in parts), tuple(k for _, _, k in parts),
                      continues, (tuple(delta), tuple(length)))


def decode_plan(seq_lens: Tensor, seq_cpu: Tensor, page_size: int) -> DecodePlan:
    """The plan of ``alloc_decode``: the k-th page-opening request gets the k-th new page."""
    opens = tuple((s - 1) % page_size == 0 for s in seq_cpu.tolist())
    return DecodePlan(sum(opens), page_size, opens_host=opens, device=seq_lens.device)
