"""Implementations that misbehave in ways only process isolation or custody checks catch (issue #11, obs. 2, 3, 6).

Importable as ``isolation_impls`` (tests put this folder on ``PYTHONPATH``) for ``kvproof conform --impl``.
Each is kvproof's own runtime with one method changed, so everything else conforms.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
import time

from kvproof.gpu_runtime.swa_allocator import SWATokenToKVPoolAllocator


class Exit0(SWATokenToKVPoolAllocator):
    """``sys.exit(0)`` in an operation: before #11, ``kvproof conform`` ended with exit code 0, a pass."""

    def alloc_extend(self, *args, **kwargs):
        sys.exit(0)


class Exit3(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        sys.exit(3)


class HardExit7(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        os._exit(7)


class Segfault(SWATokenToKVPoolAllocator):
    def alloc_extend(self, *args, **kwargs):
        ctypes.string_at(0)


def factory_blocks(config):
    """A factory that never returns (it ran outside any deadline before #11)."""
    time.sleep(3600)


def _swallow_forever() -> None:
    while True:
        with contextlib.suppress(BaseException):  # the point: the alarm fires once and is swallowed
            time.sleep(0.05)


class ConstructorBlocks(SWATokenToKVPoolAllocator):
    """A constructor that blocks and swallows the alarm: only the parent's deadline ends it."""

    def __init__(self, config):
        _swallow_forever()


class SwallowsBaseException(SWATokenToKVPoolAllocator):
    """An operation that retries forever, swallowing ``BaseException`` (the in-process alarm fires once)."""

    def alloc_extend(self, *args, **kwargs):
        _swallow_forever()


class MemoryHog(SWATokenToKVPoolAllocator):
    """An operation that allocates 16 MiB every 50 ms until it is stopped."""

    def alloc_extend(self, *args, **kwargs):
        hoard = []
        while True:
            hoard.append(bytearray(16 << 20))  # zero-filled: the pages are touched
            time.sleep(0.05)


# ---------------------------------------------------------------- writes into the caller's tensors (obs. 6)


class WritesSeqLens(SWATokenToKVPoolAllocator):
    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        out = super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        seq_lens.add_(1)
        return out


class WritesLastLoc(SWATokenToKVPoolAllocator):
    def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens):
        out = super().alloc_extend(prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens)
        last_loc.sub_(1)
        return out


class WritesFreeIndex(SWATokenToKVPoolAllocator):
    def free(self, free_index):
        super().free(free_index)
        free_index.fill_(0)


class WritesReturned(SWATokenToKVPoolAllocator):
    """Keeps the tensor ``alloc_extend`` handed out and scribbles over it on the next ``free``."""

    handed = None

    def alloc_extend(self, *args, **kwargs):
        out = super().alloc_extend(*args, **kwargs)
        self.handed = out
        return out

    def free(self, free_index):
        super().free(free_index)
        if self.handed is not None and self.handed.numel():
            self.handed.fill_(0)


class RaisesKeyboardInterrupt(SWATokenToKVPoolAllocator):
    """Indistinguishable from a real Ctrl-C: in-process, it stops the run (it is not turned into a verdict)."""

    def alloc_extend(self, *args, **kwargs):
        raise KeyboardInterrupt


class ExitsOnThirdExtend(SWATokenToKVPoolAllocator):
    """Conforms until its third ``alloc_extend``, then ends the process: a crash after several steps, whose report
    must hold every operation before it."""

    def alloc_extend(self, *args, **kwargs):
        self.extends = getattr(self, "extends", 0) + 1
        if self.extends == 3:
            os._exit(7)
        return super().alloc_extend(*args, **kwargs)
