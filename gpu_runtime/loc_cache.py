"""Engine hooks of the loc cache: the per-forward hook and the CUDA-graph runner (sglang_semantics.md §3.3, §9 S6).

* :class:`ModelRunner` is ``model_runner._forward_raw``: one ``invalidate_loc_cache()``
  per batch (point ``forward``), then each given layer's ``set_kv_buffer`` in ascending
  layer id order -- full layers at ``out_cache_loc``, SWA layers at its cached
  translation (the first SWA layer misses, the others hit: C2).
* :class:`GraphRunner` is a CUDA-graph runner: ``capture`` runs ``run_once``
  (point ``run_once``, then each layer's write from the static buffers) ``warmups``
  times eagerly, then once recorded; ``replay`` is a forward: the per-forward
  invalidation (#26152 moved it before the graph branch), then the recording
  re-executed on the static buffers' current contents. If the capture run's
  translation hit the cache (a ``run_once`` without invalidation), no gather was
  recorded and every replay writes SWA rows at the warm-up's translation (S6).

Recording is a real ``torch.cuda.CUDAGraph`` on CUDA and an emulation elsewhere (or on
request), with the same launches (:mod:`._recording`).

Invalidation is the owner's policy: the runners call ``invalidate(point)`` and the
allocator decides whether that point is on (a mutant switches one off). Arguments are
validated with ``kvproof.reference.loc_cache``'s op and argument names before any row
is written, so a rejected call writes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial

import torch

from kvproof.gpu_runtime._recording import Recording
from kvproof.gpu_runtime.paged import as_index
from kvproof.gpu_runtime.swa_kv_pool import SWAKVPool
from kvproof.reference.errors import InvalidOperation, require
from kvproof.reference.loc_cache import InvalidationPoint

__all__ = ["GraphRunner", "Invalidate", "LayerWrite", "ModelRunner", "check_forward"]

Tensor = torch.Tensor
#: The owner's invalidation call site: drops the pool's cache if ``point`` is on.
Invalidate = Callable[[InvalidationPoint], None]
Rows = Mapping[int, Tensor]


@dataclass(frozen=True, slots=True)
class LayerWrite:
    """One layer's validated write: its index in its pool, whether it is SWA, and its K / V rows."""

    index: int
    is_swa: bool
    k: Tensor
    v: Tensor


def check_forward(pool: SWAKVPool, loc: Tensor, cache_k: Rows, cache_v: Rows) -> list[LayerWrite]:
    """The reference's checks in its order: the batch's slots first (op ``forward``, argument
    ``out_cache_loc``: live or padding 0, distinct), then each layer's ``set_kv_buffer`` checks
    (layer id, rows), ascending.
    """
    require(set(cache_k) == set(cache_v), "forward", "cache_v", f"layers {sorted(cache_v)} != {sorted(cache_k)}")
    pool.check_loc("forward", loc, "out_cache_loc")
    return [LayerWrite(*pool.check_rows("set_kv_buffer", layer_id, loc, cache_k[layer_id], cache_v[layer_id]))
            for layer_id in sorted(cache_k)]


class ModelRunner:
    """The eager forward: invalidate once per batch, then write every layer through the cached translation."""

    def __init__(self, pool: SWAKVPool, invalidate: Invalidate) -> None:
        self.pool, self._invalidate = pool, invalidate

    def forward(self, out_cache_loc: Tensor, cache_k: Rows, cache_v: Rows) -> None:
        """One batch whose new tokens sit at full slots ``out_cache_loc`` (padding 0 allowed)."""
        self._invalidate(InvalidationPoint.FORWARD)  # before anything else, as _forward_raw (#26152)
        loc = as_index(out_cache_loc, self.pool.device)  # the tensor itself when it fits: its address is the key
        for w in check_forward(self.pool, loc, cache_k, cache_v):
            self.pool.store(w.index, w.is_swa, loc, w.k, w.v)


@dataclass(slots=True)
class CapturedGraph:
    """A capture: the static buffers, what ``run_once`` writes, the mapping tensor it gathers from, its recording
    (plus the CUDA graph, if real)."""

    loc: Tensor
    writes: list[LayerWrite]
    mapping: Tensor
    recording: Recording
    cuda_graph: torch.cuda.CUDAGraph | None = None

    def replay(self) -> None:
        if self.cuda_graph is not None:
            self.cuda_graph.replay()
        else:
            self.recording.replay()


