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

:func:`empty_store` validates; the operations build their results with
:func:`trusted_store`, without re-validation, and rebuild only the layers they change
(forgetting rows that are already undefined changes nothing and returns the store).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import is_not

from pydantic import BaseModel, ConfigDict

from kvproof.reference.config import PoolConfig
from kvproof.reference.paged import trusted

__all__ = ["KVStore", "Row", "any_defined", "empty_store", "forget_rows", "read_rows", "trusted_store", "write_rows"]

Row = tuple[float, ...]


class KVStore(BaseModel):
    """``layers[layer_id][slot]`` is the row, or ``None`` when undefined."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[tuple[Row | None, ...], ...]


def trusted_store(layers: tuple[tuple[Row | None, ...], ...]) -> KVStore:
    """A store derived from valid ones (as ``KVStore(layers=...)`` would build it)."""
    return trusted(KVStore, {"layers": layers}, {"layers"})


def empty_store(config: PoolConfig) -> KVStore:
    rows = []
    for layer_id in range(config.kv.num_layers):
        size = config.size_swa if config.kv.is_swa_layer(layer_id) else config.size_full
        rows.append((None,) * (size + config.page_size))
    return KVStore(layers=tuple(rows))


def write_rows(store: KVStore, *writes: tuple[int, Sequence[int], Sequence[Row | None]]) -> KVStore:
    """For each ``(layer_id, slots, rows)``, write ``rows[i]`` at ``slots[i]`` of that layer; writes to slot 0
    are dropped."""
    layers = list(store.layers)
    for layer_id, slots, rows in writes:
        layer = list(layers[layer_id])
        for slot, row in zip(slots, rows, strict=True):
            if slot > 0:
                layer[slot] = row
        layers[layer_id] = tuple(layer)
    return trusted_store(tuple(layers))


def forget_rows(store: KVStore, *groups: tuple[Iterable[int], Sequence[int]]) -> KVStore:
    """For each ``(layer_ids, slots)`` group, mark the rows at ``slots`` undefined in every layer of ``layer_ids``.

    Returns ``store`` itself when all of those rows already are undefined (the common
    case for slots just handed out: their page's rows were forgotten when it was released).
    """
    layers: list[tuple[Row | None, ...]] | None = None
    for layer_ids, slots in groups:
        if not slots:
            continue
        for layer_id in layer_ids:
            current = store.layers[layer_id] if layers is None else layers[layer_id]
            if not any(map(is_not, map(current.__getitem__, slots), repeat(None))):
                continue  # nothing defined there
            layer = list(current)
            for slot in slots:
                layer[slot] = None
            if layers is None:
                layers = list(store.layers)
            layers[layer_id] = tuple(layer)
    return store if layers is None else trusted_store(tuple(layers))


def read_rows(store: KVStore, layer_id: int, slots: Sequence[int]) -> tuple[Row | None, ...]:
    return tuple(map(store.layers[layer_id].__getitem__, slots))


def any_defined(store: KVStore, layer_id: int) -> bool:
    """Some row of the layer is defined (a check of every live row can skip a layer nobody wrote)."""
    layer = store.layers[layer_id]
    return layer.count(None) != len(layer)
