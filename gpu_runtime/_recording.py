"""What a graph capture records, for the loc cache's capture / replay (sglang_semantics.md §3.3 C3, §9 S6).

A CUDA graph records the kernels that a run launches and replays them later on
whatever their memory then holds; Python is not recorded. For the loc cache what
matters is which kernels a capture run launches:

* a translation that MISSES launches the gather ``M[x]`` into a fresh output tensor
  (the one the cache stores). The gather is recorded, so every replay re-gathers from
  the live static buffer and the live mapping tensor (C3);
* a translation that HITS launches nothing and hands out the cached tensor, so every
  replay reuses the values computed before the capture (the warm-up's: S6);
* ``set_kv_buffer`` launches its row writes, from the static K/V tensors, at the index
  tensor the translation handed out.

:class:`Recording` is that record for one capture. While a recording is active, the
pool hands each kernel-like effect to :meth:`Recording.launch` as a closure over the
tensors it uses. Emulated (CPU, or on request on CUDA), a launch does not take effect:
it is only appended, and :meth:`replay` re-executes the closures in order. Under a real
``torch.cuda.graph`` capture the closure runs at once -- the CUDA graph records its
kernels -- and is kept only so that the tensors it reads stay alive as long as the
graph (a hit's cached tensor would otherwise be freed at the next invalidation and
its memory reused while the graph still reads it).
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["Launch", "Recording"]

#: One kernel-like effect: a closure over the tensors it reads and writes.
Launch = Callable[[], object]


class Recording:
    """The launches of one capture run, in order; the gathers among them listed apart."""

    def __init__(self, *, emulate: bool) -> None:
        self.emulate = emulate  # True: record only (CPU emulation); False: run now (a CUDA graph records it)
        self.launches: list[Launch] = []
        self.gathers: list[Launch] = []

    def launch(self, fn: Launch, *, gather: bool = False) -> None:
        """Record ``fn``; run it now only when a real CUDA graph is capturing it."""
        self.launches.append(fn)
        if gather:
            self.gathers.append(fn)
        if not self.emulate:
            fn()

    def settle(self) -> None:
        """Run the recorded gathers once, eagerly, after the capture.

        [Differs from upstream: a recorded gather's output stays unwritten until the
        first replay, so the translation the cache holds right after a capture is
        garbage. The gathers write only their own fresh output tensors, so running
        them once changes nothing else, and the cache then holds ``M[static]`` -- what
        ``kvproof.reference.loc_cache.capture`` leaves in it.]
        """
        for fn in self.gathers:
            fn()

    def replay(self) -> None:
        """Re-execute the recorded launches in order (the emulated graph's replay)."""
        for fn in self.launches:
            fn()
