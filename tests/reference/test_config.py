"""PoolConfig rejects bad values with a message naming the field."""

import pytest
from pydantic import ValidationError

from kvproof.reference.config import KVGeometry, PoolConfig

GOOD = dict(size_full=32, size_swa=16, page_size=4, sliding_window_size=6)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"page_size": 0}, "page_size"),
        ({"page_size": -4}, "page_size"),
        ({"size_full": 30}, "size_full"),
        ({"size_swa": 18}, "size_swa"),
        ({"size_swa": 64}, "size_swa"),
        ({"sliding_window_size": 0}, "sliding_window_size"),
        ({"size_full": 0}, "size_full"),
        ({"extra": 1}, "extra"),
        ({"page_size": 4.0}, "page_size"),
    ],
)
def test_bad_values_name_the_field(change: dict, field: str) -> None:
    with pytest.raises(ValidationError) as info:
        PoolConfig(**{**GOOD, **change})
    assert field in str(info.value)


def test_layers_must_split_range() -> None:
    with pytest.raises(ValidationError, match="full_attention_layer_ids"):
        KVGeometry(full_attention_layer_ids=(0, 1), swa_attention_layer_ids=(1,))
    with pytest.raises(ValidationError, match="head_num"):
        KVGeometry(head_num=0)


def test_derived_sizes() -> None:
    cfg = PoolConfig(**GOOD)
    assert (cfg.num_pages_full, cfg.num_pages_swa, cfg.mapping_len) == (8, 4, 37)
    assert cfg.label() == "P4-W6-F32-S16"
    with pytest.raises(ValidationError):
        cfg.page_size = 8  # type: ignore[misc]  # frozen
