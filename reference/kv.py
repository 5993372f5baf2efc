"""KV rows of the full and SWA pools as a frozen value (sglang_semantics.md §2.8).

Each layer holds one row per pool slot: full-attention layers are indexed by full
slots (``size_full + P`` rows), sliding-window layers by SWA slots
(``size_swa + P`` rows), as in ``SWAKVPool``. A row is the K row followed by the
V row, flattened (``2 * head_num * head_dim`` numbers).

A row is *defined* only where the current owner of its page wrote it: written while
the page is held, and after the slot was last handed out. Rows of released pages
(``free``, ``free_swa``, ``free_full``, ``clear``, the pages ``restore_state`` gives
back) and of newly handed-out slots are forgotten (``None`` here): they hold whatever
an earlier owner left there, which depends on the implementation's page choice
(FIFO, LIFO, ...) and is never compared -- not even when a remap
(``set_full_to_swa_mapping``) points a live slot at a slot its owner never wrote
(issue 11, observation 1). Writes to the padding slot 0 (an SWA write through an
unmapped full slot, §1.4) are dropped for the same reason.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pydantic import BaseModel, ConfigDict

from kvproof.reference.config import PoolConfig

__all__ = ["KVStore", "Row", "empty_store", "forget_rows", "read_rows", "write_rows"]

Row = tuple[float, ...]


class KVStore(BaseModel):
    """``layers[layer_id][slot]`` is the row, or ``None`` when undefined."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[tuple[Row | None, ...], ...]


def empty_store(config: PoolConfig) -> KVStore:
    rows = []
    for layer_id in range(config.kv.num_layers):
        size = config.size_swa if config.kv.is_swa_layer(layer_id) else config.size_full
        rows.append((None,) * (size + config.page_size))
    return KVStore(layers=tuple(rows))


def write_rows(store: KVStore, layer_id: int, slots: Sequence[int], rows: Sequence[Row | None]) -> KVStore:
    """Write ``rows[i]`` at ``slots[i]`` of one layer; writes to slot 0 are dropped."""
    layer = list(store.layers[layer_id])
    for slot, row in zip(slots, rows, strict=True):
        if slot > 0:
            layer[slot] = row
    layers = list(store.layers)
    layers[layer_id] = tuple(layer)
    return store.model_copy(update={"layers": tuple(layers)})


def forget_rows(store: KVStore, layer_ids: Iterable[int], slots: Sequence[int]) -> KVStore:
    """Mark the rows at ``slots`` undefined in each of ``layer_ids`` (slots just handed out)."""
    if not slots:
        return store
    layers = list(store.layers)
    for layer_id in layer_ids:
        layer = list(layers[layer_id])
        for slot in slots:
            layer[slot] = None
        layers[layer_id] = tuple(layer)
    return store.model_copy(update={"layers": tuple(layers)})


def read_rows(store: KVStore, layer_id: int, slots: Sequence[int]) -> tuple[Row | None, ...]:
    layer = store.layers[layer_id]
    return tuple(layer[s] for s in slots)