class GraphRunner:
    """Capture ``run_once`` on static buffers; replay it as a forward (C3, S6).

    ``emulate``: ``None`` records a real CUDA graph on CUDA and emulates elsewhere;
    ``True`` emulates on any device (to compare the emulation with a real graph).
    """

    def __init__(self, pool: SWAKVPool, invalidate: Invalidate, *, emulate: bool | None = None) -> None:
        self.pool, self._invalidate = pool, invalidate
        self.emulate = pool.device.type != "cuda" if emulate is None else emulate
        self.graph: CapturedGraph | None = None

    def capture(self, static_loc: Tensor, static_k: Rows, static_v: Rows, warmups: int = 2) -> None:
        """``warmups`` eager ``run_once`` runs, then one recorded; replaces an earlier graph.

        ``static_loc`` is the runner's own buffer: an int64 1-D tensor on the pool's
        device holding padding (0) while capturing; the static K / V tensors are on
        that device too (a capture cannot copy from the host). Replays read all three
        as they are then.
        """
        op = "capture"
        loc = static_loc
        require(isinstance(loc, Tensor) and loc.dtype == torch.int64 and loc.dim() == 1
                and loc.device == self.pool.device, op, "loc", f"not an int64 1-D tensor on {self.pool.device}")
        require(not bool(loc.any()), op, "loc", "capture runs on a padding buffer (all 0)")
        require(warmups >= 0, op, "warmups", f"must be >= 0, got {warmups}")
        writes = self._check_static(op, loc, static_k, static_v)
        mapping = self.pool.require_mapping(op)  # the tensor the graph gathers from
        self.graph = None  # from here on the old graph is gone, as a runner re-capturing drops it
        run_once = partial(self._run_once, loc, writes)
        self.graph = self._record_emulated(loc, writes, mapping, run_once, warmups) if self.emulate \
            else self._record_cuda(loc, writes, mapping, run_once, warmups)

    def replay(self) -> None:
        """The per-forward invalidation (point ``forward``), then the recording on the buffers' current contents."""
        graph = self.graph
        if graph is None:
            raise InvalidOperation("replay", "graph", "nothing was captured")
        self.pool.check_loc("replay", graph.loc, "out_cache_loc")
        self._replay_invalidation()
        self._follow_mapping(graph)
        graph.replay()

    # ------------------------------------------------------------ internals

    def _replay_invalidation(self) -> None:
        """A replay is a forward: point ``forward``, before the graph branch (#26152 moved it there)."""
        self._invalidate(InvalidationPoint.FORWARD)

    def _follow_mapping(self, graph: CapturedGraph) -> None:
        """Bring the mapping tensor the graph gathers from up to date, if ``register_mapping`` installed another.

        [Differs from a bare CUDA graph, which keeps gathering from the tensor it was
        captured with: the reference's replays read the live mapping. Costs one copy of
        M per replay, and only after a ``register_mapping`` that followed the capture.]
        """
        live = self.pool.full_to_swa_index_mapping
        if live is not None and live is not graph.mapping:
            graph.mapping.copy_(live)

    def _check_static(self, op: str, loc: Tensor, static_k: Rows, static_v: Rows) -> list[LayerWrite]:
        require(set(static_k) == set(static_v), op, "static_v", f"layers {sorted(static_v)} != {sorted(static_k)}")
        writes = []
        for layer_id in sorted(static_k):
            k, v = static_k[layer_id], static_v[layer_id]
            require(isinstance(k, Tensor) and isinstance(v, Tensor) and k.device == v.device == self.pool.device,
                    op, "static_k", f"layer {layer_id}: static rows must be tensors on {self.pool.device}")
            index, is_swa, k, v = self.pool.check_rows(op, layer_id, loc, k, v)
            writes.append(LayerWrite(index, is_swa, k, v))
        return writes

    def _run_once(self, loc: Tensor, writes: list[LayerWrite]) -> None:
        """The runner's closure: invalidate (point ``run_once``), then every layer's write from the static buffers."""
        self._invalidate(InvalidationPoint.RUN_ONCE)
        for w in writes:
            self.pool.store(w.index, w.is_swa, loc, w.k, w.v)

    def _record_emulated(self, loc: Tensor, writes: list[LayerWrite], mapping: Tensor, run_once: Callable[[], None],
                         warmups: int) -> CapturedGraph:
        for _ in range(warmups):
            run_once()
        with self.pool.recording(Recording(emulate=True)) as recording:
            run_once()
        recording.settle()
        return CapturedGraph(loc, writes, mapping, recording)

    def _record_cuda(self, loc: Tensor, writes: list[LayerWrite], mapping: Tensor, run_once: Callable[[], None],
                     warmups: int) -> CapturedGraph:
        device = self.pool.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-ups on a side stream, as torch asks before a capture
            for _ in range(warmups):
                run_once()
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), self.pool.recording(Recording(emulate=False)) as recording:
            run_once()
        recording.settle()
        return CapturedGraph(loc, writes, mapping, recording, graph)
