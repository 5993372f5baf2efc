"""Configurations reject bad values with a ConfigError naming the model and the field."""

import pytest
from pydantic import ValidationError

from kvproof.reference.config import KVGeometry, PoolConfig
from kvproof.reference.decode_prealloc import DecodeConfig
from kvproof.reference.errors import ConfigError
from kvproof.reference.hisparse_host import Coordinator, HostPoolConfig

GOOD = dict(size_full=32, size_swa=16, page_size=4, sliding_window_size=6)


@pytest.mark.parametrize(
    ("change", "field", "why"),
    [
        ({"page_size": 0}, "page_size", "greater than 0, got 0"),
        ({"page_size": -4}, "page_size", "greater than 0, got -4"),
        ({"size_full": 30}, "size_full", "must be a multiple of page_size (4), got 30"),
        ({"size_swa": 18}, "size_swa", "must be a multiple of page_size (4), got 18"),
        ({"size_swa": 64}, "size_swa", "must not exceed size_full (32), got 64"),
        ({"sliding_window_size": 0}, "sliding_window_size", "greater than 0, got 0"),
        ({"size_full": 0}, "size_full", "greater than 0, got 0"),
        ({"extra": 1}, "extra", "Extra inputs are not permitted"),
        ({"page_size": 4.0}, "page_size", "valid integer, got 4.0"),
    ],
)
def test_bad_values_name_the_field(change: dict, field: str, why: str) -> None:
    with pytest.raises(ConfigError) as info:
        PoolConfig(**{**GOOD, **change})
    assert (info.value.model, info.value.field) == ("PoolConfig", field)
    assert str(info.value).startswith(f"PoolConfig.{field}: ") and why in str(info.value)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_every_bad_field_is_reported() -> None:
    with pytest.raises(ConfigError, match=r"^PoolConfig.size_full: .* \(also page_size: .*\)$") as info:
        PoolConfig(**{**GOOD, "size_full": 0, "page_size": 0})
    assert info.value.field == "size_full"


def test_size_swa_above_size_full_names_size_swa() -> None:
    with pytest.raises(ConfigError, match=r"^PoolConfig\.size_swa: must not exceed size_full \(8\), got 16$") as info:
        PoolConfig(size_full=8, size_swa=16, page_size=4, sliding_window_size=2)
    assert info.value.field == "size_swa"


def test_every_way_of_building_a_config_raises_config_error() -> None:
    bad = {**GOOD, "size_swa": 64}
    for build in (lambda: PoolConfig.model_validate(bad),
                  lambda: PoolConfig.model_validate_json('{"size_full": 32, "size_swa": 64, "page_size": 4, '
                                                         '"sliding_window_size": 6}'),
                  lambda: PoolConfig.model_validate_strings({k: str(v) for k, v in bad.items()})):
        with pytest.raises(ConfigError, match=r"^PoolConfig\.size_swa: must not exceed"):
            build()
    # strict in Python: a string is not an integer
    with pytest.raises(ConfigError, match=r"^PoolConfig\.size_full: Input should be a valid integer, got '32'"):
        PoolConfig.model_validate({k: str(v) for k, v in bad.items()})


def test_a_nested_config_is_named_by_its_path() -> None:
    with pytest.raises(ConfigError, match=r"^PoolConfig\.kv\.head_num: Input should be greater than or equal") as e:
        PoolConfig(**GOOD, kv={"head_num": 0})
    assert (e.value.model, e.value.field) == ("PoolConfig", "kv.head_num")
    # a nested model validator's own error is passed on as it is
    with pytest.raises(ConfigError, match=r"^KVGeometry\.full_attention_layer_ids: ") as e:
        PoolConfig(**GOOD, kv={"full_attention_layer_ids": (0, 1), "swa_attention_layer_ids": (1,)})
    assert (e.value.model, e.value.field) == ("KVGeometry", "full_attention_layer_ids")


def test_json_is_validated_as_json() -> None:
    """Strict models still take JSON arrays for tuples and strings for enums (vectors are JSON)."""
    cfg = PoolConfig.model_validate_json(PoolConfig(**GOOD).model_dump_json())
    assert cfg == PoolConfig(**GOOD) and cfg.kv.full_attention_layer_ids == (1,)
    host = HostPoolConfig(page_size=4, num_pages=8, max_req_slots=2, max_context_len=8)
    assert HostPoolConfig.model_validate_json(host.model_dump_json()) == host
    with pytest.raises(ConfigError, match=r"^HostPoolConfig\.coordinator: "):
        HostPoolConfig.model_validate_json(host.model_dump_json().replace('"paged"', '"tiled"'))


def test_layers_must_split_range() -> None:
    with pytest.raises(ConfigError, match=r"^KVGeometry\.full_attention_layer_ids: .* got full=\(0, 1\)") as info:
        KVGeometry(full_attention_layer_ids=(0, 1), swa_attention_layer_ids=(1,))
    assert info.value.field == "full_attention_layer_ids"
    with pytest.raises(ConfigError, match=r"^KVGeometry\.head_num: ") as info:
        KVGeometry(head_num=0)


@pytest.mark.parametrize(
    ("fields", "field", "why"),
    [
        ({"page_size": 0}, "page_size", "greater than or equal to 1, got 0"),
        ({"device_page_size": 6, "page_size": 4, "coordinator": Coordinator.PRE_23606}, "device_page_size",
         "must be a multiple of page_size (4), got 6"),
        ({"device_page_size": 8}, "device_page_size", "device_page_size 8 != page_size 4"),
        ({"coordinator": "paged"}, "coordinator", "instance of Coordinator"),
    ],
)
def test_host_pool_config_names_the_field(fields: dict, field: str, why: str) -> None:
    base = {"page_size": 4, "num_pages": 8, "max_req_slots": 2, "max_context_len": 8}
    with pytest.raises(ConfigError) as info:
        HostPoolConfig(**{**base, **fields})
    assert (info.value.model, info.value.field) == ("HostPoolConfig", field) and why in str(info.value)


def test_decode_config_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"^DecodeConfig\.clip_max_new_tokens: .*greater than or equal to 1"):
        DecodeConfig(clip_max_new_tokens=0)
    with pytest.raises(ConfigError, match=r"^DecodeConfig\.reserved_decode_tokens: "):
        DecodeConfig(reserved_decode_tokens=-1)


def test_derived_sizes() -> None:
    cfg = PoolConfig(**GOOD)
    assert (cfg.num_pages_full, cfg.num_pages_swa, cfg.mapping_len) == (8, 4, 37)
    assert cfg.label() == "P4-W6-F32-S16"
    with pytest.raises(ValidationError):
        cfg.page_size = 8  # frozen
