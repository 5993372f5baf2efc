"""The reference builds derived values without re-validation (``kvproof.reference.paged.trusted``, for speed): what it
builds must be exactly what pydantic would build, or a pydantic release that moves its internals would make states
compare, hash or dump differently without any test noticing."""

from __future__ import annotations

from pydantic import BaseModel

from kvproof.reference import swa_allocator as ref
from kvproof.reference.config import PoolConfig
from kvproof.reference.paged import PagedPool, trusted, trusted_pool


def _same_as_validated(value: BaseModel) -> None:
    again = type(value).model_validate(value.model_dump())
    assert again == value and value == again
    assert again.model_dump() == value.model_dump() and repr(again) == repr(value)
    assert value.model_fields_set <= set(type(value).model_fields)
    for name in type(value).model_fields:
        inner = getattr(value, name)
        if isinstance(inner, BaseModel):
            _same_as_validated(inner)


def test_trusted_builds_what_model_construct_builds() -> None:
    values = {"page_size": 2, "num_pages": 3, "free_pages": (2, 3), "owner": (None, 7, None, None)}
    built, constructed = trusted(PagedPool, dict(values), set(values)), PagedPool.model_construct(**values)
    assert built == constructed and built.model_fields_set == constructed.model_fields_set
    assert built.__pydantic_extra__ == constructed.__pydantic_extra__
    assert built.__pydantic_private__ == constructed.__pydantic_private__
    assert trusted_pool(2, 3, (2, 3), (None, 7, None, None)) == PagedPool(**values)


def test_every_operation_builds_values_equal_to_validated_ones() -> None:
    """A run through every operation, P = 1 and P = 2: each state (its pools, KV store and backups too) equals its
    validated copy and dumps the same."""
    for p in (1, 2):
        config = PoolConfig(size_full=16 * p, size_swa=8 * p, page_size=p, sliding_window_size=3)
        s0 = ref.initial_state(config)
        s1, a = ref.alloc_extend(s0, [0], [3 * p], [-1], 3 * p, owners=[1])
        s2, b = ref.alloc_extend(s1, [3 * p], [3 * p + 1], [a[-1]], 1, owners=[1])
        s3 = ref.set_kv_buffer(ref.set_kv_buffer(s2, 0, [a[0]], [[1.0, 2.0]], [[3.0, 4.0]]), 1, [a[1]], [[5.0, 6.0]],
                               [[7.0, 8.0]])
        backup = ref.backup_state(s3)
        s4, c = ref.alloc(s3, 2 * p)
        s5 = ref.restore_state(s4, backup)
        copy = ref.get_cpu_copy(s5, list(a))
        s6 = ref.free_swa(s5, list(a[:p]))
        s7 = ref.free(s6, list(a) + list(b))
        s8 = ref.load_cpu_copy(ref.alloc_extend(s7, [0], [3 * p], [-1], 3 * p, owners=[2])[0], copy,
                               list(ref.alloc_extend(s7, [0], [3 * p], [-1], 3 * p, owners=[2])[1]))
        s9, d = ref.alloc_extend_swa_tail(ref.clear(s8), [0], [4 * p], [-1], 4 * p, 2 * p)
        for value in (s0, s1, s2, s3, backup, s4, s5, copy, s6, s7, s8, s9):
            _same_as_validated(value)
        assert c and d
