"""Frozen, validated configuration of an SWA hybrid KV pool (sglang_semantics.md §1.3-§1.5).

A :class:`PoolConfig` describes one ``SWATokenToKVPoolAllocator`` + ``SWAKVPool``
pair: the full and SWA pool sizes in tokens, the page size, the sliding window,
and the geometry of the KV rows.

Every configuration model of the reference (these two, ``HostPoolConfig``,
``DecodeConfig``) is a :class:`ConfigModel`: a bad value is rejected at construction
(``Model(...)``, ``model_validate``, ``model_validate_json``) with a
:class:`~kvproof.reference.errors.ConfigError` naming the model and the field, e.g.
``PoolConfig.size_swa: must not exceed size_full (16), got 32`` -- a ``ValueError``,
as pydantic's ``ValidationError`` it replaces.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import ErrorDetails

from kvproof.reference.errors import ConfigError

__all__ = ["ConfigModel", "KVGeometry", "PoolConfig"]

_FROZEN = ConfigDict(frozen=True, extra="forbid", strict=True)


class ConfigModel(BaseModel):
    """A configuration: every invalid construction raises :class:`ConfigError` naming the model and the field.

    Field constraints (``gt=0`` ...) and type errors are translated from pydantic's
    ``ValidationError``; model validators raise ``ConfigError`` themselves, and the
    one they raise is what the caller gets (also from a nested configuration). A nested
    configuration's field error names the outer model and the path (``PoolConfig.kv.head_num``).
    """

    def __init__(self, /, **data: Any) -> None:
        with _config_errors(type(self)):
            super().__init__(**data)

    # Validation stays pydantic's own: without this flag pydantic would route every validation
    # (model_validate_json, nested models) through this __init__, in Python mode, where a strict
    # model rejects JSON arrays as tuples and strings as enums. pydantic's RootModel sets it too.
    __init__.__pydantic_base_init__ = True  # type: ignore[attr-defined]  # pydantic's marker, not a typed attribute

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        with _config_errors(cls):
            return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> Self:
        with _config_errors(cls):
            return super().model_validate_json(json_data, **kwargs)

    @classmethod
    def model_validate_strings(cls, obj: Any, **kwargs: Any) -> Self:
        with _config_errors(cls):
            return super().model_validate_strings(obj, **kwargs)


@contextmanager
def _config_errors(model: type[BaseModel]) -> Iterator[None]:
    """Re-raise pydantic's ``ValidationError`` as one :class:`ConfigError` (first error named, others listed)."""
    try:
        yield
    except ValidationError as err:
        raise _config_error(model.__name__, err) from None


def _config_error(model: str, err: ValidationError) -> ConfigError:
    first, *rest = err.errors(include_url=False)
    raised = first.get("ctx", {}).get("error")
    if isinstance(raised, ConfigError) and not rest:
        return raised  # a model validator's own error (of this model, or of a nested one built from a dict)
    also = "; ".join(f"{_field(e) or model}: {_describe(e)}" for e in rest)
    return ConfigError(model, _field(first), _describe(first) + (f" (also {also})" if also else ""))


def _field(error: ErrorDetails) -> str:
    return ".".join(str(part) for part in error["loc"])


def _describe(error: ErrorDetails) -> str:
    """What is wrong with one field: a validator's own message, or pydantic's with the value it got."""
    raised = error.get("ctx", {}).get("error")
    if isinstance(raised, ConfigError):
        return str(raised)
    if error["type"] == "missing":
        return "required"
    return f"{error['msg']}, got {error['input']!r}"


class KVGeometry(ConfigModel):
    """Shape of the KV rows: per layer one K and one V row of ``head_num x head_dim``.

    Layer ids ``0..n-1`` are split between full-attention and sliding-window layers,
    as ``SWAKVPool(swa_attention_layer_ids, full_attention_layer_ids)`` does.
    """

    model_config = _FROZEN

    head_num: int = Field(default=1, ge=1, description="KV heads per layer")
    head_dim: int = Field(default=2, ge=1, description="elements per head")
    full_attention_layer_ids: tuple[int, ...] = Field(default=(1,), min_length=1)
    swa_attention_layer_ids: tuple[int, ...] = Field(default=(0,), min_length=1)
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"

    @model_validator(mode="after")
    def _layers_partition_range(self) -> KVGeometry:
        full, swa = self.full_attention_layer_ids, self.swa_attention_layer_ids
        both = sorted(full + swa)
        # each layer id is exactly one kind, ids are 0..n-1
        if both != list(range(len(both))):
            raise ConfigError("KVGeometry", "full_attention_layer_ids",
                              "full_attention_layer_ids and swa_attention_layer_ids must split 0..n-1 "
                              f"without overlap, got full={full} swa={swa}")
        return self

    @property
    def num_layers(self) -> int:
        return len(self.full_attention_layer_ids) + len(self.swa_attention_layer_ids)

    @property
    def row_width(self) -> int:
        """Elements of one K (or V) row."""
        return self.head_num * self.head_dim

    def is_swa_layer(self, layer_id: int) -> bool:
        return layer_id in self.swa_attention_layer_ids


