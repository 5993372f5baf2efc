"""Preconditions of the paged extends, vectorised (sglang_semantics.md §1.3, §2.7, §7 M5).

The same checks, in the same order and with the same op and argument names, as the
reference's ``_check_extend_args`` / ``_check_swa_continuation``
(``kvproof.reference.swa_allocator``), so that a misuse raises the same
``InvalidOperation`` in both. Rules that share an argument name are fused into one
reduction (the first failure would raise the same op and argument); the message is
worked out on the error path only. Host-side rules read the ``*_cpu`` twins. Nothing
here mutates state.
"""

from __future__ import annotations

import torch

from kvproof.gpu_runtime.paged import PagedTokenToKVPoolAllocator
from kvproof.reference.errors import require

__all__ = ["ExtendArgs", "check_extend_args", "check_swa_continuation"]

Tensor = torch.Tensor
#: ``(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc)`` as int64 tensors.
ExtendArgs = tuple[Tensor, Tensor, Tensor, Tensor, Tensor]


def check_extend_args(full: PagedTokenToKVPoolAllocator, op: str, args: ExtendArgs, extend_num_tokens: int) -> None:
    """Lengths, ``0 <= prefix <= seq``, U2, then every ``last_loc`` rule (reference order)."""
    pre, pre_cpu, seq, seq_cpu, last_loc = args
    bs = seq_cpu.numel()
    # one prefix, seq and last_loc per request (device tensors and host twins alike)
    require(pre_cpu.numel() == bs == last_loc.numel() == pre.numel() == seq.numel(), op, "seq_lens",
            f"prefix_lens, seq_lens, last_loc have lengths {pre_cpu.numel()}, {bs}, {last_loc.numel()}")
    if bs == 0:
        require(extend_num_tokens == 0, op, "extend_num_tokens", f"{extend_num_tokens} tokens for an empty batch")
        return
    ext_cpu = seq_cpu - pre_cpu
    # a request never shrinks, and prefixes are lengths
    require(int(torch.minimum(pre_cpu, ext_cpu).min()) >= 0, op, "seq_lens", "need 0 <= prefix_len <= seq_len")
    # U2: the caller's token count matches the batch
    total = int(ext_cpu.sum())
    require(extend_num_tokens == total, op, "extend_num_tokens", f"{extend_num_tokens} != sum(seq - prefix) = {total}")
    if not bool(pre_cpu.any()):
        # last_loc is -1 exactly for requests without a prefix
        require(not bool((last_loc != -1).any()), op, "last_loc", "must be -1 for a request without prefix")
        return
    _check_last_loc(full, op, pre, seq, pre_cpu, seq_cpu, last_loc)


def _check_last_loc(full: PagedTokenToKVPoolAllocator, op: str, pre: Tensor, seq: Tensor, pre_cpu: Tensor,
                    seq_cpu: Tensor, last_loc: Tensor) -> None:
    """-1 iff no prefix; else the last LIVE slot of its page, right before the new token; pages continued once."""
    p = full.page_size
    safe = last_loc.clamp(0, full.end_slot)  # out-of-range slots land on never-live pages 0 / num_pages + 1
    page, off = safe // p, safe % p
    rule = full.fill[page] == off + 1  # live, and the last live slot of its page
    if p > 1:  # (last_loc + 1) mod P == prefix_len mod P (SGLang's debug-mode check)
        rule &= (safe + 1) % p == pre % p
    ok = torch.where(pre > 0, rule, last_loc == -1)
    require(bool(ok.all()), op, "last_loc", lambda: _explain_last_loc(full, pre, last_loc, ok))
    if p == 1 or not bool(((pre_cpu % p != 0) & (seq_cpu > pre_cpu)).any()):
        return
    # two requests cannot continue the same partial page
    continued = page[(pre % p != 0) & (seq > pre)]
    require(torch.unique(continued).numel() == continued.numel(), op, "last_loc", "two requests continue the same page")


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


def check_swa_continuation(mapping: Tensor, page_size: int, op: str, args: ExtendArgs) -> None:
    """M5: a 1:1 extend that continues a partial page continues its SWA page, so ``M[last_loc] > 0``."""
    pre, pre_cpu, seq, seq_cpu, last_loc = args
    p = page_size
    if p == 1 or not bool(((pre_cpu % p != 0) & (seq_cpu > pre_cpu)).any()):
        return
    continues = (pre % p != 0) & (seq > pre)
    require(not bool((continues & (mapping[last_loc] <= 0)).any()), op, "last_loc",
            "continues a page whose SWA side is released (M[last_loc] == 0)")
