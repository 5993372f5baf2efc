"""What the caller owns while an implementation runs: its inputs, and the indices it was handed.

An implementation may read the tensors it is given and must not write into them
(``free`` may not scribble over ``free_index``, ``alloc_extend`` over ``seq_lens`` or
``last_loc``); and the index tensors it returned from an operation that hands the caller
indices (``kvproof.reference.contract.CALLER_OWNED_RESULTS``) are the caller's from then
on: no later call may change them. :class:`Custody` (one per example) checks both around
every implementation call the lockstep machine makes (:class:`~kvproof.conformance.lockstep.Watched`):

* before a call it clones every tensor argument (also inside tuples, lists and dicts) and
  after it compares the *originals* with those clones. The implementation is handed the
  originals, never the clones: the ``loc_cache`` suite depends on the identity and address
  of the tensors it passes (``kvproof.conformance.index_arena``);
* after an operation in ``CALLER_OWNED_RESULTS`` it keeps the returned tensor and a clone
  (not one sharing storage with an argument), and after every later *step* compares them (the lockstep
  framework's per-step check, :meth:`Custody.returned_problem`: a write into them shows within the step that made
  it, named with the step's operations; comparing them after every call cost more than the rest of the step).
  At most :data:`TRACKED` results are kept per example (the newest).

The harness itself never writes into a tensor after handing it over or receiving it.
"""

from __future__ import annotations

import collections
import inspect
from collections.abc import Callable, Iterator
from typing import Any

from kvproof.reference.contract import CALLER_OWNED_RESULTS

__all__ = ["TRACKED", "Custody"]

#: Returned index tensors kept per example (the newest), so a long example stays cheap.
TRACKED = 32


def _tensors(value: Any, label: str, depth: int = 0) -> Iterator[tuple[str, Any]]:
    """``(label, tensor)`` for every tensor in ``value``, tuples, lists and dicts included."""
    import torch

    if isinstance(value, torch.Tensor):
        if not value.is_meta:
            yield label, value
    elif depth < 3 and isinstance(value, tuple | list):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{label}[{i}]", depth + 1)
    elif depth < 3 and isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{label}[{k!r}]", depth + 1)


#: Host integer tensors up to this many elements are kept as Python values (``tolist``: a fifth of a clone's price
#: and of the comparison's, for the small index tensors a lockstep hands over); others as a clone.
LISTED = 4096


def _keep(tensor: Any) -> Any:
    """What ``tensor`` holds now, to compare with later: ``(shape, dtype, values)`` for a small host integer tensor,
    else a clone."""
    if tensor.is_cpu and not (tensor.is_floating_point() or tensor.is_complex()) and tensor.numel() <= LISTED:
        return tensor.shape, tensor.dtype, tensor.tolist()
    return tensor.detach().clone()


def _same(tensor: Any, kept: Any) -> bool:
    """``tensor`` still holds what :func:`_keep` kept (NaN equals NaN)."""
    import torch

    if isinstance(kept, tuple):
        shape, dtype, values = kept
        return tensor.dtype == dtype and tensor.shape == shape and tensor.tolist() == values
    if tensor.dtype != kept.dtype:
        return False
    if torch.equal(tensor, kept):  # False for another shape too: the common case costs one call
        return True
    if tensor.shape == kept.shape and (tensor.is_floating_point() or tensor.is_complex()):
        return bool(torch.allclose(tensor, kept, rtol=0, atol=0, equal_nan=True))  # NaN == NaN here
    return False


def _show(tensor: Any) -> str:
    if isinstance(tensor, tuple):  # kept as values (_keep)
        import torch

        tensor = torch.tensor(tensor[2], dtype=tensor[1]).reshape(tensor[0])
    flat = tensor.detach().reshape(-1)
    items = flat[:8].tolist()
    return f"{items}{'...' if flat.numel() > 8 else ''}"


def _storage(tensor: Any) -> int:
    try:
        return int(tensor.untyped_storage().data_ptr())
    except (RuntimeError, NotImplementedError):
        return -1


def _argument(method: Any, where: str) -> str:
    """``where`` (``#2[0]``: the second positional argument's first element) with the parameter's name."""
    if not where.startswith("#"):
        return where
    digits = len(where) - len(where[1:].lstrip("0123456789"))
    index, rest = int(where[1:digits]), where[digits:]
    try:
        params = [p for p in inspect.signature(method).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        params = []
    return params[index - 1].name + rest if index <= len(params) else f"argument {index}{rest}"


class Custody:
    """The caller's tensors around one example's implementation calls (see the module docstring)."""

    def __init__(self) -> None:
        # (operation, step, tensor, clone) of the newest caller-owned results
        self.returned: collections.deque[tuple[str, int, Any, Any]] = collections.deque(maxlen=TRACKED)

    def before(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[str, Any, Any]]:
        """``(where, tensor, clone)`` for every tensor the call is handed (``where``: ``#1`` ... or a keyword)."""
        if not args and not kwargs:
            return []
        import torch

        out = []
        for i, value in enumerate(args, 1):
            if isinstance(value, torch.Tensor):  # the common case, without the generator
                if not value.is_meta:
                    out.append((f"#{i}", value, _keep(value)))
            elif isinstance(value, tuple | list | dict):
                out += [(where, tensor, _keep(tensor)) for where, tensor in _tensors(value, f"#{i}")]
        for name, value in kwargs.items():
            out += [(where, tensor, _keep(tensor)) for where, tensor in _tensors(value, name)]
        return out

    def after(self, op: str, method: Any, inputs: list[tuple[str, Any, Any]], step: int = 0, result: Any = None, *,
              returned: bool = False) -> str | None:
        """What the call wrote into its inputs (``None`` if nothing); keeps a caller-owned ``result``."""
        for where, tensor, clone in inputs:
            if not _same(tensor, clone):
                return (f"{op} wrote into its input {_argument(method, where)} "
                        f"(before {_show(clone)}, after {_show(tensor)})")
        if returned and op in CALLER_OWNED_RESULTS:
            import torch

            if isinstance(result, torch.Tensor) and result.device.type != "meta":
                storages = {_storage(t) for _, t, _ in inputs}
                if _storage(result) not in storages:
                    self.returned.append((op, step, result, _keep(result)))
        return None

    def returned_problem(self, calls: Callable[[], str]) -> str | None:
        """What the implementation wrote into a tensor it returned earlier (``None`` if nothing): checked after every
        step; ``calls()`` names the step's calls (one of them wrote it; asked only then)."""
        for earlier_op, earlier_step, tensor, clone in self.returned:
            if not _same(tensor, clone):
                return (f"{calls()} wrote into the tensor {earlier_op} returned at step {earlier_step} "
                        f"(then {_show(clone)}, now {_show(tensor)})")
        return None
