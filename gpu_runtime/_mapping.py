"""Ghost page owners and the live-mapping check of the SWA composite (sglang_semantics.md §1.5, §7 M2, M5, G3).

SGLang has no page owners. kvproof's reference does (ghost state of
``kvproof.reference.swa_allocator``), and validates ``set_full_to_swa_mapping`` with
them (``check_live_mapping``, here too, with the same errors): the new live mapping must keep

* M2 -- a live full slot maps into an *allocated* SWA page of the *same owner*, and no
  two live full slots share an SWA slot;
* M5 -- a full slot and its SWA slot have the same in-page offset, and one SWA page
  pairs with one full page;
* G3 (SWA side) -- every allocated SWA page is reached from a live full slot.

:class:`Owners` keeps one int64 label per page of each pool, handed out as the
reference's ``_resolve_owners`` does: a request that continues a page keeps the owner
of its ``last_loc``'s page, a new one gets a fresh label. Labels are only compared for
equality, so they need not be the reference's numbers. A page's label is written when
it is taken and never cleared: only allocated pages' labels are ever read.
"""

from __future__ import annotations

import torch

from kvproof.gpu_runtime._geometry import host_tensor, page_offsets
from kvproof.gpu_runtime.paged import PagedTokenToKVPoolAllocator
from kvproof.reference.errors import InvariantViolation
from kvproof.reference.swa_allocator import check_live_pairs

__all__ = ["Owners", "check_live_mapping"]

Tensor = torch.Tensor


class Owners:
    """Ghost owner label of every page of the full and the SWA pool (index ``num_pages + 1``: never allocated).

    Cheap on the hot path: one new request (every prefill chunk that starts a request,
    every bulk ``alloc``) costs two ``index_fill_`` on the pages taken; a batch labels its
    new pages (per-request labels spread by the host's page counts) with two
    ``index_put_``, and pages it only continues keep their label.
    """

    def __init__(self, full_pages: int, swa_pages: int, device: torch.device) -> None:
        self.full = torch.zeros(full_pages + 2, dtype=torch.int64, device=device)
        self.swa = torch.zeros(swa_pages + 2, dtype=torch.int64, device=device)
        self.next_label = 1

    def fresh(self) -> int:
        """A new label (a new request, a bulk ``alloc``)."""
        self.next_label += 1
        return self.next_label - 1

    def of_requests(self, pre: Tensor, pre_cpu: Tensor, last_loc: Tensor, page_size: int) -> int | Tensor:
        """Per request: the owner of ``last_loc``'s page if it has a prefix, else a fresh label (in request order).

        One request: an ``int`` when it is new (known on the host), else its page's label
        as a 1-element tensor. A batch: one label per request. Which requests are new is
        read from the host twin ``pre_cpu`` (``pre`` holds the same values).
        """
        pre_l = pre_cpu.tolist()
        if len(pre_l) == 1:
            return self.fresh() if pre_l[0] == 0 else self._of_pages(last_loc, page_size)
        new = [i for i, n in enumerate(pre_l) if n == 0]  # host
        if not new:  # every request continues (a decode batch)
            return self._of_pages(last_loc, page_size)
        first = self.next_label
        self.next_label += len(new)
        if len(new) == len(pre_l):  # every request is new (a prefill batch)
            return torch.arange(first, self.next_label, device=self.full.device)
        labels = self._of_pages(last_loc.clamp(min=0), page_size)
        which, fresh = host_tensor([new, list(range(first, self.next_label))], labels.device)
        return labels.index_copy_(0, which, fresh)

    def _of_pages(self, slots: Tensor, page_size: int) -> Tensor:
        """The full-pool owner label of each slot's page."""
        pages = slots if page_size == 1 else torch.div(slots, page_size, rounding_mode="floor")
        return self.full.index_select(0, pages)

    def claim_pages(self, full_pages: Tensor, swa_pages: Tensor, label: int | Tensor) -> None:
        """Whole new pages of one owner."""
        if isinstance(label, int):
            self.full.index_fill_(0, full_pages, label)
            self.swa.index_fill_(0, swa_pages, label)
        else:
            self.full.index_put_((full_pages,), label)
            self.swa.index_put_((swa_pages,), label)

    def claim_slots(self, full: Tensor, swa: Tensor, labels: Tensor, page_size: int) -> None:
        """The pages of the new ``full`` / ``swa`` slots belong to ``labels`` (one per slot; 1:1 allocations)."""
        if page_size > 1:
            full, swa = full // page_size, swa // page_size
        self.full.index_put_((full,), labels)
        self.swa.index_put_((swa,), labels)


