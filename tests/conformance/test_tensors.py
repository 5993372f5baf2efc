"""``int64s``: the suites' cheap host-ints-to-tensor, which must give what ``torch.tensor(..., dtype=int64)`` gives."""

from __future__ import annotations

import pytest
import torch

from kvproof.conformance.tensors import int64s


@pytest.mark.parametrize("values", [[], [0], [3, -1, 7], list(range(100)), (5, 6), [True, False], [2**63 - 1, -2**63],
                                    [1.0, 2.9]])
def test_it_gives_what_torch_tensor_gives(values: list[int]) -> None:
    got, want = int64s(values), torch.tensor(values, dtype=torch.int64)
    assert got.dtype == want.dtype == torch.int64 and got.shape == want.shape and torch.equal(got, want)
    assert got.device.type == "cpu" and int64s(values, "cpu").device.type == "cpu"


def test_what_torch_tensor_refuses_it_refuses_alike() -> None:
    for values, error in (([2**64], ValueError), (["a"], ValueError)):
        with pytest.raises(error):
            torch.tensor(values, dtype=torch.int64)
        with pytest.raises(error):
            int64s(values)


def test_each_tensor_owns_its_values() -> None:
    """Two tensors of the same values share nothing: a write into one (an implementation's, which custody reports)
    leaves the other and the caller's list alone."""
    values = [1, 2, 3]
    a, b = int64s(values), int64s(values)
    a[0] = 9
    assert b.tolist() == values == [1, 2, 3]
    a.add_(1)  # in place, as an implementation might
    assert a.tolist() == [10, 3, 4]
