"""``kvproof.spec``: Z3 obligations and transition systems, one module per component (sglang_semantics.md §1-§9).

Each component ``c`` has one module ``kvproof.spec.<c>`` exporting ``OBLIGATIONS``
(every obligation of the component, each named ``<c>.<op>.<claim>`` or
``<c>.<invariant>.<claim>``, twins with one more suffix) and ``SYSTEM`` or
``SYSTEMS`` (its :class:`~kvproof.spec._ts.TransitionSystem` values, whose
transitions are named like the reference functions):

* ``swa_allocator`` — the paged full + SWA composite allocator (§1.3-§1.6, §2.3,
  §2.7, §2.8, §7 G/M, §9 S3 S4);
* ``loc_cache`` — the full->SWA translation cache of PR #25824 / #26152 (§3, §7
  C1-C4, §9 S5 S6);
* ``decode_prealloc`` — the PD decode node's preallocation budgets and gates (§2, §7
  D1-D3, §9 S2);
* ``hisparse_host`` — the HiSparse paged host pool of PR #23606 (§4, §4.6 H0-H4,
  §9 S7);
* ``admission`` — the prefill adder's SWA budget against HiCache load-back, PR
  #27391 (§5, §7 A1-A3, §8 item 8, §9 S8 S9);
* ``tp_prefetch`` — the cross-rank sidecar hit sync and all-or-nothing SWA prefetch
  of PR #27264 and SGLang 0.5.23 (§6, §7 T1-T5, §8 item 9, §9 S10);
* ``block_pool`` — vLLM 0.33.0's v1 KV cache manager, docs/block_pool.md.

The component names are listed here because ``kvproof.spec`` is a leaf (it imports
z3 and the standard library only, never ``kvproof.reference.registry``);
``tests/spec/test_registry.py`` checks them against the registry. Obligations are
collected in this order, and :func:`collect` rejects a name without its component's
prefix or a duplicate (:class:`ObligationRegistryError`). :func:`run` checks one
obligation with a fresh solver; :mod:`._ts` is the transition-system kit every model
shares.
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Iterable, Mapping
from fnmatch import fnmatchcase
from types import MappingProxyType, ModuleType
from typing import Any

from kvproof.spec._solver import TEST_BUDGET, TEST_RLIMIT, Obligation, Result, run
from kvproof.spec._ts import TransitionSystem

__all__ = [
    "COMPONENTS",
    "COMPONENT_MODULES",
    "OBLIGATIONS",
    "TEST_BUDGET",
    "TEST_RLIMIT",
    "Obligation",
    "ObligationRegistryError",
    "Result",
    "collect",
    "obligations",
    "run",
    "systems",
]

#: The components, in registry order (``kvproof.reference.registry.Component``).
COMPONENTS = ("swa_allocator", "loc_cache", "decode_prealloc", "hisparse_host", "admission", "tp_prefetch",
              "block_pool")


class ObligationRegistryError(Exception):
    """A component module's obligations are malformed: a name outside its component, a duplicate, no module."""


def _module(component: str) -> ModuleType:
    try:
        return importlib.import_module(f"{__name__}.{component}")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.{component}":
            raise
        raise ObligationRegistryError(f"component {component!r} has no spec module {__name__}.{component}") from None


def collect(modules: Mapping[str, ModuleType]) -> tuple[Obligation, ...]:
    """Every module's ``OBLIGATIONS`` in order, checked: names start with ``<component>.``, the obligation says
    the same component, and no name repeats."""
    collected: list[Obligation] = []
    for component, module in modules.items():
        found = getattr(module, "OBLIGATIONS", None)
        if not isinstance(found, tuple) or not all(isinstance(ob, Obligation) for ob in found):
            raise ObligationRegistryError(f"{module.__name__}.OBLIGATIONS must be a tuple of Obligation values")
        for ob in found:
            if not ob.name.startswith(f"{component}.") or ob.component != component:
                raise ObligationRegistryError(
                    f"{module.__name__}: obligation {ob.name!r} (component {ob.component!r}) must be named "
                    f"'{component}.<op or invariant>.<claim>' and belong to component {component!r}")
            if ob.twin_of is not None and not ob.twin_of.startswith(f"{component}."):
                raise ObligationRegistryError(f"{module.__name__}: twin {ob.name!r} names {ob.twin_of!r}, "
                                              f"outside component {component!r}")
        collected += found
    duplicates = sorted(name for name, count in Counter(ob.name for ob in collected).items() if count > 1)
    if duplicates:
        raise ObligationRegistryError(f"obligation names must be unique, duplicated: {duplicates}")
    return tuple(collected)


#: ``kvproof.spec.<component>`` for each component, in :data:`COMPONENTS` order.
COMPONENT_MODULES: Mapping[str, ModuleType] = MappingProxyType({c: _module(c) for c in COMPONENTS})

OBLIGATIONS: tuple[Obligation, ...] = collect(COMPONENT_MODULES)


def systems(component: str) -> tuple[TransitionSystem[Any, Any], ...]:
    """The transition systems of ``component`` (its ``SYSTEMS``, or ``(SYSTEM,)``; none yet: empty)."""
    if component not in COMPONENT_MODULES:
        raise ObligationRegistryError(f"unknown component {component!r}; choose one of {list(COMPONENTS)}")
    module = COMPONENT_MODULES[component]
    found: Iterable[object] = getattr(module, "SYSTEMS", None) or (
        (module.SYSTEM,) if hasattr(module, "SYSTEM") else ())
    out = tuple(x for x in found if isinstance(x, TransitionSystem) and x.component == component)
    if len(out) != len(tuple(found)):
        raise ObligationRegistryError(f"{module.__name__}: SYSTEM(S) must be transition systems of {component!r}")
    return out


def obligations(component: str | None = None, name_filter: str | None = None) -> tuple[Obligation, ...]:
    """The registered obligations, optionally narrowed.

    ``component`` must match exactly. ``name_filter`` is a glob (``fnmatch``) when
    it contains ``*``, ``?`` or ``[``, else a substring of the name.
    """

    def wanted(ob: Obligation) -> bool:
        if component is not None and ob.component != component:
            return False
        if name_filter is None:
            return True
        if any(ch in name_filter for ch in "*?["):
            return fnmatchcase(ob.name, name_filter)
        return name_filter in ob.name

    return tuple(ob for ob in OBLIGATIONS if wanted(ob))
