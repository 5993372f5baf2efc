"""Host ints as the int64 index tensors the suites hand an implementation, at about a fifth of ``torch.tensor``'s
price (``kvproof bench``: a lockstep step builds several).

``torch.tensor(list)`` inspects every element to infer a type; :func:`int64s` packs the ints into an
``array('q')`` and wraps its buffer (``torch.frombuffer``: no copy, the tensor keeps the array alive). What an array
refuses (a float, an int past int64) goes to ``torch.tensor``, so it converts or fails exactly as before.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

__all__ = ["int64s"]


def int64s(values: Sequence[int], device: torch.device | str | None = None) -> torch.Tensor:
    """``torch.tensor(values, dtype=torch.int64, device=device)`` for a flat sequence of ints, cheaper."""
    if not values:
        tensor = torch.empty(0, dtype=torch.int64)
    else:
        try:
            tensor = torch.frombuffer(array("q", values), dtype=torch.int64)
        except (TypeError, OverflowError):
            tensor = torch.tensor(values, dtype=torch.int64)
    if device is None:
        return tensor
    device = device if isinstance(device, torch.device) else torch.device(device)
    return tensor if device.type == "cpu" else tensor.to(device)
