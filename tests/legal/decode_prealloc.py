"""``decode_prealloc`` has no implementation of its own: the legal SWA allocator serves it.

The component is the PD decode node's scheduler (sglang_semantics.md §2.2-§2.6, §1.6): kvproof's
reference scheduler admits, preallocates, decodes, evicts, retracts and resumes, and the suite
replays every allocator call it makes on the implementation under test (``reference/registry.py``
lists the runtime layer as absent). What an implementation must provide is therefore an SWA
composite allocator declaring ``Component.DECODE_PREALLOC`` and the capabilities the node calls:
``ALLOC_DECODE``, ``CPU_COPY``, ``KV_BUFFER``, ``FREE_RELEASED_SWA``, and ``ALLOC`` at P == 1 or
``ALLOC_EXTEND`` + ``ALLOC_EXTEND_SWA_TAIL`` at P > 1 (docs/contract.md). The legal allocators of
:mod:`tests.legal.swa_allocator` do; these names let ``--impl tests.legal.decode_prealloc:fifo``
read as the component it checks.
"""

from __future__ import annotations

from .swa_allocator import fifo, lifo, randomized

__all__ = ["fifo", "lifo", "randomized"]
