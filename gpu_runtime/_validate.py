"""Preconditions of the paged extends, vectorised (sglang_semantics.md §1.3, §2.7, §7 M5).

The same checks, in the same order and with the same op and argument names, as the
reference's ``_check_extend_args`` / ``_check_swa_continuation``
(``kvproof.reference.swa_allocator``), so that a misuse raises the same
``InvalidOperation`` in both. Nothing here mutates state.

* Host rules (lengths, ``0 <= prefix <= seq``, U2, and which requests have a prefix or
  continue a partial page) read the ``*_cpu`` twins as Python lists (:class:`HostBatch`):
  no tensor op, no sync. The twins hold the device tensors' values (SGLang's contract).
* Device rules on ``last_loc`` (``-1`` iff no prefix, else the last live slot of its
  page, right before the new token) are fused into one comparison of a per-request
  code with the code the host expects, one sync; the distinct-pages rule and M5 run
  only when the host sees a request that continues a page.
* Rules that share an argument name are fused (the first failure would raise the same
  op and argument); the message is worked out on the error path only.
"""

from __future__ import annotations

import torch

from kvproof.gpu_runtime._geometry import host_tensor
from kvproof.gpu_runtime.paged import PagedTokenToKVPoolAllocator
from kvproof.reference.errors import InvalidOperation, require

__all__ = ["ExtendArgs", "HostBatch", "check_extend_args", "check_swa_continuation", "host_batch"]

Tensor = torch.Tensor
#: ``(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)`` as int64 tensors.
ExtendArgs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


class HostBatch:
    """The ``*_cpu`` twins of a batch as Python ints (read once per call)."""

    __slots__ = ("_continuing", "pre", "seq")

    def __init__(self, pre: list[int], seq: list[int]) -> None:
        self.pre, self.seq = pre, seq
        self._continuing: tuple[int, list[int]] | None = None

    def continuing(self, page_size: int) -> list[int]:
        """Requests whose part 1 continues ``last_loc``'s partial page (``pre % P != 0`` and ``seq > pre``)."""
        if self._continuing is None or self._continuing[0] != page_size:
            pairs = enumerate(zip(self.pre, self.seq, strict=True))
            self._continuing = (page_size, [i for i, (pre, seq) in pairs if pre % page_size and seq > pre])
        return self._continuing[1]


def host_batch(args: ExtendArgs) -> HostBatch:
    return HostBatch(args[1].tolist(), args[3].tolist())


def check_extend_args(full: PagedTokenToKVPoolAllocator, op: str, args: ExtendArgs, extend_num_tokens: int,
                      host: HostBatch | None = None) -> None:
    """Lengths, ``0 <= prefix <= seq``, U2, then every ``last_loc`` rule (reference order)."""
    pre, _, seq, _, last_loc = args
    host = host_batch(args) if host is None else host
    bs, n_pre = len(host.seq), len(host.pre)
    # one prefix, seq and last_loc per request (device tensors and host twins alike)
    if not n_pre == bs == last_loc.numel() == pre.numel() == seq.numel():
        raise InvalidOperation(op, "seq_lens",
                               f"prefix_lens, seq_lens, last_loc have lengths {n_pre}, {bs}, {last_loc.numel()}")
    if bs == 0:
        require(extend_num_tokens == 0, op, "extend_num_tokens", f"{extend_num_tokens} tokens for an empty batch")
        return
    # a request never shrinks, and prefixes are lengths
    require(all(0 <= p <= s for p, s in zip(host.pre, host.seq, strict=True)), op, "seq_lens",
            "need 0 <= prefix_len <= seq_len")
    # U2: the caller's token count matches the batch
    total = sum(host.seq) - sum(host.pre)
    if extend_num_tokens != total:
        raise InvalidOperation(op, "extend_num_tokens", f"{extend_num_tokens} != sum(seq - prefix) = {total}")
    if not any(host.pre):
        # last_loc is -1 exactly for requests without a prefix
        all_minus_one = int(last_loc) == -1 if bs == 1 else torch.equal(last_loc, last_loc.new_full((bs,), -1))
        require(all_minus_one, op, "last_loc", "must be -1 for a request without prefix")
        return
    _check_last_loc(full, op, pre, host, last_loc)