def check_live_mapping(full: PagedTokenToKVPoolAllocator, swa: PagedTokenToKVPoolAllocator, mapping: Tensor,
                       owners: Owners) -> None:
    """The reference's ``check_live_mapping`` on ``mapping``: :class:`InvariantViolation` naming the first broken rule.

    One fused reduction decides whether any rule breaks (:func:`_rules_hold`); only then
    are the rules taken one by one (:func:`_first_broken_rule`) and the live pairs brought
    to the host and checked slot by slot with the reference's own rules
    (``kvproof.reference.swa_allocator.check_live_pairs``), so the error and its message
    are the reference's for the same violation. Entries ``<= 0`` are not checked here (M1 is).
    """
    p, n = full.page_size, full.num_pages
    # the real slots P .. end_slot, page by page: live (offset < fill) and mapped (M > 0)
    live = (page_offsets(p, mapping.device) < full.fill[1:n + 1].unsqueeze(1)).view(-1)
    m = mapping[p:full.end_slot]
    at = live.logical_and_(m > 0).nonzero().view(-1)
    f, s = at + p, m.index_select(0, at)
    if _rules_hold(f, s, p, swa, owners):
        return
    fill, labels = swa.fill.tolist(), owners.swa.tolist()
    swa_owner = {h: labels[h] for h in range(1, swa.num_pages + 1) if fill[h] > 0}
    check_live_pairs(p, zip(f.tolist(), s.tolist(), strict=True), owners.full.tolist(), swa_owner)
    # the per-slot rules passed where a reduction failed: only a broken pool gets here (a live page 0, G1)
    broken = _first_broken_rule(f, s, p, swa, owners)
    if broken is not None:  # always: _rules_hold fails exactly when a rule breaks
        raise InvariantViolation(*broken)


def _rules_hold(f: Tensor, s: Tensor, p: int, swa: PagedTokenToKVPoolAllocator, owners: Owners) -> bool:
    """Whether the live pairs ``(f, s)`` keep every rule of :func:`_first_broken_rule`, in one reduction.

    "No two live slots share an SWA slot" is not computed: it follows from M5 (same
    offset, one full page per SWA page). One SWA page pairs with one full page iff each
    pair finds its own full page in a table written at every pair's SWA page (whichever
    write wins, a second full page makes some pair miss); that table also marks the SWA
    pages reached (G3: full pages are >= 1).
    """
    if p == 1:
        g, h = f, s.clamp(max=swa.num_pages + 1)
    else:
        g = torch.div(f, p, rounding_mode="floor")
        h = torch.div(s, p, rounding_mode="floor").clamp_(max=swa.num_pages + 1)
    paired = torch.zeros_like(swa.fill).index_put_((h,), g)
    rules = [
        swa.fill.index_select(0, h) > 0,  # M2: into an allocated SWA page
        owners.swa.index_select(0, h) == owners.full.index_select(0, g),  # M2: of the same owner
        paired.index_select(0, h) == g,  # M5: one full page per SWA page
        (paired != 0).logical_or_(swa.fill == 0),  # G3: every allocated SWA page reached
    ]
    if p > 1:
        rules.append(s.remainder(p) == f.remainder(p))  # M5: same offset
    return bool(torch.cat(rules).all())


def _first_broken_rule(f: Tensor, s: Tensor, p: int, swa: PagedTokenToKVPoolAllocator,
                       owners: Owners) -> tuple[str, str] | None:
    """``(invariant, what)`` of the first rule the live pairs ``(f, s)`` break, by reductions; ``None`` if none."""
    g, h = f // p, (s // p).clamp(max=swa.num_pages + 1)  # past the pool: the never-allocated extra page
    # M2: a live slot maps into an allocated SWA page of its own owner, and no two live slots share an SWA slot
    if not bool((swa.fill[h] > 0).all()):
        return "M2", "a live full slot maps to an SWA slot outside every allocated SWA page"
    if not bool((owners.swa[h] == owners.full[g]).all()):
        return "M2", "a live full slot maps into an SWA page of another owner"
    if torch.unique(s).numel() != s.numel():
        return "M2", "two live full slots map to one SWA slot"
    # M5: same offset in page, one SWA page pairs with one full page
    if not bool((s % p == f % p).all()):
        return "M5", "a full slot and its SWA slot differ in page offset"
    pairs = torch.unique(torch.stack((h, g)), dim=1)
    if torch.unique(pairs[0]).numel() != pairs.shape[1]:
        return "M5", "an SWA page is shared by two full pages"
    reached = torch.zeros_like(swa.fill, dtype=torch.bool)
    reached[h] = True
    # G3 (SWA side): an allocated SWA page is reachable from a live full slot, else it leaked
    if bool(((swa.fill > 0) & ~reached).any()):
        return "G3", "SWA pages allocated but mapped from no live full slot"
    return None
