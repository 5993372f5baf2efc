"""Index tensors at addresses the harness chooses, so address reuse is reproducible (sglang_semantics.md §3.6 R2-a).

A pointer-keyed cache goes stale when a new index tensor lands at a freed tensor's
address; the CUDA caching allocator does this all the time, a test must do it on
purpose. :class:`IndexArena` materialises the storages of a
``kvproof.reference.index_memory.IndexMemory`` as torch tensors:

* on the CPU each storage is its own ``torch.frombuffer`` over a window of one
  ``bytearray``: distinct storages, each at the byte address the model says, and a
  storage created at a freed one's address really has that ``data_ptr()``;
* on an accelerator each storage is a slice of one device tensor: the addresses are
  the model's, but every storage shares the arena's ``untyped_storage()`` (a
  storage-base key then collides even more often than the model predicts).
"""

from __future__ import annotations

import torch

from kvproof.conformance.errors import HarnessBug

__all__ = ["IndexArena"]


class IndexArena:
    """``size`` bytes of index memory on ``device``; ``tensor(base, numel)`` is a storage at byte ``base``."""

    def __init__(self, device: str | torch.device, size: int = 1 << 20) -> None:
        self.device = torch.device(device)
        self.size = size
        if self.device.type == "cpu":
            self._bytes = bytearray(size)
            self._view = memoryview(self._bytes)
            self._device_arena: torch.Tensor | None = None
        else:
            self._device_arena = torch.zeros(size // 8, dtype=torch.int64, device=self.device)

    def tensor(self, base: int, contents: list[int]) -> torch.Tensor:
        """A new int64 storage holding ``contents`` at byte offset ``base`` of the arena."""
        n = len(contents)
        if base < 0 or base % 8 or base + 8 * n > self.size:
            raise HarnessBug(f"storage [{base}, {base + 8 * n}) does not fit the {self.size}-byte arena")
        if self._device_arena is None:
            t = torch.frombuffer(self._view[base:base + 8 * n], dtype=torch.int64)
        else:
            t = self._device_arena[base // 8:base // 8 + n]
        t.copy_(torch.tensor(contents, dtype=torch.int64))
        return t

    def address(self, t: torch.Tensor) -> int:
        """The arena offset of a tensor made here (its ``data_ptr()`` relative to the arena)."""
        origin = (torch.frombuffer(self._view, dtype=torch.uint8).data_ptr() if self._device_arena is None
                  else self._device_arena.data_ptr())
        return t.data_ptr() - origin