class PoolConfig(ConfigModel):
    """One SWA composite pool: full pool, SWA pool, page size, window, KV geometry.

    Sizes are in tokens, as SGLang's ``size`` / ``size_swa``. Page 0 (slots
    ``0..P-1``) is reserved in both pools (§1.4), so the KV buffers hold
    ``size + P`` rows and the mapping ``size_full + P + 1`` entries (§1.5).
    """

    model_config = _FROZEN

    size_full: int = Field(gt=0, description="full-attention pool size in tokens")
    size_swa: int = Field(gt=0, description="sliding-window pool size in tokens")
    page_size: int = Field(gt=0, description="tokens per page (P)")
    sliding_window_size: int = Field(gt=0, description="sliding window in tokens (W)")
    kv: KVGeometry = KVGeometry()
    #: the per-request SWA ring of SGLang 0.5.23 (``BaseSWAKVPool.swa_req_ring_size``, set only by DeepSeek-V4's
    #: pool): ``None`` = the paged SWA pool; else every request slot owns a ring of this many tokens
    swa_ring_size: int | None = Field(default=None, gt=0, description="per-request SWA ring in tokens (ring mode)")
    #: request slots (``ReqToTokenPool`` size) the ring is counted in; set exactly when ``swa_ring_size`` is
    num_req_slots: int | None = Field(default=None, gt=0, description="request slots of the ring (ring mode only)")

    @model_validator(mode="after")
    def _ring_has_slots(self) -> PoolConfig:
        # ring capacity is counted in request slots (SGLang asserts a req_to_token_pool in ring mode)
        if self.swa_ring_size is not None and self.num_req_slots is None:
            raise ConfigError("PoolConfig", "num_req_slots",
                              f"required with swa_ring_size ({self.swa_ring_size}): the ring is counted in request "
                              "slots")
        if self.swa_ring_size is None and self.num_req_slots is not None:
            raise ConfigError("PoolConfig", "num_req_slots",
                              f"only with swa_ring_size (a ring config), got {self.num_req_slots}")
        return self

    @model_validator(mode="after")
    def _sizes_fit_pages(self) -> PoolConfig:
        p = self.page_size
        # a pool is a whole number of pages (the paged allocator floors size / P)
        if self.size_full % p:
            raise ConfigError("PoolConfig", "size_full", f"must be a multiple of page_size ({p}), got {self.size_full}")
        if self.size_swa % p:
            raise ConfigError("PoolConfig", "size_swa", f"must be a multiple of page_size ({p}), got {self.size_swa}")
        # every SWA slot pairs with a full slot, so a larger SWA pool can never be used
        if self.size_swa > self.size_full:
            raise ConfigError("PoolConfig", "size_swa",
                              f"must not exceed size_full ({self.size_full}), got {self.size_swa}")
        return self

    @property
    def num_pages_full(self) -> int:
        return self.size_full // self.page_size

    @property
    def num_pages_swa(self) -> int:
        return self.size_swa // self.page_size

    @property
    def mapping_len(self) -> int:
        """Length of ``full_to_swa_index_mapping``: one entry per full slot plus the -1 sentinel."""
        return self.size_full + self.page_size + 1

    @property
    def ring(self) -> bool:
        """Ring mode: the SWA side is a per-request-slot ring, not the paged SWA pool (sglang_semantics.md §1.5;
        0.5.23 ``SWATokenToKVPoolAllocator._swa_req_ring``)."""
        return self.swa_ring_size is not None

    @property
    def swa_ring_cost(self) -> int:
        """Tokens one request slot's ring costs: ``ceil(swa_ring_size / P) * P`` (0 without a ring)."""
        if self.swa_ring_size is None:
            return 0
        p = self.page_size
        return -(-self.swa_ring_size // p) * p

    def label(self) -> str:
        """Short id used in test ids and reports, e.g. ``P4-W6-F32-S16``; a ring config appends ``-R<ring>x<slots>``
        (``P2-W3-F24-S12-R3x4``)."""
        base = f"P{self.page_size}-W{self.sliding_window_size}-F{self.size_full}-S{self.size_swa}"
        return base if self.swa_ring_size is None else f"{base}-R{self.swa_ring_size}x{self.num_req_slots}"