def _check_last_loc(full: PagedTokenToKVPoolAllocator, op: str, pre: Tensor, host: HostBatch,
                    last_loc: Tensor) -> None:
    """-1 iff no prefix; else the last LIVE slot of its page, right before the new token; pages continued once.

    A request with a prefix ``n`` needs ``last_loc`` at offset ``e = (n - 1) mod P`` of a
    page with ``fill == e + 1`` (live and last: ``fill == offset + 1``; right before the
    new token: ``(last_loc + 1) mod P == n mod P``). So the code ``offset + P * fill``
    must equal ``e + P * (e + 1)`` (offset < P, so the code determines both); a request
    without prefix compares ``last_loc`` itself with ``-1``.
    """
    p = full.page_size
    safe = last_loc.clamp(0, full.end_slot)  # out-of-range slots land on never-live pages 0 / num_pages + 1
    if p == 1:
        page, code = safe, full.fill.index_select(0, safe)  # offset 0, so the code is fill (1 when live)
    else:
        page = torch.div(safe, p, rounding_mode="floor")
        code = torch.add(safe.remainder(p), full.fill.index_select(0, page), alpha=p)
    expected = [(n - 1) % p * (p + 1) + p if n > 0 else -1 for n in host.pre]
    if not all(host.pre):
        code = torch.where(pre > 0, code, last_loc)
    want: Tensor | int = host_tensor(expected, code.device) if len(expected) > 1 else expected[0]
    ok = torch.equal(code, want) if isinstance(want, Tensor) else int(code) == want  # the one sync
    if not ok:
        raise InvalidOperation(op, "last_loc", _explain_last_loc(full, pre, last_loc, code == want))
    cont = host.continuing(p)
    if p == 1 or len(cont) < 2:
        return
    # two requests cannot continue the same partial page
    continued = page if len(cont) == len(expected) else page.index_select(0, host_tensor(cont, page.device))
    require(torch.unique(continued).numel() == len(cont), op, "last_loc", "two requests continue the same page")


def _explain_last_loc(full: PagedTokenToKVPoolAllocator, pre: Tensor, last_loc: Tensor, ok: Tensor) -> str:
    """Which rule the first bad request breaks (error path only)."""
    i = int((~ok).nonzero()[0])
    loc, n, p = int(last_loc[i]), int(pre[i]), full.page_size
    if (loc == -1) != (n == 0):
        return f"{loc} for prefix_len {n}: must be -1 iff prefix_len == 0"
    if not bool(full.live_mask(last_loc[i:i + 1]).all()):
        return f"slot {loc} is not a live slot of the full pool"
    if (loc + 1) % p != n % p:
        return f"(last_loc + 1) mod P = {(loc + 1) % p} != prefix_len mod P = {n % p}"
    return f"slot {loc} is not the last live slot of page {loc // p}"


def check_swa_continuation(mapping: Tensor, page_size: int, op: str, args: ExtendArgs,
                           host: HostBatch | None = None) -> None:
    """M5: a 1:1 extend that continues a partial page continues its SWA page, so ``M[last_loc] > 0``."""
    last_loc, p = args[4], page_size
    if p == 1:
        return
    cont = (host_batch(args) if host is None else host).continuing(p)
    if not cont:
        return
    locs = last_loc if len(cont) == last_loc.numel() else last_loc.index_select(0, host_tensor(cont, last_loc.device))
    require(int(mapping.index_select(0, locs).min()) > 0, op, "last_loc",
            "continues a page whose SWA side is released (M[last_loc] == 0)")
